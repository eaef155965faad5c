"""The golden reference: the Transformer of "Attention Is All You Need" in plain NumPy.

One short function per piece of the paper, the equation in its docstring, shapes in comments
(B batch, S source length, T target length, Q queries, K keys, H heads, d d_model, d_k head
size, V vocabulary). Every function computes in the dtype of its inputs: the golden runs at
float64 (``forward(..., dtype=np.float64)``, from the float32 shared weights upcast), and the
same code at float32 is the ``numpy-float32`` backend. Scalars are Python floats so that
NumPy never promotes a float32 computation to float64 behind our back.

Parameters ``p`` are flat dicts of canonical names (spec.param_shapes) relative to a module,
as ``spec.params_under`` gives them: multi_head_attention(p) reads p["q.weight"], ...
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from spec import ModelConfig, check_params, params_under
from spec.dropout import check_dropout_masks, masks_under
from spec.inputs import check_decode_step, check_generation, check_keep, check_model_inputs, check_source
from spec.masks import decoder_self_mask, key_mask, real_tokens

Params = Mapping[str, np.ndarray]


# ---- small pieces ---------------------------------------------------------------------------

def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x W + b, W stored [in, out] as in the paper."""
    y = x @ weight
    return y if bias is None else y + bias


def relu(x: np.ndarray) -> np.ndarray:
    """max(0, x)"""
    return np.maximum(x, 0)


_erf = np.vectorize(math.erf, otypes=[np.float64])  # NumPy has no erf; math.erf is exact to ~1 ulp


def gelu(x: np.ndarray) -> np.ndarray:
    """x Φ(x) = x (1 + erf(x / √2)) / 2, the exact form."""
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """σ(x) = 1 / (1 + e^(−x)), computed without overflow at either end."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + eˣ) = max(x, 0) + log(1 + e^(−|x|)), without overflow."""
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def swish(x: np.ndarray) -> np.ndarray:
    """x σ(x), written as x (1 + tanh(x/2)) / 2, which cannot overflow."""
    return 0.5 * x * (1.0 + np.tanh(0.5 * x))


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": relu, "gelu": gelu, "gelu-tanh": gelu_tanh, "swish": swish,
}


def softmax(x: np.ndarray, mask: np.ndarray | None = None, sink: np.ndarray | None = None) -> np.ndarray:
    """softmax(x)_j = exp(x_j - m) / Σ_k exp(x_k - m) over the last axis, keeping only entries where
    mask is True; with a sink s (gpt-oss's, broadcast to [.., 1]) the denominator alone takes
    exp(s - m) too (m the largest of them). A row with nothing kept is all zeros (SPEC.md §6), not NaN."""
    if mask is not None:
        x = np.where(mask, x, -np.inf)
    row_max = x.max(axis=-1, keepdims=True)
    if sink is not None:
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0)  # fully masked row: max is -inf
    e = np.exp(x - row_max)
    total = e.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - row_max))
    return e / np.where(total > 0, total, 1)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log softmax(x) = x - max x - log Σ exp(x - max x)"""
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# ---- embeddings and positions ---------------------------------------------------------------

def token_embedding(ids: np.ndarray, weight: np.ndarray, scale: bool) -> np.ndarray:
    """E[ids] · √d_model (the scale when cfg.embed_scale). ids [B, T] -> [B, T, d]"""
    x = weight[ids]
    return x * math.sqrt(weight.shape[1]) if scale else x


def sinusoidal_table(positions: np.ndarray, d_model: int, layout: str) -> np.ndarray:
    """angle(pos, i) = pos / 10000^(2i/d), i = 0..d/2-1, evaluated in float64.
    'sinusoidal': PE[pos, 2i] = sin, PE[pos, 2i+1] = cos (the paper, interleaved).
    'sinusoidal-concat': PE[pos, :d/2] = sin, PE[pos, d/2:] = cos (fairseq/Marian halves)."""
    inverse_frequency = 10000.0 ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # [d/2]
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inverse_frequency[None, :]  # [T, d/2]
    if layout == "sinusoidal":
        return np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(len(positions), d_model)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)


def positional_encoding(cfg: ModelConfig, params: Params, side: str, length: int, offset: int = 0,
                        dtype: np.dtype = np.float64) -> np.ndarray:
    """The encoding of positions offset..offset+length-1 for side 'src' or 'tgt'; zeros for RoPE,
    whose positions enter the attention instead (rotary). -> [T, d]"""
    positions = np.arange(offset, offset + length)
    if cfg.positional == "rope":
        return np.zeros((length, cfg.d_model), dtype)
    if cfg.positional == "learned":
        return params[f"{side}_pos.weight"][positions]
    return sinusoidal_table(positions, cfg.d_model, cfg.positional).astype(dtype)


def embed(cfg: ModelConfig, params: Params, ids: np.ndarray, side: str, offset: int = 0,
          dropout_mask: np.ndarray | None = None) -> np.ndarray:
    """x = Dropout(E[ids] (· √d) + PE[positions]), then Norm(x) when cfg.embed_norm (BART).
    ids [B, T] -> [B, T, d]"""
    table = params["tgt_embed.weight"] if side == "tgt" or cfg.share_src_tgt_embed else params["src_embed.weight"]
    x = token_embedding(ids, table, cfg.embed_scale)
    if cfg.positional != "rope":
        x = x + positional_encoding(cfg, params, side, ids.shape[1], offset, x.dtype)[None]
    x = dropout(cfg, x, dropout_mask)
    stack = "encoder" if side == "src" else "decoder"
    return norm(cfg, params_under(params, f"{stack}.embed_norm"), x) if cfg.embed_norm else x


# ---- attention ------------------------------------------------------------------------------

def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """[B, T, H·d_k] -> [B, H, T, d_k]; head h owns columns h·d_k .. (h+1)·d_k - 1."""
    batch, length, width = x.shape
    return x.reshape(batch, length, n_heads, width // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """[B, H, T, d_k] -> [B, T, H·d_k] (Concat(head_1, ..., head_h))."""
    batch, n_heads, length, d_head = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, n_heads * d_head)


def rope_frequencies(cfg: ModelConfig, length: int | None = None) -> np.ndarray:
    """ω_i = θ^(−2i/r), i = 0..r/2−1, rescaled by cfg.rope_scaling (SPEC §5.12) for a call whose
    length (1 + its largest position) is `length`; None: a call no longer than the original context. -> [r/2]"""
    r, theta, scaling = cfg.rotary_dim, float(cfg.rope_theta), cfg.rope_scaling
    omega = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r)  # [r/2]
    if scaling is None:
        return omega
    if scaling.kind == "linear":
        return omega / scaling.factor  # positions divided by the factor
    if scaling.kind == "llama3":
        return llama3_frequencies(omega, scaling)
    if scaling.kind == "longrope":
        return longrope_frequencies(omega, scaling, length)
    return yarn_frequencies(omega, r, theta, scaling)


def llama3_frequencies(omega: np.ndarray, scaling) -> np.ndarray:
    """Wavelengths λ = 2π/ω longer than L/low_freq_factor are divided by the factor, shorter than
    L/high_freq_factor kept, and between them blended: (1−s)·ω/factor + s·ω with
    s = (L/λ − low_freq_factor) / (high_freq_factor − low_freq_factor), L = original_max_len."""
    length, low, high = scaling.original_max_len, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / omega
    smooth = (length / wavelength - low) / (high - low)
    blended = (1 - smooth) * omega / scaling.factor + smooth * omega
    return np.where(wavelength > length / low, omega / scaling.factor,
                    np.where(wavelength < length / high, omega, blended))


def yarn_frequencies(omega: np.ndarray, r: int, theta: float, scaling) -> np.ndarray:
    """YaRN: pair j is interpolated (ω/factor) by ramp(j) and kept by 1 − ramp(j), the ramp rising
    from 0 to 1 between the dimensions that turn beta_fast and beta_slow times over the original
    context: dim(n) = r · ln(L / (2π·n)) / (2 ln θ)."""
    def dimension(rotations: float) -> float:
        return r * math.log(scaling.original_max_len / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    ramp = np.clip((np.arange(r // 2, dtype=np.float64) - low) / (high - low if high != low else 0.001), 0, 1)
    return omega / scaling.factor * ramp + omega * (1 - ramp)


def longrope_frequencies(omega: np.ndarray, scaling, length: int | None) -> np.ndarray:
    """LongRoPE: ω_i / f_i, f the long factors for a call longer than L = original_max_len
    (ℓ > L, strictly), else the short ones."""
    long = length is not None and length > scaling.original_max_len
    return omega / np.asarray(scaling.long_factor if long else scaling.short_factor, dtype=np.float64)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor on cos and sin (so a²  on the scores): the config's attention_factor where given;
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


def rope_tables(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a·cos and a·sin of angle(pos, i) = pos · ω_i (rope_frequencies for the call's length ℓ =
    1 + its largest position; a = rope_attention_factor), each angle repeated for both halves
    (rotate_half's layout), in float64. positions [T] -> 2 × [T, r]"""
    positions = np.asarray(positions, dtype=np.float64)
    length = int(positions.max()) + 1 if cfg.rotary_reads_length else None
    angles = positions[:, None] * rope_frequencies(cfg, length)[None, :]  # [T, r/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, r]
    factor = rope_attention_factor(cfg)
    if factor == 1:
        return np.cos(angles), np.sin(angles)
    return factor * np.cos(angles), factor * np.sin(angles)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """(x1, x2) -> (−x2, x1), x1 and x2 the two halves of the last axis."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary(cfg: ModelConfig, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """RoPE: the first r dimensions of each head rotate by their position, x_r cos + rotate_half(x_r) sin;
    the others pass (partial rotary). x [B, H, T, d_k], positions [T] -> [B, H, T, d_k]"""
    r = cfg.rotary_dim
    if r == 0:  # a NoPE layer (nope_layers): nothing turns
        return x
    cos, sin = (table.astype(x.dtype) for table in rope_tables(cfg, positions))
    rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return np.concatenate([rotated, x[..., r:]], axis=-1)


def group_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Grouped-query attention: key/value head j serves query heads j·g .. (j+1)·g − 1, g = H / H_kv.
    [B, H_kv, K, d_k] -> [B, H, K, d_k]"""
    return np.repeat(x, n_heads // x.shape[1], axis=1)


def softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    """c · tanh(x / c): x bent smoothly into (−c, c); x itself without a cap."""
    return x if cap is None else cap * np.tanh(x / cap)


def scaled_dot_product_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None,
                                 scale: float | None = None, cap: float | None = None,
                                 sinks: np.ndarray | None = None) -> np.ndarray:
    """Attention(Q, K, V) = softmax(softcap(Q Kᵀ · s)) V, s = 1/√d_k unless given (Gemma's
    1/√query_pre_attention_scalar), the cap taken before the mask (SPEC §5.13); each head's sink
    in its softmax's denominator where given (gpt-oss, SPEC §5.16).
    q [B, H, Q, d_k], k and v [B, H, K, d_k], mask keep [.., Q, K], sinks [H] -> [B, H, Q, d_k]"""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = softcap(q @ np.swapaxes(k, -1, -2) * scale, cap)  # [B, H, Q, K]
    return softmax(scores, mask, None if sinks is None else sinks[:, None, None]) @ v


