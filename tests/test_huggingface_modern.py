"""Hugging Face's modern decoders (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3) through the
importer and the transformers column.

Models are built here from configs with random weights (nothing is downloaded), at odd sizes:
vocabularies that are not powers of two, grouped-query attention with 2 groups (Llama, Qwen3),
multi-query attention (Qwen2), a Qwen3 head_dim apart from hidden / heads, rope_theta away from
its default. Every parameter is perturbed: norm scales away from 1, biases away from 0, so a
mapping that swapped gate_proj and up_proj, or q_norm and k_norm, could not pass by accident.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
torch = pytest.importorskip("torch")

import impl_numpy as golden  # noqa: E402
from benchmarks.checkpoints import random_checkpoint as build_checkpoint  # noqa: E402
from conformance.backends.transformers_backend import TransformersRunner  # noqa: E402
from conformance.harness import PASS, SKIP  # noqa: E402
from conformance.tolerance import compare, tolerance  # noqa: E402
from importers import import_huggingface  # noqa: E402
from importers.huggingface import mapping_markdown  # noqa: E402
from spec import ConfigError, RopeScaling, WeightsError  # noqa: E402
from tests.bounds import model_bounds  # noqa: E402
from tests.test_huggingface import _matrix, _rewrite, _with_config  # noqa: E402

FAMILY_CONFIGS = {
    # 6 query heads of 8 over 3 key/value heads (2 groups), untied head
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, bos_token_id=1, eos_token_id=2,
        pad_token_id=0),
    # SmolLM2's tied head, with every bias Llama can have; multi-head (5 of 8), no pad token
    "llama-tied": lambda: transformers.LlamaConfig(
        vocab_size=103, hidden_size=40, intermediate_size=68, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=5, max_position_embeddings=2048, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        bos_token_id=0, eos_token_id=[102, 101]),
    # multi-query: 4 query heads of 10 over 1 key/value head; q/k/v biases; tied
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=101, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=100, eos_token_id=100),
    # head_dim 12 where hidden / heads is 9; 2 key/value heads; q/k head norms; untied
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=89, hidden_size=36, intermediate_size=60, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, pad_token_id=0, eos_token_id=1),
    # a sliding window of 5 keys, shorter than the cases' sequences; 4 query heads of 14 over 2 key/value heads
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=107, hidden_size=56, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, sliding_window=5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=2),
    # Phi-3's fused qkv_proj and gate_up_proj; half of each head rotates (6 of 12 dimensions); a window of 5;
    # 5 query heads over 1 key/value head, so the fused blocks have three different widths
    "phi3": lambda: transformers.Phi3Config(
        vocab_size=103, hidden_size=60, intermediate_size=76, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-5, sliding_window=5,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Qwen2 with a window of 3 keys in its second layer only (max_window_layers 1; layer_types written)
    "qwen2-windowed": lambda: transformers.Qwen2Config(
        vocab_size=101, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, use_sliding_window=True,
        sliding_window=3, max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=100, eos_token_id=100),
    # Gemma 2: (1 + w) norms, four a layer; scores by 1/sqrt(16) with head_dim 20; softcaps of 3 and 4, low
    # enough to bend these weights' scores and logits; layers sliding (window 5), full, sliding
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=131, hidden_size=72, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=20, query_pre_attn_scalar=16, sliding_window=5, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, pad_token_id=0, bos_token_id=2,
        eos_token_id=1),
    # Gemma 3 (text): q/k norms; two sliding layers (window 5, theta 10000, unrescaled) then a full one
    # (theta 1e6, linear scaling by 8); query_pre_attn_scalar 24 with head_dim 16; multi-query
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        vocab_size=139, hidden_size=60, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, sliding_window_pattern=3,
        max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=0, bos_token_id=2, eos_token_id=1),
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3_text": "Gemma3ForCausalLM"}


def _build(kind: str, directory, seed: int = 0):
    return build_checkpoint(kind.split("-")[0], FAMILY_CONFIGS[kind](), directory, seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-modern")
    return {kind: _build(kind, root / kind) for kind in FAMILY_CONFIGS}


def _padded_batch(cfg, seed=0):
    """Real tokens (never pad_id) padded three ways: none, at the end, at the start (where the
    slot positions and transformers' count of real tokens differ)."""
    rng = np.random.default_rng(seed)
    length = 9
    ids = rng.integers(0, cfg.tgt_vocab_size - 1, (3, length))
    ids = np.where(ids >= cfg.pad_id, ids + 1, ids)
    keep = np.ones((3, length), bool)
    keep[1, 6:] = False
    keep[2, :4] = False
    return np.where(keep, ids, cfg.pad_id), keep


def _transformers_logits(directory, cfg, ids, keep, dtype="float64", widened=True):
    """transformers' logits with the slot positions; ``widened``: through the column's runner, whose
    float64 run evaluates RMSNorm and the rotary tables in float64; else the model as loaded."""
    if widened:
        model = TransformersRunner(directory, cfg, dtype, "cpu").model
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype),
                                                                  attn_implementation="sdpa").eval()
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.inference_mode():
        return model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(keep.astype(np.int64)),
                     position_ids=positions).logits.numpy()


