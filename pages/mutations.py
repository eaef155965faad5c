"""The mutation gallery: realistic Transformer mistakes, each a small change to a backend, and
proof that the harness catches every one and points at the right sublayer.

Each mutation replaces one function of the golden's code (impl_numpy.model, and for the training
mistakes impl_numpy.backward or impl_numpy.training) *inside a backend only* — the numpy-float32
runner — while the reference stays correct. `rosetta mutations` runs the catalogue on each
mutant (with the gradient and training cases for the training mistakes), reports the smallest
sublayer that fails (the catalogue runs from embeddings up to the whole model, then the
gradients, then the training steps) and the localization stage, and checks both against what the
mistake should break.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import impl_numpy
import impl_numpy.backward as backward
import impl_numpy.model as model
import impl_numpy.training as training
from conformance.adapter import register_backend, unregister_backend
from conformance.backends.numpy_backend import NumpyFloat32Backend, NumpyRunner
from conformance.cells import KeptGolden
from conformance.tolerance import held_at
from conformance.cases import SUBLAYERS, is_training
from conformance.harness import ERROR, FAIL, plan_matrix, run_matrix
from conformance.diagnosis.localize import localize_backward_column, localize_column
from conformance.training_cells import failing_step
from spec import ModelConfig, conformance_params, get_preset, param_shapes


# ---- the mistakes -----------------------------------------------------------------------------

def _scaled_by_d_model(q, k, v, mask=None, scale=None, cap=None, sinks=None):
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1] * q.shape[1])  # √d_model, not √d_k
    return model.softmax(scores, mask) @ v


def _cos_exponent_off(positions, d_model, layout):
    i = np.arange(0, d_model, 2, dtype=np.float64)
    angles_sin = np.asarray(positions, np.float64)[:, None] * 10000.0 ** (-i / d_model)
    angles_cos = np.asarray(positions, np.float64)[:, None] * 10000.0 ** (-(i + 1) / d_model)  # 2i+1 in the exponent
    return np.stack([np.sin(angles_sin), np.cos(angles_cos)], axis=-1).reshape(len(positions), d_model)


def _inverted_mask(x, mask=None, sink=None):
    return _original("softmax")(x, None if mask is None else ~mask, sink)  # True read as "masked out"


def _mask_after_softmax(x, mask=None, sink=None):
    weights = _original("softmax")(x, None, sink)
    return weights if mask is None else weights * mask  # zeroed after normalising: rows no longer sum to 1


def _softmax_over_queries(x, mask=None, sink=None):
    if mask is not None:
        x = np.where(mask, x, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-2, keepdims=True))
        return np.nan_to_num(e / e.sum(axis=-2, keepdims=True))  # axis -2: over queries


def _unbiased_layer_norm(x, scale, bias, eps):
    centered = x - x.mean(axis=-1, keepdims=True)
    variance = (centered * centered).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1)  # d - 1
    return centered / np.sqrt(variance + eps) * scale + bias


def _no_embedding_scale(ids, weight, scale):
    return weight[ids]  # forgot × √d_model


def _residual_from_normed(cfg, norm_p, x, sublayer, dropout_mask=None, post_norm_p=None):
    h = model.norm(cfg, norm_p, x)
    return h + sublayer(h)  # the residual adds the normalised tensor, not x


def _heads_without_transpose(x, n_heads):
    batch, length, width = x.shape
    return x.reshape(batch, n_heads, length, width // n_heads)  # reshape straight to [B, H, T, d_k]


def _causal_off_by_one(tgt_keep, q_len=None, window=None):
    k_len = np.shape(tgt_keep)[1]
    q_len = q_len or k_len
    causal = np.arange(k_len)[None, :] < k_len - q_len + np.arange(q_len)[:, None]  # < instead of <=
    return causal[None, None] & np.asarray(tgt_keep, dtype=bool)[:, None, None, :]


def _window_off_by_one(tgt_keep, q_len=None, window=None):
    # i - W <= j rather than i - W < j: W + 1 keys (one library's kernels disagreed exactly so)
    return _original("decoder_self_mask")(tgt_keep, q_len, None if window is None else window + 1)


def _window_short_by_one(tgt_keep, q_len=None, window=None):
    # i - W + 1 < j: W - 1 keys, the query's own not counted (JAX's local_window_size=(W, 0) read as W - 1 keys)
    return _original("decoder_self_mask")(tgt_keep, q_len, None if window is None or window < 2 else window - 1)


def _window_ignored_in_the_cached_step(cfg, p, cache, tgt_ids, tgt_keep=None):
    # the forward masks its window; the cached step attends to the whole cache (a serving engine's Gemma 2)
    return _original("decode_step")(cfg.replace(sliding_window=None), p, cache, tgt_ids, tgt_keep)


def _fill_minus_1e9(x, mask=None, sink=None):
    if mask is not None:
        x = np.where(mask, x, -1e9)  # a finite fill: a row with no key averages V instead of giving 0
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _plain_softmax_after_inf_fill(x, mask=None, sink=None):
    if mask is not None:
        x = np.where(mask, x, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))  # a row of -inf: -inf - -inf = NaN
        return e / e.sum(axis=-1, keepdims=True)


def _dropout_at_inference(p, x, activation, clamp=None):
    hidden = model.ACTIVATIONS[activation](model.linear(x, p["w1.weight"], p.get("w1.bias")))
    keep = np.random.default_rng(0).random(hidden.shape) >= 0.1  # dropout p=0.1 left on
    return model.linear(hidden * keep / 0.9, p["w2.weight"], p.get("w2.bias"))


def _cross_attention_ignores_padding(cfg, p, y, memory, self_mask, cross_mask, dropout_masks=None):
    return _original("decoder_layer")(cfg, p, y, memory, self_mask, None, dropout_masks)  # source padding not masked


def _ffn_first_bias_dropped(p, x, activation, clamp=None):
    hidden = model.ACTIVATIONS[activation](model.linear(x, p["w1.weight"]))  # w1's bias never added
    return model.linear(hidden, p["w2.weight"], p.get("w2.bias"))


def _qk_biases_swapped(cfg, p, x, k, v, mask, positions=None):
    # a loader that filled q.bias from k.bias and k.bias from q.bias; k's bias adds the same number
    # to every score of a query (softmax ignores it), so the swap shows through q alone
    return _original("attend")(cfg, {**p, "q.bias": p.get("k.bias")}, x, k, v, mask, positions)


def _layer_norm_without_scale(x, scale, bias, eps):
    return _original("layer_norm")(x, 1.0, bias, eps)  # γ never applied


def _layer_norm_without_bias(x, scale, bias, eps):
    return _original("layer_norm")(x, scale, 0.0, eps)  # β never added


def _head_bias_dropped(cfg, params, h):
    weight = params["tgt_embed.weight"].T if cfg.tie_head else params["head.weight"]
    return model.linear(h, weight)  # head.bias never added


def _generation_ignores_eos(cfg, p, src_ids=None, *, eos_id=None, **options):
    return _original("greedy_decoding")(cfg, p, src_ids, eos_id=None, **options)  # eos_id dropped


def _loop_never_advances(cfg, p, src_ids=None, *, prompt_ids=None, bos_id=None, eos_id=None, max_new_tokens):
    batch = len(src_ids if cfg.has_encoder else prompt_ids)
    first, first_keep, cache = model.generation_start(cfg, p, batch, src_ids, prompt_ids, bos_id)
    tokens = np.full((batch, max_new_tokens), cfg.pad_id, dtype=np.int64)
    finished = np.zeros(batch, dtype=bool)
    for t in range(max_new_tokens):
        logits, _ = model.decode_step(cfg, p, cache, first, first_keep)  # the first step, every step
        tokens[:, t] = np.where(finished, cfg.pad_id, logits[:, -1].argmax(axis=-1))
        finished |= tokens[:, t] == eos_id
    return tokens


def _loop_feeds_back_its_input(cfg, p, src_ids=None, *, prompt_ids=None, bos_id=None, eos_id=None, max_new_tokens):
    batch = len(src_ids if cfg.has_encoder else prompt_ids)
    step_ids, step_keep, cache = model.generation_start(cfg, p, batch, src_ids, prompt_ids, bos_id)
    tokens = np.full((batch, max_new_tokens), cfg.pad_id, dtype=np.int64)
    finished = np.zeros(batch, dtype=bool)
    for t in range(max_new_tokens):
        logits, cache = model.decode_step(cfg, p, cache, step_ids, step_keep)  # step_ids: never the new token
        tokens[:, t] = np.where(finished, cfg.pad_id, logits[:, -1].argmax(axis=-1))
        finished |= tokens[:, t] == eos_id
    return tokens


# ---- the training mistakes (SPEC.md §5.9, §13, §14) --------------------------------------------

def _loss_over_pads(cfg, logits, targets):
    q = model.smoothed_targets(targets, cfg.tgt_vocab_size, cfg.pad_id, float(cfg.label_smoothing))
    return float(-(q * model.log_softmax(logits)).sum() / targets.size)  # every position: pad targets too


def _loss_over_pads_vjp(cfg, logits, targets):
    q = model.smoothed_targets(targets, cfg.tgt_vocab_size, cfg.pad_id, float(cfg.label_smoothing))
    return (np.exp(model.log_softmax(logits)) - q) / targets.size  # pad targets pull on the logits too


def _smoothing_onto_pad(targets, vocab_size, pad_id, label_smoothing):
    q = np.full(targets.shape + (vocab_size,), label_smoothing / (vocab_size - 1))  # pad gets its share
    np.put_along_axis(q, targets[..., None], 1.0 - label_smoothing, axis=-1)
    return q


def _adam_kept_in_float16(settings, state, params, grads, rate):
    # the update taken, then the weights and both moments stored in float16, as a run without a
    # float32 master copy keeps them
    new_params, state = _original("adam_update")(settings, state, params, grads, rate)

    def half(arrays):
        with np.errstate(over="ignore"):  # a value past float16's range is inf there, as in such a run
            return {name: value.astype(np.float16).astype(value.dtype) for name, value in arrays.items()}

    return half(new_params), training.AdamState(state.step, half(state.m), half(state.v))


def _eps_inside_the_root(settings, state, params, grads, rate):
    t = state.step + 1
    b1, b2 = settings.beta1, settings.beta2
    new_params, m, v = {}, {}, {}
    for name, theta in params.items():
        m[name] = b1 * state.m[name] + (1 - b1) * grads[name]
        v[name] = b2 * state.v[name] + (1 - b2) * grads[name] ** 2
        m_hat, v_hat = m[name] / (1 - b1 ** t), v[name] / (1 - b2 ** t)
        decay = settings.weight_decay if training.decays(theta.shape) else 0.0
        new_params[name] = theta - rate * (m_hat / np.sqrt(v_hat + settings.eps) + decay * theta)  # ε under the root
    return new_params, training.AdamState(t, m, v)


def _decay_everything(shape):
    return True  # biases, norm scales and norm biases decay too


def _tied_table_one_use(cfg, params, ids, side, d_x, offset=0, dropout_mask=None):
    grads = _original("embed_vjp")(cfg, params, ids, side, d_x, offset, dropout_mask)
    table = "tgt_embed.weight" if side == "tgt" or cfg.share_src_tgt_embed else "src_embed.weight"
    return {**grads, table: np.zeros_like(grads[table])}  # the table's gradient from the head's use only


def _finite_fill_vjp(q, k, v, mask, d_out, scale=None, cap=None, sinks=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if mask is not None:
        scores = np.where(mask, scores, -1e9)  # a row with no key attends uniformly, and its gradient flows
    weights = _original("softmax")(scores)
    d_v = np.swapaxes(weights, -1, -2) @ d_out
    d_scores = backward.softmax_vjp(weights, d_out @ np.swapaxes(v, -1, -2))
    return d_scores @ k * scale, np.swapaxes(d_scores, -1, -2) @ q * scale, d_v


def _dropout_unscaled(cfg, x, keep):
    return x if keep is None else x * keep  # dropped, but the kept units not scaled by 1 / (1 − p)


def _detached_residual(cfg, norm_p, x, sublayer, sublayer_vjp, d_y, dropout_mask=None, post_norm_p=None):
    if cfg.norm_position == "post":
        d_sum, norm_grads = backward.norm_vjp(cfg, norm_p, x + sublayer(x), d_y)
        d_x, grads = sublayer_vjp(x, d_sum)
        return d_x, norm_grads, grads, {}  # x.detach() on the skip path: ∂s never reaches x directly
    d_normed, grads = sublayer_vjp(model.norm(cfg, norm_p, x), d_y)
    d_x, norm_grads = backward.norm_vjp(cfg, norm_p, x, d_normed)
    return d_x, norm_grads, grads, {}  # the same on the pre-norm skip path


# ---- the modern decoder's mistakes (run on llama-tiny, and on the preset whose number each gets wrong) ----

HEAD_NORM_EPS = ("at the forward case's activations of size 1, where ε moves a head norm by about ε/2, a layer moves "
                 "by less than its tolerance; mha-small's q and k of size 1e-3 fail by far more")

def _rope_interleaved(cfg, x, positions):
    # GPT-J's and Meta's original layout: dimension 2i turns with 2i + 1, not with i + r/2
    r = cfg.rotary_dim
    cos, sin = (table[:, :r // 2].repeat(2, axis=-1).astype(x.dtype) for table in model.rope_tables(cfg, positions))
    pairs = x[..., :r].reshape(*x.shape[:-1], r // 2, 2)
    turned = np.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(*x.shape[:-1], r)
    return np.concatenate([x[..., :r] * cos + turned * sin, x[..., r:]], axis=-1)


def _rope_tables_in_half_precision(cfg, positions):
    inverse_frequency = model.rope_frequencies(cfg).astype(np.float16)
    angles = np.asarray(positions).astype(np.float16)[:, None] * inverse_frequency[None, :]  # rounded to 2⁻¹¹
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    return np.cos(angles), np.sin(angles)


def _rope_scaling_ignored(cfg, length=None):
    return _original("rope_frequencies")(cfg.replace(rope_scaling=None))  # rope_theta read, rope_scaling not


def _longrope_switch_inclusive(omega, scaling, length):
    shifted = None if length is None else length + 1  # the long factors from ℓ ≥ L on: one call early
    return _original("longrope_frequencies")(omega, scaling, shifted)


def _llama3_bands_swapped(omega, scaling):
    swapped = dataclasses.replace(scaling, low_freq_factor=scaling.high_freq_factor,
                                  high_freq_factor=scaling.low_freq_factor)
    return _original("llama3_frequencies")(omega, swapped)  # each band's factor read from the other's key


def _yarn_frequencies_inverted_twice(omega, r, theta, scaling):
    return 1 / _original("yarn_frequencies")(omega, r, theta, scaling)  # an inverse frequency inverted again


def _yarn_temperature_ignored(cfg):
    return 1.0  # YaRN's mscale dropped: cos and sin not multiplied by 0.1 ln(factor) + 1


def _rms_eps_outside_the_root(x, scale, bias, eps):
    return x / (np.sqrt((x * x).mean(axis=-1, keepdims=True)) + eps) * scale  # ε added after the root


def _key_value_heads_tiled(x, n_heads):
    return np.tile(x, (1, n_heads // x.shape[1], 1, 1))  # heads 0, 1, 2, 0, 1, 2: repeat, not repeat_interleave


def _cached_keys_rotated_at_the_step(cfg, p, x, k, v, mask, positions=None):
    # keys cached before their rotation, then every key read back turned by the step's own position
    if positions is not None and k.shape[2] != len(positions):
        k = model.rotary(cfg, _ORIGINALS["rotary"](cfg, k, -np.arange(k.shape[2])),  # undo the write's rotation
                         np.full(k.shape[2], positions[-1]))
    return _original("attend")(cfg, p, x, k, v, mask, positions)


def _theta_written_in(cfg, x, positions):
    return _original("rotary")(cfg.replace(rope_theta=10000.0), x, positions)  # RoFormer's base, not the config's


def _partial_rotary_on_the_last_dimensions(cfg, x, positions):
    r, width = cfg.rotary_dim, x.shape[-1]
    tail = _original("rotary")(cfg.replace(rope_fraction=1.0, head_dim=r), x[..., width - r:], positions)
    return np.concatenate([x[..., :width - r], tail], axis=-1)  # the last r dimensions turn, not the first


def _nope_layers_rotated(cfg, x, positions):
    # SmolLM3's no_rope_layers unread: a layer that rotates nothing (its own rope_fraction 0) turns like the others
    return _original("rotary")(cfg.replace(rope_fraction=1.0) if cfg.rope_fraction == 0 else cfg, x, positions)


def _head_norm_eps_outside_the_root(cfg, p, name, x):
    scale = p.get(f"{name}_norm.scale")  # the head norms alone: the layers' norms are right
    return x if scale is None else _rms_eps_outside_the_root(x, scale, None, float(cfg.norm_eps))


def _head_norm_with_qwen3s_eps(cfg, p, name, x):
    return _original("head_norm")(cfg.replace(norm_eps=1e-6), p, name, x)  # Qwen3's rms_norm_eps written in


def _gate_and_up_swapped(p, x, activation, clamp=None):
    swapped = {**p, "w1.weight": p["w3.weight"], "w3.weight": p["w1.weight"]}  # silu(x W_up) ⊙ x W_gate
    return _original("feed_forward")(swapped, x, activation, clamp)


# ---- Gemma's mistakes of record (run on gemma2-tiny and gemma3-tiny) ----

def _attention_softcap_dropped(q, k, v, mask=None, scale=None, cap=None, sinks=None):
    return _original("scaled_dot_product_attention")(q, k, v, mask, scale, None, sinks)  # Gemma 2 served without its cap


def _softcap_after_the_mask_fill(q, k, v, mask=None, scale=None, cap=None, sinks=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)  # the fill first ...
    return model.softmax(model.softcap(scores, cap)) @ v  # ... then the cap: a masked key's −∞ becomes −c


def _final_softcap_dropped(cfg, params, h):
    return _original("output_logits")(cfg.replace(final_softcap=None), params, h)


def _norm_scale_read_as_w(cfg, scale):
    return scale  # Gemma's stored w used as γ, not 1 + w


def _post_norms_dropped(cfg, p, name, x, sublayer, dropout_mask=None):
    return _original("block")(cfg.replace(post_norms=False), p, name, x, sublayer, dropout_mask)  # Llama's block


def _output_norms_placed_before(cfg, p, name, x, sublayer, dropout_mask=None):
    return _original("block")(cfg.replace(norm_position="pre"), p, name, x, sublayer, dropout_mask)  # Llama's block


def _projection_norm_per_head(cfg, p, name, x):
    # OLMo 2's [H·d_k] scale viewed per head, as a port that splits first and then norms (Qwen3's order) takes it:
    # each head divided by its own root mean square, not by the whole projection's
    scale = p.get(f"{name}_norm.scale")
    if scale is None or cfg.qk_norm_scope != "projection":
        return _original("head_norm")(cfg, p, name, x)
    per_head = model.norm_scale(cfg, scale).reshape(x.shape[1], 1, x.shape[-1])  # [H, 1, d_k]
    return model.rms_norm(x, per_head, None, float(cfg.norm_eps))


def _query_scalar_ignored(q, k, v, mask=None, scale=None, cap=None, sinks=None):
    return _original("scaled_dot_product_attention")(q, k, v, mask, None, cap, sinks)  # 1/√d_k, not 1/√query_pre_attn_scalar


def _embedding_scale_two_decimals(ids, weight, scale):
    return weight[ids] * round(math.sqrt(weight.shape[1]), 2) if scale else weight[ids]  # a model builder's 48.0 → "48.0"


def _global_scaling_on_local_layers(cfg, length=None):
    # the sliding layers keep their own θ but take the full layers' rescaling too (linear, factor 8)
    if cfg.rope_scaling is None:
        cfg = cfg.replace(rope_scaling=get_preset("gemma3-tiny").rope_scaling)
    return _original("rope_frequencies")(cfg, length)


# ---- the mixture of experts' (SPEC §5.14; run on mixtral-tiny and qwen3-moe-tiny) ----

def _softmax_after_top_k(probabilities, chosen, renormalize):
    # a softmax over the k chosen logits, whatever norm_topk_prob says: the weights always renormalised
    return _original("routing_weights")(probabilities, chosen, True)


def _norm_topk_prob_ignored(probabilities, chosen, renormalize):
    return _original("routing_weights")(probabilities, chosen, False)  # Mixtral's weights left as p[top]


def _top_k_over_the_tokens(probabilities, k):
    # the token axis reduced before the top k: every token sent to the batch's k most probable experts
    popular = _original("top_experts")(probabilities.sum(axis=0, keepdims=True), k)  # [1, k]
    return np.broadcast_to(popular, (probabilities.shape[0], k)).copy()


def _router_softmax_over_tokens(x, router, bias=None):
    return model.softmax(model.linear(x, router, bias).T).T  # softmax(dim=0): each expert's distribution over the tokens


def _bfloat16(x):
    """x rounded to bfloat16 (to nearest, ties to even) and back to its dtype."""
    return held_at(x, "bfloat16").astype(np.asarray(x).dtype)


def _router_in_bfloat16(x, router, bias=None):
    bias = None if bias is None else _bfloat16(bias)
    return model.softmax(_bfloat16(model.linear(_bfloat16(x), _bfloat16(router), bias)))  # the config says float32


def _one_experts_gate_and_up_swapped(x, router, experts, k, renormalize, activation, clamp=None, router_bias=None):
    first = {**experts[0], "w1.weight": experts[0]["w3.weight"], "w3.weight": experts[0]["w1.weight"]}
    return _original("mixture_of_experts")(x, router, [first, *experts[1:]], k, renormalize, activation, clamp,
                                           router_bias)


# ---- gpt-oss's (SPEC §5.16; run on gpt-oss-tiny) ----

def _sink_added_to_the_scores(x, mask=None, sink=None):
    # the sink added to every score as well as taken in the denominator: exp(s) in each key's numerator
    return _original("softmax")(x if sink is None else x + sink, mask, sink)


def _sinks_dropped(x, mask=None, sink=None):
    return _original("softmax")(x, mask, None)  # the sinks loaded and never used: a plain softmax


def _clamp_on_the_wrong_branches(gate, up, limit, alpha):
    # the gate clipped from both sides and up from above only: each branch given the other's clamp
    g, u = np.clip(gate, -limit, limit), np.minimum(up, limit)
    return g * model.sigmoid(alpha * g) * (u + 1.0)


def _swiglu_without_the_plus_one(gate, up, limit, alpha):
    g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return g * model.sigmoid(alpha * g) * u  # SwiGLU's product, not gpt-oss's (u + 1)


# ---- the hybrid's gated DeltaNet (SPEC §5.15; run on qwen35-tiny), its silent bugs of record ----

def _pads_write_the_state(cfg, p, x, keep, state=None):
    return _original("gated_delta_net")(cfg, p, x, np.ones_like(keep), state)  # every token real, pads too


def _state_zeroed_at_each_call(cfg, p, x, keep, state=None):
    return _original("gated_delta_net")(cfg, p, x, keep, None)  # the handed-over state dropped


def _beta_from_the_decays_split(cfg, p, x, keep, state=None):
    swapped = {**p, "beta.weight": p["decay.weight"], "decay.weight": p["beta.weight"]}  # in_proj_ba split crossed
    return _original("gated_delta_net")(cfg, swapped, x, keep, state)


def _l2_norm_dropped(x, eps=1e-6):
    return x


def _softplus_dropped(x):
    return x  # g = −exp(A) · (x W + b): positive wherever x W + b is negative


def _decay_sign_flipped(state, q, k, v, decay, beta):
    return _original("gated_delta_rule")(state, q, k, v, -decay, beta)  # e^{−g} = e^{|g|}: the state grows


def _gate_before_the_norm(o, scale, gate, eps):
    return model.rms_norm(o * model.swish(gate), scale, None, eps)  # RMSNorm(o ⊙ SiLU(z)) γ


def _conv_window_not_moved(window, u, kernel):
    convolved, _ = _original("short_convolution")(window, u, kernel)
    return convolved, window  # the state kept as it was read: the newest input never written into it


@dataclass(frozen=True)
class Mutation:
    name: str
    mistake: str
    target: str  # the function of impl_numpy.model it replaces
    replacement: Callable
    expected_sublayer: str  # the smallest catalogue sublayer that must fail
    expected_stage: str | None  # the localization stage that must fail first (None: none fails alone)
    localize_on: str = "pad_right"  # the forward case whose inputs the localization uses
    config: Mapping[str, object] | None = None  # config fields the mistake needs (a head bias to drop)
    also: tuple[tuple[str, Callable], ...] = ()  # the same mistake in another function (a loss's VJP)
    backward: bool = False  # a training mistake: the gradient and training cases run too
    preset: str | None = None  # the preset the mistake needs (a modern decoder's), on its conformance weights
    unlocalized: str = ""  # why no stage fails alone, where expected_stage is None (mistakes_page says it)


MASKS = "the mistake is in how the model builds its masks, which the whole-stack cases catch"
LOOP = "the mistake is in the generation loop, which only the generate cases run"
LOSS = "the mistake is in the loss, after the last stage"
NO_STAGE = "no stage of the localized case fails alone; the cells above catch it"


MUTATIONS: list[Mutation] = [
    Mutation("scale_d_model", "attention scores divided by √d_model instead of √d_k", "scaled_dot_product_attention",
             _scaled_by_d_model, "attention", "encoder.layers.0"),
    Mutation("cos_exponent", "positional encoding with 2i+1 instead of 2i in the cos terms' exponent",
             "sinusoidal_table", _cos_exponent_off, "embedding", "src embedding"),
    Mutation("mask_polarity", "keep-mask read the other way round (True = masked out)", "softmax",
             _inverted_mask, "attention", "encoder.layers.0"),
    Mutation("mask_after_softmax", "padding zeroed after the softmax instead of before it", "softmax",
             _mask_after_softmax, "attention", "encoder.layers.0"),
    Mutation("softmax_over_queries", "softmax taken over the query axis", "softmax", _softmax_over_queries,
             "attention", "encoder.layers.0"),
    Mutation("unbiased_layernorm", "LayerNorm with the unbiased variance (divides by d - 1)", "layer_norm",
             _unbiased_layer_norm, "norm", "encoder.layers.0"),
    Mutation("no_embedding_scale", "token embeddings not multiplied by √d_model", "token_embedding",
             _no_embedding_scale, "embedding", "src embedding"),
    Mutation("residual_from_normed", "the residual adds the normalised tensor instead of the block input",
             "residual", _residual_from_normed, "ffn_block", "encoder.layers.0"),
    Mutation("heads_reshape", "heads split by a reshape to [B, H, T, d_k] without the transpose", "split_heads",
             _heads_without_transpose, "mha", "encoder.layers.0"),
    Mutation("causal_off_by_one", "causal mask that hides the current position (< instead of <=)",
             "decoder_self_mask", _causal_off_by_one, "decoder", None, unlocalized=MASKS),
    Mutation("window_off_by_one", "a sliding window of W keys that lets the query see W + 1 (i − W ≤ j; the "
             "kernels of one library disagreed exactly so)", "decoder_self_mask", _window_off_by_one, "decoder",
             None, unlocalized=MASKS, preset="mistral-tiny"),
    Mutation("window_short_by_one", "a sliding window of W keys that lets the query see W − 1 (the query's own "
             "key not counted among the W)", "decoder_self_mask", _window_short_by_one, "decoder", None,
             unlocalized=MASKS, preset="mistral-tiny"),
    Mutation("window_ignored_in_cached_step", "the sliding window applied by the forward but not by the cached "
             "decode step, which attends to the whole cache", "decode_step", _window_ignored_in_the_cached_step,
             "decode", None, preset="mistral-tiny",
             unlocalized="the mistake is in the cached step, which a teacher-forced forward never takes"),
    Mutation("fill_minus_1e9", "masked scores filled with -1e9: rows with no key average V instead of giving 0 "
             "(and in float16 the fill overflows to -inf: NaN)",
             "softmax", _fill_minus_1e9, "attention", "encoder.layers.0", localize_on="all_pad"),
    Mutation("inf_fill_nan", "masked scores filled with -inf and a plain softmax: NaN on rows with no key",
             "softmax", _plain_softmax_after_inf_fill, "attention", "encoder.layers.0", localize_on="all_pad"),
    Mutation("dropout_on", "dropout (p=0.1) left on at inference in the FFN", "feed_forward", _dropout_at_inference,
             "ffn", "encoder.layers.0"),
    Mutation("cross_padding", "cross-attention ignores the source padding mask", "decoder_layer",
             _cross_attention_ignores_padding, "decoder_layer", "decoder.layers.0"),
    Mutation("ffn_bias_dropped", "the FFN's first linear layer without its bias", "feed_forward",
             _ffn_first_bias_dropped, "ffn", "encoder.layers.0"),
    Mutation("qk_biases_swapped", "q and k projection biases swapped", "attend", _qk_biases_swapped, "mha",
             "encoder.layers.0"),
    Mutation("norm_without_scale", "layer norm without its scale γ", "layer_norm", _layer_norm_without_scale,
             "norm", "encoder.layers.0"),
    Mutation("norm_without_bias", "layer norm without its bias β", "layer_norm", _layer_norm_without_bias,
             "norm", "encoder.layers.0"),
    Mutation("head_bias_dropped", "the output projection without its bias (a config with head_bias)",
             "output_logits", _head_bias_dropped, "logits", "head", config={"head_bias": True}),
    Mutation("ignores_eos", "greedy generation ignores eos_id: finished rows go on", "greedy_decoding",
             _generation_ignores_eos, "generate", None, unlocalized=LOOP),
    Mutation("loop_never_advances", "a generation loop that never advances: every step reruns the first",
             "greedy_decoding", _loop_never_advances, "generate", None, unlocalized=LOOP),
    Mutation("loop_feeds_back_input", "a generation loop that feeds back its previous input, not the new token",
             "greedy_decoding", _loop_feeds_back_its_input, "generate", None, unlocalized=LOOP),
]

MUTATIONS += [
    Mutation("loss_over_pads", "the loss averaged over pad targets too", "token_cross_entropy", _loss_over_pads,
             "loss", None, also=(("token_cross_entropy_vjp", _loss_over_pads_vjp),), backward=True, unlocalized=LOSS),
    Mutation("smoothing_onto_pad", "label smoothing spread onto the pad index as well", "smoothed_targets",
             _smoothing_onto_pad, "loss", None, config={"label_smoothing": 0.1}, backward=True, unlocalized=LOSS),
    Mutation("eps_inside_root", "Adam's ε inside the square root: m̂ / √(v̂ + ε)", "adam_update",
             _eps_inside_the_root, "train_step", "step 1 params", backward=True),
    Mutation("adam_in_float16", "Adam's weights and moments kept in float16 (pure half-precision training: no "
             "float32 master copy)", "adam_update", _adam_kept_in_float16, "train_step", "step 1 first_moment",
             backward=True),
    Mutation("decay_on_vectors", "AdamW's weight decay applied to biases and norm parameters too", "decays",
             _decay_everything, "train_step", "step 1 params", backward=True),
    Mutation("tied_table_one_use", "a tied embedding table whose gradient counts the head's use only", "embed_vjp",
             _tied_table_one_use, "grad-embedding", "tgt embedding", backward=True),
    Mutation("finite_fill_gradient", "attention's backward masked with a finite fill: rows with no key leak "
             "gradient into masked keys and values", "scaled_dot_product_attention_vjp", _finite_fill_vjp,
             "grad-attention", None, backward=True),
    Mutation("detached_residual", "a .detach() on the residual's skip path", "residual_vjp", _detached_residual,
             "grad-ffn_block", "decoder.layers.1", backward=True),
    Mutation("dropout_unscaled", "dropout that keeps units without scaling them by 1 / (1 − p)", "dropout",
             _dropout_unscaled, "loss", None, backward=True,
             unlocalized="the mistake is in training mode's dropout, which only the dropout cases run"),
]

MUTATIONS += [
    Mutation("rope_interleaved", "RoPE in the interleaved layout (pairs 2i, 2i+1) on rotate_half weights", "rotary",
             _rope_interleaved, "mha", "decoder.layers.0", preset="llama-tiny"),
    Mutation("rope_tables_float16", "RoPE's angles computed in float16 (transformers PR #29285)", "rope_tables",
             _rope_tables_in_half_precision, "mha", "decoder.layers.0", preset="llama-tiny"),
    Mutation("rms_eps_outside_root", "RMSNorm with ε outside the root: x / (√mean(x²) + ε)", "rms_norm",
             _rms_eps_outside_the_root, "norm", "decoder.layers.0", preset="llama-tiny"),
    Mutation("kv_heads_tiled", "key/value heads repeated in the wrong order (tile, not repeat_interleave)",
             "group_heads", _key_value_heads_tiled, "attention", "decoder.layers.0", preset="llama-tiny"),
    Mutation("rope_after_cache_write", "keys cached unrotated, then rotated by the step's position when read",
             "attend", _cached_keys_rotated_at_the_step, "mha", None, preset="llama-tiny",
             unlocalized="the mistake is in the cache, which a teacher-forced forward never reads"),
    Mutation("swiglu_swapped", "SwiGLU with gate and up swapped: silu(x W_up) ⊙ x W_gate", "feed_forward",
             _gate_and_up_swapped, "ffn", "decoder.layers.0", preset="llama-tiny"),
    # a number written in where the config has one: each fails the preset whose value is not the default
    Mutation("rope_theta_written_in", "RoPE's θ written in as 10000 (Llama 3's is 500000)", "rotary",
             _theta_written_in, "mha", "decoder.layers.0", preset="llama-tiny"),
    Mutation("partial_rotary_last_dims", "partial rotary turning a head's last r dimensions, not its first",
             "rotary", _partial_rotary_on_the_last_dimensions, "mha", "decoder.layers.0", preset="stablelm-tiny"),
    Mutation("nope_layers_rotated", "SmolLM3's NoPE layers rotated like the others (no_rope_layers unread)",
             "rotary", _nope_layers_rotated, "mha", "decoder.layers.1", preset="smollm3-tiny"),
    Mutation("head_norm_eps_outside_root", "Qwen3's q/k head norms with ε outside the root", "head_norm",
             _head_norm_eps_outside_the_root, "mha", None, preset="qwen3-tiny", unlocalized=HEAD_NORM_EPS),
    Mutation("head_norm_eps_written_in", "Qwen3's q/k head norms with Qwen3's ε 1e-6 written in", "head_norm",
             _head_norm_with_qwen3s_eps, "mha", None, preset="qwen3-tiny", unlocalized=HEAD_NORM_EPS),
    # the rescaled rotary frequencies' bugs of record (SPEC §5.12)
    Mutation("rope_scaling_ignored", "rope_scaling ignored: Llama 3's plain θ frequencies (a logit checker's "
             "reference did this)", "rope_frequencies", _rope_scaling_ignored, "mha", "decoder.layers.0",
             preset="llama3-tiny"),
    Mutation("llama3_bands_swapped", "llama3 rescaling with low_freq_factor and high_freq_factor swapped",
             "llama3_frequencies", _llama3_bands_swapped, "mha", "decoder.layers.0", preset="llama3-tiny"),
    Mutation("yarn_inverted_twice", "YaRN's inverse frequencies inverted once more (a model builder's bug)",
             "yarn_frequencies", _yarn_frequencies_inverted_twice, "mha", "decoder.layers.0", preset="qwen2-yarn-tiny"),
    Mutation("yarn_mscale_ignored", "YaRN's attention factor (mscale) ignored: 1 where it is 1.139 (two serving "
             "engines shipped this)", "rope_attention_factor", _yarn_temperature_ignored, "mha", "decoder.layers.0",
             preset="qwen2-yarn-tiny"),
    Mutation("longrope_switch_inclusive", "LongRoPE switching to the long factors at ℓ ≥ L instead of ℓ > L (a "
             "call exactly as long as the original context takes the long ones)", "longrope_frequencies",
             _longrope_switch_inclusive, "forward", "decoder.layers.0", localize_on="at_switch", preset="phi3-tiny"),
    Mutation("longrope_attention_factor_ignored", "LongRoPE's attention factor √(1 + ln s / ln L) ignored: 1 "
             "where it is 1.096", "rope_attention_factor", _yarn_temperature_ignored, "mha", "decoder.layers.0",
             preset="phi3-tiny"),
]

MUTATIONS += [  # Gemma's (SPEC §5.13)
    Mutation("attention_softcap_dropped", "Gemma 2's attention softcap dropped (a serving engine's first Gemma 2)",
             "scaled_dot_product_attention", _attention_softcap_dropped, "attention", "decoder.layers.0",
             preset="gemma2-tiny"),
    Mutation("softcap_after_mask_fill", "the attention softcap applied after the mask fill: a masked key's score "
             "becomes −c, not −∞, and takes weight", "scaled_dot_product_attention", _softcap_after_the_mask_fill,
             "attention", "decoder.layers.0", preset="gemma2-tiny"),
    Mutation("final_softcap_dropped", "Gemma 2's final logit softcap dropped", "output_logits",
             _final_softcap_dropped, "logits", "head", preset="gemma2-tiny"),
    Mutation("norm_plus_one_read_as_w", "Gemma's RMSNorm scale read as w instead of 1 + w", "norm_scale",
             _norm_scale_read_as_w, "norm", "decoder.layers.0", preset="gemma2-tiny"),
    Mutation("post_norms_dropped", "Gemma's post-attention and post-FFN norms dropped (Llama's block)", "block",
             _post_norms_dropped, "ffn_block", "decoder.layers.0", preset="gemma2-tiny"),
    Mutation("query_pre_attn_scalar_ignored", "query_pre_attn_scalar ignored: scores by 1/√d_k (20) instead of "
             "1/√16 (a converter that never reads it)", "scaled_dot_product_attention", _query_scalar_ignored,
             "attention", "decoder.layers.0", preset="gemma2-tiny"),
    Mutation("embedding_scale_two_decimals", "√d embedding scale rounded to two decimals (8.49 for √72 = 8.4853; a "
             "model builder's)", "token_embedding", _embedding_scale_two_decimals, "embedding", "tgt embedding",
             preset="gemma2-tiny"),
    Mutation("output_norms_placed_before", "OLMo 2's norms placed before each sublayer (Llama's block), not on its "
             "output", "block", _output_norms_placed_before, "ffn_block", "decoder.layers.0", preset="olmo2-tiny"),
    Mutation("projection_norm_per_head", "OLMo 2's q/k norms taken per head (split, then normed: Qwen3's order) "
             "instead of over the whole projection", "head_norm", _projection_norm_per_head, "mha",
             "decoder.layers.0", preset="olmo2-tiny"),
    Mutation("local_layers_rescaled", "Gemma 3's linear rope scaling applied to the sliding layers too (their own θ "
             "is unrescaled)", "rope_frequencies", _global_scaling_on_local_layers, "mha", "decoder.layers.0",
             preset="gemma3-tiny"),
]

MUTATIONS += [  # the mixture of experts' (SPEC §5.14)
    Mutation("softmax_after_top_k", "the router's softmax taken over the k chosen logits (Mixtral's form) in a model "
             "whose weights are not renormalised (Qwen3-MoE's norm_topk_prob false)", "routing_weights",
             _softmax_after_top_k, "ffn", "decoder.layers.0", preset="qwen3-moe-tiny"),
    Mutation("norm_topk_prob_ignored", "the k routing weights left unrenormalised where the config renormalises "
             "them (Mixtral)", "routing_weights", _norm_topk_prob_ignored, "ffn", "decoder.layers.0",
             preset="mixtral-tiny"),
    Mutation("router_softmax_over_tokens", "the router's softmax over the tokens instead of the experts "
             "(softmax(dim=0))", "router_probabilities", _router_softmax_over_tokens, "ffn", "decoder.layers.0",
             preset="mixtral-tiny"),
    Mutation("top_k_over_the_tokens", "the top k taken over the token axis (the probabilities summed over the "
             "tokens first): every token sent to the batch's k most probable experts", "top_experts",
             _top_k_over_the_tokens, "ffn", "decoder.layers.0", preset="mixtral-tiny"),
    Mutation("router_in_bfloat16", "the router computed in bfloat16 where the config says float32", "router_probabilities",
             _router_in_bfloat16, "ffn", "decoder.layers.0", preset="mixtral-tiny"),
    Mutation("expert_gate_and_up_swapped", "one expert's gate and up projections swapped (a fused gate_up_proj split "
             "the wrong way round for expert 0)", "mixture_of_experts", _one_experts_gate_and_up_swapped, "ffn",
             "decoder.layers.0", preset="mixtral-tiny"),
]

MUTATIONS += [  # gpt-oss's (SPEC §5.16)
    Mutation("sink_in_numerator", "the attention sink added to every score as well as to the denominator (exp(s) "
             "in each key's numerator: gpt-oss's sink then weighs as a logit of 0)", "softmax", _sink_added_to_the_scores,
             "attention", "decoder.layers.0", preset="gpt-oss-tiny"),
    Mutation("sinks_dropped", "the attention sinks loaded and never used: a plain softmax over the keys (gpt-oss)", "softmax",
             _sinks_dropped, "attention", "decoder.layers.0", preset="gpt-oss-tiny"),
    Mutation("clamp_on_wrong_branches", "the clamped SwiGLU's clamps swapped between the branches: the gate clipped "
             "from both sides, up from above only (gpt-oss)", "clamped_swiglu", _clamp_on_the_wrong_branches, "ffn", "decoder.layers.0",
             preset="gpt-oss-tiny"),
    Mutation("swiglu_plus_one_dropped", "the clamped SwiGLU without the + 1 on the up branch: g·σ(αg) ⊙ u (SwiGLU's "
             "product, not gpt-oss's)", "clamped_swiglu", _swiglu_without_the_plus_one, "ffn", "decoder.layers.0",
             preset="gpt-oss-tiny"),
]

MUTATIONS += [  # the hybrid's gated DeltaNet (SPEC §5.15)
    Mutation("linear_pads_write", "pad tokens update the recurrent and convolution states (a chunked path that pads "
             "its last chunk)", "gated_delta_net", _pads_write_the_state, "linear_attn", "decoder.layers.0",
             preset="qwen35-tiny"),
    Mutation("linear_state_zeroed", "a prefill or step that does not start at position 0 begins from a zero state",
             "gated_delta_net", _state_zeroed_at_each_call, "decode", None, preset="qwen35-tiny",
             unlocalized="the mistake is in the state handed from one call to the next, which a forward never hands"),
    Mutation("linear_qk_l2_norm_dropped", "the delta rule's q and k not L2-normalised", "l2_normalize",
             _l2_norm_dropped, "linear_attn", "decoder.layers.0", preset="qwen35-tiny"),
    Mutation("linear_decay_softplus_dropped", "the decay's softplus dropped: g = −e^A (x W + b)", "softplus",
             _softplus_dropped, "linear_attn", "decoder.layers.0", preset="qwen35-tiny"),
    Mutation("linear_decay_sign_flipped", "the state multiplied by e^−g instead of e^g", "gated_delta_rule",
             _decay_sign_flipped, "linear_attn", "decoder.layers.0", preset="qwen35-tiny"),
    Mutation("linear_beta_from_decay_split", "the write strength β and the decay read from each other's half of "
             "the fused in_proj_ba",
             "gated_delta_net", _beta_from_the_decays_split, "linear_attn", "decoder.layers.0", preset="qwen35-tiny"),
    Mutation("linear_gate_before_norm", "the output gate SiLU(z) applied before the RMSNorm instead of after it",
             "gated_rms_norm", _gate_before_the_norm, "linear_attn", "decoder.layers.0", preset="qwen35-tiny"),
    Mutation("linear_conv_window_not_moved", "the short convolution's state saved before the token is written into "
             "it (one behind, so never moved on)", "short_convolution", _conv_window_not_moved, "linear_attn",
             "decoder.layers.0", preset="qwen35-tiny"),
]

# Where the golden's functions live; a name imported into another of these modules is swapped there too.
_MODULES = (model, impl_numpy, backward, training)
_ORIGINALS = {name: next(getattr(module, name) for module in _MODULES if hasattr(module, name))
              for name in {m.target for m in MUTATIONS} | {name for m in MUTATIONS for name, _ in m.also} | {"rotary"}}


def _original(name: str) -> Callable:
    return _ORIGINALS[name]


@contextlib.contextmanager
def applied(mutation: Mutation) -> Iterator[None]:
    """Swap the function (and any `also`) wherever the golden's modules hold it, then restore it."""
    swaps = [(module, name, replacement) for name, replacement in ((mutation.target, mutation.replacement), *mutation.also)
             for module in _MODULES if getattr(module, name, None) is _ORIGINALS[name]]
    for module, name, replacement in swaps:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, _ in swaps:
            setattr(module, name, _ORIGINALS[name])


