"""decoder_step_in_place: impl_torch's decode step with each layer's cache attention as one
onnxruntime GroupQueryAttention node (com.microsoft), which writes the new keys and values into
the cache it reads and attends over the positions written so far, not the whole capacity.

decoder_step (export/torch_export.py) writes the new positions into copies of the past, because a
graph never writes its inputs: every step copies the whole cache (measured on paper-base,
ScatterElements was 15% of a CPU generation's time) and attends over every preallocated
position under a mask. GroupQueryAttention is built for the other way: when its present outputs
are bound to its past inputs' buffers, it writes position start … start+n−1 in place, so a step
costs what its positions cost (export.runner binds them so).

The spec's masks are kept: the keep-vector becomes GroupQueryAttention's additive attention_bias
(0 for a real key, the dtype's lowest for a pad, at every position up to the step's last), its
causal mask is the spec's, and a query with no real key up to its position gets zeros (SPEC §6)
where GroupQueryAttention would average. A sliding window (SPEC §6) is written into the same bias
rather than into GroupQueryAttention's local_window_size: whether a window counts the query's own
key is exactly the off-by-one that bridges have got wrong, and the bias states the spec's. Its CPU
kernel takes a step of several tokens after position 0 for one row only; export.runner feeds such
a chunk a token at a time.

The attention is a torch custom op (``rosetta::cached_attention``) so that torch.onnx can translate
it into the one node; run eagerly, it computes the same function with impl_torch's attention (the
tests compare the two). The CPU kernel takes heads of a multiple of 8 only: other heads (qwen2-tiny's
10, qwen3-tiny's 12) are padded with zeros to the next multiple in q, k and v alike, which changes
no score, with the attention's scale set to the real head size's, and the cache holds the padded
heads (export.graphs.cache_head_size). The graph is exported at float32 and used on the CPU: its
CUDA kernel has not met a GPU here.
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op
from torch import nn

from impl_torch.model import (Transformer, _key_mask, attention_positions, block, merge_heads, rotary,
                              scaled_dot_product_attention, split_heads)

MICROSOFT = "com.microsoft"
INT32, INT64 = onnx.TensorProto.INT32, onnx.TensorProto.INT64


def register_group_query_attention_schema() -> None:
    """onnxruntime's GroupQueryAttention as an ONNX schema (the inputs this module uses and their
    slots), so that onnxscript and onnx.checker know the com.microsoft op; onnxruntime has its own."""
    if onnx.defs.has("GroupQueryAttention", MICROSOFT):
        return
    parameter, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    inputs = [parameter("query", "T"), parameter("key", "T", param_option=optional),
              parameter("value", "T", param_option=optional), parameter("past_key", "T", param_option=optional),
              parameter("past_value", "T", param_option=optional), parameter("seqlens_k", "M"),
              parameter("total_sequence_length", "M"), parameter("cos_cache", "T", param_option=optional),
              parameter("sin_cache", "T", param_option=optional), parameter("position_ids", "P", param_option=optional),
              parameter("attention_bias", "T", param_option=optional),
              parameter("head_sink", "T", param_option=optional)]
    outputs = [parameter("output", "T"), parameter("present_key", "T"), parameter("present_value", "T")]
    attributes = [OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "query heads"),
                  OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, "key/value heads"),
                  OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "the scores' factor (1/√head_size)",
                                     required=False),
                  OpSchema.Attribute("softcap", OpSchema.AttrType.FLOAT, "c of c·tanh(scores / c); 0: none",
                                     required=False)]
    onnx.defs.register_schema(OpSchema(
        "GroupQueryAttention", MICROSOFT, 1, inputs=inputs, outputs=outputs, attributes=attributes,
        type_constraints=[("T", floats, ""), ("M", ["tensor(int32)"], ""), ("P", ["tensor(int64)"], "")]))


@torch.library.custom_op("rosetta::cached_attention", mutates_args=())
def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_keys: torch.Tensor,
                     past_values: torch.Tensor, keep: torch.Tensor, start: torch.Tensor,
                     window: int | None = None, scale: float | None = None, cap: float | None = None,
                     sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new queries' attention over the cache with the new keys and values written at start …
    start+n−1. q [B, n, H·d_k], k and v [B, n, H_kv·d_k], past [B, H_kv, C, p] with p ≥ d_k (the
    padded head size: zeros past d_k), keep [B, C] (the new positions' included), window: the
    layer's sliding window, scale and cap: its scores' factor and softcap (SPEC §5.13), sinks [H]:
    its heads' sinks (SPEC §5.16) -> (heads [B, n, H·d_k], present keys, present values)."""
    heads_kv = past_keys.shape[1]
    head_size = k.shape[2] // heads_kv
    n, first = q.shape[1], int(start)
    keys, values = past_keys.clone(), past_values.clone()
    keys[:, :, first:first + n, :head_size] = split_heads(k, heads_kv)
    values[:, :, first:first + n, :head_size] = split_heads(v, heads_kv)
    positions = first + torch.arange(n, device=q.device)
    slots = torch.arange(keys.shape[2], device=q.device)[None, :]
    causal = slots <= positions[:, None]  # [n, C]
    if window is not None:
        causal = causal & (slots > positions[:, None] - window)
    mask = causal[None, None] & keep[:, None, None, :]  # [B, 1, n, C]
    heads = scaled_dot_product_attention(split_heads(q, q.shape[2] // head_size), keys[..., :head_size],
                                         values[..., :head_size], mask, scale=scale, cap=cap, sinks=sinks)
    return merge_heads(heads), keys, values


@cached_attention.register_fake
def _(q, k, v, past_keys, past_values, keep, start, window=None, scale=None, cap=None, sinks=None):
    return torch.empty_like(q), torch.empty_like(past_keys), torch.empty_like(past_values)


def cached_attention_onnx(n_heads: int, kv_heads: int, head_size: int, padded: int):
    """cached_attention as ONNX: one GroupQueryAttention over the first start+n positions, with the
    keep-vector (and the sliding window, where there is one) as its additive bias and zeros for a
    query without a real key; heads of head_size padded with zeros to `padded` (the cache's head
    size) around it; a layer's sinks as GroupQueryAttention's head_sink."""
    register_group_query_attention_schema()
    microsoft = onnxscript.values.Opset(MICROSOFT, 1)
    extra = padded - head_size

    def pad_heads(x, heads):  # [B, n, heads·head_size] -> [B, n, heads·padded], zeros past head_size
        split = op.Reshape(x, op.Constant(value_ints=[0, 0, heads, head_size]))
        widened = op.Pad(split, op.Constant(value_ints=[0, 0, 0, 0, 0, 0, 0, extra]))
        return op.Reshape(widened, op.Constant(value_ints=[0, 0, heads * padded]))

    def unpad_heads(x):  # [B, n, H·padded] -> [B, n, H·head_size]
        split = op.Reshape(x, op.Constant(value_ints=[0, 0, n_heads, padded]))
        kept = op.Slice(split, op.Constant(value_ints=[0]), op.Constant(value_ints=[head_size]),
                        op.Constant(value_ints=[3]))
        return op.Reshape(kept, op.Constant(value_ints=[0, 0, n_heads * head_size]))

    def translation(q, k, v, past_keys, past_values, keep, start, window=None, scale=None, cap=None, sinks=None):
        n = op.Shape(q, start=1, end=2)  # [1]
        total = op.Add(op.Reshape(start, op.Constant(value_ints=[1])), n)  # [1]: the length after the step
        batch = op.Shape(q, start=0, end=1)
        # GroupQueryAttention's lengths: each row's last position (the rows share the slots) and the total
        seqlens = op.Cast(op.Expand(op.Sub(total, op.Constant(value_ints=[1])), batch), to=INT32)
        total_length = op.Cast(op.Squeeze(total, op.Constant(value_ints=[0])), to=INT32)
        seen = op.Slice(keep, op.Constant(value_ints=[0]), total, op.Constant(value_ints=[1]))  # [B, T]
        zero = op.CastLike(op.Constant(value_float=0.0), q)
        lowest = op.CastLike(op.Constant(value_float=float(torch.finfo(torch.float32).min)), q)
        visible = op.Unsqueeze(seen, op.Constant(value_ints=[1, 2]))  # [B, 1, 1, T]
        if window is not None:  # key j is seen from query position p iff p - window < j
            slots = op.Range(op.Constant(value_int=0), op.Squeeze(total, op.Constant(value_ints=[0])),
                             op.Constant(value_int=1))  # [T]
            queries = op.Add(start, op.Range(op.Constant(value_int=0), op.Squeeze(n, op.Constant(value_ints=[0])),
                                             op.Constant(value_int=1)))  # [n]
            first = op.Sub(op.Unsqueeze(queries, op.Constant(value_ints=[1])), op.Constant(value_int=window))
            visible = op.And(visible, op.Greater(slots, first))  # [B, 1, n, T]
        bias = op.Where(visible, zero, lowest)
        bias = op.Expand(bias, op.Concat(batch, op.Constant(value_ints=[1]), n, total, axis=0))  # [B, 1, n, T]
        if extra:  # zeros past head_size in q and k add nothing to a score; the scale is head_size's
            q, k, v = pad_heads(q, n_heads), pad_heads(k, kv_heads), pad_heads(v, kv_heads)
        # the softcap is GroupQueryAttention's own (applied before its attention bias: measured in
        # tests/test_in_place_step.py against the golden, which caps before the mask)
        heads, present_keys, present_values = microsoft.GroupQueryAttention(
            q, k, v, past_keys, past_values, seqlens, total_length, None, None, None, bias, sinks,
            num_heads=n_heads, kv_num_heads=kv_heads, scale=head_size ** -0.5 if scale is None else scale,
            softcap=0.0 if cap is None else cap)
        if extra:
            heads = unpad_heads(heads)
        # a query whose positions up to its own (within its window) hold no real token has no key: zeros (SPEC §6)
        real_so_far = op.CumSum(op.Cast(seen, to=INT64), op.Constant(value_int=1))  # [B, T]
        at_queries = op.Slice(real_so_far, op.Reshape(start, op.Constant(value_ints=[1])), total,
                              op.Constant(value_ints=[1]))  # [B, n]
        if window is not None:  # less the real tokens up to p - window, before the window
            zeros = op.Expand(op.Constant(value_ints=[0]), op.Concat(batch, op.Constant(value_ints=[window]), axis=0))
            shifted = op.Concat(zeros, real_so_far, axis=1)  # [B, window + T]: at p, the count up to p - window
            at_queries = op.Sub(at_queries, op.Slice(shifted, op.Reshape(start, op.Constant(value_ints=[1])), total,
                                                     op.Constant(value_ints=[1])))
        has_key = op.Unsqueeze(op.Greater(at_queries, op.Constant(value_int=0)), op.Constant(value_ints=[2]))
        return op.Where(has_key, heads, zero), present_keys, present_values

    return translation


class InPlaceDecoderStepGraph(nn.Module):
    """The decode step of impl_torch._decode_step_body with the cache write and the attention as
    cached_attention: same inputs and outputs as decoder_step (export/graphs.py). Only the keep
    vector is written into a copy (it is [B, C] booleans)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        model, cfg = self.model, self.model.cfg
        tgt_ids, tgt_keep, start, past_keep, *rest = tensors
        past, rest = rest[:2 * cfg.n_decoder_layers], rest[2 * cfg.n_decoder_layers:]
        src_keep, cross = (rest[0], rest[1:]) if cfg.has_encoder else (None, None)
        batch, n_new = tgt_ids.shape
        positions = start + torch.arange(n_new, device=start.device)
        keep = past_keep.clone().scatter_(1, positions[None, :].expand(batch, n_new), tgt_keep)
        cross_mask = None if src_keep is None else _key_mask(src_keep)
        y = model.embed(tgt_ids, "tgt", offset=start)
        rope_positions, _ = attention_positions(cfg, n_new, n_new, start, start.device)
        present = []
        for i, layer in enumerate(model.decoder.layers):
            attention, layer_cfg = layer.self_attn, layer.cfg  # the layer's own window and rotary (SPEC §6)

            def self_attention(h: torch.Tensor) -> torch.Tensor:
                # the q, k and v of MultiHeadAttention.attend and key_value_heads, in GQA's [B, n, heads·d_k]
                k, v = attention.key_value_heads(h, rope_positions)
                q = attention.head_norm("q", split_heads(attention.q(h), cfg.n_heads))
                q = q if rope_positions is None else rotary(layer_cfg, q, rope_positions)
                heads, keys, values = cached_attention(merge_heads(q), merge_heads(k), merge_heads(v),
                                                       past[2 * i], past[2 * i + 1], keep, start,
                                                       layer_cfg.sliding_window, layer_cfg.score_scale,
                                                       layer_cfg.attention_softcap, attention.sinks)
                present.extend((keys, values))
                return attention.o(heads)

            y = block(layer_cfg, layer, "self_attn", y, self_attention)
            if cross is not None:
                y = block(cfg, layer, "cross_attn", y,
                          lambda h: layer.cross_attn.attend(h, cross[2 * i], cross[2 * i + 1], cross_mask))
            y = layer.ffn_block(y)
        return (model.output_logits(model.decoder.final_norm(y)), *present, keep)
