"""A mixture of experts' routing, checked (SPEC §5.14): the golden's choices and their margins
per case (golden_routing), the report's table of each case's smallest margin and near ties
(routing_margins), and the split of a failing cell, by replaying the golden's choices in the
column (replayed_routing) or, where the column cannot, by counting the case's near ties (near_ties)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from conformance.adapter import NotSupported
from conformance.backends.numpy_backend import NumpyRunner, golden_output
from conformance.cases import (NEAR_TIE_CASES, ROUTER_OUTPUTS, TEXT_CASES, Case, build_case, forward_of, is_gradient,
                               is_training)
from conformance.plan.memory import golden_budget
from conformance.tolerance import ACCUMULATE, SAFETY, UNIT_ROUNDOFF, Comparison, held_at, tolerance
from conformance.training_cells import OPTIMIZER_QUANTITIES, failing_step
from spec import ModelConfig

# the cases whose routing the report states: between them every position of the model's inputs
ROUTED_SUBLAYERS = ("forward", "decode", "generate")


_FIELDS = ("chosen", "weights", "margins", "logits", "absolute")


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's routing of a case, every position of every call joined along the positions."""

    layer: int
    chosen: np.ndarray  # [B, T, k], largest first
    weights: np.ndarray  # [B, T, k]: the chosen experts' weights
    margins: np.ndarray  # [B, T]: p_(k) − p_(k+1)
    logits: np.ndarray  # [B, T, E]: z = x R
    absolute: np.ndarray  # [B, T, E]: Σ_d |x_d R_de|

    @cached_property
    def probabilities(self) -> np.ndarray:
        """[B, T, E]: p = softmax(z)."""
        from impl_numpy.model import softmax

        return softmax(self.logits)

    @cached_property
    def logit_margins(self) -> np.ndarray:
        """[B, T]: z_(k) − z_(k+1) = ln(p_(k) / p_(k+1)), the choice's distance from a tie in logits."""
        k = self.chosen.shape[-1]
        ordered = -np.sort(-self.logits, axis=-1)
        return ordered[..., k - 1] - ordered[..., k] if k < ordered.shape[-1] else np.full(ordered.shape[:-1], np.inf)

    def differs(self, chosen: np.ndarray) -> np.ndarray:
        """[B, T]: where the experts `chosen` [B, T, k] are not this routing's (as sets: a top-k may
        give its k in any order)."""
        return (np.sort(chosen, axis=-1) != np.sort(self.chosen, axis=-1)).any(axis=-1)

    def rounding(self, cfg: ModelConfig, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """(β, σ) [B, T, E], SPEC §5.14: how far rounding at dtype can move each logit of a router
        run on this input (x and R as a column at dtype holds them), β_e = u·|z_e| (z_e rounded once
        to the dtype) + (8·u_sum·√d)·Σ_d|x_d R_de| (the sum, as §8 bounds one; TF32 also rounds x and
        R before the product: 2u·Σ|x R|); and σ_e, its softmax's own rounding of p_e, relative:
        8·u_sum·√E where the softmax is at least float32, else u·(2 + |z_e − max z|) beside it (the
        difference and the quotient rounded to the dtype)."""
        storage, accumulate = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[ACCUMULATE[dtype]]
        products = 2 * storage if dtype == "tf32" else 0.0
        beta = storage * np.abs(self.logits) + (SAFETY * accumulate * math.sqrt(cfg.d_model) + products) * self.absolute
        sigma = np.full(self.logits.shape, SAFETY * accumulate * math.sqrt(self.logits.shape[-1]))
        if dtype in ("float16", "bfloat16") and cfg.moe.router_softmax != "float32":
            sigma = sigma + storage * (2 + (self.logits.max(axis=-1, keepdims=True) - self.logits))
        return beta, sigma

    def bound(self, cfg: ModelConfig, dtype: str) -> np.ndarray:
        """[B, T]: the most rounding at dtype can move the logit margin z_(k) − z_(k+1) of a router run
        on this input: β + σ of the k-th and of the (k+1)-th expert."""
        beta, sigma = self.rounding(cfg, dtype)
        k = self.chosen.shape[-1]
        order = np.argsort(-self.logits, axis=-1, kind="stable")[..., k - 1:k + 1]
        return np.take_along_axis(beta + sigma, order, axis=-1).sum(axis=-1)

    def near_ties(self, cfg: ModelConfig, dtype: str) -> np.ndarray:
        """[B, T]: the decisions the router's own rounding at dtype could flip."""
        return self.logit_margins <= self.bound(cfg, dtype)

    def weights_of(self, cfg: ModelConfig, chosen: np.ndarray) -> np.ndarray:
        """[B, T, k]: the weights this router gives the experts `chosen` [B, T, k]."""
        from impl_numpy.model import routing_weights

        return routing_weights(self.probabilities, chosen, cfg.moe.renormalize)

    def weight_bound(self, cfg: ModelConfig, dtype: str, chosen: np.ndarray) -> np.ndarray:
        """[B, T, k]: the most rounding at dtype can move the weight of each expert `chosen`: ln w_j
        moves by at most β_j + Σ_i w_i β_i (over the k where renormalised, the E otherwise) + σ_j +
        max σ + u (the weights rounded to the dtype), so |δw_j| ≤ w_j·(e^that − 1)."""
        beta, sigma = self.rounding(cfg, dtype)
        weights = self.weights_of(cfg, chosen)
        if cfg.moe.renormalize:
            beta_chosen = np.take_along_axis(beta, chosen, axis=-1)
            shared = (weights * beta_chosen).sum(axis=-1, keepdims=True)
            softmax = np.take_along_axis(sigma, chosen, axis=-1).max(axis=-1, keepdims=True)
        else:
            shared = (self.probabilities * beta).sum(axis=-1, keepdims=True)
            softmax = 0.0
        own = np.take_along_axis(beta + sigma, chosen, axis=-1)
        return weights * np.expm1(own + shared + softmax + UNIT_ROUNDOFF[dtype])

    def propagated_bound(self, cfg: ModelConfig, dtype: str) -> np.ndarray:
        """2ρ·max|z| [B, T] in probabilities, ρ the tolerance at the layer's depth (SPEC §8): the bound
        for a column whose routing log does not give its router's inputs (an exported graph), which
        must cover the rounding of everything below the router too."""
        return 2 * tolerance(dtype, cfg.d_model, 2 * (self.layer + 1)) * np.abs(self.logits).max(axis=-1)


def routing_on(cfg: ModelConfig, params: Mapping[str, np.ndarray], layer: int, inputs: np.ndarray,
               dtype: str) -> LayerRouting:
    """The golden's router of decoder layer `layer` on a column's own router input [B, T, d], its
    router weight held at dtype as the column holds it: what the column's router must choose and
    weigh, to within LayerRouting.rounding (SPEC §5.14)."""
    from impl_numpy.model import routing_margins, routing_weights, softmax, top_experts

    router = held_at(params[f"decoder.layers.{layer}.ffn.router.weight"], dtype)
    bias = params.get(f"decoder.layers.{layer}.ffn.router.bias")  # gpt-oss's router
    bias = np.zeros(router.shape[-1]) if bias is None else held_at(bias, dtype)
    x = held_at(inputs, dtype)
    logits = x @ router + bias
    probabilities = softmax(logits)
    chosen = top_experts(probabilities, cfg.moe.experts_per_token)
    return LayerRouting(layer, chosen, routing_weights(probabilities, chosen, cfg.moe.renormalize),
                        routing_margins(probabilities, cfg.moe.experts_per_token), logits,
                        np.abs(x) @ np.abs(router) + np.abs(bias))


# half the smallest subnormal of each dtype: the most that rounding a value near 0 to it can move it
_UNDERFLOW = {"float64": 2.0 ** -1075, "float32": 2.0 ** -150, "tf32": 2.0 ** -150, "float16": 2.0 ** -25,
              "bfloat16": 2.0 ** -134}


def probability_underflow(cfg: ModelConfig, dtype: str) -> float:
    """The absolute rounding of a router probability held at dtype: a probability whose softmax is in the
    activations' dtype (router_softmax "activation", gpt-oss) is a float16 at float16, where a p below
    2⁻²⁴ (6e-8) rounds to a subnormal or to 0, which no relative bound covers; else at least float32."""
    held = dtype if cfg.moe.router_softmax == "activation" or dtype in ("float64", "float32", "tf32") else "float32"
    return _UNDERFLOW[held]


def compare_router(cfg: ModelConfig, params: Mapping[str, np.ndarray], case: Case, output, dtype: str) -> Comparison:
    """A router cell (SPEC §5.14): the column's probabilities, choices and weights against the golden
    router's on the case's input and router weight as the column holds them (routing_on), each
    within the router's own rounding at dtype: a probability within p_e·(e^r − 1), r = β_e + Σ_j p_j
    β_j + σ_e; the chosen experts the golden's, but where the logit margin is within its bound;
    their weights within weight_bound. Element by element, so the comparison's tol is the worst
    element's own bound."""
    layer = _decoder_layers(case, 1)[0]
    golden = routing_on(cfg, params, layer, np.asarray(case.inputs["x"]), dtype)
    if not isinstance(output, Mapping) or set(output) != set(ROUTER_OUTPUTS):
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None,
                          f"a router's output is {{{', '.join(ROUTER_OUTPUTS)}}}; got {type(output).__name__}")
    probabilities, chosen, weights = (np.asarray(output[name]) for name in ROUTER_OUTPUTS)
    if probabilities.shape != golden.logits.shape or not chosen.shape == weights.shape == golden.chosen.shape:
        return Comparison(False, math.inf, math.inf, 0.0, None, None, None,
                          f"shapes {[list(np.shape(output[name])) for name in ROUTER_OUTPUTS]}, expected "
                          f"{[list(golden.logits.shape), list(golden.chosen.shape), list(golden.chosen.shape)]}")
    beta, sigma = golden.rounding(cfg, dtype)
    expected = golden.probabilities
    relative = beta + (expected * beta).sum(axis=-1, keepdims=True) + sigma
    limit = expected * np.expm1(relative) + probability_underflow(cfg, dtype)
    checks = [("probability", probabilities.astype(np.float64), expected, limit)]
    chosen = chosen.astype(np.int64)
    flipped = golden.differs(chosen)
    margins, bound = golden.logit_margins, golden.bound(cfg, dtype)
    clear = flipped & (margins > bound)
    if clear.any():
        row, position = (int(i) for i in np.argwhere(clear)[0])
        return Comparison(False, float(margins[row, position]), math.inf, float(bound[row, position]), (row, position),
                          None, None, (
            f"the router chose differently at {int(clear.sum())} token(s) clear of its own rounding of a tie; "
            f"first: row {row}, position {position}: golden experts {golden.chosen[row, position].tolist()}, here "
            f"{chosen[row, position].tolist()} (logit margin {margins[row, position]:.3g} > rounding bound "
            f"{bound[row, position]:.3g})"))
    if (chosen >= 0).all() and (chosen < golden.logits.shape[-1]).all():
        checks.append(("weight", weights.astype(np.float64), golden.weights_of(cfg, chosen),
                       golden.weight_bound(cfg, dtype, chosen)))
    worst = None
    for what, actual, want, limit in checks:
        with np.errstate(invalid="ignore"):
            difference = np.abs(actual - want)
        difference[np.isnan(difference)] = np.inf
        ratio = difference / np.maximum(limit, np.finfo(float).tiny)
        index = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        if worst is None or ratio[index] > worst[0]:
            worst = (float(ratio[index]), what, index, float(difference[index]), float(limit[index]),
                     float(actual[index]), float(want[index]))
    ratio, what, index, difference, limit, actual, want = worst
    error = probabilities.astype(np.float64) - expected
    relative_error = float(np.linalg.norm(error) / np.linalg.norm(expected))
    passed = ratio <= 1
    where = ", ".join(str(int(i)) for i in index)
    return Comparison(passed, difference, relative_error, limit, tuple(int(i) for i in index), actual, want,
                      "" if passed else f"the router's {what} at [{where}] is {actual:.6g}, the golden router's "
                                        f"{want:.6g} on the same input: |Δ| {difference:.3g} > its rounding bound "
                                        f"{limit:.3g}")


