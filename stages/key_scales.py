"""Per-channel pre-RoPE key zero-point and range (KVQuant, Hooper et al. 2024, sec. 3.1-3.2 and 3.4).

Per (layer, KV head, channel), from the reservoir rows of the traces stage with the first `n_sink` positions
of every sample excluded (the attention sink is kept in full precision and would stretch the range):
lower / upper = the f/2 and 1 - f/2 quantiles (f = outlier fraction; f = 0: min / max),
zero = (upper + lower) / 2, range = (upper - lower) / 2, so inliers map to [-1, 1].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.codec import MAX_OUTLIER_FRACTION
from stages.base import StageResult, check_finite


@dataclass
class KeyScalesConfig:
    outlier_fraction: float = 0.0
    n_sink: int = 1


def sink_free_rows(res_pos: torch.Tensor, n_sink: int) -> torch.Tensor:
    keep = (res_pos >= n_sink).nonzero().flatten()
    if keep.numel() == 0:
        raise ValueError(f"no reservoir rows left after excluding the first n_sink={n_sink} positions")
    return keep


def fit(keys: torch.Tensor, res_pos: torch.Tensor, cfg: KeyScalesConfig) -> StageResult:
    """keys: [S, n_layers, H_kv, D] reservoir rows (pre-RoPE, smoothed if smoothing is on)."""
    f = cfg.outlier_fraction
    if not 0.0 <= f <= MAX_OUTLIER_FRACTION:
        raise ValueError(f"outlier_fraction must be in [0, {MAX_OUTLIER_FRACTION}], got {f}")
    x = keys[sink_free_rows(res_pos, cfg.n_sink)].float()
    for layer in range(x.shape[1]):
        check_finite(x[:, layer], f"calibration keys of layer {layer}")
    if f == 0:
        lower, upper = x.amin(0), x.amax(0)
    else:
        q = torch.tensor([f / 2, 1 - f / 2])
        lower, upper = torch.quantile(x.flatten(1), q, dim=0).view(2, *x.shape[1:]).unbind(0)
    zero, rng = (upper + lower) / 2, (upper - lower) / 2
    constant = int((rng == 0).sum())
    return StageResult({"lower": lower, "upper": upper, "zero": zero, "range": rng},
                       {"outlier_fraction": f, "n_sink": cfg.n_sink, "rows": int(x.shape[0]),
                        "constant_channels": constant})
