"""RMSNorm (SPEC.md §5.6), the first piece of the modern decoder: the golden and its VJP, the
parameters (a scale, no bias), PyTorch and JAX through the harness at every dtype, and the
half-precision order Llama uses (normalise in float32, cast, then scale)."""

import numpy as np
import pytest
import torch

import impl_numpy as golden
from conformance.cases import SUBLAYERS
from conformance.harness import PASS, plan_matrix, run_matrix
from conformance.tolerance import tolerance
from impl_numpy import backward
from spec import conformance_params, get_preset, param_shapes
from tests.bounds import assert_agrees, assert_derivative, assert_differs, model_bounds

CHAR_LM = get_preset("char-lm").replace(norm="rmsnorm", n_decoder_layers=2)
TINY = get_preset("tiny").replace(norm="rmsnorm")


def test_rmsnorm_has_a_scale_and_no_bias():
    shapes = param_shapes(CHAR_LM)
    assert shapes["decoder.layers.0.ffn_norm.scale"] == (CHAR_LM.d_model,)
    assert not any(name.endswith("_norm.bias") or name == "decoder.norm.bias" for name in shapes)


def test_the_golden_is_the_formula():
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    scale = np.random.default_rng(1).standard_normal(8)
    expected = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-5) * scale
    assert_agrees(golden.rms_norm(x, scale, None, 1e-5), expected, n=8)
    assert_differs(golden.rms_norm(x + 3.0, scale, None, 1e-5), expected, n=8)  # the mean is not taken out


@pytest.mark.parametrize("eps", [1e-6, 1.0])
def test_the_vjp_agrees_with_central_differences(eps):
    rng = np.random.default_rng(2)
    x, scale, d_y = rng.standard_normal((3, 4, 8)), rng.standard_normal(8), rng.standard_normal((3, 4, 8))
    d_x, d_scale, d_bias = backward.rms_norm_vjp(x, scale, eps, d_y)
    assert d_bias is None
    rounding = tolerance("float64", d_y.size, 1)  # the loss sums its 96 products, more than the norm's 8
    for name, value, gradient, wiggle in (("x", x, d_x, lambda u: (x + u, scale)),
                                          ("scale", scale, d_scale, lambda u: (x, scale + u))):
        direction = rng.standard_normal(value.shape)

        def along(step, wiggle=wiggle, direction=direction):  # the loss at x (or scale) + step · direction
            moved = wiggle(step * direction)
            return float((golden.rms_norm(moved[0], moved[1], None, eps) * d_y).sum())

        assert_derivative(float((gradient * direction).sum()), along, 1e-6, rounding, what=name)


def test_the_whole_model_backward_agrees_with_central_differences():
    cfg = CHAR_LM.replace(d_model=8, n_heads=2, d_ff=12, max_len=16, tgt_vocab_size=13)
    p = golden.cast_params(cfg, conformance_params(cfg, seed=3))
    tgt = np.random.default_rng(4).integers(1, 13, (2, 5))
    targets = np.roll(tgt, -1, axis=1)
    _, grads = backward.loss_and_gradients(cfg, p, None, tgt, targets)

    def loss(q):
        return golden.token_cross_entropy(cfg, golden.model_logits(cfg, q, None, tgt), targets)

    # the loss's rounding: the forward's n, depth and angle, with its own sums (a token's 13 logits, the
    # batch's 10 tokens) and its one sublayer more
    bounds = model_bounds(cfg, 5)
    rounding = tolerance("float64", max(bounds["n"], cfg.tgt_vocab_size, tgt.size), SUBLAYERS["loss"].depth(cfg),
                         bounds["angle"])
    for index, name in enumerate(p):
        direction = np.random.default_rng(index).standard_normal(p[name].shape)
        assert_derivative(float((grads[name] * direction).sum()),
                          lambda step: loss({**p, name: p[name] + step * direction}), 1e-5, rounding, what=name)


NORM_CELLS = ("norm-*", "grad-norm-none-*", "grad-norm-small-*", "grad-norm-large-*")
MODEL_CELLS = ("forward-pad_right-*", "grad-loss-pad_right-*", "train_step-dropout-*")


@pytest.mark.parametrize("cfg, columns", [
    # The gradient of one norm of each size (every norm is the same function) at every dtype, and the
    # model's cells through an encoder-decoder's norms (the cross-attention's, the encoder's) at float64
    # and float32, and at half precision in torch and torch-math. The -math columns differ from theirs in
    # attention alone, which no norm cell runs. Moved (issue 58): JAX's model cells at half precision, 30 s
    # of compiles, and mixed-precision training are test_training.py's half-precision training cells in
    # both frameworks on llama-tiny, an RMSNorm model (every train_* cell, its gradients included);
    # jax-math's are the jax column's own program at float16 on the CPU (asserted below) and its
    # bfloat16 dtype the jax column's; torch-math's at float64 and float32 are test_backward_cells.py's.
    (TINY, [(("torch", "jax", "numpy-float32"), ("float64", "float32", "float16", "bfloat16"), NORM_CELLS),
            (("torch", "jax", "numpy-float32"), ("float64", "float32"), MODEL_CELLS),
            (("torch", "torch-math"), ("float16", "bfloat16"), MODEL_CELLS)]),
    # ten steps: a saturated GELU's exact zero once hid a unit from the golden's cancellation check (a
    # check of the golden's, which every column meets; the -math columns' training steps at float32 are
    # test_training_cells.py's)
    (CHAR_LM, [(("torch", "jax", "numpy-float32"), ("float32",), ("train_steps-*",)),
               (("torch", "jax"), ("float64",), ("train_steps-*",))]),
], ids=["tiny-rmsnorm", "char-lm-rmsnorm"])
def test_every_framework_column_passes(cfg, columns):
    """Forward and gradient cells of the norm-bearing sublayers at every dtype, and the model's."""
    params = conformance_params(cfg)
    results, wanted = [], set()
    for backends, dtypes, patterns in columns:
        plan = plan_matrix(cfg, list(backends), list(dtypes), ["cpu"])
        wanted |= {(backend, dtype) for backend, dtype, _ in plan.columns}  # those it can run
        # the patterns as one run's alternatives: each column loaded (and JAX's programs compiled) once
        results += run_matrix(cfg, params, plan, pattern="|".join(patterns), backward=True)
    failed = {r.test_id: r.reason[:200] for r in results if r.status != PASS and r.status != "skip"}
    # not a rounding bound: every column the plan runs ran a cell (patterns that matched nothing would
    # pass with nothing failed)
    ran = {(r.backend, r.dtype) for r in results if r.status == PASS}
    assert not failed and ran == wanted, (failed, wanted - ran)


