"""The golden's own code as a backend: ``NumpyRunner`` at float64 is the reference the harness
compares against; at float32 it is the ``numpy-float32`` backend, so the harness is real from
day one (it measures what float32 arithmetic alone does to every sublayer)."""

from __future__ import annotations

import copy

from collections.abc import Mapping
from typing import Any

import numpy as np

import impl_numpy as golden
from conformance.cases import decode_steps
from spec import ModelConfig, params_under
from spec.inputs import check_activations
from spec.masks import normalize_mask, real_tokens


class NumpyRunner:
    """Runs catalogue sublayers with impl_numpy at one dtype."""

    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str = "float64"):
        self.cfg = cfg
        self.params = params
        self.dtype = np.dtype(dtype)
        self.p = golden.cast_params(cfg, params, self.dtype)

    def replaced(self, name: str, value: np.ndarray) -> NumpyRunner:
        """This runner with one parameter tensor replaced, the others not cast again."""
        runner = copy.copy(self)
        runner.params = {**self.params, name: value}
        runner.p = {**self.p, name: value.astype(self.dtype)}
        return runner

    def _float(self, x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x).astype(self.dtype)

    def _mask(self, mask: Any, x: np.ndarray, context: np.ndarray) -> np.ndarray | None:
        return normalize_mask(mask, x.shape[0], self.cfg.n_heads, x.shape[1], context.shape[1])

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
        cfg, p = self.cfg, self.p
        if sublayer == "embedding":
            return golden.embed(cfg, p, np.asarray(inputs["ids"]), inputs["side"], inputs["offset"])
        if sublayer == "positional":
            return golden.positional_encoding(cfg, p, inputs["side"], inputs["length"], inputs["offset"], self.dtype)
        if sublayer == "attention":
            q, k, v = (self._float(inputs[name]) for name in ("q", "k", "v"))
            mask = normalize_mask(inputs["mask"], q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return golden.scaled_dot_product_attention(q, k, v, mask)
        if sublayer in ("mha", "mha_cross"):
            # checked as given, before the cast to the run's dtype would hide an integer array
            check_activations(inputs["x"], "x", cfg.d_model)
            check_activations(inputs["context"], "context", cfg.d_model)
            x, context = self._float(inputs["x"]), self._float(inputs["context"])
            mask = self._mask(inputs["mask"], x, context)
            return golden.multi_head_attention(params_under(p, inputs["module"]), x, context, mask, cfg.n_heads)
        if sublayer == "ffn":
            return golden.feed_forward(params_under(p, inputs["module"]), self._float(inputs["x"]), cfg.activation)
        if sublayer == "norm":
            return golden.norm(cfg, params_under(p, inputs["module"]), self._float(inputs["x"]))
        if sublayer == "ffn_block":
            return golden.ffn_block(cfg, params_under(p, inputs["layer"]), self._float(inputs["x"]))
        if sublayer == "encoder_layer":
            x = self._float(inputs["x"])
            layer = params_under(p, f"encoder.layers.{inputs['index']}")
            return golden.encoder_layer(cfg, layer, x, self._mask(inputs["mask"], x, x))
        if sublayer == "decoder_layer":
            y, memory = self._float(inputs["y"]), self._float(inputs["memory"])
            layer = params_under(p, f"decoder.layers.{inputs['index']}")
            self_mask = self._mask(inputs["self_mask"], y, y)
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
            return golden.greedy_generate(
                cfg, self.params, inputs["src_ids"], prompt_ids=inputs["prompt_ids"], bos_id=inputs["bos_id"],
                eos_id=inputs["eos_id"], max_new_tokens=inputs["max_new_tokens"], dtype=self.dtype)
        raise KeyError(f"unknown sublayer {sublayer!r}")

    def _decode(self, inputs: Mapping[str, Any]) -> np.ndarray:
        cache = golden.start_cache(self.cfg, self.p, np.shape(inputs["tgt_ids"])[0], inputs["src_ids"])
        steps = decode_steps(inputs, cache, lambda c, ids: golden.decode_step(self.cfg, self.p, c, ids))
        return np.concatenate(steps, axis=1)


def golden_output(cfg: ModelConfig, params: Mapping[str, np.ndarray], sublayer: str, inputs: Mapping[str, Any],
                  runner: NumpyRunner | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The reference output of a case: float64; for 'decode' the full forward's logits (so a
    cache bug cannot hide by being in the reference too); for 'generate' the tokens and the
    logits each step chose from (to tell a near-tie from a wrong token)."""
    runner = runner or NumpyRunner(cfg, params, "float64")
    if sublayer == "generate":
        return golden.greedy_generate(
            cfg, params, inputs["src_ids"], prompt_ids=inputs["prompt_ids"], bos_id=inputs["bos_id"],
            eos_id=inputs["eos_id"], max_new_tokens=inputs["max_new_tokens"], return_step_logits=True)
    if sublayer == "decode":
        logits = runner.run("forward", {"src_ids": inputs["src_ids"], "tgt_ids": inputs["tgt_ids"]})
        return logits[:, inputs["prefix"]:]
    return runner.run(sublayer, inputs)


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
