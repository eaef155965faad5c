"""The tolerance policy (SPEC.md §8) and the comparison of one output against the golden.

    tol = SAFETY · √depth · (u_storage + u_accumulate · (√n + A))
    pass iff  max|actual − golden| ≤ tol · max(s, max|golden|)

u_storage is the unit roundoff (half the machine epsilon) of the dtype values are stored in,
u_accumulate that of the dtype sums are accumulated in (float32 for the half formats and TF32,
as every framework's matmuls and softmax do; the dtype itself otherwise), n the longest
reduction (inner product or sum) the case contains, depth the number of sublayers chained in
it, A the rotary angle whose rounding the case's rotations carry (rotary_angle; 0 without
RoPE) and s the size of the case's activations (1 but for the small ones). The formula is the
same for every case; no case has a hand-tuned tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from spec import ModelConfig

SAFETY = 8.0

UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,  # float32 storage, matmul inputs rounded to TF32's 10-bit mantissa (CUDA)
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}
# The spacing of each dtype's subnormals: an entry below the dtype's normal range (float16's under
# 6.1e-5) is stored on this grid however exactly it was summed; a gradient tensor of N entries stored
# so is off by up to (s/2)·√N from its exact value, which compare_gradients allows as s·√N (SPEC §13)
SUBNORMAL_SPACING = {"float64": 2.0**-1074, "float32": 2.0**-149, "tf32": 2.0**-149, "float16": 2.0**-24,
                     "bfloat16": 2.0**-133}
# each dtype's largest finite value: a backward whose chain carries more overflows there (SPEC §13)
LARGEST_FINITE = {"float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38, "tf32": 3.4028234663852886e38,
                  "float16": 65504.0, "bfloat16": 3.3895313892515355e38}
ACCUMULATE = {"float64": "float64", "float32": "float32", "tf32": "float32", "float16": "float32",
              "bfloat16": "float32"}
DTYPES = tuple(UNIT_ROUNDOFF)
# compute modes that are no column's dtype: (u_storage, the dtype sums accumulate in). int8-activations:
# each input of a product rounded to int8 per block of its reduction axis, scale max|a|/127 (onnxruntime's
# MatMulNBits at accuracy_level 4, SPEC §15.1): an element off by at most max|a_block|/254, a storage
# rounding of 1/254 of the activations' size; the products' scaling and sums in float32
COMPUTE_MODES = {"int8-activations": (1 / 254, "float32")}


def _roundoffs(dtype: str) -> tuple[float, float]:
    """(u_storage, u_accumulate) of a dtype or a COMPUTE_MODES mode."""
    if dtype in COMPUTE_MODES:
        return COMPUTE_MODES[dtype][0], UNIT_ROUNDOFF[COMPUTE_MODES[dtype][1]]
    if dtype in UNIT_ROUNDOFF:
        return UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[ACCUMULATE[dtype]]
    raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES + tuple(COMPUTE_MODES))}")


def backward_error(dtype: str, reduction_length: int) -> float:
    """u_s + u_a·√n: the relative move of a product's weights that its rounding is equivalent to
    (its inputs stored at dtype, n random-signed roundings summed), one layer's share of SPEC §8."""
    storage, accumulate = _roundoffs(dtype)
    return storage + accumulate * math.sqrt(max(1, reduction_length))


def tolerance(dtype: str, reduction_length: int, depth: int, angle: float = 0.0) -> float:
    """The relative tolerance for a case computed in ``dtype`` (or a COMPUTE_MODES mode):
    SAFETY · √depth · (backward_error + u_a · angle); ``angle`` is the case's rotary_angle (the
    rotary tables are float32 or wider, so their roundoff is u_accumulate's)."""
    accumulate = _roundoffs(dtype)[1]
    return SAFETY * math.sqrt(max(1, depth)) * (backward_error(dtype, reduction_length) + accumulate * angle)


def held_at(values: np.ndarray, dtype: str) -> np.ndarray:
    """values as a column at dtype holds them (rounded to nearest, ties to even), in float64."""
    values = np.asarray(values, np.float64)
    if dtype == "float64":
        return values
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float64)
    single = values.astype(np.float32)
    if dtype != "bfloat16":
        return single.astype(np.float64)
    bits = single.view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


