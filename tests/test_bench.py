"""rosetta bench: the CTranslate2 peer is the same model as the golden before it is timed, the
FLOP count is the documented formula, and a tiny run produces every report (no timing asserted:
performance belongs in benchmarks, never in tests)."""

import importlib.util
import json

import numpy as np
import pytest

import impl_numpy as golden
from benchmarks.limits import decode_step_flops, forward_flops
from spec import get_preset, init_params
from tests.bounds import assert_agrees, model_bounds

TINY = get_preset("tiny")


def _log_softmax(x):
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(norm_position="pre", final_norm=True, activation="gelu",
                                                    share_src_tgt_embed=True, src_vocab_size=80, tie_head=False,
                                                    head_bias=True, qkv_bias=False)],
                         ids=["tiny", "tiny-pre_gelu_shared_untied"])
def test_ctranslate2_scores_equal_the_golden(tmp_path, cfg):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from benchmarks.ctranslate2_peer import convert, greedy

    params = init_params(cfg, seed=2)
    translator = ctranslate2.Translator(str(convert(cfg, params, tmp_path / "ct2")), device="cpu",
                                        compute_type="float32")
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(3, 80, (3, 7)), rng.integers(3, 80, (3, 5))
    scored = translator.score_batch([[str(t) for t in row] for row in src], [[str(t) for t in row] for row in tgt])
    got = np.array([result.log_probs for result in scored])  # log p(t_1..t_5, eos)
    tgt_in = np.concatenate([np.ones((3, 1), np.int64), tgt], axis=1)  # bos first
    log_probs = _log_softmax(golden.forward(cfg, params, src, tgt_in))
    targets = np.concatenate([tgt, np.full((3, 1), 2)], axis=1)
    want = np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    # float32 against the golden: the whole forward over 7 source and 6 target positions, then the
    # log-softmax over V (the log_probs case's depth 2 on top; V = 80 is below d_ff)
    bounds = model_bounds(cfg, tgt_in.shape[1], src.shape[1])
    assert_agrees(got, want, dtype="float32", n=max(bounds["n"], cfg.tgt_vocab_size), depth=bounds["depth"] + 2,
                  angle=bounds["angle"], what="CTranslate2's log-probabilities")
    tokens = greedy(translator, cfg, src, 8)
    np.testing.assert_array_equal(tokens, golden.greedy_generate(cfg, params, src, bos_id=1, eos_id=2, max_new_tokens=8))


def test_ctranslate2_refuses_what_it_cannot_express():
    from benchmarks.ctranslate2_peer import Unsupported, convert

    cfg = get_preset("char-lm")
    with pytest.raises(Unsupported, match="decoder-only"):
        convert(cfg, init_params(cfg), "/nonexistent")
    with pytest.raises(Unsupported, match="'std' norm"):
        convert(TINY.replace(norm="std"), init_params(TINY.replace(norm="std")), "/nonexistent")


def test_flop_count_is_the_documented_formula():
    d, f, v, layers = 64, 256, 80, 2  # tiny
    batch, s, t = 3, 5, 4
    encoder = layers * s * (4 * d * d + 2 * d * s + 2 * d * f)
    decoder = layers * t * (4 * d * d + 2 * d * t + 2 * d * d + 2 * d * s + 2 * d * f) + layers * s * 2 * d * d
    assert forward_flops(TINY, batch, s, t) == 2 * batch * (encoder + decoder + t * d * v)
    step = layers * (4 * d * d + 2 * d * (9 + 1) + 2 * d * d + 2 * d * s + 2 * d * f) + d * v
    assert decode_step_flops(TINY, batch, 9, s) == 2 * batch * step
    # the rule of thumb: 2 FLOPs per weight a token passes through, plus attention's scores and values
    # (2·d·keys each per query: the encoder's and the decoder's self-attention, and the cross-attention)
    base = get_preset("paper-base")
    d, f, v = base.d_model, base.d_ff, base.tgt_vocab_size
    encoder_weights, decoder_weights = 6 * (4 * d * d + 2 * d * f), 6 * (8 * d * d + 2 * d * f) + d * v
    rule_of_thumb = 2 * 64 * (encoder_weights + decoder_weights)
    attention = 2 * 6 * 64 * (2 * d * 64 + 2 * d * 64 + 2 * d * 64)  # 6 layers, 64 queries, 64 keys each
    assert forward_flops(base, 1, 64, 64) == rule_of_thumb + attention


