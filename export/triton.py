"""A Triton Inference Server model repository for an export: the documented path to serving the
graphs beyond one machine.

    repository/
      rosetta_encoder/config.pbtxt          platform "onnxruntime_onnx", dynamic batching,
      rosetta_encoder/1/model.onnx          an instance group per model
      rosetta_decoder_step/...
      rosetta_forward/...

Each config.pbtxt is written from the graph's own inputs and outputs and then validated against
it (validate_repository): the same names, the same types and the same dimensions, with the batch
axis left to Triton (max_batch_size > 0) and every other dynamic axis written -1. Requests are
batched only when their non-batch shapes match. decoder_step takes its position as one scalar
for the whole batch, which Triton cannot stack across requests: it is written with
max_batch_size 0 (each request brings its own batch), and the client keeps the cache between
steps as export.runner does.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import onnx

from export.graphs import DECODER_STEP_IN_PLACE, ROUTED
from export.onnx_model import ExportError

TRITON_TYPES = {
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.BOOL: "TYPE_BOOL",
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
}
KINDS = ("KIND_GPU", "KIND_CPU")


def _tensors(values) -> list[dict[str, Any]]:
    """name, Triton type and full dims (-1 for a symbolic axis) of graph inputs or outputs."""
    tensors = []
    for value in values:
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type not in TRITON_TYPES:
            raise ExportError(f"{value.name}: ONNX element type {tensor_type.elem_type} has no Triton type here")
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim]
        tensors.append({"name": value.name, "data_type": TRITON_TYPES[tensor_type.elem_type], "dims": dims})
    return tensors


def model_config(model: onnx.ModelProto, name: str, *, max_batch_size: int, kind: str, instances: int,
                 queue_delay_us: int) -> str:
    """config.pbtxt text for one graph. Its first axis is the batch (every graph's is)."""

    def block(tensors: list[dict[str, Any]]) -> str:
        rows = []
        for t in tensors:
            dims = t["dims"][1:] if max_batch_size > 0 else t["dims"]
            rows.append(f'  {{ name: "{t["name"]}" data_type: {t["data_type"]} dims: [ {", ".join(map(str, dims))} ] }}')
        return ",\n".join(rows)

    return (f'name: "{name}"\n'
            'platform: "onnxruntime_onnx"\n'
            f"max_batch_size: {max_batch_size}\n"
            f"input [\n{block(_tensors(model.graph.input))}\n]\n"
            f"output [\n{block(_tensors(model.graph.output))}\n]\n"
            + (f"dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}\n" if max_batch_size > 0 else "")
            + f"instance_group [ {{ count: {instances} kind: {kind} }} ]\n")


def write_repository(export_dir: str | Path, repository: str | Path, *, prefix: str = "rosetta",
                     max_batch_size: int = 16, kind: str = "KIND_GPU", instances: int = 1,
                     queue_delay_us: int = 100) -> list[Path]:
    """Write one Triton model per exported graph; returns the model directories (validated)."""
    if kind not in KINDS:
        raise ExportError(f"instance kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if max_batch_size < 0 or instances < 1 or queue_delay_us < 0:
        raise ExportError("max_batch_size must be >= 0, instances >= 1 and queue_delay_us >= 0")
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", prefix):
        raise ExportError(f"model name prefix must be letters, digits, '_' or '-', got {prefix!r}")
    export_dir, repository = Path(export_dir), Path(repository)
    manifest_path = export_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ExportError(f"{export_dir} holds no manifest.json: not a directory written by `rosetta export`")
    manifest = json.loads(manifest_path.read_text())
    written = []
    for role, file in manifest["graphs"].items():
        if role == DECODER_STEP_IN_PLACE:
            continue  # it writes in place only into buffers its caller binds as both input and output
        if role in ROUTED:
            continue  # the conformance harness's: they replay routing, a server has nothing to force
        name = f"{prefix}_{role}"
        model = onnx.load(str(export_dir / file), load_external_data=False)
        directory = repository / name
        (directory / "1").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(export_dir / file, directory / "1" / "model.onnx")
        if data := manifest.get("external_data", {}).get(file):  # the weights file keeps its name: the graph names it
            shutil.copyfile(export_dir / data, directory / "1" / data)
        # an input without a batch axis (decoder_step's position) cannot be stacked across requests
        batchable = all(value.type.tensor_type.shape.dim for value in model.graph.input)
        (directory / "config.pbtxt").write_text(model_config(
            model, name, max_batch_size=max_batch_size if batchable else 0, kind=kind, instances=instances,
            queue_delay_us=queue_delay_us))
        written.append(directory)
    validate_repository(repository)
    return written


# ---- reading config.pbtxt back: the subset of protobuf text format written above ------------

_TOKEN = re.compile(r'\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<number>-?\d+(?:\.\d+)?)|(?P<word>[A-Za-z_][\w.]*)|(?P<punct>[{}\[\]:,]))')


def _tokenize(text: str) -> list[str]:
    text = re.sub(r"#[^\n]*", "", text)
    tokens, position = [], 0
    while position < len(text):
        if text[position:].strip() == "":
            break
        match = _TOKEN.match(text, position)
        if not match:
            raise ExportError(f"config.pbtxt: cannot read from {text[position:position + 30]!r}")
        tokens.append(match.group(match.lastgroup))
        position = match.end()
    return tokens


def parse_pbtxt(text: str) -> dict[str, Any]:
    """Fields of a message as {name: value or [values]} (repeated fields become lists)."""
    tokens = _tokenize(text)
    position = 0

    def value():
        nonlocal position
        token = tokens[position]
        position += 1
        if token == "{":
            return message("}")
        if token == "[":
            items = []
            while tokens[position] != "]":
                items.append(value())
                if tokens[position] == ",":
                    position += 1
            position += 1
            return items
        if token.startswith('"'):
            return json.loads(token)
        if re.fullmatch(r"-?\d+", token):
            return int(token)
        return token

    def message(end: str | None) -> dict[str, Any]:
        nonlocal position
        fields: dict[str, Any] = {}
        while position < len(tokens) and tokens[position] != end:
            name = tokens[position]
            position += 1
            if tokens[position] == ":":
                position += 1
            item = value()
            if name in fields:
                fields[name] = (fields[name] if isinstance(fields[name], list) else [fields[name]]) + [item]
            else:
                fields[name] = item
            if position < len(tokens) and tokens[position] == ",":
                position += 1
        position += 1
        return fields

    try:
        return message(None)
    except IndexError:
        raise ExportError("config.pbtxt ends in the middle of a field") from None


def validate_repository(repository: str | Path) -> None:
    """Every model's config.pbtxt must describe its model.onnx exactly; all problems are listed."""
    repository = Path(repository)
    problems = []
    models = sorted(p for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else []
    if not models:
        raise ExportError(f"{repository} holds no Triton models")
    for directory in models:
        config_path, graph_path = directory / "config.pbtxt", directory / "1" / "model.onnx"
        if not config_path.is_file() or not graph_path.is_file():
            problems.append(f"{directory.name}: needs config.pbtxt and 1/model.onnx")
            continue
        config = parse_pbtxt(config_path.read_text())
        model = onnx.load(str(graph_path), load_external_data=False)
        if config.get("name") != directory.name:
            problems.append(f"{directory.name}: config name {config.get('name')!r} differs from the directory")
        if config.get("platform") != "onnxruntime_onnx":
            problems.append(f"{directory.name}: platform {config.get('platform')!r}, not 'onnxruntime_onnx'")
        batched = int(config.get("max_batch_size", 0)) > 0
        for field, values in (("input", model.graph.input), ("output", model.graph.output)):
            listed = config.get(field, [])
            listed = listed if isinstance(listed, list) else [listed]
            by_name = {entry.get("name"): entry for entry in listed}
            graph = {t["name"]: t for t in _tensors(values)}
            for name in sorted(set(by_name) - set(graph)):
                problems.append(f"{directory.name}: {field} {name!r} is not in the graph")
            for name in sorted(set(graph) - set(by_name)):
                problems.append(f"{directory.name}: the graph's {field} {name!r} is missing from config.pbtxt")
            for name in sorted(set(graph) & set(by_name)):
                want, got = graph[name], by_name[name]
                want_dims = want["dims"][1:] if batched else want["dims"]
                if batched and want["dims"][:1] != [-1]:
                    problems.append(f"{directory.name}: {name} has no dynamic first axis to batch (dims "
                                    f"{want['dims']}) but max_batch_size > 0")
                if got.get("data_type") != want["data_type"]:
                    problems.append(f"{directory.name}: {name} is {got.get('data_type')} in config.pbtxt, "
                                    f"{want['data_type']} in the graph")
                if list(got.get("dims", [])) != want_dims:
                    problems.append(f"{directory.name}: {name} dims {got.get('dims')} in config.pbtxt, "
                                    f"{want_dims} in the graph")
    if problems:
        raise ExportError("Triton model repository does not match its graphs:\n  " + "\n  ".join(problems))