def golden_routing(cfg: ModelConfig, params: Mapping[str, np.ndarray], case: Case, step: int = 0) -> list[LayerRouting]:
    """The golden's routing of a case, per MoE layer (a gradient case's is its forward's, a
    training case's its step's batch's forward's, at `params`; a generation's steps joined along
    the positions)."""
    from impl_numpy.model import recorded_routing  # the golden's own routing, recorded as it runs

    with recorded_routing() as calls:
        if is_training(case.sublayer):  # one step: its batch's forward, at the parameters it starts from
            source = case.inputs["src_ids"]
            at = NumpyRunner.at(cfg, {name: np.asarray(value, np.float64) for name, value in params.items()})
            golden_output(cfg, params, "forward", {"src_ids": None if source is None else source[step],
                                                   "tgt_ids": case.inputs["tgt_ids"][step]}, at)
        else:  # streamed layer by layer where a whole float64 cast would not fit beside the check's others
            golden_output(cfg, params, forward_of(case.sublayer) if is_gradient(case.sublayer) else case.sublayer,
                          case.inputs, NumpyRunner(cfg, params, "float64", golden_budget(cfg, params)))
    # a generation calls every layer once a step: its calls, grouped by layer, joined along the positions
    count = cfg.n_decoder_layers if case.sublayer == "generate" else len(calls)
    return [LayerRouting(decoder_layer, *(np.concatenate([getattr(call, field) for call in calls[index::count]], axis=1)
                                          for field in _FIELDS))
            for index, decoder_layer in enumerate(_decoder_layers(case, count))]


