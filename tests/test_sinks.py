"""Attention sinks (SPEC §5.16: gpt-oss): a learned logit per head in the softmax's denominator only.
The golden's definition and backward, every column's attention against it (the explicit paths, and
onnxruntime's GroupQueryAttention with its head_sink in the in-place step), on mistral-tiny's sliding
windows with sinks, where a window and the pads empty some rows."""

import numpy as np
import pytest

import impl_numpy as golden
from conformance.harness import PASS, SKIP, plan_matrix, run_matrix
from impl_numpy import backward
from spec import ConfigError, conformance_params, get_preset, init_params, param_shapes

SINKS = get_preset("mistral-tiny").replace(attention_sinks=True)


def _attention_inputs(seed=0, heads=4, keys=5):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(2, heads, n, 6)) for n in (3, keys, keys))
    keep = rng.random((2, 1, 3, keys)) < 0.7
    keep[0, :, 0] = False  # a query with no key: all of its weight to the sink
    return q, k, v, keep, rng.normal(size=heads)


def test_a_sink_joins_the_denominator_and_nothing_else():
    q, k, v, keep, sinks = _attention_inputs()
    out = golden.scaled_dot_product_attention(q, k, v, keep, sinks=sinks)
    scores = np.where(keep, q @ np.swapaxes(k, -1, -2) / np.sqrt(6), -np.inf)
    weights = np.exp(scores) / (np.exp(sinks)[:, None, None] + np.exp(scores).sum(-1, keepdims=True))
    assert np.allclose(out, weights @ v, rtol=1e-12, atol=1e-12)
    assert np.array_equal(out[0, :, 0], np.zeros((4, 6)))  # a query with no key: 0, not NaN
    assert (weights.sum(-1) < 1).all()  # every row gives the sink its share
    # without the sinks it is the plain attention, whose rows sum to 1
    assert not np.allclose(golden.scaled_dot_product_attention(q, k, v, keep), out, atol=1e-3)


def test_a_sink_far_above_the_scores_takes_every_weight_without_overflow():
    q, k, v, keep, _ = _attention_inputs(1)
    out = golden.scaled_dot_product_attention(q, k, v, keep, sinks=np.full(4, 800.0))  # exp(800) overflows
    assert np.isfinite(out).all() and np.abs(out).max() < 1e-300


def test_the_sinks_gradient_matches_finite_differences():
    q, k, v, keep, sinks = _attention_inputs(2)
    d_out = np.random.default_rng(3).normal(size=q.shape)
    d_sinks = backward.attention_sinks_vjp(q, k, v, keep, d_out, 1 / np.sqrt(6), None, sinks)
    step = 1e-6
    for head in range(4):
        moved = [sinks + sign * step * np.eye(4)[head] for sign in (1, -1)]
        outs = [np.sum(d_out * golden.scaled_dot_product_attention(q, k, v, keep, sinks=s)) for s in moved]
        assert np.isclose(d_sinks[head], (outs[0] - outs[1]) / (2 * step), rtol=1e-6)
    # and the scores' gradient is softmax's over the keys, the sink's share in P
    d_q, _, _ = backward.scaled_dot_product_attention_vjp(q, k, v, keep, d_out, sinks=sinks)
    direction = np.random.default_rng(4).normal(size=q.shape)
    ahead, behind = (np.sum(d_out * golden.scaled_dot_product_attention(q + sign * step * direction, k, v, keep,
                                                                         sinks=sinks)) for sign in (1, -1))
    assert np.isclose(np.sum(d_q * direction), (ahead - behind) / (2 * step), rtol=1e-6)


def test_sinks_are_a_parameter_per_query_head_drawn_away_from_zero():
    assert param_shapes(SINKS)["decoder.layers.1.self_attn.sinks"] == (SINKS.n_heads,)
    assert not init_params(SINKS)["decoder.layers.0.self_attn.sinks"].any()
    drawn = conformance_params(SINKS)["decoder.layers.0.self_attn.sinks"]
    assert np.abs(drawn).max() <= 1.5 and len(set(drawn.tolist())) == SINKS.n_heads
    assert type(SINKS).from_json(SINKS.to_json()) == SINKS
    assert "attention_sinks" not in get_preset("mistral-tiny").to_dict()


def test_sinks_need_a_decoder_only_model():
    with pytest.raises(ConfigError, match="attention_sinks are a decoder-only model's"):
        get_preset("tiny").replace(attention_sinks=True)


# the cells where the sinks are met: the attention itself, a layer's attention, the whole model's forward
# and decode (where a window and the pads leave rows of one key or none), and their gradients
_WHERE_SINKS_ARE = "attention-*|mha-*|forward-pad_left|forward-all_pad|decode-pad_left|generate-pad_left"


@pytest.mark.parametrize("backends, backward_cells", [
    (["numpy-float32", "torch", "torch-math", "jax"], False),
    (["torch", "jax"], True),
    (["onnx"], False),
])
def test_every_column_computes_the_sinks_of_the_spec(backends, backward_cells):
    """The attention, mha and whole-model cells (and their gradients) at float32 on mistral-tiny with
    sinks; onnx's decode and generate cells run the in-place step, its sinks GroupQueryAttention's
    head_sink."""
    params = conformance_params(SINKS)
    plan = plan_matrix(SINKS, backends, ["float32"], ["cpu"])
    pattern = "|".join(f"grad-{part}" for part in _WHERE_SINKS_ARE.split("|")) if backward_cells \
        else _WHERE_SINKS_ARE
    results = run_matrix(SINKS, params, plan, backward=backward_cells, pattern=pattern)
    ran = [r for r in results if r.status != SKIP]
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]
    sublayers = {r.sublayer for r in ran}
    if backward_cells:
        assert {"grad-attention", "grad-mha", "grad-forward"} <= sublayers
    elif backends == ["onnx"]:
        assert {"forward", "decode", "generate"} <= sublayers
    else:
        assert {"attention", "mha", "forward", "decode"} <= sublayers


def test_a_port_without_the_sinks_fails():
    """The golden without its sinks is another model: the forward cell's check can fail."""
    from conformance.cases import build_case
    from conformance.tolerance import compare

    params = conformance_params(SINKS)
    case = build_case(SINKS, params, "forward", "pad_right")
    ids, keep = case.inputs["tgt_ids"], case.inputs["tgt_ids"] != SINKS.pad_id
    want = golden.forward(SINKS, params, None, ids, tgt_keep=keep)
    without = golden.forward(SINKS, {k: v for k, v in params.items() if not k.endswith("sinks")} | {
        k: np.full_like(v, -1e4) for k, v in params.items() if k.endswith("sinks")}, None, ids, tgt_keep=keep)
    assert not compare(without, want, case.tolerance(SINKS, "float32")).passed
