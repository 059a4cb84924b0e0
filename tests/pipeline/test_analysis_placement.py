"""The report's changed-token examples with the model on GPUs, emulated on the CPU (tests/virtual_devices.py): the
CPU-held evaluation window goes to the model's device and the answer comes back (the bug the first H200 run found,
docs/gpu.md)."""
import torch

from pipeline import analysis
from pipeline.config import load_recipe
from stages import recipe
from tests.virtual_devices import VirtualDevices


def test_changed_examples_feeds_the_window_to_the_models_device(tiny, tiny_windows, calib):
    policy = recipe.build_policy(load_recipe("kvquant-2b-1pct"), tiny.spec.n_layers, calib["plain"])
    window = tiny_windows.eval[0]
    plain = analysis.changed_examples(tiny, window, policy)
    with VirtualDevices() as mode, mode.split(tiny.model, ["cuda:0", "cuda:1"]):
        split = analysis.changed_examples(tiny, window, policy)
    assert not mode.violations, mode.violations
    assert {torch.device("cuda:0"), torch.device("cuda:1")} <= mode.computed_on
    assert split == plain
