"""exporters/figures.py: a computed figure with a mathematical range is brought into it within rounding, and only
within rounding -- further out it is a bug, named."""
import pytest

from exporters import figures


@pytest.mark.parametrize("value, want", [
    (-8.613001867274761e-09, 0.0),   # the KL of an exact cache that rounded below zero on one CPU
    (3e-9, 0.0),                     # and above it on another: the same figure, whichever way rounding fell
    (figures.KL_TOL, 0.0),
    (2 * figures.KL_TOL, 2 * figures.KL_TOL),
    (0.0123, 0.0123),
])
def test_a_kl_within_rounding_of_zero_is_zero_and_any_other_is_unchanged(value, want):
    got = figures.kl("runtime_check/canary/kl", value)
    assert got == want and type(got) is float


@pytest.mark.parametrize("value", [-1e-3, -2 * figures.KL_TOL, float("nan")])
def test_a_kl_further_below_zero_is_a_bug_that_names_the_figure(value):
    with pytest.raises(figures.FigureError, match=r"figure runtime_check/canary/kl: allowed >= 0") as err:
        figures.kl("runtime_check/canary/kl", value)
    from exporters.errors import InputError
    assert isinstance(err.value, ValueError) and not isinstance(err.value, InputError)  # a bug, not bad input


def test_fractions_are_exact_counts_over_counts():
    assert figures.fraction("top1", 1.0) == 1.0 and figures.fraction("top1", 0.25) == 0.25
    for bad in (1.0 + 1e-12, -1e-12):
        with pytest.raises(figures.FigureError, match=r"figure top1: allowed \[0, 1\]"):
            figures.fraction("top1", bad)


def test_bounds_on_either_side():
    assert figures.bounded("r", 1.0 + 1e-9, lo=0.0, hi=1.0, tol=1e-6) == 1.0
    assert figures.bounded("r", 0.5, lo=0.0, hi=1.0, tol=1e-6) == 0.5
    with pytest.raises(figures.FigureError, match="figure r: allowed <= 2"):
        figures.bounded("r", 3.0, hi=2.0)
