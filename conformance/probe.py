"""`rosetta probe`: what each installed framework's *own* primitives do on the spec's edge
cases — measured on this machine with these versions, the living evidence behind
docs/framework-notes.md. Each probe returns what it observed as short text; a framework that
is not installed gives "not installed", a probe that raises gives "error: ...".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conformance.report import framework_versions


@dataclass(frozen=True)
class Probe:
    topic: str
    primitive: str
    spec: str  # what the spec says
    measure: Callable[[], str]


def _masked_row_verdict(out: np.ndarray, values: np.ndarray) -> str:
    """Describe a fully masked row's output: NaN, zeros, the mean of V, or something else."""
    out = np.asarray(out, dtype=np.float64)
    if np.isnan(out).any():
        return "NaN"
    if np.allclose(out, 0.0):
        return "zeros"
    if np.allclose(out, np.asarray(values, np.float64).mean(axis=0), atol=1e-2):
        return "the mean of V"
    return f"other ({out.ravel()[:3]})"


# ---- fully masked rows ----------------------------------------------------------------------

def _torch_sdpa_masked_row() -> str:
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=generator) for _ in range(3))
    mask = torch.tensor([[True, True], [False, False]])
    return _masked_row_verdict(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0, 0, 1].numpy(), v[0, 0].numpy())


def _torch_mha_masked_row() -> str:
    import torch

    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    x = torch.randn(1, 3, 4)
    with torch.inference_mode():
        out, _ = attention(x, x, x, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    return "NaN" if torch.isnan(out).any() else _masked_row_verdict(out[0, 0].numpy(), np.zeros((1, 4)))


def _jax_dot_product_attention_masked_row() -> str:
    import jax
    import jax.numpy as jnp

    q, k, v = (jax.random.normal(jax.random.key(i), (1, 3, 1, 4)) for i in range(3))
    out = jax.nn.dot_product_attention(q, k, v, mask=jnp.zeros((1, 1, 3, 3), bool))
    return _masked_row_verdict(np.asarray(out[0, 0, 0]), np.asarray(v[0, :, 0]))


def _onnxruntime_attention(mask: np.ndarray) -> tuple[np.ndarray, dict]:
    """Run ONNX's opset-23 Attention on the CPU provider: Q [1,1,2,4], K and V [1,1,3,4]."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    shapes = {"Q": [1, 1, 2, 4], "K": [1, 1, 3, 4], "V": [1, 1, 3, 4]}
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, list(mask.shape)))
    graph = helper.make_graph([helper.make_node("Attention", ["Q", "K", "V", "mask"], ["Y"])], "probe", inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, shapes["Q"])])
    # onnx's newest IR version may be newer than onnxruntime reads; 10 is what opset 23 needs
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    options, quiet = onnxruntime.SessionOptions(), onnxruntime.RunOptions()
    options.log_severity_level = quiet.log_severity_level = 4  # a refusal is reported here, not logged
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    generator = np.random.default_rng(0)
    feeds = {name: generator.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    feeds["mask"] = mask
    return session.run(None, feeds, quiet)[0], feeds


def _onnxruntime_attention_masked_row() -> str:
    out, feeds = _onnxruntime_attention(np.array([[True, True, False], [False, False, False]]))
    return _masked_row_verdict(out[0, 0, 1], feeds["V"][0, 0]) + " (opset 23 Attention, CPU provider)"


def _onnxruntime_attention_mask_broadcast() -> str:
    """A key-padding mask [B, 1, 1, K] broadcast over the queries, as ONNX's broadcasting allows."""
    try:
        _onnxruntime_attention(np.array([True, True, False]).reshape(1, 1, 1, 3))
    except Exception as error:  # noqa: BLE001 - the refusal is the observation
        reason = "inconsistent q_sequence_length" if "q_sequence_length" in str(error) else type(error).__name__
        return f"refused ({reason}): the mask needs its query axis spelled out, so impl_torch expands it"
    return "broadcast over the queries"


def _onnx_ir_versions() -> str:
    import onnx
    import onnxruntime
    from onnx import helper

    model = helper.make_model(helper.make_graph([], "empty", [], []), opset_imports=[helper.make_opsetid("", 23)])
    try:
        onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        verdict = "onnxruntime loads it"
    except Exception as error:  # noqa: BLE001 - the refusal is the observation
        detail = " ".join(str(error).split("Unsupported model IR version: ")[-1].split())
        verdict = f"onnxruntime refuses it (IR version {detail[:40]})"
    return f"onnx {onnx.__version__} writes IR version {model.ir_version} by default; {verdict}"


# ---- precision and defaults -----------------------------------------------------------------

def _jax_dot_product_attention_float64() -> str:
    import jax

    with jax.enable_x64(True):
        q, k, v = (jax.random.normal(jax.random.key(i), (1, 5, 1, 8), dtype="float64") for i in range(3))
        native = np.asarray(jax.nn.dot_product_attention(q, k, v), dtype=np.float64)
        q, k, v = (np.asarray(a, np.float64)[0, :, 0] for a in (q, k, v))
    scores = q @ k.T / math.sqrt(8)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    exact = (weights / weights.sum(-1, keepdims=True)) @ v
    return f"max error vs float64 math {np.abs(native[0, :, 0] - exact).max():.1e}"


def _torch_layer_norm_eps() -> str:
    import torch

    return f"eps {torch.nn.LayerNorm(4).eps:g}"


def _flax_layer_norm() -> str:
    from flax import nnx

    norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
    return f"epsilon {norm.epsilon:g}, use_fast_variance={norm.use_fast_variance}"


def _gelu_form(value: float) -> str:
    exact = 0.5 * (1 + math.erf(1 / math.sqrt(2)))
    tanh = 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * (1 + 0.044715)))
    return "exact (erf)" if abs(value - exact) < 1e-6 else ("tanh approximation" if abs(value - tanh) < 1e-6 else f"{value}")


