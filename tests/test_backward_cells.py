"""The gradient cells grad-<sublayer>-<mask case> (SPEC.md §13) through the harness: the framework
columns pass against the golden VJPs, the comparison fails on what it must, and mistakes that
leave the forward intact — a detached residual, a tied head that counts one use, a softmax
whose fully masked rows turn the gradient into NaN — fail the gradient cells alone."""

import math

import numpy as np
import pytest
import torch

import impl_torch.model as torch_model
from conformance.cases import GRADIENT_INPUTS, SUBLAYERS, build_case, case_names, is_gradient
from conformance.harness import FAIL, PASS, SKIP, plan_matrix, run_matrix
from conformance.tolerance import SUBNORMAL_SPACING, compare_gradients, tolerance
from rosetta.main import main
from spec import conformance_params, get_preset
from tests.variants import VARIANTS

TINY = get_preset("tiny")
PARAMS = conformance_params(TINY)
CHAR_LM = VARIANTS["char-lm"]


def _run(cfg, backends, dtypes, pattern="grad-*", params=None):
    params = conformance_params(cfg) if params is None else params
    return run_matrix(cfg, params, plan_matrix(cfg, backends, dtypes, ["cpu"]), pattern=pattern, backward=True)


def _statuses(results):
    return {r.test_id: (r.status, r.reason) for r in results}


def test_every_differentiated_sublayer_has_its_cases():
    names = case_names(TINY, backward=True)
    for sublayer in GRADIENT_INPUTS:
        forward = [case for s, case in names if s == sublayer]
        assert [case for s, case in names if s == f"grad-{sublayer}"] == forward
        assert SUBLAYERS[f"grad-{sublayer}"].depth(TINY) == 2 * SUBLAYERS[sublayer].depth(TINY)


def test_cotangents_are_seeded_and_random():
    first, second = (build_case(TINY, PARAMS, "grad-mha", "causal_pad") for _ in range(2))
    np.testing.assert_array_equal(first.inputs["d_out"], second.inputs["d_out"])
    d_out = first.inputs["d_out"]
    assert d_out.shape == first.inputs["x"].shape and len(np.unique(d_out)) == d_out.size
    # N(0, 1) draws: a sample std of N values is 1 within 1/√(2N), its standard error; five of them
    assert abs(d_out.std() - 1) <= 5 / np.sqrt(2 * d_out.size)


@pytest.mark.parametrize("cfg, dtypes", [(TINY, ["float64", "float32", "bfloat16"]), (CHAR_LM, ["float32"])],
                         ids=["tiny", "char-lm"])
def test_torch_columns_pass_every_gradient_cell(cfg, dtypes):
    results = _run(cfg, ["torch", "torch-math"], dtypes)
    cells = sum(is_gradient(s) for s, _ in case_names(cfg, backward=True))
    assert len(results) == 2 * len(dtypes) * cells
    failures = [f"{r.test_id}: {r.reason}" for r in results if r.status != PASS]
    assert not failures, failures
    # SPEC §8's headroom (a correct implementation stays at or below half the tolerance), which §13
    # holds the gradient cells to as the forward's
    assert max(r.ratio for r in results) < 0.5


@pytest.mark.parametrize("dtype, patterns", [("float32", ("grad-mha-*", "grad-[!m]*-all_pad-*")),
                                             ("float64", ("grad-mha-pad_*", "grad-loss-pad_right"))])
def test_jax_passes_gradient_cells(dtype, patterns):
    """A cross-section (JAX's eager autodiff costs ~0.1 s a cell, more on a first run): at
    float32 MHA at every mask case, and every sublayer with a row of nothing but padding."""
    results = [r for pattern in patterns for r in _run(TINY, ["jax"], [dtype], pattern)]
    assert len(results) > (20 if dtype == "float32" else 3)
    failures = [f"{r.test_id}: {r.reason}" for r in results if r.status != PASS]
    assert not failures, failures


def test_onnx_columns_skip_gradients_with_the_reason():
    results = _run(TINY, ["onnx"], ["float32"], pattern="grad-forward-none")
    assert [r.status for r in results] == [SKIP] and "inference graphs" in results[0].reason


