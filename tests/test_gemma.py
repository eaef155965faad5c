"""Gemma's layer (SPEC.md §5.13) and per-layer attention kinds (§6): softcaps before the mask,
RMSNorm by (1 + w), post norms, the query scalar, sliding and full layers with their own rotary,
in the golden, PyTorch and JAX, each property shown failing where it is broken."""

import numpy as np
import pytest

import impl_numpy as golden
from conformance.tolerance import compare_generation, tolerance
from impl_numpy import backward
from spec import ConfigError, ModelConfig, conformance_params, get_preset, init_params, param_shapes, params_under
from spec.masks import causal_mask
from spec.params import CONFORMANCE_SCALE, POST_NORM_GAINS
from tests.bounds import assert_agrees, assert_derivative, assert_differs, model_bounds

GEMMA2, GEMMA3 = get_preset("gemma2-tiny"), get_preset("gemma3-tiny")


def rng(seed=0):
    return np.random.default_rng(seed)


# ---- the config ---------------------------------------------------------------------------------

def test_each_decoder_layer_has_its_own_config():
    assert GEMMA3.layer_windows == (4, 4, None)
    local, full = GEMMA3.layer(0), GEMMA3.layer(2)
    assert (local.sliding_window, local.rope_theta, local.rope_scaling, local.layer_types) == (4, 1e4, None, None)
    assert (full.sliding_window, full.rope_theta, full.rope_scaling.kind, full.rope_scaling.factor) == (None, 1e6,
                                                                                                        "linear", 8.0)
    assert GEMMA2.layer_windows == (4, None) and GEMMA2.layer(0).rope_theta == GEMMA2.layer(1).rope_theta == 1e4
    mistral = get_preset("mistral-tiny")  # alike layers: the model's own config, its window in every layer
    assert mistral.layer(1) is mistral and mistral.layer_windows == (4, 4)
    assert GEMMA3.module_config("decoder.layers.2.self_attn") == full and GEMMA3.module_config("decoder.norm") is GEMMA3
    with pytest.raises(ConfigError, match="decoder layer 3 does not exist: the model has 3"):
        GEMMA3.layer(3)


@pytest.mark.parametrize("changes, message", [
    ({"layer_types": ("sliding",)}, r"layer_types must list one kind per decoder layer \(2\)"),
    ({"layer_types": ("sliding", "local")}, "layer_types must hold full, sliding or linear; got local"),
    ({"sliding_window": None}, "layer_types has sliding layers but sliding_window is null"),
    ({"layer_types": ("full", "full")}, "sliding_window 4 is given but no layer of layer_types is sliding"),
    ({"local_rope_theta": 1.0}, "local_rope_theta must be a number greater than 1"),
    ({"layer_types": None, "local_rope_theta": 1e4}, "local_rope_theta is the θ of the sliding layers of layer_types"),
    ({"attention_softcap": 0.0}, "attention_softcap must be a positive number or null"),
    ({"final_softcap": float("inf")}, "final_softcap must be a positive number or null"),
    ({"query_pre_attention_scalar": -16.0}, "query_pre_attention_scalar must be a positive number"),
    ({"norm": "layernorm"}, "norm_scale_plus_one is Gemma's RMSNorm"),
    ({"norm_position": "post"}, "post_norms norm each sublayer's output before a pre-norm layer's residual sum"),
    ({"post_norms": "yes"}, "post_norms must be true or false"),
])
def test_invalid_gemma_configs_name_the_problem(changes, message):
    with pytest.raises(ConfigError, match=message):
        GEMMA2.replace(**changes)


def test_the_new_fields_are_absent_from_older_configs_json_and_read_back():
    assert "layer_types" not in get_preset("llama-tiny").to_dict()
    data = GEMMA3.to_dict()
    assert data["layer_types"] == ["sliding", "sliding", "full"] and data["local_rope_theta"] == 1e4
    assert ModelConfig.from_json(GEMMA3.to_json()) == GEMMA3


def test_post_norms_add_two_norms_a_layer_and_plus_one_scales_start_at_zero():
    names = param_shapes(GEMMA2)
    assert "decoder.layers.1.self_attn_post_norm.scale" in names and "decoder.layers.1.ffn_post_norm.scale" in names
    assert not any("post_norm" in name for name in param_shapes(get_preset("llama-tiny")))
    assert np.all(init_params(GEMMA2)["decoder.norm.scale"] == 0)  # γ = 1 + 0: the identity
    params = conformance_params(GEMMA2)
    assert np.abs(params["decoder.layers.0.ffn_norm.scale"]).min() > 0  # γ never 1
    # γ = gain · (1 + U(−0.2, 0.2)) (SPEC §4.1): gain 1, the FFN's post norm 3, the attention's 0.5
    for norm, gain in (("ffn_norm", 1.0), *POST_NORM_GAINS.items()):
        gamma = 1 + params[f"decoder.layers.0.{norm}.scale"].astype(np.float64)
        low, high = _gamma_range(gain)
        assert low <= gamma.min() and gamma.max() <= high, (norm, gamma.min(), gamma.max())


