"""Qwen3.5's text decoder (gated DeltaNet and gated full attention, SPEC §5.15) through the importer,
the Hugging Face writer and the transformers column (issue 59), and Qwen3-Next (the same layers, each
FFN a mixture of experts with a shared expert, SPEC §5.14) through the importer.

The model is built here with random weights (nothing is downloaded) where every number a port
writes in differs from its class default: 2 key heads of 8 over 4 value heads of 6, a
convolution 3 wide, half of each full-attention head rotated at θ = 20000, a full layer second of
four rather than fourth. Every parameter is drawn (norm weights about their identity, never it), so
a mapping that swapped q's and k's convolution kernels, or a head's query and gate rows, could not
pass by accident.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
torch = pytest.importorskip("torch")

import impl_numpy as golden  # noqa: E402
from benchmarks.checkpoints import random_checkpoint  # noqa: E402
from conformance.adapter import NotSupported, Partial  # noqa: E402
from conformance.backends.transformers_backend import (HYBRID_FLOAT32, LINEAR_LAYERS_ONLY, PAD_BETWEEN,  # noqa: E402
                                                       PAD_IN_STEP, TransformersRunner, _gated_rms_norm_float64,
                                                       _rotary_float64, _router_float64, _spec_rows, model_class,
                                                       widened_to_float64)
from conformance.cases import amplification, recurrent_depth  # noqa: E402
from conformance.harness import PASS, SKIP  # noqa: E402
from conformance.tolerance import compare, rotary_angle, tolerance  # noqa: E402
from importers import import_huggingface  # noqa: E402
from importers.huggingface import (Rule, _apply, _checkpoint_files, _qwen3_5_config, _qwen3_next_config,  # noqa: E402
                                   _read_tensors, as_held, mapping_markdown, qwen3_next_mapping)
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


def test_qwen3_next_tiny_written_as_a_directory_imports_back_and_passes_the_transformers_column(tmp_path):
    """Qwen3-Next written back: q, k, v and z regrouped by key head into in_proj_qkvz, β's and the decay's
    rows into in_proj_ba, the experts one nn.Linear each, the shared expert and its gate; the import of
    the directory is the preset's tensors, and transformers' Qwen3NextForCausalLM passes every
    whole-model case at float32 on it. A shared expert without linear layers and with q/k norms is no
    family's (Qwen2-MoE has none): refused."""
    from importers.huggingface_writer import to_huggingface

    cfg = get_preset("qwen3-next-tiny")
    params = conformance_params(cfg)
    directory = to_huggingface(cfg, params, tmp_path / "qwen3-next-tiny")
    hf = json.loads((directory / "config.json").read_text())
    assert hf["model_type"] == "qwen3_next" and hf["shared_expert_intermediate_size"] == cfg.moe.shared_expert_d_ff
    back = import_huggingface(directory)
    assert back.config == as_held(cfg) and params_digest(back.params) == params_digest(params)
    results = _matrix(directory, ["transformers"], ["float32"])
    ran = [r for r in results if r.status != SKIP]
    assert ran and all(r.status == PASS for r in ran), [(r.test_id, r.reason[:200]) for r in ran if r.status != PASS]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    dense = get_preset("qwen3-moe-tiny")
    with pytest.raises(ConfigError, match="qk_norm = True with a shared expert and full attention alone: Qwen2-MoE"):
        to_huggingface(dense.replace(moe=dataclasses.replace(dense.moe, shared_expert_d_ff=24)), {}, tmp_path / "no")


def test_a_hybrid_of_linear_layers_alone_runs_transformers_forward_and_refuses_its_decoding(tmp_path):
    """transformers' hybrid cache asks an attention layer for its length: a model without one (a bench's
    single layer of a published shape) runs its forward without a cache, and its decoding is refused by
    name rather than an error on every cell."""
    from importers.huggingface_writer import to_huggingface

    cfg = get_preset("qwen35-tiny").replace(n_decoder_layers=1, layer_types=("linear",))
    directory = to_huggingface(cfg, conformance_params(cfg), tmp_path / "linear-only")
    results = _matrix(directory, ["transformers"], ["float32"])
    ran = [r for r in results if r.status != SKIP]
    assert ran and all(r.status == PASS for r in ran), [(r.test_id, r.reason[:200]) for r in ran if r.status != PASS]
    assert {r.sublayer for r in ran} == {"forward"}
    refused = [r for r in results if r.sublayer in ("decode", "generate")]
    assert refused and all(LINEAR_LAYERS_ONLY in r.reason for r in refused)


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


