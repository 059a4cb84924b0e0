"""A transformers Cache that holds K/V in the exported format and decodes through exporters.codec.

Storage per layer: sink rows (fp16), encoded rows (codes packed into bytes, fp16 scales / zero-points, sparse
outliers as fp16 values + int16 in-row indices + int16 per-row counts; fp8 or fp16 rows for those formats), and
a full-precision residual buffer. The encoded rows of K and of V are held in pages of `page` rows (PagedRows;
K and V pages cover the same rows): each page is a StoredBlock laid out as docs/manifest.md describes the cache,
for its own rows (its outlier counts and t-major outlier list included); full pages are never touched again
and the last is a preallocated buffer the new rows are copied into, so storing a row copies that row only and
no second copy of the history is ever made. `layer.k_block` / `v_block` view the pages (PagedBlock).
Keys arrive post-RoPE (transformers 5 passes no cos/sin to Cache.update); for a pre-RoPE artifact the cache
inverts RoPE at the stored positions with the model's own rotary module before encoding and re-applies it after
decoding. SmoothAttention: the cache stores K / lambda and multiplies back.

Flushing: per-token formats encode every row that leaves the residual window; per-channel groups (KIVI) encode
`group_size` rows at a time once the buffer holds residual + group_size rows.

Beyond `update`, the cache does what transformers' generation asks of it: `reset` (empty, reusable),
`reorder_cache` / `batch_select_indices` / `batch_repeat_interleave` (beam search: every stored row, encoded or
fp16, follows its sequence), `crop(0)`. What it cannot do faithfully it refuses by name (NotImplementedError):
`crop` of any tokens (flushed rows cannot return to the residual window) and `offload` / `prefetch`.

Two ways to serve it (`ArtifactCache(..., attention=...)`):
- "materialize" (the default for a cache built directly): `update` returns every cached row decoded
  (`ArtifactLayer.materialize`), [B, H, T, D] in the model's dtype, for the model's own attention.
- "blockwise": `update` stores the new rows and returns them alone; the attention is runtime_check/blockwise.py's,
  which reads the stored form one block of positions at a time, so no full-precision copy of the history is
  ever made. It must be installed: `runtime_check.blockwise.serving(model, cache)` (a context manager) or
  `generate(...)` below (whose default it is); a block-wise cache updated without it refuses (InputError).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from exporters.codec import (CachePolicy, Encoded, TensorPolicy, check_exportable, decode, encode, pack_codes,
                            static_bits, unpack_codes)
from exporters.ledger import key_group
from exporters.rope import apply_rope, invert_rope, rotary_tables
from stages.base import InputError

ATTENTION_MODES = ("blockwise", "materialize")
HELD_KINDS = ("codes", "scales_zero_points", "outliers", "sink", "residual", "static")  # accounting(): sum = nbytes
PREFILL_MODES = ("full", "stored")   # what a chunk of T_q > 1 new tokens reads for its own rows (blockwise)
BLOCK = 2048                         # positions per block of the block-wise attention
PAGE = 2048                          # encoded rows per page of a layer's stored K or V (see PagedRows)


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
_OUTLIER_LISTS = ("outlier_index", "outlier_value")  # flat, t-major: as long as the rows' outliers, not the rows


def _rows_per_entry(name: str, p: TensorPolicy) -> int:
    """Rows per entry of a stored tensor along its growing axis: a per-channel group's scale covers group_size."""
    if name in ("scale", "zero") and p.format == "uniform" and p.axis == "channel":
        return p.group_size
    return 1


def join(blocks) -> StoredBlock:
    """Consecutive runs of rows as the one block `store` gives for all of them (one torch.cat per tensor: a copy of
    every row, for readers where size does not matter -- the oracle, the runtime check, a test)."""
    blocks = list(blocks)
    if len(blocks) == 1:
        return blocks[0]
    first, (b, h, _, d) = blocks[0], blocks[0].shape
    for prev, nxt in zip(blocks, blocks[1:]):
        assert nxt.start == prev.start + prev.shape[2], "blocks must be contiguous"
    tensors = {k: torch.cat([blk.tensors[k] for blk in blocks], _GROW_DIM[k]) for k in first.tensors}
    return StoredBlock(first.start, (b, h, sum(blk.shape[2] for blk in blocks), d), tensors)


