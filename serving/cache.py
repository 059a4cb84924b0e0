"""A transformers Cache that holds K/V in the exported format and decodes through exporters.codec.

Storage per layer: sink rows (fp16), encoded rows in the stored byte layout of exporters/layout.py (codes packed
into bytes, fp16 scales / zero-points, sparse outliers as fp16 values + int16 in-row indices + int16 per-row
counts; fp8 or fp16 rows for those formats), and a full-precision residual buffer. The encoded rows of K and of V
are held in pages of `page` rows (exporters.layout.PagedRows; K and V pages cover the same rows): each page is a
StoredBlock laid out as docs/manifest.md describes the cache, for its own rows; full pages are never touched again
and the last is a preallocated buffer the new rows are copied into, so storing a row copies that row only and
no second copy of the history is ever made. `layer.k_block` / `v_block` view the pages (PagedBlock). Sink and
residual rows are copies of their own: never views of the chunk they arrived in.
Keys arrive post-RoPE (transformers 5 passes no cos/sin to Cache.update); for a pre-RoPE artifact the cache
inverts RoPE at the stored positions with the model's own rotary module before encoding and re-applies it after
decoding, in exporters/rope.py's convention whatever the model's dtype: float32 tables, float32 copies of the keys
(the fp16 rows as received), the codec encoding the float32 result; decoded keys are float32 until `materialize`
rounds the whole history once to the model's dtype for its own attention (the block-wise reader keeps float32).
SmoothAttention: the cache stores K / lambda and multiplies back; each layer holds its lambda on its own device,
made once (ArtifactLayer.smooth), and hands that tensor to the kernels at every step (from_layer).
Rotated values (value rotation "hadamard", clip "mse": exporters.codec.export_refusal): the encoded value rows hold
the codec's bytes of the rotated, clipped row (the codec encodes them: the CPU kernel's encoder takes neither);
sink, residual and prefix rows stay un-rotated fp16; `materialize` decodes (un-rotates) row by row, the kernels
un-rotate their sum (serving/inputs.py). Value rows the codec encodes one token at a time would cost a decode step
a dozen small torch operations per layer; per-token rows are encoded independently (a row's bytes do not depend on
the rows beside it), so when the codec runs, it encodes with the flushed rows those the residual buffer holds after
them and keeps their bytes for the flushes to come (`_values_by_codec`): the same bytes, one codec call per
residual window of steps. The codec encodes a page's room at a time (a long prefill page by page), the rows kept
ahead are a copy of their own (counted in reserved_bytes, never a view holding a prefill's codec output alive) and
they follow their sequences through a batch edit (beam search does not encode the window again at every step).
Sparse outliers under static per-channel bounds are bounded per layer: at most (1 + OUTLIER_MARGIN) x the count the
declared fraction expects are held, the excess left clamped to its bound and counted (stats["outliers_clamped"]),
so a degenerate artifact (lower == upper) cannot grow the cache past its ledger by more than that factor on its
outliers; honest text never reaches it (the measurement is OUTLIER_MARGIN's).

Which rows are sink, encoded or residual at every step, when the residual buffer flushes (whole units of K's and
V's groups) and what a sliding-window layer keeps are exporters/served_rows.py's (LayerRows), the definition the
evaluation and the byte ledger read too. A policy with a prefix is served after it: the prefix's full-precision
rows are the layer's first sink rows from the start (ArtifactCache(..., prefix=...)).
A policy is bound to the model it serves before any row is stored (bind): an artifact's recorded shapes and RoPE
must be the model's, and every calibrated tensor must cover the model's heads x head_dim -- an artifact from a
stranger never reaches the kernels with tensors shorter than what they read.

Beyond `update`, the cache does what transformers' generation asks of it: `reset` (empty, reusable),
`reorder_cache` / `batch_select_indices` / `batch_repeat_interleave` (beam search: every stored row, encoded or
fp16, and the value rows encoded ahead follow their sequence), `crop(0)`. What it cannot do faithfully it refuses
by name (NotImplementedError): `crop` of any tokens (flushed rows cannot return to the residual window) and
`offload` / `prefetch`.

Two ways to serve it (`ArtifactCache(..., attention=...)`):
- "materialize" (the default for a cache built directly): `update` returns every cached row decoded
  (`ArtifactLayer.materialize`), [B, H, T, D] in the model's dtype, for the model's own attention.
- "blockwise": `update` stores the new rows and returns them alone; the attention is serving/blockwise.py's,
  which reads the stored form one block of positions at a time, so no full-precision copy of the history is
  ever made. It must be installed: `serving.blockwise.serving(model, cache)` (a context manager) or
  `serving.blockwise.generate(...)` (whose default it is); a block-wise cache updated without it refuses
  (InputError). Of serving/ this module imports only cpu_attention and inputs (the C library's encoder of new rows, the
  codec's bytes: where it is built and takes the policy; the codec otherwise): the readers import the cache.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from exporters.codec import CachePolicy, check_exportable, decode, encode, static_bits
from exporters.layout import (PAGE, PagedBlock, PagedRows, StoredBlock, calibrated_shape, check_row_entries, load,
                              select_batch, slice_rows, store, take_batch)
from exporters.rope import apply_rope, invert_rope, rotary_tables
from exporters.served_rows import layer_rows, scale_group
from serving import cpu_attention
from serving.inputs import DecodeInputs
from stages.base import InputError

ATTENTION_MODES = ("blockwise", "materialize")
HELD_KINDS = ("codes", "scales_zero_points", "outliers", "sink", "residual", "static")  # accounting(): sum = nbytes
PREFILL_MODES = ("full", "stored")   # what a chunk of T_q > 1 new tokens reads for its own rows (blockwise)
BLOCK = 2048                         # positions per block of the block-wise attention
# Sparse outliers under static per-channel bounds (axis channel: entries outside [lower, upper]) admit any count per
# row, so what a layer's K or V holds of them is bounded: at most (1 + OUTLIER_MARGIN) x the count the declared
# fraction expects (policy.outlier_fraction x H x D x B x rows held, counted over at least OUTLIER_FLOOR_ROWS rows);
# beyond it the entries farthest outside their bounds are kept and the rest left clamped to the nearest bound --
# what the codes already encode there (the codec clamps an entry before coding it) -- and counted
# (stats["outliers_clamped"]). Measured on honest text (SmolLM2-135M, the long-3.5b artifact's bounds: its 22 layers
# with 1% key outliers; wikitext-2 valid.txt and test.txt, 4 windows of 2,048 tokens each; every key row encoded
# one at a time from the first after the 16 sink rows, the worst order): held / expected peaks at 2.22 (2.21 on
# test.txt) over >= 128 rows; layers average 1.20-1.75. Gemma 3 270M stores more than its recipes declare (the
# kvquant-3b-1pct+smooth+prefix artifact: 1% declared, 2.38% measured over its evaluation text): on 2 x 2048 tokens of
# test.txt its layers peak at 5.67x the declared count. 1 + 9 = 10 leaves 1.76x above that peak, so honest text
# clamps nothing on either model; a degenerate artifact (lower == upper: every entry an outlier) holds at most 10x
# the declared outliers -- 10% of the entries at 1%, 4 bytes each beside codes of 0.25-0.5 byte.
OUTLIER_MARGIN = 9.0
# the fewest rows the bound counts: a layer's first rows pool too few to bound by their own count (one key row of
# that artifact held 17x the expected count, its first 32 rows 2.9x); the vLLM plugin's page pools as many
OUTLIER_FLOOR_ROWS = 128
# PAGE (encoded rows per page of a layer's stored K or V) and the stored layout are exporters/layout.py's


_NO_OFFLOAD = ("ArtifactCache.offload: not implemented -- the encoded blocks (packed codes, scales, outliers) and "
               "fp16 rows stay on the device they were written on")
_NO_PREFETCH = "ArtifactCache.prefetch: not implemented -- the cache is never offloaded (see ArtifactCache.offload)"


def cache_kwargs(model: torch.nn.Module, cache: Cache) -> dict:
    """{name: cache} for handing a cache to model(...) / model.generate(...): transformers 5.25 names the argument
    `cache`, earlier 5.x releases (pyproject allows >=5.0) `past_key_values`; an unknown name would be swallowed by
    **kwargs and the model would run without the cache (found on the GPU machine's transformers 5.17)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


class ArtifactLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False

    def __init__(self, layer: int, policy: CachePolicy, rope_fn, max_positions: int, rotary=None,
                 attention: str = "materialize", page: int = PAGE, window: int | None = None,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None = None, stats: dict | None = None):
        """window: a sliding-window (local) layer's window -- it holds the last `window` positions only (see
        drop_before) -- or None for a global layer. prefix: this layer's full-precision prefix rows, post-RoPE
        K and V [H, P, D], held at positions 0..P-1 before any update (policy.prefix_len = P), or None. stats: the
        cache's counters this layer adds to ("outliers_clamped": see OUTLIER_MARGIN), or None: its own."""
        super().__init__()
        self.stats = {"outliers_clamped": 0} if stats is None else stats
        self.stats.setdefault("outliers_clamped", 0)
        self.layer, self.policy, self.rope_fn, self.max_positions = layer, policy, rope_fn, max_positions
        self.rotary = rotary                 # the model's rotary module (the block-wise attention's RoPE tables)
        self.attention = attention           # "materialize" | "blockwise" (see the module docstring)
        self.served = False                  # blockwise: the block-wise attention is installed (blockwise.serving)
        self.pk, self.pv = policy.layers[layer]
        # which rows are sink, encoded and residual at every step, and the window: exporters/served_rows.py
        self.rows = layer_rows(policy, layer, window)
        if window is not None:
            if window < 1:
                raise InputError(f"layer {layer}: sliding window must be >= 1, got {window}")
            if window < self.rows.min_window:  # the residual buffer itself must fit the window
                raise InputError(f"layer {layer}: a sliding window of {window} positions cannot hold the residual "
                                 f"buffer of {self.rows.residual} rows plus a flush unit of {self.rows.unit} (whole "
                                 f"key groups of {self.rows.key_group} and value groups of {self.rows.value_group}); "
                                 f"allowed: residual + unit <= window, got {self.rows.residual} + {self.rows.unit} "
                                 f"> {window}")
            page = min(page, window)  # a local layer's pages are at most a window (freed as the window moves)
        # pages of whole flush units (whole groups of K and of V), so K and V pages cover the same rows
        self.page = -(-page // self.rows.unit) * self.rows.unit
        n_prefix = 0 if prefix is None else prefix[0].shape[-2]
        if n_prefix != policy.prefix_len or (prefix is not None and prefix[0].shape != prefix[1].shape):
            raise InputError(f"layer {layer}: policy {policy.name} has a prefix of {policy.prefix_len} tokens, got "
                             f"prefix rows of {n_prefix} tokens")
        # [1, H, P, D] fp16, copied (never a view of what was given); every sequence starts after them
        self.prefix = None if not n_prefix else tuple(x.detach().to(torch.float16)[None].clone() for x in prefix)
        self.dtype = torch.float32
        # SmoothAttention's lambda [H, D] float32 (None: no smoothing), on the layer's device from the first update
        # (lazy_initialization): made once, so every step's DecodeInputs carries the same tensor where the pages lie
        self.smooth = None if policy.smooth is None else policy.smooth[layer].detach().float().contiguous()
        # new rows through the CPU kernel's encoder (serving/cpu_attention.py) where it is built and takes
        # the policy; False: always the codec (a test compares the two)
        self.fast_encode = True
        self.reset()

    @property
    def window(self) -> int | None:
        return self.rows.window

    @window.setter
    def window(self, value: int | None) -> None:
        self.rows = replace(self.rows, window=value)

    @property
    def is_sliding(self) -> bool:
        return self.rows.window is not None

    @is_sliding.setter
    def is_sliding(self, value: bool) -> None:
        if bool(value) != self.is_sliding:
            raise ValueError(f"layer {self.layer}: is_sliding follows the window ({self.window}); set window instead")

    @property
    def k_block(self) -> PagedBlock | None:
        """The encoded key rows (None before any row is encoded): pages, as views of what is stored."""
        return self.k_rows.view()

    @property
    def v_block(self) -> PagedBlock | None:
        return self.v_rows.view()

    def lazy_initialization(self, key_states, value_states) -> None:
        # the layer computes where its rows arrive (under a device_map, the layer's GPU): the policy's calibrated
        # tensors are stored on CPU and moved here once
        self.device, self.dtype = key_states.device, key_states.dtype
        self.pk, self.pv = self.pk.to(self.device), self.pv.to(self.device)
        if self.smooth is not None:
            self.smooth = self.smooth.to(self.device)
        if self.prefix is not None:  # the prefix rows, one copy per sequence, as the first sink rows
            b = key_states.shape[0]
            self.sink = tuple(x.to(self.device).expand(b, -1, -1, -1).clone() for x in self.prefix)
        self.is_initialized = True

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of what the next update returns: every position, or for a sliding layer those
        from mask_offset (transformers' sliding layers: the last window - 1 positions before the new ones)."""
        offset = self.mask_offset(self.cumulative_length)
        return self.cumulative_length + query_length - offset, offset

    def mask_offset(self, history: int) -> int:
        """The first position a query at `history` (the first of a chunk) may read: 0, or for a sliding layer
        history - window + 1 (served_rows.LayerRows.visible_from)."""
        return self.rows.visible_from(history)

    def drop_before(self, pos: int) -> None:
        """Forget the rows at positions < pos -- a sliding layer's rows that left its window: the fp16 sink rows,
        whole encoded units (PagedRows.drop_before: pages freed, nothing copied) and fp16 residual rows; where
        the first row held then is, served_rows.LayerRows.keep_from says (never before the first row held)."""
        first = max(self.start, self.rows.keep_from(pos, self.cumulative_length))
        if first <= self.start:
            return
        if self.sink is not None:
            cut = first - self.start
            self.sink = None if cut >= self.sink[0].shape[2] else tuple(x[:, :, cut:] for x in self.sink)
        self.k_rows.drop_before(first)
        self.v_rows.drop_before(first)
        if self.recent is not None:
            r0 = self.cumulative_length - self.recent[0].shape[2]
            if first >= self.cumulative_length:
                self.recent = None
            elif first > r0:
                self.recent = tuple(x[:, :, first - r0:] for x in self.recent)
        self.start = first

    def end_step(self) -> None:
        """After the attention of a step read the layer: a sliding layer keeps only what the next token can read
        (served_rows.LayerRows.first_held: its last `window` positions, plus for grouped formats the rest of the
        oldest unit), so between steps it never holds more than its window."""
        self._forget_left_rows()

    def _forget_left_rows(self) -> None:
        if self.window is not None:
            self.drop_before(self.rows.first_held(self.cumulative_length))

    def nbytes(self) -> int:
        """Bytes held: the fp16 sink and residual rows and the stored blocks as measured, plus the per-layer
        static tensors as the artifact stores them (exporters.codec.static_bits)."""
        held = [t for pair in (self.sink, self.recent) if pair is not None for t in pair]
        return (sum(t.numel() * t.element_size() for t in held)
                + sum(static_bits(p) for p in (self.pk, self.pv)) // 8
                + self.k_rows.nbytes + self.v_rows.nbytes)

    def reserved_bytes(self) -> int:
        """Page capacity allocated but holding no row yet, and the value rows encoded ahead of their flush
        (_values_by_codec; not part of nbytes) as the storage they keep alive: a copy of their own, made when the
        codec encoded them, of at most the residual buffer's rows (their slices as flushes take rows from the front
        keep that copy whole until the last is taken)."""
        return self.k_rows.reserved_bytes() + self.v_rows.reserved_bytes() + _storage_bytes(self._v_ahead)

    # -- the cache ABI ----------------------------------------------------------------------------------------
    def _lambda(self) -> torch.Tensor | None:
        """lambda as [1, H, 1, D] (a view of self.smooth: no copy per flush), or None without smoothing."""
        return None if self.smooth is None else self.smooth[None, :, None, :]

    def _encode_rows(self, k: torch.Tensor, v: torch.Tensor, start: int, v_after: torch.Tensor | None = None) -> None:
        """k post-RoPE, v: [B, H, n, D] rows at positions start..start+n-1 -> the stored pages, encoded a page's
        room at a time (every format encodes rows, or whole per-channel groups, independently: the bytes are
        those of encoding all n at once). v_after: the value rows the residual buffer holds after these
        (positions start+n..), which the codec may encode ahead (_values_by_codec)."""
        lam = self._lambda()
        pre = self.policy.key_rope == "pre"
        n, a = k.shape[2], 0
        while a < n:
            room = self.k_rows.room()
            assert room == self.v_rows.room(), "K and V pages must cover the same rows"
            b = a + min(n - a, room)
            # the CPU kernel's encoder where it takes the policy (the same bytes: tests/serving/
            # test_cpu_attention.py), else the codec
            kb = vb = None
            if self.fast_encode:
                kb = cpu_attention.encode_rows(k[:, :, a:b], self.pk, start + a, self.rotary if pre else None,
                                               None if lam is None else lam[0, :, 0])
                vb = cpu_attention.encode_rows(v[:, :, a:b], self.pv, start + a)
            if kb is None:
                kp = k[:, :, a:b].float()
                if pre:
                    cos, sin = self.rope_fn(start + a, b - a, kp.device)
                    kp = invert_rope(kp, cos, sin)
                if lam is not None:
                    kp = kp / lam
                kb = store(encode(kp, self.pk, f"layer {self.layer} keys"), self.pk, start + a)
            if vb is None:
                vb = self._values_by_codec(v, a, b, start, v_after)
            self.k_rows.write(self._bound_outliers(kb, self.pk, self.k_rows))
            self.v_rows.write(self._bound_outliers(vb, self.pv, self.v_rows))
            a = b

    def _bound_outliers(self, blk: StoredBlock, p, held: PagedRows) -> StoredBlock:
        """blk (rows about to follow those `held` stores) with its sparse outliers bounded, for static per-channel
        bounds (axis channel): the side's outliers held after the write are at most ceil((1 + OUTLIER_MARGIN) x
        p.outlier_fraction x H x D x B x max(rows held after it, OUTLIER_FLOOR_ROWS)) -- the layer's sequences
        and pages pool the allowance, as the ledger counts them. Beyond it, the block's outliers farthest outside
        their channel's [lower, upper] are kept (ties in stored order) and the others dropped from the list: each
        such entry decodes as its code, the nearest bound's (the codec and the C encoder clamp an entry before
        coding it). Dropped entries are counted in stats["outliers_clamped"]. Per-token bounds (the values' rule)
        hold a bounded count per row by construction and pass unchanged; so does every block within the bound
        (honest text: see OUTLIER_MARGIN), with no tensor touched."""
        s = blk.tensors
        if p.axis != "channel" or p.outlier_fraction <= 0 or "outlier_value" not in s:
            return blk
        b, h, n, d = blk.shape
        m = int(s["outlier_value"].numel())
        cap = math.ceil((1 + OUTLIER_MARGIN) * p.outlier_fraction * h * d * b * max(held.rows + n, OUTLIER_FLOOR_ROWS))
        allow = max(0, cap - held.n_out)
        if m <= allow:
            return blk
        entry, value = s["outlier_index"].long(), s["outlier_value"].float()
        lower = p.lower.reshape(-1).to(value.device).float()[entry]
        upper = p.upper.reshape(-1).to(value.device).float()[entry]
        beyond = torch.maximum(lower - value, value - upper)            # how far outside its bound (> 0)
        keep = torch.zeros(m, dtype=torch.bool, device=value.device)
        keep[torch.sort(beyond, descending=True, stable=True).indices[:allow]] = True
        counts = s["outlier_count"]                                      # [n, B]: row t * B + b, t-major lists
        row = torch.repeat_interleave(torch.arange(n * b, device=counts.device), counts.reshape(-1).long())
        kept = torch.bincount(row[keep.to(row.device)], minlength=n * b).view(n, b).to(counts.dtype)
        self.stats["outliers_clamped"] += m - allow
        return StoredBlock(blk.start, blk.shape, {**s, "outlier_count": kept, "outlier_index": s["outlier_index"][keep],
                                                  "outlier_value": s["outlier_value"][keep]})

    def _values_by_codec(self, v: torch.Tensor, a: int, b: int, start: int, v_after: torch.Tensor | None) -> StoredBlock:
        """The stored bytes of value rows [a, b) of v (positions start + a..) by the codec: one page's room at a
        time (_encode_rows), so a long prefill is encoded page by page, never whole. Rows of a per-token format are
        encoded independently, so with the last page's rows of a flush (b == the flush's end) the rows after them,
        v_after (already in the residual buffer), are encoded in the same call -- at most a page plus the residual
        buffer's rows per codec call -- and their bytes kept (`_v_ahead`, a block by position) for the flushes to
        come: a copy of their own (never a view holding the codec's whole output alive), counted in
        reserved_bytes. A flush they cover takes its rows from there; a batch edit selects them with their
        sequences (batch_select_indices), a reset drops them. The bytes are those of encoding [a, b) alone
        (tests/serving/test_cache.py)."""
        p0, n = start + a, b - a
        ahead = self._v_ahead
        if ahead is None or not ahead.start <= p0 <= p0 + n <= ahead.start + ahead.shape[2]:
            rows = v[:, :, a:b]
            if scale_group(self.pv) == 1 and b == v.shape[2] and v_after is not None and v_after.shape[2]:
                rows = torch.cat([rows, v_after], 2)
            ahead = store(encode(rows.float(), self.pv, f"layer {self.layer} values"), self.pv, p0)
            if ahead.shape[2] > n:  # what is kept for later flushes: copied out of the codec's output
                self._v_ahead = _copy_block(slice_rows(ahead, n, ahead.shape[2], self.pv))
            else:
                self._v_ahead = None
            return slice_rows(ahead, 0, n, self.pv)
        off = p0 - ahead.start
        rest = ahead.shape[2] - off - n
        self._v_ahead = slice_rows(ahead, off + n, off + n + rest, self.pv) if rest else None
        return slice_rows(ahead, off, off + n, self.pv)

    def _flush(self) -> None:
        """Encode what the flush rule takes out of the residual buffer (served_rows.LayerRows.flush: whole units
        of K's and V's groups) and keep the rest as rows of their own (never a view of a larger chunk)."""
        k, v = self.recent
        n = k.shape[2]
        n_out = self.rows.flush(n)
        if n_out > 0:
            self._encode_rows(k[:, :, :n_out], v[:, :, :n_out], self.cumulative_length - n, v_after=v[:, :, n_out:])
        self.recent = tuple(_own(x[:, :, n_out:]) for x in (k, v))

    def update(self, key_states, value_states, *args, **kwargs):
        """Store the new rows [B, H, t, D] (post-RoPE keys). -> every cached row decoded (attention
        "materialize"), or the new rows as given (attention "blockwise": the installed attention reads the
        stored form itself)."""
        if self.attention == "blockwise" and not self.served:
            raise InputError("ArtifactCache(attention='blockwise') updated outside its attention: the model's own "
                             "attention would see the new rows only. Run the model under "
                             "serving.blockwise.serving(model, cache) or generate with "
                             "serving.blockwise.generate(...), or build the cache with attention='materialize'")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        if self.cumulative_length + t > self.max_positions:
            raise InputError(f"the cache would hold {self.cumulative_length + t} tokens, more than the model's "
                             f"{self.max_positions} positions")
        history = self.cumulative_length
        if self.window is not None:  # a sliding layer: what the first new query cannot read is dropped first
            self.drop_before(self.mask_offset(history))
        k, v = key_states.to(torch.float16), value_states.to(torch.float16)
        n_sink_left = max(0, self.rows.sink_end(history + t) - history)
        if n_sink_left:
            new = (_own(k[:, :, :n_sink_left]), _own(v[:, :, :n_sink_left]))  # copies: not views of the chunk
            self.sink = new if self.sink is None else tuple(torch.cat([a, b], 2) for a, b in zip(self.sink, new))
            k, v = k[:, :, n_sink_left:], v[:, :, n_sink_left:]
        self.cumulative_length += t
        if k.shape[2]:
            self.recent = (k, v) if self.recent is None else tuple(torch.cat([a, b], 2) for a, b in zip(self.recent, (k, v)))
            self._flush()
        if self.attention == "blockwise":  # blockwise.layer_attention ends the step (end_step) once it has read
            return key_states, value_states
        k_all, v_all = self.materialize()
        if self.window is None:
            return k_all, v_all
        cut = self.mask_offset(history) - self.start  # rows of a whole group kept before the mask's first position
        self.end_step()
        return k_all[:, :, cut:], v_all[:, :, cut:]

    # -- what transformers' Cache calls beyond update --------------------------------------------------------
    def reset(self) -> None:
        """Every stored row dropped (sink, encoded blocks, residual rows); the policy, the prefix rows and the
        model's RoPE stay, so the cache takes a new batch as if new (after the prefix, if the policy has one)."""
        self.cumulative_length = 0 if self.prefix is None else self.prefix[0].shape[2]
        self.start = 0
        self.sink = self.recent = None
        self.k_rows, self.v_rows = PagedRows(self.pk, self.page), PagedRows(self.pv, self.page)
        self._v_ahead = None      # value rows the codec encoded ahead of their flush (_values_by_codec)
        self.is_initialized = False

    def _batch(self) -> int:
        """Sequences held (0 when empty)."""
        for held in (self.sink, self.recent):
            if held is not None:
                return held[0].shape[0]
        return self.k_rows.pages()[0].shape[0] if self.k_rows.rows else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences `indices` [B'] in that order (repeats allowed): every stored row follows its
        sequence, the encoded blocks (codes, scales, zero-points, outliers) and the fp16 sink and residual rows."""
        idx = torch.as_tensor(indices).to(torch.long).flatten()
        self.sink, self.recent = (None if pair is None else tuple(take_batch(x, idx) for x in pair)
                                  for pair in (self.sink, self.recent))
        self.k_rows.select(idx)
        self.v_rows.select(idx)
        # the value rows encoded ahead follow their sequences too (per-token rows: the bytes of the rows selected),
        # so a beam-search step does not encode the residual window again
        self._v_ahead = select_batch(self._v_ahead, idx)

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
        """All cached rows decoded: post-RoPE keys and values [B, H, T, D] in the model's dtype (decoded and rotated
        in float32, rounded once here: what the model's own attention reads)."""
        ks, vs = [], []
        if self.sink is not None:
            ks.append(self.sink[0].float())
            vs.append(self.sink[1].float())
        lam = self._lambda()
        for kb, vb in zip(self.k_rows.pages(), self.v_rows.pages()):  # page by page: no joined copy of the bytes
            k = decode(load(kb, self.pk), self.pk)
            if lam is not None:
                k = k * lam
            if self.policy.key_rope == "pre":
                cos, sin = self.rope_fn(kb.start, k.shape[2], k.device)
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

    def __init__(self, policy: CachePolicy, model: torch.nn.Module, attention: str = "materialize",
                 block: int = BLOCK, prefill: str = "full", page: int = PAGE, prefix: dict | None = None):
        """attention: "materialize" (update returns every row decoded, for the model's own attention) or
        "blockwise" (serving/blockwise.py reads the stored form block by block; serve the model with
        blockwise.serving or generate). block: positions per block. prefill (blockwise): a chunk of T_q > 1
        new tokens attends to its own rows "full" -- in full precision, as engines do -- or "stored" -- as
        the cache stores them, what "materialize" gives; the history before a chunk, and every row a single
        decoded token reads, always come from the stored form. page: encoded rows per page of storage
        (PagedRows; rounded up to whole per-channel groups), the unit the capacity grows by.

        A policy with a prefix (policy.prefix_ids, PrefixQuant / IntactKV) is served after it, as the evaluation
        serves it: every layer holds the prefix's P full-precision rows at positions 0..P-1 from the start (and
        again after reset), so the first token given is at position P; get_seq_length() counts the prefix.
        prefix: the artifact's rows, {"k", "v": [L, H, P, D] post-RoPE} (runtime_check.check.artifact_prefix),
        or None: computed by one forward of the prefix ids alone (stages.prefix_tokens.prefix_kv, as the
        artifact's were). A prefix given for a policy without one is refused."""
        if attention not in ATTENTION_MODES:
            raise InputError(f"ArtifactCache: attention must be one of {ATTENTION_MODES}, got {attention!r}")
        if prefill not in PREFILL_MODES:
            raise InputError(f"ArtifactCache: prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise InputError(f"ArtifactCache: block must be a positive int of positions, got {block!r}")
        if isinstance(page, bool) or not isinstance(page, int) or page < 1:
            raise InputError(f"ArtifactCache: page must be a positive int of rows, got {page!r}")
        self.attention, self.block, self.prefill = attention, block, prefill
        cpu_attention.available()  # the fused CPU kernel loaded (or the reason it is not said) at start-up, not mid-step
        # the block-wise attention's own accounting: its largest float32 working set so far (bytes)
        self.stats = {"largest_decode_temporary_bytes": 0, "largest_prefill_temporary_bytes": 0}
        # sparse outliers beyond what a layer holds of them, left clamped to their bound (OUTLIER_MARGIN): every
        # layer adds to this count
        self.stats["outliers_clamped"] = 0
        for i, (pk, pv) in enumerate(policy.layers):  # evaluation-only formats: no stored layout here
            check_exportable(pk, f"ArtifactCache: layer {i} keys", "key")
            check_exportable(pv, f"ArtifactCache: layer {i} values", "value")
        bind(policy, model.config)  # before any kernel sees a tensor of it
        from stages.hooks import layer_windows, model_rotaries

        def rope_fn_of(rotary):
            def rope_fn(start: int, n: int, device: torch.device):
                """cos, sin [n, D] float32 at positions start.. (exporters.rope's convention, whatever the model's
                dtype), computed on the rotary module's device, on `device`."""
                cos, sin = rotary_tables(rotary, start, n)
                return cos[0].to(device), sin[0].to(device)
            return rope_fn

        max_positions = int(model.config.max_position_embeddings)
        # each layer's own RoPE (local and global layers may rotate differently) and window (None: global)
        rotaries, windows = model_rotaries(model), layer_windows(model.config)
        rows = prefix_rows(policy, model, prefix)
        super().__init__(layers=[ArtifactLayer(i, policy, rope_fn_of(rotaries[i]), max_positions, rotaries[i],
                                               attention, page, window=windows[i],
                                               prefix=None if rows is None else (rows[0][i], rows[1][i]),
                                               stats=self.stats)
                                 for i in range(len(policy.layers))])

    @property
    def prefix_ids(self) -> torch.Tensor | None:
        """The ids [P] every sequence is served after (None without a prefix): generation passes them first."""
        ids = self.layers[0].policy.prefix_ids
        return None if ids is None or ids.numel() == 0 else ids

    @property
    def served(self) -> bool:
        return all(layer.served for layer in self.layers)

    @served.setter
    def served(self, value: bool) -> None:
        for layer in self.layers:
            layer.served = bool(value)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def accounting(self) -> dict[str, int]:
        """Bytes held, split by kind (HELD_KINDS; their sum is nbytes()): packed codes (or fp8 / fp16 encoded
        rows), scales and zero-points, sparse outliers (values, indices, per-row counts), fp16 sink and residual
        rows, the per-layer static tensors. Not part of the sum: reserved_capacity_bytes, the pages' capacity
        allocated but holding nothing (the unused rows of each layer's last K and V page, every page's unused
        outlier slots: PagedRows) and the value rows encoded ahead of their flush (ArtifactLayer.reserved_bytes),
        the block-wise attention's largest working set so far in a decode step and in a prefill chunk
        (largest_*_temporary_bytes), and outliers_clamped: sparse outliers beyond a layer's bound, left clamped
        to their channel's bound (a count, not bytes; OUTLIER_MARGIN)."""
        out = dict.fromkeys(HELD_KINDS, 0)
        for layer in self.layers:
            for block in (*layer.k_rows.pages(), *layer.v_rows.pages()):
                for name, t in block.tensors.items():
                    kind = {"dense": "codes", "codes": "codes", "scale": "scales_zero_points",
                            "zero": "scales_zero_points"}.get(name, "outliers")
                    out[kind] += t.numel() * t.element_size()
            for kind, pair in (("sink", layer.sink), ("residual", layer.recent)):
                if pair is not None:
                    out[kind] += sum(t.numel() * t.element_size() for t in pair)
            out["static"] += sum(static_bits(p) for p in (layer.pk, layer.pv)) // 8
        out["reserved_capacity_bytes"] = sum(layer.reserved_bytes() for layer in self.layers)
        return out | {k: int(v) for k, v in self.stats.items()}

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError(_NO_OFFLOAD)

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError(_NO_PREFETCH)


def bind(policy: CachePolicy, config) -> None:
    """Refuse (InputError) a policy the model of `config` cannot be served with, before any kernel reads it: an
    artifact's policy (policy.model, exporters.manifest.model_binding) must state exactly the model's binding
    (stages.hooks.config_binding: layers, heads, head_dim, RoPE, sliding layers, positions; numbers by value), the
    difference named (ModelMismatchError); and every policy, an artifact's or one built in memory, must hold
    calibrated tensors of the model's shapes -- the layer count, exporters.layout.calibrated_shape (zero / range /
    lower / upper [H_kv, D], fp8_scale [] or [H_kv], codebook [2^bits]), smooth [L, H_kv, D] -- and the tensors its
    format needs (TensorPolicy.validate): the CPU kernel reads H_kv x D entries of each, whatever was given. A
    policy storing sparse outliers needs n_kv_heads * head_dim <= exporters.layout.MAX_ROW_ENTRIES, and its prefix
    ids must be the model's tokens."""
    from exporters.manifest import ModelMismatchError, json_difference
    from stages.hooks import config_binding

    served = config_binding(config)
    if policy.model is not None and (found := json_difference(policy.model, served, "")):
        path, ours, theirs = found
        raise ModelMismatchError(f"ArtifactCache: the artifact was calibrated for a model with model/{path[1:]}="
                                 f"{ours!r}; the model given has {path[1:]}={theirs!r}")
    n_layers, h, d = served["n_layers"], served["n_kv_heads"], served["head_dim"]
    if len(policy.layers) != n_layers:
        raise InputError(f"artifact has {len(policy.layers)} layers, the model {n_layers}")
    for i, pair in enumerate(policy.layers):
        for side, p in zip(("keys", "values"), pair):
            where = f"ArtifactCache: layer {i} {side}"
            p.validate(where)
            if p.outlier_fraction > 0:  # int16 outlier indices h * D + d (exporters.layout.MAX_ROW_ENTRIES)
                check_row_entries(h, d, where)
            for name, t in p.calibrated().items():
                shape = calibrated_shape(p, name, h, d)
                if tuple(t.shape) != shape:
                    raise InputError(f"{where}: {name} has shape {list(t.shape)}; the model given (n_kv_heads={h}, "
                                     f"head_dim={d}) needs {list(shape)}")
    if policy.smooth is not None and tuple(policy.smooth.shape) != (n_layers, h, d):
        raise InputError(f"ArtifactCache: smooth has shape {list(policy.smooth.shape)}; the model given needs "
                         f"[n_layers={n_layers}, n_kv_heads={h}, head_dim={d}]")
    ids = policy.prefix_ids
    if ids is not None and ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < config.vocab_size:
        raise InputError(f"ArtifactCache: prefix token ids must be in [0, {config.vocab_size}) (the model's "
                         f"vocabulary), got ids from {int(ids.min())} to {int(ids.max())}")


def prefix_rows(policy: CachePolicy, model: torch.nn.Module, prefix: dict | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The prefix rows a cache serving `policy` starts with: (K, V) [L, H, P, D] post-RoPE, from `prefix` (the
    artifact's, {"k", "v"}) or computed from the model over policy.prefix_ids; None for a policy without one."""
    if policy.prefix_len == 0:
        if prefix is not None:
            raise InputError(f"ArtifactCache: policy {policy.name} has no prefix (prefix_len 0), got prefix rows of "
                             f"{prefix['k'].shape[-2]} tokens")
        return None
    from stages.hooks import config_binding

    served = config_binding(model.config)
    h, d = served["n_kv_heads"], served["head_dim"]
    if prefix is None:
        from types import SimpleNamespace

        from stages.prefix_tokens import prefix_kv

        spec = SimpleNamespace(n_layers=served["n_layers"], n_kv_heads=h, head_dim=d)
        prefix = prefix_kv(model, spec, policy.prefix_ids)
        prefix = {"k": prefix["k_post"], "v": prefix["v"]}
    k, v = prefix["k"], prefix["v"]
    want = (len(policy.layers), h, policy.prefix_len, d)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise InputError(f"ArtifactCache: prefix rows must be K, V [n_layers={want[0]}, n_kv_heads={h}, "
                         f"P={want[2]}, head_dim={d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    return k, v


def _copy_block(block: StoredBlock) -> StoredBlock:
    """The block's rows in tensors of their own (contiguous copies): nothing of a larger block stays alive."""
    return StoredBlock(block.start, block.shape,
                       {k: t.clone(memory_format=torch.contiguous_format) for k, t in block.tensors.items()})


def _storage_bytes(block: StoredBlock | None) -> int:
    """Bytes of the storages a block's tensors live in, each counted once (0 for None)."""
    if block is None:
        return 0
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in block.tensors.values()}.values())


def _own(x: torch.Tensor) -> torch.Tensor:
    """x itself when it is the whole of its storage, else a contiguous copy: rows the cache keeps never hold a
    larger tensor alive (the prefill chunk they were cut from)."""
    if x.is_contiguous() and x.untyped_storage().nbytes() == x.numel() * x.element_size():
        return x
    return x.clone(memory_format=torch.contiguous_format)


def check_batch(attention_mask: torch.Tensor | None) -> None:
    """Rows of one batch must have equal lengths: positions (and so RoPE) are shared by the whole batch."""
    if attention_mask is not None and not bool(attention_mask.all()):
        lengths = attention_mask.sum(-1).tolist()
        raise InputError(f"ArtifactCache needs a batch of equal-length rows (no padding); got lengths {lengths}")


def from_layer(layer: ArtifactLayer, q: torch.Tensor, scaling: float, rotary: torch.nn.Module) -> DecodeInputs:
    """The inputs for decoding against one ArtifactLayer; q: [B, H_q, D] post-RoPE. Everything it carries lies on
    the layer's device, lambda included (the layer's own copy, made once: ArtifactLayer.smooth) -- a lambda left
    on the host made a GPU kernel copy the whole inputs over (serving.inputs.inputs_to), so every page was laid out
    again at every step (serving/pages.py keeps a page's layout by the page object)."""
    return DecodeInputs(q=q.float().contiguous(), scaling=float(scaling), key_policy=layer.pk, value_policy=layer.pv,
                        key_rope=layer.policy.key_rope, rotary=rotary, sink=layer.sink, k_block=layer.k_block,
                        v_block=layer.v_block, recent=layer.recent, smooth=layer.smooth, start=layer.start)
