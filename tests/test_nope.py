"""Layers without rotary (NoPE, SPEC §5.11: SmolLM3's no_rope_layers): the config, the golden against
transformers' own SmolLM3, the importer and the writer, and what a port that rotates them gets."""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import impl_numpy as golden  # noqa: E402
from benchmarks.checkpoints import random_checkpoint  # noqa: E402
from conformance.harness import PASS, SKIP  # noqa: E402
from conformance.tolerance import compare  # noqa: E402
from importers import import_huggingface  # noqa: E402
from importers.huggingface_writer import to_huggingface  # noqa: E402
from spec import ConfigError, conformance_params, get_preset  # noqa: E402
from tests.test_huggingface import _matrix, _with_config  # noqa: E402
from tests.test_huggingface_modern import (_padded_batch, _tolerance, _transformers_logits,  # noqa: E402
                                           written_round_trip)

SMOLLM3 = get_preset("smollm3-tiny")


def _smollm3(**fields):
    """A random SmolLM3 of 4 layers: 4 query heads of 12 over 2 key/value heads, tied, theta 3e6."""
    return transformers.SmolLM3Config(
        vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 3000000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **fields)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm3")
    # the flags written (layers 0 and 2 do not rotate), the class's default interval (layer 3 alone), and
    # windows of 5 keys on the NoPE layers (use_sliding_window), shorter than the cases' sequences
    return {"flags": random_checkpoint("smollm3", _smollm3(no_rope_layers=[0, 1, 0, 1]), root / "flags"),
            "interval": random_checkpoint("smollm3", _smollm3(), root / "interval", seed=1),
            "windowed": random_checkpoint("smollm3", _smollm3(no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
                                                              sliding_window=5), root / "windowed", seed=2)}


def test_a_nope_layer_is_its_models_layer_rotating_nothing():
    assert [SMOLLM3.layer(i).rotary_dim for i in range(4)] == [14, 0, 14, 0]
    assert SMOLLM3.layer(1).replace(rope_fraction=1.0) == SMOLLM3.layer(0)  # nothing else differs
    x, positions = np.random.default_rng(0).normal(size=(1, 2, 5, 14)), np.arange(5)
    assert np.array_equal(golden.rotary(SMOLLM3.layer(1), x, positions), x)
    assert not np.allclose(golden.rotary(SMOLLM3.layer(0), x, positions), x)
    assert SMOLLM3.first_layers(2).nope_layers == (1,) and SMOLLM3.first_layers(1).nope_layers is None
    assert type(SMOLLM3).from_json(SMOLLM3.to_json()) == SMOLLM3


@pytest.mark.parametrize("changes, message", [
    (dict(nope_layers=(3, 1)), "distinct decoder layers in increasing order"),
    (dict(nope_layers=(1, 1)), "distinct decoder layers in increasing order"),
    (dict(nope_layers=(4,)), "each in 0 .. 3"),
    (dict(nope_layers=()), "at least one"),
    (dict(nope_layers=(True,)), "decoder layer indices"),
    (dict(rope_fraction=0.01), "at least 2"),
])
def test_bad_nope_layers_are_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        SMOLLM3.replace(**changes)


def test_nope_layers_need_a_rotary_model():
    with pytest.raises(ConfigError, match="positional is 'learned'"):
        get_preset("char-lm").replace(nope_layers=(0,))


@pytest.mark.parametrize("kind, nope", [("flags", (0, 2)), ("interval", (3,)), ("windowed", (1, 3))])
def test_the_golden_equals_transformers_smollm3_at_float64(checkpoints, kind, nope):
    """A padded batch, and a 300-token prompt (past the rotary's first turns, where a NoPE layer that
    rotated would be furthest off): transformers' own SmolLM3 gives the golden's logits."""
    imported = import_huggingface(checkpoints[kind])
    cfg = imported.config
    assert imported.family == "smollm3" and cfg.nope_layers == nope and cfg.tie_head
    if kind == "windowed":  # the class's rule: its windows on the NoPE layers
        assert cfg.layer_types == ("full", "sliding", "full", "sliding") and cfg.sliding_window == 5
    ids, keep = _padded_batch(cfg)
    long_ids = np.random.default_rng(2).integers(1, cfg.tgt_vocab_size, (1, 300))
    for tokens, real in ((ids, keep), (long_ids, np.ones_like(long_ids, bool))):
        ours = golden.forward(cfg, imported.params, None, tokens, tgt_keep=real)
        result = compare(_transformers_logits(checkpoints[kind], cfg, tokens, real), ours,
                         _tolerance(cfg, tokens.shape[1]))
        assert result.passed, result.reason
        rotating = golden.forward(cfg.replace(nope_layers=None), imported.params, None, tokens, tgt_keep=real)
        assert not compare(rotating, ours, _tolerance(cfg, tokens.shape[1])).passed  # the check can fail


@pytest.mark.parametrize("windows", [None, ("sliding", "full", "full", "sliding")])
def test_smollm3_tiny_written_imports_back_and_runs_in_transformers(tmp_path, windows):
    """smollm3-tiny, and with windows of 3 keys on layers 0 and 3 (layer_types written: one slides that
    rotates, one that does not, apart from the class's default rule)."""
    cfg = SMOLLM3 if windows is None else SMOLLM3.replace(layer_types=windows, sliding_window=3)
    written_round_trip(cfg, tmp_path / "smollm3-tiny")


@pytest.mark.parametrize("changes, message", [
    (dict(qk_norm=True), "qk_norm = True with NoPE layers"),
    (dict(rope_fraction=0.3), "rope_fraction = 0.3 with NoPE layers"),
    (dict(qkv_bias=True), "qkv_bias and bias differ with NoPE layers"),
])
def test_the_writer_refuses_what_smollm3_does_not_hold(tmp_path, changes, message):
    cfg = SMOLLM3.replace(**changes)
    with pytest.raises(ConfigError, match=message):
        to_huggingface(cfg, conformance_params(cfg), tmp_path / "out")


@pytest.mark.parametrize("changes, message", [
    (dict(no_rope_layers=[1, 0]), "expected at least 4 flags"),
    (dict(no_rope_layers=[1, 2, 1, 1]), "each 1"),
    (dict(no_rope_layers=None, no_rope_layer_interval=0), "no_rope_layer_interval = 0"),
    (dict(layer_types=["full_attention"] * 3 + ["sliding_attention"], sliding_window=None), "sliding_window is null"),
])
def test_smollm3_files_the_importer_cannot_read_are_refused_by_field(tmp_path, checkpoints, changes, message):
    directory = _with_config(tmp_path, checkpoints["interval"], **changes)
    with pytest.raises(ConfigError, match=message):
        import_huggingface(directory)


def test_the_transformers_column_passes_smollm3s_whole_model_cases(checkpoints):
    results = _matrix(checkpoints["flags"], ["transformers"], ["float64", "float32"])
    ran = [r for r in results if r.status != SKIP]
    assert {r.sublayer for r in ran} == {"forward", "decode", "generate"}
    assert all(r.status == PASS for r in ran), [(r.test_id, r.reason) for r in ran if r.status != PASS]