def test_jax_takes_jax_maths_attention_at_float16_on_the_cpu():
    """What the norm test's jax-math columns left out rests on: at float16 the jax column's
    attention on the CPU is the explicit program jax-math runs."""
    from impl_jax import attention_path

    assert all(attention_path("float16", "cpu", queries, "sdpa")[0] == "math" for queries in (1, 5, 11))


# rsqrt and 1/sqrt may differ by a float32 rounding of the normed value, which moves its float16 rounding
# only where the value lies that close to a float16 rounding boundary: a chance of 2⁻¹³ an entry (float32
# keeps 13 bits more), 256 / 2¹³ = 0.03 of the test's 256 entries expected, 4 or more with a chance of 4e-8
# (Poisson). Scaling in float32 and casting once moves a fifth of them.
FEW_ENTRIES = 3


def test_half_precision_normalises_in_float32_then_scales_in_its_own_dtype():
    """The order Llama uses. Scaling in float32 and casting once at the end differs in the last bit
    for some entries; the implementations must give the cast-then-scale result, but for the few
    entries where rsqrt against 1/sqrt moves a float16 rounding."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)).astype(np.float16)
    scale = (1 + 0.3 * rng.standard_normal(64)).astype(np.float16)
    wide = x.astype(np.float32)
    normed = (wide / np.sqrt((wide * wide).mean(axis=-1, keepdims=True) + np.float32(1e-6))).astype(np.float16)
    llama = normed * scale  # float16 × float16
    once = (wide / np.sqrt((wide * wide).mean(axis=-1, keepdims=True) + np.float32(1e-6)) * scale.astype(np.float32)
            ).astype(np.float16)
    assert (llama != once).sum() > FEW_ENTRIES  # the order is visible, beyond what rsqrt's rounding moves
    from impl_torch.model import rms_norm as torch_rms_norm

    ours = torch_rms_norm(torch.from_numpy(x), torch.from_numpy(scale), None, 1e-6).numpy()
    assert ours.dtype == np.float16
    # rsqrt vs 1/sqrt may differ by one float16 rounding (2u of the largest entry), in few entries: the
    # bound alone lets the once-cast order through (it differs by one rounding too), the count does not
    assert np.abs(ours.astype(np.float32) - llama.astype(np.float32)).max() <= 2 * np.abs(
        llama.astype(np.float32)).max() * 2.0 ** -11
    assert (ours != llama).sum() <= FEW_ENTRIES
    jax = pytest.importorskip("jax")
    from impl_jax.model import rms_norm as jax_rms_norm

    theirs = np.asarray(jax_rms_norm(jax.numpy.asarray(x), jax.numpy.asarray(scale), None, 1e-6))
    assert theirs.dtype == np.float16
    assert np.abs(theirs.astype(np.float32) - llama.astype(np.float32)).max() <= 2 * np.abs(
        llama.astype(np.float32)).max() * 2.0 ** -11
    assert (theirs != llama).sum() <= FEW_ENTRIES


def _torch_without_upcast(x, scale, bias, eps, plus_one=False):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * scale


def _jax_without_upcast(x, scale, bias, eps, plus_one=False):
    import jax

    return x * jax.lax.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps) * scale


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_norm_without_its_float32_statistics_fails_the_large_case(backend, monkeypatch):
    """vLLM PR #29810's mistake, planted: RMSNorm's mean square taken in float16. Activations of
    size 1e3 (a Llama's outliers) square past float16's 65504, the root of inf zeroes the row,
    and norm-large fails at float16 only; the honest implementation passes every norm cell."""
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    plan = plan_matrix(cfg, [backend], ["float32", "float16", "bfloat16"], ["cpu"])
    honest = run_matrix(cfg, params, plan, pattern="norm-*")
    assert {r.test_id for r in honest if r.status == PASS} >= {f"norm-large-float16-{backend}-cpu",
                                                                f"norm-small-float16-{backend}-cpu"}
    assert all(r.status == PASS for r in honest)
    if backend == "torch":
        import impl_torch.model as module
        monkeypatch.setattr(module, "rms_norm", _torch_without_upcast)
    else:
        import jax

        import impl_jax.model as module
        jax.clear_caches()  # programs traced with the honest norm must not be reused
        monkeypatch.setattr(module, "rms_norm", _jax_without_upcast)
    try:
        planted = run_matrix(cfg, params, plan, pattern="norm-*")
    finally:
        if backend == "jax":
            jax.clear_caches()
    # every norm's large case: the FFN's, the self-attention's and the final one
    assert {r.test_id for r in planted if r.status != PASS} == {
        f"norm-{case}-float16-{backend}-cpu" for case in ("large", "large_attn", "large_final")}
