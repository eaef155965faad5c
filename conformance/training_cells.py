"""The training cells (SPEC.md §14): a backend's training run checked step by step from its own
state, and its divergence from the golden's own run reported step by step.

A run of N steps gives, per step k, the loss, the gradients (before clipping), Adam's moments
m_k and v_k and the parameters θ_k (Runner.train). Rounding makes any two runs drift apart, and
Adam amplifies the drift (its update is g / |g| for a gradient entry near 0, whichever way
rounding tipped it), so a comparison with the golden's own trajectory has no tolerance that
rounding alone respects. Each step is checked from the backend's own state instead:

    the loss and gradients at θ_{k-1}        against the golden's at θ_{k-1}  (SPEC §8, §13)
    m_k = β1 m_{k-1} + (1 − β1) ĝ            ĝ: the gradient, clipped
    v_k = β2 v_{k-1} + (1 − β2) ĝ²
    θ_k = θ_{k-1} − lr_k (m̂_k / (√v̂_k + ε) + λ θ_{k-1})   from the backend's own m_k and v_k

each against the golden's formula in float64 with a bound carried from the gradients' own: a
gradient within τ of the golden's (‖Δg‖ ≤ τ) moves m by (1 − β1)τ and v by (1 − β2)(2‖ĝ‖∞τ + τ²),
and the update, computed from the moments the backend holds, only by rounding. The first step
that breaks a formula is the one reported, with the quantity and tensor. The distance from the
golden's own run, ‖θ_k − θ*_k‖ / ‖θ*_k‖, is reported for every step with its growth per step.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.backends.numpy_backend import GradientReference, NumpyRunner
from conformance.cases import SUBLAYERS, TRAINING_RECORD, Case, training_batches
from conformance.tolerance import Comparison, compare, compare_gradients, held_at, tolerance
from spec import ModelConfig
from spec.training import HALF_DTYPES, TrainingConfig, decays, learning_rate, loss_scaling, master_dtype


class NotJudged(Exception):
    """A training run that gave nothing its rule judges: every step skipped by the loss scale."""


OPTIMIZER_QUANTITIES = ("first_moment", "second_moment", "params")  # a step's quantities after the gradients


@dataclass(frozen=True)
class StepCheck:
    """The worst quantity of one step: error and bound as fractions of the golden's norm."""

    step: int
    quantity: str  # loss | gradients | first_moment | second_moment | params
    error: float
    bound: float
    detail: str
    tensor: str = ""  # the worst tensor, and its worst place
    index: tuple[int, ...] = ()
    finite: bool = True
    golden: float = 0.0  # the golden's value there

    @property
    def ratio(self) -> float:
        return self.error / self.bound if self.bound > 0 else (0.0 if self.error == 0 else math.inf)


class TrainingReference:
    """A training case's reference: its inputs and the golden's own run (float64), from which
    each backend's run is checked (compare_training)."""

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], inputs: Mapping[str, Any]):
        self.cfg, self.inputs = cfg, inputs
        self.initial = {name: np.asarray(value, np.float64) for name, value in params.items()}
        self.golden_run = NumpyRunner(cfg, params, "float64").train("train_steps", inputs)


def _norm(arrays: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float((np.asarray(a, np.float64) ** 2).sum()) for a in arrays.values()))


