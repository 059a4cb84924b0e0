"""Per-layer non-uniform quantization codebooks by weighted 1-D k-means.

KVQuant (Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM
Inference with KV Cache Quantization", section 3.3) builds a non-uniform
datatype per layer: 2^b levels in the normalized [-1, 1] space, obtained by
Fisher-weighted 1-D k-means over normalized inlier values. KVQuant runs
Lloyd's algorithm (scikit-learn, one init, 50 iterations); `kmeans_1d_lloyd`
reproduces that as a cross-check.

`kmeans_1d_binned` returns the global optimum of the weighted histogram of the
points (n_bins equal-width bins, 2048 by default), which is the global optimum
on the raw points themselves only when they have at most n_bins distinct
values; with n_bins >= the number of points it is the raw optimum (how
stages/codebooks.py measures what binning costs). In one dimension an
optimal clustering consists of clusters that are contiguous in sorted order,
so the optimum follows from the classical dynamic programme (Wang & Song
2011, Ckmeans.1d.dp):

    D[l][j] = min_{l-1 <= i < j} D[l-1][i] + cost(i, j),

where D[l][j] is the best SSE of the first j sorted points in l clusters and
cost(i, j) = S2 - S1^2 / S0 is the weighted scatter of points [i, j), O(1)
from prefix sums of w, w*x, w*x^2 (float64, x centred on its weighted mean to
limit cancellation). A cluster cost then carries an absolute rounding error
of a few 1e-16 * sum(w) * max (x - mean)^2: for data in the normalized
[-1, 1] range that is far below any SSE difference that matters, but ties
closer than that are broken arbitrarily. The cluster cost satisfies the
quadrangle inequality, so the optimal split i is non-decreasing in j; each
layer is solved by divide-and-conquer over j (O(n log n) per layer, O(n)
memory), with every level of the recursion evaluated as one vectorized numpy
batch.

Millions of points are first reduced to at most `n_bins` support points:
equal-width bins over [min, max], each replaced by its weighted mean and total
weight. The within-bin scatter is a constant added to the objective, so the
DP is exact on the bins; binning only restricts which clusterings are
representable (a cluster boundary cannot split a bin).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

_F32_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be an int >= 1 (in practice 4, 8 or 16); got {k!r}")
    return int(k)


def _to_numpy_1d(t, name: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a real floating-point tensor (float16/bfloat16/float32/float64); got dtype {t.dtype}")
    return t.detach().to(device="cpu", dtype=torch.float64).numpy()


def _check_points(x, w) -> tuple[np.ndarray, np.ndarray]:
    """Validated float64 copies of x [n] and w [n]."""
    xs = _to_numpy_1d(x, "x")
    ws = _to_numpy_1d(w, "w")
    if xs.size < 1:
        raise ValueError("x must have length >= 1; got length 0")
    if ws.size != xs.size:
        raise ValueError(f"w must have the same length as x ({xs.size}); got length {ws.size}")
    n_bad = int((~np.isfinite(xs)).sum())
    if n_bad:
        raise ValueError(f"x must be finite; got {n_bad} non-finite entries out of {xs.size}")
    if np.abs(xs).max() > _F32_MAX:
        raise ValueError(f"x must lie within the float32 range (|x| <= {_F32_MAX:.3e}); got max |x| = {np.abs(xs).max():.3e}")
    n_bad = int((~np.isfinite(ws)).sum())
    if n_bad:
        raise ValueError(f"w must be finite; got {n_bad} non-finite entries out of {ws.size}")
    n_neg = int((ws < 0).sum())
    if n_neg:
        raise ValueError(f"w must be >= 0; got {n_neg} negative entries (min {ws.min():.6g})")
    total = float(ws.sum())
    if not 0 < total < np.inf:
        raise ValueError(f"w must have a finite positive sum; got sum {total!r}")
    return xs, ws


# ----------------------------------------------------------------------------
# support reduction (distinct values or histogram bins)
# ----------------------------------------------------------------------------


def _histogram(x: np.ndarray, w: np.ndarray, n_bins: int):
    """Equal-width bins over [min x, max x].

    Returns (means [m], weights [m], lower bound on the number of distinct x)
    for the m non-empty bins, in ascending order.
    """
    lo, hi = float(x.min()), float(x.max())
    frac = (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)  # [n] in [0, 1]
    idx = np.minimum((frac * n_bins).astype(np.int64), n_bins - 1)  # [n]
    weight = np.bincount(idx, weights=w, minlength=n_bins)  # [n_bins]
    moment = np.bincount(idx, weights=w * x, minlength=n_bins)  # [n_bins]
    vmin = np.full(n_bins, np.inf)
    vmax = np.full(n_bins, -np.inf)
    np.minimum.at(vmin, idx, x)
    np.maximum.at(vmax, idx, x)
    used = weight > 0
    # each non-empty bin holds >= 1 distinct value, a bin with min < max >= 2
    n_distinct_lb = int(used.sum() + (vmax[used] > vmin[used]).sum())
    means = np.clip(moment[used] / weight[used], vmin[used], vmax[used])
    return means, weight[used], n_distinct_lb


def _support(x: np.ndarray, w: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted support points v [m] and their positive weights u [m], m <= n_bins."""
    keep = w > 0
    x, w = x[keep], w[keep]
    if x.size > n_bins:
        means, weight, n_distinct_lb = _histogram(x, w, n_bins)
        if n_distinct_lb > n_bins:  # certainly too many distinct values: bin
            return means, weight
    v, inverse = np.unique(x, return_inverse=True)
    if v.size <= n_bins:
        return v, np.bincount(inverse.ravel(), weights=w, minlength=v.size)
    means, weight, _ = _histogram(x, w, n_bins)
    return means, weight