# ---- Qwen3-Next: the hybrid whose FFNs are mixtures with a shared expert ---------------------------

# the full layer third of four, not the class's fourth
NEXT_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _next_config(**changes):
    """Every size apart from the others and from Qwen3NextConfig's defaults: 2 key heads of 10 over 6
    value heads of 7 (three per key head, so in_proj_qkvz's groups are not its flat blocks), a
    convolution 3 wide; 3 query heads of 16 over 1 key/value head, half of each rotated at θ = 30000;
    5 experts of 14, 2 per token, renormalised, beside a shared expert of 22 (the dense
    intermediate_size, 52, is read by no layer); untied."""
    fields = dict(vocab_size=83, hidden_size=36, intermediate_size=52, moe_intermediate_size=14,
                  shared_expert_intermediate_size=22, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                  num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=10, linear_value_head_dim=7,
                  linear_conv_kernel_dim=3, layer_types=NEXT_LAYER_TYPES, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 30000.0, "partial_rotary_factor": 0.5})
    return transformers.Qwen3NextConfig(**{**fields, **changes})


def _next_checkpoint(config, directory, fused: bool = False):
    """benchmarks.checkpoints.random_checkpoint's draw for Qwen3NextForCausalLM (its table has no such
    class): every parameter drawn, matrices (each expert of a stack too) at 1/√(their smaller side) but
    the shared expert's gate [1, d] at 1/√d (so σ(x·g) stays off 0 and 1), the (1 + w) norms about 0
    and the DeltaNet's gated norm about 1 (never the identity), the rest about 0. Saved as
    save_pretrained writes it: one tensor per expert, or (fused) transformers 5's stacks."""
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if name.endswith("shared_expert_gate.weight"):
                tensor.copy_(noise * tensor.shape[-1] ** -0.5)
            elif tensor.ndim >= 2:
                tensor.copy_(noise * min(tensor.shape[-2:]) ** -0.5)
            elif "norm" in name:
                tensor.copy_((1.0 if "linear_attn.norm." in name else 0.0) + 0.2 * noise)
            else:
                tensor.copy_(0.2 * noise)
    model.save_pretrained(directory, save_original_format=not fused)
    return directory


@pytest.fixture(scope="module")
def next_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    return {"per expert": _next_checkpoint(_next_config(), root / "per-expert"),
            "fused": _next_checkpoint(_next_config(), root / "fused", fused=True)}


