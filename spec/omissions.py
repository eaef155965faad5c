"""Omissions: the features of a config that a port can leave out or miscount, each as the config
that computes without it (SPEC §11, "Omissions"). A whole-model column that fails (a peer, whose graph has no
sublayer entry points) is explained by the smallest set of omissions under which the golden
computes what it computed (conformance/diagnosis/explain.py).

Each omission changes the config only, never the weights: the golden of the changed config reads
the same tensors, those the changed config has (a sink or a router bias ignored is a tensor left
unread). Omissions of one group exclude each other (a window cannot be both ignored and one key
wider).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from spec.config import ModelConfig


@dataclass(frozen=True)
class Omission:
    name: str  # e.g. "attention_softcap ignored"
    group: str  # the feature it concerns; one omission per group in a set
    applies: Callable[[ModelConfig], bool]
    change: Callable[[ModelConfig], dict]  # the config's fields as the port computes them

    def apply(self, cfg: ModelConfig) -> ModelConfig:
        return cfg.replace(**self.change(cfg))


def _all_full(cfg: ModelConfig) -> dict:
    return {"sliding_window": None, "layer_types": None, "local_rope_theta": None}


def _every_fourth(cfg: ModelConfig) -> tuple[int, ...] | None:
    """SmolLM3's NoPE layers where its config lists none (no_rope_layer_interval 4): layers 3, 7, …"""
    return tuple(i for i in range(cfg.n_decoder_layers) if (i + 1) % 4 == 0) or None


def _yarn_truncated(cfg: ModelConfig) -> dict:
    return {"rope_scaling": dataclasses.replace(cfg.rope_scaling, truncate=True)}


def _window(delta: int) -> Callable[[ModelConfig], dict]:
    return lambda cfg: {"sliding_window": cfg.sliding_window + delta}


OMISSIONS: tuple[Omission, ...] = (
    Omission("rope scaling ignored (the plain rotary)", "rope_scaling",
             lambda cfg: cfg.rope_scaling is not None, lambda cfg: {"rope_scaling": None}),
    Omission("YaRN's ramp truncated (its ends rounded to whole dimensions)", "rope_scaling",
             lambda cfg: cfg.rope_scaling is not None and cfg.rope_scaling.kind == "yarn"
             and not cfg.rope_scaling.truncate, _yarn_truncated),
    Omission("partial rotary ignored (every dimension rotates)", "rope_fraction",
             lambda cfg: cfg.positional == "rope" and cfg.rope_fraction != 1.0, lambda cfg: {"rope_fraction": 1.0}),
    Omission("local_rope_theta ignored (sliding layers at the global θ and scaling)", "local_rope_theta",
             lambda cfg: cfg.local_rope_theta is not None, lambda cfg: {"local_rope_theta": None}),
    Omission("NoPE layers rotated (every layer rotates)", "nope_layers",
             lambda cfg: cfg.nope_layers is not None, lambda cfg: {"nope_layers": None}),
    Omission("NoPE layers placed by SmolLM3's default (every fourth from the fourth)", "nope_layers",
             lambda cfg: cfg.nope_layers is not None and cfg.nope_layers != _every_fourth(cfg),
             lambda cfg: {"nope_layers": _every_fourth(cfg)}),
    Omission("norms placed before the sublayers (Llama's block), not on their outputs", "norm_position",
             lambda cfg: cfg.norm_position == "output", lambda cfg: {"norm_position": "pre"}),
    Omission("sliding window ignored (every layer full)", "sliding_window",
             lambda cfg: cfg.sliding_window is not None, _all_full),
    Omission("sliding window one key wider (i − W ≤ j)", "sliding_window",
             lambda cfg: cfg.sliding_window is not None, _window(+1)),
    Omission("sliding window one key narrower", "sliding_window",
             lambda cfg: cfg.sliding_window is not None and cfg.sliding_window > 1, _window(-1)),
    Omission("sinks ignored (a plain softmax)", "attention_sinks",
             lambda cfg: cfg.attention_sinks, lambda cfg: {"attention_sinks": False}),
    Omission("clamped SwiGLU read as plain SwiGLU (no clamps, no + 1)", "swiglu_clamp",
             lambda cfg: cfg.swiglu_clamp is not None, lambda cfg: {"swiglu_limit": None, "swiglu_alpha": None}),
    Omission("router bias ignored", "router_bias",
             lambda cfg: cfg.moe is not None and cfg.moe.router_bias,
             lambda cfg: {"moe": dataclasses.replace(cfg.moe, router_bias=False)}),
    Omission("attention_softcap ignored", "attention_softcap",
             lambda cfg: cfg.attention_softcap is not None, lambda cfg: {"attention_softcap": None}),
    Omission("final_softcap ignored", "final_softcap",
             lambda cfg: cfg.final_softcap is not None, lambda cfg: {"final_softcap": None}),
    Omission("query_pre_attention_scalar ignored (scores by 1/√d_k)", "query_pre_attention_scalar",
             lambda cfg: cfg.query_pre_attention_scalar not in (None, cfg.d_head),  # equal to d_k it changes nothing
             lambda cfg: {"query_pre_attention_scalar": None}),
    Omission("(1 + w) norm scale read as w", "norm_scale_plus_one",
             lambda cfg: cfg.norm_scale_plus_one, lambda cfg: {"norm_scale_plus_one": False}),
    Omission("embedding scale √d ignored", "embed_scale",
             lambda cfg: cfg.embed_scale, lambda cfg: {"embed_scale": False}),
)


def applicable_omissions(cfg: ModelConfig) -> list[Omission]:
    """The omissions this config's features allow, in OMISSIONS' order."""
    return [omission for omission in OMISSIONS if omission.applies(cfg)]
