"""Rotary position embedding, rotate-half convention: channel i rotates with channel i + D/2.

x_rot = x * cos + rotate_half(x) * sin, rotate_half([a, b]) = [-b, a]; cos/sin: [B, T, D] with the
frequencies repeated for both halves (theta_i = base^(-2i/D)). The inverse rotation uses -sin.
"""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, sin: [B, T, D] (or [T, D])."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return x * cos[:, None].to(x.dtype) + rotate_half(x) * sin[:, None].to(x.dtype)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope(x, cos, -sin)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE (no scaling) at integer positions [T] -> cos, sin [T, D] in float32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotary_tables(rotary, start: int, n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, n, D] at positions start..start+n-1 from a model's own rotary module (so Llama-3 and other
    RoPE scalings are honoured), computed for inputs of `dtype` on the module's device. The one definition
    that evaluation, the oracle and calibration use to rotate keys."""
    device = rotary.inv_freq.device
    positions = torch.arange(start, start + n, device=device)[None]
    return rotary(torch.zeros(1, n, 1, dtype=dtype, device=device), positions)
