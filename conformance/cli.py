"""The ``rosetta`` command (also ``python -m conformance``).

    rosetta check [--preset tiny | --weights FILE] [--hf DIR] [--backends a,b] [--dtypes ...] [--devices ...]
                  [-k FILTER] [--fail-fast] [--report DIR] [--jobs N] [--shard I/N]
    rosetta merge REPORT... --out DIR
    rosetta import DIR --out FILE.safetensors
    rosetta export [--preset tiny | --weights FILE] --out DIR [--framework torch|jax] [--dtype float32|float16]
                   [--opset 23|20] [--graphs a,b] [--triton REPO]
    rosetta generate DIR (--src "5 6 7" ... | --prompt "5 6" ...) [--bos 1] [--eos 2] [--max-new-tokens N]
                   [--device auto|cpu|cuda] [--allow-cpu-fallback] [--placement]
    rosetta bench [--preset tiny | paper-base | llama-small] [--out DIR] [--contenders a,b]
    rosetta gpu [--out reports/gpu] [--device cuda|cpu] [--presets ...] [--backends ...] [--bench-preset NAME|none]
    rosetta refusals [--markdown FILE]
    rosetta differences [--markdown FILE]
    rosetta presets
    rosetta init --preset NAME [--seed N] OUT.safetensors
    rosetta info FILE.safetensors

Exit codes: 0 every cell that ran passed, 1 a cell failed (or none ran), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from conformance import terminal
from conformance.adapter import backend_names, importable_by_name
from conformance.gpu_job import NVIDIA_DRIVER
from conformance.harness import ERROR, FAIL, PASS, SKIP, CellResult, plan_matrix, run_matrix
from conformance.parallel import WorkerPool, auto_jobs
from conformance.report import (attention_paths, columns_and_rows, format_attention_paths, summary_counts,
                                write_report)
from conformance.shards import MergeError, merge_reports, parse_shard, read_reports, shard_plan
from conformance.tolerance import DTYPES
from spec import (
    ModelConfig,
    SpecError,
    conformance_params,
    count_params,
    describe_preset,
    get_preset,
    init_params,
    list_presets,
    load_weights,
    params_digest,
    save_weights,
)

class UsageError(Exception):
    """Bad command-line usage: exit code 2."""


def _split(value: str | None) -> list[str] | None:
    if value is None or value in ("", "all", "auto"):
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


# ---- check ------------------------------------------------------------------------------------

def _load_model(args: argparse.Namespace):
    if args.weights:
        cfg, params = load_weights(args.weights)
        return cfg, params, {"weights": str(args.weights)}
    if getattr(args, "hf", None) and not args.preset_given:
        from importers import import_huggingface

        imported = import_huggingface(args.hf)
        return imported.config, imported.params, {"hf": str(args.hf), "family": imported.family}
    cfg = get_preset(args.preset)
    return cfg, conformance_params(cfg, args.seed), {"preset": args.preset, "seed": args.seed}


def _cell_text(result: CellResult) -> str:
    if result.status == PASS:
        return f"ok {result.ratio:.2f}"
    if result.status == FAIL:
        return f"FAIL {result.ratio:.3g}" if result.ratio is not None else "FAIL"
    return "ERROR" if result.status == ERROR else "skip"


def format_table(results: list[CellResult]) -> str:
    """Rows sublayer-mask_case, columns backend/dtype/device; cells 'ok r' with r = error/tolerance."""
    columns, rows = columns_and_rows(results)
    cells = {(f"{r.sublayer}-{r.mask_case}", (r.backend, r.dtype, r.device)): _cell_text(r) for r in results
             if (r.backend, r.dtype, r.device) in columns}
    headers = ["case"] + ["/".join(column) for column in columns]
    body = [[row] + [cells.get((row, column), "") for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in [headers] + body) for i in range(len(headers))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(headers, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(text.ljust(width) for text, width in zip(line, widths)) for line in body]
    return "\n".join(lines)


def format_problems(results: list[CellResult]) -> str:
    lines = []
    for r in results:
        if r.status in (FAIL, ERROR):
            lines.append(f"{r.status.upper()} {r.test_id}: {r.reason}")
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.status == SKIP:
            skipped.setdefault((f"{r.backend}/{r.dtype}/{r.device}", r.reason), []).append(r.test_id)
    for (column, reason), ids in skipped.items():
        lines.append(f"skipped {column} ({len(ids)} cells): {reason}")
    return "\n".join(lines)


def _localize(cfg, params, results: list[CellResult], every_column: bool) -> dict:
    """Localize each column whose whole-model cells failed (every column with --localize), and
    walk the backward of each column whose whole-model gradient or training cells failed."""
    from conformance.cases import is_training
    from conformance.localize import WHOLE_MODEL, localize_backward_column, localize_column

    failing: dict[tuple[str, str, str], str] = {}
    failing_backward: dict[tuple[str, str, str], str] = {}
    for r in results:
        column = (r.backend, r.dtype, r.device)
        if r.status == SKIP:
            continue
        if every_column:
            failing.setdefault(column, "pad_right")
        if r.sublayer in WHOLE_MODEL and r.status in (FAIL, ERROR):
            failing[column] = r.mask_case if r.sublayer == "forward" else failing.get(column, "pad_right")
        if (r.sublayer in ("grad-forward", "grad-loss") or is_training(r.sublayer)) and r.status in (FAIL, ERROR):
            failing_backward.setdefault(column, r.mask_case if r.sublayer == "grad-loss" else "pad_right")
    localizations = {}
    for (backend, dtype, device), mask_case in failing.items():
        if not _runs_layers(backend):  # a whole-model column (transformers) has no stages to feed one by one
            continue
        if cfg.has_encoder or mask_case not in ("cross_pad", "lq_ne_lk"):
            localizations[f"{backend}/{dtype}/{device} (forward-{mask_case})"] = localize_column(
                cfg, params, backend, dtype, device, mask_case)
    for (backend, dtype, device), mask_case in failing_backward.items():
        if _runs_layers(backend) and (cfg.has_encoder or mask_case not in ("cross_pad", "lq_ne_lk", "pad_start")):
            localizations[f"{backend}/{dtype}/{device} (backward of loss-{mask_case})"] = localize_backward_column(
                cfg, params, backend, dtype, device, mask_case)
    return localizations


def _runs_layers(name: str) -> bool:
    from conformance.adapter import get_backend

    backend, _ = get_backend(name)
    return backend is not None and getattr(backend, "supports_sublayer", lambda sublayer: None)("decoder_layer") is None


def writable_folder(path: Path, option: str) -> Path:
    """Make sure a folder can be written before a long run, not after it."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot write there ({error.strerror or error})") from None
    return path


