"""`rosetta probe`: what each installed framework's *own* primitives do on the spec's edge
cases — measured on this machine with these versions, on every device present (a GPU computes
with other kernels than the CPU), the living evidence behind docs/framework-notes.md. Each probe
returns what it observed as short text; a framework that is not installed gives "not installed",
one that does not see the device "no <device> device for <framework>", a probe that raises
gives "error: ...". Probes of a default or a setting run once (device "-").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conformance.machine import framework_versions


@dataclass(frozen=True)
class Probe:
    topic: str
    primitive: str
    spec: str  # what the spec says
    measure: Callable[..., str]  # measure(device) where per_device, else measure()
    per_device: bool = True


class DeviceMissing(Exception):
    """The framework a probe needs does not see the device here."""


def probe_devices() -> list[str]:
    """'cpu', and 'cuda' where an NVIDIA driver is present (each probe then finds out whether its
    own framework sees the GPU)."""
    return ["cpu"] + (["cuda"] if Path("/proc/driver/nvidia/version").exists() else [])


def _torch_device(device: str):
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceMissing(f"no cuda device for torch {torch.__version__}")
    return torch.device(device)


def _jax_device(device: str):
    import jax

    try:
        return jax.devices("gpu" if device == "cuda" else "cpu")[0]
    except RuntimeError:
        raise DeviceMissing(f"no cuda device for jax {jax.__version__}") from None


def _onnxruntime_providers(device: str) -> list[str]:
    if device == "cuda":
        from export.runner import CUDA, cuda_available

        if not cuda_available():
            raise DeviceMissing("no cuda device for onnxruntime")
        return [CUDA]
    return ["CPUExecutionProvider"]


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

def _torch_sdpa_masked_row(device: str) -> str:
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    on = _torch_device(device)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=generator).to(on) for _ in range(3))
    mask = torch.tensor([[True, True], [False, False]], device=on)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _masked_row_verdict(out[0, 0, 1].cpu().numpy(), v[0, 0].cpu().numpy())


def _torch_mha_masked_row(device: str) -> str:
    import torch

    torch.manual_seed(0)
    on = _torch_device(device)
    attention = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval().to(on)
    x = torch.randn(1, 3, 4).to(on)
    with torch.inference_mode():
        out, _ = attention(x, x, x, key_padding_mask=torch.ones(1, 3, dtype=torch.bool, device=on))
    return "NaN" if torch.isnan(out).any() else _masked_row_verdict(out[0, 0].cpu().numpy(), np.zeros((1, 4)))


def _jax_dot_product_attention_masked_row(device: str) -> str:
    import jax
    import jax.numpy as jnp

    with jax.default_device(_jax_device(device)):
        q, k, v = (jax.random.normal(jax.random.key(i), (1, 3, 1, 4)) for i in range(3))
        out = jax.nn.dot_product_attention(q, k, v, mask=jnp.zeros((1, 1, 3, 3), bool))
    return _masked_row_verdict(np.asarray(out[0, 0, 0]), np.asarray(v[0, :, 0]))


def _jax_float16_single_query(device: str) -> str:
    """Jitted float16 attention with one query, as a decode step asks for (issue 13: XLA:GPU
    refused it on an H100 with jax 0.11.2; XLA:CPU refuses every float16 case)."""
    import jax
    import jax.numpy as jnp

    with jax.default_device(_jax_device(device)):
        q = jax.random.normal(jax.random.key(0), (2, 1, 4, 16), jnp.float16)
        k, v = (jax.random.normal(jax.random.key(i), (2, 5, 4, 16), jnp.float16) for i in (1, 2))
        try:
            out = np.asarray(jax.jit(jax.nn.dot_product_attention)(q, k, v), np.float64)
        except Exception as error:  # noqa: BLE001 - the refusal is the observation
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return f"fails to compile ({first_line[:90]}): impl_jax takes its explicit path"
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    exact = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)
    return f"runs; max error vs float64 math {np.abs(out - exact).max():.1e}"


def _onnxruntime_attention(mask: np.ndarray, device: str) -> tuple[np.ndarray, dict]:
    """Run ONNX's opset-23 Attention on the device's provider: Q [1,1,2,4], K and V [1,1,3,4]."""
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
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=_onnxruntime_providers(device))
    generator = np.random.default_rng(0)
    feeds = {name: generator.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    feeds["mask"] = mask
    return session.run(None, feeds, quiet)[0], feeds


def _onnxruntime_attention_masked_row(device: str) -> str:
    out, feeds = _onnxruntime_attention(np.array([[True, True, False], [False, False, False]]), device)
    return _masked_row_verdict(out[0, 0, 1], feeds["V"][0, 0]) + f" (opset 23 Attention, {device.upper()} provider)"


def _onnxruntime_attention_mask_broadcast(device: str) -> str:
    """A key-padding mask [B, 1, 1, K] broadcast over the queries, as ONNX's broadcasting allows."""
    try:
        _onnxruntime_attention(np.array([True, True, False]).reshape(1, 1, 1, 3), device)
    except DeviceMissing:
        raise
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

