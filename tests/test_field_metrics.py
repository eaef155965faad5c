"""The field's metrics beside our verdict (issue 38, conformance.diagnosis.field_metrics): per-token KL,
top-1 agreement, top-5 containment, and whether a cell would pass MaxText's KL ≤ 1e-4 or vLLM's
top-5 criterion. A planted mistake that the field's criteria let by and ours does not shows why
the verdict stays the tolerance policy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import impl_torch.model as torch_model
from conformance.cases import build_case
from conformance.diagnosis.field_metrics import KL_LIMIT, field_metrics, generation_metrics, logit_metrics
from conformance.harness import FAIL, PASS, plan_matrix, run_matrix
from conformance.output.report import field_metrics_table
from conformance.tolerance import tolerance
from spec import conformance_params, get_preset
from tests.bounds import assert_agrees

LOGITS = arrays(np.float64, (2, 3, 11), elements=st.floats(-20, 20))


# multiples of 1/16: a shift adds exactly, so no gap between two logits rounds away (a gap of 2e-16
# does at a shift of 2, and turns a lead into a tie: hypothesis found it)
GRID = st.integers(-320, 320).map(lambda sixteenths: sixteenths / 16)


@given(arrays(np.float64, (2, 3, 11), elements=GRID), arrays(np.float64, (2, 3, 1), elements=GRID))
@settings(max_examples=50, deadline=None)
def test_a_shift_of_every_logit_changes_no_distribution(logits, shift):
    metrics = logit_metrics(logits, logits + shift)
    # exact: both log-softmaxes subtract their row's max first, which leaves the same numbers
    assert metrics["kl_max"] == 0.0 and metrics["top1"] == 1.0 and metrics["top5"] == 1.0
    assert metrics["maxtext"] and metrics["vllm"] and metrics["positions"] == 6


# How far a computed KL may be off: each of its two log-softmaxes within SPEC §8's float64 tolerance
# (the log_probs sublayer's: n = V = 11, depth 2) of the log-probabilities' size, which for logits in
# [−20, 20] is at most 40 + ln 11; their difference, weighted by p (Σ p = 1), twice that.
KL_ROUNDING = 2 * tolerance("float64", 11, 2) * (40 + np.log(11))


@given(LOGITS, LOGITS)
@settings(max_examples=50, deadline=None)
def test_kl_is_never_negative_and_is_zero_only_for_the_same_distribution(golden, actual):
    metrics = logit_metrics(golden, actual)
    assert metrics["kl_max"] >= -KL_ROUNDING
    # a mean of the 6 positions' KL: its sum's rounding (n = 6) on the largest
    assert metrics["kl_mean"] <= metrics["kl_max"] + tolerance("float64", 6, 1) * max(1.0, abs(metrics["kl_max"]))


def test_kl_is_the_sum_over_the_vocabulary():
    golden = np.log(np.array([[0.5, 0.25, 0.25]]))
    actual = np.log(np.array([[0.25, 0.5, 0.25]]))
    expected = 0.5 * np.log(2) + 0.25 * np.log(0.5)  # Σ p (log p − log q)
    # a log-softmax (n = V = 3, depth 2) on log-probabilities up to ln 4 in size
    assert_agrees(logit_metrics(golden, actual)["kl_max"], expected, n=3, depth=2, floor=np.log(4))


def test_a_swapped_argmax_fails_top1_and_top5_only_when_it_leaves_the_top5():
    golden = np.arange(12, dtype=np.float64)[None, :]  # token 11 is best, 7..11 the top five
    near = golden.copy()
    near[0, [11, 10]] = near[0, [10, 11]]  # the best two swapped: still within each other's top five
    far = golden.copy()
    far[0, [11, 0]] = far[0, [0, 11]]  # the worst token made the best
    assert logit_metrics(golden, near)["top1"] == 0.0 and logit_metrics(golden, near)["vllm"]
    assert not logit_metrics(golden, far)["vllm"] and logit_metrics(golden, far)["top5"] == 0.0
    assert not logit_metrics(golden, far)["maxtext"]
    assert logit_metrics(golden, far, dtype="bfloat16")["maxtext"] is None  # MaxText's limit is for float32


def test_partial_rows_keep_only_the_rows_computed():
    golden = np.zeros((2, 3, 5))
    actual = golden.copy()
    actual[1, :, 0] = 30.0  # row 1 wrong, and not computed
    metrics = logit_metrics(golden, actual, rows=np.array([True, False]))
    assert metrics["positions"] == 3 and metrics["kl_max"] == 0.0



def test_the_rows_kept_are_read_a_chunk_of_positions_at_a_time_in_their_order():
    """More positions than a chunk (CHUNK), one row left out: the figures are those of the kept rows
    taken whole, the left-out row's wrong logits never read (they would make KL infinite)."""
    generator = np.random.default_rng(3)
    golden = generator.normal(size=(3, 50, 7))
    actual = golden + generator.normal(scale=0.05, size=golden.shape)
    actual[1] = np.inf
    kept_whole = logit_metrics(golden[[0, 2]], actual[[0, 2]].astype(np.float32))
    metrics = logit_metrics(golden, actual.astype(np.float32), rows=np.array([True, False, True]))
    assert metrics["positions"] == 100 and metrics == kept_whole
    assert 0 < metrics["kl_max"] < 1e-2

