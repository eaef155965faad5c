"""gpt-oss (SPEC §5.16): the preset, the importer and the writer against transformers' own
GptOssForCausalLM: a sink per head, layers alternating a window and full attention, YaRN
untruncated, biases on q, k, v and o, and a mixture whose router has a bias and whose experts are
stored fused, [in, out], gate and up interleaved, with the clamped SwiGLU. Each check is shown
failing on the mistake it is there for (the sinks dropped, the ramp truncated, gate and up read as
halves)."""

import dataclasses

import numpy as np
import pytest

import impl_numpy as golden
from spec import ConfigError, conformance_params, get_preset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from benchmarks.checkpoints import random_checkpoint  # noqa: E402
from conformance.harness import PASS, SKIP  # noqa: E402
from conformance.tolerance import compare  # noqa: E402
from importers import import_huggingface  # noqa: E402
from importers.huggingface_writer import family_of, to_huggingface  # noqa: E402
from tests.test_huggingface import _matrix, _rewrite, _with_config  # noqa: E402
from tests.test_huggingface_modern import (_padded_batch, _tolerance, _transformers_logits,  # noqa: E402
                                           written_round_trip)

GPT_OSS = get_preset("gpt-oss-tiny")


def _gpt_oss(**fields):
    """A random gpt-oss of 3 layers (sliding, full, sliding; a window of 3), 4 query heads of 16 over 2
    key/value heads, d 48, 5 experts of 24, 2 per token, the clamp at 1.5 with gain 1.3 (so that these
    weights' units are clamped), YaRN untruncated (factor 4 over 512, θ 30000), ε 3e-6; fields replace these."""
    return transformers.GptOssConfig(**{
        "vocab_size": 97, "hidden_size": 48, "intermediate_size": 24, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 3,
        "num_local_experts": 5, "num_experts_per_tok": 2, "swiglu_limit": 1.5, "swiglu_alpha": 1.3,
        "max_position_embeddings": 4096, "rms_norm_eps": 3e-6,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 30000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 512},
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **fields})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_checkpoint("gpt_oss", _gpt_oss(), tmp_path_factory.mktemp("gpt_oss") / "hf")


def _interleaving_read_as_halves(tensors):
    """A port's mistake: gate_up_proj's first d_ff columns read as the gate and the rest as up. The
    file rewritten so that a correct reader sees what that port computes."""
    changed = dict(tensors)
    for key in [key for key in tensors if key.endswith("gate_up_proj") or key.endswith("gate_up_proj_bias")]:
        value = tensors[key]
        half = value.shape[-1] // 2
        halves = np.empty_like(value)
        halves[..., 0::2], halves[..., 1::2] = value[..., :half], value[..., half:]
        changed[key] = halves
    return changed


def test_the_golden_equals_transformers_gpt_oss_at_float64(checkpoint, tmp_path):
    """A padded batch and a 300-token prompt (past the window, the sink taking its share from every
    query): transformers' own gpt-oss gives the golden's logits. The golden without the sinks, with
    YaRN's ramp truncated, or on experts whose gate and up were read as halves does not."""
    imported = import_huggingface(checkpoint)
    cfg = imported.config
    assert imported.family == "gpt_oss" and cfg.attention_sinks and cfg.layer_types == ("sliding", "full", "sliding")
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.sliding_window, cfg.norm_eps) == (1.5, 1.3, 3, 3e-6)
    assert cfg.moe.router_bias and cfg.moe.router_softmax == "activation" and cfg.moe.renormalize
    assert cfg.rope_scaling.kind == "yarn" and not cfg.rope_scaling.truncate and cfg.rope_theta == 30000.0
    ids, keep = _padded_batch(cfg)
    long_ids = np.random.default_rng(2).integers(1, cfg.tgt_vocab_size, (1, 300))
    sinkless = {name: value for name, value in imported.params.items() if not name.endswith(".sinks")}
    truncated = cfg.replace(rope_scaling=dataclasses.replace(cfg.rope_scaling, truncate=True))
    halves = import_huggingface(_rewrite(checkpoint, tmp_path / "halves", _interleaving_read_as_halves)).params
    for tokens, real in ((ids, keep), (long_ids, np.ones_like(long_ids, bool))):
        ours = golden.forward(cfg, imported.params, None, tokens, tgt_keep=real)
        tolerance = _tolerance(cfg, tokens.shape[1])
        result = compare(_transformers_logits(checkpoint, cfg, tokens, real), ours, tolerance)
        assert result.passed, result.reason
        # each check can fail
        mistakes = {"sinks dropped": golden.forward(cfg.replace(attention_sinks=False), sinkless, None, tokens,
                                                   tgt_keep=real),
                    "gate and up as halves": golden.forward(cfg, halves, None, tokens, tgt_keep=real)}
        if tokens.shape[1] == 300:  # YaRN's ramp moves a frequency; 9 positions turn it too little to see
            mistakes["ramp truncated"] = golden.forward(truncated, imported.params, None, tokens, tgt_keep=real)
        for mistake, logits in mistakes.items():
            assert not compare(logits, ours, tolerance).passed, mistake


