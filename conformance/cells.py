"""One cell of the matrix: a case run by one column (backend, dtype, device) and compared with
the golden, and the result it gives. Every executor (conformance.executors) runs cells with
run_cell, in whatever process or node holds the column's runner."""

from __future__ import annotations

import functools
import gc
import math
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import numpy as np

from conformance.adapter import NotSupported, Partial, get_backend
from conformance.backends.numpy_backend import NumpyRunner, golden_output
from conformance.cases import NEAR_TIE_CASES, SUBLAYERS, TEXT_CASES, Case, forward_of, is_gradient, is_training
from conformance.diagnosis.field_metrics import field_metrics
from conformance.plan.memory import give_back_freed, golden_budget
from conformance.diagnosis.routing import compare_router, near_ties, replayed_routing, replayed_training
from conformance.tolerance import SUBNORMAL_SPACING, backward_error, compare, compare_generation
from conformance.training_cells import NotJudged, TrainingReference, compare_training, step_tolerances
from spec import ModelConfig, params_digest

PASS, FAIL, SKIP, ERROR = "pass", "fail", "skip", "error"
# Why a cell was skipped, which decides whether a column that ran nothing fails the verdict:
ABSENT = "absent"  # declared up front: the framework is not installed, the device not present, or the
#                    backend does not run this dtype on this device (the plan's skipped columns)
NO_SUCH_SUBLAYER = "sublayer"  # declared up front: the backend has no such sublayer (supports_sublayer)
PLANNED_OUT = "planned out"  # declared up front: the plan's budget left the cell out (conformance.plan.budget)
TOO_LARGE = "memory"  # declared up front: the column's footprint is more than the memory the columns may take
REFUSED = "refused"  # the backend refused the cell while loading or running it (NotSupported), or failed to load
NOT_JUDGED = "not judged"  # nothing its rule could judge: a training run whose every step was skipped, a
#                          bound of the outputs' own size (SPEC §8: any output would pass), or a backward
#                          whose golden chain leaves the dtype's range (SPEC §13)


def unavailable_kind(reason: str) -> str:
    """The kind of a skip for a column no runner was made for: a backend that is installed but
    raised while loading (adapter.get_backend's "failed to load") is broken, anything else absent."""
    return REFUSED if reason.startswith("failed to load") else ABSENT