def _tolerance(cfg, length, dtype="float64"):
    """SPEC §8's tolerance for the logits of a batch `length` positions long, at dtype (the whole
    model's n, depth and rotary angle: tests.bounds.model_bounds)."""
    bounds = model_bounds(cfg, length)
    return tolerance(dtype, bounds["n"], bounds["depth"], bounds["angle"])


# ---- the golden equals transformers at float64 ------------------------------------------------------

@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_the_golden_equals_transformers_at_float64(checkpoints, kind):
    imported = import_huggingface(checkpoints[kind])
    cfg = imported.config
    ids, keep = _padded_batch(cfg)
    ours = golden.forward(cfg, imported.params, None, ids, tgt_keep=keep)
    theirs = _transformers_logits(checkpoints[kind], cfg, ids, keep)
    result = compare(theirs, ours, _tolerance(cfg, ids.shape[1]))
    assert result.passed, result.reason


def test_transformers_float64_llama_normalises_and_rotates_in_float32(checkpoints):
    """Why the column's float64 run widens RMSNorm and the rotary tables: as loaded, a float64
    Llama differs from the golden by float32's rounding: beyond float64's tolerance, within float32's."""
    imported = import_huggingface(checkpoints["llama"])
    cfg = imported.config
    ids, keep = _padded_batch(cfg)
    ours = golden.forward(cfg, imported.params, None, ids, tgt_keep=keep)
    as_loaded = _transformers_logits(checkpoints["llama"], cfg, ids, keep, widened=False)
    assert not compare(as_loaded, ours, _tolerance(cfg, ids.shape[1])).passed
    assert compare(as_loaded, ours, _tolerance(cfg, ids.shape[1], "float32")).passed


@pytest.mark.parametrize("kind", ["llama", "phi3", "gemma2", "gemma3_text"])
def test_the_float64_check_can_fail(checkpoints, kind):
    """gate_proj and up_proj swapped (W1 and W3; Phi-3: the two halves of gate_up_proj read the
    wrong way round): the comparison that passed above fails."""
    imported = import_huggingface(checkpoints[kind])
    cfg, params = imported.config, dict(imported.params)
    a, b = "decoder.layers.1.ffn.w1.weight", "decoder.layers.1.ffn.w3.weight"
    params[a], params[b] = params[b], params[a]
    ids, keep = _padded_batch(cfg)
    wrong = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    result = compare(_transformers_logits(checkpoints[kind], cfg, ids, keep), wrong,
                     _tolerance(cfg, ids.shape[1]))
    assert not result.passed


def test_phi3s_fused_projections_are_split_by_rows(checkpoints):
    """q, k, v are qkv_proj's row blocks of H·d_k, H_kv·d_k, H_kv·d_k (60, 12, 12 here); the gate is
    gate_up_proj's first d_ff rows, up the rest; each transposed to the spec's [in, out]."""
    from safetensors.numpy import load_file

    imported = import_huggingface(checkpoints["phi3"])
    stored = load_file(str(checkpoints["phi3"] / "model.safetensors"))
    qkv, gate_up = stored["model.layers.1.self_attn.qkv_proj.weight"], stored["model.layers.1.mlp.gate_up_proj.weight"]
    assert qkv.shape == (84, 60) and gate_up.shape == (152, 60)
    layer = {name.removeprefix("decoder.layers.1."): value for name, value in imported.params.items()
             if name.startswith("decoder.layers.1.")}
    np.testing.assert_array_equal(layer["self_attn.q.weight"], qkv[:60].T)
    np.testing.assert_array_equal(layer["self_attn.k.weight"], qkv[60:72].T)
    np.testing.assert_array_equal(layer["self_attn.v.weight"], qkv[72:].T)
    np.testing.assert_array_equal(layer["ffn.w1.weight"], gate_up[:76].T)
    np.testing.assert_array_equal(layer["ffn.w3.weight"], gate_up[76:].T)
    cfg = imported.config
    assert (cfg.rope_fraction, cfg.rotary_dim, cfg.sliding_window, cfg.n_kv_heads, cfg.qkv_bias, cfg.bias) == (
        0.5, 6, 5, 1, False, False)


