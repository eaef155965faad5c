"""The exported graphs, their roles and their input/output names: one table both exporters
(torch and JAX) and the runner read, so every graph of a role has the same interface.

Layouts (B batch, S source length, T new target tokens, C the cache's capacity in positions,
H heads, d_k head size, V target vocabulary). Token ids are int64, keep-vectors are bool (True =
a real token, SPEC.md §6), every float is the export's dtype (float32 or float16):

    forward       src_ids [B,S], src_keep [B,S], tgt_ids [B,T], tgt_keep [B,T]
                    -> logits [B,T,V]                      (teacher-forced, for conformance)
    encoder       src_ids [B,S], src_keep [B,S]
                    -> memory [B,S,d], cross.{i}.key / cross.{i}.value [B,H,S,d_k]
    decoder_step  tgt_ids [B,T], tgt_keep [B,T], start [] (int64: the position of tgt_ids[:, 0]),
                  past_keep [B,C], past.{i}.key / .value [B,H,C,d_k] (+ src_keep, cross.{i}.*)
                    -> logits [B,T,V], present.{i}.key / .value [B,H,C,d_k], present_keep [B,C]

    forward_routed  (a mixture of experts) tgt_ids [B,T], tgt_keep [B,T], forced_experts [L,B,T,k]
                  (int64), forced_weights [L,B,T,k], replay [] (bool)
                    -> logits [B,T,V], chosen_experts [L,B,T,k], routing_weights [L,B,T,k]   (the
                       forward, each MoE layer's choices and their weights its own, or the forced
                       ones where replay: replayed routing, SPEC §5.14; the weights out are always
                       the layer's own, computed at the choices it took)
    decoder_step_routed  (a mixture of experts) decoder_step's inputs, forced_experts, forced_weights, replay
                    -> decoder_step's outputs, chosen_experts, routing_weights   (the step, routed as
                       forward_routed)

A hybrid (SPEC §5.15) has forward and decoder_step only: the step's past and present hold the
attending layers' keys and values, then per linear layer i its q_window, k_window, v_window
[B, K−1, channels] (the export's dtype) and state [B, H_v, d_k, d_v] (float32).

decoder_step is impl_torch's decode step over a preallocated cache (SPEC.md §7): it writes the
new tokens' K, V and keep at positions start … start+T−1 of a copy of the cache and attends
over all C positions under the causal mask, so every step of a generation has the same shapes,
and its present buffers can be the next step's past (export.runner keeps two sets and swaps
them). The prompt's prefill is a step at start 0. decoder_step_in_place has decoder_step's
interface but for its cache's head size, d_k rounded up to a multiple of 8 (what onnxruntime's
CPU kernel takes; the dimensions past d_k hold zeros); its GroupQueryAttention writes the new K
and V into the past buffers when the present outputs are bound to them (export.runner does), and
attends over start+T positions only. Decoder-only models have no encoder graph and no
src_keep/cross inputs. Every dimension above except d, H, d_k and V is dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec import ModelConfig

FORWARD, ENCODER, DECODER_STEP = "forward", "encoder", "decoder_step"
ROLES = (FORWARD, ENCODER, DECODER_STEP)
# the forward and the copying decode step of a mixture of experts whose routing can be forced:
# for conformance only
FORWARD_ROUTED, DECODER_STEP_ROUTED = "forward_routed", "decoder_step_routed"
ROUTED = (FORWARD_ROUTED, DECODER_STEP_ROUTED)
# decoder_step's interface, its cache written in place by onnxruntime's GroupQueryAttention
# (export/in_place_step.py): torch exports at float32 add it, and the runner serves it on the CPU
DECODER_STEP_IN_PLACE = "decoder_step_in_place"
GROUP_QUERY_HEAD_MULTIPLE = 8  # onnxruntime 1.31's CPU GroupQueryAttention: "head_size must be a multiple of 8"


def cache_head_size(cfg: ModelConfig, role: str) -> int:
    """The head size of a step graph's cache: d_k, rounded up to GroupQueryAttention's multiple of 8
    for decoder_step_in_place (the extra dimensions are zeros in q, k and v alike, so no score
    changes, and the attention's scale is set to d_k's)."""
    if role != DECODER_STEP_IN_PLACE:
        return cfg.d_head
    return -(-cfg.d_head // GROUP_QUERY_HEAD_MULTIPLE) * GROUP_QUERY_HEAD_MULTIPLE


def in_place_unsupported_reason(dtype: str, cfg: ModelConfig) -> str | None:
    """Why an export of this dtype and model has no decoder_step_in_place, or None."""
    if cfg.linear_attention is not None:
        return ("a hybrid's linear layers carry states, not keys and values: its cache is decoder_step's, "
                "copied each step")
    if dtype != "float32":
        return f"dtype {dtype}: the in-place step is exported at float32 (served on the CPU)"
    return None


@dataclass(frozen=True)
class Tensor:
    name: str
    kind: str  # "ids" (int64), "keep" (bool), "position" (an int64 scalar), "experts" (int64 expert
    #            indices), "flag" (a bool scalar), "float" (the export's dtype) or "state" (float32)
    dims: tuple[str | int, ...]  # symbolic names for dynamic axes


@dataclass(frozen=True)
class GraphSignature:
    role: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


def roles(cfg: ModelConfig) -> tuple[str, ...]:
    """The graphs a model exports: the full forward plus the deployment layout."""
    if cfg.has_encoder:
        return ROLES
    return (FORWARD, DECODER_STEP) + (ROUTED if cfg.moe is not None else ())


def _kv(prefix: str, cfg: ModelConfig, length: str, head_size: int | None = None) -> tuple[Tensor, ...]:
    """prefix.{i}.key and prefix.{i}.value for each decoder layer i that attends: [B, H, length, d_k]"""
    return tuple(Tensor(f"{prefix}.{i}.{part}", "float", ("batch", cfg.kv_heads, length, head_size or cfg.d_head))
                 for i in range(cfg.n_decoder_layers) if cfg.layer_kind(i) != "linear" for part in ("key", "value"))


LINEAR_STATE_PARTS = ("q_window", "k_window", "v_window", "state")


def _linear_states(prefix: str, cfg: ModelConfig) -> tuple[Tensor, ...]:
    """A hybrid's linear layer i carries prefix.{i}.q_window, .k_window, .v_window [B, K − 1, channels]
    (its convolutions' last inputs) and prefix.{i}.state [B, H_v, d_k, d_v] (S, float32 whatever
    the export's dtype, SPEC §5.15)."""
    mixer = cfg.linear_attention
    if mixer is None:
        return ()
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    shapes = {"q_window": ("float", ("batch", mixer.conv_kernel - 1, keys)),
              "k_window": ("float", ("batch", mixer.conv_kernel - 1, keys)),
              "v_window": ("float", ("batch", mixer.conv_kernel - 1, values)),
              "state": ("state", ("batch", mixer.value_heads, mixer.key_head_dim, mixer.value_head_dim))}
    return tuple(Tensor(f"{prefix}.{i}.{part}", *shapes[part])
                 for i in range(cfg.n_decoder_layers) if cfg.layer_kind(i) == "linear" for part in LINEAR_STATE_PARTS)


def cache_tensors(prefix: str, cfg: ModelConfig, head_size: int | None = None) -> tuple[Tensor, ...]:
    """A step graph's cache (past or present) but its keep-vector: the attending layers' keys and
    values (of head_size, d_k where None), then a hybrid's linear layers' states."""
    return _kv(prefix, cfg, "capacity", head_size) + _linear_states(prefix, cfg)


def signature(cfg: ModelConfig, role: str) -> GraphSignature:
    if role == DECODER_STEP_IN_PLACE:
        head_size = cache_head_size(cfg, role)
        cache = {t.name: t for prefix in ("past", "present") for t in _kv(prefix, cfg, "capacity", head_size)}
        copying = signature(cfg, DECODER_STEP)
        return GraphSignature(role, tuple(cache.get(t.name, t) for t in copying.inputs),
                              tuple(cache.get(t.name, t) for t in copying.outputs))
    if role not in roles(cfg):
        raise ValueError(f"graph role must be one of {', '.join(roles(cfg))} for this model, got {role!r}")
    src = (Tensor("src_ids", "ids", ("batch", "src_len")), Tensor("src_keep", "keep", ("batch", "src_len")))
    tgt = (Tensor("tgt_ids", "ids", ("batch", "tgt_len")), Tensor("tgt_keep", "keep", ("batch", "tgt_len")))
    logits = Tensor("logits", "float", ("batch", "tgt_len", cfg.tgt_vocab_size))
    cross = (Tensor("src_keep", "keep", ("batch", "src_len")),) + _kv("cross", cfg, "src_len") if cfg.has_encoder else ()
    if role == FORWARD:
        return GraphSignature(role, (src if cfg.has_encoder else ()) + tgt, (logits,))
    if role in ROUTED:
        experts = (cfg.n_decoder_layers, "batch", "tgt_len", cfg.moe.experts_per_token)
        unrouted = signature(cfg, FORWARD if role == FORWARD_ROUTED else DECODER_STEP)
        return GraphSignature(role, unrouted.inputs + (Tensor("forced_experts", "experts", experts),
                                                       Tensor("forced_weights", "float", experts),
                                                       Tensor("replay", "flag", ())),
                              unrouted.outputs + (Tensor("chosen_experts", "experts", experts),
                                                  Tensor("routing_weights", "float", experts)))
    if role == ENCODER:
        memory = Tensor("memory", "float", ("batch", "src_len", cfg.d_model))
        return GraphSignature(role, src, (memory,) + _kv("cross", cfg, "src_len"))
    past = (Tensor("past_keep", "keep", ("batch", "capacity")),) + cache_tensors("past", cfg)
    present = cache_tensors("present", cfg) + (Tensor("present_keep", "keep", ("batch", "capacity")),)
    return GraphSignature(role, tgt + (Tensor("start", "position", ()),) + past + cross, (logits,) + present)


# Example sizes. torch.export treats an axis of size 0 or 1 as a constant, so every dynamic
# axis is traced at 2 or more; the graphs then run at any size (the tests run 1).
EXAMPLE_SIZES = {"batch": 2, "src_len": 5, "tgt_len": 3, "capacity": 7}
EXAMPLE_START = 2  # the example step writes positions 2 … 4 of a cache of 7


def example_sizes(cfg: ModelConfig) -> dict[str, int]:
    """EXAMPLE_SIZES, but a hybrid's target spans two chunks, so that its chunked form's number of
    chunks is traced at 2 too (a cache the same 4 positions longer than the step)."""
    if cfg.linear_attention is None:
        return EXAMPLE_SIZES
    length = max(EXAMPLE_SIZES["tgt_len"], cfg.linear_attention.chunk_size + 1)
    return {**EXAMPLE_SIZES, "tgt_len": length, "capacity": EXAMPLE_START + length + 2}


def example_inputs(cfg: ModelConfig, role: str, dtype: str) -> dict[str, np.ndarray]:
    """Valid inputs of a graph's signature at EXAMPLE_SIZES: ids of real tokens (never pad_id),
    keep-vectors all True, random floats in the export's dtype, the step at EXAMPLE_START. For
    tracing and for profiling."""
    rng = np.random.default_rng(0)
    inputs, sizes = {}, example_sizes(cfg)
    for tensor in signature(cfg, role).inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in tensor.dims]
        if tensor.kind == "ids":
            vocab = cfg.src_vocab_size if tensor.name.startswith("src") else cfg.tgt_vocab_size
            ids = rng.integers(0, vocab - 1, shape)
            inputs[tensor.name] = np.where(ids >= cfg.pad_id, ids + 1, ids).astype(np.int64)
        elif tensor.kind == "position":
            # the in-place step's GroupQueryAttention (CPU) takes several tokens after position 0 for
            # one row only, so its example is a prefill
            inputs[tensor.name] = np.array(0 if role == DECODER_STEP_IN_PLACE else EXAMPLE_START, dtype=np.int64)
        elif tensor.kind == "keep":
            inputs[tensor.name] = np.ones(shape, dtype=bool)
        elif tensor.kind == "experts":
            inputs[tensor.name] = rng.integers(0, cfg.moe.n_experts, shape).astype(np.int64)
        elif tensor.kind == "flag":
            inputs[tensor.name] = np.array(True)  # traced with the forced choices taken
        elif tensor.kind == "state":
            inputs[tensor.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            inputs[tensor.name] = rng.standard_normal(shape).astype(dtype)
    return inputs
