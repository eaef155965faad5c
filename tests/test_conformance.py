"""The case catalogue through the harness, and proof that the harness can fail."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import conformance.tolerance
from conformance.adapter import NotSupported, Partial, get_backend, register_backend, unregister_backend
from conformance.backends.numpy_backend import NumpyFloat32Backend
import impl_numpy as golden
from conformance.cases import (CHUNK_CASES, MASK_CASES, SUBLAYERS, TEXT_CASES, applicable_cases, attention_queries,
                               build_case, case_names, catalogue, choose_generation_rows)
from conformance.harness import ERROR, FAIL, PASS, SKIP, plan_matrix, run_matrix
from pages.mutations import MUTATIONS, MutantBackend
from conformance.output.report import empty_columns, format_problems
from conformance.tolerance import UNIT_ROUNDOFF, compare, tolerance
from rosetta.main import main
from spec import conformance_params, get_preset
from tests.variants import PROPERTY_PRESETS, TINY, VARIANTS

PARAMS = conformance_params(TINY)

def _cells(variant):
    cfg = VARIANTS[variant]
    prefix = "" if variant == "tiny" else f"{variant}:"
    return [pytest.param(variant, sublayer, mask_case, id=f"{prefix}{sublayer}-{mask_case}-float32-numpy-float32-cpu")
            for sublayer, mask_case in case_names(cfg, backward=True)]


@pytest.fixture(scope="module")
def matrices():
    """Each variant's matrix, run once through the harness."""
    results = {}
    for variant, cfg in VARIANTS.items():
        cells = run_matrix(cfg, conformance_params(cfg, seed=1), plan_matrix(cfg, ["numpy-float32"], ["float32"]),
                           backward=True)
        results[variant] = {(r.sublayer, r.mask_case): r for r in cells}
    return results


@pytest.mark.parametrize("variant, sublayer, mask_case", [p for v in VARIANTS for p in _cells(v)])
def test_catalogue_float32_against_golden(matrices, variant, sublayer, mask_case):
    result = matrices[variant][(sublayer, mask_case)]
    assert result.status == PASS, result.reason
    assert result.max_abs_err <= result.tol


def test_catalogue_covers_every_mask_case_and_sublayer():
    cases = catalogue(TINY, PARAMS, backward=True)
    rotary_only = {"far", "long"}
    norms_tiny_lacks = {"small_final", "large_final", "small_embed", "large_embed"}  # tiny has neither norm
    text_only = set(TEXT_CASES)  # a check given prompts runs them (tests/test_text_cases.py)
    experts_only = {"unchosen", "near_tie"}
    switch_only = {"at_switch", "past_switch"}  # configs whose computation switches at a length (longrope)
    hybrid_only = set(CHUNK_CASES)  # configs with linear layers (tests/test_gated_delta_net.py runs them)
    assert {c.mask_case for c in cases} == (set(MASK_CASES) - rotary_only - norms_tiny_lacks - text_only
                                            - experts_only - switch_only - hybrid_only)
    llama = get_preset("llama-tiny")
    llama_cases = {c.mask_case for c in catalogue(llama, conformance_params(llama))}
    assert rotary_only <= llama_cases and not switch_only & llama_cases
    phi3 = get_preset("phi3-tiny")
    assert {("forward", "at_switch"), ("forward", "past_switch")} <= set(case_names(phi3))
    assert phi3.switch_lengths == (1002,) and llama.switch_lengths == ()
    embed_norm = VARIANTS["tiny.learned_swish_shared_embednorm"].replace(final_norm=True)
    assert norms_tiny_lacks <= {mask_case for mask_case in applicable_cases(embed_norm, "norm")}
    # a mixture of experts' only, and a hybrid's only
    assert {c.sublayer for c in cases} == set(SUBLAYERS) - {"router", "experts", "linear_attn", "grad-linear_attn"}
    mixtral = get_preset("mixtral-tiny")
    assert {("router", "none"), ("experts", "unchosen"), ("ffn", "near_tie")} <= {(c.sublayer, c.mask_case)
                                                             for c in catalogue(mixtral, conformance_params(mixtral))}
    assert not any("-" in mask_case for mask_case in MASK_CASES)  # a worker splits "grad-mha-causal" at its last '-'
    decoder_only = catalogue(VARIANTS["char-lm"], conformance_params(VARIANTS["char-lm"]))
    assert not any(c.sublayer in ("encoder", "encoder_layer", "mha_cross") for c in decoder_only)


