"""Harness adapters for the ONNX exports served by onnxruntime: ``onnx`` (graphs exported from
impl_torch by torch.onnx) and ``onnx-jax`` (from impl_jax by jax2onnx). Imported only when asked.

A graph is a whole model piece, so these backends run the whole-model cases (forward, encoder,
decode with the KV cache, generate); the sublayer cases are the frameworks' own columns. Graphs
are exported on first use and cached on disk (export/cache.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from conformance.adapter import NotSupported
from conformance.cases import decode_steps, is_backward
from export.cache import exported, is_exported
from export.graphs import DECODER_STEP, DECODER_STEP_ROUTED, ENCODER, FORWARD, FORWARD_ROUTED
from export.onnx_model import DEFAULT_OPSET, DTYPES
from export.runner import OnnxTransformer, cuda_available
from spec import ModelConfig
from spec.config import ONNX_EXPORTS, not_computed_by
from spec.routing import RoutingLog

WHOLE_MODEL = ("forward", "encoder", "decode", "generate")


class OnnxRunner:
    def __init__(self, model: OnnxTransformer, source: str):
        self.model, self.cfg, self.source = model, model.cfg, source
        self._log: RoutingLog | None = None
        if model.has(FORWARD_ROUTED):  # a mixture of experts whose export can take forced choices
            self.routing_log = self._routing_log

    @contextlib.contextmanager
    def _routing_log(self, forced: list[np.ndarray] | None = None,
                     forced_weights: list[np.ndarray] | None = None) -> Iterator[RoutingLog]:
        """Inside, a forward runs the forward_routed graph and a decode or generation steps of
        decoder_step_routed (an export without it refuses those cases): each MoE layer's choices
        and own weights logged, or the forced ones taken (replayed routing, SPEC §5.14)."""
        self._log = RoutingLog(forced, forced_weights)
        try:
            yield self._log
        finally:
            self._log = None

    def _forward_routed(self, inputs: Mapping[str, Any]) -> np.ndarray:
        log, tgt_ids = self._log, np.asarray(inputs["tgt_ids"])
        forced = None if log.forced is None else np.stack(log.forced)
        weights = None if log.forced_weights is None else np.stack(log.forced_weights)
        logits, chosen, own = self.model.forward_routed(tgt_ids, forced=forced, forced_weights=weights)
        for layer, (layer_chosen, layer_own) in enumerate(zip(chosen, own)):  # checked against the forced, recorded
            log.choose(layer, len(tgt_ids), layer_chosen.reshape(-1, layer_chosen.shape[-1]))
            log.weigh(layer, layer_own.reshape(-1, layer_own.shape[-1]))
        return logits

    def _routed_step(self, cache, tgt_ids, tgt_keep=None):
        """decode_step's interface over decoder_step_routed: the log's forced choices for these
        positions taken (read from its cursor before the run), or the graph's own recorded."""
        log, (batch, length) = self._log, np.shape(tgt_ids)
        layers, k = self.cfg.n_decoder_layers, self.cfg.moe.experts_per_token
        if log.forced is None:
            logits, chosen, own, cache = self.model.decode_step_routed(cache, tgt_ids, tgt_keep)
            for layer, (layer_chosen, layer_own) in enumerate(zip(chosen, own)):
                log.choose(layer, batch, layer_chosen.reshape(-1, k))
                log.weigh(layer, layer_own.reshape(-1, k))
            return logits, cache
        forced = np.stack([log.choose(layer, batch, np.zeros((batch * length, k), np.int32)).reshape(batch, length, k)
                           for layer in range(layers)])
        weights = np.stack([log.forced_weights_at(layer).reshape(batch, length, k) for layer in range(layers)])
        logits, _chosen, own, cache = self.model.decode_step_routed(cache, tgt_ids, tgt_keep, forced=forced,
                                                                    forced_weights=weights)
        for layer, layer_own in enumerate(own):
            log.weigh(layer, layer_own.reshape(-1, k))
        return logits, cache

    def graph_served(self, sublayer: str) -> str:
        """The graph that serves a case: forward, encoder, or the decode step (export.runner's
        step_graph: the in-place one, or the copying one with why)."""
        return {"forward": FORWARD, "encoder": ENCODER}.get(sublayer, self.model.step_graph)

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
        model = self.model
        if sublayer not in WHOLE_MODEL or (sublayer in ("decode", "generate") and not model.has(DECODER_STEP)):
            raise NotSupported(f"the {self.source} export has no graph for {sublayer}")
        routed = self._log is not None
        if routed and sublayer in ("decode", "generate") and not model.has(DECODER_STEP_ROUTED):
            raise NotSupported(f"the {self.source} export takes forced expert choices in its forward_routed graph only; "
                               f"it has no decoder_step_routed ({sublayer} is not replayed)")
        if sublayer == "forward":
            out = self._forward_routed(inputs) if routed else model.forward(inputs["src_ids"], inputs["tgt_ids"])
        elif sublayer == "encoder":
            out, _cross = model.encode(inputs["src_ids"])
        elif sublayer == "decode":
            out = self._decode(inputs)
        else:
            out = model.greedy_generate(inputs["src_ids"], prompt_ids=inputs["prompt_ids"], bos_id=inputs["bos_id"],
                                        eos_id=inputs["eos_id"], max_new_tokens=inputs["max_new_tokens"],
                                        step=self._routed_step if routed else None)
        return out.astype(np.float64) if np.issubdtype(out.dtype, np.floating) else out

    def _decode(self, inputs: Mapping[str, Any]) -> np.ndarray:
        batch, length = np.shape(inputs["tgt_ids"])
        # preallocated as the framework columns' caches are: room for exactly the case's positions
        if self._log is not None:
            cache = self.model.start_cache(batch, length, inputs["src_ids"], in_place=False)
            return np.concatenate(decode_steps(inputs, cache, self._routed_step), axis=1)
        cache = self.model.start_cache(batch, length, inputs["src_ids"])
        return np.concatenate(decode_steps(inputs, cache, self.model.decode_step), axis=1)


