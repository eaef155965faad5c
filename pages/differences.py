"""docs/framework-differences.md, written by code so it cannot drift from the code.

For each part of the model the page shows the golden's NumPy next to the PyTorch and JAX
versions, as excerpts cut out of the real source files (by function or class name, with the
ast module), what the ONNX export makes of it (counted in the exported graphs), and every
difference that matters with the number measured by `rosetta probe` or computed here, and the
command that reproduces it. ``rosetta differences --markdown docs/framework-differences.md``
writes it; a test regenerates the page and compares.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pages.probe import Observation, observation

ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = {"NumPy (golden)": "impl_numpy/model.py", "PyTorch": "impl_torch/model.py", "JAX / Flax": "impl_jax/model.py"}


@functools.lru_cache(maxsize=None)
def _parsed(path: str, modified: int) -> tuple[ast.Module, list[str]]:
    """A file's syntax tree and lines, parsed once per version of it (the page quotes each
    implementation dozens of times: parsing it anew each time took half the page's build)."""
    text = (ROOT / path).read_text()
    return ast.parse(text), text.splitlines()


def _source(path: str) -> tuple[ast.Module, list[str]]:
    return _parsed(path, (ROOT / path).stat().st_mtime_ns)


def excerpt(path: str, name: str) -> str:
    """The source of a top-level function or class, or Class.method, in a file of this repository."""
    tree, lines = _source(path)
    scope: list[ast.stmt] = tree.body
    node = None
    for part in name.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise KeyError(f"{path} has no {name}")
        scope = node.body
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    return textwrap.dedent("\n".join(lines[start:node.end_lineno]))


def _assignment(path: str, name: str) -> str:
    """The source of a top-level assignment (e.g. a dict of activations)."""
    tree, lines = _source(path)
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return "\n".join(lines[node.lineno - 1:node.end_lineno])
    raise KeyError(f"{path} has no {name}")


def source_of(path: str, name: str) -> str:
    return _assignment(path, name) if name.isupper() else excerpt(path, name)


# ---- numbers computed here ---------------------------------------------------------------------

def _positional_errors() -> dict[str, float]:
    """Max |PE - golden| over positions 0..4095, d 512: float64 angles rounded to float32 at the
    end (what impl_torch/impl_jax do) against float32 angles (what a float32 arange would give)."""
    import impl_numpy as golden

    positions = np.arange(4096)
    exact = golden.sinusoidal_table(positions, 512, "sinusoidal")
    rounded_at_end = exact.astype(np.float32)
    inverse = (10000.0 ** (-np.arange(0, 512, 2, dtype=np.float32) / np.float32(512))).astype(np.float32)
    angles = positions.astype(np.float32)[:, None] * inverse[None, :]
    in_float32 = np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(4096, 512)
    return {"float64 angles": float(np.abs(rounded_at_end - exact).max()),
            "float32 angles": float(np.abs(in_float32 - exact).max())}


def _onnx_ops() -> dict[str, Counter]:
    """Operator counts in the tiny preset's exported forward graph at opsets 23 and 20."""
    import onnx

    from export.cache import exported
    from spec import conformance_params, get_preset

    cfg = get_preset("tiny")
    params = conformance_params(cfg)  # the weights of the tests' exports, which the export cache shares
    counts = {}
    for opset in (23, 20):
        graph = onnx.load(str(exported(cfg, params, opset=opset) / "forward.onnx")).graph
        counts[str(opset)] = Counter(node.op_type for node in graph.node)
    return counts


def _grouped_attention_nodes() -> list[tuple[int, int]]:
    """(query heads, key/value heads) of each `Attention` node in qwen2-tiny's exported forward
    graph, read from its inputs' inferred shapes [B, heads, T, d_k]."""
    import onnx

    from export.cache import exported
    from spec import conformance_params, get_preset

    cfg = get_preset("qwen2-tiny")
    model = onnx.shape_inference.infer_shapes(onnx.load(str(exported(cfg, conformance_params(cfg)) / "forward.onnx")))
    heads = {v.name: v.type.tensor_type.shape.dim[1].dim_value for v in model.graph.value_info
             if len(v.type.tensor_type.shape.dim) == 4}
    return [(heads.get(node.input[0], 0), heads.get(node.input[1], 0)) for node in model.graph.node
            if node.op_type == "Attention"]


def _kv_names() -> tuple[list[str], list[str]]:
    from export.graphs import DECODER_STEP, signature
    from spec import get_preset

    sig = signature(get_preset("tiny"), DECODER_STEP)
    return ([f"`{t.name}` {list(t.dims)}" for t in sig.inputs if t.name.startswith("past")][:2],
            [f"`{t.name}` {list(t.dims)}" for t in sig.outputs if t.name.startswith("present")][:2])


def _modern_numbers() -> dict[str, dict]:
    """RMSNorm's defaults in torch and Flax, and what scaling in float32 (F.rms_norm) instead of after
    the cast does at bfloat16; RoPE's angle error when the tables are taken in a narrower dtype."""
    import inspect

    import ml_dtypes
    import torch
    import torch.nn.functional as F
    from flax import nnx

    import impl_numpy as golden
    import impl_torch
    from spec import get_preset

    flax_rms = {name: p.default for name, p in inspect.signature(nnx.RMSNorm.__init__).parameters.items()}
    norms = {"torch eps": torch.nn.RMSNorm(8).eps, "flax epsilon": flax_rms["epsilon"]}
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((256, 64)), dtype=torch.bfloat16)
    scale = torch.tensor(1 + 0.5 * rng.standard_normal(64), dtype=torch.bfloat16)
    ours = impl_torch.rms_norm(x, scale, None, 1e-6).float()
    fused = F.rms_norm(x, (64,), scale, 1e-6).float()
    norms["differ"] = float((ours != fused).float().mean())
    norms["worst"] = float((ours - fused).abs().max())

    positions, r, theta = np.arange(4096), 64, 10000.0
    head = get_preset("llama-small").replace(rope_theta=theta)  # heads of 64, all of it rotating
    exact_cos, _ = golden.rope_tables(head, positions)
    errors = {}
    for name, dtype in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
        inverse = (np.float32(theta) ** (-np.arange(0, r, 2, dtype=np.float32) / np.float32(r))).astype(dtype)
        angles = (positions.astype(dtype)[:, None] * inverse[None, :]).astype(np.float64)
        errors[name] = float(np.abs(np.cos(np.concatenate([angles, angles], -1)) - exact_cos).max())
    return {"norms": norms, "rope": errors, "attention nodes": _grouped_attention_nodes(),
            "linear": _linear_roundings(), "windows": _window_conventions(), "longrope": _longrope_switch(),
            "softcap": _softcap_conventions(), "top_k": _top_k_ties(), "quantized": _quantized_kernels(),
            "int8 runtimes": _int8_runtimes(), "int8 paths": _int8_paths()}


def _quantized_kernels() -> dict[str, dict[str, float]]:
    """One MatMul, A [16, 256] (normal, one column 30 times larger: an outlier) times W [256, 64],
    quantized by onnxruntime at 4 and 8 bits (blocks of 32, symmetric) and served at accuracy_level 0
    and 4, and by quantize_dynamic: per kernel, the largest error against the golden's
    A·dequantize(B) on the weight it stores (SPEC §15) and against the float A·W, each over max|A·W|."""
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from export.quantize import QUANTIZED_OP, quantize_graph, stored_weights
    from spec.quantization import QuantizationScheme, dequantize

    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 256)).astype(np.float32)
    a[:, 7] *= 30
    w = (rng.standard_normal((256, 64)) / 16).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "matmul",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(a.shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [16, 64])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    exact = a.astype(np.float64) @ w
    size = np.abs(exact).max()
    found = {}
    schemes = {"int4, level 0": QuantizationScheme(4, 32), "int4, level 4": QuantizationScheme(4, 32, accuracy_level=4),
               "int8, level 0": QuantizationScheme(8, 32), "int8, level 4": QuantizationScheme(8, 32, accuracy_level=4),
               "quantize_dynamic's int8": QuantizationScheme(8, dynamic=True)}
    for name, scheme in schemes.items():
        quantized = quantize_graph(model, {"W": w}, scheme)
        session = onnxruntime.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {"A": a})[0].astype(np.float64)
        stored = [dequantize(weight) for weight in stored_weights(quantized).values()]
        found[name] = {"against stored": float(np.abs(got - a.astype(np.float64) @ stored[0]).max() / size)
                       if stored and any(node.op_type == QUANTIZED_OP for node in quantized.graph.node) else None,
                       "against float": float(np.abs(got - exact).max() / size)}
    return found


