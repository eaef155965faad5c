"""The ctranslate2 column: CTranslate2's own converter (TransformersConverter) and Generator on a
Hugging Face directory, checked against the golden; where it fails, what its converter left out
is named by conformance.diagnosis.explain. Every finding and refusal below is measured here.

The directories are the presets' conformance weights written by importers.huggingface_writer
(every parameter perturbed, odd sizes) and read back by transformers before CTranslate2 sees them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

ctranslate2 = pytest.importorskip("ctranslate2", reason="CTranslate2 is not installed")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

from conformance.adapter import NotSupported, register_backend, unregister_backend  # noqa: E402
from conformance.backends.ctranslate2_backend import (AFTER_LAST, ALL_PAD, INNER_PAD, PADDED_PROMPT,  # noqa: E402
                                                      PAST_WINDOW, PHI3_LOADER, CTranslate2Backend,
                                                      convert_model)
from conformance.diagnosis.explain import explain_failures  # noqa: E402
from conformance.harness import PASS, SKIP, plan_matrix, run_matrix  # noqa: E402
from importers.huggingface_writer import to_huggingface  # noqa: E402
from spec import conformance_params, get_preset  # noqa: E402
from tests.peer_directories import forward_none, saved_at  # noqa: E402

CAUSES = (AFTER_LAST, ALL_PAD, INNER_PAD, PADDED_PROMPT, PAST_WINDOW)


class Written:
    def __init__(self, preset: str, root: Path):
        self.cfg = get_preset(preset)
        self.params = conformance_params(self.cfg, seed=0)
        self.directory = to_huggingface(self.cfg, self.params, root / preset)

    def matrix(self, pattern: str | None = None, then=lambda results: results):
        """The column's cells, and `then` of them while the column is registered."""
        register_backend("ctranslate2", lambda: CTranslate2Backend(self.directory))
        try:
            plan = plan_matrix(self.cfg, ["ctranslate2"], ["float32"], ["cpu"])
            return then(run_matrix(self.cfg, self.params, plan, pattern=pattern))
        finally:
            unregister_backend("ctranslate2")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("ctranslate2"), {}

    def get(preset: str) -> Written:
        if preset not in made:
            made[preset] = Written(preset, root)
        return made[preset]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny"])
def test_the_column_passes_every_case_it_can_express(written, preset):
    """Llama, Qwen2 (biases, one KV head, a tied head), Qwen3 (q/k norms) and Mistral (a window of 4,
    decoded past): forward, decode and generate run, each cell passes, and what is left out is
    named with its measured cause."""
    results = written(preset).matrix()
    ran = [r for r in results if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]
    assert all(any(cause in r.left_out for cause in CAUSES) for r in ran if r.left_out)
    if preset == "mistral-tiny":  # the cached steps cross the window; forward_batch stops at it
        assert any(r.sublayer == "decode" and r.mask_case == "far" for r in ran)
        assert any(PAST_WINDOW in r.left_out for r in ran if r.sublayer == "forward")


@pytest.mark.slow
@pytest.mark.parametrize("preset, omitted", [
    # its Llama loader keeps the llama3 rule's frequency factors but neither its factor nor
    # original_max_position_embeddings: the rule computes as the plain rotary
    ("llama3-tiny", [["rope scaling ignored (the plain rotary)"]]),
    # its Gemma 2 loader reads neither softcap nor query_pre_attn_scalar (the forward rows it runs
    # are within the window, so the window is not what the forward tells)
    ("gemma2-tiny", [["attention_softcap ignored", "final_softcap ignored",
                      "query_pre_attention_scalar ignored (scores by 1/√d_k)"]]),
    # its Gemma 3 loader reads config.rope_scaling, which transformers 5 replaced by one
    # rope_parameters entry per layer type: the full layers' linear ×8 is lost
    ("gemma3-tiny", [["rope scaling ignored (the plain rotary)"]]),
])
def test_what_its_converter_leaves_out_is_named(written, preset, omitted):
    model = written(preset)
    explanations = model.matrix("forward-*", lambda results: explain_failures(model.cfg, model.params, results))
    assert explanations
    for column, found in explanations.items():
        assert column.startswith("ctranslate2/float32/cpu (forward-")
        assert found.to_dict()["explained_by"] == omitted, found.table()


@pytest.mark.slow
def test_its_phi3_loader_fails_on_a_transformers_5_model_and_the_column_says_so(written, tmp_path):
    model = written("phi3-tiny")
    with pytest.raises(AttributeError, match="rotary_emb"):
        convert_model(model.directory, model.cfg, tmp_path)
    with pytest.raises(NotSupported, match="Phi3Attention no longer has"):
        CTranslate2Backend(model.directory).load(model.cfg, model.params, "float32", "cpu")
    assert "AttributeError" in PHI3_LOADER


