"""Every column in the calling process, one after another (`--jobs 1`, and any column whose
backend exists only in this process)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from conformance.backends.numpy_backend import NumpyRunner
from conformance.cells import drop_runners, golden_runner_for, reference_for, run_cell
from conformance.executors import OnResult, WorkItem
from conformance.executors.shared_references import SharedReferences, shared_reference
from conformance.plan.memory import MemoryLedger, give_back_freed
from spec import ModelConfig


class InProcess:
    """Runs cells here, loading each column's runner once and the golden's output once per case,
    on the caller's golden runner where it has one (its float64 parameters, cast once), through
    `shared` where the run's worker processes compute references too (each computed once)."""

    def __init__(self, golden: NumpyRunner | None = None, memory: MemoryLedger | None = None,
                 shared: SharedReferences | None = None, references: dict | None = None):
        self.golden = golden
        self.memory = memory  # where set (the harness's), a column starts when its memory is free
        self.shared = shared
        self.references = references  # kept by the caller across runs (conformance.cells.KeptGolden)

    def _start(self, column, current, runners: dict) -> None:
        if self.memory is not None and column != current:
            # the previous column's runner goes before this one waits for memory: a waiting owner holds
            # nothing, so that where every owner waits, one of them can start (MemoryLedger.try_take)
            drop_runners(runners)
            self.memory.release(self)
            self.memory.take(self, column)

    def run(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], work: Sequence[WorkItem],
            on_result: OnResult) -> None:
        golden = self.golden if self.golden is not None and self.golden.params is params \
            else golden_runner_for(cfg, params)
        references = {} if self.references is None else self.references
        runners = {}
        column, waiting = None, {item.case.name for item in work}  # the cases whose reference is still to make
        try:
            for item in work:
                self._start(item.column, column, runners)
                column = item.column
                name, dtype, device = column
                # shared: stored in the run's folder and read back mapped, so this process need not keep it
                kept = references if self.shared is None else {}
                reference = shared_reference(self.shared, item.case.name,
                                             lambda: reference_for(cfg, params, item.case, golden, kept))
                waiting.discard(item.case.name)
                if not waiting and self.shared is None and self.references is None:
                    golden.release()  # every reference made: its float64 weights need not sit under the columns
                result = run_cell(cfg, params, item.case, name, dtype, device, reference, runners)
                give_back_freed()  # what the cell freed, rather than kept under the next column's memory
                if on_result(item.index, result):
                    return
        finally:
            if self.memory is not None:
                self.memory.release(self)

    def close(self) -> None:
        pass
