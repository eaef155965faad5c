"""CTranslate2, the outside peer: our canonical weights converted into a CTranslate2 model through
its Python spec API, one mapping like every importer here: ``TransformerSpec`` for an
encoder-decoder, ``TransformerDecoderModelSpec`` for the modern decoder (Llama, Qwen2: RMSNorm,
rotate_half rotary positions, grouped-query attention, SwiGLU), which CTranslate2 runs through its
``Generator``.

CTranslate2 stores Linear weights [out, in] (our [in, out] transposed), fuses self-attention's
Q, K and V into one [3d, d] matrix and cross-attention's K and V into one [2d, d], and names
norms gamma/beta. Positions are given as an explicit table of the spec's own layout, so the
interleaved paper sinusoids are not confused with CTranslate2's concatenated default.
Tokens are strings to CTranslate2: id i is the token "i" in both vocabularies.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

import impl_numpy as golden
from spec import ModelConfig


class Unsupported(Exception):
    """A config CTranslate2's Transformer spec cannot express."""


def unsupported_reason(cfg: ModelConfig) -> str | None:
    if not cfg.has_encoder:
        return _decoder_unsupported_reason(cfg)
    if cfg.norm != "layernorm":
        return f"CTranslate2 has no '{cfg.norm}' norm"
    if cfg.final_norm != (cfg.norm_position == "pre"):
        return "CTranslate2 ties the final norm to pre-norm"
    return None


def _decoder_unsupported_reason(cfg: ModelConfig) -> str | None:
    from importers.huggingface_writer import family_of
    from spec.errors import ConfigError

    try:
        family = family_of(cfg)
    except ConfigError as error:
        return f"a decoder-only model is mapped to CTranslate2 only as Llama or Qwen2 ({error})"
    if cfg.linear_attention is not None:
        return f"a hybrid's gated DeltaNet layers (family {family}) have no CTranslate2 layer"
    if family in ("gemma2", "gemma3_text"):
        return (f"Gemma's layer ((1 + w) norms, post norms, softcaps, the query scalar: family {family}) is not "
                "mapped to CTranslate2 here")
    if family == "qwen3":
        return "Qwen3's per-head q/k norms are not mapped to CTranslate2 here"
    if family == "smollm3":
        return (f"SmolLM3's layers without rotary (nope_layers {list(cfg.nope_layers)}) are not mapped to "
                "CTranslate2 here")
    if family == "olmo2":
        return ("OLMo 2's norms on the sublayers' outputs and its q/k norms over the whole projection are not mapped "
                "to CTranslate2 here (its converter has no OLMo 2 loader)")
    if family == "gpt_oss":
        return ("gpt-oss's sinks, clamped SwiGLU experts and router bias are not mapped to CTranslate2 here (its "
                "converter has no gpt-oss loader)")
    if family == "phi3":  # convert_decoder rotates every dimension of a head
        return f"a partial rotary (rope_fraction {cfg.rope_fraction}) is not mapped to CTranslate2 here"
    if cfg.sliding_window is not None:
        return f"a sliding window ({cfg.sliding_window} keys) is not mapped to CTranslate2 here"
    if cfg.rope_scaling is not None:
        return f"{cfg.rope_scaling.kind} rope scaling is not mapped to CTranslate2 here (its rotary is the plain one)"
    return None


def _linear(spec, weight: np.ndarray, bias: np.ndarray | None) -> None:
    spec.weight = np.ascontiguousarray(weight.T)  # [in, out] -> CTranslate2's [out, in]
    if bias is not None:
        spec.bias = bias


def _norm(spec, params: Mapping[str, np.ndarray], prefix: str) -> None:
    spec.gamma, spec.beta = params[f"{prefix}.scale"], params[f"{prefix}.bias"]


def _bias(params, name: str, width: int) -> np.ndarray:
    return params.get(name, np.zeros(width, np.float32))


def _self_attention(spec, params, prefix: str, d: int) -> None:
    q, k, v = (params[f"{prefix}.{part}.weight"] for part in "qkv")
    fused = np.concatenate([q, k, v], axis=1)  # [d, 3d]
    biases = np.concatenate([_bias(params, f"{prefix}.{part}.bias", d) for part in "qkv"])
    _linear(spec.linear[0], fused, biases)
    _linear(spec.linear[1], params[f"{prefix}.o.weight"], _bias(params, f"{prefix}.o.bias", d))


