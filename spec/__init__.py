"""Transformer Rosetta's spec: the single source of truth for names, shapes and semantics.

Depends on NumPy and safetensors only. The prose contract is spec/SPEC.md.
"""

from spec.config import (ACTIVATIONS, ARCHS, NORM_POSITIONS, NORMS, POSITIONALS, ROPE_SCALINGS, GatedDeltaNet,
                         MixtureOfExperts, ModelConfig, RopeScaling)
from spec.errors import ConfigError, InputError, SpecError, WeightsError
from spec.masks import (
    causal_mask,
    combine_masks,
    cross_mask,
    decoder_self_mask,
    encoder_self_mask,
    key_mask,
    normalize_mask,
    padding_mask,
)
from spec.params import (
    PARAM_DTYPE,
    check_params,
    conformance_params,
    count_params,
    init_params,
    param_shapes,
    params_digest,
    params_under,
)
from spec.presets import describe_preset, get_preset, list_presets
from spec.version import FORMAT_VERSION, SPEC_VERSION
from spec.weights import load_weights, read_config, save_weights

__all__ = [
    "ACTIVATIONS", "ARCHS", "NORMS", "NORM_POSITIONS", "POSITIONALS", "ROPE_SCALINGS",
    "ModelConfig", "RopeScaling", "MixtureOfExperts", "GatedDeltaNet", "get_preset", "list_presets", "describe_preset",
    "init_params", "conformance_params", "param_shapes", "count_params", "check_params", "params_digest", "params_under",
    "PARAM_DTYPE", "save_weights", "load_weights", "read_config",
    "padding_mask", "key_mask", "causal_mask", "combine_masks", "normalize_mask",
    "encoder_self_mask", "decoder_self_mask", "cross_mask",
    "SpecError", "ConfigError", "WeightsError", "InputError",
    "SPEC_VERSION", "FORMAT_VERSION",
]
