"""Computed figures with a mathematical range, brought into it where they are computed -- by `bounded` alone.

A KL divergence is >= 0, a top-1 agreement lies in [0, 1]; computed in floating point, either can land a rounding
error outside (a KL of an exact cache summed in float32 came out -8.6e-9 on one CPU and +1e-8 on another), and a
record whose figure is outside its range is refused by the manifest's schema, which keeps its bounds. So every such
figure passes through `bounded` once, where it is computed, with the rounding its computation can make:

- within `tol` of a bound, it IS the bound (a KL of 3e-9 is 0.0 whichever way the last rounding fell, so a verdict
  never depends on which CPU rounds last);
- further outside its range it is a bug, not rounding: FigureError (a ValueError: an internal invariant broken,
  not bad input), naming the figure, its range and the value;
- inside, it is returned unchanged.

Tolerances (the figure's resolution, docs/manifest.md "Figures and their resolution"):
- KL_TOL, a KL in nats per position: KL below it is reported as exactly 0.0. The project's KLs are sums over the
  vocabulary of float32 log-probabilities; per position those carry errors up to about 1.2e-6 nats (measured:
  an fp16 cache of the tiny random models, per-position KL from -1.2e-6 to +1.2e-6 with float32 sums), and the
  smallest KL any quantized format of ours makes is orders above it (fp8: ~1e-4 on SmolLM2).
- RATIO_TOL for fractions (agreement, outlier fractions): counts over counts, exact; 0.
"""
from __future__ import annotations

import math

KL_TOL = 1e-6   # nats per position
RATIO_TOL = 0.0


class FigureError(ValueError):
    """A computed figure outside its mathematical range by more than rounding: a bug in what computed it."""


def bounded(name: str, value: float, lo: float | None = None, hi: float | None = None, tol: float = 0.0) -> float:
    """value of the figure `name` brought into [lo, hi] (None: unbounded on that side): within tol of a bound ->
    that bound, exactly; further outside -> FigureError naming the figure; otherwise value unchanged (as a float)."""
    value = float(value)
    if math.isnan(value):
        raise FigureError(f"figure {name}: allowed {_range(lo, hi)}, got nan")
    if lo is not None and value <= lo + tol:
        if value < lo - tol:
            raise FigureError(f"figure {name}: allowed {_range(lo, hi)} (to within rounding {tol:g}), got {value!r}")
        return float(lo)
    if hi is not None and value >= hi - tol:
        if value > hi + tol:
            raise FigureError(f"figure {name}: allowed {_range(lo, hi)} (to within rounding {tol:g}), got {value!r}")
        return float(hi)
    return value


def kl(name: str, value: float) -> float:
    """A KL divergence in nats: >= 0, to KL_TOL."""
    return bounded(name, value, lo=0.0, tol=KL_TOL)


def fraction(name: str, value: float) -> float:
    """A fraction (agreement, a share of entries): in [0, 1], exactly."""
    return bounded(name, value, lo=0.0, hi=1.0, tol=RATIO_TOL)


def _range(lo: float | None, hi: float | None) -> str:
    if hi is None:
        return f">= {lo:g}"
    if lo is None:
        return f"<= {hi:g}"
    return f"[{lo:g}, {hi:g}]"


__all__ = ["KL_TOL", "RATIO_TOL", "FigureError", "bounded", "kl", "fraction"]
