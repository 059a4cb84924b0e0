"""Kernel vs oracle on one exported cache: the comparison at the heart of the runtime equivalence check.

`record` fills an ArtifactCache under the artifact's policy with B windows of T + 1 tokens (prefill T, then one
decode step) and captures the decode step's post-RoPE queries in every layer; `check_case` runs the attention
under test (by default the Triton kernel, runtime_check/triton_attention.py) and the oracle
(runtime_check/reference.py) over the same stored cache in every layer, and `compare` measures them against
the bound `tolerance` states and justifies. Loading the model and text, choosing the cases and writing the
result into the manifest is pipeline/check.py's work.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

ATOL = 1e-6
RTOL = 2e-4


def tolerance(manifest: dict) -> tuple[dict, str]:
    """The bound, and the reason for it: the rule and its rationale only. What was measured goes in the record's
    measured fields (max_abs_err, max_rel_err, cases), never into the reason, which depends on the manifest alone.

    The kernel and the oracle read the same bytes: codes, fp16 scales / zero-points, fp16 sparse outliers, fp8
    bytes, fp16 sink and residual rows, float32 codebooks and static ranges. Each decodes them to the same float32
    values up to one rounding (fused multiply-add); what remains is float32 rounding, expected of order
    1e-7..1e-6 relative. So the bound is relative to the output scale and far below what any decoding mistake
    causes: a wrong level, position or axis moves the output by a quantization step, 1e-2..1 of its scale."""
    keys = [layer["key"] for layer in manifest["layers"]]
    terms = ["float32 accumulation order (D-term dot products; online base-2 softmax over tiles and splits vs "
             "torch.softmax)"]
    if manifest["cache"]["key_rope"] == "pre" and any(k["format"] != "fp16" for k in keys):
        terms.append("in-kernel cos/sin of position * inv_freq (range-reduced) vs the model's rotary module")
    if manifest["cache"]["smoothing"]:
        terms.append("lambda folded into q instead of multiplied into decoded keys")
    formats = sorted({layer[kind]["format"] for layer in manifest["layers"] for kind in ("key", "value")})
    reason = (f"formats {'/'.join(formats)}: kernel and oracle decode identical stored bytes (packed codes, fp16 "
              f"scales, zero-points and outliers, fp8 bytes, fp16 sink and residual rows) to identical float32 "
              f"values; they differ only by float32 rounding (unit roundoff 6e-8) from " + "; ".join(terms) +
              f", expected of order 1e-7..1e-6 of the output scale. rtol={RTOL:g} of max|oracle| per layer is "
              f"about 100x above that and far below the change a decoding mistake makes (a wrong codebook level, "
              f"RoPE position or cache axis moves the output by a quantization step, 1e-2..1 of its scale); "
              f"atol={ATOL:g} only guards all-zero outputs. The measured errors are max_abs_err, max_rel_err and "
              f"cases.")
    return {"atol": ATOL, "rtol": RTOL,
            "criterion": "per case and layer: max|kernel - oracle| <= atol + rtol * max|oracle|"}, reason


def record(lm, policy, ids: torch.Tensor, prefix: dict | None = None) -> list:
    """Fill an ArtifactCache with ids [B, T + 1] (prefill T, decode one) -> DecodeInputs per layer for the
    decode step. prefix: {"ids": [P], "k", "v": [L, H, P, D]} the artifact's full-precision rows, which the
    cache serves at positions 0..P-1 before the ids (ArtifactCache(..., prefix=...)); None for a policy without
    a prefix, or to have the cache compute them from the model."""
    from runtime_check.cache import ArtifactCache
    from runtime_check.inputs import from_layer
    from stages.hooks import attention_override, eager_attention, model_rotaries

    model = lm.model
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = ArtifactCache(policy, model, prefix=prefix)
    queries: dict[int, tuple[torch.Tensor, float]] = {}

    def capture(module, query, key, value, mask, scaling):
        queries[module.layer_idx] = (query[:, :, -1].detach().float().cpu(), float(scaling))
        return eager_attention(query, key, value, mask, scaling)

    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        with attention_override(model, capture):
            model(ids[:, -1:], cache=cache)
    rotaries = model_rotaries(model)  # each layer's own RoPE (local and global layers may differ)
    return [from_layer(layer, queries[i][0], queries[i][1], rotaries[i]) for i, layer in enumerate(cache.layers)]


def compare(kernel_out: torch.Tensor, oracle_out: torch.Tensor) -> dict:
    diff = (kernel_out.detach().float().cpu() - oracle_out.float()).abs()
    scale = float(oracle_out.abs().max())
    finite = bool(torch.isfinite(kernel_out).all())
    max_abs = float(diff.max()) if finite else float("inf")
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / max(scale, ATOL), "scale": scale,
            "ok": finite and max_abs <= ATOL + RTOL * scale}


class KernelFailed(Exception):
    """The kernel raised: a failed check, recorded with its cause."""


def check_case(lm, policy, ids: torch.Tensor, prefix: dict | None, kernel: Callable, timing: dict) -> dict:
    """Every layer of one (context, batch): kernel vs oracle -> the worst layer's errors. lm: the model bundle
    (`.model`); ids [B, T + 1]; kernel: DecodeInputs -> [B, H_q, D]; timing: {"kernel_s", "oracle_s"}, added to.
    A kernel that raises raises KernelFailed naming the layer."""
    from runtime_check import reference

    worst = None
    for i, inp in enumerate(record(lm, policy, ids, prefix)):
        start = time.perf_counter()
        try:
            out = kernel(inp)
        except Exception as exc:  # noqa: BLE001 -- any kernel failure is a check failure, never a crash
            raise KernelFailed(f"layer {i}: {type(exc).__name__}: {exc}") from exc
        timing["kernel_s"] += time.perf_counter() - start
        start = time.perf_counter()
        ref = reference.decode_attention(inp)
        timing["oracle_s"] += time.perf_counter() - start
        res = compare(out, ref) | {"worst_layer": i}
        if worst is None or (not res["ok"], res["max_rel_err"]) > (not worst["ok"], worst["max_rel_err"]):
            worst = res
    return {k: worst[k] for k in ("max_abs_err", "max_rel_err", "worst_layer", "ok")}


__all__ = ["ATOL", "RTOL", "tolerance", "record", "compare", "check_case", "KernelFailed"]


def artifact_prefix(artifact) -> dict | None:
    """The full-precision prefix an artifact serves every sequence after, as `record` takes it:
    {"ids": [P], "k", "v": [L, H, P, D]}, or None (artifact: exporters.native.load_artifact's result)."""
    pj = artifact.manifest["cache"]["prefix"]
    if not pj:
        return None
    return {"ids": torch.tensor(pj["token_ids"], dtype=torch.long),
            "k": artifact.tensors[pj["tensors"]["k"]], "v": artifact.tensors[pj["tensors"]["v"]]}
