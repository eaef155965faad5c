"""An export's forward graph against the golden: the check `rosetta export` makes of what it
wrote, before anything is served from it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

import impl_numpy as golden
from conformance.cases import SUBLAYERS
from conformance.tolerance import Comparison, compare, tolerance
from spec import ModelConfig


def check_exported_forward(directory: str | Path, cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> Comparison:
    """Run the forward graph of the export in directory (onnxruntime, CPU) on a batch of 2 random
    sequences (seed 0; source length 7, target length 5) and compare its logits with the float64
    golden's at the export's dtype (SPEC.md §8)."""
    from export.runner import OnnxTransformer

    model = OnnxTransformer(directory, device="cpu")
    rng = np.random.default_rng(0)
    tgt = rng.integers(1, cfg.tgt_vocab_size, (2, 5))
    src = rng.integers(1, cfg.src_vocab_size, (2, 7)) if cfg.has_encoder else None
    return compare(model.forward(src, tgt).astype(np.float64), golden.forward(cfg, params, src, tgt),
                   tolerance(model.dtype, max(cfg.d_model, cfg.d_ff, 100), SUBLAYERS["forward"].depth(cfg)))
