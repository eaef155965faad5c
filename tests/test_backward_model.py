"""The golden backward of the whole model and its loss (impl_numpy/backward.py: embeddings with a
tied head, positions, multi-head attention, residual blocks, layers, stacks, the head and the
label-smoothed token cross-entropy), audited three ways: float64 central differences,
impl_torch under float64 autograd and impl_jax under x64, both attention paths each. The
configurations between them switch every option that changes the backward, on conformance
weights (no zero bias, no unit scale) and inputs with padding and fully masked query rows.

The bounds are SPEC §8's at float64: a central difference carries its truncation and the loss's
rounding over the step (tests/bounds.py), and a framework's gradients are held to SPEC §13's
comparison with the golden's terms and ReLU allowance, as the grad-loss cells hold them."""

import numpy as np
import pytest
import torch

import impl_numpy as golden
from conformance.backends.numpy_backend import GradientReference, NumpyRunner
from conformance.cases import SUBLAYERS, amplification, recurrent_depth
from conformance.tolerance import compare_gradients, tolerance
from impl_numpy import backward
from spec import GatedDeltaNet, ModelConfig, params_under
from spec.errors import ConfigError, InputError
from spec.params import conformance_params
from tests.bounds import assert_agrees, assert_derivative, central_difference, model_bounds

CONFIGS = {
    # the paper's options: post-LN, sinusoids, one table for source, target and head; smoothing
    "encoder-decoder-post-shared-tied": ModelConfig(
        d_model=8, n_heads=2, d_ff=12, n_encoder_layers=2, n_decoder_layers=2, src_vocab_size=11,
        tgt_vocab_size=11, max_len=16, share_src_tgt_embed=True, tie_head=True, label_smoothing=0.1),
    # GPT-style: pre-LN, final norm, learned positions, tied head, an embedding norm, pad_id 3
    "decoder-only-pre-learned-tied": ModelConfig(
        arch="decoder-only", d_model=8, n_heads=2, d_ff=12, n_decoder_layers=2, tgt_vocab_size=13,
        max_len=16, norm_position="pre", final_norm=True, positional="learned", activation="gelu-tanh",
        embed_norm=True, tie_head=True, pad_id=3),
    # everything else: std norm, no q/k/v bias, untied head with a bias, no scale, swish
    "encoder-decoder-pre-std-untied": ModelConfig(
        d_model=8, n_heads=4, d_ff=12, n_encoder_layers=1, n_decoder_layers=2, src_vocab_size=9,
        tgt_vocab_size=10, max_len=16, norm="std", qkv_bias=False, head_bias=True, activation="swish",
        positional="learned", embed_scale=False, final_norm=True, embed_norm=True, norm_position="pre",
        label_smoothing=0.2),
    # a hybrid (SPEC §5.15): gated DeltaNet layers around a gated attention with q/k norms and a partial
    # rotary, (1 + w) norms, grouped key/value heads on both sides; the 6 positions cross a chunk
    "decoder-only-hybrid-gated-delta-net": ModelConfig(
        arch="decoder-only", d_model=12, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=10, n_decoder_layers=3,
        tgt_vocab_size=13, max_len=16, norm="rmsnorm", norm_position="pre", final_norm=True, positional="rope",
        rope_fraction=0.5, embed_scale=False, activation="swish", gated_ffn=True, bias=False, qkv_bias=False,
        qk_norm=True, norm_scale_plus_one=True, attention_output_gate=True, layer_types=("linear", "full", "linear"),
        linear_attention=GatedDeltaNet(key_heads=1, value_heads=2, key_head_dim=4, value_head_dim=3, conv_kernel=3,
                                       chunk_size=4)),
}


def _batch(cfg: ModelConfig):
    """ids with padding: the source's row 1 ends in two pads; the target's row 1 ends in a pad;
    a decoder-only row 0 starts with two (left padding: queries 0 and 1 have no key at all).
    Token 1 never occurs, so its rows must get exactly zero gradient where nothing else uses it.
    Targets are the inputs shifted left, pad at the end."""
    rng = np.random.default_rng(len(cfg.to_json()))
    real = [i for i in range(cfg.tgt_vocab_size) if i not in (cfg.pad_id, 1)]
    tgt = rng.choice(real, (2, 6))
    if not cfg.has_encoder:
        tgt[0, :2] = cfg.pad_id
    tgt[1, -1] = cfg.pad_id
    src = None
    if cfg.has_encoder:
        src = rng.choice([i for i in range(cfg.src_vocab_size) if i not in (cfg.pad_id, 1)], (2, 5))
        src[1, -2:] = cfg.pad_id
    targets = np.roll(tgt, -1, axis=1)
    targets[:, -1] = cfg.pad_id
    return src, tgt, targets


