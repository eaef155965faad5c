"""Dropout with given keep-masks (SPEC.md §5.10): where the paper drops units, the names of those
places, the masks a run may be handed, and their checks. Conformance runs without dropout by
default; a case with dropout hands every implementation the same keep-masks, so all of them drop
the same units."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from spec.config import ModelConfig
from spec.errors import InputError
from spec.inputs import dtype_name


def dropout_sites(cfg: ModelConfig) -> list[str]:
    """Where the paper applies dropout (§5.4 of the paper): the sum of the embeddings and the
    positions of each stack ('encoder.embed', 'decoder.embed'), and the output of every sublayer
    before it is added to the residual ('decoder.layers.0.self_attn', '….cross_attn', '….ffn')."""
    sites = []
    for stack, layers in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        if layers == 0:
            continue
        sites.append(f"{stack}.embed")
        for i in range(layers):
            blocks = ("self_attn", "cross_attn", "ffn") if stack == "decoder" and cfg.has_encoder else ("self_attn", "ffn")
            sites += [f"{stack}.layers.{i}.{block}" for block in blocks]
    return sites


def draw_dropout_masks(cfg: ModelConfig, rng: np.random.Generator, batch: int, src_length: int | None,
                       tgt_length: int) -> dict[str, np.ndarray]:
    """A keep-mask [B, T, d] for every site, each unit kept with probability 1 − cfg.dropout."""
    masks = {}
    for site in dropout_sites(cfg):
        length = src_length if site.startswith("encoder") else tgt_length
        masks[site] = rng.random((batch, length, cfg.d_model)) >= cfg.dropout
    return masks


def check_dropout_masks(cfg: ModelConfig, masks: Any, batch: int, src_length: int | None, tgt_length: int) -> None:
    """Keep-masks must be boolean, one per site of the model, each [B, T, d] of its stack, and
    need a config with dropout > 0 (their scale is 1 / (1 − dropout))."""
    if masks is None:
        return
    if not isinstance(masks, Mapping):
        raise InputError(f"dropout_masks must be a mapping from site names to keep-masks, got {type(masks).__name__}")
    if not cfg.dropout > 0:
        raise InputError("dropout_masks given to a config with dropout 0: set dropout (the masks are scaled by "
                         "1 / (1 − dropout))")
    sites = dropout_sites(cfg)
    missing, unexpected = sorted(set(sites) - set(masks)), sorted(set(masks) - set(sites))
    if missing or unexpected:
        raise InputError(f"dropout_masks: missing {missing or 'none'}, unexpected {unexpected or 'none'} "
                         f"(sites: {', '.join(sites)})")
    for site, mask in masks.items():
        length = src_length if site.startswith("encoder") else tgt_length
        shape = tuple(np.shape(mask))
        if dtype_name(mask) != "bool" or shape != (batch, length, cfg.d_model):
            raise InputError(f"dropout_masks[{site!r}] must be a boolean keep-mask of shape "
                             f"{[batch, length, cfg.d_model]}, got {dtype_name(mask)} {list(shape)}")


def masks_under(masks: Mapping[str, Any] | None, prefix: str) -> dict[str, Any] | None:
    """The keep-masks below one module, names relative to it (as params_under); None stays None."""
    if masks is None:
        return None
    start = prefix + "."
    return {name[len(start):]: mask for name, mask in masks.items() if name.startswith(start)}