# ----------------------------------------------------------------------------
# exact dynamic programme
# ----------------------------------------------------------------------------


def _dp_layer(prev: np.ndarray, cost, layer: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """One DP layer: new[j] = min_{layer-1 <= i < j} prev[i] + cost(i, j), j in [layer, m].

    Divide and conquer on j using monotonicity of the (leftmost) argmin; every
    recursion level is one batch of ragged candidate ranges. Each segment of j
    values [lo, hi] carries its admissible split range [olo, ohi], and
    olo <= lo - 1 always holds, so no candidate range is ever empty.
    Returns new [m+1] and arg [m+1] (best split i for each j).
    """
    new = np.full(m + 1, np.inf)
    arg = np.zeros(m + 1, dtype=np.int64)
    lo, hi = np.array([layer]), np.array([m])  # [s] segments of j
    olo, ohi = np.array([layer - 1]), np.array([m - 1])  # [s] split range per segment
    while lo.size:
        mid = (lo + hi) // 2  # [s]
        top = np.minimum(ohi, mid - 1)  # [s]
        counts = top - olo + 1  # [s], all >= 1
        starts = np.cumsum(counts) - counts  # [s]
        seg = np.repeat(np.arange(mid.size), counts)  # [c] segment of each candidate
        i = olo[seg] + np.arange(seg.size) - starts[seg]  # [c] candidate split
        val = prev[i] + cost(i, mid[seg])  # [c]
        best = np.minimum.reduceat(val, starts)  # [s]
        first = np.minimum.reduceat(np.where(val <= best[seg], i, m), starts)  # [s] leftmost argmin
        new[mid], arg[mid] = best, first
        left, right = mid > lo, mid < hi  # [s] which children are non-empty
        lo, hi, olo, ohi = (
            np.concatenate([lo[left], mid[right] + 1]),
            np.concatenate([mid[left] - 1, hi[right]]),
            np.concatenate([olo[left], first[right]]),
            np.concatenate([first[left], ohi[right]]),
        )
    return new, arg


def _exact_centers(v: np.ndarray, u: np.ndarray, k: int) -> np.ndarray:
    """Optimal weighted k-means centers (float64, ascending, min(k, m) of them).

    v [m] sorted support points, u [m] positive weights.
    """
    m = v.size
    if m <= k:
        return v.astype(np.float64, copy=True)
    if u.sum() > 1.0:
        u = u / u.sum()  # the optimum is scale-free; keeps the prefix sums finite
    mu = float(np.dot(u, v) / u.sum())
    vc = v - mu  # centred to limit cancellation in S2 - S1^2/S0
    s0 = np.concatenate([[0.0], np.cumsum(u)])  # [m+1]
    s1 = np.concatenate([[0.0], np.cumsum(u * vc)])  # [m+1]
    s2 = np.concatenate([[0.0], np.cumsum(u * vc * vc)])  # [m+1]

    # A cluster whose weight is lost in the rounding of s0 (weights below
    # ~1e-16 of the total) gets a denominator floor instead of 0/0; its true
    # cost is equally negligible, and the clamp at 0 absorbs the rest.
    floor = s0[-1] * 2.0**-80

    def cost(i, j):  # weighted scatter of points [i, j), i < j, broadcastable
        d1 = s1[j] - s1[i]
        return np.maximum(s2[j] - s2[i] - d1 * d1 / np.maximum(s0[j] - s0[i], floor), 0.0)

    d = np.full(m + 1, np.inf)  # [m+1] layer 1: d[j] = cost(0, j)
    d[1:] = cost(0, np.arange(1, m + 1))
    args = []  # args[l-2][j]: best split for j points in l clusters
    for layer in range(2, k + 1):
        d, a = _dp_layer(d, cost, layer, m)
        args.append(a)

    bounds = [m]  # backtrack cluster boundaries from the right
    for a in reversed(args):
        bounds.append(int(a[bounds[-1]]))
    bounds.append(0)
    bounds.reverse()  # [k+1]: 0 = b0 < b1 < ... < bk = m
    centers = np.empty(k)
    for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        # weighted mean, clipped to the cluster's range (guards underflow of subnormal weights)
        total = u[a:b].sum()
        mean = np.dot(u[a:b], v[a:b]) / total if total > 0 else v[a]
        centers[c] = min(max(mean, v[a]), v[b - 1])
    return centers


# ----------------------------------------------------------------------------
# output: exactly k strictly increasing finite float32 values
# ----------------------------------------------------------------------------


def _finalize(centers: np.ndarray, k: int) -> torch.Tensor:
    """Sorted float32 tensor [k] of distinct finite values containing `centers`.

    Missing values (fewer distinct points than k, or centers merged by float32
    rounding) are added at the midpoint of the widest gap; with a single value
    they are placed one step of max(|c|, 1)/k towards zero from it. Unused
    centers can only lower the SSE.
    """
    c = np.unique(centers.astype(np.float32))  # sorted, distinct
    while c.size < k:
        if c.size == 1:
            step = max(abs(float(c[0])), 1.0) / k
            new = float(c[0]) - step if c[0] > 0 else float(c[0]) + step
        else:
            gaps = np.diff(c.astype(np.float64))
            g = int(np.argmax(gaps))
            new = (float(c[g]) + float(c[g + 1])) / 2
            if np.float32(new) in (c[g], c[g + 1]):  # no float32 room inside: extend outwards
                span = float(c[-1]) - float(c[0])
                new = float(c[0]) - span if abs(c[0]) <= abs(c[-1]) else float(c[-1]) + span
        c = np.unique(np.append(c, np.float32(new)))
    return torch.from_numpy(c.astype(np.float32))


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def weighted_sse(x: torch.Tensor, w: torch.Tensor, centers: torch.Tensor) -> float:
    """sum_i w_i * min_j (x_i - c_j)^2 over all points (x, w: 1-D, same length; centers 1-D)."""
    xs, ws = _check_points(x, w)
    c = _to_numpy_1d(centers, "centers")
    if c.size < 1:
        raise ValueError("centers must have length >= 1; got length 0")
    if not np.isfinite(c).all():
        raise ValueError(f"centers must be finite; got {int((~np.isfinite(c)).sum())} non-finite entries")
    c = np.sort(c)  # [k]
    pos = np.searchsorted(c, xs)  # [n] first center >= x
    left = c[np.maximum(pos - 1, 0)]  # [n]
    right = c[np.minimum(pos, c.size - 1)]  # [n]
    dist2 = np.minimum((xs - left) ** 2, (xs - right) ** 2)  # [n]
    return float(np.dot(ws, dist2))


def kmeans_1d_binned(x: torch.Tensor, w: torch.Tensor, k: int, n_bins: int = 2048) -> torch.Tensor:
    """Weighted 1-D k-means, optimal on the n_bins-bin weighted histogram of the points. Returns k centers,
    float32, sorted ascending.

    If the number of distinct values (with positive weight) is <= n_bins, no
    binning: the result is the exact optimum on the raw data. Otherwise points
    are binned into n_bins equal-width bins over [min, max] (weighted mean per
    bin, empty bins dropped) and the DP is exact on the bins. If there are
    fewer distinct points than k, the missing centers are filled so that the
    result still has exactly k strictly increasing finite values.
    """
    k = _check_k(k)
    if isinstance(n_bins, bool) or not isinstance(n_bins, numbers.Integral) or n_bins < 1:
        raise ValueError(f"n_bins must be an int >= 1; got {n_bins!r}")
    xs, ws = _check_points(x, w)
    v, u = _support(xs, ws, int(n_bins))  # [m], [m]
    return _finalize(_exact_centers(v, u, k), k)


def kmeans_1d_lloyd(x: torch.Tensor, w: torch.Tensor, k: int, seed: int = 0, max_iter: int = 50) -> torch.Tensor:
    """Cross-check: sklearn.cluster.KMeans(n_clusters=k, random_state=seed, n_init=1, max_iter=max_iter)
    .fit(x[:, None], sample_weight=w); returns sorted float32 centers (same k-distinct guarantee as above).

    Zero-weight points are dropped first; with at most k distinct weighted
    values the distinct values themselves are the (zero-SSE) answer.
    """
    from sklearn.cluster import KMeans

    k = _check_k(k)
    if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral) or max_iter < 1:
        raise ValueError(f"max_iter must be an int >= 1; got {max_iter!r}")
    xs, ws = _check_points(x, w)
    keep = ws > 0
    xs, ws = xs[keep], ws[keep]
    distinct = np.unique(xs)
    if distinct.size <= k:
        return _finalize(distinct, k)
    km = KMeans(n_clusters=k, random_state=seed, n_init=1, max_iter=int(max_iter))
    km.fit(xs[:, None], sample_weight=ws)
    centers = km.cluster_centers_[:, 0]  # [k]
    centers = centers[np.isfinite(centers)]  # a cluster of only subnormal weights can come back NaN
    return _finalize(centers if centers.size else np.array([np.dot(ws, xs) / ws.sum()]), k)
