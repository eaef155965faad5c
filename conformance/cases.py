"""The case catalogue: named, seeded, deterministic inputs for every sublayer and mask case.

A case is (sublayer, mask_case). Its inputs depend only on the config and the case's name
(the seed is a hash of the name), so every backend, every run and every machine sees the same
numbers. Activations are float32-representable; the golden reads them upcast to float64.

Sublayers and the inputs each receives (the adapter protocol's contract, see adapter.py):

    embedding      ids [B,T] int64, side 'src'|'tgt', offset (not with RoPE) -> [B,T,d]
    positional     length, side, offset                               -> [T,d]
    attention      q [B,H,Q,dk], k, v [B,H_kv,K,dk], mask             -> [B,H,Q,dk]
    mha            module, x [B,Q,d], context [B,K,d], mask, offset   -> [B,Q,d]   (self-attention; RoPE's
                   keys at positions offset.., the queries the last Q of them; offset with RoPE only)
    mha_cross      module, x [B,Q,d], context [B,K,d], mask           -> [B,Q,d]   (cross-attention)
    ffn            module, x [B,T,d]                                  -> [B,T,d]
    linear_attn    module (a hybrid's gated DeltaNet), x [B,T,d], tgt_keep [B,T] -> [B,T,d]   (from the
                   zero state, pads moving nothing: SPEC §5.15)
    router         module (a mixture of experts), x [B,T,d]           -> {probabilities [B,T,E], chosen and
                   weights [B,T,k]}
    experts        module, x [B,T,d], chosen [B,T,k], weights [B,T,k] -> [B,T,d]   (the block on the given
                   routing, the golden's: forced through the runner's routing log)
    norm           module, x [B,T,d]                                  -> [B,T,d]
    ffn_block      layer, x [B,T,d]        (residual/norm around the FFN)  -> [B,T,d]
    encoder_layer  index, x [B,S,d], mask                             -> [B,S,d]
    decoder_layer  index, y [B,T,d], memory [B,S,d]|None, self_mask, cross_mask -> [B,T,d]
                   (a sliding layer's causal cases: tgt_keep [B,T] in place of self_mask, and mha's in
                   place of mask: the layer builds its own mask from its config, decoder_self_mask)
    encoder        src_ids [B,S]                                      -> memory [B,S,d]
    decoder        tgt_ids [B,T], memory [B,S,d]|None, src_keep [B,S]|None -> [B,T,d]
    logits         h [B,T,d]                                          -> [B,T,V]
    log_probs      h [B,T,d]                                          -> [B,T,V]
    forward        src_ids [B,S]|None, tgt_ids [B,T]                  -> [B,T,V]
    decode         src_ids|None, tgt_ids [B,T], prefix (, resume)     -> [B,T-prefix,V]
                   (prefill tgt_ids[:, :prefix] into a KV cache, then one token per step; with resume,
                   the next `resume` tokens first as one chunk after the prefix, the hybrids' chunk cases)
    generate       src_ids|None, prompt_ids|None, bos_id, eos_id, max_new_tokens -> tokens [B,N]
    loss           src_ids [B,S]|None, tgt_ids [B,T], targets [B,T]   -> the loss, a scalar (SPEC §5.9)
                   (+ dropout_masks {site: keep [B,T,d]} in the 'dropout' case: training mode, SPEC §5.10)
    train_step,    training (spec.training.TrainingConfig), src_ids [N,B,S]|None, tgt_ids [N,B,T],
    train_steps    targets [N,B,T] (+ dropout_masks, one dict per step): N training steps from the
                   case's parameters, step i on batch i
                   -> Runner.train: one record per step (SPEC §14, conformance/training_cells.py)

Gradient cases (SPEC.md §13), Runner.gradients rather than Runner.run: `grad-<sublayer>` takes
that sublayer's inputs plus d_out, a seeded random cotangent of its output (the loss's is 1),
and returns a dict: the cotangent of each differentiated input (GRADIENT_INPUTS, by input name)
and the gradient of every parameter under the case's owner (gradient_owner, named relative to
it; the whole model's canonical names when the owner is ''), zeros for those it does not use.

Masks are boolean keep-masks in any shape the spec accepts ([K], [Q,K], [B,Q,K], [B,H,Q,K]
with size-1 axes broadcasting) or None; a backend must normalize them (spec.inputs.mask_shape_4d).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import impl_numpy as golden
from impl_numpy import backward as golden_backward
from conformance.text import LONG_TEXT, NEW_TOKENS, Prompts
from conformance.tolerance import rotary_angle, tolerance
from spec import ModelConfig, params_under
from spec.dropout import draw_dropout_masks
from spec.masks import causal_mask, combine_masks, decoder_self_mask, key_mask, normalize_mask, real_tokens
from spec.training import TrainingConfig

BATCH = 3
SRC_LEN = 7
TGT_LEN = 6
PAST_LEN = 4  # cached positions before the query in the 'incremental' mask case
FAR_POSITION = 1000  # RoPE's 'far' case: where its keys start (mha), the cache's length at the steps (decode)
LONG_PROMPT = 520  # RoPE's 'long' case: MaxText added a ~500-token prompt after short ones let a partial-RoPE bug by
BOS_ID = 1
EOS_ID = 2
MAX_NEW_TOKENS = 5
GENERATION_CANDIDATES = 8  # source or prompt rows drawn for each row of a generate case
TRAINING_STEPS = 10  # the train_steps cases' N
# The training cases' optimizer: AdamW, so that the decay's mask is exercised, with a short
# warm-up whose rate moves the parameters well beyond their rounding from the first step
TRAINING = TrainingConfig(optimizer="adamw", weight_decay=0.1, warmup_steps=4, learning_rate_scale=0.5)
CLIPPED_TO = 0.8  # train_steps clips to this fraction of the first step's gradient norm: clipping acts

MASK_CASES: dict[str, str] = {
    "none": "no mask, no padding",
    "pad_right": "mixed lengths, padding at the end",
    "pad_left": "mixed lengths, padding at the start",
    "pad_middle": "padding tokens inside the sequences",
    "causal": "causal self-attention (query t sees keys <= t)",
    "causal_pad": "causal AND key padding",
    "cross_pad": "cross-attention to a padded source (Lq != Lk)",
    "lq_ne_lk": "queries and keys of different lengths, no mask",
    "single_token": "one query, one key",
    "all_pad": "one sequence entirely padding: its rows have no key to attend to",
    "pad_start": "the target starts with pad_id, as Marian's decoder does: the start token stays real",
    "incremental": "queries after a cache: Q new positions against P+Q keys",
    "mask_k": "explicit mask of shape [K]",
    "mask_qk": "explicit mask of shape [Q, K] with a fully masked row",
    "mask_b1qk": "explicit mask of shape [B, 1, Q, K] with a fully masked row",
    "mask_bhqk": "explicit mask of shape [B, H, Q, K] with fully masked rows",
    "dropout": "padding at the end, and the paper's dropout with given keep-masks (SPEC §5.10; configs with dropout > 0)",
    "far": f"RoPE far from position 0: keys from position {FAR_POSITION} on (causal, padded), or decode steps after "
           f"{FAR_POSITION} cached positions (rotary configs)",
    "long": f"a {LONG_PROMPT}-token sequence, padding at the end (rotary configs)",
    "at_switch": "every row as long as the last length before the config switches rule (longrope: ℓ = L, the short "
                 "factors; configs with switch_lengths)",
    "past_switch": "every row one longer (longrope: ℓ = L + 1, the long factors; configs with switch_lengths)",
}
# the parameters cast to float64, asked for only by the cases whose inputs the golden chooses
GoldenParams = Callable[[], Mapping[str, np.ndarray]]
SMALL_ACTIVATIONS = 1e-3
LARGE_ACTIVATIONS = 1e3  # a Llama's residual stream has outliers this size
_SIZES = {"small": SMALL_ACTIVATIONS, "large": LARGE_ACTIVATIONS}
_SIZE_PURPOSE = {"small": "activations of size 1e-3, whose mean square (1e-6) is about ε: where ε's place decides "
                          "the value",
                 "large": "activations of size 1e3, whose squares overflow float16 (65504): the norm's statistics "
                          "must be taken wider"}
# Every norm the config has meets both sizes (SPEC §11): plain small and large are the FFN's norm
# (norm) and the q/k head norms (mha, qk_norm configs), <size>_<role> the norms of the other roles,
# the role's first module taking the small case and its last the large one
NORM_ROLES = {"attn": "the self-attention's", "cross": "the cross-attention's", "final": "each stack's final",
              "embed": "the embeddings'"}
MASK_CASES.update({size: f"{purpose} (norm: the FFN's norm; mha: the q/k head norms of qk_norm configs)"
                   for size, purpose in _SIZE_PURPOSE.items()})
MASK_CASES.update({f"{size}_{role}": f"{_SIZE_PURPOSE[size]} ({whose} norm)"
                   for role, whose in NORM_ROLES.items() for size in _SIZES})
_ROTARY_CASES = ("far", "long")  # only rotary configs run them
SWITCH_CASES = ("at_switch", "past_switch")  # only configs whose computation switches at a length run them
MASK_CASES.update({
    "text": "real text: the --prompt prompts through the checkpoint's own tokenizer, padded at the end (forward, "
            "decode) or at the start (generate)",
    "text_long": f"real text of at least {LONG_TEXT} tokens: a prompt that long, or the prompts repeated until it is"})
TEXT_CASES = ("text", "text_long")  # only a check given prompts runs them (conformance.text)
MASK_CASES.update({
    "unchosen": "the golden's routing but one expert, which no token chooses: it must add nothing (experts)",
    "near_tie": "every token at a tie between its k-th and (k+1)-th expert, by construction: which of the two a "
                "column chooses is rounding's to decide (ffn of a mixture of experts; SPEC §5.14)"})
NEAR_TIE_CASES = ("near_tie",)  # cases meant to sit at a routing tie: the report says so
MASK_CASES.update({
    "chunk_less": "every row real, one token short of a chunk (C − 1 tokens, C the linear layers' chunk_size): the "
                  "chunked prefill's only chunk filled out (hybrids; SPEC §5.15)",
    "chunk_more": "C + 1 tokens, padding at the start: a second chunk of one token, the state handed over (hybrids)",
    "chunks": "2C + 3 tokens, padding inside: three chunks, the last partial, pads in every one (hybrids)"})
CHUNK_CASES = ("chunk_less", "chunk_more", "chunks")  # only configs with linear layers run them
_MOE_CASES = ("unchosen", *NEAR_TIE_CASES)  # only a mixture of experts' sublayers run them
_SCALED = tuple(name for name in MASK_CASES if name.split("_")[0] in _SIZES)


def activation_size(mask_case: str) -> float:
    """The size of a case's activations: 1e-3 for the small cases, 1e3 for the large, else 1."""
    return _SIZES.get(mask_case.split("_")[0], 1.0)