def _same(value, other) -> bool:
    """Equal inputs, arrays and the dicts and lists of them (dropout keep-masks) included."""
    if type(value) is not type(other):
        return False
    if isinstance(value, np.ndarray):
        return np.array_equal(value, other)
    if isinstance(value, dict):
        return value.keys() == other.keys() and all(_same(value[k], other[k]) for k in value)
    if isinstance(value, list):
        return len(value) == len(other) and all(_same(a, b) for a, b in zip(value, other))
    return value == other


def test_catalogue_is_deterministic():
    first, second = catalogue(TINY, PARAMS, backward=True), catalogue(TINY, PARAMS, backward=True)
    for a, b in zip(first, second):
        for key, value in a.inputs.items():
            assert _same(value, b.inputs[key]), (a.name, key)


def _first_ends(tokens, eos_id):
    return [int(np.flatnonzero(row == eos_id)[0]) if (row == eos_id).any() else None for row in tokens]


@pytest.mark.parametrize("name", PROPERTY_PRESETS)
def test_generate_cases_end_rows_at_different_steps_and_vary(name):
    """On the conformance weights of the presets that carry every option (tests/variants.
    PROPERTY_PRESETS: paper-base, paper-big and the bench's smalls carry none of their own),
    each generate case has rows that eos_id ends at two different steps and a row that never ends,
    and a row whose tokens are nearly all distinct: ignoring eos_id, a loop that never advances and
    one that feeds back its input all change tokens the golden chose."""
    cfg = get_preset(name)
    params = conformance_params(cfg)
    for mask_case in applicable_cases(cfg, "generate"):
        inputs = build_case(cfg, params, "generate", mask_case).inputs
        tokens = golden.greedy_generate(cfg, params, inputs["src_ids"], prompt_ids=inputs["prompt_ids"],
                                        bos_id=inputs["bos_id"], eos_id=inputs["eos_id"],
                                        max_new_tokens=inputs["max_new_tokens"])
        ends = _first_ends(tokens, inputs["eos_id"])
        assert None in ends, (mask_case, tokens)
        assert len({end for end in ends if end is not None and end >= 1}) >= 2, (mask_case, tokens)
        assert max(len(set(row.tolist())) for row in tokens) >= tokens.shape[1] - 1, (mask_case, tokens)


def test_generation_rows_and_eos_are_chosen_together():
    """Slot r chooses among candidates r, r + 3, ...: the rows picked are the ones with which a
    token ends two rows at distinct steps and leaves one going, though more varied rows exist."""
    tokens = np.array([[5, 6, 1, 8], [9, 3, 1, 6], [5, 5, 5, 5],   # candidates 0, 1, 2
                       [4, 4, 4, 4], [4, 7, 9, 9], [8, 8, 7, 6]])  # candidates 3, 4, 5
    rows, eos_id = choose_generation_rows(tokens, 3, default_eos=2, pad_id=0)
    assert (rows, eos_id) == ([0, 4, 5], 7)  # not candidate 1, the most varied of its slot
    assert _first_ends(tokens[rows], eos_id) == [None, 1, 2]
    # no token ends a row while another goes on: the default eos, and the most varied rows
    rows, eos_id = choose_generation_rows(np.array([[3, 4], [3, 5]]), 1, default_eos=2, pad_id=0)
    assert eos_id == 2 and rows == [0]


def test_attention_queries_of_each_case():
    """The query lengths a case's attention runs with (a backend names its path from them)."""
    char_lm = VARIANTS["char-lm"]
    cases = {case.name: case for case in catalogue(TINY, PARAMS)}
    lm_cases = {case.name: case for case in catalogue(char_lm, conformance_params(char_lm))}
    source = cases["generate-none"].inputs["src_ids"].shape[1]
    assert attention_queries("generate", cases["generate-none"].inputs) == {1, source}
    assert attention_queries("generate", lm_cases["generate-none"].inputs) == {1, 3}
    decode = cases["decode-pad_right"].inputs
    assert attention_queries("decode", decode) == {decode["prefix"], 1, decode["src_ids"].shape[1]}
    assert attention_queries("attention", cases["attention-single_token"].inputs) == {1}
    for sublayer in ("embedding", "ffn", "norm", "logits"):
        assert attention_queries(sublayer, cases[f"{sublayer}-none"].inputs) == set()


