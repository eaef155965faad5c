"""`rosetta gpu` (and `make gpu`): the whole GPU report in one command, on whatever CUDA device
is present. It runs, each into one folder named after the device:

- the conformance matrix of every GPU backend (torch, torch-math, jax, jax-math, onnx, onnx-jax)
  on tiny, char-lm, the modern and the mixture-of-experts presets at every dtype each runs, with the gradient and
  training cells of the framework columns (--backward): check-<preset>/report.{json,md},
  heatmap.png;
- the probe of every framework's own primitives on every device present: probe.md;
- the benchmark of the GPU contenders on paper-base: bench/bench.{json,md,png};
- environment.json (device, driver, versions, the command, each step's exit code and time) and
  summary.md, the table printed last.

Each step is an ordinary `rosetta` command (its argv is in environment.json, so any one of them
can be run again by hand), and its output goes to <step>.log. It runs from a venv or from a
machine's own frameworks with the project on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from conformance.machine import NVIDIA_DRIVER, device_facts, framework_versions
from rosetta.arguments import CommandLine, UsageError, comma_list, writable_folder

MATRIX_BACKENDS = ("torch", "torch-math", "jax", "jax-math", "onnx", "onnx-jax")
MATRIX_PRESETS = ("tiny", "char-lm", "llama-tiny", "qwen2-tiny", "qwen3-tiny", "mixtral-tiny", "qwen3-moe-tiny")
BENCH_PRESET = "paper-base"


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # a `rosetta` command line


def plan_steps(out: Path, device: str, *, presets=MATRIX_PRESETS, backends=MATRIX_BACKENDS,
               bench_preset: str | None = BENCH_PRESET, bench_contenders: tuple[str, ...] = (),
               backward: bool = True, jobs: int | None = None) -> list[Step]:
    """The job's commands, in order: the matrix per preset, the probe, the benchmark. jobs: the
    check's worker processes (default its own: one on a GPU)."""
    options = ("--backward",) * backward + (("--jobs", str(jobs)) if jobs else ())
    steps = [Step(f"check-{preset}", ("check", "--preset", preset, "--backends", ",".join(backends),
                                      "--devices", device, *options, "--report", str(out / f"check-{preset}"), "--quiet"))
             for preset in presets]
    steps.append(Step("probe", ("probe", "--markdown", str(out / "probe.md"))))
    if bench_preset:
        steps.append(Step("bench", ("bench", "--preset", bench_preset, "--devices", device,
                                    "--contenders", ",".join(bench_contenders or device_contenders(device)),
                                    "--matrix-backends", "none", "--out", str(out / "bench"))))
    return steps


def device_contenders(device: str) -> tuple[str, ...]:
    """Every contender that runs on the device (on a GPU, torch eager at float16 first: the
    reference of the GPU ratios)."""
    from benchmarks.contenders import contenders

    return tuple(c.name for c in contenders((device,)))


def folder_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'"""
    return re.sub(r"[^a-z0-9.]+", "-", device_name.lower()).strip("-") or "device"


def _git_commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip() or None
    return None


