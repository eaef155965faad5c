"""The golden VJPs (impl_numpy/backward.py) audited three ways: float64 central differences (along
random directions, and whole Jacobians on tiny shapes), torch float64 autograd and JAX with x64.
Cotangents are random and seeded, never a sum() (which makes a norm's input gradient zero).

The bounds are SPEC §8's at float64, never a picked constant: a central difference carries its
truncation and the forward's rounding over the step (tests/bounds.py), and a framework's
gradients are held to SPEC §13's comparison, as the gradient cells hold them."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import impl_numpy as golden
from conformance.tolerance import compare_gradients, tolerance
from impl_numpy import backward
from tests.bounds import assert_derivative

RNG = np.random.default_rng(2026)


def _normal(*shape):
    return RNG.standard_normal(shape)


def _keep_mask():
    """[2, 1, 3, 5] keep-mask with a masked key in every row and one row with no key at all."""
    mask = RNG.random((2, 1, 3, 5)) < 0.7
    mask[..., 0] = False  # key 0: no query keeps it
    mask[..., 1] = True
    mask[0, 0, 1, :] = False  # query row (0, 1) keeps nothing
    return mask


def _attention_torch(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # rows with no key: zeros
    return weights @ v


def _attention_jax(q, k, v, mask):
    import jax
    import jax.numpy as jnp

    scores = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1, where=mask)
    return jnp.where(mask, weights, 0.0) @ v


def _norm_torch(kind):
    def norm(x, scale, bias):
        centered = x - x.mean(-1, keepdim=True)
        if kind == "layer_norm":
            return F.layer_norm(x, x.shape[-1:], scale, bias, 1e-6)
        return scale * centered / (x.std(-1, keepdim=True) + 1e-6) + bias
    return norm


def _norm_jax(kind):
    def norm(x, scale, bias):
        import jax.numpy as jnp

        centered = x - x.mean(-1, keepdims=True)
        if kind == "layer_norm":
            return centered / jnp.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-6) * scale + bias
        return scale * centered / (jnp.std(x, -1, keepdims=True, ddof=1) + 1e-6) + bias
    return norm


def _activation_jax(name):
    def act(x):
        import jax

        return {"relu": jax.nn.relu, "gelu": lambda z: jax.nn.gelu(z, approximate=False),
                "gelu-tanh": lambda z: jax.nn.gelu(z, approximate=True), "swish": jax.nn.silu}[name](x)
    return act


TORCH_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu-tanh": lambda z: F.gelu(z, approximate="tanh"),
                     "swish": F.silu}


def _cases():
    """name -> (inputs, golden forward, golden VJP returning one cotangent per input, torch
    forward, JAX forward). Every input is a float64 array; the mask, where there is one, is not."""
    cases = {}
    x, weight, bias = _normal(2, 3, 4), _normal(4, 5), _normal(5)
    cases["linear"] = ([x, weight, bias], golden.linear, lambda x, w, b, d: backward.linear_vjp(x, w, d),
                       lambda x, w, b: x @ w + b, lambda x, w, b: x @ w + b)
    for name, vjp in backward.ACTIVATION_VJPS.items():
        z = _normal(3, 7) * 2 + (0.5 if name == "relu" else 0.0)  # relu: no input at its kink
        cases[f"activation-{name}"] = ([z], golden.ACTIVATIONS[name], lambda z, d, vjp=vjp: (vjp(z, d),),
                                       TORCH_ACTIVATIONS[name], _activation_jax(name))
    mask = _keep_mask()
    q, k, v = _normal(2, 2, 3, 4), _normal(2, 2, 5, 4), _normal(2, 2, 5, 4)
    cases["attention-masked"] = (
        [q, k, v], lambda q, k, v: golden.scaled_dot_product_attention(q, k, v, mask),
        lambda q, k, v, d: backward.scaled_dot_product_attention_vjp(q, k, v, mask, d),
        lambda q, k, v: _attention_torch(q, k, v, torch.from_numpy(mask)),
        lambda q, k, v: _attention_jax(q, k, v, mask))
    for kind in ("layer_norm", "std_norm"):
        x, scale, shift = _normal(2, 3, 6) * 3 + 1, 1 + 0.2 * _normal(6), 0.2 * _normal(6)
        forward, vjp = getattr(golden, kind), getattr(backward, f"{kind}_vjp")
        cases[kind] = ([x, scale, shift], lambda x, s, b, forward=forward: forward(x, s, b, 1e-6),
                       lambda x, s, b, d, vjp=vjp: vjp(x, s, 1e-6, d), _norm_torch(kind), _norm_jax(kind))
    p = {"w1.weight": _normal(4, 6) * 0.5, "w1.bias": _normal(6) * 0.2, "w2.weight": _normal(6, 4) * 0.5,
         "w2.bias": _normal(4) * 0.2}
    names = list(p)
    cases["feed_forward-gelu"] = (
        [_normal(2, 3, 4)] + [p[n] for n in names],
        lambda x, *ws: golden.feed_forward(dict(zip(names, ws)), x, "gelu"),
        lambda x, *ws_and_d: _ffn_vjp(names, x, ws_and_d),
        lambda x, w1, b1, w2, b2: F.gelu(x @ w1 + b1) @ w2 + b2,
        lambda x, w1, b1, w2, b2: _activation_jax("gelu")(x @ w1 + b1) @ w2 + b2)
    return cases


def _ffn_vjp(names, x, weights_and_cotangent):
    *weights, d_y = weights_and_cotangent
    d_x, grads = backward.feed_forward_vjp(dict(zip(names, weights)), x, "gelu", d_y)
    return (d_x, *[grads[n] for n in names])


CASES = _cases()
# SPEC §8's n for each case: the longest sum its forward or VJP takes (the inner products, the keys
# a query sums, a norm's statistics, the 2 × 3 positions a weight's gradient sums over)
REDUCTIONS = {"linear": 6, "attention-masked": 5, "layer_norm": 6, "std_norm": 6, "feed_forward-gelu": 6,
              **{f"activation-{name}": 1 for name in backward.ACTIVATION_VJPS}}
STEP = 1e-6  # the central differences' h: its truncation (|D(2h) − D(h)|) and rounding / h are both counted


def _golden_grads(name):
    inputs, forward, vjp, _, _ = CASES[name]
    out = forward(*inputs)
    cotangent = np.random.default_rng(len(name)).standard_normal(out.shape)  # seeded per case
    return inputs, forward, cotangent, vjp(*inputs, cotangent)


def _along(inputs, forward, cotangent, index, direction):
    """f(s) = ⟨cotangent, y⟩ with input `index` moved by s·direction."""
    def f(s):
        moved = [x + s * direction if i == index else x for i, x in enumerate(inputs)]
        return float((forward(*moved) * cotangent).sum())
    return f


def _rounding(name, inputs, forward, cotangent):
    """How far computing f(s) may be off, in central_difference's terms: SPEC §8 at float64 over
    the case's sums and the out.size products f adds, relative to their total size Σ|c·y| (f itself
    may cancel), rescaled to the max(1, |f|) that central_difference multiplies it by."""
    products = forward(*inputs) * cotangent
    relative = tolerance("float64", max(REDUCTIONS[name], cotangent.size), 1)
    return relative * max(1.0, float(np.abs(products).sum())) / max(1.0, abs(float(products.sum())))


@pytest.mark.parametrize("name", list(CASES))
def test_central_differences_along_random_directions(name):
    """⟨∂x, u⟩ equals (L(x + h u) − L(x − h u)) / 2h, L = ⟨cotangent, y⟩, for each input alone, up to
    the difference's truncation and rounding."""
    inputs, forward, cotangent, grads = _golden_grads(name)
    rounding = _rounding(name, inputs, forward, cotangent)
    for index, grad in enumerate(grads):
        direction = np.random.default_rng(index).standard_normal(inputs[index].shape)
        assert_derivative(float(np.sum(grad * direction)), _along(inputs, forward, cotangent, index, direction), STEP,
                          rounding, f"{name} input {index}")