@pytest.mark.parametrize("changes", [{}, {"layer_types": None}, {"layer_types": None, "sliding_window": None}],
                         ids=["sliding-then-full", "every-layer-sliding", "no-window"])
def test_gpt_oss_tiny_written_imports_back_and_runs_in_transformers(tmp_path, changes):
    """Without a sliding layer the writer still gives a window (max_len, which no layer takes):
    GptOssModel builds its sliding mask whatever its layers, and refuses a null window."""
    written_round_trip(GPT_OSS.replace(**changes), tmp_path / "gpt-oss-tiny")


def test_the_transformers_column_passes_gpt_oss_whole_model_cases(checkpoint):
    results = _matrix(checkpoint, ["transformers"], ["float64", "float32"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]


def test_gpt_oss_config_classes_defaults_are_read_where_the_file_has_none(tmp_path, checkpoint):
    """Without rope_parameters, layer_types, sliding_window and the clamp, GptOssConfig's own: YaRN
    (factor 32 over 4096, untruncated) at θ 150000, layers alternating from a sliding one of 128 keys,
    the clamp at 7 with gain 1.702."""
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    for name in ("rope_parameters", "rope_theta", "layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha"):
        config.pop(name, None)
    directory = _with_config(tmp_path, checkpoint)
    (directory / "config.json").write_text(json.dumps(config))
    cfg = import_huggingface(directory).config
    scaling = cfg.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_len, scaling.truncate) == ("yarn", 32.0, 4096, False)
    assert cfg.rope_theta == 150000.0 and cfg.layer_types == ("sliding", "full", "sliding")
    assert (cfg.sliding_window, cfg.swiglu_limit, cfg.swiglu_alpha) == (128, 7.0, 1.702)
    theirs = transformers.AutoConfig.from_pretrained(directory)
    assert theirs.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert theirs.rope_parameters["truncate"] is False and theirs.rope_parameters["rope_theta"] == 150000.0


@pytest.mark.parametrize("changes, message", [
    (dict(attention_bias=False), "attention_bias = false: q, k, v and o without biases while the experts keep"),
    (dict(swiglu_limit=0), "swiglu_limit = 0: the clamped SwiGLU's limit and gain are positive"),
    (dict(sliding_window=None), "layer_types has sliding layers .* but sliding_window is null"),
])
def test_what_gpt_oss_cannot_hold_is_refused_by_field(tmp_path, checkpoint, changes, message):
    with pytest.raises(ConfigError, match=message):
        import_huggingface(_with_config(tmp_path, checkpoint, **changes))


@pytest.mark.parametrize("changes, message", [
    (dict(qkv_bias=False), "qkv_bias = False with gpt-oss's sinks"),
    (dict(moe=None), "moe = None with gpt-oss's sinks"),
    (dict(attention_sinks=False), "attention_sinks = False with gpt-oss's sinks, clamped SwiGLU or router bias"),
])
def test_the_writer_refuses_what_gpt_oss_does_not_hold(tmp_path, changes, message):
    cfg = GPT_OSS.replace(**changes)
    with pytest.raises(ConfigError, match=message):
        to_huggingface(cfg, conformance_params(cfg), tmp_path / "out")


def test_the_writer_refuses_a_router_softmax_in_float32():
    cfg = GPT_OSS.replace(moe=dataclasses.replace(GPT_OSS.moe, router_softmax="float32"))
    with pytest.raises(ConfigError, match="moe.router_softmax = 'float32': gpt-oss's mixture has"):
        family_of(cfg)


def test_neither_genai_nor_ctranslate2_builds_gpt_oss():
    from benchmarks.ctranslate2_peer import unsupported_reason
    from conformance.backends.genai_backend import FAMILIES, family_refusal

    assert "gpt_oss" not in FAMILIES and family_refusal("gpt_oss").startswith("gpt_oss: onnxruntime-genai's builder")
    assert "no gpt-oss loader" in unsupported_reason(GPT_OSS)


