"""Sensitivity-weighted non-uniform datatypes: one codebook per layer for K and one for V
(KVQuant, Hooper et al. 2024, sec. 3.3).

Points are the normalized inliers of the reservoir rows (sink positions excluded): keys with the static
per-channel zero/range of key_scales, values per (token, head) after the per-token outlier rule -- exactly
the normalization exporters.codec applies at encode time. Weights are the Fisher information of the same
elements (`weighting="fisher"`, as KVQuant's public code), or Fisher times the square of the element's scale
(`weighting="fisher-scale2"`, the paper's objective: an error e in the normalized space is an error range * e on
the cached value, so its first-order loss is F * range^2 * e^2). The fit is the exact weighted 1-D k-means
optimum on a binned histogram (stages.codebooks_kmeans); scikit-learn's Lloyd k-means (KVQuant's method) runs
as a cross-check on a subsample, and the weighted squared error of both on all points is reported per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from threadpoolctl import threadpool_limits

from exporters.codec import ALLOWED_BITS, token_outlier_bounds
from stages.base import InputError, StageResult
from stages.calibration_rows import CalibrationRows
from stages.codebooks_kmeans import kmeans_1d_exact, kmeans_1d_lloyd, weighted_sse


@dataclass
class CodebookConfig:
    n_bins: int = 2048
    lloyd_check: bool = True
    lloyd_max_points: int = 50_000
    seed: int = 0
    weighting: str = "fisher"          # fisher (KVQuant's public code) | fisher-scale2 (the paper's objective)


WEIGHTINGS = ("fisher-scale2", "fisher")


def check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise InputError(f"codebooks.weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def normalized_keys(k: torch.Tensor, zero, rng, lower, upper, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """k [S, H, D] -> (xn [S, H, D], mask of points that enter the fit: inliers of non-constant channels)."""
    mask = (rng[None] > 0).expand_as(k)
    if fraction > 0:
        mask = mask & (k >= lower[None]) & (k <= upper[None])
    xn = torch.where(rng[None] > 0, (k - zero[None]) / torch.where(rng > 0, rng, 1)[None], 0).clamp(-1, 1)
    return xn, mask


def normalized_values(v: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [S, H, D] (reservoir rows as tokens) -> (xn, mask, range [S, H, 1]) with the codec's per-token rule."""
    x = v.permute(1, 0, 2)[None]  # [1, H, S, D]
    mask = torch.ones_like(x, dtype=torch.bool)
    if fraction > 0:
        lo, hi = token_outlier_bounds(x, fraction)
        mask = (x >= lo) & (x <= hi)
        x = torch.minimum(torch.maximum(x, lo), hi)
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    zero, rng = (mx + mn) / 2, (mx - mn) / 2
    mask = mask & (rng > 0)
    xn = torch.where(rng > 0, (x - zero) / torch.where(rng > 0, rng, 1), 0).clamp(-1, 1)
    return xn[0].permute(1, 0, 2), mask[0].permute(1, 0, 2), rng[0].permute(1, 0, 2)


def _fit_one(x: torch.Tensor, w: torch.Tensor, k: int, cfg: CodebookConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    if float(w.sum()) <= 0:
        w = torch.ones_like(w)
    centers = kmeans_1d_exact(x, w, k, n_bins=cfg.n_bins)
    report = {"sse_exact": weighted_sse(x, w, centers), "points": int(x.numel())}
    if cfg.lloyd_check:
        sub = torch.randperm(x.numel(), generator=gen)[: cfg.lloyd_max_points]
        with threadpool_limits(1):  # 1-D k-means on 50k points: thread start-up costs more than it saves
            lloyd = kmeans_1d_lloyd(x[sub], w[sub], k, seed=cfg.seed)
        report["sse_lloyd"] = weighted_sse(x, w, lloyd)
    return centers, report


@dataclass
class Inputs:
    rows: CalibrationRows               # with fisher_k / fisher_v
    scales: dict[str, torch.Tensor]     # the key_scales stage: zero, range, lower, upper [L, H, D]
    fraction: float                     # the recipe's outlier fraction (0: no sparse outliers)
    bits: list[int]                     # the codebook bit-widths to fit (the recipes' nuq tensors)


def fit(inputs: Inputs, cfg: CodebookConfig) -> StageResult:
    """-> k_codebook_B / v_codebook_B [L, 2^B] for every B in inputs.bits."""
    bits_list, scales, fraction, n_sink = inputs.bits, inputs.scales, inputs.fraction, inputs.rows.n_sink
    bad = [b for b in bits_list if b not in ALLOWED_BITS or b == 8]
    if bad:
        raise InputError(f"codebooks.bits must be in (2, 3, 4), got {bits_list}")
    check_weighting(cfg.weighting)
    r = inputs.rows
    if r.fisher_k is None or r.fisher_v is None:
        raise ValueError("codebooks: the calibration rows carry no Fisher weights")
    kept = r.kept()
    keys, values, fisher_k, fisher_v = (t[kept].float() for t in (r.keys, r.values, r.fisher_k, r.fisher_v))
    n_layers = keys.shape[1]
    gen = torch.Generator().manual_seed(cfg.seed)
    tensors: dict[str, torch.Tensor] = {}
    report: dict[str, list] = {}
    for bits in bits_list:
        k_books, v_books = [], []
        for layer in range(n_layers):
            xk, mk = normalized_keys(keys[:, layer], scales["zero"][layer], scales["range"][layer],
                                     scales["lower"][layer], scales["upper"][layer], fraction)
            xv, mv, rv = normalized_values(values[:, layer], fraction)
            wk, wv = fisher_k[:, layer], fisher_v[:, layer]
            if cfg.weighting == "fisher-scale2":
                wk, wv = wk * scales["range"][layer][None].square(), wv * rv.square()
            for kind, x, m, w, books in (("k", xk, mk, wk, k_books), ("v", xv, mv, wv, v_books)):
                centers, rep = _fit_one(x[m], w[m], 2 ** bits, cfg, gen)
                books.append(centers)
                report.setdefault(f"{kind}{bits}", []).append(rep)
        tensors[f"k_codebook_{bits}"] = torch.stack(k_books)
        tensors[f"v_codebook_{bits}"] = torch.stack(v_books)
    return StageResult(tensors, {"sse": report, "outlier_fraction": fraction, "n_sink": n_sink})
