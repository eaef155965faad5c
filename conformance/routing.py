"""A mixture of experts' routing, checked (SPEC §5.14): the golden's choices and their margins
per case (golden_routing), the report's table of each case's smallest margin and near ties
(routing_margins), and the split of a failing cell, by replaying the golden's choices in the
column (replayed_routing) or, where the column cannot, by counting the case's near ties (near_ties)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from conformance.adapter import NotSupported
from conformance.backends.numpy_backend import NumpyRunner, golden_output
from conformance.cases import NEAR_TIE_CASES, TEXT_CASES, Case, build_case, forward_of, is_gradient, is_training
from conformance.memory import golden_budget
from conformance.tolerance import tolerance
from conformance.training_cells import OPTIMIZER_QUANTITIES, failing_step
from spec import ModelConfig

# the cases whose routing the report states: between them every position of the model's inputs
ROUTED_SUBLAYERS = ("forward", "decode", "generate")


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's routing of a case, every position of every call joined along the positions."""

    layer: int
    chosen: np.ndarray  # [B, T, k], largest first
    weights: np.ndarray  # [B, T, k]: the chosen experts' weights
    margins: np.ndarray  # [B, T]: p_(k) − p_(k+1)
    logit_scale: np.ndarray  # [B, T]: max_e |z_e|

    def bound(self, cfg: ModelConfig, dtype: str) -> np.ndarray:
        """2ρ·max|z| [B, T]: the most rounding at dtype can move a margin, or a weight, here, ρ
        the tolerance at the layer's depth (SPEC §8): logits off by δ = ρ·max|z| move each
        probability, and each renormalised weight, by at most 2δ of itself."""
        return 2 * tolerance(dtype, cfg.d_model, 2 * (self.layer + 1)) * self.logit_scale

    def near_ties(self, cfg: ModelConfig, dtype: str) -> np.ndarray:
        """[B, T]: the decisions rounding at dtype could flip."""
        return self.margins < self.bound(cfg, dtype)


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
    return [LayerRouting(layer, *(np.concatenate([getattr(call, field) for call in calls[layer::count]], axis=1)
                                  for field in ("chosen", "weights", "margins", "logit_scale")))
            for layer in range(count)]


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
    near = sum(int(layer.near_ties(cfg, dtype).sum()) for layer in layers)
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
    return _split(cfg, dtype, failed, replayed, log.layers(), golden, replay.own_weights(), golden)


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
    return _split(cfg, dtype, failed, replayed, chosen, _joined(free), replay.own_weights(), _joined(given),
                  lambda row, position: f"step {position // positions + 1}, row {row}, position {position % positions}")


def _joined(steps: Sequence[Sequence[LayerRouting]]) -> list[LayerRouting]:
    """Each layer's routing of several steps, joined along the positions in step order."""
    return [LayerRouting(layers[0].layer, *(np.concatenate([getattr(layer, field) for layer in layers], axis=1)
                                            for field in ("chosen", "weights", "margins", "logit_scale")))
            for layers in zip(*steps)]


def _split(cfg: ModelConfig, dtype: str, failed, replayed, layers: Sequence[np.ndarray], golden: Sequence[LayerRouting],
           own: Sequence[np.ndarray], given: Sequence[LayerRouting],
           place=lambda row, position: f"row {row}, position {position}"):
    """The verdict of replayed_routing: `layers` the free run's choices and `golden` the golden's
    routing where the free run was; `replayed` the replayed run's verdict, `own` the weights its
    layers computed themselves and `given` the golden's routing it was given. place(row, position)
    names a token."""
    if [chosen.shape for chosen in layers] != [layer.chosen.shape for layer in golden]:
        return failed
    weighed = bool(own) and [w.shape for w in own] == [layer.weights.shape for layer in given]
    what = "routing" if weighed else "expert choices"  # a runner whose log records no weights of its own
    flips = [(np.sort(mine, axis=-1) != np.sort(layer.chosen, axis=-1)).any(axis=-1)  # [B, T] per layer
             for mine, layer in zip(layers, golden)]
    agreement = ("the routing agrees with the golden's at every token" if not any(f.any() for f in flips) else
                 f"the router chose differently at {sum(int(f.sum()) for f in flips)} token(s)")
    if not replayed.passed:
        step = failing_step(replayed.reason or "")
        if step is not None and step.split()[-1] in OPTIMIZER_QUANTITIES:  # the model's part of the step agreed
            return replace(replayed, reason=f"with the golden's {what} replayed the run still fails, at {step}: in "
                                            f"the optimizer's update, past the model ({agreement}): {replayed.reason}")
        return replace(replayed, reason=f"with the golden's {what} replayed the cell still fails, so the experts or "
                                        f"the rest of the layer compute differently ({agreement}): {replayed.reason}")
    # layer by layer, the first whose router chose or weighed differently beyond rounding is named
    # (a later layer's differences may follow from it): the choices of the free run, where they
    # first differ, and the weights each layer computed itself in the replayed run
    first = next((index for index, f in enumerate(flips) if f.any()), None)
    bounds = [routing.bound(cfg, dtype) for routing in golden]  # [B, T] per layer
    worst = 0.0
    for index, (routing, bound) in enumerate(zip(golden, bounds)):
        clear = flips[index] & (routing.margins >= bound) if index == first else None
        if clear is not None and clear.any():
            return _router_differs(failed, what, "chose differently", "clear of a tie", clear, index, place,
                                   lambda row, position: (
                f" (margin {routing.margins[row, position]:.3g} >= rounding bound {bound[row, position]:.3g}): golden "
                f"experts {routing.chosen[row, position].tolist()}, here {layers[index][row, position].tolist()}"))
        if weighed:
            weights, bound = given[index].weights, given[index].bound(cfg, dtype)
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
    note = f"{what} replayed: {'; '.join(notes)}"
    return replace(replayed, reason=f"{note}; {replayed.reason}" if replayed.reason else note)


def _router_differs(failed, what: str, verb: str, beyond: str, where: np.ndarray, layer: int, place, describe):
    """The cell failed, naming the router: how many tokens `where` marks [B, T], and the first
    (in position order: a training run's earliest step)."""
    position, row = (int(i) for i in np.argwhere(where.T)[0])
    return replace(failed, reason=(
        f"the router {verb} at {int(where.sum())} token(s) {beyond}; first: MoE layer {layer}, {place(row, position)}"
        f"{describe(row, position)}; with the golden's {what} replayed the cell passes; {failed.reason}"))