def _quiet():
    """A mutant's overflow (a state that grows by e^|g| a token reaches inf) is its mistake's to show in
    the verdict, not a warning on the terminal."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


class MutantBackend(NumpyFloat32Backend):
    """numpy-float32 with one mistake, active only while the backend computes."""

    def __init__(self, mutation: Mutation):
        self.mutation = mutation
        self.name = f"mutant-{mutation.name}"

    def load(self, cfg, params, dtype, device):
        runner, mutation = NumpyRunner(cfg, params, dtype), self.mutation

        class Mutant:
            def run(self, sublayer, inputs):
                with applied(mutation), _quiet():
                    return runner.run(sublayer, inputs)

            def gradients(self, sublayer, inputs):
                with applied(mutation), _quiet():
                    return runner.gradients(sublayer, inputs)

            def train(self, sublayer, inputs):
                with applied(mutation), _quiet():
                    return runner.train(sublayer, inputs)

        return Mutant()


@dataclass(frozen=True)
class Verdict:
    mutation: Mutation
    failed_cells: int
    total_cells: int
    first_sublayer: str | None  # the smallest sublayer with a failing cell
    worst: str  # the first failing cell and its error / tolerance
    first_stage: str | None
    # the first cell's error where the mutant raised: a mutant that breaks on being called (a signature the
    # function no longer has) catches nothing, so such a verdict is never caught
    broken: str | None = None

    @property
    def caught(self) -> bool:
        return self.failed_cells > 0 and self.broken is None

    @property
    def localized(self) -> bool:
        return self.first_sublayer == self.mutation.expected_sublayer and self.first_stage == self.mutation.expected_stage


def mutation_model(cfg: ModelConfig, params, mutation: Mutation) -> tuple[ModelConfig, dict]:
    """The config a mutation runs on, and its weights: the given ones, and the conformance
    weights of whatever the mutation's config adds."""
    if mutation.preset:
        cfg = get_preset(mutation.preset)
        return cfg, conformance_params(cfg)
    if not mutation.config:
        return cfg, dict(params)
    cfg = cfg.replace(**mutation.config)
    added = conformance_params(cfg)
    return cfg, {name: params[name] if name in params else added[name] for name in param_shapes(cfg)}


