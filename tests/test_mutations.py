"""The mutation gallery and localization: every mistake is caught and pointed at."""

from pathlib import Path

import pytest

from conformance.adapter import register_backend, unregister_backend
from conformance.diagnosis.localize import localize_column
from pages.mutations import MUTATIONS, MutantBackend, gallery_table, run_mutation
from rosetta.main import main
from spec import get_preset, conformance_params

TINY = get_preset("tiny")
PARAMS = conformance_params(TINY)


def test_at_least_twelve_distinct_mistakes():
    assert len(MUTATIONS) >= 12 and len({m.name for m in MUTATIONS}) == len(MUTATIONS)


@pytest.fixture(scope="module")
def verdicts():
    """Each mutation's verdict, made once: the parametrized test and both pages' tests read it (a
    module fixture, so that make test keeps them in one worker rather than running the gallery
    three times)."""
    return {}


@pytest.fixture(scope="module")
def goldens():
    """The goldens of the models the mutations run on, kept across them as run_gallery keeps them."""
    return {}


def _verdict(verdicts, goldens, mutation):
    if mutation.name not in verdicts:
        verdicts[mutation.name] = run_mutation(TINY, PARAMS, mutation, goldens)
    return verdicts[mutation.name]


def test_the_training_mistakes_are_in_the_gallery():
    training = [m.name for m in MUTATIONS if m.backward]
    assert {"loss_over_pads", "smoothing_onto_pad", "eps_inside_root", "decay_on_vectors", "tied_table_one_use",
            "finite_fill_gradient", "detached_residual"} <= set(training)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_is_caught_and_localized(verdicts, goldens, mutation):
    verdict = _verdict(verdicts, goldens, mutation)
    assert verdict.caught, f"{mutation.name} was not caught"
    assert verdict.first_sublayer == mutation.expected_sublayer
    assert verdict.first_stage == mutation.expected_stage


def test_the_committed_gallery_matches_the_code(verdicts, goldens):
    committed = Path(__file__).resolve().parents[1] / "docs" / "mutation-gallery.md"
    rows = [line.split("|") for line in committed.read_text().splitlines() if line.startswith("| `")]
    table = gallery_table([_verdict(verdicts, goldens, m) for m in MUTATIONS])
    fresh = [line.split("|") for line in table.splitlines() if line.startswith("| `")]
    verdict_columns = lambda row: [row[1], row[2], row[4], row[6], row[7]]  # noqa: E731 - not the error figures
    assert [verdict_columns(r) for r in rows] == [verdict_columns(r) for r in fresh]


def test_the_committed_mistakes_page_matches_the_code(verdicts, goldens):
    import re

    from pages.mutations import mistakes_page

    committed = (Path(__file__).resolve().parents[1] / "docs" / "mistakes.md").read_text()
    fresh = mistakes_page([_verdict(verdicts, goldens, m) for m in MUTATIONS], "tiny")
    masked = lambda text: re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)  # noqa: E731 - the error figures
    assert masked(committed) == masked(fresh), "regenerate with: rosetta mutations --mistakes docs/mistakes.md"


def test_correct_backends_localize_to_nothing():
    for backend in ("numpy-float32", "torch"):
        localization = localize_column(TINY, PARAMS, backend, "float32", "cpu")
        names = [stage.name for stage in localization.stages]
        assert names == ["src embedding", "encoder.layers.0", "encoder.layers.1", "tgt embedding",
                         "decoder.layers.0", "decoder.layers.1", "head"]
        assert localization.first_failure is None
        # SPEC §8's headroom: a correct implementation stays at or below half the tolerance
        assert all(stage.isolated_ratio < 0.5 and stage.chained_ratio < 0.5 for stage in localization.stages)


def test_decoder_only_stages():
    cfg = get_preset("char-lm").replace(n_decoder_layers=2)
    localization = localize_column(cfg, conformance_params(cfg), "numpy-float32", "float32", "cpu")
    assert [s.name for s in localization.stages] == ["tgt embedding", "decoder.layers.0", "decoder.layers.1",
                                                     "decoder.norm", "head"]


def test_check_localizes_a_failing_column(capsys, tmp_path):
    import json

    mutation = next(m for m in MUTATIONS if m.name == "cross_padding")
    register_backend("mutant", lambda: MutantBackend(mutation))
    try:
        assert main(["check", "--backends", "mutant", "--dtypes", "float32", "-k", "forward-cross_pad",
                     "--report", str(tmp_path)]) == 1
    finally:
        unregister_backend("mutant")
    out = capsys.readouterr().out
    assert "localization mutant/float32/cpu (forward-cross_pad): first failing stage: decoder.layers.0" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["localization"]["mutant/float32/cpu (forward-cross_pad)"]["first_failure"] == "decoder.layers.0"
    assert (tmp_path / "error-growth.png").exists() and "## Localization" in (tmp_path / "report.md").read_text()


def test_cli_mutations(tmp_path, capsys, monkeypatch):
    """The command is a thin layer over run_gallery, whose every mutation the tests above run: two
    go through it here."""
    import pages.mutations

    monkeypatch.setattr(pages.mutations, "MUTATIONS", MUTATIONS[:2])
    assert main(["mutations", "--markdown", str(tmp_path / "gallery.md")]) == 0
    assert "2 of 2 mutations caught and localized" in capsys.readouterr().out
    assert (tmp_path / "gallery.md").read_text().startswith("# Mutation gallery")


def test_probe_runs_every_probe(capsys):
    from pages.probe import PROBES, observation, probe_devices, run_probes

    observed = run_probes(["cpu", "cuda"])
    per_device = [p for p in PROBES if p.per_device]
    assert len(observed) == len(PROBES) + len(per_device) and len(PROBES) >= 10
    assert not [(p.primitive, result) for p, _, result in observed if result.startswith("error")]
    found = {(p.primitive, device): result for p, device, result in observed if p.topic == "fully masked row"}
    assert found["torch nn.MultiheadAttention", "cpu"] == "NaN"  # as tests/test_torch.py pins too
    if not probe_devices()[1:]:  # no GPU here: every per-device probe says so for cuda
        assert all(found[p.primitive, "cuda"].startswith("no cuda device for") for p in per_device
                   if p.topic == "fully masked row")
    assert observation(observed, "float16 attention, one query", "jax.jit(jax.nn.dot_product_attention)", "cpu") \
        .startswith("fails to compile")  # XLA:CPU, the reason impl_jax's explicit path exists
    assert main(["probe"]) == 0 and "| fully masked row | torch nn.MultiheadAttention | cpu | NaN |" in capsys.readouterr().out


def test_a_mutant_that_raises_is_broken_not_caught():
    """A mutant whose replacement no longer fits its function's signature errors in every cell it
    reaches: that catches nothing (the gallery once counted 13 such as caught, after softmax took a
    sink and feed_forward a clamp), so its verdict is BROKEN."""
    from dataclasses import replace

    scale = next(m for m in MUTATIONS if m.name == "scale_d_model")
    stale = replace(scale, name="stale_signature", replacement=lambda q, k, v: q)  # three arguments, not seven
    cfg = get_preset("tiny")
    verdict = run_mutation(cfg, conformance_params(cfg), stale)
    assert verdict.broken and not verdict.caught and "| BROKEN |" in gallery_table([verdict])
