"""The training step (SPEC.md §14): the golden Adam and AdamW written out (impl_numpy/training.py)
against torch.optim and optax configured from the same TrainingConfig, step by step at float64,
and the schedule, the clipping and the defaults that differ between the frameworks.

Each framework's run is held to the spec's step from its own state (conformance.training_cells:
the loss and gradients at its θ_{k−1}, its moments and its update by §14's formulas), at the
float64 bounds of SPEC §8, as the training cells hold every backend. Its distance from the golden's
own run is not a bound: Adam amplifies rounding (g / (|g| + ε) for an entry near ε), so that
distance depends on the BLAS's order of summation, and so on the CPU (3e-12 after step 2 on one,
1.9e-10 on another)."""

import numpy as np
import pytest
import torch

import impl_numpy as golden
import impl_torch.training as torch_training
from conformance.adapter import get_backend
from conformance.cases import Case, training_batches
from conformance.training_cells import (TrainingReference, compare_training, failing_step, gradient_bounds,
                                        step_reference, step_tolerances)
from impl_numpy import backward
from impl_numpy import training as golden_training
from spec.errors import ConfigError
from spec.params import conformance_params
from spec.training import TrainingConfig, decays, learning_rate
from tests.test_backward_model import CONFIGS, _batch

CFG = CONFIGS["encoder-decoder-post-shared-tied"]
PARAMS = conformance_params(CFG, seed=1)
BATCH = _batch(CFG)
STEPS = 3
SETTINGS = {
    "adam, the paper's": TrainingConfig(warmup_steps=2, learning_rate_scale=1.0),
    "adamw, clipped": TrainingConfig(optimizer="adamw", weight_decay=0.3, warmup_steps=2, learning_rate_scale=1.0,
                                     clip_norm=0.5),
}


def _case(training):
    """STEPS steps on the test's batch, as a training case holds its batches; its longest reduction
    the largest of the widths, the vocabulary and the positions a weight's gradient sums over."""
    src, tgt, targets = BATCH
    inputs = {"training": training, "src_ids": np.stack([src] * STEPS), "tgt_ids": np.stack([tgt] * STEPS),
              "targets": np.stack([targets] * STEPS)}
    return Case("train_steps", "pad_right", inputs,
                max(CFG.d_model, CFG.d_ff, CFG.tgt_vocab_size, src.size, tgt.size))


def _checked(trace, training):
    """A run's records against the spec's step from its own state, at float64."""
    case = _case(training)
    return compare_training(trace, TrainingReference(CFG, PARAMS, case.inputs), "float64",
                            **step_tolerances(CFG, case, "float64"))


def _golden_run(training, update=None):
    """The golden's records of STEPS steps (loss, gradients, moments and parameters after each), by
    impl_numpy.training.train_step or a planted `update` of the same signature."""
    p = golden.cast_params(CFG, PARAMS)
    state = golden_training.start_adam(p)
    trace = []
    for _ in range(STEPS):
        loss, grads, p, state = (update or golden_training.train_step)(CFG, training, p, state, *BATCH)
        trace.append({"loss": loss, "gradients": grads, "first_moment": state.m, "second_moment": state.v,
                      "params": p})
    return trace


def _framework_run(backend, training):
    """The framework's own optimizer (impl_torch.training, impl_jax.training) through its runner."""
    found, why = get_backend(backend)
    if found is None:
        pytest.skip(why)
    return found.load(CFG, PARAMS, "float64", "cpu").train("train_steps", _case(training).inputs)


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_frameworks_optimizers_follow_the_spec_step_by_step(setting, backend):
    training = SETTINGS[setting]
    result = _checked(_framework_run(backend, training), training)
    assert result.passed, result.reason
    assert result.ratio < 0.5, result.reason  # the policy's headroom (SPEC §8), as the forward's