def _cross_attention(spec, params, prefix: str, d: int) -> None:
    _linear(spec.linear[0], params[f"{prefix}.q.weight"], _bias(params, f"{prefix}.q.bias", d))
    fused = np.concatenate([params[f"{prefix}.k.weight"], params[f"{prefix}.v.weight"]], axis=1)
    biases = np.concatenate([_bias(params, f"{prefix}.{part}.bias", d) for part in "kv"])
    _linear(spec.linear[1], fused, biases)
    _linear(spec.linear[2], params[f"{prefix}.o.weight"], _bias(params, f"{prefix}.o.bias", d))


def _ffn(spec, params, prefix: str, cfg: ModelConfig) -> None:
    _linear(spec.linear_0, params[f"{prefix}.ffn.w1.weight"], _bias(params, f"{prefix}.ffn.w1.bias", cfg.d_ff))
    _linear(spec.linear_1, params[f"{prefix}.ffn.w2.weight"], _bias(params, f"{prefix}.ffn.w2.bias", cfg.d_model))
    _norm(spec.layer_norm, params, f"{prefix}.ffn_norm")


def _head(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> np.ndarray:
    head = params["tgt_embed.weight"] if cfg.tie_head else params["head.weight"].T
    return np.ascontiguousarray(head)  # [V, d] either way


def _positions(cfg: ModelConfig, params, side: str) -> np.ndarray:
    if cfg.positional == "learned":
        return params[f"{side}_pos.weight"]
    return golden.sinusoidal_table(np.arange(cfg.max_len), cfg.d_model, cfg.positional).astype(np.float32)


def _save(spec, directory: str | Path) -> Path:
    """Validate the spec, store its weights at float32 and write the model directory."""
    spec.validate()
    spec.optimize(quantization="float32")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec.save(str(directory))
    return directory


def convert(cfg: ModelConfig, params: Mapping[str, np.ndarray], directory: str | Path,
            bos_id: int = 1, eos_id: int = 2) -> Path:
    """Write a CTranslate2 model directory for this config and these canonical parameters."""
    reason = unsupported_reason(cfg)  # before the import: a refusal needs no CTranslate2
    if reason:
        raise Unsupported(reason)
    from ctranslate2.specs import common_spec, transformer_spec

    activations = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                   "gelu-tanh": common_spec.Activation.GELUTanh, "swish": common_spec.Activation.SWISH}
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.norm_position == "pre",
        no_final_norm=not cfg.final_norm, activation=activations[cfg.activation])
    d = cfg.d_model
    source_table = "src_embed.weight" if "src_embed.weight" in params else "tgt_embed.weight"
    encoder, decoder = spec.encoder, spec.decoder
    encoder.embeddings[0].weight = params[source_table]
    encoder.scale_embeddings = decoder.scale_embeddings = cfg.embed_scale
    encoder.position_encodings.encodings = _positions(cfg, params, "src")
    decoder.position_encodings.encodings = _positions(cfg, params, "tgt")
    decoder.embeddings.weight = params["tgt_embed.weight"]
    for i, layer in enumerate(encoder.layer):
        prefix = f"encoder.layers.{i}"
        _self_attention(layer.self_attention, params, f"{prefix}.self_attn", d)
        _norm(layer.self_attention.layer_norm, params, f"{prefix}.self_attn_norm")
        _ffn(layer.ffn, params, prefix, cfg)
    for i, layer in enumerate(decoder.layer):
        prefix = f"decoder.layers.{i}"
        _self_attention(layer.self_attention, params, f"{prefix}.self_attn", d)
        _norm(layer.self_attention.layer_norm, params, f"{prefix}.self_attn_norm")
        _cross_attention(layer.attention, params, f"{prefix}.cross_attn", d)
        _norm(layer.attention.layer_norm, params, f"{prefix}.cross_attn_norm")
        _ffn(layer.ffn, params, prefix, cfg)
    if cfg.final_norm:
        _norm(encoder.layer_norm, params, "encoder.norm")
        _norm(decoder.layer_norm, params, "decoder.norm")
    decoder.projection.weight = _head(cfg, params)
    if cfg.head_bias:
        decoder.projection.bias = params["head.bias"]
    spec.config.layer_norm_epsilon = cfg.norm_eps
    spec.config.bos_token = spec.config.decoder_start_token = str(bos_id)
    spec.config.eos_token = str(eos_id)
    spec.config.unk_token = str(cfg.pad_id)
    spec.register_source_vocabulary([str(i) for i in range(cfg.src_vocab_size)])
    spec.register_target_vocabulary([str(i) for i in range(cfg.tgt_vocab_size)])
    return _save(spec, directory)


