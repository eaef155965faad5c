"""ONNX export and onnxruntime serving held to the golden: graphs checked and stamped, logits on
batch sizes and lengths the export never saw (1, longer than the example, an all-padding row),
greedy tokens equal to the golden's, decoder steps equal to the full forward, the torch and JAX
exports equal to each other, the runner's refusals, thread safety and node placement.

Exports come from export.cache (on disk between runs), so the first run pays ~2 min of export;
every export here uses seed 0, as the refusals, reliability, bench and docs tests do, so a fresh
machine makes each one once.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import shutil
import threading
import weakref

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import impl_numpy as golden
from conformance.cases import EOS_ID
from conformance.tolerance import compare, compare_generation, tolerance
from export.cache import exported
from export.graphs import DECODER_STEP_IN_PLACE, ENCODER, FORWARD, roles, signature
from export.onnx_model import ExportError, metadata
from export.placement import MATRIX_AND_NORM_OPS, cpu_fallbacks, fallback_message
from export.runner import (CPU, OnnxTransformer, ProviderFallbackError, cuda_available, cuda_provider_options,
                           nvidia_library_paths)
from export.torch_export import torch_roles
from spec import SPEC_VERSION, InputError, ModelConfig, get_preset, conformance_params, params_digest
from tests.bounds import assert_agrees, model_bounds

PRESETS = ("tiny", "char-lm")  # an encoder-decoder and a decoder-only model
DTYPES = ("float32", "float16")
HAS_CUDA = cuda_available()


@pytest.fixture(scope="module", params=PRESETS)
def preset(request):
    cfg = get_preset(request.param)
    return request.param, cfg, conformance_params(cfg, seed=0)


_exports: dict = {}


def _export(cfg: ModelConfig, params, framework: str, dtype: str, device: str = "cpu") -> OnnxTransformer:
    key = (cfg.to_json(), framework, dtype, device)
    if key not in _exports:
        _exports[key] = OnnxTransformer(exported(cfg, params, framework=framework, dtype=dtype), device=device)
    return _exports[key]


ON_CUDA_TOO = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device for onnxruntime on this machine")])]


def _ids(rng, cfg: ModelConfig, batch: int, length: int, vocab: int, padding: str) -> np.ndarray:
    ids = rng.integers(0, vocab - 1, (batch, length))
    ids = np.where(ids >= cfg.pad_id, ids + 1, ids)
    if padding == "pad_right" and length > 1:
        ids[0, length // 2:] = cfg.pad_id
    if padding == "all_pad" and batch > 1:
        ids[1] = cfg.pad_id
    return ids.astype(np.int64)


# (batch, source length, target length): the export traced batch 2, source 5, target 3
SHAPES = {"b1-len1": (1, 1, 1), "b1-longer": (1, 11, 13), "b4": (4, 3, 2), "b3-longer": (3, 17, 9)}
PADDINGS = ("none", "pad_right", "all_pad")


def _bounds(cfg: ModelConfig, src_len: int, tgt_len: int) -> dict:
    """As the catalogue's whole-model cases (tests.bounds.model_bounds): the widest inner product,
    the keys, or the squared positions (a sinusoid's angle carries its rounding times the position);
    the whole model's depth; the rotary angle at the last position."""
    return model_bounds(cfg, tgt_len, src_len if cfg.has_encoder else 0)


def _tolerance(cfg: ModelConfig, dtype: str, src_len: int, tgt_len: int) -> float:
    """SPEC §8's relative tolerance at dtype for a whole-model run of these lengths."""
    bounds = _bounds(cfg, src_len, tgt_len)
    return tolerance(dtype, bounds["n"], bounds["depth"], bounds["angle"])


def _forward_cells():
    """ids read forward-<padding>-<dtype>-<backend>-cpu-<shape>; an all-padding row needs a
    second row beside it, so all_pad runs at batch sizes above 1 only."""
    cells = []
    for shape, (batch, _, _) in SHAPES.items():
        for padding in PADDINGS:
            if padding == "all_pad" and batch == 1:
                continue
            for dtype in DTYPES:
                for framework, backend in (("torch", "onnx"), ("jax", "onnx-jax")):
                    cells.append(pytest.param(shape, padding, dtype, framework,
                                              id=f"forward-{padding}-{dtype}-{backend}-cpu-{shape}"))
    return cells


@pytest.mark.parametrize("shape, padding, dtype, framework", _forward_cells())
def test_forward_matches_golden(preset, shape, padding, dtype, framework):
    _, cfg, params = preset
    batch, src_len, tgt_len = SHAPES[shape]
    rng = np.random.default_rng(batch * 100 + src_len)
    src = _ids(rng, cfg, batch, src_len, cfg.src_vocab_size, padding) if cfg.has_encoder else None
    tgt = _ids(rng, cfg, batch, tgt_len, cfg.tgt_vocab_size, "pad_right" if padding != "none" else "none")
    model = _export(cfg, params, framework, dtype)
    got = model.forward(src, tgt)
    assert got.dtype == np.dtype(dtype)
    want = golden.forward(cfg, params, src, tgt)
    result = compare(got.astype(np.float64), want, _tolerance(cfg, dtype, src_len, tgt_len))
    assert result.passed, result.reason or f"error {result.max_abs_err:.3g} > tol {result.tol:.3g}"


@pytest.mark.parametrize("device", ON_CUDA_TOO)
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tokens_equal_golden(preset, dtype, device):
    """Generation through decoder_step and its two sets of buffers (on CUDA too, where one is)."""
    _, cfg, params = preset
    rng = np.random.default_rng(7)
    batch = 4
    if cfg.has_encoder:
        src = _ids(rng, cfg, batch, 6, cfg.src_vocab_size, "pad_right")
        src[2] = cfg.pad_id  # an all-padding source
        options = dict(src_ids=src, bos_id=1)
    else:
        prompt = _ids(rng, cfg, batch, 5, cfg.tgt_vocab_size, "none")
        prompt[0, :2] = cfg.pad_id  # left padding
        options = dict(prompt_ids=prompt)
    new_tokens = 10
    tokens = _export(cfg, params, "torch", dtype, device).greedy_generate(**options, eos_id=EOS_ID,
                                                                          max_new_tokens=new_tokens)
    want, step_logits = golden.greedy_generate(cfg, params, **options, eos_id=EOS_ID, max_new_tokens=new_tokens,
                                               return_step_logits=True)
    if dtype == "float32":
        np.testing.assert_array_equal(tokens, want)
    else:  # half precision may flip a near-tie: the policy's token check allows exactly that
        # the last step's keys: the source's 6 and the start token, or the prompt's 5, then the new tokens
        positions = (1 if cfg.has_encoder else 5) + new_tokens
        result = compare_generation(tokens, want, step_logits, _tolerance(cfg, dtype, 6, positions), EOS_ID)
        assert result.passed, result.reason


def _addresses(values) -> tuple[int, ...]:
    return tuple(value.data_ptr() for value in values)


def test_decoder_steps_equal_forward(preset):
    """Prefill of 3 tokens, then one token per decoder_step, against the forward graph; every
    step binds one of the same two sets of cache buffers."""
    _, cfg, params = preset
    model = _export(cfg, params, "torch", "float32")
    rng = np.random.default_rng(11)
    src = _ids(rng, cfg, 2, 5, cfg.src_vocab_size, "pad_right") if cfg.has_encoder else None
    tgt = _ids(rng, cfg, 2, 7, cfg.tgt_vocab_size, "none")
    full = model.forward(src, tgt)
    cache = model.start_cache(2, 7, src)
    buffers = {_addresses(cache.past), _addresses(cache.spare)}
    first, cache = model.decode_step(cache, tgt[:, :3])
    steps = [first]
    for t in range(3, 7):
        logits, cache = model.decode_step(cache, tgt[:, t:t + 1])
        steps.append(logits)
        assert {_addresses(cache.past), _addresses(cache.spare)} == buffers
    assert cache.length == cache.capacity == 7
    assert_agrees(np.concatenate(steps, axis=1), full, **_bounds(cfg, 5, 7), dtype="float32")
    with pytest.raises(InputError, match="the cache holds 7 positions; 7 are used and 1 more do not fit"):
        model.decode_step(cache, tgt[:, :1])


def test_a_cache_continued_two_ways_is_refused_unless_copied():
    """The two buffer sets are written in turn, so a cache whose set a step from another branch
    has since written is refused; a rewind along one line and a copy() are fine (SPEC.md §7)."""
    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)
    model = _export(cfg, params, "torch", "float32")
    rng = np.random.default_rng(12)
    src, tgt = _ids(rng, cfg, 2, 5, cfg.src_vocab_size, "none"), _ids(rng, cfg, 2, 4, cfg.tgt_vocab_size, "none")
    full = model.forward(src, tgt)
    bounds = _bounds(cfg, 5, 4)  # two float32 computations of the logits
    root = model.start_cache(2, 4, src)
    _, prefix = model.decode_step(root, tgt[:, :2])
    branch = prefix.copy()
    _, one = model.decode_step(prefix, tgt[:, 2:3])
    _, other = model.decode_step(prefix, tgt[:, 3:4])  # writes the buffers `one` reads
    with pytest.raises(InputError, match="another branch"):
        model.decode_step(one, tgt[:, 3:4])
    logits, _ = model.decode_step(branch, tgt[:, 2:3])  # the copy was taken before: its own buffers
    assert_agrees(logits, full[:, 2:3], **bounds, dtype="float32", what="the copy")
    logits, _ = model.decode_step(root, tgt[:, :3])  # a rewind to the start of the line
    assert_agrees(logits, full[:, :3], **bounds, dtype="float32", what="the rewind")


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_and_jax_exports_agree(preset, dtype):
    _, cfg, params = preset
    from_torch, from_jax = _export(cfg, params, "torch", dtype), _export(cfg, params, "jax", dtype)
    rng = np.random.default_rng(5)
    src = _ids(rng, cfg, 3, 8, cfg.src_vocab_size, "pad_right") if cfg.has_encoder else None
    tgt = _ids(rng, cfg, 3, 6, cfg.tgt_vocab_size, "pad_right")
    relative = _tolerance(cfg, dtype, 8, 6)
    a, b = from_torch.forward(src, tgt).astype(np.float64), from_jax.forward(src, tgt).astype(np.float64)
    result = compare(a, b, 2 * relative)  # each within the tolerance of the golden
    assert result.passed, result.reason or f"torch vs jax export: {result.max_abs_err:.3g} > {result.tol:.3g}"
    if cfg.has_encoder:
        (memory_t, cross_t), (memory_j, cross_j) = from_torch.encode(src), from_jax.encode(src)
        for x, y in zip([memory_t, *cross_t], [memory_j, *cross_j]):
            assert compare(x.astype(np.float64), y.astype(np.float64), 2 * relative).passed


