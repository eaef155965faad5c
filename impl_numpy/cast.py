"""The golden's parameters at its computation dtype, cast as the functions read them.

The golden computes in float64, twice the size of the float32 weights: 4 GB for a 0.5B model,
more than a 1B model's whole float32 checkpoint. CastOnRead holds at most `budget` bytes of cast
tensors, dropping the least recently read first, so that a forward pass, which reads the layers
in order, holds about one layer in float64 at a time. The functions are the same ones that run
on cast_params's dict (params_under gives a view of the same tensors, spec.params), so a
streamed golden gives the same bits (tests/test_streamed_golden.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

import numpy as np

from spec import ModelConfig, check_params


class CastOnRead(Mapping):
    """params (float32, e.g. memory-mapped) read at `dtype`; each tensor cast when read and kept
    while the cast ones fit in `budget` bytes (None: all of them, cast_params's memory)."""

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: np.dtype = np.float64,
                 budget: int | None = None):
        check_params(cfg, params)
        self.params, self.dtype, self.budget = params, np.dtype(dtype), budget
        self.held: OrderedDict[str, np.ndarray] = OrderedDict()
        self.held_bytes = 0
        self.most_held = 0  # the largest number of cast bytes held at once, for the tests and the bench
        self.casts = 0  # tensors cast so far: a model that fits is cast once

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.held:
            self.held.move_to_end(name)
            return self.held[name]
        value = self.params[name].astype(self.dtype)
        self.casts += 1
        self.held[name] = value
        self.held_bytes += value.nbytes
        while self.budget is not None and self.held_bytes > self.budget and len(self.held) > 1:
            _, dropped = self.held.popitem(last=False)
            self.held_bytes -= dropped.nbytes
        self.most_held = max(self.most_held, self.held_bytes)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __contains__(self, name: object) -> bool:
        return name in self.params

    def under(self, prefix: str) -> Under:
        """The tensors below one module, names relative to it, cast as they are read (params_under)."""
        return Under(self, prefix + ".")


class Under(Mapping):
    """A view of the tensors of a CastOnRead below one module; reading one casts it there."""

    def __init__(self, whole: CastOnRead, start: str):
        self.whole, self.start = whole, start

    def __getitem__(self, name: str) -> np.ndarray:
        return self.whole[self.start + name]

    def __iter__(self) -> Iterator[str]:
        return (name[len(self.start):] for name in self.whole if name.startswith(self.start))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.start + name in self.whole

    def under(self, prefix: str) -> Under:
        return Under(self.whole, self.start + prefix + ".")


def layer_bytes(cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: np.dtype = np.float64) -> int:
    """The bytes of the largest single layer's (or the embedding table's) tensors at dtype: the
    least a streamed golden must hold to run a pass without reading a tensor twice within a layer."""
    size = np.dtype(dtype).itemsize
    groups: dict[str, int] = {}
    for name, value in params.items():
        parts = name.split(".")
        group = ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else name
        groups[group] = groups.get(group, 0) + value.size * size
    return max(groups.values())
