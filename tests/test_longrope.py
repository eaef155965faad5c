"""LongRoPE (SPEC §5.12): a short and a long factor per rotated pair, the long ones for a call
longer than the original context L, and the rule for which length counts: 1 + the largest
position of the call, per call, with the cache keeping keys as their own call rotated them.
Against transformers' own longrope functions and Phi3ForCausalLM; in the golden, PyTorch, JAX and
the ONNX export, forward and cached decoding across L."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

import impl_numpy as golden
from conformance.tolerance import rotary_angle
from spec import ConfigError, ModelConfig, RopeScaling, conformance_params, get_preset
from tests.bounds import assert_agrees, assert_differs, model_bounds
from tests.test_rope_scaling import _power_rounding

PHI3 = get_preset("phi3-tiny")
SCALING = PHI3.rope_scaling
# phi3-tiny with an original context of 6: a decode that prefills 5 positions crosses it at its second step
SHORT_CONTEXT = PHI3.replace(rope_scaling=dataclasses.replace(SCALING, original_max_len=6))


def _ids(cfg, length, batch=2, seed=0):
    return np.random.default_rng(seed).integers(1, cfg.tgt_vocab_size, (batch, length))


def _cached_decode(cfg, ids, prefix):
    """The golden's decode: the first `prefix` tokens in one call, then a call per token."""
    p = golden.cast_params(cfg, conformance_params(cfg))
    logits, cache = golden.decode_step(cfg, p, golden.start_cache(cfg, p, ids.shape[0]), ids[:, :prefix])
    steps = [logits]
    for t in range(prefix, ids.shape[1]):
        logits, cache = golden.decode_step(cfg, p, cache, ids[:, t:t + 1])
        steps.append(logits)
    return np.concatenate(steps, axis=1)


# ---- the config ---------------------------------------------------------------------------------

def test_a_longrope_config_goes_through_json_with_its_factors():
    text = PHI3.to_json()
    assert json.loads(text)["rope_scaling"]["short_factor"] == list(SCALING.short_factor)
    assert ModelConfig.from_json(text) == PHI3
    assert "short_factor" not in get_preset("llama3-tiny").to_json()  # the other rules' JSON as before


@pytest.mark.parametrize("changes, message", [
    ({"short_factor": (1.0, 2.0)}, r"rope_scaling.short_factor has 2 factors; longrope needs one per rotated pair: 6"),
    ({"long_factor": (1.0, 2.0, 0.0, 1.0, 1.0, 1.0)}, r"rope_scaling.long_factor must be a list of positive numbers"),
    ({"long_factor": None}, r"rope_scaling.long_factor must be a list of positive numbers"),
    ({"original_max_len": None}, r"original_max_len must be a positive integer for longrope"),
    ({"attention_factor": -1.0}, r"rope_scaling.attention_factor must be positive"),
])
def test_a_longrope_the_spec_cannot_compute_is_refused_by_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        PHI3.replace(rope_scaling=dataclasses.replace(SCALING, **changes))


def test_factors_belong_to_longrope_only():
    yarn = get_preset("qwen2-yarn-tiny")
    with pytest.raises(ConfigError, match="short_factor and long_factor are longrope's; yarn has none"):
        yarn.replace(rope_scaling=dataclasses.replace(yarn.rope_scaling, short_factor=(1.0,) * 5))


# ---- the rule ------------------------------------------------------------------------------------

def test_the_long_factors_start_strictly_past_the_original_context():
    omega = PHI3.rope_theta ** (-np.arange(0, 12, 2) / 12)
    for length, factors in ((None, SCALING.short_factor), (1, SCALING.short_factor), (1002, SCALING.short_factor),
                            (1003, SCALING.long_factor), (4096, SCALING.long_factor)):
        ours = golden.rope_frequencies(PHI3, length)
        assert np.all(np.abs(ours - omega / np.array(factors)) <= _power_rounding(PHI3.rope_theta, "float64") * ours)
    assert golden.rope_attention_factor(PHI3) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1002)))
    no_gain = PHI3.replace(rope_scaling=dataclasses.replace(SCALING, factor=1.0))
    given = PHI3.replace(rope_scaling=dataclasses.replace(SCALING, attention_factor=0.8))
    assert (golden.rope_attention_factor(no_gain), golden.rope_attention_factor(given)) == (1.0, 0.8)


def test_a_call_takes_its_frequencies_from_its_largest_position():
    """The tables of positions 0..1001 (ℓ = 1002) are short; the same positions inside a call that
    reaches 1002 (ℓ = 1003) are long: a position's angle depends on its call."""
    short, _ = golden.rope_tables(PHI3, np.arange(1002))
    long, _ = golden.rope_tables(PHI3, np.arange(1003))
    assert np.array_equal(short[:1], long[:1])  # position 0 turns by nothing either way
    assert_differs(short[1:1002], long[1:1002], n=1, angle=rotary_angle(PHI3, 1001))
    same_call, _ = golden.rope_tables(PHI3, np.array([5, 1002]))
    np.testing.assert_array_equal(same_call[0], long[5])


