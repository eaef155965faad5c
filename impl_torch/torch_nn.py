"""Canonical parameters <-> ``torch.nn.Transformer`` (plus separately supplied embeddings and head).

One mapping table, used in both directions. nn.MultiheadAttention fuses q, k, v into one
``in_proj_weight`` [3d, d] (rows: q, then k, then v) and, like nn.Linear, stores weights
[out, in]; the spec keeps q, k, v apart and stores [in, out]. Norms are ``norm1..3`` with
``weight``/``bias`` where the spec says ``*_norm.scale``/``.bias``.

nn.Transformer can express only part of the spec: an encoder-decoder with LayerNorm, a final
norm on both stacks, one bias flag for every linear (q/k/v, o and the FFN alike), ReLU or exact
GELU, and none of the modern decoder (RoPE, grouped-query attention, a decoupled head_dim, a
gated FFN, q/k norms). ``check_torch_nn_config`` names whatever else a config asks for.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from spec import ModelConfig, WeightsError, check_params, param_shapes

_NORM_NAMES = {"encoder": ["self_attn_norm", "ffn_norm"], "decoder": ["self_attn_norm", "cross_attn_norm", "ffn_norm"]}
_ATTENTION_NAMES = {"self_attn": "self_attn", "cross_attn": "multihead_attn"}


def check_torch_nn_config(cfg: ModelConfig) -> None:
    """Refuse a config nn.Transformer cannot compute, naming every field in the way."""
    problems = []
    if cfg.arch != "encoder-decoder":
        problems.append("arch must be encoder-decoder")
    if cfg.norm != "layernorm":
        problems.append("norm must be layernorm")
    if not cfg.final_norm:
        problems.append("final_norm must be true (nn.Transformer always norms both stacks)")
    if cfg.qkv_bias != cfg.bias:
        problems.append("qkv_bias must equal bias (nn.Transformer has one bias flag)")
    if cfg.activation not in ("relu", "gelu"):
        problems.append("activation must be relu or gelu")
    if cfg.positional == "rope":
        problems.append("positional must not be rope (nn.MultiheadAttention rotates nothing)")
    if cfg.kv_heads != cfg.n_heads:
        problems.append("n_kv_heads must equal n_heads (nn.MultiheadAttention has a key/value head per query head)")
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        problems.append("head_dim must be d_model / n_heads (nn.MultiheadAttention's heads split d_model)")
    if cfg.gated_ffn:
        problems.append("gated_ffn must be false (nn.Transformer's FFN has no gate)")
    if cfg.qk_norm:
        problems.append("qk_norm must be false (nn.MultiheadAttention norms no head)")
    if problems:
        raise WeightsError("config cannot be expressed as torch.nn.Transformer: " + "; ".join(problems))


def torch_nn_transformer(cfg: ModelConfig) -> nn.Transformer:
    """An nn.Transformer with the config's sizes and options (batch_first, eval mode, no dropout)."""
    check_torch_nn_config(cfg)
    model = nn.Transformer(
        d_model=cfg.d_model, nhead=cfg.n_heads, num_encoder_layers=cfg.n_encoder_layers,
        num_decoder_layers=cfg.n_decoder_layers, dim_feedforward=cfg.d_ff, dropout=0.0,
        activation=cfg.activation, layer_norm_eps=cfg.norm_eps, batch_first=True,
        norm_first=cfg.norm_position == "pre", bias=cfg.bias)
    return model.eval()


def _mapping(cfg: ModelConfig) -> list[tuple[tuple[str, ...], str, bool]]:
    """(canonical names, nn.Transformer name, transpose?) for every tensor. Several canonical
    names map to one fused tensor by concatenating their [out, in] forms along rows."""
    rows: list[tuple[tuple[str, ...], str, bool]] = []
    for stack, count in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(count):
            ours, theirs = f"{stack}.layers.{i}", f"{stack}.layers.{i}"
            attentions = ["self_attn"] + (["cross_attn"] if stack == "decoder" else [])
            for attention in attentions:
                a, b = f"{ours}.{attention}", f"{theirs}.{_ATTENTION_NAMES[attention]}"
                rows.append(((f"{a}.q.weight", f"{a}.k.weight", f"{a}.v.weight"), f"{b}.in_proj_weight", True))
                if cfg.bias:
                    rows.append(((f"{a}.q.bias", f"{a}.k.bias", f"{a}.v.bias"), f"{b}.in_proj_bias", False))
                rows.append(((f"{a}.o.weight",), f"{b}.out_proj.weight", True))
                if cfg.bias:
                    rows.append(((f"{a}.o.bias",), f"{b}.out_proj.bias", False))
            for ours_linear, theirs_linear in (("w1", "linear1"), ("w2", "linear2")):
                rows.append(((f"{ours}.ffn.{ours_linear}.weight",), f"{theirs}.{theirs_linear}.weight", True))
                if cfg.bias:
                    rows.append(((f"{ours}.ffn.{ours_linear}.bias",), f"{theirs}.{theirs_linear}.bias", False))
            for number, norm in enumerate(_NORM_NAMES[stack], start=1):
                rows.append(((f"{ours}.{norm}.scale",), f"{theirs}.norm{number}.weight", False))
                rows.append(((f"{ours}.{norm}.bias",), f"{theirs}.norm{number}.bias", False))
        rows.append(((f"{stack}.norm.scale",), f"{stack}.norm.weight", False))
        rows.append(((f"{stack}.norm.bias",), f"{stack}.norm.bias", False))
    return rows