def _plus_one_rms_norm_float64(module, hidden):
    """Qwen3NextRMSNorm, (1 + w) · x / √(mean(x²) + ε), without its casts to float32."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return (1.0 + module.weight) * (hidden * (variance + module.eps).rsqrt())


def _widened_to_float64(model, cfg, monkeypatch):
    """A float64 Qwen3NextForCausalLM with the float32 transformers 5.23 computes whatever the
    dtype taken at float64: the DeltaNet's decay (A_log.float(), a.float()) and its chunked delta rule
    (torch_chunk_gated_delta_rule casts to torch.float32), re-executed from their source with the
    casts widened (each cast must still be there: a transformers that moved it fails here, not by a
    bound); the (1 + w) RMSNorms, the gated norm, the router's softmax and the rotary tables by the
    column's float64 formulas (conformance.backends.transformers_backend; its widened_to_float64
    does not know Qwen3NextRMSNorm)."""
    import functools
    import inspect
    import textwrap
    import types

    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    namespace = dict(vars(modeling))
    for function, narrow, wide in ((modeling.torch_chunk_gated_delta_rule, "torch.float32", "torch.float64"),
                                   (modeling.Qwen3NextGatedDeltaNet.forward, ".float()", ".double()")):
        source = textwrap.dedent(inspect.getsource(function))
        assert narrow in source, f"{function.__qualname__} no longer casts with {narrow}: revisit this widening"
        exec(source.replace(narrow, wide), namespace)  # the forward then calls the widened delta rule
    monkeypatch.setattr(modeling.Qwen3NextGatedDeltaNet, "forward", namespace["forward"])
    forwards = {"Qwen3NextRMSNorm": _plus_one_rms_norm_float64, "Qwen3NextRMSNormGated": _gated_rms_norm_float64,
                "Qwen3NextTopKRouter": _router_float64,
                "Qwen3NextRotaryEmbedding": functools.partial(_rotary_float64, cfg=cfg)}
    for module in model.modules():
        if type(module).__name__ in forwards:
            module.forward = types.MethodType(forwards[type(module).__name__], module)


def _next_logits(directory, ids, keep, dtype: str = "float64", widen=None):
    """transformers' Qwen3NextForCausalLM loaded at dtype (float64: the model .double()), the eager
    experts loop (transformers 5's default, grouped_mm, has no float64 kernel), the slot positions;
    ``widen`` (cfg, monkeypatch): float64 throughout (_widened_to_float64)."""
    model = transformers.Qwen3NextForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    model.set_experts_implementation("eager")
    if widen is not None:
        _widened_to_float64(model, *widen)
    with torch.inference_mode():
        return model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(keep.astype(np.int64)),
                     position_ids=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)).logits.double().numpy()


def test_qwen3_next_imported_config(next_checkpoints):
    found = import_huggingface(next_checkpoints["per expert"])
    cfg, mixer, moe = found.config, found.config.linear_attention, found.config.moe
    assert found.family == "qwen3_next" and cfg.layer_types == ("linear", "linear", "full", "linear")
    assert (mixer.key_heads, mixer.value_heads, mixer.key_head_dim, mixer.value_head_dim, mixer.conv_kernel) == \
        (2, 6, 10, 7, 3)
    assert (moe.n_experts, moe.experts_per_token, moe.renormalize, moe.router_softmax, moe.shared_expert_d_ff) == \
        (5, 2, True, "float32", 22)
    assert (cfg.d_ff, cfg.rope_theta, cfg.rope_fraction, cfg.head_dim, cfg.kv_heads) == (14, 30000.0, 0.5, 16, 1)
    assert cfg.norm_scale_plus_one and cfg.qk_norm and cfg.attention_output_gate and not cfg.tie_head
    assert found.params["decoder.layers.1.ffn.shared_expert_gate.weight"].shape == (36, 1)
    # the fused layout is the same tensors
    fused = import_huggingface(next_checkpoints["fused"])
    assert fused.config == cfg and params_digest(fused.params) == params_digest(found.params)
    assert any("stored fused" in note for note in fused.notes)


def test_qwen3_next_class_defaults_where_the_file_says_nothing():
    """No layer_types: three linear layers of every 4, the fourth full; no partial_rotary_factor:
    0.25; no head_dim: 256; no norm_topk_prob: Qwen3NextConfig's true (Qwen3-MoE's is false)."""
    hf = {"model_type": "qwen3_next", "vocab_size": 83, "hidden_size": 36, "intermediate_size": 52,
          "moe_intermediate_size": 14, "shared_expert_intermediate_size": 22, "num_experts": 5,
          "num_experts_per_tok": 2, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 2048, "pad_token_id": 0, "rope_parameters": {"rope_theta": 1e7}}
    cfg = _qwen3_next_config(hf, [])
    assert cfg.layer_types == ("linear", "linear", "linear", "full") * 2
    assert (cfg.rope_fraction, cfg.head_dim, cfg.moe.renormalize) == (0.25, 256, True)
    assert not _qwen3_next_config({**hf, "norm_topk_prob": False}, []).moe.renormalize
    # mlp_only_layers outside the model, or null, leave every layer a mixture
    assert _qwen3_next_config({**hf, "mlp_only_layers": [8, 9]}, []).moe == cfg.moe
    assert _qwen3_next_config({**hf, "mlp_only_layers": None}, []).moe == cfg.moe


@pytest.mark.parametrize("changes, message", [
    ({"mlp_only_layers": [1]}, r"mlp_only_layers = \[1\]: the FFN of layer\(s\) \[1\] is then one dense MLP"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2: only every decoder_sparse_step-th layer is then a "
                                 r"mixture of experts; the FFN of layer\(s\) \[0, 2\] is one dense MLP"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step = 0: every how many layers one is a mixture"),
    ({"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size = 0: Qwen3NextForCausalLM builds"),
    ({"n_shared_experts": 2}, r"n_shared_experts = 2: experts every token goes through .* Qwen3NextForCausalLM "
                              r"has one, shared_expert_intermediate_size wide"),
    ({"num_experts": 1}, r"num_experts = 1: the spec's mixture has at least 2 experts"),
    ({"num_experts_per_tok": 6}, r"num_experts_per_tok = 6: each token chooses 1 to num_experts \(5\)"),
    ({"attention_bias": True}, r"attention_bias = true: then q, k, v and o carry biases; Qwen3-Next's have none"),
    ({"hidden_act": "gelu"}, r"hidden_act = \"gelu\": Qwen3-Next's DeltaNet convolution takes SiLU"),
])
def test_qwen3_next_configs_the_spec_cannot_express_are_refused_by_field(changes, message):
    hf = {**_next_config().to_dict(), **changes}
    with pytest.raises(ConfigError, match=message):
        _qwen3_next_config(hf, [])


def test_the_grouped_rows_transform():
    """"transpose group rows a:b of w": rows a … b − 1 of each group of w, groups in order, transposed;
    rows that are not whole groups are refused."""
    value = np.arange(16.0).reshape(8, 2)  # two groups of 4 rows
    taken = Rule("x", (8, 2), "y", "transpose group rows 1:3 of 4").take(value)
    np.testing.assert_array_equal(taken, value[[1, 2, 5, 6]].T)
    with pytest.raises(ValueError, match="whole groups of 3"):
        Rule("x", (8, 2), "y", "transpose group rows 0:2 of 3").take(value)
    with pytest.raises(ValueError, match="whole groups of 4"):
        Rule("x", (8, 2), "y", "transpose group rows 2:5 of 4").take(value)


def test_qwen3_next_mapping_table():
    table = mapping_markdown("qwen3_next")
    assert ("| `model.layers.{i}.linear_attn.in_proj_qkvz.weight` | `decoder.layers.{i}.linear_attn.v.weight` | "
            "each key head's rows 2·d_k … 2·d_k + r·d_v − 1 (its r value heads' values) "
            "of its 2·d_k + 2·r·d_v") in table
    assert ("| `model.layers.{i}.mlp.shared_expert_gate.weight` | `decoder.layers.{i}.ffn.shared_expert_gate.weight` "
            "| transposed") in table


@pytest.mark.parametrize("layout", ["per expert", "fused"])
def test_qwen3_next_golden_equals_transformers_at_float64(next_checkpoints, layout, monkeypatch):
    """transformers' own Qwen3NextForCausalLM at float64, its float32 islands widened
    (_widened_to_float64), on a batch padded at the end and at the start: the golden's logits at
    every real token within SPEC §8's float64 bound of the whole model. Measured: 5e-14 against a
    bound of 4e-13 (logits up to 3.6), both layouts."""
    imported = import_huggingface(next_checkpoints[layout])
    cfg, params = imported.config, imported.params
    ids, keep = _batch(cfg, 9)
    ours = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    theirs = _next_logits(next_checkpoints[layout], ids, keep, "float64", widen=(cfg, monkeypatch))
    result = compare(theirs[keep], ours[keep], _tolerance(cfg, params, ids, "float64"))
    assert result.passed, result.reason


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_qwen3_next_as_transformers_writes_it_is_float32_inside(next_checkpoints, dtype):
    """The class as written, loaded at float64 (the model .double()) or at float32: the golden's
    logits within float32's bound, and at float64 far outside float64's: as Qwen3.5's
    (HYBRID_FLOAT32), the decay and the delta rule are float32 whatever the dtype, and so are its
    norms and its router's softmax. Measured: 1.8e-5 at float64, 3.1e-5 at float32, against 2.2e-4."""
    imported = import_huggingface(next_checkpoints["per expert"])
    cfg, params = imported.config, imported.params
    ids, keep = _batch(cfg, 9)
    ours = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    theirs = _next_logits(next_checkpoints["per expert"], ids, keep, dtype)
    result = compare(theirs[keep], ours[keep], _tolerance(cfg, params, ids, "float32"))
    assert result.passed, result.reason
    if dtype == "float64":
        assert not compare(theirs[keep], ours[keep], 1e3 * _tolerance(cfg, params, ids, "float64")).passed


