"""One entry for both exporters: a model's graphs from PyTorch (export.torch_export: every graph)
or from JAX (export.jax_export, jax2onnx: forward and encoder), chosen by name."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from export.onnx_model import DEFAULT_OPSET
from spec import ModelConfig
from spec.config import ONNX_EXPORTS, check_computed_by

FRAMEWORKS = ("torch", "jax")


def export_model(cfg: ModelConfig, params: Mapping[str, np.ndarray], directory: str | Path, *,
                 framework: str = "torch", dtype: str = "float32", opset: int = DEFAULT_OPSET,
                 graph_roles: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Export the model's graphs (every one the framework writes, or graph_roles) into directory
    as ROLE.onnx with a manifest.json, from impl_torch (framework 'torch') or impl_jax ('jax').
    Returns {role: path}."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    check_computed_by(cfg, ONNX_EXPORTS[framework])
    if framework == "torch":
        from export.torch_export import export_torch as export
    else:
        from export.jax_export import export_jax as export
    return export(cfg, params, directory, dtype=dtype, opset=opset, graph_roles=graph_roles)
