"""Dropout with given keep-masks (SPEC.md §5.10): the sites, the checks, the golden forward and
backward with masks audited by central differences, and PyTorch and JAX dropping the same units.
The bounds are SPEC §8's at float64 (tests/bounds.py), counted as tests/test_backward_model.py counts
them for the same configurations and batch."""

import numpy as np
import pytest

import impl_numpy as golden
from conformance.cases import SUBLAYERS
from impl_numpy import backward
from spec.dropout import check_dropout_masks, draw_dropout_masks, dropout_sites
from spec.errors import InputError
from tests.bounds import assert_agrees, assert_derivative, assert_differs, model_bounds
from tests.test_backward_model import CONFIGS, STEP, _batch, _loss_rounding, _reduction

# a hybrid has no dropout (its config refuses one: Qwen3.5's and Qwen3-Next's layers have none)
DROPPED = {name: cfg.replace(dropout=0.25) for name, cfg in CONFIGS.items() if cfg.linear_attention is None}


def _masks(cfg, src, tgt):
    return draw_dropout_masks(cfg, np.random.default_rng(7), tgt.shape[0], None if src is None else src.shape[1],
                              tgt.shape[1])


def _loss(cfg, p, src, tgt, targets, masks):
    return golden.token_cross_entropy(cfg, golden.model_logits(cfg, p, src, tgt, dropout_masks=masks), targets)


def test_the_sites_are_the_papers():
    cfg = DROPPED["encoder-decoder-post-shared-tied"]
    assert dropout_sites(cfg) == ["encoder.embed", "encoder.layers.0.self_attn", "encoder.layers.0.ffn",
                                  "encoder.layers.1.self_attn", "encoder.layers.1.ffn", "decoder.embed",
                                  "decoder.layers.0.self_attn", "decoder.layers.0.cross_attn", "decoder.layers.0.ffn",
                                  "decoder.layers.1.self_attn", "decoder.layers.1.cross_attn", "decoder.layers.1.ffn"]
    assert dropout_sites(DROPPED["decoder-only-pre-learned-tied"])[:3] == [
        "decoder.embed", "decoder.layers.0.self_attn", "decoder.layers.0.ffn"]


@pytest.mark.parametrize("change, message", [
    (lambda m: {k: v for k, v in m.items() if k != "decoder.embed"}, "missing \\['decoder.embed'\\]"),
    (lambda m: {**m, "decoder.layers.9.ffn": m["decoder.embed"]}, "unexpected \\['decoder.layers.9.ffn'\\]"),
    (lambda m: {**m, "decoder.embed": m["decoder.embed"].astype(np.float32)}, "must be a boolean keep-mask"),
    (lambda m: {**m, "encoder.embed": m["encoder.embed"][:, :2]}, "of shape \\[2, 5, 8\\]"),
])
def test_bad_masks_are_refused(change, message):
    cfg = DROPPED["encoder-decoder-post-shared-tied"]
    src, tgt, _ = _batch(cfg)
    with pytest.raises(InputError, match=message):
        check_dropout_masks(cfg, change(_masks(cfg, src, tgt)), 2, 5, 6)
    with pytest.raises(InputError, match="dropout 0"):
        check_dropout_masks(cfg.replace(dropout=0.0), _masks(cfg, src, tgt), 2, 5, 6)


@pytest.mark.parametrize("name", list(DROPPED))
def test_the_golden_backward_with_dropout_agrees_with_central_differences(name):
    cfg = DROPPED[name]
    src, tgt, targets = _batch(cfg)
    masks = _masks(cfg, src, tgt)
    p = golden.cast_params(cfg, __import__("spec").conformance_params(cfg, seed=1))
    loss, grads = backward.loss_and_gradients(cfg, p, src, tgt, targets, dropout_masks=masks)
    # the same computation: loss_and_gradients runs model_logits and token_cross_entropy on these inputs
    assert loss == _loss(cfg, p, src, tgt, targets, masks)
    assert_differs(loss, _loss(cfg, p, src, tgt, targets, None), n=_reduction(cfg, (src, tgt, targets)),
                   depth=SUBLAYERS["loss"].depth(cfg), what="the masks matter")
    rounding = _loss_rounding(cfg, (src, tgt, targets))
    for index, name_ in enumerate(p):
        direction = np.random.default_rng(index).standard_normal(p[name_].shape)
        assert_derivative(float(np.sum(grads[name_] * direction)),
                          lambda s: _loss(cfg, {**p, name_: p[name_] + s * direction}, src, tgt, targets, masks),
                          STEP, rounding, name_)


def test_the_frameworks_refuse_bad_masks_too():
    import torch

    from impl_torch.model import Transformer

    cfg = DROPPED["decoder-only-pre-learned-tied"]
    src, tgt, _ = _batch(cfg)
    masks = _masks(cfg, src, tgt)
    model = Transformer.from_params(cfg, __import__("spec").conformance_params(cfg, seed=1), dtype=torch.float64)
    with pytest.raises(InputError, match="missing"):
        model(None, tgt, dropout_masks={k: v for k, v in masks.items() if k != "decoder.embed"})
    logits = model(None, tgt, dropout_masks=masks).detach().numpy()
    golden_logits = golden.model_logits(cfg, golden.cast_params(cfg, __import__("spec").conformance_params(cfg, seed=1)),
                                        None, tgt, dropout_masks=masks)
    assert_agrees(logits, golden_logits, **model_bounds(cfg, tgt.shape[1]))


def test_the_dropout_cells_pass_and_see_an_unscaled_dropout():
    from conformance.harness import PASS, plan_matrix, run_matrix
    from pages.mutations import MUTATIONS, run_mutation
    from spec import conformance_params, get_preset

    tiny = get_preset("tiny")
    params = conformance_params(tiny)
    results = run_matrix(tiny, params, plan_matrix(tiny, ["torch", "jax-math"], ["float32"], ["cpu"]), pattern="-dropout-",
                         backward=True)
    assert [r.sublayer for r in results] == ["loss", "grad-loss", "train_step"] * 2
    assert all(r.status == PASS for r in results), [(r.test_id, r.reason) for r in results if r.status != PASS]
    verdict = run_mutation(tiny, params, next(m for m in MUTATIONS if m.name == "dropout_unscaled"))
    assert verdict.caught and verdict.first_sublayer == "loss" and verdict.worst.startswith("loss-dropout")
