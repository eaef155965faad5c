"""One conformance check of a model, as `rosetta check` makes it, callable from Python:

    from conformance.check import check_model
    run = check_model(preset="tiny", backends=["numpy-float32", "torch"], dtypes=["float32"])
    run.counts, run.passed; run.write_report("reports/mine")

The model is a preset's conformance weights, a weights file or a Hugging Face directory's import
(conformance.models); the matrix is planned (optionally one shard of it), run on an executor,
and the failing whole-model columns localized stage by stage.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conformance.plan.budget import DEFAULT_BUDGET, BudgetPlan, fit_budget, format_seconds, larger_than_presets
from conformance.cases import case_names
from conformance.cells import ERROR, FAIL, PASS, CellResult
from conformance.executors import Executor
from conformance.executors.local_pool import WorkerPool, auto_jobs
from conformance.harness import Plan, cell_extent, cold_columns, memory_ledger, plan_matrix, run_matrix, runnable_cells
from conformance.diagnosis.explain import explain_failures
from conformance.diagnosis.localize import localize_failures
from conformance.plan.memory import MemoryLedger, MemoryTooSmall, references_here
from conformance.models import checkpoint_dtype, load_model, register_model_directory
from conformance.output.report import (empty_columns, format_problems, format_table, generated_text, matrix_passed,
                                summary_counts, write_report)
from conformance.deployment.quantized import check_quantized, format_quantized, quantized_as_dict
from conformance.diagnosis.routing import routing_margins
from conformance.output.shards import shard_plan
from conformance.text import Prompts, decode_rows, prompts_for
from spec import InputError, ModelConfig
from spec.quantization import QuantizationScheme


@dataclass
class CheckRun:
    """What one check ran: the model and its source, every cell, and where the columns ran."""

    cfg: ModelConfig
    params: dict[str, np.ndarray] = field(repr=False)
    source: dict
    results: list[CellResult]
    seconds: float
    localizations: dict = field(default_factory=dict)
    placements: dict | None = None  # the executor's, where it spreads columns over nodes
    text: list[dict] = field(default_factory=list)  # the text generate case's continuations (report.generated_text)
    plan: BudgetPlan | None = None  # where a budget chose the cells
    explanations: dict = field(default_factory=dict)  # whole-model columns' failures by omissions (conformance.diagnosis.explain)
    routing: list[dict] = field(default_factory=list)  # a mixture of experts' margins per case (conformance.diagnosis.routing)
    quantized: list = field(default_factory=list)  # the quantized deployments' columns (conformance.deployment.quantized)

    @property
    def counts(self) -> dict[str, int]:
        return summary_counts(self.results)

    @property
    def ran(self) -> bool:
        """False when every cell was skipped or filtered out."""
        return any(r.status in (PASS, FAIL, ERROR) for r in self.results)

    @property
    def empty_columns(self) -> dict[str, str]:
        """The columns that ran no cell though they had some, with why (report.empty_columns)."""
        return empty_columns(self.results)

    @property
    def passed(self) -> bool:
        return matrix_passed(self.results) and all(column.passed for column in self.quantized)

    def write_report(self, directory: str | Path) -> list[Path]:
        """report.json, report.md and heatmap.png (conformance.output.report) into directory."""
        return write_report(Path(directory), self.results, self.cfg, self.source, self.params, self.seconds,
                            format_table(self.results), format_problems(self.results), self.localizations,
                            explanations=self.explanations, routing=self.routing,
                            quantized=[quantized_as_dict(column) for column in self.quantized],
                            quantized_text=format_quantized(self.quantized),
                            placements=self.placements, text=self.text, plan=self.plan_figures)

    @property
    def plan_figures(self) -> dict | None:
        """A budgeted plan's figures with the time the check took beside its estimate."""
        if self.plan is None:
            return None
        return {**self.plan.to_dict(), "took_s": round(self.seconds, 1),
                "took_over_estimate": round(self.seconds / max(self.plan.estimate.seconds, 1e-9), 2)}


