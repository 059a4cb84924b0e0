"""The packed page vLLM holds for a kvcalib artifact: one fixed-size slot per token, and per page a pool of the
static-bound outliers (docs/vllm.md, "The packed page").

vLLM's paged cache gives every token of a block the same number of bytes (vllm/v1/kv_cache_interface.py
AttentionSpec: a page is [num_head_slots, block_size, state_content_bytes], padded to page_size_padded), while the
artifact's own store (exporters/layout.py) keeps a page's sparse outliers as one variable-length list. The slot
below is that store per token; a side whose outliers have a count fixed by its bounds (per-token quantile bounds)
keeps its list in the slot at that capacity, a side whose count varies (static per-channel bounds: keys) keeps it
in its page's pool, after the page's slots:

    per token, all kv heads, key side then value side, each:
      codes      [H, ceil(D * bits / 8)] uint8   packed as exporters.codec.pack_codes packs them (little-endian)
      scale      [H] fp16                        per-token formats only (axis token): nuq's range, uniform's step
      zero       [H] fp16                        per-token formats only: nuq's midpoint, uniform's minimum
      index      [cap] int16                     per-token bounds: outliers, h * D + d within the token's H * D
                                                 entries, store's order; SENTINEL marks an empty entry
      value      [cap] fp16                      per-token bounds: the exact value
    each 2-byte field at an even offset; the slot padded to an even size.

    per page, after its block_size slots, for each side with static bounds (key side first):
      count      [block_size] int16              the token's outliers in the pool
      first      [block_size] int16              where they start in the pool
      index      [P] int16                       the page's outliers, token by token in position order, each
                                                 token's in store's order: h * D + d
      value      [P] fp16                        the exact values
    then, when the recipe keeps sink rows (cache.n_sink > 0) and no recent window (with a window the plugin keeps
    the sink rows beside it, once per sequence: serving/vllm_backend.py Window):
      sink       [n_sink, 2, H, D] fp16          the first n_sink positions of the sequence, post-RoPE K then V,
                                                 used in the page holding positions 0..block_size-1 only

A token's pool entries follow the previous token's in its page (first = the previous token's first + count; 0 for
the page's first stored token: offset 0, or the position after the sinks). Positions below n_sink have no slot
entries (count and first are never read for them).

Capacity. Per-token bounds (axis token) are the fraction / 2 and 1 - fraction / 2 quantiles of the token's H * D
entries (codec.token_outlier_bounds), with linear interpolation at the ranks r = q * (H * D - 1) (float32, as
torch computes them), so at most ceil(r_lower) entries fall below the lower one and H * D - 1 - floor(r_upper)
above the upper one (about floor(fraction / 2 * (H * D - 1)) + 1 each): the slot's capacity is exact (tokens of
distinct entries reach it). Static per-channel bounds (axis channel) admit any count per token; a page of
block_size tokens pools them, P = POOL_SLACK times the expected count (fraction * H * D * block_size), so a token
with many outliers borrows from the page's others (decided on the dev split: bench/outlier_pool.py). An outlier
beyond the capacity is left clamped to its bound (what the codes already encode: the codec clamps outliers before
coding them) and counted by the runtime; nothing is dropped silently. Pure: torch only, no vLLM.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from exporters.codec import Encoded, TensorPolicy, unpack_codes
from exporters.layout import MAX_ROW_ENTRIES

SENTINEL = MAX_ROW_ENTRIES  # an empty outlier entry: beyond every h * D + d of a served row (checked below)
POOL_SLACK = 3              # a page's static-bound outlier pool: this many times its expected count (docs/vllm.md)
SERVED_FORMATS = ("nuq", "uniform")
POLICY_TENSORS = ("codebook", "range", "zero", "lower", "upper")   # a side's static tensors the runtime reads


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a policy tensor's float32 values: how the plugin reports what it holds and the benchmark compares
    it with the artifact (serving.vllm_backend.held, bench/vllm_packed.py check_held)."""
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class SideSlot:
    """Where one side's (K or V) fields lie in a slot (byte offsets; None: absent) and its outlier capacity."""
    bits: int
    code_bytes: int          # per head
    codes: int
    scale: int | None
    zero: int | None
    index: int | None
    value: int | None
    cap: int                 # the slot's list (per-token bounds); 0: none in the slot
    pool_rate: float = 0.0   # static bounds: the page's pool holds ceil(pool_rate * block_size) entries; 0: no pool

    @property
    def kernel_outliers(self) -> int:
        """The CPU kernel's mode for this side (serving/cpu_attention.py launch): 0 none, 1 the slot's list,
        2 the page's pool (int16 offsets)."""
        return 2 if self.pool_rate else 1 if self.cap else 0

    def pool_cap(self, block_size: int) -> int:
        """Entries of a page's pool: at most SENTINEL (int16 offsets), at least 2."""
        return min(SENTINEL, max(2, math.ceil(self.pool_rate * block_size))) if self.pool_rate else 0


