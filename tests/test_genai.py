"""onnxruntime-genai's column: an ONNX implementation of Llama (with llama3 rope scaling too),
Qwen2, Qwen3, Phi-3 (with longrope) and Gemma 2 written by its model builder, not traced from
anyone's PyTorch, checked against the golden.

Models are random (nothing is downloaded), at odd sizes with every parameter perturbed, and with
heads of 16 (onnxruntime's CPU GroupQueryAttention takes no other sizes): Llama with 2 groups,
Qwen2 multi-query with q/k/v biases and a tied head, Qwen3 with a head_dim apart from hidden /
heads. Each model is built once per module (the builder takes a few seconds).

The rows genai cannot express are left out of their cells with their cause, and the others
compared; the tests below show each cause measured, so what is left out is a finding, not a hole.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

onnxruntime_genai = pytest.importorskip(
    "onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install --no-deps onnxruntime-genai-cuda)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import impl_numpy as golden  # noqa: E402
from conformance.adapter import NotSupported, register_backend, unregister_backend  # noqa: E402
from conformance.backends.genai_backend import (ALL_PAD, GEMMA3_ROPE, LEFT_PADDING, PAD_STEP,  # noqa: E402
                                                RAGGED_WINDOW, SMOLLM3_NOPE, UNPADDED_ONLY, GenaiBackend, build_model,
                                                genai_unsupported_reason, inexpressible)
from conformance.cases import build_case  # noqa: E402
from conformance.harness import FAIL, PASS, SKIP, golden_runner_for, plan_matrix, run_matrix  # noqa: E402
from conformance.tolerance import compare, tolerance  # noqa: E402
from importers import import_huggingface  # noqa: E402
from spec import WeightsError  # noqa: E402
from tests.bounds import assert_agrees, assert_differs, model_bounds  # noqa: E402
from tests.peer_directories import forward_none, saved_at  # noqa: E402
from tests.test_huggingface_modern import QWEN2_HEADS_OF_16, build_checkpoint  # noqa: E402

def PHI3_LONGROPE(**rope):  # noqa: N802 - a config factory, as the others
    return transformers.Phi3Config(
        vocab_size=103, hidden_size=80, intermediate_size=76, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, max_position_embeddings=4096, original_max_position_embeddings=6, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 6,
                         "short_factor": [1.0, 1.05, 1.2, 1.4, 1.7, 2.1, 2.6, 3.2],
                         "long_factor": [1.1, 1.6, 2.9, 5.0, 9.0, 16.0, 27.0, 41.0], **rope},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def GEMMA2_HEADS_OF_16(hidden_size=64):  # noqa: N802 - a config factory, as the others
    return transformers.Gemma2Config(
        vocab_size=131, hidden_size=hidden_size, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=5, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, pad_token_id=0, bos_token_id=2,
        eos_token_id=1)


GENAI_CONFIGS = {
    # 4 query heads of 16 over 2 key/value heads, untied head, vocabulary 97
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, bos_token_id=1, eos_token_id=2,
        pad_token_id=0),
    # Llama 3.1's rope scaling (factor 32, bands over an original context of 1280), θ 5e5
    "llama-llama3": lambda: transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1280},
        bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # multi-query: 3 query heads of 16 over 1; q/k/v biases; tied; no pad token
    "qwen2": QWEN2_HEADS_OF_16,
    # head_dim 16 where hidden / heads is 10; q/k head norms
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=89, hidden_size=40, intermediate_size=60, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, pad_token_id=0, eos_token_id=1),
    # longrope as Phi-3's files write it (no factor), its original context 6: every decode case crosses it;
    # 5 query heads of 16 over 1, every dimension rotating (8 pairs: the kernel's multiple)
    "phi3": lambda: PHI3_LONGROPE(),
    # softcaps of 3 and 4, four (1 + w) norms, a query scalar of 12, layers sliding (window 5) then full;
    # d 64, whose √d the builder's rounding to two decimals leaves exact (see the d 72 test below)
    "gemma2": lambda: GEMMA2_HEADS_OF_16(),
}
REFUSALS = {ALL_PAD, LEFT_PADDING, PAD_STEP, UNPADDED_ONLY, RAGGED_WINDOW}


class Built:
    """One family's checkpoint, its import, and genai's model of it (built once)."""

    def __init__(self, directory):
        self.directory = directory
        imported = import_huggingface(directory)
        self.cfg, self.params = imported.config, imported.params
        self.backend = GenaiBackend(directory)
        self.runner = self.backend.load(self.cfg, self.params, "float32", "cpu")

    def matrix(self, backend=None):
        register_backend("onnxruntime-genai", lambda: backend or self.backend)
        try:
            return run_matrix(self.cfg, self.params, plan_matrix(self.cfg, ["onnxruntime-genai"], ["float32"], ["cpu"]))
        finally:
            unregister_backend("onnxruntime-genai")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("genai")
    return {kind: Built(build_checkpoint(kind.split("-")[0], make(), root / kind)) for kind, make in GENAI_CONFIGS.items()}


def _apart_at_each_position(theirs, reference, bounds):
    """[positions]: each position's largest |theirs − reference| of row 0 over the policy's absolute
    tolerance for the whole output (model_bounds' n, depth and angle at float32, relative to
    max(1, max|reference|)): above 1 at a position the check tells apart."""
    tol = tolerance("float32", bounds["n"], bounds["depth"], bounds["angle"]) * max(1.0, float(np.abs(reference).max()))
    return np.abs(np.asarray(theirs, np.float64) - reference).max(axis=-1)[0] / tol


def _case(model, sublayer, mask_case):
    case = build_case(model.cfg, model.params, sublayer, mask_case)
    return case, golden_runner_for(model.cfg, model.params).run(sublayer, case.inputs)


# ---- the column -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_directory_saved_in_float64_or_bfloat16_runs(built, tmp_path, dtype):
    """save_pretrained of a float64 model writes float64 tensors and `"dtype": "float64"`, which
    CTranslate2's converter refuses (tests/test_ctranslate2.py); genai's builder takes them (with the
    staged config's float32 rewrite, conformance.backends.staging, and without it: measured), and a
    bfloat16 directory as stored. The golden reads the importer's float32 values of the same tensors."""
    directory = saved_at(built["llama"].directory, dtype, tmp_path / dtype)
    assert json.loads((directory / "config.json").read_text())["dtype"] == dtype
    cell = forward_none("onnxruntime-genai", lambda: GenaiBackend(directory), directory)
    assert cell.status == PASS, cell.reason


@pytest.mark.slow
@pytest.mark.parametrize("family", list(GENAI_CONFIGS))
def test_the_genai_column_passes_every_case_it_can_express(built, family):
    """Every whole-model cell runs: the rows genai can express are compared and pass, the others
    are named with their measured cause (decode-far's unpadded row included, once a skipped cell)."""
    results = built[family].matrix()
    ran = [r for r in results if r.status != SKIP]
    model_cases = {"forward", "decode", "generate"}
    assert {r.sublayer for r in ran} == model_cases
    assert not [r.test_id for r in results if r.status == SKIP and r.sublayer in model_cases]
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]
    partly = {f"{r.sublayer}-{r.mask_case}": r.left_out for r in ran if r.left_out}
    assert {"forward-pad_left", "forward-all_pad", "decode-pad_right", "decode-far", "generate-pad_left"} <= set(partly)
    assert all(any(cause in reason for cause in REFUSALS) for reason in partly.values()), partly
    assert partly["decode-far"] == "rows 1, 2: " + PAD_STEP


