"""Hugging Face importers and the transformers column (issue 15).

Models are built here from configs with random weights (nothing is downloaded), with odd sizes:
head counts that do not divide 64, vocabularies that are not powers of two. Every parameter and
buffer is randomised (biases, norms and final_logits_bias included), so a mapping that swapped two
biases could not pass by both being zero.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
torch = pytest.importorskip("torch")

import impl_numpy as golden  # noqa: E402
from conformance.adapter import register_backend, unregister_backend  # noqa: E402
from conformance.backends.transformers_backend import TransformersBackend, TransformersRunner  # noqa: E402
from conformance.cases import build_case  # noqa: E402
from conformance.harness import FAIL, PASS, SKIP, plan_matrix, run_matrix  # noqa: E402
from importers import import_huggingface, import_to_file  # noqa: E402
from rosetta.main import main  # noqa: E402
from spec import ConfigError, WeightsError, load_weights, params_digest  # noqa: E402
from tests.bounds import assert_agrees, assert_differs, model_bounds  # noqa: E402

# Odd sizes: 3 and 5 heads (d_k 16 and 12), vocabularies 101, 103, 89 and 97.
FAMILY_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=101, n_positions=24, n_embd=48, n_layer=2, n_head=3, n_inner=80, bos_token_id=100,
        eos_token_id=100, pad_token_id=0),
    "gpt2-untied": lambda: transformers.GPT2Config(
        vocab_size=101, n_positions=24, n_embd=60, n_layer=1, n_head=5, activation_function="gelu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "marian": lambda: transformers.MarianConfig(
        vocab_size=103, d_model=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=3,
        decoder_attention_heads=3, encoder_ffn_dim=72, decoder_ffn_dim=72, max_position_embeddings=64,
        pad_token_id=102, decoder_start_token_id=102, eos_token_id=0, activation_function="swish",
        scale_embedding=True),
    "marian-unshared": lambda: transformers.MarianConfig(
        vocab_size=103, decoder_vocab_size=89, share_encoder_decoder_embeddings=False, d_model=60,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=5, decoder_attention_heads=5,
        encoder_ffn_dim=44, decoder_ffn_dim=44, max_position_embeddings=64, pad_token_id=88,
        decoder_start_token_id=88, eos_token_id=0, activation_function="relu", scale_embedding=True),
    "bart": lambda: transformers.BartConfig(
        vocab_size=97, d_model=36, encoder_layers=2, decoder_layers=2, encoder_attention_heads=3,
        decoder_attention_heads=3, encoder_ffn_dim=52, decoder_ffn_dim=52, max_position_embeddings=40),
}
CLASSES = {"gpt2": "GPT2LMHeadModel", "marian": "MarianMTModel", "bart": "BartForConditionalGeneration"}


def _build(kind: str, directory: Path, seed: int = 0, **save_options) -> Path:
    family = kind.split("-")[0]
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family])(FAMILY_CONFIGS[kind]()).eval()
    generator = torch.Generator().manual_seed(seed)
    norm_scales = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.LayerNorm)}
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "embed_positions" in name and family == "marian":
                continue  # Marian's sinusoids are not weights
            # matrices and tables at 1/sqrt(their smaller side), as initialisations keep them;
            # biases and norm parameters perturbed by 0.1, enough that any mix-up shows
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            noise = noise * (min(tensor.shape) ** -0.5 if tensor.ndim >= 2 and tensor.shape[0] > 1 else 0.1)
            tensor.copy_(1.0 + noise if id(tensor) in norm_scales else noise)
    model.save_pretrained(directory, **save_options)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: _build(kind, root / kind) for kind in FAMILY_CONFIGS}


def _hf_logits(directory: Path, imported, src, tgt, src_keep, tgt_keep) -> np.ndarray:
    runner = TransformersRunner(directory, imported.config, "float64", "cpu")
    with torch.inference_mode():
        if src is None:
            out = runner.model(input_ids=torch.as_tensor(tgt), attention_mask=torch.as_tensor(tgt_keep.astype(int)))
        else:
            out = runner.model(input_ids=torch.as_tensor(src), attention_mask=torch.as_tensor(src_keep.astype(int)),
                               decoder_input_ids=torch.as_tensor(tgt),
                               decoder_attention_mask=torch.as_tensor(tgt_keep.astype(int)))
    return out.logits.numpy()


def _padded_batch(cfg, seed=0):
    """A right-padded batch of real tokens (never pad_id), lengths 9/6/3 and 7/5/2."""
    rng = np.random.default_rng(seed)

    def ids(vocab, lengths):
        values = rng.integers(0, vocab - 1, (len(lengths), max(lengths)))
        values = np.where(values >= cfg.pad_id, values + 1, values)
        keep = np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]
        return np.where(keep, values, cfg.pad_id), keep

    tgt, tgt_keep = ids(cfg.tgt_vocab_size, [7, 5, 2])
    if not cfg.has_encoder:
        return None, None, tgt, tgt_keep
    src, src_keep = ids(cfg.src_vocab_size, [9, 6, 3])
    return src, src_keep, tgt, tgt_keep


# ---- the golden equals transformers at float64 ------------------------------------------------------

@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_the_golden_equals_transformers_at_float64(checkpoints, kind):
    imported = import_huggingface(checkpoints[kind])
    cfg = imported.config
    src, src_keep, tgt, tgt_keep = _padded_batch(cfg)
    ours = golden.forward(cfg, imported.params, src, tgt, src_keep=src_keep, tgt_keep=tgt_keep)
    theirs = _hf_logits(checkpoints[kind], imported, src, tgt, src_keep, tgt_keep)
    assert_agrees(theirs, ours, **model_bounds(cfg, tgt.shape[1], 0 if src is None else src.shape[1]))


def test_the_float64_check_can_fail(checkpoints):
    """q and k of one layer swapped: the comparison that passed above must fail."""
    imported = import_huggingface(checkpoints["bart"])
    params = dict(imported.params)
    a, b = "encoder.layers.1.self_attn.q.weight", "encoder.layers.1.self_attn.k.weight"
    params[a], params[b] = params[b], params[a]
    src, src_keep, tgt, tgt_keep = _padded_batch(imported.config)
    wrong = golden.forward(imported.config, params, src, tgt, src_keep=src_keep, tgt_keep=tgt_keep)
    theirs = _hf_logits(checkpoints["bart"], imported, src, tgt, src_keep, tgt_keep)
    assert_differs(theirs, wrong, **model_bounds(imported.config, tgt.shape[1], src.shape[1]))


def test_every_tensor_of_the_checkpoint_is_accounted_for(checkpoints):
    """Each family's import reads every tensor of the file; what it drops is said in a note."""
    for kind, directory in checkpoints.items():
        imported = import_huggingface(directory)
        model = getattr(transformers, CLASSES[kind.split("-")[0]]).from_pretrained(directory)
        hf_count = sum(p.numel() for p in model.parameters())  # tied tensors once
        ours = sum(v.size for v in imported.params.values())
        cfg = imported.config
        dropped = {"bart": 2 * 2 * cfg.d_model,  # 2 unread rows x 2 tables
                   "marian": 2 * cfg.max_len * cfg.d_model,  # the sinusoid tables: computed, not imported
                   "gpt2": 0}[imported.family]
        bias = cfg.tgt_vocab_size if cfg.head_bias else 0  # final_logits_bias is a buffer
        assert ours + dropped - bias == hf_count, kind
    assert any("rows 0 and 1" in note for note in import_huggingface(checkpoints["bart"]).notes)


