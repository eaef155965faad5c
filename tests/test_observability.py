"""Every parameter and every behavioural input is seen by some checked output (SPEC.md §4.1).

Perturbing one parameter tensor by 0.5% of itself (SPEC §4.1's rule, whatever the loosest cell's
tolerance) must move some case's golden output beyond that case's float32 tolerance; so must changing
eos_id or bos_id, masking one kept position, or moving a position offset. Whether a parameter or
an input reaches a checked output is a property of the config's options, not of its sizes: the checks
run on tests/variants.PROPERTY_CONFIGS (the tiny presets and the variants, which carry every option of
the presets at real size), each with at most 2 layers per stack and a 512-token vocabulary: a layer
past the second is seen the way the second is, and the vocabulary's size changes no parameter's kind.
"""

import dataclasses

import numpy as np
import pytest

from conformance.diagnosis.observability import INVISIBLE, input_observations, invisible_reason, parameter_observations
from conformance.cases import TGT_LEN
from conformance.tolerance import tolerance
from spec import conformance_params, get_preset, init_params
from tests.bounds import assert_agrees
from tests.variants import PROPERTY_CONFIGS


def _checked(name):
    """The configuration, cut to two layers a stack and a 512-token vocabulary."""
    cfg = PROPERTY_CONFIGS[name]
    layers = 2
    cut = {}
    if cfg.n_encoder_layers > layers:
        cut["n_encoder_layers"] = layers
    # a hybrid keeps its layers: its first two are linear, its attention the fourth (SPEC §5.15)
    if cfg.n_decoder_layers > layers and cfg.linear_attention is None:
        cut["n_decoder_layers"] = layers
    if cfg.tgt_vocab_size > 512:
        cut["tgt_vocab_size"] = 512
        if cfg.has_encoder:
            cut["src_vocab_size"] = 512
    if "n_decoder_layers" in cut:  # the first layers, each of its own kind (SPEC §6)
        cfg = cfg.first_layers(cut.pop("n_decoder_layers"))
    return cfg.replace(**cut) if cut else cfg


@pytest.mark.parametrize("preset", PROPERTY_CONFIGS)
def test_every_parameter_is_seen(preset):
    cfg = _checked(preset)
    observations = list(parameter_observations(cfg, conformance_params(cfg), "float32"))
    unseen = [f"{o.subject} (moved {o.ratio:.2g} tol at most)" for o in observations
              if o.seen_by is None and invisible_reason(cfg, o.subject) is None]
    assert not unseen, "parameters no case observes:\n" + "\n".join(unseen)
    # what the spec calls invisible is so: the golden's float64 rounding alone moves the outputs, within
    # each case's float64 tolerance, which is u_float64 / u_float32 = 2⁻²⁹ of the float32 one the ratio counts
    float64_rounding = tolerance("float64", 1, 1) / tolerance("float32", 1, 1)
    assert all(o.ratio <= float64_rounding for o in observations if invisible_reason(cfg, o.subject))


@pytest.mark.parametrize("preset", PROPERTY_CONFIGS)
def test_every_behavioural_input_is_seen(preset):
    cfg = _checked(preset)
    observations = input_observations(cfg, conformance_params(cfg))
    subjects = {o.subject.split(": ")[1] for o in observations}
    # RoPE's offset enters attention only, where a shift of every position moves no score
    # a learned table as short as tiny.nobias_gelutanh's (6 positions) has no room for an offset one further
    offsets = cfg.positional != "rope" and (cfg.positional != "learned" or cfg.max_len > TGT_LEN + 1)
    linear = {"tgt_keep"} if cfg.linear_attention is not None else set()  # a linear layer's pads
    assert {"eos_id", "mask", "self_mask"} | linear | ({"position offset"} if offsets else set()) <= subjects
    assert ("bos_id" in subjects) == cfg.has_encoder
    unseen = [f"{o.subject} (moved {o.ratio:.2g} tol)" for o in observations if o.seen_by is None]
    assert not unseen, "inputs no case observes:\n" + "\n".join(unseen)


def test_the_paper_initialisation_leaves_parameters_unseen():
    """The hole the conformance weights close: on init_params a zero bias perturbed relatively
    stays zero, a unit scale barely moves the post-LN output, and no case sees them."""
    cfg = get_preset("tiny")
    unseen = {o.subject for o in parameter_observations(cfg, init_params(cfg), "float32")
              if o.seen_by is None and invisible_reason(cfg, o.subject) is None}
    assert "encoder.layers.0.ffn.w1.bias" in unseen and "decoder.layers.1.ffn_norm.bias" in unseen


def test_a_key_bias_moves_no_output():
    """The one parameter kind the spec names invisible, shown on a bias of 0.5 everywhere."""
    from impl_numpy import multi_head_attention

    cfg = get_preset("tiny")
    p = {k[len("encoder.layers.0.self_attn."):]: v.astype(np.float64) for k, v in conformance_params(cfg).items()
         if k.startswith("encoder.layers.0.self_attn.")}
    x = np.random.default_rng(0).standard_normal((2, 5, cfg.d_model))
    shifted = {**p, "k.bias": p["k.bias"] + 0.5}
    assert list(INVISIBLE) == ["k.bias"]
    # the mha case's bounds: one sublayer, d its longest sum (5 keys)
    assert_agrees(multi_head_attention(cfg, shifted, x, x, None), multi_head_attention(cfg, p, x, x, None),
                  n=cfg.d_model)


def test_a_loose_cell_does_not_widen_the_perturbation(monkeypatch):
    """The rule is a share of each tensor (SPEC §4.1), not a number of the loosest cell's
    tolerances: a catalogue that gains a cell a million times looser sees every tensor exactly as
    before. Under the old rule the loose cell widened the perturbation by a million, and every
    tensor read as seen, holes included."""
    import conformance.diagnosis.observability as observability
    from conformance.cases import catalogue

    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    before = {o.subject: (o.seen_by, o.ratio) for o in parameter_observations(cfg, params)}

    def with_a_loose_cell(cfg, params, backward=False):
        cases = catalogue(cfg, params, backward)
        loose = next(case for case in cases if case.sublayer == "ffn")
        return cases + [dataclasses.replace(loose, mask_case="loose", reduction_length=10 ** 12)]

    monkeypatch.setattr(observability, "catalogue", with_a_loose_cell)
    after = {o.subject: (o.seen_by, o.ratio) for o in parameter_observations(cfg, params)}
    assert after == before