@pytest.mark.parametrize("name", ["attention-masked", "layer_norm", "std_norm", "activation-gelu-tanh"])
def test_whole_jacobians_by_central_differences(name):
    """Every element of the first input's gradient, one coordinate at a time."""
    inputs, forward, cotangent, grads = _golden_grads(name)
    rounding = _rounding(name, inputs, forward, cotangent)
    for position in np.ndindex(inputs[0].shape):
        step = np.zeros_like(inputs[0])
        step[position] = 1.0
        assert_derivative(float(grads[0][position]), _along(inputs, forward, cotangent, 0, step), STEP, rounding,
                          f"{name} {list(position)}")


def _assert_gradients_agree(name, theirs):
    """SPEC §13's comparison, per input, normwise: ‖g − g*‖ ≤ tol · max(‖g*‖, ‖t*‖), tol §8's at
    float64 with the case's n and twice one function's depth (the backward re-traverses it), t*
    the golden without cancellation (softmax's VJP without its row sum)."""
    inputs, _, cotangent, grads = _golden_grads(name)
    with backward.without_cancellation():
        terms = CASES[name][2](*inputs, cotangent)
    label = [f"input {index}" for index in range(len(grads))]
    result = compare_gradients(dict(zip(label, (np.asarray(g) for g in theirs))), dict(zip(label, grads)),
                               dict(zip(label, terms)), tolerance("float64", REDUCTIONS[name], 2))
    assert result.passed, f"{name}: {result.reason}"


