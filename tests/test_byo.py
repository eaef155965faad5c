"""Bring your own implementation: the worked example passes, and mistakes in it are caught."""

import numpy as np
import pytest

from conformance.adapter import register_backend, unregister_backend
from conformance.byo import CustomBackend, map_parameters
from conformance.harness import FAIL, PASS, SKIP, plan_matrix, run_matrix
from examples import nanogpt_style
from spec import WeightsError, get_preset, conformance_params

CHAR_LM = get_preset("char-lm").replace(n_decoder_layers=2)
PARAMS = conformance_params(CHAR_LM, seed=3)


def _run(backend):
    register_backend(backend.name, lambda: backend)
    try:
        return {f"{r.sublayer}-{r.mask_case}": r for r in
                run_matrix(CHAR_LM, PARAMS, plan_matrix(CHAR_LM, [backend.name], ["float32"]))}
    finally:
        unregister_backend(backend.name)


def test_worked_example_conforms():
    results = _run(nanogpt_style.backend("nanogpt-test"))
    ran = [r for r in results.values() if r.status != SKIP]
    assert len(ran) >= 30 and all(r.status == PASS for r in ran), [r.reason for r in ran if r.status != PASS]
    assert results["forward-all_pad"].status == PASS and results["decoder_layer-causal_pad"].status == PASS
    assert results["generate-none"].status == SKIP and "no hook for generate" in results["generate-none"].reason


def test_a_wrong_mapping_is_caught(monkeypatch):
    """q and k swapped inside the fused matrix: every shape still fits, the numbers do not."""
    original = nanogpt_style.parameter_mapping

    def swapped(cfg):
        mapping = original(cfg)
        for i in range(cfg.n_decoder_layers):
            for leaf in ("weight", "bias"):
                names, transform = mapping[f"h.{i}.attn.c_attn.{leaf}"]
                mapping[f"h.{i}.attn.c_attn.{leaf}"] = ([names[1], names[0], names[2]], transform)
        return mapping

    monkeypatch.setattr(nanogpt_style, "parameter_mapping", swapped)
    results = _run(nanogpt_style.backend("nanogpt-swapped"))
    assert results["mha-none"].status == FAIL and results["forward-none"].status == FAIL
    assert results["ffn-none"].status == PASS


def test_map_parameters_reports_every_difference():
    params = {"a.weight": np.zeros((2, 3), np.float32), "b.weight": np.zeros(3, np.float32),
              "c.weight": np.zeros(4, np.float32)}
    mapping = {"x": ("a.weight", "transpose"), "y": ("a.weight", "copy"), "z": ("nope", "copy"),
               "w": (["a.weight", "b.weight"], "copy")}
    with pytest.raises(WeightsError) as error:
        map_parameters(params, mapping, {"x": (3, 2), "y": (3, 2), "v": (1,)})
    text = str(error.value)
    assert "~ y: shape [2, 3] from the mapping, model has [3, 2]" in text
    assert "! z: maps from unknown canonical name(s) nope" in text
    assert "! w: transform 'copy' with 2 name(s)" in text
    assert "- canonical b.weight is not used" in text and "- canonical c.weight is not used" in text
    assert "+ your v is not filled by the mapping" in text
    assert "~ x" not in text and "+ x" not in text and "! x" not in text  # x fits: nothing said of it


def test_map_parameters_stack_fuses_by_rows():
    q, k = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    fused = map_parameters({"q": q, "k": k}, {"qk": (["q", "k"], "stack")}, {"qk": (6, 2)})["qk"]
    assert np.array_equal(fused, np.concatenate([q.T, k.T]))


def test_custom_backend_refuses_unknown_hooks():
    with pytest.raises(ValueError, match="unknown sublayer.*attn"):
        CustomBackend("x", lambda *a: None, {"attn": lambda m, i: None})
