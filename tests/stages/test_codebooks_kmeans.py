"""Tests for stages.codebooks_kmeans (exact weighted 1-D k-means codebooks)."""

import itertools
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.codebooks_kmeans import _exact_centers, kmeans_1d_binned, kmeans_1d_lloyd, weighted_sse


def _t(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float64))


def _brute_force_sse(x: np.ndarray, w: np.ndarray, k: int) -> float:
    """Optimal weighted SSE by enumerating every contiguous partition of the sorted points."""
    order = np.argsort(x, kind="stable")
    x, w = x[order], w[order]
    n = x.size
    if n <= k:
        return 0.0

    def group(a, b):
        ww, xx = w[a:b], x[a:b]
        if ww.sum() == 0:
            return 0.0
        mean = np.dot(ww, xx) / ww.sum()
        return float(np.dot(ww, (xx - mean) ** 2))

    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        best = min(best, sum(group(a, c) for a, c in zip(b[:-1], b[1:])))
    return best


def _dense_dp_sse(v: np.ndarray, u: np.ndarray, k: int) -> float:
    """Reference O(k n^2) DP (full cost matrix) on sorted support v [m] with weights u [m]."""
    m = v.size
    if m <= k:
        return 0.0
    vc = v - np.dot(u, v) / u.sum()
    s0, s1, s2 = (np.concatenate([[0.0], np.cumsum(a)]) for a in (u, u * vc, u * vc * vc))
    i, j = np.arange(m + 1)[:, None], np.arange(m + 1)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = s2[j] - s2[i] - (s1[j] - s1[i]) ** 2 / (s0[j] - s0[i])  # [m+1, m+1]
    cost[i >= j] = np.inf
    d = cost[0].copy()
    for _ in range(k - 1):
        d = (d[:, None] + cost).min(axis=0)
    return float(d[m])


def _support(x: np.ndarray, w: np.ndarray):
    keep = w > 0
    v, inv = np.unique(x[keep], return_inverse=True)
    return v, np.bincount(inv.ravel(), weights=w[keep])


def _check_codebook(c: torch.Tensor, k: int):
    assert c.dtype == torch.float32 and c.shape == (k,)
    assert torch.isfinite(c).all()
    assert (c[1:] > c[:-1]).all(), c


def _check_against_brute_force(x: np.ndarray, w: np.ndarray, k: int):
    opt = _brute_force_sse(x, w, k)
    # float64 DP: exact to 1e-9 relative
    c64 = _exact_centers(*_support(x, w), k)
    assert weighted_sse(_t(x), _t(w), _t(c64)) == pytest.approx(opt, rel=1e-9, abs=1e-12)
    # public float32 result: rounding a center by delta adds at most W * delta^2
    c = kmeans_1d_binned(_t(x), _t(w), k)
    _check_codebook(c, k)
    delta = max(2.0**-24 * np.abs(x).max(), 2.0**-149)  # float32 rounding (relative, or subnormal)
    tol = 1e-9 * opt + w.sum() * delta**2 + 1e-12
    assert abs(weighted_sse(_t(x), _t(w), c) - opt) <= tol


# ----------------------------------------------------------------------------
# optimality
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", range(8))
def test_matches_brute_force_random(seed, k):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    x = rng.normal(size=n)
    if seed % 2:  # ties and zero weights
        x = np.round(x, 0)
    w = rng.uniform(0.0, 2.0, size=n)
    if seed % 4 == 3:
        w[rng.integers(n)] = 0.0
        w[rng.integers(n)] += 0.5  # keep a positive sum
    _check_against_brute_force(x, w, k)


@settings(max_examples=60, deadline=None)
@given(
    pts=st.lists(
        st.tuples(
            st.one_of(st.floats(-1, 1), st.sampled_from([-1.0, -0.25, 0.0, 0.5, 1.0])),
            st.one_of(st.floats(0, 10), st.just(0.0)),
        ),
        min_size=1,
        max_size=9,
    ),
    k=st.sampled_from([1, 2, 3]),
)
def test_matches_brute_force_hypothesis(pts, k):
    x = np.array([p[0] for p in pts])
    w = np.array([p[1] for p in pts])
    if not w.sum() > 0:
        w[0] = 1.0
    _check_against_brute_force(x, w, k)