@pytest.mark.slow
def test_rotary_tables_rounded_to_bfloat16_in_genai_graph_are_caught(built, tmp_path):
    """The planted mistake of transformers PR #29285, in genai's own graph: its cos/sin caches
    rounded through bfloat16. The column fails forward and decode, decode-far among them (its
    unpadded row; the cell was skipped whole before rows were compared); nothing else changed."""
    import ml_dtypes
    import onnx
    from onnx import numpy_helper

    model = built["llama"]
    tampered = tmp_path / "model"
    shutil.copytree(model.runner.directory, tampered)
    graph = onnx.load(str(tampered / "model.onnx"))
    rounded = []
    for initializer in graph.graph.initializer:
        if initializer.name in ("cos_cache", "sin_cache"):
            table = numpy_helper.to_array(initializer)
            initializer.CopyFrom(numpy_helper.from_array(table.astype(ml_dtypes.bfloat16).astype(np.float32),
                                                         initializer.name))
            rounded.append(initializer.name)
    assert sorted(rounded) == ["cos_cache", "sin_cache"]
    (tampered / "model.onnx.data").unlink()
    onnx.save(graph, str(tampered / "model.onnx"), save_as_external_data=True, location="model.onnx.data")

    backend = GenaiBackend(model.directory)
    backend._built = tampered
    failed = {(r.sublayer, r.mask_case) for r in model.matrix(backend) if r.status == FAIL}
    assert {("forward", "none"), ("forward", "long"), ("decode", "incremental"), ("decode", "far")} <= failed


