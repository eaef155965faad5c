"""The training step (SPEC.md §14): the golden Adam and AdamW written out (impl_numpy/training.py)
against torch.optim and optax configured from the same TrainingConfig, step by step at float64,
and the schedule, the clipping and the defaults that differ between the frameworks."""

import numpy as np
import pytest
import torch

import impl_numpy as golden
import impl_torch.training as torch_training
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
    "adam, the paper's": TrainingConfig(warmup_steps=2, learning_rate_scale=20.0),
    "adamw, clipped": TrainingConfig(optimizer="adamw", weight_decay=0.3, warmup_steps=2, learning_rate_scale=20.0,
                                     clip_norm=0.5),
}


def _golden_run(training, steps=STEPS, update=None):
    """(losses, parameters after each step, the state after step 1)."""
    p = golden.cast_params(CFG, PARAMS)
    state = golden_training.start_adam(p)
    losses, history, first = [], [], None
    for _ in range(steps):
        loss, _, p, state = (update or golden_training.train_step)(CFG, training, p, state, *BATCH)
        losses.append(loss)
        history.append(p)
        first = first or state
    return losses, history, first


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _assert_steps_agree(theirs, history, training):
    """Every parameter after step 1 to 1e-13 and after step 3 to 1e-10 (the error grows: measured
    2e-16, then 3e-12 at step 2, on this batch), but b^K. Its gradient is identically zero, so the
    golden's b^K never moves, while a framework's gradient there is rounding r, which Adam divides
    by its own size plus ε and turns into a step of lr · r / (r + ε). r is float64 rounding of a
    sum of terms near 0.1 (seen: 1e-18 to 3e-15, a drift of 3e-6 · Σ lr), so the bound 1e-4 · Σ lr
    passes r below 1e-13 and fails a real gradient above it."""
    moved = sum(learning_rate(CFG, training, step) for step in range(1, STEPS + 1))
    for step, bound in zip(range(STEPS), (1e-13, 1e-10, 1e-10)):
        worst = max(_relative(theirs[step][n], history[step][n]) for n in PARAMS if not n.endswith("k.bias"))
        assert worst < bound, f"step {step + 1}: {worst:.2e}"
    for name in (n for n in PARAMS if n.endswith("k.bias")):
        assert np.all(history[-1][name] == PARAMS[name])
        assert np.abs(theirs[-1][name] - PARAMS[name]).max() < moved * 1e-4, name


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


def _torch_run(training):
    from impl_torch.model import Transformer, _linear_weight_names

    model = Transformer.from_params(CFG, PARAMS, dtype=torch.float64)
    optimizer, schedule = torch_training.make_optimizer(model, training)
    transposed = _linear_weight_names(model)

    def canonical(name, value):
        array = value.detach().numpy().copy()  # the optimizer updates in place
        return array.T if name in transposed else array

    losses, history, moments = [], [], None
    for _ in range(STEPS):
        losses.append(torch_training.train_step(CFG, training, model, optimizer, schedule, *BATCH)[0])
        named = dict(model.named_parameters())
        history.append({n: canonical(n, v) for n, v in named.items()})
        moments = moments or {n: canonical(n, optimizer.state[v]["exp_avg"]) for n, v in named.items()}
    return losses, history, moments


def _jax_run(training):
    jax = pytest.importorskip("jax")

    from impl_jax.model import Transformer, _variable
    from impl_jax.training import make_optimizer, start, train_step

    with jax.enable_x64(True):
        model = Transformer.from_params(CFG, PARAMS, dtype="float64", attention="math")
        optimizer = make_optimizer(CFG, training)
        state = start(model, optimizer)
        losses, history = [], []
        for _ in range(STEPS):
            loss, _, state = train_step(CFG, model, optimizer, state, *BATCH)
            losses.append(loss)
            history.append({n: np.asarray(_variable(model, n)[...]) for n in PARAMS})
    return losses, history


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_torch_optim_agrees_step_by_step(setting):
    training = SETTINGS[setting]
    losses, history, first = _golden_run(training)
    their_losses, their_history, their_moments = _torch_run(training)
    np.testing.assert_allclose(their_losses, losses, rtol=1e-12)
    _assert_steps_agree(their_history, history, training)
    assert max(_relative(their_moments[n], first.m[n]) for n in PARAMS if np.any(first.m[n])) < 1e-12


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_optax_agrees_step_by_step(setting):
    training = SETTINGS[setting]
    losses, history, _ = _golden_run(training)
    their_losses, their_history = _jax_run(training)
    np.testing.assert_allclose(their_losses, losses, rtol=1e-12)
    _assert_steps_agree(their_history, history, training)


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
    """Two training mistakes: ε under the root, and AdamW decaying biases and norm parameters.
    Each moves parameters far beyond the 1e-12 that torch.optim agrees to."""
    training = TrainingConfig(warmup_steps=2, learning_rate_scale=20.0, eps=1e-6)
    _, history, _ = _golden_run(training)
    _, wrong, _ = _golden_run(training, update=_eps_inside_the_root)
    assert max(_relative(wrong[-1][n], history[-1][n]) for n in PARAMS) > 1e-4
    adamw = SETTINGS["adamw, clipped"]
    _, history, _ = _golden_run(adamw)
    monkeypatch.setattr(golden_training, "decays", lambda shape: True)
    _, wrong, _ = _golden_run(adamw)
    assert max(_relative(wrong[-1][n], history[-1][n]) for n in PARAMS if n.endswith((".scale", ".bias"))) > 1e-3


def test_torch_clip_grad_norm_is_not_the_specs(monkeypatch):
    """torch.nn.utils.clip_grad_norm_ scales by c / (‖g‖ + 1e-6): at float64 that is a difference
    the step-by-step comparison sees, which is why impl_torch clips by the spec's rule."""
    training = SETTINGS["adamw, clipped"]
    _, history, _ = _golden_run(training)
    monkeypatch.setattr(torch_training, "clip_by_global_norm",
                        lambda parameters, max_norm: torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    _, theirs, _ = _torch_run(training)
    worst = max(_relative(theirs[-1][n], history[-1][n]) for n in PARAMS)
    assert worst > 1e-9, worst


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
