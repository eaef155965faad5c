import dataclasses
import re
import json

import pytest

from spec import ConfigError, ModelConfig, get_preset, list_presets, param_shapes

TINY = get_preset("tiny")


def test_presets_are_listed_in_a_stable_order():
    assert list_presets() == ["tiny", "paper-base", "paper-big", "torch-nn", "annotated", "learned-pos", "char-lm",
                            "llama-tiny", "qwen2-tiny", "qwen3-tiny", "stablelm-tiny", "llama3-tiny", "qwen2-yarn-tiny",
                            "mistral-tiny", "phi3-tiny", "gemma2-tiny", "gemma3-tiny", "mixtral-tiny",
                            "qwen3-moe-tiny", "qwen35-tiny", "qwen3-next-tiny", "smollm3-tiny", "olmo2-tiny",
                            "gpt-oss-tiny",
                            "gemma2-small", "qwen35-small", "llama-small"]


@pytest.mark.parametrize("name", list_presets())
def test_json_round_trip(name):
    cfg = get_preset(name)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    # every field, but the newer ones at their defaults (rope_scaling, sliding_window, layer kinds, Gemma's, moe),
    # and longrope's factors in another rule's rope_scaling (a config written before they existed reads the same)
    newer = {"rope_scaling": None, "sliding_window": None, "layer_types": None, "local_rope_theta": None,
             "attention_softcap": None, "final_softcap": None, "norm_scale_plus_one": False, "post_norms": False,
             "query_pre_attention_scalar": None, "moe": None, "linear_attention": None,
             "attention_output_gate": False, "nope_layers": None, "qk_norm_scope": "head", "attention_sinks": False,
             "swiglu_limit": None, "swiglu_alpha": None}
    expected = {key: list(value) if key in ("layer_types", "nope_layers") and value else value
                for key, value in dataclasses.asdict(cfg).items() if key not in newer or value != newer[key]}
    if expected.get("rope_scaling"):
        expected["rope_scaling"] = {key: list(value) if isinstance(value, tuple) else value
                                    for key, value in expected["rope_scaling"].items()
                                    if key not in ("short_factor", "long_factor") or value is not None}
    if expected.get("moe"):  # a mixture without a shared expert or a router bias reads as it did before them
        expected["moe"] = {key: value for key, value in expected["moe"].items()
                           if key not in ("shared_expert_d_ff", "router_bias") or value}
    assert json.loads(cfg.to_json()) == expected


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.d_model = 32


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"n_heads": 5}, "d_model"),
        ({"d_model": 0}, "d_model"),
        ({"d_ff": -1}, "d_ff"),
        ({"n_decoder_layers": 0}, "n_decoder_layers"),
        ({"n_encoder_layers": 0}, "n_encoder_layers"),
        ({"max_len": 0}, "max_len"),
        ({"tgt_vocab_size": 0}, "tgt_vocab_size"),
        ({"pad_id": 80}, "pad_id"),
        ({"pad_id": -1}, "pad_id"),
        ({"arch": "encoder-only"}, "arch"),
        ({"norm": "groupnorm"}, "norm"),
        ({"norm_position": "sandwich"}, "norm_position"),
        ({"positional": "rope"}, "positional"),
        ({"activation": "tanh"}, "activation"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"dropout": 1.0}, "dropout"),
        ({"d_model": 64.0}, "d_model"),
        ({"d_model": True}, "d_model"),
        ({"tie_head": 1}, "tie_head"),
        ({"share_src_tgt_embed": True}, "share_src_tgt_embed"),  # vocabularies differ in tiny
        ({"d_model": 63, "n_heads": 3, "positional": "sinusoidal"}, "d_model must be even"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"head_dim": 16.0}, "head_dim"),
        ({"rope_theta": 5e5}, "positional='rope' only"),
        ({"qk_norm": True}, "qk_norm"),
        ({"gated_ffn": "yes"}, "gated_ffn"),
    ],
)
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        TINY.replace(**changes)


