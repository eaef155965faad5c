"""Gated DeltaNet's linear layers and the gated attention (SPEC §5.15): the golden's layer against
transformers' own Qwen3.5 modules, its cached decode against its forward, pads that move no state;
torch's and JAX's chunked prefill and recurrent steps against the golden, with planted mistakes
seen; and the refusals of everything that does not compute it yet."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import impl_numpy as golden
from impl_numpy.model import attend, gated_delta_net, rope_tables
from spec import ConfigError, GatedDeltaNet, ModelConfig, conformance_params, params_under
from tests.bounds import assert_agrees, assert_differs, model_bounds

MIXER = GatedDeltaNet(key_heads=2, value_heads=4, key_head_dim=6, value_head_dim=5, conv_kernel=3)
# a Qwen3.5-like hybrid whose every number differs from its neighbour's: three linear layers and a
# gated full-attention one, (1 + w) norms, q/k norms, a partial rotary
HYBRID = ModelConfig(arch="decoder-only", d_model=24, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=20,
                     n_decoder_layers=4, tgt_vocab_size=53, max_len=128, norm="rmsnorm", norm_position="pre",
                     norm_eps=1e-6, final_norm=True, positional="rope", rope_fraction=0.25, embed_scale=False,
                     activation="swish", gated_ffn=True, bias=False, qkv_bias=False, qk_norm=True,
                     norm_scale_plus_one=True, attention_output_gate=True,
                     layer_types=("linear", "linear", "linear", "full"), linear_attention=MIXER)


def _transformers_text_config():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3_5TextConfig(
        hidden_size=HYBRID.d_model, num_attention_heads=HYBRID.n_heads, num_key_value_heads=HYBRID.n_kv_heads,
        head_dim=HYBRID.d_head, linear_num_key_heads=MIXER.key_heads, linear_num_value_heads=MIXER.value_heads,
        linear_key_head_dim=MIXER.key_head_dim, linear_value_head_dim=MIXER.value_head_dim,
        linear_conv_kernel_dim=MIXER.conv_kernel, num_hidden_layers=4, rms_norm_eps=HYBRID.norm_eps,
        intermediate_size=HYBRID.d_ff, vocab_size=HYBRID.tgt_vocab_size)


def _drawn(module, seed: int) -> None:
    """Every parameter drawn away from its trivial value (no unit scale, no zero)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def _canonical_mixer(layer) -> dict[str, np.ndarray]:
    """transformers' Qwen3_5GatedDeltaNet as canonical parameters: in_proj_qkv and the conv split into
    q, k and v, every matrix [in, out]."""
    weights = {name: value.detach().numpy() for name, value in layer.named_parameters()}
    keys = MIXER.key_heads * MIXER.key_head_dim
    fused, conv = weights["in_proj_qkv.weight"], weights["conv1d.weight"][:, 0, :]
    splits = {"q": slice(0, keys), "k": slice(keys, 2 * keys), "v": slice(2 * keys, None)}
    params = {f"{name}.weight": fused[rows].T for name, rows in splits.items()}
    params |= {f"{name}_conv.weight": conv[rows] for name, rows in splits.items()}
    return params | {"z.weight": weights["in_proj_z.weight"].T, "beta.weight": weights["in_proj_b.weight"].T,
                     "decay.weight": weights["in_proj_a.weight"].T, "decay.bias": weights["dt_bias"],
                     "decay.log_rate": weights["A_log"], "norm.scale": weights["norm.weight"],
                     "o.weight": weights["out_proj.weight"].T}


def _mixer_bounds(length: int) -> dict:
    """SPEC §5.15's count: the state chains the updates of `length` tokens, each non-expansive (a
    rounding carried on, never grown), so a linear layer is `length` sublayers deep; its longest sum
    a d_k or d_v product, or d."""
    return {"n": max(HYBRID.d_model, MIXER.key_head_dim, MIXER.value_head_dim), "depth": length}


def _hybrid_bounds(length: int) -> dict:
    """The whole model's bounds with each linear layer `length` sublayers deep."""
    bounds = model_bounds(HYBRID, length)
    linear = HYBRID.layer_types.count("linear")
    return bounds | {"depth": bounds["depth"] + linear * (length - 1)}


def test_the_golden_mixer_is_transformers_gated_delta_net():
    """transformers' Qwen3_5GatedDeltaNet (its torch chunked path, chunks of 64, and its recurrent
    step) on float64 inputs: its kernels compute the recurrence in float32 whatever the input, so
    the two agree to float32's tolerance, and a planted mistake (β's and the decay's projections
    swapped) is far outside it."""
    text_config = _transformers_text_config()  # skips where transformers is not installed
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    layer = Qwen3_5GatedDeltaNet(text_config, 0).double()
    _drawn(layer, 0)
    x = np.random.default_rng(0).standard_normal((2, 9, HYBRID.d_model))
    with torch.no_grad():
        theirs = layer(torch.from_numpy(x)).numpy()
    params = _canonical_mixer(layer)
    keep = np.ones(x.shape[:2], bool)
    ours, _ = gated_delta_net(HYBRID, params, x, keep)
    assert_agrees(ours, theirs, **_mixer_bounds(9), dtype="float32", what="the mixer")
    swapped = params | {"beta.weight": params["decay.weight"], "decay.weight": params["beta.weight"]}
    assert_differs(gated_delta_net(HYBRID, swapped, x, keep)[0], theirs, **_mixer_bounds(9), dtype="float32")