def _headline(log: str) -> str:
    """The line of a step's output that sums it up."""
    for pattern in (r"^\d+ passed, \d+ failed.*$", r"^rosetta \w+: error: .*$", r"^wrote .*$"):
        found = re.findall(pattern, log, flags=re.MULTILINE)
        if found:
            return found[-1]
    lines = [line for line in log.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_gpu_job(out_root: Path, device: str, command: list[str], run_command: CommandLine, **plan_options) -> int:
    """Run the job's steps (plan_steps) one after another through run_command, the `rosetta`
    entry point, each step's output into its log; write environment.json after each step and
    summary.md at the end, into a folder of out_root named after the device. command: the
    command line recorded. Exit code 0 when every step's was 0."""
    if device == "cuda" and not NVIDIA_DRIVER.exists():
        raise UsageError("no CUDA device here (no NVIDIA driver): `rosetta gpu` runs on a machine with a GPU; "
                         "--device cpu runs the same job on the CPU")
    # JAX takes 75% of the GPU's memory at its first use unless told not to, which would leave
    # torch and onnxruntime, in this same process, a quarter of it for the benchmark.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    facts = device_facts(device)
    out = writable_folder(out_root / folder_name(facts["name"] or device), "--out")
    steps = plan_steps(out, device, **plan_options)
    record = {**facts, "versions": framework_versions(), "command": command, "git_commit": _git_commit(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": []}
    for step in steps:
        print(f"rosetta gpu: {step.name} ...", file=sys.stderr, flush=True)
        log_path = out / f"{step.name}.log"
        start = time.perf_counter()
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = run_command(list(step.argv))
        seconds = time.perf_counter() - start
        record["steps"].append({"name": step.name, "argv": ["rosetta", *step.argv], "exit_code": code,
                                "seconds": round(seconds, 1), "headline": _headline(log_path.read_text())})
        (out / "environment.json").write_text(json.dumps(record, indent=1) + "\n")  # kept current if cut off
    table = summary_table(record)
    (out / "summary.md").write_text(f"# GPU report: {facts['name']}\n\n{table}\n")
    print(table)
    print(f"\nwritten: {out}")
    return 0 if all(step["exit_code"] == 0 for step in record["steps"]) else 1


def summary_table(record: dict) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in record["versions"].items() if version)
    lines = [f"device: {record['name']} ({record['device']}), driver {record['driver'] or '-'}",
             f"versions: {versions}", f"command: {' '.join(record['command'])}", "",
             "| step | exit | seconds | result |", "|---|---|---:|---|"]
    lines += [f"| {s['name']} | {s['exit_code']} | {s['seconds']:.1f} | {s['headline']} |" for s in record["steps"]]
    return "\n".join(lines)


def cmd_gpu(args: argparse.Namespace, run_command: CommandLine) -> int:
    """The whole GPU report: matrix, probe and benchmark into one folder."""
    return run_gpu_job(args.out, args.device, ["rosetta", *args.argv], run_command,
                       presets=tuple(comma_list(args.presets) or MATRIX_PRESETS),
                       backends=tuple(comma_list(args.backends) or MATRIX_BACKENDS),
                       bench_preset=None if args.bench_preset == "none" else args.bench_preset,
                       bench_contenders=tuple(comma_list(args.bench_contenders) or ()),
                       backward=not args.forward_only, jobs=args.jobs)


def add_gpu(commands: argparse._SubParsersAction, run_command: CommandLine) -> None:
    """run_command: the `rosetta` entry point, which runs each step of the job."""
    gpu = commands.add_parser("gpu", help="the whole GPU report: matrix, probe and benchmark into one folder")
    gpu.add_argument("--out", type=Path, default=Path("reports/gpu"),
                     help="parent folder; the report goes into a folder named after the device (default reports/gpu)")
    gpu.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cuda (default), or cpu for the same job on the CPU")
    gpu.add_argument("--presets", default=",".join(MATRIX_PRESETS),
                     help=f"presets of the matrix (default {','.join(MATRIX_PRESETS)})")
    gpu.add_argument("--forward-only", action="store_true",
                     help="leave out the gradient and training cells (rosetta check --backward, on by default)")
    gpu.add_argument("--jobs", type=int, help="the checks' worker processes (default: rosetta check's, one on a GPU)")
    gpu.add_argument("--backends", default="torch,torch-math,jax,jax-math,onnx,onnx-jax",
                     help="backends of the matrix (default: every GPU backend)")
    gpu.add_argument("--bench-preset", default="paper-base", help="preset of the benchmark, or none")
    gpu.add_argument("--bench-contenders", help="default: every contender on the device")
    gpu.set_defaults(handler=lambda args: cmd_gpu(args, run_command))
