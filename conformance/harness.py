"""The conformance matrix: every case × dtype × backend × device against the golden. The harness
plans the cells and hands them to an executor (conformance.executors); a cell is run and judged
by conformance.cells, whose names are also importable from here."""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import functools
import operator
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from conformance.adapter import backend_names, get_backend, importable_by_name
from conformance.cases import Case, build_case, case_names, is_backward
from conformance.cells import (  # noqa: F401 - the cell's names, where callers have long found them
    ABSENT, ERROR, FAIL, NO_SUCH_SUBLAYER, PASS, PLANNED_OUT, SKIP, TOO_LARGE, CellResult, KeptGolden, cell_id,
    golden_runner_for, reference_for, run_cell, unavailable_kind)
from conformance.plan.cost import logit_rows, positions
from conformance.executors import Executor, WorkItem
from conformance.executors.in_process import InProcess
from conformance.executors.local_pool import LocalPool, WorkerPool
from conformance.executors.shared_references import SharedReferences
from conformance.plan.memory import (COLUMNS_SHARE, Extent, MemoryLedger, available_memory, column_footprint,
                                     columns_limit, export_bytes, golden_budget_for, golden_footprint, reference_bytes,
                                     references_here)
from conformance.text import Prompts
from conformance.tolerance import DTYPES
from spec import ModelConfig
from spec.config import GOLDEN_BACKWARD, check_computed_by


def matches(test_id: str, pattern: str | None) -> bool:
    """-k filter: a substring, or a glob when it holds * ? or [; alternatives joined by | (any)."""
    if not pattern:
        return True
    if "|" in pattern:
        return any(matches(test_id, part) for part in pattern.split("|") if part)
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
    # where a budget chose the cells (conformance.plan.budget): (sublayer, mask case, column) of those
    # that run; the others are skip cells that give `left_out` as their reason
    chosen: frozenset[tuple[str, str, tuple[str, str, str]]] | None = None
    left_out: str = ""
    # the columns whose load would export first (cold_columns), where the planner has asked once: each
    # asking hashes the weights per ONNX column (2.2 s at SmolLM2-135M's size), and a check's plan,
    # budget and memory ledger each need them
    cold: frozenset[tuple[str, str, str]] | None = None


def plan_matrix(cfg: ModelConfig, backends: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
                devices: Iterable[str] | None = None, cluster_devices: Sequence[str] | None = None) -> Plan:
    """Resolve the backends, dtypes and devices asked for into runnable and skipped columns.
    A device is present where the backend sees it here, or, for a run on a cluster, where some
    node has it (cluster_devices): the node that takes the column checks that its backend sees it."""
    names = list(backends) if backends is not None else backend_names()
    wanted_dtypes = list(dtypes) if dtypes is not None else list(DTYPES)
    for dtype in wanted_dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    columns, skipped = [], {}
    for name in names:
        backend, reason = get_backend(name)
        present = backend.devices() if backend else ["cpu"]
        if backend and cluster_devices is not None:
            present = list(dict.fromkeys([*present, *cluster_devices]))
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
                elif (why := getattr(backend, "supports_config", lambda cfg, dtype: None)(cfg, dtype)) is not None:
                    skipped[key] = why  # a feature of this model it does not compute (at this dtype; SPEC §5.15)
                else:
                    columns.append(key)
    return Plan(cfg, columns, skipped)


def runnable_cells(plan: Plan, names: Sequence[tuple[str, str]], pattern: str | None = None
                   ) -> list[tuple[str, str, tuple[str, str, str]]]:
    """(sublayer, mask case, column) of every cell the plan's columns would run, in the sequential
    order: those `pattern` matches and whose backend has the sublayer."""
    cells = []
    for column in plan.columns:
        name, dtype, device = column
        backend, _ = get_backend(name)
        why_not = getattr(backend, "supports_sublayer", lambda sublayer: None)
        cells += [(sublayer, mask_case, column) for sublayer, mask_case in names
                  if matches(cell_id(sublayer, mask_case, dtype, name, device), pattern) and why_not(sublayer) is None]
    return cells