def test_the_golden_gated_attention_is_transformers():
    """transformers' Qwen3_5Attention (its q_proj holds each head's query and gate side by side) on
    the golden's own rotary tables: the heads times σ(x W_gate) before W_o; without the gate the
    output is another one."""
    text_config = _transformers_text_config()  # skips where transformers is not installed
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    layer = Qwen3_5Attention(text_config, 3).double()
    layer.config._attn_implementation = "eager"
    _drawn(layer, 1)
    heads, size = HYBRID.n_heads, HYBRID.d_head
    fused = layer.q_proj.weight.detach().numpy().reshape(heads, 2 * size, HYBRID.d_model)
    params = {"q.weight": fused[:, :size].reshape(heads * size, -1).T,
              "gate.weight": fused[:, size:].reshape(heads * size, -1).T,
              "k.weight": layer.k_proj.weight.detach().numpy().T, "v.weight": layer.v_proj.weight.detach().numpy().T,
              "o.weight": layer.o_proj.weight.detach().numpy().T,
              "q_norm.scale": layer.q_norm.weight.detach().numpy(), "k_norm.scale": layer.k_norm.weight.detach().numpy()}
    length = 7
    x = np.random.default_rng(1).standard_normal((2, length, HYBRID.d_model))
    positions = np.arange(length)
    cos, sin = (torch.from_numpy(table)[None] for table in rope_tables(HYBRID, positions))
    causal = torch.triu(torch.full((length, length), -torch.inf, dtype=torch.float64), 1)[None, None]
    with torch.no_grad():
        theirs, _ = layer(torch.from_numpy(x), (cos, sin), causal)
    layer_cfg = HYBRID.layer(3)
    k, v = golden.key_value_heads(layer_cfg, params, x, positions)
    mask = np.tril(np.ones((length, length), bool))[None, None]
    ours = attend(layer_cfg, params, x, k, v, mask, positions)
    # transformers' eager softmax runs in float32 whatever the input
    bounds = {"n": max(HYBRID.d_model, length), "depth": 1, "dtype": "float32"}
    assert_agrees(ours, theirs.numpy(), **bounds, what="the gated attention")
    ungated = attend(layer_cfg.replace(attention_output_gate=False), params, x, k, v, mask, positions)
    assert_differs(ungated, theirs.numpy(), **bounds)


def _ids(rows: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, HYBRID.tgt_vocab_size, (rows, length))


@pytest.mark.parametrize("chunks", [(1,) * 9, (4, 1, 1, 3), (9,)], ids=["steps", "prefix-steps-chunk", "whole"])
def test_the_cached_decode_carries_each_linear_layers_state(chunks):
    """The hybrid's decode in chunks (a prefix, then steps, then a chunk), the linear layers'
    windows and states handed on, against the full forward; a decode that restarts each chunk's
    linear states from zero is far from it."""
    params = conformance_params(HYBRID)
    ids = _ids(2, 9)
    want = golden.forward(HYBRID, params, None, ids)
    p = golden.cast_params(HYBRID, params)

    def decoded(zeroed: bool) -> np.ndarray:
        cache, logits, start = golden.start_cache(HYBRID, p, 2), [], 0
        for size in chunks:
            if zeroed:
                cache = dataclasses.replace(cache, linear_states=golden.start_cache(HYBRID, p, 2).linear_states)
            step, cache = golden.decode_step(HYBRID, p, cache, ids[:, start:start + size])
            logits.append(step)
            start += size
        return np.concatenate(logits, axis=1)

    assert_agrees(decoded(False), want, **_hybrid_bounds(9), what="cached decode")
    if len(chunks) > 1:
        assert_differs(decoded(True), want, **_hybrid_bounds(9))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_decay_is_the_specs_softplus_past_torchs_threshold(framework):
    """g = −exp(log_rate) · softplus(z) at float64 for z from −30 to 45: torch's F.softplus gives z
    itself above its default threshold of 20, off by e^−z (2e-9 of it at 20, beyond float64's rounding);
    impl_torch's decay takes the threshold at 40 in float64, where e^−z is under it. JAX's softplus is
    log(1 + e^z) everywhere (logaddexp)."""
    from impl_numpy.model import softplus

    z = np.linspace(-30.0, 45.0, 151)
    log_rate = np.array([0.3])
    want = -np.exp(log_rate) * softplus(z)[:, None]
    if framework == "torch":
        import torch

        from impl_torch.model import Decay

        decay = Decay(1, 1).double()
        with torch.no_grad():
            decay.weight.fill_(1.0), decay.bias.fill_(0.0), decay.log_rate.copy_(torch.from_numpy(log_rate))
            got = decay(torch.from_numpy(z[:, None])).numpy()
    else:
        import jax
        from flax import nnx

        from impl_jax.model import Decay

        with jax.enable_x64(True):
            decay = Decay(1, 1, "highest", jax.numpy.float64, nnx.Rngs(0))
            decay.kernel[...], decay.bias[...] = jax.numpy.ones((1, 1)), jax.numpy.zeros(1)
            decay.log_rate[...] = jax.numpy.asarray(log_rate)
            got = np.asarray(decay(jax.numpy.asarray(z[:, None])))
    assert np.abs(got - want).max() <= 4 * np.finfo(np.float64).eps * np.abs(want).max(), np.abs(got - want).max()


def _padded(real: np.ndarray, before: int, inside: int, after: int, pad) -> np.ndarray:
    """real [1, T, ...] with `before` pads, `inside` pads after its third token and `after` pads."""
    def pads(count: int) -> np.ndarray:
        return np.broadcast_to(pad, (1, count, *real.shape[2:]))
    return np.concatenate([pads(before), real[:, :3], pads(inside), real[:, 3:], pads(after)], axis=1)