def _decoder_layers(case: Case, count: int) -> list[int]:
    """Which decoder layer each of a case's `count` routed calls is: a layer case's own (decoder_layer's
    index, an ffn, ffn_block or MoE case's module), else the model's in order."""
    if count != 1:
        return list(range(count))
    if "index" in case.inputs:
        return [int(case.inputs["index"])]
    module = case.inputs.get("module", case.inputs.get("layer"))
    if isinstance(module, str) and module.startswith("decoder.layers."):
        return [int(module.split(".")[2])]
    return list(range(count))


def routing_margins(cfg: ModelConfig, params: Mapping[str, np.ndarray], results: Sequence) -> list[dict]:
    """What the report states of a mixture of experts' routing: for each routed case that ran
    (ROUTED_SUBLAYERS; not the text cases, whose inputs are a tokenizer's) and each case meant to
    sit at a tie (NEAR_TIE_CASES, marked so), its decisions (tokens × layers), the smallest margin
    and where, and per dtype that ran it how many decisions sit within rounding of a tie. [] without
    experts."""
    if cfg.moe is None:
        return []
    dtypes_of: dict[tuple[str, str], set[str]] = {}
    for result in results:
        if ((result.sublayer in ROUTED_SUBLAYERS and result.mask_case not in TEXT_CASES
             or result.mask_case in NEAR_TIE_CASES and not is_gradient(result.sublayer))
                and result.status in ("pass", "fail", "error")):
            dtypes_of.setdefault((result.sublayer, result.mask_case), set()).add(result.dtype)
    rows = []
    for (sublayer, mask_case), dtypes in sorted(dtypes_of.items()):
        layers = golden_routing(cfg, params, build_case(cfg, params, sublayer, mask_case))
        closest = min(layers, key=lambda layer: layer.margins.min())
        row, position = np.unravel_index(np.argmin(closest.margins), closest.margins.shape)
        rows.append({"case": f"{sublayer}-{mask_case}", "at_a_tie_by_construction": mask_case in NEAR_TIE_CASES,
                     "decisions": sum(layer.margins.size for layer in layers),
                     "smallest_margin": float(closest.margins[row, position]),
                     "at": {"layer": closest.layer, "row": int(row), "position": int(position)},
                     "near_ties": {dtype: sum(int(layer.near_ties(cfg, dtype).sum()) for layer in layers)
                                   for dtype in sorted(dtypes)}})
    return rows