def _norm_role(mask_case: str) -> str:
    """The norm a norm case runs: 'ffn' for none, small and large, else the role its name ends in."""
    return mask_case.split("_", 1)[1] if "_" in mask_case and mask_case.split("_")[0] in _SIZES else "ffn"


def norm_modules(cfg: ModelConfig, role: str) -> list[str]:
    """Every norm module of one role, encoder first: 'ffn', 'attn' and 'cross' name the layers' norms
    of those sublayers, 'final' each stack's final norm, 'embed' each stack's embedding norm."""
    stacks = [("encoder", cfg.n_encoder_layers)] * cfg.has_encoder + [("decoder", cfg.n_decoder_layers)]
    within = {"ffn": "ffn_norm", "attn": "self_attn_norm", "cross": "cross_attn_norm"}
    if role in within:
        # a hybrid's linear layer norms its gated DeltaNet's input where the others norm the attention's
        def name(stack: str, index: int) -> str:
            return "linear_attn_norm" if role == "attn" and _is_linear(cfg, stack, index) else within[role]
        return [f"{stack}.layers.{i}.{name(stack, i)}" for stack, count in stacks for i in range(count)
                if role != "cross" or stack == "decoder" and cfg.has_encoder]
    present = {"final": cfg.final_norm, "embed": cfg.embed_norm}[role]
    return [f"{stack}.{'norm' if role == 'final' else 'embed_norm'}" for stack, _ in stacks if present]

_ATTENTION_CASES = ("none", "pad_right", "pad_left", "pad_middle", "causal", "causal_pad", "lq_ne_lk",
                    "single_token", "all_pad", "incremental", "mask_k", "mask_qk", "mask_b1qk", "mask_bhqk")
_SELF_ATTENTION_CASES = (*_ATTENTION_CASES, "far", *_SIZES)  # the sizes: qk_norm configs' head norms
_CROSS_CASES = ("cross_pad", "lq_ne_lk", "single_token", "all_pad")
_ENCODER_LAYER_CASES = ("none", "pad_right", "pad_left", "pad_middle", "single_token", "all_pad",
                        "mask_k", "mask_qk", "mask_b1qk", "mask_bhqk")
_DECODER_LAYER_CASES = ("causal", "causal_pad", "cross_pad", "lq_ne_lk", "single_token", "all_pad")
_STACK_CASES = ("none", "pad_right", "pad_left", "pad_middle", "single_token", "all_pad")
_MODEL_CASES = ("none", "pad_right", "pad_left", "pad_middle", "cross_pad", "lq_ne_lk", "single_token", "all_pad",
                "pad_start")
_NEEDS_SOURCE = {"cross_pad", "lq_ne_lk", "pad_start"}  # meaningless without an encoder (model-level cases)


def _is_linear(cfg: ModelConfig, stack: str, index: int) -> bool:
    return stack == "decoder" and cfg.layer_kind(index) == "linear"


@dataclass(frozen=True)
class Sublayer:
    name: str
    doc: str
    mask_cases: tuple[str, ...]
    depth: Callable[[ModelConfig], int]  # sublayers chained, for the tolerance
    needs_encoder: bool = False


def _layers_depth(cfg: ModelConfig) -> int:
    decoder_blocks = 3 if cfg.has_encoder else 2
    return 2 * cfg.n_encoder_layers + decoder_blocks * cfg.n_decoder_layers + 2


SUBLAYERS: dict[str, Sublayer] = {s.name: s for s in [
    Sublayer("embedding", "token embedding (x sqrt(d)) plus positional encoding", ("none",), lambda c: 1),
    Sublayer("positional", "positional encoding table rows (none for RoPE, whose positions rotate q and k)",
             ("none",), lambda c: 1),
    Sublayer("attention", "scaled dot-product attention with a mask", _ATTENTION_CASES, lambda c: 1),
    Sublayer("mha", "multi-head self-attention (the encoder's layers in turn, or the decoder's)",
             _SELF_ATTENTION_CASES, lambda c: 1),
    Sublayer("mha_cross", "multi-head cross-attention (the decoder's layers in turn)", _CROSS_CASES, lambda c: 1, True),
    Sublayer("ffn", "position-wise feed-forward network (near_tie: a mixture of experts' every token at a routing "
             "tie)", ("none", "near_tie"), lambda c: 1),
    Sublayer("linear_attn", "a hybrid's gated DeltaNet (its linear layers in turn) over the real tokens, from the "
             "zero state: the chunked prefill against the golden's recurrence", ("none", "pad_right", "pad_left",
                                                                                "pad_middle", "all_pad", *CHUNK_CASES),
             lambda c: 1),
    Sublayer("router", "a mixture of experts' router: every expert's probability, softmax(x R), the k it chooses "
             "and their weights", ("none",),
             lambda c: 1),
    Sublayer("experts", "a mixture of experts' chosen experts, weighted, on the golden's routing (unchosen: "
             "one expert chosen by no token)", ("none", "unchosen"), lambda c: 1),
    Sublayer("norm", "the config's norm (layernorm, std or rmsnorm), each of its norms at both sizes",
             ("none", *_SCALED), lambda c: 1),
    Sublayer("ffn_block", "residual + norm block around the FFN (post or pre)", ("none",), lambda c: 2),
    Sublayer("encoder_layer", "an encoder layer (each mask case the next layer)", _ENCODER_LAYER_CASES, lambda c: 4,
             True),
    Sublayer("decoder_layer", "a decoder layer (each mask case the next layer)", _DECODER_LAYER_CASES, lambda c: 6),
    Sublayer("encoder", "embedding, every encoder layer, final norm", _STACK_CASES,
             lambda c: 2 * c.n_encoder_layers + 2, True),
    Sublayer("decoder", "embedding, every decoder layer, final norm", _MODEL_CASES,
             lambda c: (3 if c.has_encoder else 2) * c.n_decoder_layers + 2),
    Sublayer("logits", "output projection (tied or not)", ("none",), lambda c: 1),
    Sublayer("log_probs", "log-softmax of the logits", ("none",), lambda c: 2),
    Sublayer("forward", "the whole model, teacher-forced", (*_MODEL_CASES, "long", *SWITCH_CASES, *CHUNK_CASES,
                                                             *TEXT_CASES), _layers_depth),
    Sublayer("decode", "incremental decoding with a KV cache vs. the full forward",
             ("incremental", "pad_right", "pad_left", "pad_start", "far", *CHUNK_CASES, "text"), _layers_depth),
    Sublayer("generate", "greedy generation with the KV cache (token ids, exact)",
             ("none", "pad_right", "pad_left", "pad_start", "text"), _layers_depth),
    Sublayer("loss", "the label-smoothed token cross-entropy of the teacher-forced logits",
             (*_MODEL_CASES, "dropout"), lambda c: _layers_depth(c) + 1),
]}

