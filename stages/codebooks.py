"""Sensitivity-weighted non-uniform datatypes: one codebook per layer for K and one for V
(KVQuant, Hooper et al. 2024, sec. 3.3).

Points are the normalized inliers of the reservoir rows (sink positions excluded): keys with the static
per-channel zero/range of key_scales, values per (token, head) after the per-token outlier rule -- exactly
the normalization exporters.codec applies at encode time. Weights are the Fisher information of the same
elements (`weighting="fisher"`, as KVQuant's public code), or Fisher times the square of the element's scale
(`weighting="fisher-scale2"`, the paper's objective: an error e in the normalized space is an error range * e on
the cached value, so its first-order loss is F * range^2 * e^2), or for keys the queries that read them
(`weighting="query-scale2"`: an error d in key channel c moves the score q . k by q_c d, so it costs about
E[q_c^2] d^2 -- the pre-RoPE mean square of the queries of the key's head group, averaged over the channel's RoPE
pair since RoPE mixes the pair -- times range^2 for the normalized space; values keep Fisher). The fit is weighted 1-D k-means, optimal on the
weighted histogram of the points in `n_bins` equal-width bins (stages.codebooks_kmeans.kmeans_1d_binned) -- not
on the raw points. With `lloyd_check`, a random subsample of the points is fitted three ways, like for like: the
same binned optimum, the exact optimum on the raw subsample points (what binning costs), and scikit-learn's Lloyd
k-means (KVQuant's method) from `lloyd_inits` seeds; their weighted squared errors on the subsample, and those
of the served codebook and of Lloyd's on all points, are reported per layer (meta["sse"]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from threadpoolctl import threadpool_limits

from exporters.codec import ALLOWED_BITS, nearest_level, token_outlier_bounds
from stages.base import Context, Declaration, InputError, StageResult
from stages.calibration_rows import CalibGroup, CalibrationRows, block_mean, group_rows
from stages.codebooks_kmeans import kmeans_1d_binned, kmeans_1d_lloyd, weighted_sse


@dataclass
class CodebookConfig:
    n_bins: int = 2048
    lloyd_check: bool = False          # the fit compared with Lloyd and the raw-point optimum (a diagnostic:
                                       # it costs more than the fit; bench.quality --lloyd-check)
    lloyd_max_points: int = 50_000
    lloyd_inits: int = 3
    seed: int = 0
    weighting: str = "fisher"          # fisher (KVQuant's public code) | fisher-scale2 (the paper's objective)
                                       # | query-scale2 (keys by the queries that read them; values by Fisher)
    qnorm: bool = False                # KVQuant's Q-Norm: levels moved so the quantized points keep the mean and
                                       # standard deviation of the points (see q_norm)


WEIGHTINGS = ("fisher-scale2", "fisher", "query-scale2")


def check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise InputError(f"codebooks.weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def query_key_weights(q_meansq: torch.Tensor, n_kv_heads: int, rope_pairing: str) -> torch.Tensor:
    """q_meansq [L, H_q, D] (pre-RoPE E[q^2] per query head, traces) -> [L, H_kv, D]: the mean over the query heads
    that read each key head, then over each channel's rotate-half RoPE pair (c, c + D/2), since RoPE rotates a
    key error within its pair before the query reads it."""
    if rope_pairing != "rotate_half":
        raise InputError(f"codebooks: RoPE pairing must be one of ('rotate_half',), got {rope_pairing!r}")
    n_layers, n_q, d = q_meansq.shape
    if n_q % n_kv_heads:
        raise ValueError(f"codebooks: {n_q} query heads do not group onto {n_kv_heads} key heads")
    q = q_meansq.double().view(n_layers, n_kv_heads, n_q // n_kv_heads, d).mean(2)
    m = (q[..., : d // 2] + q[..., d // 2 :]) / 2
    return torch.cat([m, m], -1).float()


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


def nearest_levels(x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Each point's nearest level, as exporters.codec encodes it."""
    return centers[nearest_level(x, centers).long()]


