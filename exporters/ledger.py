"""The byte ledger: bytes a cache in the exported format holds for a sequence of T tokens, and the bits an
evaluated cache held (Ledger).

Which rows are held, and in which form, is exporters/served_rows.py's (sink and prefix rows, the residual buffer
and its flush in whole units of K's and V's groups, a sliding layer's window); the bytes of those rows are
exporters/layout.py's, as the codec's size model counts them (exporters.codec.stored_bits / static_bits: packed
codes, fp16 per-token / per-group scales and zero-points, sparse outliers at 4 bytes each + a 2-byte count per
token row, static tensors in float32), and sink and residual rows are fp16. The outlier count is the only
data-dependent term and uses the expected fraction measured on evaluation text (manifest
`outliers.expected_fraction`). A sliding-window (local) layer holds only its last `window` positions (encoded
rows leave in whole units), so its bytes stop growing at the window.
"""
from __future__ import annotations

import math

from exporters.codec import (FULL_PRECISION_BITS, CachePolicy, Encoded, TensorPolicy, dense_bits, encoded_bits,
                             full_precision_bits, sparse_bits, static_bits)
from exporters.served_rows import LayerRows, layer_rows


def tensor_bytes(rows: LayerRows, p: TensorPolicy, t: int, h: int, d: int, batch: int = 1,
                 outlier_fraction: float | None = None) -> float:
    """One layer's K or V (policy p) at length t, the layer's rows served as `rows` says."""
    held = rows.held(t)
    n_fp, n_q = held.n_full_precision, held.n_encoded
    groups = n_q // max(p.group_size, 1)          # per-channel groups: the cache encodes whole groups only
    frac = p.outlier_fraction if outlier_fraction is None else outlier_fraction
    exact = static_bits(p) + full_precision_bits(batch, h, n_fp, d) + dense_bits(p, batch, h, n_q, d, n_groups=groups)
    sparse = sparse_bits(p, batch, n_q, frac * batch * h * n_q * d)   # expected outliers: may be fractional
    # whole bytes first, the fractional outlier term last
    return exact // 8 + (sparse // 8 if isinstance(sparse, int) else sparse / 8)


def layer_bytes(rows: LayerRows, key_policy: TensorPolicy, value_policy: TensorPolicy, t: int, h: int, d: int,
                batch: int = 1, expected: tuple[float | None, float | None] = (None, None)) -> float:
    """One layer's K and V at length t (expected: their measured outlier fractions, None: the policy's)."""
    return (tensor_bytes(rows, key_policy, t, h, d, batch, expected[0])
            + tensor_bytes(rows, value_policy, t, h, d, batch, expected[1]))


def predict_bytes(policy: CachePolicy, t: int, h: int, d: int, batch: int = 1,
                  expected: list[tuple[float | None, float | None]] | None = None,
                  windows: list[int | None] | None = None) -> float:
    """Every layer's K and V at length t; windows: per layer a sliding layer's window or None (default: all global,
    e.g. from the manifest: layer_windows)."""
    total = 0.0
    for i, (pk, pv) in enumerate(policy.layers):
        rows = layer_rows(policy, i, windows[i] if windows else None)
        total += layer_bytes(rows, pk, pv, t, h, d, batch, expected[i] if expected else (None, None))
    return total


def layer_windows(manifest: dict) -> list[int | None]:
    """Per layer the sliding window (None: global) a manifest's model.attention states (all global without it)."""
    attention = manifest["model"].get("attention")
    if not attention:
        return [None] * manifest["model"]["n_layers"]
    return [attention["sliding_window"] if t == "sliding" else None for t in attention["layer_types"]]


def expected_outliers(manifest: dict) -> list[tuple[float | None, float | None]]:
    return [(layer["key"]["outliers"].get("expected_fraction"), layer["value"]["outliers"].get("expected_fraction"))
            for layer in manifest["layers"]]


class Ledger:
    """The bits an evaluated cache held, summed over layers and windows: per layer, K's and V's encoded rows at
    the bits the codec's size model gives the rows it encoded (scaled to the rows the cache held encoded), fp16
    sink and residual rows at 16 bits, the static tensors once -- over every cached element. Sparse outliers are
    counted over the tensors that store them only (an fp16 layer of a mixed policy has none and is no part of the
    fraction), so `outlier_fraction` is the figure the manifest's `expected_fraction` of those tensors means."""

    def __init__(self):
        self.bits = 0.0
        self.elements = 0
        self.outliers = {"k": 0, "v": 0}
        self.encoded = {"k": 0, "v": 0}   # elements encoded by tensors that store outliers (the denominator)

    def add(self, kind: str, e: Encoded, p: TensorPolicy, rows_q: int, rows_full: int, per_row: int) -> None:
        """One layer's K (kind "k") or V ("v"): e the codec's encoding of its rows past the sinks, of which the
        cache held rows_q encoded; rows_full rows in fp16; per_row elements per row (B x H x D)."""
        encoded_rows = e.shape[2]
        if encoded_rows:
            self.bits += encoded_bits(e, p) * rows_q / encoded_rows
        self.bits += FULL_PRECISION_BITS * rows_full * per_row + static_bits(p)
        self.elements += (rows_q + rows_full) * per_row
        if p.outlier_fraction > 0:
            self.outliers[kind] += e.n_outliers
            self.encoded[kind] += math.prod(e.shape)

    def outlier_fraction(self, kind: str) -> float:
        """Stored sparse outliers per element encoded, over the tensors of `kind` that store outliers (0 if none)."""
        return self.outliers[kind] / max(1, self.encoded[kind])

    @property
    def avg_bits(self) -> float:
        return self.bits / max(1, self.elements)