def _jax_dot_product_attention_float64(device: str) -> str:
    import jax

    with jax.enable_x64(True), jax.default_device(_jax_device(device)):
        q, k, v = (jax.random.normal(jax.random.key(i), (1, 5, 1, 8), dtype="float64") for i in range(3))
        native = np.asarray(jax.nn.dot_product_attention(q, k, v), dtype=np.float64)
        q, k, v = (np.asarray(a, np.float64)[0, :, 0] for a in (q, k, v))
    scores = q @ k.T / math.sqrt(8)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    exact = (weights / weights.sum(-1, keepdims=True)) @ v
    return f"max error vs float64 math {np.abs(native[0, :, 0] - exact).max():.1e}"


# Values far from 0 with a small spread: E[x²] − E[x]² in float32 cancels to noise on them, a
# two-pass (or Welford) variance does not. σ² = 0.078, 4096² in float32 is exact to ±1.
NORM_PROBE_INPUT = 4096.0 + np.array([0.0, 0.25, 0.5, 0.75] * 2)


def _norm_error(output) -> str:
    """How far a norm's float32 output on NORM_PROBE_INPUT is from the exact (x − μ)/σ."""
    centered = NORM_PROBE_INPUT - NORM_PROBE_INPUT.mean()
    exact = centered / np.sqrt((centered * centered).mean() + 1e-6)
    error = float(np.abs(np.asarray(output, dtype=np.float64).reshape(-1) - exact).max())
    return f"on float32 4096 + [0, ¼, ½, ¾] (σ² 0.078) its output is off by {error:.1e}"


def _torch_layer_norm_eps() -> str:
    import torch

    norm = torch.nn.LayerNorm(NORM_PROBE_INPUT.size, eps=1e-6)
    with torch.no_grad():
        output = norm(torch.tensor(NORM_PROBE_INPUT, dtype=torch.float32)).numpy()
    return f"eps {torch.nn.LayerNorm(4).eps:g}; {_norm_error(output)}"


def _flax_layer_norm() -> str:
    import jax.numpy as jnp
    from flax import nnx

    default = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
    norm = nnx.LayerNorm(NORM_PROBE_INPUT.size, epsilon=1e-6, rngs=nnx.Rngs(0))
    output = norm(jnp.asarray(NORM_PROBE_INPUT, dtype=jnp.float32))
    return f"epsilon {default.epsilon:g}, use_fast_variance={default.use_fast_variance}; {_norm_error(output)}"


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

def _torch_bool_vs_additive(device: str) -> str:
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(1)
    on = _torch_device(device)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=generator).to(on) for _ in range(3))
    keep = torch.tensor([[True, False, True]] * 3, device=on)
    additive = torch.zeros(3, 3, device=on).masked_fill(~keep, float("-inf"))
    same = torch.allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=additive), atol=1e-6)
    return "bool True = attend; equals the additive 0/-inf mask" if same else "bool and additive masks differ"