def format_routing_margins(rows: Sequence[dict]) -> str:
    """The routing_margins rows as a text table."""
    head = ("case", "decisions", "smallest margin", "at (layer, row, position)", "within rounding of a tie")
    lines = [(row["case"] + (" (at a tie by construction)" if row.get("at_a_tie_by_construction") else ""),
              str(row["decisions"]), f"{row['smallest_margin']:.3g}",
              f"({row['at']['layer']}, {row['at']['row']}, {row['at']['position']})",
              ", ".join(f"{dtype} {count}" for dtype, count in row["near_ties"].items())) for row in rows]
    widths = [max(len(text) for text in column) for column in zip(head, *lines)]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip()
                     for line in (head, *lines))


def near_ties(cfg: ModelConfig, params, case: Case, dtype: str, failed):
    """A failing cell of a column that cannot replay routing (an exported graph): how many of the
    case's routing decisions sit within rounding of a tie at its dtype, said beside the verdict."""
    layers = golden_routing(cfg, params, case)
    near = sum(int((layer.margins < layer.propagated_bound(cfg, dtype)).sum()) for layer in layers)
    if not near:
        return replace(failed, reason=f"{failed.reason}; no routing decision of the case is within rounding of a tie")
    return replace(failed, reason=(
        f"{failed.reason}; {near} routing decision(s) of the case are within rounding of a tie at {dtype} (smallest "
        f"margin {min(float(layer.margins.min()) for layer in layers):.2g}), and this column cannot replay the "
        "golden's routing in this case: a flip there may explain the failure"))


