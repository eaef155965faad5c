"""A from-scratch GPT-style decoder in PyTorch, written the way tutorials write one — its own
parameter names, a fused q/k/v projection, nn.Linear's [out, in] weights — checked against the
golden with conformance.byo. It implements the `char-lm` preset's semantics (decoder-only,
pre-LN with a final norm, learned positions, tanh GELU, tied head).

    python -m examples.nanogpt_style        # prints the conformance table for this model
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapter import NotSupported, register_backend
from conformance.byo import CustomBackend, map_parameters
from spec import ModelConfig
from spec.inputs import mask_shape_4d


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)  # q, k and v in one matrix
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        q, k, v = self.c_attn(x).split(d_model, dim=2)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        y = torch.where(keep.any(dim=-1, keepdim=True), y, 0.0)  # the spec: a row with no key gives 0, whatever the kernel does
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, d_model))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff)
        self.c_proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pad_id = cfg.pad_id
        self.wte = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_len, cfg.d_model)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_decoder_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def embed(self, idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(offset, offset + idx.shape[1]))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        keep = torch.ones(length, length, dtype=torch.bool).tril() & (idx != self.pad_id)[:, None, None, :]
        x = self.embed(idx)
        for block in self.h:
            x = block(x, keep)
        return self.ln_f(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wte.weight.T  # tied with the token embedding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden(idx))


# ---- the adapter: one mapping of names, and hooks for the sublayers this model has -------------

def parameter_mapping(cfg: ModelConfig) -> dict[str, tuple]:
    """Your parameter <- (canonical name(s), transform)."""
    mapping = {"wte.weight": ("tgt_embed.weight", "copy"), "wpe.weight": ("tgt_pos.weight", "copy"),
               "ln_f.weight": ("decoder.norm.scale", "copy"), "ln_f.bias": ("decoder.norm.bias", "copy")}
    for i in range(cfg.n_decoder_layers):
        ours, spec = f"h.{i}", f"decoder.layers.{i}"
        mapping.update({
            f"{ours}.ln_1.weight": (f"{spec}.self_attn_norm.scale", "copy"),
            f"{ours}.ln_1.bias": (f"{spec}.self_attn_norm.bias", "copy"),
            f"{ours}.attn.c_attn.weight": ([f"{spec}.self_attn.{p}.weight" for p in "qkv"], "stack"),
            f"{ours}.attn.c_attn.bias": ([f"{spec}.self_attn.{p}.bias" for p in "qkv"], "stack"),
            f"{ours}.attn.c_proj.weight": (f"{spec}.self_attn.o.weight", "transpose"),
            f"{ours}.attn.c_proj.bias": (f"{spec}.self_attn.o.bias", "copy"),
            f"{ours}.ln_2.weight": (f"{spec}.ffn_norm.scale", "copy"),
            f"{ours}.ln_2.bias": (f"{spec}.ffn_norm.bias", "copy"),
            f"{ours}.mlp.c_fc.weight": (f"{spec}.ffn.w1.weight", "transpose"),
            f"{ours}.mlp.c_fc.bias": (f"{spec}.ffn.w1.bias", "copy"),
            f"{ours}.mlp.c_proj.weight": (f"{spec}.ffn.w2.weight", "transpose"),
            f"{ours}.mlp.c_proj.bias": (f"{spec}.ffn.w2.bias", "copy"),
        })
    return mapping


def build(cfg: ModelConfig, params, dtype: str, device: str) -> GPT:
    model = GPT(cfg).eval()
    own_shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    state = map_parameters(params, parameter_mapping(cfg), own_shapes)
    model.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    return model


def _layer(path: str) -> int:
    return int(path.split(".")[2])  # "decoder.layers.3.ffn" -> 3


def _keep(mask, x: torch.Tensor, n_heads: int) -> torch.Tensor:
    length = x.shape[1]
    if mask is None:
        return torch.ones(1, 1, length, length, dtype=torch.bool)
    return torch.as_tensor(np.asarray(mask)).reshape(mask_shape_4d(mask, x.shape[0], n_heads, length, length))


def _self_attention(model: GPT, inputs):
    if inputs["x"] is not inputs["context"]:
        raise NotSupported("this model has self-attention only")
    x = torch.as_tensor(inputs["x"])
    return model.h[_layer(inputs["module"])].attn(x, _keep(inputs["mask"], x, model.h[0].attn.n_heads))


def _norm(model: GPT, inputs):
    path = inputs["module"]
    norm = model.ln_f if path == "decoder.norm" else getattr(
        model.h[_layer(path)], {"self_attn_norm": "ln_1", "ffn_norm": "ln_2"}[path.split(".")[-1]])
    return norm(torch.as_tensor(inputs["x"]))


def _decoder_layer(model: GPT, inputs):
    y = torch.as_tensor(inputs["y"])
    return model.h[inputs["index"]](y, _keep(inputs["self_mask"], y, model.h[0].attn.n_heads))


HOOKS = {
    "embedding": lambda m, i: m.embed(torch.as_tensor(i["ids"]), i["offset"]),
    "mha": _self_attention,
    "ffn": lambda m, i: m.h[_layer(i["module"])].mlp(torch.as_tensor(i["x"])),
    "norm": _norm,
    "decoder_layer": _decoder_layer,
    "decoder": lambda m, i: m.hidden(torch.as_tensor(i["tgt_ids"])),
    "logits": lambda m, i: m.logits(torch.as_tensor(i["h"])),
    "forward": lambda m, i: m(torch.as_tensor(i["tgt_ids"])),
}


def backend(name: str = "nanogpt-style") -> CustomBackend:
    def to_numpy(tensor: torch.Tensor) -> np.ndarray:
        return tensor.detach().numpy()

    def run_in_inference_mode(hook):
        def wrapped(model, inputs):
            with torch.inference_mode():
                return hook(model, inputs)
        return wrapped

    return CustomBackend(name, build, {k: run_in_inference_mode(h) for k, h in HOOKS.items()}, to_numpy=to_numpy)


if __name__ == "__main__":
    from rosetta.main import main

    register_backend("nanogpt-style", backend)
    sys.exit(main(["check", "--preset", "char-lm", "--backends", "nanogpt-style", "--dtypes", "float32", *sys.argv[1:]]))
