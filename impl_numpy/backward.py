"""The golden backward: a hand-written float64 vector-Jacobian product (VJP) for every piece of
model.py, one function per equation, named after it, in model.py's order.

Each takes the forward's inputs and the cotangent of its output (d_y = ∂L/∂y, same shape as y)
and returns the cotangents of its inputs and parameters; it recomputes what it needs of the
forward from those inputs. The derivative is in each docstring's first line. Parameter
gradients come back as dicts named like the parameters they belong to; a parameter used twice
(a tied head, a shared source/target table) gets the sum of both uses. tests/test_backward.py
audits every one three ways: float64 central differences, torch float64 autograd and JAX x64.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from impl_numpy.model import (
    ACTIVATIONS,
    Params,
    attention_positions,
    balanced_model_logits,
    clamped_swiglu,
    block,
    decoder,
    decoder_layer,
    decoder_self_masks,
    delta_net_projections,
    dropout,
    embed,
    encoder,
    encoder_layer,
    _erf,
    expert_shares,
    experts_ffn,
    feed_forward,
    gated_delta_net,
    gated_delta_rule,
    gated_rms_norm,
    group_heads,
    head_norm,
    key_value_heads,
    layer_experts,
    linear,
    linear_layer,
    load_balancing_loss,
    log_softmax,
    merge_heads,
    model_inputs,
    multi_head_attention,
    norm,
    norm_scale,
    output_gate,
    positional_encoding,
    rms_norm,
    rope_tables,
    rotary,
    rotate_half,
    router_probabilities,
    routing_weights,
    scaled_dot_product_attention,
    short_convolution,
    sigmoid,
    smoothed_targets,
    softcap,
    softmax,
    split_heads,
    swish,
    token_cross_entropy,
    token_embedding,
    token_queries_keys_values,
    top_experts,
)
from spec import ModelConfig, params_under
from spec.config import GOLDEN_BACKWARD, check_computed_by
from spec.dropout import masks_under
from spec.inputs import check_targets
from spec.masks import key_mask

Grads = dict[str, np.ndarray]  # parameter name (relative to a module) -> ∂L/∂parameter


# ---- small pieces ---------------------------------------------------------------------------

def linear_vjp(x: np.ndarray, weight: np.ndarray, d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = x W + b:  ∂x = ∂y Wᵀ, ∂W = Σ xᵀ ∂y, ∂b = Σ ∂y (sums over every leading axis).
    x [.., in], W [in, out], d_y [.., out] -> d_x [.., in], d_weight [in, out], d_bias [out]"""
    rows_x, rows_d_y = x.reshape(-1, x.shape[-1]), d_y.reshape(-1, d_y.shape[-1])
    if _LARGEST[0] is not None:
        _LARGEST[0] = max(_LARGEST[0], float(np.abs(d_y).max(initial=0.0)))
    return d_y @ weight.T, rows_x.T @ rows_d_y, rows_d_y.sum(axis=0)


def relu_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂ max(0, x) / ∂x = [x > 0] (0 at x = 0, as torch and JAX take it)"""
    derivative = x > 0
    if _RELU_FLIPPED_WITHIN[0]:
        derivative = derivative ^ (np.abs(x) <= _RELU_FLIPPED_WITHIN[0] * max(1.0, float(np.abs(x).max())))
    return _through(derivative, d_y)


def _through(derivative: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂y · f'(x); without cancellation every unit passes ∂y whole: a derivative that is 0 here
    (ReLU's off side, or GELU's and swish's saturated tails, exactly 0 in float64 where the true
    value is merely tiny) is not a place that nothing reaches."""
    return d_y * derivative if _CANCELLING[0] else d_y


def gelu_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂ x Φ(x) / ∂x = Φ(x) + x φ(x), φ(x) = exp(−x²/2) / √(2π)"""
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return _through(cdf + x * pdf, d_y)


def gelu_tanh_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂/∂x of x (1 + tanh u) / 2, u = c (x + a x³): (1 + tanh u) / 2 + x (1 − tanh² u) c (1 + 3a x²) / 2"""
    c, a = math.sqrt(2.0 / math.pi), 0.044715
    t = np.tanh(c * (x + a * x**3))
    return _through(0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x), d_y)


