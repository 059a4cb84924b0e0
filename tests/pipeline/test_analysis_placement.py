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





def test_changed_examples_read_a_prefix(smollm2, monkeypatch):
    """The report's examples are the first changed positions among the window's first EXAMPLES_WITHIN: here 16 of a
    sentence's tokens, the changes a direct comparison finds there; the whole sentence when it is shorter. SmolLM2
    under a 2-bit cache on real text (a random tiny model hardly changes a token)."""
    from exporters.codec import CachePolicy, TensorPolicy
    from stages import evaluate

    text = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest structure "
            "in Paris. Its base is square, measuring 125 metres on each side. During its construction, the Eiffel "
            "Tower surpassed the Washington Monument to become the tallest man-made structure in the world.")
    window = torch.tensor(smollm2.tokenizer(text)["input_ids"])
    int2 = TensorPolicy(format="uniform", bits=2, axis="token")
    policy = CachePolicy(name="int2", layers=[(int2, int2)] * smollm2.spec.n_layers)

    def changes(length):
        ids = window[None, :length]
        with torch.no_grad():
            ref = evaluate.greedy_tokens(smollm2.model, evaluate.full_precision_hidden(smollm2.model, ids))
            got = evaluate.greedy_tokens(smollm2.model, evaluate.policy_hidden(smollm2.model, ids, policy))
        return [i for i in range(length) if ref[i] != got[i]]

    every = analysis.changed_examples(smollm2, window, policy, n=10 ** 6)
    assert [r["position"] for r in every] == changes(window.numel()) and len(every) > 3
    assert [r["position"] for r in analysis.changed_examples(smollm2, window, policy, n=2)] == changes(window.numel())[:2]
    monkeypatch.setattr(analysis, "EXAMPLES_WITHIN", 16)
    within = analysis.changed_examples(smollm2, window, policy, n=10 ** 6)
    assert [r["position"] for r in within] == changes(16) and all(r["position"] < 16 for r in within)
