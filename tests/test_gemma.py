"""Gemma's layer (SPEC.md §5.13) and per-layer attention kinds (§6): softcaps before the mask,
RMSNorm by (1 + w), post norms, the query scalar, sliding and full layers with their own rotary,
in the golden, PyTorch and JAX, each property shown failing where it is broken."""

import numpy as np
import pytest

import impl_numpy as golden
from impl_numpy import backward
from spec import ConfigError, ModelConfig, conformance_params, get_preset, init_params, param_shapes, params_under
from spec.masks import causal_mask

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
    ({"layer_types": ("sliding", "local")}, "layer_types must hold full or sliding; got local"),
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
    scales = params["decoder.layers.0.ffn_norm.scale"]
    assert np.abs(scales).max() <= 0.2 and np.abs(scales).min() > 0  # γ in (0.8, 1.2), never 1
    assert 2.4 <= (1 + params["decoder.layers.0.ffn_post_norm.scale"]).min()  # the FFN's gain of 3 (SPEC §4.1)
    assert (1 + params["decoder.layers.0.self_attn_post_norm.scale"]).max() <= 0.6  # the attention's 0.5


# ---- the golden's semantics ----------------------------------------------------------------------

def test_the_softcap_bends_scores_and_comes_before_the_mask():
    q, k, v = (3 * rng(1).standard_normal((1, 2, 6, 8)) for _ in range(3))  # scores up to about 20
    mask = causal_mask(6)
    capped = golden.scaled_dot_product_attention(q, k, v, mask, cap=2.0)
    plain = golden.scaled_dot_product_attention(q, k, v, mask)
    assert np.abs(capped - plain).max() > 0.1
    # the first query sees one key: its output is that key's value, whatever the cap does to the others
    np.testing.assert_allclose(capped[..., 0, :], v[..., 0, :], atol=1e-15)
    scores = golden.softcap(q @ k.swapaxes(-1, -2) / np.sqrt(8), 2.0)
    assert np.abs(scores).max() <= 2.0 and np.abs(q @ k.swapaxes(-1, -2) / np.sqrt(8)).max() > 10


def test_rmsnorm_by_one_plus_w_and_the_query_scalar():
    cfg = GEMMA2
    x = rng(2).standard_normal((2, 3, cfg.d_model))
    zero = {"scale": np.zeros(cfg.d_model)}
    np.testing.assert_allclose(golden.norm(cfg, zero, x), golden.rms_norm(x, 1.0, None, cfg.norm_eps), atol=1e-15)
    assert cfg.score_scale == 0.25 and get_preset("llama-tiny").score_scale == 1 / np.sqrt(8)


def test_post_norms_are_applied_to_the_sublayer_output_before_the_sum():
    cfg, p = GEMMA2, golden.cast_params(GEMMA2, conformance_params(GEMMA2))
    layer = params_under(p, "decoder.layers.0")
    x = rng(3).standard_normal((2, 5, cfg.d_model))
    ffn = lambda h: golden.feed_forward(params_under(layer, "ffn"), h, cfg.activation)  # noqa: E731
    expected = x + golden.norm(cfg, params_under(layer, "ffn_post_norm"),
                               ffn(golden.norm(cfg, params_under(layer, "ffn_norm"), x)))
    np.testing.assert_allclose(golden.ffn_block(cfg, layer, x), expected, atol=1e-14)
    llama_block = golden.ffn_block(cfg.replace(post_norms=False), layer, x)
    assert np.abs(llama_block - expected).max() > 0.1


def test_the_final_softcap_bounds_the_logits():
    cfg, p = GEMMA2, golden.cast_params(GEMMA2, conformance_params(GEMMA2))
    ids = rng(4).integers(1, cfg.tgt_vocab_size, (2, 9))
    logits = golden.model_logits(cfg, p, None, ids)
    uncapped = golden.model_logits(cfg.replace(final_softcap=None), p, None, ids)
    assert np.abs(logits).max() < cfg.final_softcap
    np.testing.assert_allclose(logits, cfg.final_softcap * np.tanh(uncapped / cfg.final_softcap), atol=1e-14)
    assert np.abs(logits - uncapped).max() > 0.5  # the conformance weights' logits bend


def test_sliding_and_full_layers_attend_differently():
    """Gemma 3's layers differ by kind: making its first layer full changes the logits (that layer
    sees every earlier key, and rotates by θ 1e6 rescaled); making the full layer sliding does too."""
    cfg, p = GEMMA3, golden.cast_params(GEMMA3, conformance_params(GEMMA3))
    ids = rng(5).integers(1, cfg.tgt_vocab_size, (2, 12))
    logits = golden.model_logits(cfg, p, None, ids)
    for kinds in (("full", "sliding", "full"), ("sliding", "sliding", "sliding")):
        other = cfg.replace(layer_types=kinds)
        assert np.abs(golden.model_logits(other, p, None, ids) - logits).max() > 1e-3, kinds


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
    np.testing.assert_allclose(np.concatenate(steps, axis=1), forward, atol=1e-13)


# ---- the VJPs -----------------------------------------------------------------------------------------

def _directional(f, x, gradient, seed, h=1e-6):
    direction = rng(seed).standard_normal(x.shape)
    return (f(x + h * direction) - f(x - h * direction)) / (2 * h), float((gradient * direction).sum())


def test_the_softcapped_attention_vjp():
    q, k, v, d_out = (2 * rng(7 + i).standard_normal((1, 2, 5, 8)) for i in range(4))
    mask = causal_mask(5)
    d_q, d_k, d_v = backward.scaled_dot_product_attention_vjp(q, k, v, mask, d_out, 0.3, 1.5)
    for index, (value, gradient) in enumerate(((q, d_q), (k, d_k), (v, d_v))):
        def loss(z, index=index):
            args = [q, k, v]
            args[index] = z
            return (golden.scaled_dot_product_attention(*args, mask, 0.3, 1.5) * d_out).sum()
        numeric, analytic = _directional(loss, value, gradient, 20 + index)
        assert numeric == pytest.approx(analytic, rel=1e-7)


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
    np.testing.assert_allclose(forward, reference, atol=1e-12)
    cache = model.start_cache(2, 10)
    first, cache = model.decode_step(cache, ids[:, :6])
    second, cache = model.decode_step(cache, ids[:, 6:])
    np.testing.assert_allclose(np.concatenate([np.asarray(first), np.asarray(second)], axis=1), reference, atol=1e-12)
    tokens = golden.greedy_generate(cfg, params, prompt_ids=ids, max_new_tokens=5)
    np.testing.assert_array_equal(np.asarray(model.greedy_generate(prompt_ids=ids, max_new_tokens=5)), tokens)
