"""The packed page vLLM holds for a kvcalib artifact: one fixed-size slot per token (docs/vllm.md, "The packed page").

vLLM's paged cache gives every token of a block the same number of bytes (vllm/v1/kv_cache_interface.py
AttentionSpec: a page is [num_head_slots, block_size, state_content_bytes]), while the artifact's own store
(exporters/layout.py) keeps a page's sparse outliers as one variable-length list. The slot below is that store per
token, with the outlier list of each side cut to a fixed capacity:

    per token, all kv heads, key side then value side, each:
      codes      [H, ceil(D * bits / 8)] uint8   packed as exporters.codec.pack_codes packs them (little-endian)
      scale      [H] fp16                        per-token formats only (axis token): nuq's range, uniform's step
      zero       [H] fp16                        per-token formats only: nuq's midpoint, uniform's minimum
      index      [cap] int16                     outliers: h * D + d within the token's H * D entries, store's
                                                 order; SENTINEL marks an empty entry
      value      [cap] fp16                      outliers: the exact value
    each 2-byte field at an even offset; the slot padded to an even size.

    per page, after its block_size slots, when the recipe keeps sink rows (cache.n_sink > 0) and no recent window
    (with a window the plugin keeps the sink rows beside it, once per sequence: serving/vllm_backend.py Window):
      sink       [n_sink, 2, H, D] fp16          the first n_sink positions of the sequence, post-RoPE K then V,
                                                 used in the page holding positions 0..block_size-1 only

Capacity of the outlier list: per-token bounds (axis token) are the fraction / 2 and 1 - fraction / 2 quantiles of
the token's H * D entries (codec.token_outlier_bounds), with linear interpolation at the ranks r = q * (H * D - 1)
(float32, as torch computes them), so at most ceil(r_lower) entries fall below the lower one and
H * D - 1 - floor(r_upper) above the upper one (about floor(fraction / 2 * (H * D - 1)) + 1 each): the capacity
is exact (tokens of distinct entries reach it). Static per-channel bounds (axis channel) admit any count; their
capacity is CHANNEL_SLACK times the expected count (fraction * H * D). An outlier beyond the capacity is left
clamped to its bound (what the codes already encode: the codec clamps outliers before coding them) and counted by
the runtime; nothing is dropped silently. Pure: torch only, no vLLM.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from exporters.codec import Encoded, TensorPolicy, unpack_codes
from exporters.layout import MAX_ROW_ENTRIES

SENTINEL = MAX_ROW_ENTRIES  # an empty outlier entry: beyond every h * D + d of a served row (checked below)
CHANNEL_SLACK = 8           # static-bound outlier capacity: this many times the expected count per token (docs/vllm.md)
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
    cap: int


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

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.slot_bytes + self.sink_bytes

    def as_json(self) -> dict:
        side = lambda s: {k: getattr(s, k) for k in ("bits", "code_bytes", "codes", "scale", "zero", "index",  # noqa: E731
                                                       "value", "cap")}
        return {"n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "slot_bytes": self.slot_bytes,
                "n_sink": self.n_sink, "sink_bytes": self.sink_bytes, "sink_in_page": self.sink_in_page,
                "key": side(self.key),
                "value": side(self.value)}


def outlier_capacity(p: TensorPolicy, n_kv_heads: int, head_dim: int) -> int:
    if p.outlier_fraction <= 0:
        return 0
    n = n_kv_heads * head_dim
    if p.axis == "token":
        # the ranks torch.quantile interpolates at (q * (n - 1), in float32 as codec.token_outlier_bounds' rows):
        # at most ceil(lo) entries fall below the lower bound and n - 1 - floor(hi) above the upper one (a whole
        # rank is a sorted entry itself). The two sides are counted apart: float32 rounding can make them differ
        # (f = 0.088, n = 4251: 187 below and 188 above, where 2 * (floor(f / 2 * (n - 1)) + 1) gives 374)
        q = torch.tensor([p.outlier_fraction / 2, 1 - p.outlier_fraction / 2], dtype=torch.float32)
        lo, hi = (q * (n - 1)).tolist()
        return math.ceil(lo) + (n - 1 - math.floor(hi))
    return max(2, math.ceil(CHANNEL_SLACK * p.outlier_fraction * n))


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
    return SideSlot(p.bits, code_bytes, codes, scale, zero, index, value, cap), at


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
    [n, slot_bytes] uint8. -> the number of outliers beyond the capacity (left clamped; see the module)."""
    h = n_kv_heads
    slots[:, s.codes:s.codes + h * s.code_bytes] = tensors["codes"][0].permute(1, 0, 2).reshape(n, -1)
    if s.scale is not None:
        slots[:, s.scale:s.scale + 2 * h] = _as_bytes(tensors["scale"][0, :, :, 0].t(), n)
        slots[:, s.zero:s.zero + 2 * h] = _as_bytes(tensors["zero"][0, :, :, 0].t(), n)
    if not s.cap:
        return 0
    counts = tensors["outlier_count"].reshape(n).long()
    m = int(counts.sum())
    index = torch.full((n, s.cap), SENTINEL, dtype=torch.int16)
    value = torch.zeros(n, s.cap, dtype=torch.float16)
    overflow = 0
    if m:
        rows = torch.repeat_interleave(torch.arange(n), counts)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(m) - first[rows]
        keep = rank < s.cap
        overflow = int((~keep).sum())
        index[rows[keep], rank[keep]] = tensors["outlier_index"][:m][keep]
        value[rows[keep], rank[keep]] = tensors["outlier_value"][:m][keep]
    slots[:, s.index:s.index + 2 * s.cap] = _as_bytes(index, n)
    slots[:, s.value:s.value + 2 * s.cap] = _as_bytes(value, n)
    return overflow


def unpack_side(slots: torch.Tensor, s: SideSlot, p: TensorPolicy, n_kv_heads: int, head_dim: int) -> Encoded:
    """Slots [T, slot_bytes] uint8 -> one side's rows in the codec's form, Encoded of shape [1, H, T, D]
    (exporters.codec.decode gives the values: pre-RoPE keys for key_rope 'pre')."""
    t, h, d = slots.shape[0], n_kv_heads, head_dim
    packed = slots[:, s.codes:s.codes + h * s.code_bytes].reshape(t, h, s.code_bytes)
    codes = unpack_codes(packed, s.bits, d).permute(1, 0, 2).unsqueeze(0)          # [1, H, T, D]
    scale = zero = None
    if s.scale is not None:
        half = lambda a: slots[:, a:a + 2 * h].contiguous().view(torch.float16).float()  # noqa: E731  [T, H]
        scale, zero = half(s.scale).t()[None, :, :, None], half(s.zero).t()[None, :, :, None]
    out_idx = out_val = None
    if s.cap:
        index = slots[:, s.index:s.index + 2 * s.cap].contiguous().view(torch.int16).long()      # [T, cap]
        value = slots[:, s.value:s.value + 2 * s.cap].contiguous().view(torch.float16)
        tt, j = (index != SENTINEL).nonzero(as_tuple=True)
        e = index[tt, j]
        out_idx = torch.stack([torch.zeros_like(e), e // d, tt, e % d], 1)
        out_val = value[tt, j]
    return Encoded((1, h, t, d), codes=codes, scale=scale, zero=zero, outlier_index=out_idx, outlier_value=out_val)