def test_graphs_are_checked_and_stamped(preset):
    _, cfg, params = preset
    for framework in ("torch", "jax"):
        directory = exported(cfg, params, framework=framework, dtype="float32")
        manifest = json.loads((directory / "manifest.json").read_text())
        expected_roles = torch_roles(cfg, "float32") if framework == "torch" else tuple(
            r for r in (FORWARD, ENCODER) if r in roles(cfg))
        assert tuple(manifest["graphs"]) == expected_roles
        for role, file in manifest["graphs"].items():
            model = onnx.load(str(directory / file))
            onnx.checker.check_model(model, full_check=True)
            stamp = metadata(model)
            assert ModelConfig.from_json(stamp["config"]) == cfg
            assert stamp["spec_version"] == SPEC_VERSION
            assert stamp["params_sha256"] == params_digest(params)
            assert stamp["role"] == role and stamp["dtype"] == "float32" and stamp["opset"] == "23"
            assert model.ir_version <= 13, "onnxruntime 1.31 reads IR versions up to 13"
            sig = signature(cfg, role)
            assert [i.name for i in model.graph.input] == sig.input_names
            assert [o.name for o in model.graph.output] == sig.output_names
            types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
            for tensor in sig.inputs:  # ids and positions int64 and keeps bool from both exporters
                want = {"ids": onnx.TensorProto.INT64, "position": onnx.TensorProto.INT64, "keep": onnx.TensorProto.BOOL,
                        "float": onnx.TensorProto.FLOAT}
                assert types[tensor.name] == want[tensor.kind], tensor.name
            ops = {node.op_type for node in model.graph.node}
            if role == DECODER_STEP_IN_PLACE:  # its self-attention is GroupQueryAttention, cross-attention Attention
                assert "GroupQueryAttention" in ops and ("Attention" in ops) == cfg.has_encoder
            elif framework == "torch" and role != ENCODER or framework == "torch" and cfg.has_encoder:
                assert "Attention" in ops, "opset 23 turns scaled dot-product attention into the Attention op"