@given(pads=st.lists(st.integers(0, 3), min_size=3, max_size=3), seed=st.integers(0, 3))
def test_a_pad_moves_no_state(pads, seed):
    """The mixer on a row padded at its start, inside and at its end gives its real tokens what they
    alone give, and the same state after them (SPEC §5.15): the pads move neither a convolution's
    window nor the recurrent state, and they get zeros. A pad that moved the state (its keep
    ignored) is seen."""
    params = params_under(golden.cast_params(HYBRID, conformance_params(HYBRID)), "decoder.layers.0.linear_attn")
    real = np.random.default_rng(seed).standard_normal((1, 6, HYBRID.d_model))
    x = _padded(real, *pads, pad=np.random.default_rng(seed + 1).standard_normal(HYBRID.d_model))
    keep = _padded(np.ones((1, 6), bool), *pads, pad=False)
    want, want_state = gated_delta_net(HYBRID, params, real, np.ones((1, 6), bool))
    got, state = gated_delta_net(HYBRID, params, x, keep)
    bounds = _mixer_bounds(x.shape[1])
    assert_agrees(got[:, keep[0]], want, **bounds, what=f"pads {pads}")
    assert_agrees(state.recurrent, want_state.recurrent, **bounds, what="the state after them")
    assert not got[~keep].any()
    if sum(pads[:2]):  # a pad before a real token: read as one, it moves what follows
        assert_differs(gated_delta_net(HYBRID, params, x, np.ones_like(keep))[0][:, keep[0]], want, **bounds)


@pytest.mark.parametrize("before, after", [(3, 0), (0, 2), (2, 1)])
def test_a_padded_row_of_the_hybrid_is_its_real_tokens(before, after):
    """The whole hybrid with its pads at the start or the end: the rotary attention reads distances
    only, the linear layers skip the pads, so the real tokens' logits are the unpadded row's."""
    params = conformance_params(HYBRID)
    real = _ids(1, 6)
    padded = _padded(real, before, 0, after, pad=HYBRID.pad_id)
    keep = padded != HYBRID.pad_id
    want = golden.forward(HYBRID, params, None, real)
    got = golden.forward(HYBRID, params, None, padded, tgt_keep=keep)
    assert_agrees(got[:, keep[0]], want, **_hybrid_bounds(padded.shape[1]), what=f"{before} before, {after} after")


def test_the_config_refuses_what_the_hybrid_does_not_define():
    with pytest.raises(ConfigError, match="layer_types has linear layers but linear_attention is null"):
        HYBRID.replace(linear_attention=None)
    with pytest.raises(ConfigError, match="no layer is linear"):
        HYBRID.replace(layer_types=None)
    with pytest.raises(ConfigError, match=r"key_heads \(3\) must divide value_heads \(4\)"):
        HYBRID.replace(linear_attention=GatedDeltaNet(key_heads=3, value_heads=4, key_head_dim=6, value_head_dim=5))
    with pytest.raises(ConfigError, match="conv_kernel must be a positive integer"):
        HYBRID.replace(linear_attention=GatedDeltaNet(key_heads=2, value_heads=4, key_head_dim=6, value_head_dim=5,
                                                      conv_kernel=0))
    assert ModelConfig.from_json(HYBRID.to_json()) == HYBRID
    assert HYBRID.first_layers(2).linear_attention == MIXER and HYBRID.first_layers(2).layer_kind(1) == "linear"


# ---- the frameworks: the chunked prefill and the recurrent step against the golden's recurrence ----

# chunks of 4 over 11 tokens: two whole chunks and a part; the decode's pieces end one token before,
# on and after a chunk boundary
CHUNKED = HYBRID.replace(linear_attention=dataclasses.replace(MIXER, chunk_size=4))
PIECES = (3, 1, 1, 6)


def _padded_batch() -> tuple[np.ndarray, np.ndarray]:
    """Three rows of 11: pads at the start, inside, at the end; and the keep-vector."""
    ids = _ids(3, 11, seed=2)
    ids[0, :3] = ids[1, 5:7] = ids[2, -2:] = HYBRID.pad_id
    return ids, ids != HYBRID.pad_id


def _framework(name: str, dtype: str):
    """(model, start_cache, decode_step, logits of ids) of impl_torch or impl_jax at dtype."""
    params = conformance_params(CHUNKED)
    if name == "torch":
        import torch

        from impl_torch import Transformer
        from impl_torch.model import decode_step, start_cache
        model = Transformer.from_params(CHUNKED, params, dtype=getattr(torch, dtype))

        def logits(ids, keep):
            with torch.no_grad():
                return model(None, ids, tgt_keep=keep).double().numpy()
    else:
        import jax

        from impl_jax import Transformer
        from impl_jax.model import decode_step, start_cache
        jax.clear_caches()  # a planted mistake is traced anew, not read from a compiled program
        model = Transformer.from_params(CHUNKED, params, dtype=dtype)

        def logits(ids, keep):
            return np.asarray(model(None, ids, tgt_keep=keep), np.float64)
    return model, start_cache, decode_step, logits


def _framework_run(name: str, dtype: str, forward: bool = True,
                   decode: bool = True) -> tuple[np.ndarray | None, np.ndarray | None, object]:
    """The framework's forward of the padded batch, its decode of it in PIECES and the cache after
    (each None where not asked for)."""
    ids, keep = _padded_batch()
    model, start_cache, decode_step, logits = _framework(name, dtype)
    cache, steps, start = start_cache(model, 3, ids.shape[1]), [], 0
    for size in PIECES if decode else ():
        step, cache = decode_step(model, cache, ids[:, start:start + size], keep[:, start:start + size])
        steps.append(step.double().numpy() if hasattr(step, "double") else np.asarray(step, np.float64))
        start += size
    return logits(ids, keep) if forward else None, np.concatenate(steps, axis=1) if decode else None, cache


