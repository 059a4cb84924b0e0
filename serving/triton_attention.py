"""Fused decode attention over the exported cache (one new query token per sequence), in Triton.

The kernel reads the cache in its stored layout (exporters/layout.py, docs/manifest.md) and never builds a
dequantized copy: per tile of BLOCK_T rows it unpacks the b-bit codes from the packed bytes (code j occupies
bits [j*b, (j+1)*b) of its row, so for b=3 a code may straddle two bytes), maps them through the codebook
(nuq) or code * scale + zero (uniform, per token or per channel group), or fp8 bytes through a 256-entry table
of their values times the per-tensor / per-head scale, overwrites sparse outliers (per token row, from an
exclusive prefix sum of the row counts made on the device), multiplies keys by the SmoothAttention lambda and
rotates pre-RoPE keys at their positions (rotate-half pairs, angle = position * inv_freq of the model's rotary
module), in the oracle's order. Sink and residual rows are read as stored (fp16). Softmax is online in float32
(base 2, scaling * log2(e) folded into q), flash-decoding style: programs (sequence, kv head, item) each reduce a
run of rows of one page for all query heads of their GQA group, and a second kernel merges the items.
Rotated values (serving/inputs.py): item 0 then reads the fp16 rows alone, the merge keeps its value sum apart
from the other items' (SPLIT), and the encoded part is un-rotated once per query head after the merge.

The cache's pages (exporters.layout.PagedBlock) are read where they lie, all in one launch: an int64 page table
gives each page's tensors (element addresses, relative to the first page's, whose tensors are the pointer
arguments) and strides, and a table of work items (page, first row, end row) is the launch's second grid axis.
A page is laid out once (serving/pages.py `laid_out`: its outlier row offsets, its table row) and kept while the page lives, so a
decode step costs one small host-to-device copy of the tables and two launches, with no device-to-host read.
Offsets into the stored rows are 64-bit (strides from the int64 table), so a page of B*H*T*D >= 2^31 elements is
read correctly; key positions past the exact range of the RoPE range reduction are refused (`refusal`).

Format and scale layout are constexpr flags, so one kernel body serves every recipe. On a machine without a
GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported).
"""
from __future__ import annotations

import contextlib
import math
import os
import weakref
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # must precede `import triton`: @triton.jit reads it when the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from exporters.codec import TensorPolicy  # noqa: E402
from exporters.layout import pages_of  # noqa: E402
from serving.inputs import DecodeInputs, finish, inputs_to, value_unrotation  # noqa: E402
from serving import pages  # noqa: E402
from serving.pages import FMT_NUQ, N_PAGE, N_SIDE, SC_HEAD, SC_STATIC, fp8_lut, side_flags  # noqa: E402

LOG2E = 1.4426950408889634

# Cody-Waite reduction of RoPE angles to [-pi, pi] before cos/sin (angles reach ~1e5 rad at 128k positions, where
# a GPU's fast cos/sin lose accuracy): 2*pi = C1 + C2 + C3, C1 and C2 with 8 significant bits so n * C1 and
# n * C2 are exact in float32 for n < 2^16 turns (positions up to ~411k at inv_freq 1): ROPE_TURNS, past which
# the kernel refuses (max_rope_position).
ROPE_TURNS = 2 ** 16 - 1
_C1 = 6.28125
_C2 = round((2 * math.pi - _C1) * 2 ** 17) / 2 ** 17
_C3 = 2 * math.pi - _C1 - _C2
TWO_PI_C1, TWO_PI_C2, TWO_PI_C3 = tl.constexpr(_C1), tl.constexpr(_C2), tl.constexpr(_C3)
INV_TWO_PI = tl.constexpr(1 / (2 * math.pi))

# The page table (one int64 row per page: its position, rows, and K's and V's fields) is serving/pages.py's,
# shared with the CPU kernel (serving/cpu_attention.py).
SIDE_FIELDS, PAGE_FIELDS = tl.constexpr(N_SIDE), tl.constexpr(N_PAGE)


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
def _at(BASE, PS, PS0, f: tl.constexpr):
    """The page's tensor of side field f: BASE (the first page's) moved by the difference of their addresses."""
    return BASE + (tl.load(PS + f) - tl.load(PS0 + f))


