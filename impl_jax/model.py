"""The spec's Transformer in JAX with Flax NNX: a parallel text to impl_numpy/model.py and
impl_torch/model.py. Same names, same order; the comments say why JAX needs something.

Shapes: B batch, S source, T target, Q queries, K keys, H heads, H_kv key/value heads, d d_model,
d_k head size, r rotary dimensions.

The module tree mirrors the canonical names. nnx.Linear keeps its kernel [in, out] — the spec's
layout — so canonical matrices load with no transpose (PyTorch's nn.Linear needs one). Only
the leaf names differ: nnx.Linear's ``kernel`` and nnx.Embed's ``embedding`` are the spec's
``weight``.

Numerics are explicit, not left to JAX's defaults:
- matmul precision: every dot is given ``precision`` ('highest' for conformance). JAX's default
  on NVIDIA GPUs rounds float32 matmul inputs to TF32; the public entry points also set
  ``jax.default_matmul_precision`` so jax.nn.dot_product_attention follows the same setting.
- float64 needs JAX's x64 mode; it is never switched on globally here: run float64 models
  inside ``with jax.enable_x64(True):`` (from_params refuses float64 outside it).
- GELU: jax.nn.gelu defaults to the tanh approximation; the config chooses explicitly.
- norms of half-precision activations take their statistics in float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.experimental import io_callback

from spec import ModelConfig, check_params, load_weights, param_shapes
from spec.inputs import (
    check_cache_capacity,
    check_cache_room,
    check_decode_step,
    check_generation,
    check_keep,
    check_model_inputs,
    check_source,
    mask_shape_4d,
)
from spec.dropout import check_dropout_masks, masks_under
from spec.masks import real_tokens
from spec.routing import RoutingLog, check_recorded_routing

ATTENTION_PATHS = ("sdpa", "math")
PRECISIONS = ("highest", "default")
DTYPES = {"float64": jnp.float64, "float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# ---- small pieces ---------------------------------------------------------------------------

def gelu(x: jax.Array) -> jax.Array:
    """x Φ(x), the exact form: jax.nn.gelu's default is the tanh approximation, so ask for erf."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2"""
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu, "gelu": gelu, "gelu-tanh": gelu_tanh, "swish": jax.nn.silu,
}


def softmax(x: jax.Array, mask: jax.Array | None = None, sink: jax.Array | None = None) -> jax.Array:
    """softmax over the last axis keeping entries where mask is True, with a sink's exp(s − m) in
    the denominator alone where given (gpt-oss); a row with nothing kept is all zeros (SPEC.md §6).
    jax.nn.softmax(where=...) would give NaN there."""
    if mask is not None:
        x = jnp.where(mask, x, -jnp.inf)
    row_max = x.max(axis=-1, keepdims=True)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    e = jnp.exp(x - row_max)
    total = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - row_max)
    return e / jnp.where(total > 0, total, 1)


# ---- embeddings and positions ---------------------------------------------------------------

def token_embedding(ids: jax.Array, table: nnx.Embed, scale: bool) -> jax.Array:
    """E[ids] · √d_model, the scale a number of the activation dtype (SPEC §5.13). ids [B, T] -> [B, T, d]"""
    x = table(ids)
    # a Python float is weakly typed and would take x's dtype anyway; written out, as in the other texts
    return x * jnp.asarray(math.sqrt(table.features), x.dtype) if scale else x


def sinusoidal_table(positions: np.ndarray, d_model: int, layout: str) -> np.ndarray:
    """angle(pos, i) = pos / 10000^(2i/d), on the host in NumPy float64: JAX has float64 only in
    x64 mode, and float32 angles lose ~1e-7·pos of accuracy. -> [T, d] float64"""
    inverse_frequency = 10000.0 ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inverse_frequency[None, :]
    if layout == "sinusoidal":
        return np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(len(positions), d_model)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


# ---- attention ------------------------------------------------------------------------------

def split_heads(x: jax.Array, n_heads: int) -> jax.Array:
    """[B, T, H·d_k] -> [B, H, T, d_k]"""
    batch, length, width = x.shape
    return x.reshape(batch, length, n_heads, width // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x: jax.Array) -> jax.Array:
    """[B, H, T, d_k] -> [B, T, H·d_k]"""
    batch, n_heads, length, d_head = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, n_heads * d_head)


def rope_frequencies(cfg: ModelConfig, dtype, length: jax.Array | None = None) -> jax.Array:
    """ω_i = θ^(−2i/r), i = 0..r/2−1, rescaled by cfg.rope_scaling (SPEC §5.12) for a call whose
    length (1 + its largest position) is `length`; None: a call no longer than the original
    context. In `dtype`. -> [r/2]"""
    r, theta, scaling = cfg.rotary_dim, float(cfg.rope_theta), cfg.rope_scaling
    omega = theta ** (-jnp.arange(0, r, 2, dtype=dtype) / r)  # [r/2]
    if scaling is None:
        return omega
    if scaling.kind == "linear":
        return omega / scaling.factor  # positions divided by the factor
    if scaling.kind == "llama3":
        return llama3_frequencies(omega, scaling)
    if scaling.kind == "longrope":
        return longrope_frequencies(omega, scaling, length)
    return yarn_frequencies(omega, r, theta, scaling)


def llama3_frequencies(omega: jax.Array, scaling) -> jax.Array:
    """Wavelengths λ = 2π/ω longer than L/low_freq_factor are divided by the factor, shorter than
    L/high_freq_factor kept, and between them blended: (1−s)·ω/factor + s·ω with
    s = (L/λ − low_freq_factor) / (high_freq_factor − low_freq_factor), L = original_max_len."""
    length, low, high = scaling.original_max_len, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / omega
    smooth = (length / wavelength - low) / (high - low)
    blended = (1 - smooth) * omega / scaling.factor + smooth * omega
    return jnp.where(wavelength > length / low, omega / scaling.factor,
                     jnp.where(wavelength < length / high, omega, blended))