def kept_golden(goldens: dict[str, KeptGolden], cfg: ModelConfig, params) -> KeptGolden:
    """The golden of this model from `goldens` (by config), made there when it holds none of these weights."""
    key = cfg.to_json()
    if key not in goldens or not goldens[key].holds(cfg, params):
        goldens[key] = KeptGolden(cfg, params)
    return goldens[key]


def run_mutation(cfg: ModelConfig, params, mutation: Mutation, goldens: dict[str, KeptGolden] | None = None) -> Verdict:
    """A mutation's verdict. goldens: the goldens of the models earlier mutations ran on, kept by the
    caller (every mistake of the gallery is checked against the same references), added to here."""
    cfg, params = mutation_model(cfg, params, mutation)
    golden = None if goldens is None else kept_golden(goldens, cfg, params)
    name = f"mutant-{mutation.name}"
    register_backend(name, lambda: MutantBackend(mutation))
    try:
        results = run_matrix(cfg, params, plan_matrix(cfg, [name], ["float32"], ["cpu"]), backward=mutation.backward,
                             kept_golden=golden)
        # a training mistake: the backward walk, and where no stage fails alone, the step and quantity
        # the training cell names
        localization = (localize_backward_column if mutation.backward else localize_column)(
            cfg, params, name, "float32", "cpu", mutation.localize_on)
    finally:
        unregister_backend(name)
    failures = [r for r in results if r.status == FAIL]
    errors = [r for r in results if r.status == ERROR]
    order = list(SUBLAYERS)
    failures.sort(key=lambda r: order.index(r.sublayer))
    first = failures[0] if failures else None
    worst = "-" if first is None else (
        f"{first.sublayer}-{first.mask_case}: " + (f"{first.ratio:.3g}× tol" if first.ratio is not None else "error"))
    stage = localization.first_failure.name if localization.first_failure else None
    if stage is None and first is not None and is_training(first.sublayer):
        stage = failing_step(first.reason)
    return Verdict(mutation, len(failures), len(results), first.sublayer if first else None, worst, stage,
                   errors[0].reason.splitlines()[0] if errors else None)


