"""The training cells train_step-<mask case> and train_steps-<mask case> (SPEC.md §14) through the
harness: every step of a backend's run checked from its own state (conformance/training_cells.py),
and the optimizer settings where the frameworks' defaults differ from the spec caught when a port
trusts them."""


import numpy as np
import pytest

from conformance.cases import TRAINING, TRAINING_STEPS, build_case, case_names, is_training
from conformance.harness import FAIL, PASS, plan_matrix, run_matrix
from conformance.training_cells import TrainingReference, compare_training, failing_step, step_tolerances
from spec import conformance_params, get_preset

TINY = get_preset("tiny")
PARAMS = conformance_params(TINY)


def _run(backends, dtypes, pattern="train*"):
    return run_matrix(TINY, PARAMS, plan_matrix(TINY, backends, dtypes, ["cpu"]), pattern=pattern, backward=True)


def _statuses(results):
    return {r.test_id: (r.status, r.reason[:300]) for r in results if r.status != PASS}


def test_the_training_cases():
    names = [(s, c) for s, c in case_names(TINY, backward=True) if is_training(s)]
    assert names == [("train_step", c) for c in ("none", "pad_right", "all_pad", "pad_start", "dropout")] + [
        ("train_steps", "pad_right")]
    assert not any(is_training(s) for s, _ in case_names(TINY))  # only with the backward half
    case = build_case(TINY, PARAMS, "train_steps", "pad_right")
    assert case.inputs["tgt_ids"].shape[0] == TRAINING_STEPS and case.inputs["training"].clip_norm > 0
    assert build_case(TINY, PARAMS, "train_step", "none").inputs["training"] == TRAINING


@pytest.mark.parametrize("backends", [["numpy-float32", "torch", "torch-math"], ["jax", "jax-math"]])
def test_every_training_cell_passes(backends):
    results = _run(backends, ["float64", "float32"])
    ran = [r for r in results if r.status != "skip"]
    assert len(ran) >= 5 * len(backends) and not _statuses(ran), _statuses(ran)
    steps = next(r for r in ran if r.sublayer == "train_steps" and r.dtype == "float32")
    assert "from the golden's own run after each step" in steps.reason and "per step" in steps.reason


def test_pure_float16_training_fails_at_step_one_and_says_why(monkeypatch):
    """A pure float16 Adam (planted: the column's half-precision model trained as it is, not in
    mixed precision, SPEC §14.2): ε = 1e-9 is 0 in float16 and (1 − β2)g² underflows, so an update
    divides by zero. The cell fails at the first step's parameters with that explanation."""
    import conformance.backends.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "master_dtype", lambda dtype: dtype)
    results = _run(["torch"], ["float16"], "train_step-none")
    assert [r.status for r in results] == [FAIL]
    assert failing_step(results[0].reason) == "step 1 params", results[0].reason
    assert "ε = 1e-09 is 0 in float16" in results[0].reason


# ---- the check fails on what it should ----------------------------------------------------------

CASE = build_case(TINY, PARAMS, "train_steps", "pad_right")
REFERENCE = TrainingReference(TINY, PARAMS, CASE.inputs)
TOLERANCES = step_tolerances(TINY, CASE, "float64")  # the cell's own (SPEC §14.1), as conformance/cells.py asks


def _compare(trace):
    return compare_training(trace, REFERENCE, "float64", **TOLERANCES)


def test_the_golden_run_passes_its_own_check():
    result = _compare(REFERENCE.golden_run)
    assert result.passed and "after each step: 0, 0" in result.reason, result.reason


@pytest.mark.parametrize("change, where", [
    (lambda run: run[2]["first_moment"].update({"decoder.layers.0.ffn.w1.weight": 1.001 * run[2]["first_moment"][
        "decoder.layers.0.ffn.w1.weight"]}), "step 3 first_moment"),
    (lambda run: run[0]["second_moment"].update({"tgt_embed.weight": 0.98 * run[0]["second_moment"]["tgt_embed.weight"]}),
     "step 1 second_moment"),
    (lambda run: run[4]["params"].update({"decoder.layers.1.ffn_norm.scale": run[4]["params"][
        "decoder.layers.1.ffn_norm.scale"] * (1 - 1e-6)}), "step 5 params"),
    (lambda run: run[6].update(loss=run[6]["loss"] * (1 + 1e-9)), "step 7 loss"),
])
def test_a_wrong_quantity_is_found_at_its_step(change, where):
    run = [{key: dict(value) if isinstance(value, dict) else value for key, value in record.items()}
           for record in REFERENCE.golden_run]
    change(run)
    result = _compare(run)
    assert not result.passed and failing_step(result.reason) == where, result.reason


