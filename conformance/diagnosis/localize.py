"""Localization: which sublayer of a backend's whole model is wrong.

The whole model is cut into stages — embeddings, each encoder layer, the encoder's final norm,
each decoder layer, the decoder's final norm, the head — named by their canonical module
names. Each stage runs twice on the backend:

- isolated: fed the golden's own input to that stage (rounded to float32, as every catalogue
  input is), so an error cannot come from an earlier stage. The first isolated stage over its
  tolerance is *the* answer: the line to look at.
- chained: fed the backend's own output of the previous stage, showing how error grows
  through the stack (what the whole-model cases see). Decoder stages use the golden memory.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

import impl_numpy as golden
from conformance.adapter import NotSupported
from conformance.cases import SUBLAYERS, is_training
from conformance.harness import ERROR, FAIL, SKIP, CellResult
from conformance.tolerance import backward_error, compare, rotary_angle, tolerance
from spec import ModelConfig, params_under
from spec.masks import key_mask, real_tokens


@dataclass(frozen=True)
class Stage:
    name: str  # canonical module name, e.g. "decoder.layers.1"
    sublayer: str  # the catalogue sublayer that runs it
    isolated_ratio: float | None  # max|error| / tolerance with golden inputs; None when not run
    chained_ratio: float | None  # the same with the backend's own previous output
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.isolated_ratio is not None and not self.isolated_ratio <= 1.0


@dataclass(frozen=True)
class Localization:
    stages: list[Stage]

    @property
    def first_failure(self) -> Stage | None:
        return next((stage for stage in self.stages if stage.failed), None)

    def table(self) -> str:
        lines = [f"{'stage':<20} {'sublayer':<14} {'isolated':>10} {'chained':>10}"]
        for stage in self.stages:
            cells = [_ratio_text(stage.isolated_ratio), _ratio_text(stage.chained_ratio)]
            flag = "  <- first failure" if stage is self.first_failure else ""
            lines.append(f"{stage.name:<20} {stage.sublayer:<14} {cells[0]:>10} {cells[1]:>10}{stage.note}{flag}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        first = self.first_failure
        return {"first_failure": first.name if first else None,
                "stages": [{"name": s.name, "sublayer": s.sublayer, "isolated_ratio": _json_number(s.isolated_ratio),
                            "chained_ratio": _json_number(s.chained_ratio), "note": s.note} for s in self.stages]}


def _ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else ("inf" if math.isinf(ratio) else f"{ratio:.3g}")


def _json_number(value: float | None):
    return None if value is None or math.isfinite(value) else str(value)


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def localize(cfg: ModelConfig, params: Mapping[str, np.ndarray], runner, dtype: str,
             src_ids: np.ndarray | None, tgt_ids: np.ndarray) -> Localization:
    """Stage-by-stage comparison of a backend runner against the golden on one input."""
    p = golden.cast_params(cfg, params)
    stages: list[Stage] = []
    tgt_keep = real_tokens(cfg, tgt_ids, "tgt")
    plan = []  # (name, sublayer, golden function of the input, backend inputs given an input)
    memory_reference = None
    if cfg.has_encoder:
        src_keep = real_tokens(cfg, src_ids, "src")
        src_mask = key_mask(src_keep)
        plan.append(("src embedding", "embedding", None, {"ids": src_ids, "side": "src", "offset": 0}))
        for i in range(cfg.n_encoder_layers):
            layer = params_under(p, f"encoder.layers.{i}")
            plan.append((f"encoder.layers.{i}", "encoder_layer",
                         lambda x, layer=layer: golden.encoder_layer(cfg, layer, x, src_mask),
                         lambda x, i=i: {"index": i, "x": x, "mask": src_mask}))
        if cfg.final_norm:
            plan.append(("encoder.norm", "norm", lambda x: golden.norm(cfg, params_under(p, "encoder.norm"), x),
                         lambda x: {"module": "encoder.norm", "x": x}))
        memory_reference = golden.encoder(cfg, p, src_ids, src_keep)
    stages += _run_stages(runner, dtype, cfg, plan, golden.embed(cfg, p, src_ids, "src") if cfg.has_encoder else None,
                          0 if src_ids is None else src_ids.shape[1])

    memory = None if memory_reference is None else _f32(memory_reference)
    self_masks = golden.decoder_self_masks(cfg, tgt_keep)
    cross = None if memory is None else key_mask(real_tokens(cfg, src_ids, "src"))
    plan = [("tgt embedding", "embedding", None, {"ids": tgt_ids, "side": "tgt", "offset": 0})]
    for i in range(cfg.n_decoder_layers):
        if cfg.layer_kind(i) == "linear":  # a hybrid's gated DeltaNet layer: the real tokens are what it masks by
            plan.append((f"decoder.layers.{i}", "decoder_layer",
                         lambda y, layer=params_under(p, f"decoder.layers.{i}"): golden.linear_layer(
                             cfg, layer, y, tgt_keep)[0],
                         lambda y, i=i: {"index": i, "y": y, "memory": None, "cross_mask": None,
                                         "tgt_keep": np.asarray(tgt_keep)}))
            continue
        layer, self_mask = params_under(p, f"decoder.layers.{i}"), self_masks[cfg.layer(i).sliding_window]
        plan.append((f"decoder.layers.{i}", "decoder_layer",
                     lambda y, layer=layer, i=i, self_mask=self_mask: golden.decoder_layer(
                         cfg.layer(i), layer, y, memory, self_mask, cross),
                     lambda y, i=i, self_mask=self_mask: {"index": i, "y": y, "memory": memory, "cross_mask": cross,
                                                          **_own_mask(cfg, i, self_mask, tgt_keep)}))
    if cfg.final_norm:
        plan.append(("decoder.norm", "norm", lambda y: golden.norm(cfg, params_under(p, "decoder.norm"), y),
                     lambda y: {"module": "decoder.norm", "x": y}))
    plan.append(("head", "logits", lambda h: golden.output_logits(cfg, p, h), lambda h: {"h": h}))
    stages += _run_stages(runner, dtype, cfg, plan, golden.embed(cfg, p, tgt_ids, "tgt"), tgt_ids.shape[1])
    return Localization(stages)


def _run_stages(runner, dtype: str, cfg: ModelConfig, plan: list, first_reference: np.ndarray | None,
                length: int) -> list[Stage]:
    """Run one stack's stages on sequences of `length` (the keys each query sums over, the
    positions its rotations turn by: SPEC §8); the first (an embedding) has no input activation."""
    stages = []
    reference = first_reference  # the golden's output of the previous stage (float64)
    chained = None  # the backend's output of the previous stage
    for name, sublayer, golden_function, inputs in plan:
        # a hybrid's linear layer chains its T tokens' updates: T deep (SPEC §8), its bound times the
        # output norm's amplification on the stage's input
        linear = name.startswith("decoder.layers.") and cfg.layer_kind(int(name.split(".")[-1])) == "linear"
        depth = SUBLAYERS[sublayer].depth(cfg) + (length - 1 if linear else 0)
        relative = tolerance(dtype, max(cfg.d_model, cfg.d_ff, length), depth, rotary_angle(cfg, length - 1))
        routing = {}  # a mixture of experts' stage: the golden's routing on each input, replayed in the runner
        if golden_function is None:  # embedding: inputs are ids, isolated and chained coincide
            expected, next_reference, isolated_inputs, chained_inputs = reference, reference, inputs, None
        else:
            isolated_input = _f32(reference)
            with golden.recorded_amplification() as found:
                expected, routing["isolated"] = _routed(golden_function, isolated_input.astype(np.float64))
            relative *= max([1.0, *found])
            next_reference, routing["chained"] = _routed(golden_function, reference)  # the golden chain, never rounded
            isolated_inputs = inputs(isolated_input)
            chained_inputs = None if chained is None else inputs(_f32(chained))
        replays = hasattr(runner, "routing_log") and any(routing.values())
        try:
            with _replayed(runner, routing.get("isolated")):
                isolated = runner.run(sublayer, isolated_inputs)
            isolated_ratio = compare(isolated, expected, relative).ratio
            if chained_inputs is None:
                chained_output, chained_ratio = isolated, isolated_ratio
            else:
                with _replayed(runner, routing.get("chained")):
                    chained_output = runner.run(sublayer, chained_inputs)
                chained_ratio = compare(chained_output, next_reference, relative).ratio
        except NotSupported as reason:
            stages.append(Stage(name, sublayer, None, None, f"  (not supported: {reason})"))
            return stages
        except Exception as error:  # noqa: BLE001 - a crashing stage is itself the localization
            stages.append(Stage(name, sublayer, math.inf, math.inf, f"  ({type(error).__name__}: {error})"))
            return stages
        stages.append(Stage(name, sublayer, isolated_ratio, chained_ratio,
                            "  (the golden's routing replayed)" if replays else ""))
        reference, chained = next_reference, chained_output
    return stages


def _routed(golden_function, x: np.ndarray) -> tuple[np.ndarray, list]:
    """The golden stage's output on x and its MoE layers' routing ([] without experts)."""
    from impl_numpy.model import recorded_routing

    with recorded_routing() as calls:
        output = golden_function(x)
    return output, list(calls)


def _replayed(runner, calls: list | None):
    """The runner with the golden's routing forced, its choices and their weights (SPEC §5.14),
    where it can take them: a stage of a mixture of experts is judged on what its experts compute,
    a flip near a tie and the gate's carrying of its input's rounding left out."""
    if not calls or not hasattr(runner, "routing_log"):
        return contextlib.nullcontext()
    return runner.routing_log(forced=[call.chosen for call in calls], forced_weights=[call.weights for call in calls])


WHOLE_MODEL = ("encoder", "decoder", "forward", "decode", "generate")


def localize_column(cfg: ModelConfig, params: Mapping[str, np.ndarray], backend_name: str, dtype: str, device: str,
                    mask_case: str = "pad_right") -> Localization:
    """Localize one matrix column on the inputs of the catalogue's forward case `mask_case`."""
    from conformance.adapter import get_backend
    from conformance.cases import build_case

    backend, reason = get_backend(backend_name)
    if backend is None:
        raise RuntimeError(f"backend {backend_name} is unavailable: {reason}")
    case = build_case(cfg, params, "forward", mask_case)
    runner = backend.load(cfg, params, dtype, device)
    return localize(cfg, params, runner, dtype, case.inputs["src_ids"], case.inputs["tgt_ids"])


