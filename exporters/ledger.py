"""The byte ledger: bytes a cache in the exported format holds for a sequence of T tokens.

Matches runtime_check/cache.py's layout exactly: sink and residual rows in fp16, the encoded rows and the
per-layer static tensors as the codec's size model counts them (exporters.codec.stored_bits / static_bits:
packed codes, fp16 per-token / per-group scales and zero-points, sparse outliers at 4 bytes each + a 2-byte
count per token row, static tensors in float32). The outlier count is the only data-dependent term and uses the
expected fraction measured on evaluation text (manifest `outliers.expected_fraction`). A sliding-window (local)
layer holds only its last `window` positions (the cache drops the rest: fp16 sink rows one by one, encoded rows in
whole groups of K's and V's per-channel groups), so its bytes stop growing at the window.
"""
from __future__ import annotations

import math

import torch

from exporters.codec import CachePolicy, TensorPolicy, dense_bits, full_precision_bits, sparse_bits, static_bits


def key_group(p: TensorPolicy) -> int:
    """Rows that leave the residual buffer together: the key's per-channel group (KIVI), else 1."""
    return p.group_size if (p.format == "uniform" and p.axis == "channel") else 1


def recent_rows(rest, residual: int, group: int):
    """The residual buffer's rows once `rest` rows have arrived after the sinks, by the cache's flush rule: rows
    leave in whole groups once the buffer holds residual + group rows (group 1: the last `residual` stay).
    rest: an int, or an integer tensor (elementwise, e.g. one entry per decoded position)."""
    over = rest - residual
    if isinstance(over, torch.Tensor):
        return rest - torch.where(over >= group, (over // group) * group, torch.zeros_like(over))
    return rest - ((over // group) * group if over >= group else 0)


def full_precision_rows(policy: CachePolicy, p: TensorPolicy, t: int) -> int:
    """Rows held in fp16 at length t: sinks, plus the residual buffer after the cache's flush rule.
    p is the layer's key policy: K and V rows leave the buffer together, in key groups."""
    sink = min(policy.n_sink, t)
    return sink + recent_rows(t - sink, policy.residual, key_group(p))


def held_rows(policy: CachePolicy, key_policy: TensorPolicy, t: int, window: int | None = None,
              group: int = 1) -> tuple[int, int]:
    """(fp16 rows, encoded rows) one layer holds at length t: sink and residual rows in fp16, the rest encoded; a
    sliding layer (window) only the positions >= t - window -- sink rows exactly, encoded rows from the start of
    their group (group: the lcm of K's and V's per-channel groups), residual rows all (the cache refuses a window
    below residual + key group, so they always fit)."""
    sink = min(policy.n_sink, t)
    recent = recent_rows(t - sink, policy.residual, key_group(key_policy))
    encoded_end = t - recent
    if window is None or t <= window:
        return sink + recent, encoded_end - sink
    lo = t - window
    first = sink + (lo - sink) // group * group if sink <= lo < encoded_end else lo
    return max(0, sink - first) + recent - max(0, first - encoded_end), max(0, encoded_end - max(sink, first))


def tensor_bytes(policy: CachePolicy, p: TensorPolicy, t: int, h: int, d: int, batch: int = 1,
                 outlier_fraction: float | None = None, key_policy: TensorPolicy | None = None,
                 window: int | None = None, group: int = 1) -> float:
    """One layer's K or V at length t (window, group: a sliding layer's, see held_rows)."""
    n_fp, n_q = held_rows(policy, key_policy or p, t, window, group)
    groups = n_q // max(p.group_size, 1)          # per-channel groups: the cache encodes whole groups only
    frac = p.outlier_fraction if outlier_fraction is None else outlier_fraction
    exact = static_bits(p) + full_precision_bits(batch, h, n_fp, d) + dense_bits(p, batch, h, n_q, d, n_groups=groups)
    sparse = sparse_bits(p, batch, n_q, frac * batch * h * n_q * d)   # expected outliers: may be fractional
    # whole bytes first, the fractional outlier term last
    return exact // 8 + (sparse // 8 if isinstance(sparse, int) else sparse / 8)


def predict_bytes(policy: CachePolicy, t: int, h: int, d: int, batch: int = 1,
                  expected: list[tuple[float | None, float | None]] | None = None,
                  windows: list[int | None] | None = None) -> float:
    """Every layer's K and V at length t; windows: per layer a sliding layer's window or None (default: all global,
    e.g. from the manifest: layer_windows)."""
    total = 0.0
    for i, (pk, pv) in enumerate(policy.layers):
        ek, ev = expected[i] if expected else (None, None)
        w = windows[i] if windows else None
        g = math.lcm(key_group(pk), key_group(pv))
        total += (tensor_bytes(policy, pk, t, h, d, batch, ek, window=w, group=g)
                  + tensor_bytes(policy, pv, t, h, d, batch, ev, key_policy=pk, window=w, group=g))
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