def _fill_outcomes(device: str) -> str:
    """A fully masked row under each fill value and dtype, with a plain softmax (torch)."""
    import torch

    on = _torch_device(device)
    outcomes = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        row = []
        for label, fill in (("-inf", float("-inf")), ("-1e9", -1e9), ("finfo.min", torch.finfo(dtype).min)):
            scores = torch.full((1, 3), fill, device=on).to(dtype)
            weights = torch.softmax(scores.float(), dim=-1) if dtype != torch.float32 else torch.softmax(scores, -1)
            verdict = "NaN" if torch.isnan(weights).any() else ("uniform" if torch.allclose(weights.float(), torch.full_like(weights.float(), 1 / 3)) else "other")
            row.append(f"{label}:{verdict}")
        outcomes.append(f"{str(dtype).split('.')[-1]} {' '.join(row)}")
    return "; ".join(outcomes)


# ---- fully masked rows, backward ------------------------------------------------------------
# One query row has no key to attend to, the others keep some. Each probe pulls two cotangents
# back through attention: one on the masked row alone (what flows through that row: the spec says
# exactly zero) and one on the other rows alone (a NaN in the masked row's weights reaches dk or
# dv even when the loss ignores that row).

BACKWARD_KEEP = np.array([[True, False, True], [False, False, False], [True, True, False]])  # [query, key]
MASKED_ROW = 1


def _gradient_verdict(gradient: np.ndarray) -> str:
    """NaN, inf, exactly zero, or how large it is."""
    gradient = np.asarray(gradient, dtype=np.float64)
    if np.isnan(gradient).any():
        return "NaN"
    if np.isinf(gradient).any():
        return "inf"
    return "zero" if not gradient.any() else f"nonzero up to {np.abs(gradient).max():.1e}"


def _masked_row_backward_verdict(through_row: dict[str, np.ndarray], from_others: dict[str, np.ndarray]) -> str:
    """'zeros' when every gradient through the masked row is exactly zero, else each one's verdict;
    then whether the other rows' gradients are finite, naming those that are not."""
    through = {name: _gradient_verdict(gradient) for name, gradient in through_row.items()}
    said = "zeros" if set(through.values()) == {"zero"} else ", ".join(f"{n} {v}" for n, v in through.items())
    broken = [f"{name} {verdict}" for name, gradient in from_others.items()
              if (verdict := _gradient_verdict(gradient)) in ("NaN", "inf")]
    return f"{said} (other rows {'finite' if not broken else 'give ' + ', '.join(broken)})"


def _masked_row_gradients(vjp: Callable[[np.ndarray], tuple[np.ndarray, ...]]) -> str:
    """vjp(cotangent [query, d]) -> (dq, dk, dv), each [position, d], for attention under BACKWARD_KEEP."""
    cotangent = np.random.default_rng(0).standard_normal((BACKWARD_KEEP.shape[0], 4)).astype(np.float32)
    on_row = np.zeros_like(cotangent)
    on_row[MASKED_ROW] = cotangent[MASKED_ROW]
    dq, dk, dv = vjp(on_row)
    through_row = {"dq": dq[MASKED_ROW], "dk": dk, "dv": dv}
    dq, dk, dv = vjp(cotangent - on_row)
    return _masked_row_backward_verdict(through_row, {"dq": np.delete(dq, MASKED_ROW, 0), "dk": dk, "dv": dv})


def _refusal(error: Exception, warned: Sequence[warnings.WarningMessage] = ()) -> str:
    """'refused (Error: its first sentence)', preferring a warning that gives the reason (torch's
    CUDA kernels warn why each one declined, then raise 'No available kernel')."""
    reasons = [str(w.message).split(" (Triggered")[0] for w in warned
               if issubclass(w.category, UserWarning) and not str(w.message).rstrip().endswith(":")]
    text = reasons[0] if reasons else str(error).strip().split(". ")[0]
    return f"refused ({type(error).__name__}: {text.splitlines()[0][:70] if text else '-'})"


