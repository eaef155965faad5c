"""One conformance check of a model, as `rosetta check` makes it, callable from Python:

    from conformance.check import check_model
    run = check_model(preset="tiny", backends=["numpy-float32", "torch"], dtypes=["float32"])
    run.counts, run.passed; run.write_report("reports/mine")

The model is a preset's conformance weights, a weights file or a Hugging Face directory's import
(conformance.models); the matrix is planned (optionally one shard of it), run on an executor,
and the failing whole-model columns localized stage by stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conformance.cells import ERROR, FAIL, PASS, CellResult
from conformance.executors import Executor
from conformance.executors.local_pool import WorkerPool, auto_jobs
from conformance.harness import plan_matrix, run_matrix
from conformance.localize import localize_failures
from conformance.models import load_model, register_model_directory
from conformance.report import (empty_columns, format_problems, format_table, generated_text, matrix_passed,
                                summary_counts, write_report)
from conformance.shards import shard_plan
from conformance.text import decode_rows, prompts_for
from spec import InputError, ModelConfig


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
        return matrix_passed(self.results)

    def write_report(self, directory: str | Path) -> list[Path]:
        """report.json, report.md and heatmap.png (conformance.report) into directory."""
        return write_report(Path(directory), self.results, self.cfg, self.source, self.params, self.seconds,
                            format_table(self.results), format_problems(self.results), self.localizations,
                            placements=self.placements, text=self.text)


def check_model(*, preset: str = "tiny", seed: int = 0, weights: str | Path | None = None,
                hf: str | Path | None = None, backends: Sequence[str] | None = None,
                dtypes: Sequence[str] | None = None, devices: Sequence[str] | None = None,
                shard: tuple[int, int] | None = None, pattern: str | None = None, fail_fast: bool = False,
                backward: bool = False, localize_every_column: bool = False, jobs: int | None = None,
                executor: Executor | None = None, pool: WorkerPool | None = None,
                progress: Callable[[CellResult, int, int], None] | None = None,
                prompts: Sequence[str] | None = None) -> CheckRun:
    """Check a model: weights (a file), else hf (a Hugging Face directory, whose transformers and
    onnxruntime-genai columns join the backends), else the preset's conformance weights of seed.
    shard (I, N) runs the I-th of N slices of the columns (conformance.shards). The cells run on
    `executor` (e.g. executors.ray_cluster.RayCluster, whose devices count as present), else in
    `jobs` local worker processes (None: one per core on the CPU), taken from `pool` where the
    caller started them ahead; both are closed here. prompts: texts that the hf directory's own
    tokenizer turns into the text cases (conformance.text; decoder-only checkpoints)."""
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
        results = run_matrix(cfg, params, plan, pattern=pattern, fail_fast=fail_fast, progress=progress,
                             jobs=auto_jobs(plan.columns) if jobs is None else jobs, pool=pool, backward=backward,
                             executor=executor, prompts=text)
    finally:
        if pool is not None:
            pool.close()
        if executor is not None:
            executor.close()
    seconds = time.perf_counter() - start
    continuations = generated_text(results, text.texts, lambda rows: decode_rows(hf, rows, text.eos_id)) if text else []
    return CheckRun(cfg, params, source, results, seconds, localize_failures(cfg, params, results, localize_every_column),
                    getattr(executor, "placements", None), continuations)
