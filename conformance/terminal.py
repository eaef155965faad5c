"""What `rosetta check` shows a person at a terminal, drawn with rich (the progress bars, tables
and summaries this ecosystem's tools use): a live progress bar, the matrix with each cell
colored by its verdict, and the failures in a panel. Output that goes to a file or a pipe stays
the plain text of conformance.report.format_table, which the reports and docs quote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conformance.harness import ERROR, FAIL, PASS, CellResult
from conformance.report import columns_and_rows

_STYLE = {PASS: "green", FAIL: "bold red", ERROR: "bold magenta"}


@contextlib.contextmanager
def progress_bar(console: Console) -> Iterator[Callable[[CellResult, int, int], None]]:
    """A progress callback for run_matrix, drawing a bar, the cells done, failures so far and
    the cell that just finished."""
    failures = 0
    with Progress(TextColumn("[bold]checking"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[failed]}"), TextColumn("[dim]{task.fields[cell]}"),
                  console=console, transient=True) as progress:
        task = progress.add_task("cells", total=None, failed="", cell="")

        def update(result: CellResult, done: int, total: int) -> None:
            nonlocal failures
            failures += result.status in (FAIL, ERROR)
            progress.update(task, completed=done, total=total, cell=escape(result.test_id),
                            failed=f"[bold red]{failures} failed" if failures else "")

        yield update


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
