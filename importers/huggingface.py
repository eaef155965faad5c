"""Hugging Face model directories -> the canonical config and parameters.

One explicit mapping per family, in the manner of Hugging Face's own conversion scripts: every
tensor of the checkpoint is named in a rule (source key, expected source shape, canonical name,
what is done to it), every shape is checked, and a mismatch is refused with the whole key diff
(missing, unexpected, mis-shaped) at once. Families:

- ``gpt2`` (GPT2LMHeadModel): decoder-only, pre-LN with a final norm, learned positions, tied
  head. Its Conv1D layers already store weights [in, out] (the spec's layout); q, k and v are
  one fused ``c_attn`` [d, 3d] whose column blocks are q, k, v.
- ``marian`` (MarianMTModel): encoder-decoder, post-LN, sinusoidal positions laid out in halves
  (not stored: the spec computes them; a stored table is checked against ours), scaled shared
  embeddings, ``final_logits_bias`` as the head bias.
- ``bart`` (BartForConditionalGeneration): as Marian, with learned positions whose first two
  rows are never read (BART numbers positions from 2) and a norm after the embeddings
  (``embed_norm`` in the spec).
- ``llama`` (LlamaForCausalLM; SmolLM2 and Llama 3.2 have this layout), ``qwen2``
  (Qwen2ForCausalLM), ``qwen3`` (Qwen3ForCausalLM) and ``mistral`` (MistralForCausalLM): the
  modern decoder of SPEC §5.11, with Llama's key names in all four: pre-RMSNorm with a final
  norm, rotary positions in the rotate_half layout (nothing stored), grouped-query attention,
  the gated FFN (gate_proj is the activated W1, up_proj W3, down_proj W2). Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms
  and a head_dim apart from d / heads. The rotary frequencies are computed, not stored; the
  linear, llama3, yarn and longrope rescalings are read (SPEC §5.12), dynamic refused. Mistral
  attends to a sliding window of keys in every layer (SPEC §6); Qwen2's and Qwen3's windows in some
  layers only are refused.
- ``phi3`` (Phi3ForCausalLM): the same computation with q, k and v fused into one ``qkv_proj``
  and the gate and up projections into one ``gate_up_proj`` (the mapping splits them by rows), a
  partial rotary (``partial_rotary_factor``, the spec's rope_fraction) and, where set, a window in
  every layer (Phi-3-mini's 2047); its longrope rescaling (the 128k models, Phi-3.5, Phi-4-mini)
  with Phi3Config's default original context of 4096.
- ``mixtral`` (MixtralForCausalLM) and ``qwen3_moe`` (Qwen3MoeForCausalLM): Mistral's and Qwen3's
  layers whose FFN is a mixture of experts (SPEC §5.14): a router ``gate`` [E, d] and E gated
  FFNs, num_experts_per_tok of them per token. Checkpoints store one nn.Linear per expert and
  projection (Mixtral: ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen3-MoE:
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``), as published and as transformers 5's
  save_pretrained writes them; transformers 5's own modules fuse them per layer
  (``mlp.experts.gate_up_proj`` [E, 2·d_ff, d], ``mlp.experts.down_proj`` [E, d, d_ff]), and a file
  saved in that layout (save_original_format=False) is split per expert. Mixtral always
  renormalises the k weights; Qwen3-MoE where norm_topk_prob says. Dense layers among the
  mixtures (Qwen3-MoE's mlp_only_layers, decoder_sparse_step) and shared experts are refused.
- ``qwen2_moe`` (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's layer (q/k/v biases where
  qkv_bias says, its default) whose FFN is Qwen3-MoE's mixture (``mlp.experts.{e}``, the k weights
  renormalised where norm_topk_prob says, its default false) beside a shared expert
  ``mlp.shared_expert`` of shared_expert_intermediate_size under its sigmoid gate
  ``mlp.shared_expert_gate``, as Qwen3-Next's (SPEC §5.14). Its windows are the class's own rule: with
  use_sliding_window, the even layers below max_window_layers (layer_types, where written, says which).
  Dense layers among the mixtures are refused.
- ``qwen3_5_text`` (Qwen3_5ForCausalLM) and ``qwen3_5`` (Qwen3_5ForConditionalGeneration, its text
  decoder): the hybrid of SPEC §5.15, gated DeltaNet in three layers of four, gated full attention in
  the others.
- ``qwen3_next`` (Qwen3NextForCausalLM): Qwen3.5's hybrid layers whose every FFN is a mixture of
  experts with a shared expert under its sigmoid gate (SPEC §5.14, moe.shared_expert_d_ff). Its
  linear layers fuse q, k, v and the output gate z into one ``in_proj_qkvz`` and β's and the decay's
  inputs into one ``in_proj_ba``, both grouped per key head (each key head's blocks, then the next
  head's): the mapping takes each block of every group. Dense layers among the mixtures
  (mlp_only_layers, decoder_sparse_step) are refused; num_experts 0 (every FFN dense) imports as
  Qwen3.5's layout would.
- ``gpt_oss`` (GptOssForCausalLM): Llama's names with biases on q, k, v and o, a sink per head
  ``self_attn.sinks`` [H] (SPEC §5.16), layers alternating a window of sliding_window keys and full
  attention (layer_types), YaRN untruncated (GptOssConfig's rope_parameters where the file has
  none), and in every layer a mixture whose router ``mlp.router`` has a bias and whose experts are
  stored as transformers' module holds them, [in, out] and fused: ``mlp.experts.gate_up_proj``
  [E, d, 2·d_ff] with the gate in the even columns and up in the odd ones (interleaved), its bias
  [E, 2·d_ff] likewise, ``down_proj`` [E, d_ff, d] and its bias [E, d]. The experts' clamped SwiGLU
  (swiglu_limit, swiglu_alpha) is read; hidden_act, which the class does not apply, is not. The
  published files' MXFP4 experts (``gate_up_proj_blocks`` and ``_scales``, uint8) are dequantized
  exactly (``dequantize_mxfp4``); another quantization_config is refused.

nn.Linear stores [out, in]: those weights are transposed. Anything a family needs that the spec
cannot express is refused with a ConfigError naming the config.json field and its value.
Reads NumPy and safetensors only: transformers is never imported here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spec import (ROPE_SCALINGS, GatedDeltaNet, MixtureOfExperts, ModelConfig, RopeScaling, check_params, params_digest,
                  save_weights)
from spec.errors import ConfigError, WeightsError
from spec.weights import read_header

FAMILIES = {
    "gpt2": "GPT2LMHeadModel",
    "marian": "MarianMTModel",
    "bart": "BartForConditionalGeneration",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",  # the published checkpoints: its text decoder is imported
    "qwen3_next": "Qwen3NextForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

# Families we know the spec cannot express, and the config.json field that says why.
_OUT_OF_SPEC = {
    "t5": ("relative_attention_num_buckets", "T5 adds a learned relative position bias to the attention scores, "
           "which it does not divide by sqrt(d_k); the spec's positions are absolute or rotary (T5's RMSNorm alone "
           "would be in it)"),
    "mt5": ("relative_attention_num_buckets", "mT5 is T5: a learned relative position bias, unscaled scores"),
    "gpt_neox": ("use_parallel_residual", "GPT-NeoX (Pythia) adds attention and FFN to one residual in parallel "
                 "when use_parallel_residual is true (its default), which the spec's sequential layers are not, "
                 "and rotates rotary_pct of each head; the importer has no gpt_neox family yet"),
    "mbart": ("add_final_layer_norm", "mBART is pre-LN with its norms after the embeddings and after each stack; "
              "import it as a separate family once the spec grows that combination"),
    "bert": ("type_vocab_size", "token-type embeddings and an encoder-only model are not in the spec"),
    "gemma3": ("vision_config", "Gemma 3's multimodal model (Gemma3ForConditionalGeneration) has a vision tower "
               "the spec does not describe; its text decoder is Gemma3ForCausalLM (model_type gemma3_text), which "
               "imports"),
}

_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu-tanh",
    "gelu_pytorch_tanh": "gelu-tanh",
    "swish": "swish",
    "silu": "swish",
}

# nn.LayerNorm's default epsilon: Marian and BART use it without recording it in config.json.
_TORCH_LAYER_NORM_EPS = 1e-5

_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")


@dataclass(frozen=True)
class Imported:
    """A checkpoint in canonical form, with every decision the import took."""

    family: str
    config: ModelConfig
    params: dict[str, np.ndarray]
    notes: tuple[str, ...]
    directory: Path


@dataclass(frozen=True)
class Rule:
    """One tensor of the checkpoint: where it goes and what is done to it on the way."""

    source: str
    source_shape: tuple[int, ...]
    target: str
    how: str  # "copy" | "transpose" | "columns a:b" | "slice a:b" (a vector) | "rows a:" | "row 0" | "transpose rows a:b"
    #           | "transpose expert e" | "transpose expert e rows a:b" (one expert's matrix of a fused [E, out, in])
    #           | "expert e" | "expert e interleaved j of n" (one expert's slice of a fused [E, ...] as stored,
    #             or every n-th entry of its last axis from j: gpt-oss's gate_up_proj, gate and up interleaved)
    #           | "channels a:b" (a depthwise nn.Conv1d's [C, 1, K] kernels of channels a … b − 1, as [b − a, K])
    #           | "transpose head half j of w" (of an nn.Linear whose outputs are, head by head, two blocks of w
    #             rows: block j of every head, transposed; Qwen3.5's q_proj, each head's query then its gate)
    #           | "transpose group rows a:b of w" (of an nn.Linear whose outputs are groups of w rows, one group
    #             per key head: rows a … b − 1 of every group, the groups' blocks one after another, transposed;
    #             Qwen3-Next's in_proj_qkvz and in_proj_ba, each key head's q, k, v, z and b, a side by side)

    def span(self) -> tuple[int, int]:
        """start and stop of a ranged rule ("columns a:b", "slice a:b", "transpose rows a:b",
        "transpose expert e rows a:b")."""
        start, stop = self.how.split()[-1].split(":")
        return int(start), int(stop)

    def head_half(self) -> tuple[int, int]:
        """j and w of "transpose head half j of w"."""
        words = self.how.split()
        return int(words[3]), int(words[5])

    def group_rows(self) -> tuple[int, int, int]:
        """a, b and w of "transpose group rows a:b of w"."""
        words = self.how.split()
        start, stop = words[3].split(":")
        return int(start), int(stop), int(words[5])

    def expert_entries(self) -> tuple[int, int, int]:
        """e, j and n of "expert e interleaved j of n" (j 0, n 1 for "expert e": every entry)."""
        words = self.how.split()
        return (int(words[1]), int(words[3]), int(words[5])) if len(words) > 2 else (int(words[1]), 0, 1)

    def take(self, value: np.ndarray) -> np.ndarray:
        if self.how == "copy":
            return value
        if self.how.startswith("expert "):  # gpt-oss's fused experts, stored [in, out]
            expert, start, step = self.expert_entries()
            return value[expert][..., start::step]
        if self.how == "transpose":  # nn.Linear stores [out, in]; the spec [in, out]
            return value.T
        if self.how.startswith("transpose expert "):  # one expert of a fused [E, out, in] (transformers 5's MoE)
            expert = value[int(self.how.split()[2])]
            if " rows " in self.how:  # gate_up_proj: the gate's rows, then up's
                start, stop = self.span()
                expert = expert[start:stop]
            return expert.T
        if self.how.startswith("transpose rows "):  # one block of a fused nn.Linear's outputs (Phi-3)
            start, stop = self.span()
            return value[start:stop].T
        if self.how.startswith("channels "):  # a depthwise convolution's kernels: [C, 1, K] -> [C, K]
            start, stop = self.span()
            return value[start:stop, 0]
        if self.how.startswith("transpose head half "):
            half, width = self.head_half()
            return value.reshape(-1, 2, width, value.shape[-1])[:, half].reshape(-1, value.shape[-1]).T
        if self.how.startswith("transpose group rows "):  # [G·w, in] -> G blocks of b − a rows, [in, G·(b − a)]
            start, stop, width = self.group_rows()
            if value.ndim != 2 or value.shape[0] % width or not 0 <= start < stop <= width:
                raise ValueError(f"{self.how!r} cannot take {self.source} of shape {list(value.shape)}: its rows must "
                                 f"be whole groups of {width}, the block inside one")
            return value.reshape(-1, width, value.shape[-1])[:, start:stop].reshape(-1, value.shape[-1]).T
        if self.how.startswith(("columns ", "slice ")):
            start, stop = self.span()
            return value[:, start:stop] if self.how.startswith("columns ") else value[start:stop]
        if self.how.startswith("rows "):
            return value[int(self.how.split()[1].rstrip(":")):]
        if self.how == "row 0":
            return value[0]
        raise ValueError(f"unknown transform {self.how!r}")


# ---- the directory ---------------------------------------------------------------------------

def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not directory.is_dir():
        raise WeightsError(f"{directory} is not a directory (a Hugging Face model directory holds config.json "
                           "and model.safetensors)")
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _checkpoint_files(directory: Path) -> list[Path]:
    """model.safetensors, or the shards its index lists. Pickles are refused, never opened."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise WeightsError(f"{index} is not a safetensors index (a JSON object with a weight_map): {error}") from None
        shards = sorted({directory / name for name in weight_map.values()})
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise WeightsError(f"{index} lists shards that are not in {directory}: {', '.join(missing)}")
        return shards
    pickles = [name for name in _PICKLE_FILES if (directory / name).exists()]
    if pickles:
        raise WeightsError(
            f"{directory} holds {pickles[0]}, not model.safetensors. {pickles[0]} is a pickle (or another "
            "framework's format), which this project never opens: a pickle can run code when loaded. Convert it "
            "to safetensors first, where you trust the file: with transformers, "
            "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)` (or AutoModelForSeq2SeqLM) "
            "writes NEW_DIR/model.safetensors; then import NEW_DIR.")
    raise WeightsError(f"{directory} has no model.safetensors (nor a model.safetensors.index.json)")


