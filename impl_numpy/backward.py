"""The golden backward, first part: a hand-written float64 vector-Jacobian product (VJP) for the
pieces of model.py that every sublayer is made of, one function per equation, named after it.

Each takes the forward's inputs and the cotangent of its output (d_y = ∂L/∂y, same shape as y)
and returns the cotangents of its inputs and parameters. The derivative is in each docstring's
first line. tests/test_backward.py audits every one three ways: float64 central differences,
torch float64 autograd and JAX with x64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from impl_numpy.model import ACTIVATIONS, _erf, softmax


# ---- small pieces ---------------------------------------------------------------------------

def linear_vjp(x: np.ndarray, weight: np.ndarray, d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = x W + b:  ∂x = ∂y Wᵀ, ∂W = Σ xᵀ ∂y, ∂b = Σ ∂y (sums over every leading axis).
    x [.., in], W [in, out], d_y [.., out] -> d_x [.., in], d_weight [in, out], d_bias [out]"""
    rows_x, rows_d_y = x.reshape(-1, x.shape[-1]), d_y.reshape(-1, d_y.shape[-1])
    return d_y @ weight.T, rows_x.T @ rows_d_y, rows_d_y.sum(axis=0)


def relu_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂ max(0, x) / ∂x = [x > 0] (0 at x = 0, as torch and JAX take it)"""
    return d_y * (x > 0)


def gelu_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂ x Φ(x) / ∂x = Φ(x) + x φ(x), φ(x) = exp(−x²/2) / √(2π)"""
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return d_y * (cdf + x * pdf)


def gelu_tanh_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂/∂x of x (1 + tanh u) / 2, u = c (x + a x³): (1 + tanh u) / 2 + x (1 − tanh² u) c (1 + 3a x²) / 2"""
    c, a = math.sqrt(2.0 / math.pi), 0.044715
    t = np.tanh(c * (x + a * x**3))
    return d_y * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x))


def swish_vjp(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """∂ x σ(x) / ∂x = σ(x) + x σ(x) (1 − σ(x)), σ(x) = (1 + tanh(x/2)) / 2"""
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * x))
    return d_y * (sigmoid + x * sigmoid * (1.0 - sigmoid))


ACTIVATION_VJPS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relu": relu_vjp, "gelu": gelu_vjp, "gelu-tanh": gelu_tanh_vjp, "swish": swish_vjp,
}


def softmax_vjp(p: np.ndarray, d_p: np.ndarray) -> np.ndarray:
    """p = softmax(x):  ∂x = p ⊙ (∂p − Σ_j ∂p_j p_j) over the last axis. A masked entry has p = 0,
    so its ∂x is exactly 0; a row with nothing kept (p all 0) gets 0, never NaN."""
    return p * (d_p - (d_p * p).sum(axis=-1, keepdims=True))


# ---- attention ------------------------------------------------------------------------------

def scaled_dot_product_attention_vjp(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                                     d_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """out = P V, P = softmax(S, mask), S = Q Kᵀ / √d_k:
    ∂V = Pᵀ ∂out, ∂P = ∂out Vᵀ, ∂S = softmax_vjp(P, ∂P), ∂Q = ∂S K / √d_k, ∂K = ∂Sᵀ Q / √d_k.
    q [B, H, Q, d_k], k and v [B, H, K, d_k], d_out [B, H, Q, d_k] -> d_q, d_k, d_v"""
    scale = 1.0 / math.sqrt(q.shape[-1])
    weights = softmax(q @ np.swapaxes(k, -1, -2) * scale, mask)  # P [B, H, Q, K]
    d_v = np.swapaxes(weights, -1, -2) @ d_out  # [B, H, K, d_k]
    d_scores = softmax_vjp(weights, d_out @ np.swapaxes(v, -1, -2))  # ∂S [B, H, Q, K]
    return d_scores @ k * scale, np.swapaxes(d_scores, -1, -2) @ q * scale, d_v


# ---- feed-forward and norms -----------------------------------------------------------------

def feed_forward_vjp(p: dict[str, np.ndarray], x: np.ndarray, activation: str,
                     d_y: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """y = act(x W1 + b1) W2 + b2: back through W2, the activation, then W1.
    x [B, T, d], d_y [B, T, d] -> d_x [B, T, d], {w1.weight, w1.bias, w2.weight, w2.bias}"""
    before = x @ p["w1.weight"] + (p["w1.bias"] if "w1.bias" in p else 0.0)  # [B, T, d_ff]
    hidden = ACTIVATIONS[activation](before)
    d_hidden, d_w2, d_b2 = linear_vjp(hidden, p["w2.weight"], d_y)
    d_x, d_w1, d_b1 = linear_vjp(x, p["w1.weight"], ACTIVATION_VJPS[activation](before, d_hidden))
    grads = {"w1.weight": d_w1, "w1.bias": d_b1, "w2.weight": d_w2, "w2.bias": d_b2}
    return d_x, {name: grad for name, grad in grads.items() if name in p}


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