def _torch_vjp(attention: Callable, device: str) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    """attention(q, k, v, keep) on seeded float32 q, k, v [1, 1, 3, 4] as a vjp for _masked_row_gradients."""
    import torch

    on = _torch_device(device)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 1, 3, 4, generator=generator).to(on) for _ in range(3)]
    keep = torch.tensor(BACKWARD_KEEP, device=on)

    def vjp(cotangent: np.ndarray) -> tuple[np.ndarray, ...]:
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attention(*leaves, keep)
        gradients = torch.autograd.grad(out, leaves, torch.as_tensor(cotangent, device=on).reshape(out.shape))
        return tuple(g[0, 0].cpu().numpy() for g in gradients)

    return vjp


def _torch_sdpa_masked_row_backward(device: str) -> str:
    """Each SDPA backend torch has, forced with sdpa_kernel; one that will not run says why."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = []
    for name, backend in (("math", SDPBackend.MATH), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def attention(q, k, v, keep, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                found.append(f"{name}: {_masked_row_gradients(_torch_vjp(attention, device))}")
            except RuntimeError as error:
                found.append(f"{name}: {_refusal(error, warned)}")
    return "; ".join(found)


def _torch_softmax_fill_backward(device: str) -> str:
    """The textbook attention: scores filled with -inf where masked, softmax, then V (pytorch #41508)."""
    import torch

    def attention(q, k, v, keep):
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    return _masked_row_gradients(_torch_vjp(attention, device))


def _jax_masked_row_backward(attention: Callable, device: str) -> str:
    """attention(q, k, v, keep) on seeded float32 q, k, v [1, 3, 1, 4] (jax's [B, T, H, d_k]), through jax.vjp."""
    import jax
    import jax.numpy as jnp

    with jax.default_device(_jax_device(device)):
        q, k, v = (jax.random.normal(jax.random.key(i), (1, 3, 1, 4)) for i in range(3))
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, jnp.asarray(BACKWARD_KEEP)), q, k, v)
        return _masked_row_gradients(lambda cotangent: tuple(
            np.asarray(g[0, :, 0]) for g in pullback(jnp.asarray(cotangent).reshape(out.shape))))


def _jax_dot_product_attention_masked_row_backward(device: str) -> str:
    """implementation None (jax chooses) and 'xla'; 'cudnn' too on cuda."""
    import jax

    found = []
    for implementation in (None, "xla") + (("cudnn",) if device == "cuda" else ()):
        def attention(q, k, v, keep, implementation=implementation):
            return jax.nn.dot_product_attention(q, k, v, mask=keep[None, None], implementation=implementation)

        try:
            found.append(f"{implementation!r}: {_jax_masked_row_backward(attention, device)}")
        except DeviceMissing:
            raise
        except Exception as error:  # noqa: BLE001 - the refusal is the observation
            found.append(f"{implementation!r}: {_refusal(error)}")
    return "; ".join(found)


def _jax_attention_with(softmax: Callable) -> Callable:
    """The explicit attention, [B, T, H, d_k] in and out, with softmax(scores, keep) its only choice."""
    import jax.numpy as jnp

    def attention(q, k, v, keep):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        return jnp.einsum("bhqk,bkhd->bqhd", softmax(scores, keep), v)

    return attention


def _jax_softmax_where_backward(device: str) -> str:
    import jax

    return _jax_masked_row_backward(_jax_attention_with(lambda s, keep: jax.nn.softmax(s, where=keep)), device)


def _jax_softmax_fill_backward(device: str) -> str:
    """Masked scores set to -inf by jnp.where, then softmax (jax #17117)."""
    import jax
    import jax.numpy as jnp

    fill = _jax_attention_with(lambda s, keep: jax.nn.softmax(jnp.where(keep, s, -jnp.inf)))
    return _jax_masked_row_backward(fill, device)


# ---- grouped-query attention: fewer key/value heads than query heads -----------------------------
# q [1, 4 heads, 3 queries, 8], k and v [1, 2 heads, 3 keys, 8]; query 0 sees no key, query 1
# one, query 2 two: the verdict names how the entry point groups the heads and what it does with
# the mask, against the spec's grouping (query head h reads key/value head h // 2) in float64.