def test_generation_parts_where_a_row_first_differs():
    golden_tokens = np.array([[5, 6, 7, 8], [1, 2, 3, 4]])
    step_logits = np.zeros((2, 4, 12))
    step_logits[0, 2] = np.arange(12)  # at row 0 step 2 the golden ranks 11, 10, 9, 8, 7 first
    inside = np.array([[5, 6, 9, 3], [1, 2, 3, 4]])
    outside = np.array([[5, 6, 0, 3], [1, 2, 3, 4]])
    assert generation_metrics(golden_tokens, golden_tokens, step_logits) == {
        "diverged_at": None, "agreed_steps": 1.0, "top5_at_divergence": None, "vllm": True}
    found = generation_metrics(inside, golden_tokens, step_logits)
    assert found["diverged_at"] == [0, 2] and found["agreed_steps"] == 6 / 8 and found["vllm"]
    assert not generation_metrics(outside, golden_tokens, step_logits)["vllm"]


def test_only_whole_model_cells_have_them():
    assert field_metrics("mha", np.zeros((1, 2, 3)), np.zeros((1, 2, 3)), None, "float32") is None
    assert field_metrics("forward", np.zeros((1, 2)), np.zeros((1, 2, 3)), None, "float32") is None  # wrong shape


CFG = get_preset("llama-tiny")
PARAMS = conformance_params(CFG)


def test_every_whole_model_cell_reports_them():
    results = run_matrix(CFG, PARAMS, plan_matrix(CFG, ["torch"], ["float32"], ["cpu"]), pattern="forward-none")
    results += run_matrix(CFG, PARAMS, plan_matrix(CFG, ["torch"], ["float32"], ["cpu"]), pattern="generate-none")
    assert all(r.status == PASS and r.field for r in results)
    forward, generate = results
    # Hoeffding's lemma: logits off by δ ∈ [−e, e] (e the cell's max error) put KL(p ‖ q) = log E_p e^δ − E_p δ
    # at most (2e)² / 8; the float64 KL adds its own rounding, two log-softmaxes (n = V, depth 2) on
    # shifted logits up to twice the logits' size (the cell's absolute tolerance over its relative one)
    logit_size = forward.tol / build_case(CFG, PARAMS, "forward", "none").tolerance(CFG, "float32")
    kl_rounding = 2 * tolerance("float64", CFG.tgt_vocab_size, 2) * 2 * logit_size
    assert forward.field["kl_max"] <= forward.max_abs_err ** 2 / 2 + kl_rounding
    assert forward.field["maxtext"] and forward.field["top1"] == 1.0
    assert generate.field["diverged_at"] is None and generate.field["vllm"]
    table = field_metrics_table(results)
    assert "forward-none-float32-torch-cpu" in table and "no step parts" in table
    assert "field" in forward.to_dict() and "field" not in results[0].__class__("t", "cpu", "float32", "mha", "none",
                                                                               PASS).to_dict()


def test_a_mistake_the_fields_criteria_let_by_and_ours_does_not(monkeypatch):
    """RMSNorm's ε written in ten times too large, as a port that reads the wrong config field:
    every token's KL stays under MaxText's 1e-4 and every argmax agrees, while the tolerance policy
    fails the whole model."""
    norm = torch_model.rms_norm
    monkeypatch.setattr(torch_model, "rms_norm", lambda x, scale, bias, eps, *rest: norm(x, scale, bias, 10 * eps, *rest))
    cfg = get_preset("qwen3-tiny")
    results = run_matrix(cfg, conformance_params(cfg), plan_matrix(cfg, ["torch"], ["float32"], ["cpu"]),
                         pattern="forward-none")
    (cell,) = results
    assert cell.status == FAIL
    assert cell.field["kl_max"] <= KL_LIMIT and cell.field["maxtext"] and cell.field["vllm"]
