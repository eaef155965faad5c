"""What every exported graph gets, whichever framework wrote it: the IR version onnxruntime can
read, the metadata that ties it to the spec and the weights, and the full checker."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from export.graphs import GraphSignature
from spec import SPEC_VERSION, ModelConfig, params_digest
from spec.errors import SpecError

DEFAULT_OPSET = 23  # scaled dot-product attention becomes ONNX's own Attention op
FALLBACK_OPSET = 20  # attention decomposed into MatMul / Softmax / Where
OPSETS = (DEFAULT_OPSET, FALLBACK_OPSET)
DTYPES = ("float32", "float16")
METADATA_PREFIX = "rosetta."
# protobuf cannot write a message over 2 GiB: a graph whose weights take more than this keeps them
# in one file beside it (ONNX's external data, `<graph>.onnx.data`), which onnxruntime reads
EXTERNAL_DATA_ABOVE = 1_800_000_000
# An export's graphs keep their weights in one file they share (SharedWeights), each tensor of at
# least SHARED_ABOVE bytes once, at an offset onnxruntime's CPU provider maps rather than copies (a
# multiple of the page): the graphs' sessions read one copy of the weights where each held its own
WEIGHTS_FILE = "weights.data"
SHARED_ABOVE = 1024
ALIGNMENT = 4096


class ExportError(SpecError):
    """An export that cannot be made, or a graph that is not what the spec expects."""


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Raise these loggers to ERROR for a while: exporters log what does not concern an export
    (jax2onnx's example plugins that need packages we do not install, torch's optional torchvision
    ops, onnx_ir's untyped shape constants)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_options(dtype: str, opset: int, graph_roles, available: tuple[str, ...], exporter: str) -> tuple[str, ...]:
    """Validate an export's dtype, opset and graph roles; returns the roles to export."""
    if dtype not in DTYPES:
        raise ExportError(f"export dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if opset not in OPSETS:
        raise ExportError(f"opset must be one of {', '.join(map(str, OPSETS))}, got {opset!r}")
    wanted = available if graph_roles is None else tuple(graph_roles)
    unknown = [r for r in wanted if r not in available]
    if unknown:
        raise ExportError(f"the {exporter} export cannot write graph role(s) {', '.join(unknown)}; "
                          f"for this model it writes {', '.join(available)}")
    return wanted


def finish(model: onnx.ModelProto, cfg: ModelConfig, params: Mapping[str, np.ndarray],
           signature: GraphSignature, *, dtype: str, opset: int, exporter: str,
           extra: Mapping[str, str] | None = None) -> onnx.ModelProto:
    """Set the IR version, stamp the metadata, check the names against the signature and run
    onnx.checker with full shape inference. Returns the (modified) model."""
    # onnx 1.23 writes IR version 14 by default while onnxruntime 1.31 reads up to 13, so the
    # graph carries the lowest IR version its opsets need (pages/probe.py records both).
    model.ir_version = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    metadata = {
        "config": cfg.to_json(),
        "spec_version": SPEC_VERSION,
        "params_sha256": params_digest(params),
        "role": signature.role,
        "dtype": dtype,
        "opset": str(opset),
        "exporter": exporter,
        **(extra or {}),
    }
    del model.metadata_props[:]
    for key, value in metadata.items():
        model.metadata_props.add(key=METADATA_PREFIX + key, value=value)
    model.producer_name = "transformer-rosetta"
    check_signature(model, signature)
    if weight_bytes(model) <= EXTERNAL_DATA_ABOVE:
        onnx.checker.check_model(model, full_check=True)  # a larger one is checked from its files by save()
    return model


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of a graph's initializers (its weights), as stored."""
    return sum(len(tensor.raw_data) or tensor.ByteSize() for tensor in model.graph.initializer)


def without_unused_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, in place, without the initializers no node reads (onnxruntime warns of each): what a
    graph rewritten by hand leaves behind."""
    used = {name for node in model.graph.node for name in node.input}
    kept = [tensor for tensor in model.graph.initializer if tensor.name in used]
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(kept)
    return model


def external_data_file(graph: str | Path) -> str:
    """The file beside a graph that holds its weights where they are too large for the graph's own."""
    return Path(graph).name + ".data"


def external_data_files(directory: str | Path, graphs) -> dict[str, str]:
    """{graph file: the file beside it that holds its weights}: the export's shared file
    (SharedWeights), or a graph's own where it was too large to hold them (save)."""
    directory = Path(directory)
    shared = (directory / WEIGHTS_FILE).is_file()
    return {name: WEIGHTS_FILE if shared else external_data_file(name) for name in graphs
            if shared or (directory / external_data_file(name)).is_file()}


def check_signature(model: onnx.ModelProto, signature: GraphSignature) -> None:
    """The graph's inputs and outputs must be exactly the signature's, in order."""
    got_in = [i.name for i in model.graph.input]
    got_out = [o.name for o in model.graph.output]
    if got_in != signature.input_names or got_out != signature.output_names:
        raise ExportError(
            f"the {signature.role} graph's interface differs from export/graphs.py:\n"
            f"  inputs  {got_in}\n  wanted  {signature.input_names}\n"
            f"  outputs {got_out}\n  wanted  {signature.output_names}")


def metadata(model: onnx.ModelProto) -> dict[str, str]:
    """The rosetta.* metadata of a graph, without the prefix."""
    return {p.key[len(METADATA_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(METADATA_PREFIX)}


class SharedWeights:
    """The weights file of one export's graphs (WEIGHTS_FILE in its directory): each initializer
    of at least SHARED_ABOVE bytes is written there once, whichever graphs hold it (the same bytes
    are the same tensor), at an offset that is a multiple of ALIGNMENT, and the graph keeps only
    where it lies (ONNX's external data)."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / WEIGHTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")
        self.written: dict[bytes, tuple[int, int]] = {}  # sha256 of the bytes -> (offset, length)

    def move_out(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """model, in place, with its large initializers' bytes in the shared file."""
        with open(self.path, "ab") as data:
            for tensor in model.graph.initializer:
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    continue
                stored = tensor.raw_data if tensor.HasField("raw_data") else \
                    numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data
                if len(stored) < SHARED_ABOVE:
                    continue
                key = hashlib.sha256(stored).digest()
                if key not in self.written:
                    data.write(b"\0" * (-data.tell() % ALIGNMENT))
                    self.written[key] = (data.tell(), len(stored))
                    data.write(stored)
                offset, length = self.written[key]
                for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                              "string_data", "external_data"):
                    tensor.ClearField(field)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key_name, value in (("location", WEIGHTS_FILE), ("offset", offset), ("length", length)):
                    tensor.external_data.add(key=key_name, value=str(value))
        return model


def save(model: onnx.ModelProto, path: Path, weights: SharedWeights | None = None) -> Path:
    """Write a graph atomically (a temporary file renamed into place): its weights in the export's
    shared file where `weights` is given (SharedWeights), else in the graph, but for a graph whose
    weights take more than EXTERNAL_DATA_ABOVE: those go to external_data_file(path), and the graph
    is checked from there (the checker cannot take so large a graph in memory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    if weights is not None:
        large = weight_bytes(model) > EXTERNAL_DATA_ABOVE
        onnx.save_model(weights.move_out(model), temporary)
        if large:
            onnx.checker.check_model(str(temporary), full_check=True)
    elif weight_bytes(model) > EXTERNAL_DATA_ABOVE:
        data = path.parent / external_data_file(path)
        data.unlink(missing_ok=True)  # save_model appends to an existing file
        onnx.save_model(model, temporary, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
        onnx.checker.check_model(str(temporary), full_check=True)
    else:
        onnx.save_model(model, temporary)
    temporary.replace(path)
    return path


def write_manifest(directory: Path, cfg: ModelConfig, params: Mapping[str, np.ndarray], graphs: Mapping[str, str],
                   *, dtype: str, opset: int, exporter: str, max_positions: int | None = None) -> Path:
    """manifest.json beside the graphs: which file holds which role, and what was exported."""
    manifest = {
        "spec_version": SPEC_VERSION,
        "config": json.loads(cfg.to_json()),
        "params_sha256": params_digest(params),
        "dtype": dtype,
        "opset": opset,
        "exporter": exporter,
        "graphs": dict(graphs),
        "external_data": external_data_files(directory, graphs.values()),
    }
    if max_positions is not None:
        manifest["max_positions"] = max_positions  # the graphs take sequences up to this length
    path = Path(directory) / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path
