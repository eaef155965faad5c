"""What `rosetta check --report DIR` writes: report.json, report.md and heatmap.png.

report.json (schema_version 1):
    passed          true when at least one cell ran, none failed or errored, and no column ran nothing
                    (empty_columns)
    counts          {"pass", "fail", "error", "skip"}: cells per status
    empty_columns   {"<backend>/<dtype>/<device>": why}: the columns that had cells and ran none of them
                    for a reason nobody declared up front (matrix_passed)
    spec_version, project_version (this package's), config (ModelConfig fields),
    source          {"preset", "seed"} or {"weights"}, and "shard": "I/N" for a slice (--shard)
    params_sha256   spec.params_digest of the weights every cell used
    machine         {"hostname", "platform", "processor", "python"} of the machine that ran it
                    (null in a merged report: merged_from names each report's, columns says
                    which report each column came from, conflicts lists cells the reports
                    disagree on; any conflict makes passed false)
    versions        python and every framework's installed version (null when absent)
    devices         {"cpu": name, "<backend>/<device>": name reported by the backend}
    tolerance_policy {"formula", "safety"}
    wall_seconds
    attention_paths {"<backend>/<dtype>/<device>": {path: passing cells}} for backends that name the
                    attention each cell ran (jax: jax.nn.dot_product_attention, or explicit and why)
    graphs          {"<backend>/<dtype>/<device>": {graph: cells that ran}} for the ONNX columns: forward,
                    encoder, decoder_step_in_place, or decoder_step with why the in-place step did not serve
    localization    {"<backend>/<dtype>/<device> (forward-<mask case>)": {"first_failure": stage or null,
                    "stages": [{name, sublayer, isolated_ratio, chained_ratio, note}]}} for the columns
                    localized (failing whole-model cells, or every column with --localize)
    explanations    (where a whole-model-only column's forward failed) {"<backend>/<dtype>/<device>
                    (forward-<mask case>)": {"case", "verdict", "sets", "explained_by": [[omission]],
                    "trials": [{"omissions", "ratio"}]}}: the smallest sets of the spec's omissions
                    under which the golden computes what the column did (conformance.diagnosis.explain)
    placements      (a run on a Ray cluster) {"<backend>/<dtype>/<device>": {"node_id", "hostname",
                    "device", "driver", "pid", "gpu_ids", "versions"}}: the node, device, driver and
                    package versions each column ran on (null where its actor died before saying)
    cells           one record per cell: backend, device, dtype, sublayer, mask_case, status,
                    passed, max_abs_err, rel_err, tol, worst_index, reason, seconds, path, graph,
                    skip (a skipped cell's kind: absent, sublayer or refused), left_out (rows not compared)
                    (infinite errors are written as the string "inf")
    routing_margins (a mixture of experts) [{"case", "at_a_tie_by_construction", "decisions", "smallest_margin",
                    "at": {"layer", "row", "position"}, "near_ties": {dtype: decisions within rounding of a
                    tie}}] for each routed case, and each case meant to sit at a tie, that ran
                    (conformance.diagnosis.routing.routing_margins)
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

from conformance.adapter import get_backend
from conformance.cells import (ABSENT, ERROR, FAIL, NO_SUCH_SUBLAYER, NOT_JUDGED, PASS, PLANNED_OUT, REFUSED, TOO_LARGE,
                               SKIP, CellResult)
from conformance.diagnosis.field_metrics import KL_LIMIT, TOP_K, format_field_metrics
from conformance.machine import framework_versions, machine, project_version
from conformance.diagnosis.routing import format_routing_margins
from conformance.tolerance import SAFETY
from spec import SPEC_VERSION, ModelConfig, params_digest


SCHEMA_VERSION = 1


def device_names(results: list[CellResult]) -> dict[str, str]:
    """The CPU, and every (backend, device) that ran, named by its backend when it can."""
    names = {"cpu": platform.processor() or platform.machine()}
    for backend_name, device in dict.fromkeys((r.backend, r.device) for r in results if r.status != SKIP):
        backend, _ = get_backend(backend_name)
        describe = getattr(backend, "device_name", None)
        if describe is not None and device != "cpu":
            names[f"{backend_name}/{device}"] = describe(device)
    return names


def summary_counts(results: list[CellResult]) -> dict[str, int]:
    return {status: sum(r.status == status for r in results) for status in (PASS, FAIL, ERROR, SKIP)}


def empty_columns(results: list[CellResult]) -> dict[str, str]:
    """The columns that had cells and ran none, each with why: every cell skipped, and some of them
    refused (a NotSupported while loading or running, a backend that failed to load) or ran and
    gave nothing to judge (NOT_JUDGED). A column
    whose every skip was declared up front (framework not installed, device not present, a
    dtype or sublayer the backend says it does not run) is not one: its skip line says so."""
    by_column: dict[str, list[CellResult]] = {}
    for r in results:
        by_column.setdefault(f"{r.backend}/{r.dtype}/{r.device}", []).append(r)
    return {column: "; ".join(dict.fromkeys(r.reason for r in cells if r.skip in (REFUSED, NOT_JUDGED)))
            for column, cells in by_column.items()
            if all(r.status == SKIP for r in cells) and any(r.skip in (REFUSED, NOT_JUDGED) for r in cells)}


def matrix_passed(results: list[CellResult], conflicts: list | tuple = ()) -> bool:
    """The verdict: some cell ran, none failed or errored, no column ran nothing (empty_columns),
    and no two merged reports disagree on a cell."""
    counts = summary_counts(results)
    return counts[PASS] > 0 and not counts[FAIL] and not counts[ERROR] and not conflicts and not empty_columns(results)


def format_empty_columns(empty: dict[str, str]) -> str:
    """One line a column that ran nothing, with why."""
    return "\n".join(f"RAN NOTHING {column}: {why}" for column, why in empty.items())


def _cells_per(results: list[CellResult], attribute: str, statuses: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """By column, the cells of these statuses per value of a CellResult attribute that names what
    served them (their attention path, their graph); cells that name nothing are not counted."""
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        if r.status in statuses and (value := getattr(r, attribute)):
            column = counts.setdefault(f"{r.backend}/{r.dtype}/{r.device}", {})
            column[value] = column.get(value, 0) + 1
    return counts


def _format_cells_per(label: str, counts: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"{label} {column}: " + "; ".join(f"{count} cells {value}" for value, count in found.items())
                     for column, found in counts.items())


def attention_paths(results: list[CellResult]) -> dict[str, dict[str, int]]:
    """Passing cells per attention path, by column, for the backends that name their path: a
    cell that ran another backend's program is not evidence for this one's primitive."""
    return _cells_per(results, "path", (PASS,))


def format_attention_paths(paths: dict[str, dict[str, int]]) -> str:
    """One line per column: how many passing cells took each attention path."""
    return _format_cells_per("attention in", paths)


def graphs_served(results: list[CellResult]) -> dict[str, dict[str, int]]:
    """The cells each ONNX graph served (passed or failed), by column: decoder_step_in_place, or
    decoder_step with why the in-place step did not serve."""
    return _cells_per(results, "graph", (PASS, FAIL))


def format_graphs_served(graphs: dict[str, dict[str, int]]) -> str:
    """One line per column: how many cells each graph served."""
    return _format_cells_per("graphs in", graphs)


def columns_and_rows(results: list[CellResult]) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Columns (backend, dtype, device) that ran at least one cell, and the rows 'sublayer-mask_case'
    those columns ran or refused while running; what was left out is said by format_skips."""
    columns = list(dict.fromkeys((r.backend, r.dtype, r.device) for r in results if r.status != SKIP))
    shown = set(columns)
    rows = list(dict.fromkeys(f"{r.sublayer}-{r.mask_case}" for r in results if (r.backend, r.dtype, r.device) in shown
                              and (r.status != SKIP or r.skip in (REFUSED, NOT_JUDGED))))
    return columns, rows