def check_model(*, preset: str = "tiny", seed: int = 0, weights: str | Path | None = None,
                hf: str | Path | None = None, backends: Sequence[str] | None = None,
                dtypes: Sequence[str] | None = None, devices: Sequence[str] | None = None,
                shard: tuple[int, int] | None = None, pattern: str | None = None, fail_fast: bool = False,
                backward: bool = False, localize_every_column: bool = False, jobs: int | None = None,
                executor: Executor | None = None, pool: WorkerPool | None = None,
                progress: Callable[[CellResult, int, int], None] | None = None,
                prompts: Sequence[str] | None = None, budget: float | None = None, size_aware: bool = False,
                on_plan: Callable[[BudgetPlan], None] | None = None, memory: int | None = None,
                quantized: Sequence[QuantizationScheme] = (), quant_budget: Mapping[str, float] | None = None,
                ) -> CheckRun:
    """Check a model: weights (a file), else hf (a Hugging Face directory, whose transformers and
    onnxruntime-genai and ctranslate2 columns join the backends), else the preset's conformance weights of seed.
    shard (I, N) runs the I-th of N slices of the columns (conformance.output.shards). The cells run on
    `executor` (e.g. executors.ray_cluster.RayCluster, whose devices count as present), else in
    `jobs` local worker processes (None: one per core on the CPU), taken from `pool` where the
    caller started them ahead; both are closed here. prompts: texts that the hf directory's own
    tokenizer turns into the text cases (conformance.text; decoder-only checkpoints). budget:
    seconds the cells are chosen to fit, by value (conformance.plan.budget; BudgetTooSmall where not
    one whole-model cell fits), the plan handed to on_plan before anything runs; size_aware:
    without a budget, DEFAULT_BUDGET where the model is larger than the presets (`rosetta
    check`'s default; --full runs everything). memory: bytes the whole check may hold, its
    processes together (`--memory`; else COLUMNS_SHARE of the memory available goes to the columns).
    quantized: weight-only schemes whose deployments (our float32 export quantized by onnxruntime)
    are checked after the matrix (conformance.deployment.quantized), quant_budget the cost they may take."""
    start = time.perf_counter()
    try:
        if hf:
            register_model_directory(hf)
        cfg, params, source = load_model(preset=preset, seed=seed, weights=weights, hf=hf)
        if prompts and not hf:
            raise InputError("the text cases tokenize with the checkpoint's own tokenizer: give --hf DIR")
        text = prompts_for(cfg, hf, list(prompts)) if prompts else None
        plan = plan_matrix(cfg, backends, dtypes, devices, cluster_devices=executor.devices() if executor else None)
        if shard:
            plan = shard_plan(plan, *shard)
            source = {**source, "shard": f"{shard[0]}/{shard[1]}"}
        if budget is None and size_aware and larger_than_presets(cfg):
            budget = DEFAULT_BUDGET
        if memory is not None or budget is not None:  # asked once for the workers, the budget and the ledger
            plan = dataclasses.replace(plan, cold=frozenset(cold_columns(cfg, params, plan.columns)))
        if jobs is None:
            jobs = auto_jobs(plan.columns)
            if memory is not None and jobs > 1:
                jobs = _workers_in_memory(cfg, params, plan, backward, pattern, text, jobs, memory)
        budgeted = None
        if budget is not None:
            plan, budgeted = _fit(cfg, params, plan, source, budget, backward, pattern, text, jobs, memory)
            if on_plan:
                on_plan(budgeted)
        results = run_matrix(cfg, params, plan, pattern=pattern, fail_fast=fail_fast, progress=progress,
                             jobs=jobs, pool=pool, backward=backward, executor=executor, prompts=text,
                             memory_total=memory)
    finally:
        if pool is not None:
            pool.close()
        if executor is not None:
            executor.close()
    columns = check_quantized(cfg, params, quantized, quant_budget, directory=hf) if quantized else []
    seconds = time.perf_counter() - start
    continuations = generated_text(results, text.texts, lambda rows: decode_rows(hf, rows, text.eos_id)) if text else []
    return CheckRun(cfg, params, source, results, seconds, localize_failures(cfg, params, results, localize_every_column),
                    getattr(executor, "placements", None), continuations, budgeted,
                    explanations=explain_failures(cfg, params, results),
                    routing=routing_margins(cfg, params, results), quantized=columns)


