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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

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
