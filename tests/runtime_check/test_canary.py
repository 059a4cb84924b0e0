"""The quality canary (runtime_check/canary.py): what kernel == oracle cannot see -- calibration that is wrong but
decodes exactly as the spec says -- it sees, against a limit nothing in the artifact can move."""
import dataclasses

import pytest
import torch

from exporters.codec import CachePolicy, TensorPolicy
from runtime_check import canary


def _fp8_policy(n_layers: int, scale: float, n_sink: int = 4, residual: int = 8) -> CachePolicy:
    t = TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=torch.tensor(scale))
    return CachePolicy(name="fp8-e4m3", layers=[(t, t)] * n_layers, n_sink=n_sink, residual=residual)


def test_the_baseline_reads_no_calibrated_tensor_and_keeps_the_sequence_structure():
    nuq = TensorPolicy(format="nuq", bits=3, axis="channel", codebook=torch.linspace(-1, 1, 8),
                       zero=torch.zeros(2, 4), range=torch.ones(2, 4))
    fp8 = TensorPolicy(format="fp8", bits=8, axis="head", fp8_scale=torch.full((2,), 7.0), fp8_dtype="e5m2")
    fp16 = TensorPolicy(format="fp16", bits=16, axis="tensor")
    policy = CachePolicy(name="r", layers=[(nuq, fp8), (fp16, nuq)], key_rope="pre", n_sink=16, residual=128,
                         smooth=torch.ones(2, 2, 4), model={"n_layers": 2})
    base = canary.baseline_policy(policy)
    (k0, v0), (k1, v1) = base.layers
    assert (k0.format, k0.axis, k0.bits, k0.range) == ("uniform", "token", 3, None)
    assert (v0.format, v0.axis, v0.fp8_dtype, float(v0.fp8_scale)) == ("fp8", "tensor", "e5m2", 1.0)
    assert (k1.format, v1.format, v1.bits) == ("fp16", "uniform", 3)
    assert (base.n_sink, base.residual, base.key_rope, base.smooth, base.model) == (16, 128, "post", None, None)


def test_the_warm_up_fills_sink_and_residual_then_stored_rows_and_shrinks_to_fit_a_short_model():
    policy = _fp8_policy(2, 1.0, n_sink=16, residual=128)
    assert canary.warmup_length(policy) == 16 + 128 + canary.STORED
    assert canary.lengths(policy, 4096) == (16 + 128 + canary.STORED, canary.TOKENS)
    warmup, tokens = canary.lengths(policy, 300)
    assert warmup + tokens <= 299 and warmup > 16 + 128 and tokens >= 16
    assert canary.lengths(policy, 150) is None  # 16 + 128 + 1 + 16 > 149


def test_a_flush_unit_past_the_model_cannot_switch_the_canary_off_it_is_named():
    """A layer whose flush unit never fills within the model's positions (KIVI-style keys grouped by 8192 rows on a
    4096-position model) used to push the warm-up past the model and the canary was "not run": the warm-up now
    counts only the units that fit, and never_stored names the layer."""
    kivi = TensorPolicy(format="uniform", bits=2, axis="channel", group_size=8192)
    tok = TensorPolicy(format="uniform", bits=2, axis="token")
    policy = CachePolicy(name="r", layers=[(kivi, tok), (tok, tok)], n_sink=4, residual=32)
    assert canary.lengths(policy, 4096) == (4 + 32 + canary.STORED, canary.TOKENS)
    assert canary.never_stored(policy, 4096) == [
        "layer 0: a flush unit of 8192 rows, more than the 4043 positions a sequence has after the sink and "
        "residual rows"]
    fits = dataclasses.replace(policy, layers=[(dataclasses.replace(kivi, group_size=32), tok), (tok, tok)])
    assert canary.never_stored(fits, 4096) == [] and canary.lengths(fits, 4096)[0] == 4 + 32 + 256


MEASURED = {"tokens": 128, "warmup": 400, "kl": 0.004, "agreement": 0.9, "baseline": "b", "baseline_kl": 1.0,
            "baseline_agreement": 0.5}


@pytest.mark.parametrize("kl, top1, claim, require, ok", [
    (0.004, 0.9, None, False, True),                                  # within the limits, no claim required
    (0.004, 0.9, None, True, False),                                   # a claim is required and absent
    (0.3, 0.9, None, False, False),                                    # KL above max_kl 0.25
    (0.004, 0.7, None, False, False),                                  # top-1 below min_top1 0.75
    (0.004, 0.9, {"kl": 0.004, "agreement": 0.9}, True, True),         # the claim re-measured
    (0.0045, 0.9, {"kl": 0.004, "agreement": 0.9}, True, False),       # worse than 1.05 x 0.004 + 1e-4 = 0.0043
    (0.004, 0.87, {"kl": 0.004, "agreement": 0.9}, True, False),       # top-1 worse than the claim by 3 of 128
    (0.004, 0.9, {"kl": 0.004, "agreement": 0.9, "tokens": 64}, True, False),  # measured on another canary
])
def test_the_verdict_is_absolute_limits_and_the_claim(kl, top1, claim, require, ok):
    measured = dict(MEASURED, kl=kl, agreement=top1)
    if claim is not None:
        claim = {"tokens": 128, "warmup": 400} | claim
    out = canary.judge(measured, claim, require_claim=require)
    assert out["ok"] is ok and out["reason"].startswith("passed" if ok else "FAILED"), out["reason"]
    assert out["limit"] == canary.MAX_KL
    assert (out["failures"] == []) is ok
    assert canary.judge(measured, claim, max_kl=1.0, min_top1=0.0, require_claim=False,
                        findings=["prefix"])["ok"] is False  # a finding beside the measurement fails it


