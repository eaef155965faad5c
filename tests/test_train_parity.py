"""`rosetta train-parity` (SPEC §14): the golden, PyTorch and JAX trained side by side from the
same weights on the same batches, the plot and the figures written, and bad requests refused."""

import json

import numpy as np
import pytest

from pages.train_parity import TEXT, text_batches, train_parity
from rosetta.main import main
from spec import conformance_params, get_preset

CHAR_LM = get_preset("char-lm")


def test_the_batches_are_windows_of_the_text():
    tgt_ids, targets = text_batches(CHAR_LM, 3, 2, 16)
    assert tgt_ids.shape == targets.shape == (3, 2, 16)
    assert np.array_equal(tgt_ids[..., 1:], targets[..., :-1])
    assert bytes(tgt_ids[0, 0].astype(np.uint8)).decode() in TEXT


def test_train_parity_draws_its_plot(tmp_path, capsys):
    assert main(["train-parity", "--steps", "6", "--batch", "2", "--length", "16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "parts at step" in out and "torch" in out and "jax" in out
    figures = json.loads((tmp_path / "train-parity.json").read_text())
    assert len(figures["losses"]["golden"]) == 6 and figures["sampled_steps"] == list(range(1, 7))
    for name in ("torch", "jax"):
        assert np.allclose(figures["losses"][name], figures["losses"]["golden"], rtol=1e-4)
        assert 0 < figures["distance_from_golden"][name][-1] < 1e-2
    assert (tmp_path / "train-parity.png").stat().st_size > 10_000


def test_a_float64_run_stays_with_the_golden():
    parity = train_parity(CHAR_LM, conformance_params(CHAR_LM), 3, backends=["torch"], dtype="float64", batch=2,
                          length=8)
    assert parity.parts_at == {"torch": None} and max(parity.distances["torch"]) < 1e-10


@pytest.mark.parametrize("arguments, message", [
    (["--preset", "tiny"], "decoder-only byte model"), (["--steps", "0"], "steps must be a positive integer"),
    (["--length", "1000"], "length must be in"),
])
def test_bad_requests_are_refused(tmp_path, capsys, arguments, message):
    assert main(["train-parity", *arguments, "--out", str(tmp_path)]) != 0
    assert message in capsys.readouterr().err
