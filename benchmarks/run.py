"""`rosetta bench`: the workloads, timed for every contender from the same shared weights.

    forward     teacher-forced logits over a grid of batch × length (source = target length)
    generate    greedy generation of N tokens with the KV cache: tokens/s, after checking the
                tokens equal the golden's (near-ties allowed only for float16, SPEC.md §8)
    decode      one cached decode step at growing positions (small batch), beside the
                no-cache step (the whole prefix again)
    matrix      the conformance matrix's own wall time on the tiny preset, per backend

Method: warm-up runs (compilation and caches happen there), then repeated runs; the median and
the 25th-75th percentile spread are reported. The machine's limits (matrix-product FLOP/s,
copy bandwidth) are measured in the same run, and every figure is also a fraction of them.
Ratios to torch eager in the same run are the headline.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import impl_numpy as golden
from benchmarks.contenders import BOS_ID, EOS_ID, Contender, Skip, contenders
from benchmarks.limits import (cuda_matmul_flops_per_second, decode_step_flops, forward_flops,
                               generation_roofline, matmul_flops_per_second, memory_bytes_per_second, streamed_bytes)
from spec import ModelConfig, conformance_params, get_preset


@dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    generate_batch: int
    generate_source: int
    new_tokens: int
    positions: tuple[int, ...]
    warmup: int
    repeats: int


PLANS = {
    "tiny": Plan(batches=(1, 8), lengths=(16, 48), generate_batch=8, generate_source=16, new_tokens=16,
                 positions=(8, 16, 32, 60), warmup=1, repeats=5),
    "paper-base": Plan(batches=(1, 8), lengths=(16, 64), generate_batch=8, generate_source=64, new_tokens=64,
                       positions=(64, 128, 256, 512), warmup=1, repeats=3),
    # issue 24's CPU generation: b8 x 64 new tokens from a 16-token prompt
    "llama-small": Plan(batches=(1, 8), lengths=(16, 64), generate_batch=8, generate_source=16, new_tokens=64,
                        positions=(64, 128, 256, 512), warmup=1, repeats=3),
}
PLANS["gemma2-small"] = PLANS["llama-small"]  # the same workloads: its 80 positions cross the window of 32
PLANS["qwen35-small"] = PLANS["llama-small"]  # issue 59's: greedy b8 x 64 from 16-token prompts, steps to 512
DEFAULT_PLAN = PLANS["tiny"]
# On a GPU the workloads of issue 14: forward at batch 64 × 128/128, generation at batch 64,
# and more warm-up runs (CUDA graphs are recorded in the first calls of reduce-overhead mode)
GPU_PLANS = {
    "tiny": Plan(batches=(1, 64), lengths=(16, 48), generate_batch=64, generate_source=16, new_tokens=16,
                 positions=(8, 16, 32, 60), warmup=3, repeats=10),
    "paper-base": Plan(batches=(1, 64), lengths=(16, 128), generate_batch=64, generate_source=64, new_tokens=64,
                       positions=(64, 128, 256, 512), warmup=3, repeats=10),
}


def plan_for(preset: str, devices: tuple[str, ...]) -> Plan:
    """The GPU workloads when only a GPU is benchmarked, else the CPU's (whose batch-64 runs
    would take the CPU contenders far too long)."""
    plans = GPU_PLANS if "cpu" not in devices else PLANS
    return plans.get(preset, plans["tiny"] if plans is GPU_PLANS else DEFAULT_PLAN)


@dataclass
class Timing:
    median: float
    p25: float
    p75: float
    runs: int

    @classmethod
    def of(cls, function: Callable[[], object], warmup: int, repeats: int) -> "Timing":
        for _ in range(warmup):
            function()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            function()
            seconds.append(time.perf_counter() - start)
        quartiles = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else [seconds[0]] * 3
        return cls(statistics.median(seconds), quartiles[0], quartiles[2], len(seconds))


@dataclass
class Results:
    preset: str
    config: dict
    machine: dict
    versions: dict
    forward: list[dict] = field(default_factory=list)
    generate: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    matrix: list[dict] = field(default_factory=list)
    matrix_wall: list[dict] = field(default_factory=list)  # the whole matrix through `rosetta check`, cold and warm
    skipped: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)


def _ids(rng: np.random.Generator, cfg: ModelConfig, batch: int, length: int, vocab: int) -> np.ndarray:
    """Real tokens only (never pad, bos or eos), so every contender sees unpadded rows."""
    return rng.integers(3, vocab, (batch, length)).astype(np.int64)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("numpy", "torch", "jax", "flax", "onnx", "onnxruntime-gpu", "jax2onnx", "ctranslate2",
                    "onnxruntime-genai-cuda"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


VECTOR_EXTENSIONS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16", "avx512_vnni": "AVX-512 VNNI",
                     "amx_tile": "AMX"}


def cpu_model_and_vector_isa(cpuinfo: str) -> tuple[str | None, list[str]]:
    """The CPU's model name and its vector extensions that matter to matrix products (AVX2,
    AVX-512 and its bf16/VNNI forms, AMX), from /proc/cpuinfo's text: a ratio holds on a machine
    class, so every figure is stated beside them."""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, flags=re.MULTILINE)
    present = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else None), [name for flag, name in VECTOR_EXTENSIONS.items()
                                                            if flag in present]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the model and ISA are then unknown, and said so
        return ""


def _machine(quick: bool, devices: tuple[str, ...] = ("cpu",)) -> dict:
    limits = matmul_flops_per_second("float32", size=1024 if quick else 2048)
    model, vector_isa = cpu_model_and_vector_isa(_cpuinfo())
    machine = {"cpu": platform.processor() or platform.machine(), "cpu_model": model, "vector_isa": vector_isa,
               "cores": os.cpu_count(),
               "matmul_float32_flops": max(limits.values()), "matmul_float32_by": limits,
               "copy_bytes_per_second": memory_bytes_per_second(64 if quick else 256)}
    if "cuda" in devices:
        # the GPU's GEMM limit per dtype (8192³ matrices in torch), None without a GPU
        machine["cuda_matmul_flops"] = {dtype: cuda_matmul_flops_per_second(dtype, size=2048 if quick else 8192)
                                        for dtype in ("float16", "bfloat16", "float32")}
        machine["cuda_device"] = _cuda_device_name()
    return machine


def _cuda_device_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def matmul_limit(machine: dict, contender: Contender) -> float | None:
    """The limit a contender's FLOP/s are a fraction of: the GPU's for its dtype on a GPU, the
    CPU's float32 limit on the CPU (None where it was not measured)."""
    if contender.device == "cuda":
        return (machine.get("cuda_matmul_flops") or {}).get(contender.dtype)
    return machine["matmul_float32_flops"]