def _int8_runtimes() -> dict[str, dict[str, float]]:
    """llama-tiny's forward-none logits from the same conformance weights through onnxruntime's int8
    (weight-only in blocks of 128 at accuracy_level 0 and 4; quantize_dynamic) and CTranslate2's
    (its converter on the weights written as a Hugging Face directory, run at compute types int8,
    int8_float32 and float32): per runtime the largest logit error over max|logit| and the share of
    tokens whose top-1 agrees, both against the float golden. {} without CTranslate2."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from conformance.backends.ctranslate2_backend import CTranslate2Runner, convert_model
    from conformance.backends.numpy_backend import golden_output
    from conformance.backends.onnx_backend import OnnxRunner
    from conformance.cases import build_case
    from export.quantize import quantized_export
    from export.runner import OnnxTransformer
    from importers.huggingface_writer import to_huggingface
    from spec import conformance_params, get_preset
    from spec.quantization import QuantizationScheme

    if importlib.util.find_spec("ctranslate2") is None:
        return {}
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    inputs = build_case(cfg, params, "forward", "none").inputs
    exact = np.asarray(golden_output(cfg, params, "forward", inputs), np.float64)
    logits = {}
    for name, scheme in (("onnxruntime int8, level 0", QuantizationScheme(8, 128)),
                         ("onnxruntime int8, level 4", QuantizationScheme(8, 128, accuracy_level=4)),
                         ("onnxruntime quantize_dynamic", QuantizationScheme(8, dynamic=True))):
        runner = OnnxRunner(OnnxTransformer(quantized_export(cfg, params, scheme), device="cpu"), name)
        logits[name] = runner.run("forward", inputs)
    with tempfile.TemporaryDirectory() as folder:
        to_huggingface(cfg, params, Path(folder) / "source", bos_id=1, eos_id=2)
        model = convert_model(Path(folder) / "source", cfg, Path(folder))
        for compute_type in ("int8", "int8_float32", "float32"):
            logits[f"CTranslate2 {compute_type}"] = CTranslate2Runner(model, cfg, compute_type).run("forward", inputs)
    size = np.abs(exact).max()
    return {name: {"error": float(np.abs(np.asarray(values, np.float64) - exact).max() / size),
                   "top1": float(np.mean(np.argmax(values, -1) == np.argmax(exact, -1)))}
            for name, values in logits.items()}


# oneDNN's cap on the instruction sets it dispatches to, read when CTranslate2 first computes: set in
# a process of its own, it runs the AVX2 products (VPMADDUBSW, saturating) on a CPU that has VNNI
CTRANSLATE2_AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def _int8_paths() -> dict[str, object]:
    """llama-tiny's forward-none through quantize_dynamic, its mean KL from the float golden and its
    top-1 agreement: as onnxruntime computes it on this CPU, and as each CPU class's arithmetic
    does (export.integer_products, run here whatever the CPU), at 8-bit and at reduce_range's 7-bit
    weights; and CTranslate2's int8 as it runs here and under oneDNN capped at AVX2."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    import onnx
    import onnxruntime

    from conformance.backends.numpy_backend import golden_output
    from conformance.cases import build_case
    from conformance.machine import int8_path
    from conformance.deployment.quantized import cost, real_tokens
    from export.cache import exported
    from export.integer_products import with_integer_products
    from export.quantize import quantize_graph
    from spec import conformance_params, get_preset
    from spec.masks import real_tokens as keep_of
    from spec.quantization import QuantizationScheme

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    inputs = build_case(cfg, params, "forward", "none").inputs
    float_logits, real = golden_output(cfg, params, "forward", inputs), real_tokens(cfg, "forward", inputs)
    feeds = {"tgt_ids": np.asarray(inputs["tgt_ids"], np.int64), "tgt_keep": keep_of(cfg, inputs["tgt_ids"], "tgt")}
    float_graph = onnx.load(str(exported(cfg, params, framework="torch", dtype="float32") / "forward.onnx"))

    def measured(logits) -> dict[str, float]:
        spent = cost(logits, float_logits, real)
        return {"kl": spent.kl_mean, "top1": spent.top1}

    def run(graph) -> np.ndarray:
        session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)[0]

    found: dict[str, object] = {"path": int8_path().describe()}
    for weights, reduce_range in (("8-bit", False), ("7-bit", True)):
        graph = quantize_graph(float_graph, params, QuantizationScheme(8, dynamic=True), reduce_range=reduce_range)
        found[weights] = {"onnxruntime": measured(run(graph)),
                          "exact": measured(run(with_integer_products(graph, False))),
                          "saturating": measured(run(with_integer_products(graph, True)))}
    if importlib.util.find_spec("ctranslate2") is not None:
        # oneDNN reads its ISA cap when CTranslate2 loads: the capped run is a process of its own
        program = "import json; from pages.differences import _ctranslate2_int8; print(json.dumps(_ctranslate2_int8()))"
        capped = subprocess.run([sys.executable, "-c", program], env={**os.environ, **CTRANSLATE2_AVX2}, check=True,
                                capture_output=True, text=True).stdout.splitlines()[-1]
        found["ctranslate2"] = {"here": _ctranslate2_int8(), "oneDNN capped at AVX2": json.loads(capped)}
    return found


def _ctranslate2_int8() -> dict[str, float]:
    """CTranslate2's int8 on llama-tiny's forward-none (its converter on the weights written as a
    Hugging Face directory): mean KL from the float golden and top-1 agreement, in this process."""
    import tempfile

    from conformance.backends.ctranslate2_backend import CTranslate2Runner, convert_model
    from conformance.backends.numpy_backend import golden_output
    from conformance.cases import build_case
    from conformance.deployment.quantized import cost, real_tokens
    from importers.huggingface_writer import to_huggingface
    from spec import conformance_params, get_preset

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    inputs = build_case(cfg, params, "forward", "none").inputs
    with tempfile.TemporaryDirectory() as folder:
        to_huggingface(cfg, params, Path(folder) / "source", bos_id=1, eos_id=2)
        model = convert_model(Path(folder) / "source", cfg, Path(folder))
        logits = CTranslate2Runner(model, cfg, "int8").run("forward", inputs)
    spent = cost(logits, golden_output(cfg, params, "forward", inputs), real_tokens(cfg, "forward", inputs))
    return {"kl": spent.kl_mean, "top1": spent.top1}


def _top_k_ties() -> dict[str, tuple[float, float]]:
    """What each framework's top-k returns on ties (SPEC §5.14: the lower index first), on 2000 rows
    of 8 probabilities drawn from {0.1, 0.2, 0.3} (most rows tie), k = 2: the share of rows whose
    chosen experts equal the golden's in order, and as sets."""
    import jax
    import jax.numpy as jnp
    import onnxruntime
    import torch
    from onnx import TensorProto, helper

    import impl_numpy as golden

    k, rng = 2, np.random.default_rng(0)
    p = rng.choice(np.array([0.1, 0.2, 0.3], np.float32), size=(2000, 8))
    want = golden.top_experts(p.astype(np.float64), k)
    node = helper.make_node("TopK", ["p", "k"], ["values", "indices"], axis=-1, largest=1, sorted=1)
    graph = helper.make_graph([node], "top_k", [helper.make_tensor_value_info("p", TensorProto.FLOAT, list(p.shape)),
                                                helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("indices", TensorProto.INT64, None)])
    top_k_model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    session = onnxruntime.InferenceSession(top_k_model.SerializeToString(), providers=["CPUExecutionProvider"])
    found = {
        "torch.topk": torch.topk(torch.from_numpy(p), k).indices.numpy(),
        "torch.topk(sorted=False)": torch.topk(torch.from_numpy(p), k, sorted=False).indices.numpy(),
        "torch.sort(stable=True)": torch.sort(torch.from_numpy(p), descending=True, stable=True).indices[:, :k].numpy(),
        "jax.lax.top_k": np.asarray(jax.lax.top_k(jnp.asarray(p), k)[1]),
        "jnp.argsort(stable=True)": np.asarray(jnp.argsort(-jnp.asarray(p), axis=-1, stable=True)[:, :k]),
        "onnxruntime TopK": session.run(None, {"p": p, "k": np.array([k], np.int64)})[1],
    }
    return {name: (float((got == want).all(axis=-1).mean()),
                   float((np.sort(got, axis=-1) == np.sort(want, axis=-1)).all(axis=-1).mean()))
            for name, got in found.items()}


CAP = 2.0  # the softcap c of the softcap measurement: c·tanh(s / c)