def head_norm(cfg: ModelConfig, p: Params, name: str, x: np.ndarray) -> np.ndarray:
    """Qwen3's RMSNorm of each head's q or k over d_k (p[name + "_norm.scale"]), when it has one;
    OLMo 2's over all the heads at once (qk_norm_scope "projection"). x [B, H, T, d_k]"""
    scale = p.get(f"{name}_norm.scale")
    if scale is None:
        return x
    if cfg.qk_norm_scope == "projection":  # RMSNorm(x W) [B, T, H·d_k], then the heads
        return split_heads(rms_norm(merge_heads(x), norm_scale(cfg, scale), None, float(cfg.norm_eps)), x.shape[1])
    return rms_norm(x, norm_scale(cfg, scale), None, float(cfg.norm_eps))


def key_value_heads(cfg: ModelConfig, p: Params, context: np.ndarray,
                    positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """K = c W^K + b, V = c W^V + b, split into the H_kv key/value heads; K normed per head (qk_norm)
    and rotated at its positions (RoPE), as a KV cache holds it. context [B, K, d] -> 2 × [B, H_kv, K, d_k]"""
    k = head_norm(cfg, p, "k", split_heads(linear(context, p["k.weight"], p.get("k.bias")), cfg.kv_heads))
    v = split_heads(linear(context, p["v.weight"], p.get("v.bias")), cfg.kv_heads)
    return (k if positions is None else rotary(cfg, k, positions)), v


def attend(cfg: ModelConfig, p: Params, x: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
           positions: np.ndarray | None = None) -> np.ndarray:
    """Concat(head_1..head_h) W^O + b, head_i = Attention(x W_i^Q, K_g(i), V_g(i)), q normed and
    rotated as K is. x [B, Q, d], k and v [B, H_kv, K, d_k] -> [B, Q, d]"""
    q = head_norm(cfg, p, "q", split_heads(linear(x, p["q.weight"], p.get("q.bias")), cfg.n_heads))
    q = q if positions is None else rotary(cfg, q, positions)
    heads = scaled_dot_product_attention(q, group_heads(k, cfg.n_heads), group_heads(v, cfg.n_heads), mask,
                                         cfg.score_scale, cfg.attention_softcap, p.get("sinks"))
    return linear(output_gate(cfg, p, x, merge_heads(heads)), p["o.weight"], p.get("o.bias"))  # heads [B, H, Q, d_k]


def output_gate(cfg: ModelConfig, p: Params, x: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """The gated attention's heads (SPEC §5.15): Concat(head_i) ⊙ σ(x W_gate + b) before W^O; the
    heads as they are without it. x [B, Q, d], heads [B, Q, H·d_k] -> [B, Q, H·d_k]"""
    if not cfg.attention_output_gate:
        return heads
    gate = sigmoid(linear(x, p["gate.weight"], p.get("gate.bias")))
    if (found := _AMPLIFICATIONS.get()) is not None:
        found.append(output_gate_amplification(x, p["gate.weight"], p.get("gate.bias"), heads, gate))
    return heads * gate


def output_gate_amplification(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, heads: np.ndarray,
                              gate: np.ndarray) -> float:
    """How much the gate magnifies the rounding of its logits g = x W + b (SPEC §8): each logit
    rounded relative to the size of its terms as a sum of random signs, √(Σ_i (x_i W_ij)² + b_j²),
    moves heads ⊙ σ(g) by heads σ(g)(1 − σ(g)) times that; the largest such move over the largest
    gated head. x [B, Q, d], heads and gate [B, Q, H·d_k]"""
    terms = np.sqrt((x * x) @ (weight * weight) + (0.0 if bias is None else bias * bias))
    gated = np.abs(heads * gate).max()
    return float((np.abs(heads) * gate * (1 - gate) * terms).max() / gated) if gated > 0 else 1.0


def attention_positions(cfg: ModelConfig, q_len: int, k_len: int, offset: int = 0) -> tuple[np.ndarray | None, ...]:
    """RoPE's (query, key) positions: the keys at offset .. offset+K−1, the queries the last Q of
    them (a self-attention's are the keys'; a decode step's the newest); (None, None) without RoPE."""
    if cfg.positional != "rope":
        return None, None
    return np.arange(offset + k_len - q_len, offset + k_len), np.arange(offset, offset + k_len)


def multi_head_attention(cfg: ModelConfig, p: Params, x: np.ndarray, context: np.ndarray, mask: np.ndarray | None,
                         offset: int = 0) -> np.ndarray:
    """MultiHead(x, c) = Concat(head_1..head_h) W^O, head_i = Attention(x W_i^Q, c W_g(i)^K, c W_g(i)^V).
    Self-attention: context is x. RoPE positions from offset (attention_positions).
    x [B, Q, d], context [B, K, d] -> [B, Q, d]"""
    q_positions, k_positions = attention_positions(cfg, x.shape[1], context.shape[1], offset)
    return attend(cfg, p, x, *key_value_heads(cfg, p, context, k_positions), mask, q_positions)


# ---- feed-forward, norms, residual ----------------------------------------------------------

def feed_forward(p: Params, x: np.ndarray, activation: str, clamp: tuple[float, float] | None = None) -> np.ndarray:
    """FFN(x) = act(x W1 + b1) W2 + b2; gated (p has W3): (act(x W1 + b1) ⊙ (x W3 + b3)) W2 + b2,
    SwiGLU with swish, GeGLU with gelu-tanh; with clamp (L, α), gpt-oss's clamped SwiGLU as the
    gated unit. [B, T, d] -> [B, T, d]"""
    gate = linear(x, p["w1.weight"], p.get("w1.bias"))  # [B, T, d_ff]
    if clamp is not None:
        hidden = clamped_swiglu(gate, linear(x, p["w3.weight"], p.get("w3.bias")), *clamp)
    else:
        hidden = ACTIVATIONS[activation](gate)
        if "w3.weight" in p:
            hidden = hidden * linear(x, p["w3.weight"], p.get("w3.bias"))
    return linear(hidden, p["w2.weight"], p.get("w2.bias"))


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """gpt-oss's gated unit (SPEC §5.16): g = min(gate, L), u = clip(up, −L, L);  g·σ(α g) ⊙ (u + 1)"""
    g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return g * sigmoid(alpha * g) * (u + 1.0)


def layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """γ (x - μ) / √(σ² + ε) + β, σ² the biased variance over d (two passes)."""
    centered = x - x.mean(axis=-1, keepdims=True)
    variance = (centered * centered).mean(axis=-1, keepdims=True)
    return centered / np.sqrt(variance + eps) * scale + bias


def std_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """γ (x - μ) / (s + ε) + β, s the unbiased standard deviation (divides by d - 1)."""
    centered = x - x.mean(axis=-1, keepdims=True)
    std = np.sqrt((centered * centered).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))
    return scale * centered / (std + eps) + bias


def rms_norm(x: np.ndarray, scale: np.ndarray, bias: None, eps: float) -> np.ndarray:
    """γ x / √(mean(x²) + ε): no centring, no bias (Llama's RMSNorm), ε inside the root."""
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * scale


def norm_scale(cfg: ModelConfig, scale: np.ndarray) -> np.ndarray:
    """γ: the stored scale, or 1 + scale where cfg.norm_scale_plus_one (Gemma)."""
    return 1.0 + scale if cfg.norm_scale_plus_one else scale


def norm(cfg: ModelConfig, p: Params, x: np.ndarray) -> np.ndarray:
    """The config's norm with parameters p["scale"] and p["bias"] (RMSNorm has none)."""
    kind = {"layernorm": layer_norm, "std": std_norm, "rmsnorm": rms_norm}[cfg.norm]
    return kind(x, norm_scale(cfg, p["scale"]), p.get("bias"), float(cfg.norm_eps))


def dropout(cfg: ModelConfig, x: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """x ⊙ keep / (1 − p), p = cfg.dropout, the keep-mask given (SPEC §5.10); None keeps every unit."""
    return x if keep is None else x * keep / (1.0 - cfg.dropout)


def residual(cfg: ModelConfig, norm_p: Params, x: np.ndarray, sublayer: Callable[[np.ndarray], np.ndarray],
             dropout_mask: np.ndarray | None = None, post_norm_p: Params | None = None) -> np.ndarray:
    """post-LN: Norm(x + Dropout(Sublayer(x)))  (the paper);  pre-LN: x + Dropout(Sublayer(Norm(x)));
    with post norms (Gemma): x + Dropout(PostNorm(Sublayer(Norm(x))));  output: x + Dropout(Norm(Sublayer(x)))
    (OLMo 2)."""
    if cfg.norm_position == "post":
        return norm(cfg, norm_p, x + dropout(cfg, sublayer(x), dropout_mask))
    if cfg.norm_position == "output":
        return x + dropout(cfg, norm(cfg, norm_p, sublayer(x)), dropout_mask)
    out = sublayer(norm(cfg, norm_p, x))
    if post_norm_p is not None:
        out = norm(cfg, post_norm_p, out)
    return x + dropout(cfg, out, dropout_mask)


def block(cfg: ModelConfig, p: Params, name: str, x: np.ndarray, sublayer: Callable[[np.ndarray], np.ndarray],
          dropout_mask: np.ndarray | None = None) -> np.ndarray:
    """The residual block of a layer's sublayer `name` (self_attn, cross_attn, ffn) with its norms:
    {name}_norm, and {name}_post_norm where the config has post norms. p: the layer's parameters."""
    post_norm_p = params_under(p, f"{name}_post_norm") if cfg.post_norms else None
    return residual(cfg, params_under(p, f"{name}_norm"), x, sublayer, dropout_mask, post_norm_p)


def ffn(cfg: ModelConfig, p: Params, x: np.ndarray) -> np.ndarray:
    """A layer's FFN: one FFN (§5.5), or the mixture of experts (§5.14). p: its "ffn" parameters.
    [B, T, d] -> [B, T, d]"""
    return feed_forward(p, x, cfg.activation, cfg.swiglu_clamp) if cfg.moe is None else experts_ffn(cfg, p, x)


def ffn_block(cfg: ModelConfig, p: Params, x: np.ndarray, dropout_mask: np.ndarray | None = None) -> np.ndarray:
    """The residual/norm block around a layer's FFN. p: the layer's parameters."""
    return block(cfg, p, "ffn", x, lambda h: ffn(cfg, params_under(p, "ffn"), h), dropout_mask)


# ---- the mixture of experts (SPEC §5.14: Mixtral, Qwen3-MoE) ---------------------------------
# A router chooses k of E gated FFNs per token and the block sums their outputs, weighted:
#     p = softmax(x R) [N, E];  top = the k largest p, ties to the lower index;
#     w = p[top] / Σ p[top] (renormalised: Mixtral) or p[top] (Qwen3-MoE without norm_topk_prob);
#     MoE(x) = Σ_j w_j · FFN_top_j(x)  (+ σ(x g) · FFN_shared(x) where a shared expert is: Qwen3-Next).
# An expert no token chose computes nothing. A token's routing margin, p_(k) − p_(k+1), is how far
# its choice is from a tie that a backend's rounding could flip. x [N, d] (tokens flattened).

def router_probabilities(x: np.ndarray, router: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """p = softmax(x R + b), b where the router has one (gpt-oss). [N, d] @ [d, E] -> [N, E]"""
    return softmax(linear(x, router, bias))


def top_experts(probabilities: np.ndarray, k: int) -> np.ndarray:
    """The k experts of largest probability per token, largest first, a tie to the lower index. [N, E] -> [N, k]"""
    if not 1 <= k <= probabilities.shape[-1]:
        raise ValueError(f"k = {k} experts per token: there are {probabilities.shape[-1]}")
    return np.argsort(-probabilities, axis=-1, kind="stable")[..., :k]  # a stable sort keeps ties in index order


def routing_weights(probabilities: np.ndarray, chosen: np.ndarray, renormalize: bool) -> np.ndarray:
    """w = p[top] / Σ p[top] where renormalised, else p[top]. -> [N, k]"""
    weights = np.take_along_axis(probabilities, chosen, axis=-1)
    return weights / weights.sum(axis=-1, keepdims=True) if renormalize else weights


def routing_margins(probabilities: np.ndarray, k: int) -> np.ndarray:
    """p_(k) − p_(k+1) per token, the probabilities sorted largest first; with k = E, p_(E). -> [N]"""
    ordered = -np.sort(-probabilities, axis=-1)
    return ordered[..., k - 1] - (ordered[..., k] if k < ordered.shape[-1] else 0.0)


def mixture_of_experts(x: np.ndarray, router: np.ndarray, experts: Sequence[Params], k: int, renormalize: bool,
                       activation: str, clamp: tuple[float, float] | None = None,
                       router_bias: np.ndarray | None = None) -> np.ndarray:
    """MoE(x) = Σ_j w_j · FFN_top_j(x), each expert run on the tokens that chose it. [N, d] -> [N, d]"""
    if router.shape[-1] != len(experts):
        raise ValueError(f"the router scores {router.shape[-1]} experts; {len(experts)} are given")
    probabilities = router_probabilities(x, router, router_bias)
    chosen = top_experts(probabilities, k)  # [N, k]
    return weighted_experts(x, experts, chosen, routing_weights(probabilities, chosen, renormalize), activation,
                            clamp)


def weighted_experts(x: np.ndarray, experts: Sequence[Params], chosen: np.ndarray, weights: np.ndarray,
                     activation: str, clamp: tuple[float, float] | None = None) -> np.ndarray:
    """Σ_j w_j · FFN_chosen_j(x) for the given choices [N, k] and weights [N, k]; an expert no
    token chose computes nothing. [N, d] -> [N, d]"""
    out = np.zeros_like(x)
    for expert, p in enumerate(experts):
        tokens, slot = np.nonzero(chosen == expert)  # the tokens that chose it, and in which of their k places
        if tokens.size:
            out[tokens] += weights[tokens, slot, None] * feed_forward(p, x[tokens], activation, clamp)
    return out


@dataclass(frozen=True)
class RoutedCall:
    """One call of a layer's mixture of experts on x [B, T, d]: what its router chose, with what
    weights, and how far each choice is from a tie."""

    chosen: np.ndarray  # [B, T, k], largest first
    weights: np.ndarray  # [B, T, k]: the chosen experts' weights w_j
    margins: np.ndarray  # [B, T]: p_(k) − p_(k+1)
    logits: np.ndarray  # [B, T, E]: z = x R
    absolute: np.ndarray  # [B, T, E]: Σ_d |x_d R_de|, the size of the terms each logit sums
    probabilities: np.ndarray  # [B, T, E]: p = softmax(z)


_RECORDING: contextvars.ContextVar[list[RoutedCall] | None] = contextvars.ContextVar("routing", default=None)


@contextlib.contextmanager
def recorded_routing() -> Iterator[list[RoutedCall]]:
    """Every experts_ffn call's routing while inside, in call order (a forward: one per layer);
    an enclosing recording gets them too."""
    calls: list[RoutedCall] = []
    token = _RECORDING.set(calls)
    try:
        yield calls
    finally:
        _RECORDING.reset(token)
        if (outer := _RECORDING.get()) is not None:
            outer.extend(calls)


_REPLAY: contextvars.ContextVar = contextvars.ContextVar("replayed routing", default=None)


@contextlib.contextmanager
def replayed_routing(log) -> Iterator:
    """Inside, every experts_ffn call routes through `log` (a spec.routing.RoutingLog): its choices
    and weights recorded, or the forced ones taken (SPEC §5.14's replayed routing), each layer known
    by its router's values."""
    token = _REPLAY.set(log)
    try:
        yield log
    finally:
        _REPLAY.reset(token)


def routing_replayed() -> bool:
    """Whether experts_ffn routes through a routing log here (replayed_routing)."""
    return _REPLAY.get() is not None


def layer_experts(cfg: ModelConfig, p: Params) -> list[Params]:
    """Each expert's gated FFN, in index order. p: the layer's "ffn" parameters."""
    return [params_under(p, f"experts.{expert}") for expert in range(cfg.moe.n_experts)]


def shared_expert(cfg: ModelConfig, p: Params, x: np.ndarray) -> np.ndarray:
    """The expert every token takes beside its k, gated per token: σ(x g) · FFN_shared(x), g [d, 1]
    (Qwen2-MoE, Qwen3-Next). p: the layer's "ffn" parameters. [.., d] -> [.., d]"""
    return sigmoid(linear(x, p["shared_expert_gate.weight"])) * feed_forward(params_under(p, "shared_expert"), x,
                                                                            cfg.activation, cfg.swiglu_clamp)


def with_shared_expert(cfg: ModelConfig, p: Params, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
    """The chosen experts' sum, plus the shared expert where the config has one. [.., d] -> [.., d]"""
    return routed + shared_expert(cfg, p, x) if cfg.moe.shared_expert_d_ff else routed


def experts_ffn(cfg: ModelConfig, p: Params, x: np.ndarray) -> np.ndarray:
    """The layer's mixture of experts on every token of x (its shared expert too). [B, T, d] -> [B, T, d]"""
    return with_shared_expert(cfg, p, x, routed_experts(cfg, p, x))


def routed_experts(cfg: ModelConfig, p: Params, x: np.ndarray) -> np.ndarray:
    """The k chosen experts' weighted sum on every token of x. [B, T, d] -> [B, T, d]"""
    tokens = x.reshape(-1, x.shape[-1])  # [N, d]: routing is per token
    moe = cfg.moe
    calls = _RECORDING.get()
    if calls is not None:
        logits = linear(tokens, p["router.weight"], p.get("router.bias"))
        probabilities = softmax(logits)
        chosen = top_experts(probabilities, moe.experts_per_token)
        calls.append(RoutedCall(chosen.reshape(*x.shape[:-1], -1),
                                routing_weights(probabilities, chosen, moe.renormalize).reshape(*x.shape[:-1], -1),
                                routing_margins(probabilities, moe.experts_per_token).reshape(x.shape[:-1]),
                                logits.reshape(*x.shape[:-1], -1),
                                linear(np.abs(tokens), np.abs(p["router.weight"]), _absolute(p.get("router.bias")))
                                .reshape(*x.shape[:-1], -1),
                                probabilities.reshape(*x.shape[:-1], -1)))
    if (log := _REPLAY.get()) is not None:  # the choices and weights through the routing log
        probabilities = router_probabilities(tokens, p["router.weight"], p.get("router.bias"))
        layer = hashlib.sha256(np.ascontiguousarray(p["router.weight"]).tobytes()).hexdigest()
        chosen = log.choose(layer, x.shape[0], top_experts(probabilities, moe.experts_per_token)).astype(np.int64)
        log.see(layer, tokens)
        weights = routing_weights(probabilities, chosen, moe.renormalize)
        forced = log.weigh(layer, weights)
        weights = weights if forced is None else forced.astype(weights.dtype)
        return weighted_experts(tokens, layer_experts(cfg, p), chosen, weights, cfg.activation,
                                cfg.swiglu_clamp).reshape(x.shape)
    return mixture_of_experts(tokens, p["router.weight"], layer_experts(cfg, p), moe.experts_per_token,
                              moe.renormalize, cfg.activation, cfg.swiglu_clamp, p.get("router.bias")).reshape(x.shape)


def _absolute(bias: np.ndarray | None) -> np.ndarray | None:
    return None if bias is None else np.abs(bias)


def expert_shares(chosen: Sequence[np.ndarray], keep: np.ndarray, n_experts: int) -> np.ndarray:
    """f_e = (1/(L·N)) Σ_l Σ_t Σ_j [chosen_ltj = e]: the share of the L layers' choices at the N real
    tokens (keep [B, T]) that went to expert e (Σ_e f_e = k). chosen [B, T, k] per layer -> [E]"""
    counts = sum((np.eye(n_experts)[layer].sum(axis=-2) * keep[..., None]).sum(axis=(0, 1)) for layer in chosen)
    return counts / max(len(chosen) * int(keep.sum()), 1)


def load_balancing_loss(probabilities: Sequence[np.ndarray], chosen: Sequence[np.ndarray], keep: np.ndarray) -> float:
    """aux = E · Σ_e f_e · P_e, P_e = (1/(L·N)) Σ_l Σ_t p_lte the mean probability of expert e over
    the L layers and N real tokens (0 when N = 0; Switch Transformer's, as Mixtral and Qwen3-MoE
    train with it). probabilities [B, T, E] and chosen [B, T, k] per layer, keep [B, T]"""
    experts = probabilities[0].shape[-1]
    mean_probability = sum((layer * keep[..., None]).sum(axis=(0, 1)) for layer in probabilities) \
        / max(len(probabilities) * int(keep.sum()), 1)
    return float(experts * (expert_shares(chosen, keep, experts) * mean_probability).sum())


# ---- gated DeltaNet: linear attention with a recurrent state (SPEC §5.15: Qwen3.5, Qwen3-Next) ---
# Each value head keeps a state S [d_k, d_v] in place of a KV cache. Per real token t:
#     q, k, v = SiLU(causal depthwise convs of x W_q, x W_k, x W_v over the last K real tokens)
#     q ← q / ‖q‖ / √d_k,  k ← k / ‖k‖  (‖·‖ with ε = 1e-6 inside the root);  β = σ(x W_β);
#     g = −exp(log_rate) · softplus(x W_decay + b_decay) ≤ 0;
#     S_t = e^g S_{t−1} + β k (v − e^g S_{t−1}ᵀ k)ᵀ   (the delta rule: write v where k reads);
#     o_t = S_tᵀ q;  out = (RMSNorm(o) γ ⊙ SiLU(x W_z)) W_o  per head, then the heads merged.
# A pad token moves neither state and outputs zeros: a padded row computes what its real tokens
# alone compute. The golden runs the recurrence token by token, the definition.

@dataclass(frozen=True)
class LinearState:
    """What a linear layer keeps between tokens: each convolution's last K − 1 real inputs (zeros
    before the first), and each value head's state."""

    windows: tuple[np.ndarray, np.ndarray, np.ndarray]  # q, k, v: [B, K − 1, H_k·d_k or H_v·d_v]
    recurrent: np.ndarray  # S [B, H_v, d_k, d_v]


def start_linear_state(cfg: ModelConfig, batch: int, dtype: np.dtype) -> LinearState:
    """The state before the first token: zero windows and zero S."""
    mixer = cfg.linear_attention
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    window = (batch, mixer.conv_kernel - 1)
    return LinearState((np.zeros((*window, keys), dtype), np.zeros((*window, keys), dtype),
                        np.zeros((*window, values), dtype)),
                       np.zeros((batch, mixer.value_heads, mixer.key_head_dim, mixer.value_head_dim), dtype))


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / √(Σ x² + ε) over the last axis."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def short_convolution(window: np.ndarray, u: np.ndarray, kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token of a causal depthwise convolution: c[j] = Σ_i kernel[j, i] · (window, u)[i, j], the
    oldest input first, then the window moved on by one. window [B, K − 1, C], u [B, C], kernel [C, K]
    -> (c [B, C], window [B, K − 1, C])"""
    inputs = np.concatenate([window, u[:, None]], axis=1)  # [B, K, C]
    return (inputs * kernel.T).sum(axis=1), inputs[:, 1:]


def gated_delta_rule(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray,
                     beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """S ← e^g S + β k (v − e^g Sᵀ k)ᵀ, o = Sᵀ q. state [B, H, d_k, d_v], q and k [B, H, d_k],
    v [B, H, d_v], decay (g) and beta [B, H] -> (o [B, H, d_v], state)"""
    state = np.exp(decay)[..., None, None] * state
    written = beta[..., None] * (v - np.einsum("bhkv,bhk->bhv", state, k))  # what k reads, corrected toward v
    state = state + np.einsum("bhk,bhv->bhkv", k, written)
    return np.einsum("bhkv,bhk->bhv", state, q), state


def output_norm_amplification(state: np.ndarray, q: np.ndarray, o: np.ndarray, eps: float) -> np.ndarray:
    """How much the output norm magnifies the rounding of o = Sᵀq (SPEC §8): the size o's terms
    S_ij q_i would give a sum of random signs, √(mean_j Σ_i S_ij² q_i²), over what the norm divides o
    by, √(mean(o²) + ε); about 1 where o is as large as its terms make it. state [B, H, d_k, d_v],
    q [B, H, d_k], o [B, H, d_v] -> [B, H]"""
    terms = np.sqrt(np.einsum("bhkv,bhk->bh", state * state, q * q) / o.shape[-1])
    return terms / np.sqrt((o * o).mean(axis=-1) + eps)


_AMPLIFICATIONS: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("amplifications", default=None)


@contextlib.contextmanager
def recorded_amplification() -> Iterator[list[float]]:
    """Inside, each gated_delta_net call appends the largest output_norm_amplification of its real
    tokens, each gated attention its output_gate_amplification (the conformance tolerance's factor
    for a hybrid's cases, SPEC §8)."""
    found: list[float] = []
    token = _AMPLIFICATIONS.set(found)
    try:
        yield found
    finally:
        _AMPLIFICATIONS.reset(token)


def gated_rms_norm(o: np.ndarray, scale: np.ndarray, gate: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm(o) γ ⊙ SiLU(gate), over each head's d_v (γ as stored). [.., d_v] -> [.., d_v]"""
    return rms_norm(o, scale, None, eps) * swish(gate)


def delta_net_projections(cfg: ModelConfig, p: Params,
                          x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """What a linear layer computes of every token at once: the q, k, v projections before their
    convolutions, β = σ(x W_β) and g = −exp(log_rate) · softplus(x W_decay + b_decay) ≤ 0.
    x [B, T, d] -> ([B, T, H_k·d_k] twice and [B, T, H_v·d_v], β [B, T, H_v], g [B, T, H_v])"""
    projected = [linear(x, p[f"{name}.weight"]) for name in ("q", "k", "v")]
    beta = sigmoid(linear(x, p["beta.weight"]))
    decay = -np.exp(p["decay.log_rate"]) * softplus(linear(x, p["decay.weight"], p["decay.bias"]))
    return projected, beta, decay


def token_queries_keys_values(cfg: ModelConfig, windows: Sequence[np.ndarray], inputs: Sequence[np.ndarray],
                              kernels: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """One token's q, k, v: SiLU of each short convolution, q and k L2-normalised (q also by
    1/√d_k) and repeated for the value heads of their group (value head h reads key head h // g).
    windows and inputs: q's, k's, v's ([B, K − 1, C] and [B, C]) -> (q and k [B, H_v, d_k],
    v [B, H_v, d_v], the windows moved on)"""
    mixer = cfg.linear_attention
    batch, groups = inputs[0].shape[0], mixer.value_heads // mixer.key_heads
    convolved = [short_convolution(window, u, kernel) for window, u, kernel in zip(windows, inputs, kernels)]
    mixed = [swish(c) for c, _ in convolved]
    q = l2_normalize(mixed[0].reshape(batch, mixer.key_heads, mixer.key_head_dim)) / math.sqrt(mixer.key_head_dim)
    k = l2_normalize(mixed[1].reshape(batch, mixer.key_heads, mixer.key_head_dim))
    v = mixed[2].reshape(batch, mixer.value_heads, mixer.value_head_dim)
    return np.repeat(q, groups, axis=1), np.repeat(k, groups, axis=1), v, [moved for _, moved in convolved]


def gated_delta_net(cfg: ModelConfig, p: Params, x: np.ndarray, keep: np.ndarray,
                    state: LinearState | None = None, visited: list | None = None) -> tuple[np.ndarray, LinearState]:
    """A linear layer's mixer over x from state (the start's where None), token by token; pads move
    nothing and give zeros. p: its "linear_attn" parameters. x [B, T, d], keep [B, T]
    -> ([B, T, d], the state after the last token). visited: where given, each token's starting
    windows and S are appended to it (the backward walks them back)."""
    mixer = cfg.linear_attention
    batch, length = x.shape[:2]
    state = start_linear_state(cfg, batch, x.dtype) if state is None else state
    projected, beta, decay = delta_net_projections(cfg, p, x)  # [B, T, H·d], [B, T, H_v] twice
    kernels = [p[f"{name}_conv.weight"] for name in ("q", "k", "v")]
    windows, recurrent = list(state.windows), state.recurrent
    outputs = np.zeros((batch, length, mixer.value_heads, mixer.value_head_dim), x.dtype)  # o_t per value head
    for t in range(length):
        real = keep[:, t]
        if visited is not None:
            visited.append((windows, recurrent))
        q, k, v, moved = token_queries_keys_values(cfg, windows, [u[:, t] for u in projected], kernels)
        windows = [np.where(real[:, None, None], after, before) for after, before in zip(moved, windows)]
        o, written = gated_delta_rule(recurrent, q, k, v, decay[:, t], beta[:, t])
        recurrent = np.where(real[:, None, None, None], written, recurrent)
        outputs[:, t] = np.where(real[:, None, None], o, 0.0)
        if (found := _AMPLIFICATIONS.get()) is not None and real.any():
            found.append(float(output_norm_amplification(written, q, o, float(cfg.norm_eps))[real].max()))
    gate = split_heads(linear(x, p["z.weight"]), mixer.value_heads).swapaxes(1, 2)  # [B, T, H_v, d_v]
    heads = gated_rms_norm(outputs, p["norm.scale"], gate, float(cfg.norm_eps))
    return linear(heads.reshape(batch, length, -1), p["o.weight"]), LinearState(tuple(windows), recurrent)


# ---- layers and stacks ----------------------------------------------------------------------

def encoder_layer(cfg: ModelConfig, p: Params, x: np.ndarray, mask: np.ndarray | None,
                  dropout_masks: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """x = Block(x, SelfAttention); x = Block(x, FFN). x [B, S, d]; dropout_masks by block name."""
    drop = dropout_masks or {}
    attention = params_under(p, "self_attn")
    x = block(cfg, p, "self_attn", x, lambda h: multi_head_attention(cfg, attention, h, h, mask), drop.get("self_attn"))
    return ffn_block(cfg, p, x, drop.get("ffn"))


def decoder_layer(cfg: ModelConfig, p: Params, y: np.ndarray, memory: np.ndarray | None,
                  self_mask: np.ndarray | None, cross_mask: np.ndarray | None,
                  dropout_masks: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """y = Block(y, masked SelfAttention); y = Block(y, CrossAttention to memory) [encoder-decoder
    only]; y = Block(y, FFN). y [B, T, d], memory [B, S, d]; dropout_masks by block name."""
    drop = dropout_masks or {}
    self_attention = params_under(p, "self_attn")
    y = block(cfg, p, "self_attn", y, lambda h: multi_head_attention(cfg, self_attention, h, h, self_mask),
              drop.get("self_attn"))
    if memory is not None:
        cross_attention = params_under(p, "cross_attn")
        y = block(cfg, p, "cross_attn", y, lambda h: multi_head_attention(cfg, cross_attention, h, memory, cross_mask),
                  drop.get("cross_attn"))
    return ffn_block(cfg, p, y, drop.get("ffn"))


def linear_layer(cfg: ModelConfig, p: Params, y: np.ndarray, keep: np.ndarray,
                 state: LinearState | None = None) -> tuple[np.ndarray, LinearState]:
    """A hybrid's linear layer (SPEC §5.15): y = Block(y, gated DeltaNet); y = Block(y, FFN), the
    mixer's state carried from `state`. cfg: the model's. y [B, T, d], keep [B, T] -> ([B, T, d], state)"""
    mixer, after = params_under(p, "linear_attn"), []

    def mix(h: np.ndarray) -> np.ndarray:
        out, moved = gated_delta_net(cfg, mixer, h, keep, state)
        after.append(moved)
        return out

    y = block(cfg, p, "linear_attn", y, mix)
    return ffn_block(cfg, p, y), after[0]


def final_norm(cfg: ModelConfig, params: Params, stack: str, x: np.ndarray) -> np.ndarray:
    """The norm after a stack (cfg.final_norm), else x unchanged."""
    return norm(cfg, params_under(params, f"{stack}.norm"), x) if cfg.final_norm else x


def encoder(cfg: ModelConfig, params: Params, src_ids: np.ndarray, src_keep: np.ndarray,
            dropout_masks: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """memory = Norm?(Layer_N(...Layer_1(Embed(src)))). src_ids [B, S] -> [B, S, d];
    dropout_masks by site (spec.dropout.dropout_sites)."""
    x = embed(cfg, params, src_ids, "src", dropout_mask=(dropout_masks or {}).get("encoder.embed"))
    mask = key_mask(src_keep)  # [B, 1, 1, S]
    for i in range(cfg.n_encoder_layers):
        x = encoder_layer(cfg, params_under(params, f"encoder.layers.{i}"), x, mask,
                          masks_under(dropout_masks, f"encoder.layers.{i}"))
    return final_norm(cfg, params, "encoder", x)


def decoder(cfg: ModelConfig, params: Params, tgt_ids: np.ndarray, tgt_keep: np.ndarray,
            memory: np.ndarray | None = None, src_keep: np.ndarray | None = None,
            dropout_masks: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """h = Norm?(Layer_N(...Layer_1(Embed(tgt), memory))). tgt_ids [B, T] -> [B, T, d];
    dropout_masks by site (spec.dropout.dropout_sites)."""
    y = embed(cfg, params, tgt_ids, "tgt", dropout_mask=(dropout_masks or {}).get("decoder.embed"))
    self_masks = decoder_self_masks(cfg, tgt_keep)  # by window: [B, 1, T, T]
    cross_mask = None if memory is None else key_mask(src_keep)  # [B, 1, 1, S]
    for i in range(cfg.n_decoder_layers):
        if cfg.layer_kind(i) == "linear":  # gated DeltaNet in self-attention's place (SPEC §5.15)
            y, _ = linear_layer(cfg, params_under(params, f"decoder.layers.{i}"), y, tgt_keep)
            continue
        layer_cfg = cfg.layer(i)  # its window and its rotary (SPEC §6)
        y = decoder_layer(layer_cfg, params_under(params, f"decoder.layers.{i}"), y, memory,
                          self_masks[layer_cfg.sliding_window], cross_mask,
                          masks_under(dropout_masks, f"decoder.layers.{i}"))
    return final_norm(cfg, params, "decoder", y)


def decoder_self_masks(cfg: ModelConfig, tgt_keep: np.ndarray, q_len: int | None = None) -> dict:
    """The decoder's self-attention masks by window, one for each window its layers have (None:
    full causal). tgt_keep [B, K] -> {W: [B, 1, Q, K]}"""
    return {window: decoder_self_mask(tgt_keep, q_len, window) for window in set(cfg.layer_windows)}


def output_logits(cfg: ModelConfig, params: Params, h: np.ndarray) -> np.ndarray:
    """logits = softcap(h W_head + b) (the final cap where the config has one); tied: W_head = E_tgtᵀ.
    [B, T, d] -> [B, T, V]"""
    weight = params["tgt_embed.weight"].T if cfg.tie_head else params["head.weight"]
    return softcap(linear(h, weight, params.get("head.bias")), cfg.final_softcap)


def log_probs(cfg: ModelConfig, params: Params, h: np.ndarray) -> np.ndarray:
    """log p(token) = log_softmax(logits). [B, T, d] -> [B, T, V]"""
    return log_softmax(output_logits(cfg, params, h))


def smoothed_targets(targets: np.ndarray, vocab_size: int, pad_id: int, label_smoothing: float) -> np.ndarray:
    """q = 1 − ε on the target token, 0 on pad, ε / (V − 2) on every other token. targets [B, T] -> [B, T, V]"""
    other = label_smoothing / (vocab_size - 2) if label_smoothing else 0.0
    q = np.full(targets.shape + (vocab_size,), other)
    q[..., pad_id] = 0.0
    np.put_along_axis(q, targets[..., None], 1.0 - label_smoothing, axis=-1)
    return q


def token_cross_entropy(cfg: ModelConfig, logits: np.ndarray, targets: np.ndarray) -> float:
    """L = (1/N) Σ_t −Σ_j q_tj log softmax(logits_t)_j over the N target tokens that are not pad
    (L = 0 when N = 0). logits [B, T, V], targets [B, T]"""
    real = targets != cfg.pad_id  # [B, T]
    q = smoothed_targets(targets, cfg.tgt_vocab_size, cfg.pad_id, float(cfg.label_smoothing))
    per_token = -(q * log_softmax(logits)).sum(axis=-1)  # [B, T]
    return float((per_token * real).sum() / max(int(real.sum()), 1))


# ---- the whole model ------------------------------------------------------------------------

def cast_params(cfg: ModelConfig, params: Params, dtype: np.dtype = np.float64) -> dict[str, np.ndarray]:
    """Check the canonical float32 parameters and cast them to the computation dtype."""
    check_params(cfg, params)
    return {name: value.astype(dtype) for name, value in params.items()}


def token_keep(cfg: ModelConfig, ids: np.ndarray, keep: np.ndarray | None, side: str, offset: int = 0) -> np.ndarray:
    """Which tokens are real [B, T]: the given keep-vector, else ids != pad_id with an
    encoder-decoder's start token (target position 0) always real (SPEC.md §6)."""
    if keep is None:
        return real_tokens(cfg, ids, side, offset)
    check_keep(keep, ids, f"{side}_keep")
    return np.asarray(keep)


def forward(cfg: ModelConfig, params: Params, src_ids: np.ndarray | None, tgt_ids: np.ndarray, *,
            dtype: np.dtype = np.float64, src_keep: np.ndarray | None = None,
            tgt_keep: np.ndarray | None = None) -> np.ndarray:
    """Teacher-forced logits [B, T, V]. Decoder-only: src_ids=None. Padding comes from pad_id
    unless keep-vectors (True = real token) are given."""
    check_model_inputs(cfg, src_ids, tgt_ids)
    return model_logits(cfg, cast_params(cfg, params, dtype), src_ids, tgt_ids, src_keep=src_keep, tgt_keep=tgt_keep)


def model_logits(cfg: ModelConfig, p: Params, src_ids: np.ndarray | None, tgt_ids: np.ndarray, *,
                 src_keep: np.ndarray | None = None, tgt_keep: np.ndarray | None = None,
                 dropout_masks: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """forward on parameters already cast to the computation dtype (cast_params); training mode
    when dropout keep-masks are given (SPEC §5.10)."""
    src_ids, tgt_ids, src_keep, tgt_keep = model_inputs(cfg, src_ids, tgt_ids, src_keep, tgt_keep, dropout_masks)
    memory = None if src_ids is None else encoder(cfg, p, src_ids, src_keep, dropout_masks)
    return output_logits(cfg, p, decoder(cfg, p, tgt_ids, tgt_keep, memory, src_keep, dropout_masks))


def model_inputs(cfg: ModelConfig, src_ids, tgt_ids, src_keep=None, tgt_keep=None, dropout_masks=None) -> tuple:
    """The teacher-forced inputs checked, as arrays, with their keep-vectors (token_keep):
    (src_ids, tgt_ids, src_keep, tgt_keep), the source's None for a decoder-only model."""
    check_model_inputs(cfg, src_ids, tgt_ids)
    check_dropout_masks(cfg, dropout_masks, np.shape(tgt_ids)[0], None if src_ids is None else np.shape(src_ids)[1],
                        np.shape(tgt_ids)[1])
    tgt_ids = np.asarray(tgt_ids)
    tgt_keep = token_keep(cfg, tgt_ids, tgt_keep, "tgt")
    if not cfg.has_encoder:
        return None, tgt_ids, None, tgt_keep
    src_ids = np.asarray(src_ids)
    return src_ids, tgt_ids, token_keep(cfg, src_ids, src_keep, "src"), tgt_keep


def training_loss(cfg: ModelConfig, p: Params, src_ids: np.ndarray | None, tgt_ids: np.ndarray, targets: np.ndarray, *,
                  dropout_masks: Mapping[str, np.ndarray] | None = None) -> float:
    """The loss a training step minimises: token_cross_entropy of the teacher-forced logits, plus
    α times a mixture of experts' load-balancing loss over the real target-side tokens
    (α = moe.load_balancing, SPEC §5.14). p: parameters in the computation dtype."""
    logits, calls = balanced_model_logits(cfg, p, src_ids, tgt_ids, dropout_masks=dropout_masks)
    loss = token_cross_entropy(cfg, logits, np.asarray(targets))
    if calls:
        keep = model_inputs(cfg, src_ids, tgt_ids)[3]
        loss += cfg.moe.load_balancing * load_balancing_loss([call.probabilities for call in calls],
                                                             [call.chosen for call in calls], keep)
    return loss


def balanced_model_logits(cfg: ModelConfig, p: Params, src_ids: np.ndarray | None, tgt_ids: np.ndarray, *,
                          src_keep: np.ndarray | None = None, tgt_keep: np.ndarray | None = None,
                          dropout_masks: Mapping[str, np.ndarray] | None = None) -> tuple[np.ndarray, list[RoutedCall]]:
    """model_logits, and every MoE layer's routing where a load-balancing loss reads it (moe.load_balancing
    not 0; else [], and the routing is not recorded)."""
    if cfg.moe is None or not cfg.moe.load_balancing:
        return model_logits(cfg, p, src_ids, tgt_ids, src_keep=src_keep, tgt_keep=tgt_keep,
                            dropout_masks=dropout_masks), []
    with recorded_routing() as calls:
        logits = model_logits(cfg, p, src_ids, tgt_ids, src_keep=src_keep, tgt_keep=tgt_keep,
                              dropout_masks=dropout_masks)
    return logits, calls


# ---- incremental decoding with a KV cache ---------------------------------------------------

@dataclass(frozen=True)
class KVCache:
    """What the decoder keeps between steps. L decoder layers; P positions decoded so far."""

    self_keys: tuple[np.ndarray, ...]  # L × [B, H_kv, P, d_k], rotated at their positions (RoPE)
    self_values: tuple[np.ndarray, ...]  # L × [B, H_kv, P, d_k]
    tgt_keep: np.ndarray  # [B, P] which decoded positions are real tokens
    cross_keys: tuple[np.ndarray, ...] | None = None  # L × [B, H_kv, S, d_k], computed once
    cross_values: tuple[np.ndarray, ...] | None = None
    src_keep: np.ndarray | None = None  # [B, S]
    linear_states: tuple[LinearState | None, ...] | None = None  # L: a linear layer's state, else None (§5.15)

    @property
    def length(self) -> int:
        return self.tgt_keep.shape[1]


def start_cache(cfg: ModelConfig, p: Params, batch: int, src_ids: np.ndarray | None = None,
                src_keep: np.ndarray | None = None) -> KVCache:
    """An empty cache; for an encoder-decoder, run the encoder once and keep each layer's
    cross-attention K and V of the memory. p: parameters already in the computation dtype."""
    dtype = p["tgt_embed.weight"].dtype
    empty = np.zeros((batch, cfg.kv_heads, 0, cfg.d_head), dtype)
    layers = range(cfg.n_decoder_layers)
    states = None if cfg.linear_attention is None else tuple(
        start_linear_state(cfg, batch, dtype) if cfg.layer_kind(i) == "linear" else None for i in layers)
    cache = KVCache(tuple(empty for _ in layers), tuple(empty for _ in layers), np.zeros((batch, 0), bool),
                    linear_states=states)
    if not cfg.has_encoder:
        return cache
    check_source(cfg, src_ids, batch)
    src_ids = np.asarray(src_ids)
    src_keep = token_keep(cfg, src_ids, src_keep, "src")
    memory = encoder(cfg, p, src_ids, src_keep)
    cross = [key_value_heads(cfg, params_under(p, f"decoder.layers.{i}.cross_attn"), memory) for i in layers]
    return KVCache(cache.self_keys, cache.self_values, cache.tgt_keep,
                   tuple(k for k, _ in cross), tuple(v for _, v in cross), src_keep)


def decode_step(cfg: ModelConfig, p: Params, cache: KVCache, tgt_ids: np.ndarray,
                tgt_keep: np.ndarray | None = None) -> tuple[np.ndarray, KVCache]:
    """Feed the next n target tokens [B, n] (n = 1 for a step, more for a prompt) after the cached
    ones; return their logits [B, n, V] and the extended cache. Equals the full forward."""
    check_decode_step(cfg, tgt_ids, cache.length, cache.tgt_keep.shape[0])
    tgt_ids = np.asarray(tgt_ids)
    keep = np.concatenate([cache.tgt_keep, token_keep(cfg, tgt_ids, tgt_keep, "tgt", cache.length)], axis=1)
    n_new, n_all = tgt_ids.shape[1], keep.shape[1]
    self_masks = decoder_self_masks(cfg, keep, n_new)  # by window: [B, 1, n, P + n]
    cross_mask = None if cache.src_keep is None else key_mask(cache.src_keep)
    y = embed(cfg, p, tgt_ids, "tgt", offset=cache.length)
    positions, _ = attention_positions(cfg, n_new, n_all)  # RoPE's: the new ones
    keys, values, states = [], [], []
    for i in range(cfg.n_decoder_layers):
        layer, layer_cfg = params_under(p, f"decoder.layers.{i}"), cfg.layer(i)
        if cfg.layer_kind(i) == "linear":  # its state carried on; no keys or values (SPEC §5.15)
            y, state = linear_layer(cfg, layer, y, keep[:, -n_new:], cache.linear_states[i])
            keys.append(cache.self_keys[i])
            values.append(cache.self_values[i])
            states.append(state)
            continue
        states.append(None)
        self_attention = params_under(layer, "self_attn")

        def cached_self_attention(h: np.ndarray) -> np.ndarray:
            # K (rotated) and V of the new positions joined to the cached ones: [B, H_kv, P + n, d_k]
            k, v = key_value_heads(layer_cfg, self_attention, h, positions)
            keys.append(np.concatenate([cache.self_keys[i], k], axis=2))
            values.append(np.concatenate([cache.self_values[i], v], axis=2))
            return attend(layer_cfg, self_attention, h, keys[-1], values[-1], self_masks[layer_cfg.sliding_window],
                          positions)

        y = block(layer_cfg, layer, "self_attn", y, cached_self_attention)
        if cache.cross_keys is not None:
            cross_attention = params_under(layer, "cross_attn")
            y = block(cfg, layer, "cross_attn", y,
                      lambda h: attend(cfg, cross_attention, h, cache.cross_keys[i], cache.cross_values[i], cross_mask))
        y = ffn_block(layer_cfg, layer, y)
    logits = output_logits(cfg, p, final_norm(cfg, p, "decoder", y))
    new_cache = KVCache(tuple(keys), tuple(values), keep, cache.cross_keys, cache.cross_values, cache.src_keep,
                        None if cache.linear_states is None else tuple(states))
    return logits, new_cache


def generation_start(cfg: ModelConfig, p: Params, batch: int, src_ids: np.ndarray | None,
                     prompt_ids: np.ndarray | None, bos_id: int | None) -> tuple[np.ndarray, np.ndarray, KVCache]:
    """The first step's input and its keep-vector [B, n], and the empty cache: an encoder-decoder
    starts from bos_id (always real), a decoder-only model from its prompt (pad_id is padding)."""
    if cfg.has_encoder:
        first = np.full((batch, 1), bos_id, dtype=np.int64)
        return first, np.ones_like(first, dtype=bool), start_cache(cfg, p, batch, src_ids)
    first = np.asarray(prompt_ids)
    return first, first != cfg.pad_id, start_cache(cfg, p, batch)


def greedy_generate(cfg: ModelConfig, params: Params, src_ids: np.ndarray | None = None, *,
                    prompt_ids: np.ndarray | None = None, bos_id: int | None = None,
                    eos_id: int | None = None, max_new_tokens: int, dtype: np.dtype = np.float64,
                    return_step_logits: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """greedy_decoding on the canonical float32 parameters, cast to the computation dtype first."""
    return greedy_decoding(cfg, cast_params(cfg, params, dtype), src_ids, prompt_ids=prompt_ids, bos_id=bos_id,
                           eos_id=eos_id, max_new_tokens=max_new_tokens, return_step_logits=return_step_logits)


def greedy_decoding(cfg: ModelConfig, p: Params, src_ids: np.ndarray | None = None, *,
                    prompt_ids: np.ndarray | None = None, bos_id: int | None = None, eos_id: int | None = None,
                    max_new_tokens: int, return_step_logits: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Greedy decoding with the KV cache -> new tokens [B, max_new_tokens] (and, when asked, the
    logits each step chose from [B, max_new_tokens, V]; zeros for steps after all finished), on
    parameters already cast to the computation dtype (cast_params).

    Encoder-decoder: decoding starts from bos_id. Decoder-only: from prompt_ids [B, P] (pad_id
    marks prompt padding). Each step takes the arg-max token (ties go to the lowest id); after a
    sequence emits eos_id its remaining tokens are pad_id. Generated tokens always count as real
    tokens, even if an id equals pad_id."""
    batch, _ = check_generation(cfg, src_ids, prompt_ids, bos_id, max_new_tokens)
    step_ids, step_keep, cache = generation_start(cfg, p, batch, src_ids, prompt_ids, bos_id)
    tokens = np.full((batch, max_new_tokens), cfg.pad_id, dtype=np.int64)
    finished = np.zeros(batch, dtype=bool)
    step_logits = np.zeros((batch, max_new_tokens, cfg.tgt_vocab_size), dtype=p["tgt_embed.weight"].dtype)
    for t in range(max_new_tokens):
        logits, cache = decode_step(cfg, p, cache, step_ids, step_keep)
        step_logits[:, t] = logits[:, -1]
        next_token = np.where(finished, cfg.pad_id, logits[:, -1].argmax(axis=-1))
        tokens[:, t] = next_token
        if eos_id is not None:
            finished |= next_token == eos_id
        if finished.all():
            break
        step_ids, step_keep = next_token[:, None], np.ones((batch, 1), dtype=bool)
    return (tokens, step_logits) if return_step_logits else tokens
