"""Mistakes planted in the framework implementations themselves, one at a time: the default run
(`rosetta check --preset tiny` on its conformance weights) fails cells of the column where each is
planted. Before the conformance weights, every one of these passed all 87 tiny float32 cells.

The gallery (tests/test_mutations.py) plants mistakes in the numpy-float32 backend; these are the
same kinds of mistake written in torch and JAX code, as a user's port would have them, and in the
ONNX graphs exported from such a torch model (with the onnxruntime runner's own generation loop).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import impl_torch.model as torch_model
from conformance.cells import KeptGolden
from conformance.harness import FAIL, PASS, plan_matrix, run_matrix
from spec import conformance_params, get_preset

TINY = get_preset("tiny")
PARAMS = conformance_params(TINY)
GOLDEN = KeptGolden(TINY, PARAMS)  # every planted run is judged against the same references


def _torch_linear_without_bias(self, x):
    return F.linear(x, self.weight)


def _torch_layer_norm_without_parameters(x, scale, bias, eps):
    return F.layer_norm(x, x.shape[-1:], None, None, eps)


def _torch_layer_norm_without_bias(x, scale, bias, eps):
    return F.layer_norm(x, x.shape[-1:], scale, None, eps)


def _without_eos(generate):
    def generate_ignoring_eos(model, src_ids=None, *, eos_id=None, **options):
        return generate(model, src_ids, eos_id=None, **options)
    return generate_ignoring_eos


def _plant_torch(monkeypatch, mistake):
    if mistake == "linear_without_bias":
        monkeypatch.setattr(torch.nn.Linear, "forward", _torch_linear_without_bias)
    elif mistake == "norm_without_parameters":
        monkeypatch.setattr(torch_model, "layer_norm", _torch_layer_norm_without_parameters)
    elif mistake == "norm_without_bias":
        monkeypatch.setattr(torch_model, "layer_norm", _torch_layer_norm_without_bias)
    elif mistake == "generation_ignores_eos":
        monkeypatch.setattr(torch_model, "greedy_generate", _without_eos(torch_model.greedy_generate))


def _plant_jax(monkeypatch, mistake):
    import jax.numpy as jnp
    from flax import nnx

    import impl_jax.model as jax_model

    if mistake == "linear_without_bias":
        monkeypatch.setattr(nnx.Linear, "__call__", lambda self, x: jnp.matmul(x, self.kernel[...],
                                                                                precision=self.precision))
    elif mistake == "norm_without_parameters":
        original = jax_model.layer_norm
        monkeypatch.setattr(jax_model, "layer_norm", lambda x, scale, bias, eps: original(x, 1.0, 0.0, eps))
    elif mistake == "norm_without_bias":
        original = jax_model.layer_norm
        monkeypatch.setattr(jax_model, "layer_norm", lambda x, scale, bias, eps: original(x, scale, 0.0, eps))
    elif mistake == "generation_ignores_eos":
        monkeypatch.setattr(jax_model, "greedy_generate", _without_eos(jax_model.greedy_generate))


MISTAKES = ["linear_without_bias", "norm_without_parameters", "norm_without_bias", "generation_ignores_eos"]
# the sublayer that must fail for each, wherever the mistake sits
FAILS_AT = {"linear_without_bias": "mha", "norm_without_parameters": "norm", "norm_without_bias": "norm",
            "generation_ignores_eos": "generate"}


@pytest.fixture
def fresh_jax():
    """JAX keeps traced programs per function in memory: a program traced before a mistake was
    planted (or with it) must not be reused by the next test."""
    jax = pytest.importorskip("jax")
    jax.clear_caches()
    yield
    jax.clear_caches()


def _failures(backend, pattern=None):
    results = run_matrix(TINY, PARAMS, plan_matrix(TINY, [backend], ["float32"], ["cpu"]), pattern=pattern,
                         kept_golden=GOLDEN)
    assert results, "no cell ran"
    return {r.sublayer for r in results if r.status == FAIL}, [r for r in results if r.status not in (PASS, FAIL)]


@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{m}-float32-torch-cpu" for m in MISTAKES])
def test_a_mistake_planted_in_torch_fails_the_default_run(monkeypatch, mistake):
    _plant_torch(monkeypatch, mistake)
    failed, others = _failures("torch")  # the whole default column: 96 cells
    assert FAILS_AT[mistake] in failed, f"{mistake}: failing sublayers {sorted(failed)}"
    assert not others, [f"{r.test_id}: {r.status} {r.reason}" for r in others]


@pytest.mark.slow
@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{m}-float32-jax-cpu" for m in MISTAKES])
def test_a_mistake_planted_in_jax_fails_the_default_run(monkeypatch, fresh_jax, mistake):
    _plant_jax(monkeypatch, mistake)
    # the cells that must fail, and the whole-model ones, rather than the column's every program
    failed, others = _failures("jax", f"{FAILS_AT[mistake]}-*")
    assert FAILS_AT[mistake] in failed, f"{mistake}: failing sublayers {sorted(failed)}"
    assert not others, [f"{r.test_id}: {r.status} {r.reason}" for r in others]


# One model mistake, exported afresh: whichever mistake the torch model carries, the graph traces it
# and the column's forward cells compare it alike. The other two model mistakes are held to the torch
# column (its whole default run) and the JAX column above. The forward cells read the forward graph
# alone, so that one is exported (6 s, where tiny's four graphs take 20 s).
ONNX_MISTAKES = ["linear_without_bias", "generation_ignores_eos"]


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ONNX_MISTAKES, ids=[f"{m}-float32-onnx-cpu" for m in ONNX_MISTAKES])
def test_a_mistake_planted_in_the_onnx_column_fails_the_default_run(monkeypatch, tmp_path, mistake):
    """A model mistake is exported with the graph: the torch model is planted, then exported
    afresh. Generation runs in the onnxruntime runner's own loop, so ignoring eos_id is planted there."""
    pytest.importorskip("onnxruntime")
    import export.runner as runner

    if mistake == "generation_ignores_eos":
        generate = runner.OnnxTransformer.greedy_generate
        monkeypatch.setattr(runner.OnnxTransformer, "greedy_generate", _without_eos(generate))
    else:
        from conformance.backends import onnx_backend
        from export.exporters import export_model

        _plant_torch(monkeypatch, mistake)

        def planted_export(cfg, params, **options):  # the export cache keys the source files, not a monkeypatch
            if not (tmp_path / "manifest.json").exists():
                export_model(cfg, params, tmp_path, **options, graph_roles=("forward",))
            return tmp_path

        monkeypatch.setattr(onnx_backend, "exported", planted_export)
    # the column runs the whole-model cases: a model mistake fails the forward cases
    failed, others = _failures("onnx", "generate-*" if mistake == "generation_ignores_eos" else "forward-*")
    assert ("generate" if mistake == "generation_ignores_eos" else "forward") in failed, sorted(failed)
    assert not others, [f"{r.test_id}: {r.status} {r.reason}" for r in others]


def test_the_paper_initialisation_hides_these_mistakes(monkeypatch):
    """Why the matrix runs on conformance weights: on init_params (zero biases, unit scales) the
    same planted mistakes pass every cell of the forward cases."""
    from spec import init_params

    _plant_torch(monkeypatch, "linear_without_bias")
    results = run_matrix(TINY, init_params(TINY), plan_matrix(TINY, ["torch"], ["float32"], ["cpu"]),
                         pattern="forward-*")
    assert results and all(r.status == PASS for r in results)
    assert np.isfinite([r.max_abs_err for r in results]).all()
