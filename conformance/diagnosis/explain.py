"""Explanation: which of the spec's features a whole-model column left out.

A column that runs whole models only (a peer: onnxruntime-genai's builder, CTranslate2's
converter, transformers) has no stages to localize. When its forward (else its decode) fails,
its logits are compared with the golden's under sets of omissions (spec.omissions: a softcap
ignored, a window one key wider, the rope scaling dropped, ...), smallest sets first, every set
of one size before the next, and within a size those whose subsets came nearest first. The sets
under which the column passes the very tolerance its cell failed are the explanation: "its
logits are the golden's with attention_softcap and final_softcap ignored". Where none does
within the sets tried, the nearest is reported, and the failure stays unexplained. The backend
runs once; each set costs one golden run of the case (a time budget bounds the search at a real
checkpoint's size, and the report says how many sets it tried).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from conformance.adapter import Partial
from conformance.backends.numpy_backend import golden_output
from conformance.cells import golden_runner_for
from conformance.tolerance import compare
from spec import ConfigError, ModelConfig, param_shapes
from spec.omissions import Omission, applicable_omissions


EXPLAINED = ("forward", "decode")  # the whole-model cases of logits, in the order a column's failure is explained


@dataclass(frozen=True)
class Trial:
    omissions: tuple[str, ...]  # the omissions' names; () is the spec itself
    ratio: float  # max|error| / tolerance of the column against the golden computed so


@dataclass(frozen=True)
class Explanation:
    case: str  # the case whose logits were explained, e.g. "forward-pad_right"
    trials: tuple[Trial, ...]  # in the order tried, the spec itself first
    sets: int  # how many sets of omissions there were, up to the largest size searched

    @property
    def explained_by(self) -> tuple[Trial, ...]:
        """The passing sets of the smallest size that has one; () when none passes."""
        passing = [trial for trial in self.trials[1:] if trial.ratio <= 1.0]
        smallest = min((len(trial.omissions) for trial in passing), default=0)
        return tuple(trial for trial in passing if len(trial.omissions) == smallest)

    @property
    def nearest(self) -> Trial:
        return min(self.trials[1:] or self.trials, key=lambda trial: trial.ratio)

    def verdict(self) -> str:
        if self.trials[0].ratio <= 1.0:
            return f"{self.case} passes: nothing to explain"
        if found := self.explained_by:
            return " or ".join("the golden's with " + ", ".join(trial.omissions) for trial in found)
        near = self.nearest
        return (f"unexplained by the {len(self.trials) - 1} sets of omissions tried (of {self.sets}); nearest: "
                + (", ".join(near.omissions) or "the spec itself") + f" at {_ratio_text(near.ratio)}× the tolerance")

    def table(self) -> str:
        lines = [f"{'error/tolerance':>15}  omitted (on {self.case})"]
        ranked = sorted(self.trials, key=lambda trial: (trial.ratio, len(trial.omissions)))
        shown = [self.trials[0], *[trial for trial in ranked if trial is not self.trials[0]][:7]]
        explaining = self.explained_by
        for trial in shown:
            flag = "  <- explains it" if trial in explaining else ""
            lines.append(f"{_ratio_text(trial.ratio):>15}  {', '.join(trial.omissions) or '(the spec itself)'}{flag}")
        if len(self.trials) > len(shown):
            lines.append(f"{'':>15}  ... {len(self.trials) - len(shown)} more sets tried")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"case": self.case, "verdict": self.verdict(), "sets": self.sets,
                "explained_by": [list(trial.omissions) for trial in self.explained_by],
                "trials": [{"omissions": list(trial.omissions), "ratio": _json_number(trial.ratio)}
                           for trial in self.trials]}


def _ratio_text(ratio: float) -> str:
    return "inf" if math.isinf(ratio) else f"{ratio:.3g}"


def _json_number(value: float):
    return value if math.isfinite(value) else str(value)


def omission_sets(cfg: ModelConfig, largest: int = 4) -> list[tuple[Omission, ...]]:
    """Every set of applicable omissions with at most one per group, smallest first."""
    found = applicable_omissions(cfg)
    sets = []
    for size in range(1, min(largest, len(found)) + 1):
        for chosen in itertools.combinations(found, size):
            if len({omission.group for omission in chosen}) == size and _omitted(cfg, chosen) is not None:
                sets.append(chosen)
    return sets


def _omitted(cfg: ModelConfig, chosen: tuple[Omission, ...]) -> ModelConfig | None:
    """The config with the chosen omissions; None where the spec cannot hold them together (a
    longrope's factors are one per rotated pair: its partial rotary cannot be ignored alone)."""
    try:
        for omission in chosen:
            cfg = omission.apply(cfg)
    except ConfigError:
        return None
    return cfg


def read_by(changed: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors a config with omissions reads: its own names (an ignored sink or router bias is left unread)."""
    return {name: params[name] for name in param_shapes(changed)}


def explain(cfg: ModelConfig, params: Mapping[str, np.ndarray], case, dtype: str, output,
            largest: int = 4, seconds: float = 300.0) -> Explanation:
    """Explain a forward or decode case's `output` (the column's logits, or its Partial) by omissions."""
    compared = None
    if isinstance(output, Partial):
        output, compared = output.output, output.compared
    relative = case.tolerance(cfg, dtype)

    def ratio(changed: ModelConfig) -> float:
        kept = read_by(changed, params)
        reference = golden_output(changed, kept, case.sublayer, case.inputs, golden_runner_for(changed, kept))
        found = compare(output, reference, relative, case.floor, compared)
        return found.ratio

    trials = [Trial((), ratio(cfg))]
    sets = omission_sets(cfg, largest)
    if trials[0].ratio <= 1.0:
        return Explanation(case.name, tuple(trials), len(sets))
    deadline, smallest_passing = time.perf_counter() + seconds, None
    ratios = {(): trials[0].ratio}  # by the omissions' names, sorted
    for chosen in _best_first(sets, ratios):
        if smallest_passing is not None and len(chosen) > smallest_passing or time.perf_counter() > deadline:
            break
        names = tuple(omission.name for omission in chosen)
        trials.append(Trial(names, ratio(_omitted(cfg, chosen))))
        ratios[tuple(sorted(names))] = trials[-1].ratio
        if trials[-1].ratio <= 1.0 and smallest_passing is None:
            smallest_passing = len(chosen)
    return Explanation(case.name, tuple(trials), len(sets))


def _best_first(sets: list[tuple[Omission, ...]], ratios: dict) -> Iterator[tuple[Omission, ...]]:
    """The sets size by size; within a size, those whose best subset one smaller came nearest
    first, so that a budget cut at a real checkpoint's size leaves out the least promising."""
    for size in sorted({len(chosen) for chosen in sets}):
        def promise(chosen: tuple[Omission, ...]) -> float:
            names = [omission.name for omission in chosen]
            return min(ratios.get(tuple(sorted(subset)), math.inf) for subset in itertools.combinations(names, size - 1))

        yield from sorted((chosen for chosen in sets if len(chosen) == size), key=promise)


def explain_column(cfg: ModelConfig, params: Mapping[str, np.ndarray], backend_name: str, dtype: str, device: str,
                   case_name: str = "forward-pad_right") -> Explanation:
    """Explain one whole-model column on the catalogue's case `case_name` (a forward or decode case)."""
    from conformance.adapter import get_backend
    from conformance.cases import build_case

    backend, reason = get_backend(backend_name)
    if backend is None:
        raise RuntimeError(f"backend {backend_name} is unavailable: {reason}")
    sublayer, mask_case = case_name.split("-", 1)
    case = build_case(cfg, params, sublayer, mask_case)
    return explain(cfg, params, case, dtype, backend.load(cfg, params, dtype, device).run(sublayer, case.inputs))


def explain_failures(cfg: ModelConfig, params: Mapping[str, np.ndarray], results: list) -> dict[str, Explanation]:
    """{'<backend>/<dtype>/<device> (<case>)': explanation} of each whole-model-only column
    (localize.runs_layers is False) whose logits failed: its first failing forward case, else its
    first failing decode case (a cache's mistake shows there only). What `rosetta check` prints
    after the localizations and its report keeps."""
    from conformance.harness import FAIL
    from conformance.diagnosis.localize import runs_layers

    failing: dict[tuple[str, str, str], dict[str, str]] = {}
    for r in results:
        if r.sublayer in EXPLAINED and r.status == FAIL:
            failing.setdefault((r.backend, r.dtype, r.device), {}).setdefault(r.sublayer, f"{r.sublayer}-{r.mask_case}")
    explanations = {}
    for (backend, dtype, device), cases in failing.items():
        if not runs_layers(backend):
            case_name = next(cases[sublayer] for sublayer in EXPLAINED if sublayer in cases)
            explanations[f"{backend}/{dtype}/{device} ({case_name})"] = explain_column(cfg, params, backend, dtype,
                                                                                      device, case_name)
    return explanations
