"""decoder_step_in_place: the decode step whose cache onnxruntime's GroupQueryAttention writes in
place (export/in_place_step.py), served by export.runner on the CPU.

It must be the same function as decoder_step on every mask the spec allows (pads anywhere, a
query with no real key, a chunk continued after position 0), really write into the past buffers,
and be refused where onnxruntime's kernel cannot run it. A planted mistake in its graph (the
padding bias dropped) is caught by the same comparison.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import impl_numpy as golden
from conformance.tolerance import compare, tolerance
from export.cache import exported
from export.graphs import DECODER_STEP, DECODER_STEP_IN_PLACE, example_inputs
from export.in_place_step import InPlaceDecoderStepGraph, in_place_unsupported_reason
from export.runner import OnnxTransformer, served_graphs, step_chunks
from export.torch_export import DecoderStepGraph, torch_roles
from impl_torch.model import Transformer
from spec import conformance_params, get_preset

PRESETS = ["tiny", "llama-tiny", "char-lm"]  # cross-attention beside it; GQA and RoPE; learned positions


def _batch(cfg, seed=1):
    """[3, 12] ids with a left-padded row and a pad in the middle of another."""
    ids = np.random.default_rng(seed).integers(0, cfg.tgt_vocab_size - 1, (3, 12))
    ids = np.where(ids >= cfg.pad_id, ids + 1, ids)
    ids[1, :3] = cfg.pad_id
    ids[2, 5] = cfg.pad_id
    return ids


def _source(cfg):
    return np.random.default_rng(2).integers(3, cfg.src_vocab_size, (3, 6)) if cfg.has_encoder else None


def _chunked_logits(model, cfg, ids, src, chunks=((0, 4), (4, 7), (7, 8), (8, 12))):
    """The ids fed in chunks after position 0 (a batch of 3: the in-place step takes them a token at a time)."""
    cache = model.start_cache(ids.shape[0], ids.shape[1], src)
    keep = ids != cfg.pad_id
    if cfg.has_encoder:
        keep[:, 0] = True  # the start token is real whatever its id (SPEC §6)
    outputs = []
    for begin, end in chunks:
        logits, cache = model.decode_step(cache, ids[:, begin:end], keep[:, begin:end])
        outputs.append(logits)
    return np.concatenate(outputs, axis=1), keep


@pytest.mark.parametrize("preset", PRESETS)
def test_the_in_place_step_is_the_spec_through_chunks_and_pads(preset):
    cfg = get_preset(preset)
    params = conformance_params(cfg)
    directory = exported(cfg, params)
    in_place, copying = OnnxTransformer(directory, device="cpu"), OnnxTransformer(directory, device="cpu")
    copying.in_place = False  # the same export served by decoder_step
    assert in_place.in_place
    ids, src = _batch(cfg), _source(cfg)
    ours, keep = _chunked_logits(in_place, cfg, ids, src)
    theirs, _ = _chunked_logits(copying, cfg, ids, src)
    want = golden.forward(cfg, params, src, ids, tgt_keep=keep)
    relative = tolerance("float32", max(cfg.d_model, cfg.d_ff, 144), 2 * cfg.n_decoder_layers + 2)
    for logits in (ours, theirs):
        result = compare(logits, want, relative)
        assert result.passed, result.reason


def test_the_step_writes_the_past_buffers_it_reads():
    cfg = get_preset("llama-tiny")
    model = OnnxTransformer(exported(cfg, conformance_params(cfg)), device="cpu")
    cache = model.start_cache(2, 8)
    assert all(spare is past for spare, past in zip(cache.spare[:-1], cache.past[:-1]))  # one set of K/V buffers
    assert cache.spare[-1] is not cache.past[-1]  # the keep-vector alone is swapped
    _, after = model.decode_step(cache, np.array([[5, 6, 7], [8, 9, 10]]))
    keys = after.past[0].numpy()
    assert np.abs(keys[:, :, :3]).min() > 0 and not keys[:, :, 3:].any()  # written at 0..2 of the buffer itself
    assert after.past[0] is cache.past[0]
    copy = after.copy()
    assert copy.past[0] is not after.past[0] and copy.spare[0] is copy.past[0]


@given(st.integers(0, 50), st.integers(1, 9), st.integers(1, 5), st.booleans())
def test_step_chunks_cover_the_step_in_order(start, n_new, batch, in_place):
    chunks = step_chunks(start, n_new, batch, in_place)
    assert [t for begin, end in chunks for t in range(begin, end)] == list(range(n_new))
    one_at_a_time = in_place and start > 0 and n_new > 1 and batch > 1
    assert len(chunks) == (n_new if one_at_a_time else 1)


def test_a_cuda_session_keeps_the_copying_step():
    graphs = {"forward": "forward.onnx", DECODER_STEP: "decoder_step.onnx",
              DECODER_STEP_IN_PLACE: "decoder_step_in_place.onnx"}
    assert served_graphs(graphs, "cpu") == graphs
    assert DECODER_STEP_IN_PLACE not in served_graphs(graphs, "cuda")


def test_where_onnxruntime_cannot_run_it_it_is_not_exported():
    assert "float16" in in_place_unsupported_reason(get_preset("tiny"), "float16")
    assert "head size 12" in in_place_unsupported_reason(get_preset("qwen3-tiny"), "float32")
    assert DECODER_STEP_IN_PLACE not in torch_roles(get_preset("qwen2-tiny"), "float32")  # heads of 10
    assert DECODER_STEP_IN_PLACE in torch_roles(get_preset("llama-tiny"), "float32")


@pytest.mark.parametrize("preset", PRESETS)
def test_run_in_torch_the_in_place_graph_module_is_the_copying_one(preset):
    """The eager meaning of the custom op (what torch.export traces around): the same logits and
    present tensors as impl_torch's step."""
    cfg = get_preset(preset)
    model = Transformer.from_params(cfg, conformance_params(cfg))
    inputs = example_inputs(cfg, DECODER_STEP_IN_PLACE, "float32")
    inputs["past_keep"][1, :2] = False
    tensors = [torch.from_numpy(value) for value in inputs.values()]
    with torch.no_grad():
        ours, theirs = InPlaceDecoderStepGraph(model)(*tensors), DecoderStepGraph(model)(*tensors)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_graph_that_attends_to_pads_is_caught(tmp_path):
    """The planted mistake: GroupQueryAttention's attention_bias removed from the in-place graph, so
    pads are attended as keys. The chunked run above then misses the golden."""
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    planted = tmp_path / "planted"
    shutil.copytree(exported(cfg, params), planted)
    file = json.loads((planted / "manifest.json").read_text())["graphs"][DECODER_STEP_IN_PLACE]
    graph = onnx.load(str(planted / file))
    nodes = [node for node in graph.graph.node if node.op_type == "GroupQueryAttention"]
    assert len(nodes) == cfg.n_decoder_layers
    for node in nodes:
        del node.input[10:]  # attention_bias is input 10
    onnx.save(graph, str(planted / file))
    ids = _batch(cfg)
    ours, keep = _chunked_logits(OnnxTransformer(planted, device="cpu"), cfg, ids, None)
    want = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    result = compare(ours, want, tolerance("float32", max(cfg.d_model, cfg.d_ff, 144), 2 * cfg.n_decoder_layers + 2))
    assert not result.passed and result.worst_index[0] in (1, 2)  # a padded row


def test_the_step_profile_sees_the_cache_copy_go():
    """benchmarks.step_profile on tiny: equal tokens from both graphs, and the profile by op type
    has the copying step's ScatterElements on the cache and the in-place step's GroupQueryAttention
    (no timing is asserted)."""
    from benchmarks.step_profile import compare_steps, summary

    result = compare_steps("tiny", batch=2, new_tokens=4, repeats=1)
    shares = {row["graph"]: row["op_shares"] for row in result["steps"]}
    assert result["same_tokens"] and set(shares) == {DECODER_STEP, DECODER_STEP_IN_PLACE}
    assert "ScatterElements" in shares[DECODER_STEP] and "GroupQueryAttention" not in shares[DECODER_STEP]
    assert "GroupQueryAttention" in shares[DECODER_STEP_IN_PLACE]
    assert shares[DECODER_STEP_IN_PLACE].get("ScatterElements", 0) < shares[DECODER_STEP]["ScatterElements"]
    assert abs(sum(shares[DECODER_STEP].values()) - 1) < 1e-9
    assert "decoder_step_in_place" in summary(result)
