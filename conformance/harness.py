"""The conformance matrix: every case × dtype × backend × device against the golden."""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import numpy as np

from conformance.adapter import NotSupported, backend_names, get_backend, importable_by_name
from conformance.backends.numpy_backend import NumpyRunner, golden_output
from conformance.cases import SUBLAYERS, Case, catalogue, forward_of, is_gradient, is_training
from conformance.parallel import WorkerPool, run_in_workers
from conformance.tolerance import DTYPES, compare, compare_generation, compare_gradients, tolerance
from conformance.training_cells import TrainingReference, compare_training
from spec import ModelConfig

PASS, FAIL, SKIP, ERROR = "pass", "fail", "skip", "error"


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
        for key in ("max_abs_err", "rel_err", "tol"):
            if record[key] is not None and not math.isfinite(record[key]):
                record[key] = str(record[key])  # JSON has no inf
        return record


def cell_id(sublayer: str, mask_case: str, dtype: str, backend: str, device: str) -> str:
    """The id a cell has in reports and under pytest: mha-causal_pad-float32-torch-cpu."""
    return f"{sublayer}-{mask_case}-{dtype}-{backend}-{device}"


def matches(test_id: str, pattern: str | None) -> bool:
    """-k filter: a substring, or a glob when it holds * ? or [."""
    if not pattern:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(test_id, pattern)
    return pattern in test_id


@dataclass
class Plan:
    """What a matrix run will do: the columns to run and the ones skipped up front (the cases
    are built when the weights are known: the generate cases read the golden's tokens)."""

    cfg: ModelConfig
    columns: list[tuple[str, str, str]]  # (backend, dtype, device) that can run
    skipped_columns: dict[tuple[str, str, str], str]  # (backend, dtype, device) -> reason


def plan_matrix(cfg: ModelConfig, backends: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
                devices: Iterable[str] | None = None) -> Plan:
    """Resolve the backends, dtypes and devices asked for into runnable and skipped columns."""
    names = list(backends) if backends is not None else backend_names()
    wanted_dtypes = list(dtypes) if dtypes is not None else list(DTYPES)
    for dtype in wanted_dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    columns, skipped = [], {}
    for name in names:
        backend, reason = get_backend(name)
        present = backend.devices() if backend else ["cpu"]
        wanted_devices = list(devices) if devices is not None else present
        for device in wanted_devices:
            for dtype in wanted_dtypes:
                key = (name, dtype, device)
                if backend is None:
                    skipped[key] = reason
                elif device not in present:
                    skipped[key] = f"device {device} not present for {name}"
                elif (why := backend.supports(dtype, device)) is not None:
                    skipped[key] = why
                else:
                    columns.append(key)
    return Plan(cfg, columns, skipped)


def run_matrix(cfg: ModelConfig, params: Mapping[str, np.ndarray], plan: Plan | None = None, *,
               pattern: str | None = None, fail_fast: bool = False,
               progress: Callable[[CellResult, int, int], None] | None = None, jobs: int = 1,
               pool: WorkerPool | None = None, backward: bool = False) -> list[CellResult]:
    """Run every planned cell whose id matches ``pattern``; skipped columns give skip cells.
    The gradient cases (grad-*, SPEC.md §13) run only with backward=True: JAX's autodiff, run
    eagerly per case, would triple a warm matrix (docs/backward.md has the figures).
    With jobs > 1, columns run in that many worker processes (conformance.parallel), taken from
    `pool` where the caller started them ahead (it is closed here, used or not); the results
    come back in the same order either way."""
    try:
        return _run_matrix(cfg, params, plan, pattern, fail_fast, progress, jobs, pool, backward)
    finally:
        if pool is not None:
            pool.close()


