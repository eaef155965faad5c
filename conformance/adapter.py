"""The backend adapter protocol and the registry the harness finds backends in.

A backend is registered by name with the dotted path of a factory ("module:attribute"), so the
harness imports it (and its framework) only when asked to. A backend whose import fails is
reported as unavailable with the reason, never as a crash and never as passed.

To be driven by the harness a backend implements:

    class MyBackend:
        name: str
        def availability(self) -> str | None        # None when usable, else why not
        def devices(self) -> list[str]              # devices present here: "cpu", "cuda", ...
        def supports(self, dtype, device) -> str | None   # None when supported, else why not
        def load(self, cfg, params, dtype, device) -> Runner
        def supports_sublayer(self, sublayer) -> str | None   # optional: None, else why not
        def supports_config(self, cfg, dtype) -> str | None   # optional: a model (at a dtype) it cannot compute
        program_family: str                         # optional: backends that compile the same programs (default: the name)
        family_spans_dtypes: bool                   # optional: the family shares start-up work across dtypes

    class Runner:
        def run(self, sublayer: str, inputs: dict) -> numpy array   # see conformance/cases.py
        def attention_path(self, sublayer, inputs) -> str   # optional: the attention this case ran
        def graph_served(self, sublayer) -> str     # optional: the ONNX graph that serves this case
        def gradients(self, sublayer, inputs) -> dict[str, array]   # optional: a grad-* case (SPEC §13)

``params`` are the canonical float32 NumPy parameters (spec.param_shapes); a runner raises
``NotSupported`` for a sublayer it does not implement (reported as skipped, with the reason).
A runner that can compute only some rows of a case the spec's way (onnxruntime-genai's padding)
returns ``Partial``: the rows it computed are compared, the others named with why.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from spec import ModelConfig


class NotSupported(Exception):
    """Raised by a runner for a sublayer or input it does not implement."""


@dataclass(frozen=True)
class Partial:
    """A runner's output of which only some entries are the spec's computation. ``output`` has the
    full shape; ``compared`` (boolean, over its leading axes: [B] rows, or [B, N] rows and decode
    steps) says which entries are compared with the golden; ``left_out`` says why, for every row
    with something left out."""

    output: np.ndarray
    compared: np.ndarray
    left_out: dict[int, str]
    unit: str = "step"  # what compared's second axis counts: a decode's steps, or a forward's "position"s

    def describe(self) -> str:
        """Which rows (and steps) were left out, and why: 'rows 1, 2 (steps 1-3): <why>; row 0: <why>'."""
        rows_by_reason: dict[str, list[str]] = {}
        for row, why in sorted(self.left_out.items()):
            kept = np.asarray(self.compared[row])
            steps = np.flatnonzero(~kept) if kept.ndim else np.array([], dtype=int)
            where = "" if not (kept.ndim and kept.any()) else \
                f" ({self.unit} {steps[0]})" if len(steps) == 1 else f" ({self.unit}s {steps[0]}-{steps[-1]})"
            rows_by_reason.setdefault(why, []).append(f"{row}{where}")
        return "; ".join(f"row{'s' * (len(rows) > 1)} {', '.join(rows)}: {why}" for why, rows in rows_by_reason.items())


class Runner(Protocol):
    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray: ...


class Backend(Protocol):
    name: str

    def availability(self) -> str | None: ...

    def devices(self) -> list[str]: ...

    def supports(self, dtype: str, device: str) -> str | None: ...

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> Runner: ...


@dataclass
class _Entry:
    target: str | Callable[[], Backend]
    instance: Backend | None = None
    error: str | None = None


_REGISTRY: dict[str, _Entry] = {
    "numpy-float32": _Entry("conformance.backends.numpy_backend:NumpyFloat32Backend"),
    "torch": _Entry("conformance.backends.torch_backend:TorchBackend"),
    "torch-math": _Entry("conformance.backends.torch_backend:TorchMathBackend"),
    "jax": _Entry("conformance.backends.jax_backend:JaxBackend"),
    "jax-math": _Entry("conformance.backends.jax_backend:JaxMathBackend"),
    "onnx": _Entry("conformance.backends.onnx_backend:OnnxBackend"),
    "onnx-jax": _Entry("conformance.backends.onnx_backend:OnnxJaxBackend"),
}


def register_backend(name: str, factory: str | Callable[[], Backend]) -> None:
    """Add a backend: a factory callable, or "module:attribute" imported on first use."""
    if not isinstance(name, str) or not name or any(c in name for c in " ,/"):
        raise ValueError(f"backend name must be a non-empty string without spaces, commas or slashes: {name!r}")
    _REGISTRY[name] = _Entry(factory)


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_paths() -> dict[str, str]:
    """The backends registered by dotted path: what another process can register again."""
    return {name: entry.target for name, entry in _REGISTRY.items() if isinstance(entry.target, str)}


def importable_by_name(name: str) -> bool:
    """Whether a fresh process finds this backend by importing its registered path (a backend
    registered with a callable exists only in the process that registered it)."""
    return name in _REGISTRY and isinstance(_REGISTRY[name].target, str)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> tuple[Backend | None, str | None]:
    """(backend, None) when it can be used, (None, reason) when not. Unknown names raise KeyError."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
    entry = _REGISTRY[name]
    if entry.instance is None and entry.error is None:
        try:
            factory = entry.target
            if isinstance(factory, str):
                module_name, _, attribute = factory.partition(":")
                factory = getattr(importlib.import_module(module_name), attribute)
            entry.instance = factory()
        except ImportError as error:
            entry.error = f"not installed: {error}"
        except Exception as error:  # noqa: BLE001 - a broken plugin is reported, not raised
            entry.error = f"failed to load: {type(error).__name__}: {error}"
    if entry.error is not None:
        return None, entry.error
    reason = entry.instance.availability()
    return (None, reason) if reason else (entry.instance, None)
