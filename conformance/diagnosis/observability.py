"""Observability: does every parameter and every behavioural input reach a checked output?

A conformance cell can only catch a mistake in something its output depends on. A parameter
that no cell observes (a zero bias on the paper's initialisation, a norm scale of exactly one, a
token the generate cases never emit) is a hole in the catalogue: a backend may drop it, add it
twice or swap it and pass. This module perturbs one thing at a time — a parameter tensor by a
relative amount well above the tolerance, or a behavioural input (eos_id, bos_id, a keep-mask,
a cache position) — and asks the golden whether some case's output moves beyond the case's
tolerance. What moves nothing is reported, with the reason when the spec says why (SPEC.md §4.1).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from conformance.backends.numpy_backend import NumpyRunner, golden_output, perturbed
from conformance.cases import TGT_LEN, Case, catalogue
from conformance.tolerance import compare, compare_generation
from spec import ModelConfig

# Parameters no output can depend on, whatever the weights: a key bias adds q·b_k to every
# score of a query, the same number for every key, and softmax ignores a shift of its row. Not so
# once the keys are rotated (RoPE turns b_k by each key's position) or normed per head (Qwen3).
INVISIBLE = {"k.bias": "softmax(s + c) = softmax(s) for a constant c per query: no output depends on a key bias"}

# SPEC §4.1: a parameter tensor changed by 0.5% of itself moves some case's output beyond its float32
# tolerance. A fixed share, not a number of tolerances: a loose cell (the rotary ones once were)
# must not widen the perturbation and hide a parameter that the other cells cannot see.
PERTURBATION = 5e-3

# The whole-model cases see every layer, so they come first: most tensors are seen by the first.
_ORDER = ("forward", "encoder", "decoder", "decode", "generate")


def invisible_reason(cfg: ModelConfig, name: str) -> str | None:
    """Why a parameter of this config can be seen by no output at all, or None."""
    if cfg.positional == "rope" or cfg.qk_norm:
        return None
    return next((why for suffix, why in INVISIBLE.items() if name.endswith(suffix)), None)


@dataclass(frozen=True)
class Observation:
    subject: str  # a parameter name, or an input like "generate-pad_right: eos_id"
    seen_by: str | None  # the first case whose output moved beyond its tolerance
    ratio: float  # that output's change / tolerance (0 when none moved)


class _Golden:
    """The golden's outputs of every case, on given weights, with each case's tolerance."""

    def __init__(self, cfg: ModelConfig, cases: list[Case], dtype: str):
        self.cfg, self.dtype = cfg, dtype
        self.cases = sorted(cases, key=lambda c: (_ORDER.index(c.sublayer) if c.sublayer in _ORDER else len(_ORDER),
                                                  _size(c)))

    def tolerance(self, case: Case) -> float:
        return case.tolerance(self.cfg, self.dtype)

    def output(self, params, case: Case, inputs=None, runner: NumpyRunner | None = None):
        return golden_output(self.cfg, params, case.sublayer, case.inputs if inputs is None else inputs,
                             runner or NumpyRunner(self.cfg, params, "float64"))

    def moved(self, case: Case, before, after) -> float:
        """How far an output moved, in tolerances (above 1: a backend could not hide it)."""
        if case.sublayer == "generate":
            tokens, logits = before
            result = compare_generation(after[0], tokens, logits, self.tolerance(case), case.inputs["eos_id"])
            return 0.0 if result.passed else np.inf
        return compare(after, before, self.tolerance(case), case.floor).ratio


def _size(case: Case) -> int:
    """How many numbers a case feeds in: within a sublayer the short cases are asked first, so that
    the long ones (a 520-token forward, a step after 1000 positions) run only for what nothing
    shorter sees, their golden outputs made only then."""
    return sum(np.size(value) for value in case.inputs.values() if isinstance(value, np.ndarray))


class _References(dict):
    """{case name: the golden's output on the unperturbed weights}, each made when first asked for."""

    def __init__(self, golden: _Golden, params, runner: NumpyRunner):
        super().__init__()
        self.golden, self.params, self.runner = golden, params, runner
        self.cases = {case.name: case for case in golden.cases}

    def __missing__(self, name: str):
        self[name] = self.golden.output(self.params, self.cases[name], None, self.runner)
        return self[name]


def parameter_observations(cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str = "float32",
                           relative: float = PERTURBATION) -> Iterator[Observation]:
    """For each parameter tensor, the first case whose golden output moves beyond its `dtype`
    tolerance when each element of the tensor is scaled by 1 ± relative (SPEC §4.1: 0.5%)."""
    golden = _Golden(cfg, catalogue(cfg, params), dtype)
    unchanged = NumpyRunner(cfg, params, "float64")  # the weights cast once
    reference = _References(golden, params, unchanged)
    for index, name in enumerate(params):
        moved = perturbed(params[name], relative, index)
        if np.array_equal(moved, params[name]):  # a zero tensor stays zero: the same weights, every output
            yield Observation(name, None, 0.0)     # the reference itself (the paper's zero biases)
            continue
        yield _first_seen(golden, name, unchanged.replaced(name, moved), reference)


def _first_seen(golden: _Golden, subject: str, runner: NumpyRunner, reference) -> Observation:
    best = 0.0
    for case in golden.cases:
        ratio = golden.moved(case, reference[case.name], golden.output(runner.params, case, None, runner))
        if ratio > 1.0:
            return Observation(subject, case.name, ratio)
        best = max(best, ratio)
    return Observation(subject, None, best)


def input_observations(cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str = "float32") -> list[Observation]:
    """Each behavioural input of the catalogue changed on its own: eos_id and bos_id of every
    generate case (moved to another id), every keep-mask (its first kept position masked), and
    every position offset (a step's cache length, one more)."""
    cases = catalogue(cfg, params)
    golden, runner = _Golden(cfg, cases, dtype), NumpyRunner(cfg, params, "float64")
    observations = []
    for case in cases:
        reference = golden.output(params, case, None, runner)
        for label, inputs in _input_changes(cfg, case):
            ratio = golden.moved(case, reference, golden.output(params, case, inputs, runner))
            observations.append(Observation(f"{case.name}: {label}", case.name if ratio > 1.0 else None, ratio))
    return observations


def _input_changes(cfg: ModelConfig, case: Case) -> Iterator[tuple[str, dict]]:
    inputs = case.inputs
    vocab = cfg.tgt_vocab_size
    if case.sublayer == "generate":
        yield "eos_id", {**inputs, "eos_id": _another_id(inputs["eos_id"], vocab, cfg.pad_id)}
        if cfg.has_encoder:
            yield "bos_id", {**inputs, "bos_id": _another_id(inputs["bos_id"], vocab, cfg.pad_id)}
    # An attention's offset is left alone: RoPE turns q and k by their positions, so q·k depends on
    # their difference only, and shifting all of them by one moves no score (the `far` case is there
    # for the rounding of large angles, not for the shift).
    moves = case.sublayer not in ("mha", "grad-mha")
    if moves and "offset" in inputs and (cfg.positional != "learned" or inputs["offset"] + TGT_LEN < cfg.max_len):
        yield "position offset", {**inputs, "offset": inputs["offset"] + 1}
    # tgt_keep: the real tokens a sliding layer builds its own mask from, and a linear layer's pads
    for key in ("mask", "self_mask", "cross_mask", "tgt_keep"):
        mask = inputs.get(key)
        if mask is not None and np.asarray(mask).any():
            flipped = np.array(mask, copy=True)
            flipped.flat[int(np.flatnonzero(flipped)[0])] = False  # the first kept position, masked
            yield key, {**inputs, key: flipped}


def _another_id(token: int, vocab: int, pad_id: int) -> int:
    return next(t for t in ((token + step) % vocab for step in range(1, vocab)) if t != pad_id)
