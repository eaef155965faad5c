"""impl_jax held to the spec: the catalogue through the harness, loading, cache, errors, and
Flax's own nnx.MultiHeadAttention as a second, independent implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import impl_numpy as golden
from conformance.cases import case_names
from conformance.harness import PASS, plan_matrix, run_matrix
from conformance.tolerance import compare, tolerance
from impl_jax import Transformer, scaled_dot_product_attention
from spec import (
    InputError,
    WeightsError,
    conformance_params,
    param_shapes,
    params_digest,
    params_under,
    save_weights,
)
from tests.bad_inputs import BAD_FORWARD_INPUTS, BAD_GENERATION
from tests.bounds import assert_agrees, assert_differs, model_bounds
from tests.presets_check import check_preset_forward
from tests.variants import PROPERTY_PRESETS, TINY, VARIANTS


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


# Cold XLA compiles dominate the time (10-15 s a column on CI's two cores, about one program per
# model-level shape and one per operation and shape, whatever the cells), so the columns are chosen:
# each dtype and path on tiny (at float64 the two paths are one: see scaled_dot_product_attention),
# the decoder-only arch (char-lm) and every option variant at float32. char-lm's float64 and jax-math
# columns (18 s) ran that dtype and that path again on a decoder that differs from tiny's by what it
# leaves out (the cross-attention and the encoder), which neither reaches: tiny's decoder runs the
# causal self-attention at every dtype and on both paths, and char-lm's float64 decoding is
# test_cached_decode_equals_full_forward_float64[char-lm]'s (issue 58).
CPU_COLUMNS = {variant: [("jax", "float32")] for variant in VARIANTS}
CPU_COLUMNS["tiny"] = [("jax", "float64"), ("jax", "float32"), ("jax-math", "float32"), ("jax", "float16"),
                       ("jax", "bfloat16")]


@pytest.fixture(scope="module")
def cpu_matrix():
    results = {}
    for variant, cfg in VARIANTS.items():
        params = conformance_params(cfg, seed=1)
        for backend, dtype in CPU_COLUMNS[variant]:
            plan = plan_matrix(cfg, [backend], [dtype], ["cpu"])
            assert not plan.skipped_columns, plan.skipped_columns
            for r in run_matrix(cfg, params, plan):
                results[(variant, r.test_id)] = r
    return results


def _cell_ids():
    ids = []
    for variant, cfg in VARIANTS.items():
        prefix = "" if variant == "tiny" else f"{variant}:"
        for sublayer, mask_case in case_names(cfg):
            for backend, dtype in CPU_COLUMNS[variant]:
                test_id = f"{sublayer}-{mask_case}-{dtype}-{backend}-cpu"
                ids.append(pytest.param(variant, test_id, id=prefix + test_id))
    return ids


@pytest.mark.parametrize("variant, test_id", _cell_ids())
def test_catalogue_cpu(cpu_matrix, variant, test_id):
    result = cpu_matrix[(variant, test_id)]
    assert result.status == PASS, result.reason


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no GPU visible to JAX on this machine")
@pytest.mark.parametrize("dtype", ["float32", "tf32", "float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["tiny", "char-lm"])
def test_catalogue_gpu(variant, dtype):
    """float32 at precision 'highest' and 'default' (the 'tf32' column), float16, bfloat16: one test
    per column pair, so pytest's workers share what took 176 s in one test on an H200
    (reports/gpu/nvidia-h200/logs/pytest-gpu.txt: most of it XLA compiling)."""
    cfg = VARIANTS[variant]
    plan = plan_matrix(cfg, ["jax", "jax-math"], [dtype], ["cuda"])
    failures = [f"{variant}:{r.test_id}: {r.status} {r.reason}" for r in run_matrix(cfg, conformance_params(cfg), plan)
                if r.status != PASS]
    assert not failures, "\n".join(failures)


# ---- loading: canonical [in, out] matrices go straight into nnx.Linear kernels ----------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(variant):
    cfg = VARIANTS[variant]
    params = conformance_params(cfg, seed=4)
    back = Transformer.from_params(cfg, params).to_params()
    assert list(back) == list(param_shapes(cfg)) and params_digest(back) == params_digest(params)
    with jax.enable_x64(True):
        back64 = Transformer.from_params(cfg, params, dtype="float64").to_params()
    assert params_digest(back64) == params_digest(params)


def test_no_transpose_and_the_leaf_names():
    params = conformance_params(TINY)
    model = Transformer.from_params(TINY, params)
    assert np.array_equal(model.encoder.layers[0].ffn.w1.kernel[...], params["encoder.layers.0.ffn.w1.weight"])
    assert np.array_equal(model.tgt_embed.embedding[...], params["tgt_embed.weight"])
    flat = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    renamed = {name.replace(".kernel", ".weight").replace(".embedding", ".weight") for name in flat}
    assert renamed == set(param_shapes(TINY))


def test_float64_needs_x64_and_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="x64"):
        Transformer.from_params(TINY, conformance_params(TINY), dtype="float64")
    with pytest.raises(ValueError, match="attention must be one of sdpa, math"):
        Transformer(TINY, attention="flash")
    with pytest.raises(ValueError, match="precision must be one of highest, default"):
        Transformer(TINY, precision="fast")
    save_weights(tmp_path / "w.safetensors", TINY, conformance_params(TINY))
    assert Transformer.from_file(tmp_path / "w.safetensors", attention="math").cfg == TINY
    bad = conformance_params(TINY)
    bad["decoder.layers.0.ffn.w2.weight"] = bad["decoder.layers.0.ffn.w2.weight"].T.copy()
    with pytest.raises(WeightsError, match=r"ffn.w2.weight: shape \[64, 256\], expected \[256, 64\]"):
        Transformer.from_params(TINY, bad)


# ---- jitted cache and generation -----------------------------------------------------------

@pytest.mark.parametrize("variant", ["tiny", "tiny.pre_std_final", "char-lm"])
def test_cached_decode_equals_full_forward_float64(variant):
    cfg = VARIANTS[variant]
    params = conformance_params(cfg, seed=2)
    generator = np.random.default_rng(0)
    src = None if not cfg.has_encoder else generator.integers(1, cfg.src_vocab_size, (3, 5))
    tgt = generator.integers(1, cfg.tgt_vocab_size, (3, 6))
    tgt[0, :2] = cfg.pad_id  # left padding: fully masked rows inside the cache
    with jax.enable_x64(True):
        model = Transformer.from_params(cfg, params, dtype="float64")
        full = np.asarray(model(src, tgt))
        cache = model.start_cache(3, 6, src)
        _, cache = model.decode_step(cache, tgt[:, :2])  # a two-token prefill, then single steps
        steps = []
        for t in range(2, 6):
            logits, cache = model.decode_step(cache, tgt[:, t:t + 1])
            steps.append(np.asarray(logits))
    assert int(cache.length) == 6
    bounds = model_bounds(cfg, 6, 0 if src is None else 5)
    assert_agrees(np.concatenate(steps, axis=1), full[:, 2:], **bounds, what="cached decode vs forward")
    assert_agrees(full, golden.forward(cfg, params, src, tgt), **bounds, what="forward")


def test_cache_capacity_is_enforced():
    model = Transformer.from_params(TINY, conformance_params(TINY))
    cache = model.start_cache(1, 2, np.ones((1, 3), np.int64))
    _, cache = model.decode_step(cache, np.ones((1, 2), np.int64))
    with pytest.raises(InputError, match="the cache holds 2 positions"):
        model.decode_step(cache, np.ones((1, 1), np.int64))


@pytest.mark.parametrize("variant", ["tiny", "char-lm"])
def test_jitted_generation_matches_the_golden(variant):
    cfg = VARIANTS[variant]
    params = conformance_params(cfg, seed=3)
    generator = np.random.default_rng(1)
    if cfg.has_encoder:
        src = generator.integers(3, cfg.src_vocab_size, (4, 6))
        src[2, 4:] = cfg.pad_id
        options = {"bos_id": 1, "eos_id": 2}
    else:
        src, options = None, {"prompt_ids": np.array([[0, 0, 65], [66, 67, 68]])}
    expected = golden.greedy_generate(cfg, params, src, max_new_tokens=7, **options)
    with jax.enable_x64(True):
        model = Transformer.from_params(cfg, params, dtype="float64")
        assert np.array_equal(np.asarray(model.greedy_generate(src, max_new_tokens=7, **options)), expected)


# ---- native JAX behaviour the implementation works around (pinned so the docs stay true) ------

def test_fully_masked_rows_are_zero_on_both_paths():
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 2, 3, 4)) for i in range(3))
    mask = jnp.ones((2, 2, 3, 3), bool).at[1, :, 2].set(False)
    for path in ("sdpa", "math"):
        out = scaled_dot_product_attention(q, k, v, mask, path)
        assert jnp.isfinite(out).all() and (out[1, :, 2] == 0).all()


def test_native_dot_product_attention_averages_a_fully_masked_row():
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 3, 1, 4)) for i in range(3))  # [B, T, H, d_k]
    mask = jnp.zeros((1, 1, 3, 3), bool)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    # the mean of V, not zeros: a float32 attention of d_k = 4 over 3 keys
    assert_agrees(out[0, 0, 0], np.asarray(v[0, :, 0], np.float64).mean(axis=0), n=4, dtype="float32")


def test_native_dot_product_attention_is_float32_accurate_at_float64():
    with jax.enable_x64(True):
        q, k, v = (jax.random.normal(jax.random.key(i), (2, 5, 2, 8), dtype=jnp.float64) for i in range(3))
        native = jax.nn.dot_product_attention(q, k, v)
        ours = scaled_dot_product_attention(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)).swapaxes(1, 2)
        exact = golden.scaled_dot_product_attention(*(np.asarray(a.swapaxes(1, 2)) for a in (q, k, v))).swapaxes(1, 2)
    # one attention: its longest sum is d_k = 8 (5 keys)
    assert_differs(np.asarray(native), exact, n=8, what="native")  # softmax taken in float32
    assert_agrees(np.asarray(ours), exact, n=8, what="ours")


def test_each_cell_names_the_attention_path_it_took(cpu_matrix):
    """float64 and float16-on-CPU cells of the `jax` column run the explicit program jax-math runs:
    the report says so per cell and counts them apart, so they are not read as evidence for
    jax.nn.dot_product_attention."""
    from conformance.output.report import attention_paths, format_attention_paths

    expected = {("jax", "float64"): "explicit (jax.nn.dot_product_attention takes its softmax in float32)",
                ("jax", "float32"): "jax.nn.dot_product_attention", ("jax-math", "float32"): "explicit",
                ("jax", "float16"): "explicit (XLA:CPU lacks the F16_F16_F32 dot algorithm)",
                ("jax", "bfloat16"): "jax.nn.dot_product_attention"}
    tiny = [r for (variant, _), r in cpu_matrix.items() if variant == "tiny"]
    for r in tiny:
        has_attention = r.sublayer not in ("embedding", "positional", "ffn", "norm", "ffn_block", "logits", "log_probs")
        assert r.path == (expected[(r.backend, r.dtype)] if has_attention else ""), r.test_id
    lines = format_attention_paths(attention_paths(tiny)).splitlines()
    float64 = next(line for line in lines if line.startswith("attention in jax/float64/cpu: "))
    assert "cells explicit (jax.nn.dot_product_attention takes its softmax in float32)" in float64
    assert "jax.nn.dot_product_attention;" not in float64 and not float64.endswith("cells jax.nn.dot_product_attention")


@pytest.mark.parametrize("dtype, platform, n_queries, taken", [
    ("float64", "cpu", 4, "math"), ("float16", "gpu", 1, "math"), ("float16", "gpu", 3, "sdpa"),
    ("float32", "cpu", 1, "sdpa"), ("bfloat16", "cpu", 2, "sdpa"),
])
def test_attention_path_names_the_fallback(dtype, platform, n_queries, taken):
    from impl_jax import attention_path

    path, why = attention_path(jnp.dtype(dtype), platform, n_queries, "sdpa")
    assert path == taken and (why is None) == (taken == "sdpa")
    assert attention_path(jnp.dtype(dtype), platform, n_queries, "math") == ("math", None)


@pytest.mark.parametrize("dtype, platform, n_queries, fails", [
    ("float16", "cpu", 1, True), ("float16", "cpu", 5, True),
    ("float16", "gpu", 1, True), ("float16", "cuda", 1, True), ("float16", "gpu", 3, False),
    ("bfloat16", "gpu", 1, False), ("float32", "gpu", 1, False), ("float32", "cpu", 1, False),
])
def test_where_native_attention_fails(dtype, platform, n_queries, fails):
    from impl_jax.model import native_attention_fails

    assert (native_attention_fails(jnp.dtype(dtype), platform, n_queries) is not None) == fails


@pytest.mark.parametrize("n_queries, native", [(1, False), (3, True)])
def test_a_single_float16_query_on_a_gpu_takes_the_explicit_path(monkeypatch, n_queries, native):
    """On a GPU (simulated: the platform is all the routing reads), float16 attention with one
    query never reaches jax.nn.dot_product_attention, which XLA:GPU fails to compile for it."""
    import impl_jax.model as model

    calls = []
    monkeypatch.setattr(model, "_platform", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, mask=None, **options: calls.append(q.shape) or q)
    q = jnp.ones((2, 4, n_queries, 8), jnp.float16)
    k = v = jnp.ones((2, 4, 5, 8), jnp.float16)
    with jax.disable_jit():  # run here, not from jit's cache
        out = model.scaled_dot_product_attention(q, k, v)
    assert bool(calls) == native and out.shape == q.shape and out.dtype == jnp.float16


def test_jax_gelu_default_is_the_tanh_form():
    x = jnp.linspace(-3, 3, 13)
    assert np.array_equal(jax.nn.gelu(x), jax.nn.gelu(x, approximate=True))  # the very same computation
    # the erf form is another function: beyond float32's rounding of one element (n = 1)
    assert_differs(jax.nn.gelu(x), jax.nn.gelu(x, approximate=False), n=1, dtype="float32")


# ---- Flax's own MultiHeadAttention agrees with ours and the golden ----------------------------

def test_flax_multi_head_attention_agrees():
    params = conformance_params(TINY, seed=9)
    attention = params_under(params, "encoder.layers.0.self_attn")
    heads, d_head, d = TINY.n_heads, TINY.d_head, TINY.d_model
    flax_attention = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=nnx.Rngs(0),
                                            precision="highest")
    # Heads are contiguous column blocks of q/k/v and row blocks of o, which is exactly Flax's
    # [in, heads, d_k] and [heads, d_k, out] kernel layout after a reshape.
    for ours, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
        getattr(flax_attention, theirs).kernel[...] = jnp.asarray(attention[f"{ours}.weight"].reshape(d, heads, d_head))
        getattr(flax_attention, theirs).bias[...] = jnp.asarray(attention[f"{ours}.bias"].reshape(heads, d_head))
    flax_attention.out.kernel[...] = jnp.asarray(attention["o.weight"].reshape(heads, d_head, d))
    flax_attention.out.bias[...] = jnp.asarray(attention["o.bias"])
    x = np.random.default_rng(0).standard_normal((2, 5, d)).astype(np.float32)
    keep = np.ones((2, 1, 5, 5), bool)
    keep[1, :, :, 3:] = False  # padding, but every row keeps a key (Flax averages empty rows)
    theirs = np.asarray(flax_attention(jnp.asarray(x), mask=jnp.asarray(keep), deterministic=True))
    model = Transformer.from_params(TINY, params)
    ours = np.asarray(model.encoder.layers[0].self_attn(jnp.asarray(x), jnp.asarray(x), jnp.asarray(keep)))
    reference = golden.multi_head_attention(TINY, attention, x.astype(np.float64), x.astype(np.float64), keep)
    relative = tolerance("float32", max(d, 5), 1)  # one attention: d = 64 its longest sum (5 keys)
    assert compare(theirs, reference, relative).passed and compare(ours, reference, relative).passed
    # each within the tolerance of the golden, so within twice it of each other
    assert compare(theirs, ours, 2 * relative).passed


# ---- bad input: the same errors as the golden -------------------------------------------------

@pytest.mark.parametrize("src, tgt, message", [pytest.param(*case[1:], id=case[0]) for case in BAD_FORWARD_INPUTS])
def test_bad_inputs_raise_the_goldens_error(src, tgt, message):
    model = Transformer.from_params(TINY, conformance_params(TINY))
    with pytest.raises(InputError, match=message) as jax_error:
        model(src, tgt)
    with pytest.raises(InputError) as golden_error:
        golden.forward(TINY, conformance_params(TINY), src, tgt)
    assert str(jax_error.value) == str(golden_error.value)


def test_bad_inputs_as_jax_arrays_and_masks():
    model = Transformer.from_params(TINY, conformance_params(TINY))
    with pytest.raises(InputError, match="token id 96"):
        model(jnp.full((1, 2), 96), jnp.ones((1, 2), jnp.int32))
    with pytest.raises(InputError, match="integer token ids"):
        model(jnp.ones((1, 2), jnp.float32), jnp.ones((1, 2), jnp.int32))
    x = jnp.zeros((2, 5, 64))
    with pytest.raises(InputError, match="does not fit"):
        model.encoder.layers[0].self_attn(x, x, jnp.ones((2, 5, 6), bool))
    with pytest.raises(InputError, match="boolean keep-mask"):
        model.encoder.layers[0].self_attn(x, x, jnp.ones((5, 5)))


def test_learned_positions_past_max_len():
    cfg = VARIANTS["tiny.nobias_gelutanh"]  # learned positions, max_len 6
    model = Transformer.from_params(cfg, conformance_params(cfg))
    with pytest.raises(InputError, match="past the learned position table"):
        model(np.ones((1, 7), np.int64), np.ones((1, 2), np.int64))


# ---- every preset ---------------------------------------------------------------------------

# the presets that carry an option no smaller one does (tests/variants.PROPERTY_PRESETS): paper-base,
# paper-big and the bench's llama-small, gemma2-small and qwen35-small carry none of their own, and
# their widths are real widths
# as torch-nn's, annotated's and learned-pos's are
@pytest.mark.parametrize("name", PROPERTY_PRESETS)
def test_every_preset_matches_the_golden(name):
    check_preset_forward(name, lambda cfg, params, src, tgt: Transformer.from_params(cfg, params)(src, tgt))


@pytest.mark.parametrize("kwargs, message", [pytest.param(*case[1:], id=case[0]) for case in BAD_GENERATION])
def test_bad_generation_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        Transformer.from_params(TINY, conformance_params(TINY)).greedy_generate(**kwargs)


def test_every_module_jit_compiles():
    """Beyond the jitted forward, decode step and generation loop: each module traces under
    nnx.jit and gives what it gives eagerly."""
    model = Transformer.from_params(TINY, conformance_params(TINY, seed=5))
    x = jax.random.normal(jax.random.key(0), (2, 5, 64))
    memory = jax.random.normal(jax.random.key(1), (2, 7, 64))
    mask = jnp.ones((2, 1, 5, 5), bool).at[0, :, :, 3:].set(False)
    d, d_ff, vocab = TINY.d_model, TINY.d_ff, TINY.tgt_vocab_size
    calls = {  # each with its longest sum n and the sublayers it chains (conformance/cases.py's depths)
        "encoder_layer": (lambda m, x: m.encoder.layers[0](x, mask), d_ff, 4),
        "decoder_layer": (lambda m, x: m.decoder.layers[1](x, memory, mask, None), d_ff, 6),
        "cross_attention": (lambda m, x: m.decoder.layers[0].cross_attn(x, memory, None), d, 1),
        "ffn_block": (lambda m, x: m.encoder.layers[1].ffn_block(x), d_ff, 2),
        "log_probs": (lambda m, x: m.log_probs(x), max(d, vocab), 2),
    }
    for name, (call, n, depth) in calls.items():
        eager, jitted = call(model, x), nnx.jit(call)(model, x)
        assert_agrees(np.asarray(jitted), np.asarray(eager), n=n, depth=depth, dtype="float32", what=name)


def test_persistent_compilation_cache(tmp_path, monkeypatch):
    from conformance.backends.jax_backend import use_persistent_compilation_cache

    previous = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("ROSETTA_JAX_CACHE", "0")
        assert use_persistent_compilation_cache() is None and jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv("ROSETTA_JAX_CACHE", str(tmp_path / "cache"))
        assert use_persistent_compilation_cache() == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
        monkeypatch.setenv("ROSETTA_JAX_CACHE", str(tmp_path / "elsewhere"))
        assert use_persistent_compilation_cache() == str(tmp_path / "cache")  # a configured cache is kept
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
