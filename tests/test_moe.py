"""The mixture of experts in the spec's model (SPEC §5.14): the golden's decoder with its experts,
impl_torch's two forms of the block (the plain loop and the batched one), the routing each
records, and replayed routing, which splits a failing cell into "the router chose differently"
and "the experts computed differently".

The tiny MoE presets' conformance weights leave some tokens of every long case within rounding
of a routing tie at float16 and bfloat16 (thousands of tokens decide among 5 or 6 experts): those
cells pass only with the golden's routing replayed, and say so; a router that chooses differently
where the margin is clear fails, and so does an expert that computes differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import numpy as np
import pytest
import torch

import impl_jax
import impl_jax.model as jax_model
import impl_numpy as golden
import impl_torch.model as torch_model
from conformance import cells
from conformance.harness import FAIL, PASS, SKIP, plan_matrix, run_matrix
from conformance.diagnosis.routing import routing_margins
from impl_numpy.model import recorded_routing
from impl_torch import Transformer
import spec.routing
from spec import conformance_params, get_preset
from tests.bounds import assert_agrees, assert_differs, model_bounds

PRESETS = ("mixtral-tiny", "qwen3-moe-tiny")


def _ids(cfg, shape=(3, 11), seed=0):
    return np.random.default_rng(seed).integers(1, cfg.tgt_vocab_size, shape)


def _golden_logits(cfg, params, ids):
    return golden.model_logits(cfg, {name: value.astype(np.float64) for name, value in params.items()}, None, ids)


def _torch_logits(model, ids):
    with torch.inference_mode():
        return model(None, torch.tensor(ids)).double().numpy()


def _jax_logits(model, ids):
    return np.asarray(model(None, ids), dtype=np.float64)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("preset", PRESETS)
def test_both_forms_of_the_block_equal_the_golden_at_float64(preset, attention):
    """The sdpa column's batched experts and the math column's loop, against the golden's."""
    cfg = get_preset(preset)
    params = conformance_params(cfg, seed=3)
    ids = _ids(cfg)
    model = Transformer.from_params(cfg, params, dtype=torch.float64, attention=attention)
    assert model.decoder.layers[0].ffn.batched == (attention == "sdpa")
    want = _golden_logits(cfg, params, ids)
    assert_agrees(_torch_logits(model, ids), want, **model_bounds(cfg, ids.shape[1]))
    back = model.to_params()
    assert all(np.array_equal(back[name], params[name]) for name in params)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("preset", PRESETS)
def test_jaxs_two_forms_equal_the_golden_at_float64_and_log_and_replay_its_routing(preset, attention):
    import jax
    cfg = get_preset(preset)
    params = conformance_params(cfg, seed=3)
    ids = _ids(cfg)
    with jax.enable_x64(True):
        model = impl_jax.Transformer.from_params(cfg, params, dtype="float64", attention=attention)
        assert model.decoder.layers[0].ffn.batched == (attention == "sdpa")
        with recorded_routing() as calls:
            want = _golden_logits(cfg, params, ids)
        bounds = model_bounds(cfg, ids.shape[1])
        assert_agrees(_jax_logits(model, ids), want, **bounds)
        with model.routing_log() as log:  # compiled, the choices come back through a host callback
            _jax_logits(model, ids)
        assert all(np.array_equal(mine, call.chosen) for mine, call in zip(log.layers(), calls))
        swapped = [call.chosen.copy() for call in calls]
        swapped[0][0, 0] = [e for e in range(cfg.moe.n_experts) if e not in swapped[0][0, 0]][:2]
        with model.routing_log(forced=swapped):
            moved = _jax_logits(model, ids)
        assert_differs(moved[0], want[0], **bounds, what="the row whose choice was swapped")
        assert_agrees(moved[1:], want[1:], **bounds, what="the other rows")


@pytest.mark.parametrize("preset", PRESETS)
def test_the_logged_routing_is_the_goldens_and_a_forced_one_is_obeyed(preset):
    cfg = get_preset(preset)
    params = conformance_params(cfg)
    ids = _ids(cfg)
    with recorded_routing() as calls:
        want = _golden_logits(cfg, params, ids)
    assert [call.chosen.shape for call in calls] == [(3, 11, 2)] * cfg.n_decoder_layers
    model = Transformer.from_params(cfg, params, dtype=torch.float64)
    with model.routing_log() as log:
        free = _torch_logits(model, ids)
    assert all(np.array_equal(mine, call.chosen) for mine, call in zip(log.layers(), calls))
    with model.routing_log(forced=[call.chosen for call in calls]):
        assert np.abs(_torch_logits(model, ids) - free).max() == 0.0
    swapped = [call.chosen.copy() for call in calls]
    swapped[0][0, 0] = [e for e in range(cfg.moe.n_experts) if e not in swapped[0][0, 0]][:2]
    with model.routing_log(forced=swapped):
        moved = _torch_logits(model, ids)
    bounds = model_bounds(cfg, ids.shape[1])
    assert_differs(moved[0], want[0], **bounds, what="the row whose choice was swapped")
    assert_agrees(moved[1:], want[1:], **bounds, what="the other rows")
    with pytest.raises(Exception, match="replayed routing out of step"), model.routing_log(forced=swapped[:1]):
        _torch_logits(model, ids)


def test_the_routing_log_lines_a_prefill_and_its_steps_up_with_a_forward():
    cfg = get_preset("mixtral-tiny")
    model = Transformer.from_params(cfg, conformance_params(cfg), dtype=torch.float64)
    ids = torch.tensor(_ids(cfg, (2, 7)))
    with model.routing_log() as whole:
        model(None, ids)
    with model.routing_log() as stepped:
        cache = model.start_cache(2, 7)
        _, cache = model.decode_step(cache, ids[:, :4])
        for t in range(4, 7):
            _, cache = model.decode_step(cache, ids[:, t:t + 1])
    assert [a.shape for a in stepped.layers()] == [(2, 7, 2)] * 2
    assert all(np.array_equal(a, b) for a, b in zip(whole.layers(), stepped.layers()))


