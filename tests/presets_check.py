"""Every preset through an implementation's forward, float32 against the golden (shared by the
torch and jax tests)."""

import numpy as np

import impl_numpy as golden
from conformance.tolerance import compare, tolerance
from spec import get_preset, conformance_params
from tests.bounds import model_bounds


def check_preset_forward(name: str, forward) -> None:
    """forward(cfg, params, src_ids, tgt_ids) -> logits. Each preset's widths and options at one
    layer per stack (the layers repeat, so depth adds nothing the catalogue's two-layer variants
    do not cover; layers of two kinds are each checked at their preset's full depth there)."""
    cfg = get_preset(name)
    cfg = cfg.first_layers(1).replace(n_encoder_layers=min(cfg.n_encoder_layers, 1))
    params = conformance_params(cfg)
    generator = np.random.default_rng(0)
    tgt = generator.integers(0, cfg.tgt_vocab_size, (2, 5))
    src = generator.integers(0, cfg.src_vocab_size, (2, 6)) if cfg.has_encoder else None
    logits = np.asarray(forward(cfg, params, src, tgt))
    # SPEC §8 for the whole model on these positions, counted as the forward cases count it
    bounds = model_bounds(cfg, tgt.shape[1], 0 if src is None else src.shape[1])
    relative = tolerance("float32", bounds["n"], bounds["depth"], bounds["angle"])
    result = compare(logits, golden.forward(cfg, params, src, tgt), relative)
    assert result.passed, result.reason
