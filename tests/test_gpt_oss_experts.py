"""gpt-oss's experts (SPEC §5.16): the clamped SwiGLU, g = min(x W1 + b1, L), u = clip(x W3 + b3, −L, L),
g·σ(α g) ⊙ (u + 1), in experts that carry the model's biases, chosen by a router with a bias. The
golden's definition and backward, and every column on a mixture of experts with them (mixtral-tiny
with biases, L = 1 so that a third of the units clamp, a router bias and attention sinks)."""

import dataclasses

import numpy as np
import pytest

import impl_numpy as golden
from conformance.harness import PASS, SKIP, plan_matrix, run_matrix
from impl_numpy import backward
from spec import ConfigError, conformance_params, get_preset, params_under

_MIXTRAL = get_preset("mixtral-tiny")
CLAMPED = _MIXTRAL.replace(bias=True, qkv_bias=True, swiglu_limit=1.0, swiglu_alpha=1.702, attention_sinks=True,
                           moe=dataclasses.replace(_MIXTRAL.moe, router_bias=True))


def test_the_clamped_unit_is_gpt_osss():
    gate = np.array([-3.0, -0.5, 0.5, 0.99, 1.0, 2.5])
    up = np.array([-4.0, -1.0, 0.2, 3.0, -0.3, 0.9])
    g, u = np.minimum(gate, 1.0), np.clip(up, -1.0, 1.0)
    expected = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    assert np.allclose(golden.clamped_swiglu(gate, up, 1.0, 1.702), expected, rtol=1e-15)
    assert golden.clamped_swiglu(np.array([5.0]), np.array([9.0]), 1.0, 1.702)[0] == pytest.approx(
        2 / (1 + np.exp(-1.702)))  # both clamped: L·σ(α L)·(L + 1)
    assert golden.clamped_swiglu(np.array([0.5]), np.array([-7.0]), 1.0, 1.702)[0] == 0.0  # u = −L: (u + 1) = 0


def test_an_ffn_with_the_clamp_is_not_the_plain_swiglu():
    p = params_under(conformance_params(CLAMPED), "decoder.layers.0.ffn.experts.1")
    x = np.random.default_rng(0).normal(size=(2, 5, CLAMPED.d_model))
    gate, up = golden.linear(x, p["w1.weight"], p["w1.bias"]), golden.linear(x, p["w3.weight"], p["w3.bias"])
    assert 0.1 < (gate > 1.0).mean() < 0.9 and 0.1 < (np.abs(up) > 1.0).mean() < 0.9  # the clamps bind
    clamped = golden.feed_forward(p, x, "swish", CLAMPED.swiglu_clamp)
    expected = golden.linear(golden.clamped_swiglu(gate, up, 1.0, 1.702), p["w2.weight"], p["w2.bias"])
    assert np.allclose(clamped, expected, rtol=1e-12, atol=1e-12)
    assert not np.allclose(golden.feed_forward(p, x, "swish"), clamped, atol=1e-2)


def test_the_clamped_units_gradient_matches_finite_differences():
    p = params_under(conformance_params(CLAMPED), "decoder.layers.1.ffn.experts.2")
    rng = np.random.default_rng(1)
    x, d_y, direction = (rng.normal(size=(3, 4, CLAMPED.d_model)) for _ in range(3))
    d_x, grads = backward.feed_forward_vjp(p, x, "swish", d_y, CLAMPED.swiglu_clamp)
    assert set(grads) == {"w1.weight", "w1.bias", "w2.weight", "w2.bias", "w3.weight", "w3.bias"}
    step = 1e-6
    ahead, behind = (np.sum(d_y * golden.feed_forward(p, x + sign * step * direction, "swish", CLAMPED.swiglu_clamp))
                     for sign in (1, -1))
    assert np.isclose(np.sum(d_x * direction), (ahead - behind) / (2 * step), rtol=1e-5)


@pytest.mark.parametrize("changes, message", [
    (dict(swiglu_alpha=None), "give both or neither"),
    (dict(swiglu_limit=-1.0), "swiglu_limit must be a positive number"),
    (dict(activation="gelu-tanh"), "it needs gated_ffn=true and activation='swish'"),
])
def test_bad_clamps_are_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        CLAMPED.replace(**changes)


def test_the_clamp_round_trips_and_is_absent_at_its_default():
    assert type(CLAMPED).from_json(CLAMPED.to_json()) == CLAMPED
    assert "swiglu_limit" not in get_preset("mixtral-tiny").to_dict()


@pytest.mark.parametrize("backends, backward_cells", [
    (["numpy-float32", "torch", "jax"], False),
    (["torch", "jax"], True),
    (["onnx"], False),  # onnx-jax's export of the mixture costs a minute here: the unit is the same JAX code
])
def test_every_column_computes_the_clamped_experts(backends, backward_cells):
    params = conformance_params(CLAMPED)
    pattern = "ffn-*|experts-*|router-*|forward-pad_right|decode-incremental"
    if backward_cells:
        pattern = "grad-ffn-*|grad-forward-pad_right"
    results = run_matrix(CLAMPED, params, plan_matrix(CLAMPED, backends, ["float32"], ["cpu"]),
                         backward=backward_cells, pattern=pattern)
    ran = [r for r in results if r.status != SKIP]
    assert ran and all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]


def test_the_router_bias_moves_the_choices_and_is_a_parameter():
    """router.bias [E] is read (U(-0.2, 0.2) in the conformance weights): without it some tokens choose
    other experts; its gradient is the logits' gradient summed, checked against finite differences."""
    params = conformance_params(CLAMPED)
    block = params_under(params, "decoder.layers.0.ffn")
    assert block["router.bias"].shape == (5,) and np.abs(block["router.bias"]).max() > 0.05
    x = np.random.default_rng(2).normal(size=(40, CLAMPED.d_model))
    with_bias = golden.top_experts(golden.router_probabilities(x, block["router.weight"], block["router.bias"]), 2)
    without = golden.top_experts(golden.router_probabilities(x, block["router.weight"]), 2)
    assert (with_bias != without).any()
    assert type(CLAMPED).from_json(CLAMPED.to_json()) == CLAMPED and "router_bias" not in _MIXTRAL.to_dict()["moe"]
    d_y = np.random.default_rng(3).normal(size=(2, 4, CLAMPED.d_model))
    tokens = np.random.default_rng(4).normal(size=(2, 4, CLAMPED.d_model))
    _, grads = backward.experts_ffn_vjp(CLAMPED, block, tokens, d_y)
    step, direction = 1e-6, np.random.default_rng(5).normal(size=5)
    moved = [{**block, "router.bias": block["router.bias"] + sign * step * direction} for sign in (1, -1)]
    outs = [np.sum(d_y * golden.experts_ffn(CLAMPED, m, tokens)) for m in moved]
    assert np.isclose(np.sum(grads["router.bias"] * direction), (outs[0] - outs[1]) / (2 * step), rtol=1e-5)