def test_loss_cells_pass_in_the_framework_columns():
    results = run_matrix(CHAR_LM, conformance_params(CHAR_LM), plan_matrix(CHAR_LM, ["torch", "jax"], ["float32"]),
                         pattern="loss-*")
    assert len(results) == 2 * len([c for s, c in case_names(CHAR_LM) if s == "loss"])
    assert all(r.status == PASS for r in results), _statuses(results)


# ---- the comparison -------------------------------------------------------------------------

GOLDEN = {"x": np.array([[1.0, -2.0, 0.0], [0.5, 0.0, 3.0]]), "k.bias": np.zeros(3)}
TERMS = {"x": np.array([[1.0, -2.0, 0.0], [0.5, 0.7, 3.0]]), "k.bias": np.array([4.0, -1.0, 2.0])}
# the relative tolerance handed to the comparison under test: no rounding bound (these gradients are
# exact numbers), only a size the planted differences are set below (1e-9, 1e-12) or above (1e-3)
GIVEN_TOL = 1e-6


def test_the_comparison_passes_rounding_and_names_the_worst_tensor():
    mine = {"x": GOLDEN["x"] * (1 + 1e-9), "k.bias": np.array([1e-12, 0.0, -1e-12])}
    result = compare_gradients(mine, GOLDEN, TERMS, GIVEN_TOL)
    assert result.passed and result.max_abs_err < GIVEN_TOL and "cosine" in result.reason


@pytest.mark.parametrize("mistake, message", [
    ({"x": GOLDEN["x"] * 1.001, "k.bias": np.zeros(3)}, "x: ‖g − g*‖/‖terms‖ 0.000983"),
    ({"x": GOLDEN["x"] + np.array([[0, 0, 1e-30], [0, 0, 0]]), "k.bias": np.zeros(3)}, "nothing reaches"),
    ({"x": GOLDEN["x"] * np.nan, "k.bias": np.zeros(3)}, "non-finite"),
    ({"x": GOLDEN["x"]}, "missing ['k.bias']"),
    ({"x": GOLDEN["x"][:1], "k.bias": np.zeros(3)}, "shape [1, 3]"),
    ({"x": GOLDEN["x"], "k.bias": np.array([1e-3, 0.0, 0.0])}, "k.bias"),
], ids=["scaled", "leak into an unreached entry", "nan", "missing tensor", "shape", "a cancelling sum that does not cancel"])
def test_the_comparison_fails(mistake, message):
    result = compare_gradients(mistake, GOLDEN, TERMS, GIVEN_TOL)
    assert not result.passed and message in result.reason, result.reason


def test_a_zero_gradient_never_reads_as_agreement():
    """A detached key gives an all-zero gradient: its cosine with the golden's is undefined, said
    so, never 1; the failure line leads with the normwise error and its bound."""
    result = compare_gradients({"x": np.zeros((2, 3)), "k.bias": np.zeros(3)}, GOLDEN, TERMS, GIVEN_TOL)
    assert not result.passed
    assert result.reason.startswith("x: ‖g − g*‖/‖terms‖ 0.983 > tol 1e-06,"), result.reason
    assert "cosine undefined (‖g‖ = 0)" in result.reason and "cosine 1" not in result.reason
    passing = compare_gradients({"x": GOLDEN["x"]}, {"x": GOLDEN["x"]}, {"x": TERMS["x"]}, GIVEN_TOL)
    assert passing.passed and "cosine 1.000000000" in passing.reason


def test_an_entry_whose_terms_cancel_is_not_required_exact():
    """x[1, 1] is 0 in the golden but its terms are not (0.7): a backend's rounding there passes."""
    mine = {"x": GOLDEN["x"] + np.array([[0, 0, 0], [0, 1e-12, 0]]), "k.bias": np.zeros(3)}
    assert compare_gradients(mine, GOLDEN, TERMS, GIVEN_TOL).passed


