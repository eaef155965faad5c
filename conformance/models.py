"""The model a run checks: a preset's conformance weights, a weights file, or the import of a
Hugging Face model directory, with the source its report records; and the columns that run a
model directory's own model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spec import ModelConfig, conformance_params, get_preset, load_weights
from spec.weights import read_header


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


_STORED = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def checkpoint_dtype(source: dict) -> str:
    """The dtype a checkpoint was published in, which a budgeted plan checks first
    (conformance.plan.budget): a Hugging Face directory's config.json says it (dtype, or torch_dtype
    in older files), else its first floating tensor's; a preset's or a weights file's is float32
    (the spec's weights are float32)."""
    if "hf" not in source:
        return "float32"
    directory = Path(source["hf"])
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    named = config.get("dtype") or config.get("torch_dtype")
    if named in _STORED.values():
        return named
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in read_header(path).items():
            if name != "__metadata__" and entry.get("dtype") in _STORED:
                return _STORED[entry["dtype"]]
    return "float32"


def register_model_directory(directory: str | Path) -> None:
    """Register the columns that run one Hugging Face model directory's own model: transformers,
    onnxruntime-genai (its builder's graph) and ctranslate2 (its converter's model). Registered
    with a callable, so they run in this process (a worker process could not be handed the
    directory by name)."""
    from conformance.adapter import register_backend
    from conformance.backends.ctranslate2_backend import CTranslate2Backend
    from conformance.backends.genai_backend import GenaiBackend
    from conformance.backends.transformers_backend import TransformersBackend

    if not Path(directory).is_dir():
        raise ValueError(f"{directory}: not a directory")
    register_backend("transformers", lambda: TransformersBackend(directory))
    register_backend("onnxruntime-genai", lambda: GenaiBackend(directory))
    register_backend("ctranslate2", lambda: CTranslate2Backend(directory))
