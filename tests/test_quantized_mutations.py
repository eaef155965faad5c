"""The quantized deployment's mistakes (pages.quantized_mutations): each planted in llama-tiny's int4
export, in the kernel or in the export, caught by the check it belongs to and localized to its
parameter; the deployment without a mistake is caught by none."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from pages.quantized_mutations import (QUANTIZED_MISTAKES, QuantizedMistake, quantized_gallery_table,  # noqa: E402
                                       run_quantized_gallery)
from rosetta.main import main  # noqa: E402


@pytest.fixture(scope="module")
def verdicts():
    return {verdict.mistake.name: verdict for verdict in run_quantized_gallery()}


def test_the_gallery_holds_every_mistake_the_issue_names():
    names = {mistake.name for mistake in QUANTIZED_MISTAKES}
    assert {"zero_point_off_by_one", "scales_wrong_axis", "block_size_mismatched", "nibbles_swapped",
            "layer_left_float", "head_int4"} <= names and len(names) == len(QUANTIZED_MISTAKES)
    assert {mistake.where for mistake in QUANTIZED_MISTAKES} == {"kernel", "export"}


@pytest.mark.parametrize("mistake", QUANTIZED_MISTAKES, ids=[mistake.name for mistake in QUANTIZED_MISTAKES])
def test_a_quantized_mistake_is_caught_and_localized(verdicts, mistake):
    verdict = verdicts[mistake.name]
    assert verdict.caught and verdict.named == mistake.expected, (verdict.named, verdict.stored, verdict.refused)
    if mistake.where == "kernel":  # the implementation reference sees it: beyond its tolerance
        assert verdict.implementation > 1 and verdict.first_product == mistake.expected
    elif not verdict.refused:  # the kernel computes what the golden reads: only the stored check can see it
        assert verdict.implementation <= 1 and verdict.first_product is None and verdict.stored


def test_the_deployment_without_a_mistake_is_caught_by_nothing():
    verdict, = run_quantized_gallery([QuantizedMistake("none", "no mistake", "export", None, "-")])
    assert not verdict.caught and verdict.implementation <= 1 and verdict.named is None  # within its tolerance


def test_the_committed_page_matches_the_code(verdicts):
    committed = Path(__file__).resolve().parents[1] / "docs" / "quantized-mutations.md"
    columns = lambda line: [cell.strip() for cell in line.split("|")][1:4] + line.split("|")[-3:-1]  # noqa: E731
    rows = [columns(line) for line in committed.read_text().splitlines() if line.startswith("| `")]
    fresh = quantized_gallery_table([verdicts[mistake.name] for mistake in QUANTIZED_MISTAKES])
    assert rows == [columns(line) for line in fresh.splitlines() if line.startswith("| `")], \
        "regenerate with: rosetta mutations --quantized --markdown docs/quantized-mutations.md"


def test_rosetta_mutations_quantized(capsys):
    assert main(["mutations", "--quantized"]) == 0
    assert f"{len(QUANTIZED_MISTAKES)} of {len(QUANTIZED_MISTAKES)} mistakes caught and localized" in \
        capsys.readouterr().out
    assert main(["mutations", "--quantized", "--preset", "tiny"]) == 2
    assert "it takes no --preset" in capsys.readouterr().err
