"""What a person at a terminal sees from `rosetta check` (conformance.output.terminal, rich): the
matrix colored by verdict, failures in a panel with their reasons shown literally, a progress
bar that counts failures and shows the time left. Piped output stays plain text (tests/test_conformance.py),
its progress a line per finished column."""

from __future__ import annotations

import io
import re
from dataclasses import replace

import pytest
from rich.console import Console

from conformance.output import terminal
from conformance.cases import case_names
from conformance.harness import ERROR, FAIL, PASS, plan_matrix, run_matrix
from spec import get_preset, conformance_params


@pytest.fixture(scope="module")
def results():
    cfg = get_preset("tiny")
    return run_matrix(cfg, conformance_params(cfg, seed=0), plan_matrix(cfg, ["numpy-float32"], ["float32"], ["cpu"]),
                      pattern="attention-*")


def _render(renderable) -> str:
    console = Console(record=True, width=120, force_terminal=True, color_system="truecolor")
    console.print(renderable)
    return console.export_text()


def test_the_matrix_table(results):
    text = _render(terminal.matrix_table(results, "Conformance - tiny"))
    assert "Conformance - tiny" in text and "numpy-float32" in text and "attention-mask_bhqk" in text
    ratio = next(r for r in results if r.mask_case == "causal").ratio
    assert f"{ratio:.2f}" in text
    assert terminal.failure_panel(results) is None


def test_failures_are_listed_with_literal_reasons(results):
    failed = replace(results[0], status=FAIL, reason="max error at [0, 3] is 2.5e-3 > tolerance [bold]", max_abs_err=1.0)
    errored = replace(results[1], status=ERROR, reason="ValueError: mask [B, K] expected")
    text = _render(terminal.failure_panel([failed, errored, *results[2:]]))
    assert "2 failed" in text
    assert f"FAIL {failed.test_id}: max error at [0, 3] is 2.5e-3 > tolerance [bold]" in text
    assert f"ERROR {errored.test_id}: ValueError: mask [B, K] expected" in text
    table = _render(terminal.matrix_table([failed, errored, *results[2:]], "t"))
    assert "FAIL" in table and "ERROR" in table


def test_the_progress_bar_counts_failures(results):
    screen = io.StringIO()
    console = Console(file=screen, width=160, force_terminal=True)
    with terminal.progress_bar(console) as update:
        for done, result in enumerate(results, start=1):
            update(replace(result, status=FAIL) if done == 2 else result, done, len(results))
    last_frame = screen.getvalue()  # the bar's final frame is drawn before it is erased
    assert f"{len(results)}/{len(results)}" in last_frame and "1 failed" in last_frame
    assert results[-1].test_id in last_frame


def test_piped_progress_is_a_line_per_finished_column(capsys):
    """Output to a file or pipe gets one line as each column finishes: its cells and failures, the
    run's cells done, the time so far and an estimate of the time left; never one per cell."""
    from rosetta.main import main

    code = main(["check", "--preset", "llama-tiny", "--backends", "torch,numpy-float32", "--dtypes", "float32,float16",
                 "-k", "mha-*", "--jobs", "1"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 0
    columns = [line for line in lines if line.startswith("column ")]
    assert len(columns) == 3, lines  # numpy-float32 has no float16 column: skipped, never started
    cells = len([name for name in case_names(get_preset("llama-tiny")) if name[0] == "mha"])
    for number, line in enumerate(columns, start=1):
        assert f"column {number}/3 done:" in line and f", {cells} cells, 0 failed;" in line
        assert f"{number * cells}/{3 * cells} cells of the run" in line
        assert re.search(r"\d+:\d\d elapsed, about \d+:\d\d left$", line), line
    assert columns[-1].endswith("about 0:00 left")


def test_column_lines_count_failures_per_column(results):
    stream = io.StringIO()
    lines = terminal.ColumnLines(stream)
    column = (results[0].backend, results[0].dtype, results[0].device)
    lines.planned({column: len(results), ("torch", "float64", "cpu"): 0})
    for done, result in enumerate(results, start=1):
        lines(replace(result, status=ERROR) if done in (2, 3) else replace(result, status=FAIL) if done == 4
              else result, done, len(results))
        assert stream.getvalue().count("\n") == (done == len(results))  # nothing until the column ends
    # errors apart: a worker killed for memory makes its column's cells errors, which are not failures
    assert stream.getvalue().startswith(f"column 1/1 done: numpy-float32/float32/cpu, {len(results)} cells, 1 failed, "
                                        "2 errors;")


def test_clock():
    assert [terminal.clock(s) for s in (0, 59.6, 61, 3599, 3600, 7325)] == \
        ["0:00", "1:00", "1:01", "59:59", "1:00:00", "2:02:05"]


def test_a_piped_check_says_what_it_is_doing_before_its_first_cell(capsys):
    """Issue 58: piped, the run's first line comes at once and says what the check is doing while it
    loads the model and computes the golden's references (a real checkpoint's take minutes)."""
    from rosetta.main import main

    assert main(["check", "--preset", "tiny", "--backends", "torch", "--dtypes", "float32", "-k", "embedding-none"]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first == ("rosetta check tiny: loading the model, planning its cells and computing the golden's "
                     "references"), first
