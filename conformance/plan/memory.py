"""What a check's parts take in memory, and what the machine has: the figures by which the golden
streams its float64 weights (impl_numpy.cast.CastOnRead) when its whole cast would not fit."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from conformance.cases import BATCH, is_backward
from impl_numpy.cast import layer_bytes
from spec.params import count_params

GOLDEN_SHARE = 0.25  # the most of the available memory the golden's float64 weights may take whole
STREAMED_LAYERS = 2  # a streamed golden holds this many of its largest layers


def available_memory() -> int:
    """Bytes the kernel says can be taken without swapping (MemAvailable), else physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resident_memory() -> int:
    """Bytes of this process's memory resident now (its mapped files' pages included), else 0."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _libc(function: str, result=None):
    """One of glibc's functions where this process runs on glibc and has it, else None."""
    name = ctypes.util.find_library("c")
    try:
        found = getattr(ctypes.CDLL(name), function, None) if name else None
    except OSError:
        return None
    if found is not None and result is not None:
        found.restype = result
    return found


class _HeapInfo(ctypes.Structure):  # glibc's struct mallinfo2 (2.33 and later): every field a size_t
    _fields_ = [(field, ctypes.c_size_t) for field in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_MALLOC_TRIM = _libc("malloc_trim")
_MALLINFO2 = _libc("mallinfo2", _HeapInfo)
# A trim gives back pages the next cell faults in again (measured alone: the tiny matrix of
# numpy-float32 and torch 15-30% slower with a trim after every cell, the mutation gallery's tests 59 s
# against 53 s), while a real-size cell frees hundreds of MB: a trim waits until the process has grown
# by this much since the last one and its heap holds at least this much free.
TRIM_ABOVE = 64 * 2**20
# The least resident memory seen since the last trim. Growth, not the free heap's figure, says a
# trim has something to give back: a trim leaves the free chunks free (it gives their pages back), so
# a long-lived process (a test worker after a catalogue) holds hundreds of MB free in fragments after
# it, and trimming whenever that figure passed TRIM_ABOVE trimmed after every cell, each trim walking
# the whole heap (6,746 trims, 23 s, in the mutation gallery's tests run after test_jax in one process).
_resident_since_trim = 0


def heap_free_bytes() -> int | None:
    """Bytes the heap holds free (freed, not yet given back), where glibc says; else None."""
    return None if _MALLINFO2 is None else int(_MALLINFO2().fordblks)


def give_back_freed(above: int = TRIM_ABOVE) -> None:
    """Return the pages the heap holds free to the kernel (glibc's malloc_trim; nothing elsewhere)
    once the process has grown by `above` bytes since the last trim and its heap holds as much free.
    An allocator keeps what a large case freed, and the next column's memory lands beside it:
    measured on SmolLM2-135M's shape, a JAX column's process kept 1.3 GB of its 2.7 GB after one
    cached decoding, and gave it back here (benchmarks/footprints.py). Where the resident memory or
    the free heap cannot be read, that condition is taken as met."""
    global _resident_since_trim
    if _MALLOC_TRIM is None:
        return
    resident = resident_memory()
    _resident_since_trim = min(_resident_since_trim, resident)
    if resident and resident - _resident_since_trim < above:
        return
    # only then the free heap: mallinfo2 walks every free chunk, which took as long as the trims it
    # spared on a fragmented heap (8 s in the mutation gallery's tests after test_jax)
    free = heap_free_bytes()
    if free is None or free >= above:
        _MALLOC_TRIM(0)
        _resident_since_trim = resident_memory()


def float64_bytes(params: Mapping[str, np.ndarray]) -> int:
    """Bytes of the parameters cast to float64: the golden's copy, whole."""
    return sum(value.size for value in params.values()) * 8


def golden_budget(cfg, params: Mapping[str, np.ndarray], available: int | None = None) -> int | None:
    """The bytes of float64 weights the golden may hold: None (all of them, cast once) where they
    take at most GOLDEN_SHARE of the available memory; else STREAMED_LAYERS of its largest layers,
    so that a model whose float64 copy does not fit runs layer by layer."""
    whole = float64_bytes(params)
    available = available_memory() if available is None else available
    if whole <= GOLDEN_SHARE * available:
        return None
    return STREAMED_LAYERS * layer_bytes(cfg, params)


def reads_each_weight_once(cases) -> bool:
    """Whether the golden's work is one case that reads each weight at most once (one forward pass,
    not a decoding's steps nor a gradient's second pass): its whole float64 cast would hold every
    layer to be read once, where a streamed one holds about one layer (the one-cell check of
    Qwen2.5-0.5B's shape held its 4 GB cast beside the column's float32 copy: 8.4 GB)."""
    if len({case.name for case in cases}) != 1:
        return False
    sublayer = next(iter(cases)).sublayer
    return sublayer not in ("decode", "generate") and not is_backward(sublayer)


def golden_budget_for(cfg, params: Mapping[str, np.ndarray], cases, available: int | None = None) -> int | None:
    """golden_budget, streamed where the run's golden work reads each weight once (reads_each_weight_once)."""
    if reads_each_weight_once(cases):
        return STREAMED_LAYERS * layer_bytes(cfg, params)
    return golden_budget(cfg, params, available)


# ---- the columns' memory ------------------------------------------------------------------------

# the most of the memory available at the start that the columns may hold together: SmolLM2-135M's
# default check peaked at 14.9 GB of 24 at 0.85 (532 s), 13.0 GB at 0.5 (581 s, its budget 600)
COLUMNS_SHARE = 0.5
BYTES = {"float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2}  # a value's bytes, by the matrix's dtype
WORKER_BYTES = 400_000_000  # a worker process with torch, JAX, onnxruntime and transformers imported (measured 0.39 GB)
_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}


def parse_memory(text: str) -> int:
    """Bytes from '6G', '6 GB', '512M', '1.5g' or a bare number of bytes (decimal units, as the
    reports print GB); ValueError naming the text where it is not one."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)b?\s*", text.lower())
    if not match:
        raise ValueError(f"--memory {text!r}: give a size such as 6G, 6GB or 512M")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"--memory {text!r}: the size must be positive")
    return value


def columns_limit(total: int | None, workers: int, held_here: int = 0) -> int:
    """The bytes the columns may hold together: COLUMNS_SHARE of the memory available now, and
    where the check is given `total` bytes in all, no more than what is left of it beside this
    process (as resident now, plus `held_here` bytes it will take) and its workers' frameworks."""
    share = int(COLUMNS_SHARE * available_memory())
    if total is None:
        return share
    left = total - resident_memory() - held_here - workers * WORKER_BYTES
    if left <= 0:
        raise MemoryTooSmall(
            f"--memory {total / 1e9:.1f} GB leaves nothing for the columns: this process holds "
            f"{(resident_memory() + held_here) / 1e9:.1f} GB (the weights, the golden's float64 copy, the cases) "
            f"and its {workers} worker process(es) about {workers * WORKER_BYTES / 1e9:.1f} GB before any column loads")
    return min(share, left)


def references_here(params: Mapping[str, np.ndarray], workers: int, total: int | None = None) -> bool:
    """Whether the harness computes the references its workers read (executors.shared_references.
    Producer) rather than each worker that first needs one: where the workers' float64 copies of
    the golden would take more than GOLDEN_SHARE of the memory (the available, or `total`). The
    harness's one golden then serves them all, at a cost in time: its process computes every
    reference while running its own columns, and a worker waits for each (SmolLM2-135M's default
    check took 727 s so, 498 s with the workers computing, at 12.1 and 17.6 GB)."""
    if workers < 1:
        return False
    memory = available_memory() if total is None else min(total, available_memory())
    return workers * float64_bytes(params) > GOLDEN_SHARE * memory


class MemoryTooSmall(ValueError):
    """A --memory that does not hold the check's own process and workers."""


@dataclass(frozen=True)
class Footprint:
    """What a backend's column holds beyond its process's frameworks: `copies` of the weights at
    the column's dtype (a framework's own, an export's graph and its session's; `half_copies` at
    float16 and bfloat16, where some convert from float32), and its longest case's activations
    `activation_copies` times (the logits, mostly, at float32 or wider; `half_activation_copies` at
    float16 and bfloat16, where a backend takes more there)."""

    copies: float
    half_copies: float | None = None
    activation_copies: float = 3.0
    half_activation_copies: float | None = None
    # the copies while the column first exports its model (its load not cached: export.cache), at
    # float32 and at half precision, where they are more than `copies`
    export_copies: tuple[float, float] | None = None
    # a mixture of experts computed with every expert on every token, their outputs stacked and the
    # chosen gathered (the sdpa paths and their exports, SPEC §5.14): [tokens, experts, d] twice over
    every_expert_on_every_token: bool = False


# Measured on SmolLM2-135M's shape (2 cores, 2026-11-28; benchmarks/footprints.py, its page in
# reports/bench/footprints/): a fresh process loading the column and running forward-none,
# decode-incremental, forward-long and decode-far, freed pages given back after each case as a worker
# does (its mapped weights' pages included). `copies`: the peak through the loading and forward-none
# over the weights at the column's dtype; `activation_copies`: what the longer cases took beyond that,
# over their activations once (an ONNX column's decoding session, made at its first decoding, among
# them); each about a tenth above the measurement. The ONNX columns' figures are those of an export
# whose graphs share one mapped weights file (export.onnx_model.SharedWeights) and whose sessions are
# made at their first use; `export_copies`, those of the same run exporting first (not cached:
# onnx/float32 6.18, onnx/float16 7.38, onnx-jax 4.78, measured before the shared file). A
# backend's activation figure is its larger dtype's, but for ONNX's float16 graphs (6.19, their
# casts' copies; float32's 5.21).
FOOTPRINTS: dict[str, Footprint] = {
    "numpy-float32": Footprint(1.0, activation_copies=2.6),
    "torch": Footprint(1.3, 1.5, activation_copies=2.8, every_expert_on_every_token=True),
    "torch-math": Footprint(1.3, 1.5, activation_copies=2.8),
    "jax": Footprint(1.4, 3.3, activation_copies=5.3, every_expert_on_every_token=True),
    "jax-math": Footprint(1.4, 3.3, activation_copies=5.3),
    "onnx": Footprint(1.4, 3.3, activation_copies=5.7, half_activation_copies=6.8, export_copies=(6.8, 8.1),
                      every_expert_on_every_token=True),
    "onnx-jax": Footprint(1.4, activation_copies=3.5, export_copies=(5.3, 5.3), every_expert_on_every_token=True),
    "transformers": Footprint(1.5, 3.9, activation_copies=3.3),
    "onnxruntime-genai": Footprint(1.7, activation_copies=5.4),
    # its converter holds transformers' model and its own spec at once
    "ctranslate2": Footprint(3.1, activation_copies=3.0),
}


def weight_copies(name: str, dtype: str) -> float:
    """The copies of its weights a backend's column holds at dtype (FOOTPRINTS)."""
    figures = FOOTPRINTS.get(name, Footprint(2.0))
    return figures.half_copies if BYTES.get(dtype, 4) == 2 and figures.half_copies is not None else figures.copies


def activation_copies(name: str, dtype: str) -> float:
    """The copies of its longest case's activations a backend's column holds at dtype (FOOTPRINTS)."""
    figures = FOOTPRINTS.get(name, Footprint(2.0))
    half = BYTES.get(dtype, 4) == 2 and figures.half_activation_copies is not None
    return figures.half_activation_copies if half else figures.activation_copies


def export_bytes(cfg, column: tuple[str, str, str]) -> int:
    """What a column holds beyond its footprint while it exports its model first (its load not
    cached): the export's copies of the weights over its sessions' (FOOTPRINTS' export_copies)."""
    name, dtype, _ = column
    figures = FOOTPRINTS.get(name, Footprint(2.0))
    if figures.export_copies is None:
        return 0
    extra = figures.export_copies[BYTES.get(dtype, 4) == 2] - weight_copies(name, dtype)
    return max(0, int(extra * count_params(cfg) * BYTES.get(dtype, 4)))


@dataclass(frozen=True)
class Extent:
    """How far a column's cases reach: the most positions one runs (its hidden states, its caches)
    and the most rows of logits one holds (conformance.plan.cost.logit_rows): decode-far runs 1,003
    positions for 2 rows of logits, forward-long 520 for 520."""

    positions: int
    logit_rows: int

    @classmethod
    def of(cls, longest: Extent | int) -> Extent:
        """An Extent, or a number of positions whose every row has logits."""
        return longest if isinstance(longest, Extent) else cls(longest, longest)

    def __or__(self, other: Extent) -> Extent:
        return Extent(max(self.positions, other.positions), max(self.logit_rows, other.logit_rows))


def activation_bytes(cfg, column: tuple[str, str, str], longest: Extent | int) -> int:
    """The activations a column is estimated to hold: BATCH rows of its longest case's logits and
    widest hidden states, activation_copies times (measured: benchmarks/footprints.py)."""
    name, dtype, _ = column
    extent = Extent.of(longest)
    activations = BATCH * (extent.logit_rows * cfg.tgt_vocab_size + extent.positions * 4 * max(cfg.d_model, cfg.d_ff))
    width = max(BYTES.get(dtype, 4), 4)
    return int(activation_copies(name, dtype) * activations * width) + every_expert_bytes(cfg, name, extent) * width


def every_expert_bytes(cfg, name: str, longest: Extent | int) -> int:
    """Elements a column's mixture of experts holds beyond the rest where it computes every expert on
    every token (Footprint.every_expert_on_every_token): the experts' outputs [tokens, E, d], as a list
    and stacked. A Qwen3-Next layer's 128 experts at 3 rows of 1,003 positions: 1.6 G elements, which
    the copies of the logits and hidden states did not count (its jax column at float32 held 13.6 GB
    against an estimate of 4.6; the check's processes together were killed for memory)."""
    if cfg.moe is None or not FOOTPRINTS.get(name, Footprint(2.0)).every_expert_on_every_token:
        return 0
    return 2 * BATCH * Extent.of(longest).positions * cfg.moe.n_experts * cfg.d_model


def column_footprint(cfg, column: tuple[str, str, str], longest: Extent | int) -> int:
    """Bytes a column is estimated to hold while it runs: its weights' copies at its dtype and
    its longest case's activations."""
    name, dtype, _ = column
    return int(weight_copies(name, dtype) * count_params(cfg) * BYTES.get(dtype, 4)) + \
        activation_bytes(cfg, column, longest)


def reference_bytes(cfg, longest: Extent | int) -> int:
    """Bytes of the longest case's reference: its float64 logits (a worker reads them mapped)."""
    return BATCH * Extent.of(longest).logit_rows * cfg.tgt_vocab_size * 8


def golden_footprint(cfg, params: Mapping[str, np.ndarray], longest: Extent | int,
                     available: int | None = None) -> int:
    """Bytes the golden takes in a process that computes a reference (a worker may, and keeps its
    cast): its float64 weights, whole or streamed (golden_budget), and its longest case's logits."""
    weights = golden_budget(cfg, params, available)
    if weights is None:
        weights = float64_bytes(params)
    return int(weights + reference_bytes(cfg, longest))


class MemoryLedger:
    """The memory the columns running on this machine hold, against `limit` bytes: a column starts
    only where its footprint fits beside the others' (else its worker waits for one to finish), and
    one whose footprint is over the limit alone does not run at all (why_not says so, with the
    figures). Shared by the executor's workers and the in-process columns' thread."""

    def __init__(self, limit: int, footprint, footprint_at=None):
        self.limit, self.footprint = limit, footprint  # footprint(column) -> bytes
        # footprint_at(column, extent) -> bytes: the column where its longest case reaches extent
        self.footprint_at = footprint_at or (lambda column, extent: footprint(column))
        self.held: dict[object, int] = {}
        self.kept: dict[object, int] = {}  # what an owner's process measured it still holds after its last column
        self.golden_activations = 0  # what the golden's references take while the harness computes them
        self.changed = threading.Condition()

    def why_not(self, column, extent: Extent | None = None) -> str | None:
        """None where the column fits alone (running cases no longer than `extent`, where given);
        else why it cannot run here."""
        need = self.footprint(column) if extent is None else self.footprint_at(column, extent)
        if need <= self.limit:
            return None
        return (f"needs about {need / 1e9:.1f} GB (its weights and activations at {column[1]}, estimated), more than "
                f"the {self.limit / 1e9:.1f} GB of this machine's memory the columns may take")

    def try_take(self, owner, column) -> bool:
        """Hold the column's footprint for `owner` if it fits beside the others now (an owner holds
        one column at a time: its previous one is released), or what the owner's process still
        keeps from its last one where that is more. A column alone always fits."""
        with self.changed:
            previous = self.held.pop(owner, None)
            need = max(self.footprint(column), self.kept.get(owner, 0))
            if self.held and sum(self.held.values()) + need > self.limit:
                if previous is not None:  # what its process keeps is held while it waits
                    self.held[owner] = previous
                return False
            self.held[owner] = need
            return True

    def take(self, owner, column) -> None:
        """try_take, waiting until it fits."""
        with self.changed:
            while not self.try_take(owner, column):
                self.changed.wait(timeout=1.0)

    def release(self, owner, kept: int = 0) -> None:
        """The owner's column is done; its process still holds `kept` bytes of it (measured, freed
        pages given back: give_back_freed), counted while the owner takes no other column."""
        with self.changed:
            self.held.pop(owner, None)
            if kept > 0:  # held until the process ends or takes its next column
                self.held[owner] = self.kept[owner] = kept
            else:
                self.kept.pop(owner, None)
            self.changed.notify_all()