def append(block: StoredBlock | None, new: StoredBlock) -> StoredBlock:
    """Rows [start, start+n) followed by the next rows, as one block (a copy of both: see `join`; the cache itself
    never appends this way, see PagedRows)."""
    return new if block is None else join([block, new])


@dataclass(frozen=True)
class PagedBlock:
    """One layer's encoded K or V rows as consecutive pages, each a StoredBlock laid out as `store` lays out its
    rows alone (docs/manifest.md's layout, per page: codes, scales / zero-points or groups, outlier counts [T_q, B]
    and the page's own t-major outlier list). Readers that care about size iterate `pages` (runtime_check/
    blockwise.py, the Triton kernel's decode_attention); `start`, `shape`, `nbytes` describe the whole, and
    `tensors` is the whole as one block (`join`: a copy, for the oracle and checks)."""
    pages: tuple[StoredBlock, ...]

    @property
    def start(self) -> int:
        return self.pages[0].start

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self.pages[0].shape
        return b, h, sum(p.shape[2] for p in self.pages), d

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pages)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return join(self.pages).tensors


def pages_of(block: StoredBlock | PagedBlock | None) -> tuple[StoredBlock, ...]:
    """The pages of a stored side in position order: a PagedBlock's pages, a plain StoredBlock as its one page."""
    if block is None:
        return ()
    return block.pages if isinstance(block, PagedBlock) else (block,)


def reserved_bytes(blocks) -> int:
    """Bytes the tensors' storages hold beyond the rows the blocks describe (the unused capacity of a page
    buffer), each storage counted once."""
    storages: dict[int, int] = {}
    used = 0
    for blk in blocks:
        for t in blk.tensors.values():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            used += t.numel() * t.element_size()
    return sum(storages.values()) - used


OUTLIER_SLACK = 1.25  # a page's outlier capacity: its rows x the expected per-row count (running rate) x this