@triton.jit
def _dequant(DATA, SCALE, ZERO, LUT, OCNT, OOFF, OIDX, OVAL, PS, PS0, n_batch,
             b, h, rows, row_ok, ch,
             FMT: tl.constexpr, BITS: tl.constexpr, SMODE: tl.constexpr, GROUP: tl.constexpr,
             D: tl.constexpr, OUTLIERS: tl.constexpr):
    """Stored rows `rows` [BT] (page-relative) of sequence b, kv head h, channels `ch` [W] -> [BT, W] float32, of the
    page whose side fields start at PS (PS0: the first page's). Offsets are int64: the strides are the table's."""
    d_b, d_h, d_t, d_c = tl.load(PS + 1), tl.load(PS + 2), tl.load(PS + 3), tl.load(PS + 4)
    base = _at(DATA, PS, PS0, 0) + b * d_b + h * d_h + rows[:, None] * d_t
    ok = row_ok[:, None] & (ch[None, :] < D)
    if FMT == 0:  # FMT_FP16
        x = tl.load(base + ch[None, :] * d_c, mask=ok, other=0.0).to(tl.float32)
    elif FMT == 1:  # FMT_FP8: value table of the byte, times the head's scale
        byte = tl.load(base + ch[None, :] * d_c, mask=ok, other=0).to(tl.int32)
        x = tl.load(LUT + byte) * tl.load(SCALE + h).to(tl.float32)
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
            off = b * tl.load(PS + 7) + h * tl.load(PS + 8) + rows * tl.load(PS + 9)
            scale = tl.load(_at(SCALE, PS, PS0, 5) + off, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            zero = tl.load(_at(ZERO, PS, PS0, 6) + off, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        elif SMODE == 2:  # SC_GROUP: rows [g*GROUP, (g+1)*GROUP) share a scale per channel
            off = (b * tl.load(PS + 7) + h * tl.load(PS + 8) + (rows // GROUP)[:, None] * tl.load(PS + 9)
                   + ch[None, :] * tl.load(PS + 10))
            scale = tl.load(_at(SCALE, PS, PS0, 5) + off, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(_at(ZERO, PS, PS0, 6) + off, mask=ok, other=0.0).to(tl.float32)
        else:  # SC_STATIC: calibrated per (head, channel), [H, D] contiguous
            off = h * D + ch
            scale = tl.load(SCALE + off).to(tl.float32)[None, :]
            zero = tl.load(ZERO + off).to(tl.float32)[None, :]
        x = level * scale + zero
    if OUTLIERS:
        # token row t of sequence b is outlier row t * B + b; its entries hold h' * D + d within the row
        orow = rows * n_batch + b
        count = tl.load(_at(OCNT, PS, PS0, 11) + orow, mask=row_ok, other=0).to(tl.int32)
        first = tl.load(_at(OOFF, PS, PS0, 12) + orow, mask=row_ok, other=0)
        idx_at = _at(OIDX, PS, PS0, 13) + first
        val_at = _at(OVAL, PS, PS0, 14) + first
        target = h * D + ch
        for j in range(0, _rowmax(count, 0)):  # the tile's longest outlier list: no bound from the host
            has = row_ok & (j < count)
            idx = tl.load(idx_at + j, mask=has, other=-1).to(tl.int32)
            val = tl.load(val_at + j, mask=has, other=0.0).to(tl.float32)
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
        Q, LAM, INV_FREQ, rope_scale, qk_scale, n_batch, n_kv,
        SK, sk_b, sk_h, sk_t, sk_c, SV, sv_b, sv_h, sv_t, sv_c, n_sink,
        RK, rk_b, rk_h, rk_t, rk_c, RV, rv_b, rv_h, rv_t, rv_c, n_rec,
        PAGES, ITEMS, n_items,
        KD, KS, KZ, KLUT, KOC, KOO, KOI, KOV,
        VD, VS, VZ, VLUT, VOC, VOO, VOI, VOV,
        PO, PM, PL,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, USE_DOT: tl.constexpr,
        ROPE: tl.constexpr, SMOOTH: tl.constexpr,
        K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_SMODE: tl.constexpr, K_GROUP: tl.constexpr,
        K_OUTL: tl.constexpr,
        V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_SMODE: tl.constexpr, V_GROUP: tl.constexpr,
        V_OUTL: tl.constexpr):
    pid = tl.program_id(0)
    item = tl.program_id(1)
    b = (pid // n_kv).to(tl.int64)
    h = (pid % n_kv).to(tl.int64)
    HALF: tl.constexpr = D // 2
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    lo = tl.arange(0, HALF)
    hi = lo + HALF
    dd = tl.arange(0, D)
    q_row = Q + (pid * G + g)[:, None] * D                       # q: [B, H_q, D] contiguous; head = h * G + g
    q_lo = tl.load(q_row + lo[None, :], mask=g_ok[:, None], other=0.0) * qk_scale
    q_hi = tl.load(q_row + hi[None, :], mask=g_ok[:, None], other=0.0) * qk_scale

    m = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: an empty item must not produce inf - inf
    l = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, D], 0.0, tl.float32)

    # item 0 also reads the full-precision rows (sinks, residual window)
    first = item == 0
    m, l, acc = _fp16_rows(m, l, acc, SK, sk_b, sk_h, sk_t, sk_c, SV, sv_b, sv_h, sv_t, sv_c,
                           tl.where(first, n_sink, 0), b, h, q_lo, q_hi, lo, hi, dd, BLOCK_T, USE_DOT)
    m, l, acc = _fp16_rows(m, l, acc, RK, rk_b, rk_h, rk_t, rk_c, RV, rv_b, rv_h, rv_t, rv_c,
                           tl.where(first, n_rec, 0), b, h, q_lo, q_hi, lo, hi, dd, BLOCK_T, USE_DOT)

    # encoded rows: the item's run [t_begin, t_end) of one page; the block stores K / lambda
    if SMOOTH:
        lam_lo = tl.load(LAM + h * D + lo)
        lam_hi = tl.load(LAM + h * D + hi)
    if ROPE:
        inv_lo = tl.load(INV_FREQ + lo)
    page = tl.load(ITEMS + item * 3)
    t_begin = tl.load(ITEMS + item * 3 + 1).to(tl.int32)
    t_end = tl.load(ITEMS + item * 3 + 2).to(tl.int32)
    k_start = tl.load(PAGES + page * PAGE_FIELDS)                # position of the page's first row
    PK0 = PAGES + 2
    PV0 = PK0 + SIDE_FIELDS
    PK = PK0 + page * PAGE_FIELDS
    PV = PV0 + page * PAGE_FIELDS
    for t0 in range(t_begin, t_end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        ok = rows < t_end
        k_lo = _dequant(KD, KS, KZ, KLUT, KOC, KOO, KOI, KOV, PK, PK0, n_batch, b, h, rows, ok, lo,
                        K_FMT, K_BITS, K_SMODE, K_GROUP, D, K_OUTL)
        k_hi = _dequant(KD, KS, KZ, KLUT, KOC, KOO, KOI, KOV, PK, PK0, n_batch, b, h, rows, ok, hi,
                        K_FMT, K_BITS, K_SMODE, K_GROUP, D, K_OUTL)
        if SMOOTH:
            k_lo = k_lo * lam_lo[None, :]
            k_hi = k_hi * lam_hi[None, :]
        if ROPE:
            pos = (k_start + rows).to(tl.float32)
            cos, sin = _cos_sin(pos[:, None] * inv_lo[None, :])
            cos = cos * rope_scale
            sin = sin * rope_scale
            k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
        v = _dequant(VD, VS, VZ, VLUT, VOC, VOO, VOI, VOV, PV, PV0, n_batch, b, h, rows, ok, dd,
                     V_FMT, V_BITS, V_SMODE, V_GROUP, D, V_OUTL)
        m, l, acc = _online_softmax(m, l, acc, _scores(q_lo, q_hi, k_lo, k_hi, USE_DOT), ok, v, USE_DOT)

    out = (pid * G + g).to(tl.int64) * n_items + item            # partials: [B * H_q, n_items]
    tl.store(PM + out, m, mask=g_ok)
    tl.store(PL + out, l, mask=g_ok)
    tl.store(PO + out[:, None] * D + dd[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _combine_kernel(PO, PM, PL, OUT, OUT_FP, n_split, S_BLOCK: tl.constexpr, D: tl.constexpr,
                    SPLIT: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for one (sequence, query head), over its n_split
    partials S_BLOCK at a time (the running max rescales what is summed, as in the partial kernel). SPLIT 1: partial
    0 (the fp16 rows alone) is summed into OUT_FP, the others into OUT, both over the same sum; 0: all into OUT."""
    row = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, D)
    s = tl.arange(0, S_BLOCK)
    ok = s < n_split
    m = tl.load(PM + row * n_split + s, mask=ok, other=float("-inf"))
    big_m = _rowmax(m, 0)
    w = tl.exp2(m - big_m)
    big_l = _sum(w * tl.load(PL + row * n_split + s, mask=ok, other=0.0), 0)
    part = w[:, None] * tl.load(PO + (row * n_split + s)[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
    fp = s < SPLIT                                               # the partials of the fp16 rows alone
    big_acc = _sum(tl.where(fp[:, None], 0.0, part), 0)
    big_fp = _sum(tl.where(fp[:, None], part, 0.0), 0)
    for s0 in range(S_BLOCK, n_split, S_BLOCK):
        ok = s0 + s < n_split
        at = row * n_split + s0 + s
        m = tl.load(PM + at, mask=ok, other=float("-inf"))
        m_new = tl.maximum(big_m, _rowmax(m, 0))
        alpha = tl.exp2(big_m - m_new)
        w = tl.exp2(m - m_new)
        big_l = big_l * alpha + _sum(w * tl.load(PL + at, mask=ok, other=0.0), 0)
        big_acc = big_acc * alpha + _sum(w[:, None] * tl.load(PO + at[:, None] * D + dd[None, :], mask=ok[:, None],
                                                               other=0.0), 0)
        big_fp = big_fp * alpha
        big_m = m_new
    tl.store(OUT + row * D + dd, big_acc / big_l)
    if SPLIT:
        tl.store(OUT_FP + row * D + dd, big_fp / big_l)


# ---- host side ----------------------------------------------------------------------------------------------

_DUMMIES: dict[str, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """A placeholder pointer for arguments a launch never reads."""
    if str(device) not in _DUMMIES:
        _DUMMIES[str(device)] = torch.zeros(1, dtype=torch.float32, device=device)
    return _DUMMIES[str(device)]


def _on_device(device: torch.device):
    """The guard a launch runs under: Triton launches on the current CUDA device, which need not be the one its
    tensors are on (a model split over GPUs, a layer on cuda:1)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ---- what the kernel reads exactly

def max_rope_position(max_inv_freq: float) -> int:
    """The last key position whose RoPE angle the kernel reduces exactly: ROPE_TURNS turns of the fastest
    frequency (411768 at inv_freq 1, whatever the base)."""
    return math.floor(ROPE_TURNS * 2 * math.pi / max_inv_freq)


_INV_FREQ_MAX: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _max_inv_freq(rotary: torch.nn.Module) -> float:
    """The rotary module's largest inv_freq, read once per module (again when inv_freq changes): on a GPU the read
    is a host sync."""
    f = rotary.inv_freq
    key = (f.data_ptr(), f._version)
    held = _INV_FREQ_MAX.get(rotary)
    if held is None or held[0] != key:
        held = _INV_FREQ_MAX[rotary] = (key, float(f.float().abs().max()))
    return held[1]


def refusal(inp: DecodeInputs) -> str | None:
    """Why the kernel cannot read these inputs exactly, or None when it can: head_dim must be a power of two (its
    tiles), and pre-RoPE keys must lie within the exact range of its RoPE range reduction (max_rope_position). The
    block-wise torch path (serving/blockwise.py) reads both."""
    d = inp.head_dim
    if d < 2 or d & (d - 1):
        return f"head_dim must be a power of two for the kernel, got {d}"
    pages = pages_of(inp.k_block)
    if inp.key_rope == "pre" and pages:
        last = pages[-1].start + pages[-1].shape[2] - 1
        fastest = _max_inv_freq(inp.rotary)
        limit = max_rope_position(fastest) if fastest > 0 else last
        if last > limit:
            return (f"key position {last} is past the kernel's exact RoPE range: positions 0..{limit} "
                    f"({ROPE_TURNS} turns of the fastest frequency, inv_freq {fastest:g}); the block-wise torch "
                    f"attention (serving/blockwise.py) reads them")
    return None


def _side_pointers(first: pages.PageSide | None, p: TensorPolicy, flags: dict, n_kv: int, device) -> list:
    """The pointer arguments of one side: the first page's tensors (the base the page table's addresses are relative
    to), the policy's static scales (fp8 per head, nuq per channel) and value table."""
    dummy = _dummy(device)
    data, scale, zero, counts, offsets, index, value = first.tensors if first is not None else (None,) * 7
    lut = None
    if flags["SMODE"] == SC_HEAD:
        scale = p.fp8_scale.float().reshape(-1)
        scale = scale.expand(n_kv).contiguous() if scale.numel() == 1 else scale   # one per kv head
        lut = fp8_lut(p.fp8_dtype, device)
    elif flags["SMODE"] == SC_STATIC:
        scale, zero = p.range.float().contiguous(), p.zero.float().contiguous()
    if flags["FMT"] == FMT_NUQ:
        lut = p.codebook.float().contiguous()
    return [dummy if t is None else t for t in (data, scale, zero, lut, counts, offsets, index, value)]


def _items(rows: list[int], block_t: int, target: int, split: bool = False) -> list[int]:
    """Work items, flat (page, first row, end row): each page's rows cut into runs of whole tiles, about `target`
    runs in all; one empty item when no row is encoded (item 0 also reads the full-precision rows). split: an empty
    item first, so that item 0 reads the full-precision rows alone (rotated values: their sum is kept apart)."""
    tiles = sum(-(-n // block_t) for n in rows)
    chunk = max(1, -(-tiles // target)) * block_t
    items = [x for i, n in enumerate(rows) for a in range(0, n, chunk) for x in (i, a, min(a + chunk, n))]
    return [0, 0, 0] + items if split else items or [0, 0, 0]


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints -> int64 on `device`; on a GPU from pinned memory, asynchronously (no host sync)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _rows_args(pair: tuple[torch.Tensor, torch.Tensor] | None, device) -> list:
    if pair is None:
        dummy = _dummy(device)
        return [dummy, 0, 0, 0, 0, dummy, 0, 0, 0, 0, 0]
    k, v = pair
    return [k, *pages.strides4(k), v, *pages.strides4(v), k.shape[2]]


def _n_splits(n_tiles: int, programs: int, device) -> int:
    if n_tiles <= 1:
        return 1
    if device.type == "cuda":  # enough programs to fill the machine twice over
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_tiles, -(-2 * sms // programs)))
    return 2  # the interpreter runs programs one by one: two splits exercise the merge at no extra cost


def _resolve(device, inp: DecodeInputs) -> torch.device:
    """The launch's device: as given, else the query's GPU, else the current GPU, else the CPU (interpreter); a
    bare "cuda" is the current device, so that inputs already there are not moved."""
    if device is None:
        device = inp.q.device if inp.q.is_cuda else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _is_on(inp: DecodeInputs, device: torch.device) -> bool:
    held = [inp.q, *(x for pair in (inp.sink, inp.recent) if pair is not None for x in pair)]
    held += [next(iter(pg.tensors.values())) for pg in (*pages_of(inp.k_block)[:1], *pages_of(inp.v_block)[:1])]
    held += [*inp.key_policy.calibrated().values(), *inp.value_policy.calibrated().values()]
    held += [] if inp.smooth is None else [inp.smooth]
    return all(t.device == device for t in held)


@dataclass
class DecodeLaunch:
    """Everything one decode step launches with: the page and item tables, the pointer and scalar arguments and the
    output buffers. What is costly to derive is made once per page and kept across steps (pages.laid_out), so building
    a launch per step is host bookkeeping and one small copy; `run` only launches the two kernels. `keep` holds
    what the tables address by number (the pages' tensors, the uploaded tables) for as long as the launch lives."""
    grid: tuple[int, int]
    args: list
    meta: dict
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # [B*H_q, n_items, D], [B*H_q, n_items] x2
    out: torch.Tensor                                            # [B, H_q, D] float32 (rotated values: the
                                                                 # encoded rows' part, in the rotated basis)
    keep: tuple = ()
    out_fp: torch.Tensor | None = None     # rotated values: [B, H_q, D] the fp16 rows' part (else None)
    unrotate: torch.Tensor | None = None   # rotated values: [D, D] (serving.inputs.value_unrotation)


def prepare(inp: DecodeInputs, block_t: int = 32, n_splits: int | None = None, device: torch.device | str | None = None,
            use_dot: bool | None = None) -> DecodeLaunch:
    """Validate the inputs and lay out the kernel arguments on `device` (default: the query's GPU, or the GPU when
    there is one). Inputs on another device are copied there as stored (packed codes, fp16 rows), never decoded on
    the host. Encoded rows in pages (exporters.layout.PagedBlock, what the serving cache holds) are read where they
    lie, all pages in one launch: each page is laid out once for as long as it lives (pages.laid_out), and a step
    uploads only the page table (each page's row) and the work items. n_splits: about how many runs of rows the
    encoded rows are cut into in all (default: enough programs to fill the GPU twice; 2 in the interpreter)."""
    device = _resolve(device, inp)
    if not _is_on(inp, device):
        inp = inputs_to(inp, device)
    b, h_q, d = inp.q.shape
    h_kv = inp.n_kv_heads
    if h_q % h_kv:
        raise ValueError(f"n_q_heads={h_q} must be a multiple of n_kv_heads={h_kv}")
    if inp.key_rope not in ("pre", "post"):
        raise ValueError(f"key_rope must be 'pre' or 'post', got {inp.key_rope!r}")
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {block_t}")
    why = refusal(inp)
    if why is not None:
        raise ValueError(why)
    group = h_q // h_kv
    use_dot = (d // 2 >= 16 and block_t >= 16) if use_dot is None else use_dot
    block_g = max(16 if use_dot else 1, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
    k_pages, v_pages = pages_of(inp.k_block), pages_of(inp.v_block)
    if len(k_pages) != len(v_pages):
        raise ValueError(f"keys are stored in {len(k_pages)} pages, values in {len(v_pages)}: K and V pages must "
                         f"cover the same rows")
    kf, vf = side_flags(inp.key_policy), side_flags(inp.value_policy)
    table, rows, sides = [], [], []
    for kb, vb in zip(k_pages, v_pages):
        if kb.shape[2] != vb.shape[2]:  # positions are the keys' (RoPE): a value page's start is not read
            raise ValueError(f"K and V pages must hold the same rows: a key page at {kb.start} holds {kb.shape[2]} "
                             f"rows, its value page at {vb.start} {vb.shape[2]}")
        ks, vs = pages.laid_out(kb, inp.key_policy, kf["SMODE"]), pages.laid_out(vb, inp.value_policy, vf["SMODE"])
        table += [kb.start, kb.shape[2], *ks.fields, *vs.fields]
        rows.append(kb.shape[2])
        sides.append((ks, vs))
    if len({(k.outliers, v.outliers) for k, v in sides}) > 1:
        raise ValueError("every page of a side must store sparse outliers, or none")
    n_q = sum(rows)
    tiles = sum(-(-n // block_t) for n in rows)
    unrotate = value_unrotation(inp.value_policy, d, device)
    items = _items(rows, block_t, n_splits or _n_splits(tiles, b * h_kv, device), split=unrotate is not None)
    table = table or [0] * N_PAGE
    tables = _upload(table + items, device)
    n_items = len(items) // 3
    first = sides[0] if sides else (None, None)
    rotary = inp.rotary
    inv_freq = rotary.inv_freq.float().to(device).contiguous()
    rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
    if inv_freq.numel() != d // 2:
        raise ValueError(f"rotary inv_freq has {inv_freq.numel()} entries, head_dim {d} needs {d // 2}")
    lam = inp.smooth.float().contiguous() if inp.smooth is not None else inv_freq
    q = inp.q.float().contiguous()
    partials = (torch.empty(b * h_q, n_items, d, dtype=torch.float32, device=device),
                torch.empty(b * h_q, n_items, dtype=torch.float32, device=device),
                torch.empty(b * h_q, n_items, dtype=torch.float32, device=device))
    args = [q, lam, inv_freq, rope_scale, inp.scaling * LOG2E, b, h_kv,
            *_rows_args(inp.sink, device), *_rows_args(inp.recent, device),
            tables[:len(table)], tables[len(table):], n_items,
            *_side_pointers(first[0], inp.key_policy, kf, h_kv, device),
            *_side_pointers(first[1], inp.value_policy, vf, h_kv, device), *partials]
    meta = dict(G=group, BLOCK_G=block_g, D=d, BLOCK_T=block_t, USE_DOT=use_dot,
                ROPE=inp.key_rope == "pre" and n_q > 0, SMOOTH=inp.smooth is not None,
                K_FMT=kf["FMT"], K_BITS=kf["BITS"], K_SMODE=kf["SMODE"], K_GROUP=kf["GROUP"],
                K_OUTL=first[0] is not None and first[0].outliers,
                V_FMT=vf["FMT"], V_BITS=vf["BITS"], V_SMODE=vf["SMODE"], V_GROUP=vf["GROUP"],
                V_OUTL=first[1] is not None and first[1].outliers)
    out = torch.empty(b, h_q, d, dtype=torch.float32, device=device)
    out_fp = None if unrotate is None else torch.empty_like(out)
    return DecodeLaunch((b * h_kv, n_items), args, meta, partials, out, keep=(tables, sides), out_fp=out_fp,
                        unrotate=unrotate)


def run(launch: DecodeLaunch) -> torch.Tensor:
    """Launch the partial-attention kernel over (sequence x kv head, work item), then the merge, on the device of
    the launch's tensors (rotated values: then the un-rotation of the encoded part, serving.inputs.finish).
    -> [B, H_q, D]"""
    n_items = launch.grid[1]
    split = launch.unrotate is not None
    with _on_device(launch.out.device):
        _decode_partial_kernel[launch.grid](*launch.args, **launch.meta, num_warps=4)
        _combine_kernel[(launch.out.shape[0] * launch.out.shape[1],)](
            *launch.partials, launch.out, launch.out_fp if split else launch.out, n_items,
            S_BLOCK=min(64, triton.next_power_of_2(n_items)), D=launch.meta["D"], SPLIT=int(split))
        if split:
            return finish(launch.out_fp, launch.out, launch.unrotate)
    return launch.out


def decode_attention(inp: DecodeInputs, block_t: int = 32, n_splits: int | None = None,
                     device: torch.device | str | None = None, use_dot: bool | None = None) -> torch.Tensor:
    """Decode attention of the new token over the stored cache -> [B, H_q, D] float32 (see prepare: every page in
    one launch, the full-precision rows with the first item, one merge of all the items)."""
    return run(prepare(inp, block_t=block_t, n_splits=n_splits, device=device, use_dot=use_dot))
