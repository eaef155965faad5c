"""The model a run checks: a preset's conformance weights, a weights file, or the import of a
Hugging Face model directory, with the source its report records; and the columns that run a
model directory's own model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spec import ModelConfig, conformance_params, get_preset, load_weights


def load_model(*, preset: str = "tiny", seed: int = 0, weights: str | Path | None = None,
               hf: str | Path | None = None) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """(config, weights, source). weights: a weights file (its config read from it); else hf: a
    Hugging Face model directory, imported (importers.import_huggingface); else the preset with
    its conformance weights of this seed (spec.conformance_params). The source is what a report
    records: {"weights": FILE}, {"hf": DIR, "family": ...} or {"preset": NAME, "seed": N}."""
    if weights:
        cfg, params = load_weights(weights, mapped=True)  # read-only views of the file, read as used
        return cfg, params, {"weights": str(weights)}
    if hf:
        from importers import import_huggingface

        imported = import_huggingface(hf)
        return imported.config, imported.params, {"hf": str(hf), "family": imported.family}
    cfg = get_preset(preset)
    return cfg, conformance_params(cfg, seed), {"preset": preset, "seed": seed}


def register_model_directory(directory: str | Path) -> None:
    """Register the columns that run one Hugging Face model directory's own model: transformers,
    and onnxruntime-genai (its builder's graph). Registered with a callable, so they run in this
    process (a worker process could not be handed the directory by name)."""
    from conformance.adapter import register_backend
    from conformance.backends.genai_backend import GenaiBackend
    from conformance.backends.transformers_backend import TransformersBackend

    if not Path(directory).is_dir():
        raise ValueError(f"{directory}: not a directory")
    register_backend("transformers", lambda: TransformersBackend(directory))
    register_backend("onnxruntime-genai", lambda: GenaiBackend(directory))
