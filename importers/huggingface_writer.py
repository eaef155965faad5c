"""Canonical weights -> a Hugging Face directory of the modern decoder (Llama, Qwen2, Qwen3,
Mistral, Phi-3, Gemma 2, Gemma 3, SmolLM3, OLMo 2, with a mixture of experts Mixtral, Qwen3-MoE,
Qwen2-MoE and gpt-oss, and the hybrids Qwen3.5 and Qwen3-Next): the importer's mapping run
backwards, so that tools which read only Hugging Face directories (onnxruntime-genai's model
builder, CTranslate2's converter, transformers itself) can run the very weights the suite checks.

There is one mapping per family, the importer's (``rotary_mapping``): each rule is inverted (a copy
stays a copy, a transposed nn.Linear is transposed back, Phi-3's blocks are put back in their rows
of the fused tensor, Qwen3-Next's into each key head's group; a mixture's experts are written one
nn.Linear per expert and projection, as published checkpoints and transformers' save_pretrained
have them), and the result is proven by importing it again, which must give back the same config
and the same tensors. A config no family can hold is refused naming the field. Reads and writes
NumPy and safetensors only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from importers.huggingface import FAMILIES, Rule, as_held, import_huggingface, rotary_mapping
from spec import ModelConfig, check_params, params_digest
from spec.config import HUGGING_FACE_WRITER, check_computed_by
from spec.errors import ConfigError, WeightsError

_MODERN_DECODER = {  # field -> the value Llama, Qwen2 and Qwen3 all have
    "arch": "decoder-only", "norm_position": "pre", "norm": "rmsnorm", "final_norm": True, "positional": "rope",
    "embed_scale": False, "activation": "swish", "gated_ffn": True, "head_bias": False,
}


_GEMMA = {**_MODERN_DECODER, "embed_scale": True, "activation": "gelu-tanh", "tie_head": True, "qkv_bias": False,
          "bias": False, "norm_scale_plus_one": True, "post_norms": True}


def _gemma_family(cfg: ModelConfig) -> str:
    """Gemma 3 (q/k norms, the sliding layers' own θ) or Gemma 2 (neither)."""
    for field, value in _GEMMA.items():
        if getattr(cfg, field) != value:
            raise ConfigError(f"{field} = {getattr(cfg, field)!r}: Gemma 2 and Gemma 3 have {field} = {value!r}")
    if cfg.query_pre_attention_scalar is None:
        raise ConfigError("query_pre_attention_scalar = None: Gemma's classes always scale the scores by "
                          "query_pre_attn_scalar (give d_k for 1/√d_k)")
    mixed = cfg.layer_types is not None
    if cfg.qk_norm:
        if mixed and cfg.local_rope_theta is None:
            raise ConfigError("local_rope_theta = None with sliding and full layers: Gemma 3's sliding layers "
                              "always rotate by a θ of their own (give rope_theta for the same one)")
        return "gemma3_text"
    if cfg.local_rope_theta is not None or cfg.rope_scaling is not None:
        raise ConfigError("local_rope_theta or rope_scaling without qk_norm: Gemma 2 rotates every layer by one "
                          "plain θ; Gemma 3 (q/k norms) is the family with per-layer rotaries")
    return "gemma2"


_QWEN3_5 = {**_MODERN_DECODER, "qkv_bias": False, "bias": False, "qk_norm": True, "norm_scale_plus_one": True,
            "post_norms": False, "attention_output_gate": True, "moe": None, "sliding_window": None,
            "rope_scaling": None, "attention_softcap": None, "final_softcap": None,
            "query_pre_attention_scalar": None, "local_rope_theta": None}


def _hybrid_family(cfg: ModelConfig) -> str:
    """Qwen3.5's text decoder: gated DeltaNet and gated full attention (q/k norms, a partial rotary
    or none), (1 + w) norms, no biases, no windows or rescaling; Qwen3-Next where every FFN is a
    mixture of experts with a shared expert (its router's softmax in float32)."""
    for field, value in _QWEN3_5.items():
        if field != "moe" and getattr(cfg, field) != value:
            raise ConfigError(f"{field} = {getattr(cfg, field)!r}: Qwen3.5 and Qwen3-Next, the families with linear "
                              f"layers, have {field} = {value!r}")
    if cfg.linear_attention is None:
        raise ConfigError("attention_output_gate without linear layers: Qwen3.5 and Qwen3-Next, the families whose "
                          "attention has an output gate, have gated DeltaNet layers (linear_attention)")
    if cfg.moe is None:
        return "qwen3_5_text"
    if not cfg.moe.shared_expert_d_ff:
        raise ConfigError("moe.shared_expert_d_ff = 0 with linear layers: Qwen3-Next, the hybrid with a mixture of "
                          "experts, builds a shared expert beside the routed ones in every layer")
    if cfg.moe.router_softmax != "float32":
        raise ConfigError(f"moe.router_softmax = {cfg.moe.router_softmax!r}: Qwen3-Next's class takes the router's "
                          "softmax in float32")
    return "qwen3_next"


def _moe_family(cfg: ModelConfig) -> str:
    """Qwen2-MoE (a shared expert; q/k/v biases or none, norm_topk_prob either way, its windows in the
    layers layer_types says), Qwen3-MoE (q/k norms; norm_topk_prob either way) or Mixtral (no q/k
    norms; always renormalised): the experts and o without biases, the router's softmax in float32;
    Qwen3-MoE and Mixtral with one window (or none) for every layer."""
    moe = cfg.moe
    if moe.router_softmax != "float32":
        raise ConfigError(f"moe.router_softmax = {moe.router_softmax!r}: Mixtral's, Qwen3-MoE's and Qwen2-MoE's "
                          "classes take the router's softmax in float32")
    if moe.shared_expert_d_ff:
        for field, value in (("qk_norm", False), ("bias", False), ("rope_fraction", 1.0)):
            if getattr(cfg, field) != value:
                raise ConfigError(f"{field} = {getattr(cfg, field)!r} with a shared expert and full attention alone: "
                                  f"Qwen2-MoE has {field} = {value!r}")
        return "qwen2_moe"
    for field, value in (("qkv_bias", False), ("rope_fraction", 1.0), ("layer_types", None)):
        if getattr(cfg, field) != value:
            raise ConfigError(f"{field} = {getattr(cfg, field)!r} with a mixture of experts: Mixtral and Qwen3-MoE "
                              f"have {field} = {value!r}")
    if cfg.qk_norm:
        return "qwen3_moe"
    if not moe.renormalize:
        raise ConfigError("moe.renormalize = False without qk_norm: Mixtral always renormalises the chosen experts' "
                          "weights; Qwen3-MoE, whose norm_topk_prob may say not to, has q/k norms")
    return "mixtral"


def _smollm3_family(cfg: ModelConfig) -> str:
    """SmolLM3: Llama's layer (biases on q, k, v, o and the FFN, or none) whose NoPE layers rotate
    nothing, every head's every dimension rotating in the others, its windows where layer_types says."""
    for field, value in (("qk_norm", False), ("rope_fraction", 1.0)):
        if getattr(cfg, field) != value:
            raise ConfigError(f"{field} = {getattr(cfg, field)!r} with NoPE layers: SmolLM3, the family whose layers "
                              f"may not rotate, is written with {field} = {value!r}")
    if cfg.qkv_bias != cfg.bias:
        raise ConfigError("qkv_bias and bias differ with NoPE layers: SmolLM3's attention_bias and mlp_bias give q, k, "
                          "v and o, and the FFN, their biases; the importer takes them only together")
    return "smollm3"


def _olmo2_family(cfg: ModelConfig) -> str:
    """OLMo 2: Llama's decoder with each sublayer's output normed before the residual sum, and q and k
    each normed over its whole projection; no biases, every dimension rotating, no windows."""
    for field, value in (("qk_norm", True), ("qk_norm_scope", "projection"), ("qkv_bias", False), ("bias", False),
                         ("rope_fraction", 1.0), ("nope_layers", None), ("sliding_window", None), ("moe", None)):
        if getattr(cfg, field) != value:
            raise ConfigError(f"{field} = {getattr(cfg, field)!r} with norm_position 'output': OLMo 2, the family that "
                              f"norms the sublayers' outputs, has {field} = {value!r}")
    return "olmo2"


_GPT_OSS = (("qkv_bias", True), ("bias", True), ("attention_sinks", True), ("qk_norm", False), ("rope_fraction", 1.0),
            ("nope_layers", None))


def _gpt_oss_family(cfg: ModelConfig) -> str:
    """gpt-oss: biases on q, k, v, o and the experts, a sink per head, every dimension rotating, a
    mixture in every layer whose router has a bias and whose k weights are a softmax over the chosen
    logits in their dtype, the experts' clamped SwiGLU; its windows where layer_types says."""
    for field, value in _GPT_OSS:
        if getattr(cfg, field) != value:
            raise ConfigError(f"{field} = {getattr(cfg, field)!r} with gpt-oss's sinks, clamped SwiGLU or router bias: "
                              f"gpt-oss, the family that has them, has {field} = {value!r}")
    moe = cfg.moe
    if moe is None or cfg.swiglu_clamp is None:
        raise ConfigError(f"{'moe = None' if moe is None else 'swiglu_limit = None'} with gpt-oss's sinks: gpt-oss's "
                          "every FFN is a mixture of experts with the clamped SwiGLU")
    expected = {"router_bias": True, "renormalize": True, "router_softmax": "activation", "shared_expert_d_ff": 0}
    for field, value in expected.items():
        if getattr(moe, field) != value:
            raise ConfigError(f"moe.{field} = {getattr(moe, field)!r}: gpt-oss's mixture has {field} = {value!r} (its "
                              "router's bias, its softmax over the k chosen logits in their dtype, no shared expert)")
    return "gpt_oss"


def family_of(cfg: ModelConfig) -> str:
    """The family whose class computes this config: Qwen3.5 or, with a mixture of experts, Qwen3-Next
    (linear layers), Gemma 3 or Gemma 2 ((1 + w) norms and post norms), with a mixture of experts
    Qwen2-MoE (a shared expert), Qwen3-MoE (q/k norms) or Mixtral, OLMo 2 (norms on the sublayers'
    outputs), SmolLM3 (NoPE layers), Phi-3 (a partial rotary, no biases, the plain rotary frequencies), Mistral (a sliding window, no biases), Qwen3 (q/k
    norms), Qwen2 (q/k/v biases only), else Llama (biases on all or none); a ConfigError naming a
    field none of them has."""
    check_computed_by(cfg, HUGGING_FACE_WRITER)
    if cfg.linear_attention is not None or cfg.attention_output_gate:
        return _hybrid_family(cfg)
    if cfg.post_norms or cfg.norm_scale_plus_one:
        return _gemma_family(cfg)
    gemma_only = [name for name in ("attention_softcap", "final_softcap", "query_pre_attention_scalar",
                                    "local_rope_theta") if getattr(cfg, name) is not None]
    if gemma_only:
        raise ConfigError(f"{gemma_only[0]} = {getattr(cfg, gemma_only[0])!r} without Gemma's norms: only Gemma's "
                          "classes have it")
    for field, value in _MODERN_DECODER.items():
        if cfg.norm_position == "output" and field == "norm_position":
            continue
        if getattr(cfg, field) != value:
            raise ConfigError(f"{field} = {getattr(cfg, field)!r}: Llama, Qwen2, Qwen3, Mistral and Phi-3 have "
                              f"{field} = {value!r}")
    if cfg.norm_position == "output" or cfg.qk_norm_scope == "projection":
        if cfg.norm_position != "output":
            raise ConfigError(f"qk_norm_scope = 'projection' with norm_position = {cfg.norm_position!r}: OLMo 2, the "
                              "family whose q/k norms span the whole projection, norms the sublayers' outputs")
        return _olmo2_family(cfg)
    if cfg.attention_sinks or cfg.swiglu_clamp is not None or (cfg.moe is not None and cfg.moe.router_bias):
        return _gpt_oss_family(cfg)
    if cfg.moe is not None:
        return _moe_family(cfg)
    if cfg.nope_layers is not None:
        return _smollm3_family(cfg)
    longrope = cfg.rope_scaling is not None and cfg.rope_scaling.kind == "longrope"
    if cfg.rope_fraction != 1 or longrope:
        other_scaling = cfg.rope_scaling is not None and not longrope
        if cfg.qk_norm or cfg.qkv_bias or cfg.bias or other_scaling:
            raise ConfigError(f"rope_fraction = {cfg.rope_fraction}, rope_scaling {cfg.rope_scaling and cfg.rope_scaling.kind}"
                              " with q/k norms, biases or a rescaling but longrope: Phi-3, the family that rotates "
                              "part of each head or rescales by longrope, has none of them")
        return "phi3"
    if cfg.layer_types is not None:  # the family its layers would have without windows, if it places them by layer
        family = family_of(cfg.replace(layer_types=None, sliding_window=None))
        if family not in ("qwen2", "qwen3"):
            raise ConfigError(f"layer_types in a {family} config: Qwen2 and Qwen3 are the families besides Gemma whose "
                              "layers slide or not one by one")
        return family
    if cfg.sliding_window is not None:
        if cfg.qk_norm or cfg.qkv_bias or cfg.bias:
            raise ConfigError("sliding_window with q/k norms or biases: Mistral, the family with a window in every "
                              "layer, has neither")
        return "mistral"
    if cfg.qk_norm:
        if cfg.qkv_bias or cfg.bias:
            raise ConfigError("qk_norm with biases: Qwen3, the family with q/k norms, has no biases")
        return "qwen3"
    if cfg.qkv_bias and not cfg.bias:
        return "qwen2"
    if cfg.qkv_bias != cfg.bias:
        raise ConfigError("bias without qkv_bias: Llama's attention_bias and mlp_bias give o_proj and the FFN "
                          "their biases only with q, k and v's")
    return "llama"


def _config_json(cfg: ModelConfig, family: str, bos_id: int, eos_id: int) -> dict:
    config = {
        "architectures": [FAMILIES[family]], "model_type": family, "vocab_size": cfg.tgt_vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_decoder_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.d_head,
        "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        # both forms of θ: transformers 5 reads rope_parameters, older readers the top-level field
        "rope_parameters": _rope_parameters(cfg), "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_head, "pad_token_id": cfg.pad_id, "bos_token_id": bos_id,
        "eos_token_id": eos_id, "dtype": "float32", "attention_dropout": 0.0,
    }
    if family in ("mixtral", "qwen3_moe", "qwen2_moe"):
        return config | _moe_config_json(cfg, family)
    if family == "gpt_oss":
        moe = cfg.moe
        return config | {"num_local_experts": moe.n_experts, "num_experts_per_tok": moe.experts_per_token,
                         "output_router_logits": bool(moe.load_balancing), "router_aux_loss_coef": moe.load_balancing,
                         "attention_bias": True, "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
                         # GptOssModel builds its sliding mask whatever its layers are (and refuses a null
                         # window), so a model with no sliding layer gets a window none of them takes
                         "sliding_window": cfg.sliding_window or cfg.max_len, "layer_types": _hf_layer_types(cfg)}
    if family in ("qwen3_5_text", "qwen3_next"):
        mixer = cfg.linear_attention
        config |= {"attention_bias": False, "layer_types": [f"{kind}_attention" for kind in cfg.layer_types],
                   "linear_num_key_heads": mixer.key_heads, "linear_num_value_heads": mixer.value_heads,
                   "linear_key_head_dim": mixer.key_head_dim, "linear_value_head_dim": mixer.value_head_dim,
                   "linear_conv_kernel_dim": mixer.conv_kernel}
        return config | _moe_config_json(cfg, family) if family == "qwen3_next" else config
    if family == "olmo2":  # its attention_bias would give q, k, v and o biases (refused by the importer)
        return config | {"attention_bias": False}
    if family in ("llama", "smollm3"):
        config |= {"attention_bias": cfg.bias, "mlp_bias": cfg.bias}
    if family == "smollm3":  # one flag per layer, 1 rotates (the interval is read only where the flags are absent)
        return config | {"no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_decoder_layers)],
                         "use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
                         "layer_types": _hf_layer_types(cfg)}
    elif family in ("mistral", "phi3"):
        config |= {"sliding_window": cfg.sliding_window}
    elif family in ("gemma2", "gemma3_text"):
        del config["hidden_act"]
        config |= {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                   # an int in Gemma's configs (transformers' strict config refuses 16.0)
                   "query_pre_attn_scalar": _integral(cfg.query_pre_attention_scalar), "sliding_window": cfg.sliding_window,
                   "layer_types": _hf_layer_types(cfg), "attn_logit_softcapping": cfg.attention_softcap,
                   "final_logit_softcapping": cfg.final_softcap}
        if family == "gemma3_text" and cfg.local_rope_theta is not None:
            config["rope_parameters"] = {"full_attention": config["rope_parameters"],
                                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}}
        return config
    elif cfg.layer_types is not None:  # Qwen2, Qwen3: the window in the layers layer_types says
        return config | {"use_sliding_window": True, "sliding_window": cfg.sliding_window,
                         "layer_types": _hf_layer_types(cfg), "max_window_layers": cfg.layer_types.index("sliding")}
    if family == "phi3" and cfg.rope_scaling is not None:  # transformers reads Phi-3's at the top level first
        config |= {"original_max_position_embeddings": cfg.rope_scaling.original_max_len}
    else:
        config |= {"use_sliding_window": False}
    return config


