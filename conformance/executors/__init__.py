"""Where the matrix's columns run. The harness (conformance.harness) plans the cells and hands
them to an executor, which runs each one with conformance.cells.run_cell wherever the column's
runner lives and reports it back as it finishes; the harness puts the results in the
sequential order. Three executors, one interface:

- InProcess (executors.in_process): every column in the calling process, one after another;
- LocalPool (executors.local_pool): columns in worker processes on this machine, the default
  of `rosetta check` (--jobs);
- RayCluster (executors.ray_cluster): columns in Ray actors on the nodes of a cluster, placed
  by the resources they need (`rosetta check --executor ray`).

A column whose backend was registered with a callable (conformance.byo) exists only in the
calling process: the harness runs it in-process whatever the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from conformance.adapter import get_backend
from conformance.cases import Case
from conformance.cells import CellResult
from spec import ModelConfig

Column = tuple[str, str, str]  # (backend, dtype, device)

# The groups that take longest go first, so that the last one to finish is short. With empty
# caches: the onnx group (two dtypes of torch.onnx exports) ~40 s; a dtype's jax and jax-math
# columns 15-35 s, and XLA compiles half-precision programs about twice as slowly as float32.
_SLOW_FIRST = ("onnx", "jax", "jax-math", "onnx-jax", "torch", "torch-math")
_SLOW_DTYPES_FIRST = ("bfloat16", "float16", "float32", "tf32", "float64")


@dataclass(frozen=True)
class WorkItem:
    """One cell to run: its place in the sequential order, its case and its column."""

    index: int
    case: Case
    column: Column


# called with each finished cell, in the calling process; True stops the run
OnResult = Callable[[int, CellResult], bool]


class Executor(Protocol):
    """Runs cells and reports each through on_result as it finishes, in any order. A column the
    executor cannot place is reported as skip cells with the reason; a process or node that dies
    turns the unfinished cells of its column into error cells that quote the cause."""

    def run(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], work: Sequence[WorkItem],
            on_result: OnResult) -> None: ...

    def close(self) -> None:
        """Free what the executor holds (processes, actors); safe to repeat."""


def cost_rank(column: Column) -> tuple[int, int]:
    """Where a column goes in a run's order: the slowest groups first, so that the last one to
    finish is short."""
    name, dtype, _ = column
    backends, dtypes = len(_SLOW_FIRST), len(_SLOW_DTYPES_FIRST)
    return (_SLOW_FIRST.index(name) if name in _SLOW_FIRST else backends,
            _SLOW_DTYPES_FIRST.index(dtype) if dtype in _SLOW_DTYPES_FIRST else dtypes)


def column_groups(columns: Sequence[Column]) -> list[list[Column]]:
    """Columns that compile the same programs, in the order given, as one group for one worker:
    a backend's optional `program_family` (jax and jax-math differ only in attention) with the
    dtype and device, or with the device alone where the backend says `family_spans_dtypes`
    (an ONNX exporter's start-up, the same for every dtype). A worker runs its group's columns
    one after another, so the later ones find the earlier one's work done in the same process."""
    groups: dict[tuple, list[Column]] = {}
    for column in columns:
        name, dtype, device = column
        backend, _ = get_backend(name)
        family = getattr(backend, "program_family", name)
        key = (family, device) if getattr(backend, "family_spans_dtypes", False) else (family, dtype, device)
        groups.setdefault(key, []).append(column)
    return list(groups.values())