def _x64(name: str, dtype: str):
    """JAX's x64 mode for its float64 run; nothing for the others."""
    if name == "jax" and dtype == "float64":
        import jax
        return jax.enable_x64(True)
    return contextlib.nullcontext()


# JAX at float32 is the hybrid matrix's JAX column (its chunk cases' forwards and resumed decodes, and
# the padded forwards): the same program as here at float64 and float16 but for the dtype (issue 58)
@pytest.mark.parametrize("name, dtype", [("torch", "float64"), ("torch", "float32"), ("torch", "float16"),
                                         ("jax", "float64"), ("jax", "float16")])
def test_the_frameworks_chunked_prefill_and_steps_are_the_recurrence(name, dtype):
    """hybrid-pads-{dtype}-{name}-cpu: a padded batch (pads at the start, inside, at the end) through
    the chunked forward (chunks of 4 over 11 tokens) and through the cached decode in pieces that
    end before, on and after a chunk boundary (the steps by the recurrence), both against the
    golden's token-by-token forward; the state kept in float32 at float16 (SPEC §5.15)."""
    pytest.importorskip(name)
    ids, keep = _padded_batch()
    want = golden.forward(CHUNKED, conformance_params(CHUNKED), None, ids, tgt_keep=keep)
    with _x64(name, dtype):
        forward, decoded, cache = _framework_run(name, dtype)
    bounds = _hybrid_bounds(ids.shape[1]) | {"dtype": dtype}
    assert_agrees(forward, want, **bounds, what=f"{name} {dtype} forward")
    assert_agrees(decoded, want, **bounds, what=f"{name} {dtype} cached decode")
    state = cache.linear_states[0].recurrent
    assert str(state.dtype).split(".")[-1] == ("float64" if dtype == "float64" else "float32")
    # keys and values for the one attention layer only: a linear layer's row would be capacity × H_kv × d_k
    # per sequence for nothing (spec.ModelConfig.cached_layers)
    assert CHUNKED.cached_layers == (None, None, None, 0)
    assert cache.self_keys.shape[0] == cache.self_values.shape[0] == 1


def _planted(name: str, mistake: str, monkeypatch) -> None:
    """One of the bugs of record planted in the framework's module."""
    module = __import__(f"impl_{name}.model", fromlist=["model"])
    if mistake == "zero-start":  # a prefill after a prefix starts from a zero state
        chunked = module.chunked_gated_delta_rule
        monkeypatch.setattr(module, "chunked_gated_delta_rule",
                            lambda state, *rest: chunked(state * 0, *rest))
    elif mistake == "pads-write":  # the pads' keep ignored: they write, decay and enter the windows
        net = module.GatedDeltaNet
        call = "forward" if name == "torch" else "__call__"
        original = getattr(net, call)
        monkeypatch.setattr(net, call, lambda self, x, keep, state=None: original(self, x, keep | True, state))
    else:  # the gated attention's gate dropped
        monkeypatch.setattr(module.MultiHeadAttention, "output_gate", lambda self, x, heads: heads)


# Each mistake in torch; in JAX the one whose code is a framework's own state handling (a prefill after
# a prefix): the comparison that sees them is the same for both, and the JAX model's pads and gate run
# in the JAX tests above at float64 and float16 and in the matrix's JAX column (issue 58: 5 s of compiles)
@pytest.mark.parametrize("name, mistake", [("torch", "zero-start"), ("torch", "pads-write"), ("torch", "ungated"),
                                           ("jax", "zero-start")])
def test_a_planted_mistake_in_the_frameworks_hybrid_is_seen(name, mistake, monkeypatch):
    """Each plant moves the forward or the cached decode beyond float32's tolerance of the golden."""
    pytest.importorskip(name)
    _planted(name, mistake, monkeypatch)
    ids, keep = _padded_batch()
    want = golden.forward(CHUNKED, conformance_params(CHUNKED), None, ids, tgt_keep=keep)
    in_decode = mistake == "zero-start"  # the others show in the forward already
    forward, decoded, _ = _framework_run(name, "float32", forward=not in_decode, decode=in_decode)
    bounds = _hybrid_bounds(ids.shape[1]) | {"dtype": "float32"}
    assert_differs(decoded if in_decode else forward, want, **bounds)


@pytest.mark.parametrize("mistake, layer", [(None, None), ("pads-write", "decoder.layers.0"),
                                            ("ungated", "decoder.layers.3")])
def test_a_hybrids_mistake_is_localized_to_its_layer(mistake, layer, monkeypatch):
    """`rosetta check`'s localization stage by stage on a hybrid (a linear layer a stage, its bound
    T deep times its output norm's amplification, SPEC §8): torch as written passes every stage;
    pads that write are localized to the first linear layer, the gate dropped to the attention layer
    (HYBRID's fourth). The pad_middle case, whose pads sit among real tokens."""
    from conformance.diagnosis.localize import localize_column

    if mistake:
        _planted("torch", mistake, monkeypatch)
    found = localize_column(CHUNKED, conformance_params(CHUNKED), "torch", "float32", "cpu", "pad_middle")
    assert [stage.name for stage in found.stages][1:5] == [f"decoder.layers.{i}" for i in range(4)]
    assert (found.first_failure.name if found.first_failure else None) == layer, found.to_dict()


# ---- the conformance matrix: the hybrid's cells, its amplification, what is left out ------------

def _matrix(backends, dtypes, pattern=None, backward=False):
    from conformance.harness import plan_matrix, run_matrix
    plan = plan_matrix(CHUNKED, backends, dtypes, ["cpu"])
    return plan, run_matrix(CHUNKED, conformance_params(CHUNKED), plan, pattern=pattern, backward=backward)