def test_a_gradient_below_float16s_normal_range_is_judged_to_its_subnormal_grid():
    """A gradient whose entries all lie under float16's normal range (6.1e-5; the gated attention's gate
    under the small case's 1e-3 activations) is stored on the 2⁻²⁴ grid of its subnormals, however
    exactly it was summed: the golden's own values (1e-6, 17 steps of the grid) stored in float16 are off
    by 1.7% of their norm, 3 times the bound. The bound allows s·√N for it (6% of this tensor's norm);
    a zero gradient, or one 10% off, still fails."""
    golden = {"gate.weight": np.random.default_rng(3).standard_normal((40, 64)) * 1e-6}
    terms = {"gate.weight": np.abs(golden["gate.weight"])}
    stored = {"gate.weight": golden["gate.weight"].astype(np.float16)}
    tol, spacing = tolerance("float16", 30, 2), SUBNORMAL_SPACING["float16"]
    assert not compare_gradients(stored, golden, terms, tol).passed
    result = compare_gradients(stored, golden, terms, tol, subnormal_spacing=spacing)
    assert result.passed and "subnormal allowance" in result.reason, result.reason
    for wrong in (np.zeros((40, 64)), (golden["gate.weight"] * 1.1).astype(np.float16)):
        assert not compare_gradients({"gate.weight": wrong}, golden, terms, tol, subnormal_spacing=spacing).passed
    assert SUBNORMAL_SPACING["float32"] * math.sqrt(1e12) < 1e-38  # nothing at float32 and wider


def test_the_relu_kink_allowance_widens_the_bound_by_its_size():
    mine = {"x": GOLDEN["x"] + 0.01, "k.bias": np.zeros(3)}
    mine["x"][GOLDEN["x"] == 0] = 0.0
    assert not compare_gradients(mine, GOLDEN, TERMS, GIVEN_TOL).passed
    result = compare_gradients(mine, GOLDEN, TERMS, GIVEN_TOL, {"x": 0.05, "k.bias": 0.0})
    assert result.passed and "ReLU kink allowance" in result.reason


def test_a_tensor_whose_bound_reaches_its_size_is_not_judged():
    """SPEC §8: a bound of a tensor's own size passes a gradient of zeros, so it judges nothing. The
    tensor is left out and named, the others are still judged, and where none is left the
    comparison says it judged nothing; a NaN in a left-out tensor still fails."""
    size = {name: max(np.linalg.norm(GOLDEN[name]), np.linalg.norm(TERMS[name])) for name in GOLDEN}
    mine = {"x": np.zeros((2, 3)), "k.bias": np.zeros(3)}
    conditioning = {"x": 1.01 * size["x"]}  # c* reaching x's size
    result = compare_gradients(mine, GOLDEN, TERMS, GIVEN_TOL, conditioning=conditioning)
    assert result.passed and result.judged and "not judged, their bound reaching their size: x (1.01" in result.reason
    just_below = compare_gradients(mine, GOLDEN, TERMS, GIVEN_TOL, conditioning={"x": 0.9 * size["x"]})
    assert not just_below.passed and just_below.judged  # 0.983 of its size off: the bound of 0.9 sees it
    off = {"x": np.zeros((2, 3)), "k.bias": np.array([1e-3, 0.0, 0.0])}
    assert not compare_gradients(off, GOLDEN, TERMS, GIVEN_TOL, conditioning=conditioning).passed
    everywhere = {**conditioning, "k.bias": 5 * size["k.bias"]}
    every = compare_gradients(off, GOLDEN, TERMS, GIVEN_TOL, conditioning=everywhere)
    assert every.passed and not every.judged and "k.bias (5" in every.reason
    nan = {"x": np.full((2, 3), np.nan), "k.bias": np.zeros(3)}
    assert not compare_gradients(nan, GOLDEN, TERMS, GIVEN_TOL, conditioning=conditioning).passed


def test_a_gradient_cell_that_judges_no_tensor_is_reported_not_judged(monkeypatch):
    """Through the harness: where c* reaches every tensor's size the cell is a `not judged` skip
    that names them, not a pass; the same cell with c* below their sizes passes as before."""
    import conformance.cases
    from conformance.backends import numpy_backend

    monkeypatch.setattr(conformance.cases, "amplification", lambda *args: 2.0)  # c* is asked only where amplified
    reported = {}

    def far(self, width):
        reported["width"] = width
        return {name: 1e6 * max(1.0, float(np.abs(g).sum())) for name, g in self.gradients.items()}

    monkeypatch.setitem(torch_model.ACTIVATIONS, TINY.activation,  # a planted error of 1%
                        lambda x, planted=torch_model.ACTIVATIONS[TINY.activation]: planted(x) * 1.01)
    monkeypatch.setattr(numpy_backend.GradientReference, "conditioning_bound", far)
    [cell] = _run(TINY, ["torch"], ["float32"], pattern="grad-ffn-none")
    assert cell.status == SKIP and cell.skip == "not judged" and "their bound reaching their size" in cell.reason
    assert reported["width"] > 0
    monkeypatch.setattr(numpy_backend.GradientReference, "conditioning_bound", lambda self, width: {})
    [cell] = _run(TINY, ["torch"], ["float32"], pattern="grad-ffn-none")
    assert cell.status == FAIL, cell.reason


