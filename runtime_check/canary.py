"""The quality canary: a check that can see poisoned calibration.

Kernel == oracle proves that the kernel decodes the stored bytes as the spec says; it cannot see calibration that
is wrong, since both read the same wrong bytes. An artifact may come from a stranger, and every number in it --
the calibrated tensors, their checksums, the evaluation it records -- can be rewritten and re-signed. So `check`
also measures what the artifact does to the model it serves, against two references:

1. The text: one window of the check's own text (the embedded evaluation text, pipeline/check.py): `warmup`
   tokens -- the artifact's full-precision rows (sink + residual) and STORED rows the cache stores in the
   artifact's format -- then `n` scored tokens.
   The full-precision reference is one forward of the window with no cache.
2. The served logits: the warm-up as one prefill chunk through the serving cache (serving.cache.ArtifactCache,
   block-wise attention, the fused CPU kernel where built), then the scored tokens one at a time: what a
   consumer's decode reads, every scored step reading rows the artifact's format stored.
3. The baseline: the same sequence structure (sink, residual, prefix) with every quantized side replaced by a
   calibration-free format at the same bits (uniform per-token asymmetric: it reads no calibrated tensor, so no
   edit of the artifact can make it worse).

Measured over the n scored positions (those after the warm-up): KL(full precision || served) in nats, mean, and
the top-1 agreement. The canary fails when the artifact's KL exceeds max(FACTOR x baseline, baseline + MARGIN)
-- a limit nothing in the artifact can move -- or, where the manifest records the canary the run measured, when
it exceeds DRIFT_FACTOR x recorded + DRIFT_MARGIN (the artifact no longer does what its run measured).
"""
from __future__ import annotations

import dataclasses

import torch

TOKENS = 128          # scored positions (after the warm-up)
STORED = 256          # rows of the warm-up stored in the artifact's format (after its sink and residual rows)
FACTOR, MARGIN = 3.0, 0.01               # the calibration-free limit: max(FACTOR * baseline, baseline + MARGIN)
DRIFT_FACTOR, DRIFT_MARGIN = 1.5, 0.005  # the recorded limit: DRIFT_FACTOR * recorded + DRIFT_MARGIN
BASELINE = ("calibration-free: uniform per-token at the artifact's bits (fp8: unit scale per tensor; fp16 kept), "
            "same sink / residual / prefix")


def baseline_policy(policy):
    """The calibration-free twin of `policy`: same name + "@baseline", sink, residual and prefix; keys post-RoPE,
    no smoothing; each side fp16 where the artifact's is, fp8 of the same type with a unit scale where it is fp8,
    else uniform per-token (min / max of each row) at its bits."""
    from exporters.codec import TensorPolicy

    def twin(p: TensorPolicy) -> TensorPolicy:
        if p.format == "fp16":
            return TensorPolicy(format="fp16", bits=16, axis="tensor")
        if p.format == "fp8":  # the same fp8 type with a unit scale: what an uncalibrated cast stores
            return TensorPolicy(format="fp8", bits=8, axis="tensor", fp8_dtype=p.fp8_dtype, fp8_scale=torch.tensor(1.0))
        return TensorPolicy(format="uniform", bits=p.bits, axis="token")

    return dataclasses.replace(policy, name=f"{policy.name}@baseline", layers=[(twin(k), twin(v)) for k, v in policy.layers],
                               key_rope="post", smooth=None, model=None)