def _group_query_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None = None,
                           **attributes) -> np.ndarray:
    """onnxruntime's GroupQueryAttention (com.microsoft, CPU) as one node: a causal self-attention of
    q, k, v [B, T, H, d] (as many key/value heads as query heads, an empty past), with an additive
    attention_bias [1, 1, T, T] where given and the node's attributes. -> out [B, T, H, d]"""
    import onnxruntime
    from onnx import TensorProto, helper

    batch, length, heads, width = q.shape
    names = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"] + (["", "", "", "bias"] if bias is not None else [])
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain="com.microsoft",
                            num_heads=heads, kv_num_heads=heads, **attributes)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, length, heads * width]) for name in "qkv"]
    inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, heads, 0, width])
               for name in ("past_k", "past_v")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    feeds = {name: x.reshape(batch, length, heads * width) for name, x in zip("qkv", (q, k, v))}
    feeds |= {"past_k": np.zeros((batch, heads, 0, width), np.float32), "past_v": np.zeros((batch, heads, 0, width),
                                                                                           np.float32),
              "seqlens_k": np.array([length - 1] * batch, np.int32), "total": np.array(length, np.int32)}
    if bias is not None:
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, list(bias.shape)))
        feeds["bias"] = bias
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("out", "present_k", "present_v")]
    model = helper.make_model(helper.make_graph([node], "attention", inputs, outputs), ir_version=8,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0].reshape(batch, length, heads, width)


def _softcap_conventions() -> dict[str, object]:
    """Where each framework takes an attention softcap (SPEC.md §5.13), on one causal attention of 9
    positions with scores well past c: the arguments of torch's SDPA and of
    jax.nn.dot_product_attention, and onnxruntime's GroupQueryAttention with softcap = c and the
    causal mask as its attention_bias, against the golden with the cap before the mask and after it."""
    import inspect

    import jax

    import impl_numpy as golden
    from spec.masks import causal_mask

    batch, length, heads, width = 1, 9, 2, 8
    rng = np.random.default_rng(1)
    q, k, v = (3 * rng.standard_normal((batch, length, heads, width)).astype(np.float32) for _ in range(3))
    to_heads = lambda x: x.transpose(0, 2, 1, 3).astype(np.float64)  # noqa: E731
    mask = causal_mask(length)
    scores = to_heads(q) @ to_heads(k).swapaxes(-1, -2) / np.sqrt(width)
    before = golden.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), mask, cap=CAP)
    after = golden.softmax(golden.softcap(np.where(mask, scores, -np.inf), CAP)) @ to_heads(v)  # the fill, then the cap
    bias = np.where(mask, 0.0, np.finfo(np.float32).min).astype(np.float32).reshape(1, 1, length, length)
    out = to_heads(_group_query_attention(q, k, v, bias, softcap=CAP))
    uncapped = golden.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), mask)
    return {"largest score": float(np.abs(scores).max()), "cap moves": float(np.abs(before - uncapped).max()),
            "onnxruntime": [float(np.abs(out - reference).max()) for reference in (before, after)],
            "jax arguments": list(inspect.signature(jax.nn.dot_product_attention).parameters)}


WINDOW = 4  # the spec's W in the window measurements: i − W < j ≤ i


def _window_conventions() -> dict[str, object]:
    """Each framework's own window parameter against the spec's window of W keys (SPEC.md §6), on
    one causal attention of 9 positions: the largest difference from the golden with a window of W
    and of W + 1, per setting; torch's SDPA arguments; transformers' overlay as a 9×9 keep-mask."""
    import jax
    import torch.nn.functional as F

    import impl_numpy as golden
    from spec.masks import causal_mask

    batch, length, heads, width = 1, 9, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, length, heads, width)).astype(np.float32) for _ in range(3))

    def apart(out: np.ndarray) -> list[float]:  # out [B, T, H, d]: from the golden's windows of W and W + 1
        to_heads = lambda x: x.transpose(0, 2, 1, 3).astype(np.float64)  # noqa: E731
        return [float(np.abs(np.asarray(out, np.float64).transpose(0, 2, 1, 3) - golden.scaled_dot_product_attention(
            to_heads(q), to_heads(k), to_heads(v), causal_mask(length, window=window))).max())
            for window in (WINDOW, WINDOW + 1)]

    found: dict[str, object] = {}
    for left in (WINDOW - 1, WINDOW):
        found[f"jax ({left}, 0)"] = apart(jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                       local_window_size=(left, 0)))
    for size in (WINDOW - 1, WINDOW):
        found[f"onnxruntime {size}"] = apart(_group_query_attention(q, k, v, local_window_size=size))
    # a builtin without a signature: its documented one, the docstring's head up to the closing parenthesis
    documented = F.scaled_dot_product_attention.__doc__.strip().split(")", 1)[0].split("(", 1)[1]
    found["sdpa arguments"] = [part.split("=")[0].strip() for part in documented.split(",") if part.strip()]
    try:  # the hf extra
        from transformers.masking_utils import sliding_window_overlay
    except ImportError:
        found["transformers is the spec"] = None
        return found
    overlay = sliding_window_overlay(WINDOW)
    keep = np.array([[bool(overlay(0, 0, i, j)) and j <= i for j in range(length)] for i in range(length)])
    found["transformers is the spec"] = bool(np.array_equal(keep, causal_mask(length, window=WINDOW)[0, 0]))
    return found


def _longrope_switch() -> dict[str, object]:
    """transformers' longrope frequencies for a call of length L and L + 1 (its seq_len): which factor
    set each takes, against the golden's rule (SPEC.md §5.12); empty without transformers."""
    import dataclasses

    try:  # the hf extra
        import transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return {}

    import impl_numpy as golden
    from spec import get_preset

    cfg = get_preset("phi3-tiny")
    scaling, length = cfg.rope_scaling, cfg.rope_scaling.original_max_len
    hf = transformers.Phi3Config(
        hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_len, original_max_position_embeddings=length,
        rope_parameters={"rope_type": "longrope", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
                         "partial_rotary_factor": cfg.rope_fraction, "original_max_position_embeddings": length,
                         "short_factor": list(scaling.short_factor), "long_factor": list(scaling.long_factor)})
    always = {name: cfg.replace(rope_scaling=dataclasses.replace(scaling, short_factor=factors, long_factor=factors))
              for name, factors in (("short", scaling.short_factor), ("long", scaling.long_factor))}
    taken = {}
    for seq_len in (length, length + 1):
        frequencies = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)[0].double().numpy()
        taken[seq_len] = next(name for name, variant in always.items()
                              if np.allclose(frequencies, golden.rope_frequencies(variant, seq_len), rtol=1e-6))
    return {"L": length, "at L": taken[length], "at L + 1": taken[length + 1]}