@pytest.mark.slow
def test_bench_tiny_writes_every_report(tmp_path, capsys):
    from rosetta.main import main

    out = tmp_path / "bench"
    assert main(["bench", "--preset", "tiny", "--out", str(out), "--matrix-backends", "numpy-float32"]) == 0
    results = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0 and "vs torch" in (out / "bench.md").read_text()
    assert results["machine"]["matmul_float32_flops"] > 0 and results["machine"]["copy_bytes_per_second"] > 0
    forward = {r["contender"] for r in results["forward"]}
    assert {"numpy-float64", "torch", "torch.compile", "jax", "onnxruntime-cpu-float32"} <= forward
    assert all(r["speedup_vs_torch"] > 0 for r in results["forward"])
    generated = {r["contender"]: r for r in results["generate"]}
    # CTranslate2 is the one outside peer: where it is not installed it is listed as not measured
    peer = {"ctranslate2"} if importlib.util.find_spec("ctranslate2") else set()
    assert {"torch", "jax", "onnxruntime-cpu-float32"} | peer <= set(generated)
    if not peer:
        assert any(s["contender"] == "ctranslate2" and "not installed" in s["reason"] for s in results["skipped"])
    assert all(r["same_tokens"] for r in generated.values()), [r["note"] for r in generated.values()]
    positions = {r["position"] for r in results["decode"] if r["contender"] == "onnxruntime-cpu-float32"}
    assert len(positions) == 4
    assert results["matrix"][0]["cells"] == results["matrix"][0]["passed"] > 0
    cold, warm, *backward = results["matrix_wall"]
    assert (cold["run"], warm["run"]) == ("cold", "warm") and cold["passed"] == warm["passed"] == 103
    assert [r["run"] for r in backward] == ["warm, --backward (its gradients' programs cold)", "warm, --backward"]
    assert all(r["passed"] == 103 + 94 + 6 and r["failed"] == 0 for r in backward)
    assert cold["failed"] == warm["failed"] == 0 and cold["seconds"] > 0 and warm["seconds"] > 0
    assert "| cold | numpy-float32 | 103 | 0 |" in (out / "bench.md").read_text()
    assert all(s["reason"] for s in results["skipped"])


# ---- the GPU side, as far as it runs without a GPU ----------------------------------------------

def _without_cuda():
    import torch

    from export.runner import cuda_available

    return not torch.cuda.is_available() and not cuda_available()


@pytest.mark.skipif(not _without_cuda(), reason="this machine has a GPU: the contenders run there (tests marked gpu)")
def test_every_gpu_contender_says_why_it_cannot_run_here():
    from benchmarks.contenders import Skip, contenders

    chosen = contenders(("cuda",))
    assert chosen[0].name == "torch-cuda-float16" and all(c.device == "cuda" for c in chosen)
    for contender in chosen:
        with pytest.raises(Skip, match="no CUDA|JAX sees no gpu|no CUDA provider"):
            contender.prepare(TINY, init_params(TINY))


def test_gpu_workloads_and_the_limit_a_contender_is_measured_against():
    from benchmarks.contenders import JaxJit, TorchEager
    from benchmarks.run import PLANS, matmul_limit, plan_for

    gpu = plan_for("paper-base", ("cuda",))
    assert (64 in gpu.batches, 128 in gpu.lengths, gpu.generate_batch, gpu.new_tokens) == (True, True, 64, 64)
    assert plan_for("paper-base", ("cpu", "cuda")) == PLANS["paper-base"] == plan_for("paper-base", ("cpu",))
    machine = {"matmul_float32_flops": 1e11, "cuda_matmul_flops": {"float16": 7e14, "bfloat16": 7e14, "float32": None}}
    assert matmul_limit(machine, TorchEager("float16", "cuda")) == 7e14
    assert matmul_limit(machine, JaxJit("float32", "cuda")) is None  # not measured: no fraction, not a wrong one
    assert matmul_limit(machine, TorchEager()) == 1e11


