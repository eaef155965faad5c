"""The tolerance policy (SPEC.md §8) and the comparison of one output against the golden.

    tol = SAFETY · √depth · (u_storage + u_accumulate · √n)
    pass iff  max|actual − golden| ≤ tol · max(1, max|golden|)

u_storage is the unit roundoff (half the machine epsilon) of the dtype values are stored in,
u_accumulate that of the dtype sums are accumulated in (float32 for the half formats and TF32,
as every framework's matmuls and softmax do; the dtype itself otherwise), n the longest
reduction (inner product or sum) the case contains, depth the number of sublayers chained in
it. The formula is the same for every case; no case has a hand-tuned tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SAFETY = 8.0

UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,  # float32 storage, matmul inputs rounded to TF32's 10-bit mantissa (CUDA)
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}
ACCUMULATE = {"float64": "float64", "float32": "float32", "tf32": "float32", "float16": "float32",
              "bfloat16": "float32"}
DTYPES = tuple(UNIT_ROUNDOFF)


def tolerance(dtype: str, reduction_length: int, depth: int) -> float:
    """The relative tolerance for a case computed in ``dtype``."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    storage, accumulate = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[ACCUMULATE[dtype]]
    return SAFETY * math.sqrt(max(1, depth)) * (storage + accumulate * math.sqrt(max(1, reduction_length)))


@dataclass(frozen=True)
class Comparison:
    passed: bool
    max_abs_err: float
    rel_err: float  # ‖actual − golden‖₂ / ‖golden‖₂
    tol: float  # absolute: the relative tolerance times max(1, max|golden|)
    worst_index: tuple[int, ...] | None
    worst_actual: float | None
    worst_expected: float | None
    reason: str = ""

    @property
    def ratio(self) -> float:
        """max_abs_err / tol: below 1 passes."""
        return self.max_abs_err / self.tol if self.tol > 0 else (0.0 if self.max_abs_err == 0 else math.inf)


def compare(actual: object, expected: np.ndarray, relative_tol: float) -> Comparison:
    """Compare a backend's output with the golden. NaN/Inf in the output fail unless the golden
    holds the very same value at that place; a shape mismatch fails with the two shapes."""
    expected = np.asarray(expected)
    try:
        actual = np.asarray(actual)
    except Exception as error:  # noqa: BLE001 - whatever the backend returned, report it
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None, f"output is not an array: {error}")
    if actual.shape != expected.shape:
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None,
                          f"shape {list(actual.shape)}, expected {list(expected.shape)}")
    if np.issubdtype(expected.dtype, np.integer) or expected.dtype == bool:
        return _compare_exact(actual, expected)
    if not (np.issubdtype(actual.dtype, np.floating) or actual.dtype == bool or np.issubdtype(actual.dtype, np.integer)):
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None, f"output dtype {actual.dtype} is not numeric")
    actual64 = actual.astype(np.float64)
    expected64 = expected.astype(np.float64)
    finite_golden = np.isfinite(expected64)
    scale = max(1.0, float(np.abs(expected64[finite_golden]).max())) if finite_golden.any() else 1.0
    tol = relative_tol * scale
    same_special = ~finite_golden & ((actual64 == expected64) | (np.isnan(actual64) & np.isnan(expected64)))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is handled just below
        difference = np.where(same_special, 0.0, np.abs(actual64 - expected64))
    difference = np.where(np.isnan(difference), np.inf, difference)  # NaN where a number was due
    if difference.size == 0:
        return Comparison(True, 0.0, 0.0, tol, None, None, None)
    worst = np.unravel_index(int(np.argmax(difference)), difference.shape)
    max_abs = float(difference[worst])
    finite = np.isfinite(difference)
    reference_norm = float(np.linalg.norm(np.where(finite_golden, expected64, 0.0)))
    error_norm = float(np.linalg.norm(np.where(finite, difference, 0.0))) if finite.all() else math.inf
    rel = error_norm / reference_norm if reference_norm > 0 else (0.0 if error_norm == 0 else math.inf)
    passed = bool(max_abs <= tol)
    reason = "" if passed else _describe(actual64, expected64, worst, max_abs, tol)
    return Comparison(passed, max_abs, rel, tol, tuple(int(i) for i in worst),
                      float(actual64[worst]), float(expected64[worst]), reason)


