"""What a person at a terminal sees from `rosetta check` (conformance.terminal, rich): the
matrix colored by verdict, failures in a panel with their reasons shown literally, a progress
bar that counts failures. Piped output stays plain text (tests/test_conformance.py)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from rich.console import Console

from conformance import terminal
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