def replayed_routing(cfg: ModelConfig, params, case: Case, runner, dtype: str, judge, failed, output):
    """A mixture-of-experts model's failing cell, split (SPEC §5.14). The backend runs again with
    the golden's routing forced: its choices and their weights. If that run fails too, the experts or the rest of the
    layer compute differently, and the cell fails saying so. If it passes, the routing made the
    difference: in the first layer whose choices differ from the golden's, a token whose margin is
    clear of rounding (LayerRouting.bound) fails the cell as "the router chose differently"; then
    a token whose own weights, computed in the replayed run, are further from the golden's than
    that bound fails it as "the router weighted differently". Otherwise the replayed run's verdict
    stands, saying so: the free run's difference is rounding in the router (near a tie, or in its
    weights) carried through the gate (a later layer's differences follow from the first's).
    output(runner, case) runs the case."""
    golden = golden_routing(cfg, params, case)
    try:
        with runner.routing_log() as log:
            output(runner, case)
        with runner.routing_log(forced=[layer.chosen for layer in golden],
                                forced_weights=[layer.weights for layer in golden]) as replay:
            replayed = judge(output(runner, case))
    except NotSupported:  # a column that replays some cases only (an export's forward graph)
        return near_ties(cfg, params, case, dtype, failed)
    except Exception as error:  # noqa: BLE001 - the free run's own verdict stands
        return replace(failed, reason=f"{failed.reason}; replaying the golden's routing failed: {error}")
    seen = log.seen()
    judged = [routing_on(cfg, params, layer.layer, inputs, dtype) for layer, inputs in zip(golden, seen)] \
        if len(seen) == len(golden) else None
    return _split(cfg, dtype, failed, replayed, log.layers(), golden, replay.own_weights(), golden,
                  judged=judged, free_weights=log.own_weights())


