"""Replayed routing (SPEC §5.14): a record of what a model's mixture-of-experts layers chose, or
the choices forced on them, kept the same way by every framework."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from spec.errors import InputError


class RoutingLog:
    """A model's routing across calls, per MoE layer: what each layer chose at every position,
    [B, T, k], and the weights it gave its choices; given `forced` (the golden's choices, one array
    per layer in the order the layers are first called), the choices are those instead, and given
    `forced_weights` (the golden's weights of those choices, [B, T, k] per layer) the weights too.
    A layer reads its positions in order from a cursor, so a forward, a prefill and its steps, and
    a generation's steps all line up."""

    def __init__(self, forced: list[np.ndarray] | None = None, forced_weights: list[np.ndarray] | None = None):
        if forced_weights is not None and forced is None:
            raise InputError("replayed routing weights need the choices they weigh: forced_weights without forced")
        self.forced = None if forced is None else [np.asarray(choices) for choices in forced]
        self.forced_weights = None if forced_weights is None else [np.asarray(w, np.float64) for w in forced_weights]
        self.chosen: list[list[np.ndarray]] = []  # per layer, in first-call order: its calls' [B, T, k]
        self.weights: list[list[np.ndarray]] = []  # per layer: the weights it computed itself, [B, T, k]
        self.inputs: list[list[np.ndarray]] = []  # per layer: its router's input, [B, T, d] (see)
        self._layers: dict[int, int] = {}
        self.routing_at: Callable[[int, Mapping[str, np.ndarray]], tuple[list, list]] | None = None
        self.steps = 0

    def replay_each_step(self, routing_at: Callable[[int, Mapping[str, np.ndarray]], tuple[list, list]]) -> None:
        """A run of training steps replayed: before step s (from 0) the trainer calls before_step
        with its parameters, and routing_at(s, parameters) gives that step's forced choices and
        weights, one [B, T, k] array of each per layer, appended along the positions (a later
        step routes on parameters only the run itself reaches)."""
        self.routing_at = routing_at

    def before_step(self, params: Callable[[], Mapping[str, np.ndarray]]) -> None:
        """Called by a trainer before each step with its parameters by canonical name (a function
        giving them, read only when the step is replayed)."""
        if self.routing_at is None:
            return
        chosen, weights = self.routing_at(self.steps, params())
        self.steps += 1
        self.forced = [np.asarray(c) for c in chosen] if self.forced is None else \
            [np.concatenate([old, new], axis=1) for old, new in zip(self.forced, chosen)]
        weights = [np.asarray(w, np.float64) for w in weights]
        self.forced_weights = weights if self.forced_weights is None else \
            [np.concatenate([old, new], axis=1) for old, new in zip(self.forced_weights, weights)]

    def choose(self, layer: int, batch: int, free: np.ndarray) -> np.ndarray:
        """The choices [N, k] of decoder layer `layer` for a call on `batch` rows: its own (`free`),
        or the forced ones. int32, as every framework can take them."""
        index = self._layers.setdefault(layer, len(self._layers))
        if index == len(self.chosen):
            self.chosen.append([])
            self.weights.append([])
            self.inputs.append([])
        cursor = sum(call.shape[1] for call in self.chosen[index])
        length = free.shape[0] // batch
        if self.forced is not None:
            if index >= len(self.forced) or self.forced[index].shape[0] != batch \
                    or cursor + length > self.forced[index].shape[1]:
                raise InputError(f"replayed routing out of step: MoE layer call {index} wants {batch} rows at positions "
                                 f"{cursor}..{cursor + length - 1}; the forced choices hold "
                                 f"{[list(f.shape[:2]) for f in self.forced]}")
            free = self.forced[index][:, cursor:cursor + length].reshape(-1, free.shape[1])
        free = np.asarray(free, dtype=np.int32)
        self.chosen[index].append(free.reshape(batch, length, -1))
        return free

    def weigh(self, layer: int, own: np.ndarray) -> np.ndarray | None:
        """Decoder layer `layer`'s own weights [N, k] of the choices its last `choose` returned,
        recorded; returns forced_weights_at(layer)."""
        index = self._layers[layer]
        self.weights[index].append(np.asarray(own, dtype=np.float64).reshape(self.chosen[index][-1].shape))
        return self.forced_weights_at(layer)

    def see(self, layer: int, inputs: np.ndarray) -> None:
        """Decoder layer `layer`'s router input [N, d] at its last `choose`, recorded: its routing is
        judged on what it saw (conformance.diagnosis.routing: the golden's router on the same input)."""
        index = self._layers[layer]
        batch, length = self.chosen[index][-1].shape[:2]
        self.inputs[index].append(np.asarray(inputs, dtype=np.float64).reshape(batch, length, -1))

    def forced_weights_at(self, layer: int) -> np.ndarray | None:
        """The forced weights [N, k] of the positions of decoder layer `layer`'s last `choose`, or
        None where weights are not forced (keep your own). float64: the caller casts them."""
        if self.forced_weights is None:
            return None
        index = self._layers[layer]
        batch, length = self.chosen[index][-1].shape[:2]
        cursor = sum(call.shape[1] for call in self.chosen[index][:-1])
        return self.forced_weights[index][:, cursor:cursor + length].reshape(batch * length, -1)

    def layers(self) -> list[np.ndarray]:
        """What each layer chose, [B, T, k], its calls joined along the positions."""
        return [np.concatenate(calls, axis=1) for calls in self.chosen]

    def own_weights(self) -> list[np.ndarray]:
        """The weights each layer computed itself, [B, T, k] (a forced run's: at the forced choices,
        from the inputs the forced weights led to); [] where the framework does not report them."""
        return [np.concatenate(calls, axis=1) for calls in self.weights] if all(self.weights) else []

    def seen(self) -> list[np.ndarray]:
        """Each layer's router inputs, [B, T, d], its calls joined along the positions; [] where a
        layer did not report every call's (an exported graph's routing gives its choices and weights
        only)."""
        complete = self.inputs and all(len(inputs) == len(chosen) for inputs, chosen in zip(self.inputs, self.chosen))
        return [np.concatenate(calls, axis=1) for calls in self.inputs] if complete else []


def check_recorded_routing(cfg, layers: int) -> None:
    """The load-balancing loss reads every MoE layer's routing of the forward (SPEC §5.14): refuse a
    recording that holds another count (a compiled forward whose trace was cached routes without
    recording)."""
    if layers != cfg.n_decoder_layers:
        raise ValueError(f"the load-balancing loss needs the routing of all {cfg.n_decoder_layers} MoE layers of the "
                         f"forward; {layers} were recorded")
