"""The modern decoder in the golden (SPEC.md §5.11): rotary positions, grouped-query attention,
head_dim apart from d_model / n_heads, the gated FFN and Qwen3's head norms, their VJPs against
central differences, and the cached decoding that must hold rotated keys."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import impl_numpy as golden
from conformance.cases import SUBLAYERS
from conformance.tolerance import SAFETY, UNIT_ROUNDOFF, rotary_angle, tolerance
from impl_numpy import backward
from spec import conformance_params, get_preset, params_under
from spec.masks import causal_mask, combine_masks, key_mask
from tests.bounds import assert_agrees, assert_derivative, assert_differs, model_bounds

FAMILIES = ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny", "gemma2-tiny", "gemma3-tiny"]


def rng(seed=0):
    return np.random.default_rng(seed)


def test_rope_is_the_identity_at_position_zero_and_keeps_lengths():
    cfg = get_preset("llama-tiny")
    x = rng().standard_normal((2, 3, 5, cfg.d_head))
    np.testing.assert_array_equal(golden.rotary(cfg, x[:, :, :1], np.array([0])), x[:, :, :1])
    rotated = golden.rotary(cfg, x, np.arange(1000, 1005))
    # any angle keeps the length: the angle's rounding (SPEC §8's A) turns a pair, only cos and sin's
    # own rounding and the norm's d_k terms reach its length
    assert_agrees(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), n=cfg.d_head)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 4000), st.integers(0, 4000), st.integers(-50, 50), st.sampled_from(FAMILIES))
def test_rope_scores_depend_on_the_distance_only(position_q, position_k, shift, family):
    """q_m · k_n after the rotation depends on m − n alone: the property RoPE exists for."""
    cfg = get_preset(family)
    q, k = rng(1).standard_normal((2, 1, 1, 1, cfg.d_head))
    score = lambda m, n: float((golden.rotary(cfg, q, np.array([m])) * golden.rotary(cfg, k, np.array([n]))).sum())
    shifted = max(0, min(position_q, position_k) + shift) - min(position_q, position_k)
    moved = (position_q + shifted, position_k + shifted)
    bound = _score_rounding(cfg, q, k, position_q, position_k) + _score_rounding(cfg, q, k, *moved)
    assert abs(score(position_q, position_k) - score(*moved)) <= bound


def _score_rounding(cfg, q, k, position_q, position_k):
    """How far float64 rounding may move a score q_m · k_n of rotated vectors. Pair i turns by p·ω_i,
    an angle a table holds to u·(p·ω_i + 1) radians (the product's rounding, and cos and sin's own),
    which moves the pair's share of the score by that angle times ‖q_i‖‖k_i‖, for each of the two
    rotations; the dot product's own sum adds u·√d_k·Σ|q_j k_j| (SPEC §8's √n). SPEC §8's safety
    over both. (The policy's A is this angle's mean over the pairs, relative to a normalised output;
    a raw score of random vectors is not one, so the sum is taken pair by pair.)"""
    half = cfg.rotary_dim // 2
    omega = golden.rope_frequencies(cfg)  # [r/2]
    q_pairs, k_pairs = (np.hypot(x[..., :half], x[..., half:2 * half]).ravel() for x in (q, k))
    turned = sum(float((q_pairs * k_pairs * (p * omega + 1)).sum()) for p in (position_q, position_k))
    summed = math.sqrt(cfg.d_head) * float(np.abs(q * k).sum())
    return SAFETY * UNIT_ROUNDOFF["float64"] * (turned + summed)


def test_rotate_half_pairs_dimension_i_with_i_plus_half_not_its_neighbour():
    """Hugging Face's layout: dimension i turns with i + r/2 at frequency θ^(−2i/r); the
    interleaved layout (GPT-J, Meta's original Llama) pairs 2i with 2i + 1."""
    cfg = get_preset("llama-tiny")  # d_k 8: pairs (0, 4), (1, 5), (2, 6), (3, 7)
    x = np.zeros((1, 1, 1, 8))
    x[..., 1] = 1.0
    rotated = golden.rotary(cfg, x, np.array([3]))[0, 0, 0]
    angle = 3 * cfg.rope_theta ** (-2 / 8)
    assert_agrees(rotated, [0, np.cos(angle), 0, 0, 0, np.sin(angle), 0, 0], n=1, angle=rotary_angle(cfg, 3))


def test_partial_rotary_leaves_the_last_dimensions_alone():
    cfg = get_preset("llama-tiny").replace(rope_fraction=0.5)
    x = rng(2).standard_normal((1, 2, 4, 8))
    rotated = golden.rotary(cfg, x, np.arange(10, 14))
    np.testing.assert_array_equal(rotated[..., 4:], x[..., 4:])
    assert_differs(rotated[..., :4], x[..., :4], n=1, angle=rotary_angle(cfg, 13))


def test_key_value_head_j_serves_a_contiguous_group_of_query_heads():
    """repeat_interleave's order (Hugging Face's repeat_kv), not tile's."""
    kv = np.arange(3)[None, :, None, None] * np.ones((1, 3, 2, 4))
    assert golden.group_heads(kv, 6)[0, :, 0, 0].tolist() == [0, 0, 1, 1, 2, 2]


def test_gated_ffn_is_swiglu():
    cfg = get_preset("llama-tiny")
    p = params_under(golden.cast_params(cfg, conformance_params(cfg)), "decoder.layers.0.ffn")
    x = rng(3).standard_normal((2, 3, cfg.d_model))
    gate, up = x @ p["w1.weight"], x @ p["w3.weight"]
    expected = (gate / (1 + np.exp(-gate)) * up) @ p["w2.weight"]
    assert_agrees(golden.feed_forward(p, x, "swish"), expected, n=max(cfg.d_model, cfg.d_ff))


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_holds_rotated_keys_and_equals_the_forward_far_from_zero(family):
    cfg = get_preset(family)
    p = golden.cast_params(cfg, conformance_params(cfg))
    ids = rng(4).integers(1, cfg.tgt_vocab_size, (2, 1004))
    ids[1, 1000:] = cfg.pad_id
    full = golden.model_logits(cfg, p, None, ids)
    cache = golden.start_cache(cfg, p, 2)
    _, cache = golden.decode_step(cfg, p, cache, ids[:, :1001])  # a chunk, then steps across its end
    assert cache.self_keys[0].shape == (2, cfg.kv_heads, 1001, cfg.d_head)
    steps = [golden.decode_step(cfg, p, cache, ids[:, 1001:1002])]
    steps.append(golden.decode_step(cfg, p, steps[0][1], ids[:, 1002:1004]))
    assert_agrees(np.concatenate([steps[0][0], steps[1][0]], axis=1), full[:, 1001:], **model_bounds(cfg, 1004))
    unrotated = golden.key_value_heads(cfg, params_under(p, "decoder.layers.0.self_attn"),
                                       np.zeros((2, 1, cfg.d_model)) + 0.1)[0]
    assert unrotated.shape == (2, cfg.kv_heads, 1, cfg.d_head)


# ---- the VJPs against central differences ------------------------------------------------------

def _assert_directional(f, x, gradient, seed, rounding, h=1e-6, what=""):
    """gradient · u is the derivative of f at x along a random direction u, as far as the central
    difference at step h tells, f rounded as SPEC §8's `rounding` allows."""
    direction = rng(seed).standard_normal(x.shape)
    assert_derivative(float((gradient * direction).sum()), lambda s: f(x + s * direction), h, rounding, what)


def _loss_rounding(cfg, batch, length):
    """SPEC §8's tolerance for the golden's loss on a batch: the forward's n, depth and angle, with
    the loss's own sums (a token's V logits, the batch's tokens) and its one sublayer more."""
    bounds = model_bounds(cfg, length)
    return tolerance("float64", max(bounds["n"], cfg.tgt_vocab_size, batch * length), SUBLAYERS["loss"].depth(cfg),
                     bounds["angle"])


def test_rotary_and_group_vjps():
    cfg = get_preset("qwen2-tiny").replace(rope_fraction=0.6)  # d_k 10: 6 rotate, 4 pass
    x, d_y = rng(5).standard_normal((2, 4, 2, 3, cfg.d_head))
    positions = np.array([7, 500, 1999])
    # n: the loss sums all 240 products; the rotation at position 1999 carries its angle
    _assert_directional(lambda z: (golden.rotary(cfg, z, positions) * d_y).sum(), x,
                        backward.rotary_vjp(cfg, positions, d_y), 6,
                        tolerance("float64", d_y.size, 1, rotary_angle(cfg, 1999)), what="rotary")
    kv, d_grouped = rng(7).standard_normal((2, 3, 1, 5, 4)), rng(8).standard_normal((3, 4, 5, 4))
    _assert_directional(lambda z: (golden.group_heads(z, 4) * d_grouped).sum(), kv[0],
                        backward.group_heads_vjp(d_grouped, 1), 9, tolerance("float64", d_grouped.size, 1),
                        what="group_heads")


def test_gated_ffn_vjp():
    cfg = get_preset("qwen3-tiny").replace(bias=True)
    p = params_under(golden.cast_params(cfg, conformance_params(cfg)), "decoder.layers.1.ffn")
    x, d_y = rng(10).standard_normal((2, 2, 3, cfg.d_model))
    d_x, grads = backward.feed_forward_vjp(p, x, "swish", d_y)
    assert set(grads) == set(p)
    loss = lambda q, z: (golden.feed_forward(q, z, "swish") * d_y).sum()  # noqa: E731
    rounding = tolerance("float64", max(cfg.d_ff, d_y.size), 1)  # the loss sums 216 products, more than d_ff 60
    _assert_directional(lambda z: loss(p, z), x, d_x, 11, rounding, what="x")
    for index, name in enumerate(p):
        _assert_directional(lambda w: loss({**p, name: w}, x), p[name], grads[name], 12 + index, rounding, what=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_vjp_with_grouped_heads_rotation_and_head_norms(family):
    cfg = get_preset(family)
    p = params_under(golden.cast_params(cfg, conformance_params(cfg)), "decoder.layers.0.self_attn")
    x, context = rng(20).standard_normal((2, 2, 5, cfg.d_model))
    d_y = rng(21).standard_normal((2, 5, cfg.d_model))
    keep = np.array([[True] * 5, [False, True, True, True, False]])
    mask = combine_masks(causal_mask(5), key_mask(keep))
    d_x, d_context, grads = backward.multi_head_attention_vjp(cfg, p, x, context, mask, d_y, offset=990)
    assert set(grads) == set(p)
    loss = lambda q, a, c: (golden.multi_head_attention(cfg, q, a, c, mask, 990) * d_y).sum()  # noqa: E731
    # n: the loss sums every output (more than d or the 5 keys); keys rotate by positions up to 994
    rounding = tolerance("float64", max(cfg.d_model, d_y.size), 1, rotary_angle(cfg, 994))
    for name, value, gradient, f in (("x", x, d_x, lambda z: loss(p, z, context)),
                                     ("context", context, d_context, lambda z: loss(p, x, z))):
        _assert_directional(f, value, gradient, 22, rounding, what=name)
    for index, name in enumerate(p):
        _assert_directional(lambda w: loss({**p, name: w}, x, context), p[name], grads[name], 30 + index, rounding,
                            what=name)
    if cfg.qkv_bias:  # rotated, b^K no longer adds one constant to a row of scores: it has a gradient
        # beyond the rounding an unrotated one (zero) would show, at the grad-mha case's depth 2
        assert_differs(grads["k.bias"], np.zeros_like(grads["k.bias"]), n=max(cfg.d_model, d_y.size), depth=2,
                       angle=rotary_angle(cfg, 994))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_whole_model_backward_agrees_with_central_differences(family):
    cfg = get_preset(family).replace(label_smoothing=0.1)
    p = golden.cast_params(cfg, conformance_params(cfg, seed=3))
    tgt = rng(4).integers(1, cfg.tgt_vocab_size, (2, 6))
    tgt[1, 4:] = cfg.pad_id
    targets = np.roll(tgt, -1, axis=1)
    targets[:, -1] = cfg.pad_id
    _, grads = backward.loss_and_gradients(cfg, p, None, tgt, targets)
    loss = lambda q: golden.token_cross_entropy(cfg, golden.model_logits(cfg, q, None, tgt), targets)  # noqa: E731
    rounding = _loss_rounding(cfg, *tgt.shape)
    for index, name in enumerate(p):
        _assert_directional(lambda w: loss({**p, name: w}), p[name], grads[name], index, rounding, h=1e-6, what=name)