def test_the_cached_decode_is_the_forward_unless_a_call_crosses_the_original_context():
    """Short throughout (phi3-tiny: L 1002) and long throughout (a prefill past L = 6): the golden's
    cached decode equals its forward. Crossing L (prefill 5 ≤ 6, steps at ℓ 6, 7, 8): the cached
    keys keep the short factors while the forward rotates all with the long ones, so they differ
    from the step at ℓ = 7 on, and agree before it."""
    ids = _ids(PHI3, 9)
    forward = golden.forward(PHI3, conformance_params(PHI3), None, ids)
    assert_agrees(_cached_decode(PHI3, ids, 5), forward, **model_bounds(PHI3, 9), what="short throughout")
    ids = _ids(SHORT_CONTEXT, 10)
    forward = golden.forward(SHORT_CONTEXT, conformance_params(SHORT_CONTEXT), None, ids)
    assert_agrees(_cached_decode(SHORT_CONTEXT, ids, 7), forward, **model_bounds(SHORT_CONTEXT, 10),
                  what="long throughout")
    crossing = _cached_decode(SHORT_CONTEXT, ids, 5)
    short_forward = golden.forward(SHORT_CONTEXT, conformance_params(SHORT_CONTEXT), None, ids[:, :6])
    assert_agrees(crossing[:, :6], short_forward, **model_bounds(SHORT_CONTEXT, 6), what="every call ℓ ≤ 6")
    for row in range(2):  # every row, every step past
        for step in range(6, 10):
            assert_differs(crossing[row, step], forward[row, step], **model_bounds(SHORT_CONTEXT, 10),
                           what=f"row {row} step {step}")


# ---- against transformers -------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [4.0, None])  # None: Phi-3's files, the ratio of the two lengths
def test_the_golden_frequencies_and_factor_equal_transformers_on_both_sides_of_the_switch(factor):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "longrope", "rope_theta": PHI3.rope_theta, "partial_rotary_factor": 0.75,
                  "short_factor": list(SCALING.short_factor), "long_factor": list(SCALING.long_factor),
                  "original_max_position_embeddings": 1002, **({} if factor is None else {"factor": factor})}
    hf = transformers.Phi3Config(hidden_size=80, num_attention_heads=5, num_key_value_heads=1,
                                 max_position_embeddings=4008, original_max_position_embeddings=1002,
                                 rope_parameters=parameters)
    cfg = PHI3.replace(max_len=4008, rope_scaling=dataclasses.replace(SCALING, factor=factor or 4008 / 1002))
    for length in (1002, 1003):
        frequencies, attention = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=length)
        # transformers' are float32: θ^(−2i/r)'s rounding, u·(ln θ + 4) relative (tests/test_rope_scaling.py)
        np.testing.assert_allclose(frequencies.double().numpy(), golden.rope_frequencies(cfg, length),
                                   rtol=_power_rounding(PHI3.rope_theta))
        assert_agrees(golden.rope_attention_factor(cfg), attention, n=1)  # a closed form, taken in float64


def test_phi3_with_longrope_computes_the_golden_on_both_sides_of_the_switch(tmp_path):
    """transformers' own Phi3ForCausalLM at float32 (its own longrope and float32 tables) on the
    weights written from phi3-tiny: within SPEC §8's float32 tolerance of the golden at ℓ = 1002
    (short) and ℓ = 1003 (long); the long tables where the short ones are meant miss it by far."""
    pytest.importorskip("transformers")
    from importers.huggingface_writer import to_huggingface
    from tests.test_huggingface_modern import _transformers_logits

    params = conformance_params(PHI3)
    directory = to_huggingface(PHI3, params, tmp_path / "phi3")
    for length in (1002, 1003):
        ids = _ids(PHI3, length, batch=1)
        keep = np.ones_like(ids, bool)
        theirs = _transformers_logits(directory, PHI3, ids, keep, dtype="float32", widened=False)
        ours = golden.forward(PHI3, params, None, ids)
        assert_agrees(theirs, ours, dtype="float32", **model_bounds(PHI3, length), what=f"ℓ = {length}")
    always_long = PHI3.replace(rope_scaling=dataclasses.replace(SCALING, short_factor=SCALING.long_factor))
    ids = _ids(PHI3, 1002, batch=1)
    wrong = golden.forward(always_long, params, None, ids)
    assert_differs(_transformers_logits(directory, PHI3, ids, np.ones_like(ids, bool), dtype="float32", widened=False),
                   wrong, dtype="float32", **model_bounds(PHI3, 1002))


# ---- the frameworks ------------------------------------------------------------------------------

def test_torch_and_jax_take_the_factors_by_the_length_they_are_given():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax
    import impl_torch

    for length in (1002, 1003):
        ours = golden.rope_frequencies(PHI3, length)
        in_torch = impl_torch.rope_frequencies(PHI3, torch.float64, torch.device("cpu"), torch.tensor(length))
        np.testing.assert_allclose(in_torch.numpy(), ours, rtol=_power_rounding(PHI3.rope_theta, "float64"))
        in_jax = impl_jax.rope_frequencies(PHI3, jnp.float32, jnp.asarray(length))
        np.testing.assert_allclose(np.asarray(in_jax, np.float64), ours, rtol=_power_rounding(PHI3.rope_theta))
    assert impl_torch.rope_attention_factor(PHI3) == impl_jax.rope_attention_factor(PHI3) == \
        golden.rope_attention_factor(PHI3)


@pytest.mark.parametrize("backend", ["torch", "jax", "onnx"])
def test_every_implementation_decodes_across_the_original_context_as_the_golden(backend):
    """A context of 6 puts every decode case across it (prefill, then steps past ℓ = 6) and the
    forward cases on both sides: each backend's forward, cached decode and generation pass, the
    decode cases against the golden's own cached decode (not the forward, which they are not)."""
    from conformance.harness import PASS, SKIP, plan_matrix, run_matrix

    cfg = SHORT_CONTEXT
    plan = plan_matrix(cfg, [backend], ["float32"], ["cpu"])
    ran = [r for sublayer in ("forward", "decode", "generate")
           for r in run_matrix(cfg, conformance_params(cfg), plan, pattern=f"{sublayer}-*") if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}, {r.sublayer for r in ran}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]
