"""The matrix across machines without a cluster engine: `rosetta check --shard I/N` runs a
deterministic slice of the columns, and `rosetta merge REPORT...` combines the reports of the
slices, from as many machines, into one matrix (the way PyTorch's and JAX's CI split by device).

A slice is every N-th column, from the I-th, of the plan's columns sorted by (backend, device,
dtype): the same on every machine given the same --backends, --dtypes and --devices, and shards
1..N together are the whole plan, each column once. Each report records the machine that ran it,
and the merged report keeps, for every column, the report and machine it came from.

Merging refuses reports that did not check the same thing: another config, other weights (the
params digest), another spec version or another version of this project. A cell that two reports
both hold is kept once when they agree (status, errors, tolerance) and flagged as a conflict,
which fails the merged matrix, when they do not.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from conformance.harness import CellResult, Plan
from conformance.output.report import format_problems, format_table, matrix_passed, write_report
from spec import ModelConfig

Column = tuple[str, str, str]  # (backend, dtype, device)


class MergeError(ValueError):
    """Reports that cannot be merged into one matrix (the message names the field that differs)."""


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 1 <= I <= N."""
    parts = text.split("/")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"--shard {text!r}: expected I/N, e.g. 1/3")
    index, count = int(parts[0]), int(parts[1])
    if not 1 <= index <= count:
        raise ValueError(f"--shard {text!r}: I must be between 1 and N")
    return index, count


def _ordered(columns: Iterable[Column]) -> list[Column]:
    return sorted(columns, key=lambda column: (column[0], column[2], column[1]))


def shard_plan(plan: Plan, index: int, count: int) -> Plan:
    """The plan's I-th of N slices: its runnable and skipped columns alike."""
    every = _ordered(set(plan.columns) | set(plan.skipped_columns))
    mine = set(every[index - 1::count])
    return replace(plan, columns=[c for c in plan.columns if c in mine],
                   skipped_columns={c: why for c, why in plan.skipped_columns.items() if c in mine})


def cell_from_dict(record: Mapping) -> CellResult:
    """A report.json cell back as a CellResult (infinite errors were written as strings)."""
    def number(value):
        return None if value is None else float(value)

    return CellResult(record["backend"], record["device"], record["dtype"], record["sublayer"], record["mask_case"],
                      record["status"], number(record["max_abs_err"]), number(record["rel_err"]),
                      number(record["tol"]),
                      None if record["worst_index"] is None else tuple(record["worst_index"]),
                      record.get("reason", ""), float(record.get("seconds", 0.0)), record.get("path", ""),
                      record.get("graph", ""), record.get("skip", ""), record.get("left_out", ""),
                      *(None if record.get(key) is None else tuple(tuple(row) for row in record[key])
                        for key in ("tokens", "golden_tokens")), _field(record.get("field")))


def _field(metrics: dict | None) -> dict | None:
    """A cell's field metrics as the cell made them (JSON writes an infinite KL as a string)."""
    if metrics is None:
        return None
    return {key: float(value) if value in ("inf", "nan") else value for key, value in metrics.items()}


def _same_verdict(a: CellResult, b: CellResult) -> bool:
    def close(x, y):
        return x == y or (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=0.0))

    return a.status == b.status and all(close(getattr(a, f), getattr(b, f)) for f in ("max_abs_err", "tol"))


_MUST_AGREE = ("config", "params_sha256", "spec_version", "project_version")


def merge_reports(reports: list[Mapping], names: list[str]) -> dict:
    """One matrix from several report.json contents (names: where each came from, for messages).
    Returns {"cells": [CellResult], "conflicts": [...], "columns": {column: name}, "sources": [...]}."""
    if not reports:
        raise MergeError("no reports to merge")
    first = reports[0]
    for report, name in zip(reports[1:], names[1:]):
        for field in _MUST_AGREE:
            if report.get(field) != first.get(field):
                raise MergeError(f"{name}: its {field} differs from {names[0]}'s ({_short(report.get(field))} vs "
                                 f"{_short(first.get(field))}); only reports of the same check can be merged")
    cells: dict[str, CellResult] = {}
    owner: dict[str, str] = {}
    conflicts = []
    for report, name in zip(reports, names):
        for record in report["cells"]:
            cell = cell_from_dict(record)
            if cell.test_id not in cells:
                cells[cell.test_id], owner[cell.test_id] = cell, name
            elif not _same_verdict(cells[cell.test_id], cell):
                kept = cells[cell.test_id]
                conflicts.append({"cell": cell.test_id, owner[cell.test_id]: _verdict(kept), name: _verdict(cell)})
    columns = {f"{c.backend}/{c.dtype}/{c.device}": owner[c.test_id] for c in cells.values()}
    sources = [{"report": name, "shard": report.get("source", {}).get("shard"), "machine": report.get("machine"),
                "versions": report.get("versions"), "devices": report.get("devices"),
                **({"placements": report["placements"]} if report.get("placements") else {}),
                "wall_seconds": report.get("wall_seconds")} for report, name in zip(reports, names)]
    return {"cells": list(cells.values()), "conflicts": conflicts, "columns": columns, "sources": sources}


def _verdict(cell: CellResult) -> str:
    return cell.status if cell.max_abs_err is None else f"{cell.status} (max|error| {cell.max_abs_err:.3g})"


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def read_reports(paths: list[Path]) -> tuple[list[dict], list[str]]:
    """report.json contents from files or from the folders `rosetta check --report` wrote."""
    reports, names = [], []
    for path in paths:
        file = path / "report.json" if path.is_dir() else path
        if not file.is_file():
            raise MergeError(f"{path}: no report.json there (give the folder --report wrote, or the file)")
        try:
            reports.append(json.loads(file.read_text()))
        except json.JSONDecodeError as error:
            raise MergeError(f"{file}: not JSON ({error})") from None
        if "cells" not in reports[-1] or "params_sha256" not in reports[-1]:
            raise MergeError(f"{file}: not a report written by `rosetta check --report`")
        names.append(str(path))
    return reports, names


@dataclass(frozen=True)
class MergedReport:
    """The merged matrix and what was written of it."""
    cells: list[CellResult]
    conflicts: list[dict]
    report_count: int  # the reports merged
    table: str  # report.format_table of the cells
    problems: str  # report.format_problems of the cells
    written: list[Path]

    @property
    def passed(self) -> bool:
        """At least one cell ran, none failed or errored, no column ran nothing, and no two
        reports disagree."""
        return matrix_passed(self.cells, self.conflicts)


def merge_into_report(paths: Sequence[Path], out: Path) -> MergedReport:
    """One matrix from the reports of several shards or machines: read them (report folders or
    report.json files), merge them (merge_reports) and write the merged report.json, report.md
    and heatmap.png into out. Raises MergeError for reports that do not check the same thing."""
    reports, names = read_reports(list(paths))
    merged = merge_reports(reports, names)
    cells = merged["cells"]
    cfg = ModelConfig.from_json(json.dumps(reports[0]["config"]))
    source = {key: value for key, value in reports[0]["source"].items() if key != "shard"}
    table, problems = format_table(cells), format_problems(cells)
    seconds = sum(report.get("wall_seconds") or 0.0 for report in reports)
    written = write_report(out, cells, cfg, source, reports[0]["params_sha256"], seconds, table, problems,
                           merged=merged)
    return MergedReport(cells, merged["conflicts"], len(reports), table, problems, written)
