"""The training step's settings (SPEC.md §14): the optimizer, its learning-rate schedule and the
gradient clipping. Every implementation configures its own optimizer from these."""

from __future__ import annotations

import dataclasses
import math

from spec.config import ModelConfig
from spec.errors import ConfigError

OPTIMIZERS = ("adam", "adamw")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Adam with the paper's β1 0.9, β2 0.98, ε 1e-9 and warm-up schedule (§5.3 of the paper) by
    default. Construction validates every field and raises ConfigError naming the offending one."""

    optimizer: str = "adam"
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9  # added to √v̂, outside the root
    weight_decay: float = 0.0  # AdamW's decoupled λ; Adam takes none
    warmup_steps: int = 4000
    learning_rate_scale: float = 1.0  # × the paper's schedule
    clip_norm: float | None = None  # the gradients' global norm is clipped to this

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        for name in ("beta1", "beta2", "eps", "weight_decay", "learning_rate_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0 or not self.learning_rate_scale > 0:
            raise ConfigError(f"eps and learning_rate_scale must be positive, got {self.eps} and "
                              f"{self.learning_rate_scale}")
        if self.weight_decay < 0 or (self.weight_decay and self.optimizer != "adamw"):
            raise ConfigError(f"weight_decay must be >= 0, and 0 unless optimizer is adamw (torch's Adam would add "
                              f"it to the gradient, an L2 penalty, not a decoupled decay); got {self.weight_decay} "
                              f"with {self.optimizer}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ConfigError(f"warmup_steps must be a positive integer, got {self.warmup_steps!r}")
        if self.clip_norm is not None and (isinstance(self.clip_norm, bool) or not isinstance(self.clip_norm, (int, float))
                                           or not self.clip_norm > 0 or not math.isfinite(self.clip_norm)):
            raise ConfigError(f"clip_norm must be a positive number or None, got {self.clip_norm!r}")


def learning_rate(cfg: ModelConfig, training: TrainingConfig, step: int) -> float:
    """lr(step) = scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), steps counted from 1:
    a linear warm-up to warmup_steps, then the inverse square root."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"training steps count from 1, got {step!r}")
    return training.learning_rate_scale * cfg.d_model ** -0.5 * min(step ** -0.5, step * training.warmup_steps ** -1.5)


def decays(shape: tuple[int, ...]) -> bool:
    """Whether AdamW's weight decay applies to a parameter of this shape: to the matrices and
    embedding tables (two axes), never to the vectors (biases, norm scales and norm biases)."""
    return len(shape) >= 2


# ---- mixed precision (SPEC §14.2) ------------------------------------------------------------

HALF_DTYPES = ("float16", "bfloat16")


def master_dtype(dtype: str) -> str:
    """The dtype a run at `dtype` keeps its weights and Adam's moments in: float32 under a half
    precision (mixed precision: the forward and backward in the half dtype), else the dtype itself."""
    return "float32" if dtype in HALF_DTYPES else dtype


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling, float16's (torch.amp.GradScaler's defaults): the loss multiplied by
    `scale` before the backward and the gradients divided by it after; a step whose gradients are
    then not all finite is skipped (weights, moments, the step count and the schedule unchanged)
    and the scale multiplied by `backoff`; after `interval` steps in a row taken, by `growth`."""

    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000


def loss_scaling(dtype: str) -> LossScaling | None:
    """float16's range needs its loss scaled; bfloat16 has float32's exponent range and does not."""
    return LossScaling() if dtype == "float16" else None