# what a skipped cell's kind says of it, in the order the grouped lines take
SKIP_CAUSES = {PLANNED_OUT: "left out by the plan's budget", TOO_LARGE: "more than the memory holds",
               NO_SUCH_SUBLAYER: "sublayers the column does not run", ABSENT: "not available here",
               REFUSED: "refused by the backend while running",
               NOT_JUDGED: "nothing its rule could judge"}


def format_skips(results: list[CellResult], verbose: bool = False) -> list[str]:
    """The skipped cells: a line per cause (SKIP_CAUSES) with its cells and columns, and the
    reasons where a cause has few; verbose (and the report): a line per column and reason."""
    skipped = [r for r in results if r.status == SKIP]
    if verbose:
        by_reason: dict[tuple[str, str], int] = {}
        for r in skipped:
            key = (f"{r.backend}/{r.dtype}/{r.device}", r.reason)
            by_reason[key] = by_reason.get(key, 0) + 1
        return [f"skipped {column} ({count} cells): {reason}" for (column, reason), count in by_reason.items()]
    lines = []
    for kind, cause in SKIP_CAUSES.items():
        cells = [r for r in skipped if (r.skip or REFUSED) == kind]
        if not cells:
            continue
        columns = list(dict.fromkeys(f"{r.backend}/{r.dtype}/{r.device}" for r in cells))
        reasons = list(dict.fromkeys(r.reason for r in cells))
        named = ", ".join(columns[:4]) + (f" and {len(columns) - 4} more" if len(columns) > 4 else "")
        why = f": {reasons[0]}" if len(reasons) == 1 else f" ({len(reasons)} reasons)"
        lines.append(f"skipped {len(cells)} cell{'s' * (len(cells) != 1)}, {cause}, in {len(columns)} "
                     f"column{'s' * (len(columns) != 1)} ({named}){why}")
    return lines + (["(rosetta check --verbose, or the report, lists every column's)"] if lines else [])