def test_the_baseline_does_not_set_the_limit():
    """A baseline of 5 nats (2 bits, calibration-free) used to allow 15 nats: the limit is max_kl whatever it is."""
    out = canary.judge(dict(MEASURED, kl=0.5, baseline_kl=5.0), None, require_claim=False)
    assert not out["ok"] and "above max_kl 0.25" in out["reason"]


def test_stored_prefix_rows_are_compared_with_the_models_own():
    k = torch.randn(2, 3, 4, 8)
    v = torch.randn(2, 3, 4, 8)
    assert canary.prefix_difference({"k": k.half(), "v": v.half()}, (k, v)) is None  # fp16 storage
    poisoned = k.clone()
    poisoned[1, :, 0] = 1e4
    why = canary.prefix_difference({"k": poisoned, "v": v}, (k, v))
    assert why.startswith("cache/prefix k, layer 1: the stored rows differ"), why


def test_a_poisoned_fp8_scale_that_decodes_as_the_spec_says_fails_the_canary_on_a_real_model(smollm2):
    """SmolLM2: an honest per-tensor fp8 scale (amax / 448 of the window's own K and V) passes; the same artifact
    with every scale / 37 -- finite, in the format's range, so the loader takes it, and the kernel and the oracle
    agree on it: every entry above amax / 37 saturates -- fails."""
    from pipeline.check import eval_ids
    from stages.hooks import attention_layers, forward_hooks

    model, spec = smollm2.model, smollm2.spec
    honest = _fp8_policy(spec.n_layers, 1.0, n_sink=4, residual=16)
    warmup, tokens = canary.lengths(honest, spec.max_positions, 48)
    ids = eval_ids(smollm2.tokenizer, 1, warmup + tokens)
    amax = {}

    def grab(i):
        def hook(_m, _inp, out):
            amax[i] = max(amax.get(i, 0.0), float(out.abs().max()))
        return hook

    hooks = [(a.k_proj, grab(i), False) for i, a in enumerate(attention_layers(model))]
    with torch.no_grad(), forward_hooks(hooks):
        model(ids)
    layers = [(TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_scale=torch.tensor(1.5 * amax[i] / 448)),) * 2
              for i in range(spec.n_layers)]
    honest = dataclasses.replace(honest, layers=layers)
    poisoned = dataclasses.replace(honest, layers=[tuple(dataclasses.replace(p, fp8_scale=p.fp8_scale / 37) for p in pair)
                                                   for pair in layers])
    good = canary.judge(canary.measure(model, honest, ids, warmup), None, require_claim=False)
    bad = canary.judge(canary.measure(model, poisoned, ids, warmup), None, require_claim=False)
    assert good["ok"], good["reason"]
    assert not bad["ok"] and bad["kl"] > canary.MAX_KL, bad["reason"]
    assert bad["baseline_kl"] == good["baseline_kl"]  # the baseline reads nothing of the artifact


@pytest.mark.parametrize("model", ["tiny", "tiny_gemma3"])
def test_an_fp16_cache_scores_kl_exactly_zero_and_agreement_exactly_one(model, request):
    """Served through the cache, an fp16 cache of a float32 model differs from the model's own forward only by the
    fp16 rounding of K / V and the order of float32 sums: its KL (true value ~1e-9 nats, in float32 sums anywhere in
    +-1e-6 per position) is 0.0 exactly and its agreement 1.0 exactly, on every CPU: the schema's minimum of 0 never
    refuses it (issue 66: -8.6e-9 refused the run's own manifest on one machine)."""
    from pipeline.check import eval_ids

    bundle = request.getfixturevalue(model)
    fp16 = TensorPolicy(format="fp16", bits=16, axis="tensor")
    policy = CachePolicy(name="fp16", layers=[(fp16, fp16)] * bundle.spec.n_layers, n_sink=4, residual=8)
    warmup, tokens = canary.lengths(policy, bundle.spec.max_positions)
    measured = canary.measure(bundle.model, policy, eval_ids(bundle.tokenizer, 1, warmup + tokens), warmup)
    assert measured["kl"] == 0.0 and measured["agreement"] == 1.0, measured
    assert measured["baseline_kl"] == 0.0 and measured["baseline_agreement"] == 1.0  # the baseline keeps fp16
    claim = {"tokens": measured["tokens"], "warmup": measured["warmup"], "kl": 0.0, "agreement": 1.0}
    assert canary.judge(measured, claim)["ok"]


def test_a_kl_far_below_zero_is_a_bug_named_not_a_figure():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0]]), -1)
    assert canary.kl_and_agreement(ref, ref) == (0.0, 1.0)
    assert canary.kl_and_agreement(ref, ref + 0.5) == (0.0, 1.0)  # a row's normalizer is not a distribution's change