def _positive(value: str, option: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(f"{option} takes a positive integer or auto, got {value!r}")
    return number


def _early_workers(jobs: int | None, backends: list[str] | None, dtypes: list[str] | None,
                   devices: list[str] | None) -> WorkerPool | None:
    """Worker processes started before the model is loaded and the matrix planned, importing the
    frameworks meanwhile (planning imports them here too): ~2 s of a warm check. None where the
    run will be one process: --jobs 1, or a GPU (auto gives one process where any column is on
    a GPU, so none is started where a device other than the CPU is asked for or present)."""
    if jobs is None:
        if (devices and set(devices) != {"cpu"}) or (not devices and NVIDIA_DRIVER.exists()):
            return None
        jobs = os.cpu_count() or 1
    names = [name for name in (backends or backend_names()) if importable_by_name(name)]
    count = min(jobs, len(names) * len(dtypes or DTYPES))  # at most one worker per column
    return WorkerPool(count, preload=names) if count > 1 else None


def cmd_check(args: argparse.Namespace) -> int:
    if args.weights and args.preset_given:
        raise UsageError("give either --preset or --weights, not both")
    if args.hf and args.preset_given:
        raise UsageError("--hf runs the Hugging Face model of DIR: give it alone (the weights are DIR's import) "
                         "or with --weights FILE made by `rosetta import`, not with --preset")
    if args.report:
        writable_folder(Path(args.report), "--report")
    if args.hf:
        _register_transformers(args.hf)
    backends = _split(args.backends)
    for column in ("transformers", "onnxruntime-genai"):
        if backends and column in backends and not args.hf:
            raise UsageError(f"the {column} column runs a Hugging Face model directory: give it with --hf DIR")
    if backends:
        unknown = [b for b in backends if b not in backend_names()]
        if unknown:
            raise UsageError(f"unknown backend(s) {', '.join(unknown)}; registered: {', '.join(backend_names())}")
    dtypes = _split(args.dtypes)
    if dtypes:
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise UsageError(f"unknown dtype(s) {', '.join(unknown)}; known: {', '.join(DTYPES)}")
    devices = _split(args.devices)
    if args.shard:
        try:
            shard = parse_shard(args.shard)
        except ValueError as error:
            raise UsageError(str(error)) from None
    jobs = None if args.jobs == "auto" else _positive(args.jobs, "--jobs")
    start = time.perf_counter()
    pool = _early_workers(jobs, backends, dtypes, devices)
    try:
        cfg, params, source = _load_model(args)
        plan = plan_matrix(cfg, backends, dtypes, devices)
        if args.shard:
            plan = shard_plan(plan, *shard)
            source = {**source, "shard": args.shard}
        jobs = auto_jobs(plan.columns) if jobs is None else jobs
        # a person at a terminal gets rich's progress bar and colored table; a file or pipe, plain text
        show_progress = sys.stderr.isatty() and not args.quiet
        with terminal.progress_bar(Console(stderr=True)) if show_progress else contextlib.nullcontext() as progress:
            results = run_matrix(cfg, params, plan, pattern=args.k, fail_fast=args.fail_fast, progress=progress,
                                 jobs=jobs, pool=pool, backward=args.backward)
    finally:
        if pool is not None:
            pool.close()
    seconds = time.perf_counter() - start
    counts = summary_counts(results)
    label = source.get("preset") or source.get("weights") or source.get("hf")
    title = f"Conformance of every backend against the golden (impl_numpy, float64) - {label}"
    problems = format_problems(results)
    if sys.stdout.isatty():
        console = Console()
        console.print(terminal.matrix_table(results, title))
        if (panel := terminal.failure_panel(results)) is not None:
            console.print(panel)
        skipped = [line for line in problems.splitlines() if line.startswith("skipped ")]
        if skipped:
            console.print("\n".join(skipped), style="dim", markup=False, highlight=False)
    else:
        print(title)
        print("cells: max|error| / tolerance, below 1 passes\n")
        print(format_table(results))
        if problems:
            print("\n" + problems)
    print(f"\n{counts[PASS]} passed, {counts[FAIL] + counts[ERROR]} failed, {counts[SKIP]} skipped "
          f"in {seconds:.2f} s")
    if paths := format_attention_paths(attention_paths(results)):
        print(paths)
    localizations = _localize(cfg, params, results, args.localize)
    for column, localization in localizations.items():
        first = localization.first_failure
        verdict = f"first failing stage: {first.name} ({first.sublayer})" if first else "no stage fails on its own"
        print(f"\nlocalization {column}: {verdict}\n{localization.table()}")
    if args.report:
        written = write_report(Path(args.report), results, cfg, source, params, seconds, format_table(results), problems,
                               localizations)
        print(f"report written: {', '.join(str(path) for path in written)}")
    if counts[PASS] + counts[FAIL] + counts[ERROR] == 0:
        hint = "; gradient and training cells run with --backward" if args.k and ("grad" in args.k or "train" in args.k) \
            and not args.backward else ""
        print(f"no cell ran (every cell was skipped or filtered out){hint}", file=sys.stderr)
        return 1
    return 1 if counts[FAIL] or counts[ERROR] else 0


def cmd_merge(args: argparse.Namespace) -> int:
    """One matrix from the reports of several shards or machines (conformance.shards)."""
    writable_folder(Path(args.out), "--out")
    try:
        reports, names = read_reports([Path(path) for path in args.reports])
        merged = merge_reports(reports, names)
    except MergeError as error:
        raise UsageError(str(error)) from None
    results = merged["cells"]
    cfg = ModelConfig.from_json(json.dumps(reports[0]["config"]))
    source = {key: value for key, value in reports[0]["source"].items() if key != "shard"}
    problems = format_problems(results)
    print(format_table(results))
    if problems:
        print("\n" + problems)
    for conflict in merged["conflicts"]:
        print(f"CONFLICT {json.dumps(conflict)}")
    counts = summary_counts(results)
    seconds = sum(report.get("wall_seconds") or 0.0 for report in reports)
    written = write_report(Path(args.out), results, cfg, source, reports[0]["params_sha256"], seconds,
                           format_table(results), problems, merged=merged)
    print(f"\n{counts[PASS]} passed, {counts[FAIL] + counts[ERROR]} failed, {counts[SKIP]} skipped, "
          f"{len(merged['conflicts'])} conflicting, from {len(reports)} reports")
    print(f"report written: {', '.join(str(path) for path in written)}")
    return 1 if counts[FAIL] or counts[ERROR] or merged["conflicts"] or counts[PASS] == 0 else 0


def _register_transformers(directory: Path) -> None:
    """The columns that run one model directory's own model: transformers, and onnxruntime-genai
    (its builder's graph). Registered with a callable, so they run in this process (a worker
    process could not be handed the directory by name)."""
    from conformance.adapter import register_backend
    from conformance.backends.genai_backend import GenaiBackend
    from conformance.backends.transformers_backend import TransformersBackend

    if not Path(directory).is_dir():
        raise UsageError(f"--hf {directory}: not a directory")
    register_backend("transformers", lambda: TransformersBackend(directory))
    register_backend("onnxruntime-genai", lambda: GenaiBackend(directory))


# ---- small commands -------------------------------------------------------------------------

def cmd_import(args: argparse.Namespace) -> int:
    """A Hugging Face model directory -> an ordinary weights file."""
    from importers import import_to_file

    imported = import_to_file(args.directory, args.out)
    cfg = imported.config
    print(f"imported {imported.family} from {args.directory}: {cfg.arch}, d_model {cfg.d_model}, {cfg.n_heads} heads, "
          f"{cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, vocabulary {cfg.tgt_vocab_size}, "
          f"{count_params(cfg):,} parameters")
    for note in imported.notes:
        print(f"  note: {note}")
    print(f"wrote {args.out} (sha256 {params_digest(imported.params)}); check it with "
          f"`rosetta check --weights {args.out} --hf {args.directory}`")
    return 0


def cmd_mutations(args: argparse.Namespace) -> int:
    """Run the mutation gallery: every mistake must be caught and localized."""
    from conformance.mutations import MUTATIONS, gallery_table, run_mutation

    cfg = get_preset(args.preset)
    params = conformance_params(cfg, args.seed)
    start = time.perf_counter()
    verdicts = [run_mutation(cfg, params, mutation) for mutation in MUTATIONS]
    table = gallery_table(verdicts)
    print(f"Mutation gallery on {args.preset}: each mistake applied to the numpy-float32 backend, "
          "the golden unchanged\n")
    print(table)
    good = sum(v.caught and v.localized for v in verdicts)
    print(f"\n{good} of {len(verdicts)} mutations caught and localized in {time.perf_counter() - start:.1f} s")
    if args.markdown:
        Path(args.markdown).write_text(f"# Mutation gallery ({args.preset})\n\n{table}\n")
    if args.mistakes:
        from conformance.mutations import mistakes_page

        Path(args.mistakes).write_text(mistakes_page(verdicts, args.preset))
    return 0 if good == len(verdicts) else 1


def cmd_train_parity(args: argparse.Namespace) -> int:
    """Train the golden, PyTorch and JAX side by side; draw the losses and the divergence."""
    from conformance.train_parity import train_parity, write

    cfg = get_preset(args.preset)
    start = time.perf_counter()
    parity = train_parity(cfg, conformance_params(cfg, args.seed), args.steps, backends=args.backends.split(","),
                          dtype=args.dtype, batch=args.batch, length=args.length)
    files = write(parity, args.out, f"{args.preset}: {args.steps} AdamW steps, the frameworks at {args.dtype}")
    print(parity.table())
    print(f"\nloss tolerance {parity.loss_tolerance:.3g} (SPEC §8 at {args.dtype}); {args.steps} steps in "
          f"{time.perf_counter() - start:.1f} s; wrote {', '.join(str(f) for f in files)}")
    return 1 if parity.unavailable else 0


def cmd_backward_page(args: argparse.Namespace) -> int:
    """Rewrite the generated part of docs/backward.md from the code."""
    from conformance.backward_page import backward_page

    current = args.markdown.read_text() if args.markdown.exists() else "# The backward half\n"
    args.markdown.write_text(backward_page(current))
    print(f"wrote {args.markdown}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    """What each framework's own primitives do on the spec's edge cases, measured here."""
    from conformance.probe import probe_table, run_probes

    observed = run_probes()
    table = probe_table(observed)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(f"# Native-behaviour probe\n\nMeasured by `rosetta probe`.\n\n{table}\n")
        devices = ", ".join(dict.fromkeys(device for _, device, _ in observed if device != "-"))
        print(f"wrote {args.markdown}: {len(observed)} observations, devices {devices}")
    return 0


def cmd_gpu(args: argparse.Namespace) -> int:
    """The whole GPU report: matrix, probe and benchmark into one folder (conformance.gpu_job)."""
    from conformance.gpu_job import MATRIX_BACKENDS, MATRIX_PRESETS, run_gpu_job

    return run_gpu_job(args.out, args.device, ["rosetta", *args.argv],
                       presets=tuple(_split(args.presets) or MATRIX_PRESETS),
                       backends=tuple(_split(args.backends) or MATRIX_BACKENDS),
                       bench_preset=None if args.bench_preset == "none" else args.bench_preset,
                       bench_contenders=tuple(_split(args.bench_contenders) or ()))


def cmd_export(args: argparse.Namespace) -> int:
    """Export the graphs, check the forward graph against the golden, optionally write a Triton repository."""
    import numpy as np

    import impl_numpy as golden
    from conformance.cases import SUBLAYERS
    from conformance.tolerance import compare, tolerance
    from export.runner import OnnxTransformer

    cfg, params, _ = _load_model(args)
    writable_folder(args.out, "--out")
    roles = tuple(_split(args.graphs) or ()) or None
    start = time.perf_counter()
    if args.framework == "torch":
        from export.torch_export import export_torch as export
    else:
        from export.jax_export import export_jax as export
    paths = export(cfg, params, args.out, dtype=args.dtype, opset=args.opset, graph_roles=roles)
    print(f"exported from {args.framework} in {time.perf_counter() - start:.1f} s (opset {args.opset}, {args.dtype}):")
    for role, path in paths.items():
        print(f"  {role:18} {path}  {path.stat().st_size / 1e6:8.2f} MB")
    if "forward" in paths:
        model = OnnxTransformer(args.out, device="cpu")
        rng = np.random.default_rng(0)
        tgt = rng.integers(1, cfg.tgt_vocab_size, (2, 5))
        src = rng.integers(1, cfg.src_vocab_size, (2, 7)) if cfg.has_encoder else None
        result = compare(model.forward(src, tgt).astype(np.float64), golden.forward(cfg, params, src, tgt),
                         tolerance(args.dtype, max(cfg.d_model, cfg.d_ff, 100), SUBLAYERS["forward"].depth(cfg)))
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
    start = time.perf_counter()
    tokens = model.greedy_generate(src, prompt_ids=prompt, bos_id=args.bos if cfg.has_encoder else None,
                                   eos_id=args.eos, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - start
    for row in tokens:
        print(" ".join(map(str, row)))
    print(f"{tokens.shape[0]} sequences x {tokens.shape[1]} tokens in {seconds * 1e3:.1f} ms on {model.device} "
          f"(providers {model.providers[0] if isinstance(model.providers[0], str) else model.providers[0][0]})",
          file=sys.stderr)
    if args.placement:
        for role, nodes in model.placement().items():
            print(f"{role:18} " + ", ".join(f"{provider}: {len(names)} nodes" for provider, names in by_provider(nodes).items()),
                  file=sys.stderr)
            if model.device == "cuda":
                for node in nodes:
                    if node.provider == CPU_PROVIDER:
                        print(f"{'':18} on the CPU: {node.name} {node.signature()}", file=sys.stderr)
    return 0


def cmd_refusals(args: argparse.Namespace) -> int:
    """Every bad weights file and bad input of the catalogue through every entry point."""
    from conformance.refusals import consistent, observe_inputs, observe_weights, refusal_table

    start = time.perf_counter()
    backends = tuple(_split(args.backends) or ("golden", "torch", "jax", "onnx"))
    unknown = [b for b in backends if b not in ("golden", "torch", "jax", "onnx")]
    if unknown:
        raise UsageError(f"unknown entry point(s) {', '.join(unknown)}; known: golden, torch, jax, onnx")
    weights = observe_weights(tuple(b for b in backends if b in ("torch", "jax")))
    inputs = observe_inputs(backends)
    table = refusal_table(weights, inputs)
    print(table)
    problems = {**consistent(weights), **consistent(inputs)}
    for case, found in problems.items():
        print(f"PROBLEM {case}:\n  " + "\n  ".join(found))
    ran = [o for o in weights + inputs if o.error != "n/a"]
    print(f"{len(weights + inputs)} observations ({len(ran)} ran), {len(problems)} cases with problems, "
          f"in {time.perf_counter() - start:.1f} s")
    if args.markdown:
        Path(args.markdown).write_text(REFUSALS_PREAMBLE + table)
    return 1 if problems else 0


REFUSALS_PREAMBLE = """# What bad weights and bad inputs get you

Generated by `rosetta refusals --markdown docs/refusals.md` (a test keeps it current). Every case
is made fresh and handed to every entry point; each must refuse it with the same error class and
the same message, before any framework sees it, and the CLI must print that message with exit
code 2 and no traceback. Error classes: WeightsError, InputError and ConfigError are all
SpecError, a ValueError. Paths in messages are shown relative to the file's folder.

What is *accepted* is defined once, in spec/SPEC.md §10 (inputs) and §9 (the weights format):
for instance token ids of any integer dtype, sequences of any length with sinusoidal positions
(only learned positions stop at `max_len`), padding anywhere including a row that is all
padding (its attention rows are zeros, never NaN), and keep-vectors left out (then they come
from `pad_id`). One exception is an export's: a JAX-exported ONNX graph holds a table of
`max_len` positions and its runner refuses longer sequences (docs/onnx.md).

"""


def cmd_bench(args: argparse.Namespace) -> int:
    """Time every contender on the preset's workloads; JSON, Markdown and plots into --out."""
    from benchmarks.run import run_bench, write

    start = time.perf_counter()
    out = writable_folder(Path(args.out), "--out")
    devices = tuple(_split(args.devices) or ("cpu",))
    results = run_bench(args.preset, names=tuple(_split(args.contenders) or ()) or None, devices=devices,
                        matrix_backends=tuple(_split(args.matrix_backends) or ()) if args.matrix_backends != "none" else (),
                        log=lambda line: print(line, file=sys.stderr))
    written = write(results, out)
    print((out / "bench.md").read_text())
    print(f"bench written: {', '.join(map(str, written))} in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_differences(args: argparse.Namespace) -> int:
    """The framework-differences page: source excerpts side by side and the measured differences."""
    from conformance.differences import differences_page

    page = differences_page()
    print(page)
    if args.markdown:
        Path(args.markdown).write_text(page)
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    for name in list_presets():
        cfg = get_preset(name)
        print(f"{name:12} {count_params(cfg):>12,} parameters  {cfg.arch}, d={cfg.d_model}, "
              f"heads={cfg.n_heads}, layers={cfg.n_encoder_layers}+{cfg.n_decoder_layers}")
        if args.verbose:
            print(f"             {describe_preset(name)}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset)
    params = init_params(cfg, args.seed)
    save_weights(args.output, cfg, params)
    print(f"wrote {args.output}: preset {args.preset}, seed {args.seed}, {count_params(cfg):,} parameters, "
          f"sha256 {params_digest(params)}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    cfg, params = load_weights(args.file)
    print(json.dumps({"config": cfg.to_dict(), "parameters": count_params(cfg), "tensors": len(params),
                      "params_sha256": params_digest(params)}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rosetta", description="Transformer Rosetta: one Transformer, "
                                     "four implementations, checked against one golden reference.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="run the conformance matrix against the golden")
    check.add_argument("--preset", default=None, help="preset config with its conformance weights, "
                       "spec.conformance_params (default: tiny)")
    check.add_argument("--weights", type=Path, help="a weights file (config read from it)")
    check.add_argument("--hf", type=Path, help="a Hugging Face model directory: adds the transformers column (and, "
                       "without --weights, imports its weights)")
    check.add_argument("--seed", type=int, default=0, help="weights seed for --preset (default 0)")
    check.add_argument("--backends", help=f"comma-separated (default all: {', '.join(backend_names())})")
    check.add_argument("--dtypes", help=f"comma-separated (default all: {', '.join(DTYPES)})")
    check.add_argument("--devices", help="comma-separated, or auto (default: every device present)")
    check.add_argument("-k", help="only cells whose id contains this (or matches this glob)")
    check.add_argument("--fail-fast", action="store_true", help="stop at the first failure")
    check.add_argument("--backward", action="store_true",
                       help="add the gradient cells grad-<sublayer>-<mask case> (SPEC.md §13) and the training "
                       "cells train_step-* and train_steps-* (§14); not by default: they triple a warm tiny matrix "
                       "(docs/backward.md)")
    check.add_argument("--report", help="write report.json, report.md and heatmap.png into this folder")
    check.add_argument("--shard", help="run the I-th of N deterministic slices of the columns (I/N); "
                                       "`rosetta merge` combines the slices' reports")
    check.add_argument("--localize", action="store_true",
                       help="show the stage-by-stage error table of every column (failing columns always get it)")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.add_argument("--jobs", default="auto",
                       help="worker processes for the columns (default auto: one per core on the CPU, 1 on a GPU)")
    check.set_defaults(handler=cmd_check)
    merge = commands.add_parser("merge", help="one matrix from the reports of several shards or machines")
    merge.add_argument("reports", nargs="+", help="report folders (or report.json files) of `rosetta check --report`")
    merge.add_argument("--out", required=True, help="folder for the merged report.json, report.md and heatmap.png")
    merge.set_defaults(handler=cmd_merge)
    importer = commands.add_parser("import", help="import a Hugging Face model directory (GPT-2, Marian, BART, "
                                   "Llama, Qwen2, Qwen3) into a weights file")
    importer.add_argument("directory", type=Path, help="holds config.json and model.safetensors")
    importer.add_argument("--out", type=Path, required=True, help="the weights file to write (.safetensors)")
    importer.set_defaults(handler=cmd_import)

    mutations = commands.add_parser("mutations", help="run the mutation gallery (proof the harness can fail)")
    mutations.add_argument("--preset", default="tiny")
    mutations.add_argument("--seed", type=int, default=0)
    mutations.add_argument("--markdown", help="also write the table to this Markdown file")
    mutations.add_argument("--mistakes", help="also write the teaching page (docs/mistakes.md) to this file")
    mutations.set_defaults(handler=cmd_mutations)
    parity = commands.add_parser("train-parity", help="train the golden, PyTorch and JAX from the same weights on "
                                 "the same batches; plot the losses and the divergence (SPEC §14)")
    parity.add_argument("--preset", default="char-lm", help="a decoder-only byte model (default char-lm)")
    parity.add_argument("--seed", type=int, default=0)
    parity.add_argument("--steps", type=int, default=200)
    parity.add_argument("--batch", type=int, default=8)
    parity.add_argument("--length", type=int, default=64)
    parity.add_argument("--dtype", default="float32", choices=("float64", "float32", "bfloat16"))
    parity.add_argument("--backends", default="torch,jax")
    parity.add_argument("--out", type=Path, default=Path("reports/train-parity"),
                        help="folder for train-parity.png and train-parity.json (default reports/train-parity)")
    parity.set_defaults(handler=cmd_train_parity)
    page = commands.add_parser("backward-page", help="regenerate the generated part of docs/backward.md")
    page.add_argument("--markdown", type=Path, default=Path("docs/backward.md"))
    page.set_defaults(handler=cmd_backward_page)
    probe = commands.add_parser("probe", help="record what each framework's own primitives do on edge cases")
    probe.add_argument("--markdown", help="also write the table to this Markdown file")
    probe.set_defaults(handler=cmd_probe)
    gpu = commands.add_parser("gpu", help="the whole GPU report: matrix, probe and benchmark into one folder")
    gpu.add_argument("--out", type=Path, default=Path("reports/gpu"),
                     help="parent folder; the report goes into a folder named after the device (default reports/gpu)")
    gpu.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cuda (default), or cpu for the same job on the CPU")
    gpu.add_argument("--presets", default="tiny,char-lm", help="presets of the matrix (default tiny,char-lm)")
    gpu.add_argument("--backends", default="torch,torch-math,jax,jax-math,onnx,onnx-jax",
                     help="backends of the matrix (default: every GPU backend)")
    gpu.add_argument("--bench-preset", default="paper-base", help="preset of the benchmark, or none")
    gpu.add_argument("--bench-contenders", help="default: every contender on the device")
    gpu.set_defaults(handler=cmd_gpu)
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
    generate.set_defaults(handler=cmd_generate)
    refusals = commands.add_parser("refusals", help="every bad weights file and bad input, through every entry point")
    refusals.add_argument("--backends", help="comma-separated entry points (default: golden,torch,jax,onnx)")
    refusals.add_argument("--markdown", help="also write the tables to this Markdown file")
    refusals.set_defaults(handler=cmd_refusals)
    bench = commands.add_parser("bench", help="benchmark every contender (JSON, Markdown and plots)")
    bench.add_argument("--preset", default="tiny",
                       help="tiny (CI smoke run), paper-base, or llama-small (the modern decoder's CPU generation)")
    bench.add_argument("--out", default="reports/bench/tmp", help="folder for bench.json, bench.md, bench.png")
    bench.add_argument("--contenders", help="comma-separated names (default: all)")
    bench.add_argument("--devices", help="cpu and/or cuda: the contenders of each (default: cpu); cuda alone times the GPU workloads (batch 64)")
    bench.add_argument("--matrix-backends", default="numpy-float32,torch,onnx",
                       help="backends whose conformance-matrix wall time is measured (or none)")
    bench.set_defaults(handler=cmd_bench)
    differences = commands.add_parser("differences", help="where the frameworks differ: code side by side, measured")
    differences.add_argument("--markdown", help="also write the page to this Markdown file")
    differences.set_defaults(handler=cmd_differences)
    presets = commands.add_parser("presets", help="list the presets")
    presets.add_argument("-v", "--verbose", action="store_true", help="say where each comes from")
    presets.set_defaults(handler=cmd_presets)
    init = commands.add_parser("init", help="write a preset's deterministic weights to a file")
    init.add_argument("--preset", default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("output", type=Path)
    init.set_defaults(handler=cmd_init)
    info = commands.add_parser("info", help="validate a weights file and show its config")
    info.add_argument("file", type=Path)
    info.set_defaults(handler=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for reports
    if args.command == "check":
        args.preset_given = args.preset is not None
        args.preset = args.preset or "tiny"
    try:
        return args.handler(args)
    except (UsageError, SpecError, ValueError, RuntimeError) as error:
        print(f"rosetta {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: nothing to report
        sys.stderr.close()
        return 1
    except OSError as error:
        print(f"rosetta {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nrosetta {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