def run_matrix(cfg: ModelConfig, params: Mapping[str, np.ndarray], plan: Plan | None = None, *,
               pattern: str | None = None, fail_fast: bool = False,
               progress: Callable[[CellResult, int, int], None] | None = None, jobs: int = 1,
               pool: WorkerPool | None = None, backward: bool = False,
               executor: Executor | None = None, prompts: Prompts | None = None,
               memory_total: int | None = None, kept_golden: KeptGolden | None = None) -> list[CellResult]:
    """Run every planned cell whose id matches ``pattern``; skipped columns give skip cells.
    The gradient cases (grad-*, SPEC.md §13) run only with backward=True: JAX's autodiff, run
    eagerly per case, would triple a warm matrix (docs/backward.md has the figures).
    The cells run on `executor` (conformance.executors), closed here; without one, in this
    process, or with jobs > 1 in that many local worker processes, taken from `pool` where the
    caller started them ahead (closed here, used or not). The results come back in the
    sequential order whatever ran them. `progress` is called with each finished cell, the cells
    finished and the cells to run; one with a `planned` method is first given the number of
    cells each column will run. With `prompts` (conformance.text) the text cases run too.
    memory_total: the bytes the whole check may hold (`rosetta check --memory`); the columns are
    scheduled within what is left of it (conformance.plan.memory.columns_limit).
    kept_golden: the golden of this model (conformance.cells.KeptGolden) that the caller keeps across
    runs, whose cases and references this run uses and adds to rather than making its own."""
    if backward:  # the gradient and training cases' reference is the golden's backward
        check_computed_by(cfg, GOLDEN_BACKWARD)
    if kept_golden is not None and not kept_golden.holds(cfg, params):
        raise ValueError("kept_golden is the golden of another model: it serves the config and weights it was made for")
    if kept_golden is not None and prompts is not None:
        raise ValueError("kept_golden keeps the catalogue's cases; a run with prompts builds its own text cases")
    executor = executor or (LocalPool(jobs, pool) if jobs > 1 else InProcess())
    try:
        return _run_matrix(cfg, params, plan, pattern, fail_fast, progress, backward, executor, prompts, memory_total,
                           kept_golden)
    finally:
        executor.close()
        if pool is not None:
            pool.close()


