"""The quality canary: a check that can see poisoned calibration.

Kernel == oracle proves that the kernel decodes the stored bytes as the spec says; it cannot see calibration that
is wrong, since both read the same wrong bytes. An artifact may come from a stranger, and every number in it --
the calibrated tensors, their checksums, the evaluation and canary it records -- can be rewritten and re-signed. So
`check` also measures what the artifact does to the model it serves, and judges it against bounds no field of the
artifact can move:

1. The text: one window of the check's own text (the embedded evaluation text, pipeline/check.py): `warmup`
   tokens -- the artifact's full-precision rows (sink + residual) and STORED rows the cache stores in the
   artifact's format -- then `n` scored tokens.
   The full-precision reference is one forward of the window with no cache, after the artifact's prefix ids (the
   model computes the prefix itself: the artifact's stored prefix rows are never the reference).
2. The served logits: the warm-up as one prefill chunk through the serving cache (serving.cache.ArtifactCache,
   block-wise attention, the fused CPU kernel where built), the artifact's stored prefix rows first, then the scored
   tokens one at a time: what a consumer's decode reads, every scored step reading rows the artifact's format stored.
3. For reference only, the calibration-free baseline: the same sequence structure with every quantized side replaced
   by a calibration-free format at the same bits (uniform per-token asymmetric), its prefix rows computed by the
   model. It is printed beside the result; it is not the limit (an artifact's declared bits move it).

Measured over the n scored positions (those after the warm-up): KL(full precision || served) in nats, mean, and
the top-1 agreement. The verdict (judge) fails on any of:
- the absolute limits, in what a user reads: KL above MAX_KL or top-1 agreement below MIN_TOP1 (`check
  max_kl=... min_top1=...`; the defaults pass every honest recipe the project exports, docs/manifest.md);
- the artifact's claim: the canary its run recorded (manifest runtime_check.canary) is a claim, re-measured here;
  a measurement worse than the claim by more than CLAIM_FACTOR x claim + CLAIM_MARGIN (KL) or CLAIM_TOP1 (agreement)
  fails, and so does a missing claim unless the user allows it (`allow_unclaimed=true`);
- the prefix: stored prefix rows that differ from what the model computes for prefix.ids (PREFIX_RTOL);
- a canary that cannot run (the model's positions cannot hold the warm-up), or a layer whose flush unit never
  fills within the model's positions (it would serve fp16 while declaring its bits): no field switches it off.
"""
from __future__ import annotations

import dataclasses

import torch

TOKENS = 128          # scored positions (after the warm-up)
STORED = 256          # rows of the warm-up stored in the artifact's format (after its sink and residual rows)
MIN_TOKENS = 16       # the fewest scored positions a canary is judged on
# the absolute limits (CheckConfig.max_kl / min_top1). The honest recipes the project exports reach KL 0.174 and
# top-1 0.812 (Gemma 3, the 2.75-bit layer policy), 0.123 / 0.859 on SmolLM2 (2.45 bits): docs/manifest.md
MAX_KL, MIN_TOP1 = 0.25, 0.75
# the claim's tolerance: the same model, text and code give the same figures (a claim re-measured on the machine that
# made it is equal); another device or kernel build moves them by float rounding, far below this
CLAIM_FACTOR, CLAIM_MARGIN, CLAIM_TOP1 = 1.05, 1e-4, 2 / TOKENS
PREFIX_RTOL = 2e-2    # stored prefix rows vs the model's own: fp16 storage and another dtype stay far below it
BASELINE = ("calibration-free: uniform per-token at the artifact's bits (fp8: unit scale per tensor; fp16 kept), "
            "same sink / residual, the prefix computed by the model")


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


def flush_units(policy) -> list[int]:
    """Per layer the rows its residual window flushes at once (exporters.served_rows: whole units of K's and V's
    groups; 1 for a layer stored row by row)."""
    from exporters.served_rows import layer_rows

    return [layer_rows(policy, i, None).unit for i in range(len(policy.layers))]


def room(policy, positions: int) -> int:
    """Positions a canary window may take: the model's, less the prefix and the decoded step."""
    return positions - policy.prefix_len - 1


