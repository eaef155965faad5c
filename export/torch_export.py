"""Export impl_torch's Transformer to ONNX with torch.onnx.export(dynamo=True).

Each graph role (export/graphs.py) is a small nn.Module over the same Transformer, calling the
same pieces the conformance harness checks (encode, decode, the decode step's body), so an
exported graph is the checked model and not a re-implementation of it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from export.graphs import (DECODER_STEP_IN_PLACE, DECODER_STEP_ROUTED, ENCODER, EXAMPLE_SIZES, FORWARD, FORWARD_ROUTED,
                           LINEAR_STATE_PARTS, GraphSignature, cache_head_size, example_inputs,
                           in_place_unsupported_reason, roles, signature)
from export.in_place_step import InPlaceDecoderStepGraph, cached_attention, cached_attention_onnx
from export.onnx_model import OPSETS, SharedWeights, check_options, finish, quiet_loggers, save, write_manifest
from impl_torch.model import GatedDeltaNet, KVCache, LinearState, Transformer, _decode_step_body
from spec import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@contextlib.contextmanager
def linear_form(model: Transformer, form: str):
    """Inside, a hybrid's linear layers take `form` whatever the length (impl_torch chooses by the
    length, which an exported graph learns only when it runs): the forward the chunked form
    deployments prefill with, the step the recurrence, token by token (SPEC §5.15)."""
    mixers = [module for module in model.modules() if isinstance(module, GatedDeltaNet)]
    for mixer in mixers:
        mixer.form = form
    try:
        yield
    finally:
        for mixer in mixers:
            mixer.form = None


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
        with linear_form(model, "chunked"):
            return model.output_logits(model.decode(tgt_ids, tgt_keep))


@contextlib.contextmanager
def _routing(model: Transformer, forced: torch.Tensor, forced_weights: torch.Tensor, replay: torch.Tensor,
             taken: list, weighed: list):
    """Inside, each MoE layer i of model takes forced[i] and forced_weights[i] where replay is
    true, else its own choices and weights, and appends what it took [B, T, k] to taken and its own
    weights (at the choices it took) to weighed (SPEC §5.14)."""
    mixtures = [layer.ffn for layer in model.decoder.layers]

    def choices(free: torch.Tensor, layer: int) -> torch.Tensor:
        chosen = torch.where(replay, forced[layer].reshape(free.shape), free)
        taken.append(chosen.reshape(forced.shape[1:]))
        return chosen

    def weighting(own: torch.Tensor, layer: int) -> torch.Tensor:
        weighed.append(own.reshape(forced.shape[1:]).to(forced_weights.dtype))
        return torch.where(replay, forced_weights[layer].reshape(own.shape).to(own.dtype), own)

    for index, mixture in enumerate(mixtures):
        mixture.choices = functools.partial(choices, layer=index)
        mixture.weighting = functools.partial(weighting, layer=index)
    try:
        yield
    finally:
        for mixture in mixtures:
            mixture.choices = mixture.weighting = None


class RoutedForwardGraph(nn.Module):
    """The forward of a mixture of experts with its routing as tensors (SPEC §5.14): each MoE
    layer's choices and weights are forced_experts[i] and forced_weights[i] where replay is true,
    else its own; its choices and its own weights are outputs either way, so the conformance
    harness can replay the golden's routing in the exported graph and see where the graph's own
    router differs."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tgt_ids, tgt_keep, forced, forced_weights, replay = tensors
        taken: list = []
        weighed: list = []
        with _routing(self.model, forced, forced_weights, replay, taken, weighed):
            logits = self.model.output_logits(self.model.decode(tgt_ids, tgt_keep))
        return logits, torch.stack(taken), torch.stack(weighed)


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