def test_all_pad_cases_really_have_rows_with_no_key():
    for case in catalogue(TINY, PARAMS):
        if case.mask_case == "all_pad" and case.sublayer in ("attention", "mha"):
            assert not case.inputs["mask"].any(axis=-1).all()
        if case.mask_case == "all_pad" and case.sublayer == "forward":
            assert (case.inputs["tgt_ids"] == TINY.pad_id).all(axis=1).any()


# ---- the tolerance policy -----------------------------------------------------------------

def test_tolerance_formula():
    assert tolerance("float32", 256, 1) == pytest.approx(8 * 2**-24 * (1 + 16))
    assert tolerance("float64", 256, 4) == pytest.approx(8 * 2 * 2**-53 * (1 + 16))
    # half formats: storage rounding plus float32 accumulation over n terms
    assert tolerance("float16", 64, 9) == pytest.approx(8 * 3 * (2**-11 + 2**-24 * 8))
    assert tolerance("tf32", 64, 1) == pytest.approx(8 * (2**-11 + 2**-24 * 8))
    assert tolerance("float64", 1, 1) < tolerance("float32", 1, 1) < tolerance("float16", 1, 1) < tolerance("bfloat16", 1, 1)
    assert set(UNIT_ROUNDOFF) == {"float64", "float32", "tf32", "float16", "bfloat16"}
    with pytest.raises(ValueError, match="unknown dtype"):
        tolerance("int8", 1, 1)
    # a compute mode that is no column's dtype: int8-rounded activations (SPEC §15.1), sums in float32
    assert tolerance("int8-activations", 64, 1) == pytest.approx(8 * (1 / 254 + 2**-24 * 8))


def test_compare_reports_the_worst_element():
    expected = np.zeros((2, 3))
    actual = expected.copy()
    actual[1, 2] = 0.5
    result = compare(actual, expected, 0.1)
    assert not result.passed and result.worst_index == (1, 2) and result.max_abs_err == 0.5
    assert "at [1, 2]" in result.reason
    assert compare(expected + 0.05, expected, 0.1).passed


def test_compare_scales_with_the_golden_magnitude():
    expected = np.array([1000.0, 1.0])
    assert compare(expected + [0.5, 0.0], expected, 1e-3).passed  # 0.5 <= 1e-3 * 1000
    assert not compare(expected + [0.0, 1.5], expected, 1e-3).passed


def test_compare_nan_and_inf():
    expected = np.array([1.0, np.inf, np.nan])
    assert compare(np.array([1.0, np.inf, np.nan]), expected, 1e-6).passed  # the same specials
    assert not compare(np.array([np.nan, np.inf, np.nan]), expected, 1e-6).passed
    assert not compare(np.array([1.0, -np.inf, np.nan]), expected, 1e-6).passed
    nan_result = compare(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), 1.0)
    assert not nan_result.passed and math.isinf(nan_result.max_abs_err) and "non-finite" in nan_result.reason



def _whole_array_comparison(actual, expected, relative_tol, where=None):
    """compare's figures computed over the arrays whole (what compare did before it took them a
    chunk at a time): (passed, max |error|, worst index, worst output, ‖error‖/‖golden‖)."""
    actual, expected = actual.astype(np.float64), expected.astype(np.float64)
    compared = np.isfinite(expected)
    if where is not None:
        kept = np.broadcast_to(where.reshape(where.shape + (1,) * (expected.ndim - where.ndim)), expected.shape)
        actual, compared = np.where(kept, actual, expected), compared & kept
    tol = relative_tol * max(1.0, np.abs(expected[compared]).max(initial=0.0))
    with np.errstate(invalid="ignore"):
        difference = np.abs(actual - expected)
    difference[~compared & ((actual == expected) | (np.isnan(actual) & np.isnan(expected)))] = 0.0
    difference[np.isnan(difference)] = np.inf
    worst = np.unravel_index(int(np.argmax(difference)), difference.shape)
    error_norm = np.linalg.norm(difference) if np.isfinite(difference).all() else math.inf
    reference_norm = np.linalg.norm(expected[compared])
    return (bool(difference[worst] <= tol), float(difference[worst]), tuple(int(i) for i in worst),
            float(actual[worst]), error_norm / reference_norm if reference_norm else (0.0 if error_norm == 0 else math.inf))


