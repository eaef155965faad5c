"""The training step in JAX with its own optimizer: a parallel text to impl_numpy/training.py.
optax.adam / adamw configured from spec.training.TrainingConfig, the paper's schedule as an
optax schedule, optax's global-norm clipping (the spec's, no ε)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from impl_jax.model import Transformer, training_loss
from spec import ModelConfig
from spec.training import LossScaling, TrainingConfig, decays


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


@dataclass
class MixedPrecision:
    """Mixed-precision training (SPEC §14.2), as an explicit policy: the model (its master weights)
    and the optimizer in float32; each step casts the weights into `compute`, the same model in
    the half dtype, for the forward and backward, and the gradients back to float32. float16's
    loss is scaled (spec.training.LossScaling, torch.amp.GradScaler's rule): a step whose
    gradients overflow is skipped and the scale backed off."""

    compute: Transformer
    scaling: LossScaling | None
    scale: float = 1.0
    taken: int = 0  # steps taken in a row since the scale last moved

    def __post_init__(self):
        self.scale = 1.0 if self.scaling is None else self.scaling.scale


def train_step(cfg: ModelConfig, model: Transformer, optimizer: optax.GradientTransformation, state,
               src_ids, tgt_ids, targets, dropout_masks=None, mixed: MixedPrecision | None = None):
    """One step: the loss and its gradients, then the optimizer's update, written into the
    model's Params; `mixed`: in mixed precision, where a float16 step whose scaled gradients
    overflow is skipped (nothing updated, optax's count not advanced). -> (the loss before the
    update, the gradients (before clipping; unscaled), the optimizer's new state)"""
    def loss_of(m: Transformer) -> jax.Array:
        if cfg.moe is None or not cfg.moe.load_balancing:  # the forward cells' compiled program, not one more
            return training_loss(cfg, m(src_ids, tgt_ids, dropout_masks=dropout_masks), targets, tgt_ids, [])
        logits, routed = m.routed_call(src_ids, tgt_ids, dropout_masks)
        return training_loss(cfg, logits, targets, tgt_ids, routed)

    params = nnx.state(model, nnx.Param)
    if mixed is None:
        loss, grads = nnx.value_and_grad(loss_of)(model)
    else:
        nnx.update(mixed.compute, jax.tree.map(lambda p: p.astype(mixed.compute.dtype), params))
        scale = mixed.scale
        # the loss (float32) times the scale: its cotangent reaches the half-precision backward scaled
        loss, grads = nnx.value_and_grad(lambda m: loss_of(m) * scale)(mixed.compute)
        loss = loss / scale
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype) / scale, grads, params)
        if mixed.scaling is not None and not all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads)):
            mixed.scale, mixed.taken = scale * mixed.scaling.backoff, 0  # skipped: nothing moves
            return float(loss), grads, state
        if mixed.scaling is not None:
            mixed.taken += 1
            if mixed.taken == mixed.scaling.interval:
                mixed.scale, mixed.taken = scale * mixed.scaling.growth, 0
    updates, state = optimizer.update(grads, state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    value = float(loss)
    if not math.isfinite(value):
        raise FloatingPointError(f"the loss is {value}")
    return value, grads, state
