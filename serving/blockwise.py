"""Attention over the stored cache, one block of positions at a time: no full-precision copy of the history.

For one layer (the stored form of serving/cache.py, viewed as serving.inputs.DecodeInputs) and queries
[B, H_q, T_q, D], the cached rows are read in position order -- fp16 sink rows, the encoded pages, fp16
residual rows -- in blocks of at most `block` positions that never cross a page. A block of encoded rows is its
page as stored, or cut from the page's bytes with exporters.layout.slice_rows (its slice of the packed codes,
of the scales / zero-points and, from the prefix sum of the per-row counts, of the sparse outliers), and decoded
exactly as the whole would be (_Reader: 2/4/8-bit nuq codes through a table of every byte's levels, bit-exact
with exporters.codec.decode; other formats through exporters.layout.load + exporters.codec.decode), keys
multiplied by the SmoothAttention lambda and, for pre-RoPE keys, rotated at their stored positions with the
model's own rotary module (float32 tables, as the oracle). Each block's scores (scaling, GQA: query head j reads kv head
j // (H_q / H_kv), the additive / boolean mask's columns or the causal rule: a query at position p sees rows at
positions <= p) are merged with the online-softmax rule in float32 -- running max m, running sum l, accumulator
rescaled by exp(m_old - m_new) -- the algorithm of the Triton kernel (serving/triton_attention.py), in
torch, on whatever device the inputs are on.

Working set per block: the decoded K and V [B, H_kv, n, D] (n <= block; per-channel groups round the block to a
multiple of the group size) and the scores [B, H_q, T_q, n], beside the stored form itself and the
[B, H_q, T_q, D] accumulator; never a [B, H, T, D] decoded copy.

Serving (`serving`, `layer_attention`): installed through transformers' attention interface
(stages.hooks.attention_override), the attention finds the cache layer by module.layer_idx. A single new token
(T_q == 1) reads exactly what the cache stores, its own row included once stored (so it equals
runtime_check/reference.py's oracle); on CUDA that step is the Triton kernel, the GPU path of the same
function, wherever the kernel reads the inputs exactly (use_kernel; else this torch path). A chunk of T_q > 1
new tokens (prefill) reads the history before it from the stored form and, by default, its own rows in full
precision as engines do (prefill="stored": as stored, what the materializing cache gives); with no mask, each
history block and the own rows go through torch's fused attention -- on CPU its flash kernel, on CUDA its
memory-efficient one -- its log-sum-exp merged by the same online-softmax rule, so a prefill chunk never holds
[T_q, n] scores.
Serving registers stages.hooks.serving_mask: transformers passes None for an unpadded causal batch (the rule
applied by position here), never a [T_q, T_k] mask.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

import torch

from exporters.codec import CachePolicy, decode
from exporters.layout import PAGE, StoredBlock, load, n_outliers, outlier_coordinates, pages_of, slice_rows
from exporters.rope import apply_rope
from exporters.served_rows import flush_unit
from serving.cache import BLOCK, ArtifactCache, ArtifactLayer, cache_kwargs, check_batch, from_layer
from serving.inputs import DecodeInputs
from serving.rope_tables import _repeated_halves, rope_at
from stages.base import InputError

__all__ = ["BLOCK", "attend", "decode_attention", "generate", "layer_attention", "serving", "stored_blocks",
           "use_kernel"]


def _row_step(inp: DecodeInputs, block: int) -> int:
    """Encoded rows per block: `block` rounded down to a multiple of the flush unit (exporters.served_rows: whole
    groups of K and of V, so every slice starts on a group boundary of both), at least one unit."""
    g = flush_unit(inp.key_policy, inp.value_policy)
    return max(g, block // g * g)


class _Reader:
    """Decodes one layer's stored rows, block by block, for one attention call. nuq codes of 2, 4 or 8 bits are
    read straight from their bytes through a table of every byte's levels (pack_codes' order: element j of a byte
    at bits [j*b, (j+1)*b)), built once per call: for per-channel keys each entry already holds
    (level x range + zero) x lambda of its (head, channel) -- the codec's per-element arithmetic, in the same
    order, on the table instead of on every row -- for per-token rows the bare level, scaled per row after.
    Sparse outliers replace their entries afterwards (x lambda for keys), as in exporters.codec.decode; every
    other format goes through exporters.layout.load + exporters.codec.decode. Pre-RoPE keys are then rotated
    at their positions with the model's rotary module's tables (float32)."""

    def __init__(self, inp: DecodeInputs):
        self.inp = inp
        self.halves: bool | None = None  # whether the rotary tables' two halves repeat (see _rotate)
        self.k_table = self._wide(self._table(inp.key_policy, inp.smooth))
        self.v_table = self._wide(self._table(inp.value_policy, None))

    @staticmethod
    def _table(p, smooth) -> torch.Tensor | None:
        if p.format != "nuq" or 8 % p.bits or p.rotation != "none":
            return None
        per = 8 // p.bits
        byte = torch.arange(256, device=p.codebook.device)
        codes = (byte[:, None] >> torch.arange(0, 8, p.bits, device=byte.device)) & ((1 << p.bits) - 1)
        levels = p.codebook.float()[codes]                                     # [256, per]
        if p.axis != "channel":
            return levels
        h, d = p.range.shape
        n_bytes = -(-d // per)
        pad = n_bytes * per - d

        def channels(t):                                                       # [H, D] -> [H, n_bytes, 1, per]
            t = t.float()
            if pad:
                t = torch.cat([t, t.new_zeros(h, pad)], 1)
            return t.view(h, n_bytes, 1, per)

        x = levels[None, None] * channels(p.range) + channels(p.zero)          # [H, n_bytes, 256, per]
        if smooth is not None:
            x = x * channels(smooth)
        return x.reshape(h * n_bytes * 256, per)

    @staticmethod
    def _wide(table: torch.Tensor | None) -> torch.Tensor | None:
        """A table [N, per] float32 viewed as N elements of per x 4 bytes (float64 for per = 2, complex128 for 4),
        so that one index_select moves a byte's `per` levels as one element (about twice as fast on CPU)."""
        if table is None:
            return None
        wide = {1: torch.float32, 2: torch.float64, 4: torch.complex128}[table.shape[1]]
        return table.contiguous().view(wide).view(-1)

    def _decode(self, rows: StoredBlock, p, table, smooth) -> torch.Tensor:
        if table is None:
            x = decode(load(rows, p), p)
            return x if smooth is None else x * smooth.float()[None, :, None, :]
        b, h, n, d = rows.shape
        s = rows.tensors
        packed = s["codes"]                                                    # [B, H, n, n_bytes] uint8
        n_bytes = packed.shape[-1]
        if p.axis == "channel":
            offset = (torch.arange(h * n_bytes, device=packed.device, dtype=torch.int32) * 256).view(h, 1, n_bytes)
            idx = offset + packed                                              # int32
        else:
            idx = packed.to(torch.int32)
        x = table.index_select(0, idx.reshape(-1)).view(torch.float32).view(b, h, n, -1)[..., :d]
        if p.axis != "channel":
            x = x * s["scale"].float() + s["zero"].float()
        elif not x.is_contiguous():
            x = x.contiguous()
        if "outlier_count" in s and s["outlier_value"].numel():
            seq, head, t, ch = outlier_coordinates(rows)
            flat = ((seq * h + head) * n + t) * d + ch                         # x is contiguous [B, H, n, D]
            value = s["outlier_value"].float()
            if smooth is not None:
                value = value * smooth.float()[head, ch]
            x.view(-1).index_put_((flat,), value)
        return x

    def keys(self, rows: StoredBlock) -> torch.Tensor:
        """Stored key rows -> post-RoPE keys [B, H_kv, n, D] float32 (decode, x lambda, RoPE at their positions)."""
        inp = self.inp
        k = self._decode(rows, inp.key_policy, self.k_table, inp.smooth)
        if inp.key_rope == "pre":
            cos, sin = rope_at(inp.rotary, rows.start, rows.shape[2], k.device)
            if self.halves is None:  # decided once per call, on its first block: a property of the rotary module
                self.halves = _repeated_halves(cos, sin)
            k = _rotate(k, cos, sin) if self.halves else apply_rope(k, cos, sin)
        return k

    def values(self, rows: StoredBlock) -> torch.Tensor:
        return self._decode(rows, self.inp.value_policy, self.v_table, None)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """exporters.rope.apply_rope(x [B, H, n, D], cos, sin [n, D]) for tables with repeated halves
    (_repeated_halves), written half by half into one output (x1 cos - x2 sin, x2 cos + x1 sin): the same rotation
    without rotate_half's concatenation and the broadcast products."""
    h = x.shape[-1] // 2
    c, s = cos[:, :h], sin[:, :h]
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.empty_like(x)
    torch.mul(x1, c, out=out[..., :h]).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=out[..., h:]).addcmul_(x1, s)
    return out