def test_every_tensor_of_the_checkpoint_is_imported(checkpoints):
    for kind, directory in checkpoints.items():
        model = getattr(transformers, CLASSES[kind.split("-")[0]]).from_pretrained(directory)
        hf_count = sum(p.numel() for p in model.parameters())  # tied tensors once
        assert sum(v.size for v in import_huggingface(directory).params.values()) == hf_count, kind


def test_the_imported_configs(checkpoints):
    llama = import_huggingface(checkpoints["llama"]).config
    assert (llama.arch, llama.norm, llama.norm_position, llama.final_norm, llama.positional, llama.gated_ffn,
            llama.activation, llama.embed_scale) == ("decoder-only", "rmsnorm", "pre", True, "rope", True, "swish",
                                                      False)
    assert (llama.n_heads, llama.n_kv_heads, llama.d_head, llama.head_dim, llama.rope_theta, llama.norm_eps,
            llama.qkv_bias, llama.bias, llama.tie_head, llama.pad_id, llama.max_len) == (
        6, 3, 8, None, 5000.0, 1e-5, False, False, False, 0, 2048)
    tied = import_huggingface(checkpoints["llama-tied"])
    assert (tied.config.qkv_bias, tied.config.bias, tied.config.tie_head, tied.config.n_kv_heads,
            tied.config.pad_id) == (True, True, True, None, 102)
    assert any("eos_token_id (102)" in note for note in tied.notes)
    qwen2 = import_huggingface(checkpoints["qwen2"]).config
    assert (qwen2.n_kv_heads, qwen2.qkv_bias, qwen2.bias, qwen2.tie_head, qwen2.rope_theta, qwen2.qk_norm) == (
        1, True, False, True, 1e6, False)
    qwen3 = import_huggingface(checkpoints["qwen3"]).config
    assert (qwen3.head_dim, qwen3.d_head, qwen3.n_kv_heads, qwen3.qk_norm, qwen3.qkv_bias, qwen3.bias,
            qwen3.tie_head) == (12, 12, 2, True, False, False, False)
    windowed = import_huggingface(checkpoints["qwen2-windowed"]).config
    assert (windowed.sliding_window, windowed.layer_types, windowed.layer_windows) == (3, ("full", "sliding"), (None, 3))
    gemma2 = import_huggingface(checkpoints["gemma2"]).config
    assert (gemma2.norm_scale_plus_one, gemma2.post_norms, gemma2.embed_scale, gemma2.activation, gemma2.tie_head,
            gemma2.query_pre_attention_scalar, gemma2.attention_softcap, gemma2.final_softcap, gemma2.layer_types,
            gemma2.sliding_window, gemma2.qk_norm, gemma2.local_rope_theta) == (
        True, True, True, "gelu-tanh", True, 16.0, 3.0, 4.0, ("sliding", "full", "sliding"), 5, False, None)
    gemma3 = import_huggingface(checkpoints["gemma3_text"]).config
    assert (gemma3.qk_norm, gemma3.layer_types, gemma3.local_rope_theta, gemma3.rope_theta, gemma3.rope_scaling.kind,
            gemma3.rope_scaling.factor, gemma3.attention_softcap, gemma3.final_softcap) == (
        True, ("sliding", "sliding", "full"), 10000.0, 1e6, "linear", 8.0, None, None)
    assert (gemma3.layer(0).rope_theta, gemma3.layer(0).rope_scaling, gemma3.layer(2).rope_theta) == (1e4, None, 1e6)