def test_b_k_moves_by_rounding_alone():
    """b^K's gradient is identically zero (keys neither rotated nor normed: softmax ignores b^K), so
    the golden's b^K never moves, while a framework's gradient there is rounding r, which Adam turns
    into a step lr · m̂ / (√v̂ + ε). m̂ is a weighted mean of the steps' gradients, each within the
    gradient bound τ of the golden's 0 (SPEC §13), so b^K moves by at most Σ lr · max τ / ε: of
    order 1e-15 / 1e-9 of the rate, where a real gradient moves a parameter by about the rate."""
    training = SETTINGS["adam, the paper's"]
    case = _case(training)
    golden_run = TrainingReference(CFG, PARAMS, case.inputs).golden_run
    theirs = _framework_run("torch", training)
    tolerances = step_tolerances(CFG, case, "float64")
    tau = {}
    for before, batch in zip([{"params": PARAMS}] + theirs[:-1], training_batches(case.inputs)):
        bounds = gradient_bounds(step_reference(CFG, before["params"], batch), tolerances["gradient_tol"],
                                 tolerances["kink_width"])
        tau = {name: max(tau.get(name, 0.0), bound) for name, bound in bounds.items()}
    moved = sum(learning_rate(CFG, training, step) for step in range(1, STEPS + 1))
    names = [n for n in PARAMS if n.endswith("k.bias")]
    assert names
    for name in names:
        assert all(np.array_equal(record["params"][name], PARAMS[name]) for record in golden_run), name
        assert np.abs(theirs[-1]["params"][name] - PARAMS[name]).max() <= moved * tau[name] / training.eps, name


def test_the_schedule_is_the_papers():
    training = TrainingConfig(warmup_steps=4000)
    cfg = CFG.replace(d_model=512, n_heads=8)
    peak = learning_rate(cfg, training, 4000)
    assert peak == pytest.approx(512 ** -0.5 * 4000 ** -0.5)
    assert learning_rate(cfg, training, 1) == pytest.approx(peak / 4000)
    assert learning_rate(cfg, training, 16000) == pytest.approx(peak / 2)
    rates = [learning_rate(cfg, training, s) for s in (1, 1000, 3999, 4000, 4001, 9000)]
    assert rates[:4] == sorted(rates[:4]) and rates[3:] == sorted(rates[3:], reverse=True)


@pytest.mark.parametrize("changes, message", [
    ({"optimizer": "sgd"}, "optimizer must be one of"), ({"beta2": 1.0}, "beta2 must be in"),
    ({"eps": 0.0}, "must be positive"), ({"weight_decay": 0.01}, "0 unless optimizer is adamw"),
    ({"warmup_steps": 0}, "warmup_steps"), ({"clip_norm": -1.0}, "clip_norm"), ({"beta1": float("nan")}, "finite"),
])
def test_bad_settings_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainingConfig(**changes)
    with pytest.raises(ConfigError, match="count from 1"):
        learning_rate(CFG, TrainingConfig(), 0)


def test_decay_is_for_matrices_and_tables():
    assert decays((4, 5)) and decays((11, 8)) and not decays((8,))


def test_the_first_adam_step_moves_each_parameter_by_the_rate():
    """After one step m̂ = g and v̂ = g², so each entry moves by lr · g / (|g| + ε) ≈ lr · sign(g)."""
    training = SETTINGS["adam, the paper's"]
    p = golden.cast_params(CFG, PARAMS)
    _, grads = backward.loss_and_gradients(CFG, p, *BATCH)
    _, _, after, state = golden_training.train_step(CFG, training, p, golden_training.start_adam(p), *BATCH)
    rate = learning_rate(CFG, training, 1)
    name = "decoder.layers.0.ffn.w1.weight"
    np.testing.assert_allclose(p[name] - after[name], rate * grads[name] / (np.abs(grads[name]) + training.eps))
    assert state.step == 1


def _eps_inside_the_root(cfg, training, params, state, *batch):
    """Adam with ε under the root (√(v̂ + ε)), as optax's eps_root or some ports put it."""
    loss, grads = backward.loss_and_gradients(cfg, params, *batch)
    t, rate = state.step + 1, learning_rate(cfg, training, state.step + 1)
    new, m, v = {}, {}, {}
    for name, theta in params.items():
        m[name] = training.beta1 * state.m[name] + (1 - training.beta1) * grads[name]
        v[name] = training.beta2 * state.v[name] + (1 - training.beta2) * grads[name] ** 2
        new[name] = theta - rate * (m[name] / (1 - training.beta1 ** t)) / np.sqrt(v[name] / (1 - training.beta2 ** t) + training.eps)
    return loss, grads, new, golden_training.AdamState(t, m, v)


def test_the_comparison_sees_eps_inside_the_root_and_decay_on_vectors(monkeypatch):
    """Two training mistakes: ε under the root, and AdamW decaying biases and norm parameters. Each
    breaks the step's formula for the parameters at step 1."""
    training = TrainingConfig(warmup_steps=2, learning_rate_scale=1.0, eps=1e-6)
    result = _checked(_golden_run(training, update=_eps_inside_the_root), training)
    assert not result.passed and failing_step(result.reason) == "step 1 params", result.reason
    adamw = SETTINGS["adamw, clipped"]
    monkeypatch.setattr(golden_training, "decays", lambda shape: True)
    result = _checked(_golden_run(adamw), adamw)
    assert not result.passed and failing_step(result.reason) == "step 1 params", result.reason
    assert result.reason.split(": ", 1)[1].split(":")[0].endswith((".scale", ".bias")), result.reason