def _linear_roundings() -> dict[str, float]:
    """x W + b at float16 (x [256, 64], W [64, 64], b ~ N(0, 1)) by torch's nn.Linear, by
    impl_jax.Linear and by flax's nnx.Linear alone: how often each differs from torch, and each
    one's largest error against the float64 product."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from impl_jax.model import Linear

    rng = np.random.default_rng(0)
    x, weight, bias = (rng.standard_normal(shape).astype(np.float16) for shape in ((256, 64), (64, 64), (64,)))
    exact = x.astype(np.float64) @ weight.astype(np.float64) + bias.astype(np.float64)
    torch_linear = torch.nn.Linear(64, 64, dtype=torch.float16)
    with torch.no_grad():
        torch_linear.weight.copy_(torch.from_numpy(weight.T.copy()))
        torch_linear.bias.copy_(torch.from_numpy(bias))
        by_torch = torch_linear(torch.from_numpy(x)).numpy()
    found = {}
    for name, layer_class in (("ours", Linear), ("nnx", nnx.Linear)):
        layer = layer_class(64, 64, dtype=jnp.float16, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
        layer.kernel.value, layer.bias.value = jnp.asarray(weight), jnp.asarray(bias)
        output = np.asarray(layer(jnp.asarray(x)))
        found[f"{name} differs"] = float((output != by_torch).mean())
        found[f"{name} error"] = float(np.abs(output.astype(np.float64) - exact).max())
    found["torch error"] = float(np.abs(by_torch.astype(np.float64) - exact).max())
    return found


def _training_numbers() -> dict[str, dict]:
    """What each framework's optimizer, clipping, smoothing and schedule do, on scalars: their
    defaults, one Adam update of a 1e-5 gradient, the clip of a gradient of norm 2 to 1, one
    smoothed loss at V 11, and the count the first update's rate is taken at."""
    import inspect
    import math

    import jax
    import jax.numpy as jnp
    import optax
    import torch
    import torch.nn.functional as F

    import impl_numpy as golden
    from impl_numpy.training import adam_update, clip_by_global_norm, start_adam
    from spec import get_preset
    from spec.params import param_shapes
    from spec.training import TrainingConfig, decays

    spec = TrainingConfig()
    torch_adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    optax_adamw = {name: p.default for name, p in inspect.signature(optax.adamw).parameters.items()}
    shapes = param_shapes(get_preset("tiny"))
    decayed = [shape for shape in shapes.values() if decays(shape)]
    defaults = {"torch": {"weight_decay": torch_adamw["weight_decay"], "beta2": torch_adamw["betas"][1],
                          "eps": torch_adamw["eps"]},
                "optax": {"weight_decay": optax_adamw["weight_decay"], "beta2": optax_adamw["b2"],
                          "eps": optax_adamw["eps"], "eps_root": optax_adamw["eps_root"]},
                "spec": {"weight_decay": spec.weight_decay, "beta2": spec.beta2, "eps": spec.eps},
                "decayed": (len(decayed), len(shapes), sum(math.prod(s) for s in decayed),
                            sum(math.prod(s) for s in shapes.values()))}

    # one Adam update at step 1, lr 1, of a gradient element 1e-5: m̂ = g, v̂ = g²
    g, eps = 1e-5, spec.eps
    theta = {"x": np.zeros(1)}
    moved, _ = adam_update(spec, start_adam(theta), theta, {"x": np.array([g])}, 1.0)
    weight = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    weight.grad = torch.tensor([g], dtype=torch.float64)
    torch.optim.Adam([weight], lr=1.0, eps=eps).step()

    def optax_step(**placement) -> float:
        adam = optax.adam(1.0, **placement)
        return -float(adam.update(jnp.array([g]), adam.init(jnp.zeros(1)))[0][0])

    update = {"golden": -float(moved["x"][0]), "torch": -float(weight.detach()[0]),
              "optax": optax_step(eps=eps, eps_root=0.0), "optax inside": optax_step(eps=0.0, eps_root=eps),
              "inside": g / math.sqrt(g * g + eps)}

    # clipping a gradient of norm 2 to 1: the factor each leaves on it
    gradient, limit = np.array([2.0]), 1.0
    weight = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    weight.grad = torch.tensor(gradient)
    torch.nn.utils.clip_grad_norm_([weight], limit)
    clipped, _ = optax.clip_by_global_norm(limit).update(jnp.asarray(gradient), optax.EmptyState())
    clip = {"norm": float(np.linalg.norm(gradient)), "to": limit, "torch": float(weight.grad[0] / gradient[0]),
            "optax": float(clipped[0] / gradient[0]),
            "golden": float(clip_by_global_norm({"x": gradient}, limit)["x"][0] / gradient[0])}

    # one logits row, V 11, ε 0.1, pad 0, target 3: q on the target, on pad and on another token
    # (torch's read back as softmax − ∂L/∂logits), and the loss
    vocab, smoothing, pad, target, other = 11, 0.1, 0, 3, 1
    logits = np.random.default_rng(0).standard_normal(vocab)
    q = golden.smoothed_targets(np.array([target]), vocab, pad, smoothing)[0]
    row = torch.tensor(logits, requires_grad=True)
    torch_loss = F.cross_entropy(row[None], torch.tensor([target]), label_smoothing=smoothing)
    torch_loss.backward()
    torch_q = (torch.softmax(row, -1) - row.grad).detach().numpy()
    optax_q = np.asarray(optax.smooth_labels(jax.nn.one_hot(target, vocab), smoothing))
    smoothing_at = {"V": vocab, "eps": smoothing, "pad": pad, "target": target,
                    "spec": (*q[[target, pad, other]], float(-(q * golden.log_softmax(logits)).sum())),
                    "torch": (*torch_q[[target, pad, other]], float(torch_loss.detach())),
                    "optax": (*optax_q[[target, pad, other]],
                              float(optax.softmax_cross_entropy(jnp.asarray(logits), optax_q)))}

    # the count each framework's schedule is called with for the first update
    counts = {"torch": [], "optax": []}
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    torch.optim.lr_scheduler.LambdaLR(sgd, lambda count: counts["torch"].append(count) or 1.0)
    recorded = optax.sgd(lambda count: counts["optax"].append(int(count)) or 1.0)
    recorded.update(jnp.ones(1), recorded.init(jnp.zeros(1)))
    return {"defaults": defaults, "update": update, "clip": clip, "smoothing": smoothing_at,
            "first count": {name: seen[0] for name, seen in counts.items()}}

# ---- the page ----------------------------------------------------------------------------------

MEASURED, EXPLAINED = "measured", "explained"  # a number this run saw, or a reading of the code


@dataclass(frozen=True)
class Measurements:
    """What one run measured or computed, for the sections to quote."""
    observed: list[Observation]  # `rosetta probe` on the CPU
    positional: dict[str, float]  # _positional_errors()
    ops: dict[str, Counter]  # _onnx_ops()
    training: dict[str, dict]  # _training_numbers()
    modern: dict[str, dict]  # _modern_numbers()


def _probed(measurements: Measurements, topic: str, primitive: str) -> str:
    """What `rosetta probe` saw one primitive do on one topic, on the CPU."""
    return observation(measurements.observed, topic, primitive)


# Each section's items: (MEASURED, text) when the text quotes what this run measured or computed,
# (EXPLAINED, text) when it reads the code or the frameworks' documentation.

def _weight_layouts(measurements: Measurements) -> list[tuple[str, str]]:
    """The exported graph's linear nodes, and each framework's weight layout."""
    linear_ops = measurements.ops["23"]["MatMul"] + measurements.ops["23"]["Gemm"]
    return [
        (MEASURED, f"ONNX (torch export): the tiny forward graph holds {linear_ops} MatMul/Gemm nodes whose "
                   "weights are initializers in the exporter's own layout."),
        (EXPLAINED, "PyTorch's `nn.Linear` stores `[out, in]` and computes `x @ Wᵀ`: every Linear weight is "
                    "transposed on the way in and out, nothing else changes (`tests/test_torch.py`)."),
        (EXPLAINED, "Flax's `nnx.Linear` kernel is `[in, out]` like the spec: no transpose, only the leaf name "
                    "(`kernel` for `weight`, `embedding` for an embedding's `weight`)."),
        (EXPLAINED, "An exported graph's metadata carries the weights' SHA-256, so a graph is tied to the file it "
                    "came from (`rosetta export`)."),
    ]


def _positional_layouts(measurements: Measurements) -> list[tuple[str, str]]:
    """The sinusoid table's error from float64 and from float32 angles, and where impl_jax makes it."""
    positional = measurements.positional
    return [
        (MEASURED, f"Angles in float64, rounded to float32 at the end (impl_torch, impl_jax, the golden at "
                   f"float32): max error {positional['float64 angles']:.1e} over positions 0–4095 at d=512; the "
                   f"same table from float32 angles: {positional['float32 angles']:.1e}."),
        (EXPLAINED, "impl_jax makes the table on the host in NumPy (JAX has float64 only in x64 mode); so its ONNX "
                    "export holds a table of max_len positions, while the torch export computes the sinusoids in "
                    "the graph (docs/onnx.md)."),
    ]


def _attention_scale_and_masks(measurements: Measurements) -> list[tuple[str, str]]:
    """What each attention primitive does with a fully masked row, its mask and float64, and the
    exported graph's attention nodes."""
    ops = measurements.ops
    return [
        (MEASURED, f"Fully masked row, torch SDPA (CPU): "
                   f"{_probed(measurements, 'fully masked row', 'torch F.scaled_dot_product_attention')}; "
                   f"`nn.MultiheadAttention`: "
                   f"{_probed(measurements, 'fully masked row', 'torch nn.MultiheadAttention')}; "
                   f"`jax.nn.dot_product_attention`: "
                   f"{_probed(measurements, 'fully masked row', 'jax.nn.dot_product_attention')}; "
                   f"onnxruntime `Attention`: "
                   f"{_probed(measurements, 'fully masked row', 'onnxruntime Attention')}."),
        (MEASURED, f"SDPA's boolean mask: "
                   f"{_probed(measurements, 'mask forms', 'torch F.scaled_dot_product_attention')}."),
        (MEASURED, f"Fill values before a softmax, for an all-masked row: "
                   f"{_probed(measurements, 'fill values, all-masked row', 'torch.softmax after a fill')}."),
        (MEASURED, f"`jax.nn.dot_product_attention` at float64: "
                   f"{_probed(measurements, 'float64 attention', 'jax.nn.dot_product_attention')}."),
        (MEASURED, f"ONNX: at opset 23 the tiny forward graph has {ops['23']['Attention']} `Attention` nodes and "
                   f"{ops['23']['Softmax']} `Softmax`; at opset 20 it has {ops['20']['Attention']} and "
                   f"{ops['20']['Softmax']}. onnxruntime's Attention and a `[B,1,1,K]` mask: "
                   f"{_probed(measurements, 'mask broadcasting', 'onnxruntime Attention')}."),
        (EXPLAINED, "No fill value gives the spec's zeros, so every implementation enforces the row rule itself "
                    "(the `all_pad` cells check it)."),
        (EXPLAINED, "`nn.MultiheadAttention`'s `key_padding_mask` has the opposite polarity (True = ignore)."),
        (EXPLAINED, "`jax.nn.dot_product_attention` takes its softmax in float32 whatever the input, so impl_jax "
                    "sends float64 through its explicit path; the report names the path each cell took."),
    ]