def rotary_angle(cfg: ModelConfig, largest_position: int) -> float:
    """A (SPEC §8): the mean, over a head's d_k/2 pairs, of the angle whose rounding a rotation at
    the largest position carries. Pair i turns by p·ω_i, ω_i = θ^(−2i/r); rounded in a table of
    unit roundoff u, that angle is off by about u·p·ω_i radians, and so is the pair's share of a
    score q·k, which sums every pair of the head. Pair 0 turns by p itself (ω_0 = 1), an integer
    every table holds exactly, so only cos and sin's own rounding (u_storage's) is left there;
    the pairs past r do not turn. Rescaled frequencies (SPEC §5.12) are the ones that turn, and
    pair 0 counts where rescaling moved its ω_0 from 1. 0 without RoPE."""
    from impl_numpy.model import rope_frequencies  # the golden's frequencies are the spec's definition

    if cfg.positional != "rope" or largest_position <= 0:
        return 0.0
    frequencies = rope_frequencies(cfg, largest_position + 1)  # ω_0 … ω_{r/2−1} of a call that long
    rounded = frequencies[1:] if frequencies[0] == 1 else frequencies
    return float(largest_position * rounded.sum() / (cfg.d_head / 2))


@dataclass(frozen=True)
class Comparison:
    passed: bool
    max_abs_err: float
    rel_err: float  # ‖actual − golden‖₂ / ‖golden‖₂
    tol: float  # absolute: the relative tolerance times max(floor, max|golden|)
    worst_index: tuple[int, ...] | None
    worst_actual: float | None
    worst_expected: float | None
    reason: str = ""
    judged: bool = True  # False where no part of the output had a bound below its own size (SPEC §8): nothing failed

    @property
    def ratio(self) -> float:
        """max_abs_err / tol: below 1 passes."""
        return self.max_abs_err / self.tol if self.tol > 0 else (0.0 if self.max_abs_err == 0 else math.inf)


def compare(actual: object, expected: np.ndarray, relative_tol: float, floor: float = 1.0,
            where: np.ndarray | None = None) -> Comparison:
    """Compare a backend's output with the golden. NaN/Inf in the output fail unless the golden
    holds the very same value at that place; a shape mismatch fails with the two shapes. The
    tolerance is relative to max(floor, max|golden|): floor is the size of the terms the output
    sums, 1 but for a case of small activations (Case.floor). `where` (boolean over the leading
    axes, adapter.Partial's) limits the comparison to the entries a backend computed."""
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
    kept = None
    if where is not None:
        where = np.asarray(where, dtype=bool)
        kept = np.broadcast_to(where.reshape(where.shape + (1,) * (expected.ndim - where.ndim)), expected.shape)
        kept = kept.reshape(-1)
    scale = max(floor, max((float(np.abs(golden[compared]).max(initial=0.0))
                            for _, golden, compared in _chunks(None, expected, kept)), default=0.0))
    tol = relative_tol * scale
    if expected.size == 0:
        return Comparison(True, 0.0, 0.0, tol, None, None, None)
    # A float64 chunk of _CHUNK elements at a time, never the output whole: a real vocabulary's
    # logits are gigabytes at float64 (Gemma's 262,144 × 520 positions × 3 rows: 3.3 GB), and a
    # whole copy per step of the arithmetic once took a check past its memory.
    max_abs, worst_flat, error_squares, reference_squares, non_finite = -1.0, 0, 0.0, 0.0, 0
    for start, (output, golden, compared) in zip(range(0, expected.size, _CHUNK), _chunks(actual, expected, kept)):
        same_special = ~compared & ((output == golden) | (np.isnan(output) & np.isnan(golden)))
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is handled just below
            difference = np.abs(output - golden)
            difference[same_special] = 0.0
            difference[np.isnan(difference)] = np.inf  # NaN where a number was due
            error_squares += float(np.square(difference).sum())
            reference_squares += float(np.square(golden[compared]).sum())
        at = int(np.argmax(difference))
        if difference[at] > max_abs:  # the first of equal maxima, as argmax over the whole
            max_abs, worst_flat = float(difference[at]), start + at
        non_finite += int((~np.isfinite(output) & np.isfinite(golden)).sum())
    worst = tuple(int(i) for i in np.unravel_index(worst_flat, expected.shape))
    error_norm, reference_norm = math.sqrt(error_squares), math.sqrt(reference_squares)  # over the entries compared
    rel = error_norm / reference_norm if reference_norm > 0 else (0.0 if error_norm == 0 else math.inf)
    worst_actual, worst_expected = float(actual[worst]), float(expected[worst])
    if kept is not None and not kept[worst_flat]:
        worst_actual = worst_expected  # what was left out is not compared
    passed = bool(max_abs <= tol)
    reason = "" if passed else _describe(worst_actual, worst_expected, worst, max_abs, tol, non_finite)
    return Comparison(passed, max_abs, rel, tol, worst, worst_actual, worst_expected, reason)


