"""The training step in PyTorch with its own optimizer: a parallel text to impl_numpy/training.py.
torch.optim.Adam / AdamW configured from spec.training.TrainingConfig, the paper's schedule as a
LambdaLR factor on a base rate of 1, the spec's global-norm clipping."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from impl_torch.model import Transformer, recorded_routers, training_loss
from spec import ModelConfig
from spec.training import LossScaling, TrainingConfig, decays, learning_rate


def make_optimizer(model: Transformer, training: TrainingConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer over the model's parameters and its schedule. AdamW decays the matrices and
    tables only: two parameter groups, as torch takes per-parameter weight decay."""
    parameters = list(model.parameters())
    groups = [{"params": [p for p in parameters if decays(tuple(p.shape))], "weight_decay": training.weight_decay},
              {"params": [p for p in parameters if not decays(tuple(p.shape))], "weight_decay": 0.0}]
    kind = torch.optim.AdamW if training.optimizer == "adamw" else torch.optim.Adam
    # torch.optim.AdamW's own default weight_decay is 1e-2: every group states its own
    optimizer = kind(groups, lr=1.0, betas=(training.beta1, training.beta2), eps=training.eps)
    # LambdaLR multiplies the base rate 1 by lr(step), its own count starting at 0 for step 1
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda count: learning_rate(model.cfg, training, count + 1))
    return optimizer, schedule


def clip_by_global_norm(parameters: list[torch.Tensor], max_norm: float) -> None:
    """g ← g · min(1, c / ‖g‖). torch.nn.utils.clip_grad_norm_ divides by ‖g‖ + 1e-6, not ‖g‖."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    if norm > max_norm:
        torch._foreach_mul_(grads, max_norm / norm)


@dataclass
class MixedPrecision:
    """Mixed-precision training (SPEC §14.2): the model (its master weights) and the optimizer in
    float32, the forward and backward under torch.autocast in `dtype`; for float16, dynamic loss
    scaling by torch.amp.GradScaler at its defaults (2¹⁶ to start, halved on an overflow, which
    skips the step, doubled after 2000 steps without one). bfloat16 has float32's range: no scaling."""

    dtype: torch.dtype
    scaling: LossScaling | None
    device: str = "cpu"
    scaler: torch.amp.GradScaler | None = None

    def __post_init__(self):
        if self.scaling is not None and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device, init_scale=self.scaling.scale,
                                               growth_factor=self.scaling.growth, backoff_factor=self.scaling.backoff,
                                               growth_interval=self.scaling.interval)


def train_step(cfg: ModelConfig, training: TrainingConfig, model: Transformer, optimizer: torch.optim.Optimizer,
               schedule: torch.optim.lr_scheduler.LambdaLR, src_ids, tgt_ids, targets,
               dropout_masks=None, mixed: MixedPrecision | None = None) -> tuple[float, dict]:
    """One step: the loss and its gradients (with dropout where keep-masks are given), clipped
    when training.clip_norm is set, then the optimizer's update at lr(step); `mixed`: in mixed
    precision, where a float16 step whose scaled gradients overflow is skipped (nothing updated,
    the schedule not advanced). -> the loss (before the update), the gradients by parameter name
    (before clipping; unscaled)"""
    optimizer.zero_grad()
    autocast = contextlib.nullcontext() if mixed is None else torch.autocast(mixed.device, dtype=mixed.dtype)
    with autocast, recorded_routers() as routed:
        logits = model(src_ids, tgt_ids, dropout_masks=dropout_masks)
        loss = training_loss(cfg, logits, targets, tgt_ids, routed)
    scaler = None if mixed is None else mixed.scaler
    (loss if scaler is None else scaler.scale(loss)).backward()
    for p in model.parameters():
        if p.grad is None:  # an expert no token chose (the loop form runs it on nothing): its gradient
            # is 0, and torch.optim skips a parameter without one, where the spec's step still decays
            # its moments and weights
            p.grad = torch.zeros_like(p)
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.unscale_(optimizer)  # the gradients divided by the scale, in float32; an overflow is noted
    # copies: clipping and the next step's zero_grad work on .grad in place
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    if training.clip_norm is not None:
        clip_by_global_norm(list(model.parameters()), training.clip_norm)
    if scaler is None:
        optimizer.step()
        schedule.step()
    else:
        scaler.step(optimizer)  # skipped where unscale_ found an inf or a NaN
        scaler.update()
        if scaler.get_scale() >= scale:  # the scale is halved on a skipped step only
            schedule.step()
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(f"the loss is {value}")
    return value, grads
