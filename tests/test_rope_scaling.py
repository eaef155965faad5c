"""Rescaled rotary frequencies (SPEC §5.12): linear, llama3 and yarn, in the config, the golden,
PyTorch and JAX, and against transformers' own rope functions; the importer reads them and the
writer writes them back (longrope, whose frequencies depend on the call: tests/test_longrope.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import impl_numpy as golden
from conformance.tolerance import UNIT_ROUNDOFF, tolerance
from spec import ConfigError, ModelConfig, RopeScaling, get_preset
from tests.bounds import assert_agrees, assert_differs

LLAMA3 = get_preset("llama3-tiny")
YARN = get_preset("qwen2-yarn-tiny")


# ---- the config ---------------------------------------------------------------------------------

def test_a_scaled_config_goes_through_json_and_an_unscaled_one_is_written_as_before():
    assert ModelConfig.from_json(LLAMA3.to_json()) == LLAMA3
    assert ModelConfig.from_json(YARN.to_json()) == YARN
    assert "rope_scaling" not in get_preset("llama-tiny").to_json()  # configs written before it existed read the same
    assert json.loads(LLAMA3.to_json())["rope_scaling"]["kind"] == "llama3"


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": RopeScaling(kind="ntk", factor=2.0)},
     r"rope_scaling.kind must be one of linear, llama3, yarn, longrope"),
    ({"rope_scaling": RopeScaling(kind="linear", factor=0.0)}, r"rope_scaling.factor must be positive"),
    ({"rope_scaling": RopeScaling(kind="llama3", factor=8.0)}, r"original_max_len must be a positive integer for llama3"),
    ({"rope_scaling": RopeScaling(kind="llama3", factor=8.0, original_max_len=64, low_freq_factor=4.0,
                                  high_freq_factor=1.0)}, r"llama3 needs 0 < low_freq_factor < high_freq_factor"),
    ({"rope_scaling": RopeScaling(kind="yarn", factor=4.0, original_max_len=64, beta_fast=1.0, beta_slow=32.0)},
     r"yarn needs 0 < beta_slow < beta_fast"),
    ({"rope_scaling": RopeScaling(kind="yarn", factor=4.0, original_max_len=64, mscale=float("nan"))},
     r"rope_scaling.mscale must be a finite number"),
])
def test_a_rescaling_the_spec_cannot_compute_is_refused_by_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        LLAMA3.replace(**changes)


def test_rope_scaling_needs_rotary_positions_and_its_json_names_unknown_fields():
    with pytest.raises(ConfigError, match="rope_theta, rope_fraction and rope_scaling apply to positional='rope' only"):
        get_preset("char-lm").replace(rope_scaling=RopeScaling(kind="linear", factor=2.0))
    data = json.loads(LLAMA3.to_json())
    data["rope_scaling"]["low_frequency"] = 1.0
    with pytest.raises(ConfigError, match="unknown rope_scaling field"):
        ModelConfig.from_dict(data)


# ---- the golden's frequencies, and the edges of its rules ---------------------------------------

def test_the_presets_put_a_frequency_in_every_band():
    """llama3-tiny: two kept, one blended, three divided; qwen2-yarn-tiny: two kept, one on the
    ramp, two interpolated, and the temperature on cos and sin."""
    def ratios(cfg):
        plain = cfg.rope_theta ** (-np.arange(0, cfg.rotary_dim, 2) / cfg.rotary_dim)
        return golden.rope_frequencies(cfg) / plain

    llama3 = ratios(LLAMA3)
    assert np.allclose(llama3[:2], 1) and np.allclose(llama3[3:], 1 / 32) and 1 / 32 < llama3[2] < 1
    yarn = ratios(YARN)
    assert np.allclose(yarn[:2], 1) and np.allclose(yarn[3:], 1 / 4) and 1 / 4 < yarn[2] < 1
    for middle, bands in ((llama3[2], (1 / 32, 1)), (yarn[2], (1 / 4, 1))):
        for band in bands:  # blended, beyond rounding from either band's value: not at an edge
            assert_differs(middle, band, n=1)
    assert golden.rope_attention_factor(YARN) == pytest.approx(0.1 * math.log(4) + 1)
    assert golden.rope_attention_factor(LLAMA3) == 1.0
    cos, sin = golden.rope_tables(YARN, np.arange(3))
    assert np.allclose(cos ** 2 + sin ** 2, golden.rope_attention_factor(YARN) ** 2)


@given(low=st.floats(0.5, 4), width=st.floats(0.5, 8), factor=st.floats(1.5, 64), length=st.integers(16, 100_000))
def test_the_llama3_blend_meets_both_bands_at_their_edges(low, width, factor, length):
    scaling = RopeScaling(kind="llama3", factor=factor, original_max_len=length, low_freq_factor=low,
                          high_freq_factor=low + width)
    edges = 2 * math.pi / np.array([length / low, length / (low + width)])  # ω at λ = L/low and λ = L/high
    blended = golden.model.llama3_frequencies(edges, scaling)
    expected = np.array([edges[0] / factor, edges[1]])
    # one function's rounding (SPEC §8, n = 1), which the blend amplifies as _condition says: at s = 0 by
    # (L/λ)/(high − low) · (1 − 1/f)/(1/f), at s = 1 by (L/λ)/(high − low) · (1 − 1/f)
    condition = 1 + np.array([low * (factor - 1), (low + width) * (1 - 1 / factor)]) / width
    assert np.all(np.abs(blended - expected) <= tolerance("float64", 1, 1) * condition * expected), (blended, expected)


def test_yarn_keeps_the_fast_pairs_and_interpolates_the_slow_ones():
    theta, r = 10000.0, 128
    scaling = RopeScaling(kind="yarn", factor=8.0, original_max_len=4096)
    omega = theta ** (-np.arange(0, r, 2) / r)
    scaled = golden.model.yarn_frequencies(omega, r, theta, scaling) / omega
    assert scaled[0] == 1 and scaled[-1] == pytest.approx(1 / 8)
    # the ramp only ever moves towards interpolation: no step up beyond one function's rounding (SPEC §8)
    assert np.all(np.diff(scaled) <= tolerance("float64", 1, 1))


# ---- against transformers' own rope functions -----------------------------------------------------

CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, RopeScaling(kind="linear", factor=4.0)),
    "llama3": ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1280},
               RopeScaling(kind="llama3", factor=32.0, original_max_len=1280)),
    "llama3-narrow": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 3.0,
                       "original_max_position_embeddings": 300},
                      RopeScaling(kind="llama3", factor=8.0, original_max_len=300, low_freq_factor=2.0,
                                  high_freq_factor=3.0)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
             RopeScaling(kind="yarn", factor=4.0, original_max_len=4096)),
    "yarn-deepseek": ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                       "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
                      RopeScaling(kind="yarn", factor=40.0, original_max_len=4096, mscale=0.707, mscale_all_dim=1.0,
                                  beta_fast=16.0, beta_slow=2.0, truncate=False)),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512,
                               "attention_factor": 0.9},
                              RopeScaling(kind="yarn", factor=2.0, original_max_len=512, attention_factor=0.9)),
}


def _power_rounding(theta: float, dtype: str = "float32") -> float:
    """θ^(−2i/r) taken in dtype (u its unit roundoff, 2⁻²⁴ for float32): the exponent's rounding moves
    it by up to u·|ln θ| relative, the power's own by u, and the rescaling adds a few roundings more."""
    return UNIT_ROUNDOFF[dtype] * (math.log(theta) + 4)