def _grouped_query_inputs() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 3, 8)).astype(np.float32) for _ in range(2))
    keep = np.array([[False, False, False], [True, False, False], [True, True, False]])
    return q, k, v, keep


def _grouped_query_verdict(out: np.ndarray) -> str:
    """How an entry point's output [1, 4, 3, 8] on _grouped_query_inputs groups the heads and
    treats the mask (its masked row, its kept keys)."""
    import impl_numpy as golden

    q, k, v, keep = (np.asarray(a, np.float64) if a.dtype != bool else a for a in _grouped_query_inputs())
    out = np.asarray(out, np.float64)
    groupings = {"repeat_interleave (the spec's)": [0, 0, 1, 1], "tile": [0, 1, 0, 1]}
    for name, order in groupings.items():
        exact = golden.scaled_dot_product_attention(q, k[:, order], v[:, order], keep)
        if np.allclose(out[:, :, 1:], exact[:, :, 1:], atol=1e-5):
            row = _masked_row_verdict(out[0, 0, 0], v[0, 0])
            return f"accepts 2 K/V heads for 4; groups as {name}; the mask honoured; a row with no key: {row}"
    return "accepts 2 K/V heads for 4, but matches neither grouping under the mask"


def _torch_sdpa_grouped(device: str, **options) -> str:
    import torch
    import torch.nn.functional as F

    on = _torch_device(device)
    q, k, v, keep = (torch.as_tensor(a).to(on) for a in _grouped_query_inputs())
    try:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, **options)
    except RuntimeError as error:
        return _refusal(error)
    return _grouped_query_verdict(out.cpu().numpy())


def _torch_sdpa_without_gqa(device: str) -> str:
    return _torch_sdpa_grouped(device)


def _torch_sdpa_enable_gqa(device: str) -> str:
    return _torch_sdpa_grouped(device, enable_gqa=True)


def _jax_dot_product_attention_grouped(device: str) -> str:
    import jax
    import jax.numpy as jnp

    q, k, v, keep = _grouped_query_inputs()
    with jax.default_device(_jax_device(device)):
        # jax's layout is [B, T, N, H]: the heads third
        out = jax.nn.dot_product_attention(*(jnp.asarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v)),
                                           mask=jnp.asarray(keep)[None, None])
    return _grouped_query_verdict(np.asarray(out).transpose(0, 2, 1, 3))


