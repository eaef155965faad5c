"""`rosetta bench`: every contender timed from the same weights (benchmarks.run)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rosetta.arguments import comma_list, writable_folder


def cmd_bench(args: argparse.Namespace) -> int:
    """Time every contender on the preset's workloads; JSON, Markdown and plots into --out."""
    from benchmarks.run import run_bench, write

    start = time.perf_counter()
    out = writable_folder(Path(args.out), "--out")
    devices = tuple(comma_list(args.devices) or ("cpu",))
    results = run_bench(args.preset, names=tuple(comma_list(args.contenders) or ()) or None, devices=devices,
                        matrix_backends=tuple(comma_list(args.matrix_backends) or ()) if args.matrix_backends != "none"
                        else (), log=lambda line: print(line, file=sys.stderr))
    written = write(results, out)
    print((out / "bench.md").read_text())
    print(f"bench written: {', '.join(map(str, written))} in {time.perf_counter() - start:.1f} s")
    return 0


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark every contender (JSON, Markdown and plots)")
    bench.add_argument("--preset", default="tiny",
                       help="tiny (CI smoke run), paper-base, or llama-small (the modern decoder's CPU generation)")
    bench.add_argument("--out", default="reports/bench/tmp", help="folder for bench.json, bench.md, bench.png")
    bench.add_argument("--contenders", help="comma-separated names (default: all)")
    bench.add_argument("--devices", help="cpu and/or cuda: the contenders of each (default: cpu); cuda alone times "
                       "the GPU workloads (batch 64)")
    bench.add_argument("--matrix-backends", default="numpy-float32,torch,onnx",
                       help="backends whose conformance-matrix wall time is measured (or none)")
    bench.set_defaults(handler=cmd_bench)
