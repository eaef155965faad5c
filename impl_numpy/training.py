"""The golden training step: the loss of SPEC §5.9 and its gradients (backward.py), optional
global-norm clipping, then one Adam or AdamW update with the paper's learning-rate schedule,
each written out as its equation (SPEC §14). Float64, as the rest of the golden."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from impl_numpy.backward import Grads, loss_and_gradients
from impl_numpy.model import Params
from spec import ModelConfig
from spec.training import TrainingConfig, decays, learning_rate


@dataclass(frozen=True)
class AdamState:
    """Adam's moments after `step` updates: m (first) and v (second), one per parameter."""

    step: int
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]


def start_adam(params: Params) -> AdamState:
    """No step taken: both moments zero."""
    return AdamState(0, {n: np.zeros_like(p) for n, p in params.items()}, {n: np.zeros_like(p) for n, p in params.items()})


def clip_by_global_norm(grads: Grads, max_norm: float) -> Grads:
    """g ← g · min(1, c / ‖g‖), ‖g‖ the norm of every gradient together (no ε in the divisor)."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    factor = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {name: g * factor for name, g in grads.items()}


def adam_update(training: TrainingConfig, state: AdamState, params: Params, grads: Grads,
                rate: float) -> tuple[dict[str, np.ndarray], AdamState]:
    """m = β1 m + (1 − β1) g,  v = β2 v + (1 − β2) g²,  m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t),
    θ ← θ − lr (m̂ / (√v̂ + ε) + λ θ), λ AdamW's decay on matrices and tables only (Adam: λ = 0)."""
    t = state.step + 1
    b1, b2, eps = training.beta1, training.beta2, training.eps
    new_params, m, v = {}, {}, {}
    for name, theta in params.items():
        g = grads[name]
        m[name] = b1 * state.m[name] + (1 - b1) * g
        v[name] = b2 * state.v[name] + (1 - b2) * g * g
        m_hat, v_hat = m[name] / (1 - b1 ** t), v[name] / (1 - b2 ** t)
        decay = training.weight_decay if decays(theta.shape) else 0.0
        new_params[name] = theta - rate * (m_hat / (np.sqrt(v_hat) + eps) + decay * theta)
    return new_params, AdamState(t, m, v)


def train_step(cfg: ModelConfig, training: TrainingConfig, params: Params, state: AdamState,
               src_ids: np.ndarray | None, tgt_ids: np.ndarray,
               targets: np.ndarray, dropout_masks=None) -> tuple[float, Grads, dict[str, np.ndarray], AdamState]:
    """One step: the loss and its gradients (with dropout where keep-masks are given), clipped
    when training.clip_norm is set, then the update at lr(step). params in the computation dtype.
    -> the loss (before the update), the gradients (before clipping), params, state"""
    loss, grads = loss_and_gradients(cfg, params, src_ids, tgt_ids, targets, dropout_masks=dropout_masks)
    taken = clip_by_global_norm(grads, training.clip_norm) if training.clip_norm is not None else grads
    new_params, new_state = adam_update(training, state, params, taken, learning_rate(cfg, training, state.step + 1))
    return loss, grads, new_params, new_state
