"""Where onnxruntime ran each node of a graph, and which CPU placements in a CUDA session are a
fallback (docs/onnx.md, "No silent CPU fallback"; SPEC.md §12).

onnxruntime keeps some shape arithmetic on the CPU on purpose, even in a session whose every
kernel exists on CUDA: sizes read from a tensor's shape (Shape, sym_size Squeezes), Concats and
Adds of those sizes, the Reshape of a shape vector. Those nodes touch a few integers that live
on the host anyway. Its own switch, ``session.disable_cpu_ep_fallback``, refuses them too, so it
refuses every session of every exported graph; the decision is made here instead, from the
placement that onnxruntime records in its profile.

A node placed on the CPU provider is a *fallback* when it
- is one of the model's compute ops (MATRIX_AND_NORM_OPS), whatever its types, or
- reads or writes a floating-point tensor (ops that read only their input's shape excepted), or
- reads or writes an integer or boolean tensor of rank 2 or more (a mask, a batch of ids:
  data, not shape metadata), or
- has no recorded tensor types (nothing proves it is shape arithmetic).

Everything here is a pure function of the placement, so the rule is tested on the CPU with the
placements seen on a GPU and fabricated ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

CPU_PROVIDER = "CPUExecutionProvider"

# ops whose work is the model's arithmetic: never acceptable on the CPU of a CUDA session
MATRIX_AND_NORM_OPS = frozenset({
    "MatMul", "Gemm", "FusedMatMul", "MatMulInteger", "MatMulNBits", "Einsum", "Conv",
    "Attention", "MultiHeadAttention", "GroupQueryAttention",
    "Softmax", "LogSoftmax",
    "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "RMSNormalization",
})
# ops that read their input's shape and never its data: a float input does not make them compute
SHAPE_READING_OPS = frozenset({"Shape", "Size"})
# onnxruntime's names for the element types that shape arithmetic uses
INTEGER_TYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


@dataclass(frozen=True)
class TensorType:
    element: str  # onnxruntime's name: "float", "float16", "int64", "bool", ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PlacedNode:
    """One node as onnxruntime ran it. inputs/outputs are None where the types were not recorded."""

    name: str
    op_type: str
    provider: str
    inputs: tuple[TensorType, ...] | None = None
    outputs: tuple[TensorType, ...] | None = None

    def signature(self) -> str:
        """'Concat(int64[1], int64[1]) -> int64[2]'"""
        def types(tensors):
            return "?" if tensors is None else ", ".join(f"{t.element}{list(t.shape)}" for t in tensors)
        return f"{self.op_type}({types(self.inputs)}) -> {types(self.outputs)}"


def _tensor_types(recorded: Sequence[Mapping[str, Sequence[int]]] | None) -> tuple[TensorType, ...] | None:
    """onnxruntime's profile writes each tensor as {element type: shape}."""
    if recorded is None:
        return None
    return tuple(TensorType(element, tuple(shape)) for entry in recorded for element, shape in entry.items())


def nodes_from_profile(events: Iterable[Mapping]) -> list[PlacedNode]:
    """The nodes of one profiled run, from onnxruntime's profile events (its JSON, parsed)."""
    nodes: dict[str, PlacedNode] = {}
    suffix = "_kernel_time"
    for event in events:
        args = event.get("args", {})
        name = event.get("name", "")
        if event.get("cat") != "Node" or "provider" not in args or not name.endswith(suffix):
            continue
        name = name[: -len(suffix)]
        nodes.setdefault(name, PlacedNode(name, args.get("op_name", "?"), args["provider"],
                                          _tensor_types(args.get("input_type_shape")),
                                          _tensor_types(args.get("output_type_shape"))))
    return list(nodes.values())


def fallback_reason(node: PlacedNode) -> str | None:
    """Why this node counts as a CPU fallback, or None where it is allowed (not on the CPU, or
    shape arithmetic on the CPU)."""
    if node.provider != CPU_PROVIDER:
        return None
    if node.op_type in MATRIX_AND_NORM_OPS:
        return f"{node.op_type} is model compute"
    if node.inputs is None or node.outputs is None:
        return "its tensor types were not recorded"
    read = () if node.op_type in SHAPE_READING_OPS else node.inputs
    for tensor in (*read, *node.outputs):
        if tensor.element not in INTEGER_TYPES:
            return f"it reads or writes a {tensor.element} tensor"
        if len(tensor.shape) > 1:
            return f"it reads or writes a {tensor.element} tensor of rank {len(tensor.shape)} (data, not a shape)"
    return None


def cpu_fallbacks(nodes: Iterable[PlacedNode]) -> list[tuple[PlacedNode, str]]:
    """The nodes of a CUDA session that fell back to the CPU, each with its reason."""
    return [(node, reason) for node in nodes if (reason := fallback_reason(node)) is not None]


def by_provider(nodes: Iterable[PlacedNode]) -> dict[str, list[str]]:
    """{provider: [node names]}"""
    placement: dict[str, list[str]] = {}
    for node in nodes:
        placement.setdefault(node.provider, []).append(node.name)
    return placement


def fallback_message(graph: str, fallbacks: Sequence[tuple[PlacedNode, str]], limit: int = 8) -> str:
    """One paragraph naming the offending nodes, their types and why each counts."""
    listed = "; ".join(f"{node.name}: {node.signature()} ({reason})" for node, reason in fallbacks[:limit])
    more = f"; and {len(fallbacks) - limit} more" if len(fallbacks) > limit else ""
    return (f"{graph}: {len(fallbacks)} compute node(s) placed on the CPU provider in a CUDA session: "
            f"{listed}{more}")