def swish_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂ x σ(x) / ∂x = σ(x) + x σ(x) (1 − σ(x)), σ(x) = (1 + tanh(x/2)) / 2"""
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * x))
    return _through(sigmoid + x * sigmoid * (1.0 - sigmoid), d_y)


ACTIVATION_VJPS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relu": relu_vjp, "gelu": gelu_vjp, "gelu-tanh": gelu_tanh_vjp, "swish": swish_vjp,
}


def log_softmax_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """y = log softmax(x):  ∂x = ∂y − softmax(x) Σ_j ∂y_j over the last axis"""
    return d_y - np.exp(log_softmax(x)) * d_y.sum(axis=-1, keepdims=True)


def softmax_vjp(p: np.ndarray, d_p: np.ndarray) -> np.ndarray:
    """p = softmax(x):  ∂x = p ⊙ (∂p − Σ_j ∂p_j p_j) over the last axis. A masked entry has p = 0,
    so its ∂x is exactly 0; a row with nothing kept (p all 0) gets 0, never NaN."""
    if not _CANCELLING[0]:
        return p * d_p
    return p * (d_p - (d_p * p).sum(axis=-1, keepdims=True))


_CANCELLING = [True]  # without_cancellation() clears it
_RELU_FLIPPED_WITHIN = [0.0]  # relu_kinks_flipped() sets it
_LARGEST: list[float | None] = [None]  # largest_cotangent() keeps the largest |∂y| a linear layer meets here


@contextlib.contextmanager
def largest_cotangent():
    """Yields a list whose one entry is, after the block, the largest |∂y| that any linear layer's
    VJP met in it: the size a backward that runs the chain must hold (SPEC.md §13: beyond a dtype's
    largest finite value, no backward at that dtype holds it)."""
    outer, _LARGEST[0] = _LARGEST[0], 0.0
    found = [0.0]
    try:
        yield found
    finally:
        found[0] = _LARGEST[0]
        _LARGEST[0] = outer if outer is None else max(outer, found[0])


@contextlib.contextmanager
def without_cancellation():
    """The VJPs with what zeroes or cancels by value dropped: softmax's ∂x = p ⊙ ∂p, ∂b^K as
    computed, every activation passing every unit (ReLU's off side, a saturated GELU's 0). Their
    values are wrong, but they serve twice (SPEC.md §13): an entry still exactly zero is one that
    nothing reaches (a masked score, a padded or absent token, a pad target), unlike one whose
    terms cancel (a row with a single key, ∂b^K) or a unit that rounding may turn on; and their
    size is the size of the terms the true gradient sums, against which its rounding is measured
    where they cancel."""
    _CANCELLING[0] = False
    try:
        yield
    finally:
        _CANCELLING[0] = True


# ---- attention ------------------------------------------------------------------------------

def softcap_vjp(x: np.ndarray, cap: float | None, d_y: np.ndarray) -> np.ndarray:
    """y = c tanh(x / c):  ∂x = ∂y (1 − tanh²(x / c)); the identity without a cap."""
    return d_y if cap is None else d_y * (1.0 - np.tanh(x / cap) ** 2)


def scaled_dot_product_attention_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                                     d_out: np.ndarray, scale: float | None = None, cap: float | None = None,
                                     sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """out = P V, P = softmax(softcap(S), mask), S = Q Kᵀ s (s = 1/√d_k unless given):
    ∂V = Pᵀ ∂out, ∂P = ∂out Vᵀ, ∂S = softcap_vjp(S, softmax_vjp(P, ∂P)), ∂Q = ∂S K s, ∂K = ∂Sᵀ Q s.
    A sink (SPEC §5.16) changes P only: the sink's own share has no ∂P, so softmax_vjp over the keys
    is its chain rule still. q [B, H, Q, d_k], k and v [B, H, K, d_k], d_out [B, H, Q, d_k] -> d_q, d_k, d_v"""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale  # S [B, H, Q, K]
    weights = softmax(softcap(scores, cap), mask, None if sinks is None else sinks[:, None, None])  # P [B, H, Q, K]
    d_v = np.swapaxes(weights, -1, -2) @ d_out  # [B, H, K, d_k]
    d_scores = softcap_vjp(scores, cap, softmax_vjp(weights, d_out @ np.swapaxes(v, -1, -2)))  # ∂S [B, H, Q, K]
    return d_scores @ k * scale, np.swapaxes(d_scores, -1, -2) @ q * scale, d_v


def attention_sinks_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, d_out: np.ndarray,
                        scale: float, cap: float | None, sinks: np.ndarray) -> np.ndarray:
    """The sinks' gradient (SPEC §5.16): P_s = 1 − Σ_k P_k is the share the sink took, and
    ∂s_h = −Σ_{b,q} P_s · Σ_k P_k ∂P_k over head h's rows (0 for a row with no key, all the sink's).
    q [B, H, Q, d_k], k and v [B, H, K, d_k], d_out [B, H, Q, d_k], sinks [H] -> [H]"""
    weights = softmax(softcap(q @ np.swapaxes(k, -1, -2) * scale, cap), mask, sinks[:, None, None])  # [B, H, Q, K]
    d_weights = d_out @ np.swapaxes(v, -1, -2)  # ∂P
    sink_share = 1.0 - weights.sum(axis=-1)  # [B, H, Q]
    if not _CANCELLING[0]:  # the terms' size: Σ_k P_k ∂P_k's terms do not cancel each other's sign
        return (sink_share * (weights * np.abs(d_weights)).sum(axis=-1)).sum(axis=(0, 2))
    return -(sink_share * (weights * d_weights).sum(axis=-1)).sum(axis=(0, 2))


# ---- feed-forward and norms -----------------------------------------------------------------

def feed_forward_vjp(p: dict[str, np.ndarray], x: np.ndarray, activation: str, d_y: np.ndarray,
                     clamp: tuple[float, float] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """y = a W2 + b2, a = act(x W1 + b1), gated: y = (a ⊙ u) W2 + b2, u = x W3 + b3:
    ∂a = ∂h ⊙ u, ∂u = ∂h ⊙ a, then back through the activation and W1 (and W3).
    x [B, T, d], d_y [B, T, d] -> d_x [B, T, d], {w1.*, w3.*, w2.*}"""
    before = x @ p["w1.weight"] + (p["w1.bias"] if "w1.bias" in p else 0.0)  # [B, T, d_ff]
    if clamp is not None:  # gpt-oss's clamped SwiGLU (SPEC §5.16)
        up = x @ p["w3.weight"] + (p["w3.bias"] if "w3.bias" in p else 0.0)
        d_hidden, d_w2, d_b2 = linear_vjp(clamped_swiglu(before, up, *clamp), p["w2.weight"], d_y)
        d_gate, d_up = clamped_swiglu_vjp(before, up, *clamp, d_hidden)
        d_x, d_w1, d_b1 = linear_vjp(x, p["w1.weight"], d_gate)
        d_from_w3, d_w3, d_b3 = linear_vjp(x, p["w3.weight"], d_up)
        return d_x + d_from_w3, _present(p, {"w1.weight": d_w1, "w1.bias": d_b1, "w2.weight": d_w2, "w2.bias": d_b2,
                                             "w3.weight": d_w3, "w3.bias": d_b3})
    activated = ACTIVATIONS[activation](before)
    if not _CANCELLING[0]:
        # a dead ReLU unit's zero, or a saturated GELU's, is a value that rounding may change: the term's size
        activated = np.where(activated == 0.0, np.abs(before), activated)
    gated = "w3.weight" in p
    linear_unit = x @ p["w3.weight"] + (p["w3.bias"] if "w3.bias" in p else 0.0) if gated else 1.0  # [B, T, d_ff]
    d_hidden, d_w2, d_b2 = linear_vjp(activated * linear_unit, p["w2.weight"], d_y)
    d_x, d_w1, d_b1 = linear_vjp(x, p["w1.weight"], ACTIVATION_VJPS[activation](before, d_hidden * linear_unit))
    grads = {"w1.weight": d_w1, "w1.bias": d_b1, "w2.weight": d_w2, "w2.bias": d_b2}
    if gated:
        d_from_w3, grads["w3.weight"], grads["w3.bias"] = linear_vjp(x, p["w3.weight"], d_hidden * activated)
        d_x = d_x + d_from_w3
    return d_x, _present(p, grads)


def clamped_swiglu_vjp(gate: np.ndarray, up: np.ndarray, limit: float, alpha: float,
                       d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """y = g σ(α g) ⊙ (u + 1), g = min(gate, L), u = clip(up, −L, L):  ∂gate = ∂y (u + 1)(σ + α g σ (1 − σ))
    where gate ≤ L, ∂up = ∂y g σ where −L ≤ up ≤ L (a clamped unit passes nothing, as torch's clamp)"""
    g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
    s = sigmoid(alpha * g)
    d_gate = _through(gate <= limit, d_y * (u + 1.0) * (s + alpha * g * s * (1.0 - s)))
    return d_gate, _through((up >= -limit) & (up <= limit), d_y * g * s)


def mixture_of_experts_vjp(x: np.ndarray, router: np.ndarray, experts: list[dict[str, np.ndarray]], k: int,
                           renormalize: bool, activation: str, d_y: np.ndarray, d_probabilities: np.ndarray | None = None,
                           clamp: tuple[float, float] | None = None, router_bias: np.ndarray | None = None
                           ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], list[dict[str, np.ndarray]]]:
    """y = Σ_j w_j FFN_top_j(x), the chosen experts constants (top-k is constant between ties):
    ∂w_j = ⟨∂y, FFN_top_j(x)⟩; renormalised, w = p_T / Σ p_T: ∂p_T = (∂w − Σ_j w_j ∂w_j) / Σ p_T;
    ∂z = softmax's VJP of ∂p (0 off the chosen), z = x R; ∂x = Σ_j w_j ∂x_FFN_j + ∂z Rᵀ.
    d_probabilities [N, E], where a loss reads the probabilities themselves (load balancing), adds
    to ∂p. x [N, d], d_y [N, d] -> d_x [N, d], (d_router [d, E], d_router_bias [E]), each expert's
    {w1.*, w3.*, w2.*} (zeros for an expert no token chose)"""
    probabilities = router_probabilities(x, router, router_bias)  # [N, E]
    chosen = top_experts(probabilities, k)  # [N, k]
    weights = routing_weights(probabilities, chosen, renormalize)  # [N, k]
    d_x, d_weights, expert_grads = np.zeros_like(x), np.zeros_like(weights), []
    for expert, p in enumerate(experts):
        tokens, slot = np.nonzero(chosen == expert)
        if not tokens.size:
            expert_grads.append({name: np.zeros_like(value) for name, value in p.items()})
            continue
        d_weights[tokens, slot] = (d_y[tokens] * feed_forward(p, x[tokens], activation, clamp)).sum(axis=-1)
        d_part, grads = feed_forward_vjp(p, x[tokens], activation, weights[tokens, slot, None] * d_y[tokens], clamp)
        d_x[tokens] += d_part
        expert_grads.append(grads)
    d_chosen = d_weights
    if renormalize:
        total = np.take_along_axis(probabilities, chosen, axis=-1).sum(axis=-1, keepdims=True)
        if _CANCELLING[0]:
            d_chosen = (d_weights - (weights * d_weights).sum(axis=-1, keepdims=True)) / total
        else:  # the terms' size: the shared term cancels between the chosen (exactly, for the router's gradient)
            d_chosen = (np.abs(d_weights) + np.abs(weights * d_weights).sum(axis=-1, keepdims=True)) / total
    d_probabilities = np.zeros_like(probabilities) if d_probabilities is None else (
        d_probabilities.copy() if _CANCELLING[0] else np.abs(d_probabilities))
    np.put_along_axis(d_probabilities, chosen, np.take_along_axis(d_probabilities, chosen, axis=-1) + d_chosen, axis=-1)
    if _CANCELLING[0]:
        d_logits = softmax_vjp(probabilities, d_probabilities)
    else:
        # unlike an attention row's masked keys, an unchosen expert's logit is reached, through the
        # softmax's shared term −p_e Σ_j p_j ∂p_j: its size, kept where the cancelling form drops it
        d_logits = probabilities * (np.abs(d_probabilities) + np.abs(probabilities * d_probabilities).sum(
            axis=-1, keepdims=True))
    d_from_router, d_router, d_router_bias = linear_vjp(x, router, d_logits)
    return d_x + d_from_router, (d_router, d_router_bias), expert_grads