def test_a_worker_takes_each_cases_amplification_from_the_harness():
    """A hybrid's case finds its amplification by a golden pass over the whole model (SPEC §8). A
    worker made that pass again for every case it built, casting the golden's float64 weights to do
    it (a Qwen3.5-0.8B check's worker held 9.4 GB so); it now takes the figure the harness found.
    Shown with a figure the golden would not find: the worker's cell is judged by it, as this
    process judges the case carrying it; a case sent none still finds its own."""
    from conformance.cases import build_case
    from conformance.cells import golden_runner_for, reference_for, run_cell
    from conformance.executors.local_pool import run_in_workers

    params = conformance_params(CHUNKED)
    golden_runner = golden_runner_for(CHUNKED, params)
    own = {name: build_case(CHUNKED, params, "forward", name) for name in ("none", "pad_right")}
    assert own["none"].amplification > 1  # the golden's figure, not a default
    cases = {"none": dataclasses.replace(own["none"], amplification=40 * own["none"].amplification),
             "pad_right": own["pad_right"]}
    column = ("numpy-float32", "float32", "cpu")

    def judged(case):
        return run_cell(CHUNKED, params, case, *column, reference_for(CHUNKED, params, case, golden_runner, {}), {})

    here = {name: judged(case) for name, case in cases.items()}
    results = {}
    run_in_workers(CHUNKED, params, [(0, "forward-none", column), (1, "forward-pad_right", column)], 1,
                   lambda index, result: results.__setitem__(index, result),
                   amplifications={"forward-none": cases["none"].amplification})
    assert [results[i].tol for i in (0, 1)] == pytest.approx([here["none"].tol, here["pad_right"].tol], rel=1e-12)
    assert results[0].status == "pass" and results[0].tol == pytest.approx(40 * judged(own["none"]).tol, rel=1e-12)


@pytest.mark.parametrize("sublayer, mask_case", [("forward", "pad_left"), ("forward", "chunk_more"),
                                                  ("decode", "pad_right")])
def test_a_cases_reference_takes_the_decoder_pass_its_amplification_made(sublayer, mask_case, monkeypatch):
    """A hybrid's whole-model case passes through the golden's whole float64 model to find its
    amplification; its reference takes that pass's output instead of making it again (at
    Qwen3.5-0.8B's size, half a minute a case), and is the very same array; the golden's decoder
    then runs once per case, and a runner with other weights takes none of it."""
    import impl_numpy
    from conformance.cases import build_case
    from conformance.cells import golden_runner_for, reference_for

    params = conformance_params(CHUNKED)
    fresh = reference_for(CHUNKED, params, build_case(CHUNKED, params, sublayer, mask_case),
                          golden_runner_for(CHUNKED, params), {})
    runner, calls = golden_runner_for(CHUNKED, params), []
    decoder = impl_numpy.model.decoder
    for module in (impl_numpy, impl_numpy.model):  # the golden's own forward calls it by its module's name
        monkeypatch.setattr(module, "decoder", lambda *args, **kwargs: calls.append(1) or decoder(*args, **kwargs))
    case = build_case(CHUNKED, params, sublayer, mask_case, lambda: runner.p, passes=runner.passes)
    other = runner.replaced("decoder.norm.scale", params["decoder.norm.scale"] * 2)
    assert other.passes.take(case.inputs) is None
    taken = reference_for(CHUNKED, params, case, runner, {})
    assert len(calls) == 1 and np.array_equal(taken, fresh)
    assert runner.passes.take(case.inputs) is None  # taken once: a second reference makes its own pass
    assert np.array_equal(reference_for(CHUNKED, params, case, runner, {}), fresh) and len(calls) == 2


def test_a_generate_case_sent_to_the_workers_keeps_its_bound():
    """The local pool sends a generate case whole (its rows took the golden's tokens to choose): its
    depth (T deep) and amplification go with it, or the workers judge a hybrid's generation by a
    bound tens of times too tight (a random Qwen3.5's bfloat16 generate cells failed in torch and
    jax alike, transformers' own model equally far from the golden, before they did)."""
    import json

    from conformance.cases import build_case
    from conformance.executors import local_pool

    case = build_case(CHUNKED, conformance_params(CHUNKED), "generate", "pad_left")
    assert case.depth > 10 and case.amplification > 1
    again = local_pool._case_from(json.loads(json.dumps(local_pool._case_message(case))))
    assert again == case and again.tolerance(CHUNKED, "bfloat16") == case.tolerance(CHUNKED, "bfloat16")


def test_the_hybrids_matrix_passes_in_torch_and_jax():
    """Every cell of the hybrid's catalogue in torch at float64 and float32 (the linear_attn cells on
    each linear layer, the chunk cases C − 1, C + 1 and 2C + 3 tokens long, the gated attention's
    mha cells on its attention layer, decode through the carried states) and jax's longest chunk case
    (2C + 3 tokens, pads among them) of each kind at float32, against the golden."""
    from conformance.cases import case_names

    names = case_names(CHUNKED)
    assert {("linear_attn", "chunks"), ("forward", "chunk_more"), ("decode", "chunk_less")} <= set(names)
    _, results = _matrix(["torch"], ["float64", "float32"])
    # JAX compiles a program per case length (29 s for its twelve chunk and padded cases): the harness's
    # path for each kind of cell, on the case that crosses two chunk edges. Pieces that end before, on and
    # after a chunk's edge, and pads at the start, inside and at the end, are JAX's own at float64 and
    # float16 in test_the_frameworks_chunked_prefill_and_steps_are_the_recurrence (the same programs).
    _, jax_results = _matrix(["jax"], ["float32"], pattern="linear_attn-chunks|forward-chunks|decode-chunks")
    failed = [f"{r.test_id}: {r.status} {r.reason}" for r in results + jax_results if r.status != "pass"]
    assert not failed, "\n".join(failed)
    assert len(results) == 2 * len(names) and len(jax_results) == 3