def _run_matrix(cfg, params, plan, pattern, fail_fast, progress, jobs, pool, backward) -> list[CellResult]:
    plan = plan or plan_matrix(cfg)
    cases = catalogue(cfg, params, backward)
    results: list[CellResult] = []
    for (name, dtype, device), reason in plan.skipped_columns.items():
        for case in cases:
            if matches(cell_id(case.sublayer, case.mask_case, dtype, name, device), pattern):
                results.append(CellResult(name, device, dtype, case.sublayer, case.mask_case, SKIP, reason=reason))
    work = []
    for column in plan.columns:
        name, dtype, device = column
        # a backend may say up front which sublayers it has, so a costly load (an ONNX export)
        # is not made for a column whose every cell would be skipped
        backend, _ = get_backend(name)
        why_not = getattr(backend, "supports_sublayer", lambda sublayer: None)
        for case in cases:
            if not matches(cell_id(case.sublayer, case.mask_case, dtype, name, device), pattern):
                continue
            if (why := why_not(case.sublayer)) is not None:
                results.append(CellResult(name, device, dtype, case.sublayer, case.mask_case, SKIP,
                                          reason=f"not supported: {why}"))
            else:
                work.append((case, column))
    finished: dict[int, CellResult] = {}

    def record(index: int, result: CellResult) -> bool:
        """Keep a cell's result; True when the run should stop."""
        finished[index] = result
        if progress:
            progress(result, len(finished), len(work))
        return fail_fast and result.status in (FAIL, ERROR)

    in_workers = [i for i, (_, (name, _, _)) in enumerate(work) if jobs > 1 and importable_by_name(name)]
    here = sorted(set(range(len(work))) - set(in_workers))
    golden, references, runners = golden_runner_for(cfg, params), {}, {}
    stopped = False
    for index in here:
        case, (name, dtype, device) = work[index]
        reference = reference_for(cfg, params, case, golden, references)
        if stopped := record(index, run_cell(cfg, params, case, name, dtype, device, reference, runners)):
            break
    if in_workers and not stopped:
        run_in_workers(cfg, params, [(i, work[i][0].name, work[i][1]) for i in in_workers], jobs, record, pool)
    return results + [finished[index] for index in sorted(finished)]


def golden_runner_for(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> NumpyRunner:
    return NumpyRunner(cfg, params, "float64")


def reference_for(cfg: ModelConfig, params, case: Case, golden: NumpyRunner, references: dict):
    """The golden's output for a case, computed once per case (a training case's: its own run)."""
    if case.name not in references:
        references[case.name] = TrainingReference(cfg, params, case.inputs) if is_training(case.sublayer) \
            else golden_output(cfg, params, case.sublayer, case.inputs, golden)
    return references[case.name]


def run_cell(cfg, params, case: Case, name: str, dtype: str, device: str, reference,
              runners: dict) -> CellResult:
    base = dict(backend=name, device=device, dtype=dtype, sublayer=case.sublayer, mask_case=case.mask_case)
    start = time.perf_counter()
    try:
        key = (name, dtype, device)
        if key not in runners:
            backend, _ = get_backend(name)
            runners[key] = backend.load(cfg, params, dtype, device)
        output = _output(runners[key], case)
        named = getattr(runners[key], "attention_path", None)
        base["path"] = named(case.sublayer, case.inputs) if named else ""
    except NotSupported as reason:
        return CellResult(**base, status=SKIP, reason=f"not supported: {reason}")
    except Exception as error:  # noqa: BLE001 - any backend failure (SpecError included) is a reported error
        return CellResult(**base, status=ERROR, reason=f"{type(error).__name__}: {error}",
                          seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    relative = tolerance(dtype, case.reduction_length, SUBLAYERS[case.sublayer].depth(cfg))
    if case.sublayer == "generate":
        result = compare_generation(output, *reference, relative, case.inputs["eos_id"])
    elif is_gradient(case.sublayer):
        # a pre-activation the forward's own tolerance cannot tell from 0 may be on either side
        kink_width = tolerance(dtype, case.reduction_length, SUBLAYERS[forward_of(case.sublayer)].depth(cfg))
        result = compare_gradients(output, reference.gradients, reference.terms, relative,
                                   reference.kink_allowance(kink_width))
    elif is_training(case.sublayer):
        # the loss's tolerance, the gradients' (twice the depth, as every grad- case) and a
        # stored value's own rounding for the update
        result = compare_training(output, reference, dtype, relative, tolerance(dtype, case.reduction_length, 2 * SUBLAYERS[
            case.sublayer].depth(cfg)), relative, tolerance(dtype, 1, 1))
    else:
        result = compare(output, reference, relative)
    return CellResult(**base, status=PASS if result.passed else FAIL, max_abs_err=result.max_abs_err,
                      rel_err=result.rel_err, tol=result.tol, worst_index=result.worst_index,
                      reason=result.reason, seconds=seconds)


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
