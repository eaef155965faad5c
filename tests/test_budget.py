"""A plan that fits a budget (issue 38, conformance.plan.budget): cells chosen by value while the
estimate (conformance.plan.cost) fits, the whole model first, the sublayers on the first, a middle and
the last layer next; left-out cells reported, never a column that "ran nothing"; a budget too
small for one whole-model cell refused with the estimate it would need."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conformance.plan import cost
from conformance.plan.budget import (DEFAULT_BUDGET, WHOLE_MODEL, BudgetTooSmall, fit_budget, larger_than_presets,
                                parse_budget, representative_cases, value_tier)
from conformance.cases import applicable_cases, case_names, layer_of
from conformance.cells import FAIL, PASS, PLANNED_OUT, SKIP
from conformance.check import check_model
from conformance.harness import plan_matrix, runnable_cells
from conformance.output.report import empty_columns
from conformance.tolerance import UNIT_ROUNDOFF
from rosetta.main import main
from spec import conformance_params, get_preset, save_weights
from spec.params import count_params

LLAMA = get_preset("llama-tiny")
DEEP = dataclasses.replace(LLAMA, n_decoder_layers=30)  # a real checkpoint's depth (SmolLM2-135M's)


@pytest.fixture(autouse=True)
def steady_speed(monkeypatch):
    """The estimates on fixed speeds: the tests do not depend on how busy this machine is."""
    monkeypatch.setattr(cost, "matmul_speed", lambda dtype: 1e9 if dtype == "float64" else 4e9)


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("90", 90), ("10m", 600), ("1.5h", 5400), (" 2m ", 120)])
def test_budgets_read_as_seconds(text, seconds):
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "ten minutes", "10 min", "-5m", "0", "5d"])
def test_a_budget_that_is_not_a_time_is_refused(text):
    with pytest.raises(ValueError, match="--budget"):
        parse_budget(text)


def test_a_deep_stacks_layer_cases_spread_from_its_first_layer_to_its_last():
    for sublayer in ("mha", "decoder_layer"):
        layers = [layer_of(DEEP, sublayer, case) for case in applicable_cases(DEEP, sublayer)]
        assert layers[0] == 0 and layers[-1] == 29 and layers == sorted(set(layers))


def test_a_shallow_stacks_layer_cases_take_its_layers_in_turn():
    """The presets' cases are as before: the stack's layers in turn."""
    cases = applicable_cases(LLAMA, "mha")
    assert [layer_of(LLAMA, "mha", case) for case in cases] == [i % 2 for i in range(len(cases))]


def test_the_representative_cases_run_the_first_a_middle_and_the_last_layer():
    for sublayer in ("mha", "decoder_layer"):
        layers = [layer_of(DEEP, sublayer, case) for case in representative_cases(DEEP, sublayer)]
        assert layers[0] == 0 and layers[-1] == 29 and 10 <= layers[1] <= 19 and len(layers) == 3
    # every norm case is its own norm module (where epsilon's place shows), the others their first case
    assert representative_cases(DEEP, "norm") == applicable_cases(DEEP, "norm")
    assert representative_cases(DEEP, "logits") == applicable_cases(DEEP, "logits")[:1]


def _cells(cfg, backends=("torch", "numpy-float32"), dtypes=("float32", "float16", "bfloat16")):
    return runnable_cells(plan_matrix(cfg, list(backends), list(dtypes), ["cpu"]), case_names(cfg))


def _order_rounding(seconds, cells):
    """How far an estimate of `cells` may round apart from the same one summed in another order:
    its terms (each cell, its column's load, its case's golden: 3 a cell at most) each add a
    float64 rounding of the total, either way."""
    return 2 * 3 * len(cells) * UNIT_ROUNDOFF["float64"] * seconds


def test_an_ample_budget_chooses_every_cell():
    cells = _cells(DEEP)
    plan = fit_budget(DEEP, cells, 1e9)
    assert plan.chosen == cells and not plan.left_out
    assert abs(plan.estimate.seconds - plan.full_estimate.seconds) <= _order_rounding(plan.full_estimate.seconds, cells)


def test_the_whole_model_at_float32_is_chosen_first():
    cells = _cells(DEEP)
    whole = [cell for cell in cells if cell[0] in WHOLE_MODEL and cell[2][1] == "float32"]
    needs = fit_budget(DEEP, whole, 1e9).estimate.seconds
    budget = needs + _order_rounding(needs, whole)  # the whole model's cells and no more
    plan = fit_budget(DEEP, cells, budget)
    assert plan.chosen == whole and plan.estimate.seconds <= budget < plan.full_estimate.seconds
    assert "1. the whole model at float32: all" in plan.describe()
    assert "2. every sublayer on the first, a middle and the last layer at float32: none" in plan.describe()
    # with more time, the sublayers at float32 come before anything at the other dtypes
    sublayers = [cell for cell in cells if cell[0] not in WHOLE_MODEL and cell[2][1] == "float32"
                 and cell[1] in representative_cases(DEEP, cell[0])]
    needs = fit_budget(DEEP, whole + sublayers, 1e9).estimate.seconds
    plan = fit_budget(DEEP, cells, needs + _order_rounding(needs, whole + sublayers))
    assert sorted(plan.chosen) == sorted(whole + sublayers)


def test_the_checkpoints_own_dtype_comes_with_float32():
    cells = _cells(DEEP)
    tier = {dtype: value_tier(DEEP, "forward", "none", dtype, "bfloat16")[0] for dtype in ("float32", "bfloat16",
                                                                                           "float16")}
    assert tier == {"float32": 0, "bfloat16": 0, "float16": 2}
    whole = [cell for cell in cells if cell[0] in WHOLE_MODEL and cell[2][1] in ("float32", "bfloat16")]
    needs = fit_budget(DEEP, whole, 1e9, "bfloat16").estimate.seconds
    plan = fit_budget(DEEP, cells, needs + _order_rounding(needs, whole), "bfloat16")
    assert set(whole) <= set(plan.chosen)
    assert not [cell for cell in plan.chosen if cell[2][1] == "float16" and cell[0] in WHOLE_MODEL]


def test_the_estimate_counts_each_columns_load_and_each_cases_golden_once():
    cells = _cells(DEEP, backends=("torch",), dtypes=("float32",))
    one = cost.estimate(DEEP, cells[:1])
    two = cost.estimate(DEEP, cells[:1] * 2)
    assert two.loads == one.loads and two.golden == one.golden and two.cells == 2 * one.cells
    start = cost.START_SECONDS
    assert cost.estimate(DEEP, cells, workers=2).seconds - start == pytest.approx(
        (cost.estimate(DEEP, cells).seconds - start) / 2)


def test_the_long_cases_cost_more_than_the_short():
    none, long_, far = (cost.case_work(DEEP, sublayer, case).flops
                        for sublayer, case in (("forward", "none"), ("forward", "long"), ("decode", "far")))
    # every projection runs once a position and attention once a pair of them: at least in proportion
    longer = cost.positions(DEEP, "forward", "long") / cost.positions(DEEP, "forward", "none")
    assert none * longer < long_ < far


def test_a_budget_too_small_for_one_whole_model_cell_is_refused_with_what_it_needs():
    with pytest.raises(BudgetTooSmall, match=r"cheapest is estimated at \d"):
        fit_budget(DEEP, _cells(DEEP), 0.01)


def test_a_budgeted_check_reports_what_it_left_out():
    plan = plan_matrix(LLAMA, ["torch", "numpy-float32"], ["float32"], ["cpu"])
    whole = [cell for cell in runnable_cells(plan, case_names(LLAMA)) if cell[0] in WHOLE_MODEL]
    needs = fit_budget(LLAMA, whole, 1e9).estimate.seconds
    budget = needs + _order_rounding(needs, whole)
    shown = []
    run = check_model(preset="llama-tiny", backends=["torch", "numpy-float32"], dtypes=["float32"], jobs=1,
                      budget=budget, on_plan=shown.append)
    assert shown == [run.plan] and run.plan.chosen
    ran = [r for r in run.results if r.status == PASS]
    left_out = [r for r in run.results if r.status == SKIP and r.skip == PLANNED_OUT]
    assert len(ran) == len(run.plan.chosen) and len(left_out) == len(run.plan.left_out) > 0
    assert all("left out by the plan's budget" in r.reason for r in left_out)
    assert {r.sublayer for r in ran} >= set(WHOLE_MODEL)
    assert run.passed and not empty_columns(run.results)  # left out is not "ran nothing"
    figures = run.plan_figures
    assert figures["cells_chosen"] == len(ran) and figures["took_s"] > 0 and figures["took_over_estimate"] > 0


def _linear_without_bias(self, x):
    return F.linear(x, self.weight)


def test_a_budget_of_the_whole_model_alone_still_finds_a_planted_mistake_and_localizes_it(monkeypatch):
    """qwen2-tiny's q/k/v biases dropped in torch: the whole-model cells a small budget keeps fail,
    and the failing column is localized stage by stage."""
    monkeypatch.setattr(torch.nn.Linear, "forward", _linear_without_bias)
    cfg = get_preset("qwen2-tiny")
    plan = plan_matrix(cfg, ["torch"], ["float32"], ["cpu"])
    whole = [cell for cell in runnable_cells(plan, case_names(cfg)) if cell[0] in WHOLE_MODEL]
    needs = fit_budget(cfg, whole, 1e9).estimate.seconds
    budget = needs + _order_rounding(needs, whole)
    run = check_model(preset="qwen2-tiny", backends=["torch"], dtypes=["float32"], jobs=1, budget=budget)
    ran = [r for r in run.results if r.status in (PASS, FAIL)]
    assert {r.sublayer for r in ran} == set(WHOLE_MODEL)
    assert [r for r in ran if r.sublayer == "forward" and r.status == FAIL]
    assert not run.passed and run.localizations


def test_a_model_larger_than_the_presets_gets_the_default_budget(tmp_path):
    cfg = dataclasses.replace(LLAMA, tgt_vocab_size=20_000)
    assert larger_than_presets(cfg) and not larger_than_presets(LLAMA)
    weights = tmp_path / "wide.safetensors"
    save_weights(weights, cfg, conformance_params(cfg))
    assert count_params(cfg) > 1_000_000
    run = check_model(weights=weights, backends=["numpy-float32"], dtypes=["float32"], jobs=1, pattern="forward-none",
                      size_aware=True)
    assert run.plan is not None and run.plan.budget == DEFAULT_BUDGET and run.passed
    run = check_model(weights=weights, backends=["numpy-float32"], dtypes=["float32"], jobs=1, pattern="forward-none")
    assert run.plan is None  # the library's default, and --full: every cell


@pytest.mark.parametrize("arguments, message", [
    (["--budget", "10m", "--full"], "give one"),
    (["--budget", "soon"], "positive time"),
    (["--budget", "0.001s", "--backends", "torch", "--dtypes", "float32"], "holds no whole-model cell"),
])
def test_rosetta_check_refuses_a_budget_it_cannot_keep(arguments, message, capsys):
    assert main(["check", "--preset", "llama-tiny", "--jobs", "1", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_rosetta_check_prints_the_plan_before_the_run_and_the_estimate_after(capsys):
    assert main(["check", "--preset", "llama-tiny", "--jobs", "1", "--backends", "numpy-float32", "--dtypes",
                 "float32", "--budget", "1h", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.index("plan: budget 1 h 00 min") < out.index("passed")
    assert "x the estimate" in out


def test_a_mixture_of_experts_costs_its_k_experts_and_router_per_token():
    """The estimate counts what an MoE layer runs per token: k experts' gated FFNs and the router's
    scores, not one FFN (a real-size Mixtral's check, planned at 20 minutes on the dense count,
    had run 57 of its 314 cells after 34), and one module call per expert per layer."""
    from dataclasses import replace

    mixtral = get_preset("mixtral-tiny")
    dense = replace(mixtral, moe=None)
    one = 3 * mixtral.d_model * mixtral.d_ff
    assert cost.ffn_weights(dense) == one
    assert cost.ffn_weights(mixtral) == mixtral.moe.experts_per_token * one + mixtral.d_model * mixtral.moe.n_experts
    assert cost.case_work(mixtral, "forward", "none").flops > cost.case_work(dense, "forward", "none").flops
    assert cost.calls_per_layer(mixtral) == cost.calls_per_layer(dense) + mixtral.moe.n_experts