_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def _read_tensors(files: list[Path], notes: list[str]) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32: float32 ones as read-only views of the memory-mapped
    file, float16 and bfloat16 widened exactly, float64 rounded (the spec's weights are float32),
    which the import says."""
    tensors: dict[str, np.ndarray] = {}
    rounded = []
    for path in files:
        header = read_header(path)  # checks the framing: header length, JSON, byte ranges
        start = 8 + int.from_bytes(path.open("rb").read(8), "little")
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            kind = entry.get("dtype")
            packed = kind == "U8" and name.endswith(_MXFP4_PARTS)  # MXFP4's bytes, unpacked by _dequantized_mxfp4
            if kind not in _FLOAT_TYPES and not packed:
                raise WeightsError(f"{path.name}: tensor {name} has dtype {kind}; the importer reads "
                                   f"{', '.join(_FLOAT_TYPES)} only (and U8 as MXFP4's blocks and scales)")
            begin, end = entry["data_offsets"]
            if packed:
                tensors[name] = np.frombuffer(data[start + begin:start + end], np.uint8).reshape(entry["shape"])
                continue
            raw = np.frombuffer(data[start + begin:start + end], dtype=np.dtype(_FLOAT_TYPES[kind]).newbyteorder("<"))
            if kind == "BF16":  # bfloat16 is the top half of a float32
                value = (raw.astype(np.uint32) << 16).view(np.float32)
            elif kind == "F32":  # read where it lies: a view of the memory-mapped file, never copied
                value = raw
            else:
                value = raw.astype(np.float32)
                if kind == "F64" and not np.array_equal(value.astype(np.float64), raw):
                    rounded.append(name)
            if name in tensors:
                raise WeightsError(f"tensor {name} appears in more than one shard")
            tensors[name] = value.reshape(entry["shape"])
    if rounded:
        notes.append(f"{len(rounded)} float64 tensor(s) rounded to float32, the spec's weight dtype "
                     f"(first: {rounded[0]})")
    return tensors


# ---- MXFP4: the published gpt-oss files' experts -----------------------------------------------------

_MXFP4_PARTS = ("_blocks", "_scales")
# FP4 (E2M1) by its 4-bit code: sign, two exponent bits, one mantissa bit
_FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                      -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling) as gpt-oss stores its experts: each byte two FP4 values, the low nibble
    first, each block of 32 times 2^(scale − 127). Exact in float32 (two significant bits times a power
    of two). blocks [E, out, G, 16] uint8, scales [E, out, G] uint8 -> [E, 32·G, out]: [in, out], as
    GptOssExperts holds it."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise WeightsError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales {list(scales.shape)} "
                           f"({scales.dtype}): expected uint8 blocks [..., G, 16] and uint8 scales [..., G]")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = _FP4_E2M1[blocks & 0x0F]
    values[..., 1::2] = _FP4_E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1).swapaxes(-1, -2)


def _dequantized_mxfp4(tensors: dict[str, np.ndarray], notes: list[str]) -> dict[str, np.ndarray]:
    """The checkpoint with each MXFP4 pair (name_blocks, name_scales) replaced by the tensor it stores
    (name, dequantized exactly); a part without its pair is refused."""
    stems = {key[:-len(part)] for key in tensors for part in _MXFP4_PARTS if key.endswith(part)}
    if not stems:
        return tensors
    unpaired = sorted(stem + part for stem in stems for part in _MXFP4_PARTS if stem + part not in tensors)
    if unpaired:
        raise WeightsError(f"MXFP4 tensors without their pair: missing {', '.join(unpaired)}")
    unpacked = {key: value for key, value in tensors.items() if not key.endswith(_MXFP4_PARTS)}
    for stem in sorted(stems):
        unpacked[stem] = dequantize_mxfp4(tensors[stem + "_blocks"], tensors[stem + "_scales"])
    notes.append(f"{len(stems)} tensor(s) stored as MXFP4 (FP4 blocks of 32 with a power-of-two scale each) "
                 f"dequantized exactly to float32: the weights the file stores (first: {min(stems)})")
    return unpacked


# ---- config.json -> ModelConfig ------------------------------------------------------------------


def _require(hf: Mapping[str, Any], name: str, family: str) -> Any:
    if name not in hf or hf[name] is None:
        raise ConfigError(f"config.json of this {family} model has no {name}")
    return hf[name]


def _activation(hf: Mapping[str, Any], name: str) -> str:
    value = hf.get(name)
    if value not in _ACTIVATIONS:
        raise ConfigError(f"{name} = {value!r} is not in the spec (it has {', '.join(_ACTIVATIONS)}); "
                          "gelu_fast and quick_gelu are approximations the spec does not define")
    return _ACTIVATIONS[value]


def _refuse_if(hf: Mapping[str, Any], name: str, bad: Callable[[Any], bool], why: str) -> None:
    if name in hf and bad(hf[name]):
        raise ConfigError(f"{name} = {json.dumps(hf[name])}: {why}")


def _pad_id(hf: Mapping[str, Any], vocab: int, notes: list[str]) -> int:
    """pad_token_id, else eos_token_id (as transformers' generate does for GPT-2), inside the vocabulary."""
    pad = hf.get("pad_token_id")
    if isinstance(pad, int) and 0 <= pad < vocab:
        return pad
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int) and 0 <= eos < vocab:
        notes.append(f"pad_token_id is {json.dumps(pad)}: pad_id is eos_token_id ({eos}), so ids equal to it count "
                     "as padding unless keep-vectors say otherwise")
        return eos
    raise ConfigError(f"pad_token_id = {json.dumps(pad)} and eos_token_id = {json.dumps(hf.get('eos_token_id'))}: "
                      f"the spec needs a padding id inside the vocabulary (0 .. {vocab - 1}); set pad_token_id")


def _gpt2_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    _refuse_if(hf, "scale_attn_weights", lambda v: v is False,
               "attention without the 1/sqrt(d_k) scale is not in the spec")
    _refuse_if(hf, "scale_attn_by_inverse_layer_idx", bool,
               "scores divided by the layer number as well are not in the spec")
    _refuse_if(hf, "add_cross_attention", bool, "a GPT-2 with cross-attention is not a decoder-only model")
    d_model = _require(hf, "n_embd", "gpt2")
    vocab = _require(hf, "vocab_size", "gpt2")
    return ModelConfig(
        arch="decoder-only", d_model=d_model, n_heads=_require(hf, "n_head", "gpt2"),
        d_ff=hf.get("n_inner") or 4 * d_model, n_decoder_layers=_require(hf, "n_layer", "gpt2"),
        tgt_vocab_size=vocab, max_len=_require(hf, "n_positions", "gpt2"), pad_id=_pad_id(hf, vocab, notes),
        norm_position="pre", norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        final_norm=True, positional="learned", embed_scale=False,
        activation=_activation(hf, "activation_function"), qkv_bias=True, bias=True, head_bias=False,
        tie_head=bool(hf.get("tie_word_embeddings", True)), dropout=float(hf.get("resid_pdrop", 0.0)),
    )


def _seq2seq_sizes(hf: Mapping[str, Any], family: str) -> dict[str, int]:
    """The sizes Marian and BART record per stack, which the spec has once."""
    for encoder_field, decoder_field in (("encoder_attention_heads", "decoder_attention_heads"),
                                         ("encoder_ffn_dim", "decoder_ffn_dim")):
        encoder, decoder = _require(hf, encoder_field, family), _require(hf, decoder_field, family)
        if encoder != decoder:
            raise ConfigError(f"{encoder_field} = {encoder} but {decoder_field} = {decoder}: the spec has one "
                              "size for both stacks")
    return {"d_model": _require(hf, "d_model", family), "n_heads": hf["encoder_attention_heads"],
            "d_ff": hf["encoder_ffn_dim"], "n_encoder_layers": _require(hf, "encoder_layers", family),
            "n_decoder_layers": _require(hf, "decoder_layers", family)}


def _seq2seq_refusals(hf: Mapping[str, Any]) -> None:
    _refuse_if(hf, "normalize_before", bool, "pre-LN layers are not what this family's model class computes")
    _refuse_if(hf, "add_final_layer_norm", bool, "a norm after each stack is not what this family's model class "
               "computes (mBART's is)")


def _marian_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    _seq2seq_refusals(hf)
    vocab = _require(hf, "vocab_size", "marian")
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    target_vocab = vocab if shared else (hf.get("decoder_vocab_size") or vocab)
    pad = _require(hf, "pad_token_id", "marian")
    if hf.get("decoder_start_token_id", pad) == pad:
        notes.append(f"Marian decodes from the pad token ({pad}); the spec keeps an encoder-decoder's start token "
                     "real whatever its id (SPEC.md §6)")
    return ModelConfig(
        **_seq2seq_sizes(hf, "marian"), src_vocab_size=vocab, tgt_vocab_size=target_vocab,
        max_len=_require(hf, "max_position_embeddings", "marian"), pad_id=pad, norm_position="post",
        norm="layernorm", norm_eps=_TORCH_LAYER_NORM_EPS, final_norm=False, positional="sinusoidal-concat",
        embed_scale=bool(hf.get("scale_embedding", False)), activation=_activation(hf, "activation_function"),
        qkv_bias=True, bias=True, head_bias=True, share_src_tgt_embed=shared,
        tie_head=bool(hf.get("tie_word_embeddings", True)), dropout=float(hf.get("dropout", 0.0)),
    )


def _bart_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    _seq2seq_refusals(hf)
    vocab = _require(hf, "vocab_size", "bart")
    notes.append("BART's position tables have 2 rows more than max_position_embeddings: positions start at row 2, "
                 "rows 0 and 1 are never read and are not imported")
    return ModelConfig(
        **_seq2seq_sizes(hf, "bart"), src_vocab_size=vocab, tgt_vocab_size=vocab,
        max_len=_require(hf, "max_position_embeddings", "bart"), pad_id=_require(hf, "pad_token_id", "bart"),
        norm_position="post", norm="layernorm", norm_eps=_TORCH_LAYER_NORM_EPS, final_norm=False,
        positional="learned", embed_scale=bool(hf.get("scale_embedding", False)), embed_norm=True,
        activation=_activation(hf, "activation_function"), qkv_bias=True, bias=True, head_bias=True,
        share_src_tgt_embed=True, tie_head=bool(hf.get("tie_word_embeddings", True)),
        dropout=float(hf.get("dropout", 0.0)),
    )


# ---- the modern decoder: Llama, Qwen2, Qwen3 ------------------------------------------------------

# Rotary variants that rescale the frequencies or the positions, as a refusal names them (the spec's: §5.12)
_ROPE_SCALINGS = {
    "linear": "positions divided by a factor (position interpolation)",
    "dynamic": "NTK scaling, a base that grows with the sequence length",
    "yarn": "YaRN: frequencies interpolated by parts, and a temperature on the scores",
    "longrope": "per-dimension rescale factors for long and short contexts (LongRoPE)",
    "llama3": "Llama 3.1's rescaling of the long wavelengths",
}


def _rotary(hf: Mapping[str, Any], family: str) -> tuple[float, float, RopeScaling | None]:
    """θ, the rotated share of each head and the rescaling of the rotary embedding (SPEC §5.11,
    §5.12). transformers 5 writes them into rope_parameters ({"rope_type": ..., "rope_theta": ...,
    and the type's keys}); older files have a top-level rope_theta and put any rescaling into
    rope_scaling, which transformers still reads first. A variant the spec lacks is refused
    whichever field names it. Phi-3, Qwen3.5 and Qwen3-Next rotate the leading partial_rotary_factor of
    each head (the spec's rope_fraction; the hybrids' classes 0.25 where the file gives none); the other classes
    rotate every dimension whatever the file says, so a partial rotary there is refused."""
    name, parameters = next(((name, hf[name]) for name in ("rope_scaling", "rope_parameters") if hf.get(name)),
                            ("rope_parameters", {}))
    if not isinstance(parameters, dict):
        raise ConfigError(f"{name} = {json.dumps(parameters)}: expected a JSON object (rope_type, rope_theta)")
    if any(isinstance(value, dict) for value in parameters.values()):  # one entry per layer type
        kinds = {"full_attention", "sliding_attention"} if family == "gemma3_text" else {"full_attention"}
        if not set(parameters) <= kinds or "full_attention" not in parameters:
            raise ConfigError(f"{name} = {json.dumps(parameters)}: rotary settings per layer type; the spec has one "
                              "rotary embedding for every layer, or Gemma 3's sliding layers with their own "
                              "unrescaled theta (local_rope_theta)")
        name, parameters = f"{name}.full_attention", parameters["full_attention"]
    fraction = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if family in _HYBRID_FAMILIES and fraction is None:
        fraction = _QWEN3_5_ROTARY_FRACTION
    if family in ("phi3", *_HYBRID_FAMILIES):
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))):
            raise ConfigError(f"partial_rotary_factor = {json.dumps(fraction)}: expected a number in (0, 1]")
    elif fraction is not None and fraction != 1:
        raise ConfigError(f"partial_rotary_factor = {json.dumps(fraction)}: {FAMILIES[family]} rotates every "
                          "dimension of a head whatever this says, so the file and transformers disagree on the "
                          "function; the spec's rope_fraction is for a family whose class honours it")
    theta = parameters.get("rope_theta", hf.get("rope_theta"))
    theta = float(_DEFAULT_THETA.get(family, 10000.0) if theta is None else theta)  # transformers' default_theta
    fraction = float(1.0 if fraction is None else fraction)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return theta, fraction, None
    field = f"{name}.{'rope_type' if 'rope_type' in parameters else 'type'}"
    if family == "phi3":  # Phi3Config reads "su" and "yarn" as longrope, and refuses every other rescaling
        if kind not in ("su", "yarn", "longrope"):
            raise ConfigError(f"{field} = {json.dumps(kind)} (a rescaling Phi3Config refuses): Phi-3's rotary "
                              "embedding is the plain one or longrope")
        kind = "longrope"
    if kind not in ROPE_SCALINGS:
        what = _ROPE_SCALINGS.get(kind, "a variant transformers defines")
        raise ConfigError(f"{field} = {json.dumps(kind)} ({what}): the spec's rotary rescalings are "
                          f"{', '.join(ROPE_SCALINGS[:-1])} and {ROPE_SCALINGS[-1]} (SPEC §5.12)")
    return theta, fraction, _rope_scaling(hf, name, kind, parameters)