def never_stored(policy, positions: int) -> list[str]:
    """The layers whose flush unit cannot fill within the model's positions (after the sink and residual rows and
    MIN_TOKENS scored tokens): such a layer would never store a row in its declared format -- it serves fp16 while
    the artifact declares its bits -- so the canary could not see it. Each named with its unit."""
    free = room(policy, positions) - policy.n_sink - policy.residual - MIN_TOKENS
    return [f"layer {i}: a flush unit of {u} rows, more than the {max(free, 0)} positions a sequence has after "
            f"the sink and residual rows" for i, u in enumerate(flush_units(policy)) if u > free]


def warmup_length(policy, stored: int = STORED, positions: int | None = None) -> int:
    """Tokens before the scored ones: the sink and residual rows, then `stored` rows in the artifact's format
    (rounded up to whole K / V flush units), so that every scored step reads at least that many stored rows. Only the
    units that fit the model's positions count (positions None: all): a layer whose unit never fills is
    never_stored's finding, and it cannot push the warm-up past the model and switch the canary off."""
    units = flush_units(policy)
    if positions is not None:
        free = room(policy, positions) - policy.n_sink - policy.residual - MIN_TOKENS
        units = [u for u in units if u <= free]
    unit = max(units, default=1)
    return policy.n_sink + policy.residual + max(1, -(-stored // unit)) * unit


def lengths(policy, positions: int, tokens: int = TOKENS) -> tuple[int, int] | None:
    """(warmup, tokens) that fit a model of `positions` positions after the policy's prefix: STORED stored rows
    and `tokens` scored ones where they fit, else fewer of both (at least one flush unit and MIN_TOKENS scored);
    None when even that does not fit (the model is too short for a canary: the check fails, naming it)."""
    stored = STORED
    limit = room(policy, positions)
    while warmup_length(policy, stored, positions) + tokens > limit and (stored > 1 or tokens > MIN_TOKENS):
        stored, tokens = max(1, stored // 2), max(MIN_TOKENS, tokens // 2) if stored == 1 else tokens
    warmup = warmup_length(policy, stored, positions)
    return (warmup, tokens) if warmup + tokens <= room(policy, positions) else None


def prefix_difference(stored: dict, computed: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """Why the artifact's stored prefix rows ({"k", "v"}: [L, H, P, D]) are not the model's own for prefix.ids
    (computed: (K, V) of serving.cache.prefix_rows with no stored rows), or None: per layer and side, max |stored -
    computed| <= PREFIX_RTOL x max |computed|. A prefix is full precision: poisoned rows would poison every sequence
    served after them."""
    for side, got, ref in (("k", stored["k"], computed[0]), ("v", stored["v"], computed[1])):
        got, ref = got.float().cpu(), ref.float().cpu()
        if got.shape != ref.shape:
            return f"cache/prefix {side}: stored rows of shape {list(got.shape)}, the model computes {list(ref.shape)}"
        for layer in range(ref.shape[0]):
            scale = float(ref[layer].abs().max())
            err = float((got[layer] - ref[layer]).abs().max()) if got[layer].numel() else 0.0
            if not err <= PREFIX_RTOL * max(scale, 1e-6):  # NaN fails too
                return (f"cache/prefix {side}, layer {layer}: the stored rows differ from what the model computes for "
                        f"prefix.ids by {err:.4g} (the rows' scale {scale:.4g}; allowed {PREFIX_RTOL:g} of it)")
    return None


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


def measure(model: torch.nn.Module, policy, ids: torch.Tensor, warmup: int, prefix: dict | None = None,
            model_prefix: dict | None = None) -> dict:
    """The canary of `policy` on `model` over ids [1, warmup + n] (see the module docstring; warmup, n: lengths)
    -> {tokens, warmup, kl, agreement, baseline, baseline_kl, baseline_agreement}. prefix: the artifact's stored
    prefix rows, which the served cache reads; model_prefix: the model's own rows for prefix.ids, which the baseline
    reads (None: computed here)."""
    if ids.shape[1] <= warmup:
        raise ValueError(f"the canary needs more than {warmup} tokens (the warm-up), got {ids.shape[1]}")
    ref = reference_logprobs(model, ids, None if prefix is None else prefix["ids"])[warmup:]
    kl, agree = kl_and_agreement(ref, served_logprobs(model, policy, ids, warmup, prefix))
    # the reference baseline's prefix rows are the model's own (model_prefix None: computed from prefix_ids)
    base_kl, base_agree = kl_and_agreement(
        ref, served_logprobs(model, baseline_policy(policy), ids, warmup, model_prefix), "baseline_")
    return {"tokens": ids.shape[1] - warmup, "warmup": warmup, "kl": kl, "agreement": agree,
            "baseline": BASELINE, "baseline_kl": base_kl, "baseline_agreement": base_agree}


def judge(measured: dict, claim: dict | None, max_kl: float = MAX_KL, min_top1: float = MIN_TOP1,
          require_claim: bool = True, findings: list[str] | None = None) -> dict:
    """measured (measure's result) against the absolute limits and the artifact's claim (the canary its run recorded,
    manifest runtime_check.canary; None: absent) -> measured + {limit, min_top1, recorded_kl, claimed_agreement,
    failures, ok, reason}. require_claim False: the run measuring its own claim, or a user who allows an unclaimed
    artifact. findings: failures found beside the measurement (prefix rows, layers never stored)."""
    failures = list(findings or [])
    if measured["kl"] > max_kl:
        failures.append(f"KL {measured['kl']:.4g} nats above max_kl {max_kl:g}")
    if measured["agreement"] < min_top1:
        failures.append(f"top-1 agreement {measured['agreement']:.3f} below min_top1 {min_top1:g}")
    out = dict(measured, limit=max_kl, min_top1=min_top1, recorded_kl=None, claimed_agreement=None)
    if claim is None:
        if require_claim:
            failures.append("the artifact claims no canary (manifest runtime_check.canary): nothing binds it to what "
                            "its run measured (allow_unclaimed=true judges it on the limits alone)")
    elif (claim.get("tokens"), claim.get("warmup")) != (measured["tokens"], measured["warmup"]):
        failures.append(f"the claimed canary was measured on {claim.get('tokens')} tokens after "
                        f"{claim.get('warmup')}; this artifact's canary is {measured['tokens']} after "
                        f"{measured['warmup']}: not the artifact it was measured on")
    else:
        out["recorded_kl"], out["claimed_agreement"] = claim["kl"], claim["agreement"]
        kl_limit = CLAIM_FACTOR * claim["kl"] + CLAIM_MARGIN
        if measured["kl"] > kl_limit:
            failures.append(f"KL {measured['kl']:.4g} worse than the claimed {claim['kl']:.4g} "
                            f"(allowed {kl_limit:.4g})")
        if measured["agreement"] < claim["agreement"] - CLAIM_TOP1:
            failures.append(f"top-1 agreement {measured['agreement']:.3f} worse than the claimed "
                            f"{claim['agreement']:.3f} (allowed {CLAIM_TOP1:.4f} less)")
    out["failures"] = failures
    out["ok"] = not failures
    limits = (f"KL {measured['kl']:.4g} nats (max_kl {max_kl:g}), top-1 {measured['agreement']:.3f} "
              f"(min_top1 {min_top1:g})")
    if out["recorded_kl"] is not None:
        limits += f"; claimed KL {claim['kl']:.4g}, top-1 {claim['agreement']:.3f}"
    out["reason"] = (f"passed: {limits}" if out["ok"] else f"FAILED: {'; '.join(failures)} [{limits}]")
    return out


__all__ = ["TOKENS", "STORED", "MIN_TOKENS", "MAX_KL", "MIN_TOP1", "CLAIM_FACTOR", "CLAIM_MARGIN", "CLAIM_TOP1",
           "PREFIX_RTOL", "BASELINE", "baseline_policy", "flush_units", "never_stored", "prefix_difference",
           "warmup_length", "lengths", "reference_logprobs", "served_logprobs", "kl_and_agreement", "measure", "judge"]
