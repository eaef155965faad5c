"""What the torch and jax adapters share: both implementations are parallel texts with the same
API (embed, encode, decode, output_logits, encoder.layers[i], start_cache, ...), so one dispatch
drives either. A subclass supplies the framework: how arrays go in and out, its attention
function, its cache constructor and the context its calls run in."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from conformance.cases import GRADIENT_INPUTS, ROUTER_OUTPUTS, decode_steps, forward_of, gradient_owner
from spec import ModelConfig
from spec.dropout import check_dropout_masks
from spec.inputs import check_activations


class ModuleRunner:
    cfg: ModelConfig
    model: Any  # impl_torch.Transformer or impl_jax.Transformer
    _standing_in: dict = {}  # module path -> the copy a gradient case differentiates (never mutated in place)

    # ---- the framework's part ----
    def _float(self, x):
        """An activation in the run's dtype, on the run's device (None stays None)."""
        raise NotImplementedError

    def _array(self, x):
        """A mask or keep-vector with its own dtype kept, so a bad dtype reaches the spec's checks."""
        raise NotImplementedError

    def _ids(self, x):
        raise NotImplementedError

    def _attention(self, q, k, v, mask, sinks=None):
        raise NotImplementedError

    def _concatenate(self, arrays: list):
        raise NotImplementedError

    def _to_numpy(self, out) -> np.ndarray:
        raise NotImplementedError

    def _scope(self):
        return contextlib.nullcontext()

    def _gradient_scope(self):
        """The context a gradient case runs in (run's, unless that switches autodiff off)."""
        return self._scope()

    def _vjp(self, forward: Callable, floats: dict, d_out, owner: str | None) -> tuple[Any, dict, dict]:
        """(output, cotangents of `floats`, gradients of the owner's parameters by canonical name
        relative to the owner) of forward(model, floats) given the output's cotangent d_out."""
        raise NotImplementedError

    # ---- shared ----
    def _module(self, path: str, model=None):
        """'encoder.layers.0.self_attn' -> model.encoder.layers[0].self_attn, unless a gradient
        case stands a differentiable copy of that module in for it (self._standing_in)."""
        if path in self._standing_in:
            return self._standing_in[path]
        module = self.model if model is None else model
        for part in path.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        return module

    def _self_mask(self, inputs: Mapping[str, Any], name: str, model):
        """The case's mask `name`; where the case gives the real tokens instead (tgt_keep: a sliding
        layer, SPEC §11), the mask the model builds for the layer from its own config."""
        if "tgt_keep" not in inputs:
            return self._array(inputs[name])
        index = int(inputs["index"] if "index" in inputs else inputs["module"].split(".")[2])
        return (self.model if model is None else model).decoder_self_mask(index, self._array(inputs["tgt_keep"]))

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
        with self._scope():
            out = self._run(sublayer, inputs)
            return {name: self._to_numpy(value) for name, value in out.items()} if isinstance(out, dict) \
                else self._to_numpy(out)

    def gradients(self, sublayer: str, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """A gradient case (conformance/cases.py): the framework's own autodiff through the very
        forward `run` takes, pulled back from the case's cotangent."""
        forward = forward_of(sublayer)
        with self._gradient_scope():  # (JAX's float64 exists only inside it)
            floats = {name: self._float(inputs[name]) for name in GRADIENT_INPUTS[forward]
                      if inputs.get(name) is not None}
            out, d_inputs, grads = self._vjp(lambda model, tensors: self._run(forward, {**inputs, **tensors}, model),
                                             floats, inputs["d_out"], gradient_owner(sublayer, inputs))
            loss = {"loss": self._to_numpy(out)} if forward == "loss" else {}
            return {**loss, **{name: self._to_numpy(g) for name, g in {**d_inputs, **grads}.items()}}

    def _run(self, sublayer: str, inputs: Mapping[str, Any], model=None):
        model, cfg = self.model if model is None else model, self.cfg
        if sublayer == "embedding":
            return model.embed(self._ids(inputs["ids"]), inputs["side"], inputs.get("offset", 0))
        if sublayer == "positional":
            return model.positional_encoding(inputs["side"], inputs["length"], inputs["offset"])
        if sublayer == "attention":
            q, k, v = (self._float(inputs[name]) for name in ("q", "k", "v"))
            return self._attention(q, k, v, self._array(inputs["mask"]), self._float(inputs.get("sinks")))
        if sublayer in ("mha", "mha_cross"):
            # checked as given, before the cast to the run's dtype would hide an integer array
            check_activations(inputs["x"], "x", cfg.d_model)
            check_activations(inputs["context"], "context", cfg.d_model)
            x, context = self._float(inputs["x"]), self._float(inputs["context"])
            return self._module(inputs["module"], model)(x, context, self._self_mask(inputs, "mask", model),
                                                         offset=inputs.get("offset", 0))
        if sublayer in ("ffn", "norm"):
            return self._module(inputs["module"], model)(self._float(inputs["x"]))
        if sublayer == "linear_attn":  # from the zero state; the keep-vector is what it masks by
            check_activations(inputs["x"], "x", cfg.d_model)
            return self._module(inputs["module"], model)(self._float(inputs["x"]), self._array(inputs["tgt_keep"]))[0]
        if sublayer == "router":
            x = self._float(inputs["x"])
            routed = self._module(inputs["module"], model).route(x.reshape(-1, x.shape[-1]))
            return dict(zip(ROUTER_OUTPUTS, (value.reshape(*x.shape[:-1], -1) for value in routed)))
        if sublayer == "experts":  # the block itself, its routing the case's (the golden's), forced
            with self.routing_log(forced=[np.asarray(inputs["chosen"])], forced_weights=[np.asarray(inputs["weights"])]):
                return self._module(inputs["module"], model)(self._float(inputs["x"]))
        if sublayer == "ffn_block":
            return self._module(inputs["layer"], model).ffn_block(self._float(inputs["x"]))
        if sublayer == "encoder_layer":
            return self._module(f"encoder.layers.{inputs['index']}", model)(self._float(inputs["x"]),
                                                                            self._array(inputs["mask"]))
        if sublayer == "decoder_layer" and cfg.layer_kind(inputs["index"]) == "linear":  # by its real tokens
            return self._module(f"decoder.layers.{inputs['index']}", model)(self._float(inputs["y"]),
                                                                            self._array(inputs["tgt_keep"]))[0]
        if sublayer == "decoder_layer":
            return self._module(f"decoder.layers.{inputs['index']}", model)(
                self._float(inputs["y"]), self._float(inputs["memory"]), self._self_mask(inputs, "self_mask", model),
                self._array(inputs["cross_mask"]))
        if sublayer == "encoder":
            src_ids = self._ids(inputs["src_ids"])
            return model.encode(src_ids, model._keep(src_ids, None, "src"))
        if sublayer == "decoder":
            tgt_ids = self._ids(inputs["tgt_ids"])
            return model.decode(tgt_ids, model._keep(tgt_ids, None, "tgt"), self._float(inputs["memory"]),
                                self._array(inputs["src_keep"]))
        if sublayer == "logits":
            return model.output_logits(self._float(inputs["h"]))
        if sublayer == "log_probs":
            return model.log_probs(self._float(inputs["h"]))
        if sublayer == "forward":
            return self._logits(model, inputs)
        if sublayer == "loss":
            return self._training_loss(model, inputs)
        if sublayer == "decode":
            return self._decode(inputs)
        if sublayer == "generate":
            return model.greedy_generate(inputs["src_ids"], prompt_ids=inputs["prompt_ids"], bos_id=inputs["bos_id"],
                                         eos_id=inputs["eos_id"], max_new_tokens=inputs["max_new_tokens"])
        raise KeyError(f"unknown sublayer {sublayer!r}")

    def _logits(self, model, inputs: Mapping[str, Any]):
        """The teacher-forced forward. A model's gradient differentiates a copy of it (nnx), so
        this is the model's entry point spelled out rather than its compiled __call__."""
        if model is self.model:
            return model(inputs["src_ids"], inputs["tgt_ids"], dropout_masks=inputs.get("dropout_masks"))
        check_dropout_masks(self.cfg, inputs.get("dropout_masks"), *_batch_lengths(inputs))
        masks = None if inputs.get("dropout_masks") is None else {
            site: self._array(keep) for site, keep in inputs["dropout_masks"].items()}
        tgt_ids = self._ids(inputs["tgt_ids"])
        memory, src_keep = None, None
        if self.cfg.has_encoder:
            src_ids = self._ids(inputs["src_ids"])
            src_keep = model._keep(inputs["src_ids"], None, "src")
            memory = model.encode(src_ids, src_keep, masks)
        return model.output_logits(model.decode(tgt_ids, model._keep(inputs["tgt_ids"], None, "tgt"), memory, src_keep,
                                                masks))

    def _decode(self, inputs: Mapping[str, Any]):
        batch, length = np.shape(inputs["tgt_ids"])
        # both caches are preallocated: room for exactly the case's positions
        cache = self.model.start_cache(batch, length, inputs["src_ids"])
        return self._concatenate(decode_steps(inputs, cache, self.model.decode_step))


def _batch_lengths(inputs: Mapping[str, Any]) -> tuple[int, int | None, int]:
    """(batch, source length or None, target length) of a model-level case."""
    src, tgt = inputs["src_ids"], inputs["tgt_ids"]
    return np.shape(tgt)[0], None if src is None else np.shape(src)[1], np.shape(tgt)[1]


class FrameworkBackend:
    """What the torch and jax backends share: every spec dtype, TF32 only on CUDA."""

    name: str
    dtypes: tuple[str, ...] = ("float64", "float32", "tf32", "float16", "bfloat16")

    def availability(self) -> str | None:
        return None

    def supports(self, dtype: str, device: str) -> str | None:
        if dtype not in self.dtypes:
            return f"dtype {dtype} is not run by {self.name}"
        if dtype == "tf32" and device != "cuda":
            return "TF32 is a CUDA matmul mode"
        return None