def _head_splitting(measurements: Measurements) -> list[tuple[str, str]]:
    """The reshape all three share, and the axis order jax.nn.dot_product_attention wants."""
    return [
        (EXPLAINED, "The same reshape-then-transpose in all three; reshaping `[B, T, d]` straight to "
                    "`[B, H, T, d_k]` without the transpose is mutation `heads_reshape` "
                    "(docs/mutation-gallery.md)."),
        (EXPLAINED, "`jax.nn.dot_product_attention` wants `[B, T, H, d_k]` (heads after the sequence axis): "
                    "impl_jax swaps axes around the call."),
    ]


def _layer_norm(measurements: Measurements) -> list[tuple[str, str]]:
    """torch's and Flax's LayerNorm defaults, and what our norms do instead."""
    return [
        (MEASURED, f"`torch.nn.LayerNorm` default: "
                   f"{_probed(measurements, 'LayerNorm defaults', 'torch.nn.LayerNorm')}; "
                   f"`flax.nnx.LayerNorm` default: "
                   f"{_probed(measurements, 'LayerNorm defaults', 'flax.nnx.LayerNorm')}."),
        (EXPLAINED, "Flax's `use_fast_variance` takes E[x²] − E[x]² in one pass, which cancels on values far "
                    "from 0; our norms pass the config's eps and take two passes."),
        (EXPLAINED, "Half-precision activations: both implementations take the statistics in float32 and cast "
                    "back."),
    ]


def _gelu(measurements: Measurements) -> list[tuple[str, str]]:
    """torch's and jax's GELU defaults, which the implementations never rely on."""
    return [
        (MEASURED, f"`torch.nn.functional.gelu` default: "
                   f"{_probed(measurements, 'GELU default', 'torch.nn.functional.gelu')}; "
                   f"`jax.nn.gelu` default: {_probed(measurements, 'GELU default', 'jax.nn.gelu')}."),
        (EXPLAINED, "Both implementations choose the form from the config, never the default."),
    ]


def _matmul_precision(measurements: Measurements) -> list[tuple[str, str]]:
    """torch's and jax's default float32 matmul precision, and why every run states its own."""
    return [
        (MEASURED, f"torch's default here: {_probed(measurements, 'matmul precision', 'torch')}; "
                   f"jax's: {_probed(measurements, 'matmul precision', 'jax')}."),
        (EXPLAINED, "On NVIDIA GPUs JAX's default float32 matmul rounds its inputs to TF32 and PyTorch's does "
                    "not (their documentation), so both backends state the precision on every run."),
        (EXPLAINED, "ONNX graphs carry no precision setting: on CUDA, onnxruntime's provider options decide "
                    "(`rosetta check --devices cuda` measures the result)."),
    ]


def _kv_cache_shapes(measurements: Measurements) -> list[tuple[str, str]]:
    """The decoder_step graph's cache inputs and outputs, and how each implementation writes its cache."""
    past, present = _kv_names()
    return [
        (MEASURED, f"The ONNX decoder_step graph takes {', '.join(past)}, … and returns {', '.join(present)}, … "
                   "at the same capacity."),
        (EXPLAINED, "Both preallocate `capacity` positions and attend over all of them under a mask, for "
                    "different reasons: impl_jax because XLA compiles once per shape, so it writes with "
                    "`dynamic_update_slice` and returns a new cache; impl_torch because a growing cache "
                    "allocates every step and, on a GPU, plans a new attention kernel for every key length, so "
                    "it writes into its buffers in place (a cache is continued one way; `copy()` one to branch, "
                    "and a stale branch is refused)."),
        (EXPLAINED, "The decoder_step graph is impl_torch's step: the new positions are written into copies (a "
                    "graph never writes its inputs); the runner keeps two sets of buffers on the device and "
                    "swaps them each step, so every step binds the same buffers. decoder_step_in_place, which "
                    "the runner serves on the CPU, makes each layer's cache attention one onnxruntime "
                    "GroupQueryAttention node, which writes the new positions into the past buffers it reads "
                    "when its present outputs are bound to them: one set of K/V buffers, and attention over "
                    "the positions written so far."),
    ]


def _rms_norm(measurements: Measurements) -> list[tuple[str, str]]:
    """torch's and Flax's RMSNorm defaults, and how far F.rms_norm's order of cast and scale moves
    the outputs at bfloat16."""
    norms = measurements.modern["norms"]
    torch_eps = "None, the input dtype's machine epsilon" if norms["torch eps"] is None else norms["torch eps"]
    return [
        (MEASURED, f"`torch.nn.RMSNorm`'s default eps: {torch_eps}; `flax.nnx.RMSNorm`'s default epsilon: "
                   f"{norms['flax epsilon']:g}. Both norms pass the config's ε."),
        (MEASURED, f"At bfloat16 (256 rows of 64, γ ≈ 1 ± 0.5): `F.rms_norm`, which scales by γ in float32 "
                   f"before the one cast, differs from the spec's cast-then-scale in {norms['differ']:.0%} of "
                   f"the outputs, by up to {norms['worst']:.3g}."),
        (EXPLAINED, "impl_torch and impl_jax write the norm out rather than call `F.rms_norm` or "
                    "`nnx.RMSNorm`, whose order of cast and scale is not the checkpoints'; ε outside the root "
                    "is mutation `rms_eps_outside_root` (docs/mutation-gallery.md)."),
    ]


def _rotary_positions(measurements: Measurements) -> list[tuple[str, str]]:
    """RoPE's angle error when its tables are taken in a narrower dtype, and how the implementations
    take them."""
    rope = measurements.modern["rope"]
    return [
        (MEASURED, f"Largest error in cos(angle) over positions 0–4095, r = 64, θ = 10⁴, with the angles "
                   f"taken in float32: {rope['float32']:.1e}; in bfloat16: {rope['bfloat16']:.2f}; in float16: "
                   f"{rope['float16']:.2f} (transformers PR #29285)."),
        (EXPLAINED, "impl_torch and impl_jax take the tables in float32 (float64 for a float64 model) and cast "
                    "them to the activations' dtype, so the multiply runs in that dtype; tables in float16 are "
                    "mutation `rope_tables_float16`, the interleaved layout (GPT-J's, Meta's original Llama "
                    "code) is `rope_interleaved`."),
        (EXPLAINED, "impl_jax builds the positions with `lax.iota`, not `jnp.arange` of a traced offset, so "
                    "the decode step compiles once and jax2onnx can export it."),
    ]


def _grouped_query_attention(measurements: Measurements) -> list[tuple[str, str]]:
    """What the native attention entry points do with fewer key/value heads, and the heads of the
    exported graph's Attention nodes."""
    grouped = measurements.modern["attention nodes"]
    return [
        (MEASURED, f"`F.scaled_dot_product_attention` with 2 K/V heads for 4: "
                   f"{_probed(measurements, 'grouped-query attention', 'torch F.scaled_dot_product_attention')}; "
                   f"with `enable_gqa=True`: "
                   f"{_probed(measurements, 'grouped-query attention', 'torch F.scaled_dot_product_attention(enable_gqa=True)')}; "
                   f"`jax.nn.dot_product_attention`: "
                   f"{_probed(measurements, 'grouped-query attention', 'jax.nn.dot_product_attention')}."),
        (EXPLAINED, "impl_torch's SDPA path passes `enable_gqa=True` and impl_jax's native path hands "
                    "`jax.nn.dot_product_attention` the H_kv heads; each framework's math path (and the golden) "
                    "repeats the K/V heads explicitly with `repeat_interleave` / `jnp.repeat`. `torch.repeat`'s "
                    "tiled order is mutation `kv_heads_tiled`."),
        (MEASURED, f"ONNX (torch export): qwen2-tiny's forward graph holds {len(grouped)} `Attention` nodes, "
                   f"whose query and key inputs have {' and '.join(sorted({f'{q} and {k}' for q, k in grouped}))} "
                   "heads: the grouping stays inside the op, with no repeat of K and V before it."),
    ]