# the smallest positive number each storage dtype holds (its smallest subnormal)
SMALLEST = {"float64": 2.0**-1074, "float32": 2.0**-149, "tf32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}


def _tensorwise(quantity: str, step: int, actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                allowance: Mapping[str, float], rounding: float) -> StepCheck:
    """Per tensor ‖a − e‖ ≤ allowance + rounding · ‖e‖; the worst tensor, as a fraction of ‖e‖.
    A non-finite value fails at once, at its first place."""
    worst = StepCheck(step, quantity, 0.0, rounding, "")
    for name, golden in expected.items():
        mine = np.asarray(actual[name], np.float64)
        if not np.isfinite(mine).all():
            index = tuple(int(i) for i in np.argwhere(~np.isfinite(mine))[0])
            return StepCheck(step, quantity, math.inf, rounding, f"{name}: {int((~np.isfinite(mine)).sum())} "
                             f"non-finite value(s), first at {list(index)}: {mine[index]}", name, index, False,
                             float(golden[index]))
        scale = max(float(np.linalg.norm(golden)), 1e-300)
        error = float(np.linalg.norm(mine - golden)) / scale
        bound = allowance[name] / scale + rounding
        if error / bound >= worst.ratio:
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(np.abs(mine - golden))), golden.shape)) \
                if golden.size else ()
            worst = StepCheck(step, quantity, error, bound,
                              f"{name}: ‖Δ‖/‖{quantity}*‖ {error:.3g} (bound {bound:.3g}), worst at "
                              f"{list(index)}: got {mine[index]:.6g}, golden {golden[index]:.6g}", name, index, True,
                              float(golden[index]) if golden.size else 0.0)
    return worst


# the smallest normal number of each storage dtype: below it a value keeps fewer digits, then none
SMALLEST_NORMAL = {"float64": 2.0**-1022, "float32": 2.0**-126, "tf32": 2.0**-126, "float16": 2.0**-14,
                   "bfloat16": 2.0**-126}


def _why_moment_is_off(check: StepCheck, dtype: str) -> str:
    """A moment far off where the golden's value is below the dtype's normal range: underflow."""
    if check.ratio <= 1 or not check.finite or abs(check.golden) >= SMALLEST_NORMAL.get(dtype, 0.0):
        return ""
    return (f"; the golden's {check.golden:.3g} there is below {dtype}'s smallest normal number "
            f"{SMALLEST_NORMAL[dtype]:.3g}, so the moment underflows: Adam needs its moments in a wider dtype")


def _why_kept_in_half(check: StepCheck, record: Mapping[str, Any], dtype: str) -> str:
    """A weight or moment off by more than float32's rounding whose every value is a half-precision
    number: the run keeps it in that half dtype (pure half-precision Adam), not in float32."""
    if check.ratio <= 1 or not check.finite or check.quantity not in OPTIMIZER_QUANTITIES:
        return ""
    values = np.asarray(record[check.quantity][check.tensor], np.float64)
    for half in (dtype,) if dtype in HALF_DTYPES else HALF_DTYPES:
        if values.size and np.array_equal(held_at(values, half), values):
            return (f"; every value of {check.tensor}'s {check.quantity.replace('_', ' ')} is a {half} number: the run "
                    f"keeps its weights and Adam's moments in {half}, where mixed precision keeps them in float32 "
                    "(SPEC §14.2)")
    return ""


def _why_not_finite(record: Mapping[str, Any], check: StepCheck, training: TrainingConfig, dtype: str) -> str:
    """What made an update non-finite, read off the backend's own moments at that place."""
    m = float(np.asarray(record["first_moment"][check.tensor])[check.index])
    v = float(np.asarray(record["second_moment"][check.tensor])[check.index])
    if v != 0:
        return ""
    why = f"; there v = 0 and m = {m:.3g}, so m̂ / (√v̂ + ε) divides by ε alone"
    if training.eps < SMALLEST.get(dtype, 0.0):
        why += (f", and ε = {training.eps:g} is 0 in {dtype}, whose smallest number is {SMALLEST[dtype]:.3g} "
                f"((1 − β2)·g² underflows there too): Adam needs its moments and ε in a wider dtype")
    return why