def _fraction(flops_per_second: float, limit: float | None) -> float | None:
    return flops_per_second / limit if limit else None


def run_bench(preset: str = "tiny", *, plan: Plan | None = None, names: tuple[str, ...] | None = None,
              devices: tuple[str, ...] = ("cpu",), matrix_backends: tuple[str, ...] = ("numpy-float32", "torch", "onnx"),
              log: Callable[[str], None] = print, after_each: Callable[[Results], None] | None = None,
              quantized: tuple = ()) -> Results:
    """names: the contenders, run in that order (default every one of the devices'). after_each:
    called with the results so far after each contender (a run stopped midway keeps them).
    quantized: the weight-only schemes whose onnxruntime exports join the CPU's contenders."""
    cfg = get_preset(preset)
    plan = plan or plan_for(preset, devices)
    params = conformance_params(cfg, seed=0)  # the weights `rosetta check --preset` runs on, and their exports
    rng = np.random.default_rng(0)
    log("measuring the machine's limits ...")
    results = Results(preset, cfg.to_dict(), _machine(quick=preset == "tiny", devices=devices), _versions())
    chosen = [c for c in contenders(devices, quantized) if names is None or c.name in names]
    if names is not None:
        chosen.sort(key=lambda contender: names.index(contender.name))
    src_vocab = cfg.src_vocab_size if cfg.has_encoder else cfg.tgt_vocab_size
    generate_src = _ids(rng, cfg, plan.generate_batch, plan.generate_source, src_vocab)
    want_tokens, step_logits = golden.greedy_generate(
        cfg, params, **({"src_ids": generate_src, "bos_id": BOS_ID} if cfg.has_encoder else {"prompt_ids": generate_src}),
        eos_id=EOS_ID, max_new_tokens=plan.new_tokens, return_step_logits=True)
    for contender in chosen:
        start = time.perf_counter()
        try:
            contender.prepare(cfg, params)
        except Skip as reason:
            results.skipped.append({"contender": contender.name, "workload": "all", "reason": str(reason)})
            log(f"  {contender.name:24} skipped: {reason}")
            continue
        log(f"  {contender.name:24} prepared in {time.perf_counter() - start:.1f} s")
        limit = matmul_limit(results.machine, contender)
        _forward(results, contender, cfg, plan, rng, limit)
        _generate(results, contender, cfg, plan, generate_src, want_tokens, step_logits)
        _decode(results, contender, cfg, plan, rng, limit)
        if after_each is not None:
            _ratios(results)
            results.targets = targets(results)
            after_each(results)
    _ratios(results)
    if matrix_backends:
        _matrix(results, matrix_backends, log)
    results.targets = targets(results)
    return results