def run_gallery(cfg: ModelConfig, params, mutations: Sequence[Mutation] | None = None) -> list[Verdict]:
    """Every mistake of the gallery (MUTATIONS, or those given) applied in turn to the
    numpy-float32 backend, the golden unchanged: each must be caught and localized."""
    goldens: dict[str, KeptGolden] = {}
    return [run_mutation(cfg, params, mutation, goldens)
            for mutation in (MUTATIONS if mutations is None else mutations)]


def gallery_table(verdicts: list[Verdict]) -> str:
    lines = ["| mutation | the mistake | cells failed | first failing sublayer | first failing cell | "
             "localized stage | verdict |", "|---|---|---:|---|---|---|---|"]
    for v in verdicts:
        verdict = "caught, localized" if v.caught and v.localized else ("caught, NOT localized" if v.caught else
                                                                         "BROKEN" if v.broken else "MISSED")
        lines.append(f"| `{v.mutation.name}` | {v.mutation.mistake} | {v.failed_cells}/{v.total_cells} | "
                     f"{v.first_sublayer or '-'} | {v.worst} | {v.first_stage or 'none alone'} | {verdict} |")
    return "\n".join(lines)


def gallery_page(verdicts: list[Verdict], preset: str) -> str:
    """The gallery's table as a Markdown page (`rosetta mutations --markdown FILE`)."""
    return f"# Mutation gallery ({preset})\n\n{gallery_table(verdicts)}\n"