def test_an_unchosen_experts_overflow_never_reaches_the_batched_output():
    """The batched form gathers the chosen outputs: multiplying every expert's output by a weight of
    0 would turn an unchosen expert's float16 overflow into 0 · inf = NaN."""
    cfg = get_preset("mixtral-tiny")
    params = conformance_params(cfg)
    ids = _ids(cfg, (1, 2))  # 2 tokens choose at most 4 of the 5 experts of a layer
    with recorded_routing() as calls:
        _golden_logits(cfg, params, ids)
    for layer, call in enumerate(calls):
        unchosen = min(set(range(cfg.moe.n_experts)) - set(call.chosen.ravel().tolist()))
        params[f"decoder.layers.{layer}.ffn.experts.{unchosen}.w2.weight"] *= np.float32(1e4)  # overflows float16
    want = _golden_logits(cfg, params, ids)
    for attention in ("sdpa", "math"):
        got = _torch_logits(Transformer.from_params(cfg, params, dtype=torch.float16, attention=attention), ids)
        assert np.isfinite(got).all(), attention
        assert_agrees(got, want, **model_bounds(cfg, ids.shape[1]), dtype="float16", what=attention)


def _cells(monkeypatch, preset, dtype, pattern, plant=None, backend="torch"):
    if plant:
        monkeypatch.setattr(*plant)
    cfg = get_preset(preset)
    results = run_matrix(cfg, conformance_params(cfg), plan_matrix(cfg, [backend], [dtype], ["cpu"]), pattern=pattern)
    return {f"{r.sublayer}-{r.mask_case}": r for r in results}


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_near_ties_at_bfloat16_pass_with_the_goldens_routing_replayed_and_say_so(monkeypatch, backend):
    cells = _cells(monkeypatch, "qwen3-moe-tiny", "bfloat16", "forward-long*", backend=backend)
    cell = cells["forward-long"]
    assert cell.status == PASS and cell.reason.startswith("routing replayed: the router chose differently at")
    assert "on the inputs it saw, as the golden router does" in cell.reason