def test_a_device_contender_is_timed_to_completion_and_its_copy_to_host_apart():
    """The GPU code path of the forward workload, run on the CPU by a contender that says it is on
    a GPU: every timed call ends in finish(), and the copy to the host is a figure of its own."""
    from benchmarks.contenders import TorchEager
    from benchmarks.run import Plan, Results, _forward, markdown

    class PretendGpu(TorchEager):
        finished = 0

        def finish(self, output):
            self.finished += 1
            return output

    contender = PretendGpu("float16", "cpu")
    contender.prepare(TINY, init_params(TINY))
    contender.device, contender.name = "cuda", "torch-cuda-float16"
    plan = Plan(batches=(2,), lengths=(5,), generate_batch=2, generate_source=5, new_tokens=2, positions=(3,),
                warmup=1, repeats=3)
    machine = {"cpu": "x", "cores": 2, "matmul_float32_flops": 1e11, "copy_bytes_per_second": 1e10,
               "cuda_matmul_flops": {"float16": 1e12}, "cuda_device": None}
    results = Results("tiny", TINY.to_dict(), machine, {})
    _forward(results, contender, TINY, plan, np.random.default_rng(0), 1e12)
    row, = results.forward
    assert contender.finished == plan.warmup + plan.repeats + 1  # the +1 is the output copied to the host
    assert row["host_copy_median"] > 0 and row["fraction_of_matmul_limit"] == pytest.approx(
        row["flops_per_second"] / 1e12)
    assert "copy to host ms" in markdown(results)


def _row(contender, median, **extra):
    return {"contender": contender, "median": median, **extra}


def test_the_gpu_targets_are_read_from_the_rows_a_run_measured():
    from benchmarks.run import Results, gpu_targets

    results = Results("paper-base", {}, {}, {})
    forward = dict(batch=64, length=128)
    results.forward = [_row("onnxruntime-cuda-float16", 0.003, fraction_of_matmul_limit=0.50, **forward),
                       _row("torch.compile-cuda-float16", 0.004, fraction_of_matmul_limit=0.4, **forward),
                       _row("torch.compile-reduce-overhead-cuda-float16", 0.0035, fraction_of_matmul_limit=0.4,
                            **forward),
                       _row("torch-cuda-float16", 0.008, fraction_of_matmul_limit=0.2, **forward)]
    results.generate = [_row("onnxruntime-cuda-float16", 1, same_tokens=True, tokens_per_second=31_000, batch=64),
                        _row("onnxruntime-cuda-graph-float16", 1, same_tokens=True, tokens_per_second=29_000, batch=64),
                        _row("torch-cuda-float16", 1, same_tokens=True, tokens_per_second=9_000, batch=64),
                        _row("jax-cuda-float16", 1, same_tokens=False, tokens_per_second=20_000, batch=64)]
    results.decode = [_row("torch-cuda-float16", 0.010, position=64), _row("torch-cuda-float16", 0.014, position=512),
                      _row("jax-cuda-float16", 0.010, position=64), _row("jax-cuda-float16", 0.020, position=512),
                      _row("torch", 0.010, position=64), _row("torch", 0.030, position=512)]
    found = {t["target"]: (t["measured"], t["met"]) for t in gpu_targets(results)}
    best = "GPU forward b64 x 128/128 float16: onnxruntime >= 1.0x the best torch.compile " \
           "(torch.compile-reduce-overhead-cuda-float16)"
    assert found[best] == ("1.17x", True)
    assert found["GPU forward b64 x 128/128 float16: onnxruntime-cuda-float16 >= 45% of the measured float16 "
                 "matmul peak"] == ("50%", True)
    assert found["GPU forward b64 x 128/128 float16: torch-cuda-float16 >= 25% of the measured float16 "
                 "matmul peak"] == ("20%", False)
    generation = {key.split(": ")[1].split(" >=")[0]: found[key] for key in found if key.startswith("GPU greedy")}
    assert generation == {"onnxruntime-cuda-float16": ("31,000 tokens/s", True),
                          "onnxruntime-cuda-graph-float16": ("29,000 tokens/s", False),
                          "torch-cuda-float16": ("9,000 tokens/s", False), "jax-cuda-float16": ("tokens differ", False)}
    steps = {key: value for key, value in found.items() if "cached step" in key}
    assert steps == {"GPU torch-cuda-float16: cached step at 512 <= 1.5x the step at 64 (batch 1)": ("1.40x", True),
                     "GPU jax-cuda-float16: cached step at 512 <= 1.5x the step at 64 (batch 1)": ("2.00x", False)}
    assert gpu_targets(Results("paper-base", {}, {}, {})) == []  # nothing measured, nothing claimed


