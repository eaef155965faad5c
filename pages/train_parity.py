"""`rosetta train-parity`: the same model trained from the same weights on the same batches by the
golden (float64), PyTorch and JAX (each with its own optimizer, SPEC §14), with the loss curves
drawn over each other and each framework's distance from the golden's parameters, step by step.

The runs go through the harness's adapters (Runner.train), so a framework that is not installed
is reported as unavailable. The batches are windows of a small built-in text, one byte a token.
"Where they part" is the first step whose loss differs from the golden's by more than the loss's
tolerance (SPEC §8 at the run's dtype): from there the curves are two trainings, not one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conformance.adapter import get_backend
from conformance.backends.numpy_backend import NumpyRunner
from conformance.cases import SUBLAYERS
from conformance.tolerance import tolerance
from conformance.training_cells import divergence
from spec import ModelConfig
from spec.training import TrainingConfig

# Our own words, about what this suite does; any text of a few kilobytes would serve.
TEXT = (
    "A transformer reads a sequence of tokens and writes, for every position, a distribution over "
    "the next one. Each layer lets every position look at the others through attention, then passes "
    "what it gathered through a small feed-forward network. Written once in plain arrays, the model "
    "is a reference; written again in each framework, it is a claim that the two agree. Agreement is "
    "not a single number. The embeddings may agree while a mask does not, the forward pass may agree "
    "while its gradient does not, and one step of training may agree while a thousand steps drift "
    "apart. A careful check therefore compares every piece on its own inputs, with a tolerance that "
    "follows from how many roundings the piece contains, and says which piece broke first. Training "
    "adds its own traps: a loss that averages over padding, a weight decay that reaches the norms, an "
    "epsilon moved inside a square root. Each looks harmless and each changes the numbers. Run the "
    "same steps in every framework from the same weights, watch the losses fall together, and measure "
    "how far the parameters wander from the reference as the steps go by. "
) * 4


def text_batches(cfg: ModelConfig, steps: int, batch: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tgt_ids, targets) [steps, batch, length]: random windows of TEXT's bytes, the targets the
    window shifted by one."""
    data = np.frombuffer(TEXT.encode(), dtype=np.uint8).astype(np.int64)
    if cfg.has_encoder or cfg.tgt_vocab_size < 256:
        raise ValueError("train-parity trains a decoder-only byte model (tgt_vocab_size >= 256), e.g. --preset char-lm")
    if not 1 <= length < min(len(data), cfg.max_len + 1):
        raise ValueError(f"length must be in [1, {min(len(data) - 1, cfg.max_len)}], got {length}")
    starts = np.random.default_rng(seed).integers(0, len(data) - length - 1, size=(steps, batch))
    windows = data[starts[..., None] + np.arange(length + 1)]
    return windows[..., :-1], windows[..., 1:]


@dataclass
class Parity:
    """Each run's losses, its distance from the golden's parameters at the sampled steps, and
    the step where its loss parts from the golden's (None: never, within the run)."""

    steps: int
    dtype: str
    loss_tolerance: float
    losses: dict[str, list[float]] = field(default_factory=dict)
    sampled: list[int] = field(default_factory=list)
    distances: dict[str, list[float]] = field(default_factory=dict)
    parts_at: dict[str, int | None] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"steps": self.steps, "dtype": self.dtype, "loss_tolerance": self.loss_tolerance, "losses": self.losses,
                "sampled_steps": self.sampled, "distance_from_golden": self.distances, "parts_at": self.parts_at,
                "unavailable": self.unavailable}

    def table(self) -> str:
        lines = [f"{'run':<16} {'loss at 1':>10} {'loss at end':>12} {'distance at end':>16} {'parts at step':>14}"]
        for name, losses in self.losses.items():
            distance = self.distances.get(name, [0.0])[-1]
            parts = "-" if name == "golden" else ("never" if self.parts_at[name] is None else str(self.parts_at[name]))
            lines.append(f"{name:<16} {losses[0]:>10.4f} {losses[-1]:>12.4f} {distance:>16.3g} {parts:>14}")
        lines += [f"{name:<16} unavailable: {why}" for name, why in self.unavailable.items()]
        return "\n".join(lines)


def train_parity(cfg: ModelConfig, params, steps: int = 200, *, backends=("torch", "jax"), dtype: str = "float32",
                 batch: int = 8, length: int = 64, training: TrainingConfig | None = None, samples: int = 40,
                 seed: int = 0) -> Parity:
    """Train the golden and each backend `steps` steps on the same batches; parameters are kept
    at about `samples` steps (every run's whole parameters at every step would not fit)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    training = training or TrainingConfig(optimizer="adamw", weight_decay=0.01, warmup_steps=50)
    tgt_ids, targets = text_batches(cfg, steps, batch, length, seed)
    every = max(1, steps // samples)
    inputs = {"training": training, "src_ids": None, "tgt_ids": tgt_ids, "targets": targets, "keep": ("params",),
              "every": every}
    reduction = max(cfg.d_model, cfg.d_ff, length, cfg.tgt_vocab_size)
    relative = tolerance(dtype, reduction, SUBLAYERS["loss"].depth(cfg))
    parity = Parity(steps, dtype, relative)
    golden = NumpyRunner(cfg, params, "float64").train("train_steps", inputs)
    parity.losses["golden"] = [float(r["loss"]) for r in golden if "loss" in r]
    parity.sampled = [i for i, r in enumerate(golden, 1) if "params" in r]
    golden_params = [r for r in golden if "params" in r]
    for name in backends:
        backend, reason = get_backend(name)
        if backend is None:
            parity.unavailable[name] = reason
            continue
        run = backend.load(cfg, params, dtype, "cpu").train("train_steps", inputs)
        if "stopped" in run[-1]:
            parity.unavailable[name] = f"stopped after {len(run) - 1} step(s): {run[-1]['stopped']}"
            run = run[:-1]
        parity.losses[name] = [float(r["loss"]) for r in run]
        parity.distances[name] = divergence([r for r in run if "params" in r], golden_params)
        parity.parts_at[name] = next((step for step, (mine, theirs) in enumerate(
            zip(parity.losses[name], parity.losses["golden"]), 1) if abs(mine - theirs) > relative * max(1.0, abs(theirs))),
            None)
    return parity


def write(parity: Parity, folder: Path, title: str) -> list[Path]:
    """train-parity.json and train-parity.png: the loss curves over each other, and the distance
    from the golden's parameters (log scale), with each run's parting step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train-parity.json").write_text(json.dumps(parity.to_dict(), indent=1) + "\n")
    figure, (losses, distances) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in parity.losses.items():
        losses.plot(range(1, len(values) + 1), values, label=name, linewidth=2.5 if name == "golden" else 1.2,
                    linestyle="-" if name == "golden" else "--")
    for name, values in parity.distances.items():
        positive = [(s, d) for s, d in zip(parity.sampled, values) if d > 0 and math.isfinite(d)]
        if positive:
            distances.semilogy(*zip(*positive), marker=".", label=name)
        if parity.parts_at.get(name):
            for axis in (losses, distances):
                axis.axvline(parity.parts_at[name], color="grey", linestyle=":", linewidth=1)
    losses.set(title="loss (same weights, same batches)", xlabel="step", ylabel="token cross-entropy")
    distances.set(title="‖θ − θ_golden‖ / ‖θ_golden‖", xlabel="step")
    losses.legend()
    distances.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(folder / "train-parity.png", dpi=100)
    plt.close(figure)
    return [folder / "train-parity.json", folder / "train-parity.png"]