def test_gemmas_four_norms_are_mapped_by_role(checkpoints):
    """Gemma's post_attention_layernorm is the attention's post norm (Llama's is the FFN's norm), and
    its norms store w for a scale of 1 + w: copied as stored."""
    from safetensors.numpy import load_file

    imported = import_huggingface(checkpoints["gemma2"])
    stored = load_file(str(checkpoints["gemma2"] / "model.safetensors"))
    for theirs, ours in (("input_layernorm", "self_attn_norm"), ("post_attention_layernorm", "self_attn_post_norm"),
                         ("pre_feedforward_layernorm", "ffn_norm"), ("post_feedforward_layernorm", "ffn_post_norm")):
        np.testing.assert_array_equal(imported.params[f"decoder.layers.1.{ours}.scale"],
                                      stored[f"model.layers.1.{theirs}.weight"])
    # about 0, Gemma's identity (1 off were 1 added): the checkpoint draws each of the d scales as 0.2·N(0, 1)
    # (benchmarks.checkpoints.random_checkpoint), so their mean is within 5 standard errors, 5 · 0.2 / √d
    scale = imported.params["decoder.layers.1.ffn_norm.scale"]
    assert abs(float(np.mean(scale))) < 5 * 0.2 / np.sqrt(scale.size)


def test_mapping_tables_for_the_new_families():
    llama, qwen2, qwen3, phi3 = (mapping_markdown(family) for family in ("llama", "qwen2", "qwen3", "phi3"))
    assert ("| `model.layers.{i}.self_attn.qkv_proj.weight` | `decoder.layers.{i}.self_attn.k.weight` | "
            "rows H·d_k … (H + H_kv)·d_k − 1, transposed |") in phi3
    assert "| `model.layers.{i}.mlp.gate_up_proj.weight` | `decoder.layers.{i}.ffn.w1.weight` | rows 0 … d_ff − 1" in phi3
    assert "| `model.layers.{i}.mlp.gate_proj.weight` | `decoder.layers.{i}.ffn.w1.weight` | transposed" in llama
    assert "| `model.layers.{i}.mlp.up_proj.weight` | `decoder.layers.{i}.ffn.w3.weight` |" in llama
    assert "lm_head.weight" in llama and "lm_head.weight" not in qwen2  # Qwen2's example is tied
    assert "`model.layers.{i}.self_attn.q_proj.bias`" in qwen2 and "o_proj.bias" not in qwen2
    assert "| `model.layers.{i}.self_attn.k_norm.weight` | `decoder.layers.{i}.self_attn.k_norm.scale` |" in qwen3


# ---- both spellings of rope_theta ----------------------------------------------------------------------

def test_rope_theta_is_read_from_rope_parameters_and_from_the_older_top_level_field(tmp_path, checkpoints):
    """transformers 5 writes rope_parameters; files from before it have rope_theta and rope_scaling
    at the top level. Both give the same import, and transformers reads the older one the same."""
    new = import_huggingface(checkpoints["qwen3"])
    older = tmp_path / "older"
    _with_config(tmp_path, checkpoints["qwen3"], rope_theta=1000000.0, rope_scaling=None).rename(older)
    config = json.loads((older / "config.json").read_text())
    del config["rope_parameters"]
    (older / "config.json").write_text(json.dumps(config))
    assert import_huggingface(older).config == new.config
    assert transformers.AutoConfig.from_pretrained(older).rope_parameters["rope_theta"] == 1000000.0
    missing = _with_config(tmp_path, checkpoints["llama"], rope_parameters=None)  # neither: the default
    assert import_huggingface(missing).config.rope_theta == 10000.0


def test_qwen_configs_as_published_are_accepted(tmp_path, checkpoints):
    """Qwen2.5's files carry a sliding_window that use_sliding_window false turns off, and a
    sliding window from max_window_layers on that a shallower model never reaches."""
    published = _with_config(tmp_path, checkpoints["qwen2"], use_sliding_window=False, sliding_window=32768,
                             max_window_layers=21, layer_types=None, rope_parameters=None, rope_theta=1000000.0,
                             rope_scaling=None)
    assert import_huggingface(published).config == import_huggingface(checkpoints["qwen2"]).config
    (published / "config.json").write_text(json.dumps({**json.loads((published / "config.json").read_text()),
                                                       "use_sliding_window": True, "max_window_layers": 2}))
    assert import_huggingface(published).config.n_decoder_layers == 2


# ---- refusals -----------------------------------------------------------------------------------------

