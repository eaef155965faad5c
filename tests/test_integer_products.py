"""The CPU's int8 path (SPEC §15.2): which arithmetic onnxruntime's u8·s8 products take on the CPU
at hand (conformance.machine.int8_path), and the two arithmetics written out as graphs it runs
exactly on any CPU (export.integer_products), so that a quantize_dynamic deployment's cost is
measured for both classes of CPU wherever the suite runs."""

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conformance.machine import Int8Path, cpu_flags, int8_path
from export.integer_products import INT16, with_integer_products
from export.onnx_model import ExportError
from spec import conformance_params, get_preset
from spec.quantization import QuantizationScheme

HERE = int8_path()


def _reference(a, a_zero_point, weights, saturating):
    """The arithmetic in NumPy: a [M, K] u8, weights [K, N] (b − z_b) -> [M, N] int64."""
    a, weights = a.astype(np.int64), weights.astype(np.int64)
    if not saturating:
        return (a - a_zero_point) @ weights
    pairs = a.reshape(len(a), -1, 2, 1) * weights.reshape(-1, 2, weights.shape[1])  # [M, K/2, 2, N]
    return np.clip(pairs.sum(axis=2), *INT16).sum(axis=1) - a_zero_point * weights.sum(0)


def _product(weights, k=8, n=5):
    """One MatMulInteger: A [M, K] u8 with its zero point as inputs, weights [K, N] s8 (zero point 0)."""
    node = helper.make_node("MatMulInteger", ["A", "B", "a_zero_point", "b_zero_point"], ["Y"])
    graph = helper.make_graph([node], "product", [helper.make_tensor_value_info("A", TensorProto.UINT8, [None, k]),
                                                  helper.make_tensor_value_info("a_zero_point", TensorProto.UINT8, [])],
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, [None, n])],
                              [numpy_helper.from_array(weights, "B"),
                               numpy_helper.from_array(np.int8(0), "b_zero_point")])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _operands():
    """Rows of large activations against large weights of one sign (pairs past int16: 255·127·2),
    and random rows beside them."""
    rng = np.random.default_rng(0)
    weights = rng.integers(-128, 128, (8, 5)).astype(np.int8)
    weights[:4, 0], weights[:4, 1] = 127, -128
    a = rng.integers(0, 256, (4, 8)).astype(np.uint8)
    a[0, :4] = 255
    return a, np.array(131, np.uint8), weights


@pytest.mark.parametrize("saturating", [False, True], ids=["exact", "saturating"])
def test_each_arithmetic_is_computed_as_written(saturating):
    a, zero_point, weights = _operands()
    expected = _reference(a, zero_point, weights, saturating)
    got = _run(with_integer_products(_product(weights), saturating), {"A": a, "a_zero_point": zero_point})
    assert got.dtype == np.int32 and np.array_equal(got, expected)
    assert not np.array_equal(_reference(a, zero_point, weights, True), _reference(a, zero_point, weights, False))


@pytest.mark.skipif(HERE.saturating is None, reason=f"this CPU's int8 path is not known: {HERE.describe()}")
def test_onnxruntime_computes_this_cpus_arithmetic():
    """onnxruntime's own MatMulInteger equals the arithmetic the CPU's flags name, and not the other."""
    a, zero_point, weights = _operands()
    theirs = _run(_product(weights), {"A": a, "a_zero_point": zero_point})
    assert np.array_equal(theirs, _reference(a, zero_point, weights, HERE.saturating)), HERE.describe()
    assert not np.array_equal(theirs, _reference(a, zero_point, weights, not HERE.saturating))