def _columns_in_memory(ledger: MemoryLedger, plan: Plan) -> int:
    """How many of the plan's columns the memory holds at once, by their median footprint. Where
    a --memory holds one, an automatic --jobs runs the columns in this process: a second worker
    would wait, holding its frameworks, while the first's column takes the memory (SmolLM2-135M's
    shape at --memory 6G, torch, jax and onnx at float32: two workers peaked at 6.6 GB in 189 s,
    this process alone at 5.1 GB in 161 s)."""
    if not plan.columns:
        return 1
    footprints = sorted(ledger.footprint(column) for column in plan.columns)
    return max(1, ledger.limit // footprints[len(footprints) // 2])


def _workers_in_memory(cfg: ModelConfig, params, plan: Plan, backward: bool, pattern: str | None,
                       text: Prompts | None, jobs: int, memory: int) -> int:
    """The local workers, at most `jobs`, for a check given `memory` bytes in all: as many as the
    columns it holds at once (_columns_in_memory), 1 (this process) where the workers' frameworks
    alone would not fit beside it (the run refuses, with the figures, where even that does not)."""
    try:
        ledger = _ledger(cfg, params, plan, backward, pattern, text, jobs, memory)
    except MemoryTooSmall:
        return 1
    return min(jobs, _columns_in_memory(ledger, plan))


def _ledger(cfg: ModelConfig, params, plan: Plan, backward: bool, pattern: str | None, text: Prompts | None,
            jobs: int, memory: int | None) -> MemoryLedger:
    """The memory ledger of a run on `jobs` local workers (none where jobs is 1: this process)."""
    names = case_names(cfg, backward, text=text is not None)
    workers = jobs if jobs > 1 else 0
    return memory_ledger(cfg, params, plan, names, pattern, text, references_here=references_here(params, workers, memory),
                         memory_total=memory, workers=workers)


def _fit(cfg: ModelConfig, params, plan: Plan, source: dict, budget: float, backward: bool, pattern: str | None,
         text: Prompts | None, jobs: int, memory: int | None = None) -> tuple[Plan, BudgetPlan]:
    """The plan with the cells a budget holds chosen (conformance.plan.budget), and the choice."""
    names = case_names(cfg, backward, text=text is not None)
    cells = runnable_cells(plan, names, pattern)
    # the cells run in parallel on the workers, but no faster than the cores let them, and no more
    # columns at once than the memory holds (conformance.plan.memory: at a 0.5B model's size, one)
    ledger = _ledger(cfg, params, plan, backward, pattern, text, jobs, memory)
    in_memory = _columns_in_memory(ledger, plan)
    # a cell whose case the memory cannot hold in its column is skipped by the run: the budget goes
    # to the others (a column's shorter cases run where its longest does not fit)
    lengths = [len(row) for row in text.ids] if text else []
    cells = [cell for cell in cells if ledger.why_not(cell[2], cell_extent(cfg, cell[0], cell[1], lengths)) is None]
    workers = max(1, min(jobs, os.cpu_count() or 1, len(plan.columns), in_memory))
    cold = plan.cold if plan.cold is not None else cold_columns(cfg, params, plan.columns)
    budgeted = fit_budget(cfg, cells, budget, checkpoint_dtype(source), workers, lengths, cold)
    left_out = f"left out by the plan's budget of {format_seconds(budget)} (--full runs every cell)"
    return dataclasses.replace(plan, chosen=frozenset(budgeted.chosen), left_out=left_out), budgeted
