"""Per-channel pre-RoPE key zero-point and range (KVQuant, Hooper et al. 2024, sec. 3.1-3.2 and 3.4).

Per (layer, KV head, channel), from the calibration rows (stages/calibration_rows.py) with the first `n_sink`
positions of every sample excluded (the attention sink is kept in full precision and would stretch the range):
lower / upper = the f/2 and 1 - f/2 quantiles (f = outlier fraction; f = 0: min / max),
zero = (upper + lower) / 2, range = (upper - lower) / 2, so inliers map to [-1, 1].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exporters.codec import MAX_OUTLIER_FRACTION
from stages.base import InputError, StageResult, check_finite
from stages.base import Context, Declaration
from stages.calibration_rows import CalibGroup, CalibrationRows, group_rows


@dataclass
class KeyScalesConfig:
    outlier_fraction: float = 0.0


def fit(inputs: CalibrationRows, cfg: KeyScalesConfig) -> StageResult:
    """inputs.keys: [S, n_layers, H_kv, D] rows in the space the recipe quantizes."""
    f = cfg.outlier_fraction
    if not 0.0 <= f <= MAX_OUTLIER_FRACTION:
        raise InputError(f"outlier_fraction must be in [0, {MAX_OUTLIER_FRACTION}], got {f}")
    x = inputs.keys[inputs.kept()].float()
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
                       {"outlier_fraction": f, "n_sink": inputs.n_sink, "rows": int(x.shape[0]),
                        "constant_channels": constant})


def _fit_stage(ctx: Context, inputs: dict, g: CalibGroup, progress) -> StageResult:
    return fit(group_rows(ctx.model, inputs, g), KeyScalesConfig(outlier_fraction=g.fraction))


STAGE = Declaration("key_scales", CalibGroup, _fit_stage, inputs=lambda g: [g.traces, *g.extra],
                    suffix=lambda g: g.suffix)
