"""A recipe (conf/quant) plus calibration results -> the per-layer cache policy that evaluation and export use."""
from __future__ import annotations

import torch

from exporters.codec import CachePolicy, CodecError, TensorPolicy, fp8_scale_from_amax
from pipeline.config import QuantConfig, TensorQuantConfig

KEY_ROPE = ("pre", "post")


def needs_calibration(q: QuantConfig) -> bool:
    return q.key.format == "nuq" or q.value.format == "nuq"


def _validate_recipe(q: QuantConfig) -> None:
    for kind in ("key", "value"):
        t = getattr(q, kind)
        TensorPolicy(format=t.format, bits=t.bits, axis=t.axis, group_size=t.group_size,
                     outlier_fraction=t.outlier_fraction, fp8_dtype=t.fp8_dtype).validate_config(f"quant.{kind}")
    if q.key_rope not in KEY_ROPE:
        raise CodecError(f"quant.key_rope must be one of {KEY_ROPE}, got {q.key_rope!r}")
    for name in ("n_sink", "residual"):
        if getattr(q, name) < 0:
            raise CodecError(f"quant.{name} must be >= 0, got {getattr(q, name)}")
    g = q.key.group_size if (q.key.format == "uniform" and q.key.axis == "channel") else 0
    if q.residual and g and q.residual % g:
        raise CodecError(f"quant.residual={q.residual} must be a multiple of the key group size "
                         f"quant.key.group_size={g}")


def _tensor_policy(t: TensorQuantConfig, layer: int, kind: str, calib: dict) -> TensorPolicy:
    p = TensorPolicy(format=t.format, bits=t.bits, axis=t.axis, group_size=t.group_size,
                     outlier_fraction=t.outlier_fraction, fp8_dtype=t.fp8_dtype)
    if t.format == "nuq":
        p.codebook = calib[f"{kind}_codebook_{t.bits}"][layer]
    if t.format == "nuq" and t.axis == "channel":
        p.zero, p.range = calib["zero"][layer], calib["range"][layer]
    if t.axis == "channel" and t.outlier_fraction > 0:
        p.lower, p.upper = calib["lower"][layer], calib["upper"][layer]
    if t.format == "fp8":
        amax = calib[f"{kind}_absmax"][layer]  # [H, D]
        p.fp8_scale = fp8_scale_from_amax(amax.amax() if t.axis == "tensor" else amax.amax(-1), t.fp8_dtype)
    p.validate(f"quant.{'key' if kind == 'k' else 'value'} (layer {layer})")
    return p


def build(q: QuantConfig, n_layers: int, calib: dict[str, torch.Tensor]) -> CachePolicy:
    """calib: tensors by name -- k_absmax / v_absmax [L, H, D] (fp8), zero / range / lower / upper [L, H, D]
    (static keys), k_codebook_B / v_codebook_B [L, 2^B] (nuq), smooth [L, H, D] (quant.smooth), prefix_ids [P]
    (quant.prefix). Only what the recipe uses must be present."""
    _validate_recipe(q)
    layers = [(_tensor_policy(q.key, i, "k", calib), _tensor_policy(q.value, i, "v", calib)) for i in range(n_layers)]
    for flag, name in ((q.smooth, "smooth"), (q.prefix, "prefix_ids")):
        if flag and name not in calib:
            raise CodecError(f"recipe {q.name}: quant.{'smooth' if name == 'smooth' else 'prefix'}=true needs the "
                             f"calibrated {name!r} tensor")
    prefix = calib.get("prefix_ids") if q.prefix else None
    return CachePolicy(name=q.name, layers=layers, key_rope=q.key_rope, n_sink=q.n_sink, residual=q.residual,
                       smooth=calib["smooth"] if q.smooth else None, prefix_ids=prefix,
                       prefix_len=0 if prefix is None else int(prefix.numel()))