# The float inputs each differentiated sublayer's gradient case returns a cotangent for (those it has:
# an attention's sinks are an input where the config has them, SPEC §5.16).
GRADIENT_INPUTS: dict[str, tuple[str, ...]] = {
    "embedding": (), "attention": ("q", "k", "v", "sinks"), "mha": ("x", "context"), "mha_cross": ("x", "context"),
    "ffn": ("x",), "linear_attn": ("x",), "norm": ("x",), "ffn_block": ("x",), "encoder_layer": ("x",),
    "decoder_layer": ("y", "memory"),
    "encoder": (), "decoder": ("memory",), "logits": ("h",), "log_probs": ("h",), "forward": (), "loss": (),
}
GRADIENT_PREFIX = "grad-"


def _gradient_sublayer(forward: Sublayer) -> Sublayer:
    """grad-<sublayer>: its backward re-traverses the forward's chain, so twice its depth."""
    return Sublayer(GRADIENT_PREFIX + forward.name, f"gradients of: {forward.doc}", forward.mask_cases,
                    lambda c, depth=forward.depth: 2 * depth(c), forward.needs_encoder)


SUBLAYERS.update({GRADIENT_PREFIX + name: _gradient_sublayer(SUBLAYERS[name]) for name in GRADIENT_INPUTS})

# The training cases come last: a mistake the forward or a gradient shows is localized there first.
# Depth: the loss's (the gradients' is twice that, as every grad- case's; conformance/training_cells.py)
SUBLAYERS.update({s.name: s for s in [
    Sublayer("train_step", "one AdamW step: the loss, every gradient, both moments, the parameters",
             ("none", "pad_right", "all_pad", "pad_start", "dropout"), lambda c: _layers_depth(c) + 1),
    Sublayer("train_steps", f"{TRAINING_STEPS} clipped AdamW steps on {TRAINING_STEPS} batches, each step checked "
             "from the backend's own state", ("pad_right",), lambda c: _layers_depth(c) + 1),
]})
TRAINING_SUBLAYERS = ("train_step", "train_steps")


def forward_of(sublayer: str) -> str:
    """The forward sublayer a gradient case differentiates ('grad-mha' -> 'mha'); itself otherwise."""
    return sublayer[len(GRADIENT_PREFIX):] if sublayer.startswith(GRADIENT_PREFIX) else sublayer


def is_gradient(sublayer: str) -> bool:
    return sublayer.startswith(GRADIENT_PREFIX)


def is_training(sublayer: str) -> bool:
    return sublayer in TRAINING_SUBLAYERS


def is_backward(sublayer: str) -> bool:
    """The cases that run only when the backward half is asked for: gradients and training."""
    return is_gradient(sublayer) or is_training(sublayer)


def gradient_owner(sublayer: str, inputs: Mapping[str, Any]) -> str | None:
    """The module whose parameters a gradient case returns: the one the forward case runs, ''
    (every parameter of the model) for the cases that run the model's own entry points, None
    for attention, which has none."""
    forward = forward_of(sublayer)
    if forward in ("mha", "mha_cross", "ffn", "linear_attn", "norm"):
        return inputs["module"]
    if forward == "ffn_block":
        return inputs["layer"]
    if forward in ("encoder_layer", "decoder_layer"):
        return f"{forward.split('_')[0]}.layers.{inputs['index']}"
    return None if forward == "attention" else ""