@dataclass(frozen=True)
class SlotLayout:
    n_kv_heads: int
    head_dim: int
    key: SideSlot
    value: SideSlot
    slot_bytes: int
    n_sink: int
    sink_in_page: bool = True    # False: a recipe with a recent window keeps its sink rows beside it, per sequence

    @property
    def sink_bytes(self) -> int:
        """Bytes after a page's slots: the sink rows, fp16 K and V (none where the sinks live beside the pages)."""
        return self.n_sink * 2 * self.n_kv_heads * self.head_dim * 2 if self.sink_in_page else 0

    def pools(self, block_size: int) -> dict:
        """Where each pooled side's fields lie in a page (byte offsets from the page's start; "key" / "value"):
        {side: {"count", "first", "index", "value", "cap"}}, after the block_size slots, key side first."""
        out, at = {}, block_size * self.slot_bytes
        for name, s in (("key", self.key), ("value", self.value)):
            cap = s.pool_cap(block_size)
            if cap:
                out[name] = {"count": at, "first": at + 2 * block_size, "index": at + 4 * block_size,
                             "value": at + 4 * block_size + 2 * cap, "cap": cap}
                at += 4 * block_size + 4 * cap
        return out

    def pool_bytes(self, block_size: int) -> int:
        return sum(4 * block_size + 4 * s.pool_cap(block_size) for s in (self.key, self.value) if s.pool_rate)

    def sink_offset(self, block_size: int) -> int:
        """Where a page's sink rows start (after its slots and pools)."""
        return block_size * self.slot_bytes + self.pool_bytes(block_size)

    def page_bytes(self, block_size: int) -> int:
        return self.sink_offset(block_size) + self.sink_bytes

    def as_json(self) -> dict:
        side = lambda s: {k: getattr(s, k) for k in ("bits", "code_bytes", "codes", "scale", "zero", "index",  # noqa: E731
                                                       "value", "cap", "pool_rate")}
        return {"n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "slot_bytes": self.slot_bytes,
                "n_sink": self.n_sink, "sink_bytes": self.sink_bytes, "sink_in_page": self.sink_in_page,
                "pool_rate": {"key": self.key.pool_rate, "value": self.value.pool_rate},
                "key": side(self.key),
                "value": side(self.value)}


def outlier_capacity(p: TensorPolicy, n_kv_heads: int, head_dim: int) -> int:
    """The slot's list: the exact capacity of per-token bounds; 0 for static bounds (their page's pool) or none."""
    if p.outlier_fraction <= 0 or p.axis != "token":
        return 0
    n = n_kv_heads * head_dim
    # the ranks torch.quantile interpolates at (q * (n - 1), in float32 as codec.token_outlier_bounds' rows): at
    # most ceil(lo) entries fall below the lower bound and n - 1 - floor(hi) above the upper one (a whole rank is a
    # sorted entry itself). The two sides are counted apart: float32 rounding can make them differ (f = 0.088,
    # n = 4251: 187 below and 188 above, where 2 * (floor(f / 2 * (n - 1)) + 1) gives 374)
    q = torch.tensor([p.outlier_fraction / 2, 1 - p.outlier_fraction / 2], dtype=torch.float32)
    lo, hi = (q * (n - 1)).tolist()
    return math.ceil(lo) + (n - 1 - math.floor(hi))