def _skip(results: Results, contender: Contender, workload: str, reason: Skip) -> None:
    results.skipped.append({"contender": contender.name, "workload": workload, "reason": str(reason)})


def _forward(results, contender, cfg, plan, rng, limit) -> None:
    for batch in plan.batches:
        for length in plan.lengths:
            src = _ids(rng, cfg, batch, length, cfg.src_vocab_size) if cfg.has_encoder else None
            tgt = _ids(rng, cfg, batch, length, cfg.tgt_vocab_size)
            try:
                timing = Timing.of(lambda: contender.forward(src, tgt), plan.warmup, plan.repeats)
            except Skip as reason:
                return _skip(results, contender, "forward", reason)
            flops = forward_flops(cfg, batch, length if cfg.has_encoder else 0, length)
            tokens = batch * length * (2 if cfg.has_encoder else 1)
            row = {"contender": contender.name, "batch": batch, "length": length, **vars(timing),
                   "tokens_per_second": tokens / timing.median, "flops_per_second": flops / timing.median,
                   "fraction_of_matmul_limit": _fraction(flops / timing.median, limit)}
            if contender.device != "cpu":
                # taken after the timed runs: a CUDA graph's output is overwritten by the next run
                logits = contender.forward(src, tgt)
                row["host_copy_median"] = Timing.of(lambda: contender.to_host(logits), 1, plan.repeats).median
            results.forward.append(row)