def _condition(cfg) -> np.ndarray:
    """How much each rescaled frequency moves, relatively, for a relative rounding of its inputs:
    1, but in llama3's blend, where s = (L/λ − low)/(high − low) turns ω's error into s's,
    amplified by (L ω / 2π) / (high − low) and weighted by (1 − 1/factor) over the blend's value,
    and on YaRN's ramp (found by hypothesis: factor 9, the ramp untruncated, θ 5e5)."""
    scaling, omega = cfg.rope_scaling, cfg.rope_theta ** (-np.arange(0, cfg.rotary_dim, 2) / cfg.rotary_dim)
    condition = np.ones_like(omega)
    if scaling.kind == "yarn":
        # ω' = ω·(1 − ramp·(1 − 1/factor)): the ramp's two roundings (a difference and a quotient, each
        # u·ramp) move ω' by 2u·ramp·(1 − 1/factor) / (1 − ramp·(1 − 1/factor)) relative
        kept = golden.rope_frequencies(cfg) / omega  # 1 − ramp·(1 − 1/factor)
        return condition + 2 * (1 - kept) / kept
    if scaling.kind != "llama3":
        return condition
    low, high, factor, length = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor, scaling.original_max_len
    turns = length * omega / (2 * math.pi)  # L / λ
    smooth = (turns - low) / (high - low)
    blended = (turns >= low) & (turns <= high)
    weight = (1 - 1 / factor) / (1 / factor + smooth * (1 - 1 / factor))
    return np.where(blended, 1 + turns / (high - low) * weight, condition)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("kind", list(CASES))