class OnnxBackend:
    """Graphs exported by torch.onnx (dynamo, opset 23) run by onnxruntime."""

    name = "onnx"
    framework = "torch"
    # an exporter's first graph in a process pays its start-up (imports, registries): a second
    # dtype exported after the first costs ~8 s less CPU, so the parallel harness gives every
    # dtype's column of one of these backends a single worker
    family_spans_dtypes = True

    def availability(self) -> str | None:
        return None

    def devices(self) -> list[str]:
        return ["cpu"] + (["cuda"] if cuda_available() else [])

    def device_name(self, device: str) -> str:
        if device == "cuda":
            import torch  # only for the GPU's name; onnxruntime does not report it

            return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
        return "cpu"

    def supports(self, dtype: str, device: str) -> str | None:
        if dtype == "tf32":  # the float32 export with onnxruntime's CUDA default (export.runner.cuda_provider_options)
            return None if device == "cuda" else "TF32 is a CUDA matmul mode"
        if dtype not in DTYPES:
            return f"ONNX exports are {' and '.join(DTYPES)} (dtype {dtype} is not exported)"
        return None

    def supports_config(self, cfg: ModelConfig, dtype: str) -> str | None:
        return not_computed_by(cfg, ONNX_EXPORTS[self.framework])

    def supports_sublayer(self, sublayer: str) -> str | None:
        if is_backward(sublayer) or sublayer == "loss":
            return ("the exported graphs are inference graphs that end at the logits: no loss and no "
                    "backward (onnxruntime's training graphs are not exported here)")
        if sublayer not in WHOLE_MODEL:
            return ("an exported graph is a whole model piece (forward, encoder, decode, generate); "
                    "sublayers are checked in the framework columns")
        if sublayer in ("decode", "generate") and self.framework == "jax":
            return "the JAX export has no decoder graphs (forward and encoder only)"
        return None

    def load_is_cached(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str) -> bool:
        """Whether load() finds its export made (conformance.plan.cost: an export of a real checkpoint
        takes minutes, a cached one seconds)."""
        return is_exported(cfg, params, framework=self.framework, dtype=_exported_dtype(dtype), opset=DEFAULT_OPSET)

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> OnnxRunner:
        directory = exported(cfg, params, framework=self.framework, dtype=_exported_dtype(dtype), opset=DEFAULT_OPSET)
        return OnnxRunner(OnnxTransformer(directory, device=device, tf32=dtype == "tf32"), self.name)


def _exported_dtype(dtype: str) -> str:
    """The TF32 column serves the float32 export."""
    return "float32" if dtype == "tf32" else dtype


class OnnxJaxBackend(OnnxBackend):
    """Graphs exported from impl_jax by jax2onnx (forward and encoder) run by onnxruntime."""

    name = "onnx-jax"
    framework = "jax"

    def availability(self) -> str | None:
        import importlib.util

        if importlib.util.find_spec("jax2onnx") is None:
            return "jax2onnx is not installed (the Makefile installs it with --no-deps)"
        return None