def test_the_cpu_targets_of_a_run_without_torch_eager():
    """`rosetta bench --contenders onnxruntime-cpu-float32` has no torch row to compare with: the
    ratio target is left out rather than the run failing; the others are still read."""
    from benchmarks.run import Results, targets

    results = Results("paper-base", {}, {}, {})
    results.forward = [_row("onnxruntime-cpu-float32", 0.5, batch=8, length=64, speedup_vs_torch=None,
                            fraction_of_matmul_limit=0.8)]
    found = {t["target"]: (t["measured"], t["met"]) for t in targets(results)}
    assert found == {"CPU forward, batch 8, 64/64: onnxruntime >= 75% of the matmul limit": ("80%", True)}


# ---- the modern decoder's CPU bench (llama-small) -----------------------------------------------------------

@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_ctranslate2_decoder_tokens_equal_the_golden(tmp_path, preset):
    """The Llama/Qwen2 mapping into CTranslate2's decoder spec (fused q/k/v with GQA or MQA,
    rotate_half rotary, SwiGLU, RMSNorm, q/k/v biases for Qwen2): greedy tokens, prompts forwarded
    at once, equal to the golden's, eos kept and pad_id after it."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from benchmarks.ctranslate2_peer import convert_decoder, greedy_decoder

    cfg = get_preset(preset)
    params = init_params(cfg, seed=0)
    generator = ctranslate2.Generator(str(convert_decoder(cfg, params, tmp_path / "ct2")), device="cpu",
                                      compute_type="float32")
    prompt = np.random.default_rng(0).integers(3, cfg.tgt_vocab_size, (4, 16))
    want = golden.greedy_generate(cfg, params, None, prompt_ids=prompt, eos_id=2, max_new_tokens=16)
    np.testing.assert_array_equal(greedy_decoder(generator, cfg, prompt, 16, 2), want)
    ended = golden.greedy_generate(cfg, params, None, prompt_ids=prompt, eos_id=int(want[0, 3]), max_new_tokens=16)
    np.testing.assert_array_equal(greedy_decoder(generator, cfg, prompt, 16, int(want[0, 3])), ended)


def test_ctranslate2_decoder_refusals_name_the_field():
    from benchmarks.ctranslate2_peer import Unsupported, convert_decoder

    with pytest.raises(Unsupported, match="q/k norms"):
        convert_decoder(get_preset("qwen3-tiny"), {}, "/nonexistent")
    with pytest.raises(Unsupported, match="norm = 'layernorm'"):
        convert_decoder(get_preset("char-lm"), {}, "/nonexistent")
    # what convert_decoder does not write: its rotary is the plain one over every dimension, no window
    with pytest.raises(Unsupported, match="a sliding window \\(4 keys\\)"):
        convert_decoder(get_preset("mistral-tiny"), {}, "/nonexistent")
    with pytest.raises(Unsupported, match="llama3 rope scaling"):
        convert_decoder(get_preset("llama3-tiny"), {}, "/nonexistent")
    with pytest.raises(Unsupported, match="a partial rotary \\(rope_fraction 0.5\\)"):
        convert_decoder(get_preset("llama-tiny").replace(rope_fraction=0.5), {}, "/nonexistent")


def test_flop_count_of_the_modern_decoder():
    """Grouped-query attention's narrower K and V, a head_dim apart from d / heads, and the gated
    FFN's third matrix are counted: a step at position 0 costs 2 FLOPs per weight, the tied
    table once more as the head (norms aside)."""
    from spec import count_params

    small = get_preset("llama-small")
    d, f, v, kv, layers = 576, 1536, 49152, 192, 10
    step = layers * (2 * d * d + 2 * d * kv + 2 * d * (300 + 1) + 3 * d * f) + d * v
    assert decode_step_flops(small, 2, 300, 0) == 2 * 2 * step
    norms = d * (2 * layers + 1)
    assert decode_step_flops(small, 1, 0, 0) - 2 * 2 * layers * d == 2 * (count_params(small) - norms)
    qwen3 = get_preset("qwen3-tiny")  # 4 heads of 12 (a = 48) in d 36, 2 key/value heads (g = 24)
    a, g, layers = 48, 24, 2
    per_token = 2 * 36 * a + 2 * 36 * g + 2 * a * 5 + 3 * 36 * 60
    assert forward_flops(qwen3, 1, 0, 5) == 2 * (layers * 5 * per_token + 5 * 36 * 89)


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
model name\t: {model}
flags\t\t: fpu sse sse2 {flags}
"""


