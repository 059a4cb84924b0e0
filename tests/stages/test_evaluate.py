import math

import pytest
import torch

from exporters.codec import TensorPolicy
from pipeline.config import TracesConfig, load_recipe
from stages import evaluate
from exporters.codec import CachePolicy


def _policy(name, k, v, n_layers=2, **kw):
    return CachePolicy(name=name, layers=[(k, v)] * n_layers, **kw)


FP16 = TensorPolicy(format="fp16", bits=16)
INT2 = TensorPolicy(format="uniform", bits=2, axis="token")


def test_reference_and_fp16_cache_agree(tiny, tiny_windows):
    w = tiny_windows.eval
    ref = _policy("ref", FP16, FP16)
    # an fp16 cache through the codec path (sink flag forces the quantized attention): tiny rounding only
    via_codec = _policy("codec-fp16", FP16, FP16, n_sink=1, smooth=torch.ones(2, 2, 16))
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [ref, via_codec])).meta["recipes"]
    assert r["ref"]["kl"] == 0 and r["ref"]["top1"] == 1 and r["ref"]["avg_bits"] == 16
    assert r["codec-fp16"]["kl"] < 1e-5 and r["codec-fp16"]["top1"] > 0.98
    assert math.isclose(r["codec-fp16"]["ppl"], r["ref"]["ppl"], rel_tol=1e-3)


def test_residual_window_covering_the_sequence_is_exact(tiny, tiny_windows):
    w = tiny_windows.eval  # T = 48
    full = _policy("all-recent", INT2, INT2, residual=64)
    none = _policy("int2", INT2, INT2)
    half = _policy("int2-r16", INT2, INT2, residual=16)
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [_policy("ref", FP16, FP16), full, none, half])).meta["recipes"]
    assert r["all-recent"]["kl"] < 1e-6 and r["all-recent"]["avg_bits"] == pytest.approx(16.0)
    assert r["int2"]["kl"] > r["int2-r16"]["kl"] > r["all-recent"]["kl"]
    # ledger: int2 per token and head, D = 16: 2 + 2*16/16 = 4 bits per element
    assert r["int2"]["avg_bits"] == pytest.approx(4.0)
    # 16 of 48 rows full precision: (32 * 4 + 16 * 16) / 48
    assert r["int2-r16"]["avg_bits"] == pytest.approx((32 * 4 + 16 * 16) / 48)


def test_pre_rope_identity_path_matches_reference(tiny, tiny_windows):
    """Keys taken pre-RoPE from the k_proj hook and rotated by our RoPE must equal the model's own keys."""
    w = tiny_windows.eval[:1]
    pre = _policy("pre-fp16", FP16, FP16, key_rope="pre", n_sink=1)
    r = evaluate.fit(evaluate.Inputs(tiny.model, tiny.spec, w, [_policy("ref", FP16, FP16), pre])).meta["recipes"]
    assert r["pre-fp16"]["kl"] < 1e-5


def test_table_lists_every_recipe():
    rows = {"fp16": {"ppl": 10.0, "kl": 0.0, "top1": 1.0, "avg_bits": 16.0, "outlier_fraction_k": 0, "outlier_fraction_v": 0},
            "x": {"ppl": 11.0, "kl": 0.1, "top1": 0.9, "avg_bits": 4.0, "outlier_fraction_k": 0.01, "outlier_fraction_v": 0.0}}
    text = evaluate.table(rows)
    assert "1.1000" in text and text.index("fp16") < text.index("\nx ")


@pytest.mark.parametrize("recipe_name", ["kvquant-4b-1pct", "kivi-2", "int4-token", "fp8-e4m3",
                                         "kvquant-3b-1pct+smooth"])
def test_evaluation_is_what_the_serving_cache_computes(tiny, tiny_windows, calib, recipe_name):
    """The logits the evaluation computes for a window equal those of decoding the same tokens one at a time
    through runtime_check/cache.py under the same policy (sink rows in fp16, every other row through the codec
    as stored, the residual buffer's flush rule): max |log-prob difference| <= 2e-4 (float32 rounding of two
    attention implementations; a wrong row precision, flush or RoPE convention moves it by >= 1e-3)."""
    from pipeline.config import load_recipe
    from runtime_check.cache import ArtifactCache
    from stages import recipe

    q = load_recipe(recipe_name)
    if q.key.format == "uniform" and q.key.axis == "channel":  # KIVI: a group and a residual that fit 48 tokens
        q.key.group_size, q.residual = 8, 16
    policy = recipe.build_policy(q, tiny.spec.n_layers, calib["smooth" if q.smooth else "plain"])
    for w in range(2):
        ids = tiny_windows.eval[w : w + 1]
        with torch.no_grad():
            ours = evaluate.policy_logprobs(tiny.model, ids, policy)
            cache = ArtifactCache(policy, tiny.model)
            served = torch.cat([torch.log_softmax(tiny.model(ids[:, i : i + 1], cache=cache).logits[0].float(), -1)
                                for i in range(ids.shape[1])])
        assert (ours - served).abs().max() <= 2e-4, (recipe_name, float((ours - served).abs().max()))


def test_ppl_ratio_interval_covers_windows_and_seeds():
    ref = torch.tensor([100.0, 120.0, 80.0, 110.0])
    same = evaluate.ppl_ratio_interval(ref[None].clone(), ref, 10)
    assert same == (1.0, 1.0, 1.0)
    shifted = evaluate.ppl_ratio_interval(ref[None] + 1.0, ref, 10)  # +0.1 nats per token on every window
    assert shifted[0] == pytest.approx(math.exp(0.1)) and shifted[1] == pytest.approx(math.exp(0.1))
    noisy = torch.stack([ref + 1.0, ref + 3.0])                       # two seeds disagree: the interval opens
    r, lo, hi = evaluate.ppl_ratio_interval(noisy, ref, 10)
    assert r == pytest.approx(math.exp(0.2)) and lo < r < hi and lo >= math.exp(0.1) - 1e-12
