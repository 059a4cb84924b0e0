"""Kernel vs oracle on one exported cache: the comparison at the heart of the runtime equivalence check.

`record` fills an ArtifactCache under the artifact's policy with B windows of T + 1 tokens (prefill T, then one
decode step) and captures the decode step's post-RoPE queries in every layer; `check_case` runs the attention
under test (by default the Triton kernel, serving/triton_attention.py) and the oracle
(runtime_check/reference.py) over the same stored cache in every layer, and `compare` measures them against
the bound `tolerance` states and justifies. Loading the model and text, choosing the cases and writing the
result into the manifest is pipeline/check.py's work.

Devices: each layer's decode inputs -- its query, its cache rows, its policy tensors -- are on the device that
layer runs on (under accelerate's device_map, its own GPU); the oracle computes there, and `compare` reads its
figures as Python numbers: no activation is moved off its layer's device (tests/runtime_check/
test_device_placement.py runs it on two emulated GPUs). A figure is never NaN or infinite: outputs that are not
finite fail the case with that cause (KernelFailed), so the record stays JSON.
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
    if any(layer["value"].get("rotation", "none") != "none" for layer in manifest["layers"]):
        terms.append("rotated values un-rotated once, the attention-weighted sum of the encoded rows times a [D, D] "
                     "float32 matrix, vs the butterfly on every decoded row (linear: equal up to D-term sums)")
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
    from serving.cache import ArtifactCache, cache_kwargs, from_layer
    from serving.inputs import inputs_to
    from stages.hooks import attention_override, eager_attention, model_device, model_rotaries

    model = lm.model
    ids = ids.to(model_device(model))
    cache = ArtifactCache(policy, model, prefix=prefix)
    queries: dict[int, tuple[torch.Tensor, float]] = {}

    def capture(module, query, key, value, mask, scaling):
        # [B, H_q, D] kept where the layer computed it: beside the layer's cache rows
        queries[module.layer_idx] = (query[:, :, -1].detach().float(), float(scaling))
        return eager_attention(query, key, value, mask, scaling)

    with torch.no_grad():
        model(ids[:, :-1], **cache_kwargs(model, cache))
        with attention_override(model, capture):
            model(ids[:, -1:], **cache_kwargs(model, cache))
    rotaries = model_rotaries(model)  # each layer's own RoPE (local and global layers may differ)
    inputs = []
    for i, layer in enumerate(cache.layers):
        q, scaling = queries[i]
        # every tensor of the layer's inputs on its query's device, the layer's (lambda is stored on CPU)
        inputs.append(inputs_to(from_layer(layer, q, scaling, rotaries[i]), q.device))
    return inputs


def non_finite(out: torch.Tensor, name: str) -> str | None:
    """Why the `name` ("kernel", "oracle") output cannot be compared -- it holds NaN or infinite values -- or None.
    It reads a number of the output: on a GPU, it waits for the launch that computes it."""
    bad = int((~torch.isfinite(out)).sum())
    return f"the {name}'s output holds {bad} non-finite values (NaN or inf) of {out.numel()}" if bad else None


def compare(kernel_out: torch.Tensor, oracle_out: torch.Tensor) -> dict:
    """The bound (see tolerance) on one layer's outputs [B, H_q, D] -> {max_abs_err, max_rel_err, scale, ok}. The
    kernel's output is taken to the oracle's device (a no-op where the kernel ran on the layer's); only Python
    numbers leave it. Outputs that are not finite are not ok and have no figures (None; non_finite says why)."""
    if non_finite(kernel_out, "kernel") or non_finite(oracle_out, "oracle"):
        return {"max_abs_err": None, "max_rel_err": None, "scale": None, "ok": False}
    diff = (kernel_out.detach().float().to(oracle_out.device) - oracle_out.float()).abs()
    scale = float(oracle_out.abs().max())
    max_abs = float(diff.max())
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / max(scale, ATOL), "scale": scale,
            "ok": max_abs <= ATOL + RTOL * scale}


class KernelFailed(Exception):
    """The kernel raised, or an output was not finite: a failed check, recorded with its cause."""


def check_case(lm, policy, ids: torch.Tensor, prefix: dict | None, kernel: Callable, timing: dict) -> dict:
    """Every layer of one (context, batch): kernel vs oracle -> the worst layer's errors. lm: the model bundle
    (`.model`); ids [B, T + 1]; kernel: DecodeInputs -> [B, H_q, D] on the inputs' device; timing: {"kernel_s",
    "oracle_s"}, added to. A kernel that raises, or a kernel or oracle output that is not finite, raises
    KernelFailed naming the layer and the cause."""
    from runtime_check import reference

    worst = None
    for i, inp in enumerate(record(lm, policy, ids, prefix)):
        start = time.perf_counter()
        try:
            out = kernel(inp)
        except Exception as exc:  # noqa: BLE001 -- any kernel failure is a check failure, never a crash
            raise KernelFailed(f"layer {i}: {type(exc).__name__}: {exc}") from exc
        cause = non_finite(out, "kernel")  # inside the timing: a GPU launch returns before it has computed
        timing["kernel_s"] += time.perf_counter() - start
        start = time.perf_counter()
        ref = reference.decode_attention(inp)
        cause = cause or non_finite(ref, "oracle")
        timing["oracle_s"] += time.perf_counter() - start
        if cause:
            raise KernelFailed(f"layer {i}: {cause}")
        res = compare(out, ref) | {"worst_layer": i}
        if worst is None or (not res["ok"], res["max_rel_err"]) > (not worst["ok"], worst["max_rel_err"]):
            worst = res
    return {k: worst[k] for k in ("max_abs_err", "max_rel_err", "worst_layer", "ok")}


__all__ = ["ATOL", "RTOL", "tolerance", "record", "compare", "non_finite", "check_case", "KernelFailed"]


def artifact_prefix(artifact) -> dict | None:
    """The full-precision prefix an artifact serves every sequence after, as `record` takes it:
    {"ids": [P], "k", "v": [L, H, P, D]}, or None (artifact: exporters.native.load_artifact's result)."""
    pj = artifact.manifest["cache"]["prefix"]
    if not pj:
        return None
    return {"ids": torch.tensor(pj["token_ids"], dtype=torch.long),
            "k": artifact.tensors[pj["tensors"]["k"]], "v": artifact.tensors[pj["tensors"]["v"]]}
