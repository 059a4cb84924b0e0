"""The byte ledger: bytes a cache in the exported format holds for a sequence of T tokens (seed 000 0x04).

Matches runtime_check/cache.py's layout exactly (sink rows fp16, residual rows fp16, packed codes, fp16
per-token / per-group scales and zero-points, sparse outliers at 4 bytes each + a 2-byte count per token row,
per-layer static tensors in float32); the outlier count is the only data-dependent term and uses the expected
fraction measured on evaluation text (manifest `outliers.expected_fraction`).
"""
from __future__ import annotations

import math

from exporters.codec import CachePolicy, TensorPolicy


def full_precision_rows(policy: CachePolicy, p: TensorPolicy, t: int) -> int:
    """Rows held in fp16 at length t: sinks, plus the residual buffer after the cache's flush rule.
    p is the layer's key policy: K and V rows leave the buffer together, in key groups."""
    sink = min(policy.n_sink, t)
    rest = t - sink
    r = policy.residual
    g = p.group_size if (p.format == "uniform" and p.axis == "channel") else 1
    flushed = ((rest - r) // g) * g if rest - r >= g else 0
    return sink + rest - flushed


def tensor_bytes(policy: CachePolicy, p: TensorPolicy, t: int, h: int, d: int, batch: int = 1,
                 outlier_fraction: float | None = None, key_policy: TensorPolicy | None = None) -> float:
    """One layer's K or V at length t."""
    n_fp = full_precision_rows(policy, key_policy or p, t)
    n_q = t - n_fp
    static = sum(x.numel() * 4 for x in (p.codebook, p.zero, p.range, p.lower, p.upper, p.fp8_scale) if x is not None)
    total = batch * h * n_fp * d * 2 + static
    if p.format == "fp16":
        return total + batch * h * n_q * d * 2
    if p.format == "fp8":
        return total + batch * h * n_q * d
    total += batch * h * n_q * math.ceil(d * p.bits / 8)
    if p.axis == "token":
        total += batch * h * n_q * 2 * 2                       # fp16 scale + zero per (token, head)
    elif p.format == "uniform":
        total += batch * h * (n_q // max(p.group_size, 1)) * d * 2 * 2  # per group of tokens and channel
    if p.outlier_fraction > 0:
        frac = p.outlier_fraction if outlier_fraction is None else outlier_fraction
        total += batch * n_q * 2 + frac * batch * h * n_q * d * 4
    return total


def predict_bytes(policy: CachePolicy, t: int, h: int, d: int, batch: int = 1,
                  expected: list[tuple[float | None, float | None]] | None = None) -> float:
    total = 0.0
    for i, (pk, pv) in enumerate(policy.layers):
        ek, ev = expected[i] if expected else (None, None)
        total += tensor_bytes(policy, pk, t, h, d, batch, ek) + tensor_bytes(policy, pv, t, h, d, batch, ev, key_policy=pk)
    return total


def expected_outliers(manifest: dict) -> list[tuple[float | None, float | None]]:
    return [(layer["key"]["outliers"].get("expected_fraction"), layer["value"]["outliers"].get("expected_fraction"))
            for layer in manifest["layers"]]