def _cell_text(result: CellResult) -> str:
    if result.status == PASS:
        return f"ok {result.ratio:.2f}"
    if result.status == FAIL:
        return f"FAIL {result.ratio:.3g}" if result.ratio is not None else "FAIL"
    return "ERROR" if result.status == ERROR else "skip"


TABLE_WIDTH = 160  # a plain table wider than this is split into blocks of columns, each beginning with the cases


def format_table(results: list[CellResult], width: int = TABLE_WIDTH) -> str:
    """Rows sublayer-mask_case, columns backend/dtype/device; cells 'ok r' with r = error/tolerance;
    blocks of columns no wider than `width` (but one column a block, however wide), one after another."""
    columns, rows = columns_and_rows(results)
    cells = {(f"{r.sublayer}-{r.mask_case}", (r.backend, r.dtype, r.device)): _cell_text(r) for r in results
             if (r.backend, r.dtype, r.device) in columns}
    texts = [["/".join(column)] + [cells.get((row, column), "") for row in rows] for column in columns]
    cases = ["case"] + rows
    case_width = max(len(text) for text in cases)
    blocks, block, used = [], [], case_width
    for column in texts:
        column_width = max(len(text) for text in column)
        if block and used + 2 + column_width > width:
            blocks.append(block)
            block, used = [], case_width
        block.append(column)
        used += 2 + column_width
    blocks.append(block)
    return "\n\n".join(_table_block(cases, block) for block in blocks)


def _table_block(cases: list[str], columns: list[list[str]]) -> str:
    """The cases' column then `columns` (each its header then its cells), padded, a rule under the headers."""
    table = [cases, *columns]
    widths = [max(len(text) for text in column) for column in table]
    lines = ["  ".join(column[index].ljust(width) for column, width in zip(table, widths)).rstrip()
             for index in range(len(cases))]
    return "\n".join([lines[0], "  ".join("-" * width for width in widths), *lines[1:]])