# Qwen3_5TextConfig's and Qwen3NextConfig's partial_rotary_factor where the file gives none
_QWEN3_5_ROTARY_FRACTION = 0.25
_HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_next")  # gated DeltaNet and gated attention (SPEC §5.15)
# Gemma3TextConfig's global theta and MixtralConfig's; the others' is 10000
_DEFAULT_THETA = {"gemma3_text": 1_000_000.0, "mixtral": 1_000_000.0, "smollm3": 2_000_000.0, "gpt_oss": 150_000.0}
_GEMMA3_LOCAL_THETA = 10_000.0  # Gemma3TextConfig's theta of the sliding layers where the file gives none


def _local_rope_theta(hf: Mapping[str, Any]) -> float:
    """Gemma 3's sliding layers rotate by their own θ, unrescaled: rope_parameters.sliding_attention
    (transformers 5), else rope_local_base_freq (older files), else 10000."""
    parameters = hf.get("rope_parameters") or {}
    entry = parameters.get("sliding_attention") if isinstance(parameters, dict) else None
    if isinstance(entry, dict):
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"rope_parameters.sliding_attention.rope_type = {json.dumps(kind)}: the spec's sliding "
                              "layers with a theta of their own rotate unrescaled (Gemma 3's local layers)")
        if entry.get("rope_theta") is not None:
            return float(entry["rope_theta"])
    return float(hf.get("rope_local_base_freq") or _GEMMA3_LOCAL_THETA)


def _rope_scaling(hf: Mapping[str, Any], name: str, kind: str, parameters: Mapping[str, Any]) -> RopeScaling:
    """A rescaling's keys as transformers reads them: original_max_position_embeddings from the
    config's top level where it has one (Phi-3), else from the entry, else max_position_embeddings;
    YaRN's and LongRoPE's factor, where absent, the ratio of the two; beta_fast and beta_slow 32 and
    1 where absent or 0; truncate true unless false. Phi3Config has a top-level
    original_max_position_embeddings of 4096 where config.json has none; an entry that differs from
    it is refused (transformers takes one or the other depending on where rope_theta is)."""
    def required(key: str) -> Any:
        if parameters.get(key) is None:
            raise ConfigError(f"{name} has rope_type {json.dumps(kind)} but no {key}: transformers requires it")
        return parameters[key]

    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(required("factor")))
    entry = parameters.get("original_max_position_embeddings")
    if hf.get("model_type") != "phi3":
        original = hf.get("original_max_position_embeddings") or entry or hf.get("max_position_embeddings")
    else:
        original = hf.get("original_max_position_embeddings") or _PHI3_ORIGINAL_MAX_LEN
        if entry is not None and entry != original:
            top = hf.get("original_max_position_embeddings")
            raise ConfigError(f"{name}.original_max_position_embeddings = {json.dumps(entry)} but the top-level field "
                              f"is {json.dumps(top) if top else f'absent (Phi3Config: {_PHI3_ORIGINAL_MAX_LEN})'}: "
                              "transformers 5 takes one or the other depending on where rope_theta is written; "
                              "give the context once, at the top level, as Phi-3's files do")
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=float(required("factor")), original_max_len=original,
                           low_freq_factor=float(required("low_freq_factor")),
                           high_freq_factor=float(required("high_freq_factor")))
    factor = parameters.get("factor")
    if factor is None:
        factor = hf.get("max_position_embeddings", original) / original
    if kind == "longrope":
        factors = {key: required(key) for key in ("short_factor", "long_factor")}
        for key, value in factors.items():
            if not isinstance(value, list):
                raise ConfigError(f"{name}.{key} = {json.dumps(value)}: expected a list of numbers, one per rotated pair")
        attention = parameters.get("attention_factor")
        return RopeScaling(kind="longrope", factor=float(factor), original_max_len=original,
                           attention_factor=None if attention is None else float(attention),
                           **{key: tuple(value) for key, value in factors.items()})
    optional = {key: float(parameters[key]) for key in ("mscale", "mscale_all_dim", "attention_factor")
                if parameters.get(key) is not None}
    return RopeScaling(kind="yarn", factor=float(factor), original_max_len=original,
                       beta_fast=float(parameters.get("beta_fast") or 32), beta_slow=float(parameters.get("beta_slow") or 1),
                       truncate=parameters.get("truncate", True) is not False, **optional)


def _refuse_foreign_fields(hf: Mapping[str, Any], family: str) -> None:
    """Fields of other architectures that these classes do not apply: a file that sets them was made
    for a model that does, and the spec has neither."""
    model = FAMILIES[family]
    if family in _GEMMA_FAMILIES:
        return
    for name, what in (("attn_logit_softcapping", "scores squashed by c·tanh(s/c)"),
                       ("final_logit_softcapping", "logits squashed by c·tanh(z/c)")):
        _refuse_if(hf, name, lambda value: value is not None,
                   f"{what} (Gemma 2) is not in the spec, and {model} does not apply it either")
    if family == "llama":
        _refuse_if(hf, "sliding_window", lambda value: value is not None,
                   "attention to a sliding window of keys (Mistral) is not in the spec, and LlamaForCausalLM does "
                   "not apply it either")


_HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _layer_kinds(hf: Mapping[str, Any], family: str, window: int | None,
                 default: Callable[[int], bool]) -> dict[str, Any]:
    """sliding_window and layer_types (SPEC §6) from the file's layer_types, else from the class's
    rule default(i) (is layer i sliding?): no field where every layer is full, a window alone where
    every layer is sliding, both where they mix."""
    layers = _require(hf, "num_hidden_layers", family)
    written = hf.get("layer_types")
    if written is not None:
        if not isinstance(written, list) or len(written) != layers or any(kind not in _HF_LAYER_TYPES for kind in written):
            raise ConfigError(f"layer_types = {json.dumps(written)}: expected {layers} entries, each "
                              f"{' or '.join(map(json.dumps, _HF_LAYER_TYPES))}")
        kinds = tuple(_HF_LAYER_TYPES[kind] for kind in written)
    else:
        kinds = tuple("sliding" if default(i) else "full" for i in range(layers))
    if "sliding" not in kinds:
        return {}
    if window is None:
        raise ConfigError(f"layer_types has sliding layers ({kinds.count('sliding')} of {layers}) but sliding_window is "
                          "null: their window is unknown")
    if "full" not in kinds:
        return {"sliding_window": window}
    return {"sliding_window": window, "layer_types": kinds}


def _qwen_layer_kinds(hf: Mapping[str, Any], family: str) -> dict[str, Any]:
    """Qwen2 and Qwen3 attend to a window of sliding_window keys in the layers from max_window_layers
    on, when use_sliding_window is true (layer_types, if written, says which layers)."""
    window = _sliding_window(hf, None) if hf.get("use_sliding_window") else None
    first = hf.get("max_window_layers", 28)
    return _layer_kinds(hf, family, window, lambda i: window is not None and i >= first)


def _rotary_decoder(hf: Mapping[str, Any], family: str, notes: list[str], *, head_dim: int, kv_heads: int,
                    d_ff_field: str = "intermediate_size", **biases_and_norms: Any) -> ModelConfig:
    """What Llama, Qwen2 and Qwen3 share: pre-RMSNorm with a final norm, rotary positions, the gated
    FFN (d_ff from d_ff_field: Qwen3-MoE's experts are moe_intermediate_size wide), no embedding
    scale, no head bias."""
    _refuse_foreign_fields(hf, family)
    d_model, n_heads = _require(hf, "hidden_size", family), _require(hf, "num_attention_heads", family)
    vocab = _require(hf, "vocab_size", family)
    if hf.get("attention_dropout"):
        notes.append(f"attention_dropout = {hf['attention_dropout']} drops attention probabilities, which is not the "
                     "spec's dropout (SPEC §5.10); the import has dropout 0, and evaluation is unaffected")
    theta, fraction, scaling = _rotary(hf, family)
    return ModelConfig(
        arch="decoder-only", d_model=d_model, n_heads=n_heads, n_kv_heads=None if kv_heads == n_heads else kv_heads,
        head_dim=None if head_dim * n_heads == d_model else head_dim, d_ff=_require(hf, d_ff_field, family),
        n_decoder_layers=_require(hf, "num_hidden_layers", family), tgt_vocab_size=vocab,
        max_len=_require(hf, "max_position_embeddings", family), pad_id=_pad_id(hf, vocab, notes),
        norm_position="pre", norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), final_norm=True,
        positional="rope", rope_theta=theta, rope_fraction=fraction, rope_scaling=scaling, embed_scale=False,
        activation=_activation({"hidden_act": "silu", **hf}, "hidden_act"),  # silu: the classes' default
        gated_ffn=True, head_bias=False, tie_head=bool(hf.get("tie_word_embeddings", False)), **biases_and_norms,
    )


def _head_dim(hf: Mapping[str, Any], family: str, default: int | None = None) -> int:
    """head_dim as the class reads it: the field, else (Qwen3) its class default, else d / heads."""
    value = hf.get("head_dim") or default
    return value or _require(hf, "hidden_size", family) // _require(hf, "num_attention_heads", family)


def _llama_biases(hf: Mapping[str, Any]) -> bool:
    """Llama's (and SmolLM3's) attention_bias (q, k, v and o) and mlp_bias, which must agree."""
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ConfigError(f"attention_bias = {json.dumps(attention_bias)} and mlp_bias = {json.dumps(mlp_bias)}: the "
                          "spec's bias field gives o_proj and the FFN their biases together (qkv_bias covers q, k "
                          "and v), so o_proj and the MLP must both have biases or neither")
    return attention_bias


def _llama_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    bias = _llama_biases(hf)
    kv_heads = hf.get("num_key_value_heads") or _require(hf, "num_attention_heads", "llama")
    return _rotary_decoder(hf, "llama", notes, head_dim=_head_dim(hf, "llama"), kv_heads=kv_heads,
                           qkv_bias=bias, bias=bias)


_SMOLLM3_NOPE_INTERVAL = 4  # SmolLM3Config's no_rope_layer_interval where the file gives neither field


def _nope_layers(hf: Mapping[str, Any], layers: int) -> tuple[int, ...] | None:
    """SmolLM3's layers that do not rotate (SPEC §5.11): the 0s of no_rope_layers (one flag per layer, 1
    rotates; the class reads the first num_hidden_layers), else every no_rope_layer_interval-th layer."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", _SMOLLM3_NOPE_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"no_rope_layer_interval = {json.dumps(interval)}: expected a positive integer")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) < layers or any(flag not in (0, 1) or isinstance(flag, float)
                                                                 for flag in flags[:layers]):
        raise ConfigError(f"no_rope_layers = {json.dumps(flags)}: expected at least {layers} flags, each 1 (the layer "
                          "rotates) or 0 (it does not)")
    return tuple(i for i in range(layers) if flags[i] == 0) or None


def _smollm3_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Llama's layer in which the layers no_rope_layers marks 0 rotate nothing (NoPE), its head tied
    unless the file says otherwise (SmolLM3Config's default). Its windows are where layer_types says,
    else (use_sliding_window) on the NoPE layers: the mask the class builds for its sdpa and eager
    paths slides there whatever use_sliding_window says, and that is what is imported."""
    bias = _llama_biases(hf)
    kv_heads = hf.get("num_key_value_heads") or _require(hf, "num_attention_heads", "smollm3")
    layers = _require(hf, "num_hidden_layers", "smollm3")
    nope = _nope_layers(hf, layers)
    window = _sliding_window(hf, None)
    kinds = _layer_kinds(hf, "smollm3", window, lambda i: bool(hf.get("use_sliding_window")) and window is not None
                         and i in (nope or ()))
    if kinds and not hf.get("use_sliding_window"):
        notes.append("layer_types has sliding layers but use_sliding_window is false: transformers' sdpa and eager "
                     "paths slide them (their mask is built from layer_types), its flash-attention path does not; "
                     "imported as the first compute")
    return _rotary_decoder({"tie_word_embeddings": True, **hf}, "smollm3", notes, head_dim=_head_dim(hf, "smollm3"),
                           kv_heads=kv_heads, qkv_bias=bias, bias=bias, nope_layers=nope, **kinds)


def _olmo2_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Llama's sizes in OLMo 2's layer: a norm on each sublayer's output before the residual sum and none
    before it (norm_position "output"), q and k each normed over the whole projection. Its attention_bias
    gives q, k, v and o biases and its MLP has none, which the spec's bias fields cannot hold together."""
    _refuse_if(hf, "attention_bias", bool, "q, k, v and o biases without the MLP's (Olmo2Attention's attention_bias) "
               "are not in the spec: its bias field gives o and the FFN their biases together")
    kv_heads = hf.get("num_key_value_heads") or _require(hf, "num_attention_heads", "olmo2")
    cfg = _rotary_decoder({"rms_norm_eps": 1e-5, **hf}, "olmo2", notes, head_dim=_head_dim(hf, "olmo2"),
                          kv_heads=kv_heads, qkv_bias=False, bias=False, qk_norm=True, qk_norm_scope="projection")
    return cfg.replace(norm_position="output")


def _qwen2_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    return _rotary_decoder(hf, "qwen2", notes, head_dim=_head_dim(hf, "qwen2"),
                           kv_heads=_require(hf, "num_key_value_heads", "qwen2"), qkv_bias=True, bias=False,
                           **_qwen_layer_kinds(hf, "qwen2"))


_PHI3_ORIGINAL_MAX_LEN = 4096  # Phi3Config's original_max_position_embeddings where config.json has none
_MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window where config.json has no such key (null: none)


def _mistral_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Llama's layout without biases, attending to the last sliding_window keys in every layer
    (SPEC §6); the key absent means the class's 4096, null means no window."""
    window = _sliding_window(hf, _MISTRAL_WINDOW)
    if "sliding_window" not in hf:
        notes.append(f"sliding_window is absent: MistralForCausalLM's default of {_MISTRAL_WINDOW} keys applies")
    kv_heads = hf.get("num_key_value_heads") or _require(hf, "num_attention_heads", "mistral")
    return _rotary_decoder(hf, "mistral", notes, head_dim=_head_dim(hf, "mistral"), kv_heads=kv_heads,
                           qkv_bias=False, bias=False, sliding_window=window)


