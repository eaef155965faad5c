"""The golden's own code as a backend: ``NumpyRunner`` at float64 is the reference the harness
compares against; at float32 it is the ``numpy-float32`` backend, so the harness is real from
day one (it measures what float32 arithmetic alone does to every sublayer)."""

from __future__ import annotations

import contextlib
import copy
import functools
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

import impl_numpy as golden
from conformance.adapter import NotSupported
from conformance.tolerance import LARGEST_FINITE, Comparison, compare_gradients
from conformance.cases import (ROUTER_OUTPUTS, DecoderPasses, decode_steps, forward_of, gradient_owner, is_gradient,
                               record_steps)
from impl_numpy import backward
from impl_numpy.cast import CastOnRead
from impl_numpy import training as golden_training
from spec import ModelConfig, params_under
from spec.inputs import check_activations
from spec.masks import decoder_self_mask, normalize_mask, real_tokens
from spec.routing import RoutingLog


class NumpyRunner:
    """Runs catalogue sublayers with impl_numpy at one dtype."""

    replays_backward_routing = False  # its VJPs route on their own (gradients, train)

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str = "float64",
                 budget: int | None = None):
        self.cfg = cfg
        self.params = params
        self.dtype = np.dtype(dtype)
        self.budget = budget
        self.passes = DecoderPasses()  # its decoder's outputs over cases' tokens, made before their references

    @functools.cached_property
    def p(self) -> Mapping[str, np.ndarray]:
        """The parameters at the run's dtype, cast when first used: at a real checkpoint's size the
        float64 cast takes seconds and twice the float32 weights' memory, and a run may need none.
        With a budget (bytes), cast as read and at most that much held (impl_numpy.cast)."""
        if self.budget is not None:
            return CastOnRead(self.cfg, self.params, self.dtype, self.budget)
        return golden.cast_params(self.cfg, self.params, self.dtype)

    def release(self) -> None:
        """Drop the cast parameters (cast again if read again); a runner made `at` float64 ones keeps them."""
        if self.params is not None:
            self.__dict__.pop("p", None)

    @classmethod
    def at(cls, cfg: ModelConfig, p: Mapping[str, np.ndarray]) -> NumpyRunner:
        """The golden at float64 on parameters given in float64 already (a point of a training
        run, which need not be float32-representable)."""
        runner = cls.__new__(cls)
        runner.cfg, runner.params, runner.dtype, runner.p = cfg, None, np.dtype(np.float64), dict(p)
        runner.passes = DecoderPasses()
        return runner

    def replaced(self, name: str, value: np.ndarray) -> NumpyRunner:
        """This runner with one parameter tensor replaced, the others not cast again."""
        runner = copy.copy(self)
        runner.passes = DecoderPasses()  # other weights: none of this one's passes is its own
        runner.params = {**self.params, name: value}
        runner.p = {**self.p, name: value.astype(self.dtype)}
        return runner

    def _float(self, x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x).astype(self.dtype)

    def _mask(self, mask: Any, x: np.ndarray, context: np.ndarray) -> np.ndarray | None:
        return normalize_mask(mask, x.shape[0], self.cfg.n_heads, x.shape[1], context.shape[1])

    def _self_mask(self, cfg: ModelConfig, inputs: Mapping[str, Any], name: str, x: np.ndarray,
                   context: np.ndarray) -> np.ndarray | None:
        """The case's mask `name`; where the case gives the real tokens instead (tgt_keep: a sliding
        layer, SPEC §11), the layer's own from its config (cfg: the layer's)."""
        if "tgt_keep" in inputs:
            return decoder_self_mask(np.asarray(inputs["tgt_keep"]), None, cfg.sliding_window)
        return self._mask(inputs[name], x, context)

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
        cfg, p = self.cfg.module_config(_module(sublayer, inputs)), self.p
        if sublayer == "embedding":
            return golden.embed(cfg, p, np.asarray(inputs["ids"]), inputs["side"], inputs.get("offset", 0))
        if sublayer == "positional":
            return golden.positional_encoding(cfg, p, inputs["side"], inputs["length"], inputs["offset"], self.dtype)
        if sublayer == "attention":
            q, k, v = (self._float(inputs[name]) for name in ("q", "k", "v"))
            mask = normalize_mask(inputs["mask"], q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            heads = q.shape[1]
            return golden.scaled_dot_product_attention(q, golden.group_heads(k, heads), golden.group_heads(v, heads), mask,
                                                       cfg.score_scale, cfg.attention_softcap,
                                                       self._float(inputs.get("sinks")))
        if sublayer in ("mha", "mha_cross"):
            # checked as given, before the cast to the run's dtype would hide an integer array
            check_activations(inputs["x"], "x", cfg.d_model)
            check_activations(inputs["context"], "context", cfg.d_model)
            x, context = self._float(inputs["x"]), self._float(inputs["context"])
            mask = self._self_mask(cfg, inputs, "mask", x, context)
            return golden.multi_head_attention(cfg, params_under(p, inputs["module"]), x, context, mask,
                                               inputs.get("offset", 0))
        if sublayer == "ffn":
            return golden.ffn(cfg, params_under(p, inputs["module"]), self._float(inputs["x"]))
        if sublayer == "linear_attn":  # the model's config: a layer's own has no mixer (SPEC §5.15)
            check_activations(inputs["x"], "x", cfg.d_model)
            keep = np.asarray(inputs["tgt_keep"], bool)
            mixer = params_under(p, inputs["module"])
            return golden.gated_delta_net(self.cfg, mixer, self._float(inputs["x"]), keep)[0]
        if sublayer == "router":
            x = self._float(inputs["x"])
            router, k = p[f"{inputs['module']}.router.weight"], cfg.moe.experts_per_token
            probabilities = golden.router_probabilities(x.reshape(-1, x.shape[-1]), router,
                                                        p.get(f"{inputs['module']}.router.bias"))
            chosen = golden.top_experts(probabilities, k)
            routed = (probabilities, chosen, golden.routing_weights(probabilities, chosen, cfg.moe.renormalize))
            return dict(zip(ROUTER_OUTPUTS, (value.reshape(*x.shape[:-1], -1) for value in routed)))
        if sublayer == "experts":
            x, k = self._float(inputs["x"]), cfg.moe.experts_per_token
            block = params_under(p, inputs["module"])
            routed = golden.weighted_experts(x.reshape(-1, x.shape[-1]), golden.layer_experts(cfg, block),
                                             np.reshape(inputs["chosen"], (-1, k)),
                                             self._float(inputs["weights"]).reshape(-1, k), cfg.activation,
                                             cfg.swiglu_clamp)
            return golden.with_shared_expert(cfg, block, x, routed.reshape(x.shape))
        if sublayer == "norm":
            return golden.norm(cfg, params_under(p, inputs["module"]), self._float(inputs["x"]))
        if sublayer == "ffn_block":
            return golden.ffn_block(cfg, params_under(p, inputs["layer"]), self._float(inputs["x"]))
        if sublayer == "encoder_layer":
            x = self._float(inputs["x"])
            layer = params_under(p, f"encoder.layers.{inputs['index']}")
            return golden.encoder_layer(cfg, layer, x, self._mask(inputs["mask"], x, x))
        if sublayer == "decoder_layer" and self.cfg.layer_kind(inputs["index"]) == "linear":  # by its real tokens,
            layer = params_under(p, f"decoder.layers.{inputs['index']}")  # the model's config (the mixer's)
            return golden.linear_layer(self.cfg, layer, self._float(inputs["y"]),
                                       np.asarray(inputs["tgt_keep"], bool))[0]
        if sublayer == "decoder_layer":
            y, memory = self._float(inputs["y"]), self._float(inputs["memory"])
            layer = params_under(p, f"decoder.layers.{inputs['index']}")
            self_mask = self._self_mask(cfg, inputs, "self_mask", y, y)
            cross_mask = None if memory is None else self._mask(inputs["cross_mask"], y, memory)
            return golden.decoder_layer(cfg, layer, y, memory, self_mask, cross_mask)
        if sublayer == "encoder":
            src_ids = np.asarray(inputs["src_ids"])
            return golden.encoder(cfg, p, src_ids, real_tokens(cfg, src_ids, "src"))
        if sublayer == "decoder":
            tgt_ids = np.asarray(inputs["tgt_ids"])
            return golden.decoder(cfg, p, tgt_ids, real_tokens(cfg, tgt_ids, "tgt"), self._float(inputs["memory"]),
                                  inputs["src_keep"])
        if sublayer == "logits":
            return golden.output_logits(cfg, p, self._float(inputs["h"]))
        if sublayer == "log_probs":
            return golden.log_probs(cfg, p, self._float(inputs["h"]))
        if sublayer == "forward":
            return golden.model_logits(cfg, p, inputs["src_ids"], inputs["tgt_ids"])
        if sublayer == "decode":
            return self._decode(inputs)
        if sublayer == "generate":
            return golden.greedy_decoding(
                cfg, p, inputs["src_ids"], prompt_ids=inputs["prompt_ids"], bos_id=inputs["bos_id"],
                eos_id=inputs["eos_id"], max_new_tokens=inputs["max_new_tokens"])
        if sublayer == "loss":
            return np.asarray(golden.training_loss(cfg, p, inputs["src_ids"], inputs["tgt_ids"], inputs["targets"],
                                                   dropout_masks=inputs.get("dropout_masks")))
        raise KeyError(f"unknown sublayer {sublayer!r}")

    @contextlib.contextmanager
    def routing_log(self, forced: list[np.ndarray] | None = None,
                    forced_weights: list[np.ndarray] | None = None) -> Iterator[RoutingLog]:
        """Inside, a forward, decode or generate case routes through a RoutingLog: each MoE layer's
        choices and own weights recorded, or the forced ones taken (SPEC §5.14). The golden's VJPs
        route on their own: a gradient or training case refuses to run inside."""
        with golden.replayed_routing(RoutingLog(forced, forced_weights)) as log:
            yield log

    def gradients(self, sublayer: str, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """A gradient case (conformance/cases.py) by the golden VJPs: cotangents of the inputs
        GRADIENT_INPUTS names, gradients of every parameter under the case's owner."""
        if golden.routing_replayed():
            raise NotSupported("the golden's VJPs route on their own: its gradients do not replay routing")
        forward = forward_of(sublayer)
        cfg, p = self.cfg.module_config(_module(forward, inputs)), self.p
        d_out = self._float(inputs["d_out"])
        owner = gradient_owner(sublayer, inputs)
        under = {} if owner is None else (p if owner == "" else params_under(p, owner))
        if forward == "attention":
            q, k, v = (self._float(inputs[name]) for name in ("q", "k", "v"))
            mask = normalize_mask(inputs["mask"], q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            heads = q.shape[1]
            sinks, keys, values = self._float(inputs.get("sinks")), golden.group_heads(k, heads), golden.group_heads(v, heads)
            d_q, d_k, d_v = backward.scaled_dot_product_attention_vjp(q, keys, values, mask, d_out, cfg.score_scale,
                                                                      cfg.attention_softcap, sinks)
            d_sinks = {} if sinks is None else {"sinks": backward.attention_sinks_vjp(
                q, keys, values, mask, d_out, cfg.score_scale, cfg.attention_softcap, sinks)}
            return {"q": d_q, "k": backward.group_heads_vjp(d_k, k.shape[1]), "v": backward.group_heads_vjp(d_v, k.shape[1]),
                    **d_sinks}
        if forward in ("mha", "mha_cross"):
            x, context = self._float(inputs["x"]), self._float(inputs["context"])
            d_x, d_context, grads = backward.multi_head_attention_vjp(
                cfg, under, x, context, self._self_mask(cfg, inputs, "mask", x, context), d_out,
                inputs.get("offset", 0))
            return {"x": d_x, "context": d_context, **_every(under, grads)}
        if forward == "ffn":
            x = self._float(inputs["x"])
            d_x, grads = (backward.feed_forward_vjp(under, x, cfg.activation, d_out, cfg.swiglu_clamp) if cfg.moe is None
                          else backward.experts_ffn_vjp(cfg, under, x, d_out))
        elif forward == "linear_attn":  # the model's config: a layer's own has no mixer (SPEC §5.15)
            d_x, grads = backward.gated_delta_net_vjp(self.cfg, under, self._float(inputs["x"]),
                                                      np.asarray(inputs["tgt_keep"], bool), d_out)
        elif forward == "norm":
            d_x, grads = backward.norm_vjp(cfg, under, self._float(inputs["x"]), d_out)
        elif forward == "ffn_block":
            d_x, grads = backward.ffn_block_vjp(cfg, under, self._float(inputs["x"]), d_out)
        elif forward == "encoder_layer":
            x = self._float(inputs["x"])
            d_x, grads = backward.encoder_layer_vjp(cfg, under, x, self._mask(inputs["mask"], x, x), d_out)
        elif forward == "decoder_layer" and self.cfg.layer_kind(inputs["index"]) == "linear":  # by its real tokens
            d_y, grads = backward.linear_layer_vjp(self.cfg, under, self._float(inputs["y"]),
                                                   np.asarray(inputs["tgt_keep"], bool), d_out)
            return {"y": d_y, **_every(under, grads)}
        elif forward == "decoder_layer":
            y, memory = self._float(inputs["y"]), self._float(inputs["memory"])
            cross_mask = None if memory is None else self._mask(inputs["cross_mask"], y, memory)
            self_mask = self._self_mask(cfg, inputs, "self_mask", y, y)
            d_y, d_memory, grads = backward.decoder_layer_vjp(cfg, under, y, memory, self_mask, cross_mask, d_out)
            return {"y": d_y, **({} if memory is None else {"memory": d_memory}), **_every(under, grads)}
        elif forward in ("logits", "log_probs"):
            h = self._float(inputs["h"])
            d_logits = backward.log_softmax_vjp(golden.output_logits(cfg, p, h), d_out) if forward == "log_probs" else d_out
            d_x, grads = backward.output_logits_vjp(cfg, p, h, d_logits)
            return {"h": d_x, **_every(under, grads)}
        else:
            return self._model_gradients(forward, inputs, d_out)
        return {"x": d_x, **_every(under, grads)}

    def _model_gradients(self, forward: str, inputs: Mapping[str, Any], d_out: np.ndarray) -> dict[str, np.ndarray]:
        """The gradient cases of the model's own entry points: every parameter's gradient."""
        cfg, p = self.cfg, self.p
        if forward == "embedding":
            return _every(p, backward.embed_vjp(cfg, p, np.asarray(inputs["ids"]), inputs["side"], d_out, inputs.get("offset", 0)))
        if forward == "encoder":
            src_ids = np.asarray(inputs["src_ids"])
            return _every(p, backward.encoder_vjp(cfg, p, src_ids, real_tokens(cfg, src_ids, "src"), d_out))
        if forward == "decoder":
            tgt_ids, memory = np.asarray(inputs["tgt_ids"]), self._float(inputs["memory"])
            grads, d_memory = backward.decoder_vjp(cfg, p, tgt_ids, real_tokens(cfg, tgt_ids, "tgt"), memory,
                                                   inputs["src_keep"], d_out)
            return {**({} if memory is None else {"memory": d_memory}), **_every(p, grads)}
        if forward == "forward":
            return backward.model_vjp(cfg, p, inputs["src_ids"], inputs["tgt_ids"], d_out)
        if forward == "loss":
            loss, grads = backward.loss_and_gradients(cfg, p, inputs["src_ids"], inputs["tgt_ids"], inputs["targets"],
                                                      dropout_masks=inputs.get("dropout_masks"))
            return {"loss": np.asarray(loss, self.dtype), **grads}
        raise KeyError(f"no gradient case for {forward!r}")

    def train(self, sublayer: str, inputs: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A training case (conformance/cases.py) by the golden's own step at this runner's dtype."""
        if golden.routing_replayed():
            raise NotSupported("the golden's training step routes on its own: it does not replay routing")
        training, run = inputs["training"], {"params": self.p, "state": golden_training.start_adam(self.p)}

        def step(src_ids, tgt_ids, targets, dropout_masks):
            loss, grads, run["params"], run["state"] = golden_training.train_step(
                self.cfg, training, run["params"], run["state"], src_ids, tgt_ids, targets, dropout_masks)
            if not np.isfinite(loss):  # as the frameworks' steps raise
                raise FloatingPointError(f"the loss is {loss}")
            return {"loss": loss, "gradients": grads, "first_moment": run["state"].m,
                    "second_moment": run["state"].v, "params": run["params"]}

        return record_steps(inputs, step)

    def _decode(self, inputs: Mapping[str, Any]) -> np.ndarray:
        cache = golden.start_cache(self.cfg, self.p, np.shape(inputs["tgt_ids"])[0], inputs["src_ids"])
        steps = decode_steps(inputs, cache, lambda c, ids: golden.decode_step(self.cfg, self.p, c, ids))
        return np.concatenate(steps, axis=1)


CONDITIONING_DRAWS = 4  # the directions GradientReference.conditioning_bound moves the weights in


class GradientReference:
    """A gradient case's reference (SPEC.md §13): the golden's gradients, the same without
    cancellation (the size of the terms each sums, and where nothing reaches), and, per dtype,
    how far the gradients move when ReLU units near their kink take the other side, and when
    every weight moves by a column's rounding (the conditioning, measured where a case is amplified)."""

    def __init__(self, runner: NumpyRunner, sublayer: str, inputs: Mapping[str, Any]):
        self.runner, self.sublayer, self.inputs = runner, sublayer, inputs
        with backward.largest_cotangent() as largest:
            self.gradients = runner.gradients(sublayer, inputs)
        self.largest_cotangent = largest[0]  # the largest |∂y| a linear layer of the chain met (SPEC §13)
        with backward.without_cancellation():
            self.terms = runner.gradients(sublayer, inputs)
        self._allowances: dict[float, dict[str, float]] = {}
        self._conditioning: dict[float, dict[str, float]] = {}

    def kink_allowance(self, relative_width: float) -> dict[str, float]:
        """Per tensor, ‖g*(ReLU kinks within relative_width flipped) − g*‖ (zero without ReLU)."""
        if self.runner.cfg.activation != "relu" or relative_width <= 0:
            return {name: 0.0 for name in self.gradients}
        if relative_width not in self._allowances:
            with backward.relu_kinks_flipped(relative_width):
                flipped = self.runner.gradients(self.sublayer, self.inputs)
            self._allowances[relative_width] = {
                name: float(np.linalg.norm(flipped[name] - golden)) for name, golden in self.gradients.items()}
        return self._allowances[relative_width]

    def conditioning_bound(self, width: float) -> dict[str, float]:
        """Per tensor, the root mean square over CONDITIONING_DRAWS draws of ‖g*(every weight ×
        (1 ± width)) − g*‖, the signs drawn per element: how far the golden's own gradients move when
        the weights move by the rounding a column's products are equivalent to (tolerance.backward_error,
        SPEC §13). A measure of the case's conditioning, which SPEC §8's depth and amplification do
        not count, and the bound where it is the larger; a few draws, as one direction may miss the
        few the gradients are sensitive to."""
        if width not in self._conditioning:
            squares = {name: 0.0 for name in self.gradients}
            for draw in range(CONDITIONING_DRAWS):
                runner = copy.copy(self.runner)
                runner.p = _Perturbed(self.runner.p, width, draw)
                moved = runner.gradients(self.sublayer, self.inputs)
                for name, golden in self.gradients.items():
                    squares[name] += float(np.linalg.norm(moved[name] - golden)) ** 2 / CONDITIONING_DRAWS
            self._conditioning[width] = {name: square ** 0.5 for name, square in squares.items()}
        return self._conditioning[width]

    def beyond_range(self, dtype: str, gradients: Mapping[str, np.ndarray]) -> str | None:
        """Why these gradients are not judged, where they are not all finite and the golden's own chain
        carries a cotangent beyond the dtype's largest finite value (SPEC §13): no backward at that dtype
        that runs the chain holds it. None where they are finite or the chain stays in range."""
        largest_finite = LARGEST_FINITE[dtype]
        if self.largest_cotangent <= largest_finite or all(np.isfinite(g).all() for g in gradients.values()):
            return None
        return (f"the golden's backward carries a cotangent of {self.largest_cotangent:.3g} into a linear layer, "
                f"beyond {dtype}'s largest finite value {largest_finite:.5g}: no {dtype} backward that runs the "
                "chain holds it, and this column's gradients are not all finite (SPEC §13)")

    def judge(self, gradients: Mapping[str, np.ndarray], relative_tol: float, kink_allowance: Mapping[str, float],
              subnormal_spacing: float = 0.0, conditioning_width: float | None = None) -> Comparison:
        """A backend's gradients against these (tolerance.compare_gradients). conditioning_width, where the
        case is amplified: gradients that miss SPEC §8's bound alone are judged again with c* at that width
        (conditioning_bound), so its golden gradients are spent only where they could change the verdict."""
        def compared(conditioning=None):
            return compare_gradients(gradients, self.gradients, self.terms, relative_tol, kink_allowance,
                                     subnormal_spacing, conditioning)
        result = compared()
        if result.passed or conditioning_width is None:
            return result
        return compared(self.conditioning_bound(conditioning_width))


def perturbed(value: np.ndarray, relative: float, seed) -> np.ndarray:
    """value · (1 ± relative), the sign drawn per element from seed (an int or a sequence of them)."""
    signs = np.where(np.random.default_rng(seed).random(np.shape(value)) < 0.5, -1.0, 1.0)
    return (value * (1.0 + relative * signs)).astype(np.asarray(value).dtype)


class _Perturbed(Mapping):
    """Parameters each scaled by 1 ± width, a sign per element drawn from the tensor's name and the
    draw (the same at every read), made as they are read: a real model's weights are not copied whole."""

    def __init__(self, p: Mapping[str, np.ndarray], width: float, draw: int = 0):
        self.p, self.width, self.draw = p, width, draw

    def __getitem__(self, name: str) -> np.ndarray:
        return perturbed(self.p[name], self.width, [zlib.crc32(name.encode()), self.draw])

    def __iter__(self) -> Iterator[str]:
        return iter(self.p)

    def __len__(self) -> int:
        return len(self.p)


def _every(params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A gradient for every parameter in `params`: zeros for those the case does not reach."""
    return {name: grads[name] if name in grads else np.zeros_like(value) for name, value in params.items()}


def golden_output(cfg: ModelConfig, params: Mapping[str, np.ndarray], sublayer: str, inputs: Mapping[str, Any],
                  runner: NumpyRunner | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray] | GradientReference:
    """The reference output of a case: float64; for 'decode' the full forward's logits (so a
    cache bug cannot hide by being in the reference too), but the golden's own cached decode
    where a call's rotary frequencies depend on its length (longrope, SPEC §5.12: the cache keeps
    keys rotated by their own call's frequencies, which the forward of the whole sequence does
    not; tests/test_longrope.py holds the golden's cached decode to its forward wherever no call
    crosses the original context); for 'generate' the tokens and the
    logits each step chose from (to tell a near-tie from a wrong token); for a gradient case the
    GradientReference."""
    runner = runner or NumpyRunner(cfg, params, "float64")
    if is_gradient(sublayer):
        return GradientReference(runner, sublayer, inputs)
    if sublayer == "generate":
        return golden.greedy_decoding(
            cfg, runner.p, inputs["src_ids"], prompt_ids=inputs["prompt_ids"], bos_id=inputs["bos_id"],
            eos_id=inputs["eos_id"], max_new_tokens=inputs["max_new_tokens"], return_step_logits=True)
    if sublayer == "decode" and cfg.rotary_reads_length:
        return runner.run("decode", inputs)
    # a hybrid's case may hold the decoder's pass made where its amplification was found: only the head is left
    hidden = runner.passes.take(inputs) if sublayer in ("forward", "decode") else None
    if sublayer == "decode" or hidden is not None:
        return _forward_from(cfg, runner, inputs["src_ids"], inputs["tgt_ids"], inputs.get("prefix", 0), hidden)
    return runner.run(sublayer, inputs)


def _forward_from(cfg: ModelConfig, runner: NumpyRunner, src_ids, tgt_ids, first: int,
                  hidden: np.ndarray | None = None) -> np.ndarray:
    """The whole forward's logits from position `first` on: every position through the decoder
    (unless its output is given), only those rows through the output head (the prompt's rows are
    never compared, and decode-far's would take 3.7 GB at Qwen2.5-0.5B's vocabulary)."""
    if hidden is None:
        tgt_ids = np.asarray(tgt_ids)
        memory = src_keep = None
        if cfg.has_encoder:
            src_ids = np.asarray(src_ids)
            memory, src_keep = runner.run("encoder", {"src_ids": src_ids}), real_tokens(cfg, src_ids, "src")
        hidden = runner.run("decoder", {"tgt_ids": tgt_ids, "memory": memory, "src_keep": src_keep})
    return runner.run("logits", {"h": np.ascontiguousarray(hidden[:, first:])})


class NumpyFloat32Backend:
    """impl_numpy at float32 on the CPU."""

    name = "numpy-float32"

    def availability(self) -> str | None:
        return None

    def devices(self) -> list[str]:
        return ["cpu"]

    def supports(self, dtype: str, device: str) -> str | None:
        if device != "cpu":
            return f"NumPy runs on the CPU only, not {device}"
        if dtype != "float32":
            return "numpy-float32 runs at float32 only (float64 is the golden itself)"
        return None

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> NumpyRunner:
        return NumpyRunner(cfg, params, dtype)


def _module(sublayer: str, inputs: Mapping[str, Any]) -> str | None:
    """The module a sublayer case runs (its config may be a decoder layer's own: SPEC §6)."""
    if sublayer == "decoder_layer":
        return f"decoder.layers.{inputs['index']}"
    return inputs.get("module") or inputs.get("layer")