def experts_ffn_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, d_y: np.ndarray,
                    d_probabilities: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """experts_ffn, back: d_x [B, T, d] and {router.weight, experts.{e}.w1.weight, ...};
    d_probabilities [B, T, E]: a loss's gradient on the router's probabilities themselves."""
    moe, width = cfg.moe, x.shape[-1]
    d_x, (d_router, d_router_bias), expert_grads = mixture_of_experts_vjp(
        x.reshape(-1, width), p["router.weight"], layer_experts(cfg, p), moe.experts_per_token, moe.renormalize,
        cfg.activation, d_y.reshape(-1, width),
        None if d_probabilities is None else d_probabilities.reshape(-1, moe.n_experts), cfg.swiglu_clamp,
        p.get("router.bias"))
    grads = _present(p, {"router.weight": d_router, "router.bias": d_router_bias})
    for expert, expert_grad in enumerate(expert_grads):
        grads.update({f"experts.{expert}.{name}": value for name, value in expert_grad.items()})
    d_x = d_x.reshape(x.shape)
    if moe.shared_expert_d_ff:
        d_from_shared, shared_grads = shared_expert_vjp(cfg, p, x, d_y)
        d_x = d_x + d_from_shared
        grads.update(shared_grads)
    return d_x, grads


def shared_expert_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, d_y: np.ndarray) -> tuple[np.ndarray, Grads]:
    """y = s ⊙ f, s = σ(x g) [.., 1], f = FFN_shared(x): ∂f = s ∂y, ∂s = Σ_d f ∂y, ∂(x g) = s (1 − s) ∂s,
    then back through g and the FFN. x, d_y [.., d] -> d_x [.., d], {shared_expert_gate.weight,
    shared_expert.w1.weight, ...}"""
    gate, expert = p["shared_expert_gate.weight"], params_under(p, "shared_expert")
    s, f = sigmoid(linear(x, gate)), feed_forward(expert, x, cfg.activation, cfg.swiglu_clamp)
    d_s = ((f if _CANCELLING[0] else np.abs(f)) * d_y).sum(axis=-1, keepdims=True)  # [.., 1]
    d_from_gate, d_gate, _ = linear_vjp(x, gate, _through(s * (1.0 - s), d_s))
    d_from_expert, expert_grads = feed_forward_vjp(expert, x, cfg.activation, s * d_y, cfg.swiglu_clamp)
    return d_from_gate + d_from_expert, {"shared_expert_gate.weight": d_gate,
                                         **{f"shared_expert.{name}": value for name, value in expert_grads.items()}}


def layer_norm_vjp(x: np.ndarray, scale: np.ndarray, eps: float,
                   d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = γ x̂ + β, x̂ = (x − μ) / √(σ² + ε):  ∂γ = Σ ∂y x̂, ∂β = Σ ∂y,
    ∂x = (g − mean(g) − x̂ mean(g x̂)) / √(σ² + ε), g = ∂y γ. x [.., d] -> d_x, d_scale, d_bias"""
    centered = x - x.mean(axis=-1, keepdims=True)
    root = np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)
    normed = centered / root
    g = d_y * scale
    d_x = (g - g.mean(axis=-1, keepdims=True) - normed * (g * normed).mean(axis=-1, keepdims=True)) / root
    return d_x, _sum_leading(d_y * normed), _sum_leading(d_y)


def std_norm_vjp(x: np.ndarray, scale: np.ndarray, eps: float,
                 d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = γ c / (s + ε) + β, c = x − μ, s = √(Σ c² / (d − 1)):  ∂s = −Σ g c / (s + ε)², g = ∂y γ,
    ∂c = g / (s + ε) + ∂s c / ((d − 1) s), ∂x = ∂c − mean(∂c). A row with s = 0 has no derivative."""
    centered = x - x.mean(axis=-1, keepdims=True)
    std = np.sqrt((centered * centered).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))
    g = d_y * scale
    d_std = -(g * centered).sum(axis=-1, keepdims=True) / (std + eps) ** 2
    d_centered = g / (std + eps) + d_std * centered / ((x.shape[-1] - 1) * std)
    d_x = d_centered - d_centered.mean(axis=-1, keepdims=True)
    return d_x, _sum_leading(d_y * centered / (std + eps)), _sum_leading(d_y)


def _sum_leading(x: np.ndarray) -> np.ndarray:
    """Σ over every axis but the last: a [d] parameter's gradient from its uses at every position."""
    return x.reshape(-1, x.shape[-1]).sum(axis=0)


def rms_norm_vjp(x: np.ndarray, scale: np.ndarray, eps: float,
                 d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """y = γ x r, r = 1 / √(mean(x²) + ε):  ∂γ = Σ ∂y x r,  ∂x = r (g − x r² mean(g x)), g = ∂y γ.
    x [.., d] -> d_x, d_scale, None (no bias)"""
    root = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    g = d_y * scale
    d_x = root * (g - x * root * root * (g * x).mean(axis=-1, keepdims=True))
    return d_x, _sum_leading(d_y * x * root), None


def norm_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, d_y: np.ndarray) -> tuple[np.ndarray, Grads]:
    """The config's norm, back: -> d_x, {scale, bias} (RMSNorm: {scale}). γ = 1 + scale (Gemma) has
    ∂scale = ∂γ."""
    kind = {"layernorm": layer_norm_vjp, "std": std_norm_vjp, "rmsnorm": rms_norm_vjp}[cfg.norm]
    d_x, d_scale, d_bias = kind(x, norm_scale(cfg, p["scale"]), float(cfg.norm_eps), d_y)
    return d_x, {"scale": d_scale} if d_bias is None else {"scale": d_scale, "bias": d_bias}


# ---- embeddings and positions ---------------------------------------------------------------

def token_embedding_vjp(ids: np.ndarray, n_rows: int, scale: bool, d_x: np.ndarray) -> np.ndarray:
    """x = E[ids] (· √d):  ∂E[i] = Σ of ∂x (· √d) over the positions holding token i; the row of a
    token that is absent stays exactly 0. ids [B, T], d_x [B, T, d] -> d_table [n_rows, d]"""
    d_model = d_x.shape[-1]
    d_table = np.zeros((n_rows, d_model), d_x.dtype)
    np.add.at(d_table, ids.reshape(-1), d_x.reshape(-1, d_model))
    return d_table * math.sqrt(d_model) if scale else d_table


def positional_encoding_vjp(cfg: ModelConfig, length: int, offset: int, d_x: np.ndarray) -> np.ndarray | None:
    """x = E[ids] + PE[positions]:  ∂PE[p] = Σ over the batch of ∂x at p, for learned positions
    only (sinusoids have no parameters). d_x [B, T, d] -> d_table [max_len, d] or None"""
    if cfg.positional != "learned":
        return None
    d_table = np.zeros((cfg.max_len, cfg.d_model), d_x.dtype)
    d_table[offset:offset + length] = d_x.sum(axis=0)
    return d_table