def test_torch_clip_grad_norm_is_not_the_specs(monkeypatch):
    """torch.nn.utils.clip_grad_norm_ scales by c / (‖g‖ + 1e-6): at float64 the first moment of
    step 1 already breaks the spec's formula, which is why impl_torch clips by the spec's rule."""
    training = SETTINGS["adamw, clipped"]
    monkeypatch.setattr(torch_training, "clip_by_global_norm",
                        lambda parameters, max_norm: torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    result = _checked(_framework_run("torch", training), training)
    assert not result.passed and failing_step(result.reason) == "step 1 first_moment", result.reason


def test_framework_defaults_differ_from_each_other():
    """What a port that trusts the defaults gets: AdamW's weight decay 1e-2 in torch, 1e-4 in
    optax; Adam's ε 1e-8 in both, not the paper's 1e-9; β2 0.999, not 0.98."""
    optax = pytest.importorskip("optax")
    import inspect

    assert torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults["weight_decay"] == 1e-2
    assert inspect.signature(optax.adamw).parameters["weight_decay"].default == 1e-4
    assert torch.optim.Adam([torch.zeros(1, requires_grad=True)]).defaults["eps"] == 1e-8
    assert inspect.signature(optax.adam).parameters["eps"].default == 1e-8
    assert inspect.signature(optax.adam).parameters["b2"].default == 0.999


# ---- mixed precision (SPEC §14.2) ---------------------------------------------------------------

def _training_cells(backend, dtypes, preset="llama-tiny"):
    from conformance.harness import plan_matrix, run_matrix
    from spec import get_preset

    cfg = get_preset(preset)
    plan = plan_matrix(cfg, [backend], dtypes, ["cpu"])
    return {(r.dtype, f"{r.sublayer}-{r.mask_case}"): r
            for r in run_matrix(cfg, conformance_params(cfg), plan, pattern="train_*", backward=True)}


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_half_precision_training_is_mixed_precision(backend):
    """At float16 and bfloat16 a training cell runs as people train: float32 master weights and
    moments, the forward and backward in the half dtype, float16's loss scaled; the update is then
    held to float32's rounding, and every training cell passes (pure half-precision Adam failed
    every one at float16)."""
    cells = _training_cells(backend, ["float16", "bfloat16"])
    assert len(cells) == 8 and all(cell.status == "pass" for cell in cells.values()), \
        {name: cell.reason for name, cell in cells.items() if cell.status != "pass"}


def test_pure_half_precision_adam_fails_saying_so(monkeypatch):
    """The planted mistake: the half-precision model trained as it is, Adam's weights and moments in
    bfloat16. Its first update misses float32's rounding by thousands of bounds, and the cell
    says where the run keeps them."""
    import conformance.backends.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "master_dtype", lambda dtype: dtype)  # the column's own dtype for everything
    cell = _training_cells("torch", ["bfloat16"])["bfloat16", "train_step-none"]
    assert cell.status == "fail" and failing_step(cell.reason) == "step 1 params", cell.reason
    assert "is a bfloat16 number: the run keeps its weights and Adam's moments in bfloat16" in cell.reason


def test_a_step_the_loss_scale_skips_moves_nothing_and_is_said(monkeypatch):
    """float16's dynamic loss scale, started at 2²¹ (the spec's is 2¹⁶): the first steps' scaled
    gradients overflow, so torch.amp's GradScaler skips them (weights, moments, the schedule and the
    bias correction's count unchanged) and halves the scale; the check holds every later step to
    the spec's formulas counted from the steps taken, and says which were skipped. A one-step
    case whose step was skipped took no step: nothing of its update is there to judge, and the
    cell says so, skipped (a column of such cells ran nothing, which fails the check)."""
    import spec.training

    import conformance.backends.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "loss_scaling", lambda dtype: spec.training.LossScaling(scale=2.0**21)
                        if dtype == "float16" else None)
    cells = _training_cells("torch", ["float16"])
    steps = cells["float16", "train_steps-pad_right"]
    assert steps.status == "pass" and "skipped by the loss scale" in steps.reason, steps.reason
    single = cells["float16", "train_step-none"]
    assert single.status == "skip" and single.reason.startswith("not judged: the run took no step; step(s) 1 "
                                                                "skipped"), single.reason
