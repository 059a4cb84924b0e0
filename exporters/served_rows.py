"""Which rows a served cache holds at every step: the one definition that the evaluation (stages/evaluate.py),
the serving cache (serving/cache.py), the block-wise reader (serving/blockwise.py) and the byte
ledger (exporters/ledger.py) read, so that what is evaluated is what is served by construction.

One layer of a cache that has received t positions (0..t-1) holds, in position order (docs/manifest.md,
"Residual window and sinks"):

- sink rows [0, min(S, t)) in fp16, S = max(n_sink, prefix_len): a prefix's P rows are the first sink rows;
- encoded rows [S, e(t)) through the codec (exporters/codec.py), in the layout of exporters/layout.py;
- residual rows [e(t), t) in fp16, received but not yet flushed.

Flush rule. Rows after the sinks enter the residual buffer; once it holds at least R + U rows (R = residual), the
oldest whole units of U rows are encoded, so between R and R + U - 1 rows stay recent (U = 1: exactly R). The
unit U is the least common multiple of the key's and the value's scale groups (`scale_group`: group_size for
uniform per-channel groups, 1 for every per-token or static format), so every flush encodes whole groups of K
and whole groups of V from position S on, and K and V leave the buffer together (their pages cover the same
rows). For KIVI (per-channel keys, per-token values) U is the key's group, as it has always been.

Sliding-window layers (window W). A query at position q reads positions q - W + 1 .. q. Between steps a layer of
length t > W holds the positions from lo = t - W on, except that encoded rows leave in whole units (a group's
scale stays until its last row leaves; the rows of it before lo are never attended), while sink and residual
rows leave one by one. The residual buffer always fits the window: W >= R + U (`LayerRows.min_window`).

Everything here is plain arithmetic on ints (or elementwise on integer tensors where noted): no torch module,
no state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from exporters.codec import CachePolicy, TensorPolicy


def scale_group(p: TensorPolicy) -> int:
    """Consecutive rows that share one scale entry and so are encoded, flushed and dropped together: a per-channel
    uniform tensor's group_size (KIVI), 1 for every other format (per-token scales, static per-channel ranges,
    fp8 and fp16 rows)."""
    return p.group_size if p.is_grouped else 1


def flush_unit(key_policy: TensorPolicy, value_policy: TensorPolicy) -> int:
    """Rows that leave the residual buffer together, and the step every encoded run of rows starts on: whole key
    groups and whole value groups (the lcm of their scale groups)."""
    return math.lcm(scale_group(key_policy), scale_group(value_policy))


@dataclass(frozen=True)
class Held:
    """The positions one layer holds at length `end`, from `start` on (> 0 once a sliding layer's first rows have
    left), each part a half-open span: sink [min(start, sink_end), sink_end), encoded [encoded_start,
    encoded_end), residual [residual_start, end); a part may be empty."""
    start: int
    sink_end: int
    encoded_start: int
    encoded_end: int
    residual_start: int
    end: int

    @property
    def n_sink(self) -> int:
        return max(0, self.sink_end - self.start)

    @property
    def n_encoded(self) -> int:
        return self.encoded_end - self.encoded_start

    @property
    def n_residual(self) -> int:
        return self.end - self.residual_start

    @property
    def n_full_precision(self) -> int:
        """Rows held in fp16: sink and residual rows."""
        return self.n_sink + self.n_residual


@dataclass(frozen=True)
class LayerRows:
    """The served rows of one layer: its sinks, residual buffer, key and value scale groups and window."""
    n_sink: int                    # first positions kept in fp16: max(policy.n_sink, policy.prefix_len)
    residual: int                  # the residual buffer's rows (R)
    key_group: int = 1             # scale_group of the layer's key policy
    value_group: int = 1           # scale_group of the layer's value policy
    window: int | None = None      # a sliding-window layer's window (W), None for a global layer

    def __post_init__(self):
        for name in ("n_sink", "residual"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerRows.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("key_group", "value_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"LayerRows.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def unit(self) -> int:
        """Rows that leave the residual buffer together: whole key groups and whole value groups (their lcm)."""
        return math.lcm(self.key_group, self.value_group)

    @property
    def min_window(self) -> int:
        """The smallest sliding window that holds the residual buffer at its fullest (R + U - 1 rows) and the
        newest row's query."""
        return self.residual + self.unit

    @property
    def holds_back(self) -> bool:
        """Whether a row past the sinks ever waits in fp16 before it is encoded (a residual buffer, or units of
        more than one row)."""
        return self.residual > 0 or self.unit > 1

    def sink_end(self, t: int) -> int:
        """Sink rows once t positions have arrived (positions 0..sink_end-1)."""
        return min(self.n_sink, t)

    def recent(self, rest):
        """Residual rows once `rest` rows have arrived after the sinks, by the flush rule: rows leave in whole
        units once the buffer holds residual + unit rows (unit 1: the last `residual` stay). rest: an int, or an
        integer tensor (elementwise, e.g. one entry per decoded position). Applied to the rows a buffer holds
        now plus new ones, it gives what the buffer keeps after flushing (recent(recent(a) + b) == recent(a + b))."""
        over = rest - self.residual
        g = self.unit
        if isinstance(over, torch.Tensor):
            return rest - torch.where(over >= g, (over // g) * g, torch.zeros_like(over))
        return rest - ((over // g) * g if over >= g else 0)

    def encoded_end(self, t):
        """The position after the last encoded row at length t: the first residual row. t: an int, or an integer
        tensor (elementwise: per query q, the cache that query reads has length q + 1)."""
        if isinstance(t, torch.Tensor):
            s = t.clamp(max=self.n_sink)
        else:
            s = self.sink_end(t)
        return t - self.recent(t - s)

    def flush(self, buffered: int) -> int:
        """Of the `buffered` rows in the residual buffer, how many the next flush encodes (a multiple of unit)."""
        return buffered - self.recent(buffered)

    def visible_from(self, q: int) -> int:
        """The first position a query at position q reads: 0, or for a sliding layer q - window + 1."""
        return visible_from(q, self.window)

    def keep_from(self, pos: int, t: int) -> int:
        """The first position held at length t once the rows before `pos` are dropped: pos itself in the sink or
        residual rows, rounded down to a whole unit from the first encoded row within the encoded rows."""
        if pos <= 0:
            return 0
        s = self.sink_end(t)
        if pos < s:
            return pos
        if pos < self.encoded_end(t):
            return s + (pos - s) // self.unit * self.unit
        return min(pos, t)

    def first_held(self, t: int) -> int:
        """The first position held between steps at length t: 0 for a global layer, the window's first position
        (rounded down to a whole unit within the encoded rows) for a sliding one."""
        return 0 if self.window is None else self.keep_from(t - self.window, t)

    def held(self, t: int, start: int | None = None) -> Held:
        """What the layer holds at length t from position `start` on (default: between steps, first_held(t))."""
        first = self.first_held(t) if start is None else start
        s, e = self.sink_end(t), self.encoded_end(t)
        return Held(start=first, sink_end=s, encoded_start=max(s, first), encoded_end=max(e, first),
                    residual_start=max(e, first), end=t)


def visible_from(q: int, window: int | None) -> int:
    """The first position a query at position q reads on a layer with sliding window `window` (None: global): 0, or
    q - window + 1 (transformers' sliding mask)."""
    return 0 if window is None else max(0, q - window + 1)


def layer_rows(policy: CachePolicy, layer: int, window: int | None = None) -> LayerRows:
    """The served rows of `policy`'s layer `layer` (window: that layer's sliding window, None if global)."""
    pk, pv = policy.layers[layer]
    return LayerRows(n_sink=max(policy.n_sink, policy.prefix_len), residual=policy.residual,
                     key_group=scale_group(pk), value_group=scale_group(pv), window=window)
