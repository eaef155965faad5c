"""impl_torch held to the spec: the catalogue through the harness, loading, cache, errors, interop."""

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import impl_numpy as golden
from conformance.cases import end_of_sequence
from conformance.harness import PASS, plan_matrix, run_matrix
from impl_torch import Transformer, scaled_dot_product_attention
from impl_torch.torch_nn import from_torch_nn, to_torch_nn, torch_nn_transformer
from spec import (
    InputError,
    WeightsError,
    get_preset,
    conformance_params,
    param_shapes,
    params_digest,
    save_weights,
)
from tests.bad_inputs import BAD_FORWARD_INPUTS, BAD_GENERATION
from tests.bounds import assert_agrees, model_bounds
from tests.presets_check import check_preset_forward
from tests.variants import PROPERTY_PRESETS, TINY, VARIANTS

BACKENDS = ["torch", "torch-math"]
CPU_DTYPES = ["float64", "float32", "float16", "bfloat16"]
HAS_CUDA = torch.cuda.is_available()


def _matrix(device, dtypes):
    results = {}
    for variant, cfg in VARIANTS.items():
        plan = plan_matrix(cfg, BACKENDS, dtypes, [device])
        assert not plan.skipped_columns, plan.skipped_columns
        for r in run_matrix(cfg, conformance_params(cfg, seed=1), plan):
            results[(variant, r.test_id)] = r
    return results


@pytest.fixture(scope="module")
def cpu_matrix():
    return _matrix("cpu", CPU_DTYPES)


def _cell_ids(device, dtypes):
    from conformance.cases import case_names
    ids = []
    for variant, cfg in VARIANTS.items():
        for sublayer, mask_case in case_names(cfg):
            for backend in BACKENDS:
                for dtype in dtypes:
                    test_id = f"{sublayer}-{mask_case}-{dtype}-{backend}-{device}"
                    prefix = "" if variant == "tiny" else f"{variant}:"
                    ids.append(pytest.param(variant, test_id, id=prefix + test_id))
    return ids


@pytest.mark.parametrize("variant, test_id", _cell_ids("cpu", CPU_DTYPES))
def test_catalogue_cpu(cpu_matrix, variant, test_id):
    result = cpu_matrix[(variant, test_id)]
    assert result.status == PASS, result.reason


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
def test_catalogue_cuda():
    results = _matrix("cuda", ["float64", "float32", "tf32", "float16", "bfloat16"])
    failures = [f"{key}: {r.status} {r.reason}" for key, r in results.items() if r.status != PASS]
    assert not failures, "\n".join(failures)