def _setup(name):
    cfg = CONFIGS[name]
    params = conformance_params(cfg, seed=1)
    src, tgt, targets = _batch(cfg)
    p = golden.cast_params(cfg, params)
    loss, grads = backward.loss_and_gradients(cfg, p, src, tgt, targets)
    return cfg, params, p, (src, tgt, targets), loss, grads


SETUPS = {name: _setup(name) for name in CONFIGS}


def _loss(cfg, p, src, tgt, targets):
    return golden.token_cross_entropy(cfg, golden.model_logits(cfg, p, src, tgt), targets)


def _reduction(cfg, batch):
    """SPEC §8's n for the loss and its gradients on the test's batch, counted as conformance/cases.py
    counts a grad-loss case: the model's (widths, keys, the positions' angles: model_bounds), the
    vocabulary the log-probabilities sum, and the positions a weight's gradient sums over."""
    src, tgt, _ = batch
    return max(model_bounds(cfg, tgt.shape[1], 0 if src is None else src.shape[1])["n"], cfg.tgt_vocab_size,
               tgt.size, 0 if src is None else src.size)


def _loss_rounding(cfg, batch):
    """How far the float64 loss may be off: SPEC §8 at the loss's depth."""
    return tolerance("float64", _reduction(cfg, batch), SUBLAYERS["loss"].depth(cfg))


STEP = 1e-5  # the central differences' h: its truncation (|D(2h) − D(h)|) and rounding / h are both counted


def _directional_checks(cfg, p, batch, grads):
    """For each parameter θ alone: ⟨∂θ, u⟩, the central difference (L(θ + h u) − L(θ − h u)) / 2h and
    how far apart the two may be (its truncation and the loss's rounding over h)."""
    checks, rounding = {}, _loss_rounding(cfg, batch)
    for index, name in enumerate(p):
        direction = np.random.default_rng(index).standard_normal(p[name].shape)
        numeric, bound = central_difference(lambda s: _loss(cfg, {**p, name: p[name] + s * direction}, *batch),
                                            STEP, rounding)
        checks[name] = (float(np.sum(grads[name] * direction)), numeric, bound)
    return checks