@pytest.mark.parametrize("model, flags, isa", [
    ("AMD EPYC 7B13", "avx avx2 fma", ["AVX2"]),
    ("Intel(R) Xeon(R) Platinum 8480+", "avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile",
     ["AVX2", "AVX-512", "AVX-512 BF16", "AVX-512 VNNI", "AMX"]),
    ("QEMU Virtual CPU", "", []),
])
def test_the_bench_names_the_cpu_and_its_vector_extensions(model, flags, isa):
    from benchmarks.run import cpu_model_and_vector_isa

    text = CPUINFO.format(vendor="x", model=model, flags=flags)
    assert cpu_model_and_vector_isa(text) == (model, isa)
    assert cpu_model_and_vector_isa("") == (None, [])


def test_the_llama_small_targets_compare_onnxruntime_with_both_peers():
    from benchmarks.run import Results, targets

    results = Results("llama-small", {}, {}, {})
    results.generate = [_row("onnxruntime-cpu-float32", 1, same_tokens=True, tokens_per_second=300),
                        _row("ctranslate2", 1, same_tokens=True, tokens_per_second=250),
                        _row("onnxruntime-genai", 1, same_tokens=True, tokens_per_second=400)]
    found = {t["target"]: (t["measured"], t["met"]) for t in targets(results)}
    assert found == {
        "CPU generation (llama-small), batch 8, 64 tokens: onnxruntime >= 1.0x ctranslate2": ("1.20x", True),
        "CPU generation (llama-small), batch 8, 64 tokens: onnxruntime >= 0.8x onnxruntime-genai": ("0.75x", False)}
    results.generate[2]["same_tokens"] = False  # a peer with other tokens is not timed against
    assert len(targets(results)) == 1


def test_ctranslate2_refuses_a_hybrid_before_converting():
    pytest.importorskip("ctranslate2")
    from benchmarks.contenders import CTranslate2, Skip

    cfg = get_preset("qwen35-tiny")
    from benchmarks.ctranslate2_peer import unsupported_reason

    assert unsupported_reason(cfg) == "a hybrid's gated DeltaNet layers (family qwen3_5_text) have no CTranslate2 layer"
    with pytest.raises(Skip, match="qwen3_5_text: CTranslate2's converter and the spec share"):  # nor its own converter
        CTranslate2().prepare(cfg, init_params(cfg, seed=0))