def embed_vjp(cfg: ModelConfig, params: Params, ids: np.ndarray, side: str, d_x: np.ndarray, offset: int = 0,
              dropout_mask: np.ndarray | None = None) -> Grads:
    """x = Norm?(Dropout(E[ids] (· √d) + PE)): back through the embedding norm and the dropout,
    then to the table and the positions offset.. . Names are the model's (tgt_embed.weight serves
    a shared source)."""
    table = "tgt_embed.weight" if side == "tgt" or cfg.share_src_tgt_embed else "src_embed.weight"
    grads: Grads = {}
    if cfg.embed_norm:
        stack = "encoder" if side == "src" else "decoder"
        before = token_embedding(ids, params[table], cfg.embed_scale)
        before = dropout(cfg, before + positional_encoding(cfg, params, side, ids.shape[1], offset, before.dtype)[None],
                         dropout_mask)
        d_x, norm_grads = norm_vjp(cfg, params_under(params, f"{stack}.embed_norm"), before, d_x)
        grads.update(_named(f"{stack}.embed_norm", norm_grads))
    d_x = dropout_vjp(cfg, dropout_mask, d_x)
    grads[table] = token_embedding_vjp(ids, params[table].shape[0], cfg.embed_scale, d_x)
    d_positions = positional_encoding_vjp(cfg, ids.shape[1], offset, d_x)  # (RoPE's are in the attention)
    if d_positions is not None:
        grads[f"{side}_pos.weight"] = d_positions
    return grads


# ---- attention ------------------------------------------------------------------------------

def rotary_vjp(cfg: ModelConfig, positions: np.ndarray | None, d_y: np.ndarray) -> np.ndarray:
    """y_r = x_r cos + rotate_half(x_r) sin, a rotation:  ∂x_r = ∂y_r cos − rotate_half(∂y_r sin)
    (rotate_half's transpose is its negative); the dimensions past r pass. d_y [B, H, T, d_k]"""
    r = cfg.rotary_dim
    if positions is None or r == 0:
        return d_y
    cos, sin = rope_tables(cfg, positions)
    return np.concatenate([d_y[..., :r] * cos - rotate_half(d_y[..., :r] * sin), d_y[..., r:]], axis=-1)


def group_heads_vjp(d_grouped: np.ndarray, kv_heads: int) -> np.ndarray:
    """Key/value head j serves query heads j·g .. (j+1)·g − 1:  ∂K_j = Σ over its group.
    [B, H, K, d_k] -> [B, H_kv, K, d_k]"""
    batch, n_heads, length, d_head = d_grouped.shape
    return d_grouped.reshape(batch, kv_heads, n_heads // kv_heads, length, d_head).sum(axis=2)


def head_norm_vjp(cfg: ModelConfig, p: Params, name: str, x: np.ndarray, d_y: np.ndarray) -> tuple[np.ndarray, Grads]:
    """Qwen3's per-head RMSNorm of q or k, back (the identity without one); OLMo 2's over the whole
    projection, back with the heads merged. x [B, H, T, d_k] -> d_x, {name_norm.scale}"""
    scale = p.get(f"{name}_norm.scale")
    if scale is None:
        return d_y, {}
    if cfg.qk_norm_scope == "projection":
        d_x, d_scale, _ = rms_norm_vjp(merge_heads(x), norm_scale(cfg, scale), float(cfg.norm_eps), merge_heads(d_y))
        return split_heads(d_x, x.shape[1]), {f"{name}_norm.scale": d_scale}
    d_x, d_scale, _ = rms_norm_vjp(x, norm_scale(cfg, scale), float(cfg.norm_eps), d_y)
    return d_x, {f"{name}_norm.scale": d_scale}


def attend_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
               d_y: np.ndarray, positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, Grads]:
    """y = Concat(heads) W^O + b, heads = Attention(rotary(norm(x W^Q + b)), K_g, V_g): back through
    W^O, the attention, the groups, the rotation, the head norm, then W^Q.
    x [B, Q, d], k and v [B, H_kv, K, d_k] -> d_x, d_k, d_v, {q.*, q_norm.*, o.*, sinks}"""
    before = split_heads(linear(x, p["q.weight"], p.get("q.bias")), cfg.n_heads)  # [B, H, Q, d_k]
    q = head_norm(cfg, p, "q", before)
    q = q if positions is None else rotary(cfg, q, positions)
    keys, values = group_heads(k, cfg.n_heads), group_heads(v, cfg.n_heads)  # [B, H, K, d_k]
    sinks = p.get("sinks")
    merged = merge_heads(scaled_dot_product_attention(q, keys, values, mask, cfg.score_scale, cfg.attention_softcap,
                                                      sinks))
    d_gated, d_wo, d_bo = linear_vjp(output_gate(cfg, p, x, merged), p["o.weight"], d_y)
    d_merged, d_from_gate, gate_grads = output_gate_vjp(cfg, p, x, merged, d_gated)
    d_heads = split_heads(d_merged, cfg.n_heads)
    d_q, d_keys, d_values = scaled_dot_product_attention_vjp(q, keys, values, mask, d_heads, cfg.score_scale,
                                                             cfg.attention_softcap, sinks)
    d_before, norm_grads = head_norm_vjp(cfg, p, "q", before, rotary_vjp(cfg, positions, d_q))
    d_x, d_wq, d_bq = linear_vjp(x, p["q.weight"], merge_heads(d_before))
    grads = _present(p, {"q.weight": d_wq, "q.bias": d_bq, "o.weight": d_wo, "o.bias": d_bo})
    if sinks is not None:
        grads["sinks"] = attention_sinks_vjp(q, keys, values, mask, d_heads, cfg.score_scale, cfg.attention_softcap,
                                             sinks)
    return (d_x + d_from_gate, group_heads_vjp(d_keys, cfg.kv_heads), group_heads_vjp(d_values, cfg.kv_heads),
            {**grads, **norm_grads, **gate_grads})


def output_gate_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, heads: np.ndarray,
                    d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, Grads]:
    """y = h ⊙ σ(a), a = x W_gate + b:  ∂h = ∂y ⊙ σ(a), ∂a = ∂y ⊙ h σ(a)(1 − σ(a)), then back through W_gate;
    the identity without a gate. x [B, Q, d], heads [B, Q, H·d_k] -> d_heads, d_x (0 without a gate), {gate.*}"""
    if not cfg.attention_output_gate:
        return d_y, 0.0, {}
    gate = sigmoid(linear(x, p["gate.weight"], p.get("gate.bias")))
    d_x, d_weight, d_bias = linear_vjp(x, p["gate.weight"], _through(gate * (1.0 - gate), d_y * heads))
    return d_y * gate, d_x, _present(p, {"gate.weight": d_weight, "gate.bias": d_bias})


def key_value_heads_vjp(cfg: ModelConfig, p: Params, context: np.ndarray, d_k: np.ndarray, d_v: np.ndarray,
                        positions: np.ndarray | None = None) -> tuple[np.ndarray, Grads]:
    """K = rotary(norm(c W^K + b)), V = c W^V + b:  ∂c = ∂K' W^Kᵀ + ∂V W^Vᵀ (heads merged back),
    ∂K' through the rotation and the head norm; ∂b^K = 0 when K is neither rotated nor normed.
    context [B, K, d], d_k and d_v [B, H_kv, K, d_k] -> d_context [B, K, d], {k.*, k_norm.*, v.*}"""
    before = split_heads(linear(context, p["k.weight"], p.get("k.bias")), cfg.kv_heads)
    d_before, norm_grads = head_norm_vjp(cfg, p, "k", before, rotary_vjp(cfg, positions, d_k))
    d_from_k, d_wk, d_bk = linear_vjp(context, p["k.weight"], merge_heads(d_before))
    d_from_v, d_wv, d_bv = linear_vjp(context, p["v.weight"], merge_heads(d_v))
    # b^K adds q·b^K to every score of a query's row, and softmax ignores a constant added to a
    # row (Σ_k ∂S_qk = 0), so its gradient is identically zero: kept exact, not as rounding. A
    # rotated or normed b^K differs from key to key, and gets a gradient.
    if _CANCELLING[0] and positions is None and not norm_grads:
        d_bk = np.zeros_like(d_bk)
    grads = {"k.weight": d_wk, "k.bias": d_bk, "v.weight": d_wv, "v.bias": d_bv}
    return d_from_k + d_from_v, {**_present(p, grads), **norm_grads}


