"""Lloyd-Max scalar levels for N(0, 1/D): the key codebook of vLLM 0.32's TurboQuant formats.

After the orthonormal Hadamard rotation each coordinate of a unit vector is taken as N(0, sigma^2), sigma^2 = 1/D.
vLLM solves the Lloyd-Max conditions for that density with a fixed numerical recipe
(vllm/model_executor/layers/quantization/turboquant/centroids.py:31-87), and its levels depend on that recipe
(the 4-bit solve stops at the iteration cap before converging), so this solver follows the same steps:

- start: 2^bits levels spread uniformly over [-3.5 sigma, 3.5 sigma], level i at lo + (hi - lo) (i + 0.5) / 2^bits;
- each iteration: cell edges at the midpoints of adjacent levels, outer edges at +-10.5 sigma; each new level is
  the conditional mean of its cell, both integrals by the trapezoid rule with 200 sub-intervals per cell; a cell
  with mass <= 1e-15 keeps its level;
- stop when max |new - old| < 1e-10 (keeping the levels of that iteration's start) or after 200 iterations;
- float64 throughout, rounded once to float32; midpoints in float32, (c[i] + c[i+1]) / 2.
"""
from __future__ import annotations

import functools
import math

import torch

MAX_ITER = 200
TOL = 1e-10
N_SUB = 200          # trapezoid sub-intervals per cell
INIT_SPAN = 3.5      # initial levels on +-3.5 sigma
EDGE_SPAN = 10.5     # outer cell edges at +-10.5 sigma (3 x the initial span)
MIN_MASS = 1e-15


def _trapezoid(f, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Integral of f over each [a_i, b_i] by the trapezoid rule with N_SUB sub-intervals: [L] float64."""
    h = (b - a) / N_SUB
    inner = a[:, None] + torch.arange(1, N_SUB, dtype=torch.float64)[None] * h[:, None]     # [L, N_SUB - 1]
    return (0.5 * (f(a) + f(b)) + f(inner).sum(1)) * h


def solve(bits: int, d: int) -> torch.Tensor:
    """-> [2^bits] float64 sorted levels for N(0, 1/d)."""
    if bits < 1 or d < 1:
        raise ValueError(f"Lloyd-Max needs bits >= 1 and d >= 1, got bits={bits}, d={d}")
    n = 2 ** bits
    var = 1.0 / d
    sigma = math.sqrt(var)

    def pdf(x):
        return torch.exp(-x * x / (2 * var)) / math.sqrt(2 * math.pi * var)

    lo, hi = -INIT_SPAN * sigma, INIT_SPAN * sigma
    levels = lo + (hi - lo) * (torch.arange(n, dtype=torch.float64) + 0.5) / n
    outer = torch.tensor([-EDGE_SPAN * sigma, EDGE_SPAN * sigma], dtype=torch.float64)
    for _ in range(MAX_ITER):
        edges = torch.cat([outer[:1], (levels[:-1] + levels[1:]) / 2, outer[1:]])
        a, b = edges[:-1], edges[1:]
        mass = _trapezoid(pdf, a, b)
        mean = _trapezoid(lambda x: x * pdf(x), a, b) / torch.where(mass > MIN_MASS, mass, 1.0)
        new = torch.where(mass > MIN_MASS, mean, levels)
        if float((new - levels).abs().max()) < TOL:
            break
        levels = new
    return levels


@functools.lru_cache(maxsize=32)
def _codebook(bits: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    levels = solve(bits, d).float()
    return levels, (levels[:-1] + levels[1:]) / 2


def codebook(bits: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (levels [2^bits], midpoints [2^bits - 1]) float32, derived from (bits, d) alone (cached; copies)."""
    levels, mids = _codebook(bits, d)
    return levels.clone(), mids.clone()