def _sliding_window(hf: Mapping[str, Any], default: int | None) -> int | None:
    window = hf.get("sliding_window", default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"sliding_window = {json.dumps(window)}: a window is a positive number of keys, or null")
    return window


def _phi3_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Llama's computation without biases, with q, k, v fused into qkv_proj and gate and up into
    gate_up_proj (the mapping splits them), the leading partial_rotary_factor of each head
    rotated, and a window of sliding_window keys in every layer where the field is set (Phi-3-mini:
    2047; the class's default is none)."""
    for name in ("resid_pdrop", "embd_pdrop"):
        if hf.get(name):
            notes.append(f"{name} = {hf[name]} drops activations in training, which is not the spec's dropout "
                         "(SPEC §5.10); the import has dropout 0, and evaluation is unaffected")
    kv_heads = hf.get("num_key_value_heads") or _require(hf, "num_attention_heads", "phi3")
    return _rotary_decoder(hf, "phi3", notes, head_dim=_head_dim(hf, "phi3"), kv_heads=kv_heads, qkv_bias=False,
                           bias=False, sliding_window=_sliding_window(hf, None))


def _qwen3_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    _refuse_if(hf, "attention_bias", bool, "Qwen3 then has biases on q, k, v and o_proj but none in its MLP; the "
               "spec's bias field gives o_proj and the FFN their biases together")
    return _rotary_decoder(hf, "qwen3", notes, head_dim=_head_dim(hf, "qwen3", 128),
                           kv_heads=_require(hf, "num_key_value_heads", "qwen3"), qkv_bias=False, bias=False,
                           qk_norm=True, **_qwen_layer_kinds(hf, "qwen3"))


_GEMMA_FAMILIES = ("gemma2", "gemma3_text")
_GEMMA_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}  # the classes' attn, final defaults
_GEMMA_WINDOW = 4096  # Gemma2Config's and Gemma3TextConfig's sliding_window where the file has none


def _gemma_config(hf: Mapping[str, Any], notes: list[str], family: str) -> ModelConfig:
    """Gemma 2 and Gemma 3 (text): Llama's layout with the embeddings times √d, RMSNorms that
    multiply by (1 + weight) and four of them a layer, scores scaled by 1/√query_pre_attn_scalar,
    GeGLU, sliding and full layers (layer_types, else every other layer from the first for Gemma 2,
    five in six for Gemma 3), Gemma 2's softcaps, Gemma 3's q/k norms and its sliding layers'
    own θ. A tied head (the classes tie it)."""
    _refuse_if(hf, "use_bidirectional_attention", bool, "its layers attend in both directions (an embedding "
               "model), and the spec's decoder is causal")
    _refuse_if(hf, "attention_bias", bool, "then q, k, v and o carry biases; Gemma's have none, nor has the spec's "
               "Gemma layout")
    if hf.get("tie_word_embeddings") is False:
        raise ConfigError(f"tie_word_embeddings = false: {FAMILIES[family]} ties its head to the embeddings whatever "
                          "this says")
    attention_cap, final_cap = (hf.get(key, default) for key, default in
                                zip(("attn_logit_softcapping", "final_logit_softcapping"), _GEMMA_SOFTCAPS[family]))
    window = _sliding_window(hf, _GEMMA_WINDOW)
    pattern = 2 if family == "gemma2" else hf.get("sliding_window_pattern", 6)
    kinds = _layer_kinds(hf, family, window, lambda i: bool((i + 1) % pattern))
    if family == "gemma3_text" and "layer_types" in kinds:
        kinds["local_rope_theta"] = _local_rope_theta(hf)
    activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    kv_heads = hf.get("num_key_value_heads") or _require(hf, "num_attention_heads", family)
    cfg = _rotary_decoder({**hf, "hidden_act": activation, "tie_word_embeddings": True}, family, notes,
                          head_dim=_head_dim(hf, family, 256), kv_heads=kv_heads, qkv_bias=False, bias=False,
                          qk_norm=family == "gemma3_text", **kinds)
    return cfg.replace(embed_scale=True, norm_scale_plus_one=True, post_norms=True,
                       query_pre_attention_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                       attention_softcap=None if attention_cap is None else float(attention_cap),
                       final_softcap=None if final_cap is None else float(final_cap))


def _gemma2_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    return _gemma_config(hf, notes, "gemma2")


def _gemma3_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    return _gemma_config(hf, notes, "gemma3_text")


# ---- mixtures of experts: Mixtral, Qwen3-MoE ---------------------------------------------------------

# Fields of models whose every token also goes through experts the router does not choose (Qwen2-MoE's
# shared expert, DeepSeek's): a file that sets them was made for such a model
_SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
_SHARED_EXPERT_WIDTH = "shared_expert_intermediate_size"  # Qwen3-Next's one shared expert (moe.shared_expert_d_ff)
# Mixtral's name for the number of experts; Qwen3-MoE's (transformers maps one to the other)
_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts")


def _mixture(hf: Mapping[str, Any], family: str, notes: list[str], renormalize: bool,
             shared: bool = False) -> MixtureOfExperts:
    """The router's settings (SPEC §5.14): E experts, k of them per token, the k weights
    renormalised or not, the softmax in float32 (the classes take it in float32); ``shared`` (Qwen2-MoE,
    Qwen3-Next): the shared expert's width, shared_expert_intermediate_size. The router's auxiliary loss and
    Mixtral's jitter act in training only: noted, not imported."""
    model = FAMILIES[family]
    for name in _SHARED_EXPERT_FIELDS:
        if shared and name == _SHARED_EXPERT_WIDTH:
            continue
        has = (f"one, {_SHARED_EXPERT_WIDTH} wide, and reads no other count of them" if shared else
               "none (the spec's one shared expert, moe.shared_expert_d_ff, is Qwen2-MoE's and Qwen3-Next's)")
        _refuse_if(hf, name, bool, f"experts every token goes through besides the k the router chooses: {model} has "
                   + has)
    shared_width = 0
    if shared:
        shared_width = _require(hf, _SHARED_EXPERT_WIDTH, family)
        if isinstance(shared_width, bool) or not isinstance(shared_width, int) or shared_width < 1:
            raise ConfigError(f"{_SHARED_EXPERT_WIDTH} = {json.dumps(shared_width)}: {model} builds a shared expert "
                              "of this width and its gate in every mixture; the spec's shared expert is at least 1 "
                              "wide (moe.shared_expert_d_ff 0 is none, with no gate)")
    counts = {name: hf[name] for name in _EXPERT_COUNT_FIELDS if hf.get(name) is not None}
    if len(set(map(json.dumps, counts.values()))) > 1:
        raise ConfigError(" and ".join(f"{name} = {json.dumps(value)}" for name, value in counts.items())
                          + f": two numbers of experts; {model} reads one as the other")
    if not counts:
        raise ConfigError(f"config.json of this {family} model has no {' (nor '.join(_EXPERT_COUNT_FIELDS)})")
    name, experts = next(iter(counts.items()))
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 2:
        raise ConfigError(f"{name} = {json.dumps(experts)}: the spec's mixture has at least 2 experts in every layer "
                          "(one expert, or none, is a dense FFN: a family without experts)")
    k = _require(hf, "num_experts_per_tok", family)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise ConfigError(f"num_experts_per_tok = {json.dumps(k)}: each token chooses 1 to {name} ({experts}) experts")
    load_balancing = 0.0
    if hf.get("output_router_logits"):
        load_balancing = hf.get("router_aux_loss_coef", 0.001)
        if isinstance(load_balancing, bool) or not isinstance(load_balancing, (int, float)) \
                or not math.isfinite(load_balancing) or load_balancing < 0:
            raise ConfigError(f"router_aux_loss_coef = {json.dumps(load_balancing)}: the load-balancing loss's weight "
                              "is a finite number >= 0")
        notes.append(f"output_router_logits = true: transformers adds router_aux_loss_coef ({load_balancing}) times "
                     "its load-balancing loss to the training loss, and so does the import (moe.load_balancing; "
                     "SPEC §5.14); no logit changes")
    elif hf.get("router_aux_loss_coef"):
        notes.append(f"router_aux_loss_coef = {hf['router_aux_loss_coef']} with output_router_logits false: "
                     "transformers adds no load-balancing loss then, nor does the import (moe.load_balancing 0)")
    if hf.get("router_jitter_noise"):
        notes.append(f"router_jitter_noise = {hf['router_jitter_noise']} multiplies the experts' input by noise in "
                     "training only; evaluation is unaffected and the import has none")
    return MixtureOfExperts(n_experts=experts, experts_per_token=k, renormalize=renormalize, router_softmax="float32",
                            load_balancing=float(load_balancing), shared_expert_d_ff=shared_width)


def _mixtral_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Mistral's layer (no biases, a window of sliding_window keys in every layer where set;
    MixtralConfig's default is none) whose FFN is num_local_experts gated experts of width
    intermediate_size, num_experts_per_tok per token, their weights always renormalised."""
    moe = _mixture(hf, "mixtral", notes, renormalize=True)
    kv_heads = hf.get("num_key_value_heads") or _require(hf, "num_attention_heads", "mixtral")
    return _rotary_decoder(hf, "mixtral", notes, head_dim=_head_dim(hf, "mixtral"), kv_heads=kv_heads,
                           qkv_bias=False, bias=False, sliding_window=_sliding_window(hf, None), moe=moe)


_QWEN3_MOE_WINDOW = 4096  # Qwen3MoeConfig's sliding_window where use_sliding_window is true and the file has none


def _qwen3_moe_window(hf: Mapping[str, Any]) -> int | None:
    """Qwen3MoeForCausalLM (transformers 5) attends to a window of sliding_window keys in every
    layer when use_sliding_window is true. Qwen2's per-layer fields in such a file (a
    max_window_layers past 0, layer_types with full layers) describe another model: refused."""
    if not hf.get("use_sliding_window"):
        return None
    layers = _require(hf, "num_hidden_layers", "qwen3_moe")
    _refuse_if(hf, "max_window_layers", lambda first: bool(first) and first < layers, "with use_sliding_window, "
               "Qwen2's rule slides only the layers from max_window_layers on, but Qwen3MoeForCausalLM slides every "
               "layer: the file and the class disagree on the function")
    _refuse_if(hf, "layer_types", lambda kinds: isinstance(kinds, list) and "full_attention" in kinds,
               "full layers among sliding ones, but Qwen3MoeForCausalLM slides every layer when use_sliding_window "
               "is true (it does not read layer_types)")
    return _sliding_window(hf, _QWEN3_MOE_WINDOW)


def _qwen3_moe_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Qwen3's layer (q/k head norms, no biases) whose FFN is num_experts gated experts of width
    moe_intermediate_size, num_experts_per_tok per token, renormalised where norm_topk_prob is true
    (Qwen3MoeConfig's default: false). Every layer must be a mixture: dense layers among them
    (mlp_only_layers, decoder_sparse_step) are not in the spec."""
    _refuse_if(hf, "attention_bias", bool, "Qwen3-MoE then has biases on q, k, v and o_proj; the spec's bias field "
               "gives o_proj its bias with the FFN's, and the mixture's experts have none")
    _refuse_if(hf, "mlp_only_layers", bool, "these layers' FFN is one dense MLP of intermediate_size and the others' a "
               "mixture of experts; the spec's mixture is in every layer or in none (SPEC §5.14)")
    _refuse_if(hf, "decoder_sparse_step", lambda step: step != 1, "only every decoder_sparse_step-th layer is then a "
               "mixture of experts and the others dense MLPs; the spec's mixture is in every layer or in none "
               "(SPEC §5.14)")
    moe = _mixture(hf, "qwen3_moe", notes, renormalize=bool(hf.get("norm_topk_prob", False)))
    return _rotary_decoder(hf, "qwen3_moe", notes, head_dim=_head_dim(hf, "qwen3_moe"),
                           kv_heads=_require(hf, "num_key_value_heads", "qwen3_moe"),
                           d_ff_field="moe_intermediate_size", qkv_bias=False, bias=False, qk_norm=True,
                           sliding_window=_qwen3_moe_window(hf), moe=moe)


