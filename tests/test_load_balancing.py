"""A mixture of experts' load-balancing loss (SPEC §5.14, moe.load_balancing): the golden's loss
and its VJP (impl_numpy) audited three ways (float64 central differences, torch under float64
autograd in both expert forms, JAX under x64), its definition held to transformers' own
load_balancing_loss_func, and the matrix catching a port that computes it wrong."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import impl_numpy as golden
import impl_torch.model as torch_model
from conformance.cases import SUBLAYERS
from conformance.harness import FAIL, PASS, plan_matrix, run_matrix
from conformance.tolerance import compare_gradients, tolerance
from impl_numpy import backward
from spec import ConfigError, ModelConfig, conformance_params, get_preset
from spec.routing import check_recorded_routing
from tests.bounds import assert_agrees, assert_derivative, assert_differs, model_bounds


def _weighted(preset: str, weight: float) -> ModelConfig:
    cfg = get_preset(preset)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_balancing=weight))


# large enough that the load-balancing term moves every gradient it reaches well past rounding
CONFIGS = {"mixtral": _weighted("mixtral-tiny", 0.1), "qwen3-moe-unrenormalised": _weighted("qwen3-moe-tiny", 0.1)}


def _batch(cfg: ModelConfig):
    """Row 1 ends in two pads: their routing must not count."""
    rng = np.random.default_rng(3)
    tgt = rng.integers(1, cfg.tgt_vocab_size, (2, 7))
    tgt[1, -2:] = cfg.pad_id
    targets = np.roll(tgt, -1, axis=1)
    targets[:, -1] = cfg.pad_id
    return tgt, targets


def _golden(name):
    cfg = CONFIGS[name]
    params = conformance_params(cfg)
    p = golden.cast_params(cfg, params)
    tgt, targets = _batch(cfg)
    loss, grads = backward.loss_and_gradients(cfg, p, None, tgt, targets)
    return cfg, params, p, tgt, targets, loss, grads


def _policy(dtype: str, bounds: dict) -> float:
    """tolerance() of bounds given as assert_agrees takes them."""
    return tolerance(dtype, bounds["n"], bounds["depth"], bounds["angle"])


def _loss_bounds(cfg: ModelConfig, tgt: np.ndarray) -> dict:
    """SPEC §8's n, depth and angle for the training loss on tgt, as conformance/cases.py's loss
    case counts them: the whole model's, and the log-softmax's sum over the vocabulary."""
    bounds = model_bounds(cfg, tgt.shape[1])
    return {**bounds, "n": max(bounds["n"], cfg.tgt_vocab_size), "depth": SUBLAYERS["loss"].depth(cfg)}


def _gradient_bounds(cfg: ModelConfig, tgt: np.ndarray) -> dict:
    """The gradients': a weight's also sums over every position of the batch, and a backward
    re-traverses the forward's chain (grad-loss: twice the loss's depth)."""
    bounds = _loss_bounds(cfg, tgt)
    return {**bounds, "n": max(bounds["n"], tgt.size), "depth": SUBLAYERS["grad-loss"].depth(cfg)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_goldens_gradient_is_central_differences(name):
    cfg, _, p, tgt, targets, loss, grads = _golden(name)
    plain = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_balancing=0.0))
    without, plain_grads = backward.loss_and_gradients(plain, p, None, tgt, targets)
    assert loss > without  # the term is there, and reaches the routers' gradients
    router = "decoder.layers.1.ffn.router.weight"
    assert_differs(grads[router], plain_grads[router], **_gradient_bounds(cfg, tgt))
    rounding = _policy("float64", _loss_bounds(cfg, tgt))  # of the loss each difference takes
    for index, name_ in enumerate(p):
        direction = np.random.default_rng(index).standard_normal(p[name_].shape)
        h = 1e-6  # the differences' truncation error goes as h² (Qwen3-MoE's router: 2e-6 of it at h = 1e-5)
        analytic = float(np.sum(grads[name_] * direction))
        assert_derivative(analytic, lambda s: golden.training_loss(cfg, {**p, name_: p[name_] + s * direction}, None,
                                                                   tgt, targets), h, rounding, what=name_)


def _assert_agree(cfg, p, tgt, targets, theirs, grads):
    """SPEC §13's comparison of every gradient: normwise, against the larger of the gradient and the
    terms it sums (the golden without cancellation), at the grad-loss case's tolerance."""
    with backward.without_cancellation():
        _, terms = backward.loss_and_gradients(cfg, p, None, tgt, targets)
    result = compare_gradients(theirs, grads, terms, _policy("float64", _gradient_bounds(cfg, tgt)))
    assert result.passed, result.reason