# ---- mistakes that only the backward sees ---------------------------------------------------

def _detached_residual(cfg, norm, x, sublayer, dropout_mask=None, post_norm=None):
    if cfg.norm_position == "post":
        return norm(x.detach() + torch_model.dropout(cfg, sublayer(x), dropout_mask))
    return x.detach() + torch_model.dropout(cfg, sublayer(norm(x)), dropout_mask)


def _head_counting_one_use(self, h, tied_table):
    weight = tied_table.detach() if not hasattr(self, "weight") else self.weight
    return torch.nn.functional.linear(h, weight, getattr(self, "bias", None))


@pytest.mark.parametrize("mistake, sublayer", [("a detached residual", "grad-encoder_layer"),
                                               ("a tied head that counts one use", "grad-logits")])
def test_a_torch_mistake_the_forward_cannot_see(monkeypatch, mistake, sublayer):
    if mistake == "a detached residual":
        monkeypatch.setattr(torch_model, "residual", _detached_residual)
    else:
        monkeypatch.setattr(torch_model.Head, "forward", _head_counting_one_use)
    forward = _run(TINY, ["torch"], ["float32"], pattern=f"{sublayer[5:]}-*")
    assert forward and all(r.status == PASS for r in forward), _statuses(forward)
    backward = _run(TINY, ["torch"], ["float32"], pattern=f"{sublayer}-*")
    assert backward and all(r.status == FAIL for r in backward), _statuses(backward)


def test_a_jax_softmax_that_hides_nan_in_its_forward(monkeypatch):
    """A mask added as a -inf bias: jax.nn.softmax of an all -inf row is NaN, and replacing that
    row by zeros afterwards (jnp.where) gives the forward the spec's zeros. The backward still
    multiplies the NaN weights by the zero cotangent, and the addition passes the NaN on to the
    scores (the trap of pytorch #41508 and jax #17117). Only the gradient cells see it."""
    import jax
    import jax.numpy as jnp

    import impl_jax.model as jax_model

    def nan_hiding_softmax(x, mask=None, sink=None):
        if mask is None:
            return jax.nn.softmax(x, axis=-1)
        weights = jax.nn.softmax(x + jnp.where(mask, 0.0, -jnp.inf), axis=-1)
        return jnp.where(mask.any(axis=-1, keepdims=True), weights, 0.0)

    monkeypatch.setattr(jax_model, "softmax", nan_hiding_softmax)
    # _attention is jitted: a fresh jit of its function traces the planted softmax
    monkeypatch.setattr(jax_model, "_attention", jax.jit(jax_model._attention.__wrapped__,
                                                         static_argnames=("path", "precision")))
    forward = _run(TINY, ["jax-math"], ["float32"], pattern="attention-mask_qk*")
    assert [r.status for r in forward] == [PASS], _statuses(forward)
    backward = _run(TINY, ["jax-math"], ["float32"], pattern="grad-attention-mask_qk")
    assert [r.status for r in backward] == [FAIL] and "non-finite" in backward[0].reason, _statuses(backward)


def test_check_runs_gradient_cells_on_request(capsys):
    assert main(["check", "--preset", "tiny", "--backends", "torch", "--dtypes", "float32", "-k", "grad-mha-causal",
                 "--backward", "--jobs", "1", "--quiet"]) == 0
    assert "2 passed" in capsys.readouterr().out
    assert main(["check", "--preset", "tiny", "--backends", "torch", "--dtypes", "float32", "-k", "grad-mha-causal",
                 "--jobs", "1", "--quiet"]) == 1
    assert "gradient and training cells run with --backward" in capsys.readouterr().err
