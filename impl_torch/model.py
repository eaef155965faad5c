"""The spec's Transformer in PyTorch: a parallel text to impl_numpy/model.py.

Same names, same order; the comments say why PyTorch needs something the golden does not.
Shapes: B batch, S source, T target, Q queries, K keys, H heads, H_kv key/value heads, d d_model,
d_k head size, r rotary dimensions.

The module tree mirrors the canonical names, so ``state_dict()`` keys *are* the canonical names.
One rule maps the values: nn.Linear stores its weight [out, in] (it computes x @ Wᵀ), the spec
stores [in, out] (x @ W), so every Linear weight is transposed on the way in and out. Nothing
else changes: embeddings are [V, d] in both, norms are vectors.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from spec import ModelConfig, check_params, load_weights, param_shapes
from spec.inputs import (
    CacheWrites,
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
from spec.masks import real_tokens, start_is_real
from spec.routing import RoutingLog, check_recorded_routing

ATTENTION_PATHS = ("sdpa", "math")
_HALF = (torch.float16, torch.bfloat16)


# ---- small pieces ---------------------------------------------------------------------------

def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2"""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # torch's default is the exact erf form, as the spec's "gelu"
    "gelu-tanh": gelu_tanh,
    "swish": F.silu,
}


def softmax(x: torch.Tensor, mask: torch.Tensor | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the last axis keeping entries where mask is True, with a sink's exp(s − m) in
    the denominator alone where given (gpt-oss); a row with nothing kept is all zeros (SPEC.md §6).
    torch.softmax of an all -inf row is NaN, hence the explicit max."""
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    row_max = x.amax(dim=-1, keepdim=True)
    if sink is not None:
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(x - row_max)
    total = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - row_max)
    return e / torch.where(total > 0, total, torch.ones_like(total))


# ---- embeddings and positions ---------------------------------------------------------------

def token_embedding(ids: torch.Tensor, table: nn.Embedding, scale: bool) -> torch.Tensor:
    """E[ids] · √d_model, the scale a number of the activation dtype (SPEC §5.13). ids [B, T] -> [B, T, d]"""
    x = table(ids)
    if not scale:
        return x
    # a Python float would be applied in float32 to a half-precision x (torch's op math); the spec
    # rounds √d to x's dtype first, as Gemma's normalizer does
    return x * torch.tensor(math.sqrt(table.embedding_dim), dtype=x.dtype, device=x.device)


def sinusoidal_table(positions: torch.Tensor, d_model: int, layout: str) -> torch.Tensor:
    """angle(pos, i) = pos / 10000^(2i/d), in float64 like the golden: float32 angles lose
    ~1e-7·pos of accuracy, which a long sequence turns into visible error."""
    exponents = torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device) / d_model
    inverse_frequency = 10000.0 ** (-exponents)  # [d/2]
    angles = positions.to(torch.float64)[:, None] * inverse_frequency[None, :]  # [T, d/2]
    if layout == "sinusoidal":
        return torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).reshape(positions.shape[0], d_model)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


# ---- attention ------------------------------------------------------------------------------

def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H·d_k] -> [B, H, T, d_k]"""
    batch, length, width = x.shape
    return x.view(batch, length, n_heads, width // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, d_k] -> [B, T, H·d_k]"""
    batch, n_heads, length, d_head = x.shape
    return x.transpose(1, 2).reshape(batch, length, n_heads * d_head)


def rope_frequencies(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                     length: torch.Tensor | None = None) -> torch.Tensor:
    """ω_i = θ^(−2i/r), i = 0..r/2−1, rescaled by cfg.rope_scaling (SPEC §5.12) for a call whose
    length (1 + its largest position) is `length`; None: a call no longer than the original
    context. In `dtype`. -> [r/2]"""
    r, theta, scaling = cfg.rotary_dim, float(cfg.rope_theta), cfg.rope_scaling
    omega = theta ** (-(torch.arange(0, r, 2, dtype=dtype, device=device) / r))  # [r/2]
    if scaling is None:
        return omega
    if scaling.kind == "linear":
        return omega / scaling.factor  # positions divided by the factor
    if scaling.kind == "llama3":
        return llama3_frequencies(omega, scaling)
    if scaling.kind == "longrope":
        return longrope_frequencies(omega, scaling, length)
    return yarn_frequencies(omega, r, theta, scaling)


def llama3_frequencies(omega: torch.Tensor, scaling) -> torch.Tensor:
    """Wavelengths λ = 2π/ω longer than L/low_freq_factor are divided by the factor, shorter than
    L/high_freq_factor kept, and between them blended: (1−s)·ω/factor + s·ω with
    s = (L/λ − low_freq_factor) / (high_freq_factor − low_freq_factor), L = original_max_len."""
    length, low, high = scaling.original_max_len, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / omega
    smooth = (length / wavelength - low) / (high - low)
    blended = (1 - smooth) * omega / scaling.factor + smooth * omega
    return torch.where(wavelength > length / low, omega / scaling.factor,
                       torch.where(wavelength < length / high, omega, blended))


def yarn_frequencies(omega: torch.Tensor, r: int, theta: float, scaling) -> torch.Tensor:
    """YaRN: pair j is interpolated (ω/factor) by ramp(j) and kept by 1 − ramp(j), the ramp rising
    from 0 to 1 between the dimensions that turn beta_fast and beta_slow times over the original
    context: dim(n) = r · ln(L / (2π·n)) / (2 ln θ)."""
    def dimension(rotations: float) -> float:
        return r * math.log(scaling.original_max_len / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    pairs = torch.arange(r // 2, dtype=omega.dtype, device=omega.device)
    ramp = ((pairs - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return omega / scaling.factor * ramp + omega * (1 - ramp)


def longrope_frequencies(omega: torch.Tensor, scaling, length: torch.Tensor | None) -> torch.Tensor:
    """LongRoPE: ω_i / f_i, f the long factors for a call longer than L = original_max_len
    (ℓ > L, strictly), else the short ones."""
    short = torch.tensor(scaling.short_factor, dtype=omega.dtype, device=omega.device)
    if length is None:
        return omega / short
    long = torch.tensor(scaling.long_factor, dtype=omega.dtype, device=omega.device)
    # a select on the length tensor, not a Python if: the length is data in a compiled or exported step
    return omega / torch.where(length > scaling.original_max_len, long, short)


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


def rope_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """a·cos and a·sin of angle(pos, i) = pos · ω_i (rope_frequencies for the call's length ℓ =
    1 + its largest position; a = rope_attention_factor), each angle repeated for both halves
    (rotate_half's layout), in `dtype`. positions [T] -> 2 × [T, r]"""
    length = positions.max() + 1 if cfg.rotary_reads_length else None
    angles = positions.to(dtype)[:, None] * rope_frequencies(cfg, dtype, positions.device, length)[None, :]  # [T, r/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, r]
    factor = rope_attention_factor(cfg)
    if factor == 1:  # no multiply in the graph an export traces
        return torch.cos(angles), torch.sin(angles)
    return factor * torch.cos(angles), factor * torch.sin(angles)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (−x2, x1), x1 and x2 the two halves of the last axis."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotary(cfg: ModelConfig, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE: the first r dimensions of each head rotate by their position, x_r cos + rotate_half(x_r) sin;
    the others pass (partial rotary). x [B, H, T, d_k], positions [T] -> [B, H, T, d_k]"""
    r = cfg.rotary_dim
    if r == 0:  # a NoPE layer (nope_layers): nothing turns
        return x
    # Angles of a half-precision dtype are useless past a few hundred positions, so the tables are
    # taken in float32 (float64 for a float64 model, like the golden) and only then cast to x's
    # dtype, as Hugging Face's Llama does: the multiply is in x's dtype.
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = (table.to(x.dtype) for table in rope_tables(cfg, positions, wide))
    rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return torch.cat([rotated, x[..., r:]], dim=-1)


def group_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query attention: key/value head j serves query heads j·g .. (j+1)·g − 1, g = H / H_kv.
    [B, H_kv, K, d_k] -> [B, H, K, d_k]"""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """c · tanh(x / c): x bent smoothly into (−c, c); x itself without a cap."""
    return x if cap is None else cap * torch.tanh(x / cap)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                                 path: str = "sdpa", scale: float | None = None, cap: float | None = None,
                                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention(Q, K, V) = softmax(softcap(Q Kᵀ · s)) V, s = 1/√d_k unless given, query head h
    reading key/value head h // (H / H_kv), each head's sink in its denominator where given
    (SPEC §5.16). q [B, H, Q, d_k], k and v [B, H_kv, K, d_k], mask a boolean keep-mask
    broadcastable to [B, H, Q, K], sinks [H]."""
    grouped = k.shape[1] != q.shape[1]
    # SDPA has no softcap and no sink: a capped attention, or one with sinks, takes the math path
    if path == "math" or cap is not None or sinks is not None:
        if grouped:
            k, v = group_heads(k, q.shape[1]), group_heads(v, q.shape[1])
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = softcap(q @ k.transpose(-1, -2) * scale, cap)  # [B, H, Q, K]
        # Half-precision softmax loses the small weights; take it in float32 as SDPA kernels do.
        wide = scores.dtype in _HALF
        sink = None if sinks is None else (sinks.float() if wide else sinks)[:, None, None]
        weights = softmax(scores.float() if wide else scores, mask, sink).to(v.dtype)
        return weights @ v
    # SDPA's boolean attn_mask has the spec's polarity (True = attend; nn.MultiheadAttention's
    # key_padding_mask is the opposite). Whether a kernel returns NaN or zeros for a row with no
    # key differs between kernels and versions, so the rule is enforced here, not assumed.
    if mask is not None:
        # onnxruntime's Attention op (1.31) refuses a mask whose query axis is 1 instead of
        # broadcasting it, so an exported graph needs it spelled out; in torch this is a view.
        mask = mask.expand(*mask.shape[:-2], q.shape[-2], k.shape[-2])
    # enable_gqa: SDPA reads each key/value head for its group in place of the golden's repeated
    # copies (and torch.onnx exports it as one GQA Attention op); only when grouped, so that
    # multi-head attention keeps every kernel SDPA may choose
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped, scale=scale)
    if mask is None:
        return out
    row_has_key = mask.any(dim=-1, keepdim=True)  # [B|1, H|1, Q|1, 1]
    return torch.where(row_has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))


class HeadNorm(nn.Module):
    """Qwen3's RMSNorm of each head's q or k over d_k; OLMo 2's over all `heads` at once
    (qk_norm_scope "projection"). A module of its own so that its parameter's state_dict key is the
    canonical ``q_norm.scale`` / ``k_norm.scale``."""

    def __init__(self, cfg: ModelConfig, heads: int):
        super().__init__()
        self.whole = cfg.qk_norm_scope == "projection"
        self.scale = nn.Parameter(torch.ones(heads * cfg.d_head if self.whole else cfg.d_head))
        self.eps, self.plus_one = float(cfg.norm_eps), cfg.norm_scale_plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole:  # RMSNorm(x W) [B, T, H·d_k], then the heads
            return split_heads(rms_norm(merge_heads(x), self.scale, None, self.eps, self.plus_one), x.shape[1])
        return rms_norm(x, self.scale, None, self.eps, self.plus_one)


def attention_positions(cfg: ModelConfig, q_len: int, k_len: int, offset: int | torch.Tensor = 0,
                        device: torch.device | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """RoPE's (query, key) positions: the keys at offset .. offset+K−1, the queries the last Q of
    them (a self-attention's are the keys'; a decode step's the newest); (None, None) without RoPE.
    offset may be a 0-d tensor on the device (a decode step's), so no position crosses to the host."""
    if cfg.positional != "rope":
        return None, None
    keys = offset + torch.arange(k_len, device=device)
    return keys[k_len - q_len:], keys


class MultiHeadAttention(nn.Module):
    """MultiHead(x, c) = Concat(head_1..head_h) W^O, head_i = Attention(x W_i^Q, c W_g(i)^K, c W_g(i)^V);
    with qk_norm, a self-attention's q_norm and k_norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, path: str = "sdpa", self_attention: bool = True):
        super().__init__()
        d, queries, keys = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
        self.cfg, self.path = cfg, path
        self.q = nn.Linear(d, queries, bias=cfg.qkv_bias)
        self.k = nn.Linear(d, keys, bias=cfg.qkv_bias)
        self.v = nn.Linear(d, keys, bias=cfg.qkv_bias)
        self.o = nn.Linear(queries, d, bias=cfg.bias)
        if cfg.qk_norm and self_attention:
            self.q_norm = HeadNorm(cfg, cfg.n_heads)
            self.k_norm = HeadNorm(cfg, cfg.kv_heads)
        if cfg.attention_output_gate and self_attention:
            self.gate = nn.Linear(d, queries, bias=cfg.qkv_bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks and self_attention else None

    def head_norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The head norm of q or k, when this attention has one. x [B, H, T, d_k]"""
        return getattr(self, f"{name}_norm")(x) if hasattr(self, f"{name}_norm") else x

    def key_value_heads(self, context: torch.Tensor,
                        positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the context, split into the H_kv key/value heads; K normed per head (qk_norm)
        and rotated at its positions (RoPE), as a KV cache holds it. [B, K, d] -> 2 × [B, H_kv, K, d_k]"""
        k = self.head_norm("k", split_heads(self.k(context), self.cfg.kv_heads))
        v = split_heads(self.v(context), self.cfg.kv_heads)
        return (k if positions is None else rotary(self.cfg, k, positions)), v

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """Concat(head_1..head_h) W^O + b with queries from x, normed and rotated as K is.
        x [B, Q, d], k and v [B, H_kv, K, d_k] -> [B, Q, d]"""
        q = self.head_norm("q", split_heads(self.q(x), self.cfg.n_heads))
        q = q if positions is None else rotary(self.cfg, q, positions)
        # K and V go in as H_kv heads, not the golden's group_heads copies: SDPA groups them itself
        heads = scaled_dot_product_attention(q, k, v, mask, self.path, self.cfg.score_scale,
                                             self.cfg.attention_softcap, self.sinks)  # [B, H, Q, d_k]
        return self.o(self.output_gate(x, merge_heads(heads)))

    def output_gate(self, x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """The gated attention's heads (SPEC §5.15): Concat(head_i) ⊙ σ(x W_gate + b) before W^O; the
        heads as they are without it. x [B, Q, d], heads [B, Q, H·d_k] -> [B, Q, H·d_k]"""
        return heads * torch.sigmoid(self.gate(x)) if hasattr(self, "gate") else heads

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None,
                offset: int | torch.Tensor = 0) -> torch.Tensor:
        """x [B, Q, d], context [B, K, d], mask any shape the spec accepts -> [B, Q, d]; RoPE
        positions from offset (attention_positions)."""
        mask = view_mask(mask, x.shape[0], self.cfg.n_heads, x.shape[1], context.shape[1])
        q_positions, k_positions = attention_positions(self.cfg, x.shape[1], context.shape[1], offset, x.device)
        return self.attend(x, *self.key_value_heads(context, k_positions), mask, q_positions)


# ---- feed-forward, norms, residual ----------------------------------------------------------

class FeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2; gated (cfg.gated_ffn): (act(x W1 + b1) ⊙ (x W3 + b3)) W2 + b2,
    SwiGLU with swish, GeGLU with gelu-tanh; gpt-oss's clamped SwiGLU as the gated unit where the
    config has its limit (SPEC §5.16)."""

    def __init__(self, cfg: ModelConfig, d_ff: int | None = None):
        super().__init__()
        d_ff = cfg.d_ff if d_ff is None else d_ff  # a shared expert's own width
        self.w1 = nn.Linear(cfg.d_model, d_ff, bias=cfg.bias)
        if cfg.gated_ffn:
            self.w3 = nn.Linear(cfg.d_model, d_ff, bias=cfg.bias)
        self.w2 = nn.Linear(d_ff, cfg.d_model, bias=cfg.bias)
        self.activation, self.clamp = ACTIVATIONS[cfg.activation], cfg.swiglu_clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            return self.w2(clamped_swiglu(self.w1(x), self.w3(x), *self.clamp))
        hidden = self.activation(self.w1(x))  # [B, T, d_ff]
        if hasattr(self, "w3"):
            hidden = hidden * self.w3(x)
        return self.w2(hidden)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's gated unit (SPEC §5.16): g = min(gate, L), u = clip(up, −L, L);  g·σ(α g) ⊙ (u + 1)"""
    g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


# what the load-balancing loss reads: every MoE layer's (probabilities [N, E], chosen [N, k]) while a
# training loss is taken (recorded_routers)
_ROUTERS: contextvars.ContextVar[list | None] = contextvars.ContextVar("routers", default=None)


@contextlib.contextmanager
def recorded_routers() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every MoE layer's (probabilities [N, E], chosen [N, k]) while inside, in call order."""
    routed: list[tuple[torch.Tensor, torch.Tensor]] = []
    token = _ROUTERS.set(routed)
    try:
        yield routed
    finally:
        _ROUTERS.reset(token)


class MixtureOfExperts(nn.Module):
    """MoE(x) = Σ_j w_j · FFN_top_j(x) (SPEC §5.14): a router R [d, E] chooses k of E gated FFNs per
    token (+ σ(x g) · FFN_shared(x) where there is a shared expert). batched: every expert on every
    token, the chosen outputs gathered (what fused ports run); else the plain loop, each expert on
    the tokens that chose it. Both are in the matrix: the sdpa column runs the batched form, the math
    column the loop."""

    def __init__(self, cfg: ModelConfig, batched: bool = False):
        super().__init__()
        self.router = nn.Linear(cfg.d_model, cfg.moe.n_experts, bias=cfg.moe.router_bias)
        self.experts = nn.ModuleList(FeedForward(cfg) for _ in range(cfg.moe.n_experts))
        if cfg.moe.shared_expert_d_ff:
            self.shared_expert = FeedForward(cfg, cfg.moe.shared_expert_d_ff)
            self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False)
        self.k, self.renormalize, self.batched = cfg.moe.experts_per_token, cfg.moe.renormalize, batched
        self.router_float32 = cfg.moe.router_softmax == "float32"  # at least float32: half activations widened
        self.log: RoutingLog | None = None  # set by Transformer.routing_log
        # an exported graph's routing (export/torch_export.RoutedForwardGraph): the free choices in,
        # the choices to take out, as tensors, since a graph's forced choices are one of its inputs
        self.choices: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.weighting: Callable[[torch.Tensor], torch.Tensor] | None = None  # the same for the weights
        self.index = 0  # which decoder layer this is, for a routing log (Stack sets it)

    def route(self, tokens: torch.Tensor, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """probabilities [N, E], the chosen experts [N, k] largest first, their weights [N, k]."""
        logits = self.router(tokens)
        widen = self.router_float32 and logits.dtype in _HALF
        probabilities = torch.softmax(logits.float() if widen else logits, dim=-1)
        if torch.onnx.is_in_onnx_export():
            # the exporter has no stable sort; ONNX's TopK breaks a tie by the lower index, as the spec does
            chosen = torch.topk(probabilities, self.k, dim=-1).indices
        else:
            # torch.topk documents no order for ties; a stable descending sort puts the lower index first
            chosen = torch.sort(probabilities, dim=-1, descending=True, stable=True).indices[:, :self.k]
        if self.choices is not None:
            chosen = self.choices(chosen)
        if self.log is not None:  # a routing log records the choices, or forces the golden's
            chosen = torch.as_tensor(self.log.choose(self.index, batch, chosen.cpu().numpy()),
                                     device=chosen.device).long()
        if (routed := _ROUTERS.get()) is not None:
            routed.append((probabilities, chosen))
        weights = probabilities.gather(-1, chosen)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weighting is not None:
            weights = self.weighting(weights)
        if self.log is not None:  # the weights logged too, or the golden's taken, and what the router saw
            self.log.see(self.index, tokens.detach().cpu().double().numpy())
            forced = self.log.weigh(self.index, weights.detach().cpu().double().numpy())
            if forced is not None:
                # the golden's values with this router's gradient: a replayed gradient or training
                # case still differentiates through the router
                golden = torch.as_tensor(forced, dtype=weights.dtype, device=weights.device)
                weights = golden + (weights - weights.detach())  # w − w is exactly 0: the values are the golden's
        return probabilities, chosen, weights.to(tokens.dtype)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """σ(x g) · FFN_shared(x): the expert every token takes beside its k. [.., d] -> [.., d]"""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed(x)
        return routed + self.shared(x) if hasattr(self, "shared_expert") else routed

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """Σ_j w_j · FFN_top_j(x) over each token's k chosen experts. [B, T, d] -> [B, T, d]"""
        tokens = x.reshape(-1, x.shape[-1])  # [N, d]: routing is per token
        _, chosen, weights = self.route(tokens, x.shape[0] if x.dim() == 3 else 1)
        if self.batched:
            outputs = torch.stack([expert(tokens) for expert in self.experts], dim=1)  # [N, E, d]
            # gathered, not multiplied by a zero weight: an unchosen expert's inf would make 0 · inf = NaN
            picked = torch.take_along_dim(outputs, chosen[..., None], dim=1)  # [N, k, d]
            return (weights[..., None] * picked).sum(dim=1).reshape(x.shape)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == index, as_tuple=True)  # the tokens that chose it, and where
            if rows.numel():
                out.index_add_(0, rows, weights[rows, slot, None] * expert(tokens[rows]))
        return out.reshape(x.shape)


def layer_ffn(cfg: ModelConfig, path: str) -> nn.Module:
    """A decoder layer's FFN, whichever mixer is before it: one FFN, or the mixture of experts (the
    batched form on the sdpa path, the loop on the math path)."""
    return FeedForward(cfg) if cfg.moe is None else MixtureOfExperts(cfg, batched=path == "sdpa")


def layer_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """γ (x - μ) / √(σ² + ε) + β with the biased variance: exactly F.layer_norm."""
    return F.layer_norm(x, x.shape[-1:], scale, bias, eps)


def std_norm(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """γ (x - μ) / (s + ε) + β with the unbiased std (torch.std's default correction=1)."""
    centered = x - x.mean(dim=-1, keepdim=True)
    return scale * centered / (x.std(dim=-1, keepdim=True) + eps) + bias


def rms_norm(x: torch.Tensor, scale: torch.Tensor, bias: None, eps: float, plus_one: bool = False) -> torch.Tensor:
    """γ x / √(mean(x²) + ε), no bias; γ = 1 + scale where plus_one (Gemma). A half-precision x is
    normalised in float32, cast back, then scaled in its own dtype, as Llama does (SPEC §5.6); not
    F.rms_norm, which scales in float32. Gemma's scales in float32 before the cast: so here."""
    wide = x.float() if x.dtype in _HALF else x
    root = torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)
    if plus_one:
        # x · (γ · r) rather than (x · r) · γ: torch.onnx's rewriter fuses the latter with the cast
        # after it into one RMSNormalization whose output type contradicts its float32 scale
        return (wide * ((1.0 + scale.to(wide.dtype)) * root)).to(x.dtype)
    return (wide * root).to(x.dtype) * scale


class Norm(nn.Module):
    """The config's norm. Parameters are named scale/bias (not nn.LayerNorm's weight/bias) so the
    state_dict keys are the canonical names without a rename; RMSNorm has no bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(cfg.d_model))
        self.bias = None if cfg.norm == "rmsnorm" else nn.Parameter(torch.zeros(cfg.d_model))
        self.norm = cfg.norm
        self.eps, self.plus_one = float(cfg.norm_eps), cfg.norm_scale_plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = {"layernorm": layer_norm, "std": std_norm, "rmsnorm": rms_norm}[self.norm]
        if self.bias is None:  # RMSNorm takes half precision itself
            return rms_norm(x, self.scale, None, self.eps, self.plus_one)
        if x.dtype in _HALF:  # statistics of half-precision activations are taken in float32
            return kind(x.float(), self.scale.float(), self.bias.float(), self.eps).to(x.dtype)
        return kind(x, self.scale, self.bias, self.eps)


def dropout(cfg: ModelConfig, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """x ⊙ keep / (1 − p) with the keep-mask given (SPEC §5.10); None keeps every unit. Not
    F.dropout, which draws its own mask: every implementation must drop the same units."""
    return x if keep is None else x * keep / (1.0 - cfg.dropout)


def residual(cfg: ModelConfig, norm: Norm, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor],
             dropout_mask: torch.Tensor | None = None, post_norm: Norm | None = None) -> torch.Tensor:
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


def block(cfg: ModelConfig, layer: nn.Module, name: str, x: torch.Tensor,
          sublayer: Callable[[torch.Tensor], torch.Tensor], dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The residual block of a layer's sublayer `name` (self_attn, cross_attn, ffn) with its norms:
    {name}_norm, and {name}_post_norm where the config has post norms."""
    return residual(cfg, getattr(layer, f"{name}_norm"), x, sublayer, dropout_mask,
                    getattr(layer, f"{name}_post_norm", None))


# ---- gated DeltaNet: linear attention with a recurrent state (SPEC §5.15: Qwen3.5, Qwen3-Next) ---
# The golden runs the recurrence token by token. A prefill here takes the chunked form deployments
# run (SPEC §5.15): C tokens at a time, a chunk's writes solved together as one unit lower-triangular
# system, the state carried from chunk to chunk. A decode step of one token runs the recurrence.

@dataclass(frozen=True)
class LinearState:
    """What a linear layer keeps between tokens: each convolution's last K − 1 real inputs (zeros
    before the first), and each value head's state."""

    windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v: [B, K − 1, H_k·d_k or H_v·d_v]
    recurrent: torch.Tensor  # S [B, H_v, d_k, d_v], float32 at least (state_dtype)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """S and the recurrence's arithmetic: float32 at half precision, as the reference kernels keep it."""
    return torch.promote_types(dtype, torch.float32)


def start_linear_state(cfg: ModelConfig, batch: int, dtype: torch.dtype, device: torch.device) -> LinearState:
    """The state before the first token: zero windows and zero S."""
    mixer = cfg.linear_attention
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    window = (batch, mixer.conv_kernel - 1)
    return LinearState((torch.zeros(*window, keys, dtype=dtype, device=device),
                        torch.zeros(*window, keys, dtype=dtype, device=device),
                        torch.zeros(*window, values, dtype=dtype, device=device)),
                       torch.zeros(batch, mixer.value_heads, mixer.key_head_dim, mixer.value_head_dim,
                                   dtype=state_dtype(dtype), device=device))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σ x² + ε) over the last axis."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def short_convolution(window: torch.Tensor, u: torch.Tensor, keep: torch.Tensor,
                      kernel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal depthwise convolution over the real tokens, c[j] = Σ_i kernel[j, i] · u[j] of the
    K − 1 real tokens before and the token itself (the window's first), and the window moved on past
    the last real token. window [B, K − 1, C], u [B, T, C], keep [B, T], kernel [C, K]
    -> (c [B, T, C]: anything at pads, window [B, K − 1, C])"""
    batch, length, channels = u.shape
    # the golden moves the window one real token at a time; here the real tokens are packed to the
    # front of their row (pads to a spare slot past the end), convolved in one call, and read back
    rank = keep.long().cumsum(dim=1) - 1  # [B, T]: each real token's place among its row's real ones
    slot = torch.where(keep, rank, length)[..., None].expand(batch, length, channels)
    packed = u.new_zeros(batch, length + 1, channels).scatter(1, slot, u)[:, :length]
    inputs = torch.cat([window, packed], dim=1)  # [B, K − 1 + T, C]
    c = F.conv1d(inputs.transpose(1, 2), kernel[:, None, :], groups=channels).transpose(1, 2)  # [B, T, C] packed
    c = c.gather(1, rank.clamp(min=0)[..., None].expand(batch, length, channels))
    last = keep.sum(dim=1)[:, None] + torch.arange(window.shape[1], device=u.device)  # [B, K − 1]
    return c, inputs.gather(1, last[..., None].expand(batch, window.shape[1], channels))


def gated_delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S ← e^g S + β k (v − e^g Sᵀ k)ᵀ, o = Sᵀ q. state [B, H, d_k, d_v], q and k [B, H, d_k],
    v [B, H, d_v], decay (g) and beta [B, H] -> (o [B, H, d_v], state)"""
    state = torch.exp(decay)[..., None, None] * state
    written = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))  # what k reads, corrected toward v
    state = state + torch.einsum("bhk,bhv->bhkv", k, written)
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def scanned(step: Callable, state: torch.Tensor,
            sequence: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """step(state, item) -> (state, output) along axis 2 of every tensor of sequence ([B, H, N, ..]),
    -> (the last state, the outputs [B, H, N, ..])."""
    items = tuple(t.movedim(2, 0) for t in sequence)
    if torch.compiler.is_exporting():
        # a loop as long as an input (N tokens or chunks, known when the graph runs): torch.export
        # cannot unroll it; scan traces one step and exports the loop (ONNX Scan)
        from torch._higher_order_ops.scan import scan
        state, outputs = scan(step, state, items)
    else:
        outputs = []
        for item in zip(*items):
            state, output = step(state, item)
            outputs.append(output)
        outputs = torch.stack(outputs)
    return state, outputs.movedim(0, 2)


def token_by_token(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                   beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens, one at a time (gated_delta_rule). q and k [B, H, T, d_k],
    v [B, H, T, d_v], decay and beta [B, H, T] -> (o [B, H, T, d_v], state)"""
    def step(state: torch.Tensor, token: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        output, state = gated_delta_rule(state, *token)
        return state, output

    state, outputs = scanned(step, state, (q, k, v, decay, beta))
    return outputs, state


def decay_ratios(decay: torch.Tensor) -> torch.Tensor:
    """Γ_t / Γ_s = exp(Σ_{s<r≤t} g_r) for s ≤ t within a chunk, 0 above the diagonal. [.., C] -> [.., C, C]"""
    size = decay.shape[-1]
    below = torch.ones(size, size, dtype=torch.bool, device=decay.device).tril(-1)
    # each sum taken over its own terms, not as a difference of two cumulative sums: those reach
    # hundreds within a chunk, and their difference would keep only float32's absolute accuracy
    sums = torch.where(below, decay[..., :, None], 0.0).cumsum(dim=-2)  # [t, s] = Σ_{s<r≤t} g_r
    return torch.where(below | torch.eye(size, dtype=torch.bool, device=decay.device), torch.exp(sums), 0.0)


def chunked_gated_delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             decay: torch.Tensor, beta: torch.Tensor,
                             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over T tokens, C at a time (SPEC §5.15's chunked form). Within a chunk from S₀,
    with Γ_t = Π_{s≤t} e^{g_s}, the writes u_t = β_t (v_t − e^{g_t} S_{t−1}ᵀ k_t) solve
    (I + L) U = β ⊙ (V − Γ ⊙ K S₀), L_ts = β_t (Γ_t/Γ_s) k_t·k_s for s < t; then
    O = (Γ ⊙ Q) S₀ + ((Γ_t/Γ_s)_{s≤t} ⊙ Q Kᵀ) U and S_C = Γ_C S₀ + (K ⊙ Γ_C/Γ)ᵀ U.
    state [B, H, d_k, d_v], q and k [B, H, T, d_k], v [B, H, T, d_v], decay (g) and beta [B, H, T]
    -> (o [B, H, T, d_v], state)"""
    length, size = q.shape[2], chunk_size
    chunks = (length + size - 1) // size  # N
    spare = chunks * size - length  # not −T mod C: torch.export's shape solver then sees N · C as the padded length
    # the last chunk filled out with tokens that write nothing (β = 0) and keep the state (g = 0)
    q, k, v = (F.pad(t, (0, 0, 0, spare)).unflatten(2, (chunks, size)) for t in (q, k, v))  # [B, H, N, C, d]
    decay, beta = (F.pad(t, (0, spare)).unflatten(2, (chunks, size)) for t in (decay, beta))  # [B, H, N, C]
    ratios = decay_ratios(decay)  # [B, H, N, C, C]
    growth = torch.exp(decay.cumsum(dim=-1))  # Γ_t [B, H, N, C]
    strict = torch.ones(size, size, dtype=torch.bool, device=q.device).tril(-1)
    system = torch.eye(size, dtype=q.dtype, device=q.device) + torch.where(
        strict, beta[..., :, None] * ratios * (k @ k.transpose(-1, -2)), 0.0)  # I + L
    # the writes, less what the state reads: U = Y − W S₀ (W and Y solved together, for every chunk at once)
    reads, values = solve_unit_lower_triangular(system, torch.cat([(beta * growth)[..., None] * k, beta[..., None] * v],
                                                                   dim=-1)).split([k.shape[-1], v.shape[-1]], dim=-1)
    scores = ratios * (q @ k.transpose(-1, -2))  # [B, H, N, C, C]
    left = ratios[..., -1, :]  # Γ_C / Γ_s [B, H, N, C]
    state, outputs = scanned(chunk_recurrence, state, (values, reads, growth, q, scores, left, k))
    return outputs.flatten(2, 3)[:, :, :length], state


def chunk_recurrence(state: torch.Tensor, chunk: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of chunked_gated_delta_rule from S₀: U = Y − W S₀, O = (Γ ⊙ Q) S₀ + scores U,
    S_C = Γ_C S₀ + (K ⊙ Γ_C/Γ)ᵀ U. state [B, H, d_k, d_v]; the chunk's values (Y), reads (W), growth (Γ),
    q, scores, left (Γ_C/Γ) and k, each [B, H, C, ..] -> (S_C, O [B, H, C, d_v])"""
    values, reads, growth, q, scores, left, k = chunk
    written = values - reads @ state  # U [B, H, C, d_v]
    output = (growth[..., None] * q) @ state + scores @ written
    return growth[..., -1, None, None] * state + (left[..., None] * k).transpose(-1, -2) @ written, output


def solve_unit_lower_triangular(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with system · X = rhs, system unit lower-triangular. [.., C, C], [.., C, n] -> [.., C, n]"""
    if not torch.compiler.is_exporting():
        return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    # ONNX has no triangular solve (torch.onnx exports none): forward substitution, X_i = rhs_i − L_i X
    # with X's rows from i on still zero, a scan over the C rows (unrolled, C = 64 took torch.export
    # minutes for each layer)
    from torch._higher_order_ops.scan import scan

    size = system.shape[-1]
    identity = torch.eye(size, dtype=system.dtype, device=system.device)

    def row(solved: torch.Tensor, item: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        lower, value, place = item  # L_i [.., C], rhs_i [.., n], e_i [C]
        x = value - (lower[..., None, :] @ solved)[..., 0, :]
        return solved + place[:, None] * x[..., None, :], x

    _, rows = scan(row, torch.zeros_like(rhs), ((system - identity).movedim(-2, 0), rhs.movedim(-2, 0), identity))
    return rows.movedim(0, -2)


class ShortConvolution(nn.Module):
    """q's, k's or v's causal depthwise convolution, its weight [channels, K] as the spec stores it
    (a module so that its key is the canonical q_conv.weight)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))

    def forward(self, window: torch.Tensor, u: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return short_convolution(window, u, keep, self.weight)


class Decay(nn.Linear):
    """g = −exp(log_rate) · softplus(x W_decay + b_decay) ≤ 0 per value head: an nn.Linear (its weight
    transposed like every Linear's) with the log rate beside it."""

    def __init__(self, d_model: int, heads: int):
        super().__init__(d_model, heads)
        self.log_rate = nn.Parameter(torch.zeros(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 at least, as the reference kernels take g: a half-precision softplus would
        # round the decay that every later token's state is multiplied by
        wide = state_dtype(x.dtype)
        # F.softplus gives z itself above its threshold (20 by default), off by log(1 + e^−z) ≈ e^−z: under
        # float32's rounding there (e^−20 = 2e-9), not float64's; past 40 it is (e^−40 = 4e-18)
        threshold = 40.0 if wide == torch.float64 else 20.0
        return -torch.exp(self.log_rate.to(wide)) * F.softplus(F.linear(x, self.weight).to(wide) + self.bias.to(wide),
                                                               threshold=threshold)


class GatedRMSNorm(nn.Module):
    """RMSNorm(o) γ ⊙ SiLU(gate) over each head's d_v (γ as stored, never 1 + γ)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(cfg.linear_attention.value_head_dim))
        self.eps = float(cfg.norm_eps)

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm(o, self.scale, None, self.eps) * F.silu(gate)


class GatedDeltaNet(nn.Module):
    """A linear layer's mixer (SPEC §5.15); cfg: the model's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mixer, d = cfg.linear_attention, cfg.d_model
        keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
        self.cfg = cfg
        self.q = nn.Linear(d, keys, bias=False)
        self.k = nn.Linear(d, keys, bias=False)
        self.v = nn.Linear(d, values, bias=False)
        self.q_conv = ShortConvolution(keys, mixer.conv_kernel)
        self.k_conv = ShortConvolution(keys, mixer.conv_kernel)
        self.v_conv = ShortConvolution(values, mixer.conv_kernel)
        self.z = nn.Linear(d, values, bias=False)
        self.beta = nn.Linear(d, mixer.value_heads, bias=False)
        self.decay = Decay(d, mixer.value_heads)
        self.norm = GatedRMSNorm(cfg)
        self.o = nn.Linear(values, d, bias=False)
        # None: one token by the recurrence, more in chunks. An exported graph's length is known only
        # when it runs, so its form is the graph's (export/torch_export.py): "recurrent" or "chunked"
        self.form: str | None = None

    def forward(self, x: torch.Tensor, keep: torch.Tensor,
                state: LinearState | None = None) -> tuple[torch.Tensor, LinearState]:
        """The mixer over x from state (the start's where None): one token by the recurrence, more
        in chunks; pads move nothing and give zeros. x [B, T, d], keep [B, T] -> ([B, T, d], state)"""
        mixer = self.cfg.linear_attention
        batch, length = x.shape[:2]
        state = start_linear_state(self.cfg, batch, x.dtype, x.device) if state is None else state
        wide = state_dtype(x.dtype)
        projected = [self.q(x), self.k(x), self.v(x)]  # [B, T, H·d]
        convolutions = [self.q_conv, self.k_conv, self.v_conv]
        # a pad writes nothing (β = 0) and keeps S (g = 0): the recurrence needs no mask beyond these
        beta = torch.where(keep[..., None], torch.sigmoid(self.beta(x)), 0.0).to(wide).transpose(1, 2)  # [B, H_v, T]
        decay = torch.where(keep[..., None], self.decay(x), 0.0).transpose(1, 2)  # g ≤ 0 [B, H_v, T]
        mixed, windows = [], []
        for u, convolution, window in zip(projected, convolutions, state.windows):
            c, moved = convolution(window, u, keep)
            mixed.append(F.silu(c))
            windows.append(moved)
        q = l2_normalize(split_heads(mixed[0], mixer.key_heads).to(wide)) / math.sqrt(mixer.key_head_dim)
        k = l2_normalize(split_heads(mixed[1], mixer.key_heads).to(wide))
        v = split_heads(mixed[2], mixer.value_heads).to(wide)  # [B, H_v, T, d_v]
        q, k = group_heads(q, mixer.value_heads), group_heads(k, mixer.value_heads)  # value head h reads h // groups
        if (self.form or ("recurrent" if length == 1 else "chunked")) == "recurrent":
            o, recurrent = token_by_token(state.recurrent, q, k, v, decay, beta)
        else:
            o, recurrent = chunked_gated_delta_rule(state.recurrent, q, k, v, decay, beta, mixer.chunk_size)
        outputs = torch.where(keep[..., None, None], o.transpose(1, 2).to(x.dtype), 0.0)  # [B, T, H_v, d_v]
        gate = split_heads(self.z(x), mixer.value_heads).transpose(1, 2)  # [B, T, H_v, d_v]
        heads = self.norm(outputs, gate)
        return self.o(heads.reshape(batch, length, -1)), LinearState(tuple(windows), recurrent)


# ---- layers and stacks ----------------------------------------------------------------------

class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, path: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.self_attn = MultiHeadAttention(cfg, path)
        self.self_attn_norm = Norm(cfg)
        self.ffn = FeedForward(cfg)
        self.ffn_norm = Norm(cfg)

    def ffn_block(self, x: torch.Tensor, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
        return block(self.cfg, self, "ffn", x, self.ffn, dropout_mask)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, dropout_masks: dict | None = None) -> torch.Tensor:
        """x = Block(x, SelfAttention); x = Block(x, FFN). x [B, S, d]; dropout_masks by block name."""
        drop = dropout_masks or {}
        x = block(self.cfg, self, "self_attn", x, lambda h: self.self_attn(h, h, mask), drop.get("self_attn"))
        return self.ffn_block(x, drop.get("ffn"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, path: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.self_attn = MultiHeadAttention(cfg, path)
        self.self_attn_norm = Norm(cfg)
        if cfg.post_norms:
            self.self_attn_post_norm = Norm(cfg)
        if cfg.has_encoder:
            self.cross_attn = MultiHeadAttention(cfg, path, self_attention=False)
            self.cross_attn_norm = Norm(cfg)
        self.ffn = layer_ffn(cfg, path)
        self.ffn_norm = Norm(cfg)
        if cfg.post_norms:
            self.ffn_post_norm = Norm(cfg)

    def ffn_block(self, x: torch.Tensor, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
        return block(self.cfg, self, "ffn", x, self.ffn, dropout_mask)

    def forward(self, y: torch.Tensor, memory: torch.Tensor | None, self_mask: torch.Tensor | None,
                cross_mask: torch.Tensor | None, dropout_masks: dict | None = None) -> torch.Tensor:
        """y = Block(y, masked SelfAttention); y = Block(y, CrossAttention) [encoder-decoder];
        y = Block(y, FFN). y [B, T, d], memory [B, S, d]; dropout_masks by block name."""
        drop = dropout_masks or {}
        y = block(self.cfg, self, "self_attn", y, lambda h: self.self_attn(h, h, self_mask), drop.get("self_attn"))
        if memory is not None:
            y = block(self.cfg, self, "cross_attn", y, lambda h: self.cross_attn(h, memory, cross_mask),
                      drop.get("cross_attn"))
        return self.ffn_block(y, drop.get("ffn"))


class LinearLayer(nn.Module):
    """A hybrid's linear layer (SPEC §5.15): y = Block(y, gated DeltaNet); y = Block(y, FFN), the
    mixer's state carried from `state`. cfg: the model's (its linear_attention)."""

    def __init__(self, cfg: ModelConfig, path: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.linear_attn = GatedDeltaNet(cfg)
        self.linear_attn_norm = Norm(cfg)
        self.ffn = layer_ffn(cfg, path)
        self.ffn_norm = Norm(cfg)

    def ffn_block(self, x: torch.Tensor, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
        return block(self.cfg, self, "ffn", x, self.ffn, dropout_mask)

    def forward(self, y: torch.Tensor, keep: torch.Tensor,
                state: LinearState | None = None) -> tuple[torch.Tensor, LinearState]:
        """y [B, T, d], keep [B, T] -> ([B, T, d], the mixer's state after the last token)"""
        after = []

        def mix(h: torch.Tensor) -> torch.Tensor:
            out, moved = self.linear_attn(h, keep, state)
            after.append(moved)
            return out

        y = block(self.cfg, self, "linear_attn", y, mix)
        return self.ffn_block(y), after[0]


class Stack(nn.Module):
    """The encoder or the decoder: its layers and, with cfg.final_norm, the norm after them (with
    cfg.embed_norm, the norm of its embeddings too)."""

    def __init__(self, cfg: ModelConfig, layer: type[nn.Module], count: int, path: str):
        super().__init__()
        if cfg.embed_norm:
            self.embed_norm = Norm(cfg)
        # each decoder layer with its own config (its window, its rotary: SPEC §6)
        layer_config = cfg.layer if layer is DecoderLayer else (lambda i: cfg)

        def make(index: int) -> nn.Module:
            if layer is DecoderLayer and cfg.layer_kind(index) == "linear":
                return LinearLayer(cfg, path)  # the model's config: its mixer is the model's
            return layer(layer_config(index), path)

        self.layers = nn.ModuleList(make(i) for i in range(count))
        for index, each in enumerate(self.layers):
            if isinstance(getattr(each, "ffn", None), MixtureOfExperts):
                each.ffn.index = index
        if cfg.final_norm:
            self.norm = Norm(cfg)

    def embedding_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(x) if hasattr(self, "embed_norm") else x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if hasattr(self, "norm") else x


class Head(nn.Module):
    """logits = softcap(h W_head + b), the final cap where the config has one. Tied: W_head = E_tgtᵀ,
    and only the bias (if any) lives here."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.tie_head:
            self.weight = nn.Parameter(torch.empty(cfg.tgt_vocab_size, cfg.d_model))  # [out, in] like nn.Linear
        if cfg.head_bias:
            self.bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size))
        self.cap = cfg.final_softcap

    def forward(self, h: torch.Tensor, tied_table: torch.Tensor) -> torch.Tensor:
        weight = tied_table if not hasattr(self, "weight") else self.weight  # both [V, d]
        return softcap(F.linear(h, weight, getattr(self, "bias", None)), self.cap)


def _key_mask(keep: torch.Tensor) -> torch.Tensor:
    """[B, K] real tokens -> [B, 1, 1, K]"""
    return keep[:, None, None, :]


def _causal_mask(q_len: int, k_len: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Query i (position k_len - q_len + i) sees keys j <= that position, and within a sliding
    window of W only j > that position - W: [1, 1, Q, K]"""
    offset = k_len - q_len
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=offset)
    if window is not None:
        keep = keep.triu(diagonal=offset - window + 1)
    return keep[None, None]


def view_mask(mask, batch: int, heads: int, q_len: int, k_len: int, name: str = "mask") -> torch.Tensor | None:
    """Check a user keep-mask with the spec's rule and view it as [B|1, H|1, Q|1, K]."""
    if mask is None:
        return None
    if torch.compiler.is_exporting():
        # Under torch.export the shapes are symbolic and checking them would freeze them to the
        # example's sizes. The masks met there are the model's own [B|1, 1, Q|1, K] ones; the
        # ONNX runner validates user inputs before a graph runs.
        return mask
    return torch.as_tensor(mask).reshape(mask_shape_4d(mask, batch, heads, q_len, k_len, name))


# ---- the training loss ----------------------------------------------------------------------

def smoothed_targets(targets: torch.Tensor, vocab_size: int, pad_id: int, label_smoothing: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """q = 1 − ε on the target token, 0 on pad, ε / (V − 2) on every other token. targets [B, T] -> [B, T, V]"""
    other = label_smoothing / (vocab_size - 2) if label_smoothing else 0.0
    q = torch.full((*targets.shape, vocab_size), other, dtype=dtype, device=targets.device)
    q[..., pad_id] = 0.0
    return q.scatter(-1, targets[..., None], 1.0 - label_smoothing)


def token_cross_entropy(cfg: ModelConfig, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L = (1/N) Σ_t −Σ_j q_tj log softmax(logits_t)_j over the N non-pad targets (0 when N = 0).
    F.cross_entropy's own label_smoothing spreads ε / V over every token, pad and target
    included, which is not the spec's q, so q goes in as class probabilities."""
    real = targets != cfg.pad_id  # [B, T]
    # half-precision log-probabilities are too coarse: the loss is taken in float32 at least
    logits = logits.float() if logits.dtype in _HALF else logits
    q = smoothed_targets(targets, cfg.tgt_vocab_size, cfg.pad_id, float(cfg.label_smoothing), logits.dtype)
    per_token = F.cross_entropy(logits.flatten(0, -2), q.flatten(0, -2), reduction="none").view(targets.shape)
    return (per_token * real).sum() / real.sum().clamp(min=1)


def load_balancing_loss(probabilities: list[torch.Tensor], chosen: list[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """aux = E · Σ_e f_e · P_e over the L layers and the N real tokens (keep [B, T]; 0 when N = 0):
    f_e the share of their choices that went to e (constants), P_e their mean probability of e.
    probabilities [N, E] and chosen [N, k] per layer."""
    experts = probabilities[0].shape[-1]
    # half-precision sums of probabilities are too coarse: the loss is taken in float32 at least
    dtype = torch.promote_types(probabilities[0].dtype, torch.float32)
    keep = keep.reshape(-1, 1).to(dtype)  # [N, 1]
    count = (len(probabilities) * keep.sum()).clamp(min=1)
    shares = sum((F.one_hot(layer, experts).sum(dim=-2) * keep).sum(dim=0) for layer in chosen) / count
    mean_probability = sum((layer.to(dtype) * keep).sum(dim=0) for layer in probabilities) / count
    return experts * (shares * mean_probability).sum()


def training_loss(cfg: ModelConfig, logits: torch.Tensor, targets, tgt_ids,
                  routed: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The loss a training step minimises: token_cross_entropy of the teacher-forced logits, plus α
    times a mixture of experts' load-balancing loss over the real target-side tokens of tgt_ids
    (α = moe.load_balancing, SPEC §5.14), from the routing the forward recorded (recorded_routers)."""
    loss = token_cross_entropy(cfg, logits, torch.as_tensor(targets, device=logits.device))
    if cfg.moe is None or not cfg.moe.load_balancing:
        return loss
    check_recorded_routing(cfg, len(routed))
    keep = torch.as_tensor(real_tokens(cfg, np.asarray(tgt_ids), "tgt"), device=logits.device)
    return loss + cfg.moe.load_balancing * load_balancing_loss([p for p, _ in routed], [c for _, c in routed], keep)


# ---- the whole model ------------------------------------------------------------------------

class Transformer(nn.Module):
    """The spec's model. ``model(src_ids, tgt_ids)`` -> logits [B, T, V] (decoder-only: src_ids=None)."""

    def __init__(self, cfg: ModelConfig, attention: str = "sdpa"):
        super().__init__()
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, got {attention!r}")
        self.cfg = cfg
        if cfg.has_encoder and not cfg.share_src_tgt_embed:
            self.src_embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model)
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model)
        if cfg.positional == "learned":
            if cfg.has_encoder:
                self.src_pos = nn.Embedding(cfg.max_len, cfg.d_model)
            self.tgt_pos = nn.Embedding(cfg.max_len, cfg.d_model)
        if cfg.has_encoder:
            self.encoder = Stack(cfg, EncoderLayer, cfg.n_encoder_layers, attention)
        self.decoder = Stack(cfg, DecoderLayer, cfg.n_decoder_layers, attention)
        self.head = Head(cfg)
        self.eval()  # conformance is eval mode; this model has no dropout at all

    # ---- loading ----
    @classmethod
    def from_params(cls, cfg: ModelConfig, params: Mapping[str, np.ndarray], *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", attention: str = "sdpa") -> "Transformer":
        """Build from canonical float32 NumPy parameters (checked against the spec first)."""
        check_params(cfg, params)
        with torch.device("meta"):  # no random initialisation to pay for: every tensor is replaced below
            model = cls(cfg, attention)
        linear_weights = _linear_weight_names(model)
        state = {}
        for name, value in params.items():
            with warnings.catch_warnings():  # a memory-mapped checkpoint is read-only; it is copied below, not written
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                tensor = torch.from_numpy(np.asarray(value))
            # one copy, straight to the model's dtype and device; torch transposes in parallel
            state[name] = (tensor.T if name in linear_weights else tensor).to(
                device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        model.load_state_dict(state, strict=True, assign=True)
        return model

    @classmethod
    def from_file(cls, path, **options) -> "Transformer":
        cfg, params = load_weights(path)
        return cls.from_params(cfg, params, **options)

    def to_params(self) -> dict[str, np.ndarray]:
        """Canonical float32 parameters (bit-exact round trip from float32 or float64 models)."""
        linear_weights = _linear_weight_names(self)
        params = {}
        for name, value in self.state_dict().items():
            array = value.detach().to("cpu", torch.float32).numpy()
            params[name] = np.ascontiguousarray(array.T if name in linear_weights else array)
        return {name: params[name] for name in param_shapes(self.cfg)}

    @contextlib.contextmanager
    def routing_log(self, forced: list[np.ndarray] | None = None,
                    forced_weights: list[np.ndarray] | None = None) -> Iterator[RoutingLog]:
        """Inside, every MoE layer logs its choices and weights, or takes the forced ones (replayed
        routing)."""
        log = RoutingLog(forced, forced_weights)
        self.attach_routing_log(log)
        try:
            yield log
        finally:
            self.attach_routing_log(None)

    def attach_routing_log(self, log: RoutingLog | None) -> None:
        """Every MoE layer writes to `log` (another model's, in use: a copy trained in its place)."""
        for module in self.modules():
            if isinstance(module, MixtureOfExperts):
                module.log = log

    def routing_log_in_use(self) -> RoutingLog | None:
        """The routing log the MoE layers write to now, if any (a trainer tells it of each step)."""
        return next((module.log for module in self.modules() if isinstance(module, MixtureOfExperts)), None)

    def decoder_self_masks(self, tgt_keep: torch.Tensor) -> dict[int | None, torch.Tensor]:
        """The decoder's self-attention masks over real tokens tgt_keep [B, T], by window, one for
        each window its layers have (None: full causal): {W: [B, 1, T, T]}"""
        length = tgt_keep.shape[1]
        return {window: _causal_mask(length, length, tgt_keep.device, window) & _key_mask(tgt_keep)
                for window in set(self.cfg.layer_windows)}

    # ---- pieces the harness drives one by one ----
    def decoder_self_mask(self, index: int, tgt_keep: torch.Tensor) -> torch.Tensor:
        """Decoder layer `index`'s self-attention mask, as decode builds it: [B, 1, T, T]"""
        return self.decoder_self_masks(tgt_keep)[self.decoder.layers[index].cfg.sliding_window]

    def _table(self, side: str) -> nn.Embedding:
        return self.src_embed if side == "src" and hasattr(self, "src_embed") else self.tgt_embed

    def positional_encoding(self, side: str, length: int, offset: int | torch.Tensor = 0) -> torch.Tensor:
        """[T, d] for positions offset..offset+length-1; zeros for RoPE, whose positions enter the
        attention instead (rotary)."""
        device, dtype = self.tgt_embed.weight.device, self.tgt_embed.weight.dtype
        if isinstance(offset, torch.Tensor):  # a decode step's position, kept on the device
            positions = offset + torch.arange(length, device=device)
        else:
            positions = torch.arange(offset, offset + length, device=device)
        if self.cfg.positional == "rope":
            return torch.zeros(length, self.cfg.d_model, dtype=dtype, device=device)
        if self.cfg.positional == "learned":
            return getattr(self, f"{side}_pos")(positions)
        return sinusoidal_table(positions, self.cfg.d_model, self.cfg.positional).to(dtype)

    def embed(self, ids: torch.Tensor, side: str, offset: int | torch.Tensor = 0,
              dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x = Dropout(E[ids] (· √d) + PE[positions]), then Norm(x) when cfg.embed_norm. [B, T] -> [B, T, d]"""
        x = token_embedding(ids, self._table(side), self.cfg.embed_scale)
        if self.cfg.positional != "rope":
            x = x + self.positional_encoding(side, ids.shape[1], offset)[None]
        x = dropout(self.cfg, x, dropout_mask)
        return (self.encoder if side == "src" else self.decoder).embedding_norm(x)

    def encode(self, src_ids: torch.Tensor, src_keep: torch.Tensor, dropout_masks: dict | None = None) -> torch.Tensor:
        """memory [B, S, d]; dropout_masks by site (spec.dropout.dropout_sites)"""
        x = self.embed(src_ids, "src", dropout_mask=(dropout_masks or {}).get("encoder.embed"))
        mask = _key_mask(src_keep)
        for i, layer in enumerate(self.encoder.layers):
            x = layer(x, mask, masks_under(dropout_masks, f"encoder.layers.{i}"))
        return self.encoder.final_norm(x)

    def decode(self, tgt_ids: torch.Tensor, tgt_keep: torch.Tensor, memory: torch.Tensor | None = None,
               src_keep: torch.Tensor | None = None, dropout_masks: dict | None = None) -> torch.Tensor:
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

    def output_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h, self.tgt_embed.weight)

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        """log_softmax in float32 at least: half-precision log-probabilities are too coarse."""
        logits = self.output_logits(h)
        return F.log_softmax(logits.float() if logits.dtype in _HALF else logits, dim=-1).to(logits.dtype)

    def _ids(self, ids) -> torch.Tensor:
        return torch.as_tensor(ids, device=self.tgt_embed.weight.device).long()

    def _keep(self, ids: torch.Tensor, keep, side: str, offset: int = 0) -> torch.Tensor:
        """The given keep-vector, else ids != pad_id with an encoder-decoder's start token real."""
        if keep is not None:
            check_keep(keep, ids, f"{side}_keep")
            return torch.as_tensor(keep, device=ids.device)
        real = ids != self.cfg.pad_id
        if start_is_real(self.cfg, side, offset):
            real[:, 0] = True
        return real

    def forward(self, src_ids, tgt_ids, src_keep=None, tgt_keep=None, dropout_masks=None) -> torch.Tensor:
        """Teacher-forced logits [B, T, V]; in training mode when dropout keep-masks are given."""
        check_model_inputs(self.cfg, src_ids, tgt_ids)
        check_dropout_masks(self.cfg, dropout_masks, np.shape(tgt_ids)[0],
                            None if src_ids is None else np.shape(src_ids)[1], np.shape(tgt_ids)[1])
        tgt_ids = self._ids(tgt_ids)
        tgt_keep = self._keep(tgt_ids, tgt_keep, "tgt")
        masks = None if dropout_masks is None else {
            site: torch.as_tensor(np.asarray(keep), device=tgt_ids.device) for site, keep in dropout_masks.items()}
        memory = None
        if self.cfg.has_encoder:
            src_ids = self._ids(src_ids)
            src_keep = self._keep(src_ids, src_keep, "src")
            memory = self.encode(src_ids, src_keep, masks)
        return self.output_logits(self.decode(tgt_ids, tgt_keep, memory, src_keep, masks))

    # ---- incremental decoding ----
    def start_cache(self, batch: int, capacity: int, src_ids=None, src_keep=None) -> "KVCache":
        return start_cache(self, batch, capacity, src_ids, src_keep)

    def decode_step(self, cache: "KVCache", tgt_ids, tgt_keep=None) -> tuple[torch.Tensor, "KVCache"]:
        return decode_step(self, cache, tgt_ids, tgt_keep)

    def greedy_generate(self, src_ids=None, **options) -> torch.Tensor:
        return greedy_generate(self, src_ids, **options)


def _linear_weight_names(model: nn.Module) -> set[str]:
    """Canonical names of the weights stored [out, in] in PyTorch (nn.Linear's and the head's)."""
    names = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    if isinstance(model, Transformer) and not model.cfg.tie_head:
        names.add("head.weight")
    return names


# ---- incremental decoding with a preallocated KV cache --------------------------------------

@dataclass(frozen=True)
class KVCache:
    """Preallocated for `capacity` positions and written in place, so a decode step allocates
    nothing and every step has the same shapes (a new key length is a new kernel plan on a GPU,
    and CUDA graphs need fixed buffers). L decoder layers, A of them attention layers, C = capacity."""

    self_keys: torch.Tensor  # [A, B, H_kv, C, d_k], rotated at their positions (RoPE); A attention layers
    self_values: torch.Tensor  # [A, B, H_kv, C, d_k] (cfg.cached_layers: a layer's row)
    tgt_keep: torch.Tensor  # [B, C]: real tokens among the decoded positions; stale past `length`
    length: int  # positions decoded so far: a host integer, so no step waits on the device for it
    cross_keys: torch.Tensor | None = None  # [L, B, H_kv, S, d_k], computed once
    cross_values: torch.Tensor | None = None
    src_keep: torch.Tensor | None = None  # [B, S]
    linear_states: tuple[LinearState | None, ...] | None = None  # L: a linear layer's state, else None (§5.15)
    writes: CacheWrites = field(default_factory=CacheWrites, repr=False, compare=False)
    version: int = 0

    @property
    def capacity(self) -> int:
        return self.tgt_keep.shape[1]

    def copy(self) -> "KVCache":
        """A cache with buffers of its own, to continue independently of this one."""
        self.writes.check(self.version)
        keys, values, keep = (t.clone() for t in (self.self_keys, self.self_values, self.tgt_keep))
        states = None if self.linear_states is None else tuple(
            None if state is None else LinearState(tuple(w.clone() for w in state.windows), state.recurrent.clone())
            for state in self.linear_states)
        return replace(self, self_keys=keys, self_values=values, tgt_keep=keep, linear_states=states,
                       writes=CacheWrites(), version=0)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step writes in place."""
        states = [] if self.linear_states is None else [t for state in self.linear_states if state is not None
                                                        for t in (*state.windows, state.recurrent)]
        return [self.self_keys, self.self_values, self.tgt_keep, *states]


@torch.inference_mode()
def start_cache(model: Transformer, batch: int, capacity: int, src_ids=None, src_keep=None) -> KVCache:
    """An empty cache of `capacity` positions; for an encoder-decoder, run the encoder once and
    keep each layer's cross-attention K and V of the memory."""
    cfg = model.cfg
    capacity = check_cache_capacity(cfg, capacity)
    weight = model.tgt_embed.weight
    rows = sum(row is not None for row in cfg.cached_layers)  # a linear layer keeps no keys or values
    shape = (rows, batch, cfg.kv_heads, capacity, cfg.d_head)
    keys, values = (torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in range(2))
    states = None if cfg.linear_attention is None else tuple(
        start_linear_state(cfg, batch, weight.dtype, weight.device) if cfg.layer_kind(i) == "linear" else None
        for i in range(cfg.n_decoder_layers))
    cache = KVCache(keys, values, torch.zeros(batch, capacity, dtype=torch.bool, device=weight.device), 0,
                    linear_states=states)
    if not cfg.has_encoder:
        return cache
    check_source(cfg, src_ids, batch)
    src_ids = model._ids(src_ids)
    src_keep = model._keep(src_ids, src_keep, "src")
    memory = model.encode(src_ids, src_keep)
    pairs = [layer.cross_attn.key_value_heads(memory) for layer in model.decoder.layers]
    return replace(cache, cross_keys=torch.stack([k for k, _ in pairs]),
                   cross_values=torch.stack([v for _, v in pairs]), src_keep=src_keep)


@torch.inference_mode()
def decode_step(model: Transformer, cache: KVCache, tgt_ids, tgt_keep=None) -> tuple[torch.Tensor, KVCache]:
    """Feed the next n target tokens [B, n] after the cached ones: logits [B, n, V], new cache."""
    cfg = model.cfg
    check_decode_step(cfg, tgt_ids, cache.length, cache.tgt_keep.shape[0])
    check_cache_room(cache.capacity, cache.length, np.shape(tgt_ids)[1])
    cache.writes.check(cache.version)
    tgt_ids = model._ids(tgt_ids)
    keep = model._keep(tgt_ids, tgt_keep, "tgt", cache.length)
    logits = _decode_step_body(model, cache, tgt_ids, keep, _position(cache.length, tgt_ids.device))
    return logits, _advanced(cache, tgt_ids.shape[1])


def _position(length: int, device: torch.device) -> torch.Tensor:
    # filled on the device (torch.tensor(length, device=...) would copy from the host, and on a
    # GPU a copy from pageable memory waits for the stream)
    return torch.full((), length, dtype=torch.long, device=device)


def _advanced(cache: KVCache, n_new: int) -> KVCache:
    """The cache after a step wrote n_new positions: host bookkeeping only."""
    return replace(cache, length=cache.length + n_new, version=cache.writes.advance(cache.version))


def _decode_step_body(model: Transformer, cache: KVCache, tgt_ids: torch.Tensor, new_keep: torch.Tensor,
                      start: torch.Tensor) -> torch.Tensor:
    """The step's tensor work: writes K, V and keep at positions start … start+n−1 and returns
    the logits [B, n, V]. `start` is a 0-d tensor on the device, not an int, so the position never
    crosses to the host and torch.compile traces one graph for every position (a graph per
    position would recompile each step and defeat CUDA graphs)."""
    cfg = model.cfg
    batch, n_new = tgt_ids.shape
    positions = start + torch.arange(n_new, device=start.device)  # [n]
    # scatter_ along the position axis rather than index_copy_: the same writes, but torch.onnx
    # exports index_copy_ on an inner axis as transposes of the whole cache around a ScatterND
    # (four per layer and step), scatter_ as one ScatterElements on that axis
    cache.tgt_keep.scatter_(1, positions[None, :].expand(batch, n_new), new_keep)
    at_positions = positions[None, None, :, None].expand(batch, cfg.kv_heads, n_new, cfg.d_head)  # [B, H_kv, n, d_k]
    slots = torch.arange(cache.capacity, device=start.device)[None, :]
    self_masks = {}
    for window in set(cfg.layer_windows):
        causal = slots <= positions[:, None]  # [n, C]
        if window is not None:
            causal = causal & (slots > positions[:, None] - window)
        # the stale entries past the new positions are hidden by the causal mask, whatever they hold
        self_masks[window] = causal[None, None] & _key_mask(cache.tgt_keep)  # [B, 1, n, C]
    cross_mask = None if cache.src_keep is None else _key_mask(cache.src_keep)
    y = model.embed(tgt_ids, "tgt", offset=start)
    rope_positions, _ = attention_positions(cfg, n_new, n_new, start, start.device)  # RoPE's: the new ones
    rows = cfg.cached_layers  # each attention layer's row of the cache
    for i, layer in enumerate(model.decoder.layers):
        if isinstance(layer, LinearLayer):  # its state carried on, written in place; no keys or values (§5.15)
            state = cache.linear_states[i]
            y, moved = layer(y, new_keep, state)
            for buffer, value in zip((*state.windows, state.recurrent), (*moved.windows, moved.recurrent)):
                buffer.copy_(value)
            continue

        def cached_self_attention(h: torch.Tensor) -> torch.Tensor:
            # write K (rotated) and V of the new positions into the preallocated cache at their positions
            k, v = layer.self_attn.key_value_heads(h, rope_positions)
            row = rows[i]
            cache.self_keys[row].scatter_(2, at_positions, k)
            cache.self_values[row].scatter_(2, at_positions, v)
            return layer.self_attn.attend(h, cache.self_keys[row], cache.self_values[row],
                                          self_masks[layer.cfg.sliding_window], rope_positions)

        y = block(layer.cfg, layer, "self_attn", y, cached_self_attention)
        if cache.cross_keys is not None:
            y = block(cfg, layer, "cross_attn", y,
                      lambda h: layer.cross_attn.attend(h, cache.cross_keys[i], cache.cross_values[i], cross_mask))
        y = layer.ffn_block(y)
    return model.output_logits(model.decoder.final_norm(y))


def compiled_step(**compile_options) -> Callable:
    """The step's tensor work under torch.compile as one graph for every position (fullgraph,
    no recompiling per position): with mode="reduce-overhead" on a GPU, a CUDA graph replayed
    each step. For greedy_generate(step=...)."""
    return torch.compile(_decode_step_body, fullgraph=True, dynamic=False, **compile_options)


STOP_CHECK_EVERY = 8  # steps between the host's looks at whether every row has finished


@torch.inference_mode()
def greedy_generate(model: Transformer, src_ids=None, *, prompt_ids=None, bos_id: int | None = None,
                    eos_id: int | None = None, max_new_tokens: int, step: Callable | None = None) -> torch.Tensor:
    """Greedy decoding with the KV cache -> new tokens [B, max_new_tokens] (SPEC.md §7).
    step: the step's tensor work, compiled (compiled_step()), else run eagerly."""
    cfg = model.cfg
    batch, _ = check_generation(cfg, src_ids, prompt_ids, bos_id, max_new_tokens)
    device = model.tgt_embed.weight.device
    if cfg.has_encoder:
        first = torch.full((batch, 1), bos_id, dtype=torch.long, device=device)
        first_keep = torch.ones_like(first, dtype=torch.bool)
    else:
        first = model._ids(prompt_ids)
        first_keep = first != cfg.pad_id
    cache = start_cache(model, batch, first.shape[1] + max_new_tokens - 1, src_ids)
    if step is not None:
        # the buffers written in place keep their addresses: a CUDA graph may then write into
        # them rather than into copies of them
        for buffer in cache.buffers():
            torch._dynamo.mark_static_address(buffer)
    body = step or _decode_step_body
    tokens = torch.full((batch, max_new_tokens), cfg.pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    one_real = torch.ones(batch, 1, dtype=torch.bool, device=device)
    step_ids, step_keep, start = first, first_keep, _position(0, device)
    for t in range(max_new_tokens):
        # generated ids are the model's own, in range by construction: the checked decode_step
        # would read them back to the host every step, and the GPU would wait for it
        logits = body(model, cache, step_ids, step_keep, start)
        cache, start = _advanced(cache, step_ids.shape[1]), start + step_ids.shape[1]
        # argmax of float32 logits: ties go to the lowest id, as in the golden
        next_token = torch.where(finished, cfg.pad_id, logits[:, -1].float().argmax(dim=-1))
        tokens[:, t] = next_token
        if eos_id is not None:
            finished |= next_token == eos_id
            # a look at `finished` waits for the device, so it is taken every few steps only:
            # the rows already finished go on producing pad, as the golden's do
            if (t + 1) % STOP_CHECK_EVERY == 0 and _all_finished(finished):
                break
        step_ids, step_keep = next_token[:, None], one_real
    return tokens


def _all_finished(finished: torch.Tensor) -> bool:
    return bool(finished.all())  # the host waits for the device here