def localize_backward(cfg: ModelConfig, params: Mapping[str, np.ndarray], runner, dtype: str,
                      src_ids: np.ndarray | None, tgt_ids: np.ndarray, targets: np.ndarray) -> Localization:
    """The backward walk (SPEC.md §13): the stages in the order the gradient visits them — the
    head, the decoder's final norm and layers from the last, the target embeddings, then the
    encoder's — each fed the golden's forward input and the golden's upstream cotangent of the
    loss (both rounded to float32), its gradients (inputs' and parameters') compared as a grad-
    case's. The first stage over its bound is wrong on its own."""
    from conformance.backends.numpy_backend import GradientReference, NumpyRunner
    from impl_numpy import backward

    p, reference_runner = golden.cast_params(cfg, params), NumpyRunner(cfg, params, "float64")
    tgt_keep = real_tokens(cfg, tgt_ids, "tgt")
    memory = cross = None
    encoder_inputs = []  # (stage, sublayer, inputs without d_out, the input's name)
    if cfg.has_encoder:
        src_mask = key_mask(real_tokens(cfg, src_ids, "src"))
        x = golden.embed(cfg, p, src_ids, "src")
        encoder_inputs.append(("src embedding", "embedding", {"ids": src_ids, "side": "src", "offset": 0}, None))
        for i in range(cfg.n_encoder_layers):
            encoder_inputs.append((f"encoder.layers.{i}", "encoder_layer", {"index": i, "x": _f32(x), "mask": src_mask}, "x"))
            x = golden.encoder_layer(cfg, params_under(p, f"encoder.layers.{i}"), x, src_mask)
        if cfg.final_norm:
            encoder_inputs.append(("encoder.norm", "norm", {"module": "encoder.norm", "x": _f32(x)}, "x"))
            x = golden.norm(cfg, params_under(p, "encoder.norm"), x)
        memory, cross = _f32(x), key_mask(real_tokens(cfg, src_ids, "src"))
    self_masks = golden.decoder_self_masks(cfg, tgt_keep)
    decoder_inputs = [("tgt embedding", "embedding", {"ids": tgt_ids, "side": "tgt", "offset": 0}, None)]
    y = golden.embed(cfg, p, tgt_ids, "tgt")
    amplified: dict[str, float] = {}  # a layer's SPEC §8 factor: its gates' and output norms', found on its forward
    for i in range(cfg.n_decoder_layers):
        layer = params_under(p, f"decoder.layers.{i}")
        with golden.recorded_amplification() as found:
            if cfg.layer_kind(i) == "linear":  # a hybrid's gated DeltaNet layer: the real tokens are what it masks by
                decoder_inputs.append((f"decoder.layers.{i}", "decoder_layer", {
                    "index": i, "y": _f32(y), "memory": None, "cross_mask": None, "tgt_keep": np.asarray(tgt_keep)},
                    "y"))
                y = golden.linear_layer(cfg, layer, y, tgt_keep)[0]
            else:
                self_mask = self_masks[cfg.layer(i).sliding_window]
                decoder_inputs.append((f"decoder.layers.{i}", "decoder_layer", {
                    "index": i, "y": _f32(y), "memory": memory, **_own_mask(cfg, i, self_mask, tgt_keep),
                    "cross_mask": cross}, "y"))
                y = golden.decoder_layer(cfg.layer(i), layer, y, memory, self_mask, cross)
        amplified[f"decoder.layers.{i}"] = max([1.0, *found])
    if cfg.final_norm:
        decoder_inputs.append(("decoder.norm", "norm", {"module": "decoder.norm", "x": _f32(y)}, "x"))
        y = golden.norm(cfg, params_under(p, "decoder.norm"), y)
    decoder_inputs.append(("head", "logits", {"h": _f32(y)}, "h"))
    d_out = backward.token_cross_entropy_vjp(cfg, golden.output_logits(cfg, p, y), np.asarray(targets))

    stages, d_memory = [], None
    for plan in (reversed(decoder_inputs), reversed(encoder_inputs)):
        for name, sublayer, inputs, input_name in plan:
            inputs = {**inputs, "d_out": _f32(d_out)}
            gradient = "grad-" + sublayer
            reference = GradientReference(reference_runner, gradient, inputs)
            # a hybrid's linear layer: its T tokens' updates, walked back as well (SPEC §8, §13)
            linear = name.startswith("decoder.layers.") and cfg.layer_kind(inputs["index"]) == "linear"
            depth = SUBLAYERS[gradient].depth(cfg) + (2 * (tgt_ids.shape[1] - 1) if linear else 0)
            angle = rotary_angle(cfg, tgt_ids.shape[1] - 1)
            reduction = max(cfg.d_model, cfg.d_ff, tgt_ids.shape[1])
            relative = amplified.get(name, 1.0) * tolerance(dtype, reduction, depth, angle)
            kinks = reference.kink_allowance(tolerance(dtype, max(cfg.d_model, cfg.d_ff), depth // 2, angle))
            try:
                width = backward_error(dtype, reduction) if amplified.get(name, 1.0) > 1 else None  # as its cell
                result = reference.judge(runner.gradients(gradient, inputs), relative, kinks, conditioning_width=width)
                ratio = result.ratio if math.isfinite(result.rel_err) else math.inf
                # as its cell: a stage whose every tensor's bound reaches its size is not judged
                stages.append(Stage(name, gradient, ratio if result.judged else None, None,
                                    "" if result.passed and result.judged else f"  ({result.reason})"))
            except NotSupported as reason:
                stages.append(Stage(name, gradient, None, None, f"  (not supported: {reason})"))
                return Localization(stages)
            except Exception as error:  # noqa: BLE001 - a crashing stage is itself the localization
                stages.append(Stage(name, gradient, math.inf, None, f"  ({type(error).__name__}: {error})"))
                return Localization(stages)
            if sublayer == "decoder_layer" and memory is not None:
                d_memory = reference.gradients["memory"] + (0.0 if d_memory is None else d_memory)
            d_out = reference.gradients[input_name] if input_name else None
        d_out = d_memory  # the encoder's last stage receives the memory's cotangent, summed over the layers
    return Localization(stages)


def localize_backward_column(cfg: ModelConfig, params: Mapping[str, np.ndarray], backend_name: str, dtype: str,
                             device: str, mask_case: str = "pad_right") -> Localization:
    """The backward walk of one matrix column on the inputs of the catalogue's loss case `mask_case`."""
    from conformance.adapter import get_backend
    from conformance.cases import build_case

    backend, reason = get_backend(backend_name)
    if backend is None:
        raise RuntimeError(f"backend {backend_name} is unavailable: {reason}")
    inputs = build_case(cfg, params, "loss", mask_case).inputs
    runner = backend.load(cfg, params, dtype, device)
    return localize_backward(cfg, params, runner, dtype, inputs["src_ids"], inputs["tgt_ids"], inputs["targets"])


def runs_layers(name: str) -> bool:
    """Whether a backend runs the model layer by layer (a whole-model backend, transformers, has no
    stages to feed one by one)."""
    from conformance.adapter import get_backend

    backend, _ = get_backend(name)
    return backend is not None and getattr(backend, "supports_sublayer", lambda sublayer: None)("decoder_layer") is None


def localize_failures(cfg: ModelConfig, params: Mapping[str, np.ndarray], results: list[CellResult],
                      every_column: bool = False) -> dict[str, Localization]:
    """{'<backend>/<dtype>/<device> (forward-<mask case>)': localization} of each column whose
    whole-model cells failed (of every column that ran, with every_column), and '... (backward of
    loss-<mask case>)' of each column whose whole-model gradient or training cells failed: what
    `rosetta check` prints and its report keeps."""
    failing: dict[tuple[str, str, str], str] = {}
    failing_backward: dict[tuple[str, str, str], str] = {}
    for r in results:
        column = (r.backend, r.dtype, r.device)
        if r.status == SKIP:
            continue
        if every_column:
            failing.setdefault(column, "pad_right")
        if r.sublayer in WHOLE_MODEL and r.status in (FAIL, ERROR):
            failing[column] = r.mask_case if r.sublayer == "forward" else failing.get(column, "pad_right")
        if (r.sublayer in ("grad-forward", "grad-loss") or is_training(r.sublayer)) and r.status in (FAIL, ERROR):
            failing_backward.setdefault(column, r.mask_case if r.sublayer == "grad-loss" else "pad_right")
    localizations = {}
    for (backend, dtype, device), mask_case in failing.items():
        if not runs_layers(backend):
            continue
        if cfg.has_encoder or mask_case not in ("cross_pad", "lq_ne_lk"):
            localizations[f"{backend}/{dtype}/{device} (forward-{mask_case})"] = localize_column(
                cfg, params, backend, dtype, device, mask_case)
    for (backend, dtype, device), mask_case in failing_backward.items():
        if runs_layers(backend) and (cfg.has_encoder or mask_case not in ("cross_pad", "lq_ne_lk", "pad_start")):
            localizations[f"{backend}/{dtype}/{device} (backward of loss-{mask_case})"] = localize_backward_column(
                cfg, params, backend, dtype, device, mask_case)
    return localizations


def _own_mask(cfg: ModelConfig, index: int, self_mask: np.ndarray, tgt_keep: np.ndarray) -> dict:
    """A decoder layer stage's self-attention mask: a sliding layer's is the one it builds from its
    own config over the real tokens (SPEC §11), so a window mistake is localized to its layer."""
    return {"self_mask": self_mask} if cfg.layer(index).sliding_window is None else {"tgt_keep": np.asarray(tgt_keep)}