def _malformed(trace: Any, steps: int, names: Sequence[str]) -> str | None:
    """Why a trace is not up to N records of the named arrays (a run that stopped ends with a
    {"stopped": why} record), or None."""
    if not isinstance(trace, Sequence) or not 0 < len(trace) <= steps:
        return f"expected {steps} step record(s), got {type(trace).__name__}" + (
            f" of {len(trace)}" if isinstance(trace, Sequence) else "")
    stopped = isinstance(trace[-1], Mapping) and set(trace[-1]) == {"stopped"}
    if len(trace) != steps and not stopped:
        return f"expected {steps} step record(s), got {len(trace)}"
    for step, record in enumerate(trace[:-1] if stopped else trace, 1):
        if not isinstance(record, Mapping) or set(record) != set(TRAINING_RECORD):
            return (f"step {step}: a record holds {', '.join(TRAINING_RECORD)}, got "
                    f"{sorted(record) if isinstance(record, Mapping) else type(record).__name__}")
        for key in TRAINING_RECORD[1:]:
            missing, extra = sorted(set(names) - set(record[key])), sorted(set(record[key]) - set(names))
            if missing or extra:
                return f"step {step} {key}: missing {missing or 'none'}, unexpected {extra or 'none'}"
    return None


def step_reference(cfg: ModelConfig, theta: Mapping[str, np.ndarray], batch) -> GradientReference:
    """The golden's loss and gradients (with their terms) at θ on one step's batch
    (src_ids, tgt_ids, targets, dropout_masks)."""
    src_ids, tgt_ids, targets, dropout_masks = batch
    return GradientReference(NumpyRunner.at(cfg, theta), "grad-loss",
                             {"src_ids": src_ids, "tgt_ids": tgt_ids, "targets": targets, "d_out": 1.0,
                              "dropout_masks": dropout_masks})


def gradient_bounds(reference: GradientReference, gradient_tol: float, kink_width: float) -> dict[str, float]:
    """τ per tensor: how far a backend's gradient may be from the golden's (SPEC §13: the tolerance
    on the larger of the gradient and its terms, and the ReLU kinks' allowance), the bound the
    moments inherit."""
    kinks = reference.kink_allowance(kink_width)
    return {name: gradient_tol * max(float(np.linalg.norm(g)), float(np.linalg.norm(reference.terms[name])))
            + kinks.get(name, 0.0) for name, g in reference.gradients.items() if name != "loss"}


