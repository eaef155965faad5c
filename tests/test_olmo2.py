"""OLMo 2's layer (SPEC §5.7, §5.11): each sublayer's output normed before the residual sum, and q and k
each normed over its whole projection. The config, the golden's forms and their backward, the golden
against transformers' own OLMo 2, the importer and the writer, and what a port that places the norms
as Llama does gets."""

import numpy as np
import pytest

import impl_numpy as golden
from impl_numpy import backward
from spec import ConfigError, conformance_params, get_preset, params_under

OLMO2 = get_preset("olmo2-tiny")


def _layer_input(cfg, seed=0):
    return np.random.default_rng(seed).normal(size=(2, 5, cfg.d_model))


def test_an_output_norm_is_the_sublayers_output_normed_before_the_sum():
    params = conformance_params(OLMO2)
    layer, x = params_under(params, "decoder.layers.0"), _layer_input(OLMO2)
    ffn = params_under(layer, "ffn")
    expected = x + golden.rms_norm(golden.feed_forward(ffn, x, "swish"), layer["ffn_norm.scale"], None, 1e-6)
    assert np.allclose(golden.ffn_block(OLMO2, layer, x), expected, rtol=1e-12, atol=1e-12)
    # Llama's block on the same tensors is another model
    assert not np.allclose(golden.ffn_block(OLMO2.replace(norm_position="pre"), layer, x), expected, atol=1e-3)


def test_a_projection_norm_takes_one_root_mean_square_over_all_heads():
    params = params_under(conformance_params(OLMO2), "decoder.layers.0.self_attn")
    assert params["q_norm.scale"].shape == (64,) and params["k_norm.scale"].shape == (32,)
    x = _layer_input(OLMO2)
    projected = golden.linear(x, params["q.weight"])  # [B, T, H·d_k]
    expected = golden.split_heads(golden.rms_norm(projected, params["q_norm.scale"], None, 1e-6), 4)
    heads = golden.split_heads(projected, 4)
    assert np.allclose(golden.head_norm(OLMO2, params, "q", heads), expected, rtol=1e-12, atol=1e-12)
    # each head by its own root mean square (the scale viewed [H, 1, d_k]) is another model
    per_head = golden.rms_norm(heads, params["q_norm.scale"].reshape(4, 1, 16), None, 1e-6)
    assert not np.allclose(per_head, expected, atol=1e-3)


@pytest.mark.parametrize("name", ["ffn_block", "head_norm"])
def test_the_golden_backward_of_olmo2s_forms_matches_finite_differences(name):
    """The VJPs of the output norm's block and of the projection norm against central differences, on
    random directions (float64)."""
    cfg, rng = OLMO2, np.random.default_rng(1)
    params = params_under(conformance_params(cfg), "decoder.layers.1")
    if name == "ffn_block":
        x = _layer_input(cfg, 2)
        forward = lambda x: golden.ffn_block(cfg, params, x)  # noqa: E731
        d_y = rng.normal(size=x.shape)
        d_x, _ = backward.ffn_block_vjp(cfg, params, x, d_y)
    else:
        attention = params_under(params, "self_attn")
        x = rng.normal(size=(2, 2, 5, 16))  # k's 2 heads
        forward = lambda x: golden.head_norm(cfg, attention, "k", x)  # noqa: E731
        d_y = rng.normal(size=x.shape)
        d_x, grads = backward.head_norm_vjp(cfg, attention, "k", x, d_y)
        assert grads["k_norm.scale"].shape == (32,)
    direction, step = rng.normal(size=x.shape), 1e-6
    numeric = np.sum(d_y * (forward(x + step * direction) - forward(x - step * direction))) / (2 * step)
    assert np.isclose(np.sum(d_x * direction), numeric, rtol=1e-6)


@pytest.mark.parametrize("changes, message", [
    (dict(qk_norm_scope="layer"), "qk_norm_scope must be one of head, projection"),
    (dict(qk_norm=False), "qk_norm is false"),
    (dict(norm_position="after"), "norm_position must be one of post, pre, output"),
])
def test_bad_olmo2_fields_are_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        OLMO2.replace(**changes)


def test_an_output_norm_needs_a_decoder_only_model():
    with pytest.raises(ConfigError, match="norm_position='output'.*decoder-only"):
        get_preset("tiny").replace(norm_position="output")


def test_olmo2s_fields_round_trip_and_are_absent_at_their_defaults():
    assert type(OLMO2).from_json(OLMO2.to_json()) == OLMO2
    assert "qk_norm_scope" not in get_preset("qwen3-tiny").to_dict()


# ---- against transformers' own OLMo 2 ----

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from benchmarks.checkpoints import random_checkpoint  # noqa: E402
from conformance.harness import PASS, SKIP  # noqa: E402
from conformance.tolerance import compare  # noqa: E402
from importers import import_huggingface  # noqa: E402
from importers.huggingface_writer import to_huggingface  # noqa: E402
from tests.test_huggingface import _matrix, _with_config  # noqa: E402
from tests.test_huggingface_modern import (_padded_batch, _tolerance, _transformers_logits,  # noqa: E402
                                           written_round_trip)