def test_the_hybrid_targets_hold_every_contenders_step_flat_in_position():
    """qwen35-small's (issue 59): onnxruntime's tokens/s at twice torch eager's, and each contender's
    step at the last position within 1.3x its step at the first; the generic 2x rows stay beside them."""
    from benchmarks.run import Results, targets

    results = Results("qwen35-small", {}, {}, {})
    results.generate = [_row("onnxruntime-cpu-float32", 1, same_tokens=True, tokens_per_second=500, batch=8,
                             new_tokens=64),
                        _row("torch", 1, same_tokens=True, tokens_per_second=200, batch=8, new_tokens=64)]
    results.decode = [_row("torch", 0.010, position=64), _row("torch", 0.012, position=512),
                      _row("jax", 0.010, position=64), _row("jax", 0.014, position=512),
                      _row("torch-no-cache", 0.1, position=64), _row("torch-no-cache", 0.4, position=512)]
    found = {t["target"]: (t["measured"], t["met"]) for t in targets(results)}
    assert found["CPU generation (qwen35-small), batch 8, 64 tokens: onnxruntime >= 2.0x torch eager"] == \
        ("2.50x", True)
    assert found["torch (qwen35-small): cached step at 512 <= 1.3x the step at 64"] == ("1.20x", True)
    assert found["jax (qwen35-small): cached step at 512 <= 1.3x the step at 64"] == ("1.40x", False)
    assert found["torch: cached step at 512 <= 2x the step at 64"] == ("1.20x", True)
    assert not any(target.startswith("torch-no-cache") for target in found)  # no cache: the cost it saves
    results.generate[1]["same_tokens"] = False  # a contender with other tokens is not timed against
    assert not any("torch eager" in t["target"] for t in targets(results))


# ---- rosetta bench --checkpoint-shapes (benchmarks/checkpoints.py) -----------------------------

def test_the_checkpoint_shapes_are_the_published_ones_and_import_as_such():
    """Each shape's config, as transformers writes it, maps to the spec's config with the published
    checkpoint's sizes (Llama-3.2-1B's with its llama3 rope scaling, SPEC §5.12)."""
    transformers = pytest.importorskip("transformers")
    from benchmarks.checkpoints import CLASSES, SHAPES
    from importers.huggingface import _CONFIGS
    from spec import RopeScaling, count_params

    published = {"smollm2-135m": (134_515_008, 30, 576, None), "qwen2.5-0.5b": (494_032_768, 24, 896, None),
                 "llama-3.2-1b": (1_235_814_400, 16, 2048, RopeScaling(kind="llama3", factor=32.0, original_max_len=8192)),
                 "tinymixtral-4x248m": (701_058_048, 12, 1024, None),
                 "qwen3-30b-a3b-layer": (757_340_416, 1, 2048, None),
                 # transformers' own count of Qwen3_5ForCausalLM at this config (0.8B counts the vision tower too)
                 "qwen3.5-0.8b": (752_393_024, 24, 1024, None),
                 "qwen3-next-80b-a3b-layer": (574_005_440, 1, 2048, None),
                 # SmolLM3-3B's 36 layers cut to 4 (its embeddings and tied head whole)
                 "smollm3-3b-4-layers": (575_162_368, 4, 2048, None),
                 "qwen1.5-moe-a2.7b-layer": (704_780_288, 1, 2048, None),
                 "olmo2-7b-2-layers": (673_222_656, 2, 4096, None),
                 # 796.5M in the 32 experts, 188.7M in the cut table and head
                 "gpt-oss-20b-layer": (1_011_933_536, 1, 2880, RopeScaling(kind="yarn", factor=32.0,
                                                                          original_max_len=4096, truncate=False))}
    untied = ("olmo2-7b-2-layers",)
    experts = {"tinymixtral-4x248m": (4, 2, True), "qwen3-30b-a3b-layer": (128, 8, True),
               "gpt-oss-20b-layer": (32, 4, True),
               "qwen3-next-80b-a3b-layer": (128, 10, True), "qwen1.5-moe-a2.7b-layer": (60, 4, False)}
    for shape, (family, fields) in SHAPES.items():
        fields = dict(fields)
        theta, scaling = fields.pop("rope_theta"), fields.pop("rope_scaling", None) or {"rope_type": "default"}
        hf = getattr(transformers, CLASSES[family][0])(**fields, rope_parameters={**scaling, "rope_theta": theta})
        hf = {**hf.to_dict(), "model_type": family}
        cfg = _CONFIGS[family](hf, [])
        assert (count_params(cfg), cfg.n_decoder_layers, cfg.d_model, cfg.rope_scaling) == published[shape]
        assert cfg.rope_theta == theta and cfg.tie_head == (shape not in experts and shape not in untied)
        moe = cfg.moe and (cfg.moe.n_experts, cfg.moe.experts_per_token, cfg.moe.renormalize)
        assert moe == experts.get(shape)


