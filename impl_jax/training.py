"""The training step in JAX with its own optimizer: a parallel text to impl_numpy/training.py.
optax.adam / adamw configured from spec.training.TrainingConfig, the paper's schedule as an
optax schedule, optax's global-norm clipping (the spec's, no ε)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from impl_jax.model import Transformer, training_loss
from spec import ModelConfig
from spec.training import TrainingConfig, decays


def make_optimizer(cfg: ModelConfig, training: TrainingConfig) -> optax.GradientTransformation:
    """Clipping (when set), then Adam or AdamW at the schedule's rate. AdamW decays the matrices
    and tables only: a mask over the parameters."""
    def schedule(count):
        # optax counts updates from 0; the spec's steps count from 1
        step = count + 1
        return training.learning_rate_scale * cfg.d_model ** -0.5 * jnp.minimum(
            step ** -0.5, step * training.warmup_steps ** -1.5)

    if training.optimizer == "adamw":
        # optax.adamw's own default weight_decay is 1e-4, torch's 1e-2: the spec's is stated
        update = optax.adamw(schedule, b1=training.beta1, b2=training.beta2, eps=training.eps, eps_root=0.0,
                             weight_decay=training.weight_decay,
                             mask=lambda params: jax.tree.map(lambda p: decays(p.shape), params))
    else:
        update = optax.adam(schedule, b1=training.beta1, b2=training.beta2, eps=training.eps, eps_root=0.0)
    return update if training.clip_norm is None else optax.chain(optax.clip_by_global_norm(training.clip_norm), update)


def start(model: Transformer, optimizer: optax.GradientTransformation):
    """The optimizer's state over the model's Params."""
    return optimizer.init(nnx.state(model, nnx.Param))


def adam_moments(state) -> optax.ScaleByAdamState:
    """Adam's moments (mu, nu) inside the optimizer's state, wherever the chain holds them."""
    found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    if len(found) != 1:
        raise ValueError(f"expected one Adam state in the optimizer's state, found {len(found)}")
    return found[0]


def train_step(cfg: ModelConfig, model: Transformer, optimizer: optax.GradientTransformation, state,
               src_ids, tgt_ids, targets, dropout_masks=None):
    """One step: the loss and its gradients, then the optimizer's update, written into the
    model's Params. -> (the loss before the update, the gradients (before clipping), the
    optimizer's new state)"""
    def loss_of(m: Transformer) -> jax.Array:
        if cfg.moe is None or not cfg.moe.load_balancing:  # the forward cells' compiled program, not one more
            return training_loss(cfg, m(src_ids, tgt_ids, dropout_masks=dropout_masks), targets, tgt_ids, [])
        logits, routed = m.routed_call(src_ids, tgt_ids, dropout_masks)
        return training_loss(cfg, logits, targets, tgt_ids, routed)

    loss, grads = nnx.value_and_grad(loss_of)(model)
    params = nnx.state(model, nnx.Param)
    updates, state = optimizer.update(grads, state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    value = float(loss)
    if not math.isfinite(value):
        raise FloatingPointError(f"the loss is {value}")
    return value, grads, state
