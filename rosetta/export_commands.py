"""`rosetta export`, ONNX graphs of a model checked against the golden (and a Triton model
repository), and `rosetta generate`, greedy generation with onnxruntime from an export."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from conformance.models import load_model
from rosetta.arguments import UsageError, comma_list, writable_folder


def cmd_export(args: argparse.Namespace) -> int:
    """Export the graphs, check the forward graph against the golden, optionally write a Triton repository."""
    from conformance.deployment.export_check import check_exported_forward
    from export.exporters import export_model
    from export.onnx_model import WEIGHTS_FILE

    cfg, params, _ = load_model(preset=args.preset, seed=args.seed, weights=args.weights)
    writable_folder(args.out, "--out")
    start = time.perf_counter()
    paths = export_model(cfg, params, args.out, framework=args.framework, dtype=args.dtype, opset=args.opset,
                         graph_roles=tuple(comma_list(args.graphs) or ()) or None)
    print(f"exported from {args.framework} in {time.perf_counter() - start:.1f} s (opset {args.opset}, {args.dtype}):")
    for role, path in paths.items():
        print(f"  {role:18} {path}  {path.stat().st_size / 1e6:8.2f} MB")
    if (weights := Path(args.out) / WEIGHTS_FILE).is_file():
        print(f"  {'weights (shared)':18} {weights}  {weights.stat().st_size / 1e6:8.2f} MB")
    if "forward" in paths:
        result = check_exported_forward(args.out, cfg, params)
        print(f"forward graph vs golden (batch 2, onnxruntime CPU): max|error| / tolerance = "
              f"{result.max_abs_err / result.tol:.3f} ({'pass' if result.passed else 'FAIL'})")
        if not result.passed:
            return 1
    if args.triton:
        from export.triton import write_repository

        models = write_repository(args.out, args.triton, kind=args.triton_kind, max_batch_size=args.max_batch_size)
        print(f"Triton model repository {args.triton}: {', '.join(m.name for m in models)} (validated)")
    return 0


def _token_rows(rows: list[str], pad_id: int, name: str):
    """'5 6 7' strings -> int64 [B, L], right-padded with pad_id."""
    import numpy as np

    try:
        parsed = [[int(token) for token in row.replace(",", " ").split()] for row in rows]
    except ValueError as error:
        raise UsageError(f"{name}: token ids are integers separated by spaces ({error})") from None
    if any(not row for row in parsed):
        raise UsageError(f"{name}: an empty sequence")
    length = max(map(len, parsed))
    return np.array([row + [pad_id] * (length - len(row)) for row in parsed], dtype=np.int64)


def cmd_generate(args: argparse.Namespace) -> int:
    """Greedy generation with onnxruntime from an exported directory."""
    from export.placement import CPU_PROVIDER, by_provider
    from export.runner import OnnxTransformer

    model = OnnxTransformer(args.model, device=args.device, on_fallback="warn" if args.allow_cpu_fallback else "refuse")
    cfg = model.cfg
    if cfg.has_encoder and not args.src:
        raise UsageError("an encoder-decoder model generates from --src (one per sequence)")
    if not cfg.has_encoder and not args.prompt:
        raise UsageError("a decoder-only model generates from --prompt (one per sequence)")
    src = _token_rows(args.src, cfg.pad_id, "--src") if cfg.has_encoder else None
    prompt = None if cfg.has_encoder else _token_rows(args.prompt, cfg.pad_id, "--prompt")
    if args.cuda_graph:
        from export.fixed_greedy import FixedBufferGreedy

        if model.device != "cuda":
            raise UsageError(f"--cuda-graph captures CUDA graphs; this model runs on {model.device} (--device cuda)")
        generate = functools.partial(FixedBufferGreedy(model).generate, src)
    else:
        generate = functools.partial(model.greedy_generate, src)
    start = time.perf_counter()
    tokens = generate(prompt_ids=prompt, bos_id=args.bos if cfg.has_encoder else None, eos_id=args.eos,
                      max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - start
    for row in tokens:
        print(" ".join(map(str, row)))
    print(f"{tokens.shape[0]} sequences x {tokens.shape[1]} tokens in {seconds * 1e3:.1f} ms on {model.device} "
          f"(providers {model.provider_name})", file=sys.stderr)
    if args.placement:
        for role, nodes in model.placement().items():
            counts = ", ".join(f"{provider}: {len(names)} nodes" for provider, names in by_provider(nodes).items())
            print(f"{role:18} {counts}", file=sys.stderr)
            if model.device == "cuda":
                for node in nodes:
                    if node.provider == CPU_PROVIDER:
                        print(f"{'':18} on the CPU: {node.name} {node.signature()}", file=sys.stderr)
    return 0


def add_export(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser("export", help="export ONNX graphs (and a Triton model repository)")
    export.add_argument("--preset", default="tiny", help="preset config with init_params (default: tiny)")
    export.add_argument("--weights", type=Path, help="a weights file (config read from it)")
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--out", type=Path, required=True, help="directory for ROLE.onnx and manifest.json")
    export.add_argument("--framework", choices=("torch", "jax"), default="torch",
                        help="torch: every graph; jax (jax2onnx): forward and encoder")
    export.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    export.add_argument("--opset", type=int, choices=(23, 20), default=23,
                        help="23: attention as ONNX's Attention op; 20: decomposed attention")
    export.add_argument("--graphs", help="comma-separated roles (default all: forward, encoder, decoder_step)")
    export.add_argument("--triton", type=Path, help="also write a Triton model repository here")
    export.add_argument("--triton-kind", choices=("KIND_GPU", "KIND_CPU"), default="KIND_GPU")
    export.add_argument("--max-batch-size", type=int, default=16, help="Triton max_batch_size (default 16)")
    export.set_defaults(handler=cmd_export)


def add_generate(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="greedy generation with onnxruntime from an export")
    generate.add_argument("model", type=Path, help="a directory written by `rosetta export`")
    generate.add_argument("--src", action="append", help='source token ids, e.g. "5 6 7" (repeat for a batch)')
    generate.add_argument("--prompt", action="append", help="prompt token ids (decoder-only; repeat for a batch)")
    generate.add_argument("--bos", type=int, default=1, help="first target token (encoder-decoder; default 1)")
    generate.add_argument("--eos", type=int, default=None, help="stop a sequence at this token")
    generate.add_argument("--max-new-tokens", type=int, default=20)
    generate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    generate.add_argument("--allow-cpu-fallback", action="store_true",
                          help="warn instead of refusing when a CUDA session would run nodes on the CPU")
    generate.add_argument("--placement", action="store_true", help="show which provider ran each graph's nodes")
    generate.add_argument("--cuda-graph", action="store_true",
                          help="on CUDA: each step a replayed CUDA graph, the argmax on the device (export.fixed_greedy)")
    generate.set_defaults(handler=cmd_generate)