def pool_rate(p: TensorPolicy, n_kv_heads: int, head_dim: int) -> float:
    """Static per-channel bounds: a page's pool entries per token (POOL_SLACK times the expected count); else 0."""
    if p.outlier_fraction <= 0 or p.axis != "channel":
        return 0.0
    return POOL_SLACK * p.outlier_fraction * n_kv_heads * head_dim


def _side(p: TensorPolicy, n_kv_heads: int, head_dim: int, at: int) -> tuple[SideSlot, int]:
    code_bytes = -(-head_dim * p.bits // 8)
    codes, at = at, at + n_kv_heads * code_bytes
    at += at % 2
    scale = zero = None
    if p.axis == "token":
        scale, zero, at = at, at + 2 * n_kv_heads, at + 4 * n_kv_heads
    cap = outlier_capacity(p, n_kv_heads, head_dim)
    index = value = None
    if cap:
        index, value, at = at, at + 2 * cap, at + 4 * cap
    return SideSlot(p.bits, code_bytes, codes, scale, zero, index, value, cap,
                    pool_rate(p, n_kv_heads, head_dim)), at


def refusals(policy) -> list[str]:
    """Why vLLM's packed page cannot hold this policy exactly, one line per field (empty: servable). A slot stores
    what a token's own rows determine; the recent window's fp16 rows are the plugin's per-sequence state beside the
    pages (serving/vllm_backend.py); anything else kept across tokens or beside the cache is refused."""
    out = []
    if policy.smooth is not None:
        out.append("cache/smoothing: SmoothAttention scales are not served by the vLLM plugin; allowed null")
    if policy.prefix_ids is not None and policy.prefix_ids.numel():
        out.append("cache/prefix: prefix rows are not served by the vLLM plugin; allowed null")
    if policy.key_rope not in ("pre", "post"):
        out.append(f"cache/key_rope: allowed 'pre' or 'post', got {policy.key_rope!r}")
    for i, (k, v) in enumerate(policy.layers):
        for kind, p in (("key", k), ("value", v)):
            where = f"layers/{i}/{kind}"
            if p.format not in SERVED_FORMATS:
                hint = " (serve fp8 as an fp8 checkpoint, fp16 as kv_cache_dtype='auto')" if p.format in (
                    "fp8", "fp16") else ""
                out.append(f"{where}/format: allowed {SERVED_FORMATS}, got {p.format!r}{hint}")
                continue
            if kind == "key" and p.rotation != "none":   # a rotated key is scored, not summed: no single un-rotation
                out.append(f"{where}/rotation: allowed 'none' on keys (values: 'hadamard'), got {p.rotation!r}")
            if kind == "key" and p.clip != "none":
                out.append(f"{where}/clip: allowed 'none' on keys (values: 'mse'), got {p.clip!r}")
            if kind == "value" and p.rotation != "none" and p.axis != "token":
                out.append(f"{where}/rotation: a rotated value is served per token; allowed axis 'token', got "
                           f"{p.axis!r}")
            if p.axis not in ("token", "channel") or (p.axis == "channel" and p.format != "nuq"):
                out.append(f"{where}/axis: allowed 'token' (nuq, uniform) or 'channel' (nuq: static scales), got "
                           f"{p.axis!r} with format {p.format!r} (per-channel groups span tokens: no slot holds them)")
    return out


def natural_bytes(policy, layer: int, n_kv_heads: int, head_dim: int) -> int:
    """One layer's slot: its key side, then its value side, padded to an even size."""
    k, v = policy.layers[layer]
    _, at = _side(k, n_kv_heads, head_dim, 0)
    _, at = _side(v, n_kv_heads, head_dim, at)
    return at + at % 2


def padding_loss(given: dict, natural: dict) -> float:
    """The fraction of the pages' slot bytes that is padding, for the slot sizes vLLM was given per layer
    ({layer: bytes}) against each layer's own (natural_bytes). 0 when every layer has a page of its own size
    (serving/vllm_backend.py customize_spec: vLLM's UniformTypeKVCacheSpecs)."""
    total = sum(given.values())
    return 1.0 - sum(natural[i] for i in given) / total if total else 0.0


def layout(policy, n_kv_heads: int, head_dim: int, layer: int = 0) -> SlotLayout:
    """Layer `layer`'s slot of a servable policy (refusals empty) for a model's kv heads and head dim: its own fields
    at its own offsets, in a slot of its own size (each layer's page is its own: vLLM groups full-attention layers
    of different page sizes in one UniformTypeKVCacheSpecs, every layer's page holding the same tokens)."""
    if n_kv_heads * head_dim > SENTINEL:
        raise ValueError(f"n_kv_heads * head_dim must be at most {SENTINEL} (int16 outlier indices), got "
                         f"{n_kv_heads * head_dim}")
    k, v = policy.layers[layer]
    key, at = _side(k, n_kv_heads, head_dim, 0)
    value, at = _side(v, n_kv_heads, head_dim, at)
    return SlotLayout(n_kv_heads, head_dim, key, value, at + at % 2, policy.n_sink, sink_in_page=not policy.residual)


# ---- a side's rows into slots and back ------------------------------------------------------------------------

def _as_bytes(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(n, -1)


def pack_side(tensors: dict, s: SideSlot, n: int, n_kv_heads: int, slots: torch.Tensor) -> int:
    """One side's stored rows of n tokens (exporters.layout.store of [1, H, n, D]: codes [1, H, n, bytes], scale /
    zero [1, H, n, 1] fp16, outlier_count [n, 1], t-major outlier_index / outlier_value) into its fields of slots
    [n, slot_bytes] uint8. -> the number of outliers beyond the capacity (left clamped; see the module). A pooled
    side's outliers are not the slot's: the caller places them in the page's pool (outlier_lists, pool_places)."""
    h = n_kv_heads
    slots[:, s.codes:s.codes + h * s.code_bytes] = tensors["codes"][0].permute(1, 0, 2).reshape(n, -1)
    if s.scale is not None:
        slots[:, s.scale:s.scale + 2 * h] = _as_bytes(tensors["scale"][0, :, :, 0].t(), n)
        slots[:, s.zero:s.zero + 2 * h] = _as_bytes(tensors["zero"][0, :, :, 0].t(), n)
    if not s.cap:
        return 0
    counts, o_index, o_value = outlier_lists(tensors, n)
    m = o_index.numel()
    index = torch.full((n, s.cap), SENTINEL, dtype=torch.int16)
    value = torch.zeros(n, s.cap, dtype=torch.float16)
    overflow = 0
    if m:
        rows = torch.repeat_interleave(torch.arange(n), counts)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(m) - first[rows]
        keep = rank < s.cap
        overflow = int((~keep).sum())
        index[rows[keep], rank[keep]] = o_index[keep]
        value[rows[keep], rank[keep]] = o_value[keep]
    slots[:, s.index:s.index + 2 * s.cap] = _as_bytes(index, n)
    slots[:, s.value:s.value + 2 * s.cap] = _as_bytes(value, n)
    return overflow


def outlier_lists(tensors: dict, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One side's stored outliers of n tokens (exporters.layout.store) -> (count [n] int64, index [m] int16,
    value [m] fp16): token by token, each token's in store's order."""
    counts = tensors["outlier_count"].reshape(n).long()
    m = int(counts.sum())
    return counts, tensors["outlier_index"][:m], tensors["outlier_value"][:m]


def pool_places(counts: torch.Tensor, start: torch.Tensor, cap: int) -> dict:
    """Where n tokens' outliers go in their pages' pools: rows in order, runs of consecutive tokens of one page;
    start [n] int64 is the pool's fill before a run's first row (>= 0) and -1 on the rows that follow the previous
    one in its page. Each token's entries follow the previous token's; those past the pool's cap are left out
    (clamped, counted). -> {"first" [n], "kept" [n] (what count and first store), "rows" [m] (each entry's token),
    "dest" [m] (its place in the pool), "keep" [m] bool, "overflow": int}."""
    n = counts.numel()
    if n and int(start[0]) < 0:
        raise ValueError("pool_places: the first row must start a run (start >= 0)")
    head = start >= 0
    run = torch.cumsum(head.long(), 0) - 1
    excl = torch.cumsum(counts, 0) - counts
    heads = head.nonzero().flatten()
    raw = start[heads][run] + excl - excl[heads][run]        # the fill before each token, uncapped
    first = raw.clamp(max=cap)
    kept = torch.minimum(counts, (cap - raw).clamp(min=0))
    m = int(counts.sum())
    rows = torch.repeat_interleave(torch.arange(n), counts)
    rank = torch.arange(m) - excl[rows]
    return {"first": first, "kept": kept, "rows": rows, "dest": first[rows] + rank, "keep": rank < kept[rows],
            "overflow": int((counts - kept).sum())}


def pool_entries(count: torch.Tensor, first: torch.Tensor, page: torch.Tensor, index: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T stored tokens' outliers read from their pages' pools: count / first [T] (the page's int16 fields), page [T]
    (each token's row of index / value [pages, P] int16 / fp16) -> (token tt [m], entry h * D + d [m], value [m]).
    A count or first outside the pool is refused (a corrupt page), never read."""
    count, first = count.long(), first.long()
    cap = index.shape[1]
    if bool((count < 0).any() | (first < 0).any() | (first + count > cap).any()):
        raise ValueError(f"a page's outlier pool: counts and starts must lie within its {cap} entries")
    m = int(count.sum())
    tt = torch.repeat_interleave(torch.arange(count.numel()), count)
    at = first[tt] + torch.arange(m) - (torch.cumsum(count, 0) - count)[tt]
    return tt, index[page[tt], at].long(), value[page[tt], at]


def unpack_side(slots: torch.Tensor, s: SideSlot, p: TensorPolicy, n_kv_heads: int, head_dim: int,
                pooled: tuple | None = None) -> Encoded:
    """Slots [T, slot_bytes] uint8 -> one side's rows in the codec's form, Encoded of shape [1, H, T, D]
    (exporters.codec.decode gives the values: pre-RoPE keys for key_rope 'pre'). A pooled side (pool_rate) takes its
    outliers from pooled: pool_entries' (tt, e, value) of the same T tokens."""
    t, h, d = slots.shape[0], n_kv_heads, head_dim
    packed = slots[:, s.codes:s.codes + h * s.code_bytes].reshape(t, h, s.code_bytes)
    codes = unpack_codes(packed, s.bits, d).permute(1, 0, 2).unsqueeze(0)          # [1, H, T, D]
    scale = zero = None
    if s.scale is not None:
        half = lambda a: slots[:, a:a + 2 * h].contiguous().view(torch.float16).float()  # noqa: E731  [T, H]
        scale, zero = half(s.scale).t()[None, :, :, None], half(s.zero).t()[None, :, :, None]
    out_idx = out_val = None
    if s.pool_rate:
        if pooled is None:
            raise ValueError("unpack_side: a pooled side's outliers come from its pages' pools (pool_entries)")
        tt, e, out_val = pooled
        out_idx = torch.stack([torch.zeros_like(e), e // d, tt, e % d], 1)
    elif s.cap:
        index = slots[:, s.index:s.index + 2 * s.cap].contiguous().view(torch.int16).long()      # [T, cap]
        value = slots[:, s.value:s.value + 2 * s.cap].contiguous().view(torch.float16)
        tt, j = (index != SENTINEL).nonzero(as_tuple=True)
        e = index[tt, j]
        out_idx = torch.stack([torch.zeros_like(e), e // d, tt, e % d], 1)
        out_val = value[tt, j]
    return Encoded((1, h, t, d), codes=codes, scale=scale, zero=zero, outlier_index=out_idx, outlier_value=out_val)

