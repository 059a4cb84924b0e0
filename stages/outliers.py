"""Dense-and-sparse outlier policy (KVQuant, Hooper et al. 2024, sec. 3.4).

Keys: static per-channel thresholds from calibration (the key_scales bounds); entries outside are stored
sparse in fp16. Values: a rule applied at encode time, per token over all KV heads, at the f/2 and
1 - f/2 quantiles of that token (exporters.codec.token_outlier_bounds). This stage fixes the thresholds and
reports the sparse fraction on the calibration rows; evaluation reports it on the evaluation text.
"""
from __future__ import annotations

import torch

from dataclasses import dataclass

from exporters.codec import token_outlier_bounds
from stages.base import StageResult
from stages.base import Context, Declaration
from stages.calibration_rows import CalibGroup, CalibrationRows, group_rows


@dataclass
class OutliersConfig:
    fraction: float = 0.0       # sparse fraction: keys outside [lower, upper], values per the token rule


@dataclass
class Inputs:
    rows: CalibrationRows
    lower: torch.Tensor         # [L, H, D] static key bounds (the key_scales stage)
    upper: torch.Tensor


def fit(inputs: Inputs, cfg: OutliersConfig) -> StageResult:
    """-> the static key thresholds and the sparse fractions measured on the calibration rows."""
    rows, lower, upper, fraction = inputs.rows, inputs.lower, inputs.upper, cfg.fraction
    kept = rows.kept()
    k, v = rows.keys[kept].float(), rows.values[kept].float()
    k_frac = float(((k < lower) | (k > upper)).float().mean()) if fraction > 0 else 0.0
    v_frac = 0.0
    if fraction > 0:
        counts = 0
        for layer in range(v.shape[1]):
            x = v[:, layer].permute(1, 0, 2)[None]  # [1, H, S, D]: reservoir rows as tokens
            lo, hi = token_outlier_bounds(x, fraction)
            counts += int(((x < lo) | (x > hi)).sum())
        v_frac = counts / v.numel()
    return StageResult({"k_lower": lower.clone(), "k_upper": upper.clone()},
                       {"configured_fraction": fraction, "calib_fraction_k": k_frac, "calib_fraction_v": v_frac,
                        "v_rule": "per token over all KV heads, quantiles f/2 and 1-f/2"})


def _fit_stage(ctx: Context, inputs: dict, g: CalibGroup, progress) -> StageResult:
    s = inputs[f"key_scales-{g.suffix}"].tensors
    return fit(Inputs(group_rows(ctx.model, inputs, g), s["lower"], s["upper"]), OutliersConfig(fraction=g.fraction))


STAGE = Declaration("outliers", CalibGroup, _fit_stage,
                    inputs=lambda g: [g.traces, f"key_scales-{g.suffix}", *g.extra], suffix=lambda g: g.suffix)