# ---- each skip's cause, measured ------------------------------------------------------------------------

def test_a_left_padded_row_is_read_as_its_length(built):
    """genai's mask is a length: a row of 3 pads then 7 real tokens is computed as if its first 7
    slots (the pads among them) were real and its last 3 were padding."""
    model = built["llama"]
    cfg = model.cfg
    ids = np.concatenate([[cfg.pad_id] * 3, [5, 17, 33, 48, 60, 71, 80]])[None]
    theirs = model.runner.logits(ids)
    as_spec = golden.forward(cfg, model.params, None, ids, tgt_keep=ids != cfg.pad_id)
    as_length = golden.forward(cfg, model.params, None, ids, tgt_keep=np.arange(10)[None] < 7)
    bounds = model_bounds(cfg, ids.shape[1])  # float32, the whole forward over 10 rotated positions
    assert_differs(theirs[:, 3:], as_spec[:, 3:], dtype="float32", **bounds,
                   what="at the real tokens: not the spec's numbers")
    assert_agrees(theirs[:, :7], as_length[:, :7], dtype="float32", **bounds,
                  what="where genai's length says real: the length's")
    assert inexpressible(ids != cfg.pad_id) == LEFT_PADDING


def test_a_pad_fed_as_a_decode_step_is_taken_as_real(built):
    model = built["llama"]
    case, expected = _case(model, "decode", "pad_right")
    ids, prefix = case.inputs["tgt_ids"], case.inputs["prefix"]
    pad_step = ids[:, prefix:] == model.cfg.pad_id
    assert pad_step.any() and not pad_step.all()
    theirs = model.runner.step_logits(ids, prefix)  # [B, steps, V]
    relative = case.tolerance(model.cfg, "float32")  # the case's own, as the harness judges it
    real = compare(theirs[~pad_step], expected[~pad_step], relative, case.floor)
    assert real.passed, real
    # every pad step beyond the case's absolute tolerance (relative to the whole output's size): each told apart
    tol = relative * max(case.floor, float(np.abs(expected).max()))
    assert (np.abs(theirs - expected).max(axis=-1)[pad_step] > tol).all()
    assert inexpressible(ids != model.cfg.pad_id, prefix) == PAD_STEP


def test_a_row_without_a_real_token_is_refused_by_onnxruntime(built):
    model = built["qwen3"]
    ids = np.array([[5, 9, 11], [model.cfg.pad_id] * 3])
    with pytest.raises(Exception, match="seqlens_k"):
        model.runner.logits(ids)
    assert inexpressible(ids != model.cfg.pad_id) == ALL_PAD