# the gradient cells of each kind the hybrid adds: the mixer over 3 to 11 tokens (one chunk and several,
# pads anywhere, an all-pad row), a linear layer, the whole model across chunks, the loss, one AdamW step
GRADIENT_CELLS = ("grad-linear_attn-*|grad-decoder_layer-causal_pad|grad-forward-chunks|grad-loss-pad_left|"
                  "train_step-none")


def test_the_hybrids_gradients_pass_in_torch_and_jax():
    """The golden walks the recurrence backwards token by token (impl_numpy.backward.gated_delta_net_vjp,
    audited by central differences in tests/test_backward_model.py); torch's and JAX's autodiff go back
    through their chunked prefill (the triangular solve, the scan over chunks). They agree, cell by
    cell: torch at float64 and float32, JAX at float32 on the mixer."""
    from conformance.cases import case_names

    _, results = _matrix(["torch"], ["float64", "float32"], pattern=GRADIENT_CELLS, backward=True)
    # JAX's autodiff runs eagerly, op by op (SPEC §13): here the mixer across chunks; its whole model's gradients
    # at float64 are tests/test_backward_model.py's (its training cells pass in `rosetta check --backward`)
    _, jax_results = _matrix(["jax"], ["float32"], pattern="grad-linear_attn-chunks", backward=True)
    failed = [f"{r.test_id}: {r.status} {r.reason}" for r in results + jax_results if r.status != "pass"]
    assert not failed, "\n".join(failed)
    linear_cases = [case for sublayer, case in case_names(CHUNKED, backward=True) if sublayer == "grad-linear_attn"]
    assert len(results) == 2 * (len(linear_cases) + 4) and len(jax_results) == 1


def test_an_ill_conditioned_gradient_case_is_judged_with_its_conditioning(monkeypatch):
    """qwen3-next-tiny's grad-forward-pad_left (SPEC §13's c*): under a rounding-sized move of every
    weight, the golden's own gradients on layer 2's q path move 13 times further than §8's bound,
    which counts the forward's amplification only. torch at float64 passes with that movement as the
    bound, its reason naming it, and missed without it (the red cell it was); in the case without
    padding §8's bound is the larger, and nothing is named. On that tensor at float32, whose
    conditioning bound is 1% of its terms, a gradient 3% off still fails."""
    from conformance.backends import numpy_backend
    from conformance.cases import build_case
    from conformance.harness import plan_matrix, run_matrix
    from conformance.tolerance import backward_error, compare_gradients
    from spec import get_preset

    cfg = get_preset("qwen3-next-tiny")
    params = conformance_params(cfg)

    def judged():
        plan = plan_matrix(cfg, ["torch"], ["float64"], ["cpu"])
        return {r.mask_case: r for r in run_matrix(cfg, params, plan, pattern="grad-forward-pad_left|grad-forward-none",
                                                   backward=True)}

    cells = judged()
    assert all(r.status == "pass" for r in cells.values()), {case: r.reason for case, r in cells.items()}
    assert "conditioning bound" in cells["pad_left"].reason and "conditioning" not in cells["none"].reason
    case = build_case(cfg, params, "grad-forward", "pad_left")
    reference = numpy_backend.golden_output(cfg, params, case.sublayer, case.inputs)
    bound = reference.conditioning_bound(backward_error("float32", case.reduction_length))
    name = "decoder.layers.2.linear_attn.q_conv.weight"
    off = {**reference.gradients, name: reference.gradients[name] * 1.03}
    assert not compare_gradients(off, reference.gradients, reference.terms, case.tolerance(cfg, "float32"),
                                 conditioning=bound).passed
    monkeypatch.setattr(numpy_backend.GradientReference, "conditioning_bound", lambda self, width: {})
    assert judged()["pad_left"].status == "fail"


def test_the_conditioning_draws_move_every_weight_by_the_width_the_same_at_every_read():
    from conformance.backends.numpy_backend import _Perturbed

    p = {"a.weight": np.arange(1.0, 7.0).reshape(2, 3), "b.bias": np.full(4, -2.0)}
    moved, again, other = _Perturbed(p, 1e-3, 0), _Perturbed(p, 1e-3, 0), _Perturbed(p, 1e-3, 1)
    for name, value in p.items():
        np.testing.assert_allclose(np.abs(moved[name] / value - 1), 1e-3, rtol=1e-9)
        assert np.array_equal(moved[name], again[name]) and np.array_equal(moved[name], moved[name])
    assert not all(np.array_equal(moved[name], other[name]) for name in p) and list(moved) == list(p)


def test_a_state_cut_between_chunks_fails_the_gradient_cells_across_chunks_only(monkeypatch):
    """A backward that stops at each chunk's edge (the carried state detached: the forward is the same
    numbers) passes every forward cell and the gradient cells of one chunk, and fails those whose
    tokens span two chunks or more: the recurrence's gradient is checked across chunks."""
    from impl_torch import model as torch_model

    recurrence = torch_model.chunk_recurrence
    monkeypatch.setattr(torch_model, "chunk_recurrence", lambda state, chunk: recurrence(state.detach(), chunk))
    _, results = _matrix(["torch"], ["float32"], pattern="linear_attn-*|grad-linear_attn-*", backward=True)
    failing = {r.test_id.removesuffix("-float32-torch-cpu") for r in results if r.status == "fail"}
    assert {"grad-linear_attn-chunks", "grad-linear_attn-chunk_more"} <= failing, failing
    assert not any(test_id.startswith("linear_attn-") for test_id in failing), failing
    assert "grad-linear_attn-chunk_less" not in failing, failing  # C − 1 tokens: one chunk, nothing cut


