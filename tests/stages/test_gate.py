"""The drift gate never passes what it cannot judge, and what it judges (ppl_ratio) exists whatever eval.recipes
lists: stages.evaluate computes the full-precision reference on every window itself."""
import math

import pytest

from exporters.codec import CachePolicy, TensorPolicy
from stages import evaluate, gate
from stages.gate import GateConfig

INT4 = TensorPolicy(format="uniform", bits=4, axis="token")


def test_gate_refuses_an_evaluation_without_ppl_ratio():
    cfg = GateConfig(max_ppl_ratio=1e9)  # any ratio would pass: a refusal cannot be a threshold failure
    with pytest.raises(ValueError, match=r"the evaluation of 'r' has no ppl_ratio to fp16; the perplexity check "
                                         r"cannot be judged"):
        gate.check(cfg, "r", {"fp16": {"ppl": 10.0, "ppl_ratio": 1.0}, "r": {"ppl": 10.0}}, None, None)
    with pytest.raises(ValueError, match=r"recipe 'r' was not evaluated \(evaluated: \['fp16'\]\)"):
        gate.check(cfg, "r", {"fp16": {"ppl": 10.0, "ppl_ratio": 1.0}}, None, None)
    assert gate.check(cfg, "r", {"r": {"ppl": 10.0, "ppl_ratio": 1.2}}, None, None)["passed"]


def test_a_recipe_evaluated_without_fp16_still_has_its_ratio(tiny, tiny_windows):
    """eval.recipes without fp16: the recipe's ppl_ratio is to the model's own full-precision pass on the same
    windows, and the gate judges it."""
    windows = tiny_windows.eval  # 2 windows of 48 tokens
    policy = CachePolicy(name="int4-token", layers=[(INT4, INT4)] * tiny.spec.n_layers)
    res = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, windows, [policy]))
    recipes = res.meta["recipes"]
    assert set(recipes) == {"int4-token"}
    row = recipes["int4-token"]
    n_tokens = windows.shape[1] - 1
    ref_ppl = math.exp(float(res.tensors["window_nll.reference"].mean()) / n_tokens)
    assert row["ppl_ratio"] == pytest.approx(row["ppl"] / ref_ppl, rel=1e-9)
    lo, hi = row["ppl_ratio_ci95"]
    assert lo * (1 - 1e-12) <= row["ppl_ratio"] <= hi * (1 + 1e-12)
    verdict = gate.check(GateConfig(max_ppl_ratio=row["ppl_ratio"] * 0.999), "int4-token", recipes, None, None)
    assert not verdict["passed"] and verdict["failures"][0].startswith("perplexity ratio")
    assert gate.check(GateConfig(max_ppl_ratio=row["ppl_ratio"] * 1.001), "int4-token", recipes, None, None)["passed"]


def test_the_long_context_evaluation_is_judged_too():
    """A run with long-context windows (evaluate-long) fails the gate when the recipe drifts there, even when
    the short windows pass; a long evaluation that lacks the recipe is a refusal, not a pass."""
    cfg = GateConfig(max_ppl_ratio=1.05)
    short = {"r": {"ppl": 10.0, "ppl_ratio": 1.01}}
    long = {"windows": 2, "seq_len": 8192, "recipes": {"r": {"ppl": 9.0, "ppl_ratio": 1.07}}}
    verdict = gate.check(cfg, "r", short, None, None, long)
    assert not verdict["passed"]
    assert verdict["failures"] == ["perplexity ratio at long context (2 x 8192 tokens) 1.0700 > max_ppl_ratio 1.05"]
    long["recipes"]["r"]["ppl_ratio"] = 1.04
    assert gate.check(cfg, "r", short, None, None, long)["passed"]
    with pytest.raises(ValueError, match=r"recipe 'r' was not evaluated at long context \(2 x 8192 tokens\)"):
        gate.check(cfg, "r", short, None, None, {"windows": 2, "seq_len": 8192, "recipes": {}})