@pytest.mark.parametrize(
    "x, w, k",
    [  # weights far below the float64 resolution of the prefix sums, and huge ones
        ([0.0, 1.0, -1.0], [3.7e-151, 1.0, 1.0], 2),
        ([0.0, 1.0, -1.0], [2.7e-302, 2.0, 5e-324], 2),
        ([0.0, 1.0, 2.0, 1e-38], [1.0, 5e-324, 1.0, 1.0], 3),
        ([0.0, 1.0, -1.0, 0.5], [1e300, 1e300, 1e300, 1e-300], 3),
    ],
)
@pytest.mark.filterwarnings("ignore:Number of distinct clusters")  # sklearn, subnormal weights
def test_extreme_weights(x, w, k):
    x, w = np.array(x), np.array(w)
    _check_against_brute_force(x, w, k)
    _check_codebook(kmeans_1d_lloyd(_t(x), _t(w), k), k)


@pytest.mark.parametrize("k", [2, 5, 16])
def test_divide_and_conquer_matches_dense_dp(k):
    rng = np.random.default_rng(k)
    x = np.concatenate([rng.normal(size=250), np.round(rng.normal(size=50), 1), rng.normal(3.0, 0.01, size=20)])
    w = rng.exponential(size=x.size)
    v, u = _support(x, w)
    c = _exact_centers(v, u, k)
    assert weighted_sse(_t(v), _t(u), _t(c)) == pytest.approx(_dense_dp_sse(v, u, k), rel=1e-9)


def test_hand_checkable():
    x, w = _t([0, 0, 1, 1, 10, 10]), torch.ones(6)
    assert kmeans_1d_binned(x, w, 2).tolist() == [0.5, 10.0]
    assert kmeans_1d_binned(x, w, 3).tolist() == [0.0, 1.0, 10.0]
    assert kmeans_1d_lloyd(x, w, 3).tolist() == [0.0, 1.0, 10.0]


def test_weights_matter():
    c = kmeans_1d_binned(_t([0, 1]), _t([3, 1]), 1)
    assert c.tolist() == [0.25]
    assert weighted_sse(_t([0, 1]), _t([3, 1]), c) == pytest.approx(3 * 0.25**2 + 0.75**2)


def test_zero_weight_points_are_ignored():
    x, w = _t([0, 1, 2, 100]), _t([1, 1, 1, 0])
    assert kmeans_1d_binned(x, w, 1).tolist() == [1.0]
    assert kmeans_1d_binned(x, w, 3).tolist() == [0.0, 1.0, 2.0]


@pytest.fixture(scope="module")
def heavy_tailed():
    """200k Student-t (df=3) draws scaled and clipped to [-1, 1], random weights."""
    rng = np.random.default_rng(1)
    x = np.clip(0.2 * rng.standard_t(3, size=200_000), -1.0, 1.0)
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(rng.exponential(size=x.size))


@pytest.mark.parametrize("k", [4, 8, 16])
def test_exact_beats_lloyd_and_binning_is_close(heavy_tailed, k):
    x, w = heavy_tailed
    binned = weighted_sse(x, w, kmeans_1d_binned(x, w, k))  # n_bins = 2048 < #distinct: binned
    unbinned = weighted_sse(x, w, kmeans_1d_binned(x, w, k, n_bins=x.numel()))  # exact on raw data
    lloyd = weighted_sse(x, w, kmeans_1d_lloyd(x, w, k))
    assert unbinned <= binned * (1 + 1e-9)  # the unbinned result is the optimum
    assert binned <= unbinned * (1 + 1e-4)  # binning into 2048 bins costs very little
    assert binned <= lloyd * (1 + 1e-4)
    assert unbinned <= lloyd * (1 + 1e-9)