def _generate(results, contender, cfg, plan, src, want_tokens, step_logits) -> None:
    from conformance.cases import SUBLAYERS
    from conformance.tolerance import compare_generation, tolerance

    try:
        tokens = contender.generate(src, plan.new_tokens)
    except Skip as reason:
        return _skip(results, contender, "generate", reason)
    quantized = {}
    if hasattr(contender, "judged_on"):  # a quantized export: judged on the weights it stores
        from conformance.deployment.quantized import generation_cost

        quantized = {"float_golden": vars(generation_cost(tokens, want_tokens))}
        if contender.judged_on is not None:
            want_tokens, step_logits = golden.greedy_generate(
                *contender.judged_on, **contender._generation_arguments(src), eos_id=EOS_ID,
                max_new_tokens=plan.new_tokens, return_step_logits=True)
    if hasattr(contender, "judged_on") and contender.judged_on is None:
        same, note = True, "int8 activations: no golden computes its tokens"
    elif contender.dtype == "float16" or quantized:
        from conformance.deployment.quantized import compute_mode

        # a quantized export is judged as `rosetta check --quantized` judges it: at its kernel's compute mode
        # (int8-activations at accuracy_level 4), a token apart from the golden's only at a near-tie
        mode = compute_mode(contender.scheme) if quantized else "float16"
        relative = tolerance(mode, cfg.d_ff, SUBLAYERS["generate"].depth(cfg))
        check = compare_generation(tokens, want_tokens, step_logits, relative, EOS_ID)
        same, note = check.passed, check.reason or "equal to the golden's" + (
            f" (near-ties allowed at {mode})" if mode != "float32" else "")
    else:
        same = np.array_equal(tokens, want_tokens)
        note = "equal to the golden's" if same else "DIFFERENT from the golden's: not timed"
    if quantized:
        first = quantized["float_golden"]["first_parted"]
        note += (" (on the weights it stores)" if contender.judged_on is not None else "") + \
            ("; the float golden's too" if first is None else f"; parts from the float golden's at step {first}")
    if not same:
        results.generate.append({"contender": contender.name, "same_tokens": False, "note": note, **quantized})
        return
    timing = Timing.of(lambda: contender.generate(src, plan.new_tokens), plan.warmup, plan.repeats)
    produced = int((tokens != cfg.pad_id).sum()) or tokens.size
    roofline = generation_roofline(cfg, len(src), src.shape[1], plan.new_tokens, streamed_bytes(
        cfg, contender.dtype, getattr(contender, "stored_as", None)), results.machine) if contender.device == "cpu" else None
    results.generate.append({"contender": contender.name, "same_tokens": True, "note": note, "batch": len(src),
                             "new_tokens": plan.new_tokens, **vars(timing),
                             "tokens_per_second": produced / timing.median, "roofline_tokens_per_second": roofline,
                             "fraction_of_roofline": _fraction(produced / timing.median, roofline), **quantized})


def _decode(results, contender, cfg, plan, rng, limit) -> None:
    src = _ids(rng, cfg, 1, 16, cfg.src_vocab_size if cfg.has_encoder else cfg.tgt_vocab_size)
    for position in plan.positions:
        if position + 1 > cfg.max_len and cfg.positional == "learned":
            continue
        try:
            step = contender.step(src, position)
        except Skip as reason:
            return _skip(results, contender, "decode", reason)
        timing = Timing.of(step, plan.warmup + 1, max(plan.repeats, 5))
        flops = decode_step_flops(cfg, 1, position, 16 if cfg.has_encoder else 0)
        results.decode.append({"contender": contender.name, "position": position, **vars(timing),
                               "fraction_of_matmul_limit": _fraction(flops / timing.median, limit)})


REFERENCES = ("torch", "torch-cuda-float16")  # torch eager on the CPU, else on the GPU


def _ratios(results: Results) -> None:
    """Each figure relative to torch eager in the same run (> 1 is faster than torch): the CPU's
    torch eager where it ran, else the GPU's at float16."""
    ran = {r["contender"] for r in results.forward + results.generate}
    torch_name = next((name for name in REFERENCES if name in ran), None)
    reference = {(r["batch"], r["length"]): r["median"] for r in results.forward if r["contender"] == torch_name}
    for row in results.forward:
        base = reference.get((row["batch"], row["length"]))
        row["speedup_vs_torch"] = base / row["median"] if base else None
    torch_rate = next((r["tokens_per_second"] for r in results.generate
                       if r["contender"] == torch_name and r["same_tokens"]), None)
    for row in results.generate:
        if row.get("same_tokens") and torch_rate:
            row["speedup_vs_torch"] = row["tokens_per_second"] / torch_rate


def _matrix(results: Results, backends: tuple[str, ...], log) -> None:
    from conformance.harness import plan_matrix, run_matrix

    cfg = get_preset("tiny")
    params = conformance_params(cfg, seed=0)  # the weights `rosetta check --preset` runs on
    for backend in backends:
        start = time.perf_counter()
        cells = run_matrix(cfg, params, plan_matrix(cfg, [backend]))
        seconds = time.perf_counter() - start
        ran = [c for c in cells if c.status in ("pass", "fail", "error")]
        results.matrix.append({"backend": backend, "seconds": seconds, "cells": len(ran),
                               "passed": sum(c.status == "pass" for c in ran)})
        log(f"  matrix {backend:16} {len(ran)} cells in {seconds:.1f} s")
    results.matrix_wall += _matrix_cold_and_warm(backends, log)


