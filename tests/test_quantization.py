"""Weight-only quantization as data (spec/quantization.py, SPEC §15): the golden's reading of
onnxruntime's MatMulNBits layout is the kernel's. A MatMul quantized by onnxruntime's own
MatMulNBitsQuantizer (4 and 8 bits, symmetric and with zero points, K not a multiple of the
block) computes A · dequantize(B) in onnxruntime, within float32's tolerance (SPEC §8) of one
product of K terms; a reading with the nibbles swapped, the zero point off by one or the scales
on the wrong axis is beyond it; a layout the spec lacks is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from spec.errors import WeightsError
from spec.quantization import BlockQuantized, dequantize, unpack
from tests.bounds import assert_agrees, assert_differs

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import helper, numpy_helper  # noqa: E402

from export.quantize import block_steps, within_a_step  # noqa: E402

K, N, M = 72, 24, 5  # K: two whole blocks of 32 and a part


def _matmul_graph(weight: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"])], "matmul",
        [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [M, N])],
        [numpy_helper.from_array(weight, "W")])
    # IR 10: onnx 1.20 writes 14 by default, past what onnxruntime 1.31 reads (13)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _quantized(bits: int, symmetric: bool, block_size: int = 32):
    """The graph quantized by onnxruntime's own quantizer, and its MatMulNBits weight read as the spec's data."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    weight = np.random.default_rng(bits + symmetric).standard_normal((K, N)).astype(np.float32)
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
    quantizer = MatMulNBitsQuantizer(_matmul_graph(weight), algo_config=config)
    quantizer.process()
    model = quantizer.model.model
    node, = [node for node in model.graph.node if node.op_type == "MatMulNBits"]
    stored = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
    inputs = list(node.input) + [""] * 4
    read = BlockQuantized(k=attributes["K"], n=attributes["N"], bits=attributes["bits"],
                          block_size=attributes["block_size"], codes=stored[inputs[1]], scales=stored[inputs[2]],
                          zero_points=stored[inputs[3]] if inputs[3] else None)
    return model, read, weight


def _run(model, a):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0].astype(np.float64)


@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_the_kernel_computes_a_times_the_spec_s_dequantized_weight(bits, symmetric):
    """Y = A·dequantize(B) within SPEC §8's float32 tolerance of one product of K terms (the
    harness's product-by-product check, conformance.deployment.quantized.products); each stored weight within
    one quantization step of the float weight it was made from."""
    model, read, weight = _quantized(bits, symmetric)
    assert (read.zero_points is None) == symmetric
    dequantized = dequantize(read)
    assert dequantized.shape == (K, N)
    # what quantization cost, in steps |scale| of each element's block (SPEC §15.1's stored-weights rule)
    steps = np.abs(dequantized - weight) / block_steps(read)
    assert steps.max() <= within_a_step(bits), steps.max()
    a = np.random.default_rng(7).standard_normal((M, K)).astype(np.float32)
    assert_agrees(_run(model, a), a.astype(np.float64) @ dequantized, n=K, dtype="float32", what="the kernel's product")


def _swap_nibbles(packed):
    return ((packed & 0x0F) << 4) | (packed >> 4)


@pytest.mark.parametrize("mistake", ["nibbles swapped", "zero point off by one", "scales on the wrong axis"])
def test_a_wrong_reading_of_the_layout_disagrees_with_the_kernel(mistake):
    model, read, _ = _quantized(4, symmetric=False)
    if mistake == "nibbles swapped":
        wrong = dataclasses.replace(read, codes=_swap_nibbles(read.codes))
    elif mistake == "zero point off by one":  # every block's zero point one higher (none is 15 here)
        assert np.all(unpack(read.zero_points.reshape(N, -1), 4) < 15)
        wrong = dataclasses.replace(read, zero_points=read.zero_points + np.uint8(0x11))
    else:  # the [N, blocks] scales read as [blocks, N]
        wrong = dataclasses.replace(read, scales=np.asarray(read.scales).reshape(-1, N).T.reshape(-1).copy())
    a = np.random.default_rng(7).standard_normal((M, K)).astype(np.float32)
    # the kernel's product beyond the float32 tolerance the right reading keeps (the test above): the check sees it
    assert_differs(_run(model, a), a.astype(np.float64) @ dequantize(wrong), n=K, dtype="float32", what=mistake)


@pytest.mark.parametrize("change, message", [
    ({"bits": 2}, "bits = 2; the spec reads 4 and 8-bit codes"),
    ({"block_size": 24}, "block_size = 24"),
    ({"scales": np.ones((N, 2), np.float32)}, r"scales are float32 \[24, 2\]; one float per column and block: \[24, 3\]"),
    ({"scales": np.ones((N, 3), np.int32)}, "scales are int32"),
    ({"zero_points": np.full((N, 2), 8.0, np.float32)}, "zero_points are float32; the spec reads them packed in uint8"),
    ({"zero_points": np.zeros((N, 3), np.uint8)}, r"pack into \[24, 2\]"),
    ({"codes": np.zeros((N, 3, 8), np.uint8)}, r"codes are uint8 \[24, 3, 8\]; .* need uint8 \[24, 3, 16\]"),
])
def test_a_layout_the_spec_lacks_is_refused_by_name(change, message):
    _, read, _ = _quantized(4, symmetric=False)
    with pytest.raises(WeightsError, match=message):
        dequantize(dataclasses.replace(read, **change))


def test_a_code_must_be_its_element_rounded_or_clipped():
    """export.quantize.unrounded (SPEC §15.1): each code within half of w / scale + z (ties either way),
    or at the edge of its range with w / scale + z beyond it; a truncated code is named with its place."""
    from export.quantize import unrounded

    scales, zero = np.full((1, 6), 0.5), np.full((1, 6), 8)
    asked = np.array([[2.5, 3.49, -0.2, 15.9, 7.6, 11.0]])  # w / scale + z
    parameter = (asked - zero) * scales
    assert unrounded(parameter, np.array([[2, 3, 0, 15, 8, 11]]), scales, zero, (0, 15), 4) == ""
    assert unrounded(parameter, np.array([[3, 3, 0, 15, 8, 11]]), scales, zero, (0, 15), 4) == ""  # a tie either way
    truncated = unrounded(parameter, np.floor(asked).astype(np.int64).clip(0, 15), scales, zero, (0, 15), 4)
    assert truncated.startswith("1 of 6 codes are not its elements rounded (the worst at [0, 4]") and \
        "1 of them below the code asked for" in truncated  # 3.49 -> 3 rounds; -0.2 -> 0 and 15.9 -> 15 clip
    edge = unrounded(parameter, np.array([[2, 3, 0, 15, 8, 15]]), scales, zero, (0, 15), 4)
    assert edge.startswith("1 of 6 codes") and "w / scale + z = 11.0000, code 15" in edge  # the edge, not beyond it