def test_qwen3_next_without_experts_imports_its_dense_ffns(tmp_path, monkeypatch):
    """num_experts 0: Qwen3NextForCausalLM builds one dense MLP of intermediate_size in every layer,
    Qwen3.5's FFN, and the import is that (said in a note), equal to transformers' at float64."""
    directory = _next_checkpoint(_next_config(num_experts=0), tmp_path / "dense")
    found = import_huggingface(directory)
    cfg = found.config
    assert cfg.moe is None and cfg.d_ff == 52 and any("num_experts = 0" in note for note in found.notes)
    ids, keep = _batch(cfg, 9)
    ours = golden.forward(cfg, found.params, None, ids, tgt_keep=keep)
    theirs = _next_logits(directory, ids, keep, "float64", widen=(cfg, monkeypatch))
    result = compare(theirs[keep], ours[keep], _tolerance(cfg, found.params, ids, "float64"))
    assert result.passed, result.reason


def _flat(rules, cfg, fused: str):
    """The mapping with one fused tensor read in Qwen3.5's flat order (every q, then every k, ...),
    not grouped per key head: the mistake a port from Qwen3.5 makes."""
    mixer = cfg.linear_attention
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    blocks = {"in_proj_qkvz": {"q": (0, keys), "k": (keys, 2 * keys), "v": (2 * keys, 2 * keys + values),
                               "z": (2 * keys + values, 2 * keys + 2 * values)},
              "in_proj_ba": {"beta": (0, mixer.value_heads), "decay": (mixer.value_heads, 2 * mixer.value_heads)}}
    wrong = []
    for rule in rules:
        if f".{fused}." in rule.source:
            start, stop = blocks[fused][rule.target.split(".")[-2]]
            rule = Rule(rule.source, rule.source_shape, rule.target, f"transpose rows {start}:{stop}")
        wrong.append(rule)
    return wrong