def test_a_router_probability_under_float16s_normals_may_round_to_zero_and_no_further():
    """gpt-oss's router softmax is in the activations' dtype: at float16 a probability below 2⁻²⁴ is a
    subnormal or 0, which a relative bound cannot cover (torch's float16 router gave 0 for a golden
    2.3e-8 on gpt-oss-20b's layer shape). Half float16's smallest subnormal is added to the bound: a
    0 there passes, a 2⁻²⁰ fails, and a router whose softmax is float32 keeps float32's floor."""
    from conformance.backends.numpy_backend import golden_output
    from conformance.cases import build_case
    from conformance.diagnosis.routing import compare_router, probability_underflow

    params = conformance_params(GPT_OSS)
    router = "decoder.layers.0.ffn.router.weight"
    params[router] = params[router] * 12  # logits far apart: some probabilities far below float16's normals
    case = build_case(GPT_OSS, params, "router", "none")
    output = {name: np.asarray(value) for name, value in golden_output(GPT_OSS, params, "router",
                                                                         case.inputs).items()}
    tiny = np.argwhere(output["probabilities"] < 2.0 ** -24)[0]
    for held, passes in ((0.0, True), (2.0 ** -20, False)):
        probabilities = output["probabilities"].copy()
        probabilities[tuple(tiny)] = held
        found = compare_router(GPT_OSS, params, case, {**output, "probabilities": probabilities}, "float16")
        assert found.passed == passes, found.reason
    float32_router = GPT_OSS.replace(moe=dataclasses.replace(GPT_OSS.moe, router_softmax="float32"))
    assert probability_underflow(GPT_OSS, "float16") == 2.0 ** -25
    assert probability_underflow(float32_router, "float16") == 2.0 ** -150


# ---- the published files' MXFP4 experts ----

@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A random gpt-oss (d 64, experts of 32: whole blocks of 32 inputs) whose experts are stored as the
    published files store them: MXFP4 blocks and scales (random bytes, scales 2⁻⁶ … 2⁻²)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    config = _gpt_oss(hidden_size=64, intermediate_size=32, num_hidden_layers=2)
    directory = random_checkpoint("gpt_oss", config, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "hf")
    quantized = shutil.copytree(directory, directory.parent / "mxfp4")
    tensors, rng = load_file(quantized / "model.safetensors"), np.random.default_rng(0)
    for key in [key for key in tensors if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = tensors.pop(key).shape
        tensors[f"{key}_blocks"] = rng.integers(0, 256, (experts, n_out, n_in // 32, 16), dtype=np.uint8)
        tensors[f"{key}_scales"] = rng.integers(121, 126, (experts, n_out, n_in // 32), dtype=np.uint8)
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    written = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**written, "quantization_config": {"quant_method": "mxfp4"}}))
    return quantized


def test_mxfp4_experts_are_dequantized_as_transformers_dequantizes_them(mxfp4_checkpoint, tmp_path):
    """The import of the MXFP4 file is bit for bit the import of the same file dequantized by
    transformers' own convert_moe_packed_tensors (its loader's, which needs accelerate here)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from spec import params_digest

    imported = import_huggingface(mxfp4_checkpoint)
    assert any("MXFP4" in note and "dequantized exactly" in note for note in imported.notes)

    def dequantized_by_transformers(tensors):
        plain = {key: value for key, value in tensors.items() if not key.endswith(("_blocks", "_scales"))}
        for key in [key for key in tensors if key.endswith("_blocks")]:
            stem = key.removesuffix("_blocks")
            plain[stem] = convert_moe_packed_tensors(torch.from_numpy(tensors[key]), torch.from_numpy(
                tensors[f"{stem}_scales"]), dtype=torch.float32).numpy()
        return plain

    plain = _rewrite(mxfp4_checkpoint, tmp_path / "plain", dequantized_by_transformers)
    assert params_digest(import_huggingface(plain).params) == params_digest(imported.params)
    # and not as halves of a byte read the other way round (the high nibble first)
    swapped = _rewrite(mxfp4_checkpoint, tmp_path / "swapped", lambda tensors: {
        key: ((value << 4) | (value >> 4)).astype(np.uint8) if key.endswith("_blocks") else value
        for key, value in tensors.items()})
    assert params_digest(import_huggingface(swapped).params) != params_digest(imported.params)


def test_an_mxfp4_part_without_its_pair_or_another_quantization_is_refused(mxfp4_checkpoint, tmp_path):
    from spec import WeightsError

    lonely = _rewrite(mxfp4_checkpoint, tmp_path / "lonely", lambda tensors: {
        key: value for key, value in tensors.items() if key != "model.layers.0.mlp.experts.down_proj_scales"})
    with pytest.raises(WeightsError, match="MXFP4 tensors without their pair: missing "
                                           "model.layers.0.mlp.experts.down_proj_scales"):
        import_huggingface(lonely)
    with pytest.raises(ConfigError, match='quant_method = "bitsandbytes": the importer reads'):
        import_huggingface(_with_config(tmp_path, mxfp4_checkpoint,
                                        quantization_config={"quant_method": "bitsandbytes"}))