def format_problems(results: list[CellResult], verbose: bool = True) -> str:
    """A line per failed or errored cell and per cell compared on some rows only, and the skipped
    cells (format_skips: a line per column and reason where verbose, as the report has them, else
    grouped by cause)."""
    lines = []
    for r in results:
        if r.status in (FAIL, ERROR):
            lines.append(f"{r.status.upper()} {r.test_id}: {r.reason}")
        if r.left_out:  # adapter.Partial: some rows were not compared
            lines.append(f"partly compared {r.test_id}: left out {r.left_out}")
    return "\n".join(lines + format_skips(results, verbose))


def write_heatmap(path: Path, results: list[CellResult], title: str) -> bool:
    """log10(max|error| / tolerance) over the matrix: below 0 passes. False when nothing ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    columns, rows = columns_and_rows(results)
    if not columns or not rows:
        return False
    values = np.full((len(rows), len(columns)), np.nan)
    for r in results:
        key = (r.backend, r.dtype, r.device)
        if key in columns and r.ratio is not None:
            ratio = r.ratio if r.status != ERROR else math.inf
            values[rows.index(f"{r.sublayer}-{r.mask_case}"), columns.index(key)] = (
                math.log10(ratio) if ratio > 0 else -8.0)
        elif key in columns and r.status == ERROR:
            values[rows.index(f"{r.sublayer}-{r.mask_case}"), columns.index(key)] = 8.0
    values = np.clip(values, -8.0, 8.0)
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * len(columns), 1.5 + 0.16 * len(rows)))
    colours = plt.get_cmap("RdYlGn_r").with_extremes(bad="lightgrey")
    image = axes.imshow(np.ma.masked_invalid(values), cmap=colours, vmin=-4, vmax=4, aspect="auto")
    axes.set_xticks(range(len(columns)), ["\n".join(c) for c in columns], fontsize=7)
    axes.set_yticks(range(len(rows)), rows, fontsize=6)
    axes.set_title(title, fontsize=9)
    bar = figure.colorbar(image, ax=axes, fraction=0.04)
    bar.set_label("log10(max|error| / tolerance); > 0 fails; grey: skipped", fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_error_growth(path: Path, localizations: dict) -> bool:
    """Per localized column, error / tolerance at each stage, isolated and chained (log scale)."""
    if not localizations:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4))
    for column, found in localizations.items():
        names = [stage.name for stage in found.stages]
        for attribute, style in (("isolated_ratio", "-o"), ("chained_ratio", "--x")):
            values = [getattr(stage, attribute) for stage in found.stages]
            values = [min(v, 1e12) if v is not None and v > 0 else float("nan") for v in values]
            axes.plot(names, values, style, label=f"{column} {attribute.split('_')[0]}")
    axes.axhline(1.0, color="red", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_ylabel("max|error| / tolerance")
    axes.set_title("error through the model, stage by stage (above the red line fails)", fontsize=9)
    axes.tick_params(axis="x", labelrotation=45, labelsize=7)
    axes.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _sources(sources: list[dict]) -> str:
    return ", ".join(f"{source['report']} ({(source['machine'] or {}).get('hostname')})" for source in sources)


def format_placements(placements: dict[str, dict | None]) -> str:
    """One line a column: the node, device and driver that ran it (an executor's placements)."""
    lines = ["where each column ran:"]
    for column, where in placements.items():
        if where is None:
            lines.append(f"  {column}: unknown (its actor died before it said)")
        elif "error" in where:
            lines.append(f"  {column}: unknown ({where['error']})")
        else:
            driver = f", driver {where['driver']}" if where.get("driver") else ""
            lines.append(f"  {column}: {where['hostname']} (node {where['node_id'][:8]}), {where['device']}{driver}")
    return "\n".join(lines)


def generated_text(results: list[CellResult], prompts: Sequence[str],
                   decode: Callable[[Sequence[Sequence[int]]], list[str]]) -> list[dict]:
    """Each prompt of the text generate case with the golden's continuation and each backend's,
    decoded (`decode`: the checkpoint's tokenizer), and where a backend's first differs."""
    cells = [r for r in results if r.tokens is not None and r.golden_tokens is not None]
    if not cells:
        return []
    golden = decode(cells[0].golden_tokens)
    entries = []
    for row, prompt in enumerate(prompts):
        backends = {}
        for cell in cells:
            theirs, ours = cell.tokens[row], cell.golden_tokens[row]
            differs = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
            backends["/".join((cell.backend, cell.dtype, cell.device))] = {
                "text": decode([theirs])[0], "first_difference": differs}
        entries.append({"prompt": prompt, "golden": golden[row], "backends": backends})
    return entries


def format_generated_text(entries: list[dict]) -> str:
    """generated_text as lines: the prompt, the golden's continuation, each backend's (or 'same')."""
    lines = []
    for number, entry in enumerate(entries, start=1):
        width = max(len("golden"), *(len(column) for column in entry["backends"]))
        lines += [f"prompt {number}: {entry['prompt']!r}", f"  {'golden':<{width}}  {entry['golden']!r}"]
        for column, found in entry["backends"].items():
            shown = "same" if found["first_difference"] is None else \
                f"{found['text']!r} (differs from token {found['first_difference'] + 1})"
            lines.append(f"  {column:<{width}}  {shown}")
    return "\n".join(lines)


def field_metrics_table(results: list[CellResult]) -> str:
    """The whole-model cells that ran, our verdict beside the field's metrics and criteria
    (conformance.diagnosis.field_metrics); '' where no cell has them."""
    cells = [{"id": r.test_id, "status": r.status, "field": r.field} for r in results if r.field]
    return format_field_metrics(cells) if cells else ""


def write_report(directory: Path, results: list[CellResult], cfg: ModelConfig, source: dict, params,
                 seconds: float, table: str, problems: str, localizations: dict | None = None, *,
                 merged: dict | None = None, placements: dict | None = None,
                 text: list[dict] | None = None, plan: dict | None = None,
                 explanations: dict | None = None, routing: list[dict] | None = None,
                 quantized: Sequence[dict] = (), quantized_text: str = "") -> list[Path]:
    """Write report.json, report.md and heatmap.png into directory; return the paths written.
    params: the weights, or (a merged report, conformance.output.shards) their digest; merged: the
    merge's conflicts, columns and sources, which also decide `passed`; placements: where each
    column ran, from an executor that spreads them over nodes (the Ray executor's); text: the
    text generate case's continuations, decoded (generated_text); plan: a budgeted plan's
    figures (conformance.plan.budget.BudgetPlan.to_dict), its estimate beside the time taken;
    explanations: the failing whole-model columns' omissions (conformance.diagnosis.explain); routing: a
    mixture of experts' routing margins per case (conformance.diagnosis.routing.routing_margins); quantized:
    the quantized deployments' columns as dicts, quantized_text as text (conformance.deployment.quantized), a
    failing column failing the report."""
    counts = summary_counts(results)
    conflicts = (merged or {}).get("conflicts", [])
    empty = empty_columns(results)
    report = {
        "schema_version": SCHEMA_VERSION,
        "passed": matrix_passed(results, conflicts) and all(column["passed"] for column in quantized),
        "counts": counts,
        "empty_columns": empty,
        "spec_version": SPEC_VERSION,
        "project_version": project_version(),
        "config": cfg.to_dict(),
        "source": source,
        "params_sha256": params if isinstance(params, str) else params_digest(params),
        "machine": None if merged else machine(),
        "versions": framework_versions(),
        "devices": device_names(results),
        "tolerance_policy": {"formula": "SAFETY * sqrt(depth) * (u_storage + u_accumulate * (sqrt(n) + A)) "
                                        "* max(s, max|golden|)", "safety": SAFETY},
        "wall_seconds": round(seconds, 3),
        "attention_paths": attention_paths(results),
        "graphs": graphs_served(results),
        "localization": {column: found.to_dict() for column, found in (localizations or {}).items()},
        **({"explanations": {column: found.to_dict() for column, found in explanations.items()}} if explanations else {}),
        **({"placements": placements} if placements else {}),
        **({"generated_text": text} if text else {}),
        **({"plan": plan} if plan else {}),
        **({"routing_margins": routing} if routing else {}),
        **({"quantized": list(quantized)} if quantized else {}),
        "cells": [r.to_dict() for r in results],
        **({"merged_from": merged["sources"], "columns": merged["columns"], "conflicts": conflicts} if merged else {}),
    }
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "report.json", directory / "report.md"]
    written[0].write_text(json.dumps(report, indent=1) + "\n")
    title = f"{source.get('preset') or source.get('weights')}: error / tolerance per cell"
    has_heatmap = write_heatmap(directory / "heatmap.png", results, title)
    markdown = ["# Conformance report\n", f"- passed: **{report['passed']}** ({counts})",
                *(f"- ran nothing: {column} ({why})" for column, why in empty.items()),
                *([f"- merged from: {_sources(merged['sources'])}", f"- conflicting cells: {len(conflicts)}"]
                  if merged else []),
                f"- config: `{cfg.to_json()}`", f"- source: {source}", f"- wall time: {seconds:.2f} s",
                f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items() if v)}", "",
                "Cells show max|error| / tolerance (below 1 passes).", "", "```", table, "```", "", problems]
    if conflicts:
        markdown += ["", "## Conflicting cells", "", *(f"- {json.dumps(conflict)}" for conflict in conflicts)]
    if paths := format_attention_paths(report["attention_paths"]):
        markdown += ["", "Attention path of the passing cells, where a backend names it (an explicit path is the "
                     "program of the `-math` column, not evidence for the native primitive):", "", "```", paths, "```"]
    if graphs := format_graphs_served(report["graphs"]):
        markdown += ["", "The ONNX graph that served each cell that ran:", "", "```", graphs, "```"]
    if has_heatmap:
        markdown += ["", "![error / tolerance heatmap](heatmap.png)"]
        written.append(directory / "heatmap.png")
    if placements:
        markdown += ["", "## Where each column ran", "", "```", format_placements(placements), "```"]
    if text:
        markdown += ["", "## Generated text (generate-text)", "", "```", format_generated_text(text), "```"]
    if routing:
        markdown += ["", "## Routing margins", "",
                     "Per routed case, the golden's decisions (tokens × MoE layers), the smallest margin p_(k) − p_(k+1) "
                     "and where, and per dtype the decisions within rounding of a tie (margin < 2ρ·max|z|, SPEC §5.14): "
                     "a flip there is the dtype's, and a failing cell replays the golden's routing to tell.", "",
                     "```", format_routing_margins(routing), "```"]
    if quantized:
        markdown += ["", "## Quantized deployments", "",
                     "Each column judged twice (SPEC §15): the implementation, error / tolerance against the golden on "
                     "the weights the deployment stores, dequantized (a failure is the kernel's, the exporter's or the "
                     "dequantization's); and the cost, against the float golden on the original weights, measured per "
                     "real token (KL in nats, top-1 agreement), judged only by a budget (--quant-budget).", "",
                     "```", quantized_text, "```"]
    if field := field_metrics_table(results):
        markdown += ["", "## The field's metrics (whole-model cells)", "",
                     f"Per-token KL(golden ‖ backend), top-1 agreement and top-{TOP_K} containment, and whether each "
                     f"cell would pass MaxText's logit check (every token's KL ≤ {KL_LIMIT:g}, float32 cells) and "
                     f"vLLM's top-{TOP_K} containment. Our verdict is the tolerance policy's.", "", "```", field, "```"]
    for column, found in (localizations or {}).items():
        first = found.first_failure
        markdown += ["", f"## Localization {column}", "",
                     f"First failing stage: **{first.name if first else 'none alone'}**", "", "```", found.table(), "```"]
    for column, found in (explanations or {}).items():
        markdown += ["", f"## What explains {column}", "", found.verdict(), "", "```", found.table(), "```"]
    if write_error_growth(directory / "error-growth.png", localizations):
        markdown += ["", "![error growth](error-growth.png)"]
        written.append(directory / "error-growth.png")
    written[1].write_text("\n".join(markdown) + "\n")
    return written