@pytest.mark.parametrize("fused", ["in_proj_qkvz", "in_proj_ba"])
def test_a_flat_reading_of_the_grouped_projections_fails_the_comparison(next_checkpoints, fused, monkeypatch):
    """The mapping with in_proj_qkvz (or in_proj_ba) read in Qwen3.5's flat order rather than per key
    head: every tensor has the right shape, the import's checks pass, and the comparison that passed
    above fails, at float64's bound and at float32's."""
    directory = next_checkpoints["per expert"]
    imported = import_huggingface(directory)
    cfg = imported.config
    rules = qwen3_next_mapping(cfg)
    right = _apply(rules, _read_tensors(_checkpoint_files(directory), []), {}, "qwen3_next", [])
    assert params_digest(right) == params_digest(imported.params)  # the mapping the import ran
    wrong = _apply(_flat(rules, cfg, fused), _read_tensors(_checkpoint_files(directory), []), {}, "qwen3_next", [])
    ids, keep = _batch(cfg, 9)
    theirs = _next_logits(directory, ids, keep, "float64", widen=(cfg, monkeypatch))
    mistaken = golden.forward(cfg, wrong, None, ids, tgt_keep=keep)
    for dtype in ("float64", "float32"):
        result = compare(theirs[keep], mistaken[keep], _tolerance(cfg, wrong, ids, dtype))
        assert not result.passed, f"within the {dtype} bound ({result.max_abs_err:.3g}): the check cannot see it"


def test_a_multi_token_prediction_head_is_left_out_with_a_note(tmp_path, next_checkpoints):
    """The published Qwen3-Next files carry mtp.* tensors (speculative decoding), which
    Qwen3NextForCausalLM does not load: the import leaves them out and says so."""
    from tests.test_huggingface import _rewrite

    def with_mtp(tensors):
        return {**tensors, "mtp.fc.weight": np.ones((36, 72), np.float32),
                "mtp.norm.weight": np.zeros(36, np.float32)}

    found = import_huggingface(_rewrite(next_checkpoints["per expert"], tmp_path / "mtp", with_mtp))
    assert any(note.startswith("ignored 2 tensor(s): the multi-token prediction head") for note in found.notes)
    assert params_digest(found.params) == params_digest(import_huggingface(next_checkpoints["per expert"]).params)
