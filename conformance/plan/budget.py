"""A plan that fits a time budget (`rosetta check --budget 10m`): the cells chosen by value, in
this order, while the estimate (conformance.plan.cost) stays within the budget:

1. the whole model (forward, cached decoding, generation) at the checkpoint's own dtype and
   float32: what a port is for, and where every sublayer's mistake shows;
2. every other sublayer at those dtypes, on the first, a middle and the last layer (a layer-level
   sublayer's mask cases take the stack's layers in turn: the cases on those three);
3. the whole model at the other dtypes; 4. the sublayers of 2. at the other dtypes;
5. the rest: the other layers' cases, at the checkpoint's dtype and float32 first.

Gradient and training cells (--backward) follow their forward's cells in each step. A failing
whole-model column is localized over every layer after the run, whatever the budget
(conformance.diagnosis.localize). A model larger than the conformance presets gets DEFAULT_BUDGET unless
the caller asks for everything (`--full`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from conformance.cases import applicable_cases, forward_of, is_backward, layer_of
from conformance.plan.cost import Column, Estimate, case_work, cell_seconds, golden_seconds, load_seconds
from spec import ModelConfig
from spec.params import count_params

DEFAULT_BUDGET = 600.0  # seconds: the size-aware default of a model larger than the presets
SIZE_AWARE_ABOVE = 1_000_000  # parameters: above every conformance preset (char-lm has 858,880)
WHOLE_MODEL = ("forward", "decode", "generate")
LAYERED = ("mha", "mha_cross", "linear_attn", "encoder_layer", "decoder_layer")
TIERS = ("the whole model at {dtypes}", "every sublayer on the first, a middle and the last layer at {dtypes}",
         "the whole model at the other dtypes", "every sublayer on the first, a middle and the last layer at the "
         "other dtypes", "the other mask cases and layers")

Cell = tuple[str, str, Column]  # (sublayer, mask case, column)


class BudgetTooSmall(ValueError):
    """A budget that cannot hold even one whole-model cell; the message says what it would take."""


def parse_budget(text: str) -> float:
    """Seconds from '90s', '10m', '1.5h' or a bare number of seconds; a clear error otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--budget {text!r}: give a positive time such as 90s, 10m or 1.5h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def format_seconds(seconds: float) -> str:
    """'45 s', '12 min 30 s', '1 h 05 min'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def larger_than_presets(cfg: ModelConfig) -> bool:
    """Whether the default check of this model is budgeted (a model larger than the presets)."""
    return count_params(cfg) > SIZE_AWARE_ABOVE


def representative_cases(cfg: ModelConfig, sublayer: str) -> tuple[str, ...]:
    """The mask cases of a sublayer that a budgeted plan runs first: for a layer-level sublayer the
    first case on the stack's first layer, on its middle one and on its last; for the others the
    first case, and every norm case (each its own norm module: where ε's place shows)."""
    cases = applicable_cases(cfg, sublayer)
    forward = forward_of(sublayer)
    if forward == "norm":
        return cases
    if forward not in LAYERED:
        return cases[:1]
    layers = {case: layer_of(cfg, forward, case) for case in cases}
    deepest = max(layers.values(), default=0)
    wanted = dict.fromkeys((0, deepest // 2, deepest))
    return tuple(dict.fromkeys(next(case for case, layer in layers.items() if layer >= target) for target in wanted))


def value_tier(cfg: ModelConfig, sublayer: str, mask_case: str, dtype: str, checkpoint_dtype: str) -> tuple[int, bool]:
    """(step of the module docstring's order, 0-based; a backward cell), the order cells are chosen in."""
    primary = dtype in (checkpoint_dtype, "float32")
    forward = forward_of(sublayer)
    if forward in WHOLE_MODEL:
        step = 0 if primary else 2
    elif mask_case in representative_cases(cfg, forward):
        step = 1 if primary else 3
    else:
        step = 4
    return step, is_backward(sublayer)


@dataclass
class BudgetPlan:
    """The cells a budget holds, and what it leaves out."""

    budget: float
    chosen: list[Cell]
    left_out: list[Cell]
    estimate: Estimate
    full_estimate: Estimate
    checkpoint_dtype: str
    tiers: Counter = field(default_factory=Counter)  # chosen cells per step
    tiers_left_out: Counter = field(default_factory=Counter)

    def describe(self) -> str:
        """The plan as printed before the run: the budget, what runs and what does not, the estimates."""
        dtypes = " and ".join(dict.fromkeys((self.checkpoint_dtype, "float32")))
        lines = [f"plan: budget {format_seconds(self.budget)}, {len(self.chosen)} of "
                 f"{len(self.chosen) + len(self.left_out)} cells, estimated {format_seconds(self.estimate.seconds)} "
                 f"(everything: {format_seconds(self.full_estimate.seconds)}; --full runs it)"]
        for step, title in enumerate(TIERS):
            ran, left = self.tiers[step], self.tiers_left_out[step]
            if ran or left:
                state = "all" if not left else "none" if not ran else f"{ran} of {ran + left}"
                lines.append(f"  {step + 1}. {title.format(dtypes=dtypes)}: {state}"
                             + (f" ({ran + left} cells)" if state in ("all", "none") else " cells"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"budget_s": self.budget, "estimated_s": round(self.estimate.seconds, 1),
                "everything_estimated_s": round(self.full_estimate.seconds, 1),
                "checkpoint_dtype": self.checkpoint_dtype, "cells_chosen": len(self.chosen),
                "cells_left_out": len(self.left_out),
                "steps": [{"step": title, "chosen": self.tiers[step], "left_out": self.tiers_left_out[step]}
                          for step, title in enumerate(TIERS)]}


class _Running:
    """An estimate that grows by one cell, counting each column's load and each case's golden once."""

    def __init__(self, cfg: ModelConfig, workers: int, text_lengths: Sequence[int], cold: Container[Column] = ()):
        self.cfg, self.text_lengths, self.cold = cfg, text_lengths, cold
        self.total = Estimate(workers=max(1, workers))
        self.columns: set[Column] = set()
        self.cases: set[tuple[str, str]] = set()

    def cost(self, cell: Cell) -> Estimate:
        """The estimate with `cell` added (not kept)."""
        sublayer, mask_case, column = cell
        work = case_work(self.cfg, sublayer, mask_case, self.text_lengths)
        return Estimate(self.total.loads + (column not in self.columns) * load_seconds(self.cfg, column,
                                                                                      column in self.cold),
                        self.total.cells + cell_seconds(self.cfg, work, column),
                        self.total.golden + ((sublayer, mask_case) not in self.cases) * golden_seconds(self.cfg, work),
                        self.total.workers)

    def add(self, cell: Cell, grown: Estimate) -> None:
        self.total = grown
        self.columns.add(cell[2])
        self.cases.add(cell[:2])


def fit_budget(cfg: ModelConfig, cells: Sequence[Cell], budget: float, checkpoint_dtype: str = "float32",
               workers: int = 1, text_lengths: Sequence[int] = (), cold: Container[Column] = ()) -> BudgetPlan:
    """Choose among `cells` by value (the module docstring's order; the catalogue's order within a
    step) while the estimate on `workers` processes stays within `budget` seconds (the columns in
    `cold` export first). A cell that does not fit is left out and the next is tried.
    BudgetTooSmall where not one whole-model cell fits."""
    values = [value_tier(cfg, sublayer, mask_case, column[1], checkpoint_dtype) for sublayer, mask_case, column in cells]
    order = sorted(range(len(cells)), key=lambda i: (values[i], i))
    running, everything = _Running(cfg, workers, text_lengths, cold), _Running(cfg, workers, text_lengths, cold)
    chosen, left_out, tiers, tiers_left_out = [], [], Counter(), Counter()
    cheapest_whole = None
    for index in order:
        cell = cells[index]
        step = values[index][0]
        everything.add(cell, everything.cost(cell))
        grown = running.cost(cell)
        if grown.seconds <= budget:
            running.add(cell, grown)
            chosen.append(cell)
            tiers[step] += 1
        else:
            left_out.append(cell)
            tiers_left_out[step] += 1
        if cell[0] in WHOLE_MODEL:
            alone = _Running(cfg, 1, text_lengths, cold).cost(cell).seconds
            cheapest_whole = alone if cheapest_whole is None else min(cheapest_whole, alone)
    if cheapest_whole is not None and not any(cell[0] in WHOLE_MODEL for cell in chosen):
        raise BudgetTooSmall(f"a budget of {format_seconds(budget)} holds no whole-model cell of this model here: "
                             f"the cheapest is estimated at {format_seconds(cheapest_whole)}")
    if not chosen and cells:
        raise BudgetTooSmall(f"a budget of {format_seconds(budget)} holds no cell of this plan")
    keep = set(chosen)
    return BudgetPlan(budget, [cell for cell in cells if cell in keep], [cell for cell in cells if cell not in keep],
                      running.total, everything.total, checkpoint_dtype, tiers, tiers_left_out)