def _through_the_log(self, probabilities, chosen, batch):
    """A mocked router's choices and renormalised weights through the cell's routing log, as
    impl_torch's route takes them: (probabilities, chosen, weights)."""
    if self.log is not None:
        chosen = torch.as_tensor(self.log.choose(self.index, batch, chosen.numpy())).long()
    if (routed := torch_model._ROUTERS.get()) is not None:  # what a load-balancing loss reads
        routed.append((probabilities, chosen))
    weights = probabilities.gather(-1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    if self.log is not None:
        forced = self.log.weigh(self.index, weights.detach().double().numpy())
        weights = weights if forced is None else torch.as_tensor(forced, dtype=weights.dtype) + (weights - weights.detach())
    return probabilities, chosen, weights


def _route_smallest(self, tokens, batch=1):
    """A router that takes the k *least* likely experts (an ascending sort)."""
    probabilities = torch.softmax(self.router(tokens).float(), dim=-1)
    chosen = torch.sort(probabilities, dim=-1, stable=True).indices[:, :self.k]
    probabilities, chosen, weights = _through_the_log(self, probabilities, chosen, batch)
    return probabilities, chosen, weights.to(tokens.dtype)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_the_case_at_a_tie_by_construction_passes_replayed_and_still_catches_an_expert_mistake(monkeypatch, backend):
    """ffn-near_tie puts every token at a tie between its k-th and (k+1)-th expert: at float32 some
    flip (rounding's choice, 7-10 of 18 on mixtral-tiny), the cell passes with the golden's routing
    replayed and says the case sits at a tie; at float64 none flips. The golden at float32
    (numpy-float32) replays through its own routing log too."""
    cfg = get_preset("mixtral-tiny")
    plan = plan_matrix(cfg, [backend, "numpy-float32"], ["float64", "float32"], ["cpu"])
    cells = {(r.backend, r.dtype): r for r in run_matrix(cfg, conformance_params(cfg), plan, pattern="ffn-near_tie")}
    replayed = cells[backend, "float32"]
    assert replayed.status == PASS and replayed.reason.startswith(
        "every token of this case sits at a routing tie by construction; routing replayed: the router chose "
        "differently at"), replayed.reason
    assert cells[backend, "float64"].status == PASS and not cells[backend, "float64"].reason
    golden32 = cells["numpy-float32", "float32"]
    assert golden32.status == PASS and golden32.reason.startswith(
        "every token of this case sits at a routing tie by construction; routing replayed"), golden32.reason


def test_the_gradient_of_the_case_at_a_tie_is_refused_where_the_backward_cannot_replay():
    """numpy-float32's forward replays routing, its VJPs do not (they route on their own): its
    grad-ffn-near_tie cell was failed by rounding's choice of expert, a red that meant nothing. It is
    refused saying why; torch, whose autodiff runs through the replayed routing, is judged and passes."""
    cfg = get_preset("qwen3-moe-tiny")
    plan = plan_matrix(cfg, ["torch", "numpy-float32"], ["float32"], ["cpu"])
    cells = {r.backend: r for r in run_matrix(cfg, conformance_params(cfg), plan, pattern="grad-ffn-near_tie",
                                              backward=True)}
    assert cells["torch"].status == PASS, cells["torch"].reason
    refused = cells["numpy-float32"]
    assert refused.status == SKIP and "(this one's gradients route on their own)" in refused.reason, refused.reason


def test_the_golden_replays_routing_through_its_log():
    """numpy-float32's routing log (impl_numpy.replayed_routing): the free run's choices recorded,
    forced choices and weights taken (the output is then the experts' on them), and its VJPs refuse
    to run inside it, as they route on their own."""
    from conformance.adapter import NotSupported
    from conformance.backends.numpy_backend import NumpyRunner
    from conformance.cases import build_case
    from conformance.tolerance import compare

    cfg = get_preset("mixtral-tiny")
    params = conformance_params(cfg)
    runner = NumpyRunner(cfg, params, "float32")
    case = build_case(cfg, params, "forward", "pad_right")
    with runner.routing_log() as log:
        free = runner.run("forward", case.inputs)
    assert np.array_equal(free, runner.run("forward", case.inputs))
    chosen = log.layers()
    assert len(chosen) == cfg.n_decoder_layers and chosen[0].shape == (*case.inputs["tgt_ids"].shape, 2)
    other = [np.ascontiguousarray(layer[..., ::-1] + 1) % cfg.moe.n_experts for layer in chosen]  # other experts
    with runner.routing_log(forced=other, forced_weights=[np.full(c.shape, 0.5) for c in other]) as replay:
        forced = runner.run("forward", case.inputs)
    assert [np.array_equal(a, b) for a, b in zip(replay.layers(), other)] == [True] * cfg.n_decoder_layers
    assert not compare(forced, free, case.tolerance(cfg, "float32")).passed  # the case's check sees the forced choices
    with runner.routing_log(), pytest.raises(NotSupported, match="VJPs route on their own"):
        runner.gradients("grad-forward", build_case(cfg, params, "grad-forward", "none").inputs)


def test_the_case_at_a_tie_by_construction_still_catches_an_expert_mistake(monkeypatch):
    cell = _cells(monkeypatch, "mixtral-tiny", "float32", "ffn-near_tie",
                  plant=(torch_model.FeedForward, "forward", _gate_and_up_swapped))["ffn-near_tie"]
    assert cell.status == FAIL and cell.reason.startswith(
        "every token of this case sits at a routing tie by construction; with the golden's routing replayed the "
        "cell still fails"), cell.reason


def _gate_and_up_swapped(self, x):
    """An expert whose gate and up projections trade places: act(x W3) ⊙ x W1."""
    return self.w2(self.activation(self.w3(x)) * self.w1(x))


def _route_in_bfloat16(self, tokens, batch=1):
    """A router whose logits are computed in bfloat16 where the config says float32."""
    logits = torch.nn.functional.linear(tokens.bfloat16(), self.router.weight.bfloat16()).to(tokens.dtype)
    probabilities = torch.softmax(logits, dim=-1)
    chosen = torch.sort(probabilities, dim=-1, descending=True, stable=True).indices[:, :self.k]
    probabilities, chosen, weights = _through_the_log(self, probabilities, chosen, batch)
    return probabilities, chosen, weights.to(tokens.dtype)


def test_the_router_and_experts_cells_tell_a_router_mistake_from_an_expert_mistake(monkeypatch):
    """The router cell judges the probabilities, the experts cells the chosen experts on the
    golden's routing: a router in bfloat16 fails the first only, an expert's gate and up swapped
    the second only."""
    router = _cells(monkeypatch, "mixtral-tiny", "float32", "[re][ox]*-*",
                    (torch_model.MixtureOfExperts, "route", _route_in_bfloat16))
    # a mistake, not rounding, by orders of magnitude: SPEC §8's correct cells sit below 0.5 of their
    # tolerance, the mistakes of docs/mutation-gallery.md 1.8e3 to 5.7e5 above it; 100 lies between
    assert router["router-none"].status == FAIL and router["router-none"].max_abs_err > 100 * router["router-none"].tol
    assert router["experts-none"].status == PASS and router["experts-unchosen"].status == PASS
    monkeypatch.undo()
    expert = _cells(monkeypatch, "mixtral-tiny", "float32", "[re][ox]*-*",
                    (torch_model.FeedForward, "forward", _gate_and_up_swapped))
    assert expert["router-none"].status == PASS  # and the experts' cells fail by orders of magnitude, as above
    assert all(expert[name].status == FAIL and expert[name].max_abs_err > 100 * expert[name].tol
               for name in ("experts-none", "experts-unchosen"))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_unchosen_case_leaves_one_expert_to_no_token(preset):
    """experts-unchosen: the least probable expert is chosen by no token, so a backend must run an
    expert with nothing to compute (SPEC §5.14: it adds nothing); experts-none is the router's own."""
    from conformance.cases import build_case
    cfg = get_preset(preset)
    params = conformance_params(cfg)
    case = build_case(cfg, params, "experts", "unchosen")
    assert len(set(range(cfg.moe.n_experts)) - set(case.inputs["chosen"].ravel().tolist())) == 1
    case = build_case(cfg, params, "experts", "none")
    x = case.inputs["x"].reshape(-1, cfg.d_model).astype(np.float64)
    router = params[f"{case.inputs['module']}.router.weight"].astype(np.float64)
    want = golden.top_experts(golden.router_probabilities(x, router), cfg.moe.experts_per_token)
    assert np.array_equal(case.inputs["chosen"].reshape(want.shape), want)


def test_a_router_mistake_is_named_as_the_router_choosing_differently(monkeypatch):
    cells = _cells(monkeypatch, "mixtral-tiny", "float32", "forward-none",
                   (torch_model.MixtureOfExperts, "route", _route_smallest))
    cell = cells["forward-none"]
    assert cell.status == FAIL and cell.reason.startswith("the router chose differently at")
    assert "clear of a tie; first: MoE layer 0, row 0, position 0" in cell.reason
    assert "with the golden's routing replayed the cell passes" in cell.reason


def _unrenormalised(init):
    """impl_torch's block with its weights left unrenormalised (norm_topk_prob ignored, in Mixtral)."""
    def __init__(self, cfg, batched=False):
        init(self, cfg, batched)
        self.renormalize = False
    return __init__


def test_a_router_that_weighs_wrong_is_named_as_the_router_weighting_differently(monkeypatch):
    """Weights left unrenormalised choose the golden's experts, so only the weights tell: the
    replayed run, with the golden's weights, passes, and the weights the router computed there are
    named, in the first layer, beyond their rounding bound."""
    cells = _cells(monkeypatch, "mixtral-tiny", "float32", "forward-none",
                   (torch_model.MixtureOfExperts, "__init__", _unrenormalised(torch_model.MixtureOfExperts.__init__)))
    cell = cells["forward-none"]
    assert cell.status == FAIL and cell.reason.startswith("the router weighted differently at"), cell.reason
    assert "first: MoE layer 0, row 0, position 0" in cell.reason
    assert "with the golden's routing replayed the cell passes" in cell.reason


def test_the_gates_carrying_of_rounding_passes_with_the_goldens_weights_replayed(monkeypatch):
    """A gate amplifies its input's rounding where the chosen experts' outputs and router rows
    differ most (on a random transformers Mixtral, forward-long at bfloat16 failed 1.41 times its
    tolerance with the golden's choices replayed). Here the router's rows are scaled up to make
    the gates that sensitive: the free run fails, and passes with the golden's weights replayed
    too, the router's own weights within rounding of the golden router's on the inputs it saw (at 3 times
    the rows, where the choices alone left 1.40). Without weights (a router that logs choices only)
    the failure stands."""
    cfg = get_preset("mixtral-tiny")
    params = dict(conformance_params(cfg))
    for name in params:
        if name.endswith("router.weight"):
            params[name] = (params[name] * 4).astype(np.float32)  # the same choices, sharper gates
    plan = plan_matrix(cfg, ["torch"], ["bfloat16"], ["cpu"])
    cell, = run_matrix(cfg, params, plan, pattern="forward-long*")
    assert cell.status == PASS and cell.reason.startswith("routing replayed: "), cell.reason
    assert "its weights within rounding of the golden router's" in cell.reason
    monkeypatch.setattr(spec.routing.RoutingLog, "weigh", lambda self, layer, own: None)  # choices only
    cell, = run_matrix(cfg, params, plan, pattern="forward-long*")
    assert cell.status == FAIL and "still fails" in cell.reason, cell.reason


def test_an_expert_mistake_still_fails_with_the_goldens_routing_replayed(monkeypatch):
    cells = _cells(monkeypatch, "mixtral-tiny", "float32", "forward-none",
                   (torch_model.FeedForward, "forward", _gate_and_up_swapped))
    cell = cells["forward-none"]
    assert cell.status == FAIL and cell.reason.startswith(
        "with the golden's routing replayed the cell still fails, so the experts or the rest of the layer compute "
        "differently (the router chose differently at")  # in layer 1, after layer 0's experts moved its input


def _sharp(params, factor=8):
    """The routers' rows `factor` times larger: the same choices, sharper gates (SPEC §5.14)."""
    return {name: (value * factor).astype(np.float32) if name.endswith("router.weight") else value
            for name, value in params.items()}


def test_a_training_steps_flips_are_replayed_and_an_expert_mistake_still_fails_it(monkeypatch):
    """mixtral-tiny's train_step-none at bfloat16 (mixed precision), its router rows 8 times
    larger, flips a choice near a tie: replayed from the golden's forward of the batch, it passes
    and says so; an expert mistake fails it with the routing replayed."""
    cfg = get_preset("mixtral-tiny")
    params = _sharp(conformance_params(cfg))
    plan = plan_matrix(cfg, ["torch"], ["bfloat16"], ["cpu"])
    cell, = run_matrix(cfg, params, plan, pattern="train_step-none*", backward=True)
    assert cell.status == PASS and cell.reason.startswith("routing replayed: the router chose differently"), cell.reason
    monkeypatch.setattr(torch_model.FeedForward, "forward", _gate_and_up_swapped)
    cell, = run_matrix(cfg, params, plan, pattern="train_step-none*", backward=True)
    assert cell.status == FAIL and cell.reason.startswith("with the golden's routing replayed the cell still fails")


def test_a_run_of_training_steps_is_replayed_step_by_step(monkeypatch):
    """Each step after the first routes on parameters only the backend's run reaches: the replayed
    run is given, before each step, the golden's routing at the parameters it starts from. With
    mixtral-tiny's router rows 8 times larger (sharper gates), torch's free run of steps at bfloat16
    flips choices near a tie and fails at a later step's gradients; replayed, it passes and says so.
    A router taking the least likely experts is named at the step and token it first chose
    differently; an expert mistake still fails with the routing replayed; and a pure float16 run
    that the optimizer's update breaks (Adam's ε is 0 there, SPEC §14.2) is said to fail past the
    model, not in the experts."""
    cfg = get_preset("mixtral-tiny")
    params = conformance_params(cfg)
    sharp = _sharp(params)
    plan = plan_matrix(cfg, ["torch"], ["bfloat16"], ["cpu"])
    cell, = run_matrix(cfg, sharp, plan, pattern="train_steps-*", backward=True)
    assert cell.status == PASS and cell.reason.startswith("routing replayed: the router chose differently"), cell.reason
    monkeypatch.setattr(cells, "_routing_verdict", lambda cfg, params, case, runner, dtype, judge, failed: failed)
    free, = run_matrix(cfg, sharp, plan, pattern="train_steps-*", backward=True)
    assert free.status == FAIL and re.match(r"step \d+ gradients", free.reason), free.reason  # the replay explained
    monkeypatch.undo()
    plan = plan_matrix(cfg, ["torch"], ["bfloat16", "float16"], ["cpu"])
    monkeypatch.setattr(torch_model.MixtureOfExperts, "route", _route_smallest)
    router, _ = run_matrix(cfg, params, plan, pattern="train_steps-*", backward=True)
    assert router.status == FAIL and router.reason.startswith("the router chose differently at"), router.reason
    assert "first: MoE layer 0, step 1, row " in router.reason
    monkeypatch.undo()
    monkeypatch.setattr(torch_model.FeedForward, "forward", _gate_and_up_swapped)
    expert, _ = run_matrix(cfg, params, plan, pattern="train_steps-*", backward=True)
    assert expert.status == FAIL and expert.reason.startswith(
        "with the golden's routing replayed the cell still fails, so the experts"), expert.reason
    monkeypatch.undo()
    import conformance.backends.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "master_dtype", lambda dtype: dtype)  # pure half precision: Adam in the column's dtype
    _, half = run_matrix(cfg, params, plan, pattern="train_steps-*", backward=True)
    assert half.status == FAIL and half.reason.startswith(
        "with the golden's routing replayed the run still fails, at step 1 params: in the optimizer's update"), half.reason