def test_measure_sees_a_child_process_memory_and_stops_at_the_limit():
    import sys

    from benchmarks.checkpoints import measure

    grows = [sys.executable, "-c", "import numpy, time; a = numpy.ones(2**26); time.sleep(1.0); print('done')"]
    result = measure("test", "allocates", grows, limit=60, every=0.05)
    # at least the array's own 2^26 float64s, 2^29 bytes (each page written by ones, held for the 1 s
    # the sampler reads every 0.05 s): 0.54 in the decimal GB peak_pss_gb counts, the interpreter's pages on top
    assert result.exit_code == 0 and result.tail == ["done"] and result.peak_pss_gb >= 2 ** 29 / 1e9
    sleeps = measure("test", "sleeps", [sys.executable, "-c", "import time; time.sleep(60)"], limit=1.0)
    # stopped at its limit: it ran at least the limit and ended before its own 60 s did (not a speed: a deadline)
    assert sleeps.exit_code is None and 1.0 <= sleeps.seconds < 60


def test_the_checkpoint_page_puts_each_run_beside_its_target():
    from benchmarks.checkpoints import Measured, markdown

    page = markdown([Measured("qwen2.5-0.5b", "one-cell", ["x"], 25.0, 8.2, 0),
                     Measured("smollm2-135m", "default", ["x"], 900.0, 3.0, None, ["last words"]),
                     Measured("smollm2-135m", "import", ["x"], 5.0, 1.0, 0)],
                    {"processor": "x86_64", "python": "3.11"}, "2026-11-26")
    assert "| qwen2.5-0.5b | one-cell | 25.0 | 8.20 | 0 | ≤ 20 s | 1.25 | - |" in page
    assert "| smollm2-135m | default | 900.0 | 3.00 | stopped at the limit | ≤ 600 s, ≤ 6 GB | 1.50 (at least) | 0.50 |" in page
    assert "| smollm2-135m | import | 5.0 | 1.00 | 0 | - | - | - |" in page
    assert "last words" in page


def test_quantized_contenders_are_judged_on_the_weights_they_store(tmp_path):
    """`rosetta bench --quantized`: onnxruntime's int4 export is timed when its tokens are the
    golden's on the weights it stores (tiny, encoder and decoder quantized), with where they part
    from the float golden's; the dynamic int8 export's tokens no golden computes, and it says so, as
    CTranslate2's int8 (its weights and activations int8) does.
    No timing is asserted."""
    import json

    from rosetta.main import main

    out = tmp_path / "bench"
    peers = ",ctranslate2-int8" if importlib.util.find_spec("ctranslate2") else ""
    assert main(["bench", "--preset", "tiny", "--contenders", "onnxruntime-int4-b32-sym,onnxruntime-dynamic-int8" + peers,
                 "--quantized", "int4,dynamic-int8", "--matrix-backends", "none", "--out", str(out)]) == 0
    rows = {row["contender"]: row for row in json.loads((out / "bench.json").read_text())["generate"]}
    int4, dynamic = rows["onnxruntime-int4-b32-sym"], rows["onnxruntime-dynamic-int8"]
    assert int4["same_tokens"] and int4["note"].startswith("equal to the golden's (on the weights it stores)")
    int8_activations = [dynamic] + ([rows["ctranslate2-int8"]] if peers else [])  # CTranslate2's int8 quantizes both
    for row in int8_activations:
        assert row["same_tokens"] and row["note"].startswith("int8 activations: no golden computes its tokens")
    for row in (int4, *int8_activations):
        assert set(row["float_golden"]) == {"rows", "rows_parted", "first_parted"} and row["tokens_per_second"] > 0
        assert row["roofline_tokens_per_second"] > 0 and row["fraction_of_roofline"] > 0
    assert main(["bench", "--preset", "tiny", "--quantized", "int3", "--out", str(out)]) == 2