def test_a_mismatched_checkpoint_gets_the_whole_key_diff(tmp_path, checkpoints):
    def damage(tensors):
        tensors.pop("model.layers.1.mlp.up_proj.weight")
        tensors["model.layers.0.self_attn.key_norm.weight"] = tensors.pop("model.layers.0.self_attn.k_norm.weight")
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].T.copy()
        return tensors

    with pytest.raises(WeightsError) as error:
        import_huggingface(_rewrite(checkpoints["qwen3"], tmp_path / "damaged", damage))
    message = str(error.value)
    assert "missing: model.layers.0.self_attn.k_norm.weight, model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight: shape [36, 24], expected [24, 36]" in message
    assert "unexpected: model.layers.0.self_attn.key_norm.weight" in message


def test_a_tied_head_may_be_stored_only_as_an_equal_copy(tmp_path, checkpoints):
    def stored(offset):
        return lambda tensors: {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + offset}

    equal = import_huggingface(_rewrite(checkpoints["qwen2"], tmp_path / "equal", stored(0)))
    assert any("lm_head.weight" in note for note in equal.notes)
    with pytest.raises(WeightsError, match="lm_head.weight should equal model.embed_tokens.weight"):
        import_huggingface(_rewrite(checkpoints["qwen2"], tmp_path / "differs", stored(1)))


def test_inverse_frequencies_saved_by_older_transformers_are_checked(tmp_path, checkpoints):
    def with_frequencies(theta):
        frequencies = (theta ** (-np.arange(0, 8, 2) / 8)).astype(np.float32)
        return lambda tensors: {**tensors, "model.layers.1.self_attn.rotary_emb.inv_freq": frequencies}

    good = import_huggingface(_rewrite(checkpoints["llama"], tmp_path / "good", with_frequencies(5000.0)))
    assert any("inverse frequencies" in note for note in good.notes)
    with pytest.raises(WeightsError, match="rotary_emb.inv_freq is not the spec's rotary inverse frequencies"):
        import_huggingface(_rewrite(checkpoints["llama"], tmp_path / "bad", with_frequencies(10000.0)))


@pytest.mark.parametrize("kind, changes, message", [
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r'rope_scaling.rope_type = "dynamic"'),
    ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 6,
                                   "long_factor": 2.0}}, r'rope_parameters.long_factor = 2.0: expected a list'),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True,
               "sliding_window": None}, r"layer_types has sliding layers \(1 of 2\) but sliding_window is null"),
    ("qwen3", {"layer_types": ["full_attention", "local"], "use_sliding_window": True, "sliding_window": 4},
     r'layer_types = \["full_attention", "local"\]: expected 2 entries, each "full_attention" or "sliding_attention"'),
    ("gemma2", {"use_bidirectional_attention": True}, r"use_bidirectional_attention = true: its layers attend in both"),
    ("gemma2", {"tie_word_embeddings": False}, r"tie_word_embeddings = false: Gemma2ForCausalLM ties its head"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     r"rope_parameters.sliding_attention.rope_type = \"linear\": the spec's sliding layers"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r'rope_parameters.full_attention.rope_type = "dynamic"'),
    ("llama", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}},
     r'model_type = "gemma3" cannot be imported: vision_config = \{\}: Gemma 3\'s multimodal model'),
    ("llama", {"sliding_window": 4096}, r"sliding_window = 4096: attention to a sliding window of keys \(Mistral\)"),
    ("llama", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping = 50.0: scores squashed by c·tanh"),
    ("qwen3", {"final_logit_softcapping": 30.0},
     r"final_logit_softcapping = 30.0: logits squashed .* Qwen3ForCausalLM does not apply it either"),
    ("llama", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor = 0.5: LlamaForCausalLM rotates every dimension"),
    ("llama", {"attention_bias": True}, r"attention_bias = true and mlp_bias = false: the spec's bias field"),
    ("qwen3", {"attention_bias": True}, r"attention_bias = true: Qwen3 then has biases on q, k, v and o_proj"),
    ("qwen2", {"hidden_act": "gelu_fast"}, r"hidden_act = 'gelu_fast' is not in the spec"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, r"only LlamaForCausalLM has the output head"),
    ("qwen2", {"num_key_value_heads": None}, r"config.json of this qwen2 model has no num_key_value_heads"),
    ("mistral", {"sliding_window": 0}, r"sliding_window = 0: a window is a positive number of keys, or null"),
    ("mistral", {"attn_logit_softcapping": 30.0}, r"attn_logit_softcapping = 30.0: scores squashed"),
    # Phi3Config reads "yarn" (and "su") as longrope: never YaRN, so a YaRN's keys are not enough
    ("phi3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
     r'rope_parameters has rope_type "longrope" but no short_factor'),
    ("phi3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
     r'rope_parameters.rope_type = "linear" \(a rescaling Phi3Config refuses\)'),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     r"rope_fraction 0.75 of head_dim 12 rotates 9 dimensions; it must be an even number"),
    ("phi3", {"sliding_window": -1}, r"sliding_window = -1: a window is a positive number of keys"),
    ("phi3", {"attn_logit_softcapping": 30.0}, r"attn_logit_softcapping = 30.0: .* Phi3ForCausalLM does not apply"),
])
def test_configs_the_spec_cannot_express_are_refused_by_field(tmp_path, checkpoints, kind, changes, message):
    with pytest.raises(ConfigError, match=message):
        import_huggingface(_with_config(tmp_path, checkpoints[kind], **changes))