def _jax_route_smallest(self, tokens, batch=1):
    """JAX's router taking the k *least* likely experts."""
    import jax
    import jax.experimental
    import jax.numpy as jnp
    probabilities = jax.nn.softmax(self.router(tokens).astype(jnp.float32), axis=-1)
    chosen = jnp.argsort(probabilities, axis=-1, stable=True)[:, :self.k]
    if jax_model._ROUTING.get() is not None:  # the cell's routing log, as impl_jax's own route reaches it
        chosen = jax.experimental.io_callback(functools.partial(jax_model._ROUTING.get().choose, self.index, batch),
                                              jax.ShapeDtypeStruct(chosen.shape, jnp.int32), chosen.astype(jnp.int32),
                                              ordered=True)
    weights = jnp.take_along_axis(probabilities, chosen, axis=-1)
    weights = weights / weights.sum(-1, keepdims=True)
    if jax_model._ROUTING.get() is not None:
        weights = jax_model._weighed(jax_model._ROUTING.get(), self.index, weights)
    return probabilities, chosen, weights.astype(tokens.dtype)


def _jax_gate_and_up_swapped(self, x):
    return self.w2(self.activation(self.w3(x)) * self.w1(x))


def test_jaxs_router_and_expert_mistakes_are_told_apart(monkeypatch):
    router = _cells(monkeypatch, "mixtral-tiny", "float32", "forward-none",
                    (jax_model.MixtureOfExperts, "route", _jax_route_smallest), backend="jax")["forward-none"]
    assert router.status == FAIL and router.reason.startswith("the router chose differently at")
    monkeypatch.undo()
    expert = _cells(monkeypatch, "mixtral-tiny", "float32", "forward-none",
                    (jax_model.FeedForward, "__call__", _jax_gate_and_up_swapped), backend="jax")["forward-none"]
    assert expert.status == FAIL and expert.reason.startswith("with the golden's routing replayed the cell still fails")