def _qwen2_moe_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Qwen2's layer whose every FFN is a mixture of num_experts gated experts of width
    moe_intermediate_size, num_experts_per_tok per token, renormalised where norm_topk_prob is true
    (Qwen2MoeConfig's default: false), its softmax in float32 as the class takes it, beside a shared
    expert of width shared_expert_intermediate_size under its sigmoid gate (SPEC §5.14). q, k and v
    have biases where qkv_bias is true (its default), o_proj none. With use_sliding_window, the class
    slides layer i where i is even and below max_window_layers (its default 28); layer_types, where
    the file writes them, say so. Dense layers among the mixtures (mlp_only_layers,
    decoder_sparse_step) are refused."""
    family = "qwen2_moe"
    _every_layer_a_mixture(hf, family)
    moe = _mixture(hf, family, notes, renormalize=bool(hf.get("norm_topk_prob", False)), shared=True)
    window = _sliding_window(hf, None) if hf.get("use_sliding_window") else None
    below = hf.get("max_window_layers", 28)
    kinds = _layer_kinds(hf, family, window, lambda i: window is not None and i % 2 == 0 and i < below)
    return _rotary_decoder(hf, family, notes, head_dim=_head_dim(hf, family),
                           kv_heads=_require(hf, "num_key_value_heads", family), d_ff_field="moe_intermediate_size",
                           qkv_bias=bool(hf.get("qkv_bias", True)), bias=False, moe=moe, **kinds)


# GptOssConfig's defaults where config.json has no such key
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_GPT_OSS_DEFAULTS = {"rms_norm_eps": 1e-5, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                     "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def _gpt_oss_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """gpt-oss (SPEC §5.16): Llama's layer with biases on q, k, v and o and a sink per head; layers
    sliding (a window of sliding_window keys) and full as layer_types says, else alternating from a
    sliding one; in every layer a mixture of num_local_experts experts with biases, their clamped
    SwiGLU (swiglu_limit, swiglu_alpha), num_experts_per_tok per token weighed by a softmax over their
    logits alone (renormalised) in the logits' dtype, the router's logits with a bias. Where the file
    has no rope_parameters, GptOssConfig's YaRN (factor 32 over 4096, untruncated) and θ 150000."""
    family = "gpt_oss"
    _refuse_if(hf, "attention_bias", lambda value: value is False, "q, k, v and o without biases while the experts "
               "keep theirs: the spec's bias field gives o and the FFN their biases together")
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method != "mxfp4":
            raise ConfigError(f"quantization_config.quant_method = {json.dumps(method)}: the importer reads gpt-oss's "
                              "experts as stored, or as MXFP4 (the published files' form, dequantized exactly)")
        notes.append("quantization_config.quant_method = mxfp4: the experts' MXFP4 blocks are dequantized, the "
                     "weights the file stores; the spec's computation on them is float (no FP4 arithmetic)")
    hf = {**_GPT_OSS_DEFAULTS, **hf}
    if not any(hf.get(name) for name in ("rope_scaling", "rope_parameters")):
        hf["rope_parameters"] = _GPT_OSS_ROPE
    if hf.get("hidden_act", "silu") != "silu":
        notes.append(f"hidden_act = {json.dumps(hf['hidden_act'])} is not applied by GptOssForCausalLM: its experts' "
                     "unit is the clamped SwiGLU whatever it says, and so is the import's")
    moe = _mixture(hf, family, notes, renormalize=True)
    moe = dataclasses.replace(moe, router_softmax="activation", router_bias=True)
    window = _sliding_window(hf, None)
    kinds = _layer_kinds(hf, family, window, lambda i: i % 2 == 0)
    clamp = {name: hf[name] for name in ("swiglu_limit", "swiglu_alpha")}
    for name, value in clamp.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{name} = {json.dumps(value)}: the clamped SwiGLU's limit and gain are positive numbers")
    kv_heads = hf["num_key_value_heads"] or _require(hf, "num_attention_heads", family)
    return _rotary_decoder({**hf, "hidden_act": "silu"}, family, notes, head_dim=_head_dim(hf, family),
                           kv_heads=kv_heads, qkv_bias=True, bias=True, moe=moe, attention_sinks=True,
                           **{name: float(value) for name, value in clamp.items()}, **kinds)


# ---- hybrids: Qwen3.5, Qwen3-Next ------------------------------------------------------------------

_HF_HYBRID_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
# GatedDeltaNet's field <- Qwen3_5TextConfig's (and Qwen3NextConfig's), with the classes' default
_QWEN3_5_LINEAR = {
    "key_heads": ("linear_num_key_heads", 16), "value_heads": ("linear_num_value_heads", 32),
    "key_head_dim": ("linear_key_head_dim", 128), "value_head_dim": ("linear_value_head_dim", 128),
    "conv_kernel": ("linear_conv_kernel_dim", 4)}


_HYBRID_NAMES = {"qwen3_5_text": "Qwen3.5", "qwen3_next": "Qwen3-Next"}


def _hybrid_config(hf: Mapping[str, Any], notes: list[str], family: str) -> ModelConfig:
    """The layers Qwen3.5 and Qwen3-Next share (SPEC §5.15): gated DeltaNet in the "linear_attention"
    layers of layer_types (else three of every full_attention_interval = 4 layers, the fourth full),
    gated full attention with q/k norms and a partial rotary in the others, (1 + w) RMSNorms but for
    the DeltaNet's gated norm, no biases; a dense FFN of intermediate_size (Qwen3-Next's mixture
    replaces it). The chunked prefill's chunk is the kernels' 64 (the file has none; any chunk
    computes the same sums)."""
    model = _HYBRID_NAMES[family]
    _refuse_if(hf, "attention_bias", bool, f"then q, k, v and o carry biases; {model}'s have none, nor has the "
               f"spec's {model} layout")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act = {json.dumps(hf['hidden_act'])}: {model}'s DeltaNet convolution takes SiLU "
                          "whatever the MLP's activation, and the spec's linear layers share the model's one")
    layers = _require(hf, "num_hidden_layers", family)
    written = hf.get("layer_types")
    if written is None:
        interval = hf.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"full_attention_interval = {json.dumps(interval)}: every how many layers one is full "
                              "attention, a positive integer")
        written = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(written, list) or len(written) != layers or any(kind not in _HF_HYBRID_LAYER_TYPES
                                                                      for kind in written):
        raise ConfigError(f"layer_types = {json.dumps(written)}: expected {layers} entries, each "
                          f"{' or '.join(map(json.dumps, _HF_HYBRID_LAYER_TYPES))}")
    mixer = GatedDeltaNet(**{field: hf.get(name, default) for field, (name, default) in _QWEN3_5_LINEAR.items()})
    notes.append(f"the linear layers' chunked prefill takes chunks of {mixer.chunk_size} tokens (the kernels'; "
                 "any chunk computes the same sums, SPEC §5.15)")
    cfg = _rotary_decoder(hf, family, notes, head_dim=_head_dim(hf, family, 256),
                          kv_heads=_require(hf, "num_key_value_heads", family), qkv_bias=False, bias=False,
                          qk_norm=True)
    return cfg.replace(norm_scale_plus_one=True, layer_types=tuple(_HF_HYBRID_LAYER_TYPES[kind] for kind in written),
                       linear_attention=mixer, attention_output_gate=True)


def _qwen3_5_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Qwen3.5's text decoder: the hybrid layers (_hybrid_config), each FFN one gated MLP."""
    return _hybrid_config(hf, notes, "qwen3_5_text")