@pytest.mark.slow
def test_a_decode_step_past_position_1000_agrees(built):
    """decode-far leaves its padded rows out; its unpadded row, 1001 cached positions then two
    steps through genai's cache, agrees with the golden at the case's tolerance."""
    model = built["qwen2"]
    case, expected = _case(model, "decode", "far")
    ids, prefix = case.inputs["tgt_ids"], case.inputs["prefix"]
    unpadded = [row for row in range(ids.shape[0]) if (ids[row] != model.cfg.pad_id).all()]
    assert prefix >= 1000 and unpadded
    theirs = model.runner.step_logits(ids[unpadded], prefix)
    result = compare(theirs, expected[unpadded], case.tolerance(model.cfg, "float32"), case.floor)
    assert result.passed, result


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 4)), min_size=1, max_size=4), st.integers(0, 9))
def test_what_genai_can_express_is_right_padded_rows_with_real_steps(rows, first_step):
    """Rows of real tokens then pads are expressible; a pad moved to the front of a row, an empty
    row, or a pad among the decode steps is not, each with its own cause."""
    width = max(real + pads for real, pads in rows)
    keep = np.array([[slot < real for slot in range(width)] for real, _ in rows])
    assert inexpressible(keep) is None
    steps_real = keep[:, min(first_step, width):].all()
    assert inexpressible(keep, first_step) == (None if steps_real else PAD_STEP)
    if not keep.all():
        shifted = np.roll(keep, 1, axis=1)  # some row now starts with a pad before its real tokens
        assert inexpressible(shifted) == (LEFT_PADDING if (~shifted[:, 0] & shifted.any(axis=1)).any() else None)
    emptied = keep.copy()
    emptied[-1] = False
    assert inexpressible(emptied) == ALL_PAD


# ---- refusals -------------------------------------------------------------------------------------------

def test_other_dtypes_and_sublayers_are_refused_by_name():
    backend = GenaiBackend("unused")
    assert backend.supports("float32", "cpu") is None
    assert "float16" in backend.supports("float16", "cpu")
    assert "whole decoders" in backend.supports_sublayer("attention")
    assert backend.devices() == ["cpu"]


def test_weights_that_are_not_the_directory_import_are_refused(built):
    model = built["llama"]
    changed = dict(model.params)
    name = next(iter(changed))
    changed[name] = changed[name] + 1e-3
    with pytest.raises(WeightsError, match="onnxruntime-genai column"):
        GenaiBackend(model.directory).load(model.cfg, changed, "float32", "cpu")


def test_a_head_size_genai_cannot_run_on_the_cpu_is_refused(tmp_path):
    config = GENAI_CONFIGS["qwen3"]()
    config.head_dim = 12
    directory = build_checkpoint("qwen3", config, tmp_path / "qwen3-head-12")
    imported = import_huggingface(directory)
    with pytest.raises(NotSupported, match="head size 12"):
        GenaiBackend(directory).load(imported.config, imported.params, "float32", "cpu")


def _genai_forward(directory, cfg, ids):
    """genai's prompt logits of the builder's model of directory, refusals aside (to measure them)."""
    from conformance.backends.genai_backend import GenaiRunner, build_model

    folder = directory.parent / "built"
    folder.mkdir()
    return GenaiRunner(build_model(directory, cfg, folder), cfg).run("forward", {"src_ids": None, "tgt_ids": ids})


