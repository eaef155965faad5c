"""Qwen3.5's text decoder (gated DeltaNet and gated full attention, SPEC §5.15) through the importer,
the Hugging Face writer and the transformers column (issue 59).

The model is built here with random weights (nothing is downloaded) where every number a port
writes in differs from its class default: 2 key heads of 8 over 4 value heads of 6, a
convolution 3 wide, half of each full-attention head rotated at θ = 20000, a full layer second of
four rather than fourth. Every parameter is drawn (norm weights about their identity, never it), so
a mapping that swapped q's and k's convolution kernels, or a head's query and gate rows, could not
pass by accident.
"""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
torch = pytest.importorskip("torch")

import impl_numpy as golden  # noqa: E402
from benchmarks.checkpoints import random_checkpoint  # noqa: E402
from conformance.adapter import NotSupported, Partial  # noqa: E402
from conformance.backends.transformers_backend import (HYBRID_FLOAT32, PAD_BETWEEN, PAD_IN_STEP,  # noqa: E402
                                                       TransformersRunner, _spec_rows, model_class,
                                                       widened_to_float64)
from conformance.cases import amplification, recurrent_depth  # noqa: E402
from conformance.harness import PASS, SKIP  # noqa: E402
from conformance.tolerance import compare, rotary_angle, tolerance  # noqa: E402
from importers import import_huggingface  # noqa: E402
from importers.huggingface import _qwen3_5_config, as_held, mapping_markdown  # noqa: E402
from spec import ConfigError, conformance_params, get_preset, params_digest  # noqa: E402
from tests.test_huggingface import _matrix  # noqa: E402

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def _config(**changes):
    fields = dict(vocab_size=97, hidden_size=40, intermediate_size=56, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3, layer_types=LAYER_TYPES,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5})
    return transformers.Qwen3_5TextConfig(**{**fields, **changes})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_checkpoint("qwen3_5_text", _config(), tmp_path_factory.mktemp("qwen3_5") / "model")


@pytest.fixture(scope="module")
def imported(checkpoint):
    return import_huggingface(checkpoint)


def _batch(cfg, length: int, seed: int = 0):
    """Real tokens padded at the end (row 1) and at the start (row 2), the way a decoder-only batch is."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, cfg.tgt_vocab_size, (3, length))
    keep = np.ones((3, length), bool)
    keep[1, length - 3:] = False
    keep[2, :4] = False
    return np.where(keep, ids, cfg.pad_id), keep


def _transformers_logits(directory, cfg, ids, keep, dtype: str):
    """transformers' own model (float32 or float64 as loaded: the class config.json names), the slot
    positions given."""
    model = model_class(directory).from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        return model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(keep.astype(np.int64)),
                     position_ids=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)).logits.double().numpy()


def _tolerance(cfg, params, ids, dtype: str) -> float:
    """SPEC §8's bound for a forward of ids at dtype: a linear layer T tokens deep, times the
    output norms' amplification on these inputs (conformance.cases, as the catalogue's cases)."""
    inputs = {"tgt_ids": ids}
    depth = recurrent_depth(cfg, "forward", inputs)
    factor = amplification(cfg, lambda: golden.cast_params(cfg, params), "forward", inputs)
    n = max(cfg.d_model, cfg.d_ff, ids.shape[1])
    return max(1.0, factor) * tolerance(dtype, n, depth, rotary_angle(cfg, ids.shape[1] - 1))


# ---- the import -----------------------------------------------------------------------------------

def test_the_imported_config(imported):
    cfg = imported.config
    mixer = cfg.linear_attention
    assert cfg.layer_types == ("linear", "full", "linear", "linear") and cfg.attention_output_gate
    assert (mixer.key_heads, mixer.value_heads, mixer.key_head_dim, mixer.value_head_dim, mixer.conv_kernel) == \
        (2, 4, 8, 6, 3)
    assert (cfg.rope_theta, cfg.rope_fraction, cfg.head_dim, cfg.kv_heads) == (20000.0, 0.5, 16, 2)
    assert cfg.norm_scale_plus_one and cfg.qk_norm and not cfg.tie_head and not cfg.bias and not cfg.qkv_bias
    assert any("chunks of 64 tokens" in note for note in imported.notes)


def test_the_class_defaults_where_the_file_says_nothing():
    """No layer_types: three linear layers of every full_attention_interval (4), the fourth full; no
    partial_rotary_factor: the class's 0.25; no head_dim: its 256; no linear sizes: its own."""
    hf = {"model_type": "qwen3_5_text", "vocab_size": 97, "hidden_size": 40, "intermediate_size": 56,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 2048, "pad_token_id": 0, "rope_parameters": {"rope_theta": 1e7}}
    cfg = _qwen3_5_config(hf, [])
    assert cfg.layer_types == ("linear", "linear", "linear", "full") * 2
    assert (cfg.rope_fraction, cfg.head_dim, cfg.linear_attention.value_heads, cfg.linear_attention.conv_kernel) == \
        (0.25, 256, 32, 4)
    assert _qwen3_5_config({**hf, "full_attention_interval": 2}, []).layer_types == ("linear", "full") * 4


