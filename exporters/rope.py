"""Rotary position embedding, rotate-half convention: channel i rotates with channel i + D/2.

x_rot = x * cos + rotate_half(x) * sin, rotate_half([a, b]) = [-b, a]; cos/sin: [B, T, D] with the
frequencies repeated for both halves (theta_i = base^(-2i/D), adjusted by the manifest's rope.scaling). The inverse
rotation uses -sin.

Precision, the one convention of the cache (docs/manifest.md, RoPE): the tables are float32 -- angle = the float32
product position x inv_freq (float32), cos / sin of it in float32 (rotary_tables, rope_cos_sin; the Triton kernel
computes the same angle) -- and apply_rope / invert_rope rotate float32 copies of the keys and return float32,
whatever the model's dtype. The caller rounds to its storage dtype after the rotation: the codec encodes the
float32 pre-RoPE keys; decoded keys stay float32 for the attention (a bfloat16 model's own attention gets them
rounded once to its dtype). So inverting at the cache and re-applying at any reader is the identity to float32
rounding; bfloat16 tables (cos^2 + sin^2 != 1 by ~2^-8) were not.
"""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3")  # the rope.scaling types a consumer without the model can rebuild


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D] (any float dtype); cos, sin: [B, T, D] (or [T, D]), float32 (rotary_tables) -> x rotated,
    float32: computed on float32 copies of x and the tables (the module's convention)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    x = x.float()
    return x * cos[:, None].float() + rotate_half(x) * sin[:, None].float()


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope(x, cos, -sin)


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The rotary inverse frequencies [D/2] (float32) from the manifest's model.rope: 1 / theta^(2i/D), adjusted by
    `scaling` (model.rope.scaling, transformers' rope_parameters without rope_theta) as the model's config does,
    every step in float32 in transformers' order (its rotary modules' own inv_freq, to the bit on one machine):
    - {} or rope_type "default": unchanged;
    - "linear" {factor}: divided by factor;
    - "llama3" {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} (Llama 3.1+): with
      wavelength w = 2 pi / f and L = original_max_position_embeddings, f / factor where w > L / low_freq_factor,
      f where w < L / high_freq_factor, and in between (1 - s) f / factor + s f with
      s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor).
    Any other type, a missing field or an unknown one is refused: a consumer never guesses a position encoding."""
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    need = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if kind not in need:
        raise ValueError(f"rope.scaling.rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    missing = [k for k in need[kind] if k not in scaling]
    unknown = sorted(set(scaling) - {"rope_type", "type", "partial_rotary_factor", *need[kind]})
    if unknown:  # e.g. one set of parameters per layer type: the caller picks the layer type's own
        raise ValueError(f"rope.scaling of rope_type {kind!r} takes {['rope_type', *need[kind]]}; unknown fields "
                         f"{unknown} (given {scaling})")
    if missing:
        raise ValueError(f"rope.scaling of rope_type {kind!r} needs {list(need[kind])}; missing {missing} "
                         f"(given {scaling})")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope.scaling.partial_rotary_factor must be 1.0 (every channel rotates), "
                         f"got {scaling['partial_rotary_factor']!r}")
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE at integer positions [T] -> cos, sin [T, D] in float32, from the manifest's rope fields alone (theta,
    scaling: see inv_frequencies), as a rotary module computes them (the convention, docs/manifest.md): float32
    inv_freq, angle = the float32 product position x inv_freq, cos / sin of it in float32. The scaling types here
    all have attention factor 1 (cos / sin unscaled)."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    angles = positions.float()[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotary_tables(rotary, start: int, n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, n, D] at positions start..start+n-1 from a model's own rotary module (so Llama-3 and other
    RoPE scalings are honoured), on the module's device: float32 angles and cos / sin, returned in `dtype`. The
    one definition of the tables that the evaluation, the serving cache, the block-wise reader and the oracle
    rotate keys with, always in float32 (the default: the module's convention). Another dtype gives what the
    model's own forward applies in that dtype (calibration rows of post-RoPE recipes imitate it)."""
    device = rotary.inv_freq.device
    positions = torch.arange(start, start + n, device=device)[None]
    return rotary(torch.zeros(1, n, 1, dtype=dtype, device=device), positions)


class LayerRotary:
    """One layer type's rotary tables from a rotary module that serves several (Gemma 3: `rotary(x, positions,
    layer_type)`, with `<type>_inv_freq` and `<type>_attention_scaling`), with the interface of a one-table module:
    `inv_freq`, `attention_scaling`, `rope_type` and `rotary(x, positions) -> (cos, sin)`, so every reader of a
    rotary module (rotary_tables, the oracle, the kernel, the block-wise attention) takes it unchanged."""

    def __init__(self, rotary, layer_type: str):
        if not hasattr(rotary, f"{layer_type}_inv_freq"):
            raise ValueError(f"rotary module {type(rotary).__name__} has no tables for layer type {layer_type!r}")
        self.rotary, self.layer_type = rotary, layer_type

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.rotary, f"{self.layer_type}_inv_freq")

    @property
    def attention_scaling(self) -> float:
        return float(getattr(self.rotary, f"{self.layer_type}_attention_scaling", 1.0))

    @property
    def rope_type(self) -> str:
        types = getattr(self.rotary, "rope_type", {})
        return str(types.get(self.layer_type, "default") if isinstance(types, dict) else types)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, positions, self.layer_type)

    def __eq__(self, other) -> bool:
        return isinstance(other, LayerRotary) and other.rotary is self.rotary and other.layer_type == self.layer_type

    def __hash__(self) -> int:
        return hash((id(self.rotary), self.layer_type))


def layer_rotaries(rotary, layer_types: list[str] | None, n_layers: int) -> list:
    """The rotary module each of n_layers layers applies: the module itself for every layer when it has one table
    (`inv_freq`), else one LayerRotary per layer type (`layer_types[i]`, the model config's list)."""
    if hasattr(rotary, "inv_freq") or not layer_types:
        return [rotary] * n_layers
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has {n_layers}")
    by_type = {t: LayerRotary(rotary, t) for t in sorted(set(layer_types))}
    return [by_type[t] for t in layer_types]
