"""SmoothAttention scales (QServe, Lin et al. 2024, sec. 4.2; DeepCompressor `calib/smooth.py`).

Per (layer, KV head, channel): lambda = max|K|^alpha / max|Q|^beta, K and Q the pre-RoPE projections (the
traces stage's abs-max statistics). The cache stores K / lambda and a consumer multiplies q by lambda, so
q.k is unchanged while the key channels with large magnitude are flattened before quantization.

Constraints that keep the transform exact:
- RoPE: the two channels RoPE rotates together must share one lambda (then RoPE(k / lambda) = RoPE(k) /
  lambda). Under the rotate-half convention channel i pairs with i + D/2; the pair's statistic is the
  maximum of its two channels. Any other convention is refused by name.
- GQA: query head j reads KV head j // (H_q / H_kv); one lambda serves all query heads of a group, so the
  Q statistic is the maximum over the group.
A pair whose statistic is 0 (a dead key pair, or with beta > 0 a dead query pair) carries nothing to
balance and gets lambda = 1. Every lambda must be finite and > 0; anything else names layer, head, channel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.base import Context, Declaration, InputError, StageResult

ROPE_PAIRINGS = ("rotate_half",)


@dataclass
class SmoothConfig:
    """lambda = max|K|^alpha / max|Q|^beta."""
    alpha: float = 0.5
    beta: float = 0.0


@dataclass
class Inputs:
    q_absmax: torch.Tensor        # [L, H_q, D] pre-RoPE query abs-max (traces)
    k_absmax: torch.Tensor        # [L, H_kv, D] pre-RoPE key abs-max (traces)
    rope_pairing: str             # the model's RoPE convention (pipeline.model.ModelSpec.rope_pairing)


def validate(cfg: SmoothConfig) -> None:
    for name in ("alpha", "beta"):
        value = getattr(cfg, name)
        if not 0.0 <= value <= 1.0:
            raise InputError(f"smooth.{name} must be in [0, 1], got {value}")


def _pair_max(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: each channel replaced by the max of its rotate-half pair (i, i + D/2)."""
    half = x.shape[-1] // 2
    m = torch.maximum(x[..., :half], x[..., half:])
    return torch.cat([m, m], dim=-1)