def test_the_imported_configs(checkpoints):
    gpt2 = import_huggingface(checkpoints["gpt2"]).config
    assert (gpt2.arch, gpt2.norm_position, gpt2.positional, gpt2.activation, gpt2.tie_head, gpt2.final_norm) == (
        "decoder-only", "pre", "learned", "gelu-tanh", True, True)
    assert (gpt2.n_heads, gpt2.d_head, gpt2.d_ff, gpt2.norm_eps, gpt2.pad_id) == (3, 16, 80, 1e-5, 0)
    marian = import_huggingface(checkpoints["marian"])
    assert (marian.config.positional, marian.config.activation, marian.config.embed_scale, marian.config.head_bias,
            marian.config.share_src_tgt_embed, marian.config.pad_id) == ("sinusoidal-concat", "swish", True, True,
                                                                          True, 102)
    assert any("pad token" in note for note in marian.notes)
    unshared = import_huggingface(checkpoints["marian-unshared"]).config
    assert (unshared.src_vocab_size, unshared.tgt_vocab_size, unshared.share_src_tgt_embed) == (103, 89, False)
    bart = import_huggingface(checkpoints["bart"]).config
    assert (bart.positional, bart.embed_norm, bart.embed_scale, bart.activation, bart.max_len) == (
        "learned", True, False, "gelu", 40)