@pytest.mark.parametrize("changes, message", [
    ({"hidden_act": "gelu"}, "hidden_act = \"gelu\""),
    ({"attention_bias": True}, "attention_bias = true"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]},
     "layer_types = "),
    ({"layer_types": None, "full_attention_interval": 0}, "full_attention_interval = 0"),
])
def test_configs_the_spec_cannot_express_are_refused_by_field(changes, message):
    hf = {**_config().to_dict(), **changes}
    with pytest.raises(ConfigError, match=message):
        _qwen3_5_config(hf, [])


def test_the_mapping_table():
    table = mapping_markdown("qwen3_5_text")
    assert ("| `model.layers.{i}.linear_attn.conv1d.weight` | `decoder.layers.{i}.linear_attn.k_conv.weight` | "
            "channels H_k·d_k … 2·H_k·d_k − 1") in table
    assert ("| `model.layers.{i}.self_attn.q_proj.weight` | `decoder.layers.{i}.self_attn.gate.weight` | "
            "each head's second d_k rows") in table
    assert "| `model.layers.{i}.linear_attn.A_log` | `decoder.layers.{i}.linear_attn.decay.log_rate` | as is |" in table


# ---- the golden equals transformers' Qwen3.5 --------------------------------------------------------------

@pytest.mark.parametrize("length", [9, 300])
def test_the_golden_equals_transformers_on_a_padded_batch(checkpoint, imported, length):
    """transformers' own model, loaded at float32, on a batch padded at the start and at the end (9
    tokens, within one of its 64-token chunks) and on a 300-token one (five chunks, the last
    partial): the golden's logits at every real token, within float32's bound. Measured: at
    float64 as loaded the errors stay float32's (its decay and delta rule are float32 inside,
    HYBRID_FLOAT32), about 6e-6 on 9 tokens and 3e-4 on 300 (logits up to 4)."""
    cfg, params = imported.config, imported.params
    ids, keep = _batch(cfg, length)
    ours = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    theirs = _transformers_logits(checkpoint, cfg, ids, keep, "float32")
    result = compare(theirs[keep], ours[keep], _tolerance(cfg, params, ids, "float32"))
    assert result.passed, result.reason


@pytest.mark.parametrize("mistake", ["q and k convolutions swapped", "query and gate rows swapped",
                                     "decay bias and log-rate swapped", "beta and decay weights swapped"])
def test_a_mapping_mistake_fails_the_comparison(checkpoint, imported, mistake):
    """Each mistake a port of these tensors can make, between tensors of the same shape: the
    comparison that passed above fails."""
    cfg, params = imported.config, dict(imported.params)
    pairs = {"q and k convolutions swapped": ("linear_attn.q_conv.weight", "linear_attn.k_conv.weight", 0),
             "query and gate rows swapped": ("self_attn.q.weight", "self_attn.gate.weight", 1),
             "decay bias and log-rate swapped": ("linear_attn.decay.bias", "linear_attn.decay.log_rate", 2),
             "beta and decay weights swapped": ("linear_attn.beta.weight", "linear_attn.decay.weight", 3)}
    first, second, layer = pairs[mistake]
    a, b = f"decoder.layers.{layer}.{first}", f"decoder.layers.{layer}.{second}"
    params[a], params[b] = params[b], params[a]
    ids, keep = _batch(cfg, 9)
    wrong = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    theirs = _transformers_logits(checkpoint, cfg, ids, keep, "float32")
    assert not compare(theirs[keep], wrong[keep], _tolerance(cfg, params, ids, "float32")).passed