def check_step(cfg: ModelConfig, training: TrainingConfig, step: int, batch, before: Mapping[str, Mapping[str, np.ndarray]],
               record: Mapping[str, Any], dtype: str, loss_tol: float, gradient_tol: float, kink_width: float,
               rounding: float, count: int | None = None) -> list[StepCheck]:
    """Step `step` (from 1) of a backend's run against the spec's formulas applied to the state
    it started from (`before`: params, first_moment, second_moment), every quantity; `count` the
    update's own number (the schedule's and the bias correction's step), `step` less the steps a
    loss scale skipped (SPEC §14.2)."""
    count = step if count is None else count
    theta = {name: np.asarray(value, np.float64) for name, value in before["params"].items()}
    reference = step_reference(cfg, theta, batch)
    golden = {name: g for name, g in reference.gradients.items() if name != "loss"}
    checks = []
    loss = compare(np.asarray(float(record["loss"])), reference.gradients["loss"], loss_tol)
    checks.append(StepCheck(step, "loss", loss.max_abs_err, loss.tol, f"loss {float(record['loss']):.9g}, golden "
                                                                      f"{float(reference.gradients['loss']):.9g}"))
    gradients = compare_gradients(record["gradients"], golden, reference.terms, gradient_tol,
                                  reference.kink_allowance(kink_width))
    checks.append(StepCheck(step, "gradients", gradients.rel_err, gradients.tol, gradients.reason)
                  if gradients.passed or math.isfinite(gradients.rel_err) else
                  StepCheck(step, "gradients", math.inf, gradients.tol, gradients.reason))
    tau = gradient_bounds(reference, gradient_tol, kink_width)
    factor, spread = 1.0, 0.0
    if training.clip_norm is not None:
        norm = _norm(golden)
        total = math.sqrt(sum(t * t for t in tau.values()))
        factor = min(1.0, training.clip_norm / norm)
        if norm + total > training.clip_norm:  # the backend's norm may clip differently: the factor moves
            # |c/‖g‖ − c/‖g*‖| for ‖g‖ within `total` of ‖g*‖; a factor is in [0, 1] whatever the norm
            spread = min(1.0, training.clip_norm * total / (norm * (norm - total))) if norm > total else 1.0
    clipped = {name: g * factor for name, g in golden.items()}
    tau = {name: factor * tau[name] + spread * float(np.linalg.norm(golden[name])) for name in golden}
    b1, b2 = training.beta1, training.beta2
    m = {name: b1 * np.asarray(before["first_moment"][name], np.float64) + (1 - b1) * g for name, g in clipped.items()}
    v = {name: b2 * np.asarray(before["second_moment"][name], np.float64) + (1 - b2) * g * g for name, g in clipped.items()}
    moments = [_tensorwise("first_moment", step, record["first_moment"], m,
                           {name: (1 - b1) * t for name, t in tau.items()}, rounding),
               _tensorwise("second_moment", step, record["second_moment"], v,
                           {name: (1 - b2) * (2 * float(np.abs(clipped[name]).max(initial=0.0)) * t + t * t)
                            for name, t in tau.items()}, rounding)]
    checks += [dataclasses.replace(c, detail=c.detail + _why_moment_is_off(c, dtype)
                                   + _why_kept_in_half(c, record, dtype)) for c in moments]
    # the update from the backend's own moments: only the update's own rounding is allowed
    rate = learning_rate(cfg, training, count)
    expected, allowed = {}, {}
    for name, before_value in theta.items():
        m_hat = np.asarray(record["first_moment"][name], np.float64) / (1 - b1 ** count)
        v_hat = np.asarray(record["second_moment"][name], np.float64) / (1 - b2 ** count)
        decay = training.weight_decay if decays(before_value.shape) else 0.0
        update = rate * (m_hat / (np.sqrt(v_hat) + training.eps) + decay * before_value)
        expected[name] = before_value - update
        allowed[name] = rounding * (float(np.linalg.norm(before_value)) + float(np.linalg.norm(update)))
    params = _tensorwise("params", step, record["params"], expected, allowed, 0.0)
    if not params.finite:
        params = dataclasses.replace(params, detail=params.detail + _why_not_finite(record, params, training, dtype))
    params = dataclasses.replace(params, detail=params.detail + _why_kept_in_half(params, record, dtype))
    return checks + [params]


def step_tolerances(cfg: ModelConfig, case: Case, dtype: str) -> dict[str, float]:
    """compare_training's bounds for a training case at dtype: the loss's, SPEC §8 at the case's
    depth; the gradients', at twice it, as every grad- case (§13); the kink width, the loss's (a
    pre-activation that tolerance cannot tell from 0 may be on either side); and one rounding in
    the dtype the weights and moments are kept in for the update (float32 under a half precision:
    mixed precision, SPEC §14.2)."""
    relative = case.tolerance(cfg, dtype)
    return {"loss_tol": relative, "gradient_tol": case.tolerance(cfg, dtype, 2 * SUBLAYERS[case.sublayer].depth(cfg)),
            "kink_width": relative, "rounding": tolerance(master_dtype(dtype), 1, 1)}