class _OpenPage:
    """The page rows are being appended to: capacity buffers [B, H, cap, ...] (per-channel groups: cap / G
    entries), outlier counts [cap, B] and outlier lists of `out_cap` entries, filled in place from row 0."""

    def __init__(self, first: StoredBlock, p: TensorPolicy, cap: int, out_cap: int):
        b, h, _, d = first.shape
        self.p, self.start, self.b, self.h, self.d = p, first.start, b, h, d
        self.cap, self.rows, self.n_out = cap, 0, 0
        self.skip = 0  # leading rows forgotten (a sliding-window layer's rows that left the window: drop_before)
        self.buf: dict[str, torch.Tensor] = {}
        for name, t in first.tensors.items():
            if name in _OUTLIER_LISTS:
                size = (out_cap,)
            elif name == "outlier_count":
                size = (cap, t.shape[1])
            else:
                size = (*t.shape[:2], cap // _rows_per_entry(name, p), *t.shape[3:])
            self.buf[name] = torch.empty(size, dtype=t.dtype, device=t.device)

    @property
    def out_cap(self) -> int:
        return self.buf["outlier_value"].numel() if "outlier_value" in self.buf else 0

    def room(self) -> int:
        return self.cap - self.rows

    def write(self, blk: StoredBlock) -> None:
        """blk's rows after the rows held: every tensor copied into its slot, nothing held moves -- except, when
        blk's outliers overflow the page's outlier capacity, the page's own outlier lists (a copy bounded by
        one page: never of another page)."""
        n = blk.shape[2]
        if blk.start != self.start + self.rows or n > self.room() or blk.shape[:2] != (self.b, self.h):
            raise ValueError(f"page at {self.start} holding {self.rows}/{self.cap} rows of batch {self.b}: cannot "
                             f"take {n} rows at {blk.start} of batch {blk.shape[0]}")
        s = blk.tensors
        if any(self.rows % _rows_per_entry(name, self.p) for name in s):
            raise ValueError(f"page at {self.start}: {self.rows} rows held, not whole groups of {self.p.group_size}: "
                             f"per-channel groups must be appended whole")
        m = int(s["outlier_value"].numel()) if "outlier_value" in s else 0
        if self.n_out + m > self.out_cap:
            grow = max(2 * self.out_cap, self.n_out + m)
            for name in _OUTLIER_LISTS:
                old = self.buf[name]
                self.buf[name] = torch.empty(grow, dtype=old.dtype, device=old.device)
                self.buf[name][:self.n_out].copy_(old[:self.n_out])
        for name, t in s.items():
            if name in _OUTLIER_LISTS:
                self.buf[name][self.n_out:self.n_out + m].copy_(t)
            elif name == "outlier_count":
                self.buf[name][self.rows:self.rows + n].copy_(t)
            else:
                a = self.rows // _rows_per_entry(name, self.p)
                self.buf[name][:, :, a:a + t.shape[2]].copy_(t)
        self.rows += n
        self.n_out += m

    def view(self) -> StoredBlock:
        """The rows held, as `store` lays them out: views of the buffers (no copy)."""
        out = {}
        for name, t in self.buf.items():
            if name in _OUTLIER_LISTS:
                out[name] = t[:self.n_out]
            elif name == "outlier_count":
                out[name] = t[:self.rows]
            else:
                out[name] = t[:, :, :-(-self.rows // _rows_per_entry(name, self.p))]
        full = StoredBlock(self.start, (self.b, self.h, self.rows, self.d), out)
        return slice_rows(full, self.skip, self.rows, self.p) if self.skip else full


class PagedRows:
    """One layer's encoded K (or V) rows, in pages of `page` rows: full pages are never touched again, the last
    page is a preallocated buffer that rows are copied into, so appending rows copies only the new rows and never
    holds a second copy of the stored ones. Capacity grows one page at a time; `reserved_bytes` is the capacity
    allocated but holding nothing: the open page's unused rows, and every page's unused outlier slots (a page's
    outlier lists are sized at opening from the rate seen so far, OUTLIER_SLACK above it; on overflow the open
    page's lists alone move to a buffer twice as large)."""

    def __init__(self, p: TensorPolicy, page: int):
        self.p, self.page = p, page
        self.sealed: list[StoredBlock] = []       # full pages, as views of their buffers
        self.open: _OpenPage | None = None
        self.rows = self.n_out = 0                 # held in all pages
        self.end: int | None = None                # position after the last row written

    def room(self) -> int:
        """Rows the open page still takes (a whole page when none is open)."""
        return self.page if self.open is None else self.open.room()

    def _out_capacity(self, blk: StoredBlock) -> int:
        """Outlier slots of a new page: its rows x the per-(token, sequence)-row count expected -- the larger of
        the policy's fraction of the row's H*D entries and the rate seen so far, blk included -- x the slack."""
        if "outlier_value" not in blk.tensors:
            return 0
        b, h, n, d = blk.shape
        m = int(blk.tensors["outlier_value"].numel())
        rate = max(self.p.outlier_fraction * h * d, (self.n_out + m) / (b * (self.rows + n)))
        return max(m, int(OUTLIER_SLACK * rate * b * self.page) + 1)

    def write(self, blk: StoredBlock) -> None:
        """blk (at most room() rows, following the rows held) into the open page; a full page is sealed."""
        if self.end is not None and blk.start != self.end:
            raise ValueError(f"rows must be appended in order: {self.rows} rows held up to position "
                             f"{self.end}, got rows at {blk.start}")
        if self.open is None:
            self.open = _OpenPage(blk, self.p, self.page, self._out_capacity(blk))
        self.open.write(blk)
        self.rows += blk.shape[2]
        self.end = blk.start + blk.shape[2]
        self.n_out += int(blk.tensors["outlier_value"].numel()) if "outlier_value" in blk.tensors else 0
        if self.open.room() == 0:
            self.sealed.append(self.open.view())
            self.open = None

    def first(self) -> int | None:
        """Position of the first row held (None when none is)."""
        pages = self.pages()
        return pages[0].start if pages else None

    def drop_before(self, pos: int) -> None:
        """Forget the rows at positions < pos (a sliding-window layer's rows that left its window), copying nothing:
        pages wholly before pos go (their buffers freed once no reader holds them), the first page left is viewed
        from pos on (slice_rows: pos must start a per-channel group of the page). Rows of a page that is kept stay
        in its buffer until the whole page goes (reserved_bytes counts them), never in nbytes or a reader's view."""
        while self.sealed and self.sealed[0].start + self.sealed[0].shape[2] <= pos:
            self.sealed.pop(0)
        if self.sealed and self.sealed[0].start < pos:
            first = self.sealed[0]
            self.sealed[0] = slice_rows(first, pos - first.start, first.shape[2], self.p)
        elif not self.sealed and self.open is not None:
            self.open.skip = max(self.open.skip, min(pos - self.open.start, self.open.rows))
            if self.open.skip == self.open.rows:
                self.open = None  # every row it held left: the next rows open a new page
        pages = self.pages()
        self.rows = sum(p.shape[2] for p in pages)
        self.n_out = sum(n_outliers(p) for p in pages)

    def pages(self) -> tuple[StoredBlock, ...]:
        return (*self.sealed, *(() if self.open is None else (self.open.view(),)))

    def view(self) -> PagedBlock | None:
        pages = self.pages()
        return PagedBlock(pages) if pages else None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pages())

    def reserved_bytes(self) -> int:
        return reserved_bytes(self.pages())

    def select(self, idx: torch.Tensor) -> None:
        """Keep the sequences idx (see select_batch), page by page in place: one page is gathered at a time, so
        the old and the new form coexist for one page only (and for nothing a reader still holds)."""
        for i, page in enumerate(self.sealed):
            self.sealed[i] = select_batch(page, idx)
        if self.open is not None:
            held = select_batch(self.open.view(), idx)
            self.open = _OpenPage(held, self.p, self.page, self._out_capacity(held))
            self.open.write(held)
        self.n_out = sum(n_outliers(p) for p in self.pages())


def n_outliers(block: StoredBlock | PagedBlock) -> int:
    """Sparse outliers the block (every page of it) stores (0 for a format without them)."""
    if isinstance(block, PagedBlock):
        return sum(n_outliers(p) for p in block.pages)
    values = block.tensors.get("outlier_value")
    return 0 if values is None else int(values.numel())


def slice_rows(block: StoredBlock, a: int, b: int, p: TensorPolicy, outlier_start: int | None = None) -> StoredBlock:
    """Rows [a, b) of the block (block-relative), as `store` lays out those rows alone: views of the packed codes /
    dense rows and of the per-token scales, the per-channel groups covering the rows (a must start a group:
    a % group_size == 0; a partial last group is decoded only as far as b), and the sparse outliers of those
    rows -- a contiguous run of the t-major outlier list, from the prefix sum of the per-row counts.
    outlier_start: outliers stored in rows [0, a) when the caller already knows it (a running sum over
    consecutive slices), else summed here. Nothing is decoded or copied beyond the outlier counts' sum."""
    bsz, h, t, d = block.shape
    if not 0 <= a <= b <= t:
        raise ValueError(f"slice_rows: rows [{a}, {b}) are not within the block's {t} rows")
    s = block.tensors
    out: dict[str, torch.Tensor] = {}
    for name in ("dense", "codes"):
        if name in s:
            out[name] = s[name][:, :, a:b]
    grouped = p.format == "uniform" and p.axis == "channel"
    if grouped and a % p.group_size:
        raise ValueError(f"slice_rows: per-channel groups of {p.group_size} rows: a slice must start on a group "
                         f"boundary, got row {a}")
    for name in ("scale", "zero"):
        if name in s:
            out[name] = s[name][:, :, a // p.group_size:-(-b // p.group_size)] if grouped else s[name][:, :, a:b]
    if "outlier_count" in s:
        counts = s["outlier_count"]                                          # [T, B]: row t * B + b
        lo = int(counts[:a].sum()) if outlier_start is None else int(outlier_start)
        n = int(counts[a:b].sum())
        out["outlier_count"] = counts[a:b]
        out["outlier_index"] = s["outlier_index"][lo:lo + n]
        out["outlier_value"] = s["outlier_value"][lo:lo + n]
    return StoredBlock(block.start + a, (bsz, h, b - a, d), out)


def outlier_coordinates(block: StoredBlock) -> tuple[torch.Tensor, ...]:
    """The stored sparse outliers' (batch, head, row, channel) indices, long [N] each, in their stored order:
    counts per row t-major (row = t * B + b), each outlier's index within its row h * D + d (see `store`)."""
    b, h, t, d = block.shape
    s = block.tensors
    counts = s["outlier_count"].long().flatten()              # [T * B], t-major
    row = torch.repeat_interleave(torch.arange(b * t, device=counts.device), counts)
    in_row = s["outlier_index"].long()
    return row % b, in_row // d, row // b, in_row % d


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
        e.outlier_index = torch.stack(outlier_coordinates(block), dim=1)
        e.outlier_value = s["outlier_value"]
    return e


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t's entries idx along dim 0 (float8 moved as bytes: index_select need not support the type)."""
    idx = idx.to(t.device)
    if t.is_floating_point() and t.element_size() == 1:
        return t.view(torch.uint8).index_select(0, idx).view(t.dtype)
    return t.index_select(0, idx)


def select_batch(block: StoredBlock | PagedBlock | None, idx: torch.Tensor) -> StoredBlock | PagedBlock | None:
    """The block of the sequences idx [B'] (any order, repeats allowed): the block `store` gives for the batch
    x[idx] (a PagedBlock: page by page). Codes, dense rows, scales and zero-points carry the batch in dim 0; sparse
    outliers are a flat list in row order (row = t * B + b, see `store`), so whole rows of it are gathered in the
    new order."""
    if block is None:
        return None
    if isinstance(block, PagedBlock):
        return PagedBlock(tuple(select_batch(p, idx) for p in block.pages))
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

    def __init__(self, layer: int, policy: CachePolicy, rope_fn, max_positions: int, rotary=None,
                 attention: str = "materialize", page: int = PAGE, window: int | None = None):
        """window: a sliding-window (local) layer's window -- it holds the last `window` positions only (see
        drop_before) -- or None for a global layer."""
        super().__init__()
        self.layer, self.policy, self.rope_fn, self.max_positions = layer, policy, rope_fn, max_positions
        self.rotary = rotary                 # the model's rotary module (the block-wise attention's RoPE tables)
        self.attention = attention           # "materialize" | "blockwise" (see the module docstring)
        self.served = False                  # blockwise: the block-wise attention is installed (blockwise.serving)
        self.pk, self.pv = policy.layers[layer]
        self.cumulative_length = 0
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None       # post-RoPE K, V rows (fp16)
        self.recent: tuple[torch.Tensor, torch.Tensor] | None = None     # post-RoPE K, V rows (fp16)
        # pages of whole per-channel groups of both K and V, so K and V pages cover the same rows
        groups = math.lcm(key_group(self.pk), key_group(self.pv))
        self.group = groups                  # rows leave a sliding window in these units (whole groups)
        self.window = window
        self.is_sliding = window is not None
        self.start = 0                       # position of the first row held (> 0 once rows left the window)
        if window is not None:
            if window < 1:
                raise InputError(f"layer {layer}: sliding window must be >= 1, got {window}")
            if window < policy.residual + key_group(self.pk):  # the residual buffer itself must fit the window
                raise InputError(f"layer {layer}: a sliding window of {window} positions cannot hold the residual "
                                 f"buffer of {policy.residual} rows plus a key group of {key_group(self.pk)}; "
                                 f"allowed: residual + group <= window, got {policy.residual} + "
                                 f"{key_group(self.pk)} > {window}")
            page = min(page, window)  # a local layer's pages are at most a window (freed as the window moves)
        self.page = -(-page // groups) * groups
        self.k_rows, self.v_rows = PagedRows(self.pk, self.page), PagedRows(self.pv, self.page)
        self.dtype = torch.float32

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
        history - window + 1."""
        return 0 if self.window is None else max(0, history - self.window + 1)

    def _keep_from(self, pos: int) -> int:
        """The first position held once the rows before `pos` are dropped: pos itself in the fp16 sink or residual
        rows, rounded down to a whole group (self.group) within the encoded rows, which are encoded and sliced in
        groups (docs/manifest.md); never before the first position held."""
        if pos <= self.start:
            return self.start
        if self.sink is not None and pos < self.start + self.sink[0].shape[2]:
            return pos
        first = self.k_rows.first()
        if first is not None and pos < first + self.k_rows.rows:
            return first + (pos - first) // self.group * self.group
        return min(pos, self.cumulative_length)

    def drop_before(self, pos: int) -> None:
        """Forget the rows at positions < pos -- a sliding layer's rows that left its window: the fp16 sink rows,
        whole encoded groups (PagedRows.drop_before: pages freed, nothing copied) and fp16 residual rows."""
        first = self._keep_from(pos)
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
        """After the attention of a step read the layer: a sliding layer keeps its last `window` positions only
        (what the newest token attended), so between steps it never holds more than its window (plus, for
        per-channel key groups, the rest of the oldest group)."""
        if self.window is not None:
            self.drop_before(self.cumulative_length - self.window)

    def nbytes(self) -> int:
        """Bytes held: the fp16 sink and residual rows and the stored blocks as measured, plus the per-layer
        static tensors as the artifact stores them (exporters.codec.static_bits)."""
        held = [t for pair in (self.sink, self.recent) if pair is not None for t in pair]
        return (sum(t.numel() * t.element_size() for t in held)
                + sum(static_bits(p) for p in (self.pk, self.pv)) // 8
                + self.k_rows.nbytes + self.v_rows.nbytes)

    def reserved_bytes(self) -> int:
        """Page capacity allocated but holding no row yet (not part of nbytes)."""
        return self.k_rows.reserved_bytes() + self.v_rows.reserved_bytes()

    # -- the cache ABI ----------------------------------------------------------------------------------------
    def _lambda(self) -> torch.Tensor | None:
        if self.policy.smooth is None:
            return None
        return self.policy.smooth[self.layer].float().to(self.device)[None, :, None, :]

    def _encode_rows(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k post-RoPE, v: [B, H, n, D] rows at positions start..start+n-1 -> the stored pages, encoded a page's
        room at a time (every format encodes rows, or whole per-channel groups, independently: the bytes are
        those of encoding all n at once)."""
        lam = self._lambda()
        n, a = k.shape[2], 0
        while a < n:
            room = self.k_rows.room()
            assert room == self.v_rows.room(), "K and V pages must cover the same rows"
            b = a + min(n - a, room)
            kp = k[:, :, a:b].float()
            if self.policy.key_rope == "pre":
                cos, sin = self.rope_fn(start + a, b - a, kp.device)
                kp = invert_rope(kp, cos, sin)
            if lam is not None:
                kp = kp / lam
            self.k_rows.write(store(encode(kp, self.pk, f"layer {self.layer} keys"), self.pk, start + a))
            self.v_rows.write(store(encode(v[:, :, a:b].float(), self.pv, f"layer {self.layer} values"), self.pv,
                                    start + a))
            a = b

    def _flush(self) -> None:
        k, v = self.recent
        n = k.shape[2]
        r = self.policy.residual
        g = key_group(self.pk)
        n_out = ((n - r) // g) * g if n - r >= g else 0
        if n_out <= 0:
            return
        start = self.cumulative_length - n
        self._encode_rows(k[:, :, :n_out], v[:, :, :n_out], start)
        self.recent = (k[:, :, n_out:], v[:, :, n_out:])

    def update(self, key_states, value_states, *args, **kwargs):
        """Store the new rows [B, H, t, D] (post-RoPE keys). -> every cached row decoded (attention
        "materialize"), or the new rows as given (attention "blockwise": the installed attention reads the
        stored form itself)."""
        if self.attention == "blockwise" and not self.served:
            raise InputError("ArtifactCache(attention='blockwise') updated outside its attention: the model's own "
                             "attention would see the new rows only. Run the model under "
                             "runtime_check.blockwise.serving(model, cache) or generate with "
                             "runtime_check.cache.generate(...), or build the cache with attention='materialize'")
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
        """Every stored row dropped (sink, encoded blocks, residual rows); the policy and the model's RoPE stay,
        so the cache takes a new batch as if new."""
        self.cumulative_length = 0
        self.start = 0
        self.sink = self.recent = None
        self.k_rows, self.v_rows = PagedRows(self.pk, self.page), PagedRows(self.pv, self.page)
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
        self.sink, self.recent = (None if pair is None else tuple(_take(x, idx) for x in pair)
                                  for pair in (self.sink, self.recent))
        self.k_rows.select(idx)
        self.v_rows.select(idx)

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
                 block: int = BLOCK, prefill: str = "full", page: int = PAGE):
        """attention: "materialize" (update returns every row decoded, for the model's own attention) or
        "blockwise" (runtime_check/blockwise.py reads the stored form block by block; serve the model with
        blockwise.serving or generate). block: positions per block. prefill (blockwise): a chunk of T_q > 1
        new tokens attends to its own rows "full" -- in full precision, as engines do -- or "stored" -- as
        the cache stores them, what "materialize" gives; the history before a chunk, and every row a single
        decoded token reads, always come from the stored form. page: encoded rows per page of storage
        (PagedRows; rounded up to whole per-channel groups), the unit the capacity grows by."""
        if attention not in ATTENTION_MODES:
            raise InputError(f"ArtifactCache: attention must be one of {ATTENTION_MODES}, got {attention!r}")
        if prefill not in PREFILL_MODES:
            raise InputError(f"ArtifactCache: prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise InputError(f"ArtifactCache: block must be a positive int of positions, got {block!r}")
        if isinstance(page, bool) or not isinstance(page, int) or page < 1:
            raise InputError(f"ArtifactCache: page must be a positive int of rows, got {page!r}")
        self.attention, self.block, self.prefill = attention, block, prefill
        # the block-wise attention's own accounting: its largest float32 working set so far (bytes)
        self.stats = {"largest_decode_temporary_bytes": 0, "largest_prefill_temporary_bytes": 0}
        for i, (pk, pv) in enumerate(policy.layers):  # evaluation-only formats: no stored layout here
            check_exportable(pk, f"ArtifactCache: layer {i} keys")
            check_exportable(pv, f"ArtifactCache: layer {i} values")
        from stages.hooks import layer_windows, model_rotaries

        dtype = next(model.parameters()).dtype

        def rope_fn_of(rotary):
            def rope_fn(start: int, n: int, device: torch.device):
                """cos, sin [n, D] float32 at positions start.., computed on the rotary module's device, on `device`."""
                cos, sin = rotary_tables(rotary, start, n, dtype)
                return cos[0].float().to(device), sin[0].float().to(device)
            return rope_fn

        max_positions = int(model.config.max_position_embeddings)
        if len(policy.layers) != model.config.num_hidden_layers:
            raise InputError(f"artifact has {len(policy.layers)} layers, the model {model.config.num_hidden_layers}")
        # each layer's own RoPE (local and global layers may rotate differently) and window (None: global)
        rotaries, windows = model_rotaries(model), layer_windows(model.config)
        super().__init__(layers=[ArtifactLayer(i, policy, rope_fn_of(rotaries[i]), max_positions, rotaries[i],
                                               attention, page, window=windows[i])
                                 for i in range(len(policy.layers))])

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
        outlier slots: PagedRows), and the block-wise
        attention's largest working set so far in a decode step and in a prefill chunk
        (largest_*_temporary_bytes)."""
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


def check_batch(attention_mask: torch.Tensor | None) -> None:
    """Rows of one batch must have equal lengths: positions (and so RoPE) are shared by the whole batch."""
    if attention_mask is not None and not bool(attention_mask.all()):
        lengths = attention_mask.sum(-1).tolist()
        raise InputError(f"ArtifactCache needs a batch of equal-length rows (no padding); got lengths {lengths}")


def generate(model, policy: CachePolicy, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             attention: str = "blockwise", block: int = BLOCK, prefill: str = "full", page: int = PAGE,
             **kwargs) -> tuple[torch.Tensor, ArtifactCache]:
    """Generation (greedy, sampling, beam search) with the artifact's cache; refuses padded batches instead of
    mis-rotating them. attention="blockwise" (default) serves it with the block-wise attention
    (runtime_check/blockwise.py: no decoded copy of the history); "materialize" with the model's own attention
    over every row decoded. block, prefill, page: see ArtifactCache."""
    check_batch(attention_mask)
    cache = ArtifactCache(policy, model, attention=attention, block=block, prefill=prefill, page=page)
    if attention == "materialize":
        return model.generate(input_ids, attention_mask=attention_mask, cache=cache, **kwargs), cache
    from runtime_check.blockwise import serving  # blockwise imports this module

    with serving(model, cache):
        out = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **kwargs)
    return out, cache