def _describe(actual: np.ndarray, expected: np.ndarray, worst: tuple, max_abs: float, tol: float) -> str:
    index = list(int(i) for i in worst)
    if not np.isfinite(actual[worst]) and np.isfinite(expected[worst]):
        count = int((~np.isfinite(actual) & np.isfinite(expected)).sum())
        return f"{count} non-finite value(s) where the golden is finite, first worst at {index}: {actual[worst]}"
    return (f"max |error| {max_abs:.3g} > tol {tol:.3g} at {index}: "
            f"got {actual[worst]:.6g}, golden {expected[worst]:.6g}")


def compare_generation(actual: object, golden_tokens: np.ndarray, golden_step_logits: np.ndarray,
                       relative_tol: float, eos_id: int | None) -> Comparison:
    """Greedy tokens must equal the golden's, except at a near-tie (SPEC.md §8): at the first step
    where a row differs, the golden's logit for the backend's token must be within the logit
    tolerance of the golden's best logit at that step; the row is not compared after it (the
    prefixes differ from there on). A row the golden ended with eos_id is padding from then on,
    exactly: a different token there is never a tie (the golden chose nothing at those steps).
    golden_step_logits [B, N, V] are the golden's logits at each step."""
    golden_tokens = np.asarray(golden_tokens)
    try:
        actual = np.asarray(actual)
    except Exception as error:  # noqa: BLE001
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None, f"output is not an array: {error}")
    if actual.shape != golden_tokens.shape:
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None,
                          f"shape {list(actual.shape)}, expected {list(golden_tokens.shape)}")
    tol = relative_tol * max(1.0, float(np.abs(golden_step_logits).max()))
    worst_margin, ties = 0.0, []
    for row in range(golden_tokens.shape[0]):
        differ = np.flatnonzero(actual[row] != golden_tokens[row])
        if differ.size == 0:
            continue
        step = int(differ[0])
        token, expected = int(actual[row, step]), int(golden_tokens[row, step])
        ended = np.flatnonzero(golden_tokens[row, :step] == eos_id) if eos_id is not None else np.array([])
        if ended.size:
            return Comparison(False, math.inf, math.inf, tol, (row, step), float(token), float(expected),
                              f"row {row} step {step}: got token {token} after the golden ended the row with "
                              f"eos_id {eos_id} at step {int(ended[0])}; from there every token is {expected}")
        logits = golden_step_logits[row, step]
        margin = float(logits.max() - logits[token]) if 0 <= token < logits.shape[0] else math.inf
        if not margin <= tol:
            return Comparison(False, margin, math.inf, tol, (row, step), float(token), float(expected),
                              f"row {row} step {step}: got token {token}, golden {expected}, whose "
                              f"logit is higher by {margin:.3g} > tol {tol:.3g} (not a tie)")
        worst_margin = max(worst_margin, margin)
        ties.append(f"row {row} step {step}")
    note = f"near-tie accepted at {', '.join(ties)} (margin {worst_margin:.3g} <= {tol:.3g})" if ties else ""
    return Comparison(True, worst_margin, 0.0, tol, None, None, None, note)


def _compare_exact(actual: np.ndarray, expected: np.ndarray) -> Comparison:
    """Token ids and other integers must match exactly."""
    mismatch = actual != expected
    if not mismatch.any():
        return Comparison(True, 0.0, 0.0, 0.0, None, None, None)
    worst = tuple(int(i) for i in np.argwhere(mismatch)[0])
    count = int(mismatch.sum())
    return Comparison(False, math.inf, count / mismatch.size, 0.0, worst, float(actual[worst]), float(expected[worst]),
                      f"{count} of {mismatch.size} values differ, first at {list(worst)}: got {actual[worst]}, golden {expected[worst]}")