# ---- loading: the module tree is the canonical names ------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_keys_are_the_canonical_names(variant):
    cfg = VARIANTS[variant]
    model = Transformer.from_params(cfg, conformance_params(cfg))
    assert set(model.state_dict()) == set(param_shapes(cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(variant, dtype):
    cfg = VARIANTS[variant]
    params = conformance_params(cfg, seed=4)
    back = Transformer.from_params(cfg, params, dtype=dtype).to_params()
    assert list(back) == list(param_shapes(cfg)) and params_digest(back) == params_digest(params)


def test_linear_weights_are_transposed_and_nothing_else():
    params = conformance_params(TINY)
    model = Transformer.from_params(TINY, params)
    assert torch.equal(model.encoder.layers[0].ffn.w1.weight, torch.from_numpy(params["encoder.layers.0.ffn.w1.weight"].T))
    assert torch.equal(model.tgt_embed.weight, torch.from_numpy(params["tgt_embed.weight"]))
    assert torch.equal(model.decoder.layers[1].cross_attn_norm.scale,
                       torch.from_numpy(params["decoder.layers.1.cross_attn_norm.scale"]))


def test_from_file_and_refusals(tmp_path):
    cfg = VARIANTS["tiny.concat_gelu_untied"]
    params = conformance_params(cfg)
    save_weights(tmp_path / "w.safetensors", cfg, params)
    model = Transformer.from_file(tmp_path / "w.safetensors", attention="math")
    assert model.cfg == cfg and params_digest(model.to_params()) == params_digest(params)
    bad = dict(params)
    bad.pop("head.weight")
    with pytest.raises(WeightsError, match="missing: head.weight"):
        Transformer.from_params(cfg, bad)
    with pytest.raises(ValueError, match="attention must be one of sdpa, math"):
        Transformer(cfg, attention="flash")


# ---- the cache and generation ---------------------------------------------------------------

@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("variant", ["tiny", "tiny.pre_std_final", "char-lm"])
def test_cached_decode_equals_full_forward_float64(variant, attention):
    cfg = VARIANTS[variant]
    model = Transformer.from_params(cfg, conformance_params(cfg, seed=2), dtype=torch.float64, attention=attention)
    generator = np.random.default_rng(0)
    src = None if not cfg.has_encoder else generator.integers(1, cfg.src_vocab_size, (3, 5))
    tgt = generator.integers(1, cfg.tgt_vocab_size, (3, 6))
    tgt[0, :2] = cfg.pad_id  # left padding: fully masked rows inside the cache
    if src is not None:
        src[1, 3:] = cfg.pad_id
    with torch.inference_mode():
        full = model(src, tgt).numpy()
    cache = model.start_cache(3, 6, src)
    steps = []
    for t in range(6):
        logits, cache = model.decode_step(cache, tgt[:, t:t + 1])
        steps.append(logits.numpy())
    bounds = model_bounds(cfg, 6, 0 if src is None else 5)
    assert_agrees(np.concatenate(steps, axis=1), full, **bounds, what="cached decode vs forward")
    assert_agrees(full, golden.forward(cfg, conformance_params(cfg, seed=2), src, tgt), **bounds, what="forward")


def test_generation_matches_the_golden():
    params = conformance_params(TINY, seed=3)
    src = np.random.default_rng(1).integers(3, 96, (4, 6))
    src[2, 4:] = 0
    expected = golden.greedy_generate(TINY, params, src, bos_id=1, eos_id=2, max_new_tokens=8)
    for attention in ("sdpa", "math"):
        model = Transformer.from_params(TINY, params, dtype=torch.float64, attention=attention)
        assert np.array_equal(model.greedy_generate(src, bos_id=1, eos_id=2, max_new_tokens=8).numpy(), expected)


# ---- the preallocated cache ------------------------------------------------------------------

def _tiny_float64():
    params = conformance_params(TINY, seed=4)
    return Transformer.from_params(TINY, params, dtype=torch.float64), params


@settings(max_examples=12, deadline=None)
@given(chunks=st.lists(st.integers(1, 3), min_size=1, max_size=5), spare=st.integers(0, 3))
def test_any_split_into_steps_equals_the_forward(chunks, spare):
    """Feeding the target in chunks of any sizes, into a cache with room to spare, gives the
    forward's logits: the capacity's unused positions never leak into attention."""
    model, params = _tiny_float64()
    length = sum(chunks)
    generator = np.random.default_rng(length)
    src = generator.integers(1, TINY.src_vocab_size, (2, 4))
    tgt = generator.integers(1, TINY.tgt_vocab_size, (2, length))
    tgt[1, 0] = TINY.pad_id  # the start token stays real (SPEC.md §6)
    expected = golden.forward(TINY, params, src, tgt)
    cache, steps, at = model.start_cache(2, length + spare, src), [], 0
    for n in chunks:
        logits, cache = model.decode_step(cache, tgt[:, at:at + n])
        steps.append(logits.numpy())
        at += n
    assert cache.length == length
    assert_agrees(np.concatenate(steps, axis=1), expected, **model_bounds(TINY, length, 4))


def test_a_step_writes_into_the_buffers_it_was_given():
    model, _ = _tiny_float64()
    cache = model.start_cache(2, 5, np.ones((2, 3), np.int64))
    keys, values = cache.self_keys.data_ptr(), cache.self_values.data_ptr()
    for _ in range(5):
        _, cache = model.decode_step(cache, np.full((2, 1), 4))
    assert (cache.self_keys.data_ptr(), cache.self_values.data_ptr()) == (keys, values)
    assert cache.self_keys.shape == (TINY.n_decoder_layers, 2, TINY.n_heads, 5, TINY.d_head)


def test_continuing_an_ancestor_rewinds_and_a_stale_branch_is_refused():
    model, params = _tiny_float64()
    src = np.array([[5, 6, 7]])
    tgt = np.array([[1, 8, 9, 10]])
    root = model.start_cache(1, 4, src)
    _, prefix = model.decode_step(root, tgt[:, :2])
    _, branch_a = model.decode_step(prefix, tgt[:, 2:3])
    # a rewind: continuing the prefix again rewrites position 2 with another token
    other, branch_b = model.decode_step(prefix, np.array([[11]]))
    expected = golden.forward(TINY, params, src, np.array([[1, 8, 11]]))[:, -1:]
    assert_agrees(other.numpy(), expected, **model_bounds(TINY, 3, 3), what="the rewound branch")
    with pytest.raises(InputError, match="copy\\(\\) a cache"):
        model.decode_step(branch_a, tgt[:, 3:4])  # its position 2 now holds branch b's token
    # a copy is a branch of its own
    _, copied = model.decode_step(prefix.copy(), tgt[:, 2:3])
    model.decode_step(branch_b, np.array([[12]]))
    last, _ = model.decode_step(copied, tgt[:, 3:4])
    assert_agrees(last.numpy(), golden.forward(TINY, params, src, tgt)[:, -1:], **model_bounds(TINY, 4, 3),
                  what="the copied branch")


@pytest.fixture
def counted_graphs():
    """A torch.compile backend that counts the graphs Dynamo hands it and runs each as plain
    PyTorch (no code generated): the graphs list and the backend."""
    import torch._dynamo

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    yield graphs, backend
    torch._dynamo.reset()


def _float64_model(variant: str, seed: int):
    cfg = VARIANTS[variant] if variant in VARIANTS else get_preset(variant)
    params = conformance_params(cfg, seed=seed)
    return cfg, params, Transformer.from_params(cfg, params, dtype=torch.float64)


@pytest.mark.parametrize("variant", ["tiny", "char-lm", "qwen3-tiny"])
def test_the_step_is_one_graph_for_every_position(variant, counted_graphs):
    """torch.compile traces the decode step's tensor work as one graph, without a break (no value
    read back to the host) and without a new graph per position: what CUDA graphs and
    mode="reduce-overhead" need on a GPU. The logits are the uncompiled step's."""
    import impl_torch.model as torch_model
    from impl_torch import compiled_step

    graphs, backend = counted_graphs
    cfg, _, model = _float64_model(variant, seed=5)
    step = compiled_step(backend=backend)
    source = np.full((2, 4), 5) if cfg.has_encoder else None
    ids = np.random.default_rng(0).integers(3, cfg.tgt_vocab_size, (2, 6))
    compiled, plain = model.start_cache(2, 6, source), model.start_cache(2, 6, source)
    keep = torch.ones(2, 1, dtype=torch.bool)
    with torch.inference_mode():
        for t in range(6):
            token, start = torch.as_tensor(ids[:, t:t + 1]), torch.full((), t, dtype=torch.long)
            assert torch.equal(step(model, compiled, token, keep, start),
                               torch_model._decode_step_body(model, plain, token, keep, start))
    assert len(graphs) == 1


@pytest.mark.parametrize("variant", ["tiny", "char-lm", "qwen3-tiny"])
def test_generation_with_the_compiled_step_gives_the_goldens_tokens(variant, counted_graphs):
    """greedy_generate(step=compiled_step(...)) runs the traced graph each step (on a GPU,
    mode="reduce-overhead" would replay it as a CUDA graph): the golden's tokens, one graph per
    chunk length (the prompt's, then one token)."""
    from impl_torch import compiled_step

    graphs, backend = counted_graphs
    cfg, params, model = _float64_model(variant, seed=3)
    source = np.random.default_rng(1).integers(3, 50, (3, 5))
    arguments = ({"src_ids": source, "bos_id": 1} if cfg.has_encoder else {"prompt_ids": source})
    expected = golden.greedy_generate(cfg, params, **arguments, eos_id=2, max_new_tokens=12)
    tokens = model.greedy_generate(**arguments, eos_id=2, max_new_tokens=12, step=compiled_step(backend=backend))
    assert np.array_equal(tokens.numpy(), expected)
    assert len(graphs) == (1 if cfg.has_encoder else 2)


@pytest.mark.parametrize("capacity", [0, -1, 2.5, "4", True])
def test_a_capacity_that_is_not_a_positive_integer_is_refused(capacity):
    model, _ = _tiny_float64()
    with pytest.raises(InputError, match="cache capacity must be a positive integer"):
        model.start_cache(1, capacity, np.ones((1, 3), np.int64))


def test_a_full_cache_is_refused():
    model, _ = _tiny_float64()
    cache = model.start_cache(1, 2, np.ones((1, 3), np.int64))
    _, cache = model.decode_step(cache, np.ones((1, 2), np.int64))
    with pytest.raises(InputError, match="the cache holds 2 positions; 2 are used and 1 more do not fit"):
        model.decode_step(cache, np.ones((1, 1), np.int64))


def test_generation_looks_at_the_device_only_every_few_steps(monkeypatch):
    """The loop never reads a generated token back to the host, and asks whether every row has
    finished once per STOP_CHECK_EVERY steps: the tokens are the golden's all the same."""
    import impl_torch.model as torch_model

    params = conformance_params(TINY, seed=3)
    src = np.random.default_rng(1).integers(3, 96, (4, 6))
    model = Transformer.from_params(TINY, params, dtype=torch.float64)
    looks, steps = [], []
    monkeypatch.setattr(torch_model, "_all_finished", lambda finished: looks.append(1) or bool(finished.all()))
    monkeypatch.setattr(torch_model, "check_decode_step", lambda *args: pytest.fail("generate checked its own ids"))
    body = torch_model._decode_step_body
    monkeypatch.setattr(torch_model, "_decode_step_body", lambda *args: steps.append(1) or body(*args))
    every = torch_model.STOP_CHECK_EVERY
    first = golden.greedy_generate(TINY, params, src, bos_id=1, max_new_tokens=1)[:, 0]
    # every row's first token is the eos: all finish at step 1, the loop stops at the first look
    same = np.repeat(src[:1], 4, axis=0)
    # an eos that ends some rows and not others: the loop runs to the end, looking every few steps
    eos_id, (_, rows_ended) = end_of_sequence(golden.greedy_generate(TINY, params, src, bos_id=1, max_new_tokens=30),
                                              default=2, pad_id=TINY.pad_id)
    assert 1 <= rows_ended < 4
    for source, eos_id, expected_steps, expected_looks in [(same, int(first[0]), every, 1), (src, None, 30, 0),
                                                           (src, eos_id, 30, 30 // every)]:
        looks.clear(), steps.clear()
        expected = golden.greedy_generate(TINY, params, source, bos_id=1, eos_id=eos_id, max_new_tokens=30)
        tokens = model.greedy_generate(source, bos_id=1, eos_id=eos_id, max_new_tokens=30).numpy()
        assert np.array_equal(tokens, expected)
        assert (len(steps), len(looks)) == (expected_steps, expected_looks)


# ---- the fully-masked-row rule and native behaviour -------------------------------------------

def test_fully_masked_rows_are_zero_on_both_paths():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 4, generator=generator) for _ in range(3))
    mask = torch.ones(2, 2, 3, 3, dtype=torch.bool)
    mask[1, :, 2] = False
    for path in ("sdpa", "math"):
        out = scaled_dot_product_attention(q, k, v, mask, path)
        assert torch.isfinite(out).all() and (out[1, :, 2] == 0).all()


def test_nn_multihead_attention_gives_nan_where_the_spec_gives_zeros():
    """Why the spec states the rule: torch's own nn.MultiheadAttention (and so nn.Transformer)
    returns NaN for a query whose keys are all padding."""
    attention = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    x = torch.randn(1, 3, 4)
    with torch.inference_mode():
        out, _ = attention(x, x, x, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    assert torch.isnan(out).all()


# ---- bad input: the same errors as the golden -------------------------------------------------

@pytest.mark.parametrize("src, tgt, message", [pytest.param(*case[1:], id=case[0]) for case in BAD_FORWARD_INPUTS])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_bad_inputs_raise_the_goldens_error(src, tgt, message, as_tensor):
    model = Transformer.from_params(TINY, conformance_params(TINY))
    def convert(a):  # torch has no string tensors: those stay NumPy
        return torch.as_tensor(a) if as_tensor and isinstance(a, np.ndarray) and a.dtype.kind in "biuf" else a
    with pytest.raises(InputError, match=message) as torch_error:
        model(convert(src), convert(tgt))
    with pytest.raises(InputError) as golden_error:
        golden.forward(TINY, conformance_params(TINY), src, tgt)
    assert str(torch_error.value) == str(golden_error.value)


def test_learned_positions_past_max_len():
    cfg = VARIANTS["tiny.nobias_gelutanh"]  # learned positions, max_len 6
    model = Transformer.from_params(cfg, conformance_params(cfg))
    with pytest.raises(InputError, match="past the learned position table"):
        model(np.ones((1, 7), np.int64), np.ones((1, 2), np.int64))
    cache = model.start_cache(1, 8, np.ones((1, 2), np.int64))  # capacity: the table's 6 positions
    assert cache.capacity == 6
    for _ in range(6):
        _, cache = model.decode_step(cache, np.ones((1, 1), np.int64))
    with pytest.raises(InputError, match="reaches position 6"):
        model.decode_step(cache, np.ones((1, 1), np.int64))


@pytest.mark.parametrize("mask, message", [
    (torch.ones(2, 5, 6, dtype=torch.bool), "does not fit"),
    (torch.ones(5, 5), "boolean keep-mask"),
    (torch.ones(1, 1, 1, 1, 5, dtype=torch.bool), "rank 1 to 4"),
])
def test_bad_masks(mask, message):
    model = Transformer.from_params(TINY, conformance_params(TINY))
    x = torch.randn(2, 5, 64)
    with pytest.raises(InputError, match=message):
        model.encoder.layers[0].self_attn(x, x, mask)


def test_bad_activations_in_the_harness_adapter():
    from conformance.backends.torch_backend import TorchBackend

    runner = TorchBackend().load(TINY, conformance_params(TINY), "float32", "cpu")
    with pytest.raises(InputError, match=re.escape("x must have shape [batch, length, 64]")):
        runner.run("mha", {"module": "encoder.layers.0.self_attn", "x": np.zeros((2, 3, 63), np.float32),
                           "context": np.zeros((2, 3, 64), np.float32), "mask": None})


# ---- torch.compile --------------------------------------------------------------------------

@pytest.mark.slow
def test_torch_compile_conforms():
    params = conformance_params(TINY, seed=6)
    model = Transformer.from_params(TINY, params)
    compiled = torch.compile(model)
    src = np.random.default_rng(2).integers(1, 96, (2, 7))
    tgt = np.random.default_rng(3).integers(1, 80, (2, 5))
    src[1, 4:] = 0
    # tensors, not NumPy arrays, and no_grad rather than inference_mode: dynamo's guards on
    # from_numpy inputs trip over inference-mode dispatch keys in this torch version
    with torch.no_grad():
        eager = model(torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
        out = compiled(torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    reference = golden.forward(TINY, params, src, tgt)
    assert_agrees(out, reference, **model_bounds(TINY, 5, 7), dtype="float32", what="compiled")
    assert_agrees(eager, reference, **model_bounds(TINY, 5, 7), dtype="float32", what="eager")


# ---- torch.nn.Transformer interop -----------------------------------------------------------

TORCH_NN = get_preset("torch-nn").replace(n_encoder_layers=2, n_decoder_layers=2)


def test_torch_nn_round_trip_is_exact():
    params = conformance_params(TORCH_NN, seed=1)
    state, extras = to_torch_nn(TORCH_NN, params)
    reference = torch_nn_transformer(TORCH_NN)
    reference.load_state_dict(state, strict=True)  # every key and shape accepted by torch itself
    back = from_torch_nn(TORCH_NN, reference.state_dict(), extras)
    assert params_digest(back) == params_digest(params)


def test_torch_nn_key_diff_is_readable():
    state, extras = to_torch_nn(TORCH_NN, conformance_params(TORCH_NN))
    state.pop("encoder.layers.0.linear1.bias")
    state["encoder.layers.0.extra"] = torch.zeros(1)
    state["decoder.layers.1.norm3.weight"] = torch.zeros(7)
    with pytest.raises(WeightsError) as error:
        from_torch_nn(TORCH_NN, state, extras)
    text = str(error.value)
    assert "3 difference(s)" in text and "- missing encoder.layers.0.linear1.bias" in text
    assert "+ unexpected encoder.layers.0.extra" in text
    assert "~ decoder.layers.1.norm3.weight: shape [7], expected [512]" in text


def test_torch_nn_refuses_what_it_cannot_express():
    with pytest.raises(WeightsError, match="norm must be layernorm.*qkv_bias must equal bias"):
        to_torch_nn(get_preset("annotated"), conformance_params(get_preset("annotated").replace(n_encoder_layers=1, n_decoder_layers=1)))


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_golden_equals_torch_nn_transformer(norm_position):
    """Same weights, same padding and causal masks: our golden and torch.nn.Transformer agree."""
    cfg = TORCH_NN.replace(norm_position=norm_position)
    params = conformance_params(cfg, seed=7)
    state, extras = to_torch_nn(cfg, params)
    reference = torch_nn_transformer(cfg).double()
    reference.load_state_dict({k: v.double() for k, v in state.items()})
    generator = np.random.default_rng(5)
    src, tgt = generator.integers(1, 1000, (3, 9)), generator.integers(1, 1000, (3, 7))
    src[1, 6:] = cfg.pad_id
    tgt[2, 5:] = cfg.pad_id  # right padding only: nn.Transformer gives NaN on rows with no key
    embed = lambda ids, side: torch.from_numpy(golden.embed(cfg, golden.cast_params(cfg, params), ids, side))  # noqa: E731
    src_padding, tgt_padding = torch.from_numpy(src == cfg.pad_id), torch.from_numpy(tgt == cfg.pad_id)
    # nn.Transformer's masks mark what to *exclude* (True = masked), the spec's what to keep.
    causal = ~torch.ones(7, 7, dtype=torch.bool).tril()  # True above the diagonal = may not attend
    with torch.inference_mode():
        hidden = reference(embed(src, "src"), embed(tgt, "tgt"), tgt_mask=causal, tgt_is_causal=True,
                           src_key_padding_mask=src_padding, tgt_key_padding_mask=tgt_padding,
                           memory_key_padding_mask=src_padding)
        logits = hidden @ extras["head.weight"].double().T + extras["head.bias"].double()
    assert_agrees(logits.numpy(), golden.forward(cfg, params, src, tgt), **model_bounds(cfg, 7, 9))


# ---- the modern decoder: RoPE, grouped-query attention, head_dim, gated FFN, q/k norms -----------

MODERN = {
    "llama-tiny": get_preset("llama-tiny"),
    "qwen2-tiny": get_preset("qwen2-tiny"),
    "qwen3-tiny": get_preset("qwen3-tiny"),
    "partial_rope_geglu_mqa": get_preset("llama-tiny").replace(
        rope_fraction=0.5, head_dim=12, n_kv_heads=1, qkv_bias=True, bias=True, activation="gelu-tanh"),
    # an encoder-decoder's cross-attention has no q/k norms, and none of it rotates
    "tiny.gqa_headdim_gated_qknorm": TINY.replace(norm="rmsnorm", n_kv_heads=2, head_dim=6, gated_ffn=True,
                                                  qk_norm=True),
}


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("variant", MODERN)
def test_the_modern_decoder_is_the_goldens_whole_and_in_steps(variant, attention):
    """float64: canonical state_dict keys, the forward of a padded batch, and decode steps of
    uneven chunks (the cache holds H_kv heads of rotated keys) all give the golden's logits."""
    cfg = MODERN[variant]
    params = conformance_params(cfg, seed=2)
    model = Transformer.from_params(cfg, params, dtype=torch.float64, attention=attention)
    assert set(model.state_dict()) == set(param_shapes(cfg))
    assert params_digest(model.to_params()) == params_digest(params)
    generator = np.random.default_rng(0)
    src = None if not cfg.has_encoder else generator.integers(3, cfg.src_vocab_size, (3, 5))
    tgt = generator.integers(3, cfg.tgt_vocab_size, (3, 7))
    tgt[0, :2] = cfg.pad_id
    tgt[2, 5:] = cfg.pad_id
    expected = golden.forward(cfg, params, src, tgt)
    bounds = model_bounds(cfg, 7, 0 if src is None else 5)
    with torch.inference_mode():
        assert_agrees(model(src, tgt).numpy(), expected, **bounds, what="forward")
    cache, steps = model.start_cache(3, 7, src), []
    for start, stop in [(0, 3), (3, 4), (4, 7)]:
        logits, cache = model.decode_step(cache, tgt[:, start:stop])
        steps.append(logits.numpy())
    assert_agrees(np.concatenate(steps, axis=1), expected, **bounds, what="decode steps")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_sdpa_reads_grouped_key_value_heads_as_the_math_path_repeats_them(dtype):
    """F.scaled_dot_product_attention(enable_gqa=True) with a boolean mask on CPU gives what the
    explicit repeat gives, with the spec's zeros for a row with no key."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 8, generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, 5, 8, generator=generator).to(dtype) for _ in range(2))
    mask = torch.rand(2, 1, 4, 5, generator=generator) > 0.3
    mask[1, :, 2] = False
    grouped = scaled_dot_product_attention(q, k, v, mask, "sdpa")
    repeated = scaled_dot_product_attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), mask, "sdpa")
    assert torch.equal(grouped, repeated) and (grouped[1, :, 2] == 0).all()
    math_path = scaled_dot_product_attention(q, k, v, mask, "math")
    # one attention: its longest sum is d_k = 8 (5 keys)
    assert_agrees(grouped.double().numpy(), math_path.double().numpy(), n=8, dtype=str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rotates_by_angles_taken_in_float32(dtype):
    """bfloat16 rounds positions 1000..1003 to 1000 or 1004, so angles taken in it are off by up
    to 2 radians (float16's by ~0.03); the tables are taken in float32 and cast, so the rotation
    is the float64 one to the dtype's rounding."""
    from conformance.tolerance import rotary_angle
    from impl_torch import rotary

    cfg = get_preset("llama-tiny")
    x = torch.randn(1, 1, 3, cfg.d_head, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = torch.arange(1000, 1003)
    exact = rotary(cfg, x, positions)
    # a rotation sums two terms per element, at the angle of position 1002
    assert_agrees(rotary(cfg, x.to(dtype), positions).double().numpy(), exact.numpy(), n=2,
                  dtype=str(dtype).removeprefix("torch."), angle=rotary_angle(cfg, 1002))


# ---- every preset ---------------------------------------------------------------------------

# the presets that carry an option no smaller one does (tests/variants.PROPERTY_PRESETS): paper-base,
# paper-big and the bench's llama-small, gemma2-small and qwen35-small carry none of their own, and
# their widths are real widths
# as torch-nn's, annotated's and learned-pos's are
@pytest.mark.parametrize("name", PROPERTY_PRESETS)
def test_every_preset_matches_the_golden(name):
    def forward(cfg, params, src, tgt):
        with torch.inference_mode():
            return Transformer.from_params(cfg, params)(src, tgt).numpy()

    check_preset_forward(name, forward)


@pytest.mark.parametrize("kwargs, message", [pytest.param(*case[1:], id=case[0]) for case in BAD_GENERATION])
def test_bad_generation_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        Transformer.from_params(TINY, conformance_params(TINY)).greedy_generate(**kwargs)
