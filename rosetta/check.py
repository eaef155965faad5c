"""`rosetta check`, the conformance matrix against the golden, and `rosetta merge`, one matrix
from the reports of several shards or machines (conformance.output.shards)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from conformance.output import terminal
from conformance.adapter import backend_names, importable_by_name
from conformance.check import check_model
from conformance.plan.budget import DEFAULT_BUDGET, BudgetPlan, format_seconds, parse_budget
from conformance.plan.cost import matmul_speed
from conformance.plan.memory import parse_memory
from conformance.cells import ERROR, FAIL, PASS, SKIP
from conformance.executors.local_pool import WorkerPool
from conformance.models import register_model_directory
from conformance.machine import NVIDIA_DRIVER
from conformance.output.report import (attention_paths, empty_columns, field_metrics_table, format_attention_paths,
                                format_empty_columns, format_generated_text, format_graphs_served, format_placements,
                                format_problems, format_table, graphs_served, summary_counts)
from conformance.deployment.quantized import format_quantized, parse_budget as parse_quant_budget
from conformance.diagnosis.routing import format_routing_margins
from conformance.output.shards import MergeError, merge_into_report, parse_shard
from conformance.text import LONG_TEXT, load_tokenizer, read_prompts_file
from conformance.tolerance import DTYPES
from rosetta.arguments import UsageError, comma_list, positive_integer, writable_folder
from spec.errors import WeightsError
from spec.quantization import parse_scheme


def _early_workers(jobs: int | None, backends: list[str] | None, dtypes: list[str] | None,
                   devices: list[str] | None, memory: int | None = None) -> WorkerPool | None:
    """Worker processes started before the model is loaded and the matrix planned, importing the
    frameworks meanwhile (planning imports them here too): ~2 s of a warm check. None where the
    run will be one process: --jobs 1, or a GPU (auto gives one process where any column is on
    a GPU, so none is started where a device other than the CPU is asked for or present); and
    none with --memory and no --jobs, whose workers the plan counts (as many as the columns the
    memory holds at once: conformance.check)."""
    if jobs is None and memory is not None:
        return None
    if jobs is None:
        if (devices and set(devices) != {"cpu"}) or (not devices and NVIDIA_DRIVER.exists()):
            return None
        jobs = os.cpu_count() or 1
    names = [name for name in (backends or backend_names()) if importable_by_name(name)]
    count = min(jobs, len(names) * len(dtypes or DTYPES))  # at most one worker per column
    return WorkerPool(count, preload=names) if count > 1 else None


def _ray_cluster(address: str | None, accelerator: str | None):
    """The Ray executor, connected and pre-flighted; a clear refusal where it cannot be."""
    from conformance.executors.ray_cluster import ClusterMismatch, RayCluster, RayUnavailable

    try:
        return RayCluster(address, accelerator)
    except (RayUnavailable, ClusterMismatch) as error:
        raise UsageError(str(error)) from None


def _print_plan(plan: BudgetPlan) -> None:
    """A budgeted plan, before the run: what it runs and leaves out, and the estimates."""
    print(plan.describe(), flush=True)


def cmd_check(args: argparse.Namespace) -> int:
    # the peer columns' libraries draw progress bars of their own (transformers' "Loading weights"
    # once per case, "Writing model shards"): huggingface_hub's switch turns them off, read by
    # transformers when it is first imported, here and in the workers, which inherit it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.weights and args.preset_given:
        raise UsageError("give either --preset or --weights, not both")
    if args.hf and args.preset_given:
        raise UsageError("--hf runs the Hugging Face model of DIR: give it alone (the weights are DIR's import) "
                         "or with --weights FILE made by `rosetta import`, not with --preset")
    if args.report:
        writable_folder(Path(args.report), "--report")
    if args.hf:
        if not Path(args.hf).is_dir():
            raise UsageError(f"--hf {args.hf}: not a directory")
        register_model_directory(args.hf)
    backends = comma_list(args.backends)
    for column in ("transformers", "onnxruntime-genai"):
        if backends and column in backends and not args.hf:
            raise UsageError(f"the {column} column runs a Hugging Face model directory: give it with --hf DIR")
    if backends:
        unknown = [b for b in backends if b not in backend_names()]
        if unknown:
            raise UsageError(f"unknown backend(s) {', '.join(unknown)}; registered: {', '.join(backend_names())}")
    dtypes = comma_list(args.dtypes)
    if dtypes:
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise UsageError(f"unknown dtype(s) {', '.join(unknown)}; known: {', '.join(DTYPES)}")
    devices = comma_list(args.devices)
    if args.shard:
        try:
            shard = parse_shard(args.shard)
        except ValueError as error:
            raise UsageError(str(error)) from None
    jobs = None if args.jobs == "auto" else positive_integer(args.jobs, "--jobs")
    if args.executor != "ray" and (args.address or args.accelerator):
        raise UsageError("--address and --accelerator name a Ray cluster: give them with --executor ray")
    if args.executor == "ray" and jobs is not None:
        raise UsageError("--jobs counts the local executor's worker processes; on Ray each column group is an actor")
    if args.budget and args.full:
        raise UsageError("--budget chooses the cells that fit a time, --full runs every cell: give one")
    try:
        budget = parse_budget(args.budget) if args.budget else None
        memory = parse_memory(args.memory) if args.memory else None
        schemes = [parse_scheme(name) for name in comma_list(args.quantized)] if args.quantized else []
        quant_budget = parse_quant_budget(args.quant_budget) if args.quant_budget else None
    except (ValueError, WeightsError) as error:
        raise UsageError(str(error)) from None
    for scheme in schemes:
        if scheme.builder != "onnxruntime" and not args.hf:
            who = "onnxruntime-genai's builder" if scheme.builder == "onnxruntime-genai" else "CTranslate2's converter"
            raise UsageError(f"--quantized {scheme.name} is {who}'s model of a Hugging Face directory: give --hf DIR")
    if args.quant_budget and not schemes:
        raise UsageError("--quant-budget is what the --quantized columns may cost: give --quantized SCHEMES")
    prompts = list(args.prompt or []) + (read_prompts_file(args.prompts) if args.prompts else [])
    if prompts:
        if not args.hf:
            raise UsageError("--prompt and --prompts tokenize with the checkpoint's own tokenizer: give --hf DIR")
        load_tokenizer(args.hf)  # refused here, before the model is read, where DIR has none
    executor = _ray_cluster(args.address, args.accelerator) if args.executor == "ray" else None
    if args.budget or ((args.hf or args.weights) and not args.full):
        # this machine's speed, for a plan that fits a budget, measured before the workers start
        # importing their frameworks beside it (a plan made on shared cores chose a third of the cells)
        matmul_speed("float64"), matmul_speed("float32")
    pool = _early_workers(jobs, backends, dtypes, devices, memory) if executor is None else None
    # a person at a terminal gets rich's progress bar and colored table; a file or pipe, plain text
    # and a line per finished column
    if args.quiet:
        showing = contextlib.nullcontext()
    elif sys.stderr.isatty():
        showing = terminal.progress_bar(Console(stderr=True))
    else:
        showing = contextlib.nullcontext(terminal.ColumnLines(sys.stderr))
        # a log's first line, before the minutes a real checkpoint's loading and references can take
        model = args.hf or args.weights or args.preset
        print(f"rosetta check {model}: loading the model, planning its cells and computing the golden's references",
              file=sys.stderr, flush=True)
    with showing as progress:
        run = check_model(preset=args.preset, seed=args.seed, weights=args.weights, hf=args.hf, backends=backends,
                          dtypes=dtypes, devices=devices, shard=shard if args.shard else None, pattern=args.k,
                          fail_fast=args.fail_fast, backward=args.backward, localize_every_column=args.localize,
                          jobs=jobs, executor=executor, pool=pool, progress=progress, prompts=prompts or None,
                          budget=budget, size_aware=not args.full, on_plan=_print_plan, memory=memory,
                          quantized=schemes, quant_budget=quant_budget)
    results, source, seconds = run.results, run.source, run.seconds
    counts = run.counts
    label = source.get("preset") or source.get("weights") or source.get("hf")
    title = f"Conformance of every backend against the golden (impl_numpy, float64) - {label}"
    problems = format_problems(results, verbose=args.verbose)
    if sys.stdout.isatty():
        console = Console()
        console.print(terminal.matrix_table(results, title))
        if (panel := terminal.failure_panel(results)) is not None:
            console.print(panel)
        skipped = [line for line in problems.splitlines() if line.startswith(("skipped ", "(rosetta check --verbose"))]
        if skipped:
            console.print("\n".join(skipped), style="dim", markup=False, highlight=False)
    else:
        print(title)
        print("cells: max|error| / tolerance, below 1 passes\n")
        print(format_table(results))
        if problems:
            print("\n" + problems)
    empty = run.empty_columns
    nothing = f", {len(empty)} column{'s' * (len(empty) != 1)} ran nothing" if empty else ""
    print(f"\n{counts[PASS]} passed, {counts[FAIL] + counts[ERROR]} failed, {counts[SKIP]} skipped{nothing} "
          f"in {seconds:.2f} s")
    if empty:
        print(format_empty_columns(empty))
    if paths := format_attention_paths(attention_paths(results)):
        print(paths)
    if graphs := format_graphs_served(graphs_served(results)):
        print(graphs)
    if run.placements:
        print(format_placements(run.placements))
    if run.plan:
        figures = run.plan_figures
        print(f"\nplan: estimated {format_seconds(run.plan.estimate.seconds)}, took {format_seconds(run.seconds)} "
              f"({figures['took_over_estimate']}x the estimate); {len(run.plan.left_out)} cells left out by the budget "
              "(--full runs them)")
    if "hf" in source and (field := field_metrics_table(results)):
        print(f"\nthe field's metrics (whole-model cells; our verdict is the tolerance policy's):\n{field}")
    if run.routing:
        print(f"\nrouting margins (decisions within rounding of a tie, per dtype; SPEC §5.14):\n"
              f"{format_routing_margins(run.routing)}")
    if run.quantized:
        print("\nquantized deployments (implementation: error / tolerance against the golden on the stored weights; "
              f"cost against the float golden; SPEC §15):\n{format_quantized(run.quantized)}")
    if run.text:
        print(f"\ngenerated text (generate-text):\n{format_generated_text(run.text)}")
    for column, localization in run.localizations.items():
        first = localization.first_failure
        verdict = f"first failing stage: {first.name} ({first.sublayer})" if first else "no stage fails on its own"
        print(f"\nlocalization {column}: {verdict}\n{localization.table()}")
    for column, explanation in run.explanations.items():
        print(f"\nexplanation {column}: {explanation.verdict()}\n{explanation.table()}")
    if args.report:
        written = run.write_report(args.report)
        print(f"report written: {', '.join(str(path) for path in written)}")
    if not run.ran:
        hint = "; gradient and training cells run with --backward" if args.k and ("grad" in args.k or "train" in args.k) \
            and not args.backward else ""
        print(f"no cell ran (every cell was skipped or filtered out){hint}", file=sys.stderr)
        return 1
    return 0 if run.passed else 1


def cmd_merge(args: argparse.Namespace) -> int:
    """One matrix from the reports of several shards or machines (conformance.output.shards)."""
    out = writable_folder(Path(args.out), "--out")
    try:
        merged = merge_into_report([Path(path) for path in args.reports], out)
    except MergeError as error:
        raise UsageError(str(error)) from None
    print(merged.table)
    if merged.problems:
        print("\n" + merged.problems)
    for conflict in merged.conflicts:
        print(f"CONFLICT {json.dumps(conflict)}")
    counts, empty = summary_counts(merged.cells), empty_columns(merged.cells)
    print(f"\n{counts[PASS]} passed, {counts[FAIL] + counts[ERROR]} failed, {counts[SKIP]} skipped, "
          f"{len(merged.conflicts)} conflicting, from {merged.report_count} reports")
    if empty:
        print(format_empty_columns(empty))
    print(f"report written: {', '.join(str(path) for path in merged.written)}")
    return 0 if merged.passed else 1


def add_check(commands: argparse._SubParsersAction) -> None:
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
    check.add_argument("-k", help="only cells whose id contains this (or matches this glob; alternatives joined by |)")
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
    check.add_argument("--prompt", action="append", metavar="TEXT",
                       help="with --hf: real text, tokenized by DIR's tokenizer.json, for the text cases "
                            "(forward-text, decode-text, generate-text and forward-text_long, a prompt of at least "
                            f"{LONG_TEXT} tokens); repeat it for a batch")
    check.add_argument("--prompts", metavar="FILE", help="with --hf: prompts from a file, one per line")
    check.add_argument("--budget", metavar="TIME",
                       help="choose the cells that fit TIME (90s, 10m, 1.5h) by value: the whole model at the "
                            "checkpoint's dtype and float32 first, then the sublayers on the first, a middle and the "
                            "last layer, then the other dtypes and cases (the plan is printed first). Default: "
                            f"{DEFAULT_BUDGET / 60:.0f}m for a model larger than the presets, else every cell")
    check.add_argument("--full", action="store_true", help="run every cell whatever the model's size")
    check.add_argument("--memory", metavar="SIZE",
                       help="the most memory the check may take, its processes together (6G, 512M): columns that "
                            "do not fit beside each other run one after another, one that cannot fit at all is "
                            "skipped with its figures (default: the columns take up to 85%% of the memory available)")
    check.add_argument("--quantized", metavar="SCHEMES",
                       help="add weight-only quantized deployments: our float32 export quantized by onnxruntime's "
                            "MatMulNBitsQuantizer, each judged against the golden on the weights it stores and "
                            "measured against the float golden (SPEC §15); comma-separated schemes, e.g. "
                            "int4,int8-b128,int4-b32-zp-head8 (int4|int8, -b<block size> default 32, -sym|-zp, "
                            "-head<bits>: the head quantized too, -al4: onnxruntime's accuracy_level 4, int8 "
                            "activations), dynamic-int8 (onnxruntime's quantize_dynamic: its cost only), or "
                            "genai-int4 (onnxruntime-genai's builder's -p int4 model of --hf DIR), or "
                            "ctranslate2-int8, ctranslate2-int8_float32 (CTranslate2's, of --hf DIR: its cost only), "
                            "or torchao-int8 (torchao's weight-only int8 of the torch model)")
    check.add_argument("--quant-budget", metavar="BUDGET",
                       help="what the --quantized columns may cost against the float golden, e.g. kl=1e-2,top1=0.99 "
                            "(mean KL per token, share of tokens whose top-1 agrees); without it the cost is reported, "
                            "not judged")
    check.add_argument("--quiet", action="store_true",
                       help="no progress (at a terminal the bar, piped a line per finished column)")
    check.add_argument("--verbose", "-v", action="store_true",
                       help="a line per column and reason for the skipped cells (default: a line per cause; the "
                            "report lists them all)")
    check.add_argument("--jobs", default="auto",
                       help="worker processes for the columns (default auto: one per core on the CPU, 1 on a GPU)")
    check.add_argument("--executor", choices=("local", "ray"), default="local",
                       help="where the columns run: local worker processes (default), or the actors of a Ray "
                       "cluster, placed by the CPU or GPU each column needs (docs/cluster.md)")
    check.add_argument("--address", help="with --executor ray: the cluster to join (auto: the one started on this "
                       "machine by `ray start`; HOST:PORT: its head). Default: a new one-machine cluster")
    check.add_argument("--accelerator", help="with --executor ray: the GPU kind CUDA columns need, e.g. H100 "
                       "(Ray's accelerator_type resource)")
    check.set_defaults(handler=cmd_check)


def add_merge(commands: argparse._SubParsersAction) -> None:
    merge = commands.add_parser("merge", help="one matrix from the reports of several shards or machines")
    merge.add_argument("reports", nargs="+", help="report folders (or report.json files) of `rosetta check --report`")
    merge.add_argument("--out", required=True, help="folder for the merged report.json, report.md and heatmap.png")
    merge.set_defaults(handler=cmd_merge)