def _gamma_range(gain):
    """The ends of gain · (1 + U(−s, s)), s = CONFORMANCE_SCALE, widened by the float32 rounding of
    the stored γ − 1 (2⁻²⁴ of its size)."""
    low, high = gain * (1 - CONFORMANCE_SCALE), gain * (1 + CONFORMANCE_SCALE)
    rounding = 2.0 ** -24 * max(abs(low - 1), abs(high - 1))
    return low - rounding, high + rounding


# ---- the golden's semantics ----------------------------------------------------------------------

def test_the_softcap_bends_scores_and_comes_before_the_mask():
    q, k, v = (3 * rng(1).standard_normal((1, 2, 6, 8)) for _ in range(3))  # scores up to about 20
    mask = causal_mask(6)
    capped = golden.scaled_dot_product_attention(q, k, v, mask, cap=2.0)
    plain = golden.scaled_dot_product_attention(q, k, v, mask)
    assert_differs(capped, plain, n=8)  # n: d_k = 8 beside 6 keys
    # the first query sees one key: its output is that key's value, whatever the cap does to the others
    # (a weight of exactly 1, the others exactly 0: 1 · v + 0 · v' is v in any order of summation)
    np.testing.assert_array_equal(capped[..., 0, :], v[..., 0, :])
    scores = golden.softcap(q @ k.swapaxes(-1, -2) / np.sqrt(8), 2.0)
    assert np.abs(scores).max() <= 2.0  # c · tanh(s / c) never passes c: |tanh| ≤ 1 rounds to at most 1
    # the test's premise, not a rounding bound: the raw scores reach 5× past the cap, so it bends them
    assert np.abs(q @ k.swapaxes(-1, -2) / np.sqrt(8)).max() > 5 * 2.0


def test_rmsnorm_by_one_plus_w_and_the_query_scalar():
    cfg = GEMMA2
    x = rng(2).standard_normal((2, 3, cfg.d_model))
    zero = {"scale": np.zeros(cfg.d_model)}
    assert_agrees(golden.norm(cfg, zero, x), golden.rms_norm(x, 1.0, None, cfg.norm_eps), n=cfg.d_model)
    assert cfg.score_scale == 0.25 and get_preset("llama-tiny").score_scale == 1 / np.sqrt(8)


def test_post_norms_are_applied_to_the_sublayer_output_before_the_sum():
    cfg, p = GEMMA2, golden.cast_params(GEMMA2, conformance_params(GEMMA2))
    layer = params_under(p, "decoder.layers.0")
    x = rng(3).standard_normal((2, 5, cfg.d_model))
    ffn = lambda h: golden.feed_forward(params_under(layer, "ffn"), h, cfg.activation)  # noqa: E731
    expected = x + golden.norm(cfg, params_under(layer, "ffn_post_norm"),
                               ffn(golden.norm(cfg, params_under(layer, "ffn_norm"), x)))
    block = {"n": max(cfg.d_model, cfg.d_ff), "depth": 2}  # the ffn_block case's: the FFN and its norms
    assert_agrees(golden.ffn_block(cfg, layer, x), expected, **block)
    llama_block = golden.ffn_block(cfg.replace(post_norms=False), layer, x)
    assert_differs(llama_block, expected, **block)


def test_the_final_softcap_bounds_the_logits():
    cfg, p = GEMMA2, golden.cast_params(GEMMA2, conformance_params(GEMMA2))
    ids = rng(4).integers(1, cfg.tgt_vocab_size, (2, 9))
    logits = golden.model_logits(cfg, p, None, ids)
    uncapped = golden.model_logits(cfg.replace(final_softcap=None), p, None, ids)
    assert np.abs(logits).max() < cfg.final_softcap
    assert_agrees(logits, cfg.final_softcap * np.tanh(uncapped / cfg.final_softcap), **model_bounds(cfg, 9))
    assert_differs(logits, uncapped, **model_bounds(cfg, 9))  # the conformance weights' logits bend


def test_sliding_and_full_layers_attend_differently():
    """Gemma 3's layers differ by kind: making its first layer full changes the logits (that layer
    sees every earlier key, and rotates by θ 1e6 rescaled); making the full layer sliding does too."""
    cfg, p = GEMMA3, golden.cast_params(GEMMA3, conformance_params(GEMMA3))
    ids = rng(5).integers(1, cfg.tgt_vocab_size, (2, 12))
    logits = golden.model_logits(cfg, p, None, ids)
    for kinds in (("full", "sliding", "full"), ("sliding", "sliding", "sliding")):
        other = cfg.replace(layer_types=kinds)
        assert_differs(golden.model_logits(other, p, None, ids), logits, **model_bounds(cfg, 12), what=str(kinds))