def multi_head_attention_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, context: np.ndarray,
                             mask: np.ndarray | None, d_y: np.ndarray, offset: int = 0
                             ) -> tuple[np.ndarray, np.ndarray, Grads]:
    """MultiHead(x, c), back: queries through attend_vjp, keys and values through
    key_value_heads_vjp. Self-attention (c = x) adds the two. -> d_x, d_context, {q, k, v, o}"""
    q_positions, k_positions = attention_positions(cfg, x.shape[1], context.shape[1], offset)
    k, v = key_value_heads(cfg, p, context, k_positions)
    d_x, d_k, d_v, grads = attend_vjp(cfg, p, x, k, v, mask, d_y, q_positions)
    d_context, key_value_grads = key_value_heads_vjp(cfg, p, context, d_k, d_v, k_positions)
    return d_x, d_context, {**grads, **key_value_grads}


# ---- gated DeltaNet (SPEC §5.15) -------------------------------------------------------------
# Back through time: the forward is run again to keep the state each token found, then the tokens
# are walked backwards carrying ∂S (and ∂ of each convolution's window), as the recurrence's own
# chain rule. A pad moved nothing forward, so it passes ∂S and ∂window on untouched and gets nothing.

def l2_normalize_vjp(x: np.ndarray, d_y: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """y = x / n, n = √(Σ x² + ε):  ∂x = (∂y − y (y · ∂y)) / n over the last axis; without cancellation
    the two terms' sizes, which cancel where ∂y lies along y (only its part across y moves y)"""
    root = np.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)
    y = x / root
    if not _CANCELLING[0]:
        return (np.abs(d_y) + np.abs(y) * np.abs((y * d_y).sum(axis=-1, keepdims=True))) / root
    return (d_y - y * (y * d_y).sum(axis=-1, keepdims=True)) / root


def short_convolution_vjp(window: np.ndarray, u: np.ndarray, kernel: np.ndarray, d_c: np.ndarray,
                          d_moved: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """c[j] = Σ_i kernel[j, i] · a[i, j], a = (window, u), moved = a[1:]:  ∂a = ∂c ⊙ kernelᵀ + (0, ∂moved),
    ∂kernel[j, i] = Σ_b a[i, j] ∂c[j]. -> d_window [B, K − 1, C], d_u [B, C], d_kernel [C, K]"""
    inputs = np.concatenate([window, u[:, None]], axis=1)  # [B, K, C]
    d_inputs = d_c[:, None] * kernel.T
    d_inputs[:, 1:] += d_moved
    return d_inputs[:, :-1], d_inputs[:, -1], (inputs * d_c[:, None]).sum(axis=0).T


def token_queries_keys_values_vjp(cfg: ModelConfig, windows: Sequence[np.ndarray], inputs: Sequence[np.ndarray],
                                  kernels: Sequence[np.ndarray], d_q: np.ndarray, d_k: np.ndarray, d_v: np.ndarray,
                                  d_moved: Sequence[np.ndarray]) -> tuple[list, list, list]:
    """One token's q, k, v, back: the value heads' repeats summed into their key head, then the
    L2 norms (and 1/√d_k), SiLU and the convolutions. -> ∂windows, ∂inputs, ∂kernels (q's, k's, v's)"""
    mixer = cfg.linear_attention
    batch, groups = inputs[0].shape[0], mixer.value_heads // mixer.key_heads
    convolved = [short_convolution(window, u, kernel)[0] for window, u, kernel in zip(windows, inputs, kernels)]
    d_q, d_k = (d.reshape(batch, mixer.key_heads, groups, mixer.key_head_dim).sum(axis=2) for d in (d_q, d_k))
    d_mixed = [l2_normalize_vjp(swish(convolved[0]).reshape(d_q.shape), d_q / math.sqrt(mixer.key_head_dim)),
               l2_normalize_vjp(swish(convolved[1]).reshape(d_k.shape), d_k), d_v]
    pulled = [short_convolution_vjp(window, u, kernel, swish_vjp(c, d.reshape(batch, -1)), moved)
              for window, u, kernel, c, d, moved in zip(windows, inputs, kernels, convolved, d_mixed, d_moved)]
    return [d_window for d_window, _, _ in pulled], [d_u for _, d_u, _ in pulled], [d for _, _, d in pulled]


def gated_delta_rule_vjp(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray,
                         beta: np.ndarray, d_o: np.ndarray, d_after: np.ndarray) -> tuple[np.ndarray, ...]:
    """S' = e^g S, e = v − S'ᵀk, S⁺ = S' + β k eᵀ, o = S⁺ᵀ q, given ∂o and ∂S⁺ from the later tokens:
    ∂S⁺ += q ∂oᵀ, ∂q = S⁺ ∂o; ∂k = ∂S⁺ (β e) − S' (β ∂e), ∂e = ∂S⁺ᵀ k, ∂β = ∂e · e, ∂v = β ∂e;
    ∂S' = ∂S⁺ − k (β ∂e)ᵀ; ∂S = e^g ∂S', ∂g = Σ S' ⊙ ∂S'.
    -> (∂S, ∂q, ∂k, ∂v, ∂g, ∂β), shapes as gated_delta_rule's"""
    decayed = np.exp(decay)[..., None, None] * state
    error = v - np.einsum("bhkv,bhk->bhv", decayed, k)
    after = decayed + np.einsum("bhk,bhv->bhkv", k, beta[..., None] * error)
    d_after = d_after + np.einsum("bhk,bhv->bhkv", q, d_o)
    d_q = np.einsum("bhkv,bhv->bhk", after, d_o)
    d_error = np.einsum("bhkv,bhk->bhv", d_after, k)
    d_written = beta[..., None] * d_error  # ∂ of β e, e's cotangent through v and through S'ᵀk
    d_k = np.einsum("bhkv,bhv->bhk", d_after, beta[..., None] * error) - np.einsum("bhkv,bhv->bhk", decayed, d_written)
    d_decayed = d_after - np.einsum("bhk,bhv->bhkv", k, d_written)
    d_decay = (decayed * d_decayed).sum(axis=(-1, -2))
    return np.exp(decay)[..., None, None] * d_decayed, d_q, d_k, d_written, d_decay, (d_error * error).sum(axis=-1)


def gated_delta_net_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, keep: np.ndarray,
                        d_y: np.ndarray) -> tuple[np.ndarray, Grads]:
    """gated_delta_net from the zero state, back: the tokens in reverse, each through W_o, the gated
    norm (RMSNorm(o) γ ⊙ SiLU(x W_z)), gated_delta_rule_vjp and token_queries_keys_values_vjp; then
    the projections, β = σ(x W_β) and g = −exp(log_rate) softplus(a) (∂a = ∂g · −exp(log_rate) σ(a),
    ∂log_rate = Σ ∂g · g). x [B, T, d], keep [B, T], d_y [B, T, d] -> d_x, the mixer's grads"""
    mixer, eps, scale = cfg.linear_attention, float(cfg.norm_eps), p["norm.scale"]
    batch, length = x.shape[:2]
    found: list = []  # found[t]: the windows and S token t started from
    gated_delta_net(cfg, p, x, keep, visited=found)
    projected, beta, decay = delta_net_projections(cfg, p, x)
    kernels = [p[f"{name}_conv.weight"] for name in ("q", "k", "v")]
    gate = linear(x, p["z.weight"]).reshape(batch, length, mixer.value_heads, mixer.value_head_dim)
    d_heads = (d_y @ p["o.weight"].T).reshape(gate.shape)  # ∂ of RMSNorm(o) γ ⊙ SiLU(gate), per token and head
    d_gate, d_projected = np.zeros_like(gate), [np.zeros_like(u) for u in projected]
    d_beta, d_decay, d_kernels = np.zeros_like(beta), np.zeros_like(decay), [np.zeros_like(k) for k in kernels]
    grads: Grads = {"o.weight": np.zeros_like(p["o.weight"]), "norm.scale": np.zeros_like(scale)}
    d_windows, d_state = [np.zeros_like(w) for w in found[0][0]], np.zeros_like(found[0][1])
    for t in reversed(range(length)):
        real, (windows, recurrent) = keep[:, t], found[t]
        inputs = [u[:, t] for u in projected]
        q, k, v, _ = token_queries_keys_values(cfg, windows, inputs, kernels)
        o = np.where(real[:, None, None], gated_delta_rule(recurrent, q, k, v, decay[:, t], beta[:, t])[0], 0.0)
        grads["o.weight"] += gated_rms_norm(o, scale, gate[:, t], eps).reshape(batch, -1).T @ d_y[:, t]
        d_o, d_scale, _ = rms_norm_vjp(o, scale, eps, d_heads[:, t] * swish(gate[:, t]))
        grads["norm.scale"] += d_scale
        d_gate[:, t] = swish_vjp(gate[:, t], d_heads[:, t] * rms_norm(o, scale, None, eps))
        d_o = np.where(real[:, None, None], d_o, 0.0)  # a pad's o is the constant 0
        d_before, d_q, d_k, d_v, d_g, d_b = gated_delta_rule_vjp(recurrent, q, k, v, decay[:, t], beta[:, t], d_o,
                                                                 d_state)
        d_state = np.where(real[:, None, None, None], d_before, d_state)
        d_decay[:, t], d_beta[:, t] = np.where(real[:, None], d_g, 0.0), np.where(real[:, None], d_b, 0.0)
        pulled_windows, d_inputs, d_token_kernels = token_queries_keys_values_vjp(
            cfg, windows, inputs, kernels, *(np.where(real[:, None, None], d, 0.0) for d in (d_q, d_k, d_v)),
            [np.where(real[:, None, None], d, 0.0) for d in d_windows])
        d_windows = [np.where(real[:, None, None], pulled, carried)
                     for pulled, carried in zip(pulled_windows, d_windows)]
        for index in range(3):
            d_projected[index][:, t] = np.where(real[:, None], d_inputs[index], 0.0)
            d_kernels[index] += d_token_kernels[index]
    d_x, grads["z.weight"], _ = linear_vjp(x, p["z.weight"], d_gate.reshape(batch, length, -1))
    for name, d_u in zip(("q", "k", "v"), d_projected):
        d_from, grads[f"{name}.weight"], _ = linear_vjp(x, p[f"{name}.weight"], d_u)
        d_x = d_x + d_from
    decay_input = linear(x, p["decay.weight"], p["decay.bias"])
    d_from_beta, grads["beta.weight"], _ = linear_vjp(x, p["beta.weight"], _through(beta * (1.0 - beta), d_beta))
    d_from_decay, grads["decay.weight"], grads["decay.bias"] = linear_vjp(
        x, p["decay.weight"], _through(-np.exp(p["decay.log_rate"]) * sigmoid(decay_input), d_decay))
    grads.update({"decay.log_rate": _sum_leading(d_decay * decay),
                  **{f"{name}_conv.weight": d for name, d in zip(("q", "k", "v"), d_kernels)}})
    return d_x + d_from_beta + d_from_decay, grads


