"""Config variants shared by the conformance tests: together they cover every ModelConfig option."""

import dataclasses

from spec import get_preset, list_presets
from spec.params import count_params

TINY = get_preset("tiny")

VARIANTS = {
    "tiny": TINY,
    "tiny.pre_std_final": TINY.replace(norm_position="pre", norm="std", final_norm=True),
    "tiny.concat_gelu_untied": TINY.replace(positional="sinusoidal-concat", activation="gelu", tie_head=False,
                                            head_bias=True),
    "tiny.learned_swish_shared_embednorm": TINY.replace(
        positional="learned", embed_scale=False, activation="swish", src_vocab_size=80, share_src_tgt_embed=True,
        pad_id=3, embed_norm=True),
    "tiny.nobias_gelutanh": TINY.replace(qkv_bias=False, bias=False, activation="gelu-tanh", max_len=6,
                                         positional="learned"),
    "char-lm": get_preset("char-lm").replace(n_decoder_layers=2),
}


# ---- the configurations a property of the options is checked on (issue 58) ----------------------
# Whether a case sees a parameter, whether generation varies, whether the streamed golden equals the
# whole one: properties of a config's options, not of its sizes. The presets at real size (the
# paper's, torch.nn's, the Annotated Transformer's, learned-pos, the bench's smalls) carry no
# option that a tiny preset or one of VARIANTS lacks (tests/test_config.py holds that), so such a
# property is checked on PROPERTY_CONFIGS, at a hundredth of the parameters: 270 s of CI's suite.
# SIZES are the fields whose values change no option: where one is optional, its being set is the option.
SIZES = ("d_model", "n_heads", "d_ff", "dropout", "head_dim", "n_kv_heads", "n_encoder_layers", "n_decoder_layers",
         "src_vocab_size", "tgt_vocab_size", "max_len", "pad_id", "norm_eps", "rope_theta", "local_rope_theta",
         "sliding_window", "attention_softcap", "final_softcap", "query_pre_attention_scalar", "label_smoothing")
REAL_SIZE_PARAMETERS = 1_000_000  # a preset with more is at real size


def option_features(cfg) -> set[tuple[str, object]]:
    """The config's options: each field's value, a size's being set (not its value), the kinds of
    layer it stacks, its rope scaling's rule and whether it routes to experts."""
    features = set()
    for field, value in dataclasses.asdict(cfg).items():
        if field == "layer_types":
            features.add((field, tuple(sorted(set(value))) if value else None))
        elif field == "rope_scaling":
            features.add((field, None if value is None else value["kind"]))
        elif field in ("moe", "linear_attention"):  # their own fields are sizes
            features.add((field, value is not None))
        elif field in SIZES:
            features.add((field, value is not None and value != 0))
        else:
            features.add((field, repr(value)))
    return features


def _property_configs() -> dict:
    tiny_presets = {name: get_preset(name) for name in list_presets()
                    if count_params(get_preset(name)) <= REAL_SIZE_PARAMETERS}
    return {**tiny_presets, **VARIANTS}


def _property_presets() -> list[str]:
    """Every tiny preset, and a preset at real size only where it carries an option that no smaller
    preset does (learned-pos, torch-nn, annotated; not paper-base, paper-big or the bench's smalls)."""
    carried, kept = set(), []
    for name in sorted(list_presets(), key=lambda name: count_params(get_preset(name))):
        features = option_features(get_preset(name))
        if count_params(get_preset(name)) <= REAL_SIZE_PARAMETERS or not features <= carried:
            kept.append(name)
        carried |= features
    return [name for name in list_presets() if name in kept]


PROPERTY_CONFIGS = _property_configs()  # the tiny presets and the variants
PROPERTY_PRESETS = _property_presets()  # presets, where a property is of the presets' own cases
REAL_SIZE_PRESETS = [name for name in list_presets() if name not in PROPERTY_CONFIGS]