def _qwen3_5_published_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """The published Qwen3.5 checkpoints (Qwen3_5ForConditionalGeneration): a vision tower beside
    the text decoder of text_config, whose logits on text alone are that decoder's. The decoder is
    imported, the tower left out (a note says how many tensors); the head is tied as the top-level
    tie_word_embeddings says, which the class reads."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"text_config = {json.dumps(text)}: a qwen3_5 config.json holds its text decoder's config "
                          "there (a JSON object)")
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return _qwen3_5_config({**text, "tie_word_embeddings": tied}, notes)


def _every_layer_a_mixture(hf: Mapping[str, Any], family: str) -> None:
    """Qwen3NextForCausalLM's and Qwen2MoeForCausalLM's layer i is a mixture iff i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0, else one dense MLP of intermediate_size; the
    spec's mixture is in every layer or in none, so a config with a dense layer is refused, naming the
    field that makes it so."""
    layers = _require(hf, "num_hidden_layers", family)
    listed = hf.get("mlp_only_layers") or []
    if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in listed):
        raise ConfigError(f"mlp_only_layers = {json.dumps(listed)}: expected a list of layer indices")
    step = hf.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step = {json.dumps(step)}: every how many layers one is a mixture of "
                          "experts, a positive integer")
    why = ("and the others' a mixture of experts; the spec's mixture is in every layer or in none (SPEC §5.14)")
    if dense := sorted({i for i in listed if 0 <= i < layers}):
        raise ConfigError(f"mlp_only_layers = {json.dumps(listed)}: the FFN of layer(s) {dense} is then one dense MLP "
                          f"of intermediate_size {why}")
    if dense := [i for i in range(layers) if (i + 1) % step]:
        raise ConfigError(f"decoder_sparse_step = {step}: only every decoder_sparse_step-th layer is then a mixture "
                          f"of experts; the FFN of layer(s) {dense} is one dense MLP of intermediate_size {why}")


def _qwen3_next_config(hf: Mapping[str, Any], notes: list[str]) -> ModelConfig:
    """Qwen3-Next: Qwen3.5's hybrid layers (_hybrid_config) whose every FFN is a mixture of
    num_experts gated experts of width moe_intermediate_size (the spec's d_ff), num_experts_per_tok
    per token, renormalised where norm_topk_prob is true (Qwen3NextConfig's default: true), its
    softmax in float32 as the class takes it, beside a shared expert of width
    shared_expert_intermediate_size (moe.shared_expert_d_ff) under its sigmoid gate (SPEC §5.14).
    Dense layers among the mixtures (mlp_only_layers, decoder_sparse_step) are refused; num_experts
    0 makes every layer's FFN one dense MLP of intermediate_size, Qwen3.5's FFN, and imports so."""
    family = "qwen3_next"
    cfg = _hybrid_config(hf, notes, family)
    if hf.get("num_experts") == 0:
        notes.append(f"num_experts = 0: every layer's FFN is one dense gated MLP of intermediate_size "
                     f"({cfg.d_ff}), as Qwen3.5's; no mixture of experts")
        return cfg
    _every_layer_a_mixture(hf, family)
    moe = _mixture(hf, family, notes, renormalize=bool(hf.get("norm_topk_prob", True)), shared=True)
    return cfg.replace(d_ff=_require(hf, "moe_intermediate_size", family), moe=moe)


# ---- the mappings ------------------------------------------------------------------------------

def _linear(rules: list[Rule], source: str, target: str, n_in: int, n_out: int, bias: bool = True) -> None:
    """An nn.Linear: weight [out, in] transposed, its bias (if it has one) copied."""
    rules.append(Rule(f"{source}.weight", (n_out, n_in), f"{target}.weight", "transpose"))
    if bias:
        rules.append(Rule(f"{source}.bias", (n_out,), f"{target}.bias", "copy"))


def _fused_linear(rules: list[Rule], source: str, targets: Mapping[str, int], n_in: int) -> None:
    """An nn.Linear without bias whose outputs are several of the spec's projections one after
    another (Phi-3's qkv_proj, gate_up_proj): each target's block of rows, transposed."""
    start, n_out = 0, sum(targets.values())
    for target, width in targets.items():
        rules.append(Rule(f"{source}.weight", (n_out, n_in), f"{target}.weight", f"transpose rows {start}:{start + width}"))
        start += width


def _layer_norm(rules: list[Rule], source: str, target: str, d: int) -> None:
    rules.append(Rule(f"{source}.weight", (d,), f"{target}.scale", "copy"))
    rules.append(Rule(f"{source}.bias", (d,), f"{target}.bias", "copy"))


def gpt2_mapping(cfg: ModelConfig, prefix: str = "transformer.") -> list[Rule]:
    """GPT2LMHeadModel -> canonical. ``prefix`` is "" for checkpoints saved from GPT2Model (the
    original openai-community/gpt2 file)."""
    d, d_ff, rules = cfg.d_model, cfg.d_ff, []
    rules.append(Rule(f"{prefix}wte.weight", (cfg.tgt_vocab_size, d), "tgt_embed.weight", "copy"))
    rules.append(Rule(f"{prefix}wpe.weight", (cfg.max_len, d), "tgt_pos.weight", "copy"))
    for i in range(cfg.n_decoder_layers):
        hf, ours = f"{prefix}h.{i}", f"decoder.layers.{i}"
        _layer_norm(rules, f"{hf}.ln_1", f"{ours}.self_attn_norm", d)
        # Conv1D stores [in, out] already; c_attn's columns are q | k | v
        for block, projection in enumerate("qkv"):
            columns = f"columns {block * d}:{(block + 1) * d}"
            rules.append(Rule(f"{hf}.attn.c_attn.weight", (d, 3 * d), f"{ours}.self_attn.{projection}.weight", columns))
        for block, projection in enumerate("qkv"):
            rules.append(Rule(f"{hf}.attn.c_attn.bias", (3 * d,), f"{ours}.self_attn.{projection}.bias",
                              f"slice {block * d}:{(block + 1) * d}"))
        rules.append(Rule(f"{hf}.attn.c_proj.weight", (d, d), f"{ours}.self_attn.o.weight", "copy"))
        rules.append(Rule(f"{hf}.attn.c_proj.bias", (d,), f"{ours}.self_attn.o.bias", "copy"))
        _layer_norm(rules, f"{hf}.ln_2", f"{ours}.ffn_norm", d)
        rules.append(Rule(f"{hf}.mlp.c_fc.weight", (d, d_ff), f"{ours}.ffn.w1.weight", "copy"))
        rules.append(Rule(f"{hf}.mlp.c_fc.bias", (d_ff,), f"{ours}.ffn.w1.bias", "copy"))
        rules.append(Rule(f"{hf}.mlp.c_proj.weight", (d_ff, d), f"{ours}.ffn.w2.weight", "copy"))
        rules.append(Rule(f"{hf}.mlp.c_proj.bias", (d,), f"{ours}.ffn.w2.bias", "copy"))
    _layer_norm(rules, f"{prefix}ln_f", "decoder.norm", d)
    if not cfg.tie_head:
        rules.append(Rule("lm_head.weight", (cfg.tgt_vocab_size, d), "head.weight", "transpose"))
    return rules


_SEQ2SEQ_ATTENTION = {"self_attn": "self_attn", "encoder_attn": "cross_attn"}
_SEQ2SEQ_NORMS = {"self_attn_layer_norm": "self_attn_norm", "encoder_attn_layer_norm": "cross_attn_norm",
                  "final_layer_norm": "ffn_norm"}


def seq2seq_mapping(cfg: ModelConfig, family: str) -> list[Rule]:
    """MarianMTModel or BartForConditionalGeneration -> canonical (they share the layer names)."""
    d, d_ff, rules = cfg.d_model, cfg.d_ff, []
    if cfg.share_src_tgt_embed:
        rules.append(Rule("model.shared.weight", (cfg.tgt_vocab_size, d), "tgt_embed.weight", "copy"))
    else:
        rules.append(Rule("model.encoder.embed_tokens.weight", (cfg.src_vocab_size, d), "src_embed.weight", "copy"))
        rules.append(Rule("model.decoder.embed_tokens.weight", (cfg.tgt_vocab_size, d), "tgt_embed.weight", "copy"))
    if family == "bart":
        for stack, side in (("encoder", "src"), ("decoder", "tgt")):
            rules.append(Rule(f"model.{stack}.embed_positions.weight", (cfg.max_len + 2, d), f"{side}_pos.weight",
                              "rows 2:"))
            _layer_norm(rules, f"model.{stack}.layernorm_embedding", f"{stack}.embed_norm", d)
    for stack, count in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(count):
            hf, ours = f"model.{stack}.layers.{i}", f"{stack}.layers.{i}"
            for theirs, attention in _SEQ2SEQ_ATTENTION.items():
                if stack == "encoder" and theirs == "encoder_attn":
                    continue
                for projection, canonical in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
                    _linear(rules, f"{hf}.{theirs}.{projection}", f"{ours}.{attention}.{canonical}", d, d)
            for theirs, norm in _SEQ2SEQ_NORMS.items():
                if stack == "encoder" and theirs == "encoder_attn_layer_norm":
                    continue
                _layer_norm(rules, f"{hf}.{theirs}", f"{ours}.{norm}", d)
            _linear(rules, f"{hf}.fc1", f"{ours}.ffn.w1", d, d_ff)
            _linear(rules, f"{hf}.fc2", f"{ours}.ffn.w2", d_ff, d)
    if not cfg.tie_head:
        rules.append(Rule("lm_head.weight", (cfg.tgt_vocab_size, d), "head.weight", "transpose"))
    if cfg.head_bias:
        rules.append(Rule("final_logits_bias", (1, cfg.tgt_vocab_size), "head.bias", "row 0"))
    return rules


_MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "qwen3_next")
_ROTARY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", *_GEMMA_FAMILIES, *_MOE_FAMILIES, "qwen3_5_text",
                    "qwen3_5", "smollm3", "olmo2", "gpt_oss")
_LLAMA_MLP = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))  # gate_proj is the activated one


def llama_mapping(cfg: ModelConfig, fused: bool = False, experts: str | None = None) -> list[Rule]:
    """LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or MistralForCausalLM -> canonical
    (the Qwen and Mistral classes kept Llama's names). q/k/v/o biases where the config has them
    (Qwen2: q, k and v), Qwen3's per-head q_norm and k_norm [d_k]. q and k are taken as stored: transformers' checkpoints are already in
    the rotate_half layout the spec rotates (its converter permuted Meta's interleaved originals),
    so no permutation happens here. k and v are [H_kv·d_k, d]: grouped-query attention.
    ``fused`` (Phi-3): q, k and v are the row blocks of one qkv_proj, gate and up of one gate_up_proj.
    ``experts`` (a mixture of experts, cfg.moe): the layout of each layer's router and experts, a
    family's own names or "fused" (see _expert_rules)."""
    d, d_ff, d_k, rules = cfg.d_model, cfg.d_ff, cfg.d_head, []
    widths = {"q": cfg.n_heads * d_k, "k": cfg.kv_heads * d_k, "v": cfg.kv_heads * d_k}
    rules.append(Rule("model.embed_tokens.weight", (cfg.tgt_vocab_size, d), "tgt_embed.weight", "copy"))
    for i in range(cfg.n_decoder_layers):
        hf, ours = f"model.layers.{i}", f"decoder.layers.{i}"
        if cfg.norm_position != "output":  # OLMo 2's layer has no norm before a sublayer, only after
            rules.append(Rule(f"{hf}.input_layernorm.weight", (d,), f"{ours}.self_attn_norm.scale", "copy"))
        if fused:
            _fused_linear(rules, f"{hf}.self_attn.qkv_proj",
                          {f"{ours}.self_attn.{projection}": width for projection, width in widths.items()}, d)
        else:
            for projection, width in widths.items():
                _linear(rules, f"{hf}.self_attn.{projection}_proj", f"{ours}.self_attn.{projection}", d, width,
                        cfg.qkv_bias)
        _linear(rules, f"{hf}.self_attn.o_proj", f"{ours}.self_attn.o", widths["q"], d, cfg.bias)
        if cfg.attention_sinks:  # gpt-oss: one logit per head in the softmax's denominator
            rules.append(Rule(f"{hf}.self_attn.sinks", (cfg.n_heads,), f"{ours}.self_attn.sinks", "copy"))
        if cfg.qk_norm:  # OLMo 2's over the whole projection, Qwen3's over a head
            for projection in "qk":
                width = widths[projection] if cfg.qk_norm_scope == "projection" else d_k
                rules.append(Rule(f"{hf}.self_attn.{projection}_norm.weight", (width,),
                                  f"{ours}.self_attn.{projection}_norm.scale", "copy"))
        if cfg.norm_position == "output":  # OLMo 2: post_attention_layernorm norms the attention's output
            for theirs, norm in (("post_attention_layernorm", "self_attn_norm"),
                                 ("post_feedforward_layernorm", "ffn_norm")):
                rules.append(Rule(f"{hf}.{theirs}.weight", (d,), f"{ours}.{norm}.scale", "copy"))
        elif cfg.post_norms:  # Gemma: post_attention_layernorm is the attention's post norm, not the FFN's
            for theirs, norm in (("post_attention_layernorm", "self_attn_post_norm"),
                                 ("pre_feedforward_layernorm", "ffn_norm"),
                                 ("post_feedforward_layernorm", "ffn_post_norm")):
                rules.append(Rule(f"{hf}.{theirs}.weight", (d,), f"{ours}.{norm}.scale", "copy"))
        else:
            rules.append(Rule(f"{hf}.post_attention_layernorm.weight", (d,), f"{ours}.ffn_norm.scale", "copy"))
        if cfg.moe is not None:  # with Qwen2-MoE's shared expert (_expert_rules)
            _expert_rules(rules, hf, f"{ours}.ffn", cfg, experts)
            continue
        if fused:  # Phi3MLP chunks gate_up_proj's outputs in two and activates the first half
            _fused_linear(rules, f"{hf}.mlp.gate_up_proj", {f"{ours}.ffn.w1": d_ff, f"{ours}.ffn.w3": d_ff}, d)
        for projection, canonical in _LLAMA_MLP[2:] if fused else _LLAMA_MLP:
            n_in, n_out = (d_ff, d) if canonical == "w2" else (d, d_ff)
            _linear(rules, f"{hf}.mlp.{projection}", f"{ours}.ffn.{canonical}", n_in, n_out, cfg.bias)
    rules.append(Rule("model.norm.weight", (d,), "decoder.norm.scale", "copy"))
    if not cfg.tie_head:
        rules.append(Rule("lm_head.weight", (cfg.tgt_vocab_size, d), "head.weight", "transpose"))
    return rules


def qwen3_5_mapping(cfg: ModelConfig, prefix: str = "model.") -> list[Rule]:
    """Qwen3_5ForCausalLM -> canonical. A linear layer's in_proj_qkv [2·H_k·d_k + H_v·d_v, d] holds
    q, k, then v (split by rows, transposed), its conv1d [same, 1, K] their depthwise kernels
    (split by channels), in_proj_z the gate of its output norm, in_proj_b β's, in_proj_a, dt_bias
    and A_log the decay's weight, bias and log-rate. A full layer's q_proj [H·2·d_k, d] holds each
    head's query rows and then its output gate's (each taken head by head), its q_norm and k_norm
    [d_k]. input_layernorm is the layer's first norm, whichever mixer follows it. ``prefix``: the
    decoder's, "model.language_model." in the published Qwen3_5ForConditionalGeneration files."""
    d, d_ff, mixer, rules = cfg.d_model, cfg.d_ff, cfg.linear_attention, []
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    rules.append(Rule(f"{prefix}embed_tokens.weight", (cfg.tgt_vocab_size, d), "tgt_embed.weight", "copy"))
    for i, kind in enumerate(cfg.layer_types):
        hf, ours = f"{prefix}layers.{i}", f"decoder.layers.{i}"
        if kind == "linear":
            rules.append(Rule(f"{hf}.input_layernorm.weight", (d,), f"{ours}.linear_attn_norm.scale", "copy"))
            attention, start = f"{ours}.linear_attn", 0
            for projection, width in (("q", keys), ("k", keys), ("v", values)):
                rules.append(Rule(f"{hf}.linear_attn.in_proj_qkv.weight", (2 * keys + values, d),
                                  f"{attention}.{projection}.weight", f"transpose rows {start}:{start + width}"))
                rules.append(Rule(f"{hf}.linear_attn.conv1d.weight", (2 * keys + values, 1, mixer.conv_kernel),
                                  f"{attention}.{projection}_conv.weight", f"channels {start}:{start + width}"))
                start += width
            _linear(rules, f"{hf}.linear_attn.in_proj_z", f"{attention}.z", d, values, bias=False)
            _linear(rules, f"{hf}.linear_attn.in_proj_b", f"{attention}.beta", d, mixer.value_heads, bias=False)
            _linear(rules, f"{hf}.linear_attn.in_proj_a", f"{attention}.decay", d, mixer.value_heads, bias=False)
            _delta_net_decay_norm_out(rules, f"{hf}.linear_attn", attention, cfg)
        else:
            rules.append(Rule(f"{hf}.input_layernorm.weight", (d,), f"{ours}.self_attn_norm.scale", "copy"))
            _gated_attention(rules, f"{hf}.self_attn", f"{ours}.self_attn", cfg)
        rules.append(Rule(f"{hf}.post_attention_layernorm.weight", (d,), f"{ours}.ffn_norm.scale", "copy"))
        _dense_mlp(rules, f"{hf}.mlp", f"{ours}.ffn", d, d_ff)
    rules.append(Rule(f"{prefix}norm.weight", (d,), "decoder.norm.scale", "copy"))
    if not cfg.tie_head:
        rules.append(Rule("lm_head.weight", (cfg.tgt_vocab_size, d), "head.weight", "transpose"))
    return rules


def _delta_net_decay_norm_out(rules: list[Rule], source: str, target: str, cfg: ModelConfig) -> None:
    """What Qwen3.5's and Qwen3-Next's linear layers store alike after their projections: dt_bias and
    A_log [H_v] (the decay's bias and log-rate), the gated norm's weight [d_v], out_proj."""
    mixer = cfg.linear_attention
    rules.append(Rule(f"{source}.dt_bias", (mixer.value_heads,), f"{target}.decay.bias", "copy"))
    rules.append(Rule(f"{source}.A_log", (mixer.value_heads,), f"{target}.decay.log_rate", "copy"))
    rules.append(Rule(f"{source}.norm.weight", (mixer.value_head_dim,), f"{target}.norm.scale", "copy"))
    _linear(rules, f"{source}.out_proj", f"{target}.o", mixer.value_heads * mixer.value_head_dim, cfg.d_model,
            bias=False)


def _gated_attention(rules: list[Rule], source: str, target: str, cfg: ModelConfig) -> None:
    """Qwen3.5's and Qwen3-Next's full attention: q_proj [H·2·d_k, d] holds each head's query rows and
    then its output gate's (each taken head by head), k_proj, v_proj, o_proj, q_norm and k_norm [d_k]."""
    d, d_k = cfg.d_model, cfg.d_head
    for half, projection in enumerate(("q", "gate")):
        rules.append(Rule(f"{source}.q_proj.weight", (2 * cfg.n_heads * d_k, d), f"{target}.{projection}.weight",
                          f"transpose head half {half} of {d_k}"))
    for projection in "kv":
        _linear(rules, f"{source}.{projection}_proj", f"{target}.{projection}", d, cfg.kv_heads * d_k, bias=False)
    _linear(rules, f"{source}.o_proj", f"{target}.o", cfg.n_heads * d_k, d, bias=False)
    for projection in "qk":
        rules.append(Rule(f"{source}.{projection}_norm.weight", (d_k,), f"{target}.{projection}_norm.scale", "copy"))


def _dense_mlp(rules: list[Rule], source: str, target: str, d: int, d_ff: int) -> None:
    """A gated MLP without biases, Llama's names: gate_proj (W1, the activated one), up_proj (W3), down_proj (W2)."""
    for projection, canonical in _LLAMA_MLP:
        n_in, n_out = (d_ff, d) if canonical == "w2" else (d, d_ff)
        _linear(rules, f"{source}.{projection}", f"{target}.{canonical}", n_in, n_out, bias=False)


_QWEN3_NEXT_QKVZ = ("q", "k", "v", "z")  # each key head's blocks of in_proj_qkvz, in order
_QWEN3_NEXT_BA = ("beta", "decay")  # each key head's blocks of in_proj_ba: its r b's (β), then its r a's (the decay)


def qwen3_next_mapping(cfg: ModelConfig, experts: str | None = "qwen3_next") -> list[Rule]:
    """Qwen3NextForCausalLM -> canonical. A linear layer's in_proj_qkvz [H_k·(2·d_k + 2·r·d_v), d]
    (r = H_v / H_k) is grouped by key head: key head h's query (d_k rows), its key (d_k), the values of
    its r value heads h·r … h·r + r − 1 (r·d_v) and their output-norm gates z (r·d_v), then head h + 1's
    (fix_query_key_value_ordering); in_proj_ba [H_k·2·r, d] likewise, each key head's r rows of b (β)
    then its r of a (the decay's input). Each canonical projection is its block of every group,
    transposed ("transpose group rows"). conv1d [2·H_k·d_k + H_v·d_v, 1, K] holds q, k and v one
    after another (the class concatenates them after regrouping) as Qwen3.5's, and dt_bias, A_log,
    the gated norm, out_proj and the full layers are Qwen3.5's. Each FFN (cfg.moe): the router
    mlp.gate, the experts in ``experts``' layout, then the shared expert mlp.shared_expert.{gate,up,down}_proj
    (W1, W3, W2, shared_expert_d_ff wide) and its gate mlp.shared_expert_gate [1, d] -> [d, 1]
    (_expert_rules); without cfg.moe (num_experts 0), one dense mlp."""
    d, mixer, rules = cfg.d_model, cfg.linear_attention, []
    d_k, d_v, r = mixer.key_head_dim, mixer.value_head_dim, mixer.value_heads // mixer.key_heads
    keys, values = mixer.key_heads * d_k, mixer.value_heads * d_v
    widths = {"q": d_k, "k": d_k, "v": r * d_v, "z": r * d_v}  # one key head's group of in_proj_qkvz
    group = sum(widths.values())
    rules.append(Rule("model.embed_tokens.weight", (cfg.tgt_vocab_size, d), "tgt_embed.weight", "copy"))
    for i, kind in enumerate(cfg.layer_types):
        hf, ours = f"model.layers.{i}", f"decoder.layers.{i}"
        if kind == "linear":
            rules.append(Rule(f"{hf}.input_layernorm.weight", (d,), f"{ours}.linear_attn_norm.scale", "copy"))
            attention, start = f"{ours}.linear_attn", 0
            for projection in _QWEN3_NEXT_QKVZ:
                rules.append(Rule(f"{hf}.linear_attn.in_proj_qkvz.weight", (mixer.key_heads * group, d),
                                  f"{attention}.{projection}.weight",
                                  f"transpose group rows {start}:{start + widths[projection]} of {group}"))
                start += widths[projection]
            start = 0
            for projection, width in (("q", keys), ("k", keys), ("v", values)):
                rules.append(Rule(f"{hf}.linear_attn.conv1d.weight", (2 * keys + values, 1, mixer.conv_kernel),
                                  f"{attention}.{projection}_conv.weight", f"channels {start}:{start + width}"))
                start += width
            for block, projection in enumerate(_QWEN3_NEXT_BA):
                rules.append(Rule(f"{hf}.linear_attn.in_proj_ba.weight", (mixer.key_heads * 2 * r, d),
                                  f"{attention}.{projection}.weight",
                                  f"transpose group rows {block * r}:{(block + 1) * r} of {2 * r}"))
            _delta_net_decay_norm_out(rules, f"{hf}.linear_attn", attention, cfg)
        else:
            rules.append(Rule(f"{hf}.input_layernorm.weight", (d,), f"{ours}.self_attn_norm.scale", "copy"))
            _gated_attention(rules, f"{hf}.self_attn", f"{ours}.self_attn", cfg)
        rules.append(Rule(f"{hf}.post_attention_layernorm.weight", (d,), f"{ours}.ffn_norm.scale", "copy"))
        if cfg.moe is None:
            _dense_mlp(rules, f"{hf}.mlp", f"{ours}.ffn", d, cfg.d_ff)
            continue
        _expert_rules(rules, hf, f"{ours}.ffn", cfg, experts)
    rules.append(Rule("model.norm.weight", (d,), "decoder.norm.scale", "copy"))
    if not cfg.tie_head:
        rules.append(Rule("lm_head.weight", (cfg.tgt_vocab_size, d), "head.weight", "transpose"))
    return rules


_QWEN3_5_DECODER = "model.language_model."  # the published files' text decoder


def _decoder_prefix(family: str) -> str:
    """Where a rotary family's decoder tensors live: under model., or the published Qwen3.5's text decoder."""
    return _QWEN3_5_DECODER if family == "qwen3_5" else "model."


def phi3_mapping(cfg: ModelConfig) -> list[Rule]:
    """Phi3ForCausalLM -> canonical: Llama's names but for two fused projections, split by rows
    (nn.Linear's outputs) before the transpose. qkv_proj [H·d_k + 2·H_kv·d_k, d] holds q, then k,
    then v; gate_up_proj [2·d_ff, d] holds the activated gate (W1), then up (W3)."""
    return llama_mapping(cfg, fused=True)


# Each family's names for a layer's mixture, one nn.Linear per expert and projection: the block, then
# each expert's gate (W1, the activated one), up (W3) and down (W2). The router is the block's "gate".
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                 "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                 "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                 "qwen3_next": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
FUSED_EXPERTS = "fused"
GPT_OSS_EXPERTS = "gpt_oss"  # transformers' GptOssExperts: fused, [in, out], gate and up interleaved, with biases


def _expert_rules(rules: list[Rule], source: str, target: str, cfg: ModelConfig, layout: str | None) -> None:
    """A layer's router, gate.weight [E, d] transposed to the spec's [d, E], and its E experts.
    layout: a family of _EXPERT_NAMES (w1/w3/w2 or gate_proj/up_proj/down_proj, each [out, in]
    transposed: the published files and transformers 5's save_pretrained), or FUSED_EXPERTS:
    transformers 5's modules as they are (save_pretrained(save_original_format=False)), Mixtral's,
    Qwen3-MoE's and Qwen3-Next's alike, mlp.experts.gate_up_proj [E, 2·d_ff, d] (expert e's gate in
    its first d_ff rows, up in the rest, as nn.Linear's outputs) and mlp.experts.down_proj [E, d, d_ff]: each
    expert's slice, transposed. A shared expert (moe.shared_expert_d_ff: Qwen2-MoE, Qwen3-Next) after
    them: mlp.shared_expert.{gate,up,down}_proj (W1, W3, W2) and its gate mlp.shared_expert_gate [1, d]."""
    d, d_ff, count = cfg.d_model, cfg.d_ff, cfg.moe.n_experts
    if layout not in (*_EXPERT_NAMES, FUSED_EXPERTS, GPT_OSS_EXPERTS):
        raise ValueError(f"a mixture of experts needs its layout ({', '.join(_EXPERT_NAMES)}, {FUSED_EXPERTS} or "
                         f"{GPT_OSS_EXPERTS}), got {layout!r}")
    if layout == GPT_OSS_EXPERTS:
        _gpt_oss_expert_rules(rules, f"{source}.mlp", target, cfg)
        return
    block = "mlp" if layout == FUSED_EXPERTS else _EXPERT_NAMES[layout][0]
    rules.append(Rule(f"{source}.{block}.gate.weight", (count, d), f"{target}.router.weight", "transpose"))
    for expert in range(count):
        ours = f"{target}.experts.{expert}"
        if layout == FUSED_EXPERTS:
            gate_up, down = f"{source}.mlp.experts.gate_up_proj", f"{source}.mlp.experts.down_proj"
            rules.append(Rule(gate_up, (count, 2 * d_ff, d), f"{ours}.w1.weight",
                              f"transpose expert {expert} rows 0:{d_ff}"))
            rules.append(Rule(gate_up, (count, 2 * d_ff, d), f"{ours}.w3.weight",
                              f"transpose expert {expert} rows {d_ff}:{2 * d_ff}"))
            rules.append(Rule(down, (count, d, d_ff), f"{ours}.w2.weight", f"transpose expert {expert}"))
            continue
        for projection, canonical in zip(_EXPERT_NAMES[layout][1], ("w1", "w3", "w2")):
            n_in, n_out = (d_ff, d) if canonical == "w2" else (d, d_ff)
            _linear(rules, f"{source}.{block}.experts.{expert}.{projection}", f"{ours}.{canonical}", n_in, n_out,
                    bias=False)
    if cfg.moe.shared_expert_d_ff:  # Qwen2-MoE's and Qwen3-Next's, beside the k experts
        _dense_mlp(rules, f"{source}.mlp.shared_expert", f"{target}.shared_expert", d, cfg.moe.shared_expert_d_ff)
        _linear(rules, f"{source}.mlp.shared_expert_gate", f"{target}.shared_expert_gate", d, 1, bias=False)


def _gpt_oss_expert_rules(rules: list[Rule], source: str, target: str, cfg: ModelConfig) -> None:
    """gpt-oss's mixture as GptOssMLP holds it: the router ``router`` (an nn.Linear [E, d] with its
    bias), and its E experts fused and stored [in, out]: ``experts.gate_up_proj`` [E, d, 2·d_ff] whose
    column 2i is unit i's gate (W1, the activated one) and 2i + 1 its up (W3), ``gate_up_proj_bias``
    [E, 2·d_ff] likewise, ``down_proj`` [E, d_ff, d] (W2) and ``down_proj_bias`` [E, d]: each expert's
    slice, as stored."""
    d, d_ff, count = cfg.d_model, cfg.d_ff, cfg.moe.n_experts
    _linear(rules, f"{source}.router", f"{target}.router", d, count)
    for expert in range(count):
        ours = f"{target}.experts.{expert}"
        for half, canonical in enumerate(("w1", "w3")):
            interleaved = f"expert {expert} interleaved {half} of 2"
            rules.append(Rule(f"{source}.experts.gate_up_proj", (count, d, 2 * d_ff), f"{ours}.{canonical}.weight",
                              interleaved))
            rules.append(Rule(f"{source}.experts.gate_up_proj_bias", (count, 2 * d_ff), f"{ours}.{canonical}.bias",
                              interleaved))
        rules.append(Rule(f"{source}.experts.down_proj", (count, d_ff, d), f"{ours}.w2.weight", f"expert {expert}"))
        rules.append(Rule(f"{source}.experts.down_proj_bias", (count, d), f"{ours}.w2.bias", f"expert {expert}"))


def rotary_mapping(family: str, cfg: ModelConfig, fused_experts: bool = False) -> list[Rule]:
    """The mapping of a rotary family: Phi-3's fused one, else Llama's names; a mixture's experts
    by the family's names, or (fused_experts) as transformers 5's fused modules."""
    if family == "phi3":
        return phi3_mapping(cfg)
    if family in ("qwen3_5_text", "qwen3_5"):
        return qwen3_5_mapping(cfg, _decoder_prefix(family))
    if family == "qwen3_next":  # num_experts 0: dense FFNs, no experts
        return qwen3_next_mapping(cfg, (FUSED_EXPERTS if fused_experts else family) if cfg.moe else None)
    if family == "gpt_oss":  # its own fused layout, whichever way transformers saved it
        return llama_mapping(cfg, experts=GPT_OSS_EXPERTS)
    experts = (FUSED_EXPERTS if fused_experts else family) if family in _MOE_FAMILIES else None
    return llama_mapping(cfg, experts=experts)


def _fused_experts(family: str, tensors: Mapping[str, np.ndarray], notes: list[str]) -> bool:
    """Whether a mixture's experts are stored as transformers 5's fused modules (said in a note)."""
    fused = family in _MOE_FAMILIES and any(key.endswith(".mlp.experts.gate_up_proj") for key in tensors)
    if fused:
        notes.append("the experts are stored fused, as transformers 5's modules hold them (mlp.experts.gate_up_proj "
                     "and down_proj per layer; save_pretrained(save_original_format=False)): each expert's slices "
                     "are taken")
    return fused


def _copies(family: str, cfg: ModelConfig, prefix: str) -> dict[str, str]:
    """Keys a checkpoint may hold as copies of a mapped tensor (tied weights): key -> the key it
    must equal. They are checked, not imported."""
    copies: dict[str, str] = {}
    if family == "gpt2" or family in _ROTARY_FAMILIES:
        if cfg.tie_head:
            copies["lm_head.weight"] = f"{prefix}wte.weight" if family == "gpt2" else \
                f"{_decoder_prefix(family)}embed_tokens.weight"
        return copies
    table = "model.shared.weight" if cfg.share_src_tgt_embed else "model.decoder.embed_tokens.weight"
    if cfg.share_src_tgt_embed:
        copies["model.encoder.embed_tokens.weight"] = table
        copies["model.decoder.embed_tokens.weight"] = table
    if cfg.tie_head:
        copies["lm_head.weight"] = table
    return copies


_INVERSE_FREQUENCIES = r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"  # older Llama files


def _ignored(family: str, key: str) -> str | None:
    """Why a checkpoint key that no rule reads may be left out, or None."""
    if family == "gpt2" and re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", key):
        return "GPT-2's causal-mask buffers (older checkpoints store them)"
    if family == "marian" and re.fullmatch(r"model\.(encoder|decoder)\.embed_positions\.weight", key):
        return "Marian's sinusoid tables (checked against the spec's, which are computed)"
    if family == "qwen3_5" and key.startswith("model.visual."):
        return "the vision tower of Qwen3_5ForConditionalGeneration (the spec is its text decoder)"
    if family in ("qwen3_5", "qwen3_next") and key.startswith("mtp."):
        return "the multi-token prediction head of the published files (speculative decoding; not the model's logits)"
    if family in _ROTARY_FAMILIES and re.fullmatch(_INVERSE_FREQUENCIES, key):
        return ("the rotary inverse frequencies older transformers saved (checked against the spec's, which are "
                "computed)")
    return None


# ---- applying a mapping --------------------------------------------------------------------------

def _apply(rules: list[Rule], tensors: Mapping[str, np.ndarray], copies: Mapping[str, str], family: str,
           notes: list[str]) -> dict[str, np.ndarray]:
    """Run the rules over the checkpoint; refuse with the whole key diff if it does not fit."""
    problems: list[str] = []
    expected = {}
    for rule in rules:
        expected.setdefault(rule.source, rule.source_shape)
    missing = [key for key in expected if key not in tensors]
    if missing:
        problems.append("missing: " + ", ".join(missing))
    for key, shape in expected.items():
        if key in tensors and tuple(tensors[key].shape) != shape:
            problems.append(f"{key}: shape {list(tensors[key].shape)}, expected {list(shape)}")
    for key, original in copies.items():
        if key in tensors and original in tensors and not np.array_equal(tensors[key], tensors[original]):
            problems.append(f"{key} should equal {original} (tied in config.json) but differs")
    ignored = {key: _ignored(family, key) for key in tensors if key not in expected and key not in copies}
    unexpected = sorted(key for key, why in ignored.items() if why is None)
    if unexpected:
        problems.append("unexpected: " + ", ".join(unexpected))
    if problems:
        raise WeightsError(f"the checkpoint does not match its config.json as a {family} model:\n  "
                           + "\n  ".join(problems))
    for why in sorted({why for why in ignored.values() if why}):
        keys = [key for key, reason in ignored.items() if reason == why]
        notes.append(f"ignored {len(keys)} tensor(s): {why}")
    present_copies = [key for key in copies if key in tensors]
    if present_copies:
        notes.append(f"checked {len(present_copies)} tied copy(ies) equal to their original: {', '.join(present_copies)}")
    # a transposed or sliced tensor stays a view of the checkpoint's bytes (NumPy, torch and JAX take
    # any strides): a 0.5B model imports without copying its 2 GB
    return {rule.target: np.asarray(rule.take(tensors[rule.source]), dtype=np.float32) for rule in rules}


def _check_marian_positions(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
    """A stored Marian sinusoid table must be the spec's sinusoidal-concat, rounded to float32."""
    from impl_numpy.model import sinusoidal_table  # the golden's table is the spec's definition

    for stack in ("encoder", "decoder"):
        stored = tensors.get(f"model.{stack}.embed_positions.weight")
        if stored is None:
            continue
        ours = sinusoidal_table(np.arange(stored.shape[0]), cfg.d_model, cfg.positional)
        if stored.shape[1] != cfg.d_model or np.max(np.abs(stored - ours)) > 2.0 ** -20:
            raise WeightsError(f"model.{stack}.embed_positions.weight is not the sinusoid table the spec computes "
                               "for Marian (sin in the first half, cos in the second, frequencies 10000^(-2i/d))")


def _check_rotary_frequencies(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> None:
    """Stored inverse frequencies must be θ^(−2i/r), i = 0 … r/2 − 1, rescaled as the config says
    (SPEC §5.12), rounded to float32."""
    from impl_numpy.model import rope_frequencies  # the golden's frequencies are the spec's definition

    r, ours = cfg.rotary_dim, rope_frequencies(cfg)
    scaled = "" if cfg.rope_scaling is None else f", rescaled by {cfg.rope_scaling.kind}"
    for key, stored in tensors.items():
        if re.fullmatch(_INVERSE_FREQUENCIES, key) and (
                stored.shape != ours.shape or np.max(np.abs(stored / ours - 1)) > 2.0 ** -20):
            raise WeightsError(f"{key} is not the spec's rotary inverse frequencies for rope_theta = {cfg.rope_theta} "
                               f"and {r} rotated dimensions (theta^(-2i/{r}), {r // 2} values{scaled})")


# ---- the entry points ------------------------------------------------------------------------------

def detect_family(hf: Mapping[str, Any]) -> str:
    """The family of a config.json, or a ConfigError naming the field that puts it out of reach."""
    model_type = hf.get("model_type")
    if model_type in _OUT_OF_SPEC:
        field, why = _OUT_OF_SPEC[model_type]
        value = json.dumps(hf.get(field)) if field in hf else "(absent)"
        raise ConfigError(f"model_type = {json.dumps(model_type)} cannot be imported: {field} = {value}: {why}")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type = {json.dumps(model_type)} is not a family the importer knows "
                          f"(it knows {', '.join(FAMILIES)})")
    architectures = hf.get("architectures")
    if architectures and FAMILIES[model_type] not in architectures:
        raise ConfigError(f"architectures = {json.dumps(architectures)}: only {FAMILIES[model_type]} has the output "
                          "head the spec describes (a language-model head over the vocabulary)")
    return model_type


_CONFIGS = {"gpt2": _gpt2_config, "marian": _marian_config, "bart": _bart_config, "llama": _llama_config,
            "qwen2": _qwen2_config, "qwen3": _qwen3_config, "mistral": _mistral_config, "phi3": _phi3_config,
            "gemma2": _gemma2_config, "gemma3_text": _gemma3_config, "mixtral": _mixtral_config,
            "qwen3_moe": _qwen3_moe_config, "qwen2_moe": _qwen2_moe_config, "qwen3_5_text": _qwen3_5_config,
            "qwen3_5": _qwen3_5_published_config, "qwen3_next": _qwen3_next_config, "smollm3": _smollm3_config,
            "olmo2": _olmo2_config, "gpt_oss": _gpt_oss_config}


def import_huggingface(directory: str | os.PathLike) -> Imported:
    """Read a Hugging Face model directory into the canonical config and float32 parameters."""
    directory = Path(directory)
    hf = _read_config(directory)
    family = detect_family(hf)
    notes: list[str] = []
    cfg = _CONFIGS[family](hf, notes)
    tensors = _read_tensors(_checkpoint_files(directory), notes)
    tensors = _dequantized_mxfp4(tensors, notes)
    if family == "gpt2":
        prefix = "transformer." if any(key.startswith("transformer.") for key in tensors) else ""
        rules = gpt2_mapping(cfg, prefix)
    elif family in _ROTARY_FAMILIES:
        prefix = ""
        rules = rotary_mapping(family, cfg, _fused_experts(family, tensors, notes))
        _check_rotary_frequencies(cfg, tensors)
    else:
        prefix = ""
        rules = seq2seq_mapping(cfg, family)
        if family == "marian":
            _check_marian_positions(cfg, tensors)
    params = _apply(rules, tensors, _copies(family, cfg, prefix), family, notes)
    bad = [name for name, value in params.items() if not np.isfinite(value).all()]
    if bad:
        raise WeightsError(f"the checkpoint holds NaN or Inf in: {', '.join(bad)}")
    check_params(cfg, params, where=f"the {family} import")
    return Imported(family, cfg, params, tuple(notes), directory)


def import_to_file(directory: str | os.PathLike, out: str | os.PathLike) -> Imported:
    """Import a Hugging Face model directory and write an ordinary weights file (spec §9)."""
    imported = import_huggingface(directory)
    save_weights(out, imported.config, imported.params)
    return imported


def as_held(cfg: ModelConfig) -> ModelConfig:
    """cfg as a Hugging Face directory holds it: a hybrid's chunked prefill at the import's chunk
    (config.json has none; a chunk changes no sum, SPEC §5.15, and transformers' class takes its own)."""
    if cfg.linear_attention is None:
        return cfg
    return cfg.replace(linear_attention=dataclasses.replace(cfg.linear_attention, chunk_size=GatedDeltaNet.chunk_size))


def require_import_of(directory: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray],
                      column: str) -> Imported:
    """The directory's import, when the weights under test are exactly it; else a WeightsError. A
    column that runs the directory's own model (transformers, onnxruntime-genai) checks the
    spec against that model only if the two hold the same config and tensors."""
    imported = import_huggingface(directory)
    if as_held(cfg) != imported.config or params_digest(params) != params_digest(imported.params):
        raise WeightsError(f"the weights under test are not the import of {directory}: the {column} column runs "
                           "that directory's model, so it must hold the same config and tensors "
                           f"(rosetta import {directory} --out FILE makes the matching weights file)")
    return imported


_FUSED_BLOCKS = {  # a fused tensor's row blocks as the mapping table writes them
    "q": "0 … H·d_k − 1", "k": "H·d_k … (H + H_kv)·d_k − 1", "v": "(H + H_kv)·d_k … (H + 2·H_kv)·d_k − 1",
    "w1": "0 … d_ff − 1 (the gate)", "w3": "d_ff … 2·d_ff − 1 (up)"}


_LINEAR_BLOCKS = {  # Qwen3.5's in_proj_qkv and conv1d: q, k and v one after another
    "q": "0 … H_k·d_k − 1", "k": "H_k·d_k … 2·H_k·d_k − 1",
    "v": "2·H_k·d_k … 2·H_k·d_k + H_v·d_v − 1"}


_GROUPED_BLOCKS = {  # Qwen3-Next's in_proj_qkvz and in_proj_ba: one key head's group, r = H_v / H_k
    "q": "rows 0 … d_k − 1 (its query)", "k": "rows d_k … 2·d_k − 1 (its key)",
    "v": "rows 2·d_k … 2·d_k + r·d_v − 1 (its r value heads' values)",
    "z": "rows 2·d_k + r·d_v … 2·d_k + 2·r·d_v − 1 (their output gates)",
    "beta": "rows 0 … r − 1 (its r value heads' b)", "decay": "rows r … 2·r − 1 (their a)"}


def _block_rows(rule: Rule) -> str:
    return _FUSED_BLOCKS[rule.target.split(".")[-2]]


def _indices_named(key: str) -> str:
    """A key with its expert's index as {e} and its layer's as {i} (GPT-2's h.0. included)."""
    key = re.sub(r"experts\.\d+\.", "experts.{e}.", key)
    return re.sub(r"layers\.\d+\.", "layers.{i}.", key).replace(".0.", ".{i}.")


def mapping_markdown(family: str) -> str:
    """The family's mapping as a Markdown table (layer 0 written as {i}), for docs/huggingface.md."""
    examples = {
        "gpt2": (gpt2_mapping, ModelConfig(arch="decoder-only", d_model=8, n_heads=2, d_ff=16, n_decoder_layers=1,
                                           tgt_vocab_size=10, max_len=4, norm_position="pre", final_norm=True,
                                           positional="learned", embed_scale=False, tie_head=True)),
        "marian": (lambda cfg: seq2seq_mapping(cfg, "marian"), ModelConfig(
            d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1, src_vocab_size=10,
            tgt_vocab_size=10, max_len=4, positional="sinusoidal-concat", head_bias=True, share_src_tgt_embed=True,
            tie_head=True)),
        "bart": (lambda cfg: seq2seq_mapping(cfg, "bart"), ModelConfig(
            d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1, src_vocab_size=10,
            tgt_vocab_size=10, max_len=4, positional="learned", embed_norm=True, head_bias=True,
            share_src_tgt_embed=True, tie_head=True)),
    }
    rotary = ModelConfig(arch="decoder-only", d_model=8, n_heads=2, n_kv_heads=1, d_ff=16, n_decoder_layers=1,
                         tgt_vocab_size=10, max_len=4, norm_position="pre", norm="rmsnorm", final_norm=True,
                         positional="rope", embed_scale=False, activation="swish", gated_ffn=True, qkv_bias=False,
                         bias=False)
    examples["llama"] = (llama_mapping, rotary)
    examples["qwen2"] = (llama_mapping, rotary.replace(qkv_bias=True, tie_head=True))
    examples["qwen3"] = (llama_mapping, rotary.replace(head_dim=6, qk_norm=True))
    examples["mistral"] = (llama_mapping, rotary.replace(sliding_window=2))
    examples["phi3"] = (phi3_mapping, rotary.replace(rope_fraction=0.5, sliding_window=2))
    gemma = rotary.replace(embed_scale=True, activation="gelu-tanh", tie_head=True, norm_scale_plus_one=True,
                           post_norms=True, query_pre_attention_scalar=4.0)
    examples["gemma2"] = (llama_mapping, gemma.replace(attention_softcap=50.0, final_softcap=30.0))
    examples["gemma3_text"] = (llama_mapping, gemma.replace(qk_norm=True, head_dim=4))
    moe = MixtureOfExperts(n_experts=2, experts_per_token=1)
    examples["mixtral"] = (lambda cfg: rotary_mapping("mixtral", cfg), rotary.replace(moe=moe))
    examples["qwen3_moe"] = (lambda cfg: rotary_mapping("qwen3_moe", cfg), rotary.replace(head_dim=6, qk_norm=True,
                                                                                          moe=moe))
    examples["qwen2_moe"] = (lambda cfg: rotary_mapping("qwen2_moe", cfg), rotary.replace(
        qkv_bias=True, moe=dataclasses.replace(moe, shared_expert_d_ff=8)))
    hybrid = rotary.replace(n_decoder_layers=2, n_kv_heads=None, head_dim=4, qk_norm=True, norm_scale_plus_one=True,
                            rope_fraction=0.5, layer_types=("linear", "full"), attention_output_gate=True,
                            linear_attention=GatedDeltaNet(key_heads=1, value_heads=2, key_head_dim=4,
                                                           value_head_dim=4, conv_kernel=2))
    examples["qwen3_5_text"] = (qwen3_5_mapping, hybrid)
    examples["qwen3_5"] = (lambda cfg: qwen3_5_mapping(cfg, _QWEN3_5_DECODER), hybrid)
    examples["qwen3_next"] = (qwen3_next_mapping, hybrid.replace(moe=dataclasses.replace(moe, shared_expert_d_ff=8)))
    examples["smollm3"] = (llama_mapping, rotary.replace(n_decoder_layers=2, tie_head=True, nope_layers=(1,)))
    examples["olmo2"] = (llama_mapping, rotary.replace(head_dim=6, qk_norm=True, qk_norm_scope="projection",
                                                       norm_position="output"))
    examples["gpt_oss"] = (lambda cfg: rotary_mapping("gpt_oss", cfg), rotary.replace(
        head_dim=6, qkv_bias=True, bias=True, attention_sinks=True, swiglu_limit=7.0, swiglu_alpha=1.702,
        moe=dataclasses.replace(moe, router_bias=True, router_softmax="activation")))
    mapping, cfg = examples[family]
    hows = {"copy": "as is", "transpose": "transposed ([out, in] → [in, out])", "row 0": "its one row"}
    lines = ["| Hugging Face tensor | canonical parameter | taken |", "|---|---|---|"]
    for rule in mapping(cfg):
        how = hows.get(rule.how, rule.how)
        if rule.how.startswith("transpose rows") and ".linear_attn." in rule.target:
            how = f"rows {_LINEAR_BLOCKS[rule.target.split('.')[-2]]}, transposed"
        elif rule.how.startswith("channels"):
            block = _LINEAR_BLOCKS[rule.target.split(".")[-2].removesuffix("_conv")]
            how = f"channels {block} (the [C, 1, K] kernels as [C, K])"
        elif rule.how.startswith("transpose group rows"):
            field = rule.target.split(".")[-2]
            fused = "2·d_k + 2·r·d_v" if field in _QWEN3_NEXT_QKVZ else "2·r"
            how = f"each key head's {_GROUPED_BLOCKS[field]} of its {fused}, head after head, transposed"
        elif rule.how.startswith("transpose head half"):
            how = (f"each head's {'first' if rule.head_half()[0] == 0 else 'second'} d_k rows of its 2·d_k "
                   f"({'the query' if rule.head_half()[0] == 0 else 'the output gate'}), transposed")
        elif rule.how.startswith("expert "):  # gpt-oss's fused [E, ...], stored [in, out]
            _, start, step = rule.expert_entries()
            how = ("expert e's slice, as stored" if step == 1 else
                   f"expert e's slice, its {'even' if start == 0 else 'odd'} entries of the last axis "
                   f"({'the gate' if start == 0 else 'up'}: gate and up interleaved)")
        elif rule.how.startswith("transpose rows"):
            how = f"rows {_block_rows(rule)}, transposed"
        elif rule.how.startswith(("columns", "slice")):
            block = rule.span()[0] // cfg.d_model
            how = f"{'columns' if rule.how.startswith('columns') else 'entries'} {block}·d … {block + 1}·d − 1"
        elif rule.how.startswith("rows"):
            how = "rows 2 … (rows 0 and 1 are never read)"
        # an expert's index as {e}, a layer's as {i} (a hybrid's full layer too), each rule one row
        source, target = (_indices_named(name) for name in (rule.source, rule.target))
        line = f"| `{source}` | `{target}` | {how} |"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)