def _sliding_windows(measurements: Measurements) -> list[tuple[str, str]]:
    """How each framework's own window parameter counts W, and LongRoPE's switch in transformers."""
    found, rope = measurements.modern["windows"], measurements.modern["longrope"]

    def against(key: str) -> str:
        spec_w, wider = found[key]
        return f"{spec_w:.1e} from the spec's window of {WINDOW}, {wider:.1e} from a window of {WINDOW + 1}"

    sdpa = ", ".join(f"`{name}`" for name in found["sdpa arguments"])
    items = [
        (MEASURED, f"`jax.nn.dot_product_attention(is_causal=True, local_window_size=({WINDOW - 1}, 0))` on 9 "
                   f"positions: {against(f'jax ({WINDOW - 1}, 0)')}; with `({WINDOW}, 0)`: "
                   f"{against(f'jax ({WINDOW}, 0)')}. JAX's left size does not count the query itself: the spec's "
                   f"W is `(W − 1, 0)`."),
        (MEASURED, f"onnxruntime's `GroupQueryAttention` (com.microsoft, CPU) with `local_window_size={WINDOW}`: "
                   f"{against(f'onnxruntime {WINDOW}')}; with `{WINDOW - 1}` (a window of {WINDOW - 1}): "
                   f"{against(f'onnxruntime {WINDOW - 1}')}. "
                   "Its size counts the query, as the spec's W does."),
        (MEASURED, f"`F.scaled_dot_product_attention` takes {sdpa}: no window; a window is a mask."),
    ]
    if found["transformers is the spec"] is not None:
        items.append((MEASURED, f"transformers' `sliding_window_overlay({WINDOW})` (kv_idx > q_idx − W) on a 9 × 9 "
                                f"causal grid is {'exactly' if found['transformers is the spec'] else 'NOT'} the "
                                f"spec's window of {WINDOW}: `sliding_window` in Mistral's and Phi-3's config.json "
                                "is the spec's W."))
    if rope:
        items.append((MEASURED, f"transformers' longrope (`_compute_longrope_parameters(seq_len=…)`, phi3-tiny's "
                                f"factors, L = {rope['L']}): a call of length L takes the {rope['at L']} factors, "
                                f"L + 1 the {rope['at L + 1']} ones, as SPEC.md §5.12's ℓ > L."))
    return items + [
        (EXPLAINED, "impl_torch and impl_jax build the window into the causal keep-mask (`_causal_mask`), so one "
                    "mask serves the native and the math attention paths; their decode steps keep a cache slot "
                    "where slot > position − W; the ONNX in-place step writes the window into GroupQueryAttention's "
                    "`attention_bias` (export/in_place_step.py), not into `local_window_size`, whose count the "
                    "measurement above settles. onnxruntime-genai's builder drops Mistral's and Phi-3's windows and "
                    "derives longrope's attention factor from the two lengths, ignoring `factor` "
                    "(docs/huggingface.md, measured by tests/test_genai.py)."),
    ]


def _softcaps(measurements: Measurements) -> list[tuple[str, str]]:
    """Which frameworks take an attention softcap themselves, and where onnxruntime's applies it."""
    found, sdpa = measurements.modern["softcap"], measurements.modern["windows"]["sdpa arguments"]
    before, after = found["onnxruntime"]
    where = "before" if before < after else "after"
    return [
        (MEASURED, f"onnxruntime's `GroupQueryAttention` (com.microsoft, CPU) with `softcap={CAP}` and the causal mask "
                   f"as its `attention_bias`, on scores up to {found['largest score']:.1f} (the cap moves the output "
                   f"by {found['cap moves']:.2f}): {before:.1e} from the golden's cap before the mask, {after:.1e} from a "
                   f"cap after the mask fill. It caps {where} its bias, as SPEC.md §5.13 says."),
        (MEASURED, f"`F.scaled_dot_product_attention` takes {', '.join(f'`{name}`' for name in sdpa)}; "
                   f"`jax.nn.dot_product_attention` takes {', '.join(f'`{name}`' for name in found['jax arguments'])}: "
                   "neither has a softcap (its tanh sits between the product and the softmax, inside the kernel)."),
        (EXPLAINED, "So impl_torch and impl_jax take their math path for a capped attention (`softcap` in "
                    "`scaled_dot_product_attention`, their own matmul, tanh and softmax), and say so: the JAX "
                    "column's attention row reads \"explicit (jax.nn.dot_product_attention has no softcap)\". The "
                    "ONNX in-place step passes the cap to GroupQueryAttention's own `softcap`; the torch export writes "
                    "the math path's Tanh between its MatMul and Softmax. transformers' Gemma 2 has no SDPA path at "
                    "all (`_supports_sdpa = False`); its column runs eager attention."),
    ]


def _top_k_routing(measurements: Measurements) -> list[tuple[str, str]]:
    """What each framework's top-k returns on ties, measured."""
    rows = "; ".join(f"`{name}` {ordered:.1%} in order, {as_set:.1%} as sets"
                     for name, (ordered, as_set) in measurements.modern["top_k"].items())
    return [
        (MEASURED, f"2000 rows of 8 router probabilities drawn from {{0.1, 0.2, 0.3}} (most rows tie), k = 2, "
                   f"against the golden's choice (a stable sort of −p: ties to the lower index): {rows}."),
        (EXPLAINED, "`torch.topk` and `jax.lax.top_k` document no order for ties; ONNX's TopK does (the lower index "
                    "first, operator spec). So impl_torch and impl_jax take a stable descending sort, and impl_torch's "
                    "export writes TopK, whose ties the spec's rule already is (the exporter has no stable sort). With "
                    "the experts' outputs summed in slot order, `topk(sorted=False)` also changes the order of that "
                    "sum, which rounding can see in bfloat16."),
    ]


def _quantized_kernels_rows(measurements: Measurements) -> list[tuple[str, str]]:
    """What onnxruntime's quantized MatMuls compute, against the weight they store and the float one."""
    rows = "; ".join(f"{name}: " + ("" if errors["against stored"] is None else
                                    f"{errors['against stored']:.2g} against A·dequantize(B), ")
                     + f"{errors['against float']:.2g} against A·W"
                     for name, errors in measurements.modern["quantized"].items())
    runtimes = "; ".join(f"{name}: {figures['error']:.2g}, top-1 {figures['top1']:.0%}"
                         for name, figures in measurements.modern["int8 runtimes"].items())
    return [
        (MEASURED, "One MatMul, A [16, 256] with an outlier column 30 times the others, W [256, 64], quantized by "
                   "onnxruntime (blocks of 32, symmetric) and run on its CPU provider; the largest error over "
                   f"max|A·W|: {rows}."),
        *([(MEASURED, "onnxruntime's int8 and CTranslate2's on the same weights (llama-tiny's conformance weights, "
                      "forward-none; CTranslate2 through its own converter): the largest logit error over max|logit| "
                      f"against the float golden, and the tokens whose top-1 agrees: {runtimes}.")]
          if runtimes else []),
        (EXPLAINED, "At accuracy_level 0 MatMulNBits computes A times the weight it stores, to float32's rounding: "
                    "the golden on that weight is its reference (SPEC §15.1). Level 4 first rounds A to int8 per "
                    "block of K (scale max|a|/127), an error of up to max|a_block|/254 per element, which an "
                    "outlier spreads over its whole block: the policy judges it in its int8-activations mode. "
                    "quantize_dynamic rounds all of A with one scale per tensor, so the outlier costs every "
                    "element; no golden computes that product, and only its cost against A·W is measured."),
        (EXPLAINED, "CTranslate2's int8 quantizes each weight row to int8 with one scale per output row (not per "
                    "block) and, at compute types int8 and int8_float32 alike (the same numbers on the CPU, where "
                    "both keep every other layer in float32), each input row to int8 at run time with its own "
                    "absmax scale before an integer product: a quantization of the activations, as quantize_dynamic's "
                    "but per row, where onnxruntime's weight-only level 0 keeps them float and level 4 rounds them "
                    "per block of K. Its stored weights are in its own model file, which the spec does not read: "
                    "only its cost is measured (`rosetta bench --quantized` runs it as ctranslate2-int8)."),
    ]


def _int8_paths_rows(measurements: Measurements) -> list[tuple[str, str]]:
    """What a dynamic int8 deployment costs on each class of CPU, measured here for both."""
    paths = measurements.modern["int8 paths"]

    def figures(found: dict[str, float]) -> str:
        return f"mean KL {found['kl']:.2g}, top-1 {found['top1']:.0%}"

    rows = [(MEASURED, f"This CPU's int8 path: {paths['path']}. llama-tiny's forward-none through onnxruntime's "
                       "quantize_dynamic, against the float golden: " + "; ".join(
                           f"{weights} weights{' (reduce_range)' if weights == '7-bit' else ''}: onnxruntime here "
                           f"{figures(found['onnxruntime'])}, the exact arithmetic {figures(found['exact'])}, the "
                           f"saturating one {figures(found['saturating'])}" for weights, found in paths.items()
                           if weights in ("8-bit", "7-bit")) + ".")]
    if "ctranslate2" in paths:
        rows.append((MEASURED, "CTranslate2's int8 on the same weights: here " + figures(paths["ctranslate2"]["here"])
                     + "; in a process whose oneDNN is capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`), "
                     + figures(paths["ctranslate2"]["oneDNN capped at AVX2"]) + "."))
    return rows + [
        (EXPLAINED, "An int8 product multiplies u8 activations by s8 weights. With VNNI (VPDPBUSD) or AMX every "
                    "product is summed in int32, exactly. With AVX2 or AVX-512 alone, VPMADDUBSW first adds each "
                    "pair of neighbouring products into an int16, clamped to [−32768, 32767], and two large "
                    "activations against two large weights of one sign (255 · 127 · 2 = 64,770) are cut to 32,767. "
                    "So the same deployment on the same weights costs more on a CPU without VNNI. onnxruntime "
                    "(MLAS) and CTranslate2 (oneDNN) pick the kernel from the CPU at run time; the rewrite above "
                    "computes either arithmetic on any CPU (SPEC.md §15.2)."),
        (EXPLAINED, "onnxruntime's `reduce_range` quantizes the weights to 7 bits (±64): a pair is then at most "
                    "255 · 64 · 2 = 32,640 and never saturates, so the cost is the same on every CPU, at the price "
                    "of one bit of the weights."),
    ]