def _ratios(checks):
    """|⟨∂θ, u⟩ − difference| over its bound, per parameter: above 1, the central difference sees a mistake."""
    return {name: abs(analytic - numeric) / bound for name, (analytic, numeric, bound) in checks.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_parameter_gradient_matches_central_differences(name):
    cfg, _, p, batch, _, grads = SETUPS[name]
    assert set(grads) == set(p) and all(grads[n].shape == p[n].shape for n in p)
    checks = _directional_checks(cfg, p, batch, grads)
    ratios = _ratios(checks)
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= 1, f"{worst}: analytic {checks[worst][0]:.12g}, central difference {checks[worst][1]:.12g}"


def test_small_parameters_element_by_element():
    """Every element of every parameter of at most 16 numbers (biases, norm scales), one
    coordinate at a time, on the paper-like configuration."""
    cfg, _, p, batch, _, grads = SETUPS["encoder-decoder-post-shared-tied"]
    checked, rounding = 0, _loss_rounding(cfg, batch)
    for name, value in p.items():
        if value.size > 16:
            continue
        for position in np.ndindex(value.shape):
            step = np.zeros_like(value)
            step[position] = 1.0
            assert_derivative(float(grads[name][position]), lambda s: _loss(cfg, {**p, name: value + s * step}, *batch),
                              STEP, rounding, f"{name}{list(position)}")
            checked += 1
    assert checked > 200


def _torch_gradients(cfg, params, batch, attention):
    from impl_torch.model import Transformer, _linear_weight_names, token_cross_entropy

    src, tgt, targets = batch
    model = Transformer.from_params(cfg, params, dtype=torch.float64, attention=attention)
    loss = token_cross_entropy(cfg, model(src, tgt), torch.from_numpy(targets))
    loss.backward()
    transposed = _linear_weight_names(model)
    named = dict(model.named_parameters())
    grads = {}
    for name in params:
        grad = named[name].grad.numpy()
        grads[name] = grad.T if name in transposed else grad
    return float(loss.detach()), grads


def _jax_gradients(cfg, params, batch, attention):
    jax = pytest.importorskip("jax")
    from flax import nnx

    from impl_jax.model import Transformer, _variable, token_cross_entropy

    src, tgt, targets = batch
    with jax.enable_x64(True):
        model = Transformer.from_params(cfg, params, dtype="float64", attention=attention)
        loss, state = nnx.value_and_grad(lambda m: token_cross_entropy(cfg, m(src, tgt), jax.numpy.asarray(targets)))(model)
        nnx.update(model, state)  # the model's variables now hold the gradients, under their names
        return float(loss), {name: np.asarray(_variable(model, name)[...]) for name in params}


def _assert_gradients_agree(cfg, p, batch, their_loss, theirs):
    """The loss within SPEC §8's tolerance at its depth, and the gradients by SPEC §13's comparison
    (conformance.tolerance.compare_gradients) as a grad-loss cell makes it: per tensor, normwise,
    ‖g − g*‖ ≤ tol · max(‖g*‖, ‖t*‖) + a*, tol §8's at twice the loss's depth, t* the golden without
    cancellation, a* the ReLU allowance at the loss's tolerance. b^K's gradient is identically zero
    (the golden keeps it exact); a framework's is rounding, bounded by its terms' size. A hybrid's
    depth counts its recurrence's tokens and its bound the amplification, as its cells' do (SPEC §8)."""
    src, tgt, targets = batch
    inputs = {"src_ids": src, "tgt_ids": tgt, "targets": targets, "d_out": 1.0, "dropout_masks": None}
    reference = GradientReference(NumpyRunner.at(cfg, p), "grad-loss", inputs)
    n = _reduction(cfg, batch)
    depth = {case: recurrent_depth(cfg, case, inputs) or SUBLAYERS[case].depth(cfg) for case in ("loss", "grad-loss")}
    amplified = max(1.0, amplification(cfg, lambda: p, "grad-loss", inputs))
    assert_agrees(their_loss, reference.gradients["loss"], n=n, depth=depth["loss"], what="loss")
    for name in p:
        if name.endswith("k.bias"):
            assert np.all(reference.gradients[name] == 0.0), name
    result = compare_gradients({"loss": np.asarray(their_loss), **theirs}, reference.gradients, reference.terms,
                               amplified * tolerance("float64", n, depth["grad-loss"]),
                               reference.kink_allowance(_loss_rounding(cfg, batch)))
    assert result.passed, result.reason


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_float64_autograd_agrees(name, attention):
    cfg, params, p, batch, _, _ = SETUPS[name]
    _assert_gradients_agree(cfg, p, batch, *_torch_gradients(cfg, params, batch, attention))


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_jax_x64_agrees(name, attention):
    cfg, params, p, batch, _, _ = SETUPS[name]
    _assert_gradients_agree(cfg, p, batch, *_jax_gradients(cfg, params, batch, attention))


# ---- what the masks and the loss make exactly zero ------------------------------------------

def test_rows_of_absent_and_padding_tokens_get_exactly_zero():
    """The untied tables: token 1 occurs nowhere, and pad occurs only at padded positions, whose
    outputs nothing attends to and whose targets the loss skips. Their rows are exactly 0 in the
    golden and in both frameworks (no rounding: nothing reaches them)."""
    cfg, params, p, batch, _, grads = SETUPS["encoder-decoder-pre-std-untied"]
    _, torch_grads = _torch_gradients(cfg, params, batch, "math")
    _, jax_grads = _jax_gradients(cfg, params, batch, "sdpa")
    for source in (grads, torch_grads, jax_grads):
        for table in ("src_embed.weight", "tgt_embed.weight"):
            assert np.all(source[table][[1, cfg.pad_id]] == 0.0), table
        assert np.all(source["src_pos.weight"][5:] == 0.0) and np.all(source["tgt_pos.weight"][6:] == 0.0)
        assert np.abs(source["src_embed.weight"]).sum(axis=1).astype(bool).sum() == len(set(batch[0].ravel()) - {cfg.pad_id})


def test_a_linear_layers_pads_get_exactly_zero():
    """A pad moves no state of a gated DeltaNet and outputs 0 (SPEC §5.15), so nothing reaches it
    back through the mixer: its input's gradient is exactly 0 (pads at the start, inside, at the
    end, and a row of pads) in the golden's recurrence walked backwards and in torch's chunked
    prefill under float64 autograd; nothing is NaN. (The grad-linear_attn cells hold every column
    to these zeros: JAX's in tests/test_gated_delta_net.py, on rows with every other token a pad.)"""
    from impl_torch.model import Transformer

    cfg, params, p, _, _, _ = SETUPS["decoder-only-hybrid-gated-delta-net"]
    rng = np.random.default_rng(5)
    x, d_y = rng.standard_normal((4, 9, cfg.d_model)), rng.standard_normal((4, 9, cfg.d_model))
    keep = np.ones((4, 9), bool)
    keep[0, :3] = keep[1, 4:6] = keep[2, -2:] = keep[3] = False
    d_x, grads = backward.gated_delta_net_vjp(cfg, params_under(p, "decoder.layers.0.linear_attn"), x, keep, d_y)
    mixer = Transformer.from_params(cfg, params, dtype=torch.float64).decoder.layers[0].linear_attn
    x_torch = torch.tensor(x, requires_grad=True)
    (torch_d_x,) = torch.autograd.grad(mixer(x_torch, torch.from_numpy(keep))[0], x_torch, torch.from_numpy(d_y))
    for name, found in {"golden": d_x, "torch": torch_d_x.numpy()}.items():
        assert np.all(found[~keep] == 0.0) and np.all(found[keep] != 0.0), name
        assert np.isfinite(found).all(), name
    assert all(np.isfinite(g).all() for g in grads.values())


def test_pad_targets_give_exactly_zero_and_no_target_gives_zero_loss():
    cfg, _, p, (src, tgt, targets), _, _ = SETUPS["encoder-decoder-post-shared-tied"]
    logits = golden.model_logits(cfg, p, src, tgt)
    d_logits = backward.token_cross_entropy_vjp(cfg, logits, targets)
    assert np.all(d_logits[targets == cfg.pad_id] == 0.0) and np.all(d_logits[targets != cfg.pad_id] != 0.0)
    nothing = np.full_like(targets, cfg.pad_id)
    loss, grads = backward.loss_and_gradients(cfg, p, src, tgt, nothing)
    assert loss == 0.0 and all(np.all(g == 0.0) for g in grads.values())


def test_fully_masked_query_rows_leak_no_nan():
    """Left padding leaves the first two queries of a decoder-only row with no key at all (the
    forward's zeros, SPEC §6); no NaN reaches any parameter, in any of the three."""
    cfg, params, p, batch, _, grads = SETUPS["decoder-only-pre-learned-tied"]
    assert batch[1][0, 0] == batch[1][0, 1] == cfg.pad_id
    for source in (grads, _torch_gradients(cfg, params, batch, "sdpa")[1], _jax_gradients(cfg, params, batch, "sdpa")[1]):
        assert all(np.isfinite(g).all() for g in source.values())


def test_smoothed_targets_put_nothing_on_pad():
    q = golden.smoothed_targets(np.array([[2, 4]]), 6, 0, 0.2)
    np.testing.assert_allclose(q, [[[0, 0.05, 0.8, 0.05, 0.05, 0.05], [0, 0.05, 0.05, 0.05, 0.8, 0.05]]])
    with pytest.raises(ConfigError, match="label_smoothing must be in"):
        CONFIGS["decoder-only-pre-learned-tied"].replace(label_smoothing=1.0)
    with pytest.raises(ConfigError, match="tgt_vocab_size >= 3"):
        ModelConfig(arch="decoder-only", d_model=4, n_heads=1, d_ff=4, n_decoder_layers=1, tgt_vocab_size=2,
                    max_len=4, label_smoothing=0.1)


def test_targets_are_checked():
    cfg, _, p, (src, tgt, targets), _, _ = SETUPS["encoder-decoder-post-shared-tied"]
    with pytest.raises(InputError, match="targets must be shaped like tgt_ids"):
        backward.loss_and_gradients(cfg, p, src, tgt, targets[:, :3])
    with pytest.raises(InputError, match="targets"):
        backward.loss_and_gradients(cfg, p, src, tgt, targets + cfg.tgt_vocab_size)


# ---- the audit fails on the mistakes people make --------------------------------------------

PLANTED = {
    "a tied embedding's gradient counts the head's use only":
        ("encoder-decoder-post-shared-tied", "embed_vjp", lambda original: lambda *a, **k: {
            name: 0.0 * grad for name, grad in original(*a, **k).items()}),
    "the loss averages over pad targets too":
        ("decoder-only-pre-learned-tied", "token_cross_entropy_vjp", lambda original: lambda cfg, logits, targets: (
            original(cfg, logits, targets) * (targets != cfg.pad_id).sum() / targets.size)),
    "label smoothing spread onto the pad index":
        ("encoder-decoder-post-shared-tied", "smoothed_targets", lambda original: lambda t, v, pad, e: (
            np.where(np.arange(v) == pad, e / (v - 2), original(t, v, pad, e)) / (1 + e / (v - 2)))),
    "a detached residual":
        ("decoder-only-pre-learned-tied", "residual_vjp", lambda original: lambda cfg, *a: (
            lambda d_x, norm_grads, grads, post: (d_x - a[4], norm_grads, grads, post))(*original(cfg, *a))),  # a[4]: d_y
    "the decay's gradient dropped from the recurrence":
        ("decoder-only-hybrid-gated-delta-net", "gated_delta_rule_vjp", lambda original: lambda *a: (
            lambda d_state, d_q, d_k, d_v, d_decay, d_beta: (d_state, d_q, d_k, d_v, 0 * d_decay, d_beta))(
                *original(*a))),
    "a convolution's window not carried back to the tokens before":
        ("decoder-only-hybrid-gated-delta-net", "short_convolution_vjp", lambda original: lambda *a: original(
            *a[:4], 0 * a[4])),
}


@pytest.mark.parametrize("planted", list(PLANTED))
def test_the_audit_catches(monkeypatch, planted):
    name, function, mistake = PLANTED[planted]
    monkeypatch.setattr(backward, function, mistake(getattr(backward, function)))
    cfg, _, p, batch, _, _ = SETUPS[name]
    _, grads = backward.loss_and_gradients(cfg, p, *batch)
    assert max(_ratios(_directional_checks(cfg, p, batch, grads)).values()) > 1, planted  # beyond what h can explain


# ---- outside agreement: torch.nn.Transformer's own autograd ---------------------------------

def test_torch_nn_transformer_autograd_agrees():
    """The torch-nn preset's layers as torch.nn.Transformer itself (impl_torch.torch_nn's mapping),
    with the embeddings, positions, head and loss around it in plain torch: every canonical
    gradient agrees with the golden's at float64 by SPEC §13's comparison, b^K's within rounding of 0."""
    from impl_torch.model import token_cross_entropy
    from impl_torch.torch_nn import _mapping, to_torch_nn, torch_nn_transformer
    from spec import get_preset

    cfg = get_preset("torch-nn").replace(n_encoder_layers=2, n_decoder_layers=2, d_model=16, n_heads=2, d_ff=24,
                                          src_vocab_size=13, tgt_vocab_size=11, label_smoothing=0.1)
    params = conformance_params(cfg, seed=3)
    src, tgt, targets = _batch(cfg)  # right padding only: nn.Transformer gives NaN on rows with no key
    state, extras = to_torch_nn(cfg, params)
    reference = torch_nn_transformer(cfg).double()
    reference.load_state_dict({k: v.double() for k, v in state.items()})
    leaves = {name: value.double().requires_grad_() for name, value in extras.items()}
    p = golden.cast_params(cfg, params)

    def embedded(ids, table, side):
        positions = torch.from_numpy(golden.positional_encoding(cfg, p, side, ids.shape[1]))
        return table[torch.from_numpy(ids)] * cfg.d_model ** 0.5 + positions

    src_padding, tgt_padding = torch.from_numpy(src == cfg.pad_id), torch.from_numpy(tgt == cfg.pad_id)
    causal = ~torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).tril()  # nn's masks: True = excluded
    hidden = reference(embedded(src, leaves["src_embed"], "src"), embedded(tgt, leaves["tgt_embed"], "tgt"),
                       tgt_mask=causal, src_key_padding_mask=src_padding, tgt_key_padding_mask=tgt_padding,
                       memory_key_padding_mask=src_padding)
    logits = hidden @ leaves["head.weight"].T + leaves["head.bias"]
    loss = token_cross_entropy(cfg, logits, torch.from_numpy(targets))
    loss.backward()

    theirs = {"src_embed.weight": leaves["src_embed"].grad.numpy(), "tgt_embed.weight": leaves["tgt_embed"].grad.numpy(),
              "head.weight": leaves["head.weight"].grad.numpy().T, "head.bias": leaves["head.bias"].grad.numpy()}
    grads = dict(reference.named_parameters())
    for ours, their_name, transpose in _mapping(cfg):  # the mapping of the weights, read backwards
        for name, part in zip(ours, np.split(grads[their_name].grad.numpy(), len(ours), axis=0)):
            theirs[name] = part.T if transpose else part
    _assert_gradients_agree(cfg, p, (src, tgt, targets), float(loss.detach()), theirs)