def test_a_backward_mistake_in_a_linear_layer_is_localized_to_it(monkeypatch):
    """The backward walk (SPEC §13) feeds each stage, from the head down, the golden's input and
    cotangent: torch's passes every stage of the hybrid, linear layers included; with the decay's
    gradient cut (its forward the same numbers) the walk stops at the last linear layer, naming the
    decay's parameters."""
    from conformance.diagnosis.localize import localize_backward_column
    from impl_torch import model as torch_model

    params = conformance_params(CHUNKED)
    clean = localize_backward_column(CHUNKED, params, "torch", "float32", "cpu")
    assert [stage.name for stage in clean.stages][2:6] == [f"decoder.layers.{i}" for i in (3, 2, 1, 0)]
    assert all(stage.isolated_ratio < 1 for stage in clean.stages), clean.stages
    decay = torch_model.Decay.forward
    monkeypatch.setattr(torch_model.Decay, "forward", lambda self, x: decay(self, x).detach())
    planted = localize_backward_column(CHUNKED, params, "torch", "float32", "cpu")
    failing = [stage for stage in planted.stages if stage.isolated_ratio > 1]
    assert failing[0].name == "decoder.layers.2" and "linear_attn.decay" in failing[0].note, planted.stages


def test_qwen3_nexts_experts_follow_its_linear_layers():
    """qwen3-next-tiny: the hybrid whose every FFN is a mixture of experts with a shared expert (SPEC
    §5.14, §5.15), its linear layers' FFNs too. Torch's batched and looped blocks through a padded
    prefill over chunks, decode through the carried states, a generation, and the blocks themselves
    on every layer, at float32. (JAX's blocks are the same layer_ffn in both kinds of layer: its
    forward of qwen3-next-tiny is tests/test_jax.py's every preset; its decode through the states,
    the hybrid's above; its mixture's, tests/test_moe.py's.)"""
    from conformance.harness import plan_matrix, run_matrix
    from spec import get_preset

    cfg = get_preset("qwen3-next-tiny")
    pattern = "experts-*|forward-pad_left|forward-chunks|decode-chunk_more|decode-incremental|generate-pad_left"
    results = run_matrix(cfg, conformance_params(cfg), plan_matrix(cfg, ["torch", "torch-math"], ["float32"], ["cpu"]),
                         pattern=pattern)
    failed = [f"{r.test_id}: {r.status} {r.reason}" for r in results if r.status != "pass"]
    assert not failed, "\n".join(failed)
    assert len(results) == 2 * 7, sorted(r.test_id for r in results)


@pytest.fixture(scope="module")
def hybrid_export():
    """The hybrid's export from impl_torch at float32, made once (export.cache) for both tests below."""
    from export.cache import exported

    return exported(CHUNKED, conformance_params(CHUNKED))


def test_the_torch_export_serves_the_hybrid(hybrid_export):
    """Every whole-model cell of the hybrid through the ONNX export from impl_torch at float32: the
    forward graph prefills in chunks (a Scan over them, the triangular systems solved row by row),
    the step graph carries each linear layer's windows and state (float32) as inputs and outputs,
    and decode and generate run through it; it has no in-place step, and says why."""
    import onnx

    from export.runner import OnnxTransformer

    _, results = _matrix(["onnx"], ["float32"])
    ran = {r.test_id: r for r in results if r.status != "skip"}
    failed = {test_id: r.reason[:300] for test_id, r in ran.items() if r.status != "pass"}
    assert not failed, failed
    wanted = {f"{sublayer}-{case}-float32-onnx-cpu" for sublayer in ("forward", "decode")
              for case in ("chunk_less", "chunk_more", "chunks", "pad_left")}
    assert wanted | {"generate-pad_left-float32-onnx-cpu"} <= set(ran)
    directory = hybrid_export
    forward = onnx.load(str(directory / "forward.onnx"), load_external_data=False).graph
    assert "Scan" in {node.op_type for node in forward.node}
    step = onnx.load(str(directory / "decoder_step.onnx"), load_external_data=False).graph
    states = {i.name: i.type.tensor_type.elem_type for i in step.input if i.name.startswith("past.0.")}
    assert states == {"past.0.q_window": onnx.TensorProto.FLOAT, "past.0.k_window": onnx.TensorProto.FLOAT,
                      "past.0.v_window": onnx.TensorProto.FLOAT, "past.0.state": onnx.TensorProto.FLOAT}
    assert {i.name for i in step.input if i.name.endswith(".key")} == {"past.3.key"}  # the attention layer's alone
    assert OnnxTransformer(directory, device="cpu").step_graph.startswith("decoder_step (a hybrid's linear layers")


def test_a_step_graph_that_drops_the_state_fails_the_decode_cells(hybrid_export, monkeypatch, tmp_path):
    """A planted mistake in the export's wiring: the step graph gives back the states it was given
    (each linear layer's present.* the past.* it read, the step's moves lost), planted in the graph
    itself. The decode cells after a prefix fail."""
    import shutil

    import onnx

    from conformance.backends import onnx_backend

    planted = shutil.copytree(hybrid_export, tmp_path / "forgetful")
    model = onnx.load(str(planted / "decoder_step.onnx"), load_external_data=False)
    graph = model.graph
    dropped = [output.name for output in graph.output
               if output.name.startswith("present.") and output.name.split(".")[-1] in ("q_window", "k_window",
                                                                                       "v_window", "state")]
    assert len(dropped) == 4 * CHUNKED.layer_types.count("linear"), dropped
    for name in dropped:
        for node in graph.node:  # the moved state now goes nowhere; the input comes back out in its place
            node.output[:] = [f"{output}.moved" if output == name else output for output in node.output]
        graph.node.append(onnx.helper.make_node("Identity", [name.replace("present.", "past.", 1)], [name]))
    onnx.save(model, str(planted / "decoder_step.onnx"))
    monkeypatch.setattr(onnx_backend, "exported", lambda cfg, params, **options: planted)
    _, results = _matrix(["onnx"], ["float32"], pattern="decode-*")
    failing = {r.test_id for r in results if r.status == "fail"}
    assert {"decode-chunk_less-float32-onnx-cpu", "decode-incremental-float32-onnx-cpu"} <= failing, failing


