"""A Hugging Face directory saved again at another dtype, and a peer column's forward-none on it:
the float64 and bfloat16 directories the peer columns must take (tests/test_ctranslate2.py,
tests/test_genai.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conformance.adapter import register_backend, unregister_backend
from conformance.cells import CellResult
from conformance.harness import plan_matrix, run_matrix
from importers.huggingface import import_huggingface


def saved_at(source: Path, dtype: str, into: Path) -> Path:
    """`source`'s model as save_pretrained writes it at dtype (tensors and config.json's `dtype`),
    the tokenizer's files beside it."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    model.save_pretrained(into)
    for path in Path(source).iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            (into / path.name).write_bytes(path.read_bytes())
    return into


def forward_none(name: str, backend: Callable[[], object], directory: Path) -> CellResult:
    """The column `name` (registered as `backend` for the while) on forward-none at float32, against
    the golden on the directory's import."""
    imported = import_huggingface(directory)
    register_backend(name, backend)
    try:
        plan = plan_matrix(imported.config, [name], ["float32"], ["cpu"])
        cell, = run_matrix(imported.config, imported.params, plan, pattern="forward-none")
    finally:
        unregister_backend(name)
    return cell