def stored_blocks(inp: DecodeInputs, limit: int, block: int = BLOCK
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """The stored rows at positions < limit, decoded one block at a time, in position order ->
    (keys, values [B, H_kv, n, D] float32 post-RoPE, position of the first row). Positions: sink rows 0..S-1, the
    encoded rows from their `start` -- page by page (exporters.layout.PagedBlock; a plain StoredBlock is one
    page), a block never crossing a page, a page no longer than the block read as it is -- residual rows after."""
    pos = inp.start  # 0, or where a sliding layer's rows begin once its oldest left the window
    if inp.sink is not None:
        sk, sv = inp.sink
        n = min(sk.shape[2], max(0, limit - pos))
        for a in range(0, n, block):
            b = min(a + block, n)
            yield sk[:, :, a:b].float(), sv[:, :, a:b].float(), pos + a
        pos += sk.shape[2]
    k_pages, v_pages = pages_of(inp.k_block), pages_of(inp.v_block)
    if len(k_pages) != len(v_pages):
        raise ValueError(f"keys are stored in {len(k_pages)} pages, values in {len(v_pages)}: K and V pages must "
                         f"cover the same rows")
    step = _row_step(inp, block)
    reader = _Reader(inp)
    for kb, vb in zip(k_pages, v_pages):  # each page read where it lies, in blocks that never cross a page
        if kb.start != pos or vb.start != pos or kb.shape[2] != vb.shape[2]:
            raise ValueError(f"stored pages must follow the {pos} rows before them: keys start {kb.start} "
                             f"({kb.shape[2]} rows), values start {vb.start} ({vb.shape[2]} rows)")
        n = min(kb.shape[2], max(0, limit - pos))
        k_off = v_off = 0  # outliers stored in the page's rows before the slice (running prefix sum of the counts)
        for a in range(0, n, step):
            b = min(a + step, n)
            if a == 0 and b == kb.shape[2]:  # the whole page: its tensors as stored
                k_rows, v_rows = kb, vb
            else:
                k_rows = slice_rows(kb, a, b, inp.key_policy, k_off)
                v_rows = slice_rows(vb, a, b, inp.value_policy, v_off)
                k_off, v_off = k_off + n_outliers(k_rows), v_off + n_outliers(v_rows)
            yield reader.keys(k_rows), reader.values(v_rows), pos + a
        pos += kb.shape[2]
    if inp.recent is not None:
        rk, rv = inp.recent
        n = min(rk.shape[2], max(0, limit - pos))
        for a in range(0, n, block):
            b = min(a + block, n)
            yield rk[:, :, a:b].float(), rv[:, :, a:b].float(), pos + a


def _own_blocks(own: tuple[torch.Tensor, torch.Tensor], pos0: int, block: int):
    k, v = own
    for a in range(0, k.shape[2], block):
        yield k[:, :, a:a + block].float(), v[:, :, a:a + block].float(), pos0 + a


def _on_device(inp: DecodeInputs, device: torch.device) -> DecodeInputs:
    """The policies' calibrated tensors (codebook, static zero / range, fp8 scales) and lambda on `device`; the
    stored rows are read where they are."""
    tensors = [*inp.key_policy.calibrated().values(), *inp.value_policy.calibrated().values()]
    if inp.smooth is not None:
        tensors.append(inp.smooth)
    if all(t.device == device for t in tensors):
        return inp
    return replace(inp, key_policy=inp.key_policy.to(device), value_policy=inp.value_policy.to(device),
                   smooth=None if inp.smooth is None else inp.smooth.to(device))


def _fused_op(device: torch.device, head_dim: int):
    """torch's fused attention that also returns the log-sum-exp of each query's scores (what merging a block into
    the online softmax needs) -- op(q, k, v, is_causal=False, scale=None) -> (output, lse, ...) -- or None where
    there is none: on CPU the flash kernel, on CUDA the memory-efficient one (_cuda_fused; head_dim a multiple of
    8, its alignment)."""
    if device.type == "cpu":
        return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if device.type == "cuda" and head_dim % 8 == 0:
        return _cuda_fused
    return None


def _cuda_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's memory-efficient CUDA attention on float32 q [B, H, M, D], k, v [B, H, n, D] (the flash kernel takes
    half precision only) -> output [B, H, M, D] and the natural log-sum-exp [B, H, M] of each query's scaled
    scores, which the kernel pads to a multiple of 32 queries."""
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                    scale=scale)[:2]
    return o, lse[..., :q.shape[-2]]


def _merge(state, o: torch.Tensor, lse: torch.Tensor):
    """Fold a block's normalized output o [..., T_q, D] and log-sum-exp lse [..., T_q] into the running
    (m, l, acc) of the online softmax: the block counts as m_b = lse, l_b = 1, acc_b = o."""
    m, l, acc = state
    m_new = torch.maximum(m, lse)
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
    alpha, beta = torch.exp(m - m_safe), torch.exp(lse - m_safe)
    return m_new, l * alpha + beta, acc * alpha[..., None] + o * beta[..., None]


def attend(inp: DecodeInputs, query: torch.Tensor, scaling: float, limit: int, q_start: int,
           own: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None,
           block: int = BLOCK, stats: dict | None = None, mask_offset: int = 0) -> torch.Tensor:
    """Attention of query [B, H_q, T_q, D] (post-RoPE; query i at position q_start + i) over the stored rows at
    positions < limit and then `own` rows (K, V [B, H_kv, n, D] at positions limit..limit+n-1, read as given).
    mask: None (causal by position) or transformers' [B | 1, 1, T_q, >= limit + n - mask_offset] additive float or
    boolean mask, column j for position mask_offset + j (a sliding layer's mask starts at its window; rows held
    before mask_offset -- the rest of a per-channel group -- are never attended). stats: {"largest_decode_temporary_bytes" (T_q == 1),
    "largest_prefill_temporary_bytes"}, raised to this call's largest working set (decoded K and V of a block,
    its scores and probabilities, the query, running max / sum and accumulator; the codec's transient tensors
    while decoding a block come on top). -> [B, H_q, T_q, D] float32.

    Fused where it applies: a chunk of T_q > 1 queries with no mask (causal by position), on CPU or CUDA
    (_fused_op), has each block of rows wholly before its queries attended by torch's fused attention, which
    returns the block's output and log-sum-exp without holding its [T_q, n] scores, merged by the same rule; its
    own rows (q_start == limit: the rows at the queries' positions) as one causal fused call. The same arithmetic
    up to float rounding (tests/serving/test_blockwise.py); everything else -- single tokens, masks, other
    devices -- the scores of each block in float32, as the Triton kernel."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    b, h_q, t_q, d = query.shape
    device = query.device
    inp = _on_device(inp, device)
    h_kv = inp.n_kv_heads
    if h_q % h_kv:
        raise ValueError(f"n_q_heads={h_q} must be a multiple of n_kv_heads={h_kv}")
    n_own = 0 if own is None else own[0].shape[2]
    if mask is not None and mask.shape[-1] < limit + n_own - mask_offset:
        raise ValueError(f"the mask covers {mask.shape[-1]} key positions from {mask_offset}, the attention reads "
                         f"up to {limit + n_own}")
    g = h_q // h_kv
    op = _fused_op(device, d) if t_q > 1 and mask is None else None
    q = query.float().reshape(b, h_kv, g, t_q, d).contiguous()
    q_pos = torch.arange(q_start, q_start + t_q, device=device)
    m = torch.full((b, h_kv, g, t_q), float("-inf"), device=device)
    l = torch.zeros(b, h_kv, g, t_q, device=device)
    acc = torch.zeros(b, h_kv, g, t_q, d, device=device)
    own_fused = op is not None and own is not None and q_start == limit and n_own == t_q
    blocks = stored_blocks(inp, limit, block)
    if own is not None and not own_fused:
        blocks = _chain(blocks, _own_blocks(own, limit, block))
    largest, seen = 0, False
    for k, v, p0 in blocks:
        seen = True
        n = k.shape[2]
        k, v = k.to(device), v.to(device)
        if op is not None and p0 + n - 1 <= q_start:  # every row before every query: one fused call
            o, lse = op(q.view(b, h_kv, g * t_q, d), k, v, scale=scaling)[:2]
            m, l, acc = _merge((m, l, acc), o.reshape(b, h_kv, g, t_q, d), lse.reshape(b, h_kv, g, t_q))
            largest = max(largest, sum(t.numel() * t.element_size() for t in (k, v, o, lse)))
            continue
        s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scaling                     # [B, H_kv, G, T_q, n]
        if mask is not None:
            cols = _mask_columns(mask, p0 - mask_offset, n)[:, :, None].to(device)   # [B, 1, 1, T_q, n]
            s = s.masked_fill(~cols, float("-inf")) if cols.dtype == torch.bool else s + cols.float()
        elif p0 + n - 1 > q_start:  # some rows of the block lie after the first query
            later = torch.arange(p0, p0 + n, device=device)[None, :] > q_pos[:, None]  # [T_q, n]
            s = s.masked_fill(later, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)   # a query that has seen no row yet: exp(-inf) = 0
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bhgqk,bhkd->bhgqd", p, v)
        m = m_new
        largest = max(largest, sum(t.numel() * t.element_size() for t in (k, v, s, p)))
    if own_fused:  # the chunk's own rows, causal: query i sees own rows 0..i
        k, v = (x.float().repeat_interleave(g, dim=1) for x in own)                   # [B, H_q, T_q, D]
        o, lse = op(query.float(), k, v, is_causal=True, scale=scaling)[:2]
        largest = max(largest, sum(t.numel() * t.element_size() for t in (k, v, o, lse)))
        if not seen:  # nothing before the chunk (its first rows): merging into the empty state gives o itself
            if stats is not None:
                key = "largest_prefill_temporary_bytes"
                stats[key] = max(stats.get(key, 0), largest + sum(t.numel() * t.element_size() for t in (q, m, l, acc)))
            return o
        m, l, acc = _merge((m, l, acc), o.reshape(b, h_kv, g, t_q, d), lse.reshape(b, h_kv, g, t_q))
    if stats is not None:
        live = sum(t.numel() * t.element_size() for t in (q, m, l, acc))
        key = "largest_decode_temporary_bytes" if t_q == 1 else "largest_prefill_temporary_bytes"
        stats[key] = max(stats.get(key, 0), largest + live)
    return (acc / l[..., None]).reshape(b, h_q, t_q, d)


def _mask_columns(mask: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """The mask's columns lo..lo+n-1; a column before the first (lo < 0: a row held before the mask's window)
    masks its row out."""
    if lo >= 0:
        return mask[..., lo:lo + n]
    pad = min(-lo, n)
    fill = torch.zeros if mask.dtype == torch.bool else (lambda *a, **k: torch.full(*a, float("-inf"), **k))
    filler = fill((*mask.shape[:-1], pad), dtype=mask.dtype, device=mask.device)
    return torch.cat([filler, mask[..., :max(0, lo + n)]], -1)


def _chain(*iterators):
    for it in iterators:
        yield from it


def decode_attention(inp: DecodeInputs, block: int = BLOCK) -> torch.Tensor:
    """The new token's attention over every stored row -> [B, H_q, D] float32: the signature of
    reference.decode_attention and triton_attention.decode_attention (a `kernel` for check.check_case)."""
    end = inp.start + inp.length
    out = attend(inp, inp.q[:, :, None], inp.scaling, limit=end, q_start=end - 1, block=block)
    return out[:, :, 0]


def layer_attention(layer: ArtifactLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, scaling: float, block: int = BLOCK, prefill: str = "full",
                    stats: dict | None = None, kernel: bool | None = None) -> torch.Tensor:
    """One attention layer's output over the cache layer, after its `update` stored the T_q new rows (key,
    value: those rows as the model computed them, what a block-wise layer's update returns). -> [B, H_q, T_q, D]
    float32. T_q == 1: every stored row, the new one included (through the Triton kernel on CUDA or the fused CPU kernel, where use_kernel says).
    T_q > 1: the rows before the chunk as stored, then the chunk's own rows in full precision (prefill="full")
    or as stored (prefill="stored"), causally. A sliding-window layer (layer.window) reads through its window's
    mask (transformers' sliding mask, from layer.mask_offset; built here when none is given) and, once the step
    has read it, drops what the next token cannot see (ArtifactLayer.end_step); the kernel serves its single
    tokens when every row held is one the token reads (it reads every row it is given)."""
    if prefill not in ("full", "stored"):
        raise InputError(f"prefill must be 'full' or 'stored', got {prefill!r}")
    t_q = query.shape[2]
    total = layer.cumulative_length
    history = total - t_q
    if history < 0:
        raise ValueError(f"layer {layer.layer}: {t_q} queries but the cache holds {total} rows: update it first")
    inp = from_layer(layer, query[:, :, -1], scaling, layer.rotary)
    offset = layer.mask_offset(history)
    if layer.window is not None and mask is None:
        mask = window_mask(history, t_q, offset, layer.window, query.device)
    common = dict(mask=mask, block=block, stats=stats, mask_offset=offset)
    if t_q == 1:
        route = use_kernel(kernel, query.device, layer.start >= offset, inp)
        if route == "triton":
            from serving import triton_attention

            out = triton_attention.decode_attention(inp, device=query.device)[:, :, None]
        elif route == "cpu":
            from serving import cpu_attention

            out = cpu_attention.decode_attention(inp, stats=stats)[:, :, None]
        else:
            out = attend(inp, query, scaling, limit=total, q_start=history, **common)
    elif prefill == "stored":
        out = attend(inp, query, scaling, limit=total, q_start=history, **common)
    else:
        if key.shape[2] != t_q:
            raise ValueError(f"layer {layer.layer}: prefill='full' needs the chunk's own {t_q} rows, got "
                             f"{key.shape[2]}")
        out = attend(inp, query, scaling, limit=history, q_start=history, own=(key, value), **common)
    layer.end_step()
    return out


def use_kernel(kernel: bool | None, device: torch.device, reads_every_row: bool, inp: DecodeInputs) -> str | None:
    """Which kernel serves a single-token step: "triton" when asked (kernel=True) or, by default, on CUDA; "cpu"
    (serving/cpu_attention.py, the fused C kernel) by default on the CPU where it is built; None: this
    module's torch path, the same arithmetic. A kernel only when every row held is one the token reads (the
    kernels read every row they are given) and the kernel reads these inputs exactly (triton_attention.refusal:
    head_dim a power of two, pre-RoPE keys within its exact RoPE range; cpu_attention.refusal). kernel=False:
    always the torch path."""
    if kernel is False or not reads_every_row:
        return None
    if kernel or device.type == "cuda":
        from serving import triton_attention  # imports triton: only where the kernel may run

        return "triton" if triton_attention.refusal(inp) is None else None
    if device.type == "cpu":
        from serving import cpu_attention

        return "cpu" if cpu_attention.refusal(inp) is None else None
    return None


def window_mask(history: int, t_q: int, offset: int, window: int, device) -> torch.Tensor:
    """transformers' sliding-window causal mask [1, 1, T_q, history + T_q - offset] (True: attended) for queries
    at history.. over keys from `offset`: a query at p reads positions p - window + 1 .. p."""
    q = torch.arange(history, history + t_q, device=device)[:, None]
    k = torch.arange(offset, history + t_q, device=device)[None]
    return ((k <= q) & (k > q - window))[None, None]


@contextmanager
def serving(model: torch.nn.Module, cache: ArtifactCache, kernel: bool | None = None) -> Iterator[ArtifactCache]:
    """Within the block, `model(..., cache=cache)` and `model.generate(..., cache=cache)` attend through
    layer_attention over `cache` (attention="blockwise"), with the cache's block and prefill settings; the
    model's attention implementation is restored on exit. kernel: the Triton kernel for single-token steps
    (None: on CUDA)."""
    from stages.hooks import attention_override

    if cache.attention != "blockwise":
        raise InputError(f"serving: the cache was built with attention={cache.attention!r}; block-wise serving "
                         f"needs ArtifactCache(..., attention='blockwise')")

    def attention(module, query, key, value, mask, scaling):
        layer = cache.layers[module.layer_idx]
        out = layer_attention(layer, query, key, value, mask, scaling, block=cache.block, prefill=cache.prefill,
                              stats=cache.stats, kernel=kernel)
        return out.transpose(1, 2).contiguous().to(query.dtype)                      # [B, T_q, H_q, D]

    previous = cache.served
    cache.served = True
    try:
        with attention_override(model, attention, mask="serving"):
            yield cache
    finally:
        cache.served = previous


def generate(model, policy: CachePolicy, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             attention: str = "blockwise", block: int = BLOCK, prefill: str = "full", page: int = PAGE,
             prefix: dict | None = None, **kwargs) -> tuple[torch.Tensor, ArtifactCache]:
    """Generation (greedy, sampling, beam search) with the artifact's cache; refuses padded batches instead of
    mis-rotating them. attention="blockwise" (default) serves it with the block-wise attention (`serving`: no
    decoded copy of the history); "materialize" with the model's own attention over every row decoded. block,
    prefill, page, prefix: see serving.cache.ArtifactCache. A policy with a prefix serves input_ids after
    it: the cache already holds the prefix's rows, so generation is given the prefix ids first (transformers
    then feeds only the positions the cache does not hold) and the prefix is cut from the output again."""
    check_batch(attention_mask)
    cache = ArtifactCache(policy, model, attention=attention, block=block, prefill=prefill, page=page, prefix=prefix)
    ids, mask = input_ids, attention_mask
    ahead = cache.prefix_ids
    if ahead is not None:
        ids = torch.cat([ahead.to(input_ids)[None].expand(input_ids.shape[0], -1), input_ids], 1)
        if mask is not None:
            mask = torch.cat([mask.new_ones(mask.shape[0], ahead.numel()), mask], 1)
    if attention == "materialize":
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), **kwargs)
    else:
        with serving(model, cache):
            out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), **kwargs)
    if ahead is not None:  # the prompt as given, then the new tokens
        if isinstance(out, torch.Tensor):
            out = out[:, ahead.numel():]
        else:  # return_dict_in_generate: the sequences field
            out.sequences = out.sequences[:, ahead.numel():]
    return out, cache


def greedy_stepwise(model, policy: CachePolicy, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt` with the artifact's cache, the prompt given one token at a time: every
    position reads what the evaluation's step reads (docs/manifest.md, "Evaluation: the served cache, read one token
    at a time"; a recent window's rows in fp16 included), which is what the kvcalib vLLM plugin serves a prompt as,
    however vLLM cuts it into chunks. -> the new token ids."""
    cache = ArtifactCache(policy, model, attention="blockwise")
    out: list[int] = []
    kw = cache_kwargs(model, cache)
    with torch.no_grad(), serving(model, cache):
        logits = None
        for tok in prompt:
            logits = model(torch.tensor([[tok]]), use_cache=True, **kw).logits
        for _ in range(new_tokens):
            nxt = int(logits[0, -1].float().argmax())
            out.append(nxt)
            logits = model(torch.tensor([[nxt]]), use_cache=True, **kw).logits
    return out
