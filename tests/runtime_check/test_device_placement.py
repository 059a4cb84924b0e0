"""The runtime check with the model split over two GPUs, emulated on the CPU (tests/virtual_devices.py): every
layer's decode inputs stay on that layer's device, and neither the recording, the oracle, the comparison nor a
torch kernel moves an activation off it or meets tensors of two devices (issue 31, item 1). The kernel here is
the block-wise reader (serving/blockwise.py): torch only, so it runs under the emulation; the Triton kernel's
own launch device is tests/pipeline/test_check.py's."""
import pytest
import torch

from exporters.native import load_artifact
from pipeline.check import eval_ids
from runtime_check.check import artifact_prefix, check_case, record
from serving import blockwise
from tests.virtual_devices import VirtualDevices

DEVICES = ["cuda:0", "cuda:1"]  # the tiny model's two layers: layer 0 on cuda:0, layer 1 on cuda:1


def _tensors(inp) -> dict[str, torch.Tensor]:
    """Every tensor a layer's DecodeInputs holds, by name."""
    out = {"q": inp.q}
    for name, pair in (("sink", inp.sink), ("recent", inp.recent)):
        if pair is not None:
            out |= {f"{name}.k": pair[0], f"{name}.v": pair[1]}
    for kind, block, policy in (("k", inp.k_block, inp.key_policy), ("v", inp.v_block, inp.value_policy)):
        for p, page in enumerate(() if block is None else block.pages):
            out |= {f"{kind}_block.{p}.{n}": t for n, t in page.tensors.items()}
        out |= {f"{kind}_policy.{n}": t for n, t in policy.calibrated().items()}
    if inp.smooth is not None:
        out["smooth"] = inp.smooth
    return out


@pytest.mark.parametrize("recipe", ["kvquant-3b-1pct+smooth+prefix", "kivi-4", "fp8-e4m3"])
def test_the_check_keeps_each_layer_on_its_own_device(tiny, make_artifact, recipe):
    artifact = load_artifact(make_artifact(recipe), tiny.spec)
    prefix = artifact_prefix(artifact)
    ids = eval_ids(tiny.tokenizer, 2, 150)  # > KIVI's 128 residual rows: encoded pages, sink and residual rows
    timing = {"kernel_s": 0.0, "oracle_s": 0.0}
    with VirtualDevices() as mode, mode.split(tiny.model, DEVICES):
        inputs = record(tiny, artifact.policy, ids, prefix)
        placed = {(i, name): mode.placement(t) for i, inp in enumerate(inputs) for name, t in _tensors(inp).items()}
        case = check_case(tiny, artifact.policy, ids, prefix, blockwise.decode_attention, timing)
    assert mode.layer_devices == [torch.device(d) for d in DEVICES]
    assert {torch.device(d) for d in DEVICES} <= mode.computed_on  # the split was real
    off = {key: str(dev) for key, dev in placed.items() if dev != mode.layer_devices[key[0]]}
    assert not off, f"decode inputs off their layer's device: {off}"
    assert not mode.violations, mode.violations
    assert case["ok"], case
