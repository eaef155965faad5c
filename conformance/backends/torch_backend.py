"""Harness adapters for impl_torch: ``torch`` (the F.scaled_dot_product_attention path, what users
run) and ``torch-math`` (the explicit softmax(QKᵀ/√d_k)V path). Imported only when asked for."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from impl_torch import Transformer, scaled_dot_product_attention, view_mask
from spec import ModelConfig
from spec.inputs import check_activations

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "tf32": torch.float32,
                "float16": torch.float16, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def matmul_precision(precision: str):
    """float32 matmuls in full float32 ('highest') or TF32 ('high'); PyTorch's own default is
    'highest', but a user's process may have changed it, so every run states it."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class TorchRunner:
    def __init__(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str, attention: str):
        self.cfg, self.device, self.attention = cfg, torch.device(device), attention
        self.dtype = TORCH_DTYPES[dtype]
        self.precision = "high" if dtype == "tf32" else "highest"
        self.model = Transformer.from_params(cfg, params, dtype=self.dtype, device=device, attention=attention)

    def _float(self, x):
        return None if x is None else torch.as_tensor(np.asarray(x)).to(self.device, self.dtype)

    def _other(self, x):
        """Ids, keep-vectors and masks keep their dtype (a bad dtype must reach the spec's checks)."""
        return None if x is None else torch.as_tensor(np.asarray(x)).to(self.device)

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray:
        with torch.inference_mode(), matmul_precision(self.precision):
            out = self._run(sublayer, inputs)
        if out.is_floating_point():
            return out.to("cpu", torch.float64).numpy()
        return out.cpu().numpy()

    def _run(self, sublayer: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        model, cfg = self.model, self.cfg
        if sublayer == "embedding":
            return model.embed(self._other(inputs["ids"]), inputs["side"], inputs["offset"])
        if sublayer == "positional":
            return model.positional_encoding(inputs["side"], inputs["length"], inputs["offset"])
        if sublayer == "attention":
            q, k, v = (self._float(inputs[name]) for name in ("q", "k", "v"))
            mask = self._other(inputs["mask"])
            mask = view_mask(mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return scaled_dot_product_attention(q, k, v, mask, self.attention)
        if sublayer in ("mha", "mha_cross"):
            x, context = self._float(inputs["x"]), self._float(inputs["context"])
            check_activations(x, "x", cfg.d_model)
            check_activations(context, "context", cfg.d_model)
            return model.get_submodule(inputs["module"])(x, context, self._other(inputs["mask"]))
        if sublayer in ("ffn", "norm"):
            return model.get_submodule(inputs["module"])(self._float(inputs["x"]))
        if sublayer == "ffn_block":
            return model.get_submodule(inputs["layer"]).ffn_block(self._float(inputs["x"]))
        if sublayer == "encoder_layer":
            return model.encoder.layers[inputs["index"]](self._float(inputs["x"]), self._other(inputs["mask"]))
        if sublayer == "decoder_layer":
            return model.decoder.layers[inputs["index"]](
                self._float(inputs["y"]), self._float(inputs["memory"]), self._other(inputs["self_mask"]),
                self._other(inputs["cross_mask"]))
        if sublayer == "encoder":
            src_ids = self._other(inputs["src_ids"])
            return model.encode(src_ids, src_ids != cfg.pad_id)
        if sublayer == "decoder":
            tgt_ids = self._other(inputs["tgt_ids"])
            return model.decode(tgt_ids, tgt_ids != cfg.pad_id, self._float(inputs["memory"]),
                                self._other(inputs["src_keep"]))
        if sublayer == "logits":
            return model.output_logits(self._float(inputs["h"]))
        if sublayer == "log_probs":
            return model.log_probs(self._float(inputs["h"]))
        if sublayer == "forward":
            return model(self._other(inputs["src_ids"]), self._other(inputs["tgt_ids"]))
        if sublayer == "decode":
            tgt_ids, prefix = self._other(inputs["tgt_ids"]), inputs["prefix"]
            cache = model.start_cache(tgt_ids.shape[0], self._other(inputs["src_ids"]))
            _, cache = model.decode_step(cache, tgt_ids[:, :prefix])
            steps = []
            for t in range(prefix, tgt_ids.shape[1]):
                logits, cache = model.decode_step(cache, tgt_ids[:, t:t + 1])
                steps.append(logits)
            return torch.cat(steps, dim=1)
        if sublayer == "generate":
            return model.greedy_generate(self._other(inputs["src_ids"]), prompt_ids=self._other(inputs["prompt_ids"]),
                                         bos_id=inputs["bos_id"], eos_id=inputs["eos_id"],
                                         max_new_tokens=inputs["max_new_tokens"])
        raise KeyError(f"unknown sublayer {sublayer!r}")


class TorchBackend:
    """impl_torch with one attention path on every device torch sees."""

    attention = "sdpa"
    name = "torch"

    def availability(self) -> str | None:
        return None

    def devices(self) -> list[str]:
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    def supports(self, dtype: str, device: str) -> str | None:
        if dtype not in TORCH_DTYPES:
            return f"dtype {dtype} is not run by {self.name}"
        if dtype == "tf32" and device != "cuda":
            return "TF32 is a CUDA matmul mode"
        return None

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> TorchRunner:
        return TorchRunner(cfg, params, dtype, device, self.attention)


class TorchMathBackend(TorchBackend):
    attention = "math"
    name = "torch-math"