def _matrix_cold_and_warm(backends: tuple[str, ...], log) -> list[dict]:
    """The whole matrix of these backends as a user runs it (`rosetta check` in a new process,
    its columns in worker processes), first with empty caches (JAX's compiled programs, the
    ONNX exports), then again with the caches that run left; then twice with the gradient cells
    (--backward, which JAX's eager autodiff makes too slow for the default run), the first
    compiling the gradients' programs, the second finding them on disk."""
    rows = []
    with tempfile.TemporaryDirectory() as caches:
        environment = {**os.environ, "XDG_CACHE_HOME": caches}
        for variable in ("ROSETTA_JAX_CACHE", "ROSETTA_ONNX_CACHE"):
            environment.pop(variable, None)  # both caches go under XDG_CACHE_HOME, empty at first
        runs = (("cold", []), ("warm", []), ("warm, --backward (its gradients' programs cold)", ["--backward"]),
                ("warm, --backward", ["--backward"]))
        for run, options in runs:
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "rosetta", "check", "--preset", "tiny", "--quiet",
                                   "--backends", ",".join(backends), *options], env=environment, capture_output=True,
                                  text=True)
            seconds = time.perf_counter() - start
            summary = re.search(r"^(\d+) passed, (\d+) failed, (\d+) skipped", done.stdout, flags=re.MULTILINE)
            if summary is None:
                raise RuntimeError(f"rosetta check ended without its summary (exit {done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-300:]}")
            passed, failed, skipped = map(int, summary.groups())
            rows.append({"run": run, "backends": ",".join(backends), "seconds": seconds, "passed": passed,
                         "failed": failed, "skipped": skipped})
            log(f"  matrix, {run} caches: {passed} passed, {failed} failed in {seconds:.1f} s")
    return rows


def _find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def targets(results: Results) -> list[dict]:
    """Where we stand on the issue's targets (only those this run measured)."""
    found = []
    if results.preset == "paper-base":
        onnx = _find(results.forward, contender="onnxruntime-cpu-float32", batch=8, length=64)
        if onnx and onnx["speedup_vs_torch"] is not None:  # None where torch eager was not run
            found.append({"target": "CPU forward, batch 8, 64/64: onnxruntime >= 1.0x torch eager",
                          "measured": f"{onnx['speedup_vs_torch']:.2f}x", "met": onnx["speedup_vs_torch"] >= 1.0})
        if onnx:
            found.append({"target": "CPU forward, batch 8, 64/64: onnxruntime >= 75% of the matmul limit",
                          "measured": f"{100 * onnx['fraction_of_matmul_limit']:.0f}%",
                          "met": onnx["fraction_of_matmul_limit"] >= 0.75})
        ours, peer = _find(results.generate, contender="onnxruntime-cpu-float32"), _find(results.generate,
                                                                                      contender="ctranslate2")
        if ours and peer and ours.get("same_tokens") and peer.get("same_tokens"):
            ratio = ours["tokens_per_second"] / peer["tokens_per_second"]
            found.append({"target": "CPU generation, batch 8, 64 tokens: onnxruntime >= 1.0x CTranslate2 float32",
                          "measured": f"{ratio:.2f}x", "met": ratio >= 1.0})
    if results.preset in ("llama-small", "gemma2-small"):
        ours = _find(results.generate, contender="onnxruntime-cpu-float32")
        found += _quantized_targets(results, ours)
        for peer, share in (("ctranslate2", 1.0), ("onnxruntime-genai", 0.8)):
            theirs = _find(results.generate, contender=peer)
            if ours and theirs and ours.get("same_tokens") and theirs.get("same_tokens"):
                ratio = ours["tokens_per_second"] / theirs["tokens_per_second"]
                found.append({"target": f"CPU generation ({results.preset}), batch 8, 64 tokens: onnxruntime >= "
                                        f"{share:.1f}x {peer}", "measured": f"{ratio:.2f}x", "met": ratio >= share})
    if results.preset == "qwen35-small":
        found += _hybrid_targets(results)
    found += gpu_targets(results)
    return found + _flat_steps(results, ("onnxruntime-cpu-float32", "torch"), 2.0, "{name}")