@pytest.mark.parametrize("changes, message", [
    ({"rope_fraction": 0.1}, "rotates 0 dimensions"),  # head_dim 8
    ({"rope_fraction": 0.375}, "rotates 3 dimensions"),
    ({"rope_fraction": 1.5}, "rope_fraction must be in"),
    ({"rope_theta": 1.0}, "rope_theta must be greater than 1"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number"),
    ({"n_heads": 5, "n_kv_heads": None}, "divisible by n_heads"),
    ({"norm": "layernorm"}, "qk_norm"),
])
def test_invalid_modern_decoders_name_the_problem(changes, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("qwen3-tiny").replace(head_dim=None, n_heads=4, n_kv_heads=2, d_model=32, qk_norm=True).replace(
            **changes)


@pytest.mark.parametrize("changes, message", [
    ({"n_experts": 1, "experts_per_token": 1}, "n_experts must be at least 2"),
    ({"experts_per_token": 6}, r"experts_per_token \(6\) cannot exceed moe.n_experts \(5\)"),
    ({"experts_per_token": 0}, "experts_per_token must be a positive integer"),
    ({"n_experts": True}, "n_experts must be a positive integer"),
    ({"renormalize": 1}, "renormalize must be true or false"),
    ({"router_softmax": "bfloat16"}, "router_softmax must be one of float32, activation"),
    ({"shared_expert_d_ff": -1}, r"shared_expert_d_ff \(the shared expert's width; 0 for none\) must be an integer"),
    ({"shared_expert_d_ff": True}, "shared_expert_d_ff .* must be an integer >= 0, got True"),
])
def test_invalid_mixtures_of_experts_name_the_field(changes, message):
    moe = get_preset("mixtral-tiny").moe
    with pytest.raises(ConfigError, match=message):
        get_preset("mixtral-tiny").replace(moe=dataclasses.replace(moe, **changes))


def test_experts_are_gated_ffns_with_the_models_biases():
    with pytest.raises(ConfigError, match="moe's experts are gated FFNs"):
        get_preset("mixtral-tiny").replace(gated_ffn=False)
    with pytest.raises(ConfigError, match="decoder-only"):
        TINY.replace(gated_ffn=True, bias=False, moe=get_preset("mixtral-tiny").moe)
    biased = get_preset("mixtral-tiny").replace(bias=True)  # gpt-oss's experts: each linear with its bias
    assert param_shapes(biased)["decoder.layers.0.ffn.experts.4.w2.bias"] == (biased.d_model,)


def test_a_mixture_of_experts_reads_back_from_json_and_a_bad_one_is_named():
    cfg = get_preset("qwen3-moe-tiny")
    data = json.loads(cfg.to_json())
    assert data["moe"] == {"n_experts": 6, "experts_per_token": 2, "renormalize": False, "router_softmax": "float32",
                           "load_balancing": 0.0}
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="unknown moe field.*top_k"):
        ModelConfig.from_dict({**data, "moe": {**data["moe"], "top_k": 2}})
    with pytest.raises(ConfigError, match="moe must be a JSON object"):
        ModelConfig.from_dict({**data, "moe": 6})
    written_before = {name: value for name, value in data["moe"].items() if name != "load_balancing"}
    assert ModelConfig.from_dict({**data, "moe": written_before}) == cfg  # a config from before the field
    shared = get_preset("qwen3-next-tiny")  # a shared expert's width is written where there is one
    assert json.loads(shared.to_json())["moe"]["shared_expert_d_ff"] == 24
    assert ModelConfig.from_json(shared.to_json()) == shared


def test_head_dim_is_decoupled_and_key_value_heads_default_to_the_heads():
    qwen3 = get_preset("qwen3-tiny")
    assert (qwen3.d_model, qwen3.n_heads, qwen3.d_head, qwen3.kv_heads, qwen3.rotary_dim) == (36, 4, 12, 2, 12)
    assert (TINY.d_head, TINY.kv_heads, TINY.rotary_dim) == (16, 4, 0)
    assert ModelConfig.from_json(qwen3.to_json()) == qwen3


def test_decoder_only_has_no_source():
    cfg = get_preset("char-lm")
    for changes in ({"n_encoder_layers": 1}, {"src_vocab_size": 10}):
        with pytest.raises(ConfigError, match="decoder-only"):
            cfg.replace(**changes)
    with pytest.raises(ConfigError, match="share_src_tgt_embed"):
        cfg.replace(share_src_tgt_embed=True)


def test_std_norm_needs_two_features():
    with pytest.raises(ConfigError, match="norm='std'"):
        ModelConfig(d_model=1, n_heads=1, d_ff=4, n_encoder_layers=1, n_decoder_layers=1, src_vocab_size=4,
                    tgt_vocab_size=4, max_len=8, positional="learned", norm="std")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"d_model": 64}', "missing config field"),
        (json.dumps({**TINY.to_dict(), "colour": "red"}), "unknown config field.*colour"),
        (json.dumps({**TINY.to_dict(), "d_model": "64"}), "d_model must be an integer"),
    ],
)
def test_bad_json_is_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_json(text)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="tiny, paper-base"):
        get_preset("gpt-5")


