"""What a quantize_dynamic export's int8 products compute on each class of CPU, as graphs that
onnxruntime runs exactly on any CPU (SPEC §15.2).

quantize_dynamic's graph multiplies activations quantized at run time to u8 (zero point z_a) by
int8 weights (zero point z_b) in MatMulInteger: y = Σ_k (a_k − z_a)(b_k − z_b) in int32. The kernel
computes Σ_k a_k (b_k − z_b) and subtracts z_a Σ_k (b_k − z_b), and the instruction the CPU has
decides how the first sum is taken:

    exact (VNNI, AMX):         Σ_k a_k·b_k                                in int32
    saturating (VPMADDUBSW):   Σ_i clamp(a_2i·b_2i + a_2i+1·b_2i+1,       each pair in int16 first
                                         −32768, 32767)

A pair saturates when two large activations meet two large weights of one sign: 255 · 127 · 2 =
64,770 is twice what an int16 holds. with_integer_products rewrites every MatMulInteger of a graph
into one of the two in plain int32 operators (Mul, ReduceSum, Clip, MatMul), so that either CPU's
result is computed here, and which one onnxruntime's own kernel computes on this CPU can be told.
The saturating form holds a [rows, K/2, N] int32 tensor per product: for small models only.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.onnx_model import ExportError, without_unused_initializers

INTEGER_PRODUCT = "MatMulInteger"
INT16 = (-(2**15), 2**15 - 1)


def with_integer_products(model: onnx.ModelProto, saturating: bool) -> onnx.ModelProto:
    """A copy of `model` whose every MatMulInteger is its exact (saturating False) or pairwise
    saturating (True) arithmetic in int32 operators; its weights must be constants."""
    rewritten = copy.deepcopy(model)
    constants = {tensor.name: tensor for tensor in rewritten.graph.initializer}
    nodes = []
    for node in rewritten.graph.node:
        if node.op_type != INTEGER_PRODUCT:
            nodes.append(node)
            continue
        weights = _centred_weights(node, constants)
        nodes += (_saturating if saturating else _exact)(node, weights, rewritten.graph.initializer)
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(nodes)
    return without_unused_initializers(rewritten)  # the int8 weights: constants of the int32 products now


def _centred_weights(node: onnx.NodeProto, constants) -> np.ndarray:
    """[K, N] int64: b − z_b of the node's weight, read from the graph's constants."""
    inputs = list(node.input) + [""] * (4 - len(node.input))
    if inputs[1] not in constants:
        raise ExportError(f"{node.name or node.output[0]}: its weight {inputs[1]!r} is not a constant of the graph")
    weight = numpy_helper.to_array(constants[inputs[1]]).astype(np.int64)
    if weight.ndim != 2:
        raise ExportError(f"{node.name or node.output[0]}: its weight is {list(weight.shape)}, not [K, N]")
    if inputs[3]:
        if inputs[3] not in constants:
            raise ExportError(f"{node.name or node.output[0]}: its weight's zero point is not a constant of the graph")
        weight = weight - numpy_helper.to_array(constants[inputs[3]]).astype(np.int64)
    return weight


def _exact(node: onnx.NodeProto, weights: np.ndarray, initializers) -> list[onnx.NodeProto]:
    """(a − z_a) · (b − z_b), a MatMul in int32."""
    a, _, zero_point = (list(node.input) + [""] * 3)[:3]
    name = node.output[0] + "/exact/"
    initializers.append(numpy_helper.from_array(weights.astype(np.int32), name + "weights"))
    made = [helper.make_node("Cast", [a], [name + "a"], to=TensorProto.INT32)]
    if zero_point:
        made += [helper.make_node("Cast", [zero_point], [name + "zero_point"], to=TensorProto.INT32),
                 helper.make_node("Sub", [name + "a", name + "zero_point"], [name + "centred"])]
    made.append(helper.make_node("MatMul", [name + ("centred" if zero_point else "a"), name + "weights"],
                                 [node.output[0]]))
    return made


def _saturating(node: onnx.NodeProto, weights: np.ndarray, initializers) -> list[onnx.NodeProto]:
    """Σ_i clamp(a_2i b_2i + a_2i+1 b_2i+1) − z_a Σ_k b_k, a [..., K] by [K, N]."""
    a, _, zero_point = (list(node.input) + [""] * 3)[:3]
    k, n = weights.shape
    if k % 2:
        raise ExportError(f"{node.name or node.output[0]}: K = {k} is odd; VPMADDUBSW pairs the reduction axis")
    name = node.output[0] + "/saturating/"

    def constant(suffix: str, value) -> str:
        initializers.append(numpy_helper.from_array(np.asarray(value), name + suffix))
        return name + suffix

    pairs = constant("weights", weights.reshape(k // 2, 2, n).astype(np.int32))  # [K/2, 2, N]
    made = [
        helper.make_node("Cast", [a], [name + "a"], to=TensorProto.INT32),
        helper.make_node("Shape", [name + "a"], [name + "shape"]),
        helper.make_node("Slice", [name + "shape", constant("first", np.array([0], np.int64)),
                                   constant("last", np.array([-1], np.int64))], [name + "leading"]),
        helper.make_node("Concat", [name + "leading", constant("n", np.array([n], np.int64))], [name + "out_shape"],
                         axis=0),
        helper.make_node("Reshape", [name + "a", constant("rows", np.array([-1, k // 2, 2, 1], np.int64))],
                         [name + "a_pairs"]),  # [M, K/2, 2, 1]
        helper.make_node("Mul", [name + "a_pairs", pairs], [name + "products"]),  # [M, K/2, 2, N]
        helper.make_node("ReduceSum", [name + "products", constant("pair_axis", np.array([2], np.int64))],
                         [name + "pair_sums"], keepdims=0),  # [M, K/2, N]
        helper.make_node("Clip", [name + "pair_sums", constant("low", np.int32(INT16[0])),
                                  constant("high", np.int32(INT16[1]))], [name + "clamped"]),
        helper.make_node("ReduceSum", [name + "clamped", constant("k_axis", np.array([1], np.int64))],
                         [name + "sums"], keepdims=0),  # [M, N]
    ]
    if zero_point:
        made += [helper.make_node("Cast", [zero_point], [name + "zero_point"], to=TensorProto.INT32),
                 helper.make_node("Mul", [name + "zero_point",
                                          constant("column_sums", weights.sum(0).astype(np.int32))], [name + "offset"]),
                 helper.make_node("Sub", [name + "sums", name + "offset"], [name + "centred"])]
    made.append(helper.make_node("Reshape", [name + ("centred" if zero_point else "sums"), name + "out_shape"],
                                 [node.output[0]]))
    return made

