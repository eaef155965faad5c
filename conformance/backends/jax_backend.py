"""Harness adapters for impl_jax: ``jax`` (jax.nn.dot_product_attention) and ``jax-math`` (the
explicit softmax(QKᵀ/√d_k)V). Imported only when asked for.

dtype 'float64' runs inside JAX's x64 mode, scoped to that runner's calls; 'tf32' is float32
with JAX's default matmul precision on a GPU (TF32 on NVIDIA), every other dtype uses 'highest'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from impl_jax import Transformer, scaled_dot_product_attention, view_mask
from spec import ModelConfig
from spec.inputs import check_activations

JAX_DTYPES = {"float64": "float64", "float32": "float32", "tf32": "float32", "float16": "float16",
              "bfloat16": "bfloat16"}


def _platform_devices(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:  # no such backend on this machine
        return []


class JaxRunner:
    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str, attention: str):
        self.cfg, self.attention = cfg, attention
        self.x64 = dtype == "float64"
        self.precision = "default" if dtype == "tf32" else "highest"
        self.device = _platform_devices("gpu" if device == "cuda" else "cpu")[0]
        with self._scope():
            self.model = Transformer.from_params(cfg, params, dtype=JAX_DTYPES[dtype], attention=attention,
                                                 precision=self.precision)
        self.dtype, self.precision = self.model.dtype, self.model.precision  # half dtypes use 'default'

    @contextlib.contextmanager
    def _scope(self):
        with jax.enable_x64(self.x64), jax.default_device(self.device), jax.default_matmul_precision(self.precision):
            yield

    def _float(self, x):
        return None if x is None else jnp.asarray(np.asarray(x), dtype=self.dtype)

    def _other(self, x):
        """Masks and keep-vectors keep their dtype (a bad dtype must reach the spec's checks)."""
        return None if x is None else jnp.asarray(np.asarray(x))

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
        with self._scope():
            out = self._run(sublayer, inputs)
            out = np.asarray(out.astype(jnp.float32) if out.dtype == jnp.bfloat16 else out)
        return out.astype(np.float64) if np.issubdtype(out.dtype, np.floating) else out.astype(np.int64)

    def _run(self, sublayer: str, inputs: Mapping[str, Any]):
        model, cfg = self.model, self.cfg
        if sublayer == "embedding":
            return model.embed(jnp.asarray(np.asarray(inputs["ids"]), jnp.int32), inputs["side"], inputs["offset"])
        if sublayer == "positional":
            return model.positional_encoding(inputs["side"], inputs["length"], inputs["offset"])
        if sublayer == "attention":
            q, k, v = (self._float(inputs[name]) for name in ("q", "k", "v"))
            mask = view_mask(self._other(inputs["mask"]), q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return scaled_dot_product_attention(q, k, v, mask, self.attention, self.precision)
        if sublayer in ("mha", "mha_cross"):
            x, context = self._float(inputs["x"]), self._float(inputs["context"])
            check_activations(x, "x", cfg.d_model)
            check_activations(context, "context", cfg.d_model)
            return _module(model, inputs["module"])(x, context, self._other(inputs["mask"]))
        if sublayer in ("ffn", "norm"):
            return _module(model, inputs["module"])(self._float(inputs["x"]))
        if sublayer == "ffn_block":
            return _module(model, inputs["layer"]).ffn_block(self._float(inputs["x"]))
        if sublayer == "encoder_layer":
            return model.encoder.layers[inputs["index"]](self._float(inputs["x"]), self._other(inputs["mask"]))
        if sublayer == "decoder_layer":
            return model.decoder.layers[inputs["index"]](
                self._float(inputs["y"]), self._float(inputs["memory"]), self._other(inputs["self_mask"]),
                self._other(inputs["cross_mask"]))
        if sublayer == "encoder":
            src_ids = jnp.asarray(np.asarray(inputs["src_ids"]), jnp.int32)
            return model.encode(src_ids, src_ids != cfg.pad_id)
        if sublayer == "decoder":
            tgt_ids = jnp.asarray(np.asarray(inputs["tgt_ids"]), jnp.int32)
            return model.decode(tgt_ids, tgt_ids != cfg.pad_id, self._float(inputs["memory"]),
                                self._other(inputs["src_keep"]))
        if sublayer == "logits":
            return model.output_logits(self._float(inputs["h"]))
        if sublayer == "log_probs":
            return model.log_probs(self._float(inputs["h"]))
        if sublayer == "forward":
            return model(inputs["src_ids"], inputs["tgt_ids"])
        if sublayer == "decode":
            tgt_ids, prefix = np.asarray(inputs["tgt_ids"]), inputs["prefix"]
            cache = model.start_cache(tgt_ids.shape[0], tgt_ids.shape[1], inputs["src_ids"])
            _, cache = model.decode_step(cache, tgt_ids[:, :prefix])
            steps = []
            for t in range(prefix, tgt_ids.shape[1]):
                logits, cache = model.decode_step(cache, tgt_ids[:, t:t + 1])
                steps.append(logits)
            return jnp.concatenate(steps, axis=1)
        if sublayer == "generate":
            return model.greedy_generate(inputs["src_ids"], prompt_ids=inputs["prompt_ids"], bos_id=inputs["bos_id"],
                                         eos_id=inputs["eos_id"], max_new_tokens=inputs["max_new_tokens"])
        raise KeyError(f"unknown sublayer {sublayer!r}")


def _module(model: Transformer, path: str):
    """'encoder.layers.0.self_attn' -> model.encoder.layers[0].self_attn"""
    module = model
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


class JaxBackend:
    """impl_jax with one attention path on every device JAX sees ('cuda' is JAX's gpu platform)."""

    attention = "sdpa"
    name = "jax"

    def availability(self) -> str | None:
        return None

    def devices(self) -> list[str]:
        return ["cpu"] + (["cuda"] if _platform_devices("gpu") else [])

    def supports(self, dtype: str, device: str) -> str | None:
        if dtype not in JAX_DTYPES:
            return f"dtype {dtype} is not run by {self.name}"
        if dtype == "tf32" and device != "cuda":
            return "TF32 is a CUDA matmul mode"
        return None

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> JaxRunner:
        return JaxRunner(cfg, params, dtype, device, self.attention)


class JaxMathBackend(JaxBackend):
    attention = "math"
    name = "jax-math"
