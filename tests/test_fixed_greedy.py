"""Greedy generation on fixed buffers (export.fixed_greedy): the runner's tokens, from buffers
reused across steps and generations, the argmax taken on the device. On CUDA each step replays a
captured graph (the gpu test); on the CPU the same loop runs without one."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from export.cache import exported
from export.fixed_greedy import FixedBufferGreedy, argmax_graph
from export.onnx_model import ExportError
from export.runner import OnnxTransformer, cuda_available
from spec import conformance_params, get_preset
from spec.errors import InputError

HAS_CUDA = cuda_available()
CASES = [("tiny", "float32"), ("tiny", "float16"), ("llama-tiny", "float32"), ("char-lm", "float16")]


def _model(preset: str, dtype: str, device: str = "cpu") -> OnnxTransformer:
    cfg = get_preset(preset)
    return OnnxTransformer(exported(cfg, conformance_params(cfg, seed=0), framework="torch", dtype=dtype), device=device)


def _inputs(cfg, rng, batch: int) -> dict:
    """A padded source (encoder-decoder) or a prompt with a left-padded row (decoder-only)."""
    if cfg.has_encoder:
        src = rng.integers(3, cfg.src_vocab_size, (batch, 7))
        src[0, 5:] = cfg.pad_id
        return {"src_ids": src, "bos_id": 1}
    prompt = rng.integers(3, cfg.tgt_vocab_size, (batch, 6))
    prompt[1, :2] = cfg.pad_id
    return {"prompt_ids": prompt}


@given(st.integers(1, 5), st.integers(2, 40), st.sampled_from(["float32", "float16"]), st.data())
@settings(max_examples=40, deadline=None)
def test_the_device_argmax_takes_the_lowest_id_on_a_tie(batch, vocab, dtype, data):
    import onnxruntime as ort

    session = ort.InferenceSession(argmax_graph(dtype, vocab), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.integers(-3, 3, (batch, 1, vocab)).astype(dtype)  # small integers: ties on most rows
    (got,) = session.run(None, {"logits": logits})
    assert got.dtype == np.int64 and got.shape == (batch, 1)
    np.testing.assert_array_equal(got[:, 0], logits[:, 0].astype(np.float32).argmax(axis=-1))


@pytest.mark.parametrize("preset, dtype", CASES, ids=[f"greedy-fixed_buffers-{d}-onnx-{p}-cpu" for p, d in CASES])
def test_the_runners_tokens_across_generations_and_shapes(preset, dtype):
    """Three generations per eos setting: the first of a shape (new buffers), a second of the same
    shape (the buffers zeroed and reused), one of another batch size (buffers of its own); with an
    eos that finishes a row early, its later tokens are pad_id as the runner's."""
    model = _model(preset, dtype)
    loop = FixedBufferGreedy(model)
    rng = np.random.default_rng(0)
    finished_early = 0
    for batch in (3, 3, 2):
        inputs = _inputs(model.cfg, rng, batch)
        want = model.greedy_generate(**inputs, max_new_tokens=9)
        np.testing.assert_array_equal(loop.generate(**inputs, max_new_tokens=9), want)
        eos = int(want[0, 3])
        want = model.greedy_generate(**inputs, eos_id=eos, max_new_tokens=9)
        np.testing.assert_array_equal(loop.generate(**inputs, eos_id=eos, max_new_tokens=9), want)
        finished_early += int((want[0, 4:] == model.cfg.pad_id).all())
    assert finished_early == 3


def test_a_step_that_reads_the_set_it_writes_is_caught():
    """Planted: the two parities' bindings exchanged, so a step reads the buffers it is about to
    write (the set one step older): the tokens part from the runner's. (On tiny, whose decoder
    starts from one start token and leans on the source, the same mistake leaves the tokens as
    they are: a decoder-only model, where the prompt is all there is.)"""
    model = _model("llama-tiny", "float32")
    loop = FixedBufferGreedy(model)
    inputs = _inputs(model.cfg, np.random.default_rng(0), 3)
    want = model.greedy_generate(**inputs, max_new_tokens=9)
    np.testing.assert_array_equal(loop.generate(**inputs, max_new_tokens=9), want)
    loop.bindings.reverse()
    assert not np.array_equal(loop.generate(**inputs, max_new_tokens=9), want)


def test_refusals():
    model = _model("tiny", "float32")
    with pytest.raises(ValueError, match="CUDA graphs are captured on CUDA; this model's sessions run on cpu"):
        FixedBufferGreedy(model, cuda_graph=True)
    with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
        FixedBufferGreedy(model).generate(src_ids=np.full((1, 3), 5), bos_id=1, max_new_tokens=0)
    cfg = get_preset("tiny")
    jax_export = OnnxTransformer(exported(cfg, conformance_params(cfg, seed=0), framework="jax"), device="cpu")
    with pytest.raises(ExportError, match="has no decoder_step graph to generate with"):
        FixedBufferGreedy(jax_export)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device for onnxruntime on this machine")
@pytest.mark.parametrize("preset, dtype", CASES, ids=[f"greedy-cuda_graph-{d}-onnx-{p}-cuda" for p, d in CASES])
def test_cuda_graph_replays_give_the_runners_tokens(preset, dtype):
    """On CUDA every step after the prompt is a replay of a captured graph (one per buffer parity):
    the runner's tokens on the first generation (warm-up and capture), on later ones (replays),
    and on another shape (a session and graphs of its own)."""
    model = _model(preset, dtype, "cuda")
    loop = FixedBufferGreedy(model)
    assert loop.cuda_graph
    rng = np.random.default_rng(0)
    for batch in (3, 3, 3, 2):
        inputs = _inputs(model.cfg, rng, batch)
        want = model.greedy_generate(**inputs, max_new_tokens=12)
        np.testing.assert_array_equal(loop.generate(**inputs, max_new_tokens=12), want)
