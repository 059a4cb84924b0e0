"""A transformers Cache that holds K/V in the exported format and decodes through exporters.codec.

Storage per layer: sink rows (fp16), encoded blocks (codes packed into bytes, fp16 scales / zero-points, sparse
outliers as fp16 values + int16 in-row indices + int16 per-row counts; fp8 or fp16 rows for those formats), and
a full-precision residual buffer. Keys arrive post-RoPE (transformers 5 passes no cos/sin to Cache.update); for a
pre-RoPE artifact the cache inverts RoPE at the stored positions with the model's own rotary module before
encoding and re-applies it after decoding. SmoothAttention: the cache stores K / lambda and multiplies back.

Flushing: per-token formats encode every row that leaves the residual window; per-channel groups (KIVI) encode
`group_size` rows at a time once the buffer holds residual + group_size rows.

Beyond `update`, the cache does what transformers' generation asks of it: `reset` (empty, reusable),
`reorder_cache` / `batch_select_indices` / `batch_repeat_interleave` (beam search: every stored row, encoded or
fp16, follows its sequence), `crop(0)`. What it cannot do faithfully it refuses by name (NotImplementedError):
`crop` of any tokens (flushed rows cannot return to the residual window) and `offload` / `prefetch`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from exporters.codec import (CachePolicy, Encoded, TensorPolicy, check_exportable, decode, encode, pack_codes,
                            static_bits, unpack_codes)
from exporters.rope import apply_rope, invert_rope
from stages.base import InputError


@dataclass
class StoredBlock:
    """One encoded run of rows [start, start + n) of one layer's K or V, in bytes as a runtime would hold them."""
    start: int
    shape: tuple[int, int, int, int]
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def store(e: Encoded, p: TensorPolicy, start: int) -> StoredBlock:
    b, h, t, d = e.shape
    out: dict[str, torch.Tensor] = {}
    if e.dense is not None:
        out["dense"] = e.dense
    if e.codes is not None:
        out["codes"] = pack_codes(e.codes, p.bits)
    for name in ("scale", "zero"):
        s = getattr(e, name)
        if s is not None:
            out[name] = s.to(torch.float16)
    if p.outlier_fraction > 0:
        idx = e.outlier_index  # [n, 4] (b, h, t, d)
        row = idx[:, 2] * b + idx[:, 0]                      # token row, t-major so later rows append at the end
        in_row = idx[:, 1] * d + idx[:, 3]                   # position within the row of H*D entries
        order = torch.argsort(row * (h * d) + in_row)
        out["outlier_count"] = torch.bincount(row, minlength=b * t).to(torch.int16).view(t, b)
        out["outlier_index"] = in_row[order].to(torch.int16)
        out["outlier_value"] = e.outlier_value[order].to(torch.float16)
    return StoredBlock(start, e.shape, out)


# the axis along which each stored tensor grows when rows are appended
_GROW_DIM = {"dense": 2, "codes": 2, "scale": 2, "zero": 2, "outlier_count": 0, "outlier_index": 0, "outlier_value": 0}


def append(block: StoredBlock | None, new: StoredBlock) -> StoredBlock:
    """Rows [start, start+n) followed by the next rows: one block per layer, so decoding is one call."""
    if block is None:
        return new
    assert new.start == block.start + block.shape[2], "blocks must be contiguous"
    b, h, t, d = block.shape
    tensors = {k: torch.cat([block.tensors[k], new.tensors[k]], _GROW_DIM[k]) for k in block.tensors}
    return StoredBlock(block.start, (b, h, t + new.shape[2], d), tensors)