def _run_matrix(cfg, params, plan, pattern, fail_fast, progress, backward, executor: Executor,
                prompts: Prompts | None, memory_total: int | None, kept: KeptGolden | None) -> list[CellResult]:
    plan = plan or plan_matrix(cfg)
    names = case_names(cfg, backward, text=prompts is not None)
    results: list[CellResult] = []
    for (name, dtype, device), reason in plan.skipped_columns.items():
        kind = unavailable_kind(reason)
        for sublayer, mask_case in names:
            if matches(cell_id(sublayer, mask_case, dtype, name, device), pattern):
                results.append(CellResult(name, device, dtype, sublayer, mask_case, SKIP, reason=reason, skip=kind))
    # a case is built only when some column runs it: its inputs may take the golden to make (the
    # generate cases' rows), which at a real checkpoint's size costs more than the cell itself
    built: dict[tuple[str, str], Case] = {} if kept is None else kept.cases
    # its float64 parameters cast when first needed, once
    golden = golden_runner_for(cfg, params) if kept is None else kept.runner
    params = params if kept is None else kept.params  # the same weights, the object the golden holds
    work: list[WorkItem] = []
    # the workers' references computed here where their float64 goldens would crowd the memory
    producing = hasattr(executor, "reference") and references_here(params, executor.jobs, memory_total)
    memory = memory_ledger(cfg, params, plan, names, pattern, prompts, references_here=producing,
                           memory_total=memory_total, workers=getattr(executor, "jobs", 0)) \
        if hasattr(executor, "memory") else None
    lengths = [len(row) for row in prompts.ids] if prompts else []
    for column in plan.columns:
        name, dtype, device = column
        # a backend may say up front which sublayers it has, so a costly load (an ONNX export)
        # is not made for a column whose every cell would be skipped
        backend, _ = get_backend(name)
        why_not = getattr(backend, "supports_sublayer", lambda sublayer: None)
        too_large = memory.why_not(column) if memory else None
        for sublayer, mask_case in names:
            if not matches(cell_id(sublayer, mask_case, dtype, name, device), pattern):
                continue
            if (why := why_not(sublayer)) is not None:
                results.append(CellResult(name, device, dtype, sublayer, mask_case, SKIP,
                                          reason=f"not supported: {why}", skip=NO_SUCH_SUBLAYER))
                continue
            # the memory first: a budget's plan chose no cell that the memory cannot hold
            if too_large:  # never started, rather than killed by the kernel for want of memory
                results.append(CellResult(name, device, dtype, sublayer, mask_case, SKIP, reason=too_large,
                                          skip=TOO_LARGE))
                continue
            if plan.chosen is not None and (sublayer, mask_case, column) not in plan.chosen:
                # the budget's plan left out the cells whose case the memory cannot hold: said so
                too_long = memory.why_not(column, cell_extent(cfg, sublayer, mask_case, lengths)) if memory else None
                results.append(CellResult(name, device, dtype, sublayer, mask_case, SKIP,
                                          reason=too_long or plan.left_out, skip=TOO_LARGE if too_long else PLANNED_OUT))
                continue
            if (sublayer, mask_case) not in built:
                built[sublayer, mask_case] = build_case(cfg, params, sublayer, mask_case, lambda: golden.p, prompts,
                                                             passes=golden.passes)
            work.append(WorkItem(len(work), built[sublayer, mask_case], column))
    if "p" not in vars(golden):  # not cast yet (a generate case's rows would have): its budget may change
        golden.budget = golden_budget_for(cfg, params, [item.case for item in work])
    finished: dict[int, CellResult] = {}
    stopped = False
    if hasattr(progress, "planned"):  # a progress that reports by column (terminal.ColumnLines)
        progress.planned(collections.Counter(item.column for item in work))

    def record(index: int, result: CellResult) -> bool:
        """Keep a cell's result; True when the run should stop."""
        nonlocal stopped
        finished[index] = result
        if progress:
            progress(result, len(finished), len(work))
        stopped = stopped or (fail_fast and result.status in (FAIL, ERROR))
        return stopped

    # a backend registered with a callable exists only in this process (conformance.byo)
    elsewhere = [item for item in work if importable_by_name(item.column[0])]
    here = [item for item in work if not importable_by_name(item.column[0])]
    if isinstance(executor, InProcess):
        here, elsewhere = work, []
    references = None if kept is None else kept.references
    with contextlib.ExitStack() as stack:
        shared = None
        if elsewhere and producing:
            # this process holds the golden: it computes the references for the workers (and its own
            # columns), so that no worker casts the golden's float64 weights
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="rosetta-references-"))
            shared = SharedReferences(folder)
            executor.reference = lambda case: reference_for(cfg, params, case, golden, {})
            executor.references = folder
        if memory is not None:
            # what is left now that the cases are built (the golden's choice of the generate rows is held
            # here) and the golden cast, less what its references take while they are computed
            if shared is not None:
                golden.p  # noqa: B018 - cast now, so the memory measured next is what is left beside it
            memory.limit = max(0, columns_limit(memory_total, getattr(executor, "jobs", 0)) - memory.golden_activations)
            executor.memory = memory
        if here and elsewhere:
            # both at once: the executor's workers need not wait for this process's columns (a real
            # checkpoint's transformers and onnxruntime-genai columns take minutes)
            _alongside(lambda: InProcess(golden, memory, shared, references).run(cfg, params, here, record),
                       lambda: executor.run(cfg, params, elsewhere, record))
        elif here:
            InProcess(golden, memory, references=references).run(cfg, params, here, record)
        elif elsewhere:
            executor.run(cfg, params, elsewhere, record)
    return results + [finished[index] for index in sorted(finished)]


def cold_columns(cfg: ModelConfig, params: Mapping[str, np.ndarray], columns) -> set:
    """The columns whose load would export first: a backend that can say (load_is_cached) says not
    cached (conformance.plan.cost counts the export's minutes, the memory ledger its peak)."""
    cold = set()
    for column in columns:
        cached = getattr(get_backend(column[0])[0], "load_is_cached", None)
        if cached is not None and not cached(cfg, params, column[1]):
            cold.add(column)
    return cold