@settings(max_examples=40)
@given(data=st.data())
def test_compare_a_chunk_at_a_time_gives_the_whole_arrays_figures(data):
    """compare takes a large output a chunk of its flattened elements at a time (no float64 copy of
    it whole): the verdict, the worst element (the first of equal maxima), its values and the norms
    are those of the arrays whole, chunks of 5 elements here, with NaN, ±inf, ties and a `where`."""
    shape = data.draw(st.sampled_from([(3, 4, 5), (2, 7), (11,), (1, 3, 1, 4)]))
    values = st.one_of(st.floats(-4, 4), st.sampled_from([0.0, 1.0, np.inf, -np.inf, np.nan]))
    expected = np.array(data.draw(st.lists(values, min_size=math.prod(shape), max_size=math.prod(shape)))).reshape(shape)
    noise = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, -0.5, 2.0, np.nan, np.inf]),
                                        min_size=math.prod(shape), max_size=math.prod(shape)))).reshape(shape)
    with np.errstate(invalid="ignore"):
        actual = (expected + noise).astype(data.draw(st.sampled_from([np.float64, np.float32])))
    where = None
    if data.draw(st.booleans()):
        where = np.array(data.draw(st.lists(st.booleans(), min_size=shape[0], max_size=shape[0])))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conformance.tolerance, "_CHUNK", 5)
        result = compare(actual, expected, 0.3, where=where)
    passed, max_abs, worst, worst_actual, rel = _whole_array_comparison(actual, expected, 0.3, where)
    assert (result.passed, result.max_abs_err, result.worst_index) == (passed, max_abs, worst)
    assert result.worst_actual == worst_actual or (math.isnan(worst_actual) and math.isnan(result.worst_actual))
    assert result.rel_err == pytest.approx(rel, rel=1e-12, nan_ok=True) or (math.isinf(rel) and math.isinf(result.rel_err))


def test_compare_shapes_and_integers():
    assert "shape [2], expected [3]" in compare(np.zeros(2), np.zeros(3), 1.0).reason
    assert compare(np.array([[1, 2]]), np.array([[1, 2]]), 0.0).passed
    result = compare(np.array([[1, 3]]), np.array([[1, 2]]), 0.0)
    assert not result.passed and "1 of 2 values differ" in result.reason


# ---- the harness can fail -----------------------------------------------------------------

def _mutant(name):
    return MutantBackend(next(m for m in MUTATIONS if m.name == name))


def _run_mutant(name, cfg=TINY):
    register_backend("mutant", lambda: _mutant(name))
    try:
        results = run_matrix(cfg, conformance_params(cfg), plan_matrix(cfg, ["mutant"], ["float32"]))
    finally:
        unregister_backend("mutant")
    return {f"{r.sublayer}-{r.mask_case}": r for r in results}


def test_wrong_attention_scale_fails_every_attention_case():
    results = _run_mutant("scale_d_model")
    assert results["attention-none"].status == FAIL and results["forward-none"].status == FAIL
    assert results["ffn-none"].status == PASS and results["norm-none"].status == PASS
    assert results["attention-single_token"].status == PASS  # one key: the scale cannot matter


def test_nan_on_fully_masked_rows_is_caught():
    results = _run_mutant("inf_fill_nan")
    for case in ("attention-all_pad", "mha-all_pad", "attention-mask_qk", "forward-all_pad"):
        assert results[case].status == FAIL and "non-finite" in results[case].reason, case
    assert results["attention-causal"].status == PASS and results["forward-pad_right"].status == PASS
    # an encoder-decoder's target position 0 is its start token, always real, so the decoding
    # rows that see only padding are a decoder-only model's left-padded ones
    assert results["decode-pad_left"].status == PASS and results["decode-pad_start"].status == PASS
    decoder_only = _run_mutant("inf_fill_nan", VARIANTS["char-lm"])
    assert decoder_only["decode-pad_left"].status == FAIL and "non-finite" in decoder_only["decode-pad_left"].reason