def test_a_routing_log_walks_each_layers_positions_and_refuses_what_is_out_of_step():
    from spec.errors import InputError
    from spec.routing import RoutingLog

    forced = [np.arange(2 * 5 * 2).reshape(2, 5, 2) % 7, np.zeros((2, 5, 2), np.int64)]
    log = RoutingLog(forced)
    free = np.full((8, 2), 6)
    assert np.array_equal(log.choose(3, 2, free), forced[0][:, :4].reshape(-1, 2))  # layer 3, first called: forced[0]
    assert log.choose(3, 2, free[:2]).tolist() == forced[0][:, 4].tolist()  # its next position
    assert log.choose(4, 2, free[:2]).dtype == np.int32
    assert [chosen.shape for chosen in log.layers()] == [(2, 5, 2), (2, 1, 2)]
    with pytest.raises(InputError, match=r"out of step: MoE layer call 0 wants 2 rows at positions 5\.\.5"):
        log.choose(3, 2, free[:2])
    with pytest.raises(InputError, match="MoE layer call 2"):
        log.choose(5, 2, free[:2])
    recorded = RoutingLog()
    recorded.choose(0, 1, np.array([[1, 0], [2, 3]]))
    assert recorded.layers()[0].tolist() == [[[1, 0], [2, 3]]]


def test_a_routing_log_replayed_step_by_step_takes_each_steps_routing_before_it():
    """RoutingLog.replay_each_step: before each step the trainer's parameters go to routing_at, and
    the routing it gives is appended along the positions, so each step's forward reads its own;
    a log not replayed so never reads the parameters."""
    from spec.routing import RoutingLog

    asked = []

    def routing_at(step, params):
        asked.append((step, params["w"]))
        return [np.full((1, 2, 2), step)], [np.full((1, 2, 2), 0.5 + step)]

    log = RoutingLog()
    log.replay_each_step(routing_at)
    for step in range(2):
        log.before_step(lambda: {"w": 10 + step})
        assert log.choose(0, 1, np.zeros((2, 2))).tolist() == [[step, step]] * 2
        assert log.weigh(0, np.zeros((2, 2))).tolist() == [[0.5 + step] * 2] * 2
    assert asked == [(0, 10), (1, 11)] and log.layers()[0].shape == (1, 4, 2)
    plain = RoutingLog()
    plain.before_step(lambda: 1 / 0)
    assert plain.forced is None


def _localized(preset, backend, dtype, mask_case):
    from conformance.diagnosis.localize import localize_column
    cfg = get_preset(preset)
    return localize_column(cfg, conformance_params(cfg), backend, dtype, "cpu", mask_case)


def test_localization_replays_the_goldens_routing_in_each_moe_stage(monkeypatch):
    """forward-long at bfloat16 flips choices near ties in every layer; with the golden's routing
    replayed stage by stage no stage fails alone, and each MoE stage says it replayed. Without
    the replay, the same walk blames a layer (the flips)."""
    found = _localized("qwen3-moe-tiny", "torch", "bfloat16", "long")
    layers = [stage for stage in found.stages if stage.sublayer == "decoder_layer"]
    assert found.first_failure is None, found.table()
    assert layers and all("routing replayed" in stage.note for stage in layers)
    monkeypatch.setattr("conformance.diagnosis.localize._replayed", lambda runner, chosen: contextlib.nullcontext())
    assert _localized("qwen3-moe-tiny", "torch", "bfloat16", "long").first_failure is not None


def test_an_expert_mistake_is_localized_to_its_layer_with_the_routing_replayed(monkeypatch):
    monkeypatch.setattr(torch_model.FeedForward, "forward", _gate_and_up_swapped)
    found = _localized("mixtral-tiny", "torch", "float32", "pad_right")
    assert found.first_failure.name == "decoder.layers.0" and "routing replayed" in found.first_failure.note


def _loop_in_reverse(self, x):
    """impl_torch's loop over the experts, the highest index first: each token's k outputs summed
    in another order, every addition rounded to the activation dtype (index_add_)."""
    tokens = x.reshape(-1, x.shape[-1])
    _, chosen, weights = self.route(tokens, x.shape[0] if x.dim() == 3 else 1)
    out = torch.zeros_like(tokens)
    for index in reversed(range(len(self.experts))):
        rows, slot = torch.nonzero(chosen == index, as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, weights[rows, slot, None] * self.experts[index](tokens[rows]))
    return out.reshape(x.shape)


def test_the_k_outputs_summed_in_another_order_at_bfloat16_stay_inside_the_derived_bound(monkeypatch):
    """The record's third source of MoE gaps: the k weighted outputs summed in another order at
    bfloat16 (scatter-add order, an unsorted top-k). With k = 4 the orders differ (with k = 2 they
    cannot: a + b = b + a exactly), by at most the recursive-summation bound 2(k−1)u·Σ_j|w_j y_j|
    per element (each order within (k−1)u of the exact sum, u = 2⁻⁸); the tolerance policy
    absorbs it, so the forward cells pass either way: the order is not a mistake to catch."""
    from conformance.tolerance import UNIT_ROUNDOFF

    cfg = get_preset("mixtral-tiny")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, experts_per_token=4))
    params = conformance_params(cfg)
    model = Transformer.from_params(cfg, params, dtype=torch.bfloat16, attention="math")
    block = model.decoder.layers[0].ffn
    x = torch.tensor(np.random.default_rng(1).standard_normal((3, 17, cfg.d_model)), dtype=torch.bfloat16)
    with torch.inference_mode():
        ordered = block(x).double()
        _, chosen, weights = block.route(x.reshape(-1, cfg.d_model), 3)
        each = torch.stack([expert(x.reshape(-1, cfg.d_model)) for expert in block.experts], dim=1)  # [N, E, d]
        terms = (weights[..., None] * torch.take_along_dim(each, chosen[..., None], dim=1)).double()  # [N, k, d]
        monkeypatch.setattr(torch_model.MixtureOfExperts, "forward", _loop_in_reverse)
        reversed_order = block(x).double()
    difference = (ordered - reversed_order).abs().reshape(-1, cfg.d_model)
    bound = 2 * (cfg.moe.experts_per_token - 1) * UNIT_ROUNDOFF["bfloat16"] * terms.abs().sum(dim=1)
    assert difference.max() > 0 and bool((difference <= bound).all())
    results = run_matrix(cfg, params, plan_matrix(cfg, ["torch-math"], ["bfloat16"], ["cpu"]), pattern="forward-*")
    assert len(results) == 7 and all(r.status == PASS for r in results), [r.reason for r in results if r.status != PASS]