def _flat_steps(results: Results, names, bound: float, label: str) -> list[dict]:
    """Each named contender's cached step at the last position measured within `bound` times its
    step at the first (`label` names the target, from {name})."""
    positions = sorted({r["position"] for r in results.decode})
    if len(positions) < 2:
        return []
    low, high, found = positions[0], positions[-1], []
    for name in names:
        a, b = _find(results.decode, contender=name, position=low), _find(results.decode, contender=name, position=high)
        if a and b:
            ratio = b["median"] / a["median"]
            found.append({"target": f"{label.format(name=name)}: cached step at {high} <= {bound:g}x the step at {low}",
                          "measured": f"{ratio:.2f}x", "met": ratio <= bound})
    return found


def _hybrid_targets(results: Results) -> list[dict]:
    """Issue 59's, for a hybrid: onnxruntime's greedy generation at twice torch eager's tokens/s or
    more, and every contender's cached step as cheap at the last position as at the first, within
    30% (its linear layers carry a state of fixed size: only the full-attention layers read more)."""
    found = []
    ours, eager = _find(results.generate, contender="onnxruntime-cpu-float32"), _find(results.generate,
                                                                                   contender="torch")
    if ours and eager and ours.get("same_tokens") and eager.get("same_tokens"):
        ratio = ours["tokens_per_second"] / eager["tokens_per_second"]
        found.append({"target": f"CPU generation ({results.preset}), batch {ours['batch']}, {ours['new_tokens']} "
                                "tokens: onnxruntime >= 2.0x torch eager", "measured": f"{ratio:.2f}x",
                      "met": ratio >= 2.0})
    # torch-no-cache's step computes the whole prefix again: what the cache saves, not a cached step
    cached = [name for name in dict.fromkeys(r["contender"] for r in results.decode) if name != "torch-no-cache"]
    return found + _flat_steps(results, cached, 1.3, f"{{name}} ({results.preset})")


def _quantized_targets(results: Results, ours: dict | None) -> list[dict]:
    """Issue 41's: float32 onnxruntime's greedy generation at 70% of its roofline or more, and each
    int4 export's at 1.5 times float32 onnxruntime's or more, with what it cost stated."""
    found = []
    if ours and ours.get("same_tokens") and ours.get("fraction_of_roofline") is not None:
        found.append({"target": f"CPU generation ({results.preset}), batch {ours['batch']}, {ours['new_tokens']} "
                                "tokens: onnxruntime float32 >= 70% of its roofline",
                      "measured": f"{100 * ours['fraction_of_roofline']:.0f}%", "met": ours["fraction_of_roofline"] >= 0.7})
    for row in results.generate:
        if not (row["contender"].startswith("onnxruntime-int4") and ours and ours.get("same_tokens")):
            continue
        parted = row["float_golden"]["first_parted"]
        cost = "its tokens the float golden's" if parted is None else f"its tokens part from the float golden's at step {parted}"
        if not row.get("same_tokens"):
            found.append({"target": f"CPU generation ({results.preset}): {row['contender']} >= 1.5x onnxruntime float32",
                          "measured": "tokens differ from the golden's on its weights", "met": False})
            continue
        ratio = row["tokens_per_second"] / ours["tokens_per_second"]
        found.append({"target": f"CPU generation ({results.preset}), batch {row['batch']}, {row['new_tokens']} tokens: "
                                f"{row['contender']} >= 1.5x onnxruntime float32 ({cost})",
                      "measured": f"{ratio:.2f}x", "met": ratio >= 1.5})
    return found