def test_a_crashing_backend_is_an_error_not_a_pass():
    class Broken(NumpyFloat32Backend):
        def load(self, cfg, params, dtype, device):
            class Runner:
                def run(self, sublayer, inputs):
                    if sublayer == "ffn":
                        raise NotSupported("no FFN here")
                    raise RuntimeError("kernel exploded")
            return Runner()

    register_backend("broken", Broken)
    try:
        results = run_matrix(TINY, conformance_params(TINY), plan_matrix(TINY, ["broken"], ["float32"]))
    finally:
        unregister_backend("broken")
    statuses = {r.sublayer: r.status for r in results}
    assert statuses["ffn"] == SKIP and statuses["mha"] == ERROR
    assert any("kernel exploded" in r.reason for r in results)


def test_a_missing_framework_is_reported_unavailable():
    register_backend("ghost", "no_such_framework_module:Backend")
    try:
        backend, reason = get_backend("ghost")
        assert backend is None and "not installed" in reason
        results = run_matrix(TINY, conformance_params(TINY), plan_matrix(TINY, ["ghost"], ["float32"]))
        assert results and all(r.status == SKIP and "not installed" in r.reason for r in results)
    finally:
        unregister_backend("ghost")


def test_unsupported_dtypes_and_devices_are_skipped_with_a_reason():
    results = run_matrix(TINY, conformance_params(TINY), plan_matrix(TINY, ["numpy-float32"], ["float16"], ["cpu", "cuda"]),
                         pattern="ffn")
    reasons = {(r.device, r.status, r.reason) for r in results}
    assert ("cpu", SKIP, "numpy-float32 runs at float32 only (float64 is the golden itself)") in reasons
    assert ("cuda", SKIP, "device cuda not present for numpy-float32") in reasons


# ---- the CLI ------------------------------------------------------------------------------