_CHUNK = 1 << 22  # elements at a time (32 MB of float64) for the arithmetic over a large output


def _chunks(actual: np.ndarray | None, expected: np.ndarray, kept: np.ndarray | None):
    """(the output at float64, the golden at float64, the entries compared: golden finite and kept)
    _CHUNK flattened elements at a time; where `kept` (flat) leaves an entry out, the output holds
    the golden's value. Without `actual`, the output is None."""
    flat_expected = expected.reshape(-1)
    flat_actual = None if actual is None else actual.reshape(-1)
    for start in range(0, flat_expected.size, _CHUNK):
        golden = flat_expected[start:start + _CHUNK].astype(np.float64, copy=False)
        compared = np.isfinite(golden)
        output = None if flat_actual is None else flat_actual[start:start + _CHUNK].astype(np.float64)
        if kept is not None:
            compared &= kept[start:start + _CHUNK]
            if output is not None:
                output = np.where(kept[start:start + _CHUNK], output, golden)
        yield output, golden, compared


def _describe(actual: float, expected: float, worst: tuple, max_abs: float, tol: float, non_finite: int) -> str:
    index = list(worst)
    if not math.isfinite(actual) and math.isfinite(expected):
        return f"{non_finite} non-finite value(s) where the golden is finite, first worst at {index}: {actual}"
    return (f"max |error| {max_abs:.3g} > tol {tol:.3g} at {index}: "
            f"got {actual:.6g}, golden {expected:.6g}")


def compare_generation(actual: object, golden_tokens: np.ndarray, golden_step_logits: np.ndarray,
                       relative_tol: float, eos_id: int | None, rows: np.ndarray | None = None) -> Comparison:
    """Greedy tokens must equal the golden's, except at a near-tie (SPEC.md §8): at the first step
    where a row differs, the golden's logit for the backend's token must be within the logit
    tolerance of the golden's best logit at that step; the row is not compared after it (the
    prefixes differ from there on). A row the golden ended with eos_id is padding from then on,
    exactly: a different token there is never a tie (the golden chose nothing at those steps).
    golden_step_logits [B, N, V] are the golden's logits at each step; `rows` (boolean [B],
    adapter.Partial's) limits the comparison to the rows a backend generated."""
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
        if rows is not None and not rows[row]:
            continue
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


