"""What a check's parts take in memory, and what the machine has: the figures by which the golden
streams its float64 weights (impl_numpy.cast.CastOnRead) when its whole cast would not fit."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from impl_numpy.cast import layer_bytes

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