class DecoderStepGraph(nn.Module):
    """impl_torch's decode step over a preallocated cache (impl_torch._decode_step_body, the step
    the conformance matrix and greedy_generate run) on explicit tensors: it writes in place, and
    a graph's inputs are never written, so it writes into copies of the past, which are the
    present outputs."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.model.cfg
        kinds = [cfg.layer_kind(i) for i in range(cfg.n_decoder_layers)]
        parts = len(LINEAR_STATE_PARTS)
        attending, carried = 2 * (len(kinds) - kinds.count("linear")), parts * kinds.count("linear")
        tgt_ids, tgt_keep, start, past_keep, *rest = tensors
        past, states, rest = rest[:attending], rest[attending:attending + carried], rest[attending + carried:]
        src_keep, cross = (rest[0], rest[1:]) if cfg.has_encoder else (None, None)
        # a linear layer's state (its windows and S) in its place among the layers, copied to be written
        held = iter([LinearState(tuple(t.clone() for t in states[at:at + parts - 1]), states[at + parts - 1].clone())
                     for at in range(0, len(states), parts)])
        linear_states = tuple(next(held) if kind == "linear" else None for kind in kinds) if states else None
        # per-layer tensors where impl_torch stacks the layers: the step only indexes them by layer
        cache = KVCache([k.clone() for k in past[0::2]], [v.clone() for v in past[1::2]], past_keep.clone(), 0,
                        None if cross is None else list(cross[0::2]), None if cross is None else list(cross[1::2]),
                        src_keep, linear_states)
        with linear_form(self.model, "recurrent"):
            logits = _decode_step_body(self.model, cache, tgt_ids, tgt_keep, start)
        present = [t for pair in zip(cache.self_keys, cache.self_values) for t in pair]
        moved = [t for state in cache.linear_states or () if state is not None
                 for t in (*state.windows, state.recurrent)]
        return (logits, *present, *moved, cache.tgt_keep)


class RoutedDecoderStepGraph(DecoderStepGraph):
    """decoder_step with its routing as tensors, as RoutedForwardGraph's: the decode case and
    generation replay the golden's routing step by step."""

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *step, forced, forced_weights, replay = tensors
        taken: list = []
        weighed: list = []
        with _routing(self.model, forced, forced_weights, replay, taken, weighed):
            outputs = super().forward(*step)
        return (*outputs, torch.stack(taken), torch.stack(weighed))


def _wrapper(model: Transformer, role: str) -> nn.Module:
    if role == FORWARD:
        return ForwardGraph(model)
    if role == ENCODER:
        return EncoderGraph(model)
    if role == DECODER_STEP_IN_PLACE:
        return InPlaceDecoderStepGraph(model)
    if role == FORWARD_ROUTED:
        return RoutedForwardGraph(model)
    if role == DECODER_STEP_ROUTED:
        return RoutedDecoderStepGraph(model)
    return DecoderStepGraph(model)


def torch_roles(cfg: ModelConfig, dtype: str) -> tuple[str, ...]:
    """The graphs a torch export writes: every role, and the in-place decode step where onnxruntime's
    CPU kernel runs it (float32; any head size, padded to its multiple of 8)."""
    return roles(cfg) + (() if in_place_unsupported_reason(dtype, cfg) else (DECODER_STEP_IN_PLACE,))


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
            dynamic_shapes={"tensors": _dynamic_shapes(sig)},
            custom_translation_table={cached_attention._opoverload: cached_attention_onnx(
                cfg.n_heads, cfg.kv_heads, cfg.d_head, cache_head_size(cfg, DECODER_STEP_IN_PLACE))})
    return finish(program.model_proto, cfg, params, sig, dtype=dtype, opset=opset,
                  exporter=f"torch {torch.__version__}")


def export_torch(cfg: ModelConfig, params: Mapping[str, np.ndarray], directory: str | Path, *,
                 dtype: str = "float32", opset: int = OPSETS[0], graph_roles: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Export every graph of the model (or graph_roles) into directory as ROLE.onnx, with a
    manifest.json. Returns {role: path}."""
    wanted = check_options(dtype, opset, graph_roles, torch_roles(cfg, dtype), "torch")
    model = Transformer.from_params(cfg, params, dtype=TORCH_DTYPES[dtype])
    directory = Path(directory)
    weights = SharedWeights(directory)
    paths = {role: save(export_graph(model, params, role, dtype=dtype, opset=opset), directory / f"{role}.onnx", weights)
             for role in wanted}
    write_manifest(directory, cfg, params, {role: path.name for role, path in paths.items()},
                   dtype=dtype, opset=opset, exporter=f"torch {torch.__version__}")
    return paths