# ---- residual blocks, layers and stacks -----------------------------------------------------

Sublayer = Callable[[np.ndarray], np.ndarray]
SublayerVJP = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, Grads]]  # (h, d_out) -> d_h, grads


def dropout_vjp(cfg: ModelConfig, keep: np.ndarray | None, d_y: np.ndarray) -> np.ndarray:
    """y = x ⊙ keep / (1 − p):  ∂x = ∂y ⊙ keep / (1 − p), exactly 0 at a dropped unit."""
    return dropout(cfg, d_y, keep)


def residual_vjp(cfg: ModelConfig, norm_p: Params, x: np.ndarray, sublayer: Sublayer, sublayer_vjp: SublayerVJP,
                 d_y: np.ndarray, dropout_mask: np.ndarray | None = None,
                 post_norm_p: Params | None = None) -> tuple[np.ndarray, Grads, Grads, Grads]:
    """post: y = Norm(s), s = x + D(F(x)):  ∂s = Norm_vjp(∂y), ∂x = ∂s + F_vjp(x, D_vjp(∂s));
    pre:  y = x + D(F(Norm(x))):  ∂x = ∂y + Norm_vjp(x, F_vjp(Norm(x), D_vjp(∂y))), D the dropout;
    with a post norm, y = x + D(PostNorm(F(Norm(x)))): PostNorm_vjp(F(Norm(x)), D_vjp(∂y)) goes to F_vjp;
    output: y = x + D(Norm(F(x))):  ∂x = ∂y + F_vjp(x, Norm_vjp(F(x), D_vjp(∂y))).
    -> d_x, norm's grads, F's grads, the post norm's grads"""
    if cfg.norm_position == "post":
        d_sum, norm_grads = norm_vjp(cfg, norm_p, x + dropout(cfg, sublayer(x), dropout_mask), d_y)
        d_x, grads = sublayer_vjp(x, dropout_vjp(cfg, dropout_mask, d_sum))
        return d_sum + d_x, norm_grads, grads, {}
    if cfg.norm_position == "output":
        d_out, norm_grads = norm_vjp(cfg, norm_p, sublayer(x), dropout_vjp(cfg, dropout_mask, d_y))
        d_x, grads = sublayer_vjp(x, d_out)
        return d_y + d_x, norm_grads, grads, {}
    normed, d_out, post_grads = norm(cfg, norm_p, x), dropout_vjp(cfg, dropout_mask, d_y), {}
    if post_norm_p is not None:
        d_out, post_grads = norm_vjp(cfg, post_norm_p, sublayer(normed), d_out)
    d_normed, grads = sublayer_vjp(normed, d_out)
    d_x, norm_grads = norm_vjp(cfg, norm_p, x, d_normed)
    return d_y + d_x, norm_grads, grads, post_grads


def block_vjp(cfg: ModelConfig, p: Params, name: str, x: np.ndarray, sublayer: Sublayer, sublayer_vjp: SublayerVJP,
              d_y: np.ndarray, dropout_mask: np.ndarray | None = None) -> tuple[np.ndarray, Grads]:
    """residual_vjp for the layer's sublayer `name` (self_attn, cross_attn, ffn) and its norms
    `name_norm` and `name_post_norm` (post norms), gradients named relative to the layer."""
    post_norm_p = params_under(p, f"{name}_post_norm") if cfg.post_norms else None
    d_x, norm_grads, grads, post_grads = residual_vjp(cfg, params_under(p, f"{name}_norm"), x, sublayer, sublayer_vjp,
                                                      d_y, dropout_mask, post_norm_p)
    return d_x, {**_named(f"{name}_norm", norm_grads), **_named(name, grads), **_named(f"{name}_post_norm", post_grads)}


def self_attention_vjp(cfg: ModelConfig, p: Params, mask: np.ndarray | None) -> tuple[Sublayer, SublayerVJP]:
    """Self-attention as a sublayer and its VJP: the input is both queries and context."""
    attention = params_under(p, "self_attn")

    def backward(h: np.ndarray, d_out: np.ndarray) -> tuple[np.ndarray, Grads]:
        d_queries, d_context, grads = multi_head_attention_vjp(cfg, attention, h, h, mask, d_out)
        return d_queries + d_context, grads

    return (lambda h: multi_head_attention(cfg, attention, h, h, mask)), backward


def ffn_block_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, d_y: np.ndarray,
                  dropout_mask: np.ndarray | None = None,
                  d_probabilities: np.ndarray | None = None) -> tuple[np.ndarray, Grads]:
    """The FFN's residual block, back: one FFN's, or the mixture of experts' (§5.14; d_probabilities
    [B, T, E] a loss's gradient on its router's probabilities). p: the layer's parameters."""
    ffn_p = params_under(p, "ffn")
    if cfg.moe is None:
        return block_vjp(cfg, p, "ffn", x, lambda h: feed_forward(ffn_p, h, cfg.activation, cfg.swiglu_clamp),
                         lambda h, d_out: feed_forward_vjp(ffn_p, h, cfg.activation, d_out, cfg.swiglu_clamp), d_y,
                         dropout_mask)
    return block_vjp(cfg, p, "ffn", x, lambda h: experts_ffn(cfg, ffn_p, h),
                     lambda h, d_out: experts_ffn_vjp(cfg, ffn_p, h, d_out, d_probabilities), d_y, dropout_mask)