def test_k16_2048_bins_is_fast(heavy_tailed):
    x, w = heavy_tailed
    kmeans_1d_binned(x, w, 16)  # warm-up
    start = time.perf_counter()
    c = kmeans_1d_binned(x, w, 16, n_bins=2048)
    assert time.perf_counter() - start < 1.0
    _check_codebook(c, 16)


# ----------------------------------------------------------------------------
# degenerate inputs: still k strictly increasing finite centers
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [kmeans_1d_binned, kmeans_1d_lloyd])
def test_fewer_distinct_values_than_k(fn):
    c = fn(torch.full((10,), 0.5), torch.ones(10), 4)
    _check_codebook(c, 4)
    assert 0.5 in c.tolist()
    c = fn(_t([-1, 1, 1, -1, 0]), torch.ones(5), 16)
    _check_codebook(c, 16)
    assert {-1.0, 0.0, 1.0} <= set(c.tolist())
    c = fn(torch.zeros(3), torch.ones(3), 8)
    _check_codebook(c, 8)
    assert 0.0 in c.tolist()


def test_float32_collisions_are_separated():
    x = _t([1.0, 1.0 + 1e-12, 1.0 + 2e-12, 2.0])  # distinct in float64, equal in float32
    c = kmeans_1d_binned(x, torch.ones(4), 3)
    _check_codebook(c, 3)


def test_low_precision_inputs():
    x = torch.linspace(-1, 1, 1000).to(torch.bfloat16)
    c = kmeans_1d_binned(x, torch.ones(1000, dtype=torch.float16), 4)
    _check_codebook(c, 4)


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------

_X, _W = _t([0.0, 0.5, 1.0]), torch.ones(3)


@pytest.mark.parametrize("fn", [kmeans_1d_binned, kmeans_1d_lloyd])
@pytest.mark.parametrize(
    "x, w, k, match",
    [
        (_X, _W, 0, r"k must be an int >= 1.*got 0"),
        (_X, _W, 2.0, r"k must be an int >= 1.*got 2\.0"),
        (_X, _W, True, r"k must be an int >= 1.*got True"),
        (_X[:, None], _W, 2, r"x must be 1-D.*got shape \(3, 1\)"),
        (_X, _W[:2], 2, r"w must have the same length as x \(3\); got length 2"),
        (_X[:0], _W[:0], 2, r"x must have length >= 1; got length 0"),
        (_t([0, float("nan"), float("inf")]), _W, 2, r"x must be finite; got 2 non-finite"),
        (_X, _t([1, -1, 1]), 2, r"w must be >= 0; got 1 negative"),
        (_X, _t([1, float("nan"), 1]), 2, r"w must be finite; got 1 non-finite"),
        (_X, torch.zeros(3), 2, r"w must have a finite positive sum; got sum 0\.0"),
        (_X, torch.ones(3, dtype=torch.int64), 2, r"w must be a real floating-point tensor.*got dtype torch\.int64"),
    ],
)
def test_validation_errors(fn, x, w, k, match):
    with pytest.raises(ValueError, match=match):
        fn(x, w, k)


def test_validation_errors_other_arguments():
    with pytest.raises(ValueError, match=r"n_bins must be an int >= 1; got 0"):
        kmeans_1d_binned(_X, _W, 2, n_bins=0)
    with pytest.raises(ValueError, match=r"max_iter must be an int >= 1; got 0"):
        kmeans_1d_lloyd(_X, _W, 2, max_iter=0)
    with pytest.raises(ValueError, match=r"centers must have length >= 1"):
        weighted_sse(_X, _W, torch.zeros(0))
    with pytest.raises(ValueError, match=r"centers must be finite"):
        weighted_sse(_X, _W, _t([0.0, float("nan")]))
    with pytest.raises(ValueError, match=r"x must be finite; got 1 non-finite"):
        weighted_sse(_t([0, 1, float("inf")]), _W, _t([0.0]))
    with pytest.raises(ValueError, match=r"x must lie within the float32 range"):
        kmeans_1d_binned(_t([0.0, 1e39]), _W[:2], 2)