def _linear_layers(measurements: Measurements) -> list[tuple[str, str]]:
    """How often and how far nnx.Linear's second rounding and impl_jax's Linear differ from torch's
    nn.Linear at float16."""
    linear = measurements.modern["linear"]
    return [
        (MEASURED, f"At float16 (x [256, 64], W [64, 64], b ~ N(0, 1), CPU): `nnx.Linear` alone differs from "
                   f"torch's `nn.Linear` in {linear['nnx differs']:.1%} of the outputs, impl_jax's `Linear` in "
                   f"{linear['ours differs']:.1%}. Largest error against the float64 x W + b: torch "
                   f"{linear['torch error']:.3g}, impl_jax {linear['ours error']:.3g}, `nnx.Linear` "
                   f"{linear['nnx error']:.3g}."),
        (EXPLAINED, "`nnx.Linear` rounds x W to its dtype and then adds b, a second rounding; impl_jax's "
                    "`Linear` asks the dot for a float32 result (`preferred_element_type`), adds b there and "
                    "rounds once. With the second rounding, a random Qwen2 (biases on q, k and v) failed "
                    "forward-long at float16 in the jax columns at 1.11× its tolerance; rounded once, 0.49× "
                    "(tests/test_huggingface_modern.py plants the double rounding and sees it fail)."),
    ]


def _training_step(measurements: Measurements) -> list[tuple[str, str]]:
    """The optimizers' defaults, ε's placement, clipping, label smoothing and the schedule's first
    count in torch, optax and the spec, and how the implementations match the spec."""
    training = measurements.training
    defaults, update, clip, smoothing = (training[k] for k in ("defaults", "update", "clip", "smoothing"))
    decayed, tensors, decayed_numbers, numbers = defaults["decayed"]

    def q(name: str) -> str:
        return "{:.4f} on the target, {:.4f} on pad, {:.4f} elsewhere".format(*smoothing[name][:3])

    return [
        (MEASURED, f"AdamW's weight decay by default: {defaults['torch']['weight_decay']:g} in torch "
                   f"(`torch.optim.AdamW([p]).defaults`), {defaults['optax']['weight_decay']:g} in optax "
                   f"(`inspect.signature(optax.adamw)`), {defaults['spec']['weight_decay']:g} in the spec "
                   f"(`TrainingConfig().weight_decay`). "
                   f"β2 and ε default to {defaults['torch']['beta2']:g} and {defaults['torch']['eps']:g} in torch, "
                   f"{defaults['optax']['beta2']:g} and {defaults['optax']['eps']:g} in optax, "
                   f"{defaults['spec']['beta2']:g} and {defaults['spec']['eps']:g} in the spec. "
                   f"`decays` picks {decayed} of the tiny preset's {tensors} tensors (`param_shapes`; the matrices "
                   f"and tables: {decayed_numbers:,} of {numbers:,} numbers), never a bias or a norm."),
        (MEASURED, f"ε outside the root: one update at step 1, lr 1, of a gradient element 1e-5 (m̂ = g, v̂ = g², "
                   f"ε {defaults['spec']['eps']:g}) moves it by {update['golden']:.4f} in the golden "
                   f"(`adam_update`), {update['torch']:.4f} in `torch.optim.Adam(eps=ε)`, {update['optax']:.4f} in "
                   f"`optax.adam(eps=ε)`. With ε inside, m̂ / √(v̂ + ε), the move is {update['inside']:.4f} "
                   f"(the formula at float64), {update['optax inside']:.4f} in `optax.adam(eps=0, eps_root=ε)`: "
                   f"optax's `eps_root` "
                   f"(default {defaults['optax']['eps_root']:g}) is the term under the root."),
        (MEASURED, f"Clipping a gradient of norm {clip['norm']:g} to {clip['to']:g}: "
                   f"`torch.nn.utils.clip_grad_norm_([p], {clip['to']:g})` scales it by {clip['torch']:.8g}, a "
                   f"divisor of ‖g‖ + {clip['to'] / clip['torch'] - clip['norm']:.1e}; "
                   f"`optax.clip_by_global_norm({clip['to']:g})` by {clip['optax']:g} and the golden's "
                   f"`clip_by_global_norm` by {clip['golden']:g}, a divisor of ‖g‖."),
        (MEASURED, f"Label smoothing at V = {smoothing['V']}, ε = {smoothing['eps']:g} (pad {smoothing['pad']}, "
                   f"target {smoothing['target']}): the spec's q is {q('spec')} (`smoothed_targets`); "
                   f"`F.cross_entropy(logits, target, label_smoothing=ε)` uses {q('torch')} (read back as "
                   f"softmax − ∂L/∂logits) and `optax.smooth_labels(one_hot, ε)` gives {q('optax')}. On one "
                   f"N(0, 1) logits row the loss is {smoothing['spec'][3]:.4f} by the spec, "
                   f"{smoothing['torch'][3]:.4f} by torch and {smoothing['optax'][3]:.4f} by optax: "
                   f"{smoothing['spec'][3] - smoothing['torch'][3]:.1e} apart."),
        (MEASURED, f"The first update's rate is taken at count {training['first count']['torch']} by "
                   f"`LambdaLR(optimizer, f)` and at count {training['first count']['optax']} by an optax schedule "
                   f"(`optax.sgd(f)`, one update; f records its argument); the spec's first step is 1."),
        (EXPLAINED, "torch takes a per-parameter weight decay as parameter groups, so impl_torch builds two "
                    "(decayed and not); optax takes a `mask`, a tree of booleans like the parameters. Both come "
                    "from `decays`, and both state the spec's λ, β2 and ε rather than take a default."),
        (EXPLAINED, "`torch.optim.Adam(weight_decay=λ)` adds λθ to the gradient before Adam scales it (an L2 "
                    "penalty), not AdamW's decoupled decay; `TrainingConfig` refuses weight decay with `adam`."),
        (EXPLAINED, "impl_torch clips by the spec's rule itself (`torch._foreach_mul_` by c/‖g‖) instead of "
                    "`clip_grad_norm_`, whose 1e-6 is a relative error of 1e-6/‖g‖ in every clipped gradient; "
                    "impl_jax uses `optax.clip_by_global_norm`, which is the spec's rule."),
        (EXPLAINED, "Neither framework's built-in smoothing can leave pad at 0, so impl_torch and impl_jax build "
                    "the spec's q (`smoothed_targets`) and hand it to the cross-entropy of class probabilities "
                    "(`F.cross_entropy` with probabilities, `optax.softmax_cross_entropy`)."),
        (EXPLAINED, "Both implementations call the schedule at count + 1. At the count itself the paper's formula "
                    "gives min(0^-0.5, 0 · warmup^-1.5) = 0 to the first update, and every later rate would be one "
                    "step behind the golden's."),
    ]


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    names: dict[str, str | tuple[str, ...]]  # implementation label -> function/class name(s) in its file
    items: Callable[[Measurements], list[tuple[str, str]]]  # what differs, measured and explained