def gpu_targets(results: Results) -> list[dict]:
    """Issue 14's GPU targets, from the rows this run measured (float16 at batch 64)."""
    found = []
    ort, eager = "onnxruntime-cuda-float16", "torch-cuda-float16"
    length = max((r["length"] for r in results.forward if r["contender"] == ort), default=None)
    onnx = _find(results.forward, contender=ort, batch=64, length=length)
    compiled = [r for r in results.forward if r["contender"].startswith("torch.compile")
                and r["contender"].endswith("-cuda-float16") and r["batch"] == 64 and r["length"] == length]
    if onnx and compiled:
        best = min(compiled, key=lambda r: r["median"])
        ratio = best["median"] / onnx["median"]
        found.append({"target": f"GPU forward b64 x {length}/{length} float16: onnxruntime >= 1.0x the best "
                                f"torch.compile ({best['contender']})", "measured": f"{ratio:.2f}x", "met": ratio >= 1.0})
    for name, share, row in ((ort, 0.45, onnx), (eager, 0.25, _find(results.forward, contender=eager, batch=64,
                                                                     length=length))):
        if row and row["fraction_of_matmul_limit"] is not None:
            found.append({"target": f"GPU forward b64 x {length}/{length} float16: {name} >= {share:.0%} of the "
                                    "measured float16 matmul peak",
                          "measured": f"{100 * row['fraction_of_matmul_limit']:.0f}%",
                          "met": row["fraction_of_matmul_limit"] >= share})
    for name, rate in ((ort, 30_000), ("onnxruntime-cuda-graph-float16", 30_000), (eager, 15_000),
                       ("jax-cuda-float16", 15_000)):
        row = _find(results.generate, contender=name)
        if row is None:
            continue
        same = row.get("same_tokens")
        found.append({"target": f"GPU greedy generation b{row.get('batch', 64)} float16: {name} >= {rate:,} "
                                "tokens/s with the golden's tokens",
                      "measured": f"{row['tokens_per_second']:,.0f} tokens/s" if same else "tokens differ",
                      "met": bool(same) and row["tokens_per_second"] >= rate})
    gpu_steps = [r for r in results.decode if "-cuda-" in r["contender"]]
    for name in dict.fromkeys(r["contender"] for r in gpu_steps):
        rows = {r["position"]: r["median"] for r in gpu_steps if r["contender"] == name}
        low, high = min(rows), max(rows)
        if low != high:
            ratio = rows[high] / rows[low]
            found.append({"target": f"GPU {name}: cached step at {high} <= 1.5x the step at {low} (batch 1)",
                          "measured": f"{ratio:.2f}x", "met": ratio <= 1.5})
    return found


