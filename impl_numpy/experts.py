"""The mixture-of-experts FFN (Mixtral, Qwen3-MoE), the golden's: a router chooses k of E
gated FFNs per token and the block sums their outputs, weighted.

    p      = softmax(x R)                               router probabilities [N, E]
    top    = the k largest p, ties to the lower index   chosen experts [N, k]
    w      = p[top] / Σ p[top]  (renormalised; Mixtral)  or  p[top]  (Qwen3-MoE without norm_topk_prob)
    MoE(x) = Σ_j w_j · FFN_top_j(x)

An expert no token chose computes nothing and adds nothing. A routing margin is p_(k) − p_(k+1),
the gap between the k-th and the (k+1)-th probability of a token: how far its choice is from a tie,
which a backend's rounding could flip. Shapes: x [N, d] (tokens flattened), R [d, E]; each expert
is a gated FFN's parameters (w1, w3: [d, d_ff]; w2: [d_ff, d]), as impl_numpy.model.feed_forward.

Its VJP is here beside it until the framework implementations exist (issue 40): then it joins
impl_numpy/backward.py, whose every VJP the backward page sets beside torch's and JAX's code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from impl_numpy.backward import _CANCELLING, feed_forward_vjp, linear_vjp, softmax_vjp
from impl_numpy.model import feed_forward, linear, softmax

Params = Mapping[str, np.ndarray]


def router_probabilities(x: np.ndarray, router: np.ndarray) -> np.ndarray:
    """p = softmax(x R). [N, d] @ [d, E] -> [N, E]"""
    return softmax(linear(x, router))


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
                       activation: str) -> np.ndarray:
    """MoE(x) = Σ_j w_j · FFN_top_j(x), each expert run on the tokens that chose it. [N, d] -> [N, d]"""
    if router.shape[-1] != len(experts):
        raise ValueError(f"the router scores {router.shape[-1]} experts; {len(experts)} are given")
    probabilities = router_probabilities(x, router)
    chosen = top_experts(probabilities, k)  # [N, k]
    weights = routing_weights(probabilities, chosen, renormalize)  # [N, k]
    out = np.zeros_like(x)
    for expert, p in enumerate(experts):
        tokens, slot = np.nonzero(chosen == expert)  # the tokens that chose it, and in which of their k places
        if tokens.size:
            out[tokens] += weights[tokens, slot, None] * feed_forward(p, x[tokens], activation)
    return out


def mixture_of_experts_vjp(x: np.ndarray, router: np.ndarray, experts: list[dict[str, np.ndarray]], k: int,
                           renormalize: bool, activation: str,
                           d_y: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[dict[str, np.ndarray]]]:
    """y = Σ_j w_j FFN_top_j(x), the chosen experts constants (top-k is constant between ties):
    ∂w_j = ⟨∂y, FFN_top_j(x)⟩; renormalised, w = p_T / Σ p_T: ∂p_T = (∂w − Σ_j w_j ∂w_j) / Σ p_T;
    ∂z = softmax's VJP of ∂p (0 off the chosen), z = x R; ∂x = Σ_j w_j ∂x_FFN_j + ∂z Rᵀ.
    x [N, d], d_y [N, d] -> d_x [N, d], d_router [d, E], each expert's {w1.*, w3.*, w2.*} (zeros
    for an expert no token chose)"""
    probabilities = router_probabilities(x, router)  # [N, E]
    chosen = top_experts(probabilities, k)  # [N, k]
    weights = routing_weights(probabilities, chosen, renormalize)  # [N, k]
    d_x, d_weights, expert_grads = np.zeros_like(x), np.zeros_like(weights), []
    for expert, p in enumerate(experts):
        tokens, slot = np.nonzero(chosen == expert)
        if not tokens.size:
            expert_grads.append({name: np.zeros_like(value) for name, value in p.items()})
            continue
        d_weights[tokens, slot] = (d_y[tokens] * feed_forward(p, x[tokens], activation)).sum(axis=-1)
        d_part, grads = feed_forward_vjp(p, x[tokens], activation, weights[tokens, slot, None] * d_y[tokens])
        d_x[tokens] += d_part
        expert_grads.append(grads)
    d_chosen = d_weights
    if renormalize:
        total = np.take_along_axis(probabilities, chosen, axis=-1).sum(axis=-1, keepdims=True)
        shared = (weights * d_weights).sum(axis=-1, keepdims=True) if _CANCELLING[0] else 0.0
        d_chosen = (d_weights - shared) / total
    d_probabilities = np.zeros_like(probabilities)
    np.put_along_axis(d_probabilities, chosen, d_chosen, axis=-1)
    d_from_router, d_router, _ = linear_vjp(x, router, softmax_vjp(probabilities, d_probabilities))
    return d_x + d_from_router, d_router, expert_grads