SECTIONS = [
    Section("Weight layouts and transposes",
            "The spec stores a linear map as `[in, out]` and computes `x @ W + b`, as the paper writes it.",
            {"NumPy (golden)": "linear", "PyTorch": "Transformer.from_params", "JAX / Flax": "_variable"},
            _weight_layouts),
    Section("Positional encoding layouts",
            "PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...): interleaved in the paper, "
            "`sinusoidal-concat` puts all sines first (tensor2tensor's layout).",
            {name: "sinusoidal_table" for name in IMPLEMENTATIONS},
            _positional_layouts),
    Section("Where 1/√d_k is applied, mask polarity and rows with no key",
            "softmax(QKᵀ/√d_k)V with a boolean keep-mask (True = may attend); a query row with no key "
            "outputs zeros (SPEC.md §6).",
            {"NumPy (golden)": "scaled_dot_product_attention", "PyTorch": "scaled_dot_product_attention",
             "JAX / Flax": ("scaled_dot_product_attention", "_attention")},
            _attention_scale_and_masks),
    Section("Splitting heads",
            "Heads are contiguous blocks of d_k columns: [B, T, d] → [B, H, T, d_k].",
            {name: "split_heads" for name in IMPLEMENTATIONS},
            _head_splitting),
    Section("LayerNorm: variance and eps",
            "γ (x − μ) / √(σ² + ε) + β with the biased variance and the config's ε.",
            {"NumPy (golden)": "layer_norm", "PyTorch": "Norm", "JAX / Flax": "Norm"},
            _layer_norm),
    Section("GELU",
            "`gelu` is the exact erf form; `gelu-tanh` the tanh approximation. The config chooses.",
            {"NumPy (golden)": "gelu", "PyTorch": "ACTIVATIONS", "JAX / Flax": "gelu"},
            _gelu),
    Section("Matmul precision (TF32)",
            "Conformance states the float32 matmul precision on every run ('highest'); the `tf32` column "
            "of the matrix is the same float32 model with TF32 matmuls, on CUDA only.",
            {"PyTorch": "conformance/backends/torch_backend.py::matmul_precision",
             "JAX / Flax": "conformance/backends/jax_backend.py::JaxRunner._scope"},
            _matmul_precision),
    Section("KV-cache shapes",
            "The golden: L decoder layers × (keys, values) of [B, H, P, d_k] for the P positions decoded, "
            "plus their keep-vector. The frameworks: keys and values of [L, B, H, C, d_k] for a capacity C, "
            "the keep-vector [B, C] and the length P.",
            {name: "KVCache" for name in IMPLEMENTATIONS},
            _kv_cache_shapes),
    Section("RMSNorm: eps inside the root, and the float32 upcast",
            "γ x / √(mean(x²) + ε) with no bias (SPEC.md §5.6). A half-precision x is normalised in float32, "
            "cast back to its dtype, and only then scaled by γ, as Hugging Face's Llama does.",
            {name: "rms_norm" for name in IMPLEMENTATIONS},
            _rms_norm),
    Section("Rotary positions (RoPE): layout and the tables' precision",
            "The rotate_half layout: dimension i pairs with i + r/2, not with its neighbour (SPEC.md §5.11). "
            "The angles pos · θ^(−2i/r) are taken in float32 or wider whatever the model's dtype, and the "
            "keys are rotated before they enter the KV cache.",
            {"NumPy (golden)": ("rope_tables", "rotary"), "PyTorch": ("rope_tables", "rotary"),
             "JAX / Flax": ("rope_tables", "rotary")},
            _rotary_positions),
    Section("Grouped-query attention: native entry points and the explicit repeat",
            "H query heads share H_kv key/value heads: key/value head j serves query heads j·g .. (j+1)·g − 1, "
            "g = H / H_kv (`repeat_interleave`'s order, SPEC.md §5.11). The KV cache holds the H_kv heads.",
            {"NumPy (golden)": "group_heads", "PyTorch": ("group_heads", "scaled_dot_product_attention"),
             "JAX / Flax": ("group_heads", "_attention")},
            _grouped_query_attention),
    Section("Sliding windows and LongRoPE's switch: how each framework counts",
            "A window of W keys: query i sees key j iff i − W < j ≤ i, the query among the W (SPEC.md §6). "
            "LongRoPE takes its long factors for a call of length ℓ > L, ℓ = 1 + the call's largest position "
            "(SPEC.md §5.12).",
            {"NumPy (golden)": ("spec/masks.py::causal_mask", "longrope_frequencies"),
             "PyTorch": ("_causal_mask", "longrope_frequencies"), "JAX / Flax": ("_causal_mask", "longrope_frequencies")},
            _sliding_windows),
    Section("Softcapping: which kernels take it, and where",
            "Gemma 2's c·tanh(s/c) on the attention scores comes after the scale and before the mask, and the "
            "final one on the logits after the head (SPEC.md §5.13).",
            {"NumPy (golden)": ("softcap", "scaled_dot_product_attention"),
             "PyTorch": ("softcap", "scaled_dot_product_attention"), "JAX / Flax": ("softcap", "attention_path")},
            _softcaps),
    Section("Top-k routing: ties",
            "A mixture of experts chooses the k largest router probabilities per token, a tie going to the lower "
            "expert index (SPEC.md §5.14).",
            {"NumPy (golden)": "top_experts", "PyTorch": "MixtureOfExperts.route",
             "JAX / Flax": "MixtureOfExperts.route"},
            _top_k_routing),
    Section("Quantized matrix products: what onnxruntime's kernels compute",
            "A weight-only deployment stores each linear layer's weight in 4 or 8-bit blocks; the golden reads the "
            "stored weight exactly (SPEC.md §15) and runs on it.",
            {"NumPy (golden)": ("spec/quantization.py::unpack", "spec/quantization.py::block_elements",
                                "spec/quantization.py::dequantize")},
            _quantized_kernels_rows),
    Section("Int8 products: what the CPU's instruction set computes",
            "A quantize_dynamic deployment quantizes the activations to u8 at run time and multiplies them by s8 "
            "weights in int32 (MatMulInteger). The spec computes no golden for it; its cost is measured (SPEC.md "
            "§15.2), and the CPU decides part of it.",
            {"The CPU's path": "conformance/machine.py::int8_path",
             "The saturating arithmetic": "export/integer_products.py::_saturating"},
            _int8_paths_rows),
    Section("Linear layers: where x W + b is rounded",
            "y = x W + b. At a half-precision dtype the product is accumulated in float32 (SPEC.md §8's "
            "u_accumulate) and the bias is added there too, before the one rounding to the model's dtype, as "
            "torch's `nn.Linear` (addmm) does.",
            {"NumPy (golden)": "linear", "PyTorch": "MultiHeadAttention.__init__", "JAX / Flax": "Linear"},
            _linear_layers),
    Section("The training step: loss, clipping, optimizer, schedule",
            "SPEC.md §5.9 and §14: the loss against q = 1 − ε on the target, 0 on pad and ε/(V − 2) elsewhere; "
            "the gradients scaled by min(1, c/‖g‖); then θ ← θ − lr(t) (m̂/(√v̂ + ε) + λθ) at step t counted "
            "from 1, with AdamW's λ on matrices and tables only. Each framework runs its own optimizer, "
            "configured from `TrainingConfig`. The numbers below are `_training_numbers()` in "
            "pages/differences.py, computed by every `rosetta differences` from the calls each item names.",
            {"NumPy (golden)": ("smoothed_targets", "token_cross_entropy",
                                "impl_numpy/training.py::clip_by_global_norm", "impl_numpy/training.py::adam_update",
                                "spec/training.py::learning_rate", "spec/training.py::decays"),
             "PyTorch": ("smoothed_targets", "token_cross_entropy", "impl_torch/training.py::make_optimizer",
                         "impl_torch/training.py::clip_by_global_norm"),
             "JAX / Flax": ("smoothed_targets", "token_cross_entropy", "impl_jax/training.py::make_optimizer")},
            _training_step),
]


def differences_page() -> str:
    from pages.probe import framework_versions, run_probes

    measurements = Measurements(run_probes(["cpu"]),  # the page quotes the CPU's behaviour
                                _positional_errors(), _onnx_ops(), _training_numbers(), _modern_numbers())
    versions = framework_versions()
    lines = ["# Where the frameworks differ, side by side", "",
             "Generated by `rosetta differences --markdown docs/framework-differences.md` from the source files "
             "and from measurements made by the same run (`rosetta probe` for the frameworks' own primitives); "
             "a test regenerates it. The three implementations are parallel texts: same names, same order.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), "",
             f"CPU int8 path: {measurements.modern['int8 paths']['path']}", ""]
    for section in SECTIONS:
        lines += [f"## {section.title}", "", section.intro, ""]
        for label, names in section.names.items():
            for name in (names,) if isinstance(names, str) else names:
                path, name = name.split("::") if "::" in name else (IMPLEMENTATIONS[label], name)
                lines += [f"**{label}** — `{path}` · `{name}`", "", "```python", source_of(path, name), "```", ""]
        found = section.items(measurements)
        for kind, heading in ((MEASURED, "What differs, measured by this run (`rosetta probe`, the exported graphs):"),
                              (EXPLAINED, "Why, from the code above and the frameworks' documentation (not measured):")):
            items = [text for item_kind, text in found if item_kind == kind]
            if items:
                lines += [heading, ""] + [f"- {text}" for text in items] + [""]
    return "\n".join(lines)