def test_the_bytes_a_decode_step_reads_and_its_roofline():
    """llama-tiny (untied, no biases): float32 reads every parameter but the embedding table; int4
    in blocks of 32 reads each linear weight at half a byte plus a float32 scale per column and block,
    with zero points a code more per block; the 8-bit head likewise. The roofline: each step the
    slower of the weights at the copy bandwidth and its FLOPs at the matmul limit."""
    from benchmarks.limits import generation_roofline, streamed_bytes
    from spec.params import param_shapes
    from spec.quantization import QuantizationScheme

    cfg = get_preset("llama-tiny")
    shapes = param_shapes(cfg)
    sizes = {name: int(np.prod(shape)) for name, shape in shapes.items()}
    assert streamed_bytes(cfg) == 4 * (sum(sizes.values()) - sizes["tgt_embed.weight"])
    assert streamed_bytes(cfg, "bfloat16") == streamed_bytes(cfg) / 2
    linear = {name: shape for name, shape in shapes.items() if len(shape) == 2
              and name not in ("tgt_embed.weight", "head.weight")}
    vectors = sum(size for name, size in sizes.items() if len(shapes[name]) == 1)

    def quantized(shape, bits, zero_points=False):
        blocks = -(-shape[0] // 32)
        return shape[0] * shape[1] * bits / 8 + 4 * shape[1] * blocks + (shape[1] * blocks * bits / 8 if zero_points
                                                                         else 0)
    int4 = sum(quantized(shape, 4) for shape in linear.values())
    assert streamed_bytes(cfg, scheme=QuantizationScheme(4, 32, True)) == 4 * (vectors + sizes["head.weight"]) + int4
    assert streamed_bytes(cfg, scheme=QuantizationScheme(4, 32, False, head_bits=8)) == 4 * vectors + sum(
        quantized(shape, 4, True) for shape in linear.values()) + quantized(shapes["head.weight"], 8, True)
    tied = get_preset("qwen2-tiny")  # a tied head reads its table whole, as the head
    assert streamed_bytes(tied) == 4 * sum(np.prod(shape) for shape in param_shapes(tied).values())

    # memory-bound: each of the 64 steps reads 2e3 bytes at 1e3 bytes/s, 2 s exactly (its FLOPs at 1e30 are
    # less): 128 s, every figure exact in binary
    memory_bound = {"copy_bytes_per_second": 1e3, "matmul_float32_flops": 1e30}
    assert generation_roofline(cfg, 8, 16, 64, 2e3, memory_bound) == 8 * 64 / (64 * 2.0)
    compute_bound = {"copy_bytes_per_second": 1e30, "matmul_float32_flops": 1e9}
    seconds = (forward_flops(cfg, 8, 0, 16) + sum(decode_step_flops(cfg, 8, 16 + step - 1, 0)
                                                  for step in range(1, 64))) / 1e9
    # compute-bound: the same FLOPs (integers, exact) divided step by step and summed there, summed then
    # divided here: float64 rounding of a sum of n = 64 terms
    assert_agrees(generation_roofline(cfg, 8, 16, 64, 2e3, compute_bound), 8 * 64 / seconds, n=64)


def test_the_quantized_generation_targets():
    """llama-small's: float32 onnxruntime at 70% of its roofline, each int4 export at 1.5x it, with
    where its tokens part from the float golden's; an int4 export with other tokens misses."""
    from benchmarks.run import Results, targets

    results = Results("llama-small", {}, {}, {})
    common = dict(batch=8, new_tokens=64, same_tokens=True)
    results.generate = [
        _row("onnxruntime-cpu-float32", 1, tokens_per_second=300, fraction_of_roofline=0.55, **common),
        _row("onnxruntime-int4-b32-sym", 1, tokens_per_second=600, float_golden={"first_parted": 3}, **common),
        _row("onnxruntime-int8-b128-sym", 1, tokens_per_second=400, float_golden={"first_parted": None}, **common)]
    found = {t["target"]: (t["measured"], t["met"]) for t in targets(results)}
    assert found == {
        "CPU generation (llama-small), batch 8, 64 tokens: onnxruntime float32 >= 70% of its roofline": ("55%", False),
        "CPU generation (llama-small), batch 8, 64 tokens: onnxruntime-int4-b32-sym >= 1.5x onnxruntime float32 "
        "(its tokens part from the float golden's at step 3)": ("2.00x", True)}
