"""Exports kept on disk between runs: exporting the tiny preset's four graphs takes ~25 s, and
the harness and the tests ask for the same graphs again and again.

An entry's key hashes everything the graphs depend on: the config, the weights' digest, dtype,
opset, the exporter and framework versions, and the source text of the implementation and of
export/, so an edit to the model or the exporter never reuses a stale graph.
ROSETTA_ONNX_CACHE=0 turns the cache off (a fresh temporary directory per export),
ROSETTA_ONNX_CACHE=DIR moves it; by default it is ~/.cache/transformer-rosetta/onnx.
Processes that ask for the same entry at once (the columns of a check in their workers, a test
suite's workers) export it once: the others wait for it and read it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from export.exporters import FRAMEWORKS, export_model
from spec import ModelConfig, params_digest

_ROOT = Path(__file__).resolve().parent.parent
_SOURCES = {"torch": ("impl_torch/model.py",), "jax": ("impl_jax/model.py",)}
_EXPORT_SOURCES = ("export/graphs.py", "export/onnx_model.py", "export/torch_export.py", "export/in_place_step.py",
                   "export/jax_export.py")


def cache_root() -> Path | None:
    setting = os.environ.get("ROSETTA_ONNX_CACHE", "")
    if setting == "0":
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(setting) if setting else base / "transformer-rosetta" / "onnx"


def _framework_version(framework: str) -> str:
    from importlib.metadata import version

    if framework == "torch":
        return f"torch {version('torch')} onnxscript {version('onnxscript')}"
    return f"jax {version('jax')} flax {version('flax')} jax2onnx {version('jax2onnx')}"


def cache_key(cfg: ModelConfig, params: Mapping[str, np.ndarray], *, framework: str, dtype: str, opset: int) -> str:
    digest = hashlib.sha256()
    parts = [cfg.to_json(), params_digest(params), framework, dtype, str(opset), _framework_version(framework)]
    for part in parts:
        digest.update(part.encode() + b"\0")
    for source in _SOURCES[framework] + _EXPORT_SOURCES:
        digest.update((_ROOT / source).read_bytes())
    return digest.hexdigest()[:32]


def is_exported(cfg: ModelConfig, params: Mapping[str, np.ndarray], *, framework: str = "torch",
                dtype: str = "float32", opset: int = 23) -> bool:
    """Whether the cache holds this model's export whole (exported() would not export it again)."""
    root = cache_root()
    return root is not None and _complete(root / cache_key(cfg, params, framework=framework, dtype=dtype, opset=opset))


def exported(cfg: ModelConfig, params: Mapping[str, np.ndarray], *, framework: str = "torch",
             dtype: str = "float32", opset: int = 23) -> Path:
    """The directory of this model's export (written on first use). framework: 'torch' | 'jax'."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    root = cache_root()
    if root is not None:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            root = None  # an unwritable home: export every time rather than fail
    if root is None:
        directory = Path(tempfile.mkdtemp(prefix="rosetta-onnx-"))
        export_model(cfg, params, directory, framework=framework, dtype=dtype, opset=opset)
        return directory
    key = cache_key(cfg, params, framework=framework, dtype=dtype, opset=opset)
    directory = root / key
    if _complete(directory):
        return directory
    with _one_exporter(root / f".{key}.lock"):
        if _complete(directory):
            return directory  # exported by the process this one waited for
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
        try:
            export_model(cfg, params, staging, framework=framework, dtype=dtype, opset=opset)
            # An entry appears whole, by one rename, and is never removed once whole: another process
            # (one without the lock: a file system without flock) may be reading the copy that won.
            if not _complete(directory):
                shutil.rmtree(directory, ignore_errors=True)  # what an interrupted run of older code left
                staging.rename(directory)
        except OSError:
            if not _complete(directory):
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return directory


@contextlib.contextmanager
def _one_exporter(lock: Path):
    """Held while an entry is exported, so that a second process asking for it waits and reads it
    rather than exporting it again beside the first (a torch export of a tiny model is ~20 s of CPU).
    The lock is the kernel's (flock) and goes with the process that held it, killed or not; where
    there is none (not POSIX, or a file system that refuses it) each process exports its own copy."""
    try:
        import fcntl
        handle = open(lock, "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without flock: export beside the other process, as without the lock
        yield


def _complete(directory: Path) -> bool:
    """Whether a cache entry holds its manifest and every graph and weights file the manifest names."""
    if not (directory / "manifest.json").is_file():
        return False
    manifest = json.loads((directory / "manifest.json").read_text())
    files = [*manifest["graphs"].values(), *manifest.get("external_data", {}).values()]
    return all((directory / name).is_file() for name in files)