@dataclass(frozen=True)
class CellResult:
    backend: str
    device: str
    dtype: str
    sublayer: str
    mask_case: str
    status: str  # pass | fail | skip | error
    max_abs_err: float | None = None
    rel_err: float | None = None
    tol: float | None = None
    worst_index: tuple[int, ...] | None = None
    reason: str = ""
    seconds: float = 0.0
    path: str = ""  # the attention the cell ran, where the runner names it (Runner.attention_path)
    graph: str = ""  # the ONNX graph that served the cell, where the runner names it (Runner.graph_served)
    skip: str = ""  # a skipped cell's kind: ABSENT, NO_SUCH_SUBLAYER, PLANNED_OUT, TOO_LARGE, REFUSED or NOT_JUDGED
    left_out: str = ""  # the rows a runner could not compute the spec's way, and why (adapter.Partial)
    # a text generate case's tokens, the backend's and the golden's, rows of ids (the report decodes them)
    tokens: tuple[tuple[int, ...], ...] | None = None
    golden_tokens: tuple[tuple[int, ...], ...] | None = None
    # a whole-model cell's metrics of the field (conformance.diagnosis.field_metrics): KL, top-1, top-5, ...
    field: dict | None = None

    @property
    def test_id(self) -> str:
        return cell_id(self.sublayer, self.mask_case, self.dtype, self.backend, self.device)

    @property
    def ratio(self) -> float | None:
        if self.max_abs_err is None or self.tol is None:
            return None
        return self.max_abs_err / self.tol if self.tol > 0 else (0.0 if self.max_abs_err == 0 else math.inf)

    def to_dict(self) -> dict:
        record = asdict(self)
        record["passed"] = self.status == PASS
        record["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        for key in ("tokens", "golden_tokens", "field"):  # a text generate case's alone; a whole-model cell's
            if record[key] is None:
                del record[key]
        if "field" in record:
            record["field"] = {key: str(value) if isinstance(value, float) and not math.isfinite(value) else value
                               for key, value in record["field"].items()}
        for key in ("max_abs_err", "rel_err", "tol"):
            if record[key] is not None and not math.isfinite(record[key]):
                record[key] = str(record[key])  # JSON has no inf
        return record


def cell_id(sublayer: str, mask_case: str, dtype: str, backend: str, device: str) -> str:
    """The id a cell has in reports and under pytest: mha-causal_pad-float32-torch-cpu."""
    return f"{sublayer}-{mask_case}-{dtype}-{backend}-{device}"


def golden_runner_for(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> NumpyRunner:
    """The golden at float64; streamed layer by layer where its whole cast would not fit here
    (conformance.plan.memory.golden_budget)."""
    return NumpyRunner(cfg, params, "float64", golden_budget(cfg, params))


class KeptGolden:
    """The golden of one model kept by a caller across runs of the matrix (a gallery of mistakes,
    each its own run on the same weights): each case built and its reference computed once,
    however many runs ask for it. A reference is the golden's alone, whichever column a run checks."""

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray]):
        self.cfg, self.params = cfg, params
        self.runner = golden_runner_for(cfg, params)
        self.cases: dict[tuple[str, str], Case] = {}
        self.references: dict[str, object] = {}

    def holds(self, cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> bool:
        """Whether this is the golden of that model: the same config and the same weights (the
        same arrays, or arrays of the same digest)."""
        if cfg != self.cfg or params.keys() != self.params.keys():
            return False
        return all(params[name] is self.params[name] for name in params) or params_digest(params) == self.digest

    @functools.cached_property
    def digest(self) -> str:
        """The kept weights' digest, taken once: a gallery asks for it at every mistake on a model of its own."""
        return params_digest(self.params)


def reference_for(cfg: ModelConfig, params, case: Case, golden: NumpyRunner, references: dict):
    """The golden's output for a case, computed once per case (a training case's: its own run)."""
    if case.name not in references:
        references[case.name] = TrainingReference(cfg, params, case.inputs) if is_training(case.sublayer) \
            else golden_output(cfg, params, case.sublayer, case.inputs, golden)
    return references[case.name]


def drop_runners(runners: dict) -> None:
    """Drop a process's runners and give their memory back before the next column loads. One that
    outlives the drop sits in a reference cycle, which only the collector frees, and it would run
    after the next column had loaded beside it (an ONNX runner's sessions did: 1.9 GB at
    SmolLM2-135M's size); it is collected (0.15 s with the frameworks imported), only then."""
    try:
        dropped = [weakref.ref(runner) for runner in runners.values()]
    except TypeError:  # a runner that cannot be weakly referenced cannot say: collected
        dropped = None
    runners.clear()
    if dropped is None or any(reference() is not None for reference in dropped):
        gc.collect()
    give_back_freed(above=0)  # whatever the process grew by: a drop of its weights can hide what its cells left


def run_cell(cfg, params, case: Case, name: str, dtype: str, device: str, reference,
              runners: dict) -> CellResult:
    """Run one cell on the column's runner from `runners` (loaded there when it is not: the one
    runner a process holds) and judge it against the golden's `reference`."""
    base = dict(backend=name, device=device, dtype=dtype, sublayer=case.sublayer, mask_case=case.mask_case)
    if (relative := case.tolerance(cfg, dtype)) >= 1:  # SPEC §8: a bound the outputs' size passes anything
        return CellResult(**base, status=SKIP, skip=NOT_JUDGED,
                          reason=f"not judged: SPEC §8's bound here is {relative:.3g} of the outputs' size (its "
                                 f"amplification {case.amplification:.3g}), so no output could fail")
    start = time.perf_counter()
    try:
        key = (name, dtype, device)
        if key not in runners:
            # every executor runs a column's cells together: the columns before it are done, and
            # their runners go before this one loads (at a real checkpoint's size each holds GBs)
            drop_runners(runners)
            backend, _ = get_backend(name)
            runners[key] = backend.load(cfg, params, dtype, device)
        if case.mask_case in NEAR_TIE_CASES and not _replays_routing(runners[key], case.sublayer):
            raise NotSupported("the case sits at a routing tie by construction, where rounding picks either expert: "
                               "only a column that can replay the golden's routing is judged on it"
                               + (" (this one's gradients route on their own)" if hasattr(runners[key], "routing_log")
                                  else ""))
        output = _output(runners[key], case)
        named = getattr(runners[key], "attention_path", None)
        base["path"] = named(case.sublayer, case.inputs) if named else ""
        served = getattr(runners[key], "graph_served", None)
        base["graph"] = served(case.sublayer) if served else ""
    except NotSupported as reason:
        return CellResult(**base, status=SKIP, reason=f"not supported: {reason}", skip=REFUSED)
    except Exception as error:  # noqa: BLE001 - any backend failure (SpecError included) is a reported error
        return CellResult(**base, status=ERROR, reason=f"{type(error).__name__}: {error}",
                          seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    compared = None
    if isinstance(output, Partial):  # only some rows are the spec's computation: those are compared
        if not np.any(output.compared):
            return CellResult(**base, status=SKIP, reason=f"not supported: {output.describe()}", skip=REFUSED,
                              seconds=seconds)
        base["left_out"] = output.describe()
        output, compared = output.output, output.compared
    if case.sublayer == "generate" and case.mask_case in TEXT_CASES:
        base["tokens"], base["golden_tokens"] = _rows(output), _rows(reference[0])
    # each kind's comparison, kept to judge a mixture of experts' replayed run by the same rule
    if case.sublayer == "generate":
        def judge(tokens):
            return compare_generation(tokens, *reference, relative, case.inputs["eos_id"], compared)
    elif is_gradient(case.sublayer):
        # a pre-activation the forward's own tolerance cannot tell from 0 may be on either side
        kink_width = case.tolerance(cfg, dtype, SUBLAYERS[forward_of(case.sublayer)].depth(cfg))

        # where the golden found a norm dividing by a small size, the gradients' own conditioning may bound them
        width = backward_error(dtype, case.reduction_length) if case.amplification > 1 else None

        def judge(gradients):
            return reference.judge(gradients, relative, reference.kink_allowance(kink_width), SUBNORMAL_SPACING[dtype],
                                   width)
    elif is_training(case.sublayer):
        def judge(trained):
            return compare_training(trained, reference, dtype, **step_tolerances(cfg, case, dtype))
    elif case.sublayer == "router":
        def judge(routed):
            return compare_router(cfg, params, case, routed, dtype)
    else:
        def judge(values):
            return compare(values, reference, relative, case.floor, compared)
    try:
        result = judge(output)
    except NotJudged as why:
        return CellResult(**base, status=SKIP, reason=f"not judged: {why}", skip=NOT_JUDGED, seconds=seconds)
    if not result.judged:  # every part's bound reached its size: no output could have failed (SPEC §8)
        return CellResult(**base, status=SKIP, reason=result.reason, skip=NOT_JUDGED, seconds=seconds)
    if not result.passed and is_gradient(case.sublayer) and (why := reference.beyond_range(dtype, output)):
        return CellResult(**base, status=SKIP, reason=f"not judged: {why}", skip=NOT_JUDGED, seconds=seconds)
    if not result.passed and cfg.moe is not None and case.sublayer != "router":  # a router cell is the routing
        result = _routing_verdict(cfg, params, case, runners[key], dtype, judge, result)
    base["field"] = _field_metrics(case, output, reference, compared, dtype)
    return CellResult(**base, status=PASS if result.passed else FAIL, max_abs_err=result.max_abs_err,
                      rel_err=result.rel_err, tol=result.tol, worst_index=result.worst_index,
                      reason=result.reason, seconds=seconds)


def _replays_routing(runner, sublayer: str) -> bool:
    """Whether a column can run this case with the golden's routing forced: a runner with a
    routing_log, and for a gradient or training case one whose backward replays it too (the
    golden's own VJPs route on their own: numpy-float32's cannot)."""
    if not hasattr(runner, "routing_log"):
        return False
    return not (is_gradient(sublayer) or is_training(sublayer)) or getattr(runner, "replays_backward_routing", True)


def _routing_verdict(cfg, params, case: Case, runner, dtype: str, judge, failed):
    if not hasattr(runner, "routing_log"):
        return near_ties(cfg, params, case, dtype, failed)
    split = replayed_training if case.sublayer == "train_steps" else replayed_routing
    verdict = split(cfg, params, case, runner, dtype, judge, failed, _output)
    if case.mask_case in NEAR_TIE_CASES:
        return replace(verdict, reason="every token of this case sits at a routing tie by construction; "
                                       f"{verdict.reason}")
    return verdict


def _field_metrics(case: Case, output, reference, compared, dtype: str) -> dict | None:
    """The field's metrics of a whole-model cell (conformance.diagnosis.field_metrics); None where the
    output is not what they read (the comparison has said why)."""
    try:
        return field_metrics(case.sublayer, output, reference, compared, dtype)
    except (TypeError, ValueError, IndexError):
        return None


def _rows(tokens) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(token) for token in row) for row in np.asarray(tokens))


def _output(runner, case: Case):
    """What a runner gives for a case: run's output, or a gradient case's named gradients from
    Runner.gradients (a runner without it has no backward: skipped, with that reason)."""
    if is_training(case.sublayer):
        train = getattr(runner, "train", None)
        if train is None:
            raise NotSupported("this backend does not train (its runner has no train method)")
        return train(case.sublayer, case.inputs)
    if not is_gradient(case.sublayer):
        return runner.run(case.sublayer, case.inputs)
    gradients = getattr(runner, "gradients", None)
    if gradients is None:
        raise NotSupported("this backend computes no gradients (its runner has no gradients method)")
    return gradients(case.sublayer, case.inputs)