# ---- the exported graphs: routing as tensors (export/torch_export.RoutedForwardGraph) ----

def _routed_export(preset, dtype="float32"):
    """The export the onnx column would load (export.cache: made once, kept between runs)."""
    from export.cache import exported
    from export.runner import OnnxTransformer
    cfg = get_preset(preset)
    params = conformance_params(cfg)
    return cfg, params, OnnxTransformer(exported(cfg, params, dtype=dtype), device="cpu")


@pytest.mark.slow
def test_the_routed_forward_graph_gives_its_choices_and_takes_forced_ones():
    # mixtral-tiny: its weights renormalised over the chosen (the onnx column's replay below serves
    # qwen3-moe-tiny's, as they are), so both routings pass through a torch export
    cfg, params, model = _routed_export("mixtral-tiny")
    ids = _ids(cfg)
    with recorded_routing() as calls:
        want = _golden_logits(cfg, params, ids)
    logits, chosen, weights = model.forward_routed(ids)
    # float32 graphs: the whole model's n and depth, for the logits and for the weights a layer's router
    # gives on what the layers before it computed
    bounds = model_bounds(cfg, ids.shape[1]) | {"dtype": "float32"}
    assert np.array_equal(chosen, np.stack([call.chosen for call in calls]))  # its own choices: the golden's here
    assert_agrees(weights, np.stack([call.weights for call in calls]), **bounds, what="its own weights")
    assert_agrees(logits, want, **bounds, what="logits")
    assert np.abs(model.forward(None, ids) - logits).max() == 0  # the same forward as the deployed graph's
    forced = np.broadcast_to(np.array([4, 0]), chosen.shape).copy()
    forced_weights = np.broadcast_to(np.array([0.75, 0.5], np.float32), chosen.shape).copy()
    logits, taken, own = model.forward_routed(ids, forced=forced, forced_weights=forced_weights)
    torch_model_forced = Transformer.from_params(cfg, params, dtype=torch.float32)
    with torch_model_forced.routing_log(forced=list(forced), forced_weights=list(forced_weights)) as log:
        expected = _torch_logits(torch_model_forced, ids)
    assert np.array_equal(taken, forced)
    assert_agrees(logits, expected, **bounds, what="logits at the forced choices")
    assert_agrees(own, np.stack(log.own_weights()), **bounds, what="its own weights at the forced choices")
    from spec.errors import InputError
    with pytest.raises(InputError, match=r"forced experts of shape \[2, 3, 11\]: this model and tgt_ids take"):
        model.forward_routed(ids, forced=forced[..., 0], forced_weights=forced_weights)
    with pytest.raises(InputError, match="forced choices need their weights"):
        model.forward_routed(ids, forced=forced)

    # decoder_step_routed: a prefill and then one token a step line up with the forward's routing
    chunks = [(0, 4)] + [(t, t + 1) for t in range(4, ids.shape[1])]
    for replayed, replayed_weights in ((None, None), (forced, forced_weights)):
        cache = model.start_cache(len(ids), ids.shape[1], in_place=False)
        steps, choices, weighed = [], [], []
        for begin, end in chunks:
            step_logits, step_chosen, step_weights, cache = model.decode_step_routed(
                cache, ids[:, begin:end], forced=None if replayed is None else replayed[:, :, begin:end],
                forced_weights=None if replayed is None else replayed_weights[:, :, begin:end])
            steps.append(step_logits)
            choices.append(step_chosen)
            weighed.append(step_weights)
        want_logits, want_chosen, want_weights = model.forward_routed(ids, forced=replayed,
                                                                      forced_weights=replayed_weights)
        assert np.array_equal(np.concatenate(choices, axis=2), want_chosen)
        assert_agrees(np.concatenate(weighed, axis=2), want_weights, **bounds, what="the steps' weights")
        assert_agrees(np.concatenate(steps, axis=1), want_logits, **bounds, what="the steps' logits")
    with pytest.raises(InputError, match="decode_step_routed writes decoder_step's cache; this one is the in-place"):
        model.decode_step_routed(model.start_cache(len(ids), ids.shape[1]), ids[:, :2])


@pytest.mark.slow
def test_the_jax_exports_routed_forward_gives_its_choices_and_takes_forced_ones():
    """onnx-jax's forward_routed: jax2onnx's graph of impl_jax's routing, the choices and weights its
    own (the golden's here) or the forced ones, int64 choices out as the torch export's, the logits
    impl_jax's with the same routing forced, its own weights at the forced choices impl_jax's."""
    from export.cache import exported
    from export.runner import OnnxTransformer
    cfg = get_preset("mixtral-tiny")
    params = conformance_params(cfg)
    model = OnnxTransformer(exported(cfg, params, framework="jax"), device="cpu")
    ids = _ids(cfg)
    with recorded_routing() as calls:
        want = _golden_logits(cfg, params, ids)
    logits, chosen, weights = model.forward_routed(ids)
    bounds = model_bounds(cfg, ids.shape[1]) | {"dtype": "float32"}  # as the torch export's above
    assert chosen.dtype == np.int64 and np.array_equal(chosen, np.stack([call.chosen for call in calls]))
    assert_agrees(weights, np.stack([call.weights for call in calls]), **bounds, what="its own weights")
    assert_agrees(logits, want, **bounds, what="logits")
    forced = np.broadcast_to(np.array([4, 1]), chosen.shape).copy()
    forced_weights = np.broadcast_to(np.array([0.25, 0.5], np.float32), chosen.shape).copy()
    logits, taken, own = model.forward_routed(ids, forced=forced, forced_weights=forced_weights)
    jax_model_forced = impl_jax.Transformer.from_params(cfg, params, dtype="float32")
    with jax_model_forced.routing_log(forced=list(forced), forced_weights=list(forced_weights)) as log:
        expected = np.asarray(jax_model_forced(None, ids))
    assert np.array_equal(taken, forced)
    assert_agrees(logits, expected, **bounds, what="logits at the forced choices")
    assert_agrees(own, np.stack(log.own_weights()), **bounds, what="its own weights at the forced choices")