def convert_decoder(cfg: ModelConfig, params: Mapping[str, np.ndarray], directory: str | Path,
                    bos_id: int = 1, eos_id: int = 2) -> Path:
    """Write a CTranslate2 decoder model (Llama's layout: RMSNorm, rotate_half rotary positions, q,
    k and v fused into one [(H + 2·H_kv)·d_k, d] matrix, gate_proj as linear_0, up_proj as
    linear_0_noact) for this rotary decoder-only config; the directory."""
    reason = unsupported_reason(cfg)
    if reason:
        raise Unsupported(reason)
    from ctranslate2.specs import common_spec, transformer_spec

    spec = transformer_spec.TransformerDecoderModelSpec.from_config(
        cfg.n_decoder_layers, cfg.n_heads, pre_norm=True, activation=common_spec.Activation.SWISH, ffn_glu=True,
        rms_norm=True, rotary_dim=0, rotary_interleave=False, rotary_base=cfg.rope_theta,
        num_heads_kv=cfg.kv_heads, head_dim=cfg.d_head)
    decoder = spec.decoder
    decoder.scale_embeddings = False
    decoder.embeddings.weight = params["tgt_embed.weight"]
    decoder.layer_norm.gamma = params["decoder.norm.scale"]
    for i, layer in enumerate(decoder.layer):
        prefix = f"decoder.layers.{i}"
        attention = layer.self_attention
        attention.layer_norm.gamma = params[f"{prefix}.self_attn_norm.scale"]
        fused = np.concatenate([params[f"{prefix}.self_attn.{part}.weight"] for part in "qkv"], axis=1)
        biases = np.concatenate([params[f"{prefix}.self_attn.{part}.bias"] for part in "qkv"]) if cfg.qkv_bias else None
        _linear(attention.linear[0], fused, biases)
        _linear(attention.linear[1], params[f"{prefix}.self_attn.o.weight"], params.get(f"{prefix}.self_attn.o.bias"))
        layer.ffn.layer_norm.gamma = params[f"{prefix}.ffn_norm.scale"]
        for target, canonical in ((layer.ffn.linear_0, "w1"), (layer.ffn.linear_0_noact, "w3"),
                                  (layer.ffn.linear_1, "w2")):
            _linear(target, params[f"{prefix}.ffn.{canonical}.weight"], params.get(f"{prefix}.ffn.{canonical}.bias"))
    decoder.projection.weight = _head(cfg, params)
    spec.config.layer_norm_epsilon = cfg.norm_eps
    spec.config.bos_token, spec.config.eos_token = str(bos_id), str(eos_id)
    spec.config.unk_token = str(cfg.pad_id)
    spec.register_vocabulary([str(i) for i in range(cfg.tgt_vocab_size)])
    return _save(spec, directory)


def greedy_decoder(generator, cfg: ModelConfig, prompt_ids: np.ndarray, max_new_tokens: int, eos_id: int) -> np.ndarray:
    """Greedy continuations [B, N] of unpadded prompts, in the golden's convention: the end token
    kept, then pad_id. The prompts are forwarded at once (include_prompt_in_result=False)."""
    prompts = [[str(t) for t in row] for row in prompt_ids]
    results = generator.generate_batch(prompts, beam_size=1, sampling_topk=1, max_length=max_new_tokens,
                                       include_prompt_in_result=False, end_token=str(eos_id), return_end_token=True)
    tokens = np.full((len(prompts), max_new_tokens), cfg.pad_id, dtype=np.int64)
    for row, result in enumerate(results):
        produced = [int(t) for t in result.sequences[0]][:max_new_tokens]
        tokens[row, :len(produced)] = produced
    return tokens


def greedy(translator, cfg: ModelConfig, src_ids: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Greedy tokens [B, N] in the golden's convention: the end token kept, then pad_id.
    Sources are right-padded ids; CTranslate2 takes each row without its padding."""
    keep = src_ids != cfg.pad_id
    batch = [[str(t) for t in row[k]] for row, k in zip(src_ids, keep)]
    results = translator.translate_batch(batch, beam_size=1, max_decoding_length=max_new_tokens,
                                         return_end_token=True, return_scores=False)
    tokens = np.full((len(batch), max_new_tokens), cfg.pad_id, dtype=np.int64)
    for row, result in enumerate(results):
        produced = [int(t) for t in result.hypotheses[0]][:max_new_tokens]
        tokens[row, :len(produced)] = produced
    return tokens