@pytest.mark.parametrize("flags, path", [
    ({"avx2", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"}, Int8Path("AMX", "TDPBUSD", False)),
    ({"avx2", "avx512bw", "avx512_vnni"}, Int8Path("AVX-512 VNNI", "VPDPBUSD", False)),
    ({"avx2", "avx_vnni"}, Int8Path("AVX-VNNI", "VPDPBUSD", False)),
    ({"avx2", "avx512bw"}, Int8Path("AVX-512 without VNNI", "VPMADDUBSW", True)),
    ({"avx2", "fma"}, Int8Path("AVX2 without VNNI", "VPMADDUBSW", True)),
    ({"asimd"}, Int8Path("no AVX2", "", None)),
], ids=["amx", "avx512-vnni", "avx-vnni", "avx512", "avx2", "arm"])
def test_the_int8_path_is_read_from_the_flags(flags, path):
    assert int8_path(frozenset(flags)) == path
    assert ("int16" in path.describe()) == bool(path.saturating)


def test_the_flags_are_read_from_cpuinfo():
    text = "processor\t: 0\nflags\t\t: fpu avx2 avx512_vnni\nbugs\t\t: none\n"
    assert cpu_flags(text) == {"fpu", "avx2", "avx512_vnni"} and cpu_flags("") == frozenset()


def test_a_product_it_cannot_rewrite_is_refused_by_name():
    _, _, weights = _operands()
    odd = _product(np.zeros((7, 5), np.int8), k=7)
    with pytest.raises(ExportError, match="K = 7 is odd"):
        with_integer_products(odd, saturating=True)
    computed = _product(weights)
    computed.graph.initializer.pop(0)  # B now comes from nowhere: not a constant
    computed.graph.input.append(helper.make_tensor_value_info("B", TensorProto.INT8, [8, 5]))
    with pytest.raises(ExportError, match="its weight 'B' is not a constant"):
        with_integer_products(computed, saturating=False)
    onnx.checker.check_model(with_integer_products(_product(weights), saturating=True))


# ---- a quantize_dynamic deployment: its cost is the CPU's ---------------------------------------

def _dynamic_forward(cfg, params):
    """llama-tiny's quantize_dynamic forward graph, and forward-none's feeds, logits and real tokens."""
    import json

    from conformance.backends.numpy_backend import golden_output
    from conformance.cases import build_case
    from conformance.deployment.quantized import real_tokens
    from export.quantize import quantized_export
    from spec.masks import real_tokens as keep_of

    directory = quantized_export(cfg, params, QuantizationScheme(8, dynamic=True))
    graph = onnx.load(str(directory / json.loads((directory / "manifest.json").read_text())["graphs"]["forward"]))
    case = build_case(cfg, params, "forward", "none")
    feeds = {"tgt_ids": np.asarray(case.inputs["tgt_ids"], np.int64),
             "tgt_keep": keep_of(cfg, case.inputs["tgt_ids"], "tgt")}
    return graph, feeds, case, golden_output(cfg, params, "forward", case.inputs), real_tokens(cfg, "forward",
                                                                                              case.inputs)


@pytest.mark.skipif(HERE.saturating is None, reason=f"this CPU's int8 path is not known: {HERE.describe()}")
def test_a_dynamic_deployments_logits_are_this_cpus_arithmetic_and_the_others_cost_is_measured():
    """llama-tiny's quantize_dynamic forward: onnxruntime's logits are the rewrite's with this CPU's
    arithmetic, to float32's tolerance of the case (the two differ at most in the order of their
    float operations), and beyond it from the other's: on llama-tiny some pairs saturate. Both
    costs are measured here, whichever CPU runs (SPEC §15.2: KL 4e-4 exact, 0.07 saturating)."""
    from conformance.deployment.quantized import cost
    from conformance.tolerance import compare

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    graph, feeds, case, float_logits, real = _dynamic_forward(cfg, params)
    theirs = _run(graph, feeds)
    arithmetic = {saturating: _run(with_integer_products(graph, saturating), feeds) for saturating in (False, True)}
    relative = case.tolerance(cfg, "float32")
    same = compare(theirs, arithmetic[HERE.saturating], relative)
    assert same.passed, f"{HERE.describe()}: {same.reason}"
    assert not compare(theirs, arithmetic[not HERE.saturating], relative).passed
    spent = {saturating: cost(logits, float_logits, real) for saturating, logits in arithmetic.items()}
    assert all(0 < spent[s].kl_mean < math.inf for s in spent)  # int8 rounding is never free, and always a number
    # log-softmax moves by at most twice the largest logit change, and so does each position's KL
    assert abs(cost(theirs, float_logits, real).kl_mean - spent[HERE.saturating].kl_mean) <= 2 * same.max_abs_err


def test_a_dynamic_deployment_has_its_cost_measured_and_no_implementation_reference():
    """onnxruntime's quantize_dynamic as a quantized column: no golden computes its int8 products, so
    its cost is measured and reported with the CPU's int8 path that sets it (llama-tiny's mean KL:
    4e-4 where the products are exact, 0.07 where VPMADDUBSW saturates, SPEC §15.2); a budget judges
    it, here set from what was measured: half the largest cost is broken, the largest is kept."""
    from conformance.deployment.quantized import Cost, check_quantized, format_quantized

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    column, = check_quantized(cfg, params, [QuantizationScheme(8, dynamic=True)])
    assert column.name == "onnx-dynamic-int8" and not column.error and column.passed, column.error
    assert column.verdict == "measured"  # nothing judged it: not ok, and not a failure either
    assert column.stored == [] and column.stages is None
    assert all(cell.implementation is None for cell in column.cells)
    logits = [cell.cost for cell in column.cells if isinstance(cell.cost, Cost)]
    assert logits and all(0 < spent.kl_mean < math.inf and 0 <= spent.top1 <= 1 for spent in logits)
    assert column.int8_path == HERE.describe()
    text = format_quantized([column])
    assert f"int8 products on this machine: {HERE.describe()}" in text and "n/a: int8 activations at run time" in text
    assert "onnx-dynamic-int8: measured, not judged" in text
    worst = max(spent.kl_mean for spent in logits)
    over, = check_quantized(cfg, params, [QuantizationScheme(8, dynamic=True)], {"kl": worst / 2})
    assert not over.passed
    assert [bool(cell.over_budget) for cell in over.cells] == [
        isinstance(cell.cost, Cost) and cell.cost.kl_mean > worst / 2 for cell in column.cells]
    assert over.verdict == "fail"
    kept, = check_quantized(cfg, params, [QuantizationScheme(8, dynamic=True)], {"kl": worst})
    assert kept.passed and kept.verdict == "ok"  # the budget judged it


def test_a_quantized_column_that_compared_nothing_ran_nothing(monkeypatch, capsys):
    """A runner whose every case leaves out every row (adapter.Partial, nothing compared): each case is
    recorded as left out whole with its cause, and the column ran nothing: not a pass, as a matrix
    column that ran nothing is not, and `rosetta check` exits 1."""
    import conformance.deployment.quantized as quantized
    from conformance.adapter import Partial
    from conformance.cases import BATCH
    from rosetta.main import main

    class NothingComputed:
        def run(self, sublayer, inputs):
            return Partial(np.zeros((BATCH, 1, 1)), np.zeros(BATCH, bool), {row: "a layout it cannot serve"
                                                                           for row in range(BATCH)})

    monkeypatch.setattr(quantized, "served", lambda *arguments: (NothingComputed(), None, {}))
    cfg = get_preset("llama-tiny")
    column, = quantized.check_quantized(cfg, conformance_params(cfg), [QuantizationScheme(8, dynamic=True)])
    assert column.cells and not any(cell.ran for cell in column.cells)
    assert column.verdict == "ran nothing" and not column.passed
    text = quantized.format_quantized([column])
    assert "RAN NOTHING" in text and "forward-none, left out whole: rows 0, 1, 2: a layout it cannot serve" in text
    capsys.readouterr()
    assert main(["check", "--preset", "llama-tiny", "--jobs", "1", "--backends", "numpy-float32", "--dtypes",
                 "float32", "-k", "forward-none", "--quantized", "dynamic-int8"]) == 1
    out = capsys.readouterr().out
    assert "1 passed, 0 failed" in out and "onnx-dynamic-int8: RAN NOTHING" in out  # the matrix passed; this did not