def replayed_training(cfg: ModelConfig, params, case: Case, runner, dtype: str, judge, failed, output):
    """replayed_routing for a run of training steps. Each step after the first routes on
    parameters only the backend's run reaches, so the golden's routing is taken there, step by
    step: the replayed run is given, before each step, the golden's choices and weights at the
    parameters it starts that step from (RoutingLog.replay_each_step), and the free run's choices
    are judged against the golden's at the free run's own parameters, step by step."""
    given: list[list[LayerRouting]] = []  # per step of the replayed run: the routing it was given

    def routing_at(step: int, at: Mapping[str, np.ndarray]):
        # the first step is judged from the case's parameters, not the backend's copy of them (rounded to
        # its dtype), and so routed; a later step from the parameters the backend's run reached
        given.append(golden_routing(cfg, params if step == 0 else at, case, step))
        return [layer.chosen for layer in given[-1]], [layer.weights for layer in given[-1]]

    try:
        with runner.routing_log() as log:
            trace = output(runner, case)
        with runner.routing_log() as replay:
            replay.replay_each_step(routing_at)
            replayed = judge(output(runner, case))
        # the golden's routing of each step the free run took, at the parameters it started from
        starts = [params] + [record["params"] for record in trace[:-1]]
        free = [golden_routing(cfg, at, case, step)
                for step, (at, record) in enumerate(zip(starts, trace)) if "stopped" not in record]
    except NotSupported:
        return near_ties(cfg, params, case, dtype, failed)
    except Exception as error:  # noqa: BLE001 - the free run's own verdict stands
        return replace(failed, reason=f"{failed.reason}; replaying the golden's routing failed: {error}")
    positions = case.inputs["tgt_ids"].shape[-1]
    chosen = [layer[:, :len(free) * positions] for layer in log.layers()]  # not a step that stopped the run
    seen, judged = log.seen(), None
    if len(seen) == len(chosen):  # each step's router inputs judged by the router at that step's parameters
        judged = _joined([[routing_on(cfg, at, layer, inputs[:, step * positions:(step + 1) * positions], dtype)
                           for layer, inputs in enumerate(seen)] for step, at in enumerate(starts[:len(free)])])
    free_weights = [weights[:, :len(free) * positions] for weights in log.own_weights()]
    return _split(cfg, dtype, failed, replayed, chosen, _joined(free), replay.own_weights(), _joined(given),
                  lambda row, position: f"step {position // positions + 1}, row {row}, position {position % positions}",
                  judged=judged, free_weights=free_weights)


def _joined(steps: Sequence[Sequence[LayerRouting]]) -> list[LayerRouting]:
    """Each layer's routing of several steps, joined along the positions in step order."""
    return [LayerRouting(layers[0].layer, *(np.concatenate([getattr(layer, field) for layer in layers], axis=1)
                                            for field in _FIELDS))
            for layers in zip(*steps)]


