"""What a check's parts take in memory, and what the machine has: the figures by which the golden
streams its float64 weights (impl_numpy.cast.CastOnRead) when its whole cast would not fit."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from conformance.cases import BATCH
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


def golden_budget(cfg, params: Mapping[str, np.ndarray], available: int | None = None) -> int | None:
    """The bytes of float64 weights the golden may hold: None (all of them, cast once) where they
    take at most GOLDEN_SHARE of the available memory; else STREAMED_LAYERS of its largest layers,
    so that a model whose float64 copy does not fit runs layer by layer."""
    whole = sum(value.size for value in params.values()) * 8
    available = available_memory() if available is None else available
    if whole <= GOLDEN_SHARE * available:
        return None
    return STREAMED_LAYERS * layer_bytes(cfg, params)


# ---- the columns' memory ------------------------------------------------------------------------

COLUMNS_SHARE = 0.85  # the most of the memory available at the start that the columns may hold together
BYTES = {"float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2}  # a value's bytes, by the matrix's dtype


@dataclass(frozen=True)
class Footprint:
    """What a backend's column holds beyond its process's frameworks: `copies` of the weights at
    the column's dtype (a framework's own, an export's graph and its session's; `half_copies` at
    float16 and bfloat16, where some convert from float32), and its longest case's activations
    `activation_copies` times (the logits, mostly, at float32 or wider)."""

    copies: float
    half_copies: float | None = None
    activation_copies: float = 3.0


# Measured on SmolLM2-135M's shape (2 cores, 2026-11-26): the peak resident memory of a fresh
# process loading the column and running forward-none, decode-incremental and forward-long (its
# mapped weights' pages included), over the weights at the column's dtype. JAX holds about four
# copies after its first cached decoding (nnx's jitted state, kept beside the model's own).
FOOTPRINTS: dict[str, Footprint] = {
    "numpy-float32": Footprint(1.0),
    "torch": Footprint(1.2, 1.4),
    "torch-math": Footprint(1.2, 1.4),
    "jax": Footprint(4.7, 7.5),
    "jax-math": Footprint(4.7, 7.5),
    "onnx": Footprint(4.3, 6.0),
    "onnx-jax": Footprint(3.7, 6.5),
    "transformers": Footprint(1.6, 3.5),
    "onnxruntime-genai": Footprint(1.4, activation_copies=6.0),
}


def column_footprint(cfg, column: tuple[str, str, str], longest_positions: int) -> int:
    """Bytes a column is estimated to hold while it runs: its weights' copies at its dtype and
    the activations of its longest case (BATCH rows of `longest_positions`: the logits and the
    widest hidden states)."""
    name, dtype, _ = column
    figures = FOOTPRINTS.get(name, Footprint(2.0))
    width = BYTES.get(dtype, 4)
    copies = figures.half_copies if width == 2 and figures.half_copies is not None else figures.copies
    activations = BATCH * longest_positions * (cfg.tgt_vocab_size + 4 * max(cfg.d_model, cfg.d_ff)) * max(width, 4)
    return int(copies * count_params(cfg) * width + figures.activation_copies * activations)


def golden_footprint(cfg, params: Mapping[str, np.ndarray], longest_positions: int,
                     available: int | None = None) -> int:
    """Bytes the golden takes in a process that computes a reference (a worker may, and keeps its
    cast): its float64 weights, whole or streamed (golden_budget), and its longest case's logits."""
    weights = golden_budget(cfg, params, available)
    if weights is None:
        weights = sum(value.size for value in params.values()) * 8
    return int(weights + BATCH * longest_positions * cfg.tgt_vocab_size * 8)


class MemoryLedger:
    """The memory the columns running on this machine hold, against `limit` bytes: a column starts
    only where its footprint fits beside the others' (else its worker waits for one to finish), and
    one whose footprint is over the limit alone does not run at all (why_not says so, with the
    figures). Shared by the executor's workers and the in-process columns' thread."""

    def __init__(self, limit: int, footprint):
        self.limit, self.footprint = limit, footprint  # footprint(column) -> bytes
        self.held: dict[object, int] = {}
        self.changed = threading.Condition()

    def why_not(self, column) -> str | None:
        """None where the column fits alone; else why it cannot run here."""
        need = self.footprint(column)
        if need <= self.limit:
            return None
        return (f"needs about {need / 1e9:.1f} GB (its weights and activations at {column[1]}, estimated), more than "
                f"the {self.limit / 1e9:.1f} GB of this machine's memory the columns may take")

    def try_take(self, owner, column) -> bool:
        """Hold the column's footprint for `owner` if it fits beside the others now (an owner holds
        one column at a time: its previous one is released). A column alone always fits."""
        with self.changed:
            self.held.pop(owner, None)
            need = self.footprint(column)
            if self.held and sum(self.held.values()) + need > self.limit:
                return False
            self.held[owner] = need
            return True

    def take(self, owner, column) -> None:
        """try_take, waiting until it fits."""
        with self.changed:
            while not self.try_take(owner, column):
                self.changed.wait(timeout=1.0)

    def release(self, owner) -> None:
        with self.changed:
            self.held.pop(owner, None)
            self.changed.notify_all()
