"""Bad weights files and bad inputs (pages/refusals.py): every entry point refuses each one
with the same error class and message, the CLI prints it with exit code 2 and no traceback, and
docs/refusals.md is what `rosetta refusals` prints today."""

from pathlib import Path

import pytest

from pages.refusals import (
    BAD_INPUTS,
    BAD_WEIGHTS,
    REFUSALS_PREAMBLE,
    consistent,
    observe_inputs,
    observe_weights,
    refusal_table,
)
from rosetta.main import main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "refusals.md"


@pytest.fixture(scope="module")
def weights_observed():
    return observe_weights(command_line=main)  # the CLI's entry points too, handed in from the floor above


@pytest.fixture(scope="module")
def inputs_observed():
    return observe_inputs()


def test_the_catalogues_are_large_enough():
    assert len(BAD_WEIGHTS) >= 30 and len(BAD_INPUTS) >= 30
    assert len({c.name for c in BAD_WEIGHTS}) == len(BAD_WEIGHTS)
    assert len({c.name for c in BAD_INPUTS}) == len(BAD_INPUTS)


@pytest.mark.parametrize("case", [c.name for c in BAD_WEIGHTS])
def test_bad_weights_refused_alike_everywhere(weights_observed, case):
    seen = [o for o in weights_observed if o.case == case]
    assert len(seen) == 6  # spec, torch, jax, rosetta info / check / export
    assert consistent(seen) == {}


@pytest.mark.parametrize("case", [c.name for c in BAD_INPUTS])
def test_bad_inputs_refused_alike_everywhere(inputs_observed, case):
    seen = [o for o in inputs_observed if o.case == case]
    assert {o.entry_point for o in seen} == {"golden", "torch", "jax", "onnx"}
    assert sum(o.error != "n/a" for o in seen) >= 3
    assert consistent(seen) == {}


def test_the_docs_table_is_current(weights_observed, inputs_observed):
    expected = REFUSALS_PREAMBLE + refusal_table(weights_observed, inputs_observed)
    assert DOCS.read_text() == expected, "regenerate with: rosetta refusals --markdown docs/refusals.md"


def test_consistency_check_can_fail():
    """The checker itself: an accepted input, a wrong message and a disagreement are all reported."""
    from pages.refusals import Observation

    accepted = [Observation("c", "golden", "accepted", "", False)]
    assert "golden: accepted" in consistent(accepted)["c"][0]
    disagree = [Observation("c", "golden", "InputError", "a", True), Observation("c", "torch", "InputError", "b", True)]
    assert "disagree" in consistent(disagree)["c"][0]
    cli = [Observation("c", "golden", "InputError", "a", True), Observation("c", "rosetta info", "_CliRefusal", "z", True)]
    assert "printed 'z'" in consistent(cli)["c"][0]