def _olmo2(**fields):
    """A random OLMo 2 of 3 layers: 4 query heads of 16 over 2 key/value heads, d 48, eps 3e-6."""
    return transformers.Olmo2Config(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=3e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 300000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **fields)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_checkpoint("olmo2", _olmo2(), tmp_path_factory.mktemp("olmo2") / "hf")


def test_the_golden_equals_transformers_olmo2_at_float64(checkpoint):
    """A padded batch and a 300-token prompt: transformers' own OLMo 2 gives the golden's logits, and
    the same tensors in Llama's block do not."""
    imported = import_huggingface(checkpoint)
    cfg = imported.config
    assert imported.family == "olmo2" and cfg.norm_position == "output" and cfg.qk_norm_scope == "projection"
    assert (cfg.norm_eps, cfg.rope_theta, cfg.d_head, cfg.kv_heads) == (3e-6, 300000.0, 16, 2)
    ids, keep = _padded_batch(cfg)
    long_ids = np.random.default_rng(2).integers(1, cfg.tgt_vocab_size, (1, 300))
    for tokens, real in ((ids, keep), (long_ids, np.ones_like(long_ids, bool))):
        ours = golden.forward(cfg, imported.params, None, tokens, tgt_keep=real)
        tolerance = _tolerance(cfg, tokens.shape[1])
        result = compare(_transformers_logits(checkpoint, cfg, tokens, real), ours, tolerance)
        assert result.passed, result.reason
        llama = golden.forward(cfg.replace(norm_position="pre"), imported.params, None, tokens, tgt_keep=real)
        assert not compare(llama, ours, tolerance).passed  # the check can fail


def test_olmo2_tiny_written_imports_back_and_runs_in_transformers(tmp_path):
    written_round_trip(OLMO2, tmp_path / "olmo2-tiny")


@pytest.mark.parametrize("changes, message", [
    (dict(qk_norm_scope="head"), "qk_norm_scope = 'head' with norm_position 'output'"),
    (dict(qkv_bias=True), "qkv_bias = True with norm_position 'output'"),
    (dict(nope_layers=(1,)), "nope_layers = \\(1,\\) with norm_position 'output'"),
])
def test_the_writer_refuses_what_olmo2_does_not_hold(tmp_path, changes, message):
    cfg = OLMO2.replace(**changes)
    with pytest.raises(ConfigError, match=message):
        to_huggingface(cfg, conformance_params(cfg), tmp_path / "out")


def test_the_writer_refuses_a_projection_norm_in_llamas_block(tmp_path):
    cfg = OLMO2.replace(norm_position="pre")
    with pytest.raises(ConfigError, match="qk_norm_scope = 'projection' with norm_position = 'pre'"):
        to_huggingface(cfg, conformance_params(cfg), tmp_path / "out")


def test_olmo2s_attention_biases_are_refused_by_field(tmp_path, checkpoint):
    directory = _with_config(tmp_path, checkpoint, attention_bias=True)
    with pytest.raises(ConfigError, match="attention_bias = true: q, k, v and o biases without the MLP's"):
        import_huggingface(directory)


def test_the_transformers_column_passes_olmo2s_whole_model_cases(checkpoint):
    results = _matrix(checkpoint, ["transformers"], ["float64", "float32"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]


def test_neither_genai_nor_ctranslate2_builds_olmo2():
    from benchmarks.ctranslate2_peer import unsupported_reason
    from conformance.backends.genai_backend import FAMILIES, family_refusal

    assert "olmo2" not in FAMILIES and family_refusal("olmo2").startswith("olmo2: onnxruntime-genai's builder")
    assert "no OLMo 2 loader" in unsupported_reason(OLMO2)


def test_a_gradient_beyond_float16s_range_in_the_golden_is_not_judged_at_float16():
    """SPEC §13: OLMo 2's output norm meets a fully masked query row's zero attention output, whose
    backward is 1/√ε = 1000 times its upstream: on grad-forward-pad_left the golden's chain carries
    7.44e4 into layer 0's o, past float16's 65504. A float16 column's non-finite gradients there are
    not judged, saying so; its finite ones are judged as ever, and a non-finite one where the chain
    stays in range (float32 here, or llama-tiny at float16) still fails."""
    from conformance.backends.numpy_backend import NumpyRunner, golden_output
    from conformance.cases import build_case

    params = conformance_params(OLMO2)
    case = build_case(OLMO2, params, "grad-forward", "pad_left")
    reference = golden_output(OLMO2, params, "grad-forward", case.inputs, NumpyRunner(OLMO2, params, "float64"))
    assert 7.4e4 < reference.largest_cotangent < 7.5e4  # torch's float64 autograd: 74,401.8 at o's output
    overflowed = {**reference.gradients, "decoder.layers.0.self_attn.o.weight": np.full((64, 52), np.nan)}
    assert "cotangent of 7.44e+04" in reference.beyond_range("float16", overflowed)
    assert reference.beyond_range("float16", reference.gradients) is None  # finite: judged
    assert reference.beyond_range("float32", overflowed) is None  # in float32's range: the NaN fails
    llama = get_preset("llama-tiny")
    llama_params = conformance_params(llama)
    llama_case = build_case(llama, llama_params, "grad-forward", "pad_left")
    in_range = golden_output(llama, llama_params, "grad-forward", llama_case.inputs)
    assert in_range.largest_cotangent < 100
    assert in_range.beyond_range("float16", {"x": np.array([np.nan])}) is None
