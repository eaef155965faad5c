"""conformance.diagnosis.explain: a failing whole-model column explained by the spec's omissions. Each
planted port below computes the golden with one feature left out; the explanation must name that
omission, and only it, at the smallest size; an output no omission explains stays unexplained."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapter import NotSupported, register_backend, unregister_backend
from conformance.backends.numpy_backend import golden_output
from conformance.cases import build_case
from conformance.cells import golden_runner_for
from conformance.diagnosis.explain import explain, explain_failures, omission_sets, read_by
from conformance.harness import FAIL, plan_matrix, run_matrix
from spec import conformance_params, get_preset, list_presets
from spec.omissions import OMISSIONS


def _changed(cfg, names):
    for omission in OMISSIONS:
        if omission.name in names:
            cfg = omission.apply(cfg)
    return cfg


class OmittingBackend:
    """A whole-model port that leaves out the named omissions: the golden of the changed config."""

    name = "omitting"
    omissions: tuple[str, ...] = ()
    sublayers = ("forward", "decode", "generate")  # the cases whose computation leaves them out

    def availability(self):
        return None

    def devices(self):
        return ["cpu"]

    def supports(self, dtype, device):
        return None if dtype == "float32" else "float32 only"

    def supports_sublayer(self, sublayer):
        return None if sublayer in ("forward", "decode", "generate") else "whole models only"

    def load(self, cfg, params, dtype, device):
        changed, where = _changed(cfg, self.omissions), self.sublayers

        class Runner:
            def run(self, sublayer, inputs):
                if sublayer not in ("forward", "decode", "generate"):
                    raise NotSupported(sublayer)
                computed = changed if sublayer in where else cfg
                read = read_by(computed, params)
                return golden_output(computed, read, sublayer, inputs, golden_runner_for(computed, read))

        return Runner()


@pytest.fixture
def omitting():
    register_backend("omitting", lambda: OmittingBackend())
    yield OmittingBackend
    OmittingBackend.omissions, OmittingBackend.sublayers = (), ("forward", "decode", "generate")
    unregister_backend("omitting")


def _forward_explanation(preset, names, mask_case="pad_right"):
    cfg = get_preset(preset)
    params = conformance_params(cfg, seed=0)
    case = build_case(cfg, params, "forward", mask_case)
    changed = _changed(cfg, names)
    read = read_by(changed, params)  # a port that ignores the sinks never reads them
    return explain(cfg, params, case, "float32", golden_output(changed, read, "forward", case.inputs,
                                                                golden_runner_for(changed, read)))


@pytest.mark.parametrize("preset, planted", [
    ("mistral-tiny", ("sliding window one key wider (i − W ≤ j)",)),
    ("mistral-tiny", ("sliding window ignored (every layer full)",)),
    ("gemma2-tiny", ("final_softcap ignored",)),
    ("gemma2-tiny", ("attention_softcap ignored", "query_pre_attention_scalar ignored (scores by 1/√d_k)")),
    ("gemma3-tiny", ("local_rope_theta ignored (sliding layers at the global θ and scaling)",)),
    ("llama3-tiny", ("rope scaling ignored (the plain rotary)",)),
    ("stablelm-tiny", ("partial rotary ignored (every dimension rotates)",)),
    ("smollm3-tiny", ("NoPE layers rotated (every layer rotates)",)),
    ("smollm3-tiny", ("NoPE layers placed by SmolLM3's default (every fourth from the fourth)",)),
    ("olmo2-tiny", ("norms placed before the sublayers (Llama's block), not on their outputs",)),
    ("gpt-oss-tiny", ("sinks ignored (a plain softmax)",)),
    ("gpt-oss-tiny", ("clamped SwiGLU read as plain SwiGLU (no clamps, no + 1)", "router bias ignored")),
])
def test_a_planted_omission_is_named_and_only_it(preset, planted):
    found = _forward_explanation(preset, planted)
    assert found.trials[0].ratio > 1.0  # the planted port fails the spec: its error beyond the tolerance
    assert [trial.omissions for trial in found.explained_by] == [planted], found.table()
    assert found.verdict() == "the golden's with " + ", ".join(planted)
    assert "<- explains it" in found.table()


def test_an_output_within_tolerance_needs_no_explanation():
    found = _forward_explanation("gemma2-tiny", ())
    assert found.verdict() == "forward-pad_right passes: nothing to explain" and len(found.trials) == 1


def test_an_output_no_omission_explains_is_said_to_be_unexplained():
    cfg = get_preset("gemma2-tiny")
    params = conformance_params(cfg, seed=0)
    case = build_case(cfg, params, "forward", "pad_right")
    reference = golden_output(cfg, params, "forward", case.inputs, golden_runner_for(cfg, params))
    noisy = reference + np.random.default_rng(0).normal(0, 0.05, reference.shape)
    found = explain(cfg, params, case, "float32", noisy)
    assert found.explained_by == () and found.verdict().startswith("unexplained by the ")
    assert len(found.trials) - 1 == found.sets  # every set was tried before saying so


def test_sets_are_smallest_first_with_one_omission_per_feature():
    cfg = get_preset("gemma3-tiny")
    sets = omission_sets(cfg)
    assert [len(chosen) for chosen in sets] == sorted(len(chosen) for chosen in sets)
    assert all(len({omission.group for omission in chosen}) == len(chosen) for chosen in sets)
    assert not omission_sets(get_preset("tiny").replace(embed_scale=False))


@pytest.mark.parametrize("preset", list_presets())
def test_every_omission_a_set_holds_changes_the_config(preset):
    cfg = get_preset(preset)
    for chosen in omission_sets(cfg, largest=1):
        assert chosen[0].apply(cfg) != cfg, chosen[0].name
    # a longrope's factors are one per rotated pair: ignoring its partial rotary alone is no config
    names = {chosen[0].name for chosen in omission_sets(cfg, largest=1)}
    assert ("partial rotary ignored (every dimension rotates)" in names) == (
        cfg.rope_fraction != 1.0 and (cfg.rope_scaling is None or cfg.rope_scaling.kind != "longrope"))


def test_a_failing_whole_model_column_of_a_run_is_explained(omitting):
    cfg = get_preset("gemma2-tiny")
    params = conformance_params(cfg, seed=0)
    omitting.omissions = ("final_softcap ignored",)
    results = run_matrix(cfg, params, plan_matrix(cfg, ["omitting"], ["float32"], ["cpu"]), pattern="forward-*")
    assert FAIL in {r.status for r in results}
    explanations = explain_failures(cfg, params, results)
    (column, found), = explanations.items()
    assert column.startswith("omitting/float32/cpu (forward-") and found.verdict() == "the golden's with final_softcap ignored"
    assert found.to_dict()["explained_by"] == [["final_softcap ignored"]]
    omitting.omissions = ()
    assert not explain_failures(cfg, params, run_matrix(cfg, params, plan_matrix(cfg, ["omitting"], ["float32"], ["cpu"]),
                                                        pattern="forward-*"))


def test_a_mistake_of_the_cache_alone_is_explained_on_a_decode_case(omitting):
    """A port whose cached steps ignore the window (a bug of record) passes forward; its first
    failing decode case is what is explained."""
    cfg = get_preset("mistral-tiny")
    params = conformance_params(cfg, seed=0)
    omitting.omissions, omitting.sublayers = ("sliding window ignored (every layer full)",), ("decode",)
    results = run_matrix(cfg, params, plan_matrix(cfg, ["omitting"], ["float32"], ["cpu"]), pattern="*")
    assert {r.status for r in results if r.sublayer == "forward"} == {"pass"}
    (column, found), = explain_failures(cfg, params, results).items()
    assert column.startswith("omitting/float32/cpu (decode-")
    assert ("sliding window ignored (every layer full)",) in [trial.omissions for trial in found.explained_by]
