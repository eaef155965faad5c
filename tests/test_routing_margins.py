"""The routing margins a check reports for a mixture of experts (SPEC §5.14,
conformance.diagnosis.routing.routing_margins): each routed case's decisions, its smallest margin and
where, and per dtype how many decisions sit within rounding of a tie, in report.json and
report.md."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.cases import build_case
from conformance.check import check_model
from conformance.diagnosis.routing import format_routing_margins, golden_routing, routing_margins
from spec import conformance_params, get_preset, save_weights


def _results(sublayer, mask_case, dtypes):
    from conformance.cells import PASS, CellResult
    return [CellResult("torch", "cpu", dtype, sublayer, mask_case, PASS) for dtype in dtypes]


def test_the_smallest_margin_and_the_near_ties_are_the_goldens_own(monkeypatch):
    """Counted here from the golden's probabilities directly (not through golden_routing)."""
    import impl_numpy as golden
    from impl_numpy.model import routing_margins as margins_of

    cfg = get_preset("qwen3-moe-tiny")
    params = conformance_params(cfg)
    [row] = routing_margins(cfg, params, _results("forward", "long", ["float32", "bfloat16"]))
    case = build_case(cfg, params, "forward", "long")
    recorded, original = [], golden.model.router_probabilities
    monkeypatch.setattr(golden.model, "router_probabilities",
                        lambda x, router, bias=None: recorded.append(original(x, router, bias)) or recorded[-1])
    golden.model_logits(cfg, {k: v.astype(np.float64) for k, v in params.items()}, None, case.inputs["tgt_ids"])
    monkeypatch.undo()
    margins = [margins_of(p, cfg.moe.experts_per_token) for p in recorded]
    assert row["case"] == "forward-long"
    assert row["decisions"] == sum(m.size for m in margins) == cfg.n_decoder_layers * case.inputs["tgt_ids"].size
    assert row["smallest_margin"] == min(float(m.min()) for m in margins)
    layers = golden_routing(cfg, params, case)
    assert row["near_ties"]["bfloat16"] == sum(int(layer.near_ties(cfg, "bfloat16").sum()) for layer in layers) > 0
    assert row["near_ties"]["bfloat16"] > row["near_ties"]["float32"]


def test_a_router_that_can_hardly_choose_puts_every_decision_near_a_tie():
    """Every router column the same up to 1e-7 of itself: each margin inside float32's rounding
    (and so far inside float16's), none inside float64's."""
    cfg = get_preset("mixtral-tiny")
    params = dict(conformance_params(cfg))
    rng = np.random.default_rng(0)
    for name in [name for name in params if name.endswith("router.weight")]:
        column = params[name][:, :1]
        params[name] = (column + 1e-7 * rng.standard_normal(params[name].shape) * np.abs(column)).astype(np.float32)
    rows = routing_margins(cfg, params, _results("decode", "incremental", ["float64", "float32", "float16"]))
    [row] = rows
    # every decision, the smallest margin's among them, within LayerRouting.bound at float32
    assert row["near_ties"] == {"float16": row["decisions"], "float32": row["decisions"], "float64": 0}
    assert "decode-incremental" in format_routing_margins(rows)


def test_no_experts_no_rows():
    cfg = get_preset("llama-tiny")
    assert routing_margins(cfg, conformance_params(cfg), _results("forward", "long", ["float32"])) == []


@pytest.mark.parametrize("preset", ["mixtral-tiny"])
def test_the_report_states_the_routing_margins(tmp_path, preset):
    cfg = get_preset(preset)
    weights = tmp_path / "weights.safetensors"
    save_weights(weights, cfg, conformance_params(cfg))
    run = check_model(weights=weights, backends=["torch"], dtypes=["float32"], pattern="forward-pad_right*", jobs=1)
    run.write_report(tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    [row] = report["routing_margins"]
    assert row["case"] == "forward-pad_right" and set(row["near_ties"]) == {"float32"}
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Routing margins" in markdown and "forward-pad_right" in markdown.split("## Routing margins")[1]


# ---- the case meant to sit at a tie (ffn-near_tie) ----------------------------------------------

@pytest.mark.parametrize("preset", ["mixtral-tiny", "qwen3-moe-tiny"])
def test_the_near_tie_case_puts_every_token_at_a_tie_and_says_so(preset):
    """Every token's k-th and (k+1)-th experts tie up to float32's rounding of its input: inside
    float32's rounding bound, clear of float64's; the report marks the row."""
    cfg = get_preset(preset)
    params = conformance_params(cfg)
    [layer] = golden_routing(cfg, params, build_case(cfg, params, "ffn", "near_tie"))
    [plain] = golden_routing(cfg, params, build_case(cfg, params, "ffn", "none"))
    assert layer.near_ties(cfg, "float32").all() and not layer.near_ties(cfg, "float64").any()
    assert not plain.near_ties(cfg, "float32").any()  # the same draw, before it is moved onto the ties
    rows = routing_margins(cfg, params, _results("ffn", "near_tie", ["float32"]) + _results("ffn", "none", ["float32"]))
    [row] = rows  # ffn-none is no routed case: only the one meant to sit at a tie is added
    assert row["case"] == "ffn-near_tie" and row["at_a_tie_by_construction"]
    assert row["near_ties"] == {"float32": row["decisions"]} and row["smallest_margin"] == float(layer.margins.min())
    assert "ffn-near_tie (at a tie by construction)" in format_routing_margins(rows)



def test_the_goldens_routing_is_the_same_streamed_layer_by_layer(monkeypatch):
    """golden_routing casts the weights to float64 as the check's golden does: whole where they fit,
    else layer by layer (conformance.plan.memory.golden_budget; a real-size Mixtral's check, casting its
    5.6 GB whole for each routing it replayed, was killed for memory). Streamed, the routing is the
    same to the bit."""
    import conformance.diagnosis.routing as routing

    cfg = get_preset("mixtral-tiny")
    params = conformance_params(cfg)
    case = build_case(cfg, params, "forward", "pad_right")
    whole = golden_routing(cfg, params, case)
    monkeypatch.setattr(routing, "golden_budget", lambda cfg, params: 1)  # one layer's weights at a time
    streamed = golden_routing(cfg, params, case)
    for a, b in zip(whole, streamed, strict=True):
        assert all(np.array_equal(getattr(a, field), getattr(b, field))
                   for field in ("chosen", "weights", "margins", "logits", "absolute"))