# ---- reports --------------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def markdown(results: Results) -> str:
    m = results.machine
    vector_isa = ", ".join(m.get("vector_isa") or []) or "none of AVX2, AVX-512, AMX found"
    lines = [f"# Benchmark: {results.preset}", "",
             f"Machine: {m.get('cpu_model') or m['cpu']} ({vector_isa}), {m['cores']} cores; "
             "measured float32 matrix-product limit "
             f"{m['matmul_float32_flops'] / 1e9:.1f} GFLOP/s, copy bandwidth {m['copy_bytes_per_second'] / 1e9:.1f} GB/s."]
    if "cuda_matmul_flops" in m:
        peaks = ", ".join(f"{dtype} {flops / 1e12:.0f} TFLOP/s" for dtype, flops in m["cuda_matmul_flops"].items()
                          if flops)
        lines.append(f"GPU: {m.get('cuda_device') or 'none found'}" + (f"; measured matmul peaks {peaks}" if peaks else "")
                     + " (a GPU contender's % of limit is of its dtype's peak).")
    copies = any("host_copy_median" in r for r in results.forward)
    lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in results.versions.items() if v), "",
              "## Teacher-forced forward (median ms, spread p25-p75; speed-up vs torch eager)", "",
              "| contender | batch | length | ms | spread | tokens/s | GFLOP/s | % of limit | vs torch |"
              + (" copy to host ms |" if copies else ""),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if copies else "")]
    for r in results.forward:
        speedup = f"{r['speedup_vs_torch']:.2f}x" if r.get("speedup_vs_torch") else "-"
        copy = (f" {_ms(r['host_copy_median'])} |" if "host_copy_median" in r else " - |") if copies else ""
        lines.append(f"| {r['contender']} | {r['batch']} | {r['length']} | {_ms(r['median'])} | "
                     f"{_ms(r['p25'])}-{_ms(r['p75'])} | {r['tokens_per_second']:,.0f} | "
                     f"{r['flops_per_second'] / 1e9:.2f} | {_share(r['fraction_of_matmul_limit'])} | {speedup} |" + copy)
    lines += ["", "## Greedy generation with the KV cache", "",
              "Roofline: per step the slower of reading the contender's weights once at the copy bandwidth and "
              "doing the step's FLOPs at the matrix-product limit (benchmarks.limits.generation_roofline).", "",
              "| contender | tokens | ms | spread | tokens/s | % of roofline | vs torch |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in results.generate:
        if not r.get("same_tokens"):
            lines.append(f"| {r['contender']} | {r['note']} | - | - | - | - | - |")
            continue
        speedup = f"{r['speedup_vs_torch']:.2f}x" if r.get("speedup_vs_torch") else "-"
        lines.append(f"| {r['contender']} | {r['note']} | {_ms(r['median'])} | {_ms(r['p25'])}-{_ms(r['p75'])} | "
                     f"{r['tokens_per_second']:,.0f} | {_share(r.get('fraction_of_roofline'))} | {speedup} |")
    positions = sorted({r["position"] for r in results.decode})
    lines += ["", "## One decode step at position p (batch 1; ms, median)", "",
              "| contender | " + " | ".join(f"p={p}" for p in positions) + " |",
              "|---|" + "---:|" * len(positions)]
    for name in dict.fromkeys(r["contender"] for r in results.decode):
        cells = [_find(results.decode, contender=name, position=p) for p in positions]
        lines.append(f"| {name} | " + " | ".join(_ms(c["median"]) if c else "-" for c in cells) + " |")
    if results.matrix:
        lines += ["", "## The conformance matrix (tiny preset)", "", "| backend | cells | passed | seconds |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['backend']} | {r['cells']} | {r['passed']} | {r['seconds']:.1f} |" for r in results.matrix]
    if results.matrix_wall:
        lines += ["", "## The whole matrix through `rosetta check` (a new process, columns in workers)", "",
                  "| caches | backends | passed | failed | seconds |", "|---|---|---:|---:|---:|"]
        lines += [f"| {r['run']} | {r['backends']} | {r['passed']} | {r['failed']} | {r['seconds']:.1f} |"
                  for r in results.matrix_wall]
    if results.targets:
        lines += ["", "## Targets", "", "| target | measured | met |", "|---|---:|---|"]
        lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in results.targets]
    if results.skipped:
        lines += ["", "## Not measured", ""]
        lines += [f"- {s['contender']} ({s['workload']}): {s['reason']}" for s in results.skipped]
    return "\n".join(lines) + "\n"


def plots(results: Results, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["contender"] for r in results.forward):
        for length, style in zip(sorted({r["length"] for r in results.forward}), ("-", "--", ":")):
            rows = sorted((r for r in results.forward if r["contender"] == name and r["length"] == length),
                          key=lambda r: r["batch"])
            axes[0].plot([r["batch"] for r in rows], [r["tokens_per_second"] for r in rows], style, marker="o",
                         label=f"{name} L={length}")
    axes[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="teacher-forced forward")
    axes[0].legend(fontsize=6)
    for name in dict.fromkeys(r["contender"] for r in results.decode):
        rows = sorted((r for r in results.decode if r["contender"] == name), key=lambda r: r["position"])
        axes[1].plot([r["position"] for r in rows], [r["median"] * 1e3 for r in rows], marker="o", label=name)
    axes[1].set(xlabel="position", ylabel="ms per step", yscale="log", title="one decode step (batch 1)")
    axes[1].legend(fontsize=6)
    figure.tight_layout()
    path = directory / "bench.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(path)
    return written


def write(results: Results, directory: Path, plot: bool = True) -> list[Path]:
    """bench.json and bench.md, and with `plot` bench.png (matplotlib's figure takes most of a
    second: the writes after each contender leave it to the last)."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "bench.json"
    json_path.write_text(json.dumps(vars(results), indent=1, default=float) + "\n")
    md_path = directory / "bench.md"
    md_path.write_text(markdown(results))
    return [json_path, md_path, *(plots(results, directory) if plot else ())]
