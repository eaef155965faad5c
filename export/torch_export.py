"""Export impl_torch's Transformer to ONNX with torch.onnx.export(dynamo=True).

Each graph role (export/graphs.py) is a small nn.Module over the same Transformer, calling the
same pieces the conformance harness checks (encode, decode, decode_step's attention), so an
exported graph is the checked model and not a re-implementation of it.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from export.graphs import (DECODER_WITH_PAST, ENCODER, EXAMPLE_SIZES, FORWARD, GraphSignature, example_inputs,
                           roles, signature)
from export.onnx_model import OPSETS, check_options, finish, quiet_loggers, save, write_manifest
from impl_torch.model import Transformer, _causal_mask, _key_mask, residual
from spec import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class ForwardGraph(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        model = self.model
        if model.cfg.has_encoder:
            src_ids, src_keep, tgt_ids, tgt_keep = tensors
            memory = model.encode(src_ids, src_keep)
            return model.output_logits(model.decode(tgt_ids, tgt_keep, memory, src_keep))
        tgt_ids, tgt_keep = tensors
        return model.output_logits(model.decode(tgt_ids, tgt_keep))


class EncoderGraph(nn.Module):
    """memory and, per decoder layer, the cross-attention K and V of the memory: computed once
    per source, so no decoder step repeats them."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        src_ids, src_keep = tensors
        memory = self.model.encode(src_ids, src_keep)
        cross = []
        for layer in self.model.decoder.layers:
            cross.extend(layer.cross_attn.key_value_heads(memory))
        return (memory, *cross)


class DecoderGraph(nn.Module):
    """One decoder call over the new tokens, with (decoder_with_past) or without a cache:
    the same computation as impl_torch.decode_step, on explicit tensors."""

    def __init__(self, model: Transformer, with_past: bool):
        super().__init__()
        self.model, self.with_past = model, with_past

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model, cfg = self.model, self.model.cfg
        n_layers = cfg.n_decoder_layers
        tgt_ids, tgt_keep, *rest = tensors
        past_keep, past = None, None
        if self.with_past:
            past_keep, *rest = rest
            past, rest = rest[:2 * n_layers], rest[2 * n_layers:]
        src_keep, cross = (rest[0], rest[1:]) if cfg.has_encoder else (None, None)
        keep = tgt_keep if past_keep is None else torch.cat([past_keep, tgt_keep], dim=1)  # [B, P + T]
        offset = 0 if past is None else past[0].shape[2]
        self_mask = _causal_mask(tgt_ids.shape[1], keep.shape[1], keep.device) & _key_mask(keep)
        cross_mask = None if src_keep is None else _key_mask(src_keep)
        y = model.embed(tgt_ids, "tgt", offset=offset)
        present = []
        for i, layer in enumerate(model.decoder.layers):

            def cached_self_attention(h: torch.Tensor) -> torch.Tensor:
                k, v = layer.self_attn.key_value_heads(h)
                if past is not None:
                    k, v = torch.cat([past[2 * i], k], dim=2), torch.cat([past[2 * i + 1], v], dim=2)
                present.extend((k, v))
                return layer.self_attn.attend(h, k, v, self_mask)

            y = residual(cfg, layer.self_attn_norm, y, cached_self_attention)
            if cross is not None:
                y = residual(cfg, layer.cross_attn_norm, y,
                             lambda h: layer.cross_attn.attend(h, cross[2 * i], cross[2 * i + 1], cross_mask))
            y = layer.ffn_block(y)
        logits = model.output_logits(model.decoder.final_norm(y))
        return (logits, *present, keep)


def _wrapper(model: Transformer, role: str) -> nn.Module:
    if role == FORWARD:
        return ForwardGraph(model)
    if role == ENCODER:
        return EncoderGraph(model)
    return DecoderGraph(model, with_past=role == DECODER_WITH_PAST)


def _dynamic_shapes(sig: GraphSignature) -> tuple:
    """Each input's dynamic axes as torch.export dimensions, shared by name across inputs."""
    dims = {name: torch.export.Dim(name, min=1) for name in EXAMPLE_SIZES}
    return tuple({axis: dims[d] for axis, d in enumerate(t.dims) if isinstance(d, str)} for t in sig.inputs)


def export_graph(model: Transformer, params: Mapping[str, np.ndarray], role: str, *, dtype: str = "float32",
                 opset: int = OPSETS[0]) -> onnx.ModelProto:
    """One graph as an ONNX model, checked and stamped (export/onnx_model.finish)."""
    cfg = model.cfg
    sig = signature(cfg, role)
    wrapper = _wrapper(model, role).eval()
    example = tuple(torch.from_numpy(array) for array in example_inputs(cfg, role, dtype).values())
    # the exporter's progress lines and its warnings about optional packages are noise here;
    # a failure still raises
    with (warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad(),
          quiet_loggers("torch.onnx._internal.exporter._registration")):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            wrapper, example, dynamo=True, opset_version=opset, verbose=False,
            input_names=sig.input_names, output_names=sig.output_names,
            dynamic_shapes={"tensors": _dynamic_shapes(sig)})
    return finish(program.model_proto, cfg, params, sig, dtype=dtype, opset=opset,
                  exporter=f"torch {torch.__version__}")


def export_torch(cfg: ModelConfig, params: Mapping[str, np.ndarray], directory: str | Path, *,
                 dtype: str = "float32", opset: int = OPSETS[0], graph_roles: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Export every graph of the model (or graph_roles) into directory as ROLE.onnx, with a
    manifest.json. Returns {role: path}."""
    wanted = check_options(dtype, opset, graph_roles, roles(cfg), "torch")
    model = Transformer.from_params(cfg, params, dtype=TORCH_DTYPES[dtype])
    directory = Path(directory)
    paths = {role: save(export_graph(model, params, role, dtype=dtype, opset=opset), directory / f"{role}.onnx")
             for role in wanted}
    write_manifest(directory, cfg, params, {role: path.name for role, path in paths.items()},
                   dtype=dtype, opset=opset, exporter=f"torch {torch.__version__}")
    return paths