@pytest.mark.slow
def test_the_onnx_jax_column_replays_the_forward(monkeypatch):
    """qwen3-moe-tiny's forward-long at float16 flips a choice near a tie in jax2onnx's graph too:
    it passes with the golden's choices replayed in its forward_routed graph, saying so."""
    cell = _cells(monkeypatch, "qwen3-moe-tiny", "float16", "forward-long*", backend="onnx-jax")["forward-long"]
    assert cell.status == PASS and cell.reason.startswith("routing replayed: the router chose differently at"), \
        cell.reason


def _experts_gate_and_up_swapped(source, planted):
    """A copy of the export at source whose every graph reads each expert's gate weight (w1) where
    its up weight (w3) lies and back: _gate_and_up_swapped as a served graph would carry it, made
    from the cached export instead of a second one (a torch export of an MoE preset is ~35 s)."""
    import json
    import shutil

    import onnx

    shutil.copytree(source, planted)
    swapped = 0
    for file in json.loads((planted / "manifest.json").read_text())["graphs"].values():
        graph = onnx.load(str(planted / file), load_external_data=False)
        stored = {tensor.name: tensor for tensor in graph.graph.initializer}
        for name, gate in stored.items():
            if re.fullmatch(r".*\.experts\.\d+\.w1\.weight", name):
                up = stored[name.replace(".w1.", ".w3.")]
                gate_at, up_at = list(gate.external_data), list(up.external_data)
                del gate.external_data[:], up.external_data[:]
                gate.external_data.extend(up_at)
                up.external_data.extend(gate_at)
                swapped += 1
        onnx.save(graph, str(planted / file))
    assert swapped, "the export stores no expert's gate weight apart"


@pytest.mark.slow
def test_the_onnx_column_replays_the_forward_and_names_an_expert_mistake(monkeypatch, tmp_path):
    """qwen3-moe-tiny's forward-long at float16 flips a choice near a tie: it passes with the
    golden's routing replayed in the routed graph; an expert mistake in the served graphs (each
    expert's gate and up weights swapped) still fails with the routing replayed. decode-incremental
    the same, through decoder_step_routed."""
    from conformance.backends import onnx_backend

    # forward-long and decode-incremental (and the decoder sublayer's cells, which onnx skips)
    both = "[fd]*-[li][on]*"
    cells = _cells(monkeypatch, "qwen3-moe-tiny", "float16", both, backend="onnx")
    for name in ("forward-long", "decode-incremental"):
        assert cells[name].status == PASS and cells[name].reason.startswith("routing replayed:"), cells[name].reason
    served = onnx_backend.exported

    def planted(cfg, params, **options):
        if not (tmp_path / "planted").exists():
            _experts_gate_and_up_swapped(served(cfg, params, **options), tmp_path / "planted")
        return tmp_path / "planted"

    monkeypatch.setattr(onnx_backend, "exported", planted)
    cells = _cells(monkeypatch, "qwen3-moe-tiny", "float16", both, backend="onnx")
    for name in ("forward-long", "decode-incremental"):
        assert cells[name].status == FAIL and cells[name].reason.startswith(
            "with the golden's routing replayed the cell still fails"), cells[name].reason


def test_an_expert_no_token_chose_still_takes_the_optimizers_step():
    """One token chooses 2 of mixtral-tiny's 5 experts per layer. torch.optim skips a parameter
    without a .grad, and the loop form's unchosen experts have none (they ran on nothing), where
    the spec's AdamW step gives them a zero gradient and still decays their weights. impl_torch's
    step gives them that zero gradient: each of two steps, from torch's own state, is the spec's
    AdamW step on every parameter within SPEC §14's bounds (a skipped expert is off by lr·λ·‖θ‖)."""
    from conformance.backends.torch_backend import TorchRunner
    from conformance.cases import Case
    from conformance.training_cells import TrainingReference, compare_training, step_tolerances
    from spec.training import TrainingConfig

    cfg = get_preset("mixtral-tiny")
    # without the load-balancing loss, whose gradient reaches every router column: Adam turns a column's
    # rounding-sized gradient into a step (tests/test_training.py's b^K), and the next step routes on it
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_balancing=0.0))
    params = conformance_params(cfg)
    training = TrainingConfig(optimizer="adamw", weight_decay=0.3, warmup_steps=2, learning_rate_scale=1.0)
    tgt_ids, targets = np.array([[5]]), np.array([[7]])
    with recorded_routing() as calls:
        golden.model_logits(cfg, golden.cast_params(cfg, params), None, tgt_ids)
    unchosen = [f"decoder.layers.{layer}.ffn.experts.{expert}.w1.weight" for layer, call in enumerate(calls)
                for expert in sorted(set(range(cfg.moe.n_experts)) - set(call.chosen.ravel().tolist()))]
    runner = TorchRunner(cfg, params, "float64", "cpu", "math")  # the loop form
    assert not runner.model.decoder.layers[0].ffn.batched
    inputs = {"training": training, "src_ids": None, "tgt_ids": np.stack([tgt_ids] * 2),
              "targets": np.stack([targets] * 2)}
    trace = runner.train("train_steps", inputs)
    assert len(unchosen) == 3 * cfg.n_decoder_layers and all(not trace[0]["gradients"][name].any() for name in unchosen)
    reference = TrainingReference(cfg, params, inputs)
    assert all(not np.array_equal(trace[-1]["params"][name], params[name]) for name in unchosen)  # decayed
    # the training case's bounds (conformance/cases.py): one position, so the longest sum is d, d_ff or V
    case = Case("train_steps", "none", inputs, max(cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size))
    result = compare_training(trace, reference, "float64", **step_tolerances(cfg, case, "float64"))
    assert result.passed, result.reason


def _router_off_in_half_precision(self, tokens, batch=1):
    """A router whose logit for expert 0 is 0.1 too high in float16 and bfloat16 only, as a fused
    half-precision kernel's mistake would be; float32 is the real route."""
    linear = self.router

    def biased(inputs):
        logits = torch.nn.functional.linear(inputs, linear.weight)
        if logits.dtype not in (torch.float16, torch.bfloat16):
            return logits
        return logits + torch.tensor([0.1] + [0.0] * (logits.shape[-1] - 1), dtype=logits.dtype)

    self.__dict__["_modules"]["router"] = biased  # nn.Module keeps its children here
    try:
        return _ORIGINAL_ROUTE(self, tokens, batch)
    finally:
        self.__dict__["_modules"]["router"] = linear


_ORIGINAL_ROUTE = torch_model.MixtureOfExperts.route