def _split(cfg: ModelConfig, dtype: str, failed, replayed, layers: Sequence[np.ndarray], golden: Sequence[LayerRouting],
           own: Sequence[np.ndarray], given: Sequence[LayerRouting],
           place=lambda row, position: f"row {row}, position {position}", judged: Sequence[LayerRouting] | None = None,
           free_weights: Sequence[np.ndarray] = ()):
    """The verdict of replayed_routing: `layers` the free run's choices and `golden` the golden's
    routing where the free run was; `replayed` the replayed run's verdict, `own` the weights its
    layers computed themselves and `given` the golden's routing it was given. place(row, position)
    names a token. `judged`, where the column's log gave its routers' inputs: the golden's router
    on each layer's own input in the free run (routing_on), and `free_weights` the weights the
    free run's layers gave their choices; every layer's choices and weights are then judged there."""
    if [chosen.shape for chosen in layers] != [layer.chosen.shape for layer in golden]:
        return failed
    weighed = bool(own) and [w.shape for w in own] == [layer.weights.shape for layer in given]
    what = "routing" if weighed else "expert choices"  # a runner whose log records no weights of its own
    flips = [layer.differs(mine) for mine, layer in zip(layers, golden)]  # [B, T] per layer
    agreement = ("the routing agrees with the golden's at every token" if not any(f.any() for f in flips) else
                 f"the router chose differently at {sum(int(f.sum()) for f in flips)} token(s)")
    if not replayed.passed:
        step = failing_step(replayed.reason or "")
        if step is not None and step.split()[-1] in OPTIMIZER_QUANTITIES:  # the model's part of the step agreed
            return replace(replayed, reason=f"with the golden's {what} replayed the run still fails, at {step}: in "
                                            f"the optimizer's update, past the model ({agreement}): {replayed.reason}")
        return replace(replayed, reason=f"with the golden's {what} replayed the cell still fails, so the experts or "
                                        f"the rest of the layer compute differently ({agreement}): {replayed.reason}")
    if judged is not None and [layer.chosen.shape for layer in judged] == [c.shape for c in layers]:
        return _judged_on_own_inputs(cfg, dtype, failed, replayed, layers, judged, free_weights, place, agreement)
    # no router inputs to judge on: layer by layer, the first whose router chose or weighed
    # differently beyond the rounding of everything below it is named (a later layer's differences
    # may follow from it): the choices of the free run, where they first differ, and the weights
    # each layer computed itself in the replayed run
    first = next((index for index, f in enumerate(flips) if f.any()), None)
    bounds = [routing.propagated_bound(cfg, dtype) for routing in golden]  # [B, T] per layer
    worst = 0.0
    for index, (routing, bound) in enumerate(zip(golden, bounds)):
        clear = flips[index] & (routing.margins >= bound) if index == first else None
        if clear is not None and clear.any():
            return _router_differs(failed, what, "chose differently", "clear of a tie", clear, index, place,
                                   lambda row, position: (
                f" (margin {routing.margins[row, position]:.3g} >= rounding bound {bound[row, position]:.3g}): golden "
                f"experts {routing.chosen[row, position].tolist()}, here {layers[index][row, position].tolist()}"))
        if weighed:
            weights, bound = given[index].weights, given[index].propagated_bound(cfg, dtype)
            difference = np.abs(own[index] - weights).max(axis=-1)  # [B, T]
            beyond = difference > bound
            if beyond.any():
                return _router_differs(failed, what, "weighted differently", "beyond rounding", beyond, index, place,
                                       lambda row, position: (
                    f": golden weights {np.round(weights[row, position], 4).tolist()}, here "
                    f"{np.round(own[index][row, position], 4).tolist()} for experts "
                    f"{given[index].chosen[row, position].tolist()} (|Δw| {difference[row, position]:.3g} > rounding "
                    f"bound {bound[row, position]:.3g})"))
            worst = max(worst, float((difference / np.maximum(bound, np.finfo(float).tiny)).max(initial=0.0)))
    notes = []
    if first is not None:
        notes.append(f"{agreement}, those of MoE layer {first} each within rounding of a tie (smallest margin there "
                     f"{float(golden[first].margins[flips[first]].min()):.2g}, bound "
                     f"{float(bounds[first][flips[first]].min()):.2g})")
    if weighed:
        notes.append(f"the router's own weights within rounding of the golden's (largest |Δw| {worst:.2g} of its bound)")
    if not notes:  # the same choices, and no weights to tell: nothing explains the failure
        return failed
    notes.append("judged against the golden's margins with the rounding of everything below the router (this "
                 "column's routing log gives no router inputs)")
    note = f"{what} replayed: {'; '.join(notes)}"
    return replace(replayed, reason=f"{note}; {replayed.reason}" if replayed.reason else note)