def test_preset_contents():
    annotated = get_preset("annotated")
    assert (annotated.norm, annotated.norm_eps, annotated.qkv_bias, annotated.final_norm) == ("std", 1e-6, False, False)
    assert (annotated.n_encoder_layers, annotated.src_vocab_size, annotated.max_len) == (8, 1024, 2048)
    torch_nn = get_preset("torch-nn")
    assert (torch_nn.norm_eps, torch_nn.final_norm, torch_nn.bias, torch_nn.qkv_bias, torch_nn.tie_head) == (1e-5, True, True, True, False)
    base = get_preset("paper-base")
    assert base.share_src_tgt_embed and base.tie_head and base.src_vocab_size == 37000
    assert get_preset("learned-pos").positional == "learned" and not get_preset("learned-pos").embed_scale
    char_lm = get_preset("char-lm")
    assert char_lm.arch == "decoder-only" and char_lm.norm_position == "pre" and char_lm.final_norm


def _porters_numbers():
    """SPEC §2's table of the numbers a port writes in: (field, where, default, {preset: value})."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "spec" / "SPEC.md").read_text()
    table = text.split("**The numbers a port writes in.**", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        field, where, default, presets = (cell.strip() for cell in line.strip("|").split("|"))
        values = dict(re.findall(r"`([\w-]+)` \(([^)]+)\)", presets))
        rows.append((field.strip("`"), where, default, {name: float(value) for name, value in values.items()}))
    return rows


# the config's value each row of the table means: the head norms' ε is norm_eps, head_dim and
# n_kv_heads are read through their defaults (d_head, kv_heads)
_VALUE = {"head_dim": lambda cfg: cfg.d_head, "n_kv_heads": lambda cfg: cfg.kv_heads}
_APPLIES = {"rotary configs": lambda cfg: cfg.positional == "rope", "every config": lambda cfg: True,
            "`norm = rmsnorm`": lambda cfg: cfg.norm == "rmsnorm", "`norm = layernorm`": lambda cfg: cfg.norm == "layernorm",
            "`qk_norm` (the head norms')": lambda cfg: cfg.qk_norm}
_DEFAULT = {"d_model / n_heads": lambda cfg: cfg.d_model // cfg.n_heads, "n_heads": lambda cfg: cfg.n_heads}


def test_every_number_a_port_writes_in_differs_from_its_default_in_some_preset():
    rows = _porters_numbers()
    assert {field for field, *_ in rows} == {"rope_theta", "norm_eps", "rope_fraction", "head_dim", "n_kv_heads"}
    for field, where, default, presets in rows:
        assert presets, f"{field} ({where}): no preset differs from {default}"
        for name, stated in presets.items():
            cfg = get_preset(name)
            value = _VALUE.get(field, lambda cfg: getattr(cfg, field))(cfg)
            common = _DEFAULT[default](cfg) if default in _DEFAULT else float(default)
            assert _APPLIES[where](cfg), f"{name} is not a config where {field} ({where}) applies"
            assert value == stated != common, f"{name}.{field} is {value}; SPEC §2 says {stated}, default {common}"


def test_the_real_size_presets_carry_no_option_the_property_configs_lack():
    """The properties of options (observability, generation's variety, the streamed golden) run on
    the tiny presets and the variants: each option of a real-size preset must be among theirs."""
    from tests.variants import PROPERTY_CONFIGS, REAL_SIZE_PRESETS, option_features

    carried = set().union(*(option_features(cfg) for cfg in PROPERTY_CONFIGS.values()))
    assert {"paper-base", "paper-big", "llama-small", "gemma2-small", "qwen35-small"} <= set(REAL_SIZE_PRESETS)
    for name in REAL_SIZE_PRESETS:
        assert option_features(get_preset(name)) <= carried, (name, option_features(get_preset(name)) - carried)
    # and the check can fail: an option no tiny configuration has
    assert not option_features(get_preset("llama-tiny").replace(rope_fraction=0.5)) <= carried


def test_the_property_presets_leave_out_only_real_size_presets_whose_options_they_carry():
    from tests.variants import PROPERTY_PRESETS, option_features

    carried = set().union(*(option_features(get_preset(name)) for name in PROPERTY_PRESETS))
    left_out = [name for name in list_presets() if name not in PROPERTY_PRESETS]
    assert left_out == ["paper-base", "paper-big", "gemma2-small", "qwen35-small", "llama-small"]
    assert all(option_features(get_preset(name)) <= carried for name in left_out)