def output_shape(cfg: ModelConfig, sublayer: str, inputs: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape of a forward case's output, the shape of its gradient case's cotangent."""
    if sublayer == "embedding":
        return (*np.shape(inputs["ids"]), cfg.d_model)
    if sublayer == "attention":
        return np.shape(inputs["q"])
    if sublayer in ("mha", "mha_cross", "ffn", "linear_attn", "experts", "norm", "ffn_block", "encoder_layer"):
        return np.shape(inputs["x"])
    if sublayer == "router":
        return (*np.shape(inputs["x"])[:-1], cfg.moe.n_experts)
    if sublayer == "decoder_layer":
        return np.shape(inputs["y"])
    if sublayer == "encoder":
        return (*np.shape(inputs["src_ids"]), cfg.d_model)
    if sublayer == "decoder":
        return (*np.shape(inputs["tgt_ids"]), cfg.d_model)
    if sublayer in ("logits", "log_probs"):
        return (*np.shape(inputs["h"])[:2], cfg.tgt_vocab_size)
    if sublayer == "forward":
        return (*np.shape(inputs["tgt_ids"]), cfg.tgt_vocab_size)
    if sublayer == "loss":
        return ()
    raise KeyError(f"no gradient case for {sublayer!r}")


@dataclass(frozen=True)
class Case:
    sublayer: str
    mask_case: str
    inputs: dict[str, Any] = field(compare=False, repr=False)
    reduction_length: int = 1  # the longest inner product or sum in the case
    angle: float = 0.0  # the rotary angle whose rounding its rotations carry (tolerance.rotary_angle)
    depth: int | None = None  # the sublayers it chains, where its length adds to its sublayer's (recurrent_depth)
    amplification: float = 1.0  # how much a hybrid's output norms magnify rounding on its inputs (amplification)

    @property
    def name(self) -> str:
        return f"{self.sublayer}-{self.mask_case}"

    @property
    def floor(self) -> float:
        """The smallest output size the tolerance is relative to (SPEC §8): a case's activations'
        size where they are small, since rounding is relative to the terms an output sums, else 1."""
        return min(1.0, activation_size(self.mask_case))

    def tolerance(self, cfg: ModelConfig, dtype: str, depth: int | None = None) -> float:
        """SPEC §8's relative tolerance of this case at dtype (at `depth`, else its sublayer's)."""
        if depth is None:
            depth = SUBLAYERS[self.sublayer].depth(cfg) if self.depth is None else self.depth
        return max(1.0, self.amplification) * tolerance(dtype, self.reduction_length, depth, self.angle)


class DecoderPasses:
    """The golden decoder's output over a whole-model case's tokens, kept from the pass that found its
    amplification (amplification) for its reference to take (numpy_backend.golden_output): the same
    float64 pass over the same tokens and weights, which a hybrid's case would otherwise make twice
    (at Qwen3.5-0.8B's size, about half a minute each). Each is taken once, by the case's own inputs."""

    def __init__(self):
        self._kept: dict[int, tuple[Mapping[str, Any], np.ndarray]] = {}

    def keep(self, inputs: Mapping[str, Any], hidden: np.ndarray) -> None:
        self._kept[id(inputs)] = (inputs, hidden)  # the inputs held too, so their id names them alone

    def take(self, inputs: Mapping[str, Any]) -> np.ndarray | None:
        kept, hidden = self._kept.pop(id(inputs), (None, None))
        return hidden if kept is inputs else None


def case_seed(sublayer: str, mask_case: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{sublayer}-{mask_case}".encode()).digest()[:8], "little")


# ---- input makers -----------------------------------------------------------------------------

def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _keep(batch: int, length: int, padding: str) -> np.ndarray:
    """Which positions hold real tokens [B, L] under a padding pattern. Rows get lengths L, L-2,
    L/2 (so the batch mixes lengths); 'all_pad' empties row 1 entirely."""
    keep = np.ones((batch, length), dtype=bool)
    real_lengths = [length, max(1, length - 2), max(1, length // 2)]
    for row in range(batch):
        real = real_lengths[row % 3]
        if padding == "pad_right":
            keep[row, real:] = False
        elif padding == "pad_left":
            keep[row, :length - real] = False
        elif padding == "pad_middle" and length >= 3 and row % 3 < 2:
            keep[row, 1:length - 1:2] = False
        elif padding == "all_pad" and row == 1:
            keep[row, :] = False
    return keep


def _token_ids(rng: np.random.Generator, batch: int, length: int, vocab: int, pad_id: int,
               padding: str) -> np.ndarray:
    """Random real tokens (never pad_id) with pad_id where the padding pattern says."""
    if vocab < 2:
        return np.full((batch, length), pad_id, dtype=np.int64)
    ids = rng.integers(0, vocab - 1, size=(batch, length))
    ids = np.where(ids >= pad_id, ids + 1, ids)  # every id but pad_id
    return np.where(_keep(batch, length, padding), ids, pad_id).astype(np.int64)


def _explicit_mask(rng: np.random.Generator, mask_case: str, batch: int, heads: int, q_len: int, k_len: int) -> np.ndarray | None:
    """Masks for the attention-level mask cases (None = no mask)."""
    if mask_case in ("none", "lq_ne_lk", "single_token", *_SIZES):
        return None
    if mask_case in ("pad_right", "pad_left", "pad_middle", "all_pad", "cross_pad"):
        padding = "pad_right" if mask_case == "cross_pad" else mask_case
        return key_mask(_keep(batch, k_len, padding))
    if mask_case == "causal":
        return causal_mask(q_len, k_len)
    if mask_case in ("causal_pad", "far"):
        return combine_masks(causal_mask(q_len, k_len), key_mask(_keep(batch, k_len, "pad_left")))
    if mask_case == "incremental":
        return combine_masks(causal_mask(q_len, k_len), key_mask(_keep(batch, k_len, "pad_right")))
    if mask_case == "mask_k":
        keep = rng.random(k_len) < 0.7
        keep[0] = True
        return keep
    shapes = {"mask_qk": (q_len, k_len), "mask_b1qk": (batch, 1, q_len, k_len), "mask_bhqk": (batch, heads, q_len, k_len)}
    mask = rng.random(shapes[mask_case]) < 0.7
    mask[..., 0, :] = False  # a fully masked row in every (batch, head)
    return mask


# the self-attention cases whose mask a sliding decoder layer builds itself (SPEC §11): the real
# tokens of each, from which the layer's own causal, windowed mask is made
_OWN_MASK_PADDING = {"causal": "none", "causal_pad": "pad_left", "far": "pad_left", "all_pad": "pad_left"}


def _own_mask_keep(cfg: ModelConfig, module: str, mask_case: str, length: int) -> np.ndarray | None:
    """The real tokens [B, T] of a decoder self-attention case on a layer whose config slides (the
    case's mask the one that layer builds from its own window, so a window mistake fails the layer's
    own cell); None where the case's explicit mask stands (a layer that does not slide, another case)."""
    if not module.startswith("decoder.layers.") or mask_case not in _OWN_MASK_PADDING:
        return None
    if cfg.layer(int(module.split(".")[2])).sliding_window is None:
        return None
    keep = _keep(BATCH, length, _OWN_MASK_PADDING[mask_case])
    return keep & _keep(BATCH, length, "all_pad") if mask_case == "all_pad" else keep


def _lengths(mask_case: str) -> tuple[int, int]:
    """(query length, key length) of an attention-level case (no positions involved)."""
    q_len, k_len = TGT_LEN, TGT_LEN
    if mask_case in ("lq_ne_lk", "cross_pad"):
        k_len = SRC_LEN
    elif mask_case == "single_token":
        q_len = k_len = 1
    elif mask_case == "incremental":
        q_len, k_len = 1, PAST_LEN + 1
    return q_len, k_len


def _offset(mask_case: str) -> int:
    """Where an attention case's positions start (RoPE's keys)."""
    return FAR_POSITION if mask_case == "far" else 0


def layer_of(cfg: ModelConfig, sublayer: str, mask_case: str) -> int:
    """The layer a layer-level case runs: its mask cases take the stack's layers in turn, so every
    layer's attention is checked on its own inputs (a deep layer's parameters reach the whole
    model's output only faintly). A stack deeper than the cases are many has them spread from
    its first layer to its last (a real checkpoint's 24 or 30 layers)."""
    layers = _layers_of(cfg, sublayer)
    stack = len(layers)
    cases = applicable_cases(cfg, sublayer)
    index = cases.index(mask_case)
    if stack <= len(cases) or len(cases) == 1:
        return layers[index % stack]
    return layers[round(index * (stack - 1) / (len(cases) - 1))]


def _layers_of(cfg: ModelConfig, sublayer: str) -> list[int]:
    """The layers a layer-level sublayer's cases take in turn: a hybrid's attention cases its
    attention layers, its linear_attn cases its linear layers (SPEC §5.15)."""
    if sublayer == "encoder_layer" or (sublayer == "mha" and cfg.has_encoder):
        return list(range(cfg.n_encoder_layers))
    linear = [i for i in range(cfg.n_decoder_layers) if cfg.layer_kind(i) == "linear"]
    if sublayer == "linear_attn":
        return linear
    if sublayer in ("mha", "decoder_layer"):
        return [i for i in range(cfg.n_decoder_layers) if i not in linear]
    return list(range(cfg.n_decoder_layers))


_MOE_SUBLAYERS = ("router", "experts")
ROUTER_OUTPUTS = ("probabilities", "chosen", "weights")  # a router case's output: [B, T, E], [B, T, k], [B, T, k]


def _experts_routing(cfg: ModelConfig, p: Mapping[str, np.ndarray], x: np.ndarray,
                    leave_one_out: bool) -> tuple[np.ndarray, np.ndarray]:
    """An experts case's routing, [B, T, k] each: the golden router's choices on x and their weights
    (float32-representable, as every input), or, leaving one out, the k most probable of the other
    experts, so the least probable expert overall is chosen by no token (it must add nothing)."""
    moe = cfg.moe
    probabilities = golden.router_probabilities(x.reshape(-1, x.shape[-1]).astype(np.float64), p["router.weight"],
                                                p.get("router.bias"))
    candidates = probabilities.copy()
    if leave_one_out:
        candidates[:, np.argmin(probabilities.sum(axis=0))] = -1.0
    chosen = golden.top_experts(candidates, moe.experts_per_token)
    weights = golden.routing_weights(probabilities, chosen, moe.renormalize).astype(np.float32)
    return chosen.reshape(*x.shape[:-1], -1), weights.reshape(*x.shape[:-1], -1)


def _at_routing_ties(cfg: ModelConfig, router: np.ndarray, x: np.ndarray, rounds: int = 4,
                     bias: np.ndarray | None = None) -> np.ndarray:
    """x [B, T, d] moved, token by token, onto the plane where its k-th and (k+1)-th router logits
    are equal: x − ((x·r + c) / r·r) r, r = R[:, a] − R[:, b] the difference of the two experts' router
    columns, c = b_a − b_b their biases' (gpt-oss's router; 0 without). The move changes the other
    logits a little, so the pair is taken again for a few rounds; rounded to float32, each token's
    margin is left at float32's rounding of its logits."""
    k = cfg.moe.experts_per_token
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    bias = np.zeros(router.shape[-1]) if bias is None else np.asarray(bias, np.float64)
    for _ in range(rounds):
        order = np.argsort(-golden.linear(rows, router, bias), axis=-1, kind="stable")
        r = (router[:, order[:, k - 1]] - router[:, order[:, k]]).T  # [N, d]
        c = bias[order[:, k - 1]] - bias[order[:, k]]  # [N]
        rows = rows - ((np.sum(rows * r, axis=-1) + c) / np.sum(r * r, axis=-1))[:, None] * r
    return rows.reshape(x.shape).astype(np.float32)


def _model_ids(cfg: ModelConfig, rng: np.random.Generator, mask_case: str) -> tuple[np.ndarray | None, np.ndarray]:
    """(src_ids, tgt_ids) for a model-level case; lengths capped at max_len."""
    src_len, tgt_len = min(SRC_LEN, cfg.max_len), min(TGT_LEN, cfg.max_len)
    if mask_case in ("far", "long"):
        tgt_len = min(FAR_POSITION + 3 if mask_case == "far" else LONG_PROMPT, cfg.max_len)
    elif mask_case in SWITCH_CASES:  # ℓ = 1 + the largest position: every row real to its end
        tgt_len = cfg.switch_lengths[0] + (mask_case == "past_switch")
    elif mask_case in CHUNK_CASES:
        tgt_len = min(chunk_case_length(cfg, mask_case), cfg.max_len)
    if mask_case == "single_token":
        src_len = tgt_len = 1
    elif mask_case == "lq_ne_lk":
        src_len = min(SRC_LEN + 3, cfg.max_len)
    target_padding = {"cross_pad": "none", "lq_ne_lk": "none", "pad_start": "pad_right",
                      "dropout": "pad_right", "far": "pad_right", "long": "pad_right", "at_switch": "none",
                      "past_switch": "none", **CHUNK_PADDING}.get(mask_case, mask_case)
    source_padding = "pad_right" if mask_case == "cross_pad" else target_padding
    tgt = _token_ids(rng, BATCH, tgt_len, cfg.tgt_vocab_size, cfg.pad_id, target_padding)
    if mask_case == "pad_start":
        tgt[:, 0] = cfg.pad_id  # the start token is the pad token (Marian): real all the same
    if not cfg.has_encoder:
        return None, tgt
    return _token_ids(rng, BATCH, src_len, cfg.src_vocab_size, cfg.pad_id, source_padding), tgt


CHUNK_PADDING = {"chunk_less": "none", "chunk_more": "pad_left", "chunks": "pad_middle"}


def chunk_case_length(cfg: ModelConfig, mask_case: str) -> int:
    """A chunk case's token count: C − 1, C + 1 or 2C + 3 (C the linear layers' chunk_size), at least 2."""
    size = cfg.linear_attention.chunk_size
    return max(2, {"chunk_less": size - 1, "chunk_more": size + 1, "chunks": 2 * size + 3}[mask_case])


def _build(cfg: ModelConfig, golden_params: GoldenParams, sublayer: str, mask_case: str,
           rng: np.random.Generator) -> tuple[dict[str, Any], int]:
    """(inputs, reduction length) for one case."""
    d, d_ff, heads = cfg.d_model, cfg.d_ff, cfg.n_heads
    stack = "encoder" if cfg.has_encoder else "decoder"
    if sublayer in ("embedding", "positional"):
        side = "src" if cfg.has_encoder else "tgt"
        length, offset = min(TGT_LEN, cfg.max_len), min(3, cfg.max_len - min(TGT_LEN, cfg.max_len))
        # sin(p·ω) inherits the rounding of its angle times p: the position is its "reduction"
        reduction = (offset + length) ** 2
        if sublayer == "positional":
            return {"length": length, "side": side, "offset": offset}, reduction
        vocab = cfg.src_vocab_size if side == "src" else cfg.tgt_vocab_size
        ids = _token_ids(rng, BATCH, length, vocab, cfg.pad_id, "pad_right")
        if cfg.positional == "rope":  # no position enters the embedding: a lookup and a scale
            return {"ids": ids, "side": side}, 1
        return {"ids": ids, "side": side, "offset": offset}, reduction
    if sublayer == "attention":
        q_len, k_len = _lengths(mask_case)
        # the config's H_kv key/value heads: grouped- and multi-query attention meet each framework's own
        # grouping (SDPA's enable_gqa, jax.nn.dot_product_attention) at every mask case
        inputs = {"q": _normal(rng, BATCH, heads, q_len, cfg.d_head),
                  "k": _normal(rng, BATCH, cfg.kv_heads, k_len, cfg.d_head),
                  "v": _normal(rng, BATCH, cfg.kv_heads, k_len, cfg.d_head),
                  "mask": _explicit_mask(rng, mask_case, BATCH, heads, q_len, k_len)}
        if cfg.attention_sinks:  # a logit per head beside the scores' own size, U(-1.5, 1.5) (SPEC §5.16)
            inputs["sinks"] = (1.5 * (2.0 * rng.random(heads) - 1.0)).astype(np.float32)
        return inputs, max(cfg.d_head, k_len)
    if sublayer in ("mha", "mha_cross"):
        q_len, k_len = _lengths(mask_case)
        x = _normal(rng, BATCH, q_len, d) * np.float32(activation_size(mask_case))
        self_attention = sublayer == "mha" and q_len == k_len
        context = x if self_attention else _normal(rng, BATCH, k_len, d)
        module = (f"{stack}.layers.{layer_of(cfg, sublayer, mask_case)}.self_attn" if sublayer == "mha"
                  else f"decoder.layers.{layer_of(cfg, sublayer, mask_case)}.cross_attn")
        offset = _offset(mask_case)
        inputs = {"module": module, "x": x, "context": context}
        keep = _own_mask_keep(cfg, module, mask_case, k_len) if self_attention else None
        if keep is None:
            inputs["mask"] = _explicit_mask(rng, mask_case, BATCH, heads, q_len, k_len)
        else:
            inputs["tgt_keep"] = keep
        if cfg.positional == "rope":  # positions enter an attention only through its rotations
            inputs["offset"] = offset
        return inputs, max(d, k_len)
    if sublayer == "norm":
        modules = norm_modules(cfg, _norm_role(mask_case))
        module = modules[-1] if mask_case.startswith("large") else modules[0]
        return {"module": module, "x": _normal(rng, BATCH, TGT_LEN, d) * np.float32(activation_size(mask_case))}, d
    if sublayer in ("ffn", "ffn_block"):
        key, module = ("module", f"{stack}.layers.0.ffn") if sublayer == "ffn" else ("layer", f"{stack}.layers.0")
        x = _normal(rng, BATCH, TGT_LEN, d)
        if mask_case == "near_tie":
            block = params_under(golden_params(), module)
            x = _at_routing_ties(cfg, block["router.weight"], x, bias=block.get("router.bias"))
        return {key: module, "x": x}, max(d, d_ff)
    if sublayer == "linear_attn":
        length = min(chunk_case_length(cfg, mask_case) if mask_case in CHUNK_CASES else TGT_LEN, cfg.max_len)
        keep = _keep(BATCH, length, CHUNK_PADDING.get(mask_case, mask_case))
        mixer = cfg.linear_attention
        return {"module": f"decoder.layers.{layer_of(cfg, sublayer, mask_case)}.linear_attn",
                "x": _normal(rng, BATCH, length, d), "tgt_keep": keep}, max(d, mixer.key_head_dim, mixer.value_head_dim)
    if sublayer in _MOE_SUBLAYERS:
        module = f"decoder.layers.{layer_of(cfg, sublayer, mask_case)}.ffn"
        x = _normal(rng, BATCH, TGT_LEN, d)
        if sublayer == "router":
            return {"module": module, "x": x}, d
        chosen, weights = _experts_routing(cfg, params_under(golden_params(), module), x, mask_case == "unchosen")
        return {"module": module, "x": x, "chosen": chosen, "weights": weights}, max(d, d_ff)
    if sublayer == "encoder_layer":
        length = 1 if mask_case == "single_token" else SRC_LEN
        return {"index": layer_of(cfg, sublayer, mask_case), "x": _normal(rng, BATCH, length, d),
                "mask": _explicit_mask(rng, mask_case, BATCH, heads, length, length)}, max(d, d_ff, length)
    if sublayer == "decoder_layer":
        t_len, s_len = (1, 1) if mask_case == "single_token" else (TGT_LEN, SRC_LEN)
        if mask_case == "lq_ne_lk":
            s_len = SRC_LEN + 3
        index = layer_of(cfg, sublayer, mask_case)
        keep = _own_mask_keep(cfg, f"decoder.layers.{index}", mask_case, t_len)
        self_mask = _explicit_mask(rng, "causal_pad" if mask_case in ("causal_pad", "all_pad") else "causal",
                                   BATCH, heads, t_len, t_len)
        if mask_case == "all_pad":
            self_mask = combine_masks(self_mask, key_mask(_keep(BATCH, t_len, "all_pad")))
        memory = _normal(rng, BATCH, s_len, d) if cfg.has_encoder else None
        cross = None
        if cfg.has_encoder and mask_case in ("cross_pad", "all_pad"):
            cross = key_mask(_keep(BATCH, s_len, "pad_right" if mask_case == "cross_pad" else "all_pad"))
        own = {"self_mask": self_mask} if keep is None else {"tgt_keep": keep}  # a sliding layer builds its own
        return {"index": index, "y": _normal(rng, BATCH, t_len, d), "memory": memory, **own,
                "cross_mask": cross}, max(d, d_ff, s_len)
    src_ids, tgt_ids = _model_ids(cfg, rng, mask_case)
    # the keys a query sums over; added positions round like their angle times p (SPEC §8), rotated
    # ones are the case's rotary angle (Case.angle)
    positions = tgt_ids.shape[1] if cfg.positional == "rope" else (SRC_LEN + 3 + MAX_NEW_TOKENS) ** 2
    reduction = max(d, d_ff, SRC_LEN + 3, positions)
    if sublayer == "encoder":
        return {"src_ids": src_ids}, reduction
    if sublayer == "decoder":
        memory = _normal(rng, BATCH, src_ids.shape[1], d) if cfg.has_encoder else None
        src_keep = (src_ids != cfg.pad_id) if cfg.has_encoder else None
        return {"tgt_ids": tgt_ids, "memory": memory, "src_keep": src_keep}, reduction
    if sublayer in ("logits", "log_probs"):
        return {"h": _normal(rng, BATCH, TGT_LEN, d)}, max(d, cfg.tgt_vocab_size if sublayer == "log_probs" else 1)
    if sublayer == "forward":
        return {"src_ids": src_ids, "tgt_ids": tgt_ids}, reduction
    if sublayer == "decode":
        prefix = tgt_ids.shape[1] - 2 if mask_case == "far" else min(2, tgt_ids.shape[1] - 1)  # far: a long prefix
        inputs = {"src_ids": src_ids, "tgt_ids": tgt_ids, "prefix": prefix}
        if mask_case in CHUNK_CASES and tgt_ids.shape[1] - prefix > 2:
            # a chunked prefill resumed after a prefix: the state handed over, never zeros (SPEC §5.15)
            inputs["resume"] = tgt_ids.shape[1] - prefix - 2
        return inputs, reduction
    if sublayer == "generate":
        return _generation_inputs(cfg, golden_params, rng, mask_case), reduction
    if sublayer == "loss":
        inputs = {"src_ids": src_ids, "tgt_ids": tgt_ids, "targets": next_tokens(cfg, tgt_ids)}
        if mask_case == "dropout":
            inputs["dropout_masks"] = _dropout_masks(cfg, rng, src_ids, tgt_ids)
        return inputs, max(reduction, cfg.tgt_vocab_size)
    raise KeyError(f"unknown sublayer {sublayer!r}")


def _dropout_masks(cfg: ModelConfig, rng: np.random.Generator, src_ids: np.ndarray | None,
                   tgt_ids: np.ndarray) -> dict[str, np.ndarray]:
    return draw_dropout_masks(cfg, rng, tgt_ids.shape[0], None if src_ids is None else src_ids.shape[1], tgt_ids.shape[1])


def next_tokens(cfg: ModelConfig, tgt_ids: np.ndarray) -> np.ndarray:
    """Next-token targets [B, T]: tgt_ids shifted left, pad_id at the last position (it has none)."""
    targets = np.roll(tgt_ids, -1, axis=1)
    targets[:, -1] = cfg.pad_id
    return targets


TRAINING_RECORD = ("loss", "gradients", "first_moment", "second_moment", "params")  # Runner.train's, per step


def training_batches(inputs: Mapping[str, Any]) -> list[tuple[np.ndarray | None, np.ndarray, np.ndarray, dict | None]]:
    """A training case's (src_ids, tgt_ids, targets, dropout_masks or None) of each step."""
    src, masks = inputs["src_ids"], inputs.get("dropout_masks")
    return [(None if src is None else src[i], tgt, targets, None if masks is None else masks[i])
            for i, (tgt, targets) in enumerate(zip(inputs["tgt_ids"], inputs["targets"]))]


def record_steps(inputs: Mapping[str, Any], step: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """Runner.train's records: step(src_ids, tgt_ids, targets, dropout_masks) on each batch of a
    training case.
    A step whose loss is not finite (the implementations raise FloatingPointError) ends the run
    with a last record {"stopped": why}, so the steps before it are still checked. A long run
    (rosetta train-parity) may ask to keep fewer arrays: inputs["keep"] names the record's keys
    kept at every inputs["every"]-th step and the last; the loss is kept at every step."""
    keep, every, batches = inputs.get("keep", TRAINING_RECORD), inputs.get("every", 1), training_batches(inputs)
    records = []
    for index, batch in enumerate(batches, 1):
        try:
            record = step(*batch)
            kept = keep if index % every == 0 or index == len(batches) else ("loss",)
            records.append({key: value for key, value in record.items() if key in kept or key == "loss"})
        except FloatingPointError as error:
            records.append({"stopped": f"{type(error).__name__}: {error}"})
            break
    return records


def _training_inputs(cfg: ModelConfig, golden_params: GoldenParams, sublayer: str, mask_case: str,
                     rng: np.random.Generator) -> tuple[dict[str, Any], int]:
    """A training case: N batches with the mask case's padding (N = 1 for train_step), and the
    optimizer. train_steps clips, to CLIPPED_TO of the golden's first gradient norm."""
    steps = TRAINING_STEPS if sublayer == "train_steps" else 1
    batches = [_model_ids(cfg, rng, mask_case) for _ in range(steps)]
    tgt_ids = np.stack([tgt for _, tgt in batches])
    src_ids = None if batches[0][0] is None else np.stack([src for src, _ in batches])
    targets = np.stack([next_tokens(cfg, tgt) for tgt in tgt_ids])
    masks = None if mask_case != "dropout" else [_dropout_masks(cfg, rng, None if src_ids is None else src_ids[i], tgt)
                                                 for i, tgt in enumerate(tgt_ids)]
    training = TRAINING
    if sublayer == "train_steps":
        _, grads = golden_backward.loss_and_gradients(cfg, golden_params(), None if src_ids is None else src_ids[0], tgt_ids[0],
                                                      targets[0])
        norm = float(np.sqrt(sum((g * g).sum() for g in grads.values())))
        training = dataclasses.replace(TRAINING, clip_norm=CLIPPED_TO * norm)
    _, reduction = _build(cfg, golden_params, "loss", mask_case, np.random.default_rng(0))
    # a weight's gradient also sums over every position of the batch
    return {"training": training, "src_ids": src_ids, "tgt_ids": tgt_ids, "targets": targets,
            **({} if masks is None else {"dropout_masks": masks})}, max(reduction, BATCH * (SRC_LEN + 3))


def _gradient_inputs(cfg: ModelConfig, golden_params: GoldenParams, sublayer: str, mask_case: str,
                     rng: np.random.Generator) -> tuple[dict[str, Any], int]:
    """A gradient case: its forward's inputs, then the cotangent d_out drawn from the same stream
    (random and seeded, never all ones: a sum() makes a norm's input gradient zero)."""
    forward = forward_of(sublayer)
    inputs, reduction = _build(cfg, golden_params, forward, mask_case, rng)
    d_out = np.float32(1.0) if forward == "loss" else _normal(rng, *output_shape(cfg, forward, inputs))
    # a weight's gradient also sums over every position of the batch
    return {**inputs, "d_out": d_out}, max(reduction, BATCH * (SRC_LEN + 3))


def _generation_inputs(cfg: ModelConfig, golden_params: GoldenParams, rng: np.random.Generator,
                       mask_case: str) -> dict[str, Any]:
    """A generate case whose greedy output tells a working loop from a broken one (SPEC.md §11):
    GENERATION_CANDIDATES candidates are drawn for each batch row, with the row's padding, and
    the rows and eos_id are chosen together (choose_generation_rows) so that eos_id ends some
    rows early, at different steps, and not others, and the rows' tokens are varied (a loop that
    never advances repeats its first token)."""
    candidates = BATCH * GENERATION_CANDIDATES  # candidate j of row r is row r + BATCH·j: same padding
    src_ids = prompt = None
    if cfg.has_encoder:
        padding = "pad_right" if mask_case == "pad_start" else mask_case
        src_ids = _token_ids(rng, candidates, min(SRC_LEN, cfg.max_len), cfg.src_vocab_size, cfg.pad_id, padding)
    else:
        prompt = _token_ids(rng, candidates, 3, cfg.tgt_vocab_size, cfg.pad_id, "pad_left" if mask_case != "none" else "none")
    new_tokens = max(1, min(MAX_NEW_TOKENS, cfg.max_len - (1 if prompt is None else 3)))
    bos_id = cfg.pad_id if mask_case == "pad_start" else min(BOS_ID, cfg.tgt_vocab_size - 1)
    tokens = golden.greedy_decoding(cfg, golden_params(), src_ids, prompt_ids=prompt, bos_id=bos_id, eos_id=None,
                                    max_new_tokens=new_tokens)
    rows, eos_id = choose_generation_rows(tokens, BATCH, min(EOS_ID, cfg.tgt_vocab_size - 1), cfg.pad_id)
    return {"src_ids": None if src_ids is None else src_ids[rows], "prompt_ids": None if prompt is None else prompt[rows],
            "bos_id": bos_id, "eos_id": eos_id, "max_new_tokens": new_tokens}


def choose_generation_rows(tokens: np.ndarray, batch: int, default_eos: int, pad_id: int) -> tuple[list[int], int]:
    """The batch rows, one per slot (slot r chooses among candidates r, r + batch, ...), and the
    eos_id, from free-running greedy tokens [candidates, N]. Every choice of rows is weighed:
    first by end_of_sequence's score (rows its eos ends at distinct steps, then rows it ends),
    then by the fewest distinct tokens in a row, then by distinct tokens in all rows, then by
    positions where two rows differ; ties go to the lowest candidates."""
    options = [range(slot, tokens.shape[0], batch) for slot in range(batch)]
    # each candidate's figures once, not once per choice of rows (8³ choices a case: 2.9 s of a tiny
    # matrix's 5.9 s were spent recounting them)
    firsts = [first_positions(row) for row in tokens]
    variety = [len(first) for first in firsts]
    differing = (tokens[:, None, :] != tokens[None, :, :]).sum(axis=-1)  # [candidates, candidates]
    best, best_key = None, None
    for rows in itertools.product(*options):
        eos_id, score = end_of_sequence(tokens[list(rows)], default_eos, pad_id, [firsts[r] for r in rows])
        varieties = [variety[r] for r in rows]
        differences = sum(int(differing[rows[i], rows[j]]) for i in range(batch) for j in range(i))
        key = (score, min(varieties), sum(varieties), differences, tuple(-r for r in rows))
        if best_key is None or key > best_key:
            best, best_key = (list(rows), eos_id), key
    assert best is not None
    return best


def first_positions(row: np.ndarray) -> dict[int, int]:
    """Each token of a row [N] and the position it first appears at."""
    return {token: position for position, token in reversed(list(enumerate(row.tolist())))}


def end_of_sequence(tokens: np.ndarray, default: int, pad_id: int,
                    firsts: list[dict[int, int]] | None = None) -> tuple[int, tuple[int, int]]:
    """The eos_id for free-running greedy tokens [B, N], with its score: the token whose first
    appearances end the most rows at distinct steps 1..N-2 (a row's tokens, then padding), then
    the most rows, always leaving a row that never ends; ties go to the lowest id, pad_id is never
    chosen (the padding after an end must be told from the end). `default`, scored (0, 0), when
    no token ends a row. `firsts`: each row's first_positions, where the caller has them."""
    firsts = [first_positions(row) for row in tokens] if firsts is None else firsts
    best, best_score = default, (0, 0)
    for token in sorted(set().union(*firsts) - {pad_id}):
        ends = [first[token] for first in firsts if token in first]
        if len(ends) == tokens.shape[0]:
            continue  # every row would end: nothing shows that a row without it must go on
        score = (len({step for step in ends if 1 <= step <= tokens.shape[1] - 2}), len(ends))
        if score > best_score:
            best, best_score = token, score
    return best, best_score


def attention_queries(sublayer: str, inputs: Mapping[str, Any]) -> set[int]:
    """The query lengths with which a case's attention runs; empty where the sublayer has none.
    A backend whose attention path depends on the query length names its path from these."""
    sublayer = forward_of(sublayer)
    src = inputs.get("src_ids")
    encoder = set() if src is None else {np.shape(src)[-1]}  # [B, S], or [N, B, S] in a training case
    if sublayer == "attention":
        return {np.shape(inputs["q"])[-2]}
    if sublayer in ("mha", "mha_cross", "encoder_layer"):
        return {np.shape(inputs["x"])[1]}
    if sublayer == "decoder_layer":
        return {np.shape(inputs["y"])[1]}
    if sublayer == "encoder":
        return encoder
    if sublayer in ("decoder", "forward", "loss", *TRAINING_SUBLAYERS):
        return {np.shape(inputs["tgt_ids"])[-1]} | encoder
    if sublayer == "decode":  # the prefix in one chunk (and the resumed one), then one token a step
        return {inputs["prefix"], 1, *([inputs["resume"]] if inputs.get("resume") else [])} | encoder
    if sublayer == "generate":  # a decoder-only model prefills its prompt first
        prompt = inputs.get("prompt_ids")
        return {1} | encoder | (set() if prompt is None else {np.shape(prompt)[1]})
    return set()


def decode_steps(inputs: dict[str, Any], cache: Any, decode_step: Callable[[Any, np.ndarray], tuple[Any, Any]]) -> list:
    """The decode case's protocol, for every backend: prefill tgt_ids[:, :prefix] into `cache` in
    one chunk, then (with `resume`) the next tokens as one more chunk, then one token per step;
    returns the logits of each chunk after the prefix and each step, [B, n, V]."""
    tgt_ids, prefix = np.asarray(inputs["tgt_ids"]), inputs["prefix"]
    _, cache = decode_step(cache, tgt_ids[:, :prefix])
    steps = []
    if resume := inputs.get("resume", 0):
        logits, cache = decode_step(cache, tgt_ids[:, prefix:prefix + resume])
        steps.append(logits)
        prefix += resume
    for t in range(prefix, tgt_ids.shape[1]):
        logits, cache = decode_step(cache, tgt_ids[:, t:t + 1])
        steps.append(logits)
    return steps


def applicable_cases(cfg: ModelConfig, sublayer: str, text: bool = False) -> tuple[str, ...]:
    """The mask cases of a sublayer that make sense for this config; the text cases too where the
    check has prompts (`text`: decoder-only models)."""
    spec_ = SUBLAYERS[sublayer]
    if spec_.needs_encoder and not cfg.has_encoder or sublayer in _MOE_SUBLAYERS and cfg.moe is None:
        return ()
    if sublayer == "linear_attn" and cfg.linear_attention is None or not _layers_of(cfg, forward_of(sublayer)):
        return ()  # (a hybrid of linear layers only has no layer for mha's or decoder_layer's cases)
    cases = tuple(c for c in spec_.mask_cases if c not in TEXT_CASES or text and not cfg.has_encoder)
    if cfg.moe is None:
        cases = tuple(c for c in cases if c not in _MOE_CASES)
    if cfg.linear_attention is None:
        cases = tuple(c for c in cases if c not in CHUNK_CASES)
    if cfg.positional == "rope":
        if forward_of(sublayer) == "positional":
            return ()
    else:
        cases = tuple(c for c in cases if c not in _ROTARY_CASES)
    if forward_of(sublayer) == "norm":
        cases = tuple(c for c in cases if norm_modules(cfg, _norm_role(c)))
    elif not cfg.qk_norm:  # an attention's activations meet a norm only in its head norms
        cases = tuple(c for c in cases if c not in _SCALED)
    if not cfg.dropout > 0:
        cases = tuple(c for c in cases if c != "dropout")
    if not cfg.switch_lengths or cfg.switch_lengths[0] + 1 > cfg.max_len:
        cases = tuple(c for c in cases if c not in SWITCH_CASES)
    if not cfg.has_encoder:
        if forward_of(sublayer) == "decoder_layer":
            cases = tuple(c for c in cases if c != "cross_pad" and c != "lq_ne_lk")
        elif forward_of(sublayer) in ("decoder", "forward", "decode", "generate", "loss", *TRAINING_SUBLAYERS):
            cases = tuple(c for c in cases if c not in _NEEDS_SOURCE)
    return cases


def case_names(cfg: ModelConfig, backward: bool = False, text: bool = False) -> list[tuple[str, str]]:
    """(sublayer, mask case) of every case of the config's catalogue, in order; the gradient
    and training cases too when `backward`, the text cases when `text` (a check given prompts)."""
    return [(sublayer, mask_case) for sublayer in SUBLAYERS for mask_case in applicable_cases(cfg, sublayer, text)
            if backward or not is_backward(sublayer)]


def build_case(cfg: ModelConfig, params: Mapping[str, np.ndarray], sublayer: str, mask_case: str,
               golden_params: GoldenParams | None = None, prompts: Prompts | None = None,
               amplification_found: float | None = None, passes: DecoderPasses | None = None) -> Case:
    """One case, its inputs built (the generate cases read the golden's tokens on `params`, the
    train_steps cases its first gradient's norm, the text cases the prompts' ids). golden_params
    gives the parameters cast to float64 where the caller holds them already (a golden runner's);
    else they are cast here, if the case needs them. amplification_found: the case's amplification
    where another process found it on the same inputs (a worker is sent its harness's): a hybrid's
    is a golden pass over the whole model, which a worker would make again with the golden's float64
    weights cast for it (6 GB at Qwen3.5-0.8B's size). passes: where the golden that will make the case's
    reference keeps the decoder's output of that pass (its DecoderPasses)."""
    rng = np.random.default_rng(case_seed(sublayer, mask_case))
    golden_params = golden_params or (lambda: golden.cast_params(cfg, params))
    if mask_case in TEXT_CASES:
        if prompts is None:
            raise ValueError(f"the case {sublayer}-{mask_case} runs real text: give the prompts (conformance.text)")
        inputs, reduction = _text_inputs(cfg, prompts, sublayer, mask_case)
    else:
        build = _gradient_inputs if is_gradient(sublayer) else _training_inputs if is_training(sublayer) else _build
        inputs, reduction = build(cfg, golden_params, sublayer, mask_case, rng)
    angle = rotary_angle(cfg, largest_rotated_position(cfg, sublayer, inputs))
    if amplification_found is None:
        amplification_found = amplification(cfg, golden_params, sublayer, inputs, passes)
    return Case(sublayer, mask_case, inputs, reduction, angle, recurrent_depth(cfg, sublayer, inputs),
                amplification_found)


def amplification(cfg: ModelConfig, golden_params: GoldenParams, sublayer: str, inputs: Mapping[str, Any],
                  passes: DecoderPasses | None = None) -> float:
    """SPEC §8's factor for a hybrid's case: the most that a gated DeltaNet's output norm magnifies
    the rounding of o (impl_numpy.model.output_norm_amplification), or a gated attention's gate the
    rounding of its logits (output_gate_amplification), on the case's inputs, found by the golden
    over them; 1 for the other configs and sublayers. A generate case takes its prompt's (the
    tokens it generates are the columns' own). A forward or decode case's decoder output is kept in
    `passes`, for its reference."""
    forward = forward_of(sublayer)
    whole = ("decoder", "forward", "decode", "loss", "generate", *TRAINING_SUBLAYERS)
    gated = cfg.attention_output_gate and forward in ("mha", *whole)  # a layer's gate reads its norm's outputs
    if not gated and (cfg.linear_attention is None or forward not in ("linear_attn", *whole)):
        return 1.0
    p = golden_params()
    with golden.recorded_amplification() as found:
        if forward == "mha":
            layer_cfg = cfg.module_config(inputs["module"])
            x, context = (np.asarray(inputs[name], np.float64) for name in ("x", "context"))
            mask = (decoder_self_mask(np.asarray(inputs["tgt_keep"]), None, layer_cfg.sliding_window)
                    if "tgt_keep" in inputs else normalize_mask(inputs["mask"], x.shape[0], cfg.n_heads, x.shape[1],
                                                                context.shape[1]))
            golden.multi_head_attention(layer_cfg, params_under(p, inputs["module"]), x, context, mask,
                                        inputs.get("offset", 0))
        elif forward == "linear_attn":
            golden.gated_delta_net(cfg, params_under(p, inputs["module"]), np.asarray(inputs["x"], np.float64),
                                   np.asarray(inputs["tgt_keep"], bool))
        else:
            ids = inputs["prompt_ids"] if forward == "generate" else inputs["tgt_ids"]
            for batch in np.asarray(ids).reshape(-1, *np.shape(ids)[-2:]):  # a training case's N batches
                hidden = golden.decoder(cfg, p, batch, real_tokens(cfg, batch, "tgt"))  # the head records nothing
            if passes is not None and sublayer in ("forward", "decode") and not cfg.has_encoder:
                passes.keep(inputs, hidden)
    return max(found, default=1.0)


def recurrent_depth(cfg: ModelConfig, sublayer: str, inputs: Mapping[str, Any]) -> int | None:
    """A case's depth where its length adds to it (SPEC §8's count for §5.15): a linear layer's
    state chains the updates of its T tokens, so it is T sublayers deep (a gradient case's twice
    that: its backward walks the tokens back, SPEC §13); None where the sublayer's own depth stands."""
    if cfg.linear_attention is None:
        return None
    forward, passes = forward_of(sublayer), 2 if is_gradient(sublayer) else 1
    if forward == "linear_attn":
        return passes * np.shape(inputs["x"])[1]
    if forward in ("decoder", "forward", "decode", "loss", "generate", *TRAINING_SUBLAYERS):
        tokens = (np.shape(inputs["prompt_ids"])[1] + inputs["max_new_tokens"] if forward == "generate"
                  else np.shape(inputs["tgt_ids"])[-1])
        linear = sum(cfg.layer_kind(i) == "linear" for i in range(cfg.n_decoder_layers))
        return SUBLAYERS[sublayer].depth(cfg) + passes * linear * (tokens - 1)
    return None


def _text_inputs(cfg: ModelConfig, prompts: Prompts, sublayer: str, mask_case: str) -> tuple[dict[str, Any], int]:
    """A text case: the prompts' ids padded with pad_id at the end (forward, decode: the steps run
    the last four positions, the shorter rows' padding among them) or at the start (generate,
    as a decoder-only model's batch is), or the one long prompt."""
    rows = [prompts.long] if mask_case == "text_long" else list(prompts.ids)
    length = max(len(row) for row in rows)
    padded = np.full((len(rows), length), cfg.pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        if sublayer == "generate":
            padded[i, length - len(row):] = row
        else:
            padded[i, :len(row)] = row
    reduction = max(cfg.d_model, cfg.d_ff, length + (NEW_TOKENS if sublayer == "generate" else 0))
    if sublayer == "forward":
        return {"src_ids": None, "tgt_ids": padded}, reduction
    if sublayer == "decode":
        return {"src_ids": None, "tgt_ids": padded, "prefix": max(1, length - 4)}, reduction
    return {"src_ids": None, "prompt_ids": padded, "bos_id": None, "eos_id": prompts.eos_id,
            "max_new_tokens": NEW_TOKENS}, reduction


def largest_rotated_position(cfg: ModelConfig, sublayer: str, inputs: Mapping[str, Any]) -> int:
    """The largest position by which a case's rotations turn a query or key; 0 without RoPE."""
    if cfg.positional != "rope":
        return 0
    forward = forward_of(sublayer)
    if forward == "mha":  # keys at offset .. offset + K − 1, the queries the last of them
        return inputs.get("offset", 0) + np.shape(inputs["context"])[1] - 1
    if forward == "decoder_layer":
        return np.shape(inputs["y"])[1] - 1
    if forward in ("decoder", "forward", "decode", "loss", *TRAINING_SUBLAYERS):
        return np.shape(inputs["tgt_ids"])[-1] - 1
    if forward == "generate":
        return np.shape(inputs["prompt_ids"])[1] + inputs["max_new_tokens"] - 1
    return 0


def catalogue(cfg: ModelConfig, params: Mapping[str, np.ndarray], backward: bool = False) -> list[Case]:
    """Every applicable (sublayer, mask case) of the config, inputs built; the gradient and
    training cases too when `backward`."""
    golden_params = functools.cache(lambda: golden.cast_params(cfg, params))
    return [build_case(cfg, params, sublayer, mask_case, golden_params) for sublayer, mask_case in case_names(cfg, backward)]