def test_a_rotation_genai_cannot_run_and_a_window_it_drops_are_refused_with_the_measured_cause(tmp_path):
    """Mistral's window of 5: the builder writes local_window_size -1, and its logits on a 12-token
    prompt are full causal attention's (equal to the golden without a window, apart from the
    golden with it from position 5 on); the column refuses a window naming that. Phi-3 rotating
    12 of 16 dimensions (6 pairs): its kernel refuses, and so does the column."""
    mistral = transformers.MistralConfig(
        vocab_size=107, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, sliding_window=5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    directory = build_checkpoint("mistral", mistral, tmp_path / "mistral" / "hf")
    imported = import_huggingface(directory)
    cfg, params = imported.config, imported.params
    with pytest.raises(NotSupported, match="a sliding window of 5 keys: the builder reads"):
        GenaiBackend(directory).load(cfg, params, "float32", "cpu")
    ids = np.random.default_rng(0).integers(1, cfg.tgt_vocab_size, (1, 12))
    theirs = _genai_forward(directory, cfg, ids)
    full_causal = golden.forward(cfg.replace(sliding_window=None), params, None, ids)
    windowed = golden.forward(cfg, params, None, ids)
    bounds = model_bounds(cfg, ids.shape[1])  # float32, the whole forward over 12 rotated positions
    assert_agrees(theirs, full_causal, dtype="float32", **bounds, what="full causal attention")
    assert_agrees(theirs[:, :5], windowed[:, :5], dtype="float32", **bounds, what="within the window")
    assert (_apart_at_each_position(theirs, windowed, bounds)[5:] > 1).all()  # past it, each position told apart
    partial = PHI3_LONGROPE(partial_rotary_factor=0.75, short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                            long_factor=[1.2, 2.0, 4.0, 9.0, 20.0, 40.0])
    directory = build_checkpoint("phi3", partial, tmp_path / "phi3-partial")
    imported = import_huggingface(directory)
    with pytest.raises(NotSupported, match="12 rotated dimensions: .* a multiple of 8 pairs"):
        GenaiBackend(directory).load(imported.config, imported.params, "float32", "cpu")


def test_genai_takes_longropes_attention_factor_from_the_two_lengths_not_from_factor(tmp_path):
    """A longrope file with factor 4 (transformers reads it; its warning asks for it): genai's
    builder computes √(1 + ln(4096/6) / ln 6) = 2.15 where the spec and transformers take
    √(1 + ln 4 / ln 6) = 1.33; its logits are the golden's with that attention factor, and miss
    the golden's own by far from position 1 on (position 0 attends to itself alone)."""
    import dataclasses

    directory = build_checkpoint("phi3", PHI3_LONGROPE(factor=4.0), tmp_path / "phi3-factor" / "hf")
    imported = import_huggingface(directory)
    cfg, params = imported.config, imported.params
    assert cfg.rope_scaling.factor == 4.0
    ids = np.random.default_rng(0).integers(1, cfg.tgt_vocab_size, (1, 9))
    theirs = _genai_forward(directory, cfg, ids)
    from_lengths = cfg.replace(rope_scaling=dataclasses.replace(
        cfg.rope_scaling, attention_factor=float(np.sqrt(1 + np.log(4096 / 6) / np.log(6)))))
    bounds = model_bounds(cfg, ids.shape[1])  # float32, the whole forward over 9 rotated positions
    assert_agrees(theirs, golden.forward(from_lengths, params, None, ids), dtype="float32", **bounds,
                  what="the golden with genai's attention factor")
    ours = golden.forward(cfg, params, None, ids)
    assert_agrees(theirs[:, :1], ours[:, :1], dtype="float32", **bounds, what="position 0")
    assert (_apart_at_each_position(theirs, ours, bounds)[1:] > 1).all()  # from position 1 on, each told apart


@pytest.mark.slow
def test_genai_rescales_llama3s_frequencies(built):
    """The llama3 file passes every case (the column test above); here, that it would not have
    passed without the rescaling: its forward is far from the golden's with the plain rotary."""
    model = built["llama-llama3"]
    case, reference = _case(model, "forward", "none")
    theirs = model.runner.run("forward", case.inputs)
    assert compare(theirs, reference, case.tolerance(model.cfg, "float32"), case.floor).passed
    plain = model.cfg.replace(rope_scaling=None)
    unscaled = golden_runner_for(plain, model.params).run("forward", case.inputs)
    assert not compare(theirs, unscaled, case.tolerance(model.cfg, "float32"), case.floor).passed


@pytest.mark.slow
def test_rosetta_check_runs_the_genai_column_with_hf(built, capsys):
    from rosetta.main import main

    arguments = ["--backends", "onnxruntime-genai", "--dtypes", "float32", "-k", "forward", "--quiet"]
    assert main(["check", "--hf", str(built["qwen3"].directory), *arguments]) == 0
    assert "forward-long" in capsys.readouterr().out
    assert main(["check", "--backends", "onnxruntime-genai"]) == 2
    assert "the onnxruntime-genai column runs a Hugging Face model directory" in capsys.readouterr().err


@pytest.mark.slow
def test_the_bench_contender_generates_the_golden_tokens_from_canonical_weights():
    """rosetta bench's onnxruntime-genai contender: the canonical weights written as a Hugging Face
    directory, built, and its batch greedy search equal to the golden's (eos kept, pad after)."""
    from benchmarks.contenders import EOS_ID, OnnxRuntimeGenai
    from spec import get_preset, init_params

    cfg = get_preset("llama-tiny").replace(n_heads=3, n_kv_heads=1)  # heads of 16
    params = init_params(cfg, seed=0)
    contender = OnnxRuntimeGenai()
    contender.prepare(cfg, params)
    prompt = np.random.default_rng(0).integers(3, cfg.tgt_vocab_size, (4, 16))
    want = golden.greedy_generate(cfg, params, None, prompt_ids=prompt, eos_id=EOS_ID, max_new_tokens=16)
    np.testing.assert_array_equal(contender.generate(prompt, 16), want)
    ended = golden.greedy_generate(cfg, params, None, prompt_ids=prompt, eos_id=int(want[1, 4]), max_new_tokens=16)
    np.testing.assert_array_equal(contender.runner.greedy_batch(prompt, 16, int(want[1, 4])), ended)


# ---- Gemma: the builder's embedding scale, and Gemma 3 ------------------------------------------------

def test_genais_gemma_scales_the_embeddings_by_sqrt_d_rounded_to_two_decimals(tmp_path):
    """d = 72: √72 = 8.4853 becomes 8.49 in the builder (GemmaModel's embed_attrs scale), 5.6e-4 apart.
    Every logits cell fails the spec's float32 tolerance by that, and the golden with the rounded
    scale written in agrees with genai within it: the disagreement is that one number."""
    directory = build_checkpoint("gemma2", GEMMA2_HEADS_OF_16(hidden_size=72), tmp_path / "gemma2-72" / "hf")
    model = Built(directory)
    case, reference = _case(model, "forward", "none")
    ids = case.inputs["tgt_ids"]
    ours = model.runner.logits(ids)
    tol = case.tolerance(model.cfg, "float32")  # the case's own, as the column's cell is judged
    assert not compare(ours, reference, tol, case.floor).passed
    original = golden.token_embedding

    def rounded(ids_, weight, scale):
        return weight[ids_] * round(float(np.sqrt(weight.shape[1])), 2) if scale else weight[ids_]

    golden.model.token_embedding = rounded
    try:
        theirs = golden.forward(model.cfg, model.params, None, ids)
    finally:
        golden.model.token_embedding = original
    assert compare(ours, theirs, tol, case.floor).passed


def test_genai_cannot_build_gemma_3_from_a_transformers_5_directory(tmp_path):
    """The builder's make_rope_init reads rope_parameters["rope_type"]; Gemma 3's rope_parameters holds
    one entry per layer type: measured, and the column refuses Gemma 3 with that cause."""
    config = transformers.Gemma3TextConfig(
        vocab_size=139, hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        pad_token_id=0, bos_token_id=2, eos_token_id=1)
    directory = build_checkpoint("gemma3_text", config, tmp_path / "gemma3" / "hf")
    cfg = import_huggingface(directory).config
    with pytest.raises(RuntimeError, match="KeyError: 'rope_type'"):
        build_model(directory, cfg, tmp_path)
    assert genai_unsupported_reason(cfg, "gemma3_text") == GEMMA3_ROPE
    with pytest.raises(NotSupported, match="make_rope_init reads"):
        GenaiBackend(directory).load(cfg, import_huggingface(directory).params, "float32", "cpu")


def test_genai_cannot_build_smollm3s_nope_layers(tmp_path):
    """The builder has a SmolLM3 class, which turns the rotation inside GroupQueryAttention off for a
    NoPE layer; its base class then rotates by a separate op that reads position_ids, which the CPU
    model does not take: measured, and the column refuses SmolLM3 with that cause."""
    config = transformers.SmolLM3Config(
        vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, no_rope_layers=[1, 0],
        rope_parameters={"rope_type": "default", "rope_theta": 3000000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    directory = build_checkpoint("smollm3", config, tmp_path / "smollm3" / "hf")
    imported = import_huggingface(directory)
    with pytest.raises(RuntimeError, match="KeyError: 'position_ids'"):
        build_model(directory, imported.config, tmp_path)
    assert genai_unsupported_reason(imported.config, "smollm3") == SMOLLM3_NOPE
    with pytest.raises(NotSupported, match="its NoPE layers would rotate"):
        GenaiBackend(directory).load(imported.config, imported.params, "float32", "cpu")


def test_the_builder_refuses_the_hybrids_files_the_writer_writes(tmp_path):
    """onnxruntime-genai's builder makes Qwen3.5's gated DeltaNet layers from the multimodal
    checkpoint's architecture only: the text model's files (Qwen3_5ForCausalLM, which the writer
    writes) it refuses, and the column and the bench's contender say so before building."""
    from benchmarks.contenders import OnnxRuntimeGenai, Skip
    from importers.huggingface_writer import to_huggingface
    from spec import conformance_params, get_preset

    cfg = get_preset("qwen35-tiny")
    params = conformance_params(cfg)
    directory = to_huggingface(cfg, params, tmp_path / "hf")
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    with pytest.raises(RuntimeError, match="model is not currently supported"):  # its architecture
        build_model(directory, cfg, tmp_path)
    assert "Qwen3_5ForConditionalGeneration" in genai_unsupported_reason(cfg, "qwen3_5_text")
    with pytest.raises(Skip, match="gated DeltaNet"):
        OnnxRuntimeGenai().prepare(cfg, params)


# ---- the builder, run from a process that imported torch and transformers once -----------------------

def _digests(folder):
    import hashlib

    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def test_a_build_forked_from_the_builder_server_is_the_command_lines_build(tmp_path, monkeypatch):
    """A fork of the server (conformance.backends.genai_builder) writes what `python -m
    onnxruntime_genai.models.builder` writes, byte for byte, after another family was built by the
    same server (nothing one build sets reaches the next); where the server is gone (killed here), the
    build runs afresh and a later one starts a server again."""
    import conformance.backends.genai_builder as builder

    built = {}
    for family in ("qwen2", "gemma2"):
        directory = build_checkpoint(family, GENAI_CONFIGS[family](), tmp_path / family / "hf")
        cfg = import_huggingface(directory).config
        (tmp_path / family / "server").mkdir()
        built[family] = build_model(directory, cfg, tmp_path / family / "server")
    server = builder._SERVER
    assert server is not None and server.process.poll() is None  # both builds were the server's
    with monkeypatch.context() as patched:
        patched.setattr(builder, "_server", lambda: None)  # the command line, as before the server
        (tmp_path / "gemma2" / "fresh").mkdir()
        fresh = build_model(directory, cfg, tmp_path / "gemma2" / "fresh")
    assert _digests(fresh) == _digests(built["gemma2"])
    server.process.kill()
    server.process.wait()
    (tmp_path / "gemma2" / "after").mkdir()
    assert _digests(build_model(directory, cfg, tmp_path / "gemma2" / "after")) == _digests(fresh)
    assert builder._SERVER is None  # the dead server was closed; the next build starts another
    (tmp_path / "gemma2" / "again").mkdir()
    assert _digests(build_model(directory, cfg, tmp_path / "gemma2" / "again")) == _digests(fresh)
    assert builder._SERVER is not None and builder._SERVER is not server


def test_a_server_that_cannot_fork_is_not_started_again(tmp_path, monkeypatch):
    """A server that answers it cannot fork (more than one thread) leaves the build to the command
    line, and no other server is started in this process: each would import again for nothing."""
    import sys

    import conformance.backends.genai_builder as builder

    refusing = "import sys, json; sys.stdin.readline(); print(json.dumps({'status': None}), flush=True)"
    monkeypatch.setattr(builder._Server, "COMMAND", (sys.executable, "-c", refusing))
    monkeypatch.setattr(builder, "_SERVER", None)
    monkeypatch.setattr(builder, "_FORKS_REFUSED", False)
    assert builder.run_builder([], tmp_path / "log") == 2  # the command line's own refusal: no output named
    assert "the following arguments are required: -o/--output" in (tmp_path / "log").read_text()
    assert builder._server() is None and builder._FORKS_REFUSED


# ---- its int4 model (rosetta check --hf DIR --quantized genai-int4, SPEC §15.1) ---------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_genai_int4_is_judged_on_the_weights_its_builder_stores(tmp_path, family):
    """onnxruntime-genai's builder at -p int4 (accuracy_level 4; q, k and v packed into one product;
    qwen2's tied head and embedding one int4 table, read by GatherBlockQuantized): each stored weight
    is matched to its parameter by content, every case it can express passes the int8-activations
    mode against the golden on those weights, they are stored as GENAI_INT4 says, and every product
    is within its tolerance; its cost is measured, the rows it cannot compute left out with why."""
    from conformance.deployment.quantized import check_quantized, format_quantized
    from spec.quantization import GENAI_INT4

    directory = build_checkpoint(family, GENAI_CONFIGS[family](), tmp_path / family)
    imported = import_huggingface(directory)
    column, = check_quantized(imported.config, imported.params, [GENAI_INT4], directory=directory)
    assert column.name == "onnxruntime-genai-int4" and not column.error, column.error
    assert column.passed, format_quantized([column])
    packed = [product.parameter for product in column.products if "+" in product.parameter]
    assert packed and packed[0] == ("decoder.layers.0.self_attn.q.weight+decoder.layers.0.self_attn.k.weight+"
                                    "decoder.layers.0.self_attn.v.weight")
    assert "head.weight" in {product.parameter for product in column.products}
    assert all(cell.cost.kl_mean > 0 for cell in column.cells if hasattr(cell.cost, "kl_mean"))  # quantizing costs
    partly = {cell.case: cell.left_out for cell in column.cells if cell.left_out}
    assert set(partly) == {"decode-pad_right", "generate-pad_left"}, partly
    assert all(any(cause in reason for cause in REFUSALS) for reason in partly.values()), partly


def test_genai_int4_weights_that_match_no_parameter_are_refused_by_name(tmp_path, monkeypatch):
    """The weights are matched by content, so a model of other weights (the imported ones times 1.5)
    is refused, never judged; and so is a misreading of the layout (nibbles swapped where K = d_ff):
    the FFN's down projection then lies near no parameter, and its product is named."""
    import dataclasses

    import export.quantize as quantize
    from conformance.deployment.quantized import check_quantized
    from spec.quantization import GENAI_INT4

    directory = build_checkpoint("llama", GENAI_CONFIGS["llama"](), tmp_path / "llama")
    imported = import_huggingface(directory)
    other = {name: value * 1.5 for name, value in imported.params.items()}
    column, = check_quantized(imported.config, other, [GENAI_INT4], directory=directory)
    assert "lies within one quantization step of 0 of the model's parameters (none)" in column.error
    assert not column.passed
    dequantize = quantize.dequantize
    monkeypatch.setattr(quantize, "dequantize", lambda weight: dequantize(weight if weight.k != imported.config.d_ff
                                                                          else dataclasses.replace(weight, codes=(
                                                                              (weight.codes & 0x0F) << 4) | (weight.codes >> 4))))
    column, = check_quantized(imported.config, imported.params, [GENAI_INT4], directory=directory)
    assert "down_proj" in column.error and "of 0 of the model's parameters" in column.error, column.error


def test_genai_int4_embedding_read_otherwise_than_the_head_is_refused(tmp_path):
    """qwen2's tied table, read by GatherBlockQuantized from the head's own codes and scales, stays
    tied; the same lookup with another block size is a table of its own, refused by name."""
    import onnx

    from conformance.backends.genai_backend import build_model
    from export.quantize import deployed_by_content

    directory = build_checkpoint("qwen2", GENAI_CONFIGS["qwen2"](), tmp_path / "qwen2")
    imported = import_huggingface(directory)
    (tmp_path / "built").mkdir()
    model = onnx.load(str(build_model(directory, imported.config, tmp_path / "built", precision="int4") / "model.onnx"))
    deployed, _ = deployed_by_content(imported.config, imported.params, model)
    assert deployed.cfg.tie_head and deployed.stored["head.weight"].bits == 4
    lookup = next(node for node in model.graph.node if node.op_type == "GatherBlockQuantized")
    next(attribute for attribute in lookup.attribute if attribute.name == "block_size").i = 16
    with pytest.raises(WeightsError, match="an embedding quantized otherwise than the head"):
        deployed_by_content(imported.config, imported.params, model)