@pytest.mark.parametrize("preset", ["gemma2-tiny", "gemma3-tiny"])
def test_cached_decoding_equals_the_forward_across_the_window(preset):
    cfg = get_preset(preset)
    p = golden.cast_params(cfg, conformance_params(cfg))
    ids = rng(6).integers(1, cfg.tgt_vocab_size, (2, 11))
    ids[1, :3] = cfg.pad_id
    forward = golden.model_logits(cfg, p, None, ids)
    cache, steps = golden.start_cache(cfg, p, 2), []
    for begin, end in ((0, 3), (3, 4), (4, 9), (9, 11)):
        logits, cache = golden.decode_step(cfg, p, cache, ids[:, begin:end])
        steps.append(logits)
    assert_agrees(np.concatenate(steps, axis=1), forward, **model_bounds(cfg, 11))


# ---- the VJPs -----------------------------------------------------------------------------------------

def _assert_directional(f, x, gradient, seed, rounding, h=1e-6, what=""):
    """gradient · u is the derivative of f at x along a random direction u, as far as the central
    difference at step h tells, f rounded as SPEC §8's `rounding` allows."""
    direction = rng(seed).standard_normal(x.shape)
    assert_derivative(float((gradient * direction).sum()), lambda s: f(x + s * direction), h, rounding, what)


def test_the_softcapped_attention_vjp():
    q, k, v, d_out = (2 * rng(7 + i).standard_normal((1, 2, 5, 8)) for i in range(4))
    mask = causal_mask(5)
    d_q, d_k, d_v = backward.scaled_dot_product_attention_vjp(q, k, v, mask, d_out, 0.3, 1.5)
    rounding = tolerance("float64", d_out.size, 1)  # the loss sums all 80 outputs: more than 5 keys or d_k 8
    for index, (name, value, gradient) in enumerate((("q", q, d_q), ("k", k, d_k), ("v", v, d_v))):
        def loss(z, index=index):
            args = [q, k, v]
            args[index] = z
            return (golden.scaled_dot_product_attention(*args, mask, 0.3, 1.5) * d_out).sum()
        _assert_directional(loss, value, gradient, 20 + index, rounding, what=name)


# (the whole model's backward against central differences: tests/test_modern_decoder.py, whose families
# include the two Gemmas)


# ---- PyTorch and JAX ------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["gemma2-tiny", "gemma3-tiny"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_frameworks_equal_the_golden_at_float64(preset, framework):
    cfg = get_preset(preset)
    params = conformance_params(cfg)
    ids = rng(8).integers(1, cfg.tgt_vocab_size, (2, 10))
    ids[1, :3] = cfg.pad_id
    reference = golden.forward(cfg, params, None, ids)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        from impl_torch import Transformer
        model = Transformer.from_params(cfg, params, dtype=torch.float64)
        with torch.no_grad():
            forward = model(None, ids).numpy()
    else:
        jax = pytest.importorskip("jax")
        from impl_jax import Transformer
        with jax.enable_x64(True):  # float64 exists in JAX inside x64 mode only
            model = Transformer.from_params(cfg, params, dtype="float64")
            _check_model(model, cfg, params, ids, reference, np.asarray(model(None, ids)))
        return
    _check_model(model, cfg, params, ids, reference, forward)


def _check_model(model, cfg, params, ids, reference, forward):
    """forward, a cached decode in two chunks, and greedy tokens, against the golden."""
    assert_agrees(forward, reference, **model_bounds(cfg, 10), what="forward")
    cache = model.start_cache(2, 10)
    first, cache = model.decode_step(cache, ids[:, :6])
    second, cache = model.decode_step(cache, ids[:, 6:])
    assert_agrees(np.concatenate([np.asarray(first), np.asarray(second)], axis=1), reference, **model_bounds(cfg, 10),
                  what="cached decode")
    tokens, step_logits = golden.greedy_generate(cfg, params, prompt_ids=ids, max_new_tokens=5,
                                                 return_step_logits=True)
    # the golden's tokens, or a near-tie within the logits' tolerance (SPEC §8), as the generate cells judge
    bounds = model_bounds(cfg, 15)
    generated = compare_generation(np.asarray(model.greedy_generate(prompt_ids=ids, max_new_tokens=5)), tokens,
                                   step_logits, tolerance("float64", bounds["n"], bounds["depth"], bounds["angle"]),
                                   None)
    assert generated.passed, generated.reason