def yarn_frequencies(omega: jax.Array, r: int, theta: float, scaling) -> jax.Array:
    """YaRN: pair j is interpolated (ω/factor) by ramp(j) and kept by 1 − ramp(j), the ramp rising
    from 0 to 1 between the dimensions that turn beta_fast and beta_slow times over the original
    context: dim(n) = r · ln(L / (2π·n)) / (2 ln θ)."""
    def dimension(rotations: float) -> float:
        return r * math.log(scaling.original_max_len / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    pairs = jnp.arange(r // 2, dtype=omega.dtype)
    ramp = jnp.clip((pairs - low) / (high - low if high != low else 0.001), 0, 1)
    return omega / scaling.factor * ramp + omega * (1 - ramp)


def longrope_frequencies(omega: jax.Array, scaling, length: jax.Array | None) -> jax.Array:
    """LongRoPE: ω_i / f_i, f the long factors for a call longer than L = original_max_len
    (ℓ > L, strictly), else the short ones."""
    short = jnp.asarray(scaling.short_factor, dtype=omega.dtype)
    if length is None:
        return omega / short
    long = jnp.asarray(scaling.long_factor, dtype=omega.dtype)
    # a select on the length, not a Python if: under jit the length is a tracer
    return omega / jnp.where(length > scaling.original_max_len, long, short)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor on cos and sin (so a² on the scores): the config's attention_factor where given;
    YaRN's mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are given, else
    mscale(factor, 1), mscale(s, m) = 0.1·m·ln s + 1 (1 for s ≤ 1); LongRoPE's √(1 + ln s / ln L)
    (1 for s ≤ 1); 1 for the other rules."""
    scaling = cfg.rope_scaling
    if scaling is None or scaling.kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.kind == "longrope":
        if scaling.factor <= 1:
            return 1.0
        return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_len))

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def rope_tables(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """a·cos and a·sin of angle(pos, i) = pos · ω_i (rope_frequencies for the call's length ℓ =
    1 + its largest position; a = rope_attention_factor), each angle repeated for both halves
    (rotate_half's layout), in `dtype`. positions [T] -> 2 × [T, r]"""
    # on the device, not on the host as sinusoidal_table is: a decode step's positions are traced.
    # expand_dims, not [:, None]: jax2onnx cannot index along a symbolic length (an ONNX export)
    length = positions.max() + 1 if cfg.rotary_reads_length else None
    angles = jnp.expand_dims(positions.astype(dtype), -1) * rope_frequencies(cfg, dtype, length)  # [T, r/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, r]
    factor = rope_attention_factor(cfg)
    if factor == 1:  # no multiply in the graph an export traces
        return jnp.cos(angles), jnp.sin(angles)
    return factor * jnp.cos(angles), factor * jnp.sin(angles)


def rotate_half(x: jax.Array) -> jax.Array:
    """(x1, x2) -> (−x2, x1), x1 and x2 the two halves of the last axis."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary(cfg: ModelConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE: the first r dimensions of each head rotate by their position, x_r cos + rotate_half(x_r) sin;
    the others pass (partial rotary). x [B, H, T, d_k], positions [T] -> [B, H, T, d_k]"""
    r = cfg.rotary_dim
    if r == 0:  # a NoPE layer (nope_layers): nothing turns
        return x
    # Angles of a half-precision dtype are useless past a few hundred positions, so the tables are
    # taken in float32 (float64 for a float64 model, which exists only in x64 mode) and only then
    # cast to x's dtype, as Hugging Face's Llama does: the multiply is in x's dtype.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    cos, sin = (table.astype(x.dtype) for table in rope_tables(cfg, positions, wide))
    rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return jnp.concatenate([rotated, x[..., r:]], axis=-1)


def group_heads(x: jax.Array, n_heads: int) -> jax.Array:
    """Grouped-query attention: key/value head j serves query heads j·g .. (j+1)·g − 1, g = H / H_kv.
    [B, H_kv, K, d_k] -> [B, H, K, d_k]"""
    return jnp.repeat(x, n_heads // x.shape[1], axis=1)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """c · tanh(x / c): x bent smoothly into (−c, c); x itself without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def scaled_dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None,
                                 path: str = "sdpa", precision: str = "highest", scale: float | None = None,
                                 cap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Attention(Q, K, V) = softmax(softcap(Q Kᵀ · s)) V, s = 1/√d_k unless given, query head h
    reading key/value head h // (H / H_kv), each head's sink in its denominator where given
    (SPEC §5.16). q [B, H, Q, d_k], k and v [B, H_kv, K, d_k], mask a boolean keep-mask
    broadcastable to [B, H, Q, K], sinks [H]."""
    # Decided before the jit, so both paths' calls that end up explicit share one program.
    path, _ = attention_path(q.dtype, _platform(), q.shape[-2], path, cap is not None, sinks is not None)
    return _attention(q, k, v, mask, sinks, path, precision, 1 / math.sqrt(q.shape[-1]) if scale is None else scale,
                      cap)


def attention_path(dtype, platform: str, n_queries: int, path: str, capped: bool = False,
                   sinks: bool = False) -> tuple[str, str | None]:
    """The path attention asked for `path` takes ('sdpa' or 'math'), and why it is not the one
    asked for (None when it is); `capped`: the scores are softcapped (SPEC §5.13); `sinks`: the
    softmax has sinks (SPEC §5.16)."""
    if path == "math":
        return "math", None
    if capped:
        return "math", "jax.nn.dot_product_attention has no softcap"
    if sinks:
        return "math", "jax.nn.dot_product_attention has no sink"
    # jax.nn.dot_product_attention always takes its softmax in float32 — for float64 inputs too,
    # which leaves float64 attention float32-accurate (errors ~1e-7)
    if jnp.dtype(dtype) == jnp.float64:
        return "math", "jax.nn.dot_product_attention takes its softmax in float32"
    failure = native_attention_fails(dtype, platform, n_queries)
    return ("math", failure) if failure else ("sdpa", None)


@partial(jax.jit, static_argnames=("path", "precision", "scale", "cap"))
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, sinks: jax.Array | None, path: str,
               precision: str, scale: float, cap: float | None) -> jax.Array:
    if path == "math":
        k, v = group_heads(k, q.shape[1]), group_heads(v, q.shape[1])
        scores = softcap(jnp.matmul(q, k.swapaxes(-1, -2), precision=precision) * scale, cap)  # [B, H, Q, K]
        # Half-precision softmax loses the small weights; take it in float32 as the fused kernels do.
        wide = scores.dtype in _HALF
        sink = None if sinks is None else (sinks.astype(jnp.float32) if wide else sinks)[:, None, None]
        weights = softmax(scores.astype(jnp.float32) if wide else scores, mask, sink).astype(v.dtype)
        return jnp.matmul(weights, v, precision=precision)
    # jax.nn.dot_product_attention wants [B, T, H, d_k] (heads after the sequence axis). Its mask
    # has the spec's polarity (True = attend), but it fills masked logits with a large finite
    # negative, so a row with no key gets the *mean of V* rather than zeros: enforced below. It
    # groups heads itself (fewer K/V heads than query heads, a mask of H or 1 heads), reading each
    # key/value head for its group in place of the golden's repeated copies.
    out = jax.nn.dot_product_attention(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), mask=mask, scale=scale)
    out = out.swapaxes(1, 2)
    if mask is None:
        return out
    return jnp.where(mask.any(axis=-1, keepdims=True), out, jnp.zeros((), out.dtype))


def native_attention_fails(dtype, platform: str, n_queries: int) -> str | None:
    """Why jitted jax.nn.dot_product_attention fails to compile for this case, or None where it
    runs (docs/framework-notes.md; `rosetta probe` rows "float16 attention")."""
    if jnp.dtype(dtype) != jnp.float16:
        return None
    if platform == "cpu":
        # it asks for the F16_F16_F32 dot algorithm, which XLA:CPU lacks, and its fallback only
        # catches errors raised while tracing (jax 0.10.2)
        return "XLA:CPU lacks the F16_F16_F32 dot algorithm"
    if platform in ("gpu", "cuda") and n_queries == 1:
        # "Unsupported dot precision algorithm: 4" at any default_matmul_precision; 3 queries,
        # bfloat16 and jnp.matmul at float16 all compile (jax 0.11.2, CUDA 13, H100)
        return "XLA:GPU refuses the dot algorithm of a single float16 query"
    return None


def _platform() -> str:
    """Where new computations run: the default device's platform, else the default backend."""
    device = jax.config.jax_default_device
    return device.platform if device is not None and not isinstance(device, str) else jax.default_backend()


class HeadNorm(nnx.Module):
    """Qwen3's RMSNorm of each head's q or k over d_k; OLMo 2's over all `heads` at once
    (qk_norm_scope "projection"). A module of its own so that its parameter's path is the canonical
    ``q_norm.scale`` / ``k_norm.scale``."""

    def __init__(self, cfg: ModelConfig, heads: int, dtype):
        self.whole = cfg.qk_norm_scope == "projection"
        self.scale = nnx.Param(jnp.ones(heads * cfg.d_head if self.whole else cfg.d_head, dtype))
        self.eps, self.plus_one = float(cfg.norm_eps), cfg.norm_scale_plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.whole:  # RMSNorm(x W) [B, T, H·d_k], then the heads
            return split_heads(rms_norm(merge_heads(x), self.scale[...], None, self.eps, self.plus_one), x.shape[1])
        return rms_norm(x, self.scale[...], None, self.eps, self.plus_one)


def attention_positions(cfg: ModelConfig, q_len: int, k_len: int, offset=0) -> tuple[jax.Array | None, ...]:
    """RoPE's (query, key) positions: the keys at offset .. offset+K−1, the queries the last Q of
    them (a self-attention's are the keys'; a decode step's the newest); (None, None) without RoPE.
    offset may be traced (a decode step's cache length) and the lengths symbolic (an ONNX export)."""
    if cfg.positional != "rope":
        return None, None
    # start + iota: jnp.arange needs concrete bounds; and lax.iota, not jnp.arange, whose jax2onnx
    # stand-in gives a symbolic length (an ONNX export) that no longer matches the activations'
    return (offset + k_len - q_len) + lax.iota(jnp.int32, q_len), offset + lax.iota(jnp.int32, k_len)


class Linear(nnx.Linear):
    """x W + b, accumulated and biased in float32 (or wider) and rounded once to the model's dtype,
    as torch's addmm does. nnx.Linear alone rounds x W to a half-precision dtype and then adds b, a
    second rounding: a random Qwen2, whose q, k and v have biases, failed forward-long at float16
    by 1.11× its tolerance so, and passes at 0.49× rounded once."""

    def __init__(self, *args, dtype, **kwargs):
        super().__init__(*args, dtype=dtype, preferred_element_type=jnp.promote_types(dtype, jnp.float32), **kwargs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x).astype(self.dtype)


class MultiHeadAttention(nnx.Module):
    """MultiHead(x, c) = Concat(head_1..head_h) W^O, head_i = Attention(x W_i^Q, c W_g(i)^K, c W_g(i)^V);
    with qk_norm, a self-attention's q_norm and k_norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, path: str, precision: str, dtype, rngs: nnx.Rngs,
                 self_attention: bool = True):
        d, queries, keys = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
        # float64 attention always takes the math path (scaled_dot_product_attention): stored so,
        # a float64 model's programs are the same for either path, traced and compiled once
        self.cfg, self.precision = cfg, precision
        self.path = "math" if jnp.dtype(dtype) == jnp.float64 else path
        linear = partial(Linear, dtype=dtype, param_dtype=dtype, precision=precision, rngs=rngs)
        self.q = linear(d, queries, use_bias=cfg.qkv_bias)
        self.k = linear(d, keys, use_bias=cfg.qkv_bias)
        self.v = linear(d, keys, use_bias=cfg.qkv_bias)
        self.o = linear(queries, d, use_bias=cfg.bias)
        head_norms = cfg.qk_norm and self_attention
        self.q_norm = HeadNorm(cfg, cfg.n_heads, dtype) if head_norms else None
        self.k_norm = HeadNorm(cfg, cfg.kv_heads, dtype) if head_norms else None
        self.gate = linear(d, queries, use_bias=cfg.qkv_bias) if cfg.attention_output_gate and self_attention else None
        self.sinks = nnx.Param(jnp.zeros(cfg.n_heads, dtype)) if cfg.attention_sinks and self_attention else None

    def head_norm(self, name: str, x: jax.Array) -> jax.Array:
        """The head norm of q or k, when this attention has one. x [B, H, T, d_k]"""
        norm = getattr(self, f"{name}_norm")
        return x if norm is None else norm(x)

    def key_value_heads(self, context: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """K, V of the context, split into the H_kv key/value heads; K normed per head (qk_norm)
        and rotated at its positions (RoPE), as a KV cache holds it. [B, K, d] -> 2 × [B, H_kv, K, d_k]"""
        k = self.head_norm("k", split_heads(self.k(context), self.cfg.kv_heads))
        v = split_heads(self.v(context), self.cfg.kv_heads)
        return (k if positions is None else rotary(self.cfg, k, positions)), v

    def attend(self, x: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
               positions: jax.Array | None = None) -> jax.Array:
        """Concat(head_1..head_h) W^O + b with queries from x, normed and rotated as K is.
        x [B, Q, d], k and v [B, H_kv, K, d_k] -> [B, Q, d]"""
        q = self.head_norm("q", split_heads(self.q(x), self.cfg.n_heads))
        q = q if positions is None else rotary(self.cfg, q, positions)
        heads = scaled_dot_product_attention(q, k, v, mask, self.path, self.precision, self.cfg.score_scale,
                                             self.cfg.attention_softcap,
                                             None if self.sinks is None else self.sinks[...])  # [B, H, Q, d_k]
        return self.o(self.output_gate(x, merge_heads(heads)))

    def output_gate(self, x: jax.Array, heads: jax.Array) -> jax.Array:
        """The gated attention's heads (SPEC §5.15): Concat(head_i) ⊙ σ(x W_gate + b) before W^O; the
        heads as they are without it. x [B, Q, d], heads [B, Q, H·d_k] -> [B, Q, H·d_k]"""
        return heads if self.gate is None else heads * jax.nn.sigmoid(self.gate(x))

    def __call__(self, x: jax.Array, context: jax.Array, mask, offset=0) -> jax.Array:
        """x [B, Q, d], context [B, K, d], mask any shape the spec accepts -> [B, Q, d]; RoPE
        positions from offset (attention_positions)."""
        mask = view_mask(mask, x.shape[0], self.cfg.n_heads, x.shape[1], context.shape[1])
        q_positions, k_positions = attention_positions(self.cfg, x.shape[1], context.shape[1], offset)
        return self.attend(x, *self.key_value_heads(context, k_positions), mask, q_positions)


# ---- feed-forward, norms, residual ----------------------------------------------------------

class FeedForward(nnx.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2; gated (cfg.gated_ffn): (act(x W1 + b1) ⊙ (x W3 + b3)) W2 + b2,
    SwiGLU with swish, GeGLU with gelu-tanh; gpt-oss's clamped SwiGLU as the gated unit where the
    config has its limit (SPEC §5.16)."""

    def __init__(self, cfg: ModelConfig, precision: str, dtype, rngs: nnx.Rngs, d_ff: int | None = None):
        linear = partial(Linear, use_bias=cfg.bias, dtype=dtype, param_dtype=dtype, precision=precision, rngs=rngs)
        d_ff = cfg.d_ff if d_ff is None else d_ff  # a shared expert's own width
        self.w1 = linear(cfg.d_model, d_ff)
        self.w3 = linear(cfg.d_model, d_ff) if cfg.gated_ffn else None
        self.w2 = linear(d_ff, cfg.d_model)
        self.activation, self.clamp = ACTIVATIONS[cfg.activation], cfg.swiglu_clamp

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.clamp is not None:
            return self.w2(clamped_swiglu(self.w1(x), self.w3(x), *self.clamp))
        hidden = self.activation(self.w1(x))  # [B, T, d_ff]
        if self.w3 is not None:
            hidden = hidden * self.w3(x)
        return self.w2(hidden)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's gated unit (SPEC §5.16): g = min(gate, L), u = clip(up, −L, L);  g·σ(α g) ⊙ (u + 1)"""
    # the constants at the activations' dtype: jax2onnx writes a weak-typed Python float as a float32
    # constant, which a float16 graph's Mul refuses
    limit, alpha, one = (jnp.asarray(value, gate.dtype) for value in (limit, alpha, 1.0))
    g, u = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return g * jax.nn.sigmoid(alpha * g) * (u + one)


# nnx.jit traverses a module's attributes as its graph: the log rides a context variable instead
_ROUTING: contextvars.ContextVar[RoutingLog | None] = contextvars.ContextVar("routing", default=None)
# an exported graph's routing (export/jax_export's forward_routed): its forced choices and weights
# [L, B, T, k] and replay flag are graph inputs, traced values, and each layer's choices and own
# weights go into the lists, as outputs
_GRAPH_ROUTING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("graph_routing", default=None)


@contextlib.contextmanager
def graph_routing(forced: jax.Array, forced_weights: jax.Array, replay: jax.Array, taken: list,
                  weighed: list) -> Iterator[None]:
    """While a graph is traced inside, MoE layer i takes forced[i] and forced_weights[i] where replay
    is true, else its own choices and weights, and appends what it took [N, k] to taken and its
    own weights (at the choices it took) to weighed (SPEC §5.14)."""
    token = _GRAPH_ROUTING.set((forced, forced_weights, replay, taken, weighed))
    try:
        yield
    finally:
        _GRAPH_ROUTING.reset(token)


def _weighed(log: RoutingLog, layer: int, weights: jax.Array) -> jax.Array:
    """RoutingLog.weigh at every run of the compiled program, through a host callback: the forced
    weights, else the layer's own. The callback runs on a thread of its own, where x64 mode
    (thread-local) is off, so float64 weights cross it as their bits, two uint32 words each."""
    if weights.dtype != jnp.float64:
        return io_callback(partial(_weigh, log, layer), jax.ShapeDtypeStruct(weights.shape, weights.dtype), weights,
                           ordered=True)
    bits = jax.lax.bitcast_convert_type(weights, jnp.uint32)  # [N, k, 2]
    bits = io_callback(partial(_weigh_bits, log, layer), jax.ShapeDtypeStruct(bits.shape, jnp.uint32), bits,
                       ordered=True)
    return jax.lax.bitcast_convert_type(bits, jnp.float64)


def _seen(log: RoutingLog, layer: int, tokens: jax.Array) -> None:
    """RoutingLog.see at every run of the compiled program: the router's input, float64 as bits
    (the callback's thread runs without x64, as for _weighed)."""
    if tokens.dtype != jnp.float64:
        io_callback(partial(_see, log, layer), None, tokens, ordered=True)
    else:
        io_callback(partial(_see_bits, log, layer), None, jax.lax.bitcast_convert_type(tokens, jnp.uint32),
                    ordered=True)


def _see(log: RoutingLog, layer: int, tokens: np.ndarray) -> None:
    log.see(layer, np.asarray(tokens).astype(np.float64))


def _see_bits(log: RoutingLog, layer: int, bits: np.ndarray) -> None:
    log.see(layer, np.ascontiguousarray(bits).view(np.float64)[..., 0])


def _weigh(log: RoutingLog, layer: int, own: np.ndarray) -> np.ndarray:
    forced = log.weigh(layer, own)
    return np.asarray(own if forced is None else forced, dtype=own.dtype)  # the dtype the program declared


def _weigh_bits(log: RoutingLog, layer: int, bits: np.ndarray) -> np.ndarray:
    own = np.ascontiguousarray(bits).view(np.float64)[..., 0]  # [N, k]
    forced = log.weigh(layer, own)
    return np.ascontiguousarray(own if forced is None else forced, dtype=np.float64)[..., None].view(np.uint32)


# what the load-balancing loss reads: every MoE layer's (probabilities [N, E], chosen [N, k]) while a
# training loss's forward is traced (recorded_routers). Set inside a trace only (_forward_routed, or
# an eager forward): a compiled program whose trace is cached would not run `route` again.
_ROUTERS: contextvars.ContextVar[list | None] = contextvars.ContextVar("routers", default=None)


@contextlib.contextmanager
def recorded_routers() -> Iterator[list[tuple[jax.Array, jax.Array]]]:
    """Every MoE layer's (probabilities [N, E], chosen [N, k]) while inside, in call order."""
    routed: list[tuple[jax.Array, jax.Array]] = []
    token = _ROUTERS.set(routed)
    try:
        yield routed
    finally:
        _ROUTERS.reset(token)


class MixtureOfExperts(nnx.Module):
    """MoE(x) = Σ_j w_j · FFN_top_j(x) (SPEC §5.14): a router R [d, E] chooses k of E gated FFNs per
    token (+ σ(x g) · FFN_shared(x) where there is a shared expert). batched: every expert on every
    token, the chosen outputs gathered (what fused ports run); else a loop over the experts. Both are
    in the matrix: the sdpa column runs the batched form, the math column the loop."""

    def __init__(self, cfg: ModelConfig, batched: bool, precision: str, dtype, rngs: nnx.Rngs):
        self.router = Linear(cfg.d_model, cfg.moe.n_experts, use_bias=cfg.moe.router_bias, dtype=dtype, param_dtype=dtype,
                             precision=precision, rngs=rngs)
        self.experts = nnx.List([FeedForward(cfg, precision, dtype, rngs) for _ in range(cfg.moe.n_experts)])
        shared = cfg.moe.shared_expert_d_ff
        self.shared_expert = FeedForward(cfg, precision, dtype, rngs, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.d_model, 1, use_bias=False, dtype=dtype, param_dtype=dtype,
                                         precision=precision, rngs=rngs) if shared else None
        self.k, self.renormalize, self.batched = cfg.moe.experts_per_token, cfg.moe.renormalize, batched
        self.router_float32 = cfg.moe.router_softmax == "float32"  # at least float32: half activations widened
        # which decoder layer this is, for a routing log (Stack sets it): nnx.jit traces copies of a
        # module with Variables of their own, so neither the module's identity nor theirs lasts
        self.index = 0

    def route(self, tokens: jax.Array, batch: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
        """probabilities [N, E], the chosen experts [N, k] largest first, their weights [N, k]."""
        logits = self.router(tokens)
        widen = self.router_float32 and logits.dtype in _HALF
        probabilities = jax.nn.softmax(logits.astype(jnp.float32) if widen else logits, axis=-1)
        # lax.top_k documents no order for ties; a stable sort of −p puts the lower index first. Sorted in
        # float32 at least: jax2onnx's export of a float16 argsort is mistyped ("Inferred elem type differs",
        # float vs float16), and the widening is exact, so the order and its ties are the same
        ranked = probabilities.astype(jnp.float32) if probabilities.dtype in _HALF else probabilities
        chosen = jnp.argsort(-ranked, axis=-1, stable=True)[:, :self.k]
        graph = _GRAPH_ROUTING.get()
        if graph is not None:
            forced, forced_weights, replay, taken, weighed = graph
            chosen = jnp.where(replay, forced[self.index].reshape(chosen.shape).astype(chosen.dtype), chosen)
            taken.append(chosen)
        log = _ROUTING.get()
        if log is not None:  # a routing log records the choices, or forces the golden's
            # at every run of the compiled program, through a host callback; int32 across: the callback
            # runs on a thread of its own, where x64 mode (thread-local) is off
            chosen = io_callback(partial(log.choose, self.index, batch), jax.ShapeDtypeStruct(chosen.shape, jnp.int32),
                                 chosen.astype(jnp.int32), ordered=True).astype(chosen.dtype)
        if (routed := _ROUTERS.get()) is not None:
            routed.append((probabilities, chosen))
        weights = jnp.take_along_axis(probabilities, chosen, axis=-1)
        if self.renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if graph is not None:
            weighed.append(weights)
            weights = jnp.where(replay, forced_weights[self.index].reshape(weights.shape).astype(weights.dtype), weights)
        if log is not None:  # the weights logged too, or the golden's taken
            own = jax.lax.stop_gradient(weights)  # a host callback has no derivative
            _seen(log, self.index, jax.lax.stop_gradient(tokens))
            # the golden's values (w − w is exactly 0) with this router's gradient (log.weigh hands back
            # the router's own where nothing is forced): a replayed gradient or training case still
            # reaches the router
            weights = _weighed(log, self.index, own) + (weights - own)
        return probabilities, chosen, weights.astype(tokens.dtype)

    def shared(self, x: jax.Array) -> jax.Array:
        """σ(x g) · FFN_shared(x): the expert every token takes beside its k. [.., d] -> [.., d]"""
        return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        routed = self.routed(x)
        return routed + self.shared(x) if self.shared_expert is not None else routed

    def routed(self, x: jax.Array) -> jax.Array:
        """Σ_j w_j · FFN_top_j(x) over each token's k chosen experts. [B, T, d] -> [B, T, d]"""
        tokens = x.reshape(-1, x.shape[-1])  # [N, d]: routing is per token
        _, chosen, weights = self.route(tokens, x.shape[0] if x.ndim == 3 else 1)
        if self.batched:
            outputs = jnp.stack([expert(tokens) for expert in self.experts], axis=1)  # [N, E, d]
            # gathered, not multiplied by a zero weight: an unchosen expert's inf would make 0 · inf = NaN
            picked = jnp.take_along_axis(outputs, chosen[..., None], axis=1)  # [N, k, d]
            return (weights[..., None] * picked).sum(axis=1).reshape(x.shape)
        # jit needs static shapes, so the loop runs each expert on every token and keeps its output
        # only where chosen (jnp.where rather than a zero weight, for the same reason as above)
        out = jnp.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            here = chosen == index  # [N, k]
            weight = jnp.where(here, weights, 0).sum(axis=-1, keepdims=True)  # [N, 1]
            out = out + jnp.where(here.any(axis=-1, keepdims=True), weight * expert(tokens), 0)
        return out.reshape(x.shape)


def layer_ffn(cfg: ModelConfig, path: str, precision: str, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """A decoder layer's FFN, whichever mixer is before it: one FFN, or the mixture of experts (the
    batched form on the sdpa path, the loop on the math path)."""
    return (FeedForward(cfg, precision, dtype, rngs) if cfg.moe is None
            else MixtureOfExperts(cfg, path == "sdpa", precision, dtype, rngs))


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """γ (x - μ) / √(σ² + ε) + β, two passes. (nnx.LayerNorm's default use_fast_variance=True
    takes E[x²] − E[x]², which cancels badly when the mean is large.)"""
    centered = x - x.mean(axis=-1, keepdims=True)
    variance = (centered * centered).mean(axis=-1, keepdims=True)
    return centered / jnp.sqrt(variance + eps) * scale + bias


def std_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """γ (x - μ) / (s + ε) + β with the unbiased std (jnp.std needs ddof=1 for it)."""
    centered = x - x.mean(axis=-1, keepdims=True)
    return scale * centered / (jnp.std(x, axis=-1, keepdims=True, ddof=1) + eps) + bias


def rms_norm(x: jax.Array, scale: jax.Array, bias: None, eps: float, plus_one: bool = False) -> jax.Array:
    """γ x / √(mean(x²) + ε), no bias; γ = 1 + scale where plus_one (Gemma). A half-precision x is
    normalised in float32, cast back, then scaled in its own dtype, as Llama does (SPEC §5.6);
    Gemma's scales in float32 before the cast: so here."""
    wide = x.astype(jnp.float32) if x.dtype in _HALF else x
    normed = wide * lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (normed * (1.0 + scale.astype(normed.dtype))).astype(x.dtype)
    return normed.astype(x.dtype) * scale


class Norm(nnx.Module):
    """The config's norm with parameters named scale/bias, as in the spec (RMSNorm has no bias)."""

    def __init__(self, cfg: ModelConfig, dtype):
        self.scale = nnx.Param(jnp.ones(cfg.d_model, dtype))
        self.bias = None if cfg.norm == "rmsnorm" else nnx.Param(jnp.zeros(cfg.d_model, dtype))
        self.norm = cfg.norm
        self.eps, self.plus_one = float(cfg.norm_eps), cfg.norm_scale_plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        kind = {"layernorm": layer_norm, "std": std_norm, "rmsnorm": rms_norm}[self.norm]
        scale = self.scale[...]
        if self.bias is None:  # RMSNorm takes half precision itself
            return rms_norm(x, scale, None, self.eps, self.plus_one)
        bias = self.bias[...]
        if x.dtype in _HALF:  # statistics of half-precision activations are taken in float32
            return kind(x.astype(jnp.float32), scale.astype(jnp.float32), bias.astype(jnp.float32),
                             self.eps).astype(x.dtype)
        return kind(x, scale, bias, self.eps)


def dropout(cfg: ModelConfig, x: jax.Array, keep: jax.Array | None) -> jax.Array:
    """x ⊙ keep / (1 − p) with the keep-mask given (SPEC §5.10); None keeps every unit. Not
    nnx.Dropout, which draws its own mask: every implementation must drop the same units."""
    return x if keep is None else x * keep / (1.0 - cfg.dropout)


def residual(cfg: ModelConfig, norm: Norm, x: jax.Array, sublayer: Callable[[jax.Array], jax.Array],
             dropout_mask: jax.Array | None = None, post_norm: Norm | None = None) -> jax.Array:
    """post-LN: Norm(x + Dropout(Sublayer(x)));  pre-LN: x + Dropout(Sublayer(Norm(x)));
    with post norms (Gemma): x + Dropout(PostNorm(Sublayer(Norm(x))));  output: x + Dropout(Norm(Sublayer(x)))
    (OLMo 2)."""
    if cfg.norm_position == "post":
        return norm(x + dropout(cfg, sublayer(x), dropout_mask))
    if cfg.norm_position == "output":
        return x + dropout(cfg, norm(sublayer(x)), dropout_mask)
    out = sublayer(norm(x))
    if post_norm is not None:
        out = post_norm(out)
    return x + dropout(cfg, out, dropout_mask)


def block(cfg: ModelConfig, layer: nnx.Module, name: str, x: jax.Array, sublayer: Callable[[jax.Array], jax.Array],
          dropout_mask: jax.Array | None = None) -> jax.Array:
    """The residual block of a layer's sublayer `name` (self_attn, cross_attn, ffn) with its norms:
    {name}_norm, and {name}_post_norm where the config has post norms."""
    return residual(cfg, getattr(layer, f"{name}_norm"), x, sublayer, dropout_mask,
                    getattr(layer, f"{name}_post_norm", None))


# ---- gated DeltaNet: linear attention with a recurrent state (SPEC §5.15: Qwen3.5, Qwen3-Next) ---
# The golden runs the recurrence token by token. A prefill here takes the chunked form deployments
# run (SPEC §5.15): C tokens at a time, a chunk's writes solved together as one unit lower-triangular
# system, the state carried from chunk to chunk. A decode step of one token runs the recurrence.

@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LinearState:
    """What a linear layer keeps between tokens: each convolution's last K − 1 real inputs (zeros
    before the first), and each value head's state."""

    windows: tuple[jax.Array, jax.Array, jax.Array]  # q, k, v: [B, K − 1, H_k·d_k or H_v·d_v]
    recurrent: jax.Array  # S [B, H_v, d_k, d_v], float32 at least (state_dtype)


def state_dtype(dtype):
    """S and the recurrence's arithmetic: float32 at half precision, as the reference kernels keep it."""
    return jnp.promote_types(dtype, jnp.float32)


def start_linear_state(cfg: ModelConfig, batch: int, dtype) -> LinearState:
    """The state before the first token: zero windows and zero S."""
    mixer = cfg.linear_attention
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    window = (batch, mixer.conv_kernel - 1)
    return LinearState((jnp.zeros((*window, keys), dtype), jnp.zeros((*window, keys), dtype),
                        jnp.zeros((*window, values), dtype)),
                       jnp.zeros((batch, mixer.value_heads, mixer.key_head_dim, mixer.value_head_dim),
                                 state_dtype(dtype)))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / √(Σ x² + ε) over the last axis."""
    return x * lax.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def short_convolution(window: jax.Array, u: jax.Array, keep: jax.Array, kernel: jax.Array,
                      precision: str) -> tuple[jax.Array, jax.Array]:
    """A causal depthwise convolution over the real tokens, c[j] = Σ_i kernel[j, i] · u[j] of the
    K − 1 real tokens before and the token itself (the window's first), and the window moved on past
    the last real token. window [B, K − 1, C], u [B, T, C], keep [B, T], kernel [C, K]
    -> (c [B, T, C]: anything at pads, window [B, K − 1, C])"""
    batch, length, channels = u.shape
    # the golden moves the window one real token at a time; here the real tokens are packed to the
    # front of their row (pads to a spare slot past the end), convolved in one call, and read back
    rank = jnp.cumsum(keep.astype(jnp.int32), axis=1) - 1  # [B, T]: each real token's place among the real ones
    slot = jnp.where(keep, rank, length)
    rows = jnp.arange(batch)[:, None]
    packed = jnp.zeros((batch, length + 1, channels), u.dtype).at[rows, slot].set(u)[:, :length]
    inputs = jnp.concatenate([window, packed], axis=1)  # [B, K − 1 + T, C]
    c = lax.conv_general_dilated(inputs, kernel.T[:, None, :], window_strides=(1,), padding="VALID",
                                 dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=channels,
                                 precision=precision)  # [B, T, C] packed
    c = jnp.take_along_axis(c, jnp.maximum(rank, 0)[..., None], axis=1)
    last = keep.sum(axis=1)[:, None] + jnp.arange(window.shape[1])  # [B, K − 1]
    return c, jnp.take_along_axis(inputs, last[..., None], axis=1)


def gated_delta_rule(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array,
                     beta: jax.Array, precision: str) -> tuple[jax.Array, jax.Array]:
    """S ← e^g S + β k (v − e^g Sᵀ k)ᵀ, o = Sᵀ q. state [B, H, d_k, d_v], q and k [B, H, d_k],
    v [B, H, d_v], decay (g) and beta [B, H] -> (o [B, H, d_v], state)"""
    state = jnp.exp(decay)[..., None, None] * state
    written = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", state, k, precision=precision))
    state = state + jnp.einsum("bhk,bhv->bhkv", k, written, precision=precision)
    return jnp.einsum("bhkv,bhk->bhv", state, q, precision=precision), state


def scanned(step: Callable, state: jax.Array, sequence: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """step(state, item) -> (state, output) along axis 2 of every tensor of sequence ([B, H, N, ..]),
    -> (the last state, the outputs [B, H, N, ..])."""
    # lax.scan compiles the step once, where a Python loop would unroll N copies of it into the program
    state, outputs = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 2, 0) for t in sequence))
    return state, jnp.moveaxis(outputs, 0, 2)


def token_by_token(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array, beta: jax.Array,
                   precision: str) -> tuple[jax.Array, jax.Array]:
    """The recurrence over T tokens, one at a time (gated_delta_rule). q and k [B, H, T, d_k],
    v [B, H, T, d_v], decay and beta [B, H, T] -> (o [B, H, T, d_v], state)"""
    def step(state: jax.Array, token: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        output, state = gated_delta_rule(state, *token, precision)
        return state, output

    state, outputs = scanned(step, state, (q, k, v, decay, beta))
    return outputs, state


def decay_ratios(decay: jax.Array) -> jax.Array:
    """Γ_t / Γ_s = exp(Σ_{s<r≤t} g_r) for s ≤ t within a chunk, 0 above the diagonal. [.., C] -> [.., C, C]"""
    size = decay.shape[-1]
    below = jnp.tril(jnp.ones((size, size), bool), -1)
    # each sum taken over its own terms, not as a difference of two cumulative sums: those reach
    # hundreds within a chunk, and their difference would keep only float32's absolute accuracy
    sums = jnp.cumsum(jnp.where(below, decay[..., :, None], 0.0), axis=-2)  # [t, s] = Σ_{s<r≤t} g_r
    return jnp.where(below | jnp.eye(size, dtype=bool), jnp.exp(sums), 0.0)


def chunked_gated_delta_rule(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array,
                             beta: jax.Array, chunk_size: int, precision: str) -> tuple[jax.Array, jax.Array]:
    """The recurrence over T tokens, C at a time (SPEC §5.15's chunked form). Within a chunk from S₀,
    with Γ_t = Π_{s≤t} e^{g_s}, the writes u_t = β_t (v_t − e^{g_t} S_{t−1}ᵀ k_t) solve
    (I + L) U = β ⊙ (V − Γ ⊙ K S₀), L_ts = β_t (Γ_t/Γ_s) k_t·k_s for s < t; then
    O = (Γ ⊙ Q) S₀ + ((Γ_t/Γ_s)_{s≤t} ⊙ Q Kᵀ) U and S_C = Γ_C S₀ + (K ⊙ Γ_C/Γ)ᵀ U.
    state [B, H, d_k, d_v], q and k [B, H, T, d_k], v [B, H, T, d_v], decay (g) and beta [B, H, T]
    -> (o [B, H, T, d_v], state)"""
    length, size = q.shape[2], chunk_size
    chunks = (length + size - 1) // size  # N
    spare = chunks * size - length
    matmul = partial(jnp.matmul, precision=precision)
    # the last chunk filled out with tokens that write nothing (β = 0) and keep the state (g = 0)
    batch, heads = q.shape[:2]
    q, k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, spare), (0, 0))).reshape(batch, heads, chunks, size, t.shape[-1])
               for t in (q, k, v))  # [B, H, N, C, d]
    decay, beta = (jnp.pad(t, ((0, 0), (0, 0), (0, spare))).reshape(batch, heads, chunks, size)
                   for t in (decay, beta))  # [B, H, N, C]
    ratios = decay_ratios(decay)  # [B, H, N, C, C]
    growth = jnp.exp(jnp.cumsum(decay, axis=-1))  # Γ_t [B, H, N, C]
    strict = jnp.tril(jnp.ones((size, size), bool), -1)
    system = jnp.eye(size, dtype=q.dtype) + jnp.where(
        strict, beta[..., :, None] * ratios * matmul(k, k.swapaxes(-1, -2)), 0.0)  # I + L
    # the writes, less what the state reads: U = Y − W S₀ (W and Y solved together, for every chunk at once)
    solved = jax.scipy.linalg.solve_triangular(system, jnp.concatenate(
        [(beta * growth)[..., None] * k, beta[..., None] * v], axis=-1), lower=True, unit_diagonal=True)
    reads, values = solved[..., :k.shape[-1]], solved[..., k.shape[-1]:]
    scores = ratios * matmul(q, k.swapaxes(-1, -2))  # [B, H, N, C, C]
    left = ratios[..., -1, :]  # Γ_C / Γ_s [B, H, N, C]
    state, outputs = scanned(partial(chunk_recurrence, precision=precision), state,
                             (values, reads, growth, q, scores, left, k))
    return outputs.reshape(batch, heads, -1, v.shape[-1])[:, :, :length], state


def chunk_recurrence(state: jax.Array, chunk: tuple[jax.Array, ...], precision: str) -> tuple[jax.Array, jax.Array]:
    """One chunk of chunked_gated_delta_rule from S₀: U = Y − W S₀, O = (Γ ⊙ Q) S₀ + scores U,
    S_C = Γ_C S₀ + (K ⊙ Γ_C/Γ)ᵀ U. state [B, H, d_k, d_v]; the chunk's values (Y), reads (W), growth (Γ),
    q, scores, left (Γ_C/Γ) and k, each [B, H, C, ..] -> (S_C, O [B, H, C, d_v])"""
    values, reads, growth, q, scores, left, k = chunk
    matmul = partial(jnp.matmul, precision=precision)
    written = values - matmul(reads, state)  # U [B, H, C, d_v]
    output = matmul(growth[..., None] * q, state) + matmul(scores, written)
    return growth[..., -1, None, None] * state + matmul((left[..., None] * k).swapaxes(-1, -2), written), output


class ShortConvolution(nnx.Module):
    """q's, k's or v's causal depthwise convolution, its weight [channels, K] as the spec stores it
    (a module so that its path is the canonical q_conv.weight)."""

    def __init__(self, channels: int, kernel: int, precision: str, dtype):
        self.weight = nnx.Param(jnp.zeros((channels, kernel), dtype))
        self.precision = precision

    def __call__(self, window: jax.Array, u: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
        return short_convolution(window, u, keep, self.weight[...], self.precision)


class Decay(Linear):
    """g = −exp(log_rate) · softplus(x W_decay + b_decay) ≤ 0 per value head: a Linear (its kernel
    the canonical decay.weight) with the log rate beside it."""

    def __init__(self, d_model: int, heads: int, precision: str, dtype, rngs: nnx.Rngs):
        super().__init__(d_model, heads, use_bias=True, dtype=dtype, param_dtype=dtype, precision=precision,
                         rngs=rngs)
        self.log_rate = nnx.Param(jnp.zeros(heads, dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        # in float32 at least, as the reference kernels take g: a half-precision softplus would
        # round the decay that every later token's state is multiplied by
        wide = state_dtype(x.dtype)
        logits = jnp.matmul(x, self.kernel[...], precision=self.precision, preferred_element_type=wide)
        return -jnp.exp(self.log_rate[...].astype(wide)) * jax.nn.softplus(logits + self.bias[...].astype(wide))


class GatedRMSNorm(nnx.Module):
    """RMSNorm(o) γ ⊙ SiLU(gate) over each head's d_v (γ as stored, never 1 + γ)."""

    def __init__(self, cfg: ModelConfig, dtype):
        self.scale = nnx.Param(jnp.ones(cfg.linear_attention.value_head_dim, dtype))
        self.eps = float(cfg.norm_eps)

    def __call__(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        return rms_norm(o, self.scale[...], None, self.eps) * jax.nn.silu(gate)


class GatedDeltaNet(nnx.Module):
    """A linear layer's mixer (SPEC §5.15); cfg: the model's."""

    def __init__(self, cfg: ModelConfig, precision: str, dtype, rngs: nnx.Rngs):
        mixer, d = cfg.linear_attention, cfg.d_model
        keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
        self.cfg, self.precision = cfg, precision
        linear = partial(Linear, use_bias=False, dtype=dtype, param_dtype=dtype, precision=precision, rngs=rngs)
        self.q = linear(d, keys)
        self.k = linear(d, keys)
        self.v = linear(d, values)
        self.q_conv = ShortConvolution(keys, mixer.conv_kernel, precision, dtype)
        self.k_conv = ShortConvolution(keys, mixer.conv_kernel, precision, dtype)
        self.v_conv = ShortConvolution(values, mixer.conv_kernel, precision, dtype)
        self.z = linear(d, values)
        self.beta = linear(d, mixer.value_heads)
        self.decay = Decay(d, mixer.value_heads, precision, dtype, rngs)
        self.norm = GatedRMSNorm(cfg, dtype)
        self.o = linear(values, d)

    def __call__(self, x: jax.Array, keep: jax.Array,
                 state: LinearState | None = None) -> tuple[jax.Array, LinearState]:
        """The mixer over x from state (the start's where None): one token by the recurrence, more
        in chunks; pads move nothing and give zeros. x [B, T, d], keep [B, T] -> ([B, T, d], state)"""
        mixer = self.cfg.linear_attention
        batch, length = x.shape[:2]
        state = start_linear_state(self.cfg, batch, x.dtype) if state is None else state
        wide = state_dtype(x.dtype)
        projected = [self.q(x), self.k(x), self.v(x)]  # [B, T, H·d]
        convolutions = [self.q_conv, self.k_conv, self.v_conv]
        # a pad writes nothing (β = 0) and keeps S (g = 0): the recurrence needs no mask beyond these
        beta = jnp.where(keep[..., None], jax.nn.sigmoid(self.beta(x)), 0.0).astype(wide).swapaxes(1, 2)  # [B, H_v, T]
        decay = jnp.where(keep[..., None], self.decay(x), 0.0).swapaxes(1, 2)  # g ≤ 0 [B, H_v, T]
        mixed, windows = [], []
        for u, convolution, window in zip(projected, convolutions, state.windows):
            c, moved = convolution(window, u, keep)
            mixed.append(jax.nn.silu(c))
            windows.append(moved)
        q = l2_normalize(split_heads(mixed[0], mixer.key_heads).astype(wide)) / math.sqrt(mixer.key_head_dim)
        k = l2_normalize(split_heads(mixed[1], mixer.key_heads).astype(wide))
        v = split_heads(mixed[2], mixer.value_heads).astype(wide)  # [B, H_v, T, d_v]
        q, k = group_heads(q, mixer.value_heads), group_heads(k, mixer.value_heads)  # value head h reads h // groups
        if length == 1:
            o, recurrent = token_by_token(state.recurrent, q, k, v, decay, beta, self.precision)
        else:
            o, recurrent = chunked_gated_delta_rule(state.recurrent, q, k, v, decay, beta, mixer.chunk_size,
                                                    self.precision)
        outputs = jnp.where(keep[..., None, None], o.swapaxes(1, 2).astype(x.dtype), 0.0)  # [B, T, H_v, d_v]
        gate = split_heads(self.z(x), mixer.value_heads).swapaxes(1, 2)  # [B, T, H_v, d_v]
        heads = self.norm(outputs, gate)
        return self.o(heads.reshape(batch, length, -1)), LinearState(tuple(windows), recurrent)


# ---- layers and stacks ----------------------------------------------------------------------

class EncoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, path: str, precision: str, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.self_attn = MultiHeadAttention(cfg, path, precision, dtype, rngs)
        self.self_attn_norm = Norm(cfg, dtype)
        self.ffn = FeedForward(cfg, precision, dtype, rngs)
        self.ffn_norm = Norm(cfg, dtype)

    def ffn_block(self, x: jax.Array, dropout_mask: jax.Array | None = None) -> jax.Array:
        return block(self.cfg, self, "ffn", x, self.ffn, dropout_mask)

    def __call__(self, x: jax.Array, mask, dropout_masks: dict | None = None) -> jax.Array:
        """x = Block(x, SelfAttention); x = Block(x, FFN). x [B, S, d]; dropout_masks by block name."""
        drop = dropout_masks or {}
        x = block(self.cfg, self, "self_attn", x, lambda h: self.self_attn(h, h, mask), drop.get("self_attn"))
        return self.ffn_block(x, drop.get("ffn"))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, path: str, precision: str, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.self_attn = MultiHeadAttention(cfg, path, precision, dtype, rngs)
        self.self_attn_norm = Norm(cfg, dtype)
        self.self_attn_post_norm = Norm(cfg, dtype) if cfg.post_norms else None
        if cfg.has_encoder:
            self.cross_attn = MultiHeadAttention(cfg, path, precision, dtype, rngs, self_attention=False)
            self.cross_attn_norm = Norm(cfg, dtype)
        self.ffn = layer_ffn(cfg, path, precision, dtype, rngs)
        self.ffn_norm = Norm(cfg, dtype)
        self.ffn_post_norm = Norm(cfg, dtype) if cfg.post_norms else None

    def ffn_block(self, x: jax.Array, dropout_mask: jax.Array | None = None) -> jax.Array:
        return block(self.cfg, self, "ffn", x, self.ffn, dropout_mask)

    def __call__(self, y: jax.Array, memory: jax.Array | None, self_mask, cross_mask,
                 dropout_masks: dict | None = None) -> jax.Array:
        """y = Block(y, masked SelfAttention); y = Block(y, CrossAttention) [encoder-decoder];
        y = Block(y, FFN). y [B, T, d], memory [B, S, d]; dropout_masks by block name."""
        drop = dropout_masks or {}
        y = block(self.cfg, self, "self_attn", y, lambda h: self.self_attn(h, h, self_mask), drop.get("self_attn"))
        if memory is not None:
            y = block(self.cfg, self, "cross_attn", y, lambda h: self.cross_attn(h, memory, cross_mask),
                      drop.get("cross_attn"))
        return self.ffn_block(y, drop.get("ffn"))


class LinearLayer(nnx.Module):
    """A hybrid's linear layer (SPEC §5.15): y = Block(y, gated DeltaNet); y = Block(y, FFN), the
    mixer's state carried from `state`. cfg: the model's (its linear_attention)."""

    def __init__(self, cfg: ModelConfig, path: str, precision: str, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.linear_attn = GatedDeltaNet(cfg, precision, dtype, rngs)
        self.linear_attn_norm = Norm(cfg, dtype)
        self.ffn = layer_ffn(cfg, path, precision, dtype, rngs)
        self.ffn_norm = Norm(cfg, dtype)

    def ffn_block(self, x: jax.Array, dropout_mask: jax.Array | None = None) -> jax.Array:
        return block(self.cfg, self, "ffn", x, self.ffn, dropout_mask)

    def __call__(self, y: jax.Array, keep: jax.Array,
                 state: LinearState | None = None) -> tuple[jax.Array, LinearState]:
        """y [B, T, d], keep [B, T] -> ([B, T, d], the mixer's state after the last token)"""
        after = []

        def mix(h: jax.Array) -> jax.Array:
            out, moved = self.linear_attn(h, keep, state)
            after.append(moved)
            return out

        y = block(self.cfg, self, "linear_attn", y, mix)
        return self.ffn_block(y), after[0]


class Stack(nnx.Module):
    """The encoder or the decoder: its layers and, with cfg.final_norm, the norm after them (with
    cfg.embed_norm, the norm of its embeddings too)."""

    def __init__(self, cfg: ModelConfig, layer: type, count: int, path: str, precision: str, dtype, rngs: nnx.Rngs):
        self.embed_norm = Norm(cfg, dtype) if cfg.embed_norm else None
        # each decoder layer with its own config (its window, its rotary: SPEC §6)
        layer_config = cfg.layer if layer is DecoderLayer else (lambda i: cfg)

        def make(index: int) -> nnx.Module:
            if layer is DecoderLayer and cfg.layer_kind(index) == "linear":
                return LinearLayer(cfg, path, precision, dtype, rngs)  # the model's config: its mixer is the model's
            return layer(layer_config(index), path, precision, dtype, rngs)

        self.layers = nnx.List([make(i) for i in range(count)])
        for index, each in enumerate(self.layers):
            if isinstance(getattr(each, "ffn", None), MixtureOfExperts):
                each.ffn.index = index
        self.norm = Norm(cfg, dtype) if cfg.final_norm else None

    def embedding_norm(self, x: jax.Array) -> jax.Array:
        return x if self.embed_norm is None else self.embed_norm(x)

    def final_norm(self, x: jax.Array) -> jax.Array:
        return x if self.norm is None else self.norm(x)


class Head(nnx.Module):
    """logits = softcap(h W_head + b), the final cap where the config has one. Tied: W_head = E_tgtᵀ,
    and only the bias (if any) lives here."""

    def __init__(self, cfg: ModelConfig, precision: str, dtype):
        self.precision, self.cap = precision, cfg.final_softcap
        self.weight = None if cfg.tie_head else nnx.Param(jnp.zeros((cfg.d_model, cfg.tgt_vocab_size), dtype))
        self.bias = nnx.Param(jnp.zeros(cfg.tgt_vocab_size, dtype)) if cfg.head_bias else None

    def __call__(self, h: jax.Array, tied_table: jax.Array) -> jax.Array:
        weight = tied_table.T if self.weight is None else self.weight[...]  # [d, V]
        logits = jnp.matmul(h, weight, precision=self.precision)
        return softcap(logits if self.bias is None else logits + self.bias[...], self.cap)


def _key_mask(keep: jax.Array) -> jax.Array:
    """[B, K] real tokens -> [B, 1, 1, K]"""
    return keep[:, None, None, :]


def _causal_mask(q_len: int, k_len: int, window: int | None = None) -> jax.Array:
    """Query i (position k_len - q_len + i) sees keys j <= that position, and within a sliding
    window of W only j > that position - W: [1, 1, Q, K]"""
    offset = k_len - q_len
    keep = jnp.tril(jnp.ones((q_len, k_len), dtype=bool), k=offset)
    if window is not None:
        keep = jnp.triu(keep, k=offset - window + 1)
    return keep[None, None]


def view_mask(mask, batch: int, heads: int, q_len: int, k_len: int, name: str = "mask"):
    """Check a user keep-mask with the spec's rule and view it as [B|1, H|1, Q|1, K]."""
    if mask is None:
        return None
    if not all(isinstance(n, int) for n in (batch, q_len, k_len)):
        # symbolic shapes (an ONNX export): checking would need their values. The masks met
        # there are the model's own [B|1, 1, Q|1, K] ones; the ONNX runner checks user inputs.
        return mask
    return jnp.reshape(mask, mask_shape_4d(mask, batch, heads, q_len, k_len, name))


# ---- the training loss ----------------------------------------------------------------------

def smoothed_targets(targets: jax.Array, vocab_size: int, pad_id: int, label_smoothing: float, dtype) -> jax.Array:
    """q = 1 − ε on the target token, 0 on pad, ε / (V − 2) on every other token. targets [B, T] -> [B, T, V]"""
    other = label_smoothing / (vocab_size - 2) if label_smoothing else 0.0
    q = jnp.full((*targets.shape, vocab_size), other, dtype=dtype).at[..., pad_id].set(0.0)
    # optax.smooth_labels spreads ε / V over every token, pad and target included: not the spec's q
    return jnp.where(jax.nn.one_hot(targets, vocab_size, dtype=bool), 1.0 - label_smoothing, q)


def token_cross_entropy(cfg: ModelConfig, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """L = (1/N) Σ_t −Σ_j q_tj log softmax(logits_t)_j over the N non-pad targets (0 when N = 0)."""
    real = targets != cfg.pad_id  # [B, T]
    # half-precision log-probabilities are too coarse: the loss is taken in float32 at least
    logits = logits.astype(jnp.float32) if logits.dtype in _HALF else logits
    q = smoothed_targets(targets, cfg.tgt_vocab_size, cfg.pad_id, float(cfg.label_smoothing), logits.dtype)
    per_token = optax.softmax_cross_entropy(logits, q)  # [B, T]
    return (per_token * real).sum() / jnp.maximum(real.sum(), 1)


def load_balancing_loss(probabilities: list[jax.Array], chosen: list[jax.Array], keep: jax.Array) -> jax.Array:
    """aux = E · Σ_e f_e · P_e over the L layers and the N real tokens (keep [B, T]; 0 when N = 0):
    f_e the share of their choices that went to e (constants), P_e their mean probability of e.
    probabilities [N, E] and chosen [N, k] per layer."""
    experts = probabilities[0].shape[-1]
    # half-precision sums of probabilities are too coarse: the loss is taken in float32 at least
    dtype = jnp.promote_types(probabilities[0].dtype, jnp.float32)
    keep = keep.reshape(-1, 1).astype(dtype)  # [N, 1]
    count = jnp.maximum(len(probabilities) * keep.sum(), 1)
    shares = sum((jax.nn.one_hot(layer, experts, dtype=dtype).sum(axis=-2) * keep).sum(axis=0) for layer in chosen) / count
    mean_probability = sum((layer.astype(dtype) * keep).sum(axis=0) for layer in probabilities) / count
    return experts * (shares * mean_probability).sum()


def training_loss(cfg: ModelConfig, logits: jax.Array, targets, tgt_ids,
                  routed: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """The loss a training step minimises: token_cross_entropy of the teacher-forced logits, plus α
    times a mixture of experts' load-balancing loss over the real target-side tokens of tgt_ids
    (α = moe.load_balancing, SPEC §5.14), from the routing the forward recorded (recorded_routers)."""
    loss = token_cross_entropy(cfg, logits, jnp.asarray(targets))
    if cfg.moe is None or not cfg.moe.load_balancing:
        return loss
    check_recorded_routing(cfg, len(routed))
    keep = on_device(real_tokens(cfg, np.asarray(tgt_ids), "tgt"))
    return loss + cfg.moe.load_balancing * load_balancing_loss([p for p, _ in routed], [c for _, c in routed], keep)


# ---- the whole model ------------------------------------------------------------------------

class Transformer(nnx.Module):
    """The spec's model. ``model(src_ids, tgt_ids)`` -> logits [B, T, V] (decoder-only: src_ids=None)."""

    def __init__(self, cfg: ModelConfig, *, attention: str = "sdpa", precision: str = "highest",
                 dtype: str = "float32", rngs: nnx.Rngs | None = None):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, got {attention!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError("a float64 model needs JAX's x64 mode: build and run it inside "
                             "`with jax.enable_x64(True):` (JAX would silently use float32)")
        # Precision governs float32/float64 matmuls; half-precision inputs are multiplied as they
        # are (XLA on CPU refuses 'highest' for float16 dot products with float32 results).
        if dtype in ("float16", "bfloat16"):
            precision = "default"
        self.cfg, self.precision, self.dtype = cfg, precision, DTYPES[dtype]
        rngs = rngs or nnx.Rngs(0)
        embed = partial(nnx.Embed, features=cfg.d_model, dtype=self.dtype, param_dtype=self.dtype, rngs=rngs)
        self.src_embed = embed(cfg.src_vocab_size) if cfg.has_encoder and not cfg.share_src_tgt_embed else None
        self.tgt_embed = embed(cfg.tgt_vocab_size)
        learned = cfg.positional == "learned"
        self.src_pos = embed(cfg.max_len) if learned and cfg.has_encoder else None
        self.tgt_pos = embed(cfg.max_len) if learned else None
        self.encoder = (Stack(cfg, EncoderLayer, cfg.n_encoder_layers, attention, precision, self.dtype, rngs)
                        if cfg.has_encoder else None)
        self.decoder = Stack(cfg, DecoderLayer, cfg.n_decoder_layers, attention, precision, self.dtype, rngs)
        self.head = Head(cfg, precision, self.dtype)

    # ---- loading ----
    @classmethod
    def from_params(cls, cfg: ModelConfig, params: Mapping[str, np.ndarray], **options) -> "Transformer":
        """Build from canonical float32 NumPy parameters (checked against the spec first).
        options: attention ('sdpa' | 'math'), precision ('highest' | 'default'), dtype."""
        check_params(cfg, params)
        # Built from shapes alone: the constructor's random initialisation compiles and runs some
        # 20 XLA programs (threefry, truncated normal, one per weight shape) for weights that are
        # replaced at once, ~0.6 s of every load and ~1.5 s of a first load with empty caches.
        model = nnx.eval_shape(lambda: cls(cfg, **options))
        for name, shape in param_shapes(cfg).items():
            variable = _variable(model, name)
            if tuple(variable.shape) != shape or variable.dtype != model.dtype:
                raise AssertionError(f"impl_jax builds {name} as {variable.dtype}{list(variable.shape)}, "
                                     f"the spec says {np.dtype(model.dtype)}{list(shape)}")
            variable.set_value(on_device(params[name], model.dtype))
        return model

    @classmethod
    def from_file(cls, path, **options) -> "Transformer":
        cfg, params = load_weights(path)
        return cls.from_params(cfg, params, **options)

    def to_params(self) -> dict[str, np.ndarray]:
        """Canonical float32 parameters (bit-exact round trip from float32 or float64 models)."""
        return {name: np.asarray(_variable(self, name)[...], dtype=np.float32) for name in param_shapes(self.cfg)}

    @contextlib.contextmanager
    def routing_log(self, forced: list[np.ndarray] | None = None,
                    forced_weights: list[np.ndarray] | None = None) -> Iterator[RoutingLog]:
        """Inside, every MoE layer logs its choices, or takes the forced ones (replayed routing).
        The layers see the log when they are traced: the compiled programs are traced again inside
        (with the host callbacks) and after (without them)."""
        log = RoutingLog(forced, forced_weights)
        jax.clear_caches()
        token = _ROUTING.set(log)
        try:
            yield log
        finally:
            _ROUTING.reset(token)
            jax.clear_caches()

    def routing_log_in_use(self) -> RoutingLog | None:
        """The routing log the MoE layers write to now, if any (a trainer tells it of each step)."""
        return _ROUTING.get()

    def decoder_self_masks(self, tgt_keep: jax.Array) -> dict[int | None, jax.Array]:
        """The decoder's self-attention masks over real tokens tgt_keep [B, T], by window, one for
        each window its layers have (None: full causal): {W: [B, 1, T, T]}"""
        length = tgt_keep.shape[1]
        return {window: _causal_mask(length, length, window) & _key_mask(tgt_keep)
                for window in set(self.cfg.layer_windows)}

    # ---- pieces the harness drives one by one ----
    def decoder_self_mask(self, index: int, tgt_keep: jax.Array) -> jax.Array:
        """Decoder layer `index`'s self-attention mask, as decode builds it: [B, 1, T, T]"""
        return self.decoder_self_masks(tgt_keep)[self.decoder.layers[index].cfg.sliding_window]

    def _table(self, side: str) -> nnx.Embed:
        return self.src_embed if side == "src" and self.src_embed is not None else self.tgt_embed

    def positional_encoding(self, side: str, length: int, offset=0, table_rows: int | None = None) -> jax.Array:
        """[T, d] for positions offset..offset+length-1; zeros for RoPE, whose positions enter the
        attention instead (rotary). A traced offset (inside the jitted decode step) or a symbolic
        length (an ONNX export) slices a table of table_rows positions (default max_len) made on
        the host."""
        if self.cfg.positional == "rope":
            return jnp.zeros((length, self.cfg.d_model), self.dtype)
        if self.cfg.positional == "learned":
            table = getattr(self, f"{side}_pos").embedding[...]
            return lax.dynamic_slice_in_dim(table, offset, length, axis=0)
        if isinstance(offset, int) and isinstance(length, int):
            return on_device(sinusoidal_table(np.arange(offset, offset + length), self.cfg.d_model,
                                              self.cfg.positional), self.dtype)
        rows = self.cfg.max_len if table_rows is None else table_rows
        table = jnp.asarray(sinusoidal_table(np.arange(rows), self.cfg.d_model, self.cfg.positional), self.dtype)
        return lax.dynamic_slice_in_dim(table, offset, length, axis=0)

    def embed(self, ids: jax.Array, side: str, offset=0, table_rows: int | None = None,
              dropout_mask: jax.Array | None = None) -> jax.Array:
        """x = Dropout(E[ids] (· √d) + PE[positions]), then Norm(x) when cfg.embed_norm. [B, T] -> [B, T, d]"""
        x = token_embedding(ids, self._table(side), self.cfg.embed_scale)
        if self.cfg.positional != "rope":
            x = x + self.positional_encoding(side, ids.shape[1], offset, table_rows)[None]
        x = dropout(self.cfg, x, dropout_mask)
        return (self.encoder if side == "src" else self.decoder).embedding_norm(x)

    def encode(self, src_ids: jax.Array, src_keep: jax.Array, dropout_masks: dict | None = None) -> jax.Array:
        """memory [B, S, d]; dropout_masks by site (spec.dropout.dropout_sites)"""
        x = self.embed(src_ids, "src", dropout_mask=(dropout_masks or {}).get("encoder.embed"))
        mask = _key_mask(src_keep)
        for i, layer in enumerate(self.encoder.layers):
            x = layer(x, mask, masks_under(dropout_masks, f"encoder.layers.{i}"))
        return self.encoder.final_norm(x)

    def decode(self, tgt_ids: jax.Array, tgt_keep: jax.Array, memory: jax.Array | None = None,
               src_keep: jax.Array | None = None, dropout_masks: dict | None = None) -> jax.Array:
        """Decoder output [B, T, d] before the head; dropout_masks by site."""
        y = self.embed(tgt_ids, "tgt", dropout_mask=(dropout_masks or {}).get("decoder.embed"))
        self_masks = self.decoder_self_masks(tgt_keep)
        cross_mask = None if memory is None else _key_mask(src_keep)
        for i, layer in enumerate(self.decoder.layers):
            if isinstance(layer, LinearLayer):  # its own state from zeros; it reads the keep-vector, no mask
                y, _ = layer(y, tgt_keep)
                continue
            y = layer(y, memory, self_masks[layer.cfg.sliding_window], cross_mask,
                      masks_under(dropout_masks, f"decoder.layers.{i}"))
        return self.decoder.final_norm(y)

    def output_logits(self, h: jax.Array) -> jax.Array:
        return self.head(h, self.tgt_embed.embedding[...])

    def log_probs(self, h: jax.Array) -> jax.Array:
        """log_softmax in float32 at least: half-precision log-probabilities are too coarse."""
        logits = self.output_logits(h)
        return jax.nn.log_softmax(logits.astype(jnp.float32) if logits.dtype in _HALF else logits).astype(logits.dtype)

    def _keep(self, ids, keep, side: str, offset: int = 0) -> jax.Array:
        """The given keep-vector, else ids != pad_id with an encoder-decoder's start token real;
        worked out on the host, where the ids are."""
        if keep is None:
            return on_device(real_tokens(self.cfg, np.asarray(ids), side, offset))
        check_keep(keep, ids, f"{side}_keep")
        return on_device(keep)

    def __call__(self, src_ids, tgt_ids, src_keep=None, tgt_keep=None, dropout_masks=None) -> jax.Array:
        """Teacher-forced logits [B, T, V]; checked on the host, computed by one jitted function;
        in training mode when dropout keep-masks are given."""
        with jax.default_matmul_precision(self.precision):
            return _bound(self, _forward)(*self._forward_inputs(src_ids, tgt_ids, src_keep, tgt_keep, dropout_masks))

    def routed_call(self, src_ids, tgt_ids, dropout_masks=None) -> tuple[jax.Array, list]:
        """__call__'s logits, and every MoE layer's (probabilities, chosen) as outputs of the
        compiled program: what the load-balancing loss reads (recorded_routers)."""
        with jax.default_matmul_precision(self.precision):
            return _bound(self, _forward_routed)(*self._forward_inputs(src_ids, tgt_ids, None, None, dropout_masks))

    def _forward_inputs(self, src_ids, tgt_ids, src_keep, tgt_keep, dropout_masks) -> tuple:
        check_model_inputs(self.cfg, src_ids, tgt_ids)
        check_dropout_masks(self.cfg, dropout_masks, np.shape(tgt_ids)[0],
                            None if src_ids is None else np.shape(src_ids)[1], np.shape(tgt_ids)[1])
        tgt = _as_ids(tgt_ids)
        tgt_keep = self._keep(tgt_ids, tgt_keep, "tgt")
        src, src_keep = (None, None) if src_ids is None else (_as_ids(src_ids), self._keep(src_ids, src_keep, "src"))
        masks = None if dropout_masks is None else {site: on_device(keep) for site, keep in dropout_masks.items()}
        return src, tgt, src_keep, tgt_keep, masks

    # ---- incremental decoding ----
    def start_cache(self, batch: int, capacity: int, src_ids=None, src_keep=None) -> "KVCache":
        return start_cache(self, batch, capacity, src_ids, src_keep)

    def decode_step(self, cache: "KVCache", tgt_ids, tgt_keep=None) -> tuple[jax.Array, "KVCache"]:
        return decode_step(self, cache, tgt_ids, tgt_keep)

    def greedy_generate(self, src_ids=None, **options) -> jax.Array:
        return greedy_generate(self, src_ids, **options)


def _variable(model: Transformer, name: str) -> nnx.Variable:
    """The nnx variable behind a canonical name: 'encoder.layers.0.ffn.w1.weight' ->
    model.encoder.layers[0].ffn.w1.kernel (nnx.Linear) and '*_embed.weight' -> .embedding."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    if leaf == "weight" and isinstance(module, nnx.Linear):
        leaf = "kernel"
    elif leaf == "weight" and isinstance(module, nnx.Embed):
        leaf = "embedding"
    return getattr(module, leaf)


def on_device(array, dtype=None) -> jax.Array:
    """A host array on the default device, its dtype converted on the host. jnp.asarray would
    compile a small XLA program per shape for the copy (and one more for a dtype change): about
    30 of the ~180 programs a conformance column otherwise compiles."""
    return jax.device_put(np.asarray(array, dtype=dtype))


def _as_ids(ids) -> jax.Array:
    """int32 ids: JAX has int64 only in x64 mode, and the spec's ids fit int32."""
    return on_device(ids, np.int32)


_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bound(model: Transformer, function: Callable) -> Callable:
    """An nnx.jit function with the model's graph traversal done once. nnx.jit walks the whole
    module graph on every call (~8 ms of a tiny decode step's ~11 ms on our CPU, see
    docs/benchmarks.md); nnx.cached_partial walks it once and still sees later assignments to the
    model's variables, because its clones share the same Variable objects."""
    per_model = _BOUND.setdefault(model, {})
    if function not in per_model:
        per_model[function] = nnx.cached_partial(function, model)
    return per_model[function]


def _logits(model: Transformer, src_ids, tgt_ids, src_keep, tgt_keep, dropout_masks=None) -> jax.Array:
    memory = None if src_ids is None else model.encode(src_ids, src_keep, dropout_masks)
    return model.output_logits(model.decode(tgt_ids, tgt_keep, memory, src_keep, dropout_masks))


_forward = nnx.jit(_logits)


@nnx.jit
def _forward_routed(model: Transformer, src_ids, tgt_ids, src_keep, tgt_keep, dropout_masks=None) -> tuple:
    with recorded_routers() as routed:  # set inside the trace: the routing leaves as the program's outputs
        logits = _logits(model, src_ids, tgt_ids, src_keep, tgt_keep, dropout_masks)
    return logits, routed


# ---- incremental decoding with a preallocated KV cache --------------------------------------

@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Preallocated for `capacity` positions, so every decode step has the same shapes and
    compiles once (XLA recompiles for every new shape). L decoder layers, A of them attention layers, C = capacity."""

    self_keys: jax.Array  # [A, B, H_kv, C, d_k], rotated at their positions (RoPE); A attention layers
    self_values: jax.Array  # [A, B, H_kv, C, d_k] (cfg.cached_layers: a layer's row)
    tgt_keep: jax.Array  # [B, C]: real tokens among the decoded positions; False past `length`
    length: jax.Array  # int32 scalar: positions decoded so far
    cross_keys: jax.Array | None = None  # [L, B, H_kv, S, d_k], computed once
    cross_values: jax.Array | None = None
    src_keep: jax.Array | None = None  # [B, S]
    linear_states: tuple[LinearState | None, ...] | None = None  # L: a linear layer's state, else None (§5.15)

    @property
    def capacity(self) -> int:
        return self.tgt_keep.shape[1]


def start_cache(model: Transformer, batch: int, capacity: int, src_ids=None, src_keep=None) -> KVCache:
    """An empty cache of `capacity` positions; for an encoder-decoder, run the encoder once and
    keep each layer's cross-attention K and V of the memory."""
    cfg = model.cfg
    capacity = check_cache_capacity(cfg, capacity)
    rows = sum(row is not None for row in cfg.cached_layers)  # a linear layer keeps no keys or values
    shape = (rows, batch, cfg.kv_heads, capacity, cfg.d_head)
    empty = jnp.zeros(shape, model.dtype)
    states = None if cfg.linear_attention is None else tuple(
        start_linear_state(cfg, batch, model.dtype) if cfg.layer_kind(i) == "linear" else None
        for i in range(cfg.n_decoder_layers))
    cache = KVCache(empty, empty, jnp.zeros((batch, capacity), bool), jnp.zeros((), jnp.int32), linear_states=states)
    if not cfg.has_encoder:
        return cache
    check_source(cfg, src_ids, batch)
    src_keep = model._keep(src_ids, src_keep, "src")
    with jax.default_matmul_precision(model.precision):
        cross_keys, cross_values = _encode_for_cache(model, _as_ids(src_ids), src_keep)
    return KVCache(cache.self_keys, cache.self_values, cache.tgt_keep, cache.length, cross_keys, cross_values, src_keep,
                   cache.linear_states)


@nnx.jit
def _encode_for_cache(model: Transformer, src_ids, src_keep) -> tuple[jax.Array, jax.Array]:
    memory = model.encode(src_ids, src_keep)
    pairs = [layer.cross_attn.key_value_heads(memory) for layer in model.decoder.layers]
    return jnp.stack([k for k, _ in pairs]), jnp.stack([v for _, v in pairs])


def decode_step(model: Transformer, cache: KVCache, tgt_ids, tgt_keep=None) -> tuple[jax.Array, KVCache]:
    """Feed the next n target tokens [B, n] after the cached ones: logits [B, n, V], new cache."""
    cfg = model.cfg
    length = int(cache.length)
    check_decode_step(cfg, tgt_ids, length, cache.tgt_keep.shape[0])
    check_cache_room(cache.capacity, length, np.shape(tgt_ids)[1])
    keep = model._keep(tgt_ids, tgt_keep, "tgt", length)
    with jax.default_matmul_precision(model.precision):
        return _bound(model, _decode_step)(cache, _as_ids(tgt_ids), keep)


def _decode_step_body(model: Transformer, cache: KVCache, tgt_ids: jax.Array, new_keep: jax.Array) -> tuple[jax.Array, KVCache]:
    cfg = model.cfg
    n_new, capacity = tgt_ids.shape[1], cache.capacity
    start = cache.length.astype(jnp.int32)
    zero = jnp.zeros((), jnp.int32)  # lax slice indices must share one integer type (x64 mode makes 0 int64)
    keep = lax.dynamic_update_slice(cache.tgt_keep, new_keep, (zero, start))  # [B, C]
    query_positions = cache.length + jnp.arange(n_new)
    slots = jnp.arange(capacity)[None, :]
    self_masks = {}
    for window in set(cfg.layer_windows):
        causal = slots <= query_positions[:, None]  # [n, C]
        if window is not None:
            causal = causal & (slots > query_positions[:, None] - window)
        self_masks[window] = causal[None, None] & _key_mask(keep)  # [B, 1, n, C]
    cross_mask = None if cache.src_keep is None else _key_mask(cache.src_keep)
    y = model.embed(tgt_ids, "tgt", offset=start, table_rows=capacity)
    positions, _ = attention_positions(cfg, n_new, n_new, start)  # RoPE's: the new ones, after the cached
    keys, values = cache.self_keys, cache.self_values
    states = None if cache.linear_states is None else list(cache.linear_states)
    rows = cfg.cached_layers  # each attention layer's row of the cache
    for i, layer in enumerate(model.decoder.layers):
        if isinstance(layer, LinearLayer):  # its state carried on; no keys or values (§5.15)
            y, states[i] = layer(y, new_keep, states[i])
            continue

        def cached_self_attention(h: jax.Array) -> jax.Array:
            # write K (rotated) and V of the new positions into the preallocated cache at `length`
            nonlocal keys, values
            k, v = layer.self_attn.key_value_heads(h, positions)
            row = rows[i]
            at = (jnp.int32(row), zero, zero, start, zero)
            keys = lax.dynamic_update_slice(keys, k[None], at)
            values = lax.dynamic_update_slice(values, v[None], at)
            return layer.self_attn.attend(h, keys[row], values[row], self_masks[layer.cfg.sliding_window], positions)

        y = block(layer.cfg, layer, "self_attn", y, cached_self_attention)
        if cache.cross_keys is not None:
            y = block(cfg, layer, "cross_attn", y,
                      lambda h: layer.cross_attn.attend(h, cache.cross_keys[i], cache.cross_values[i], cross_mask))
        y = layer.ffn_block(y)
    logits = model.output_logits(model.decoder.final_norm(y))
    new_cache = KVCache(keys, values, keep, cache.length + n_new, cache.cross_keys, cache.cross_values, cache.src_keep,
                        None if states is None else tuple(states))
    return logits, new_cache


_decode_step = nnx.jit(_decode_step_body)


def greedy_generate(model: Transformer, src_ids=None, *, prompt_ids=None, bos_id: int | None = None,
                    eos_id: int | None = None, max_new_tokens: int) -> jax.Array:
    """Greedy decoding with the KV cache, the loop a jitted lax.while_loop -> [B, max_new_tokens]."""
    cfg = model.cfg
    batch, _ = check_generation(cfg, src_ids, prompt_ids, bos_id, max_new_tokens)
    if cfg.has_encoder:
        first = np.full((batch, 1), bos_id, dtype=np.int32)
        first_keep = jnp.ones((batch, 1), bool)
    else:
        first = np.asarray(prompt_ids)
        first_keep = on_device(first != cfg.pad_id)
    total = first.shape[1] + max_new_tokens - 1
    cache = start_cache(model, batch, total, src_ids)
    with jax.default_matmul_precision(model.precision):
        return _generate(model, cache, _as_ids(first), first_keep, -1 if eos_id is None else eos_id, max_new_tokens)


@partial(nnx.jit, static_argnums=(5,))
def _generate(model: Transformer, cache: KVCache, first, first_keep, eos_id, max_new_tokens: int) -> jax.Array:
    pad_id = model.cfg.pad_id
    batch = first.shape[0]

    def choose(logits: jax.Array, finished: jax.Array) -> jax.Array:
        # argmax of float32 logits: ties go to the lowest id, as in the golden
        return jnp.where(finished, pad_id, jnp.argmax(logits[:, -1].astype(jnp.float32), axis=-1).astype(jnp.int32))

    # XLA compiles every call of the step in the program: a single start token (an encoder-
    # decoder's, or a one-token prompt) is fed by the loop's first step, so the program holds one
    # step and compiles in ~60% of the time; only a longer prompt is fed before the loop
    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
    finished = jnp.zeros(batch, bool)
    step, next_ids, next_keep = 0, first, first_keep
    if first.shape[1] > 1:
        logits, cache = _decode_step_body(model, cache, first, first_keep)
        token = choose(logits, finished)
        step, tokens, finished = 1, tokens.at[:, 0].set(token), token == eos_id
        next_ids, next_keep = token[:, None], jnp.ones((batch, 1), bool)

    def keep_going(state) -> jax.Array:
        step, _, _, _, _, finished = state
        return (step < max_new_tokens) & ~finished.all()

    def one_step(state):
        step, cache, tokens, next_ids, next_keep, finished = state
        logits, cache = _decode_step_body(model, cache, next_ids, next_keep)
        token = choose(logits, finished)
        return (step + 1, cache, tokens.at[:, step].set(token), token[:, None], jnp.ones((batch, 1), bool),
                finished | (token == eos_id))

    state = (jnp.asarray(step), cache, tokens, next_ids, next_keep, finished)
    return lax.while_loop(keep_going, one_step, state)[2]