def test_the_golden_frequencies_and_temperature_equal_transformers(kind, theta):
    """transformers computes them in float32: equal to its rounding, the factor to float64's."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_parameters, ours = CASES[kind]
    cfg = LLAMA3.replace(rope_theta=theta, rope_scaling=ours, max_len=16384)
    hf = transformers.LlamaConfig(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, head_dim=cfg.d_head,
                                  max_position_embeddings=cfg.max_len,
                                  rope_parameters={**hf_parameters, "rope_theta": theta})
    frequencies, temperature = ROPE_INIT_FUNCTIONS[hf_parameters["rope_type"]](hf, "cpu")
    ours = golden.rope_frequencies(cfg)
    error = np.abs(ours - frequencies.double().numpy()) / ours
    assert np.all(error <= _power_rounding(theta) * _condition(cfg)), (error, _condition(cfg))
    assert_agrees(golden.rope_attention_factor(cfg), temperature, n=1)  # a closed form, taken in float64


# ---- PyTorch and JAX compute the same frequencies --------------------------------------------------

SCALINGS = st.one_of(
    st.builds(lambda factor: RopeScaling(kind="linear", factor=factor), st.floats(1.0, 64.0)),
    st.builds(lambda factor, length, low, width: RopeScaling(kind="llama3", factor=factor, original_max_len=length,
                                                              low_freq_factor=low, high_freq_factor=low + width),
              st.floats(1.5, 64.0), st.integers(16, 100_000), st.floats(0.5, 4.0), st.floats(0.5, 8.0)),
    st.builds(lambda factor, length, fast, slow, truncate: RopeScaling(
        kind="yarn", factor=factor, original_max_len=length, beta_fast=fast + slow, beta_slow=slow, truncate=truncate),
        st.floats(1.5, 64.0), st.integers(16, 100_000), st.floats(1.0, 64.0), st.floats(0.25, 4.0), st.booleans()),
)


@settings(max_examples=40, deadline=None)
@given(scaling=SCALINGS, theta=st.sampled_from([10000.0, 500000.0, 1000000.0]), head=st.sampled_from([8, 12, 64, 128]))
def test_torch_and_jax_frequencies_equal_the_golden(scaling, theta, head):
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax
    import impl_torch

    cfg = LLAMA3.replace(head_dim=head, rope_theta=theta, rope_scaling=scaling)
    ours = golden.rope_frequencies(cfg)
    in_torch = impl_torch.rope_frequencies(cfg, torch.float64, torch.device("cpu")).numpy()
    assert np.all(np.abs(in_torch - ours) <= _power_rounding(theta, "float64") * _condition(cfg) * ours)
    in_jax = np.asarray(impl_jax.rope_frequencies(cfg, jnp.float32), dtype=np.float64)
    assert np.all(np.abs(in_jax - ours) <= _power_rounding(theta) * _condition(cfg) * ours)
    assert impl_torch.rope_attention_factor(cfg) == impl_jax.rope_attention_factor(cfg) == golden.rope_attention_factor(cfg)


# ---- the importer and the writer -------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_directory(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from benchmarks.checkpoints import random_checkpoint

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return random_checkpoint("llama", config, tmp_path_factory.mktemp("rope") / "llama", 0)


@pytest.mark.parametrize("changes, expected", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     (500000.0, RopeScaling(kind="llama3", factor=32.0, original_max_len=8192))),
    # the older form: θ at the top, the rescaling in rope_scaling with "type"; original_max from max_position_embeddings
    ({"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
     (10000.0, RopeScaling(kind="linear", factor=2.0))),
    # YaRN's factor from the two lengths; beta 0 means the default; a top-level original_max_position_embeddings wins
    ({"rope_parameters": None, "rope_theta": 1000000.0, "original_max_position_embeddings": 512,
      "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 1024, "beta_fast": 0}},
     (1000000.0, RopeScaling(kind="yarn", factor=4.0, original_max_len=512))),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                          "mscale_all_dim": 1.0, "truncate": False, "original_max_position_embeddings": 4096}},
     (10000.0, RopeScaling(kind="yarn", factor=40.0, original_max_len=4096, mscale=0.707, mscale_all_dim=1.0,
                           truncate=False))),
    # longrope in a Llama: its factor from the two lengths where absent (2048 / 512), as transformers takes it
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
                          "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 4.0, 9.0, 20.0]}},
     (10000.0, RopeScaling(kind="longrope", factor=4.0, original_max_len=512, short_factor=(1.0, 1.5, 2.0, 3.0),
                           long_factor=(1.0, 4.0, 9.0, 20.0)))),
])
def test_the_importer_reads_each_rescaling_as_transformers_does(tmp_path, llama_directory, changes, expected):
    from importers import import_huggingface
    from tests.test_huggingface import _with_config

    imported = import_huggingface(_with_config(tmp_path, llama_directory, **changes))
    assert (imported.config.rope_theta, imported.config.rope_scaling) == expected


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r'rope_scaling.rope_type = "dynamic" \(NTK scaling.*\): the spec\'s rotary rescalings are linear, llama3, yarn '
     r"and longrope"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4}},
     r'rope_parameters has rope_type "longrope" but no long_factor'),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 3,
                          "long_factor": [2.0] * 3}}, r"rope_scaling.short_factor has 3 factors; longrope needs one "
                                                      r"per rotated pair: 4"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}},
     r'rope_parameters has rope_type "llama3" but no high_freq_factor'),
])
def test_a_rescaling_the_spec_lacks_is_refused_by_name(tmp_path, llama_directory, changes, message):
    from importers import import_huggingface
    from tests.test_huggingface import _with_config

    with pytest.raises(ConfigError, match=message):
        import_huggingface(_with_config(tmp_path, llama_directory, **changes))


@pytest.mark.parametrize("preset", ["llama3-tiny", "qwen2-yarn-tiny", "phi3-tiny"])
def test_transformers_own_rescaled_rope_passes_every_whole_model_case_at_float32(tmp_path, preset):
    """At float32 the transformers column runs its own rope functions (at float64 the spec's, as
    transformers computes them in float32 whatever the dtype): every whole-model case, the long
    and far ones too, within the golden's tolerance."""
    pytest.importorskip("transformers")
    from conformance.harness import PASS, SKIP
    from importers.huggingface_writer import to_huggingface
    from spec import conformance_params
    from tests.test_huggingface import _matrix

    cfg = get_preset(preset)
    directory = to_huggingface(cfg, conformance_params(cfg), tmp_path / preset)
    ran = [r for r in _matrix(directory, ["transformers"], ["float32"]) if r.status != SKIP]
    assert {r.mask_case for r in ran} >= {"none", "pad_left", "far", "long"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]


def test_jax_float32_yarn_ramp_within_its_rounding():
    """The case hypothesis found: a fractional ramp near 1 at factor 9 moves ω' by up to 16 u."""
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax

    cfg = LLAMA3.replace(head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(
        kind="yarn", factor=9.0, original_max_len=111, beta_fast=2.0, beta_slow=1.0, truncate=False))
    ours = golden.rope_frequencies(cfg)
    in_jax = np.asarray(impl_jax.rope_frequencies(cfg, jnp.float32), dtype=np.float64)
    assert np.all(np.abs(in_jax - ours) <= _power_rounding(cfg.rope_theta) * _condition(cfg) * ours)
