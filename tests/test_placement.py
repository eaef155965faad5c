"""The CPU-fallback rule of a CUDA session (export.placement), as a pure function of the
placement: the CPU nodes an H100 showed for our exports are shape arithmetic and allowed; any
compute node, floating-point tensor or data-sized integer tensor on the CPU is refused. The
profile parser is checked on real onnxruntime profiles of the exported graphs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from export.graphs import DECODER_STEP_IN_PLACE
from export.placement import (
    CPU_PROVIDER,
    INTEGER_TYPES,
    MATRIX_AND_NORM_OPS,
    PlacedNode,
    TensorType,
    by_provider,
    cpu_fallbacks,
    fallback_message,
    fallback_reason,
    nodes_from_profile,
)

CUDA_PROVIDER = "CUDAExecutionProvider"


def node(op_type, inputs, outputs, provider=CPU_PROVIDER, name=None):
    def tensors(spec):
        return None if spec is None else tuple(TensorType(element, tuple(shape)) for element, shape in spec)
    return PlacedNode(name or f"node_{op_type}", op_type, provider, tensors(inputs), tensors(outputs))


# The CPU nodes onnxruntime 1.31.1's CUDA provider left on the host for our torch exports (tiny and
# char-lm, float32 and float16, every graph role), as typed by onnx shape inference on an H100
# (issue 13): sizes read from shapes and the arithmetic on them.
SEEN_ON_H100 = [
    node("Squeeze", [("int64", [1])], [("int64", [])], name="node_sym_size_int_42"),
    node("Concat", [("int64", [1]), ("int64", [1]), ("int64", [1])], [("int64", [3])], name="node_Concat_142"),
    node("Add", [("int64", []), ("int64", [])], [("int64", [])], name="node_Add_17"),
    node("Reshape", [("int64", [1]), ("int64", [1])], [("int64", [1])], name="node_Reshape_88"),
    node("Shape", [("float16", [2, 4, 5, 16])], [("int64", [1])], name="node_Shape_15"),
]
# decoder_step's, on an H200 (tiny, float32 and float16)
SEEN_ON_H200 = [
    node("Concat", [("int64", [1])] * 4, [("int64", [4])], name="node_Concat_210"),
    node("Concat", [("int64", [1]), ("int64", [1])], [("int64", [2])], name="node_Concat_40"),
    node("Squeeze", [("int64", [1])], [("int64", [])], name="node_sym_size_int_41"),
]


def test_shape_arithmetic_seen_on_a_gpu_is_allowed():
    assert cpu_fallbacks(SEEN_ON_H100) == [] and cpu_fallbacks(SEEN_ON_H200) == []


@pytest.mark.parametrize("case, placed, reason", [
    ("matmul-float32", node("MatMul", [("float", [2, 5, 32]), ("float", [32, 32])], [("float", [2, 5, 32])]),
     "MatMul is model compute"),
    ("matmul-int64", node("MatMul", [("int64", [2, 2]), ("int64", [2])], [("int64", [2])]), "MatMul is model compute"),
    ("attention-float16", node("Attention", [("float16", [2, 4, 5, 8])] * 3, [("float16", [2, 4, 5, 8])]),
     "Attention is model compute"),
    ("layernorm", node("LayerNormalization", [("float", [2, 5, 32]), ("float", [32])], [("float", [2, 5, 32])]),
     "LayerNormalization is model compute"),
    ("softmax", node("Softmax", [("float", [2, 4, 5, 5])], [("float", [2, 4, 5, 5])]), "Softmax is model compute"),
    ("embedding-gather", node("Gather", [("float", [96, 32]), ("int64", [2, 5])], [("float", [2, 5, 32])]),
     "float tensor"),
    ("float-add", node("Add", [("float16", [2, 5, 32]), ("float16", [2, 5, 32])], [("float16", [2, 5, 32])]),
     "float16 tensor"),
    ("bool-mask", node("And", [("bool", [2, 1, 5, 5]), ("bool", [2, 1, 5, 5])], [("bool", [2, 1, 5, 5])]),
     "bool tensor of rank 4"),
    ("ids-cast", node("Cast", [("int64", [2, 5])], [("int32", [2, 5])]), "int64 tensor of rank 2"),
    ("float-from-ints", node("Cast", [("int64", [1])], [("float", [1])]), "float tensor"),
    ("types-unknown", node("Concat", None, None), "not recorded"),
])
def test_compute_on_the_cpu_is_a_fallback(case, placed, reason):
    found = fallback_reason(placed)
    assert found is not None and reason in found, found


def test_a_compute_node_among_allowed_ones_is_named():
    matmul = node("MatMul", [("float", [2, 5, 32]), ("float", [32, 32])], [("float", [2, 5, 32])],
                  name="node_MatMul_7")
    fallbacks = cpu_fallbacks([*SEEN_ON_H100, matmul])
    assert [placed.name for placed, _ in fallbacks] == ["node_MatMul_7"]
    message = fallback_message("decoder_step.onnx", fallbacks)
    assert "decoder_step.onnx: 1 compute node(s)" in message
    assert "node_MatMul_7: MatMul(float[2, 5, 32], float[32, 32]) -> float[2, 5, 32]" in message


def test_the_message_lists_a_few_and_counts_the_rest():
    many = [(node("MatMul", [], [], name=f"node_MatMul_{i}"), "MatMul is model compute") for i in range(20)]
    message = fallback_message("forward.onnx", many, limit=3)
    assert "node_MatMul_2" in message and "node_MatMul_3" not in message and "and 17 more" in message


@given(st.sampled_from(sorted(MATRIX_AND_NORM_OPS | {"Add", "Gather", "Concat", "Where", "Relu"})),
       st.lists(st.tuples(st.sampled_from(sorted(INTEGER_TYPES | {"float", "float16", "bfloat16", "double"})),
                          st.lists(st.integers(1, 4), max_size=4)), min_size=1, max_size=3),
       st.sampled_from([CPU_PROVIDER, CUDA_PROVIDER]))
def test_the_rule_on_any_node(op_type, tensors, provider):
    """Nothing on CUDA is a fallback; on the CPU, exactly compute ops, non-integer tensors and
    tensors of rank 2 or more are."""
    placed = node(op_type, tensors, tensors[:1], provider=provider)
    data = any(element not in INTEGER_TYPES or len(shape) > 1 for element, shape in tensors)
    expected = provider == CPU_PROVIDER and (op_type in MATRIX_AND_NORM_OPS or data)
    assert (fallback_reason(placed) is not None) == expected


def test_profile_events_parse_into_nodes():
    events = [
        {"cat": "Session", "name": "model_run", "args": {}},
        {"cat": "Node", "name": "node_MatMul_3_fence_before", "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "node_MatMul_3_kernel_time",
         "args": {"op_name": "MatMul", "provider": CUDA_PROVIDER,
                  "input_type_shape": [{"float": [2, 5, 32]}, {"float": [32, 32]}],
                  "output_type_shape": [{"float": [2, 5, 32]}]}},
        {"cat": "Node", "name": "node_Concat_9_kernel_time",
         "args": {"op_name": "Concat", "provider": CPU_PROVIDER, "input_type_shape": [{"int64": [1]}, {"int64": [1]}],
                  "output_type_shape": [{"int64": [2]}]}},
        {"cat": "Node", "name": "node_Concat_9_kernel_time",  # a second run of the same node
         "args": {"op_name": "Concat", "provider": CPU_PROVIDER}},
    ]
    nodes = nodes_from_profile(events)
    assert [n.name for n in nodes] == ["node_MatMul_3", "node_Concat_9"]
    assert nodes[0].inputs == (TensorType("float", (2, 5, 32)), TensorType("float", (32, 32)))
    assert nodes[1].signature() == "Concat(int64[1], int64[1]) -> int64[2]"
    assert by_provider(nodes) == {CUDA_PROVIDER: ["node_MatMul_3"], CPU_PROVIDER: ["node_Concat_9"]}
    assert cpu_fallbacks(nodes) == []


# CPU nodes per graph that CUDA sessions left on the host for tiny at float32: forward and encoder
# on an H100 (issue 13), decoder_step on an H200 (2026-11-26, onnxruntime-gpu 1.31.1: 7 of its 119
# nodes, the same at float16; llama-tiny and qwen3-tiny 7, char-lm 6)
GPU_CPU_NODES_TINY = {"forward": 9, "encoder": 4, "decoder_step": 7}
SHAPE_ARITHMETIC = {"Shape", "Concat", "Squeeze", "Unsqueeze", "Add", "Reshape", "Range"}


@pytest.mark.slow
@pytest.mark.parametrize("preset, dtype", [("tiny", "float32"), ("char-lm", "float16")])
def test_real_profiles_sort_compute_from_shape_arithmetic(preset, dtype):
    """Every node of our exported graphs as the CPU provider ran it, judged as if it were a CUDA
    session's CPU placement: the matrix products, attention, norms and embedding lookups are
    refused; what is allowed is integer scalar and vector arithmetic on shapes, room enough for
    the nodes the H100 kept on the CPU."""
    from export.cache import exported
    from export.runner import OnnxTransformer
    from spec import get_preset, conformance_params

    cfg = get_preset(preset)
    model = OnnxTransformer(exported(cfg, conformance_params(cfg, seed=0), framework="torch", dtype=dtype), device="cpu")
    for role, nodes in model.placement().items():
        assert nodes and {n.provider for n in nodes} == {CPU_PROVIDER}, role
        if role == DECODER_STEP_IN_PLACE:
            continue  # served on the CPU only (export.runner never loads it into a CUDA session)
        refused = {n.name for n, _ in cpu_fallbacks(nodes)}
        assert {"MatMul", "Attention", "Gather", "SkipLayerNormalization"} <= {n.op_type for n in nodes if n.name in refused}, role
        allowed = [n for n in nodes if n.name not in refused]
        assert {n.op_type for n in allowed} <= SHAPE_ARITHMETIC, role
        assert all(t.element == "int64" and len(t.shape) <= 1 for n in allowed for t in n.outputs), role
        if preset == "tiny" and role in GPU_CPU_NODES_TINY:
            assert len(allowed) >= GPU_CPU_NODES_TINY[role], role