@pytest.mark.slow
def test_a_rope_scaling_its_converter_lacks_is_refused_in_its_own_words(written, tmp_path):
    model = written("qwen2-yarn-tiny")
    with pytest.raises(NotSupported, match="RoPE scaling type 'yarn' is not yet implemented"):
        CTranslate2Backend(model.directory).load(model.cfg, model.params, "float32", "cpu")


@pytest.mark.slow
def test_with_a_window_forward_batch_refuses_long_prompts_and_mixed_lengths(written, tmp_path):
    """Why the column leaves rows longer than the window out of forward, and calls it a row at a
    time: both calls fail in CTranslate2 (4.8), while its cached steps go past the window."""
    model = written("mistral-tiny")
    generator = ctranslate2.Generator(str(convert_model(model.directory, model.cfg, tmp_path)), device="cpu")
    window = model.cfg.sliding_window
    assert np.asarray(generator.forward_batch([list(range(3, 3 + window))])).shape[1] == window
    with pytest.raises(ValueError, match="buffer to copy is of size"):
        generator.forward_batch([list(range(3, 4 + window))])
    with pytest.raises(ValueError, match="Length mask has size"):
        generator.forward_batch([list(range(3, 3 + window)), list(range(3, 2 + window))])


def test_other_dtypes_and_the_sublayers_are_refused_by_name(tmp_path):
    backend = CTranslate2Backend(tmp_path)
    assert "float32 compute type" in backend.supports("float16", "cpu")
    assert backend.supports("float32", "cpu") is None
    assert "no sublayer entry points" in backend.supports_sublayer("decoder_layer")
    assert backend.supports_sublayer("decode") is None and backend.devices() == ["cpu"]


@pytest.mark.slow
def test_rosetta_check_with_hf_runs_the_column_and_prints_the_explanation(written, tmp_path, capsys):
    from rosetta.main import main

    directory = written("gemma2-tiny").directory
    assert main(["check", "--hf", str(directory), "--backends", "ctranslate2", "-k", "forward",
                 "--report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "explanation ctranslate2/float32/cpu (forward-pad_right): the golden's with attention_softcap ignored" in out
    assert "## What explains ctranslate2/float32/cpu (forward-pad_right)" in (tmp_path / "report.md").read_text()


def test_its_int8_is_a_quantized_column_measured_against_the_float_golden(written):
    """`rosetta check --hf DIR --quantized ctranslate2-int8,ctranslate2-int8_float32`: CTranslate2's
    int8 quantizes its activations at run time, which no golden computes: the column has no
    implementation reference ('n/a') and no stored-weights check, and its cost is measured on every
    case it can express, the rows it cannot left out with their cause; a budget judges it."""
    from conformance.deployment.quantized import check_quantized, format_quantized
    from spec.quantization import CTRANSLATE2_INT8

    model = written("llama-tiny")
    columns = check_quantized(model.cfg, model.params, list(CTRANSLATE2_INT8.values()), directory=model.directory)
    assert [column.name for column in columns] == ["ctranslate2-int8", "ctranslate2-int8_float32"]
    for column in columns:
        assert column.passed and not column.error and not column.stored, format_quantized([column])
        assert column.verdict == "measured", column.verdict  # nothing judged it without a budget: never "ok"
        assert f"{column.name}: measured, not judged" in format_quantized([column])
        assert {cell.case for cell in column.cells if cell.ran} >= {"forward-none", "decode-incremental",
                                                                    "generate-none"}
        assert all(cell.implementation is None for cell in column.cells)
        assert all(0 < cell.cost.kl_mean for cell in column.cells if hasattr(cell.cost, "kl_mean"))
        assert any(any(cause in cell.left_out for cause in CAUSES) for cell in column.cells if cell.left_out)
    # kl=0: broken by every cell whose cost is above 0, which each is (above)
    over, = check_quantized(model.cfg, model.params, [CTRANSLATE2_INT8["int8"]], {"kl": 0.0},
                            directory=model.directory)
    assert not over.passed and over.verdict == "fail"
    assert "n/a: int8 activations at run time" in format_quantized([over])


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_directory_saved_in_float64_or_bfloat16_runs(written, tmp_path, dtype):
    """save_pretrained of a float64 model writes float64 tensors and `"dtype": "float64"`, which
    CTranslate2's converter refused on every cell ("float64 is not in list of supported dtypes"):
    the staged config now loads it as float32, the column's compute type. A bfloat16 directory
    runs as stored. The golden reads the same values (the importer's float32)."""
    directory = saved_at(written("llama-tiny").directory, dtype, tmp_path / dtype)
    cell = forward_none("ctranslate2", lambda: CTranslate2Backend(directory), directory)
    assert cell.status == PASS, cell.reason