def test_fallback_opset_decomposes_attention():
    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)
    directory = exported(cfg, params, opset=20)  # the same export docs/framework-differences.md counts
    model = onnx.load(str(directory / "forward.onnx"))
    ops = {node.op_type for node in model.graph.node}
    assert "Attention" not in ops and "Softmax" in ops
    assert metadata(model)["opset"] == "20"
    rng = np.random.default_rng(2)
    src, tgt = _ids(rng, cfg, 3, 9, 96, "all_pad"), _ids(rng, cfg, 3, 4, 80, "pad_right")
    runner = OnnxTransformer(directory, device="cpu")
    got = runner.forward(src, tgt)
    tokens = runner.greedy_generate(src, bos_id=1, eos_id=2, max_new_tokens=6)  # decoder graphs at opset 20
    np.testing.assert_array_equal(tokens, golden.greedy_generate(cfg, params, src, bos_id=1, eos_id=2,
                                                                 max_new_tokens=6))
    result = compare(got.astype(np.float64), golden.forward(cfg, params, src, tgt),
                     _tolerance(cfg, "float32", 9, 4))
    assert result.passed and not np.isnan(got).any()


def test_processes_asking_for_one_export_at_once_export_it_once(tmp_path, monkeypatch):
    """Two askers of one cache entry at the same time (a suite's two workers, a check's columns):
    the second waits for the first's export and reads it. Threads stand in for the processes (each
    opens the lock itself, as a process does); without the lock both export (shown below)."""
    import contextlib

    from export import cache

    monkeypatch.setenv("ROSETTA_ONNX_CACHE", str(tmp_path / "cache"))
    exports = []

    def slow_export(cfg, params, directory, **options):
        exports.append(directory)
        (directory / "forward.onnx").write_bytes(b"graph")
        threading.Event().wait(0.5)  # the other asker comes to the door while this one exports
        (directory / "manifest.json").write_text(json.dumps({"graphs": {FORWARD: "forward.onnx"}}))

    monkeypatch.setattr(cache, "export_model", slow_export)
    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)

    def two_askers():
        exports.clear()
        found = []
        threads = [threading.Thread(target=lambda: found.append(cache.exported(cfg, params))) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return found

    found = two_askers()
    assert len(exports) == 1 and len(found) == 2 and found[0] == found[1] and (found[0] / "manifest.json").is_file()
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setattr(cache, "_one_exporter", lambda lock: contextlib.nullcontext())
    assert len(two_askers()) == 2 and len(exports) == 2  # without the lock: each exports its own copy


def test_runner_refuses_bad_inputs():
    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)
    model = _export(cfg, params, "torch", "float32")
    good = np.ones((2, 3), dtype=np.int64)
    with pytest.raises(InputError, match="outside the vocabulary"):
        model.forward(good, np.full((2, 3), 80))
    with pytest.raises(InputError, match="batch"):
        model.forward(good, np.ones((3, 3), dtype=np.int64))
    with pytest.raises(InputError, match="boolean"):
        model.forward(good, good, src_keep=np.ones((2, 3), dtype=np.int64))
    with pytest.raises(InputError, match="integer"):
        model.forward(good.astype(np.float32), good)
    with pytest.raises(InputError, match="max_new_tokens"):
        model.greedy_generate(good, bos_id=1, max_new_tokens=0)
    cache = model.start_cache(2, 4, good)
    with pytest.raises(InputError, match="batch"):
        model.decode_step(cache, np.ones((3, 1), dtype=np.int64))
    jax_model = _export(cfg, params, "jax", "float32")
    with pytest.raises(InputError, match="at most 64"):
        jax_model.forward(np.ones((1, 65), dtype=np.int64), good[:1])
    with pytest.raises(ExportError, match="no decoder_step graph"):
        jax_model.greedy_generate(good, bos_id=1, max_new_tokens=2)


