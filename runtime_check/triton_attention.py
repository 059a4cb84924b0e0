"""Fused decode attention over the exported cache (one new query token per sequence), in Triton.

The kernel reads the cache in its stored layout (exporters/layout.py, docs/manifest.md) and never builds a
dequantized copy: per tile of BLOCK_T rows it unpacks the b-bit codes from the packed bytes (code j occupies
bits [j*b, (j+1)*b) of its row, so for b=3 a code may straddle two bytes), maps them through the codebook
(nuq) or code * scale + zero (uniform, per token or per channel group), or fp8 bytes through a 256-entry table
of their values times the per-tensor / per-head scale, overwrites sparse outliers (per token row, from the
host's exclusive prefix sum of the row counts), rotates pre-RoPE keys at their positions (rotate-half pairs,
angle = position * inv_freq of the model's rotary module), and folds the SmoothAttention lambda into q.
Sink and residual rows are read as stored (fp16). Softmax is online in float32 (base 2, scaling * log2(e)
folded into q), flash-decoding style: programs (sequence, kv head, split) each reduce a slice of the rows for
all query heads of their GQA group, and a second kernel merges the splits.

Format and scale layout are constexpr flags, so one kernel body serves every recipe. On a machine without a
GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

if not torch.cuda.is_available():  # must precede `import triton`: @triton.jit reads it when the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from exporters.codec import FP8, TensorPolicy  # noqa: E402
from exporters.layout import StoredBlock, pages_of  # noqa: E402
from runtime_check.inputs import DecodeInputs, inputs_to  # noqa: E402

FMT_FP16, FMT_FP8, FMT_UNIFORM, FMT_NUQ = 0, 1, 2, 3
# where a row's scale / zero live: none (fp16), per token [B,H,T,1], per channel group [B,H,G,D],
# static per channel [H,D] (nuq keys), one per head or tensor (fp8)
SC_NONE, SC_TOKEN, SC_GROUP, SC_STATIC, SC_HEAD = 0, 1, 2, 3, 4
LOG2E = 1.4426950408889634

# Cody-Waite reduction of RoPE angles to [-pi, pi] before cos/sin (angles reach ~1e5 rad at 128k positions, where
# a GPU's fast cos/sin lose accuracy): 2*pi = C1 + C2 + C3, C1 and C2 with 8 significant bits so n * C1 and
# n * C2 are exact in float32 for n < 2^16 turns (positions up to ~400k).
_C1 = 6.28125
_C2 = round((2 * math.pi - _C1) * 2 ** 17) / 2 ** 17
_C3 = 2 * math.pi - _C1 - _C2
TWO_PI_C1, TWO_PI_C2, TWO_PI_C3 = tl.constexpr(_C1), tl.constexpr(_C2), tl.constexpr(_C3)
INV_TWO_PI = tl.constexpr(1 / (2 * math.pi))


# The kernels call no triton.language.standard helper (tl.sum, tl.max, tl.zeros): transformers and torch import
# triton before the check can set TRITON_INTERPRET, and helpers created then are compiled-mode functions the
# interpreter cannot call. Reductions go through the core tl.reduce with the standard combine functions, which the
# interpreter recognises and runs as numpy reductions (and the compiler lowers exactly like tl.sum / tl.max).
@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _rowmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _cos_sin(angle):
    n = tl.floor(angle * INV_TWO_PI + 0.5)
    r = angle - n * TWO_PI_C1
    r = r - n * TWO_PI_C2
    r = r - n * TWO_PI_C3
    return tl.cos(r), tl.sin(r)


@triton.jit
def _dequant(DATA, d_b, d_h, d_t, d_c, SCALE, ZERO, s_b, s_h, s_t, s_c, LUT,
             OCNT, OOFF, OIDX, OVAL, o_max, n_batch,
             b, h, rows, row_ok, ch,
             FMT: tl.constexpr, BITS: tl.constexpr, SMODE: tl.constexpr, GROUP: tl.constexpr,
             D: tl.constexpr, OUTLIERS: tl.constexpr):
    """Stored rows `rows` [BT] (block-relative) of sequence b, kv head h, channels `ch` [W] -> [BT, W] float32."""
    base = DATA + b * d_b + h * d_h + rows[:, None] * d_t
    ok = row_ok[:, None] & (ch[None, :] < D)
    if FMT == 0:  # FMT_FP16
        x = tl.load(base + ch[None, :] * d_c, mask=ok, other=0.0).to(tl.float32)
    elif FMT == 1:  # FMT_FP8: value table of the byte, times the head's (or tensor's) scale
        byte = tl.load(base + ch[None, :] * d_c, mask=ok, other=0).to(tl.int32)
        x = tl.load(LUT + byte) * tl.load(SCALE + h * s_h).to(tl.float32)
    else:  # FMT_UNIFORM, FMT_NUQ: b-bit codes packed little-endian along the row
        bit = ch * BITS
        byte = bit // 8
        word = tl.load(base + byte[None, :] * d_c, mask=ok, other=0).to(tl.int32)
        if (8 % BITS) != 0:  # a code may straddle into the next byte (b=3)
            n_bytes: tl.constexpr = (D * BITS + 7) // 8
            nxt = tl.load(base + (byte[None, :] + 1) * d_c, mask=ok & (byte[None, :] + 1 < n_bytes), other=0)
            word = word | (nxt.to(tl.int32) << 8)
        code = (word >> (bit % 8)[None, :]) & ((1 << BITS) - 1)
        if FMT == 2:  # uniform: code * scale + min
            level = code.to(tl.float32)
        else:  # nuq: codebook level * range + zero
            level = tl.load(LUT + code)
        if SMODE == 1:  # SC_TOKEN
            off = b * s_b + h * s_h + rows * s_t
            scale = tl.load(SCALE + off, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            zero = tl.load(ZERO + off, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        elif SMODE == 2:  # SC_GROUP: rows [g*GROUP, (g+1)*GROUP) share a scale per channel
            off = b * s_b + h * s_h + (rows // GROUP)[:, None] * s_t + ch[None, :] * s_c
            scale = tl.load(SCALE + off, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(ZERO + off, mask=ok, other=0.0).to(tl.float32)
        else:  # SC_STATIC: calibrated per (head, channel)
            off = h * s_h + ch * s_c
            scale = tl.load(SCALE + off).to(tl.float32)[None, :]
            zero = tl.load(ZERO + off).to(tl.float32)[None, :]
        x = level * scale + zero
    if OUTLIERS:
        # token row t of sequence b is outlier row t * B + b; its entries hold h' * D + d within the row
        orow = rows * n_batch + b
        count = tl.load(OCNT + orow, mask=row_ok, other=0).to(tl.int32)
        first = tl.load(OOFF + orow, mask=row_ok, other=0)
        target = h * D + ch
        for j in range(0, o_max):
            has = row_ok & (j < count)
            idx = tl.load(OIDX + first + j, mask=has, other=-1).to(tl.int32)
            val = tl.load(OVAL + first + j, mask=has, other=0.0).to(tl.float32)
            x = tl.where(idx[:, None] == target[None, :], val[:, None], x)
    return x


@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, USE_DOT: tl.constexpr):
    """[G, D/2] x2, [BT, D/2] x2 -> [G, BT]: q . k over both RoPE halves."""
    if USE_DOT:
        s = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
        s += tl.dot(q_hi, tl.trans(k_hi), input_precision="ieee")
    else:
        s = _sum(q_lo[:, None, :] * k_lo[None, :, :], 2) + _sum(q_hi[:, None, :] * k_hi[None, :, :], 2)
    return s


@triton.jit
def _online_softmax(m, l, acc, s, row_ok, v, USE_DOT: tl.constexpr):
    """One tile of base-2 logits s [G, BT] and values v [BT, D] into the running max m, sum l, output acc."""
    s = tl.where(row_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, _rowmax(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + _sum(p, 1)
    if USE_DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = _sum(p[:, :, None] * v[None, :, :], 1)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def _fp16_rows(m, l, acc, KP, k_b, k_h, k_t, k_c, VP, v_b, v_h, v_t, v_c, n_rows, b, h, q_lo, q_hi,
               lo, hi, dd, BLOCK_T: tl.constexpr, USE_DOT: tl.constexpr):
    """Full-precision (sink or residual) rows 0..n_rows-1: post-RoPE K and V as stored."""
    for t0 in range(0, n_rows, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        ok = rows < n_rows
        kb = KP + b * k_b + h * k_h + rows[:, None] * k_t
        k_lo = tl.load(kb + lo[None, :] * k_c, mask=ok[:, None], other=0.0).to(tl.float32)
        k_hi = tl.load(kb + hi[None, :] * k_c, mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(VP + b * v_b + h * v_h + rows[:, None] * v_t + dd[None, :] * v_c, mask=ok[:, None],
                    other=0.0).to(tl.float32)
        m, l, acc = _online_softmax(m, l, acc, _scores(q_lo, q_hi, k_lo, k_hi, USE_DOT), ok, v, USE_DOT)
    return m, l, acc


@triton.jit
def _decode_partial_kernel(
        Q, LAM, INV_FREQ, rope_scale, qk_scale, k_start, n_q, chunk, n_batch, n_kv,
        SK, sk_b, sk_h, sk_t, sk_c, SV, sv_b, sv_h, sv_t, sv_c, n_sink,
        RK, rk_b, rk_h, rk_t, rk_c, RV, rv_b, rv_h, rv_t, rv_c, n_rec,
        KD, kd_b, kd_h, kd_t, kd_c, KS, KZ, ks_b, ks_h, ks_t, ks_c, KLUT, KOC, KOO, KOI, KOV, k_omax,
        VD, vd_b, vd_h, vd_t, vd_c, VS, VZ, vs_b, vs_h, vs_t, vs_c, VLUT, VOC, VOO, VOI, VOV, v_omax,
        PO, PM, PL, n_split,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, USE_DOT: tl.constexpr,
        ROPE: tl.constexpr, SMOOTH: tl.constexpr,
        K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_SMODE: tl.constexpr, K_GROUP: tl.constexpr,
        K_OUTL: tl.constexpr,
        V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_SMODE: tl.constexpr, V_GROUP: tl.constexpr,
        V_OUTL: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // n_kv
    h = pid % n_kv
    HALF: tl.constexpr = D // 2
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    lo = tl.arange(0, HALF)
    hi = lo + HALF
    dd = tl.arange(0, D)
    q_row = Q + (pid * G + g)[:, None] * D                       # q: [B, H_q, D] contiguous; head = h * G + g
    q_lo = tl.load(q_row + lo[None, :], mask=g_ok[:, None], other=0.0) * qk_scale
    q_hi = tl.load(q_row + hi[None, :], mask=g_ok[:, None], other=0.0) * qk_scale

    m = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: an empty split must not produce inf - inf
    l = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, D], 0.0, tl.float32)

    # split 0 also reads the full-precision rows (sinks, residual window)
    first = split == 0
    m, l, acc = _fp16_rows(m, l, acc, SK, sk_b, sk_h, sk_t, sk_c, SV, sv_b, sv_h, sv_t, sv_c,
                           tl.where(first, n_sink, 0), b, h, q_lo, q_hi, lo, hi, dd, BLOCK_T, USE_DOT)
    m, l, acc = _fp16_rows(m, l, acc, RK, rk_b, rk_h, rk_t, rk_c, RV, rv_b, rv_h, rv_t, rv_c,
                           tl.where(first, n_rec, 0), b, h, q_lo, q_hi, lo, hi, dd, BLOCK_T, USE_DOT)

    # encoded rows: the block stores K / lambda, so q * lambda . (K / lambda) = q . K (lambda is shared by the
    # two channels of a RoPE pair, so it commutes with the rotation)
    if SMOOTH:
        q_lo = q_lo * tl.load(LAM + h * D + lo)[None, :]
        q_hi = q_hi * tl.load(LAM + h * D + hi)[None, :]
    if ROPE:
        inv_lo = tl.load(INV_FREQ + lo)
    t_begin = split * chunk
    t_end = tl.minimum(t_begin + chunk, n_q)
    for t0 in range(t_begin, t_end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        ok = rows < t_end
        k_lo = _dequant(KD, kd_b, kd_h, kd_t, kd_c, KS, KZ, ks_b, ks_h, ks_t, ks_c, KLUT, KOC, KOO, KOI, KOV, k_omax,
                        n_batch, b, h, rows, ok, lo, K_FMT, K_BITS, K_SMODE, K_GROUP, D, K_OUTL)
        k_hi = _dequant(KD, kd_b, kd_h, kd_t, kd_c, KS, KZ, ks_b, ks_h, ks_t, ks_c, KLUT, KOC, KOO, KOI, KOV, k_omax,
                        n_batch, b, h, rows, ok, hi, K_FMT, K_BITS, K_SMODE, K_GROUP, D, K_OUTL)
        if ROPE:
            pos = (k_start + rows).to(tl.float32)
            cos, sin = _cos_sin(pos[:, None] * inv_lo[None, :])
            cos = cos * rope_scale
            sin = sin * rope_scale
            k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
        v = _dequant(VD, vd_b, vd_h, vd_t, vd_c, VS, VZ, vs_b, vs_h, vs_t, vs_c, VLUT, VOC, VOO, VOI, VOV, v_omax,
                     n_batch, b, h, rows, ok, dd, V_FMT, V_BITS, V_SMODE, V_GROUP, D, V_OUTL)
        m, l, acc = _online_softmax(m, l, acc, _scores(q_lo, q_hi, k_lo, k_hi, USE_DOT), ok, v, USE_DOT)

    out = (pid * G + g) * n_split + split                       # partials: [B * H_q, n_split]
    tl.store(PM + out, m, mask=g_ok)
    tl.store(PL + out, l, mask=g_ok)
    tl.store(PO + out[:, None] * D + dd[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _combine_kernel(PO, PM, PL, OUT, n_split, S_P2: tl.constexpr, D: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for one (sequence, query head)."""
    row = tl.program_id(0)
    s = tl.arange(0, S_P2)
    ok = s < n_split
    dd = tl.arange(0, D)
    m = tl.load(PM + row * n_split + s, mask=ok, other=float("-inf"))
    l = tl.load(PL + row * n_split + s, mask=ok, other=0.0)
    acc = tl.load(PO + (row * n_split + s)[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
    w = tl.exp2(m - _rowmax(m, 0))
    out = _sum(w[:, None] * acc, 0) / _sum(w * l, 0)
    tl.store(OUT + row * D + dd, out)


# ---- host side ----------------------------------------------------------------------------------------------

_FORMATS = {"fp16": FMT_FP16, "fp8": FMT_FP8, "uniform": FMT_UNIFORM, "nuq": FMT_NUQ}


def fp8_lut(fp8_dtype: str, device) -> torch.Tensor:
    """[256] float32: the value of every fp8 byte (the kernel's fp8 decode is lut[byte] * scale)."""
    dtype = FP8[fp8_dtype][0]
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().to(device)


def _strides4(t: torch.Tensor) -> list[int]:
    assert t.dim() == 4, t.shape
    return list(t.stride())


def _side_args(block: StoredBlock | None, p: TensorPolicy, n_batch: int, device) -> tuple[list, dict]:
    """Kernel arguments for one encoded side (K or V): data + strides, scale, zero + strides, LUT, outliers,
    and its constexpr flags. A missing block (no encoded rows yet) passes placeholders that are never read."""
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    fmt = _FORMATS[p.format]
    flags = {"FMT": fmt, "BITS": max(1, p.bits if fmt in (FMT_UNIFORM, FMT_NUQ) else 8), "SMODE": SC_NONE,
             "GROUP": 1, "OUTL": False}
    if block is None:
        return [dummy, 0, 0, 0, 0, dummy, dummy, 0, 0, 0, 0, dummy, dummy, dummy, dummy, dummy, 0], flags
    s = block.tensors
    if fmt in (FMT_UNIFORM, FMT_NUQ):
        data = s["codes"]
    elif fmt == FMT_FP8:
        data = s["dense"].view(torch.uint8)  # the same bytes, read through the fp8 table
    else:
        data = s["dense"]
    scale = zero = dummy
    sc_strides = [0, 0, 0, 0]
    lut = dummy
    if fmt == FMT_FP8:
        scale = p.fp8_scale.float().reshape(-1).to(device)
        flags["SMODE"] = SC_HEAD
        sc_strides = [0, 1 if scale.numel() > 1 else 0, 0, 0]
        lut = fp8_lut(p.fp8_dtype, device)
    elif fmt in (FMT_UNIFORM, FMT_NUQ):
        if p.axis == "token":
            scale, zero = s["scale"], s["zero"]
            flags["SMODE"] = SC_TOKEN
            sc_strides = _strides4(scale)
        elif p.format == "uniform":
            scale, zero = s["scale"], s["zero"]
            flags["SMODE"], flags["GROUP"] = SC_GROUP, p.group_size
            sc_strides = _strides4(scale)
        else:
            scale, zero = p.range.float().contiguous(), p.zero.float().contiguous()
            flags["SMODE"] = SC_STATIC
            sc_strides = [0, scale.stride(0), 0, scale.stride(1)]
        if scale.stride() != zero.stride():
            raise ValueError(f"scale and zero must share a layout, got strides {scale.stride()} and {zero.stride()}")
        if fmt == FMT_NUQ:
            lut = p.codebook.float().contiguous().to(device)
    outl = [dummy, dummy, dummy, dummy, 0]
    if "outlier_count" in s and s["outlier_value"].numel():
        counts = s["outlier_count"].reshape(-1).to(torch.int32)          # [T * B], row t * B + b
        offsets = (torch.cumsum(counts, 0) - counts).to(torch.int32)     # exclusive prefix sum: host metadata
        outl = [counts.contiguous(), offsets.contiguous(), s["outlier_index"], s["outlier_value"], int(counts.max())]
        flags["OUTL"] = True
    args = [data, *_strides4(data), scale, zero, *sc_strides, lut, *outl]
    return args, flags


def _rows_args(pair: tuple[torch.Tensor, torch.Tensor] | None, device) -> list:
    if pair is None:
        dummy = torch.zeros(1, dtype=torch.float16, device=device)
        return [dummy, 0, 0, 0, 0, dummy, 0, 0, 0, 0, 0]
    k, v = pair
    return [k, *_strides4(k), v, *_strides4(v), k.shape[2]]


def _n_splits(n_tiles: int, programs: int, device) -> int:
    if n_tiles <= 1:
        return 1
    if device.type == "cuda":  # enough programs to fill the machine twice over
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_tiles, -(-2 * sms // programs)))
    return 2  # the interpreter runs programs one by one: two splits exercise the merge at no extra cost


@dataclass
class DecodeLaunch:
    """Everything a decode step launches with: the stored tensors, the host metadata derived from them once
    (outlier row offsets, split sizes) and the output buffers. A runtime keeps this across steps; `run` only
    launches the two kernels."""
    grid: tuple[int, int]
    args: list
    meta: dict
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # [B*H_q, S, D], [B*H_q, S], [B*H_q, S]
    out: torch.Tensor                                            # [B, H_q, D] float32


def prepare(inp: DecodeInputs, block_t: int = 32, n_splits: int | None = None, device: torch.device | str | None = None,
            use_dot: bool | None = None) -> DecodeLaunch:
    """Validate the inputs and lay out the kernel arguments on `device` (default: the GPU when there is one).
    Inputs on another device are copied there as stored (packed codes, fp16 rows), never decoded on the host."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    inp = inputs_to(inp, device)
    b, h_q, d = inp.q.shape
    h_kv = inp.n_kv_heads
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the kernel, got {d}")
    if h_q % h_kv:
        raise ValueError(f"n_q_heads={h_q} must be a multiple of n_kv_heads={h_kv}")
    if inp.key_rope not in ("pre", "post"):
        raise ValueError(f"key_rope must be 'pre' or 'post', got {inp.key_rope!r}")
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {block_t}")
    group = h_q // h_kv
    use_dot = (d // 2 >= 16 and block_t >= 16) if use_dot is None else use_dot
    block_g = max(16 if use_dot else 1, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
    n_q = inp.k_block.shape[2] if inp.k_block is not None else 0
    k_start = inp.k_block.start if inp.k_block is not None else 0
    n_tiles = -(-n_q // block_t)
    split = n_splits or _n_splits(n_tiles, b * h_kv, device)
    chunk = max(1, -(-n_tiles // split)) * block_t
    split = max(1, -(-n_q // chunk))
    k_args, kf = _side_args(inp.k_block, inp.key_policy, b, device)
    v_args, vf = _side_args(inp.v_block, inp.value_policy, b, device)
    rotary = inp.rotary
    inv_freq = rotary.inv_freq.float().to(device).contiguous()
    rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
    if inv_freq.numel() != d // 2:
        raise ValueError(f"rotary inv_freq has {inv_freq.numel()} entries, head_dim {d} needs {d // 2}")
    if inp.smooth is not None and inp.key_rope == "pre" and n_q > 0:
        half = d // 2
        if not torch.equal(inp.smooth[:, :half], inp.smooth[:, half:]):
            raise ValueError("smoothing lambda must be equal on the two channels of each RoPE pair (i, i + D/2) "
                             "for pre-RoPE keys: folding it into q commutes with the rotation only then")
    lam = inp.smooth.float().contiguous() if inp.smooth is not None else inv_freq
    q = inp.q.float().contiguous()
    partials = (torch.empty(b * h_q, split, d, dtype=torch.float32, device=device),
                torch.empty(b * h_q, split, dtype=torch.float32, device=device),
                torch.empty(b * h_q, split, dtype=torch.float32, device=device))
    args = [q, lam, inv_freq, rope_scale, inp.scaling * LOG2E, k_start, n_q, chunk, b, h_kv,
            *_rows_args(inp.sink, device), *_rows_args(inp.recent, device), *k_args, *v_args, *partials, split]
    meta = dict(G=group, BLOCK_G=block_g, D=d, BLOCK_T=block_t, USE_DOT=use_dot,
                ROPE=inp.key_rope == "pre" and n_q > 0, SMOOTH=inp.smooth is not None,
                K_FMT=kf["FMT"], K_BITS=kf["BITS"], K_SMODE=kf["SMODE"], K_GROUP=kf["GROUP"], K_OUTL=kf["OUTL"],
                V_FMT=vf["FMT"], V_BITS=vf["BITS"], V_SMODE=vf["SMODE"], V_GROUP=vf["GROUP"], V_OUTL=vf["OUTL"])
    out = torch.empty(b, h_q, d, dtype=torch.float32, device=device)
    return DecodeLaunch((b * h_kv, split), args, meta, partials, out)


def run(launch: DecodeLaunch) -> torch.Tensor:
    """Launch the partial-attention kernel over (sequence x kv head, split), then the merge. -> [B, H_q, D]"""
    _decode_partial_kernel[launch.grid](*launch.args, **launch.meta, num_warps=4)
    split = launch.grid[1]
    _combine_kernel[(launch.out.shape[0] * launch.out.shape[1],)](
        *launch.partials, launch.out, split, S_P2=triton.next_power_of_2(split), D=launch.meta["D"])
    return launch.out


def decode_attention(inp: DecodeInputs, block_t: int = 32, n_splits: int | None = None,
                     device: torch.device | str | None = None, use_dot: bool | None = None) -> torch.Tensor:
    """Decode attention of the new token over the stored cache -> [B, H_q, D] float32 (see prepare). Encoded rows
    stored in pages (exporters.layout.PagedBlock, what the serving cache holds) are read where they lie: one
    launch of the partial kernel per page, the full-precision rows with the first, and one merge of all their
    splits -- the pages are more splits of the same reduction, and no page is copied or joined."""
    pages = list(zip(pages_of(inp.k_block), pages_of(inp.v_block)))
    if len(pages) <= 1:
        if pages:
            inp = replace(inp, k_block=pages[0][0], v_block=pages[0][1])
        return run(prepare(inp, block_t=block_t, n_splits=n_splits, device=device, use_dot=use_dot))
    launches = [prepare(replace(inp, k_block=k, v_block=v, sink=inp.sink if i == 0 else None,
                                recent=inp.recent if i == 0 else None),
                        block_t=block_t, n_splits=n_splits, device=device, use_dot=use_dot)
                for i, (k, v) in enumerate(pages)]
    for launch in launches:
        _decode_partial_kernel[launch.grid](*launch.args, **launch.meta, num_warps=4)
    po, pm, pl = (torch.cat([launch.partials[j] for launch in launches], 1).contiguous() for j in range(3))
    out = launches[0].out
    split = pm.shape[1]
    _combine_kernel[(out.shape[0] * out.shape[1],)](po, pm, pl, out, split, S_P2=triton.next_power_of_2(split),
                                                   D=launches[0].meta["D"])
    return out