@pytest.mark.parametrize("mistake, cells", [("pads-write", "linear_attn-pad"), ("zero-start", "decode-")])
def test_the_matrix_localizes_a_planted_mistake_to_its_cells(mistake, cells, monkeypatch):
    """Pads that write fail the linear_attn cells with padding (and the models' padded cases); a zero
    state after a prefix fails the decode cells only: each mistake where it lives."""
    _planted("torch", mistake, monkeypatch)
    _, results = _matrix(["torch"], ["float32"], pattern="linear_attn-|forward-|decode-")
    failing = {r.test_id for r in results if r.status == "fail"}
    assert failing and any(cells in test_id for test_id in failing)
    if mistake == "zero-start":
        assert all(test_id.startswith("decode-") for test_id in failing), failing


def test_a_cell_whose_bound_is_the_outputs_size_is_not_judged():
    """SPEC §8: at half precision some of the hybrid's bounds, times their amplification, reach the
    outputs' own size, where nothing could fail: those cells are skipped saying so (and the
    thousand-position ones are), the others judged and passed."""
    from conformance.cells import NOT_JUDGED

    _, results = _matrix(["torch"], ["float16"], pattern="linear_attn-|forward-")
    skipped = [r for r in results if r.status == "skip"]
    assert skipped and all(r.skip == NOT_JUDGED and "of the outputs' size" in r.reason for r in skipped)
    assert "forward-long" in {f"{r.sublayer}-{r.mask_case}" for r in skipped}
    assert all(r.status == "pass" for r in results if r.status != "skip") and len(skipped) < len(results)


def _plain_attention() -> ModelConfig:
    """The hybrid's attention alone: no linear layer, no gate (no amplification)."""
    return HYBRID.replace(layer_types=None, linear_attention=None, attention_output_gate=False)


def test_the_amplification_is_the_output_norms_magnification():
    """output_norm_amplification: a state whose two keys hold v and −v, read by a q across both, gives
    o = 0 from terms of size √(Σ S² q² / d_v), magnified by 1/√ε; read along one key, o is as large
    as its terms, amplification about 1. The hybrid's cases carry the largest over their tokens:
    above 1 on these weights, and 1 where the config has no linear layer."""
    from conformance.cases import build_case
    from impl_numpy.model import output_norm_amplification

    value = np.array([0.6, 0.8])
    state = np.stack([value, -value])[None, None]  # S [1, 1, d_k = 2, d_v = 2]
    across, along = np.full((1, 1, 2), np.sqrt(0.5)), np.array([[[1.0, 0.0]]])
    for q, want in ((across, np.sqrt(0.5) / 1e-3), (along, np.sqrt(0.5) / np.sqrt(0.5 + 1e-6))):
        o = np.einsum("bhkv,bhk->bhv", state, q)
        assert output_norm_amplification(state, q, o, 1e-6)[0, 0] == pytest.approx(want, rel=1e-6)
    params = conformance_params(CHUNKED)
    assert build_case(CHUNKED, params, "forward", "pad_middle").amplification > 1
    assert build_case(CHUNKED, params, "linear_attn", "none").amplification > 1
    plain = _plain_attention()
    assert build_case(plain, conformance_params(plain), "forward", "pad_middle").amplification == 1


def test_a_budgeted_plan_costs_and_ranks_the_hybrids_cells():
    """The planner prices every hybrid cell (linear_attn's from its own FLOPs, the chunk cases at
    their lengths) and ranks linear_attn as a layered sublayer: its first, middle and last linear
    layer come before the other cases."""
    from conformance.cases import case_names, layer_of
    from conformance.harness import cell_extent
    from conformance.plan.budget import representative_cases
    from conformance.plan.cost import case_work

    for sublayer, mask_case in case_names(CHUNKED):
        assert case_work(CHUNKED, sublayer, mask_case).flops > 0 and cell_extent(CHUNKED, sublayer, mask_case)
    assert case_work(CHUNKED, "linear_attn", "chunks").flops > case_work(CHUNKED, "linear_attn", "none").flops
    assert cell_extent(CHUNKED, "decode", "chunks").positions == 2 * CHUNKED.linear_attention.chunk_size + 3
    layers = {layer_of(CHUNKED, "linear_attn", case) for case in representative_cases(CHUNKED, "linear_attn")}
    assert layers == {0, 1, 2}


def test_what_does_not_compute_the_hybrid_refuses_it_by_name(tmp_path):
    """The spec, the golden (forward, cached decode and backward), impl_torch, impl_jax, the torch
    export, the Hugging Face writer and transformers compute it (tests/test_huggingface_hybrid.py):
    the JAX export refuses a hybrid naming the feature, rather than export another model."""
    from export.exporters import export_model

    match = re.escape("the ONNX export from impl_jax (jax2onnx) does not compute gated DeltaNet's linear layers")
    with pytest.raises(ConfigError, match=match):
        export_model(HYBRID, conformance_params(HYBRID), tmp_path, framework="jax")