def test_malformed_traces_are_named():
    run = REFERENCE.golden_run
    assert "expected 10 step record(s), got 3" in _compare(run[:3]).reason
    missing = [{**run[0], "params": {k: v for k, v in run[0]["params"].items() if k != "tgt_embed.weight"}}] + run[1:]
    assert "step 1 params: missing ['tgt_embed.weight']" in _compare(missing).reason
    stopped = _compare(run[:2] + [{"stopped": "FloatingPointError: the loss is nan"}])
    assert not stopped.passed and "step 3: the run stopped (FloatingPointError: the loss is nan) after 2" in stopped.reason
    not_finite = [{**run[0], "params": {**run[0]["params"], "tgt_embed.weight": np.full_like(
        run[0]["params"]["tgt_embed.weight"], np.nan)}}] + run[1:]
    assert "tgt_embed.weight: " in _compare(not_finite).reason and "non-finite" in _compare(not_finite).reason


# ---- the frameworks' defaults, trusted by a port, are caught --------------------------------

def _torch_with(monkeypatch, make_optimizer):
    import impl_torch.training as torch_training

    monkeypatch.setattr(torch_training, "make_optimizer", make_optimizer)
    return _run(["torch"], ["float64"], "train_step*-pad_right-*")


def test_torch_adamw_default_weight_decay_is_caught(monkeypatch):
    """torch.optim.AdamW over every parameter with its own default weight_decay (1e-2)."""
    import torch

    from spec.training import learning_rate

    def trusting(model, training):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(training.beta1, training.beta2), eps=training.eps)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: learning_rate(model.cfg, training, n + 1))

    results = _torch_with(monkeypatch, trusting)
    assert all(r.status == FAIL and failing_step(r.reason) == "step 1 params" for r in results), _statuses(results)


def test_torch_clip_grad_norm_epsilon_is_caught(monkeypatch):
    """torch.nn.utils.clip_grad_norm_ divides by ‖g‖ + 1e-6: at float64 the first moment sees it."""
    import torch

    import impl_torch.training as torch_training

    monkeypatch.setattr(torch_training, "clip_by_global_norm",
                        lambda parameters, max_norm: torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    results = _run(["torch"], ["float64"], "train_steps-*")
    assert [failing_step(r.reason) for r in results] == ["step 1 first_moment"], _statuses(results)


@pytest.mark.parametrize("mistake", ["eps_root", "optax's default weight decay"])
def test_optax_settings_are_caught(monkeypatch, mistake):
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp

    import impl_jax.training as jax_training

    def trusting(cfg, training):
        def rate(count):
            step = count + 1
            return training.learning_rate_scale * cfg.d_model ** -0.5 * jnp.minimum(
                step ** -0.5, step * training.warmup_steps ** -1.5)

        if mistake == "eps_root":  # ε under the root as well: m̂ / (√(v̂ + ε) + ε)
            return optax.adamw(rate, b1=training.beta1, b2=training.beta2, eps=training.eps, eps_root=training.eps,
                               weight_decay=training.weight_decay,
                               mask=lambda params: jax.tree.map(lambda p: len(p.shape) >= 2, params))
        # optax's own weight_decay (1e-4), on every parameter
        return optax.adamw(rate, b1=training.beta1, b2=training.beta2, eps=training.eps)

    monkeypatch.setattr(jax_training, "make_optimizer", trusting)
    results = run_matrix(TINY, PARAMS, plan_matrix(TINY, ["jax-math"], ["float64"], ["cpu"]),
                         pattern="train_step-pad_right-*", backward=True)
    assert [failing_step(r.reason) for r in results] == ["step 1 params"], _statuses(results)