# ---- the transformers column ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_the_transformers_column_passes_every_whole_model_case(checkpoints, kind):
    results = _matrix(checkpoints[kind], ["transformers"], ["float64", "float32", "float16", "bfloat16"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    assert {r.mask_case for r in ran} >= {"pad_right", "pad_left", "all_pad", "far", "long"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]


@pytest.mark.slow
def test_the_whole_matrix_on_imported_weights(checkpoints):
    backends = ["numpy-float32", "torch", "jax", "transformers"]
    results = _matrix(checkpoints["llama-tied"], backends, ["float32"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.backend for r in ran} == set(backends)
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]


# ---- canonical weights back to a Hugging Face directory --------------------------------------------------

@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "llama3-tiny", "qwen2-yarn-tiny"])
def test_canonical_weights_written_as_a_directory_import_back_and_run_in_transformers(tmp_path, preset):
    """The importer's mapping run backwards (importers.huggingface_writer): the import of the
    written directory is the same config and tensors, and transformers' own model of it computes
    the golden's logits at float64."""
    from spec import get_preset

    written_round_trip(get_preset(preset), tmp_path / preset)


def written_round_trip(cfg, directory) -> None:
    """cfg's conformance weights written as a Hugging Face directory (importers.huggingface_writer):
    the import gives back the same config and tensors, and transformers runs the directory to the
    golden's logits at float64 on a padded batch."""
    from importers.huggingface_writer import to_huggingface
    from spec import conformance_params, params_digest

    params = conformance_params(cfg)
    directory = to_huggingface(cfg, params, directory)
    imported = import_huggingface(directory)
    assert imported.config == cfg and params_digest(imported.params) == params_digest(params)
    ids, keep = _padded_batch(cfg)
    theirs = _transformers_logits(directory, cfg, ids, keep)
    result = compare(theirs, golden.forward(cfg, params, None, ids, tgt_keep=keep),
                     _tolerance(cfg, ids.shape[1]))
    assert result.passed, result.reason


def test_phi3s_longrope_from_the_top_level_with_the_class_default_context(tmp_path, checkpoints):
    """Phi-3-mini-128k's layout: rope_theta and rope_scaling {"type": "longrope"} at the top level;
    without original_max_position_embeddings, Phi3Config's 4096 applies; factor from
    max_position_embeddings / 4096. transformers reads the same. (Older files say "su", which
    Phi3Config renames to longrope after its check for the key, so transformers 5.23 cannot load
    them; the importer reads them as longrope.)"""
    su = {"type": "longrope", "short_factor": [1.0, 1.1, 1.5], "long_factor": [1.2, 5.0, 30.0]}
    directory = _with_config(tmp_path, checkpoints["phi3"], rope_theta=10000.0, partial_rotary_factor=0.5,
                             max_position_embeddings=131072, rope_scaling=su)
    config = json.loads((directory / "config.json").read_text())
    for key in ("rope_parameters", "original_max_position_embeddings"):  # a file from before transformers 5
        del config[key]
    (directory / "config.json").write_text(json.dumps(config))
    scaling = import_huggingface(directory).config.rope_scaling
    assert scaling == RopeScaling(kind="longrope", factor=32.0, original_max_len=4096, short_factor=(1.0, 1.1, 1.5),
                                  long_factor=(1.2, 5.0, 30.0))
    hf = transformers.AutoConfig.from_pretrained(directory)
    assert (hf.rope_parameters["rope_type"], hf.rope_parameters["original_max_position_embeddings"]) == ("longrope", 4096)
    # an entry that disagrees with the top level (or its default): transformers 5 reads either, by where rope_theta is
    disagreeing = _with_config(tmp_path / "disagreeing", checkpoints["phi3"], rope_parameters=None, rope_theta=10000.0,
                               partial_rotary_factor=0.5, rope_scaling={**su, "original_max_position_embeddings": 8})
    with pytest.raises(ConfigError, match=r"rope_scaling.original_max_position_embeddings = 8 but the top-level field "
                                          r"is 4096: transformers 5 takes one or the other"):
        import_huggingface(disagreeing)