def test_transformers_at_float64_is_float32_inside(checkpoint, imported):
    """Why the column refuses float64 for a hybrid: widened as the column widens the other families
    (RMSNorms and the rotary tables in float64), transformers' float64 model still misses the
    golden by float32's rounding, within float32's bound and far outside float64's."""
    cfg, params = imported.config, imported.params
    ids, keep = _batch(cfg, 9)
    ours = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    with pytest.raises(NotSupported, match="float32 whatever the model's dtype"):
        TransformersRunner(checkpoint, cfg, "float64", "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    widened_to_float64(model, cfg)
    with torch.inference_mode():
        theirs = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(keep.astype(np.int64)),
                       position_ids=torch.arange(9).expand(3, -1)).logits.numpy()
    assert compare(theirs[keep], ours[keep], _tolerance(cfg, params, ids, "float32")).passed
    assert not compare(theirs[keep], ours[keep], 1e3 * _tolerance(cfg, params, ids, "float64")).passed
    assert "A_log.float()" in HYBRID_FLOAT32


# ---- where transformers' pads are not the spec's -------------------------------------------------------

def test_a_pad_between_real_tokens_moves_transformers_state(checkpoint, imported):
    """The reason the column leaves such a row out, measured: a row with a pad among its real tokens
    gives transformers' logits after the pad that differ from the golden's (whose pads move
    nothing) far beyond the bound, while the same row without the pad agrees."""
    cfg, params = imported.config, imported.params
    ids, keep = _batch(cfg, 9)
    keep[0, 4] = False
    ids = np.where(keep, ids, cfg.pad_id)
    ours = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    theirs = _transformers_logits(checkpoint, cfg, ids, keep, "float32")
    bound = _tolerance(cfg, params, ids, "float32")
    assert not compare(theirs[0, 5:], ours[0, 5:], bound).passed
    assert compare(theirs[1:][keep[1:]], ours[1:][keep[1:]], bound).passed


def test_a_pad_fed_in_a_cached_step_moves_transformers_state(checkpoint, imported):
    """A left-padded row decoded a token at a time from a one-token prefill: transformers takes the
    pads of the steps as real tokens (the linear layers' mask reaches the first call only), and its
    logits at the row's real tokens differ from the golden's."""
    cfg, params = imported.config, imported.params
    ids, keep = _batch(cfg, 9)
    runner = TransformersRunner(checkpoint, cfg, "float32", "cpu")
    with torch.inference_mode():
        steps = runner.decode({"tgt_ids": ids, "prefix": 1}).double().numpy()  # positions 1 … 8
    ours = golden.forward(cfg, params, None, ids, tgt_keep=keep)[:, 1:]
    bound = _tolerance(cfg, params, ids, "float32")
    assert not compare(steps[2][keep[2, 1:]], ours[2][keep[2, 1:]], bound).passed  # row 2: pads at 0 … 3
    assert compare(steps[0], ours[0], bound).passed


def test_the_left_out_positions_are_those_from_a_moving_pad_on():
    """Row 0 has a pad between real tokens, row 1 pads after its last, row 2 before its first: a
    forward leaves out row 0 from its pad on; a decode from a one-token prefill also leaves out the
    steps of every pad it feeds."""
    keep = np.array([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], bool)
    logits = np.zeros((3, 5, 2))
    assert isinstance(found := _spec_rows(logits, keep, None), Partial)
    assert found.compared.tolist() == [[1, 1, 0, 0, 0], [1] * 5, [1] * 5] and found.left_out == {0: PAD_BETWEEN}
    steps = _spec_rows(logits[:, 1:], keep, 1)
    assert steps.compared.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert steps.left_out == {0: PAD_BETWEEN, 1: PAD_IN_STEP, 2: PAD_IN_STEP}
    assert not isinstance(_spec_rows(logits[:2, 3:], keep[:2] | True, 3), Partial)


