"""What `rosetta check` shows a person at a terminal, drawn with rich (the progress bars, tables
and summaries this ecosystem's tools use): a live progress bar with the time left, the matrix
with each cell colored by its verdict, and the failures in a panel. Output that goes to a file
or a pipe stays plain text: a line per finished column while it runs (ColumnLines), then
conformance.output.report.format_table, which the reports and docs quote.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from conformance.harness import ERROR, FAIL, PASS, CellResult
from conformance.output.report import columns_and_rows

_STYLE = {PASS: "green", FAIL: "bold red", ERROR: "bold magenta"}


@contextlib.contextmanager
def progress_bar(console: Console) -> Iterator[Callable[[CellResult, int, int], None]]:
    """A progress callback for run_matrix, drawing a bar, the cells done, failures so far and
    the cell that just finished."""
    failures = 0
    with Progress(TextColumn("[bold]checking"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("[dim]left"), TimeRemainingColumn(), TextColumn("{task.fields[failed]}"), TextColumn("[dim]{task.fields[cell]}"),
                  console=console, transient=True) as progress:
        task = progress.add_task("cells", total=None, failed="", cell="")

        def update(result: CellResult, done: int, total: int) -> None:
            nonlocal failures
            failures += result.status in (FAIL, ERROR)
            progress.update(task, completed=done, total=total, cell=escape(result.test_id),
                            failed=f"[bold red]{failures} failed" if failures else "")

        yield update


class ColumnLines:
    """The progress of a run whose output goes to a file or a pipe: one line per finished column,
    with its cells, failures and errors, the time since the run started (this object's making: the
    loading and the references count) and an estimate of the time left (the cells left at the
    pace since the cells were planned). A log of a long check on a real checkpoint shows where it
    is without a terminal."""

    def __init__(self, stream: TextIO):
        self.stream, self.start = stream, time.perf_counter()
        self.planned_at = self.start
        self.cells: dict[tuple[str, str, str], int] = {}
        self.left: dict[tuple[str, str, str], int] = {}
        self.failed: dict[tuple[str, str, str], int] = {}
        self.errors: dict[tuple[str, str, str], int] = {}  # apart: a killed worker's cells are errors, not failures
        self.columns_done = 0

    def planned(self, cells_by_column: Mapping[tuple[str, str, str], int]) -> None:
        """Told by the harness, before the first cell, how many cells each column will run."""
        self.planned_at = time.perf_counter()
        self.cells = {column: count for column, count in cells_by_column.items() if count}
        self.left = dict(self.cells)
        self.failed, self.errors = dict.fromkeys(self.cells, 0), dict.fromkeys(self.cells, 0)

    def __call__(self, result: CellResult, done: int, total: int) -> None:
        column = (result.backend, result.dtype, result.device)
        if column not in self.left:
            return
        self.left[column] -= 1
        self.failed[column] += result.status == FAIL
        self.errors[column] += result.status == ERROR
        if self.left[column]:
            return
        self.columns_done += 1
        now = time.perf_counter()
        elapsed, remaining = now - self.start, (now - self.planned_at) / done * (total - done)
        errors = f", {self.errors[column]} errors" if self.errors[column] else ""
        print(f"column {self.columns_done}/{len(self.left)} done: {'/'.join(column)}, {self.cells[column]} cells, "
              f"{self.failed[column]} failed{errors}; {done}/{total} cells of the run, {clock(elapsed)} elapsed, "
              f"about {clock(remaining)} left", file=self.stream, flush=True)


def clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour."""
    minutes, second = divmod(round(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}" if hours else f"{minute}:{second:02d}"


def _cell(result: CellResult) -> str:
    style = _STYLE.get(result.status, "dim")
    if result.status == PASS:
        return f"[{style}]{result.ratio:.2f}"
    if result.status == FAIL:
        return f"[{style}]FAIL {result.ratio:.3g}" if result.ratio is not None else f"[{style}]FAIL"
    return f"[{style}]ERROR" if result.status == ERROR else "[dim]skip"


def matrix_table(results: list[CellResult], title: str) -> Table:
    """Rows sublayer-mask_case, a column per backend/dtype/device that ran; cells error/tolerance."""
    columns, rows = columns_and_rows(results)
    cells = {(f"{r.sublayer}-{r.mask_case}", (r.backend, r.dtype, r.device)): _cell(r) for r in results}
    table = Table(title=title, caption="max|error| / tolerance: below 1 passes", header_style="bold",
                  show_lines=False, pad_edge=False)
    table.add_column("case", no_wrap=True)
    for backend, dtype, device in columns:
        table.add_column(f"{backend}\n{dtype}\n{device}", justify="right", no_wrap=True)
    for row in rows:
        table.add_row(row, *(cells.get((row, column), "") for column in columns))
    return table


def failure_panel(results: list[CellResult]) -> Panel | None:
    """Every failed or errored cell with its reason; None when there is none."""
    lines = [f"[{_STYLE[r.status]}]{r.status.upper()}[/] {escape(r.test_id)}: {escape(r.reason or '')}" for r in results
             if r.status in (FAIL, ERROR)]
    if not lines:
        return None
    return Panel("\n".join(lines), title=f"{len(lines)} failed", border_style="red", expand=False)