def q_norm(x: torch.Tensor, centers: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """KVQuant's Q-Norm (Hooper et al. 2024, sec. 3.6): quantization shrinks the spread of what is read back (a
    centroid is the mean of its cell, so Var(Q(x)) = Var(x) - E[(x - Q(x))^2]); the levels are moved by one affine
    map, c' = (c - mean Q(x)) * std(x) / std(Q(x)) + mean(x), so that the points quantized to them keep the
    points' mean and standard deviation (unweighted: the activations as they are, not as the fit weighs them).
    Offline, on the calibration points; order-preserving, so the codebook stays sorted. Our reading of the paper:
    the statistics are taken once per codebook (per layer, K or V) on its normalized inliers.
    -> (levels, shift, scale) with shift = mean(x) - mean(Q(x)) * scale."""
    q = nearest_levels(x, centers).double()
    xd = x.double()
    sq = float(q.std())
    if not sq > 0:
        return centers, 0.0, 1.0
    scale = float(xd.std()) / sq
    shift = float(xd.mean()) - float(q.mean()) * scale
    return (centers.double() * scale + shift).float(), shift, scale


def _fit_one(x: torch.Tensor, w: torch.Tensor, k: int, cfg: CodebookConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """-> (the served codebook: binned optimum on all points, its report). Report keys: sse_binned / sse_lloyd:
    weighted SSE on all points of the served codebook and of Lloyd (seed cfg.seed, fitted on the subsample);
    sub_binned / sub_exact / sub_lloyd (one per init): the same subsample fitted and scored by each method."""
    if float(w.sum()) <= 0:
        w = torch.ones_like(w)
    centers = kmeans_1d_binned(x, w, k, n_bins=cfg.n_bins)
    report = {"sse_binned": weighted_sse(x, w, centers), "points": int(x.numel())}
    if cfg.qnorm:
        centers, report["qnorm_shift"], report["qnorm_scale"] = q_norm(x, centers)
        report["sse_qnorm"] = weighted_sse(x, w, centers)
    if cfg.lloyd_check:
        sub = torch.randperm(x.numel(), generator=gen)[: cfg.lloyd_max_points]
        xs, ws = x[sub], w[sub]
        if float(ws.sum()) <= 0:
            ws = torch.ones_like(ws)
        with threadpool_limits(1):  # 1-D k-means on 50k points: thread start-up costs more than it saves
            lloyds = [kmeans_1d_lloyd(xs, ws, k, seed=cfg.seed + i) for i in range(max(1, cfg.lloyd_inits))]
        report["sse_lloyd"] = weighted_sse(x, w, lloyds[0])
        report["sub_points"] = int(xs.numel())
        report["sub_binned"] = weighted_sse(xs, ws, kmeans_1d_binned(xs, ws, k, n_bins=cfg.n_bins))
        report["sub_exact"] = weighted_sse(xs, ws, kmeans_1d_binned(xs, ws, k, n_bins=xs.numel()))
        report["sub_lloyd"] = [weighted_sse(xs, ws, c) for c in lloyds]
    return centers, report


@dataclass
class Inputs:
    rows: CalibrationRows               # with fisher_k / fisher_v
    scales: dict[str, torch.Tensor]     # the key_scales stage: zero, range, lower, upper [L, H, D]
    fraction: float                     # the recipe's outlier fraction (0: no sparse outliers)
    bits: list[int]                     # the codebook bit-widths to fit (the recipes' nuq tensors)
    key_query_weights: torch.Tensor | None = None  # [L, H_kv, D] (query_key_weights) for weighting query-scale2


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
    if cfg.weighting == "query-scale2" and inputs.key_query_weights is None:
        raise ValueError("codebooks: weighting query-scale2 needs the key query weights (traces q_meansq)")
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
            elif cfg.weighting == "query-scale2":
                wk = (inputs.key_query_weights[layer] * scales["range"][layer].square())[None].expand_as(wk)
            for kind, x, m, w, books in (("k", xk, mk, wk, k_books), ("v", xv, mv, wv, v_books)):
                centers, rep = _fit_one(x[m], w[m], 2 ** bits, cfg, gen)
                books.append(centers)
                report.setdefault(f"{kind}{bits}", []).append(rep)
        tensors[f"k_codebook_{bits}"] = torch.stack(k_books)
        tensors[f"v_codebook_{bits}"] = torch.stack(v_books)
    return StageResult(tensors, {"sse": report, "outlier_fraction": fraction, "n_sink": n_sink})


@dataclass
class CodebookJob:
    """The codebooks stage's config: the calibration group's rows, the bit-widths its recipes need, the fit."""
    group: CalibGroup
    bits: list[int]
    codebooks: CodebookConfig


def _fit_stage(ctx: Context, inputs: dict, job: CodebookJob, progress) -> StageResult:
    g = job.group
    query_w = None
    if job.codebooks.weighting == "query-scale2":  # keys weighted by the queries that read them
        query_w = query_key_weights(inputs[g.traces].tensors["q_meansq"], ctx.spec.n_kv_heads, ctx.spec.rope_pairing)
        if g.smooth:  # the cache stores K / lambda: an error there is lambda times larger on K
            query_w = query_w * inputs["smooth"].tensors["smooth"].square()
        if g.rotate_k:  # rotated keys: each rotated channel mixes its whole Hadamard block
            query_w = block_mean(query_w)
    return fit(Inputs(group_rows(ctx.model, inputs, g, with_fisher=True), inputs[f"key_scales-{g.suffix}"].tensors,
                      g.fraction, list(job.bits), query_w), job.codebooks)


STAGE = Declaration("codebooks", CodebookJob, _fit_stage,
                    inputs=lambda j: [j.group.traces, j.group.fisher, f"key_scales-{j.group.suffix}", *j.group.extra],
                    suffix=lambda j: j.group.suffix)