def _moe_config_json(cfg: ModelConfig, family: str) -> dict:
    """The mixture's fields as each class reads them (Mixtral: num_local_experts, always
    renormalised; Qwen3-MoE: num_experts as its published files spell it, experts
    moe_intermediate_size wide, norm_topk_prob, every layer a mixture) and the window, in every
    layer, or none."""
    moe = cfg.moe
    # transformers adds its load-balancing loss only where output_router_logits is set
    common = {"num_experts_per_tok": moe.experts_per_token, "output_router_logits": bool(moe.load_balancing),
              "router_aux_loss_coef": moe.load_balancing}
    if family == "mixtral":
        return common | {"num_local_experts": moe.n_experts, "router_jitter_noise": 0.0,
                         "sliding_window": cfg.sliding_window}
    common |= {"num_experts": moe.n_experts, "moe_intermediate_size": cfg.d_ff, "norm_topk_prob": moe.renormalize,
               "decoder_sparse_step": 1, "mlp_only_layers": []}
    windows = {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window}
    if family == "qwen2_moe":  # q/k/v biases by qkv_bias; its windows where layer_types says (the class reads them)
        return common | windows | {"shared_expert_intermediate_size": moe.shared_expert_d_ff, "qkv_bias": cfg.qkv_bias,
                                   "layer_types": _hf_layer_types(cfg), "max_window_layers": cfg.n_decoder_layers}
    common |= {"attention_bias": False}
    if family == "qwen3_next":  # a mixture in every layer, beside its shared expert
        return common | {"shared_expert_intermediate_size": moe.shared_expert_d_ff}
    return common | windows