def _torch_gelu_default() -> str:
    import torch

    return _gelu_form(float(torch.nn.functional.gelu(torch.tensor(1.0, dtype=torch.float64))))


def _jax_gelu_default() -> str:
    import jax

    with jax.enable_x64(True):
        return _gelu_form(float(jax.nn.gelu(jax.numpy.float64(1.0))))


def _torch_matmul_precision() -> str:
    import torch

    return f"float32 matmul precision '{torch.get_float32_matmul_precision()}' (TF32 off unless 'high'/'medium')"


def _jax_matmul_precision() -> str:
    import jax

    return f"default_matmul_precision={jax.config.jax_default_matmul_precision!r} (None: the backend's own default)"


# ---- mask forms and fills -------------------------------------------------------------------

def _torch_bool_vs_additive() -> str:
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=generator) for _ in range(3))
    keep = torch.tensor([[True, False, True]] * 3)
    additive = torch.zeros(3, 3).masked_fill(~keep, float("-inf"))
    same = torch.allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=additive), atol=1e-6)
    return "bool True = attend; equals the additive 0/-inf mask" if same else "bool and additive masks differ"


def _fill_outcomes() -> str:
    """A fully masked row under each fill value and dtype, with a plain softmax (torch)."""
    import torch

    outcomes = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        row = []
        for label, fill in (("-inf", float("-inf")), ("-1e9", -1e9), ("finfo.min", torch.finfo(dtype).min)):
            scores = torch.full((1, 3), fill).to(dtype)
            weights = torch.softmax(scores.float(), dim=-1) if dtype != torch.float32 else torch.softmax(scores, -1)
            verdict = "NaN" if torch.isnan(weights).any() else ("uniform" if torch.allclose(weights, torch.full_like(weights, 1 / 3)) else "other")
            row.append(f"{label}:{verdict}")
        outcomes.append(f"{str(dtype).split('.')[-1]} {' '.join(row)}")
    return "; ".join(outcomes)


PROBES = [
    Probe("fully masked row", "torch F.scaled_dot_product_attention (CPU)", "zeros", _torch_sdpa_masked_row),
    Probe("fully masked row", "torch nn.MultiheadAttention", "zeros", _torch_mha_masked_row),
    Probe("fully masked row", "jax.nn.dot_product_attention", "zeros", _jax_dot_product_attention_masked_row),
    Probe("fully masked row", "onnxruntime Attention", "zeros", _onnxruntime_attention_masked_row),
    Probe("mask broadcasting", "onnxruntime Attention", "a [B,1,1,K] mask broadcasts over queries",
          _onnxruntime_attention_mask_broadcast),
    Probe("model IR version", "onnx.helper.make_model", "exported graphs load in onnxruntime", _onnx_ir_versions),
    Probe("float64 attention", "jax.nn.dot_product_attention", "float64-accurate (< 1e-14)",
          _jax_dot_product_attention_float64),
    Probe("LayerNorm defaults", "torch.nn.LayerNorm", "eps from the config; two-pass variance", _torch_layer_norm_eps),
    Probe("LayerNorm defaults", "flax.nnx.LayerNorm", "eps from the config; two-pass variance", _flax_layer_norm),
    Probe("GELU default", "torch.nn.functional.gelu", "config chooses: gelu = exact, gelu-tanh", _torch_gelu_default),
    Probe("GELU default", "jax.nn.gelu", "config chooses: gelu = exact, gelu-tanh", _jax_gelu_default),
    Probe("matmul precision", "torch", "stated per run: 'highest' for conformance", _torch_matmul_precision),
    Probe("matmul precision", "jax", "stated per run: 'highest' for conformance", _jax_matmul_precision),
    Probe("mask forms", "torch F.scaled_dot_product_attention", "boolean keep-masks only", _torch_bool_vs_additive),
    Probe("fill values, all-masked row", "torch.softmax after a fill", "zeros (no fill value gives that)",
          _fill_outcomes),
]


def run_probes() -> list[tuple[Probe, str]]:
    observed = []
    for probe in PROBES:
        try:
            result = probe.measure()
        except ImportError as error:
            result = f"not installed ({error.name})"
        except Exception as error:  # noqa: BLE001 - a probe that breaks is itself an observation
            result = f"error: {type(error).__name__}: {error}"
        observed.append((probe, result))
    return observed


def probe_table(observed: list[tuple[Probe, str]]) -> str:
    versions = framework_versions()
    lines = [f"Versions: {', '.join(f'{k} {v}' for k, v in versions.items() if v)}", "",
             "| topic | primitive | observed here | the spec |", "|---|---|---|---|"]
    lines += [f"| {p.topic} | {p.primitive} | {result} | {p.spec} |" for p, result in observed]
    return "\n".join(lines)