def _skipped(record: Mapping[str, Any], before: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
    """A step a loss scale skipped (SPEC §14.2): its gradients not all finite, and its weights and
    moments exactly those it started from."""
    if all(np.isfinite(np.asarray(g)).all() for g in record["gradients"].values()):
        return False
    return all(np.array_equal(np.asarray(record[key][name], np.float64), np.asarray(value, np.float64))
               for key in TRAINING_RECORD[2:] for name, value in before[key].items())


def compare_training(trace: Any, reference: TrainingReference, dtype: str, loss_tol: float, gradient_tol: float,
                     kink_width: float, rounding: float) -> Comparison:
    """A training case: every step from the backend's own state (check_step), failing at the
    first quantity of the first step that breaks its formula; the distance from the golden's
    own run after each step in the reason."""
    cfg, inputs = reference.cfg, reference.inputs
    training, batches = inputs["training"], training_batches(inputs)
    if (why := _malformed(trace, len(batches), list(reference.initial))) is not None:
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None, why)
    before = {"params": reference.initial, "first_moment": {n: np.zeros_like(v) for n, v in reference.initial.items()},
              "second_moment": {n: np.zeros_like(v) for n, v in reference.initial.items()}}
    worst, skipped = None, []
    for step, (batch, record) in enumerate(zip(batches, trace), 1):
        if "stopped" in record:
            return Comparison(False, math.inf, math.inf, 0.0, None, None, None,
                              f"step {step}: the run stopped ({record['stopped']}) after {step - 1} step(s) that "
                              f"agree; {_divergence(trace[:step - 1], reference)}")
        if loss_scaling(dtype) is not None and _skipped(record, before):
            # the scaled backward overflowed: nothing moved; the loss, taken before it, is still the golden's
            loss = compare(np.asarray(float(record["loss"])), step_reference(cfg, before["params"], batch)
                           .gradients["loss"], loss_tol)
            if not loss.passed:
                return Comparison(False, loss.max_abs_err, loss.max_abs_err, loss.tol, None, None, None,
                                  f"step {step} loss breaks its formula (a step the loss scale skipped): "
                                  f"{loss.reason}; {_divergence(trace[:step], reference)}")
            skipped.append(step)
            continue
        checks = check_step(cfg, training, step, batch, before, record, dtype, loss_tol, gradient_tol, kink_width,
                            rounding, step - len(skipped))
        failed = [c for c in checks if not c.ratio <= 1]
        if failed:
            first = failed[0]
            return Comparison(False, first.error, first.error, first.bound, None, None, None,
                              f"step {step} {first.quantity} breaks its formula: {first.detail}; "
                              f"{_divergence(trace[:step], reference)}")
        step_worst = max(checks, key=lambda c: c.ratio)
        worst = step_worst if worst is None or step_worst.ratio > worst.ratio else worst
        before = {key: record[key] for key in TRAINING_RECORD[2:]}
    scaling = loss_scaling(dtype)
    skips = "" if not skipped else (
        f"; step(s) {', '.join(map(str, skipped))} skipped by the loss scale (their gradients overflowed float16 at "
        f"{', '.join(f'{scaling.scale * scaling.backoff ** k:g}' for k in range(len(skipped)))} times the loss)")
    if worst is None:  # nothing of the update to check (the grad- cells judge the backward without a scale)
        raise NotJudged(f"the run took no step{skips}: the spec's loss scale starts at {scaling.scale:g} (SPEC §14.2)")
    return Comparison(True, worst.error, worst.error, worst.bound, None, None, None,
                      f"worst step {worst.step} {worst.quantity} ({worst.ratio:.2g} of its bound){skips}; "
                      f"{_divergence(trace, reference)}")


def failing_step(reason: str) -> str | None:
    """'step 3 params' from a failed training cell's reason: where the run first broke a formula."""
    found = re.match(r"step (\d+) (\w+) breaks its formula", reason)
    return f"step {found[1]} {found[2]}" if found else None


def divergence(trace: Sequence[Mapping[str, Any]], golden_run: Sequence[Mapping[str, Any]]) -> list[float]:
    """‖θ_k − θ*_k‖ / ‖θ*_k‖ after each step k: a run's distance from the golden's own."""
    distances = []
    for mine, golden in zip(trace, golden_run):
        difference = {n: np.asarray(mine["params"][n], np.float64) - g for n, g in golden["params"].items()}
        distances.append(_norm(difference) / _norm(golden["params"]))
    return distances


def _divergence(trace, reference: TrainingReference) -> str:
    distances = divergence(trace, reference.golden_run)
    if not distances:
        return "no step to measure from the golden's own run"
    text = "from the golden's own run after each step: " + ", ".join(f"{d:.2g}" for d in distances)
    positive = [d for d in distances if d > 0]
    if len(positive) >= 2:
        growth = (positive[-1] / positive[0]) ** (1 / (len(positive) - 1))
        text += f" (×{growth:.3g} per step)"
    return text