def load(block: StoredBlock, p: TensorPolicy) -> Encoded:
    b, h, t, d = block.shape
    s = block.tensors
    e = Encoded(block.shape, dense=s.get("dense"))
    if "codes" in s:
        e.codes = unpack_codes(s["codes"], p.bits, d)
    for name in ("scale", "zero"):
        if name in s:
            setattr(e, name, s[name].float())
    if "outlier_count" in s:
        counts = s["outlier_count"].long().flatten()          # [T * B], t-major
        row = torch.repeat_interleave(torch.arange(b * t), counts)
        in_row = s["outlier_index"].long()
        e.outlier_index = torch.stack([row % b, in_row // d, row // b, in_row % d], dim=1)
        e.outlier_value = s["outlier_value"]
    return e


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t's entries idx along dim 0 (float8 moved as bytes: index_select need not support the type)."""
    idx = idx.to(t.device)
    if t.is_floating_point() and t.element_size() == 1:
        return t.view(torch.uint8).index_select(0, idx).view(t.dtype)
    return t.index_select(0, idx)


def select_batch(block: StoredBlock | None, idx: torch.Tensor) -> StoredBlock | None:
    """The block of the sequences idx [B'] (any order, repeats allowed): the block `store` gives for the batch
    x[idx]. Codes, dense rows, scales and zero-points carry the batch in dim 0; sparse outliers are a flat list in
    row order (row = t * B + b, see `store`), so whole rows of it are gathered in the new order."""
    if block is None:
        return None
    b, h, t, d = block.shape
    idx = idx.to(torch.long).cpu()
    out = {k: _take(v, idx) for k, v in block.tensors.items() if _GROW_DIM[k] == 2}  # the [B, H, T, ...] ones
    if "outlier_count" in block.tensors:
        counts = block.tensors["outlier_count"].long().cpu().flatten()    # [T * B], t-major
        starts = torch.cumsum(counts, 0) - counts
        src = (torch.arange(t)[:, None] * b + idx[None, :]).flatten()    # [T * B']: old row of each new row
        n = counts[src]
        first = torch.cumsum(n, 0) - n
        pos = (starts[src].repeat_interleave(n) + torch.arange(int(n.sum())) - first.repeat_interleave(n))
        out["outlier_count"] = n.view(t, idx.numel()).to(torch.int16).to(block.tensors["outlier_count"].device)
        out["outlier_index"] = _take(block.tensors["outlier_index"], pos)
        out["outlier_value"] = _take(block.tensors["outlier_value"], pos)
    return StoredBlock(block.start, (idx.numel(), h, t, d), out)


_NO_OFFLOAD = ("ArtifactCache.offload: not implemented -- the encoded blocks (packed codes, scales, outliers) and "
               "fp16 rows stay on the device they were written on")
_NO_PREFETCH = "ArtifactCache.prefetch: not implemented -- the cache is never offloaded (see ArtifactCache.offload)"


class ArtifactLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer: int, policy: CachePolicy, rope_fn, max_positions: int):
        super().__init__()
        self.layer, self.policy, self.rope_fn, self.max_positions = layer, policy, rope_fn, max_positions
        self.pk, self.pv = policy.layers[layer]
        self.cumulative_length = 0
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None       # post-RoPE K, V rows (fp16)
        self.recent: tuple[torch.Tensor, torch.Tensor] | None = None     # post-RoPE K, V rows (fp16)
        self.k_block: StoredBlock | None = None
        self.v_block: StoredBlock | None = None
        self.dtype = torch.float32

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def nbytes(self) -> int:
        """Bytes held: the fp16 sink and residual rows and the stored blocks as measured, plus the per-layer
        static tensors as the artifact stores them (exporters.codec.static_bits)."""
        held = [t for pair in (self.sink, self.recent) if pair is not None for t in pair]
        return (sum(t.numel() * t.element_size() for t in held)
                + sum(static_bits(p) for p in (self.pk, self.pv)) // 8
                + sum(b.nbytes for b in (self.k_block, self.v_block) if b is not None))

    # -- the cache ABI ----------------------------------------------------------------------------------------
    def _lambda(self) -> torch.Tensor | None:
        if self.policy.smooth is None:
            return None
        return self.policy.smooth[self.layer].float()[None, :, None, :]

    def _encode_rows(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k post-RoPE, v: [B, H, n, D] rows at positions start..start+n-1 -> stored blocks."""
        k = k.float()
        if self.policy.key_rope == "pre":
            cos, sin = self.rope_fn(start, k.shape[2])
            k = invert_rope(k, cos, sin)
        lam = self._lambda()
        if lam is not None:
            k = k / lam
        self.k_block = append(self.k_block, store(encode(k, self.pk, f"layer {self.layer} keys"), self.pk, start))
        self.v_block = append(self.v_block, store(encode(v.float(), self.pv, f"layer {self.layer} values"), self.pv, start))

    def _flush(self) -> None:
        k, v = self.recent
        n = k.shape[2]
        r = self.policy.residual
        g = self.pk.group_size if (self.pk.format == "uniform" and self.pk.axis == "channel") else 1
        n_out = ((n - r) // g) * g if n - r >= g else 0
        if n_out <= 0:
            return
        start = self.cumulative_length - n
        self._encode_rows(k[:, :, :n_out], v[:, :, :n_out], start)
        self.recent = (k[:, :, n_out:], v[:, :, n_out:])

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        if self.cumulative_length + t > self.max_positions:
            raise InputError(f"the cache would hold {self.cumulative_length + t} tokens, more than the model's "
                             f"{self.max_positions} positions")
        k, v = key_states.to(torch.float16), value_states.to(torch.float16)
        n_sink_left = max(0, self.policy.n_sink - self.cumulative_length)
        if n_sink_left:
            take = min(n_sink_left, t)
            new = (k[:, :, :take], v[:, :, :take])
            self.sink = new if self.sink is None else tuple(torch.cat([a, b], 2) for a, b in zip(self.sink, new))
            k, v = k[:, :, take:], v[:, :, take:]
        self.cumulative_length += t
        if k.shape[2]:
            self.recent = (k, v) if self.recent is None else tuple(torch.cat([a, b], 2) for a, b in zip(self.recent, (k, v)))
            self._flush()
        return self.materialize()

    # -- what transformers' Cache calls beyond update --------------------------------------------------------
    def reset(self) -> None:
        """Every stored row dropped (sink, encoded blocks, residual rows); the policy and the model's RoPE stay,
        so the cache takes a new batch as if new."""
        self.cumulative_length = 0
        self.sink = self.recent = None
        self.k_block = self.v_block = None
        self.is_initialized = False

    def _batch(self) -> int:
        """Sequences held (0 when empty)."""
        for held in (self.sink, self.recent):
            if held is not None:
                return held[0].shape[0]
        return self.k_block.shape[0] if self.k_block is not None else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences `indices` [B'] in that order (repeats allowed): every stored row follows its
        sequence, the encoded blocks (codes, scales, zero-points, outliers) and the fp16 sink and residual rows."""
        idx = torch.as_tensor(indices).to(torch.long).flatten()
        self.sink, self.recent = (None if pair is None else tuple(_take(x, idx) for x in pair)
                                  for pair in (self.sink, self.recent))
        self.k_block, self.v_block = select_batch(self.k_block, idx), select_batch(self.v_block, idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence i continues beam_idx[i] (index_select on the batch, as transformers' layers)."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self._batch()).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Only crop(0), a no-op: rows flushed into encoded blocks cannot go back into the residual window, so no
        crop gives the cache that never saw the removed tokens (is_croppable is False)."""
        if tokens_to_remove:
            raise NotImplementedError(
                f"ArtifactCache.crop({tokens_to_remove}): not implemented -- rows already flushed from the fp16 "
                f"residual window into encoded blocks cannot be put back, so a cropped cache would not be the cache "
                f"that never saw those tokens; reset() and refill it instead")

    def offload(self):
        raise NotImplementedError(_NO_OFFLOAD)

    def prefetch(self):
        raise NotImplementedError(_NO_PREFETCH)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All cached rows decoded: post-RoPE keys and values [B, H, T, D] in the model's dtype."""
        ks, vs = [], []
        if self.sink is not None:
            ks.append(self.sink[0].float())
            vs.append(self.sink[1].float())
        lam = self._lambda()
        if self.k_block is not None:
            kb, vb = self.k_block, self.v_block
            k = decode(load(kb, self.pk), self.pk)
            if lam is not None:
                k = k * lam
            if self.policy.key_rope == "pre":
                cos, sin = self.rope_fn(kb.start, k.shape[2])
                k = apply_rope(k, cos, sin)
            ks.append(k)
            vs.append(decode(load(vb, self.pv), self.pv))
        if self.recent is not None:
            ks.append(self.recent[0].float())
            vs.append(self.recent[1].float())
        return torch.cat(ks, 2).to(self.dtype), torch.cat(vs, 2).to(self.dtype)


class ArtifactCache(Cache):
    """Cache(layers=[ArtifactLayer ...]) for `model(..., cache=cache)` and `model.generate(..., cache=cache)`
    (greedy, sampling, beam search). reset / reorder_cache / batch_select_indices / batch_repeat_interleave /
    crop(0) work on every layer; crop(n != 0), offload and prefetch raise NotImplementedError naming them."""

    def __init__(self, policy: CachePolicy, model: torch.nn.Module):
        for i, (pk, pv) in enumerate(policy.layers):  # evaluation-only formats: no stored layout here
            check_exportable(pk, f"ArtifactCache: layer {i} keys")
            check_exportable(pv, f"ArtifactCache: layer {i} values")
        rotary = model.model.rotary_emb
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device

        def rope_fn(start: int, n: int):
            pos = torch.arange(start, start + n, device=device)[None]
            cos, sin = rotary(torch.zeros(1, n, 1, dtype=dtype, device=device), pos)
            return cos[0].float(), sin[0].float()

        max_positions = int(model.config.max_position_embeddings)
        if len(policy.layers) != model.config.num_hidden_layers:
            raise InputError(f"artifact has {len(policy.layers)} layers, the model {model.config.num_hidden_layers}")
        super().__init__(layers=[ArtifactLayer(i, policy, rope_fn, max_positions) for i in range(len(policy.layers))])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError(_NO_OFFLOAD)

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError(_NO_PREFETCH)


def check_batch(attention_mask: torch.Tensor | None) -> None:
    """Rows of one batch must have equal lengths: positions (and so RoPE) are shared by the whole batch."""
    if attention_mask is not None and not bool(attention_mask.all()):
        lengths = attention_mask.sum(-1).tolist()
        raise InputError(f"ArtifactCache needs a batch of equal-length rows (no padding); got lengths {lengths}")


def generate(model, policy: CachePolicy, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             **kwargs) -> tuple[torch.Tensor, ArtifactCache]:
    """Generation (greedy, sampling, beam search) with the artifact's cache; refuses padded batches instead of
    mis-rotating them."""
    check_batch(attention_mask)
    cache = ArtifactCache(policy, model)
    out = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **kwargs)
    return out, cache
