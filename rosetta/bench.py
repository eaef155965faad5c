"""`rosetta bench`: every contender timed from the same weights (benchmarks.run)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rosetta.arguments import UsageError, comma_list, writable_folder
from spec.errors import WeightsError
from spec.quantization import parse_scheme


def cmd_bench(args: argparse.Namespace) -> int:
    """Time every contender on the preset's workloads; JSON, Markdown and plots into --out."""
    from benchmarks.run import run_bench, write

    start = time.perf_counter()
    out = writable_folder(Path(args.out), "--out")
    if args.checkpoint_shapes:
        return _bench_checkpoints(args, out)
    devices = tuple(comma_list(args.devices) or ("cpu",))
    try:
        quantized = tuple(parse_scheme(name) for name in comma_list(args.quantized)) if args.quantized else ()
    except WeightsError as error:
        raise UsageError(f"--quantized: {error}") from None
    def keep(so_far) -> None:  # a bench stopped midway keeps its tables; the plot is drawn once, at the end
        write(so_far, out, plot=False)

    results = run_bench(args.preset, names=tuple(comma_list(args.contenders) or ()) or None, devices=devices,
                        quantized=quantized,
                        matrix_backends=tuple(comma_list(args.matrix_backends) or ()) if args.matrix_backends != "none"
                        else (), log=lambda line: print(line, file=sys.stderr), after_each=keep)
    written = write(results, out)
    print((out / "bench.md").read_text())
    print(f"bench written: {', '.join(map(str, written))} in {time.perf_counter() - start:.1f} s")
    return 0


def _bench_checkpoints(args: argparse.Namespace, out: Path) -> int:
    """Import, the one-cell check, the default check (and, asked for, --full) on random models of real
    checkpoints' shapes."""
    import datetime
    import json

    from benchmarks.checkpoints import RUNS, SHAPES, as_dicts, bench_checkpoints, markdown
    from conformance.machine import machine

    shapes = comma_list(args.shapes) or ["smollm2-135m", "qwen2.5-0.5b"]
    runs = comma_list(args.runs) or [run for run in RUNS if run != "full"]  # every cell takes hours at 0.5B
    for given, known, what in ((shapes, SHAPES, "--shapes"), (runs, RUNS, "--runs")):
        if unknown := [name for name in given if name not in known]:
            raise UsageError(f"{what}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    results = bench_checkpoints(shapes, runs, Path(args.checkpoints).expanduser(), args.limit,
                                log=lambda line: print(line, file=sys.stderr, flush=True), logs=out)
    date = datetime.date.today().isoformat()
    (out / "bench.json").write_text(json.dumps({"date": date, "machine": machine(), "runs": as_dicts(results)},
                                               indent=2) + "\n")
    (out / "bench.md").write_text(page := markdown(results, machine(), date))
    print(page)
    return 0


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark every contender (JSON, Markdown and plots)")
    bench.add_argument("--preset", default="tiny",
                       help="tiny (CI smoke run), paper-base, llama-small (the modern decoder's CPU generation), "
                            "gemma2-small or qwen35-small (the hybrid's)")
    bench.add_argument("--out", default="reports/bench/tmp", help="folder for bench.json, bench.md, bench.png")
    bench.add_argument("--contenders", help="comma-separated names (default: all)")
    bench.add_argument("--quantized", metavar="SCHEMES",
                       help="add onnxruntime's quantized exports as CPU contenders, e.g. int4,int8-b128,dynamic-int8 "
                            "(as rosetta check --quantized): each named onnxruntime-<scheme>, its tokens judged on the "
                            "weights it stores and where they part from the float golden's stated")
    bench.add_argument("--devices", help="cpu and/or cuda: the contenders of each (default: cpu); cuda alone times "
                       "the GPU workloads (batch 64)")
    bench.add_argument("--matrix-backends", default="numpy-float32,torch,onnx",
                       help="backends whose conformance-matrix wall time is measured (or none)")
    bench.add_argument("--checkpoint-shapes", action="store_true",
                       help="instead: time `rosetta import`, the one-cell check and the default check, with their "
                            "peak memory, on random models with the shapes of real checkpoints (benchmarks/checkpoints.py)")
    bench.add_argument("--shapes", help="with --checkpoint-shapes: smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, "
                       "qwen3.5-0.8b and the others of benchmarks/checkpoints.py (default: the first two)")
    bench.add_argument("--runs", help="with --checkpoint-shapes: import, one-cell, default (the plan of the default "
                       "budget), full (every cell), default-at-memory-target (the default with --memory at the shape's "
                       "memory target) (default: all but full)")
    bench.add_argument("--limit", type=float, default=3600.0,
                       help="with --checkpoint-shapes: seconds after which a run is stopped (default 3600)")
    bench.add_argument("--checkpoints", default="~/.cache/transformer-rosetta/checkpoint-shapes",
                       help="with --checkpoint-shapes: where the random checkpoints are made, once")
    bench.set_defaults(handler=cmd_bench)
