"""The stored byte layout of the cache: what a runtime holds for one layer's encoded K or V rows, the ABI that
docs/manifest.md ("Runtime storage and the byte ledger") describes and exporters/ledger.py's size model predicts.

A run of encoded rows [start, start + n) is a StoredBlock (`store`): the codec's output (exporters/codec.py) as
bytes -- codes packed `ceil(D * b / 8)` bytes per (token, head) row (pack_codes), or fp8 / fp16 rows as `dense`;
per-token scales and zero-points [B, H, n, 1] or per-channel group ones [B, H, ceil(n / G), D] in fp16; sparse
outliers as `outlier_count` [n, B] int16 per token row (row t * B + b), then the t-major list of their
`outlier_index` (int16, h * D + d within the row) and `outlier_value` (fp16). Rows are held in pages (PagedRows,
PagedBlock): each page is laid out as `store` lays out its rows alone, and the pages joined are the one block of
all the rows. Slicing rows out of a block (`slice_rows`), gathering sequences (`select_batch`) and loading it back
into the codec's form (`load`) read only this layout. Which rows are encoded at all is exporters/served_rows.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.codec import Encoded, TensorPolicy, pack_codes, unpack_codes
from exporters.errors import InputError
from exporters.served_rows import scale_group

PAGE = 2048                          # encoded rows per page of a layer's stored K or V (see PagedRows)
# the most entries a (token, sequence) row of H * D may have where sparse outliers are stored: their indices
# h * D + d are int16, so H * D <= 32767 keeps every index in range (and 32767 itself beyond every index: the empty
# entry of exporters/vllm_slots.py, SENTINEL). The C encoder's wrapper and the manifest's cross-checks refuse the same.
MAX_ROW_ENTRIES = 0x7FFF


def check_row_entries(n_kv_heads: int, head_dim: int, where: str) -> None:
    """Refuse (InputError) a row of n_kv_heads * head_dim entries whose int16 outlier indices would wrap."""
    if n_kv_heads * head_dim > MAX_ROW_ENTRIES:
        raise InputError(f"{where}: sparse outliers are stored with int16 indices h * head_dim + d, so n_kv_heads * "
                         f"head_dim must be at most {MAX_ROW_ENTRIES}; got n_kv_heads={n_kv_heads} * "
                         f"head_dim={head_dim} = {n_kv_heads * head_dim}")


def calibrated_shape(p: TensorPolicy, name: str, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape of a policy's calibrated tensor `name` (exporters.codec.CALIBRATED_FIELDS) for a model of n_kv_heads
    heads of head_dim channels, as a runtime reads it: codebook [2^bits], fp8_scale [] (axis tensor) or [H_kv]
    (axis head), rotation_signs [b] (b = head_dim & -head_dim, the rotation's block), zero / range / lower /
    upper [H_kv, D]."""
    return {"codebook": (2 ** p.bits,), "fp8_scale": () if p.axis == "tensor" else (n_kv_heads,),
            "rotation_signs": (head_dim & -head_dim,)}.get(name, (n_kv_heads, head_dim))


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
    """The codec's output for rows [start, start + n) laid out as stored (see the module docstring). Refuses
    (InputError) sparse outliers of a row longer than MAX_ROW_ENTRIES: their int16 indices would wrap."""
    b, h, t, d = e.shape
    if p.outlier_fraction > 0:
        check_row_entries(h, d, "store")
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
    """Rows per entry of a stored tensor along its growing axis: a per-channel group's scale covers its group."""
    return scale_group(p) if name in ("scale", "zero") else 1


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
    and the page's own t-major outlier list). Readers that care about size iterate `pages` (serving/
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
        if "outlier_index" in blk.tensors:  # a block not made by store (the C encoder's) is held to the same limit
            check_row_entries(blk.shape[1], blk.shape[3], "PagedRows.write")
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
    g = scale_group(p)
    if a % g:
        raise ValueError(f"slice_rows: per-channel groups of {g} rows: a slice must start on a group boundary, got "
                         f"row {a}")
    for name in ("scale", "zero"):
        if name in s:
            out[name] = s[name][:, :, a // g:-(-b // g)]
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


def take_batch(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
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
    out = {k: take_batch(v, idx) for k, v in block.tensors.items() if _GROW_DIM[k] == 2}  # the [B, H, T, ...] ones
    if "outlier_count" in block.tensors:
        counts = block.tensors["outlier_count"].long().cpu().flatten()    # [T * B], t-major
        starts = torch.cumsum(counts, 0) - counts
        src = (torch.arange(t)[:, None] * b + idx[None, :]).flatten()    # [T * B']: old row of each new row
        n = counts[src]
        first = torch.cumsum(n, 0) - n
        pos = (starts[src].repeat_interleave(n) + torch.arange(int(n.sum())) - first.repeat_interleave(n))
        out["outlier_count"] = n.view(t, idx.numel()).to(torch.int16).to(block.tensors["outlier_count"].device)
        out["outlier_index"] = take_batch(block.tensors["outlier_index"], pos)
        out["outlier_value"] = take_batch(block.tensors["outlier_value"], pos)
    return StoredBlock(block.start, (idx.numel(), h, t, d), out)