def _judged_on_own_inputs(cfg: ModelConfig, dtype: str, failed, replayed, layers: Sequence[np.ndarray],
                          judged: Sequence[LayerRouting], free_weights: Sequence[np.ndarray], place, agreement: str):
    """_split where the column's routers are judged on their own inputs (SPEC §5.14): in every layer,
    a choice that is not the golden router's on the same input fails the cell unless that input's
    logit margin is within the router's own rounding (LayerRouting.bound); a weight further from the
    golden router's weight of the same choice than its rounding (weight_bound) fails it too. The
    replayed run (which passed) then stands: the routing made the difference, within rounding."""
    flips, closest, worst = 0, 0.0, 0.0
    weighed = [np.shape(w) for w in free_weights] == [np.shape(c) for c in layers]
    for index, (mine, routing) in enumerate(zip(layers, judged)):
        mine = np.asarray(mine, np.int64)
        flipped = routing.differs(mine)  # [B, T]
        margins, bound = routing.logit_margins, routing.bound(cfg, dtype)
        clear = flipped & (margins > bound)
        if clear.any():
            return _router_differs(failed, "routing", "chose differently", "clear of its own rounding of a tie", clear,
                                   routing.layer, place, lambda row, position: (
                f" on the input it saw (logit margin {margins[row, position]:.3g} > rounding bound "
                f"{bound[row, position]:.3g}): golden experts {routing.chosen[row, position].tolist()}, here "
                f"{mine[row, position].tolist()}"))
        if flipped.any():
            flips += int(flipped.sum())
            closest = max(closest, float((margins / bound)[flipped].max()))
        if not weighed:
            continue
        weights, limit = routing.weights_of(cfg, mine), routing.weight_bound(cfg, dtype, mine)  # [B, T, k]
        difference = np.abs(np.asarray(free_weights[index], np.float64) - weights)
        beyond = (difference > limit).any(axis=-1)
        if beyond.any():
            def described(row, position, difference=difference, limit=limit, weights=weights, mine=mine, index=index):
                j = int(np.argmax(difference[row, position] / limit[row, position]))
                return (f" on the input it saw: golden weights {np.round(weights[row, position], 4).tolist()}, here "
                        f"{np.round(free_weights[index][row, position], 4).tolist()} for experts "
                        f"{mine[row, position].tolist()} (|Δw| {difference[row, position, j]:.3g} > rounding bound "
                        f"{limit[row, position, j]:.3g})")
            return _router_differs(failed, "routing", "weighted differently", "beyond its own rounding", beyond,
                                   routing.layer, place, described)
        worst = max(worst, float((difference / np.maximum(limit, np.finfo(float).tiny)).max(initial=0.0)))
    seen = (f"as the golden router does but at {flips} token(s), each within its own rounding of a tie (margins up "
            f"to {closest:.2g} of their bound)" if flips else "as the golden router does at every token")
    notes = [f"{agreement}; on the inputs it saw, {seen}"]
    if weighed:
        notes.append(f"its weights within rounding of the golden router's ({worst:.2g} of their bound)")
    note = f"routing replayed: {'; '.join(notes)}"
    return replace(replayed, reason=f"{note}; {replayed.reason}" if replayed.reason else note)


def _router_differs(failed, what: str, verb: str, beyond: str, where: np.ndarray, layer: int, place, describe):
    """The cell failed, naming the router: how many tokens `where` marks [B, T], and the first
    (in position order: a training run's earliest step)."""
    position, row = (int(i) for i in np.argwhere(where.T)[0])
    return replace(failed, reason=(
        f"the router {verb} at {int(where.sum())} token(s) {beyond}; first: MoE layer {layer}, {place(row, position)}"
        f"{describe(row, position)}; with the golden's {what} replayed the cell passes; {failed.reason}"))