def fit(inputs: Inputs, cfg: SmoothConfig) -> StageResult:
    """-> smooth [L, H_kv, D]."""
    q_absmax, k_absmax, rope_pairing = inputs.q_absmax, inputs.k_absmax, inputs.rope_pairing
    validate(cfg)
    if rope_pairing not in ROPE_PAIRINGS:
        raise InputError(f"smooth: RoPE pairing must be one of {ROPE_PAIRINGS}, got {rope_pairing!r}")
    n_layers, n_q, d = q_absmax.shape
    n_kv = k_absmax.shape[1]
    if k_absmax.shape != (n_layers, n_kv, d) or n_q % n_kv or d % 2:
        raise ValueError(f"smooth: q_absmax {tuple(q_absmax.shape)} and k_absmax {tuple(k_absmax.shape)} must be "
                         f"[L, H_q, D] and [L, H_kv, D] with H_q a multiple of H_kv and D even")
    q = _pair_max(q_absmax.double().view(n_layers, n_kv, n_q // n_kv, d).amax(2))  # [L, H_kv, D]
    k = _pair_max(k_absmax.double())
    lam = k.pow(cfg.alpha) / q.pow(cfg.beta)
    dead = (k == 0) | ((q == 0) & (cfg.beta > 0))
    lam = torch.where(dead, torch.ones_like(lam), lam).float()
    bad = ~(torch.isfinite(lam) & (lam > 0))
    if bad.any():
        layer, head, channel = (int(i) for i in bad.nonzero()[0])
        half = d // 2
        raise ValueError(f"smooth: lambda must be finite and > 0, got {float(lam[layer, head, channel])} at "
                         f"layer {layer}, kv head {head}, channel {channel} (RoPE pair {channel % half}/"
                         f"{channel % half + half}; max|K| "
                         f"{float(k[layer, head, channel])}, max|Q| {float(q[layer, head, channel])}); "
                         f"{int(bad.sum())} entries are bad")
    meta = {"alpha": cfg.alpha, "beta": cfg.beta, "rope_pairing": rope_pairing, "unit_pairs": int(dead.sum()) // 2,
            "lambda_min": float(lam.min()), "lambda_max": float(lam.max())}
    return StageResult({"smooth": lam}, meta)


# the per-head norms before RoPE whose output is x_normed * (offset + weight) (transformers' source)
NORM_WEIGHT_OFFSET = {"Gemma3RMSNorm": 1.0}


def fold(model: torch.nn.Module, smooth: torch.Tensor, n_q_heads: int) -> None:
    """Fold lambda into `model` in place (pass a copy), so the model's own q.k is unchanged and its cache holds
    K / lambda: where the pre-RoPE keys are k_proj's output, q_proj rows x lambda and k_proj rows / lambda (biases
    too); where a per-head norm follows the projection (Gemma 3's q_norm / k_norm, the keys just before RoPE), the
    norms' gains instead -- scaling k_proj would be undone by the norm. A norm's gain is one [D] vector shared by
    every head, so there lambda must be the same for every KV head of the layer (always with one KV head);
    otherwise the fold is refused (the evaluation and the cache apply lambda per head and need no fold)."""
    n_layers, n_kv, d = smooth.shape
    group = n_q_heads // n_kv
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            attn = block.self_attn
            k_norm, q_norm = getattr(attn, "k_norm", None), getattr(attn, "q_norm", None)
            if k_norm is not None or q_norm is not None:
                _fold_norms(layer, q_norm, k_norm, smooth[layer])
                continue
            lam_k = smooth[layer].reshape(-1)                                    # [H_kv * D]
            lam_q = smooth[layer].repeat_interleave(group, dim=0).reshape(-1)    # [H_q * D]
            for proj, scale in ((attn.q_proj, lam_q), (attn.k_proj, 1 / lam_k)):
                proj.weight.mul_(scale.to(proj.weight.dtype)[:, None])
                if proj.bias is not None:
                    proj.bias.mul_(scale.to(proj.bias.dtype))


def _fold_norms(layer: int, q_norm, k_norm, lam: torch.Tensor) -> None:
    """lam [H_kv, D] into the gains of the per-head norms: gain_q x lambda, gain_k / lambda."""
    if q_norm is None or k_norm is None:
        raise InputError(f"smooth.fold: layer {layer} has a norm on only one of queries and keys; folding needs both "
                         f"(q_norm and k_norm) or neither")
    if not torch.equal(lam, lam[:1].expand_as(lam)):
        raise InputError(f"smooth.fold: layer {layer}'s lambda differs between its {lam.shape[0]} KV heads, but its "
                         f"q_norm / k_norm gains are one [D] vector shared by every head; a per-head lambda cannot be "
                         f"folded into them (serve it through the cache, which divides each head by its own)")
    for norm, scale in ((q_norm, lam[0]), (k_norm, 1 / lam[0])):
        kind = type(norm).__name__
        if kind not in NORM_WEIGHT_OFFSET:
            raise InputError(f"smooth.fold: layer {layer}: norm {kind} is not one whose gain is known; supported: "
                             f"{sorted(NORM_WEIGHT_OFFSET)}")
        offset = NORM_WEIGHT_OFFSET[kind]
        gain = (offset + norm.weight.double()) * scale.double()
        norm.weight.copy_((gain - offset).to(norm.weight.dtype))


def _fit_stage(ctx: Context, inputs: dict, cfg: SmoothConfig, progress) -> StageResult:
    t = inputs["traces"].tensors
    return fit(Inputs(t["q_absmax"], t["k_pre_absmax"], ctx.spec.rope_pairing), cfg)


STAGE = Declaration("smooth", SmoothConfig, _fit_stage, inputs=lambda c: ["traces"])