def test_cli_check_passes_and_writes_a_report(tmp_path, capsys):
    assert main(["check", "--preset", "tiny", "--backends", "numpy-float32,torch", "--dtypes", "float32",
                 "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "numpy-float32/float32/cpu" in out and "mha-causal_pad" in out and " 0 failed" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is True and report["config"]["d_model"] == 64
    assert report["versions"]["numpy"] and report["spec_version"]
    cell = report["cells"][0]
    for key in ("backend", "device", "dtype", "sublayer", "mask_case", "passed", "status", "max_abs_err", "rel_err",
                "tol", "worst_index", "reason"):
        assert key in cell
    assert all(c["passed"] == (c["status"] == "pass") for c in report["cells"])
    assert report["devices"]["cpu"] and report["versions"]["torch"]
    assert (tmp_path / "report.md").read_text().startswith("# Conformance report")
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_filter_and_exit_codes(tmp_path, capsys):
    assert main(["check", "-k", "attention-causal", "--dtypes", "float32"]) == 0  # every registered backend
    out = capsys.readouterr().out
    assert "attention-causal " in out and "mha-" not in out
    assert all(f"{name}/float32/cpu" in out for name in ("numpy-float32", "torch", "torch-math", "jax", "jax-math"))
    assert main(["check", "-k", "no-such-cell"]) == 1
    assert main(["check", "--backends", "nope"]) == 2
    assert "unknown backend" in capsys.readouterr().err
    assert main(["check", "--dtypes", "float8"]) == 2
    assert main(["check", "--preset", "gpt-5"]) == 2
    assert main(["check", "--weights", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_failing_backend_exits_1(capsys):
    register_backend("mutant", lambda: _mutant("scale_d_model"))
    try:
        assert main(["check", "--backends", "mutant", "--dtypes", "float32", "-k", "attention"]) == 1
    finally:
        unregister_backend("mutant")
    assert "FAIL attention-none-float32-mutant-cpu" in capsys.readouterr().out


class _Refuses(NumpyFloat32Backend):
    """A backend that cannot run this model at all, as onnxruntime-genai refuses a head size its
    CPU kernel lacks: every cell skipped, at load."""
    name = "refuses"

    def load(self, cfg, params, dtype, device):
        raise NotSupported("head size 16: this kernel takes multiples of 32")


class _BrokenAtImport:
    def __init__(self):
        raise RuntimeError("CUDA driver too old")


def test_a_column_that_ran_nothing_fails_the_check(tmp_path, capsys):
    """Every cell of a column skipped is not a pass: rosetta check names the column and why, its
    report says so, and it exits 1 (before, the other columns' passes made the verdict). A skip
    declared up front (a framework not installed) is one line and no failure; a backend that
    raised while loading is."""
    register_backend("refuses", _Refuses)
    register_backend("ghost", "no_such_framework_module:Backend")
    register_backend("broken", _BrokenAtImport)
    arguments = ["--dtypes", "float32", "-k", "forward-none", "--quiet"]
    try:
        assert main(["check", "--backends", "torch,refuses", *arguments, "--report", str(tmp_path)]) == 1
        out = capsys.readouterr().out
        assert "1 passed, 0 failed, 1 skipped, 1 column ran nothing" in out
        assert "RAN NOTHING refuses/float32/cpu: not supported: head size 16: this kernel takes multiples of 32" in out
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["passed"] is False and list(report["empty_columns"]) == ["refuses/float32/cpu"]
        assert main(["check", "--backends", "torch,ghost", *arguments]) == 0
        assert "skipped 1 cell, not available here, in 1 column (ghost/float32/cpu): not installed" in \
            capsys.readouterr().out
        assert main(["check", "--backends", "torch,broken", *arguments]) == 1
        assert "RAN NOTHING broken/float32/cpu: failed to load: RuntimeError: CUDA driver too old" in capsys.readouterr().out
        # a column whose cells are sublayers its backend says it lacks ran nothing it could run: no failure
        assert main(["check", "--backends", "torch,onnx", "--dtypes", "float32", "-k", "ffn-none", "--quiet"]) == 0
    finally:
        for name in ("refuses", "ghost", "broken"):
            unregister_backend(name)


class _RowOneWrong(NumpyFloat32Backend):
    """Computes row 1 of the forward wrongly and says so (adapter.Partial), as onnxruntime-genai
    says which padded rows it cannot compute the spec's way; `compared` is what it claims."""
    name = "row-one-wrong"

    def __init__(self, compared):
        self.compared = compared

    def load(self, cfg, params, dtype, device):
        runner, compared = super().load(cfg, params, dtype, device), self.compared

        class Runner:
            def run(self, sublayer, inputs):
                out = runner.run(sublayer, inputs)
                out[1] += 1.0
                return Partial(out, np.array(compared), {1: "its padding cannot be expressed"})
        return Runner()


@pytest.mark.parametrize("compared, status", [([True, False, True], PASS), ([True, True, True], FAIL),
                                              ([False, False, False], SKIP)],
                         ids=["row left out", "row compared", "nothing compared"])
def test_a_partial_output_is_compared_on_its_rows_and_says_what_it_left_out(compared, status):
    register_backend("row-one-wrong", lambda: _RowOneWrong(compared))
    try:
        results = run_matrix(TINY, PARAMS, plan_matrix(TINY, ["row-one-wrong"], ["float32"]), pattern="forward-none")
    finally:
        unregister_backend("row-one-wrong")
    [result] = results
    assert result.status == status, result.reason
    if status == PASS:
        assert result.left_out == "row 1: its padding cannot be expressed"
        assert "partly compared forward-none-float32-row-one-wrong-cpu: left out row 1" in format_problems(results)
    if status == SKIP:  # nothing the backend computed is the spec's: the column ran nothing
        assert empty_columns(results) == {"row-one-wrong/float32/cpu": "not supported: row 1: its padding cannot be expressed"}


def test_cli_init_info_and_check_weights(tmp_path, capsys):
    path = tmp_path / "w.safetensors"
    assert main(["init", "--preset", "char-lm", "--seed", "2", str(path)]) == 0
    assert main(["info", str(path)]) == 0
    assert '"arch": "decoder-only"' in capsys.readouterr().out
    assert main(["check", "--weights", str(path), "--backends", "numpy-float32,torch", "--dtypes", "float32",
                 "-k", "forward"]) == 0
    assert main(["check", "--weights", str(path), "--preset", "tiny"]) == 2


def test_python_dash_m_rosetta():
    done = subprocess.run([sys.executable, "-m", "rosetta", "presets"], capture_output=True, text=True, check=True)
    assert "paper-base" in done.stdout and "63,082,496" in done.stdout


def test_float32_headroom_under_the_policy(matrices):
    """A correct float32 implementation must sit well inside the tolerance: at or below half of it,
    the headroom SPEC.md §8 states for every correct implementation (the golden's own float32 was
    calibrated at 0.13); if this creeps up, the policy is too tight."""
    worst = max(r.ratio for cells in matrices.values() for r in cells.values() if r.ratio is not None)
    assert worst < 0.5


def test_check_model_is_rosetta_check_from_python(tmp_path, capsys):
    """conformance.check.check_model: the cells, verdict and report of `rosetta check`, without the CLI."""
    import json

    from conformance.check import check_model

    run = check_model(preset="tiny", backends=["numpy-float32", "torch"], dtypes=["float32"], pattern="ffn-*",
                      jobs=1, shard=(2, 2))
    assert run.ran and run.passed and run.source == {"preset": "tiny", "seed": 0, "shard": "2/2"}
    assert {r.backend for r in run.results} == {"torch"}  # the second of two slices, sorted by backend
    assert main(["check", "--backends", "numpy-float32,torch", "--dtypes", "float32", "-k", "ffn-*", "--jobs", "1",
                 "--shard", "2/2", "--report", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    run.write_report(tmp_path / "python")
    cli, python = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("cli", "python"))
    assert [(c["sublayer"], c["status"], c["max_abs_err"]) for c in cli["cells"]] == [
        (c["sublayer"], c["status"], c["max_abs_err"]) for c in python["cells"]]
    assert cli["source"] == python["source"] and cli["params_sha256"] == python["params_sha256"]
    nothing = check_model(backends=["numpy-float32"], pattern="no-such-cell", jobs=1)
    assert not nothing.ran and not nothing.passed


def test_the_table_shows_the_columns_that_ran_and_the_skips_by_cause(capsys):
    """Issue 58: piped, the table holds only the columns that ran a cell (onnx's sublayer cells,
    which it does not expose, no longer make a column of `skip`), and the skipped cells are a line
    per cause with their counts; --verbose gives a line per column and reason, as the report."""
    arguments = ["check", "--backends", "torch,onnx,ghost", "--dtypes", "float32", "-k", "ffn-none", "--quiet"]
    register_backend("ghost", "no_such_framework_module:Backend")
    try:
        assert main(arguments) == 0
        out = capsys.readouterr().out
        header = next(line for line in out.splitlines() if line.startswith("case"))
        assert "torch/float32/cpu" in header and "onnx" not in header and "ghost" not in header
        skipped = [line for line in out.splitlines() if line.startswith("skipped ")]
        assert len(skipped) == 2, skipped
        assert skipped[0].startswith("skipped 1 cell, sublayers the column does not run, in 1 column "
                                     "(onnx/float32/cpu): not supported: ")
        assert skipped[1].startswith("skipped 1 cell, not available here, in 1 column (ghost/float32/cpu): not "
                                     "installed")
        assert main([*arguments, "--verbose"]) == 0
        verbose = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped ")]
        assert any(line.startswith("skipped ghost/float32/cpu (1 cells): not installed") for line in verbose)
    finally:
        unregister_backend("ghost")


def test_a_wide_plain_table_splits_into_blocks_of_columns():
    """Piped, a table wider than 160 characters is split into blocks of columns, each beginning with
    the cases; every column appears once, and one too wide for a block is a block of its own."""
    from conformance.cells import CellResult
    from conformance.output.report import TABLE_WIDTH, format_table

    results = [CellResult(f"backend{i}", "cpu", "float32", "forward", case, PASS, max_abs_err=0.1, tol=1.0)
               for i in range(12) for case in ("none", "pad_right")]
    blocks = format_table(results).split("\n\n")
    assert len(blocks) == 2 and all(block.startswith("case") for block in blocks)
    assert max(len(line) for line in "\n".join(blocks).splitlines()) <= TABLE_WIDTH
    headers = " ".join(block.splitlines()[0] for block in blocks).split()
    assert [h for h in headers if h != "case"] == [f"backend{i}/float32/cpu" for i in range(12)]
    assert format_table(results[:2], width=10).count("\n\n") == 0  # one column: one block, however wide