def _defined_in(target: str) -> str:
    """The repository path of the file that defines a golden function (some come from spec)."""
    import inspect
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return Path(inspect.getsourcefile(_ORIGINALS[target])).resolve().relative_to(root).as_posix()


def mistakes_page(verdicts: list[Verdict], preset: str) -> str:
    """docs/mistakes.md: each mistake as a lesson — the wrong line, the right one (both cut out of
    the source), what it does to the numbers and where the harness points."""
    from pages.differences import excerpt

    lines = ["# Common Transformer mistakes, and how the harness finds them", "",
             f"Generated by `rosetta mutations --mistakes docs/mistakes.md` on the {preset} preset; a test "
             "regenerates it. Each mistake is applied to the numpy-float32 backend only, while the golden stays "
             "right; the numbers are max|error| / tolerance (below 1 passes). The *first failing sublayer* is the "
             "smallest catalogue entry that fails; the *localized stage* is the first stage of the whole model "
             "that is wrong when fed the golden's own inputs (`rosetta check --localize`). For the training "
             "mistakes the gradient and training cases run too, and the localized stage is the first stage of the "
             "backward walk (each fed the golden's input and upstream cotangent) that is wrong alone, or, where none "
             "is, the step and quantity the training cell names. The one-line table is "
             "[mutation-gallery.md](mutation-gallery.md).", ""]
    for v in verdicts:
        m = v.mutation
        lines += [f"## {m.mistake[0].upper() + m.mistake[1:]}", "",
                  f"`{m.name}` replaces `{_defined_in(m.target).removesuffix('.py').replace('/', '.')}.{m.target}`"
                  + "".join(f" and `{name}`" for name, _ in m.also) + ".", "",
                  "Wrong:", "", "```python", excerpt("pages/mutations.py", m.replacement.__name__), "```", "",
                  f"Right (the golden, `{_defined_in(m.target)}`):", "", "```python",
                  excerpt(_defined_in(m.target), m.target), "```", "",
                  f"What it does: {v.failed_cells} of {v.total_cells} cells fail; the first failing sublayer is "
                  f"`{v.first_sublayer}` (first failing cell {v.worst}). Localized to: "
                  f"{'`' + v.first_stage + '`' if v.first_stage else f'no stage alone ({m.unlocalized or NO_STAGE})'}. "
                  f"Verdict: {'caught and localized' if v.caught and v.localized else 'NOT localized as expected'}.", ""]
    return "\n".join(lines)