# ---- the whole matrix on imported weights --------------------------------------------------------------

def _matrix(directory: Path, backends, dtypes):
    imported = import_huggingface(directory)
    register_backend("transformers", lambda: TransformersBackend(directory))
    try:
        plan = plan_matrix(imported.config, backends, dtypes, ["cpu"])
        return run_matrix(imported.config, imported.params, plan)
    finally:
        unregister_backend("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "marian", "bart"])
def test_the_transformers_column_passes_every_whole_model_case(checkpoints, kind):
    results = _matrix(checkpoints[kind], ["transformers"], ["float64", "float32", "float16", "bfloat16"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"} | (
        {"encoder"} if kind != "gpt2" else set())
    assert {r.mask_case for r in ran} >= {"pad_right", "pad_left", "all_pad"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]
    skipped = {r.reason for r in results if r.status == SKIP}
    assert all("whole models" in reason for reason in skipped)


@pytest.mark.slow
@pytest.mark.parametrize("kind, backends", [
    ("gpt2", ["numpy-float32", "torch", "jax", "transformers"]),
    ("marian-unshared", ["numpy-float32", "torch", "jax-math", "transformers"]),
    ("bart", ["numpy-float32", "torch", "jax", "onnx", "transformers"]),
])
def test_the_whole_matrix_on_imported_weights(checkpoints, kind, backends):
    results = _matrix(checkpoints[kind], backends, ["float32"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.backend for r in ran} == set(backends)
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]


def test_the_column_refuses_weights_that_are_not_the_directory(checkpoints):
    imported = import_huggingface(checkpoints["gpt2"])
    params = dict(imported.params)
    params["decoder.norm.bias"] = params["decoder.norm.bias"] + np.float32(1e-3)
    register_backend("transformers", lambda: TransformersBackend(checkpoints["gpt2"]))
    try:
        results = run_matrix(imported.config, params, plan_matrix(imported.config, ["transformers"], ["float32"]))
    finally:
        unregister_backend("transformers")
    errors = [r for r in results if r.status not in (SKIP,)]
    assert errors and all(r.status == "error" and "not the import of" in r.reason for r in errors)


def test_eager_attention_differs_from_the_spec_only_on_rows_without_keys(checkpoints):
    """What docs/huggingface.md says: transformers' eager attention gives a query with no key
    the softmax over every key, SDPA (the column's) the spec's zeros."""
    imported = import_huggingface(checkpoints["gpt2"])
    cfg = imported.config
    case = build_case(cfg, imported.params, "forward", "pad_left")
    ours = golden.forward(cfg, imported.params, None, case.inputs["tgt_ids"])
    keep = case.inputs["tgt_ids"] != cfg.pad_id
    no_key = ~np.logical_or.accumulate(keep, axis=1)  # [B, T]: nothing real at or before the position
    assert no_key.any()
    limit = case.tolerance(cfg, "float64") * max(1.0, np.abs(ours).max())  # the case's own check, per position
    for implementation in ("sdpa", "eager"):
        model = transformers.GPT2LMHeadModel.from_pretrained(checkpoints["gpt2"], dtype=torch.float64,
                                                             attn_implementation=implementation).eval()
        with torch.inference_mode():
            theirs = model(input_ids=torch.as_tensor(case.inputs["tgt_ids"]),
                           attention_mask=torch.as_tensor(keep.astype(int))).logits.numpy()
        differs = np.abs(theirs - ours).max(axis=-1) > limit
        if implementation == "sdpa":
            assert not differs.any()
        else:
            assert np.array_equal(differs, no_key)


def test_transformers_missing_is_reported_unavailable(monkeypatch, checkpoints):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    reason = TransformersBackend(checkpoints["gpt2"]).availability()
    assert reason is not None and reason.startswith("not installed")


# ---- checkpoint formats --------------------------------------------------------------------------------

def test_bfloat16_float16_and_sharded_checkpoints(tmp_path, checkpoints):
    reference = import_huggingface(checkpoints["bart"]).params
    for dtype in (torch.bfloat16, torch.float16):
        model = transformers.BartForConditionalGeneration.from_pretrained(checkpoints["bart"], dtype=dtype)
        model.save_pretrained(tmp_path / str(dtype))
        params = import_huggingface(tmp_path / str(dtype)).params
        for name, value in params.items():
            rounded = torch.from_numpy(reference[name]).to(dtype).float().numpy()
            assert np.array_equal(value, rounded), name
    sharded = _build("gpt2", tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    assert params_digest(import_huggingface(sharded).params) == params_digest(import_huggingface(checkpoints["gpt2"]).params)


def _rewrite(directory: Path, target: Path, change) -> Path:
    """A copy of a model directory whose tensors went through change(dict) -> dict."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(directory, target)
    tensors = change(load_file(target / "model.safetensors"))
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_gpt2_checkpoints_without_the_transformer_prefix_and_with_mask_buffers(tmp_path, checkpoints):
    """The original openai-community/gpt2 file: keys without 'transformer.', causal-mask buffers."""
    def original_layout(tensors):
        renamed = {key.removeprefix("transformer."): value for key, value in tensors.items()}
        for i in range(2):
            renamed[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 24, 24), np.float32))
        return renamed

    directory = _rewrite(checkpoints["gpt2"], tmp_path / "gpt2-original", original_layout)
    imported = import_huggingface(directory)
    assert params_digest(imported.params) == params_digest(import_huggingface(checkpoints["gpt2"]).params)
    assert any("causal-mask buffers" in note for note in imported.notes)


def test_a_stored_marian_sinusoid_table_is_checked(tmp_path, checkpoints):
    d = 48

    def with_table(table):
        return lambda tensors: {**tensors, "model.encoder.embed_positions.weight": table.astype(np.float32)}

    ours = golden.sinusoidal_table(np.arange(64), d, "sinusoidal-concat")
    good = _rewrite(checkpoints["marian"], tmp_path / "good", with_table(ours))
    assert any("sinusoid tables" in note for note in import_huggingface(good).notes)
    interleaved = golden.sinusoidal_table(np.arange(64), d, "sinusoidal")
    bad = _rewrite(checkpoints["marian"], tmp_path / "bad", with_table(interleaved))
    with pytest.raises(WeightsError, match="not the sinusoid table"):
        import_huggingface(bad)


# ---- refusals ----------------------------------------------------------------------------------------

def test_a_pickle_checkpoint_is_refused_unopened(tmp_path, checkpoints):
    directory = tmp_path / "pickled"
    directory.mkdir()
    shutil.copy(checkpoints["gpt2"] / "config.json", directory)
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be opened")
    with pytest.raises(WeightsError, match=r"pytorch_model.bin.*pickle.*never opens.*safetensors"):
        import_huggingface(directory)


def test_a_mismatched_checkpoint_gets_the_whole_key_diff(tmp_path, checkpoints):
    def damage(tensors):
        tensors.pop("transformer.h.1.mlp.c_fc.bias")
        tensors["transformer.h.0.attn.c_proj.weight"] = tensors["transformer.h.0.attn.c_proj.weight"][:, :40]
        tensors["transformer.h.0.adapter.weight"] = np.zeros(3, np.float32)
        return tensors

    with pytest.raises(WeightsError) as error:
        import_huggingface(_rewrite(checkpoints["gpt2"], tmp_path / "damaged", damage))
    message = str(error.value)
    assert "missing: transformer.h.1.mlp.c_fc.bias" in message
    assert "transformer.h.0.attn.c_proj.weight: shape [48, 40], expected [48, 48]" in message
    assert "unexpected: transformer.h.0.adapter.weight" in message


def test_an_untied_copy_and_non_finite_weights_are_refused(tmp_path, checkpoints):
    def untie(tensors):
        return {**tensors, "lm_head.weight": tensors["transformer.wte.weight"] + 1}

    with pytest.raises(WeightsError, match="lm_head.weight should equal transformer.wte.weight"):
        import_huggingface(_rewrite(checkpoints["gpt2"], tmp_path / "untied", untie))

    def poison(tensors):
        tensors["transformer.ln_f.bias"] = tensors["transformer.ln_f.bias"].copy()
        tensors["transformer.ln_f.bias"][3] = np.nan
        return tensors

    with pytest.raises(WeightsError, match="NaN or Inf in: decoder.norm.bias"):
        import_huggingface(_rewrite(checkpoints["gpt2"], tmp_path / "nan", poison))


def _with_config(tmp_path: Path, source: Path, **changes) -> Path:
    target = tmp_path / "edited"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("kind, changes, message", [
    ("gpt2", {"model_type": "t5", "relative_attention_num_buckets": 32},
     r"model_type = \"t5\" cannot be imported: relative_attention_num_buckets = 32: .*relative position bias.*RMSNorm"),
    ("gpt2", {"model_type": "gpt_neox", "use_parallel_residual": True},
     r"use_parallel_residual = true: GPT-NeoX \(Pythia\) adds attention and FFN to one residual in parallel"),
    ("gpt2", {"model_type": "gptj"}, r"model_type = \"gptj\" is not a family the importer knows"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx = true"),
    ("gpt2", {"activation_function": "gelu_fast"}, r"activation_function = 'gelu_fast' is not in the spec"),
    ("gpt2", {"architectures": ["GPT2ForSequenceClassification"]}, r"only GPT2LMHeadModel has the output head"),
    ("gpt2", {"pad_token_id": None, "eos_token_id": 50256}, r"pad_token_id = null and eos_token_id = 50256"),
    ("marian", {"decoder_attention_heads": 6}, r"encoder_attention_heads = 3 but decoder_attention_heads = 6"),
    ("bart", {"add_final_layer_norm": True}, r"add_final_layer_norm = true"),
])
def test_configs_the_spec_cannot_express_are_refused_by_field(tmp_path, checkpoints, kind, changes, message):
    with pytest.raises(ConfigError, match=message):
        import_huggingface(_with_config(tmp_path, checkpoints[kind], **changes))


def test_gpt2_without_a_pad_token_pads_with_eos(tmp_path, checkpoints):
    imported = import_huggingface(_with_config(tmp_path, checkpoints["gpt2"], pad_token_id=None))
    assert imported.config.pad_id == 100 and any("eos_token_id (100)" in note for note in imported.notes)


# ---- the command line ------------------------------------------------------------------------------------

def test_rosetta_import_writes_an_ordinary_weights_file(tmp_path, checkpoints, capsys):
    out = tmp_path / "marian.safetensors"
    assert main(["import", str(checkpoints["marian"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "imported marian" in printed and "note: Marian decodes from the pad token" in printed
    cfg, params = load_weights(out)
    imported = import_huggingface(checkpoints["marian"])
    assert cfg == imported.config and params_digest(params) == params_digest(imported.params)
    assert import_to_file(checkpoints["marian"], tmp_path / "again.safetensors").config == cfg


def test_rosetta_check_with_hf(tmp_path, checkpoints, capsys):
    out = tmp_path / "bart.safetensors"
    assert main(["import", str(checkpoints["bart"]), "--out", str(out)]) == 0
    arguments = ["--backends", "numpy-float32,transformers", "--dtypes", "float32", "-k", "forward", "--quiet"]
    assert main(["check", "--weights", str(out), "--hf", str(checkpoints["bart"]), *arguments]) == 0
    assert "forward-pad_start" in capsys.readouterr().out  # the transformers column ran, start token included
    assert main(["check", "--hf", str(checkpoints["bart"]), *arguments]) == 0  # weights imported on the way
    other = tmp_path / "gpt2.safetensors"
    main(["import", str(checkpoints["gpt2"]), "--out", str(other)])
    assert main(["check", "--weights", str(other), "--hf", str(checkpoints["bart"]), *arguments]) == 1
    assert "not the import of" in capsys.readouterr().out
    assert main(["check", "--backends", "transformers"]) == 2
    assert "--hf DIR" in capsys.readouterr().err
    assert main(["check", "--preset", "tiny", "--hf", str(checkpoints["bart"])]) == 2


def test_the_transformers_column_loads_without_other_libraries_lines(checkpoints):
    """Issue 58: a check's output is its own. Loading a model class makes transformers import torchao
    where it is installed (the tests' extra), which logs its CUDA libraries' absence and makes torch
    log an enum's registration; transformers draws a loading bar. A fresh process that loads the
    column's runner writes none of them."""
    import subprocess
    import sys

    load = ("from pathlib import Path\n"
            "from conformance.backends.transformers_backend import TransformersRunner\n"
            "from importers import import_huggingface\n"
            f"directory = Path({str(checkpoints['gpt2'])!r})\n"
            "TransformersRunner(directory, import_huggingface(directory).config, 'float32', 'cpu')\n"
            "print('loaded')\n")
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]
    for line in ("Failed to load", "_pytree", "Loading weights"):
        assert line not in done.stderr, done.stderr[-2000:]
