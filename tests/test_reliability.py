"""Reliability: property tests across backends (random valid configs agree with the golden,
random invalid inputs are refused alike), endurance (1000 generations without memory growth)
and the CLI under Ctrl-C and unwritable folders. CI runs the 'ci' hypothesis profile;
HYPOTHESIS_PROFILE=thorough explores more."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import impl_numpy as golden
from conformance.cases import SUBLAYERS
from conformance.tolerance import compare, tolerance
from spec import InputError, get_preset, conformance_params
from tests.strategies import small_configs

TINY = get_preset("tiny")
# every example of the cross-backend test builds (and for JAX, compiles) a new model
CROSS_BACKEND = settings(max_examples=max(4, settings.default.max_examples // 3), deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _depth(cfg) -> int:
    return SUBLAYERS["forward"].depth(cfg)  # the catalogue's whole-model depth


def _padded_ids(data, cfg, vocab: int, batch: int, length: int) -> np.ndarray:
    """Random ids with pad_id at random places (a whole padded row included sometimes)."""
    ids = np.array(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length),
                                      min_size=batch, max_size=batch)), dtype=np.int64)
    padded = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=length, max_size=length),
                                         min_size=batch, max_size=batch)), dtype=bool)
    if data.draw(st.booleans()):
        padded[data.draw(st.integers(0, batch - 1))] = True  # a row that is all padding
    return np.where(padded, cfg.pad_id, ids)


@CROSS_BACKEND
@given(small_configs(), st.data())
def test_random_configs_and_padding_agree_with_the_golden(cfg, data):
    from impl_jax import Transformer as JaxTransformer
    from impl_torch import Transformer as TorchTransformer

    params = conformance_params(cfg, seed=data.draw(st.integers(0, 5)))
    batch = data.draw(st.integers(1, 3))
    tgt_len = data.draw(st.integers(1, cfg.max_len if cfg.positional == "learned" else 12))
    tgt = _padded_ids(data, cfg, cfg.tgt_vocab_size, batch, tgt_len)
    src = None
    if cfg.has_encoder:
        src_len = data.draw(st.integers(1, cfg.max_len if cfg.positional == "learned" else 12))
        src = _padded_ids(data, cfg, cfg.src_vocab_size, batch, src_len)
    want = golden.forward(cfg, params, src, tgt)
    assert np.isfinite(want).all()
    lengths = max(tgt.shape[1], 0 if src is None else src.shape[1])
    relative = tolerance("float32", max(cfg.d_model, cfg.d_ff, (lengths + 3) ** 2), _depth(cfg))
    outputs = {
        "numpy-float32": golden.forward(cfg, params, src, tgt, dtype=np.float32),
        "torch": TorchTransformer.from_params(cfg, params)(src, tgt).detach().numpy(),
        "jax": np.asarray(JaxTransformer.from_params(cfg, params)(src, tgt)),
    }
    for backend, got in outputs.items():
        result = compare(got.astype(np.float64), want, relative)
        assert result.passed, f"{backend} on {cfg}: {result.reason or result.max_abs_err / result.tol}"


@st.composite
def bad_forward_inputs(draw):
    """(src_ids, tgt_ids) for tiny (vocab 96 / 80) with exactly one thing wrong."""
    batch, src_len, tgt_len = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    src = np.ones((batch, src_len), np.int64)
    tgt = np.ones((batch, tgt_len), np.int64)
    fault = draw(st.sampled_from(["src_high", "tgt_high", "negative", "float", "bool", "rank", "empty",
                                  "zero_length", "batch"]))
    row, column = draw(st.integers(0, batch - 1)), draw(st.integers(0, tgt_len - 1))
    if fault == "src_high":
        src[row, min(column, src_len - 1)] = draw(st.integers(96, 2**40))
    elif fault == "tgt_high":
        tgt[row, column] = draw(st.integers(80, 2**40))
    elif fault == "negative":
        tgt[row, column] = draw(st.integers(-(2**40), -1))
    elif fault == "float":
        tgt = tgt.astype(draw(st.sampled_from([np.float16, np.float32, np.float64])))
    elif fault == "bool":
        src = src.astype(bool)
    elif fault == "rank":
        tgt = tgt.reshape(-1) if draw(st.booleans()) else tgt[..., None]
    elif fault == "empty":
        src, tgt = src[:0], tgt[:0]
    elif fault == "zero_length":
        tgt = tgt[:, :0]
    else:
        tgt = np.ones((batch + draw(st.integers(1, 3)), tgt_len), np.int64)
    return src, tgt


@pytest.fixture(scope="module")
def tiny_models():
    from export.cache import exported
    from export.runner import OnnxTransformer
    from impl_jax import Transformer as JaxTransformer
    from impl_torch import Transformer as TorchTransformer

    params = conformance_params(TINY, seed=0)
    return {
        "golden": lambda src, tgt: golden.forward(TINY, params, src, tgt),
        "torch": TorchTransformer.from_params(TINY, params),
        "jax": JaxTransformer.from_params(TINY, params),
        "onnx": OnnxTransformer(exported(TINY, params), device="cpu").forward,
    }


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad_forward_inputs())
def test_random_invalid_inputs_are_refused_alike(tiny_models, inputs):
    src, tgt = inputs
    messages = {}
    for backend, model in tiny_models.items():
        with pytest.raises(InputError) as error:
            model(src, tgt)
        messages[backend] = str(error.value)
    assert len(set(messages.values())) == 1, messages


# ---- endurance ------------------------------------------------------------------------------

def _resident_megabytes() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_a_thousand_generations_do_not_grow_memory(backend):
    from export.cache import exported
    from export.runner import OnnxTransformer
    from impl_torch import Transformer as TorchTransformer

    params = conformance_params(TINY, seed=0)
    model = (OnnxTransformer(exported(TINY, params), device="cpu") if backend == "onnx"
             else TorchTransformer.from_params(TINY, params))
    rng = np.random.default_rng(0)
    sources = [rng.integers(1, 96, (2, 3 + i % 5)) for i in range(1000)]
    first = None
    for i, src in enumerate(sources):
        tokens = model.greedy_generate(src, bos_id=1, eos_id=2, max_new_tokens=4)
        if i == 99:  # allocator pools and caches are warm by now
            first = _resident_megabytes()
    grown = _resident_megabytes() - first
    assert tokens.shape == (2, 4)
    assert grown < 20, f"resident memory grew {grown:.1f} MB over 900 generations"


# ---- the CLI under interruption and unwritable folders ----------------------------------------

def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys, tmp_path):
    import conformance.check
    from rosetta.main import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(conformance.check, "run_matrix", interrupted)
    assert main(["check", "--backends", "numpy-float32", "--report", str(tmp_path / "report")]) == 130
    error = capsys.readouterr().err
    assert "interrupted" in error and "Traceback" not in error
    assert not (tmp_path / "report" / "report.json").exists()  # no half-written report


@pytest.mark.parametrize("argv", [
    ["check", "--backends", "numpy-float32", "-k", "ffn-none", "--report", "{file}/report"],
    ["export", "--preset", "tiny", "--graphs", "forward", "--out", "{file}/onnx"],
])
def test_unwritable_folders_are_refused_before_any_work(tmp_path, capsys, argv):
    from rosetta.main import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be made under a file (root ignores permissions)
    assert main([a.replace("{file}", str(blocker)) for a in argv]) == 2
    captured = capsys.readouterr()
    assert "cannot write there (Not a directory)" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""  # refused before the matrix or the export ran
