"""The ``rosetta`` command (also ``python -m conformance``).

    rosetta check [--preset tiny | --weights FILE] [--backends a,b] [--dtypes ...] [--devices ...]
                  [-k FILTER] [--fail-fast] [--report DIR]
    rosetta presets
    rosetta init --preset NAME [--seed N] OUT.safetensors
    rosetta info FILE.safetensors

Exit codes: 0 every cell that ran passed, 1 a cell failed (or none ran), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from conformance.adapter import backend_names
from conformance.harness import ERROR, FAIL, PASS, SKIP, CellResult, plan_matrix, run_matrix
from conformance.report import columns_and_rows, summary_counts, write_report
from conformance.tolerance import DTYPES
from spec import (
    SpecError,
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
    cfg = get_preset(args.preset)
    return cfg, init_params(cfg, args.seed), {"preset": args.preset, "seed": args.seed}


def _progress(result: CellResult, done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {result.test_id[:60]:<60}")
    if done == total:
        sys.stderr.write("\r" + " " * (width + 75) + "\r")
    sys.stderr.flush()


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
    """Localize each column whose whole-model cells failed (every column with --localize)."""
    from conformance.localize import WHOLE_MODEL, localize_column

    failing: dict[tuple[str, str, str], str] = {}
    for r in results:
        column = (r.backend, r.dtype, r.device)
        if r.status == SKIP:
            continue
        if every_column:
            failing.setdefault(column, "pad_right")
        if r.sublayer in WHOLE_MODEL and r.status in (FAIL, ERROR):
            failing[column] = r.mask_case if r.sublayer == "forward" else failing.get(column, "pad_right")
    localizations = {}
    for (backend, dtype, device), mask_case in failing.items():
        if cfg.has_encoder or mask_case not in ("cross_pad", "lq_ne_lk"):
            localizations[f"{backend}/{dtype}/{device} (forward-{mask_case})"] = localize_column(
                cfg, params, backend, dtype, device, mask_case)
    return localizations


def cmd_check(args: argparse.Namespace) -> int:
    if args.weights and args.preset_given:
        raise UsageError("give either --preset or --weights, not both")
    backends = _split(args.backends)
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
    cfg, params, source = _load_model(args)
    start = time.perf_counter()
    plan = plan_matrix(cfg, backends, dtypes, devices)
    show_progress = sys.stderr.isatty() and not args.quiet
    results = run_matrix(cfg, params, plan, pattern=args.k, fail_fast=args.fail_fast,
                         progress=_progress if show_progress else None)
    seconds = time.perf_counter() - start
    counts = summary_counts(results)
    label = source.get("preset") or source.get("weights")
    print(f"Conformance of every backend against the golden (impl_numpy, float64) - {label}")
    print("cells: max|error| / tolerance, below 1 passes\n")
    print(format_table(results))
    problems = format_problems(results)
    if problems:
        print("\n" + problems)
    print(f"\n{counts[PASS]} passed, {counts[FAIL] + counts[ERROR]} failed, {counts[SKIP]} skipped "
          f"in {seconds:.2f} s")
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
        print("no cell ran (every cell was skipped or filtered out)", file=sys.stderr)
        return 1
    return 1 if counts[FAIL] or counts[ERROR] else 0


# ---- small commands -------------------------------------------------------------------------

def cmd_mutations(args: argparse.Namespace) -> int:
    """Run the mutation gallery: every mistake must be caught and localized."""
    from conformance.mutations import MUTATIONS, gallery_table, run_mutation

    cfg = get_preset(args.preset)
    params = init_params(cfg, args.seed)
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
    return 0 if good == len(verdicts) else 1


def cmd_probe(args: argparse.Namespace) -> int:
    """What each framework's own primitives do on the spec's edge cases, measured here."""
    from conformance.probe import probe_table, run_probes

    table = probe_table(run_probes())
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(f"# Native-behaviour probe\n\nMeasured by `rosetta probe`.\n\n{table}\n")
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
    check.add_argument("--preset", default=None, help="preset config with init_params (default: tiny)")
    check.add_argument("--weights", type=Path, help="a weights file (config read from it)")
    check.add_argument("--seed", type=int, default=0, help="init seed for --preset (default 0)")
    check.add_argument("--backends", help=f"comma-separated (default all: {', '.join(backend_names())})")
    check.add_argument("--dtypes", help=f"comma-separated (default all: {', '.join(DTYPES)})")
    check.add_argument("--devices", help="comma-separated, or auto (default: every device present)")
    check.add_argument("-k", help="only cells whose id contains this (or matches this glob)")
    check.add_argument("--fail-fast", action="store_true", help="stop at the first failure")
    check.add_argument("--report", help="write report.json, report.md and heatmap.png into this folder")
    check.add_argument("--localize", action="store_true",
                       help="show the stage-by-stage error table of every column (failing columns always get it)")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    check.set_defaults(handler=cmd_check)
    mutations = commands.add_parser("mutations", help="run the mutation gallery (proof the harness can fail)")
    mutations.add_argument("--preset", default="tiny")
    mutations.add_argument("--seed", type=int, default=0)
    mutations.add_argument("--markdown", help="also write the table to this Markdown file")
    mutations.set_defaults(handler=cmd_mutations)
    probe = commands.add_parser("probe", help="record what each framework's own primitives do on edge cases")
    probe.add_argument("--markdown", help="also write the table to this Markdown file")
    probe.set_defaults(handler=cmd_probe)
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
    if args.command == "check":
        args.preset_given = args.preset is not None
        args.preset = args.preset or "tiny"
    try:
        return args.handler(args)
    except (UsageError, SpecError, ValueError) as error:
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