def compare_gradients(actual: object, expected: Mapping[str, np.ndarray], terms: Mapping[str, np.ndarray],
                      relative_tol: float, kink_allowance: Mapping[str, float] | None = None,
                      subnormal_spacing: float = 0.0, conditioning: Mapping[str, float] | None = None) -> Comparison:
    """A gradient case (SPEC.md §13): every tensor the golden returns, per tensor and normwise.

    `terms` is the golden without cancellation (impl_numpy.backward.without_cancellation). A
    tensor passes iff ‖g − g*‖ ≤ tol · max(‖g*‖, ‖t*‖): rounding is relative to the size of the
    terms a gradient sums, which ‖t*‖ measures where they cancel. Where t* is exactly zero,
    nothing reaches the gradient (what the masks cut off, pad targets, absent tokens), and the
    backend must be exactly zero too. NaN or Inf fails. `kink_allowance` (per tensor, absolute)
    is added to the bound: how far the gradient moves when ReLU units within rounding of their
    kink take the other side. `subnormal_spacing` (the dtype's, SUBNORMAL_SPACING) adds s·√N for
    a tensor of N entries: what storing it at its dtype may move it where it lies below the normal
    range. `conditioning` (per tensor, absolute) replaces tol · max(‖g*‖, ‖t*‖) where it is larger:
    how far the golden's own gradients move when every weight moves by the rounding a column's
    products are equivalent to (GradientReference.conditioning_bound), measured where the case
    is amplified. A tensor whose bound reaches its own size (≥ 1 of max(‖g*‖, ‖t*‖): a gradient of
    zeros would pass) is not judged, as SPEC §8 leaves out such an output: the reason names it, and
    a comparison where no tensor is judged says so (`judged` False). Its NaN, Inf and leaks still
    fail. The Comparison's max_abs_err and rel_err hold the worst judged tensor's ‖g − g*‖ / ‖g*‖
    (what is compared), its reason names that tensor with its max|g − g*| / ‖g*‖ and cosine."""
    if not isinstance(actual, Mapping):
        return Comparison(False, math.inf, math.inf, relative_tol, None, None, None,
                          f"gradients must be a dict of named arrays, got {type(actual).__name__}")
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or extra:
        return Comparison(False, math.inf, math.inf, relative_tol, None, None, None,
                          f"gradient names differ: missing {missing or 'none'}, unexpected {extra or 'none'}")
    worst_name, worst_ratio, worst_error, worst_bound, notes, unjudged = None, -1.0, 0.0, relative_tol, [], {}
    for name, golden in expected.items():
        golden = np.asarray(golden, dtype=np.float64)
        try:
            mine = np.asarray(actual[name], dtype=np.float64)
        except (TypeError, ValueError) as error:
            return Comparison(False, math.inf, math.inf, relative_tol, None, None, None, f"{name}: not an array: {error}")
        if mine.shape != golden.shape:
            return Comparison(False, math.inf, math.inf, relative_tol, None, None, None,
                              f"{name}: shape {list(mine.shape)}, expected {list(golden.shape)}")
        if not np.isfinite(mine).all():
            index = tuple(int(i) for i in np.argwhere(~np.isfinite(mine))[0])
            return Comparison(False, math.inf, math.inf, relative_tol, index, float(mine[index]), float(golden[index]),
                              f"{name}: {int((~np.isfinite(mine)).sum())} non-finite value(s), first at {list(index)}")
        norm = max(float(np.linalg.norm(golden)), float(np.linalg.norm(terms[name])))
        leaked = (np.asarray(terms[name]) == 0.0) & (mine != 0.0)
        if leaked.any():
            index = tuple(int(i) for i in np.argwhere(leaked)[0])
            return Comparison(False, math.inf, math.inf, relative_tol, index, float(mine[index]), 0.0,
                              f"{name}: {int(leaked.sum())} value(s) nonzero where nothing reaches the gradient "
                              f"(masked, padded, absent or unused), first at {list(index)}: {mine[index]:.3g}")
        difference = float(np.linalg.norm(mine - golden))
        kink, floor = (kink_allowance or {}).get(name, 0.0), subnormal_spacing * math.sqrt(golden.size)
        moved = (conditioning or {}).get(name, 0.0)
        error = difference / norm if norm > 0 else 0.0
        bound = max(relative_tol, moved / norm if norm > 0 else 0.0) + ((kink + floor) / norm if norm > 0 else 0.0)
        if bound >= 1:  # SPEC §8: a bound of the tensor's own size passes anything of that size
            unjudged[name] = bound
            continue
        if error / bound >= worst_ratio:
            worst_name, worst_ratio, worst_error, worst_bound = name, error / bound, error, bound
            scale = norm if norm > 0 else 1.0
            denominator = "‖g*‖" if norm == float(np.linalg.norm(golden)) else "‖terms‖"
            notes = [f"{name}: ‖g − g*‖/{denominator} {error:.3g}",
                     f"max|g − g*|/{denominator} {np.abs(mine - golden).max() / scale:.3g}",
                     _cosine(mine, golden)] + ([f"ReLU kink allowance {kink / scale:.3g}"] if kink else []) + (
                         [f"subnormal allowance {floor / scale:.3g}"] if floor / scale >= 1e-6 else []) + (
                         [f"conditioning bound {moved / scale:.3g}"] if moved / scale > relative_tol else [])
    passed = worst_error <= worst_bound
    if not passed:  # the normwise error and its bound first: they are the verdict
        notes[0] += f" > tol {worst_bound:.3g}"
    reason = ", ".join(notes)
    reason = reason if not passed else f"worst {reason}" if worst_name else ""
    if unjudged:
        named = ", ".join(f"{name} ({bound:.3g} of its size)" for name, bound in unjudged.items())
        reason = "; ".join(filter(None, [reason, f"not judged, their bound reaching their size: {named}"]))
    return Comparison(passed, worst_error, worst_error, worst_bound, None, None, None, reason,
                      judged=worst_name is not None or not unjudged)


def _cosine(mine: np.ndarray, golden: np.ndarray) -> str:
    """The cosine of the angle between a gradient and the golden's: undefined, and said so, where
    either is zero (a gradient that is all zeros does not point the golden's way)."""
    zero = [label for label, g in (("‖g‖", mine), ("‖g*‖", golden)) if not np.any(g)]
    if zero:
        return f"cosine undefined ({' and '.join(zero)} = 0)"
    return f"cosine {float((mine * golden).sum() / (np.linalg.norm(mine) * np.linalg.norm(golden))):.9f}"