@pytest.mark.parametrize("name", list(CASES))
def test_torch_float64_autograd_agrees(name):
    inputs, _, cotangent, _ = _golden_grads(name)
    tensors = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in inputs]
    out = CASES[name][3](*tensors)
    _assert_gradients_agree(name, [g.numpy() for g in torch.autograd.grad(out, tensors, torch.from_numpy(cotangent))])


@pytest.mark.parametrize("name", list(CASES))
def test_jax_x64_agrees(name):
    jax = pytest.importorskip("jax")
    inputs, _, cotangent, _ = _golden_grads(name)
    with jax.enable_x64(True):
        arrays = [jax.numpy.asarray(x, dtype=jax.numpy.float64) for x in inputs]
        _, pullback = jax.vjp(CASES[name][4], *arrays)
        theirs = [np.asarray(g) for g in pullback(jax.numpy.asarray(cotangent))]
    _assert_gradients_agree(name, theirs)


def test_masked_positions_get_exactly_zero_gradient():
    """What the mask removes is structurally zero: a masked key's score gradient, and a query row
    with no key at all (its output is the spec's zeros) gives nothing to q, k or v and no NaN."""
    inputs, _, cotangent, (d_q, d_k, d_v) = _golden_grads("attention-masked")
    q, k, v = inputs
    mask = _keep_mask()
    scores = q @ np.swapaxes(k, -1, -2) / 2.0
    weights = golden.softmax(scores, mask)
    d_scores = backward.softmax_vjp(weights, cotangent @ np.swapaxes(v, -1, -2))
    assert np.all(d_scores[~np.broadcast_to(mask, d_scores.shape)] == 0.0)
    assert np.all(d_q[0, :, 1] == 0.0)  # the row with no key
    assert all(np.isfinite(g).all() for g in (d_q, d_k, d_v))
    unseen_keys = ~mask.any(axis=-2)[..., 0, :]  # [B, K]: keys no query keeps
    assert np.all(d_k[unseen_keys[:, None, :].repeat(2, 1)] == 0.0) and np.all(d_v[unseen_keys[:, None, :].repeat(2, 1)] == 0.0)


@pytest.mark.parametrize("planted", ["softmax without its row sum", "layer norm without the x̂ term"])
def test_the_audit_catches_a_wrong_vjp(monkeypatch, planted):
    """Each audit fails on a VJP that drops one term of its derivative."""
    if planted.startswith("softmax"):  # the attention VJP looks softmax_vjp up when called
        monkeypatch.setattr(backward, "softmax_vjp", lambda p, d_p: p * d_p)
        name = "attention-masked"
    else:
        def without_normed_term(x, scale, shift, d_y):
            centered = x - x.mean(axis=-1, keepdims=True)
            root = np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + 1e-6)
            g = d_y * scale
            return (g - g.mean(axis=-1, keepdims=True)) / root, *backward.layer_norm_vjp(x, scale, 1e-6, d_y)[1:]
        name = "layer_norm"
        monkeypatch.setitem(CASES, name, (*CASES[name][:2], without_normed_term, *CASES[name][3:]))
    with pytest.raises(AssertionError):
        test_central_differences_along_random_directions(name)
    with pytest.raises(AssertionError):
        test_torch_float64_autograd_agrees(name)