def test_runner_refuses_bad_directories(tmp_path):
    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)
    with pytest.raises(ExportError, match="no manifest.json"):
        OnnxTransformer(tmp_path)
    # a graph from another export (other weights) slipped into the directory
    mixed = tmp_path / "mixed"
    shutil.copytree(exported(cfg, params, framework="torch"), mixed)
    other = exported(cfg, conformance_params(cfg, seed=4), framework="jax")
    shutil.copy(other / "forward.onnx", mixed / "forward.onnx")
    with pytest.raises(ExportError, match="params_sha256 metadata does not match"):
        OnnxTransformer(mixed, device="cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        OnnxTransformer(mixed, device="tpu")
    with pytest.raises(ValueError, match="on_fallback"):
        OnnxTransformer(mixed, on_fallback="ignore")


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a usable CUDA provider")
def test_cuda_refused_where_it_cannot_run():
    cfg = get_preset("tiny")
    directory = exported(cfg, conformance_params(cfg, seed=0), framework="torch")
    with pytest.raises(ProviderFallbackError, match="CUDA provider cannot run here"):
        OnnxTransformer(directory, device="cuda")
    assert OnnxTransformer(directory, device="auto").device == "cpu"


def test_one_session_shared_by_eight_threads():
    cfg = get_preset("tiny")
    model = _export(cfg, conformance_params(cfg, seed=0), "torch", "float32")
    rng = np.random.default_rng(9)
    jobs = [(_ids(rng, cfg, 2, 4 + i % 5, 96, "pad_right"), _ids(rng, cfg, 2, 2 + i % 3, 80, "none")) for i in range(32)]
    sequential = [(model.forward(s, t), model.greedy_generate(s, bos_id=1, eos_id=2, max_new_tokens=6)) for s, t in jobs]
    concurrent: list = [None] * len(jobs)

    def work(index_range):
        for i in index_range:
            s, t = jobs[i]
            concurrent[i] = (model.forward(s, t), model.greedy_generate(s, bos_id=1, eos_id=2, max_new_tokens=6))

    threads = [threading.Thread(target=work, args=(range(k, len(jobs), 8),)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (logits_a, tokens_a), (logits_b, tokens_b) in zip(sequential, concurrent):
        np.testing.assert_array_equal(logits_a, logits_b)
        np.testing.assert_array_equal(tokens_a, tokens_b)
    # a CPU session is made at its first use: eight threads asking at once share the one made
    fresh, made = OnnxTransformer(model.directory, device="cpu"), []
    make = fresh.sessions._make()
    fresh.sessions._make = lambda: lambda role, file: (made.append(role), make(role, file))[1]
    together = threading.Barrier(8)
    threads = [threading.Thread(target=lambda: (together.wait(), fresh.forward(*jobs[0]))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert made == [FORWARD]
    # the sessions hold their model weakly: dropped, it is freed at once, not when the collector runs
    gc.disable()
    try:
        dropped = OnnxTransformer(model.directory, device="cpu")
        dropped.forward(*jobs[0])
        gone = weakref.ref(dropped)
        del dropped
        assert gone() is None
    finally:
        gc.enable()


def test_every_node_placed_on_the_cpu_provider():
    cfg = get_preset("tiny")
    placement = _export(cfg, conformance_params(cfg, seed=0), "torch", "float32").placement()
    assert set(placement) == set(torch_roles(cfg, "float32")) == set(roles(cfg)) | {DECODER_STEP_IN_PLACE}
    for role, nodes in placement.items():
        assert nodes and {node.provider for node in nodes} == {CPU}, role


def test_only_the_gpu_onnxruntime_is_installed():
    """jax2onnx declares the CPU onnxruntime package; installing it would overwrite onnxruntime-gpu."""
    assert importlib.metadata.version("onnxruntime-gpu")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("onnxruntime")
    assert ort.__file__.startswith(str(importlib.metadata.distribution("onnxruntime-gpu").locate_file("")))


def test_cuda_libraries_are_found_in_whichever_site_holds_them(tmp_path):
    """onnxruntime's CUDA provider links cuBLAS, cuDNN... by name; NVIDIA's wheels may sit in
    another site folder than onnxruntime (a machine's own torch with our onnxruntime-gpu beside
    it): each library is taken from the first site that holds it, in onnxruntime's order."""
    first, second = tmp_path / "ours", tmp_path / "theirs"
    for site, name in [(second, "libcublasLt.so.13"), (first, "libcudart.so.13"), (second, "libcudart.so.13")]:
        (site / "nvidia" / "cu13" / "lib").mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / "cu13" / "lib" / name).write_bytes(b"")
    wanted = [("nvidia", "cu13", "lib", "libcublasLt.so.13"), ("nvidia", "cu13", "lib", "libcublas.so.13"),
              ("nvidia", "cu13", "lib", "libcudart.so.13")]
    assert nvidia_library_paths([str(first), str(second)], wanted) == [
        str(second / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13"), str(first / "nvidia" / "cu13" / "lib" / "libcudart.so.13")]
    assert nvidia_library_paths([], wanted) == []


def test_float32_is_float32_on_cuda_unless_tf32_is_asked(tmp_path):
    """onnxruntime's CUDA provider rounds float32 matrix products to TF32 unless use_tf32 is 0: on
    an H200 our float32 exports sat 3e-3 from the golden with its default. The runner turns it off;
    the TF32 column asks for it, on CUDA and for a float32 graph only."""
    assert cuda_provider_options() == {"device_id": "0", "use_tf32": "0"}
    assert cuda_provider_options(tf32=True) == {"device_id": "0", "use_tf32": "1"}
    cfg = get_preset("tiny")
    directory = exported(cfg, conformance_params(cfg, seed=0), framework="torch")
    with pytest.raises(ValueError, match="tf32 is a CUDA matmul mode of float32 graphs; this is a float32 export on cpu"):
        OnnxTransformer(directory, device="cpu", tf32=True)
    from conformance.backends.onnx_backend import OnnxBackend

    assert OnnxBackend().supports("tf32", "cpu") == "TF32 is a CUDA matmul mode"
    assert OnnxBackend().supports("tf32", "cuda") is None and OnnxBackend().supports("float64", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device for onnxruntime on this machine")
def test_cuda_tf32_is_onnxruntimes_default_and_within_tf32s_tolerance(preset):
    """What the H200 showed (reports/gpu/nvidia-h200/): with use_tf32 on, the float32 export is as
    far from the golden as TF32 makes it, past float32's tolerance; with it off, within."""
    _, cfg, params = preset
    directory = exported(cfg, params, framework="torch", dtype="float32")
    rng = np.random.default_rng(1)
    src = _ids(rng, cfg, 3, 9, cfg.src_vocab_size, "pad_right") if cfg.has_encoder else None
    tgt = _ids(rng, cfg, 3, 12, cfg.tgt_vocab_size, "pad_right")
    want = golden.forward(cfg, params, src, tgt)
    rounded = OnnxTransformer(directory, device="cuda", tf32=True).forward(src, tgt).astype(np.float64)
    exact = OnnxTransformer(directory, device="cuda").forward(src, tgt).astype(np.float64)
    assert compare(exact, want, _tolerance(cfg, "float32", 9, 12)).passed
    assert compare(rounded, want, _tolerance(cfg, "tf32", 9, 12)).passed
    assert not compare(rounded, want, _tolerance(cfg, "float32", 9, 12)).passed


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device for onnxruntime on this machine")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_every_node_on_cuda_and_matches_golden(preset, dtype):
    _, cfg, params = preset
    model = OnnxTransformer(exported(cfg, params, framework="torch", dtype=dtype), device="cuda")
    for role, nodes in model.placement().items():
        assert cpu_fallbacks(nodes) == [], fallback_message(role, cpu_fallbacks(nodes))
        # onnxruntime may fuse MatMuls into other ops on CUDA: every compute op, whichever it is
        assert {node.provider for node in nodes if node.op_type in MATRIX_AND_NORM_OPS} == {"CUDAExecutionProvider"}, role
    rng = np.random.default_rng(1)
    src = _ids(rng, cfg, 3, 9, cfg.src_vocab_size, "all_pad") if cfg.has_encoder else None
    tgt = _ids(rng, cfg, 3, 5, cfg.tgt_vocab_size, "pad_right")
    result = compare(model.forward(src, tgt).astype(np.float64), golden.forward(cfg, params, src, tgt),
                     _tolerance(cfg, dtype, 9, 5))
    assert result.passed, result.reason


@pytest.mark.slow
def test_the_jax_export_is_the_same_graph_on_a_gpu_machine(tmp_path, monkeypatch):
    """On an H100 the float16 JAX export failed onnx's checker ("Mul ... B has inconsistent type
    tensor(float)"): traced where the default backend is a GPU, impl_jax's float16 attention took
    jax.nn.dot_product_attention. Simulated here (the default backend is all impl_jax reads), the
    export must give the very graph a CPU machine gives."""
    import jax

    import impl_jax.model
    from export.jax_export import export_jax

    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)
    on_cpu = onnx.load(exported(cfg, params, framework="jax", dtype="float16") / "forward.onnx")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert impl_jax.model._platform() == "gpu"
    paths = export_jax(cfg, params, tmp_path, dtype="float16", graph_roles=(FORWARD,))
    on_gpu = onnx.load(paths[FORWARD])
    assert [(n.op_type, list(n.input), list(n.output)) for n in on_gpu.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in on_cpu.graph.node]


def _with_a_node_cuda_cannot_run(directory, destination):
    """A copy of an export whose forward graph also runs Unique (onnxruntime has no CUDA kernel
    for it) on the logits, adding 0 x their sum back: same logits, one float node that must land
    on the CPU."""
    shutil.copytree(directory, destination)
    model = onnx.load(destination / "forward.onnx")
    graph = model.graph
    logits = graph.output[0].name
    for node in graph.node:
        node.output[:] = [f"{name}.inner" if name == logits else name for name in node.output]
        node.input[:] = [f"{name}.inner" if name == logits else name for name in node.input]
    graph.initializer.extend([onnx.numpy_helper.from_array(np.array([-1], np.int64), "unique.flat_shape")])
    element = graph.output[0].type.tensor_type.elem_type
    graph.initializer.extend([onnx.helper.make_tensor("unique.zero", element, [], [0.0])])
    graph.node.extend([
        onnx.helper.make_node("Reshape", [f"{logits}.inner", "unique.flat_shape"], ["unique.flat"]),
        onnx.helper.make_node("Unique", ["unique.flat"], ["unique.values"], name="node_Unique_forced"),
        onnx.helper.make_node("ReduceSum", ["unique.values"], ["unique.sum"], keepdims=0),
        onnx.helper.make_node("Mul", ["unique.sum", "unique.zero"], ["unique.nothing"]),
        onnx.helper.make_node("Add", [f"{logits}.inner", "unique.nothing"], [logits]),
    ])
    onnx.save(model, destination / "forward.onnx")
    return destination


def test_the_forced_cpu_node_graph_computes_the_same_logits(tmp_path):
    """The graph the GPU test below refuses is a valid graph with unchanged logits."""
    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)
    directory = exported(cfg, params, framework="torch")
    forced = OnnxTransformer(_with_a_node_cuda_cannot_run(directory, tmp_path / "forced"), device="cpu")
    rng = np.random.default_rng(4)
    src, tgt = _ids(rng, cfg, 2, 6, 96, "pad_right"), _ids(rng, cfg, 2, 4, 80, "none")
    np.testing.assert_array_equal(forced.forward(src, tgt), _export(cfg, params, "torch", "float32").forward(src, tgt))
    assert "Unique" in {node.op_type for node in forced.placement()[FORWARD]}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device for onnxruntime on this machine")
def test_cuda_refuses_a_compute_node_on_the_cpu(tmp_path):
    cfg = get_preset("tiny")
    directory = exported(cfg, conformance_params(cfg, seed=0), framework="torch")
    forced = _with_a_node_cuda_cannot_run(directory, tmp_path / "forced")
    with pytest.raises(ProviderFallbackError, match="node_Unique_forced: Unique"):
        OnnxTransformer(forced, device="cuda")
    with pytest.warns(RuntimeWarning, match="CUDA FALLBACK: forward.onnx: .*node_Unique_forced"):
        model = OnnxTransformer(forced, device="cuda", on_fallback="warn")
    names = {node.name for node, _ in cpu_fallbacks(model.placement()[FORWARD])}
    assert "node_Unique_forced" in names


# ---- Triton model repository ----------------------------------------------------------------

def test_triton_repository_matches_the_graphs(tmp_path):
    from export.triton import parse_pbtxt, validate_repository, write_repository

    cfg = get_preset("tiny")
    directory = exported(cfg, conformance_params(cfg, seed=0), framework="torch")
    models = write_repository(directory, tmp_path / "repo", max_batch_size=8, kind="KIND_CPU", instances=2)
    assert sorted(m.name for m in models) == sorted(f"rosetta_{role}" for role in roles(cfg))
    config = parse_pbtxt((tmp_path / "repo" / "rosetta_encoder" / "config.pbtxt").read_text())
    assert config["platform"] == "onnxruntime_onnx" and config["max_batch_size"] == 8
    assert config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert "max_queue_delay_microseconds" in config["dynamic_batching"]
    inputs = {entry["name"]: entry for entry in config["input"]}
    assert inputs["src_ids"] == {"name": "src_ids", "data_type": "TYPE_INT64", "dims": [-1]}  # batch axis left to Triton
    # the step's position is one scalar for its whole batch: no batching across requests there
    config = parse_pbtxt((tmp_path / "repo" / "rosetta_decoder_step" / "config.pbtxt").read_text())
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    inputs = {entry["name"]: entry for entry in config["input"]}
    assert inputs["start"] == {"name": "start", "data_type": "TYPE_INT64", "dims": []}
    assert inputs["past.0.key"]["dims"] == [-1, cfg.n_heads, -1, cfg.d_head]
    assert {entry["name"] for entry in config["output"]} >= {"logits", "present_keep"}

    # a config that drifts from its graph is caught, every problem named
    path = tmp_path / "repo" / "rosetta_encoder" / "config.pbtxt"
    path.write_text(path.read_text().replace("TYPE_INT64", "TYPE_INT32").replace('name: "src_keep"', 'name: "source_keep"'))
    with pytest.raises(ExportError) as caught:
        validate_repository(tmp_path / "repo")
    message = str(caught.value)
    assert "src_ids is TYPE_INT32 in config.pbtxt, TYPE_INT64 in the graph" in message
    assert "input 'source_keep' is not in the graph" in message
    assert "the graph's input 'src_keep' is missing" in message
    # a step batched by Triton would stack its scalar position across requests
    path = tmp_path / "repo" / "rosetta_decoder_step" / "config.pbtxt"
    path.write_text(path.read_text().replace("max_batch_size: 0", "max_batch_size: 8"))
    with pytest.raises(ExportError, match=r"start has no dynamic first axis to batch \(dims \[\]\)"):
        validate_repository(tmp_path / "repo")
    with pytest.raises(ExportError, match="instance kind"):
        write_repository(directory, tmp_path / "other", kind="KIND_TPU")


# ---- the CLI --------------------------------------------------------------------------------

def test_cli_export_and_generate(tmp_path, capsys):
    from rosetta.main import main

    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)
    assert main(["export", "--preset", "tiny", "--out", str(tmp_path / "onnx"), "--graphs", "forward"]) == 0
    out = capsys.readouterr().out
    assert "forward graph vs golden" in out and "(pass)" in out
    assert json.loads((tmp_path / "onnx" / "manifest.json").read_text())["graphs"] == {"forward": "forward.onnx"}

    directory = exported(cfg, params, framework="torch")
    assert main(["generate", str(directory), "--src", "5 6 7 8", "--src", "9 10", "--eos", "2",
                 "--max-new-tokens", "6"]) == 0
    printed = np.array([[int(t) for t in line.split()] for line in capsys.readouterr().out.strip().splitlines()])
    src = np.array([[5, 6, 7, 8], [9, 10, 0, 0]])
    np.testing.assert_array_equal(printed, golden.greedy_generate(cfg, params, src, bos_id=1, eos_id=2, max_new_tokens=6))


@pytest.mark.parametrize("argv, message", [
    (["generate", "{tmp}"], "no manifest.json"),
    (["generate", "{export}", "--src", "5 x"], "token ids are integers"),
    (["generate", "{export}", "--prompt", "5 6"], "generates from --src"),
    (["generate", "{export}", "--src", "5 999"], "outside the vocabulary"),
    (["generate", "{export}", "--src", "5", "--max-new-tokens", "0"], "max_new_tokens must be a positive"),
    (["generate", "{export}", "--src", "5", "--device", "cpu", "--cuda-graph"],
     "--cuda-graph captures CUDA graphs; this model runs on cpu (--device cuda)"),
    (["export", "--preset", "tiny", "--out", "{tmp}/x", "--graphs", "decoder"], "cannot write graph role(s) decoder"),
    (["export", "--preset", "tiny", "--out", "{tmp}/x", "--framework", "jax", "--graphs", "decoder_step"],
     "cannot write graph role(s) decoder_step"),
] + ([] if HAS_CUDA else [(["generate", "{export}", "--src", "5", "--device", "cuda"], "CUDA provider cannot run here")]))
def test_cli_errors_exit_2(tmp_path, capsys, argv, message):
    from rosetta.main import main

    cfg = get_preset("tiny")
    directory = exported(cfg, conformance_params(cfg, seed=0), framework="torch")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{export}", str(directory)) for a in argv]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error


# ---- the modern decoder: RoPE, grouped-query attention, q/k norms --------------------------------

@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "qwen2-yarn-tiny", "mistral-tiny",
                                  "gemma2-tiny"])
def test_the_modern_decoder_exports_pass_every_whole_model_cell(name):
    """Both exports at float32 against the golden on every whole-model case, `far` (decode steps
    after 1000 cached positions) and `long` (a 520-token forward) included; the torch export keeps
    each attention one `Attention` op reading the H_kv key/value heads, not a repeat of them.
    qwen2-yarn-tiny carries rescaled frequencies (SPEC §5.12) and YaRN's attention factor into
    both graphs (llama3-tiny's go through the torch export in test_in_place_step, which keeps the
    suite's cold exports fewer); mistral-tiny its sliding window (SPEC §6) into both, and into the
    in-place step's attention bias; gemma2-tiny its softcaps, (1 + w) norms, post norms and sliding and
    full layers (SPEC §5.13), the attention's cap a Tanh before the mask in both graphs."""
    from conformance.harness import PASS, plan_matrix, run_matrix

    cfg = get_preset(name)
    params = conformance_params(cfg)
    results = run_matrix(cfg, params, plan_matrix(cfg, ["onnx", "onnx-jax"], ["float32"], ["cpu"]))
    ran = [r for r in results if r.status != "skip"]
    assert all(r.status == PASS for r in ran), {r.test_id: r.reason[:200] for r in ran if r.status != PASS}
    passed = {r.test_id for r in ran}
    assert {"forward-long-float32-onnx-cpu", "decode-far-float32-onnx-cpu", "generate-pad_left-float32-onnx-cpu",
            "forward-long-float32-onnx-jax-cpu"} <= passed
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(exported(cfg, params) / "forward.onnx"))).graph
    heads = {v.name: v.type.tensor_type.shape.dim[1].dim_value for v in graph.value_info
             if len(v.type.tensor_type.shape.dim) == 4}
    attention = [(heads.get(node.input[0]), heads.get(node.input[1])) for node in graph.node if node.op_type == "Attention"]
    if cfg.attention_softcap is None:
        assert attention == [(cfg.n_heads, cfg.kv_heads)] * cfg.n_decoder_layers
    else:  # SDPA has no softcap: the math path, its cap one Tanh per layer and the final cap one more
        assert attention == [] and sum(node.op_type == "Tanh" for node in graph.node) >= cfg.n_decoder_layers + 1