def warmup_length(policy, stored: int = STORED) -> int:
    """Tokens before the scored ones: the sink and residual rows, then `stored` rows in the artifact's format
    (rounded up to whole K / V flush units), so that every scored step reads at least that many stored rows."""
    from exporters.served_rows import layer_rows

    unit = max(layer_rows(policy, i, None).unit for i in range(len(policy.layers)))
    return policy.n_sink + policy.residual + max(1, -(-stored // unit)) * unit


def lengths(policy, positions: int, tokens: int = TOKENS) -> tuple[int, int] | None:
    """(warmup, tokens) that fit a model of `positions` positions after the policy's prefix: STORED stored rows
    and `tokens` scored ones where they fit, else fewer of both (at least one flush unit and 16 scored tokens);
    None when even that does not fit (the model is too short for a canary)."""
    room = positions - policy.prefix_len - 1
    stored = STORED
    while warmup_length(policy, stored) + tokens > room and (stored > 1 or tokens > 16):
        stored, tokens = max(1, stored // 2), max(16, tokens // 2) if stored == 1 else tokens
    warmup = warmup_length(policy, stored)
    return (warmup, tokens) if warmup + tokens <= room else None


def reference_logprobs(model: torch.nn.Module, ids: torch.Tensor, prefix_ids: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Full precision: one forward of ids [1, n] (after prefix_ids, the artifact's prefix, when it has one) with no
    cache -> log-probabilities [n, V] float32 of the step after each token."""
    from stages.hooks import model_device

    run = ids if prefix_ids is None else torch.cat([prefix_ids.long().view(1, -1), ids], 1)
    with torch.no_grad():
        logits = model(run.to(model_device(model)), use_cache=False).logits[0, run.shape[1] - ids.shape[1]:]
    return torch.log_softmax(logits.float().cpu(), -1)


def served_logprobs(model: torch.nn.Module, policy, ids: torch.Tensor, warmup: int, prefix: dict | None = None
                    ) -> torch.Tensor:
    """ids [1, n] through the serving cache (the artifact's prefix first, held by the cache): the first `warmup`
    tokens as one prefill chunk, then one token at a time, as a consumer decodes -> log-probabilities [n - warmup,
    V] float32 of the step after each decoded token."""
    from serving.blockwise import serving
    from serving.cache import ArtifactCache, cache_kwargs
    from stages.hooks import model_device

    device = model_device(model)
    cache = ArtifactCache(policy, model, attention="blockwise", prefix=prefix)
    out = []
    with torch.no_grad(), serving(model, cache):
        model(ids[:, :warmup].to(device), **cache_kwargs(model, cache))
        for t in range(warmup, ids.shape[1]):
            logits = model(ids[:, t:t + 1].to(device), **cache_kwargs(model, cache)).logits[0, -1]
            out.append(torch.log_softmax(logits.float().cpu(), -1))
    return torch.stack(out)


def kl_and_agreement(ref: torch.Tensor, got: torch.Tensor, prefix: str = "") -> tuple[float, float]:
    """Mean KL(ref || got) in nats and top-1 agreement over positions (rows of log-probabilities). Both rows are
    renormalized in float64 first (float32 log_softmax rows sum to 1 only to float32 rounding, which alone moved the
    KL of an exact cache below zero), and each figure is brought into its range by exporters.figures (a KL within
    KL_TOL of 0 is 0.0; a larger negative one is a bug, FigureError naming the manifest field runtime_check/canary/
    <prefix>kl)."""
    from exporters import figures

    ref64, got64 = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (ref64.exp() * (ref64 - got64)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    return (figures.kl(f"runtime_check/canary/{prefix}kl", float(kl.mean())),
            figures.fraction(f"runtime_check/canary/{prefix}agreement", float(agree)))


def measure(model: torch.nn.Module, policy, ids: torch.Tensor, warmup: int, prefix: dict | None = None) -> dict:
    """The canary of `policy` on `model` over ids [1, warmup + n] (see the module docstring; warmup, n: lengths)
    -> {tokens, warmup, kl, agreement, baseline, baseline_kl, baseline_agreement}."""
    if ids.shape[1] <= warmup:
        raise ValueError(f"the canary needs more than {warmup} tokens (the warm-up), got {ids.shape[1]}")
    ref = reference_logprobs(model, ids, None if prefix is None else prefix["ids"])[warmup:]
    kl, agree = kl_and_agreement(ref, served_logprobs(model, policy, ids, warmup, prefix))
    base_kl, base_agree = kl_and_agreement(ref, served_logprobs(model, baseline_policy(policy), ids, warmup, prefix),
                                           "baseline_")
    return {"tokens": ids.shape[1] - warmup, "warmup": warmup, "kl": kl, "agreement": agree,
            "baseline": BASELINE, "baseline_kl": base_kl, "baseline_agreement": base_agree}


def judge(measured: dict, recorded: dict | None) -> dict:
    """measured (measure's result) against the calibration-free limit and, when given, the canary the artifact's
    run recorded -> measured + {limit, recorded_kl, ok, reason}."""
    limit = max(FACTOR * measured["baseline_kl"], measured["baseline_kl"] + MARGIN)
    why = f"KL {measured['kl']:.4g} nats vs the calibration-free limit {limit:.4g} (baseline {measured['baseline_kl']:.4g})"
    ok = measured["kl"] <= limit
    out = dict(measured, limit=limit, recorded_kl=None)
    if recorded is not None and recorded.get("tokens") == measured["tokens"]:
        drift = DRIFT_FACTOR * recorded["kl"] + DRIFT_MARGIN
        out["recorded_kl"] = recorded["kl"]
        why += f"; vs the run's recorded {recorded['kl']:.4g} (limit {drift:.4g})"
        ok = ok and measured["kl"] <= drift
    out["ok"] = ok
    out["reason"] = ("passed: " if ok else "FAILED: ") + why
    return out


__all__ = ["TOKENS", "FACTOR", "MARGIN", "DRIFT_FACTOR", "DRIFT_MARGIN", "BASELINE", "baseline_policy",
           "warmup_length", "lengths", "reference_logprobs", "served_logprobs", "kl_and_agreement", "measure", "judge"]