# ---- canonical weights written back, and the column ------------------------------------------------------

def test_qwen35_tiny_written_as_a_directory_imports_back_and_passes_the_transformers_column(tmp_path):
    """The importer's mapping run backwards: the import of the written directory is the preset's
    tensors and its config but for the chunk (the file has none: as_held); the transformers column
    passes every whole-model case at float32 and float16, the rows of a moving pad left out with
    their reason, and float64 refused with its."""
    from importers.huggingface_writer import to_huggingface

    cfg = get_preset("qwen35-tiny")
    params = conformance_params(cfg)
    directory = to_huggingface(cfg, params, tmp_path / "qwen35-tiny")
    back = import_huggingface(directory)
    assert back.config == as_held(cfg) != cfg and params_digest(back.params) == params_digest(params)
    results = _matrix(directory, ["transformers"], ["float64", "float32", "float16"])
    ran = [r for r in results if r.status != SKIP]
    assert ran and all(r.status == PASS for r in ran), [(r.test_id, r.reason[:200]) for r in ran if r.status != PASS]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    assert {r.dtype for r in ran} == {"float32", "float16"}
    refused = [r for r in results if r.dtype == "float64"]  # up front, as a column the run cannot have
    assert refused and all(r.reason == HYBRID_FLOAT32 for r in refused)
    left_out = {r.test_id: r.left_out for r in ran if r.left_out}
    assert PAD_BETWEEN in left_out["forward-pad_middle-float32-transformers-cpu"]
    assert PAD_IN_STEP in left_out["decode-pad_left-float32-transformers-cpu"]
    assert "forward-pad_left-float32-transformers-cpu" not in left_out


# ---- the published files: Qwen3_5ForConditionalGeneration ------------------------------------------

@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A random Qwen3_5ForConditionalGeneration, as Qwen3.5 is published: the text decoder of
    _config() under model.language_model., a one-block vision tower beside it, the head tied."""
    text = {key: value for key, value in _config().to_dict().items() if key not in ("model_type", "architectures")}
    config = transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=True,
                                        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                           out_hidden_size=text["hidden_size"]))
    return random_checkpoint("qwen3_5", config, tmp_path_factory.mktemp("qwen3_5") / "published")


def test_the_published_checkpoints_text_decoder_is_imported(published):
    """The decoder of text_config, the vision tower left out with a note, the head tied as the
    top-level config says; transformers' multimodal model on text alone gives the golden's logits."""
    found = import_huggingface(published)
    cfg = found.config
    assert found.family == "qwen3_5" and cfg.tie_head and cfg.layer_types == ("linear", "full", "linear", "linear")
    assert any("vision tower" in note for note in found.notes)
    ids, keep = _batch(cfg, 9)
    ours = golden.forward(cfg, found.params, None, ids, tgt_keep=keep)
    theirs = _transformers_logits(published, cfg, ids, keep, "float32")
    assert compare(theirs[keep], ours[keep], _tolerance(cfg, found.params, ids, "float32")).passed
    assert "model.language_model.layers.{i}.linear_attn.conv1d.weight" in mapping_markdown("qwen3_5")
    # the Auto class a causal LM is usually loaded with makes the text-only class, which finds none of
    # these weights and draws them at random: the column loads the class the file names
    assert type(transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(published))
                ).__name__ == "Qwen3_5ForCausalLM" != model_class(published).__name__


def test_the_transformers_column_runs_the_published_class(published):
    """The column on the published directory: its forward, cached decode and generation cases pass
    at float32 (the rows of a moving pad left out, as for the text class)."""
    results = _matrix(published, ["transformers"], ["float32"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason[:200]) for r in ran if r.status != PASS]