def _placed(model: onnx.ModelProto) -> dict[str, tuple[str, int, int]]:
    """{initializer: (file, offset, length)} of a graph's weights kept outside it."""
    placed = {}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in tensor.external_data}
            placed[tensor.name] = (info["location"], int(info["offset"]), int(info["length"]))
    return placed


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_an_exports_graphs_share_one_weights_file_each_tensor_once_where_onnxruntime_maps_it(tmp_path, framework):
    """Issue 58: the graphs of an export keep their weights in one file (weights.data), each tensor
    once whichever graphs hold it, at an offset onnxruntime's CPU provider maps rather than copies
    (a multiple of the page), so the sessions of an export read one copy of the weights; the CPU
    sessions are made at their first use. The cache's entry is whole only with the file, and a
    Triton repository copies it beside each graph."""
    from export import cache, onnx_model
    from export.triton import write_repository

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    directory = exported(cfg, params, framework=framework, dtype="float32")
    graphs = json.loads((directory / "manifest.json").read_text())["graphs"]
    assert json.loads((directory / "manifest.json").read_text())["external_data"] == {
        file: onnx_model.WEIGHTS_FILE for file in graphs.values()}
    placed = {file: _placed(onnx.load(str(directory / file), load_external_data=False)) for file in graphs.values()}
    spans = {span for graph in placed.values() for span in graph.values()}
    assert {location for location, _, _ in spans} == {onnx_model.WEIGHTS_FILE}
    assert all(offset % onnx_model.ALIGNMENT == 0 for _, offset, _ in spans)
    size = (directory / onnx_model.WEIGHTS_FILE).stat().st_size
    distinct = sum(length for _, _, length in spans)
    assert distinct <= size < distinct + onnx_model.ALIGNMENT * len(spans)  # each tensor once
    assert distinct >= 0.9 * 4 * sum(array.size for array in params.values())  # and every weight there
    if framework == "torch":  # forward, decoder_step and the in-place step read the same bytes
        referenced = sum(length for graph in placed.values() for _, _, length in graph.values())
        assert len(graphs) >= 3 and referenced > 2 * size
    model = OnnxTransformer(directory, device="cpu")
    assert model.sessions.made == {}
    ids = np.array([[5, 9, 3, 7], [2, 8, 4, 1]], dtype=np.int64)
    logits = model.forward(None, ids)
    assert list(model.sessions.made) == [FORWARD]
    expected = golden.forward(cfg, params, None, ids)
    assert compare(logits.astype(np.float64), expected, _tolerance(cfg, "float32", 0, ids.shape[1])).passed
    whole = tmp_path / "entry"
    shutil.copytree(directory, whole)
    (whole / onnx_model.WEIGHTS_FILE).unlink()
    assert cache._complete(directory) and not cache._complete(whole)  # exported() would write it again
    if framework == "torch":
        written = write_repository(directory, tmp_path / "triton")
        forward_model = next(path for path in written if path.name.endswith("_forward"))
        assert (forward_model / "1" / onnx_model.WEIGHTS_FILE).stat().st_size == size


