"""The evaluation with the model split over two GPUs, emulated on the CPU (tests/virtual_devices.py): each layer's
policy tensors, lambda and RoPE tables follow that layer's device, the metrics are taken where the head computes,
and no activation leaves its device or meets a tensor of another (issue 31, item 2)."""
import copy
from dataclasses import replace

import pytest
import torch

from pipeline.config import load_recipe
from stages import evaluate, recipe
from tests.virtual_devices import VirtualDevices

DEVICES = ["cuda:0", "cuda:1"]  # the tiny model's two layers: layer 0 on cuda:0, layer 1 on cuda:1


def _policy(tiny, calib, name: str):
    """A recipe's policy on the tiny model's 48-token windows (KIVI: a group and a residual that fit them; the prefix
    recipe: a prefix of 3 tokens)."""
    q = load_recipe(name)
    if q.key.format == "uniform" and q.key.axis == "channel":
        q.key.group_size, q.residual = 8, 16
    policy = recipe.build_policy(q, tiny.spec.n_layers, calib["smooth" if q.smooth else "plain"])
    if q.prefix:
        policy = replace(policy, prefix_ids=torch.tensor([tiny.spec.bos_token_id, 17, 23]), prefix_len=3)
    return policy


def _untied(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model whose head has a weight of its own (Llama-3's): accelerate puts it on the last device,
    the embedding on the first."""
    model = copy.deepcopy(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


@pytest.mark.parametrize("head, perturb_seeds", [("tied", []), ("untied", [0])])
def test_the_evaluation_keeps_each_layer_on_its_own_device(tiny, tiny_windows, calib, head, perturb_seeds):
    model = tiny.model if head == "tied" else _untied(tiny.model)
    names = ["fp16", "kvquant-3b-1pct+smooth", "kivi-2", "fp8-e4m3", "kvquant-3b-1pct+prefix", "kvquant-3b-1pct+rot",
             "vllm-int4-per-token-head", "vllm-turboquant-k8v4"]
    policies = [_policy(tiny, calib, n) for n in names]
    cfg = evaluate.EvalConfig(perturb_seeds=perturb_seeds)
    windows = tiny_windows.eval[:1]
    plain = evaluate.fit(evaluate.Inputs(model, tiny.spec, windows, policies), cfg).meta["recipes"]
    with VirtualDevices() as mode, mode.split(model, DEVICES):
        split = evaluate.fit(evaluate.Inputs(model, tiny.spec, windows, policies), cfg).meta["recipes"]
    assert not mode.violations, mode.violations
    assert {torch.device(d) for d in DEVICES} <= mode.computed_on  # the split was real
    for name in names:  # the same arithmetic: only the placements differ
        assert split[name]["ppl"] == pytest.approx(plain[name]["ppl"], rel=1e-6), name