@pytest.mark.parametrize("attention", ["sdpa", "math"])  # the batched experts, and the loop
@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_float64_autograd_agrees(name, attention):
    cfg, params, p, tgt, targets, loss, grads = _golden(name)
    model = torch_model.Transformer.from_params(cfg, params, dtype=torch.float64, attention=attention)
    with torch_model.recorded_routers() as routed:
        logits = model(None, tgt)
    their_loss = torch_model.training_loss(cfg, logits, targets, tgt, routed)
    their_loss.backward()
    transposed, named = torch_model._linear_weight_names(model), dict(model.named_parameters())
    assert_agrees(float(their_loss.detach()), loss, **_loss_bounds(cfg, tgt))
    # the loop form's expert that no token chose has no .grad: its gradient is 0
    found = {name: torch.zeros_like(named[name]) if named[name].grad is None else named[name].grad for name in params}
    _assert_agree(cfg, p, tgt, targets,
                  {name: (found[name].T if name in transposed else found[name]).numpy() for name in params}, grads)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_jax_x64_agrees(name, attention):
    jax = pytest.importorskip("jax")
    from flax import nnx

    from impl_jax.model import Transformer, _variable, training_loss

    cfg, params, p, tgt, targets, loss, grads = _golden(name)
    with jax.enable_x64(True):
        model = Transformer.from_params(cfg, params, dtype="float64", attention=attention)

        def loss_of(m):
            logits, routed = m.routed_call(None, tgt)
            return training_loss(cfg, logits, targets, tgt, routed)

        their_loss, state = nnx.value_and_grad(loss_of)(model)
        nnx.update(model, state)
        assert_agrees(float(their_loss), loss, **_loss_bounds(cfg, tgt))
        _assert_agree(cfg, p, tgt, targets, {name: np.asarray(_variable(model, name)[...]) for name in params}, grads)


def test_the_definition_is_transformers_load_balancing_loss():
    """transformers' load_balancing_loss_func (what Mixtral and Qwen3-MoE train with, given
    output_router_logits), on the golden's router logits of a padded batch: log p gives back p
    under its softmax. With no real token transformers divides 0 by 0; the spec's loss is 0."""
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    cfg, _, p, tgt, _, _, _ = _golden("mixtral")
    with golden.recorded_routing() as calls:
        golden.model_logits(cfg, p, None, tgt)
    probabilities, chosen = [call.probabilities for call in calls], [call.chosen for call in calls]
    keep = tgt != cfg.pad_id
    ours = golden.load_balancing_loss(probabilities, chosen, keep)
    theirs = modeling.load_balancing_loss_func(
        tuple(torch.from_numpy(np.log(layer.reshape(-1, cfg.moe.n_experts))) for layer in probabilities),
        cfg.moe.n_experts, cfg.moe.experts_per_token, torch.from_numpy(keep.astype(np.int64)))
    # a mean over the L layers' tokens is its longest sum; transformers sums in float32
    tokens = len(probabilities) * keep.size
    assert_agrees(float(theirs), ours, n=tokens, dtype="float32")
    everywhere = golden.load_balancing_loss(probabilities, chosen, np.ones_like(keep))
    assert_differs(everywhere, ours, n=tokens)  # the pads' routing would count otherwise
    assert golden.load_balancing_loss(probabilities, chosen, np.zeros_like(keep)) == 0.0


@pytest.mark.parametrize("weight", [-0.01, float("nan"), float("inf"), True, "0.02"])
def test_a_weight_that_is_not_a_finite_number_at_least_0_is_refused(weight):
    cfg = get_preset("mixtral-tiny")
    with pytest.raises(ConfigError, match="moe.load_balancing"):
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_balancing=weight))


def test_a_recording_without_every_layer_is_refused():
    """A compiled forward whose trace was cached routes without recording: the loss would miss it."""
    cfg = get_preset("mixtral-tiny")
    check_recorded_routing(cfg, cfg.n_decoder_layers)
    with pytest.raises(ValueError, match="routing of all 2 MoE layers of the forward; 0 were recorded"):
        check_recorded_routing(cfg, 0)


def _counting_pads(probabilities, chosen, keep):
    """A port whose load-balancing loss counts the pad tokens' routing too."""
    return _LOAD_BALANCING(probabilities, chosen, torch.ones_like(keep))


def _summed_over_layers(probabilities, chosen, keep):
    """Switch Transformer's per-layer losses summed: L times the shares-of-all-layers loss on one
    layer, not transformers' (and the spec's) one loss over the layers together."""
    return sum(_LOAD_BALANCING([p], [c], keep) for p, c in zip(probabilities, chosen))


_LOAD_BALANCING = torch_model.load_balancing_loss


@pytest.mark.parametrize("mistake", [_counting_pads, _summed_over_layers])
def test_the_matrix_catches_a_wrong_load_balancing_loss(monkeypatch, mistake):
    """mixtral-tiny trains with Mixtral's published weight 0.02: the loss and gradient cells at
    float32 see a port's load-balancing loss that counts pads or sums per layer."""
    cfg = get_preset("mixtral-tiny")
    assert cfg.moe.load_balancing == 0.02
    plan = plan_matrix(cfg, ["torch"], ["float32"], ["cpu"])
    cells = {f"{r.sublayer}-{r.mask_case}": r
             for r in run_matrix(cfg, conformance_params(cfg), plan, pattern="*loss-pad_right*", backward=True)}
    assert {cell.status for cell in cells.values()} == {PASS} and len(cells) == 2
    monkeypatch.setattr(torch_model, "load_balancing_loss", mistake)
    cells = {f"{r.sublayer}-{r.mask_case}": r
             for r in run_matrix(cfg, conformance_params(cfg), plan, pattern="*loss-pad_right*", backward=True)}
    assert cells["loss-pad_right"].status == FAIL, cells["loss-pad_right"].reason
    assert cells["grad-loss-pad_right"].status == FAIL, cells["grad-loss-pad_right"].reason