def test_a_graph_too_large_for_protobuf_is_checked_from_its_files(tmp_path, monkeypatch):
    """Issue 38: above protobuf's 2 GB (the threshold lowered here) a graph cannot be checked in
    memory: save checks it from its files, in the export's shared weights file or, for a graph
    saved alone (a planted copy), in `<graph>.onnx.data` beside it; onnxruntime serves both."""
    from export import onnx_model

    monkeypatch.setattr(onnx_model, "EXTERNAL_DATA_ABOVE", 1000)
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg, seed=0)
    source = exported(cfg, params, framework="torch", dtype="float32")
    checked = []
    monkeypatch.setattr(onnx.checker, "check_model", lambda model, **options: checked.append(model))
    ids = np.array([[5, 9, 3, 7]], dtype=np.int64)
    expected = golden.forward(cfg, params, None, ids)
    for folder, weights in (("shared", True), ("alone", False)):
        directory = tmp_path / folder
        path = onnx_model.save(onnx.load(str(source / "forward.onnx")), directory / "forward.onnx",
                               onnx_model.SharedWeights(directory) if weights else None)
        assert checked[-1] == str(directory / "forward.onnx.tmp")  # from the file, before its rename
        kept_in = onnx_model.WEIGHTS_FILE if weights else "forward.onnx.data"
        assert {location for location, _, _ in _placed(onnx.load(str(path), load_external_data=False)).values()} == {kept_in}
        session = ort.InferenceSession(str(path), providers=[CPU])
        logits = session.run(None, {"tgt_ids": ids, "tgt_keep": np.ones_like(ids, dtype=bool)})[0]
        assert compare(logits.astype(np.float64), expected, _tolerance(cfg, "float32", 0, ids.shape[1])).passed