PROBES = [
    Probe("fully masked row", "torch F.scaled_dot_product_attention", "zeros", _torch_sdpa_masked_row),
    Probe("fully masked row", "torch nn.MultiheadAttention", "zeros", _torch_mha_masked_row),
    Probe("fully masked row", "jax.nn.dot_product_attention", "zeros", _jax_dot_product_attention_masked_row),
    Probe("fully masked row", "onnxruntime Attention", "zeros", _onnxruntime_attention_masked_row),
    Probe("mask broadcasting", "onnxruntime Attention", "a [B,1,1,K] mask broadcasts over queries",
          _onnxruntime_attention_mask_broadcast),
    Probe("model IR version", "onnx.helper.make_model", "exported graphs load in onnxruntime", _onnx_ir_versions,
          per_device=False),
    Probe("float64 attention", "jax.nn.dot_product_attention", "float64-accurate (< 1e-14)",
          _jax_dot_product_attention_float64),
    Probe("float16 attention, one query", "jax.jit(jax.nn.dot_product_attention)",
          "the spec's attention at float16", _jax_float16_single_query),
    Probe("LayerNorm defaults", "torch.nn.LayerNorm", "eps from the config; two-pass variance", _torch_layer_norm_eps,
          per_device=False),
    Probe("LayerNorm defaults", "flax.nnx.LayerNorm", "eps from the config; two-pass variance", _flax_layer_norm,
          per_device=False),
    Probe("GELU default", "torch.nn.functional.gelu", "config chooses: gelu = exact, gelu-tanh", _torch_gelu_default,
          per_device=False),
    Probe("GELU default", "jax.nn.gelu", "config chooses: gelu = exact, gelu-tanh", _jax_gelu_default,
          per_device=False),
    Probe("matmul precision", "torch", "stated per run: 'highest' for conformance", _torch_matmul_precision,
          per_device=False),
    Probe("matmul precision", "jax", "stated per run: 'highest' for conformance", _jax_matmul_precision,
          per_device=False),
    Probe("mask forms", "torch F.scaled_dot_product_attention", "boolean keep-masks only", _torch_bool_vs_additive),
    Probe("fill values, all-masked row", "torch.softmax after a fill", "zeros (no fill value gives that)",
          _fill_outcomes),
    Probe("fully masked row, backward", "torch F.scaled_dot_product_attention, each backend", "zeros, no NaN",
          _torch_sdpa_masked_row_backward),
    Probe("fully masked row, backward", "torch.softmax after masked_fill(-inf)", "zeros, no NaN",
          _torch_softmax_fill_backward),
    Probe("fully masked row, backward", "jax.nn.dot_product_attention", "zeros, no NaN",
          _jax_dot_product_attention_masked_row_backward),
    Probe("fully masked row, backward", "jax.nn.softmax(where=mask)", "zeros, no NaN", _jax_softmax_where_backward),
    Probe("grouped-query attention", "torch F.scaled_dot_product_attention", "K/V head h // g serves query head h",
          _torch_sdpa_without_gqa),
    Probe("grouped-query attention", "torch F.scaled_dot_product_attention(enable_gqa=True)",
          "K/V head h // g serves query head h", _torch_sdpa_enable_gqa),
    Probe("grouped-query attention", "jax.nn.dot_product_attention", "K/V head h // g serves query head h",
          _jax_dot_product_attention_grouped),
    Probe("fully masked row, backward", "jax.nn.softmax after jnp.where(mask, x, -inf)", "zeros, no NaN",
          _jax_softmax_fill_backward),
]

Observation = tuple[Probe, str, str]  # (probe, device or "-", what was observed)


def _observe(probe: Probe, *args: str) -> str:
    try:
        return probe.measure(*args)
    except ImportError as error:
        return f"not installed ({error.name})"
    except DeviceMissing as missing:
        return str(missing)
    except Exception as error:  # noqa: BLE001 - a probe that breaks is itself an observation
        return f"error: {type(error).__name__}: {error}"


def run_probes(devices: Sequence[str] | None = None) -> list[Observation]:
    """Every probe, per device where the device matters (probe_devices() unless given)."""
    devices = list(devices or probe_devices())
    observed: list[Observation] = []
    for probe in PROBES:
        if probe.per_device:
            observed += [(probe, device, _observe(probe, device)) for device in devices]
        else:
            observed.append((probe, "-", _observe(probe)))
    return observed


def observation(observed: Sequence[Observation], topic: str, primitive: str, device: str = "cpu") -> str:
    """What one probe saw on one device (a device-independent probe answers for every device)."""
    for probe, where, result in observed:
        if probe.topic == topic and probe.primitive == primitive and where in (device, "-"):
            return result
    raise KeyError(f"no probe {topic} / {primitive} on {device}")


def probe_table(observed: Sequence[Observation]) -> str:
    versions = framework_versions()
    lines = [f"Versions: {', '.join(f'{k} {v}' for k, v in versions.items() if v)}", "",
             "| topic | primitive | device | observed here | the spec |", "|---|---|---|---|---|"]
    lines += [f"| {p.topic} | {p.primitive} | {device} | {result} | {p.spec} |" for p, device, result in observed]
    return "\n".join(lines)


def probe_page(observed: Sequence[Observation]) -> str:
    """The probe's table as a Markdown page (`rosetta probe --markdown FILE`)."""
    return f"# Native-behaviour probe\n\nMeasured by `rosetta probe`.\n\n{probe_table(observed)}\n"