def memory_ledger(cfg: ModelConfig, params: Mapping[str, np.ndarray], plan: Plan, names: Sequence[tuple[str, str]],
                  pattern: str | None, prompts: Prompts | None, references_here: bool = False,
                  memory_total: int | None = None, workers: int = 0) -> MemoryLedger:
    """The ledger by which the columns run on this machine share its memory (conformance.plan.memory):
    COLUMNS_SHARE of what is available now, each column's footprint from its dtype and the longest
    case it runs, with the golden's where the process that runs it computes references: a worker
    does for the gradient and training cases, and for every case unless `references_here` (the
    local executor's harness computes them: the worker reads them mapped, and this process holds
    the golden and its activations, which the ledger's golden_activations says). memory_total: the
    bytes the whole check may hold (conformance.plan.memory.columns_limit; MemoryTooSmall where they do
    not hold this process, the golden it will cast and its workers)."""
    lengths = [len(row) for row in prompts.ids] if prompts else []
    longest: dict[tuple[str, str, str], Extent] = {}
    unchosen: dict[tuple[str, str, str], Extent] = {}  # the columns a budget's plan chose no cell of
    backward: set[tuple[str, str, str]] = set()
    for sublayer, mask_case, column in runnable_cells(plan, names, pattern):
        extent = cell_extent(cfg, sublayer, mask_case, lengths)
        if plan.chosen is None or (sublayer, mask_case, column) in plan.chosen:
            longest[column] = longest.get(column, Extent(1, 1)) | extent
            if is_backward(sublayer):
                backward.add(column)
        else:
            unchosen[column] = unchosen.get(column, Extent(1, 1)) | extent
    available = available_memory()
    longest_case = functools.reduce(operator.or_, longest.values(), Extent(1, 1))
    # a column the plan left out whole is measured on its own cases, so that why_not says where the
    # memory was the cause (the budget left it out for that: conformance.check._fit)
    longest.update({column: extent for column, extent in unchosen.items() if column not in longest})
    reference = reference_bytes(cfg, longest_case)
    golden_weights = golden_footprint(cfg, params, longest_case, available) - reference  # cast here later, if not already

    # an uncached ONNX export holds more than its sessions
    exporting = plan.cold if plan.cold is not None else cold_columns(cfg, params, longest)

    def footprint_at(column, extent: Extent) -> int:
        own = reference_bytes(cfg, extent)  # its case's reference, mapped
        if workers and (column in backward or not references_here):
            # the golden a worker casts for itself; without workers, the columns run beside this
            # process's golden, counted once in the limit (held_here)
            own += golden_weights
        exporting_too = export_bytes(cfg, column) if column in exporting else 0
        return column_footprint(cfg, column, extent) + own + exporting_too

    def footprint(column) -> int:
        return footprint_at(column, longest.get(column, Extent(1, 1)))

    ledger = MemoryLedger(columns_limit(memory_total, workers, golden_weights) if memory_total else
                          int(COLUMNS_SHARE * available), footprint, footprint_at)
    ledger.golden_activations = 2 * reference if references_here else 0
    return ledger


def cell_extent(cfg: ModelConfig, sublayer: str, mask_case: str, lengths: Sequence[int] = ()) -> Extent:
    """How far a cell's case reaches: its positions and its rows of logits (conformance.plan.cost)."""
    return Extent(positions(cfg, sublayer, mask_case, lengths), logit_rows(cfg, sublayer, mask_case, lengths))


def _alongside(background: Callable[[], None], foreground: Callable[[], None]) -> None:
    """Run background in a thread while foreground runs here; an exception from either is raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            background()
        except BaseException as error:  # noqa: BLE001 - raised again in the calling thread
            raised.append(error)

    thread = threading.Thread(target=run, name="in-process columns", daemon=True)
    thread.start()
    try:
        foreground()
    finally:
        thread.join()
    if raised:
        raise raised[0]
