"""What a column holds in memory, measured: the figures behind conformance.plan.memory.FOOTPRINTS.

Each column runs in a fresh process, as a worker of the local executor runs it: the weights
memory-mapped, the column loaded, then forward-none, decode-incremental, forward-long and decode-far, the
heap's freed pages given back after each (conformance.plan.memory.give_back_freed). Its footprint is
the process's peak resident memory over what it held before loading; `copies` is the peak through
the loading and forward-none (whose activations are next to nothing) over the weights at the dtype,
`activation_copies` what the cases took beyond it over the
activations once (conformance.plan.memory.activation_bytes at one copy); `kept` is what it still
held once the column's runner was dropped (what a worker keeps).

    python -m benchmarks.footprints WEIGHTS.safetensors [--hf DIR] [--columns jax/float32,...] [--out FOLDER]

Writes footprints.md and footprints.json into FOLDER (default: print only)."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import subprocess
import sys
from pathlib import Path

from conformance.plan.memory import BYTES, Extent, activation_bytes, activation_copies, weight_copies

CASES = (("forward", "none"), ("decode", "incremental"), ("forward", "long"), ("decode", "far"))
DEFAULT_COLUMNS = ("torch/float32", "torch/bfloat16", "jax/float32", "jax/bfloat16", "onnx/float32",
                   "onnx/float16", "numpy-float32/float32")


def measure_here(weights: str, name: str, dtype: str, hf: str | None) -> dict:
    """One column in this process: bytes resident before loading, at the peak, and after its cases."""
    from conformance.adapter import NotSupported, get_backend
    from conformance.cases import build_case
    from conformance.plan.cost import logit_rows, positions
    from conformance.plan.memory import give_back_freed, resident_memory
    from conformance.models import register_model_directory
    from spec import load_weights

    if hf:
        register_model_directory(hf)
    cfg, params = load_weights(weights, mapped=True)
    cases = [build_case(cfg, params, sublayer, mask_case) for sublayer, mask_case in CASES]
    backend, _ = get_backend(name)
    before = resident_memory()
    runner, ran, loaded = backend.load(cfg, params, dtype, "cpu"), [], None
    for case in cases:
        try:
            runner.run(case.sublayer, case.inputs)
            ran.append(case)
        except NotSupported:  # an export without a decoding graph (onnx-jax): the column runs the others
            pass
        give_back_freed()
        # the peak through the load and forward-none (six positions: activations next to nothing) is
        # the weights' copies; JAX places its weights when a program first runs, not when it loads
        loaded = loaded or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del runner  # as a worker drops a finished column's runner before it says what it keeps
    gc.collect()
    give_back_freed()
    return {"before": before, "loaded": loaded, "peak": peak, "after": resident_memory(),
            "cases": [case.name for case in ran],
            "positions": max(positions(cfg, case.sublayer, case.mask_case, []) for case in ran),
            "logit_rows": max(logit_rows(cfg, case.sublayer, case.mask_case, []) for case in ran)}


def measure(weights: str, column: str, hf: str | None) -> dict:
    """A column measured in a fresh process, with the copies of its weights that the peak means."""
    from spec import load_weights
    from spec.params import count_params

    name, dtype = column.split("/")
    command = [sys.executable, "-m", "benchmarks.footprints", weights, "--here", column] + (["--hf", hf] if hf else [])
    answer = subprocess.run(command, capture_output=True, text=True, check=False)
    if answer.returncode != 0:
        return {"column": column, "error": (answer.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    found = json.loads(answer.stdout.strip().splitlines()[-1])
    cfg, _ = load_weights(weights, mapped=True)
    weights_bytes = count_params(cfg) * BYTES[dtype]
    extent = Extent(found["positions"], found["logit_rows"])
    activations = activation_bytes(cfg, (name, dtype, "cpu"), extent)
    one_copy = activations / activation_copies(name, dtype)  # the activations once
    taken, loading = found["peak"] - found["before"], found["loaded"] - found["before"]
    return {"column": column, "cases": found["cases"], "peak_gb": round(taken / 1e9, 2),
            "kept_gb": round((found["after"] - found["before"]) / 1e9, 2),
            "weights_gb": round(weights_bytes / 1e9, 2), "activations_gb": round(one_copy / 1e9, 2),
            "copies": round(loading / weights_bytes, 2), "table_copies": weight_copies(name, dtype),
            "activation_copies": round((taken - loading) / one_copy, 2),
            "table_activation_copies": activation_copies(name, dtype)}


def markdown(rows: list[dict], source: str) -> str:
    lines = [f"# What a column holds in memory ({source})", "",
             f"Machine: {platform.machine()}, Python {platform.python_version()}. Each column a fresh process: "
             "the weights mapped, the column loaded, forward-none, decode-incremental, forward-long and decode-far, "
             "the heap's "
             "freed pages given back after each. Peak: resident memory over what the process held before loading. "
             "Copies: the peak through the loading and forward-none over the weights at the dtype; "
             "activation copies: what the cases took beyond "
             "it, over the activations once (BATCH rows of the longest case's logits and 4 widest hidden states).", "",
             "| column | peak GB | kept after GB | weights GB | activations once GB | copies | table's copies | "
             "activation copies | table's |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['column']} | error: {row['error']} | | | | | | | |")
        else:
            lines.append(f"| {row['column']} | {row['peak_gb']} | {row['kept_gb']} | {row['weights_gb']} | "
                         f"{row['activations_gb']} | {row['copies']} | {row['table_copies']} | "
                         f"{row['activation_copies']} | {row['table_activation_copies']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights")
    parser.add_argument("--hf", help="the Hugging Face directory the weights came from (transformers, onnxruntime-genai)")
    parser.add_argument("--columns", default=",".join(DEFAULT_COLUMNS), help="backend/dtype, comma-separated")
    parser.add_argument("--out")
    parser.add_argument("--source", help="what the weights are, for the page's title (default: their name)")
    parser.add_argument("--here", help=argparse.SUPPRESS)  # one column, in this process
    args = parser.parse_args(argv)
    if args.here:
        print(json.dumps(measure_here(args.weights, *args.here.split("/"), args.hf)))
        return 0
    rows = []
    for column in args.columns.split(","):
        rows.append(measure(args.weights, column, args.hf))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    page = markdown(rows, args.source or Path(args.weights).stem)
    print(page)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "footprints.md").write_text(page)
        Path(args.out, "footprints.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
