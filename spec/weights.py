"""Weight files: safetensors with the config and a format version in the metadata. Never pickle.

The reader checks the file's structure itself before handing it to safetensors, so a damaged
file gets a message that says what is wrong with it rather than a library traceback.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from spec.config import ModelConfig
from spec.errors import ConfigError, WeightsError
from spec.params import check_params, params_digest, param_shapes
from spec.version import FORMAT_NAME, FORMAT_VERSION, SPEC_VERSION

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def save_weights(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> None:
    """Write a weights file. The parameters are checked first (names, shapes, float32, finite);
    the file is written to a temporary name and renamed, so a failure never leaves half a file."""
    from safetensors.numpy import save_file

    if not isinstance(cfg, ModelConfig):
        raise WeightsError(f"save_weights needs a ModelConfig, got {type(cfg).__name__}")
    check_params(cfg, params)
    tensors = {name: np.ascontiguousarray(params[name]) for name in param_shapes(cfg)}
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "spec_version": SPEC_VERSION,
        "config": cfg.to_json(),
        "params_sha256": params_digest(tensors),
    }
    target = Path(path)
    if target.is_dir():
        raise WeightsError(f"cannot write weights to {target}: it is a directory")
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise WeightsError(f"cannot write weights to {target}: folder {directory} does not exist")
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_header(path: str | os.PathLike) -> dict:
    """The file's JSON header, after checking the framing that safetensors relies on:
    8-byte little-endian header length, a JSON object, tensor byte ranges inside the file."""
    target = Path(path)
    if not target.exists():
        raise WeightsError(f"weights file {target} does not exist")
    if not target.is_file():
        raise WeightsError(f"weights path {target} is not a regular file")
    size = target.stat().st_size
    with target.open("rb") as stream:
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise WeightsError(f"{target} is not a safetensors file: only {size} bytes long")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(size - 8, _MAX_HEADER_BYTES):
            raise WeightsError(
                f"{target} is not a safetensors file, or is truncated: its first 8 bytes announce "
                f"a {header_length}-byte header but the file holds {size} bytes"
            )
        raw = stream.read(header_length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WeightsError(f"{target}: the safetensors header is corrupted (not valid JSON: {error})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{target}: the safetensors header is corrupted (not a JSON object)")
    data_size = size - 8 - header_length
    ends = [0]
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
            raise WeightsError(f"{target}: the safetensors header is corrupted (bad entry for {name!r})")
        ends.append(offsets[1])
    if max(ends) > data_size:
        raise WeightsError(
            f"{target} is truncated: its tensors need {max(ends)} bytes of data, the file holds {data_size}"
        )
    return header


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a weights file's metadata, after checking the format version."""
    return _config_from_header(path, read_header(path))


def _config_from_header(path: str | os.PathLike, header: dict) -> ModelConfig:
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise WeightsError(f"{path}: no metadata; not a Transformer Rosetta weights file (no config stored)")
    if metadata.get("format") != FORMAT_NAME:
        raise WeightsError(
            f"{path}: metadata 'format' is {metadata.get('format')!r}, expected {FORMAT_NAME!r}; "
            "not a Transformer Rosetta weights file"
        )
    version_text = metadata.get("format_version")
    try:
        version = int(version_text)
    except (TypeError, ValueError):
        raise WeightsError(f"{path}: metadata 'format_version' is {version_text!r}, not an integer") from None
    if version > FORMAT_VERSION:
        raise WeightsError(
            f"{path} was written in weights format version {version}; this release reads up to "
            f"version {FORMAT_VERSION}. Upgrade transformer-rosetta to read it."
        )
    if version < 1:
        raise WeightsError(f"{path}: metadata 'format_version' {version} is not a valid version")
    if "config" not in metadata:
        raise WeightsError(f"{path}: metadata has no 'config' entry")
    try:
        return ModelConfig.from_json(metadata["config"])
    except ConfigError as error:
        raise WeightsError(f"{path}: the stored config is invalid: {error}") from None


def load_weights(
    path: str | os.PathLike, expected_config: ModelConfig | None = None, *, mapped: bool = False
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read (config, params) from a weights file, refusing anything that does not match the spec.

    With ``expected_config``, a file whose stored config differs is refused, naming the fields.
    ``mapped``: the tensors are read-only arrays memory-mapped from the file rather than copies:
    processes that map one file share its pages, and a tensor's bytes are read when used.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    header = read_header(path)
    cfg = _config_from_header(path, header)
    if expected_config is not None and cfg != expected_config:
        stored, wanted = cfg.to_dict(), expected_config.to_dict()
        differences = [f"{k}: file has {stored[k]!r}, expected {wanted[k]!r}" for k in stored if stored[k] != wanted[k]]
        raise WeightsError(f"{path}: the stored config does not match:\n  " + "\n  ".join(differences))
    try:
        # a file holding a dtype the map does not read goes to safetensors itself, whose refusal
        # (or reading) is then the same whichever way the file was asked for
        params = (mapped and _mapped_tensors(path, header)) or dict(load_file(str(path)))
    except SafetensorError as error:
        raise WeightsError(f"{path}: safetensors could not read the file: {error}") from None
    check_params(cfg, params, where=f"tensors in {path}")
    stored_digest = header["__metadata__"].get("params_sha256")
    if stored_digest is not None and stored_digest != params_digest(params):
        raise WeightsError(f"{path}: tensor bytes do not match the SHA-256 stored at save time (file corrupted)")
    return cfg, params


_STORED_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                 "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _mapped_tensors(path: str | os.PathLike, header: dict) -> dict[str, np.ndarray] | None:
    """The tensors of a safetensors file whose framing read_header has checked, as views of one
    read-only memory map of it; None where a tensor's dtype or size is not what this reads."""
    with open(path, "rb") as stream:
        (header_length,) = struct.unpack("<Q", stream.read(8))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in _STORED_TYPES or not isinstance(entry.get("shape"), list):
            return None
        dtype = np.dtype(_STORED_TYPES[entry["dtype"]]).newbyteorder("<")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != dtype.itemsize * int(np.prod(shape)):
            return None
        tensors[name] = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)),
                                      offset=8 + header_length + begin).reshape(shape)
    return tensors