@pytest.mark.parametrize("preset", ["mixtral-tiny", "qwen3-moe-tiny"])
def test_a_router_off_by_a_tenth_in_half_precision_fails_at_float16_and_bfloat16(monkeypatch, preset):
    """SPEC §5.14: the router is judged on its own input, to its own rounding. A logit 0.1 too high
    at half precision only (about 6 bfloat16 ulps of a logit near 3) fails the router cell at both
    half precisions, and the whole model's cells name the router, not rounding; float32 passes."""
    monkeypatch.setattr(torch_model.MixtureOfExperts, "route", _router_off_in_half_precision)
    cfg = get_preset(preset)
    plan = plan_matrix(cfg, ["torch"], ["float32", "float16", "bfloat16"], ["cpu"])
    cells = {(r.dtype, f"{r.sublayer}-{r.mask_case}"): r
             for r in run_matrix(cfg, conformance_params(cfg), plan, pattern="[rf]o[ur]*-[nl]o*")}
    for dtype in ("float16", "bfloat16"):
        router = cells[dtype, "router-none"]
        assert router.status == FAIL and router.max_abs_err > 10 * router.tol, router.reason
        assert "on the same input" in router.reason or "clear of its own rounding" in router.reason
        forward = cells[dtype, "forward-long"]
        assert forward.status == FAIL and forward.reason.startswith("the router "), forward.reason
        assert "on the input it saw" in forward.reason
    assert cells["float32", "router-none"].status == PASS and cells["float32", "forward-long"].status == PASS


def test_the_router_cell_judges_its_choices_and_weights(monkeypatch):
    """The router cell compares the chosen experts and their weights, not only the probabilities:
    weights left unrenormalised, and a top-k that takes the k least likely experts, each fail it at
    float32 with the probabilities right."""
    def unrenormalised(self, tokens, batch=1):
        probabilities, chosen, weights = _ORIGINAL_ROUTE(self, tokens, batch)
        return probabilities, chosen, probabilities.gather(-1, chosen).to(weights.dtype)

    def least_likely(self, tokens, batch=1):
        probabilities, chosen, weights = _ORIGINAL_ROUTE(self, tokens, batch)
        chosen = torch.sort(probabilities, dim=-1, stable=True).indices[:, :self.k]
        return probabilities, chosen, weights

    cfg = get_preset("mixtral-tiny")
    plan = plan_matrix(cfg, ["torch"], ["float32"], ["cpu"])
    for route, words in ((unrenormalised, "the router's weight"), (least_likely, "the router chose differently")):
        monkeypatch.setattr(torch_model.MixtureOfExperts, "route", route)
        cell, = run_matrix(cfg, conformance_params(cfg), plan, pattern="router-none")
        assert cell.status == FAIL and cell.reason.startswith(words), cell.reason


def test_the_near_tie_share_is_the_routers_own_rounding():
    """SPEC §5.14: the decisions within the router's own rounding of a tie, on the tiny presets'
    forward-long (3,120 each): none at float32, a few at bfloat16 (mixtral-tiny 9, qwen3-moe-tiny 16:
    under 1%; the whole model's tolerance as the bound counted 83-94%)."""
    for preset in ("mixtral-tiny", "qwen3-moe-tiny"):
        cfg = get_preset(preset)
        params = conformance_params(cfg)
        [row] = routing_margins(cfg, params, [cells.CellResult("torch", "cpu", dtype, "forward", "long", PASS)
                                              for dtype in ("float32", "float16", "bfloat16")])
        assert row["decisions"] == 3120 and row["near_ties"]["float32"] == 0
        assert 0 < row["near_ties"]["bfloat16"] < 0.01 * row["decisions"], row


# ---- the shared expert (SPEC §5.14: Qwen2-MoE, Qwen3-Next) ------------------------------------

_QWEN3_MOE = get_preset("qwen3-moe-tiny")
SHARED = _QWEN3_MOE.replace(moe=dataclasses.replace(_QWEN3_MOE.moe, shared_expert_d_ff=24))
# the block's cells and its gradients (the golden's shared_expert_vjp) up to one AdamW step of the whole
# model; qwen3-next-tiny's shared experts run in every whole-model cell of the torch and JAX columns
# (tests/test_torch.py's and test_jax.py's every preset, test_gated_delta_net.py's Qwen3-Next cells)
SHARED_CELLS = "ffn-none|experts-*|grad-ffn-none*|train_step-none*"


def test_a_shared_expert_passes_the_frameworks_cells_forward_and_back():
    """σ(x g) · FFN_shared(x) beside the k routed experts, in torch's two forms of the block (batched,
    the loop) at float32: forward, gradient and training cells; JAX's block and its gradient (its
    training step is the same autodiff, through the model: tests/test_training_cells.py)."""
    params = conformance_params(SHARED)
    results = run_matrix(SHARED, params, plan_matrix(SHARED, ["torch", "torch-math"], ["float32"], ["cpu"]),
                         pattern=SHARED_CELLS, backward=True)
    results += run_matrix(SHARED, params, plan_matrix(SHARED, ["jax"], ["float32"], ["cpu"]),
                          pattern="experts-none|grad-ffn-none*", backward=True)
    failed = {r.test_id: r.reason[:200] for r in results if r.status not in (PASS, "skip")}
    assert not failed, failed
    ran = {r.test_id for r in results if r.status == PASS}
    wanted = {f"{cell}-float32-{backend}-cpu" for cell in ("experts-none", "grad-ffn-none", "train_step-none")
              for backend in ("torch", "torch-math")} | {"experts-none-float32-jax-cpu", "grad-ffn-none-float32-jax-cpu"}
    assert wanted <= ran, wanted - ran


@pytest.mark.parametrize("mistake", ["ungated", "left_out"])
def test_a_shared_expert_ungated_or_left_out_fails_the_cells_that_run_it(monkeypatch, mistake):
    """A port that adds the shared expert without its sigmoid gate, or drops it (a block copied from
    Qwen3-MoE's), fails the block's cells and the model's."""
    block = torch_model.MixtureOfExperts
    if mistake == "ungated":
        monkeypatch.setattr(block, "shared", lambda self, x: self.shared_expert(x))
    else:
        monkeypatch.setattr(block, "forward", block.routed)
    results = run_matrix(SHARED, conformance_params(SHARED), plan_matrix(SHARED, ["torch"], ["float32"], ["cpu"]),
                         pattern="ffn-none|experts-none|forward-pad_right*")
    assert {r.test_id for r in results if r.status == FAIL} == {
        f"{cell}-float32-torch-cpu" for cell in ("ffn-none", "experts-none", "forward-pad_right")}