def encoder_layer_vjp(cfg: ModelConfig, p: Params, x: np.ndarray, mask: np.ndarray | None,
                      d_y: np.ndarray, dropout_masks: Mapping[str, np.ndarray] | None = None) -> tuple[np.ndarray, Grads]:
    """x1 = Block(x, SelfAttention), y = Block(x1, FFN): back through the FFN block, then the
    attention block. -> d_x, the layer's grads"""
    drop = dropout_masks or {}
    attention, attention_vjp = self_attention_vjp(cfg, p, mask)
    x1 = block(cfg, p, "self_attn", x, attention, drop.get("self_attn"))
    d_x1, ffn_grads = ffn_block_vjp(cfg, p, x1, d_y, drop.get("ffn"))
    d_x, attention_grads = block_vjp(cfg, p, "self_attn", x, attention, attention_vjp, d_x1, drop.get("self_attn"))
    return d_x, {**attention_grads, **ffn_grads}


def decoder_layer_vjp(cfg: ModelConfig, p: Params, y: np.ndarray, memory: np.ndarray | None,
                      self_mask: np.ndarray | None, cross_mask: np.ndarray | None,
                      d_out: np.ndarray, dropout_masks: Mapping[str, np.ndarray] | None = None,
                      d_probabilities: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None, Grads]:
    """y1 = Block(y, masked SelfAttention), y2 = Block(y1, CrossAttention to memory), out =
    Block(y2, FFN): back through the three blocks in reverse (d_probabilities: ffn_block_vjp's).
    -> d_y, d_memory, the layer's grads"""
    drop = dropout_masks or {}
    attention, attention_vjp = self_attention_vjp(cfg, p, self_mask)
    y1 = block(cfg, p, "self_attn", y, attention, drop.get("self_attn"))
    grads: Grads = {}
    d_memory = None
    if memory is None:
        d_y1, grads = ffn_block_vjp(cfg, p, y1, d_out, drop.get("ffn"), d_probabilities)
    else:
        cross = params_under(p, "cross_attn")
        cross_attention = lambda h: multi_head_attention(cfg, cross, h, memory, cross_mask)  # noqa: E731
        y2 = block(cfg, p, "cross_attn", y1, cross_attention, drop.get("cross_attn"))
        d_y2, grads = ffn_block_vjp(cfg, p, y2, d_out, drop.get("ffn"), d_probabilities)
        d_memory_parts = []

        def cross_attention_vjp(h: np.ndarray, d_h_out: np.ndarray) -> tuple[np.ndarray, Grads]:
            # the memory's gradient leaves through the side door: the block sees queries only
            d_h, d_context, cross_grads = multi_head_attention_vjp(cfg, cross, h, memory, cross_mask, d_h_out)
            d_memory_parts.append(d_context)
            return d_h, cross_grads

        d_y1, cross_grads = block_vjp(cfg, p, "cross_attn", y1, cross_attention, cross_attention_vjp, d_y2,
                                      drop.get("cross_attn"))
        grads.update(cross_grads)
        d_memory = d_memory_parts[0]
    d_y, attention_grads = block_vjp(cfg, p, "self_attn", y, attention, attention_vjp, d_y1, drop.get("self_attn"))
    return d_y, d_memory, {**attention_grads, **grads}


def linear_layer_vjp(cfg: ModelConfig, p: Params, y: np.ndarray, keep: np.ndarray, d_out: np.ndarray,
                     d_probabilities: np.ndarray | None = None) -> tuple[np.ndarray, Grads]:
    """A hybrid's linear layer, y1 = Block(y, gated DeltaNet), out = Block(y1, FFN), back through the
    two blocks in reverse (d_probabilities: ffn_block_vjp's). cfg: the model's. -> d_y, the layer's grads"""
    mixer = params_under(p, "linear_attn")

    def mix(h: np.ndarray) -> np.ndarray:
        return gated_delta_net(cfg, mixer, h, keep)[0]

    y1 = block(cfg, p, "linear_attn", y, mix)
    d_y1, ffn_grads = ffn_block_vjp(cfg, p, y1, d_out, None, d_probabilities)
    d_y, mixer_grads = block_vjp(cfg, p, "linear_attn", y, mix,
                                 lambda h, d_h: gated_delta_net_vjp(cfg, mixer, h, keep, d_h), d_y1)
    return d_y, {**mixer_grads, **ffn_grads}


def final_norm_vjp(cfg: ModelConfig, params: Params, stack: str, x: np.ndarray,
                   d_y: np.ndarray) -> tuple[np.ndarray, Grads]:
    """The norm after a stack, back (the identity when cfg.final_norm is off)."""
    if not cfg.final_norm:
        return d_y, {}
    d_x, grads = norm_vjp(cfg, params_under(params, f"{stack}.norm"), x, d_y)
    return d_x, _named(f"{stack}.norm", grads)


def encoder_vjp(cfg: ModelConfig, params: Params, src_ids: np.ndarray, src_keep: np.ndarray,
                d_memory: np.ndarray, dropout_masks: Mapping[str, np.ndarray] | None = None) -> Grads:
    """memory = Norm?(Layer_N(...Layer_1(Embed(src)))): each layer's input is recomputed
    forward, then the VJPs run from the last layer to the embedding. -> the encoder's grads"""
    mask, embed_mask = key_mask(src_keep), (dropout_masks or {}).get("encoder.embed")
    inputs = [embed(cfg, params, src_ids, "src", dropout_mask=embed_mask)]  # inputs[i]: layer i's input [B, S, d]
    for i in range(cfg.n_encoder_layers):
        inputs.append(encoder_layer(cfg, params_under(params, f"encoder.layers.{i}"), inputs[i], mask,
                                    masks_under(dropout_masks, f"encoder.layers.{i}")))
    d_x, grads = final_norm_vjp(cfg, params, "encoder", inputs[-1], d_memory)
    for i in reversed(range(cfg.n_encoder_layers)):
        d_x, layer_grads = encoder_layer_vjp(cfg, params_under(params, f"encoder.layers.{i}"), inputs[i], mask, d_x,
                                             masks_under(dropout_masks, f"encoder.layers.{i}"))
        grads.update(_named(f"encoder.layers.{i}", layer_grads))
    return _accumulate(grads, embed_vjp(cfg, params, src_ids, "src", d_x, dropout_mask=embed_mask))


def decoder_vjp(cfg: ModelConfig, params: Params, tgt_ids: np.ndarray, tgt_keep: np.ndarray, memory: np.ndarray | None,
                src_keep: np.ndarray | None, d_h: np.ndarray,
                dropout_masks: Mapping[str, np.ndarray] | None = None,
                d_probabilities: np.ndarray | None = None) -> tuple[Grads, np.ndarray | None]:
    """h = Norm?(Layer_N(...Layer_1(Embed(tgt), memory))), back; the memory's gradient is the sum
    over every layer's cross-attention; d_probabilities [B, T, E], a loss's gradient on every MoE
    layer's router probabilities (the load-balancing loss's is the same in each). -> the decoder's
    grads, d_memory"""
    self_masks = decoder_self_masks(cfg, tgt_keep)  # by window: [B, 1, T, T]
    cross_mask = None if memory is None else key_mask(src_keep)
    embed_mask = (dropout_masks or {}).get("decoder.embed")
    inputs = [embed(cfg, params, tgt_ids, "tgt", dropout_mask=embed_mask)]
    layer_cfgs = [cfg.layer(i) for i in range(cfg.n_decoder_layers)]  # each layer's window and rotary (SPEC §6)
    for i, layer_cfg in enumerate(layer_cfgs):
        layer = params_under(params, f"decoder.layers.{i}")
        if cfg.layer_kind(i) == "linear":  # gated DeltaNet in self-attention's place (SPEC §5.15)
            inputs.append(linear_layer(cfg, layer, inputs[i], tgt_keep)[0])
            continue
        inputs.append(decoder_layer(layer_cfg, layer, inputs[i], memory, self_masks[layer_cfg.sliding_window],
                                    cross_mask, masks_under(dropout_masks, f"decoder.layers.{i}")))
    d_y, grads = final_norm_vjp(cfg, params, "decoder", inputs[-1], d_h)
    d_memory = None if memory is None else np.zeros_like(memory)
    for i in reversed(range(cfg.n_decoder_layers)):
        layer = params_under(params, f"decoder.layers.{i}")
        if cfg.layer_kind(i) == "linear":
            d_y, layer_grads = linear_layer_vjp(cfg, layer, inputs[i], tgt_keep, d_y, d_probabilities)
            grads.update(_named(f"decoder.layers.{i}", layer_grads))
            continue
        d_y, d_layer_memory, layer_grads = decoder_layer_vjp(layer_cfgs[i], layer, inputs[i], memory,
                                                             self_masks[layer_cfgs[i].sliding_window], cross_mask, d_y,
                                                             masks_under(dropout_masks, f"decoder.layers.{i}"),
                                                             d_probabilities)
        grads.update(_named(f"decoder.layers.{i}", layer_grads))
        if d_memory is not None:
            d_memory += d_layer_memory
    return _accumulate(grads, embed_vjp(cfg, params, tgt_ids, "tgt", d_y, dropout_mask=embed_mask)), d_memory