def _integral(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _hf_layer_types(cfg: ModelConfig) -> list[str]:
    """layer_types as transformers writes them, every layer's kind spelled out."""
    kinds = cfg.layer_types or ("sliding" if cfg.sliding_window else "full",) * cfg.n_decoder_layers
    return [f"{kind}_attention" for kind in kinds]


def _rope_parameters(cfg: ModelConfig) -> dict:
    """rope_parameters as transformers 5 reads them: θ, and the rescaling's keys (SPEC §5.12)."""
    scaling = cfg.rope_scaling
    fraction = {} if cfg.rope_fraction == 1 else {"partial_rotary_factor": cfg.rope_fraction}
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta, **fraction}
    parameters = {"rope_type": scaling.kind, "rope_theta": cfg.rope_theta, "factor": scaling.factor, **fraction}
    if scaling.kind == "llama3":
        parameters |= {"original_max_position_embeddings": scaling.original_max_len,
                       "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor}
    elif scaling.kind == "yarn":
        parameters |= {"original_max_position_embeddings": scaling.original_max_len, "beta_fast": scaling.beta_fast,
                       "beta_slow": scaling.beta_slow, "truncate": scaling.truncate}
        parameters |= {key: getattr(scaling, key) for key in ("mscale", "mscale_all_dim", "attention_factor")
                       if getattr(scaling, key) is not None}
    elif scaling.kind == "longrope":
        parameters |= {"original_max_position_embeddings": scaling.original_max_len,
                       "short_factor": list(scaling.short_factor), "long_factor": list(scaling.long_factor)}
        if scaling.attention_factor is not None:
            parameters |= {"attention_factor": scaling.attention_factor}
    return parameters


def _source_tensors(rules: list[Rule], params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each rule inverted: a copy stays a copy, a transposed nn.Linear ([in, out]) goes back to
    [out, in], a block of a fused nn.Linear back into its rows."""
    tensors: dict[str, np.ndarray] = {}
    for rule in rules:
        value = np.asarray(params[rule.target], np.float32)
        if rule.how == "copy":
            tensors[rule.source] = value
        elif rule.how == "transpose":
            tensors[rule.source] = value.T
        elif rule.how.startswith("transpose rows "):
            start, stop = rule.span()
            tensors.setdefault(rule.source, np.zeros(rule.source_shape, np.float32))[start:stop] = value.T
        elif rule.how.startswith("expert "):  # back into gpt-oss's fused experts, interleaved where they were
            expert, start, step = rule.expert_entries()
            tensors.setdefault(rule.source, np.zeros(rule.source_shape, np.float32))[expert][..., start::step] = value
        elif rule.how.startswith("channels "):  # a depthwise convolution's kernels back into [C, 1, K]
            start, stop = rule.span()
            tensors.setdefault(rule.source, np.zeros(rule.source_shape, np.float32))[start:stop, 0] = value
        elif rule.how.startswith("transpose group rows "):  # each key head's block back into its group
            start, stop, width = rule.group_rows()
            fused = tensors.setdefault(rule.source, np.zeros(rule.source_shape, np.float32))
            blocks = value.T.reshape(-1, stop - start, value.shape[0])
            fused.reshape(-1, width, fused.shape[-1])[:, start:stop] = blocks
        elif rule.how.startswith("transpose head half "):  # each head's block back among its two
            half, width = rule.head_half()
            fused = tensors.setdefault(rule.source, np.zeros(rule.source_shape, np.float32))
            fused.reshape(-1, 2, width, fused.shape[-1])[:, half] = value.T.reshape(-1, width, fused.shape[-1])
        else:
            raise ValueError(f"the rotary families' mappings have no {rule.how!r} rule to invert")
    return {key: np.ascontiguousarray(value) for key, value in tensors.items()}


def to_huggingface(cfg: ModelConfig, params: Mapping[str, np.ndarray], directory: str | os.PathLike, *,
                   bos_id: int = 1, eos_id: int = 2) -> Path:
    """Write config.json and model.safetensors for these canonical weights; the directory."""
    from safetensors.numpy import save_file

    family = family_of(cfg)
    check_params(cfg, params, where="the weights to write as a Hugging Face directory")
    for name, token in (("bos_id", bos_id), ("eos_id", eos_id)):
        if not 0 <= token < cfg.tgt_vocab_size:
            raise ConfigError(f"{name} = {token}: outside the vocabulary (0 .. {cfg.tgt_vocab_size - 1})")
    tensors = _source_tensors(rotary_mapping(family, cfg), params)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_config_json(cfg, family, bos_id, eos_id), indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    back, held = import_huggingface(directory), as_held(cfg)
    fields = [f"{name} = {getattr(held, name)!r} (read back: {getattr(back.config, name)!r})"
              for name in held.to_dict() if getattr(back.config, name) != getattr(held, name)]
    if fields:
        raise ConfigError(f"{directory} as a {family} directory cannot hold " + ", ".join(fields))
    if params_digest(back.params) != params_digest(params):
        raise WeightsError(f"writing {directory} as a {family} directory did not give back the same tensors")
    return directory