def to_torch_nn(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Canonical params -> (nn.Transformer state_dict, extras). The extras are what nn.Transformer
    leaves to the user: 'src_embed' [V_src, d], 'tgt_embed' [V_tgt, d], 'head.weight' [V, d]
    (nn.Linear layout), and 'head.bias' when the config has one."""
    check_torch_nn_config(cfg)
    check_params(cfg, params)
    state = {}
    for ours, theirs, transpose in _mapping(cfg):
        parts = [params[name].T if transpose else params[name] for name in ours]
        state[theirs] = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=0)))
    tgt_embed = params["tgt_embed.weight"]
    extras = {
        "src_embed": torch.from_numpy(params.get("src_embed.weight", tgt_embed).copy()),
        "tgt_embed": torch.from_numpy(tgt_embed.copy()),
        "head.weight": torch.from_numpy(np.ascontiguousarray((tgt_embed.T if cfg.tie_head else params["head.weight"]).T)),
    }
    if cfg.head_bias:
        extras["head.bias"] = torch.from_numpy(params["head.bias"].copy())
    return state, extras


def from_torch_nn(cfg: ModelConfig, state: Mapping[str, torch.Tensor], extras: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """nn.Transformer state_dict + extras (as to_torch_nn gives them) -> canonical float32 params.
    Every key and shape is checked first; a mismatch raises one WeightsError with a readable diff."""
    check_torch_nn_config(cfg)
    d, shapes = cfg.d_model, param_shapes(cfg)
    mapping = _mapping(cfg)
    expected = {}
    for ours, theirs, transpose in mapping:  # nn.Transformer's [out, in], q/k/v stacked on rows
        shape = shapes[ours[0]]
        expected[theirs] = (shape[1] * len(ours), shape[0]) if transpose else (shape[0] * len(ours),)
    expected_extras = {"src_embed": (cfg.src_vocab_size, d), "tgt_embed": (cfg.tgt_vocab_size, d),
                       "head.weight": (cfg.tgt_vocab_size, d)}
    if cfg.head_bias:
        expected_extras["head.bias"] = (cfg.tgt_vocab_size,)
    _check_keys("nn.Transformer state_dict", state, expected)
    _check_keys("extras", extras, expected_extras)

    params: dict[str, np.ndarray] = {}
    for ours, theirs, transpose in mapping:
        value = state[theirs].detach().to("cpu", torch.float32).numpy()
        for name, part in zip(ours, np.split(value, len(ours), axis=0)):
            params[name] = np.ascontiguousarray(part.T if transpose else part)
    array = {name: tensor.detach().to("cpu", torch.float32).numpy() for name, tensor in extras.items()}
    params["tgt_embed.weight"] = np.ascontiguousarray(array["tgt_embed"])
    if cfg.share_src_tgt_embed:
        if not np.array_equal(array["src_embed"], array["tgt_embed"]):
            raise WeightsError("config shares source and target embeddings but the two tables differ")
    else:
        params["src_embed.weight"] = np.ascontiguousarray(array["src_embed"])
    if cfg.tie_head:
        if not np.array_equal(array["head.weight"], array["tgt_embed"]):
            raise WeightsError("config ties the head to tgt_embed but head.weight differs from it")
    else:
        params["head.weight"] = np.ascontiguousarray(array["head.weight"].T)
    if cfg.head_bias:
        params["head.bias"] = np.ascontiguousarray(array["head.bias"])
    check_params(cfg, params, where="converted nn.Transformer parameters")
    return {name: params[name] for name in param_shapes(cfg)}


def _check_keys(what: str, given: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]) -> None:
    missing = [name for name in expected if name not in given]
    unexpected = sorted(name for name in given if name not in expected)
    wrong = [f"{name}: shape {list(given[name].shape)}, expected {list(shape)}"
             for name, shape in expected.items() if name in given and tuple(given[name].shape) != shape]
    lines = ([f"- missing {name}" for name in missing] + [f"+ unexpected {name}" for name in unexpected]
             + [f"~ {line}" for line in wrong])
    if lines:
        raise WeightsError(f"{what} does not match the config ({len(lines)} difference(s)):\n  " + "\n  ".join(lines))