def output_logits_vjp(cfg: ModelConfig, params: Params, h: np.ndarray, d_logits: np.ndarray) -> tuple[np.ndarray, Grads]:
    """logits = softcap(z), z = h W_head + b:  ∂z = softcap_vjp(z, ∂logits), ∂h = ∂z W_headᵀ, ∂W_head = Σ hᵀ ∂z;
    tied (W_head = Eᵀ):
    ∂E gets ∂W_headᵀ. h [B, T, d], d_logits [B, T, V] -> d_h, {head.* or tgt_embed.weight}"""
    weight = params["tgt_embed.weight"].T if cfg.tie_head else params["head.weight"]
    if cfg.final_softcap is not None:  # logits = c tanh(z / c), z = h W_head + b
        d_logits = softcap_vjp(linear(h, weight, params.get("head.bias")), cfg.final_softcap, d_logits)
    d_h, d_weight, d_bias = linear_vjp(h, weight, d_logits)
    grads = {"tgt_embed.weight": d_weight.T} if cfg.tie_head else {"head.weight": d_weight}
    if "head.bias" in params:
        grads["head.bias"] = d_bias
    return d_h, grads


# ---- the loss and the whole model -----------------------------------------------------------

def token_cross_entropy_vjp(cfg: ModelConfig, logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """L = (1/N) Σ_t −Σ_j q_tj log softmax(logits_t)_j:  ∂logits_t = (softmax(logits_t) − q_t) / N at
    the N non-pad targets (Σ_j q_tj = 1), exactly 0 at pad targets. -> d_logits [B, T, V]"""
    real = targets != cfg.pad_id  # [B, T]
    q = smoothed_targets(targets, cfg.tgt_vocab_size, cfg.pad_id, float(cfg.label_smoothing))
    d_logits = (np.exp(log_softmax(logits)) - q) / max(int(real.sum()), 1)
    return np.where(real[..., None], d_logits, 0.0)


def model_vjp(cfg: ModelConfig, p: Params, src_ids: np.ndarray | None, tgt_ids: np.ndarray, d_logits: np.ndarray, *,
              src_keep: np.ndarray | None = None, tgt_keep: np.ndarray | None = None,
              dropout_masks: Mapping[str, np.ndarray] | None = None,
              d_probabilities: np.ndarray | None = None) -> Grads:
    """The gradient of every parameter given ∂L/∂logits [B, T, V] (model_logits' inputs, p already
    in the computation dtype), and ∂L/∂p on every MoE layer's router probabilities [B, T, E] where
    the loss reads them (load balancing). Every canonical name is present; a row no token reached is 0."""
    check_computed_by(cfg, GOLDEN_BACKWARD)
    src_ids, tgt_ids, src_keep, tgt_keep = model_inputs(cfg, src_ids, tgt_ids, src_keep, tgt_keep, dropout_masks)
    memory = None if src_ids is None else encoder(cfg, p, src_ids, src_keep, dropout_masks)
    h = decoder(cfg, p, tgt_ids, tgt_keep, memory, src_keep, dropout_masks)
    d_h, grads = output_logits_vjp(cfg, p, h, d_logits)
    decoder_grads, d_memory = decoder_vjp(cfg, p, tgt_ids, tgt_keep, memory, src_keep, d_h, dropout_masks,
                                          d_probabilities)
    grads = _accumulate(grads, decoder_grads)
    if memory is not None:
        grads = _accumulate(grads, encoder_vjp(cfg, p, src_ids, src_keep, d_memory, dropout_masks))
    total = {name: np.zeros_like(value) for name, value in p.items()}
    return _accumulate(total, grads)


def loss_and_gradients(cfg: ModelConfig, p: Params, src_ids: np.ndarray | None, tgt_ids: np.ndarray,
                       targets: np.ndarray, *, src_keep: np.ndarray | None = None,
                       tgt_keep: np.ndarray | None = None,
                       dropout_masks: Mapping[str, np.ndarray] | None = None) -> tuple[float, Grads]:
    """The training loss (token_cross_entropy of the teacher-forced logits against targets [B, T],
    plus α times a mixture of experts' load-balancing loss: training_loss) and the gradient of every
    parameter. p: parameters in the computation dtype. With dropout keep-masks (SPEC §5.10), the
    loss of the model in training mode."""
    check_targets(cfg, targets, tgt_ids)
    targets = np.asarray(targets)
    logits, calls = balanced_model_logits(cfg, p, src_ids, tgt_ids, src_keep=src_keep, tgt_keep=tgt_keep,
                                          dropout_masks=dropout_masks)
    loss, d_logits, d_probabilities = token_cross_entropy(cfg, logits, targets), token_cross_entropy_vjp(
        cfg, logits, targets), None
    if calls:
        weight, chosen = cfg.moe.load_balancing, [call.chosen for call in calls]
        keep = model_inputs(cfg, src_ids, tgt_ids, src_keep, tgt_keep)[3]
        loss += weight * load_balancing_loss([call.probabilities for call in calls], chosen, keep)
        d_probabilities = weight * load_balancing_loss_vjp(chosen, keep, cfg.moe.n_experts)
    grads = model_vjp(cfg, p, src_ids, tgt_ids, d_logits, src_keep=src_keep, tgt_keep=tgt_keep,
                      dropout_masks=dropout_masks, d_probabilities=d_probabilities)
    return loss, grads


def load_balancing_loss_vjp(chosen: list[np.ndarray], keep: np.ndarray, n_experts: int) -> np.ndarray:
    """aux = E Σ_e f_e P_e with the choices (so f) constants: ∂p_lte = E · f_e / (L·N) at the N real
    tokens, 0 at the others; the same in each of the L layers. chosen [B, T, k] per layer -> [B, T, E]"""
    return n_experts * expert_shares(chosen, keep, n_experts) * keep[..., None] / max(len(chosen) * int(keep.sum()), 1)


# ---- helpers --------------------------------------------------------------------------------

def _present(p: Params, grads: Grads) -> Grads:
    """Only the gradients of parameters the module has (biases are optional)."""
    return {name: grad for name, grad in grads.items() if name in p}


def _named(prefix: str, grads: Grads) -> Grads:
    return {f"{prefix}.{name}": grad for name, grad in grads.items()}


def _accumulate(total: Grads, part: Grads) -> Grads:
    """total += part, name by name: a parameter's uses add up (llm.c's `+=`)."""
    for name, grad in part.items():
        total[name] = total[name] + grad if name in total else grad
    return total


@contextlib.contextmanager
def relu_kinks_flipped(relative_width: float):
    """ReLU's derivative taken on the other side of its kink for every pre-activation within
    relative_width · max(1, max|pre-activations|) of 0. A correct implementation whose
    pre-activations are that far off may land on either side, and each unit that does moves
    the gradient by its whole contribution: the change these VJPs give is the allowance that
    SPEC.md §13 adds for ReLU (it is zero where no pre-activation lies that near the kink)."""
    _RELU_FLIPPED_WITHIN[0] = relative_width
    try:
        yield
    finally:
        _RELU_FLIPPED_WITHIN[0] = 0.0