def test_a_partial_rotary_with_a_window_is_written_as_phi3(tmp_path):
    """The writer's Phi-3: q, k, v and gate, up put back into their fused tensors, read back to the
    same config and tensors, and transformers' Phi3ForCausalLM computes the golden's logits."""
    from importers.huggingface_writer import to_huggingface
    from spec import conformance_params, get_preset, params_digest

    cfg = get_preset("llama-tiny").replace(rope_fraction=0.5, sliding_window=4)
    params = conformance_params(cfg)
    directory = to_huggingface(cfg, params, tmp_path / "phi3")
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    imported = import_huggingface(directory)
    assert imported.family == "phi3" and imported.config == cfg
    assert params_digest(imported.params) == params_digest(params)
    ids, keep = _padded_batch(cfg)
    result = compare(_transformers_logits(directory, cfg, ids, keep),
                     golden.forward(cfg, params, None, ids, tgt_keep=keep), _tolerance(cfg, ids.shape[1]))
    assert result.passed, result.reason


@pytest.mark.parametrize("changes, message", [
    ({"dropout": 0.1}, r"cannot hold dropout = 0.1"),
    ({"norm": "layernorm"}, r"norm = 'layernorm': Llama, Qwen2, Qwen3, Mistral and Phi-3 have norm = 'rmsnorm'"),
    ({"bias": True}, r"bias without qkv_bias"),
    ({"rope_fraction": 0.5, "qkv_bias": True}, r"rope_fraction = 0.5, rope_scaling None with q/k norms, biases"),
])
def test_a_config_no_family_holds_is_not_written(tmp_path, changes, message):
    from importers.huggingface_writer import to_huggingface
    from spec import get_preset, init_params

    cfg = get_preset("llama-tiny").replace(**changes)
    with pytest.raises(ConfigError, match=message):
        to_huggingface(cfg, init_params(cfg), tmp_path / "out")


# ---- a bias added after rounding: JAX at float16 ---------------------------------------------------------

QWEN2_HEADS_OF_16 = lambda: transformers.Qwen2Config(  # noqa: E731 - the model where it was found
    vocab_size=101, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=3,
    num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=100, eos_token_id=100)


@pytest.mark.slow
@pytest.mark.parametrize("rounding", ["once", "twice"])
def test_a_biased_projection_rounded_twice_fails_qwen2_at_float16(tmp_path, monkeypatch, rounding):
    """impl_jax.Linear rounds x W + b once, as torch's addmm does; flax's nnx.Linear rounds x W to
    float16 before adding b. On a random Qwen2 (biases on q, k and v; 512 tokens) the second
    rounding alone takes forward-long past its tolerance, in the math path as in the native one."""
    pytest.importorskip("jax")
    import impl_jax.model
    from flax import nnx

    if rounding == "twice":  # nnx.Linear as it is
        monkeypatch.setattr(impl_jax.model.Linear, "__init__", nnx.Linear.__init__)
        monkeypatch.setattr(impl_jax.model.Linear, "__call__", nnx.Linear.__call__)
    imported = import_huggingface(build_checkpoint("qwen2", QWEN2_HEADS_OF_16(), tmp_path / "qwen2"))
    from conformance.harness import plan_matrix, run_matrix

    results = run_matrix(imported.config, imported.params,
                         plan_matrix(imported.config, ["jax-math"], ["float16"], ["cpu"]), pattern="forward-long")
    cell, = [r for r in results if r.status != SKIP]
    assert cell.status == (PASS if rounding == "once" else "fail"), (cell.ratio, cell.reason)
