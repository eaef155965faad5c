"""The bounds the tests hold numbers to, each derived rather than picked (issue 56).

A constant such as `< 1e-10` passes on the CPU it was measured on and fails on one whose BLAS sums
in another order. So a test says what it expects in the terms of SPEC §8 instead:

- two computations of one quantity (an implementation against the golden, a cached decode against
  the full forward, an identity of the golden) agree within the policy's tolerance for their dtype,
  their longest reduction n and the sublayers they chain (`assert_agrees`);
- a planted mistake, or a setting that must matter, moves the output beyond that tolerance
  (`assert_differs`): the check the harness runs would see it;
- a central difference carries its truncation, estimated from the same quotient at twice the
  step, and its rounding, the policy's for the function divided by the step
  (`central_difference`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from conformance.tolerance import Comparison, compare, tolerance


def assert_agrees(actual, golden, *, n: int, depth: int = 1, dtype: str = "float64", angle: float = 0.0,
                  floor: float = 1.0, what: str = "") -> Comparison:
    """actual within SPEC §8's tolerance of golden: max|Δ| ≤ tol(dtype, n, depth, angle) · max(floor, max|golden|)."""
    result = compare(np.asarray(actual), np.asarray(golden, np.float64), tolerance(dtype, n, depth, angle), floor)
    assert result.passed, f"{what + ': ' if what else ''}{result.reason} ({result.ratio:.3g} of the tolerance)"
    return result


def assert_differs(actual, golden, *, n: int, depth: int = 1, dtype: str = "float64", angle: float = 0.0,
                   floor: float = 1.0, what: str = "") -> Comparison:
    """actual beyond SPEC §8's tolerance of golden: a check held to the policy fails on it."""
    result = compare(np.asarray(actual), np.asarray(golden, np.float64), tolerance(dtype, n, depth, angle), floor)
    assert not result.passed, (f"{what + ': ' if what else ''}within the tolerance "
                               f"({result.max_abs_err:.3g} ≤ {result.tol:.3g}): the check cannot see it")
    return result


def central_difference(f: Callable[[float], float], h: float, rounding: float) -> tuple[float, float]:
    """(f(h) − f(−h)) / 2h, an estimate of f′(0), and how far from f′(0) it may be.

    D(h) = f′ + c·h² + O(h⁴), so D(2h) − D(h) = 3c·h²: |D(2h) − D(h)| bounds the truncation c·h²
    with a factor 3 to spare. Each value f(±h), f(±2h) is off by at most rounding · max(1, |f|)
    (`rounding`: SPEC §8's tolerance for the computation of f), which D(h) divides by 2h and D(2h)
    by 4h; their sum, 1.5 · rounding · max(1, |f|) / h, is taken twice."""
    up, down, far_up, far_down = f(h), f(-h), f(2 * h), f(-2 * h)
    near, far = (up - down) / (2 * h), (far_up - far_down) / (4 * h)
    size = max(1.0, abs(up), abs(down), abs(far_up), abs(far_down))
    return near, abs(far - near) + 3 * rounding * size / h


def assert_derivative(analytic: float, f: Callable[[float], float], h: float, rounding: float,
                      what: str = "") -> None:
    """analytic is f′(0), as far as the central difference of f at step h can tell."""
    numeric, bound = central_difference(f, h, rounding)
    assert abs(analytic - numeric) <= bound, (f"{what + ': ' if what else ''}analytic {analytic:.12g}, central "
                                              f"difference {numeric:.12g}: off by {abs(analytic - numeric):.3g} "
                                              f"> {bound:.3g}")


def model_bounds(cfg, tgt_len: int, src_len: int = 0) -> dict:
    """assert_agrees' n, depth and angle for a whole model run on tgt_len target (and src_len
    source) positions, counted as conformance/cases.py counts its whole-model cases: n the widest
    inner product (d, d_ff), the keys a query sums and, where positions are added rather than
    rotated, the square of the position count (sin(p·ω) carries its angle's rounding times p);
    depth the forward's sublayers chained; the rotary angle at the last target position."""
    from conformance.cases import SUBLAYERS
    from conformance.tolerance import rotary_angle

    length = max(tgt_len, src_len)
    positions = tgt_len if cfg.positional == "rope" else length ** 2
    return {"n": max(cfg.d_model, cfg.d_ff, length, positions), "depth": SUBLAYERS["forward"].depth(cfg),
            "angle": rotary_angle(cfg, tgt_len - 1)}
