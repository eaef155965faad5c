"""The ``transformers`` column: Hugging Face's own implementation of an imported checkpoint.

The runner loads the model from its Hugging Face directory with transformers (GPT2LMHeadModel,
MarianMTModel, BartForConditionalGeneration, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, and the
others of importers.huggingface.FAMILIES, MixtralForCausalLM and Qwen3MoeForCausalLM among them)
and runs the whole-model cases through Hugging Face's API: forward logits, the encoder, cached
decoding (past_key_values) and greedy generation (generate). The weights under test must be that
directory's import (checked by digest), so the column says whether Hugging Face and the spec
compute the same function.

Where the two conventions differ, the runner states the spec's in Hugging Face's terms:
- padding: the spec's keep-vectors (spec.masks.real_tokens) become attention_mask and
  decoder_attention_mask;
- positions: the spec numbers slots from 0 whatever the padding; generate() numbers a padded
  prompt's real tokens instead, so a decoder-only model is given the slot positions explicitly
  (position_ids) in every call: the forward, each decode step (P … P+n−1 after P cached slots)
  and generation. The forward and decode steps would count slots anyway (from the cache's
  length), but the rotary positions are too central to leave implicit;
- Marian's sinusoid table: Hugging Face builds it in float32 even in a float64 model; the spec
  evaluates angles in float64, so the table is rebuilt at the run's dtype by Marian's formula;
- the Llama family's float32 internals: its RMSNorm normalises in float32 whatever the model's
  dtype (an upcast meant for half precision) and its rotary embedding computes the inverse
  frequencies and the angles in float32 before casting cos and sin to the model's dtype. The
  spec allows both (SPEC §5.6, §5.11) up to float32; at float64 they are downcasts that leave
  float32 errors (about 1e-6 in the logits) in a float64 column, so a float64 run evaluates the same formulas
  in float64 (and so the MoE router's softmax, which both Mixtral and Qwen3-MoE take in float32).
  Every other dtype runs the modules as transformers wrote them; MoE models with the eager experts
  loop, since the default (grouped_mm) has no float64 kernel;
- a mixture of experts' routing can be replayed (`routing_log`, SPEC §5.14): each TopKRouter's
  choices go through a routing log, and its weights are its own probabilities at those choices;
- generation settings: the model's generation_config (bad words, forced tokens, penalties) is
  replaced by plain greedy decoding, which is what the spec defines;
- Qwen3.5's linear layers (SPEC §5.15): transformers zeroes a pad's input rather than skipping
  it, so a pad between real tokens still shifts the convolution's window and decays the state,
  and it applies the mask in the first call only, so a pad fed in a cached step moves the state
  as a real token does. The spec's pads move nothing: those rows' positions from such a pad on
  are left out, with that reason (tests/test_huggingface_hybrid.py shows both differences). It
  computes the decay and the gated delta rule in float32 whatever the model's dtype, so the
  float64 column is refused for a hybrid (a float64 run would be float32's). Its kernels
  (causal-conv1d, flash-linear-attention) are not installed: the column runs transformers' own
  PyTorch fallbacks, torch_chunk_gated_delta_rule for a prefill and the recurrent rule for a step.
The model runs with attn_implementation="sdpa" (transformers' default on PyTorch), stated so the
column does not change with the default. Its "eager" attention differs from the spec on a query
row with no key to attend to (it adds a large negative number to every score of the row, so the
softmax sees every key again; at float64 the number is -inf in its float32 softmax, and the row is
NaN); SDPA gives the spec's zeros. See docs/huggingface.md. Gemma 2 refuses SDPA (it has no softcap):
its column runs "spec-eager", transformers' eager formula (scores · scaling, the softcap, the mask,
a float32 softmax, float64 in a float64 run) with a boolean mask, and a row with no key gives zeros
as the spec says. gpt-oss refuses SDPA too: its column runs gpt-oss's own eager attention, the only
one that takes its sinks; a row with no key still has its sink there, which takes all of its
weight, so the row is the spec's zeros (its softmax is in the scores' dtype, bfloat16 at bfloat16).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from conformance.adapter import NotSupported, Partial
from spec import ROPE_SCALINGS, ModelConfig
from spec.config import TRANSFORMERS_COLUMN, not_computed_by
from spec.masks import real_tokens
from spec.routing import RoutingLog

MODEL_CASES = ("forward", "encoder", "decode", "generate")
DTYPES = ("float64", "float32", "float16", "bfloat16")
# torchao, which transformers imports with a model class where it is installed (the tests' extra),
# warns of its CUDA kernels' libraries, absent from a CPU build, and torch of an enum torchao
# registers: lines in the middle of a check's output that concern no column
NOISY_ON_IMPORT = ("torchao", "torch.utils._pytree",
                   # Qwen3.5's kernels (causal-conv1d, flash-linear-attention; not installed) fall back to
                   # transformers' PyTorch code, said once per case: the column states it once, here
                   "transformers.integrations.hub_kernels")


def quiet_noisy_imports() -> None:
    """Raise NOISY_ON_IMPORT's loggers to ERROR (a failure still shows)."""
    import logging

    for name in NOISY_ON_IMPORT:
        logging.getLogger(name).setLevel(logging.ERROR)


def attending_layers(cfg: ModelConfig) -> list[int]:
    """The decoder layers that attend (not a hybrid's linear ones)."""
    return [i for i in range(cfg.n_decoder_layers) if cfg.layer_kind(i) != "linear"]


class TransformersRunner:
    def __init__(self, directory: Path, cfg: ModelConfig, dtype: str, device: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig
        from transformers.utils import logging

        logging.disable_progress_bar()  # a loading bar per column would bury the matrix's own progress
        quiet_noisy_imports()

        if cfg.linear_attention is not None and dtype == "float64":
            raise NotSupported(HYBRID_FLOAT32)
        self.torch, self.cfg, self.device = torch, cfg, torch.device(device)
        torch_dtype = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                       "bfloat16": torch.bfloat16}[dtype]
        loader = model_class(directory) or (AutoModelForSeq2SeqLM if cfg.has_encoder else AutoModelForCausalLM)
        attention = "sdpa" if cfg.attention_softcap is None else register_spec_eager()
        if cfg.attention_sinks:  # gpt-oss refuses SDPA; its eager attention takes the sinks, whose row is never empty
            attention = "eager"
        self.model = loader.from_pretrained(directory, dtype=torch_dtype, attn_implementation=attention)
        self.model = self.model.to(self.device).eval()
        self.model.generation_config = GenerationConfig()  # plain greedy: no bad words, forced or suppressed tokens
        if cfg.moe is not None:
            # transformers 5's default experts implementation, grouped_mm, has no float64 kernel ("Expected
            # mat_a to be Float32, BFloat16 or Float16 matrix, got Double"): every dtype runs the eager loop
            self.model.set_experts_implementation("eager")
            # where output_router_logits is set (a config trained with the load-balancing loss), transformers
            # 5.23 takes that loss in every forward, with the whole attention mask against the routing of the
            # call's own tokens: a cached decode step raises ("The size of tensor a (3) must match the size of
            # tensor b (9)"). The column's cases are inference: the loss is never read
            self.model.config.output_router_logits = False
        self._rebuild_sinusoids(torch_dtype)
        if dtype == "float64":
            widened_to_float64(self.model, cfg)

    @contextlib.contextmanager
    def routing_log(self, forced: list[np.ndarray] | None = None,
                    forced_weights: list[np.ndarray] | None = None) -> Iterator[RoutingLog]:
        """Inside, each MoE layer's router (its TopKRouter) logs its choices and weights or takes the
        forced ones (replayed routing, SPEC §5.14), its own weights taken from its probabilities at
        the choices, as it takes them at its own."""
        import types

        log = RoutingLog(forced, forced_weights)
        # the router is the block's gate (Mixtral, the Qwens) or its router (gpt-oss)
        blocks = [module for module in self.model.modules()
                  if type(_router_of(module)).__name__.endswith("TopKRouter")]
        if not blocks:
            raise NotSupported("this model has no TopKRouter to replay routing through")
        hooks, routers = [], []
        for index, block in enumerate(blocks):
            # the router sees [B·T, d]: the block's input says how many rows a call has
            hooks.append(block.register_forward_pre_hook(lambda block, args: setattr(block, "_rows", args[0].shape[0])))
            router = _router_of(block)
            own = router.forward
            router.forward = types.MethodType(functools.partial(_logged_router, own=own, log=log, index=index,
                                                                block=block), router)
            routers.append((router, own))
        try:
            yield log
        finally:
            for hook in hooks:
                hook.remove()
            for router, own in routers:
                router.forward = own

    def _rebuild_sinusoids(self, dtype) -> None:
        """Marian's table by its own formula, evaluated in float64 and rounded to the run's dtype."""
        from impl_numpy.model import sinusoidal_table

        for module in self.model.modules():
            if type(module).__name__ == "MarianSinusoidalPositionalEmbedding":
                rows, d_model = module.weight.shape
                table = sinusoidal_table(np.arange(rows), d_model, "sinusoidal-concat")
                module.weight.data = self.torch.from_numpy(table).to(self.device, dtype)

    # ---- inputs ----
    def _ids(self, ids) -> Any:
        return self.torch.as_tensor(np.asarray(ids), dtype=self.torch.long, device=self.device)

    def _keep(self, ids, side: str, offset: int = 0) -> Any:
        keep = real_tokens(self.cfg, np.asarray(ids), side, offset)
        return self.torch.as_tensor(keep.astype(np.int64), device=self.device)

    def _slots(self, batch: int, start: int, stop: int) -> Any:
        """position_ids [batch, stop − start]: the slot indices start … stop − 1, padding or not (SPEC §5.2)."""
        return self.torch.arange(start, stop, device=self.device).expand(batch, -1)

    def run(self, sublayer: str, inputs: Mapping[str, Any]) -> np.ndarray | Partial:
        if sublayer not in MODEL_CASES:
            raise NotSupported(f"transformers runs whole models ({', '.join(MODEL_CASES)}), not {sublayer}")
        if sublayer in ("decode", "generate") and not attending_layers(self.cfg):
            raise NotSupported(LINEAR_LAYERS_ONLY)
        with self.torch.inference_mode():
            out = getattr(self, sublayer)(inputs)
        out = out.to("cpu", self.torch.float64).numpy() if out.is_floating_point() else out.cpu().numpy()
        if self.cfg.linear_attention is None or sublayer not in ("forward", "decode"):
            return out
        return _spec_rows(out, real_tokens(self.cfg, np.asarray(inputs["tgt_ids"]), "tgt"), inputs.get("prefix"))

    # ---- the whole-model cases ----
    def forward(self, inputs: Mapping[str, Any]):
        tgt = inputs["tgt_ids"]
        if not self.cfg.has_encoder:
            batch, length = np.shape(tgt)
            # no cache: a hybrid of linear layers alone has none transformers can make (LINEAR_LAYERS_ONLY)
            return self.model(input_ids=self._ids(tgt), attention_mask=self._keep(tgt, "tgt"),
                              position_ids=self._slots(batch, 0, length), use_cache=False).logits
        src = inputs["src_ids"]
        return self.model(input_ids=self._ids(src), attention_mask=self._keep(src, "src"),
                          decoder_input_ids=self._ids(tgt), decoder_attention_mask=self._keep(tgt, "tgt")).logits

    def encoder(self, inputs: Mapping[str, Any]):
        src = inputs["src_ids"]
        return self.model.get_encoder()(input_ids=self._ids(src), attention_mask=self._keep(src, "src")).last_hidden_state

    def decode(self, inputs: Mapping[str, Any]):
        """Prefill tgt_ids[:, :prefix] in one call, then one token per call, through past_key_values."""
        from transformers import DynamicCache, EncoderDecoderCache

        tgt, prefix = np.asarray(inputs["tgt_ids"]), inputs["prefix"]
        keep = self._keep(tgt, "tgt")
        arguments: dict[str, Any] = {"use_cache": True}
        if self.cfg.has_encoder:
            src = inputs["src_ids"]
            arguments["attention_mask"] = self._keep(src, "src")
            arguments["encoder_outputs"] = self.model.get_encoder()(input_ids=self._ids(src),
                                                                    attention_mask=arguments["attention_mask"])
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        else:  # a hybrid's cache holds its linear layers' states, laid out from the config (as its forward does)
            cache = DynamicCache(config=self.model.config) if self.cfg.linear_attention is not None else DynamicCache()
        steps, start = [], 0
        for stop in [prefix, *range(prefix + 1, tgt.shape[1] + 1)]:
            chunk = self._ids(tgt[:, start:stop])
            if self.cfg.has_encoder:
                output = self.model(decoder_input_ids=chunk, decoder_attention_mask=keep[:, :stop],
                                    past_key_values=cache, **arguments)
            else:
                output = self.model(input_ids=chunk, attention_mask=keep[:, :stop], past_key_values=cache,
                                    position_ids=self._slots(tgt.shape[0], start, stop), use_cache=True)
            cache = output.past_key_values
            if start >= prefix:
                steps.append(output.logits)
            start = stop
        return self.torch.cat(steps, dim=1)

    def generate(self, inputs: Mapping[str, Any]):
        """generate() with plain greedy settings; the spec's slot positions for a padded prompt."""
        from transformers import GenerationConfig

        cfg, count = self.cfg, inputs["max_new_tokens"]
        settings = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=count, min_new_tokens=0,
                                    pad_token_id=cfg.pad_id, eos_token_id=inputs["eos_id"], use_cache=True)
        if cfg.has_encoder:
            src = inputs["src_ids"]
            settings.decoder_start_token_id = inputs["bos_id"]
            tokens = self.model.generate(input_ids=self._ids(src), attention_mask=self._keep(src, "src"),
                                         generation_config=settings)[:, 1:]  # after the start token
        else:
            prompt = np.asarray(inputs["prompt_ids"])
            tokens = self.model.generate(input_ids=self._ids(prompt), attention_mask=self._keep(prompt, "tgt"),
                                         position_ids=self._slots(prompt.shape[0], 0, prompt.shape[1]),
                                         generation_config=settings)[:, prompt.shape[1]:]
        if tokens.shape[1] < count:  # generate stops once every row has finished; the spec pads
            tokens = self.torch.nn.functional.pad(tokens, (0, count - tokens.shape[1]), value=cfg.pad_id)
        return tokens


def model_class(directory: str | Path):
    """The class config.json's architectures names, where transformers has it, else None (the Auto
    class then). Not AutoModelForCausalLM whatever the file: for a published Qwen3.5
    (Qwen3_5ForConditionalGeneration) it makes Qwen3_5ForCausalLM, whose weights under
    model.language_model. it does not find, and it initialises them at random with a warning."""
    import json

    import transformers

    architectures = json.loads((Path(directory) / "config.json").read_text()).get("architectures") or []
    return getattr(transformers, architectures[0], None) if architectures else None


HYBRID_FLOAT32 = ("transformers' Qwen3.5 and Qwen3-Next compute their linear layers' decay (A_log.float(), a.float()) "
                  "and gated delta rule (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule) in float32 "
                  "whatever the model's dtype: a float64 run is float32's there")
LINEAR_LAYERS_ONLY = ("transformers' hybrid cache asks its first attention layer how many positions it holds "
                      "(get_seq_length, get_mask_sizes) and raises where every layer is a linear one: a model of "
                      "linear layers alone decodes only without a cache there")
PAD_BETWEEN = ("a pad between real tokens moves transformers' Qwen3.5 linear-layer state (it zeroes the pad's input; "
               "the convolution window and the decay still take the pad), where the spec's pads move nothing "
               "(SPEC §5.15)")
PAD_IN_STEP = ("a pad fed in a cached step moves transformers' Qwen3.5 linear-layer state as a real token (its "
               "mask reaches the linear layers in the first call only), where the spec's pads move nothing "
               "(SPEC §5.15)")


def _spec_rows(logits: np.ndarray, keep: np.ndarray, prefix: int | None) -> np.ndarray | Partial:
    """A hybrid's logits [B, L, V] (a forward's) or [B, L − prefix, V] (a decode's steps), the
    positions from a pad that moved transformers' state on left out: a pad with real tokens on both
    sides, or (decode) one fed in a step after the prefill."""
    length = keep.shape[1]
    seen = np.cumsum(keep, axis=1) > 0  # a real token at or before each position
    ahead = np.cumsum(keep[:, ::-1], axis=1)[:, ::-1] > 0  # one at or after it
    between = ~keep & seen & ahead
    stepped = np.zeros_like(keep) if prefix is None else ~keep & (np.arange(length) >= prefix)
    moved = between | stepped
    first = np.where(moved.any(axis=1), moved.argmax(axis=1), length)  # [B]
    positions = np.arange(length) if prefix is None else np.arange(prefix, length)
    compared = positions[None, :] < first[:, None]
    left_out = {int(row): PAD_IN_STEP if stepped[row, first[row]] and not between[row, first[row]] else PAD_BETWEEN
                for row in np.flatnonzero(first < length) if not compared[row].all()}
    return Partial(logits, compared, left_out, "step" if prefix is not None else "position") if left_out else logits


def widened_to_float64(model, cfg: ModelConfig) -> None:
    """A float64 model's RMSNorms (Qwen3.5's gated one too), rotary embeddings and MoE routers by
    their own formulas in float64 (transformers computes them in float32 whatever the model's dtype)."""
    import types

    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
        elif kind.endswith("RMSNormGated"):
            module.forward = types.MethodType(_gated_rms_norm_float64, module)
        elif kind.endswith("TopKRouter") and kind != "GptOssTopKRouter":  # gpt-oss's softmax is in float64 already
            module.forward = types.MethodType(_router_float64, module)
        elif kind.endswith("RotaryEmbedding"):
            rope_types = module.rope_type.values() if isinstance(module.rope_type, dict) else [module.rope_type]
            if any(rope_type not in ("default", *ROPE_SCALINGS) for rope_type in rope_types):
                raise NotSupported(f"{kind} is {module.rope_type} RoPE; the spec's rescalings are "
                                   f"{', '.join(ROPE_SCALINGS)} (SPEC §5.12)")
            module.forward = types.MethodType(functools.partial(_rotary_float64, cfg=cfg), module)


def _router_of(block):
    """A mixture block's TopKRouter: its gate (Mixtral, the Qwens) or its router (gpt-oss); else None."""
    return getattr(block, "gate", None) or getattr(block, "router", None)


def _logged_router(module, hidden, *, own, log: RoutingLog, index: int, block):
    """A TopKRouter's forward with its choices through a routing log: its own (logits, weights,
    chosen), the chosen replaced by the log's, the weights those choices' probabilities,
    renormalised where the class renormalises (or the log's forced ones), in the dtype it gives them."""
    import torch

    logits, weights, chosen = own(hidden)
    chosen = torch.as_tensor(log.choose(index, block._rows, chosen.cpu().numpy()), device=chosen.device).long()
    # at least float32, as both classes take their softmax (float64 in a float64 run)
    probabilities = (logits if logits.dtype == torch.float64 else logits.float()).softmax(dim=-1)
    picked = probabilities.gather(-1, chosen)
    if getattr(module, "norm_topk_prob", True):
        picked = picked / picked.sum(dim=-1, keepdim=True)
    log.see(index, hidden.detach().reshape(-1, hidden.shape[-1]).cpu().double().numpy())
    forced = log.weigh(index, picked.detach().cpu().double().numpy())
    if forced is not None:  # the golden's weights (this column computes no gradients)
        picked = torch.as_tensor(forced, dtype=picked.dtype, device=picked.device)
    return logits, picked.to(weights.dtype), chosen


def _router_float64(module, hidden):
    """transformers' MoE router (Mixtral's, Qwen3-MoE's): p = softmax(x Rᵀ), its k largest,
    renormalised where the class says (Mixtral always, Qwen3-MoE with norm_topk_prob), without its
    softmax in float32 (a float64 run). Returns its (logits, weights, chosen)."""
    logits = hidden.reshape(-1, module.hidden_dim) @ module.weight.T
    weights, chosen = logits.softmax(dim=-1).topk(module.top_k, dim=-1)
    if getattr(module, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights, chosen


# the classes whose RMSNorm multiplies by 1 + weight (and names its ε eps)
_SCALE_PLUS_ONE_NORMS = ("Gemma", "Qwen3_5")


def _rms_norm_float64(module, hidden):
    """transformers' Llama-family RMSNorm, γ · x / √(mean(x²) + ε), without its cast to float32 (a
    float64 run); Gemma's and Qwen3.5's multiply by 1 + weight and name their ε eps."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    if type(module).__name__.startswith(_SCALE_PLUS_ONE_NORMS):
        return (1.0 + module.weight) * (hidden * (variance + module.eps).rsqrt())
    return module.weight * (hidden * (variance + module.variance_epsilon).rsqrt())


def _gated_rms_norm_float64(module, hidden, gate):
    """Qwen3.5's gated norm of the DeltaNet output, γ · x / √(mean(x²) + ε) ⊙ SiLU(gate), without its
    casts to float32 (a float64 run)."""
    import torch

    variance = hidden.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden * (variance + module.variance_epsilon).rsqrt()) * torch.nn.functional.silu(gate)


SPEC_EAGER = "spec-eager"


def register_spec_eager() -> str:
    """Register transformers' eager attention with a boolean mask and the spec's empty rows (zeros)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def boolean_mask(*args, **kwargs):
        # always the mask itself: SDPA's own may be skipped (None) where is_causal would do, which eager has not
        return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})

    AttentionInterface.register(SPEC_EAGER, _spec_eager_attention)
    AttentionMaskInterface.register(SPEC_EAGER, boolean_mask)
    return SPEC_EAGER


def _spec_eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                          **kwargs):
    """Gemma 2's eager attention (scores · scaling, softcap, mask, softmax in float32) with the mask a
    boolean keep-mask, and a query with no key to attend to given zeros (SPEC §6), not NaN."""
    import torch

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * (module.head_dim ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:
        raise NotSupported("transformers gave spec-eager attention no mask: causality would be lost")
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    row_has_key = torch.isfinite(scores).any(dim=-1, keepdim=True)
    # float32 for half precision, as eager does; a float64 run keeps float64 (eager's float32 would cap it)
    wide = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    weights = torch.softmax(wide.masked_fill(~row_has_key, 0.0), dim=-1).to(query.dtype)
    weights = weights.masked_fill(~row_has_key, 0.0)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _rotary_float64(module, x, position_ids, layer_type=None, *, cfg):
    """transformers' rotary embedding, a·cos and a·sin of position · ω_i repeated for both halves,
    with the frequencies and angles in float64 rather than float32 (a float64 run). transformers
    computes its frequencies in float32 whatever the dtype (for the rescaled kinds too), so at
    float64 they are the spec's (impl_numpy's, SPEC §5.12); tests/test_rope_scaling.py checks
    transformers' own float32 frequencies and attention factor against them."""
    import torch

    from impl_numpy.model import rope_attention_factor, rope_frequencies

    if layer_type is not None:  # Gemma 3: one table per layer type, the sliding layers' with their own θ
        kind = {"full_attention": "full", "sliding_attention": "sliding"}[layer_type]
        kinds = cfg.layer_types or ("sliding" if cfg.sliding_window else "full",) * cfg.n_decoder_layers
        cfg = cfg.layer(kinds.index(kind))
    inverse = getattr(module, "inv_freq", None)
    if inverse is None:
        inverse = getattr(module, f"{layer_type}_inv_freq")
    if 2 * inverse.shape[-1] != cfg.rotary_dim:
        raise NotSupported(f"transformers rotates {2 * inverse.shape[-1]} dimensions of each head, the "
                           f"config {cfg.rotary_dim}")
    # transformers' longrope takes the long factors where max(position_ids) + 1 passes the original
    # context, per call: the spec's rule (SPEC §5.12)
    if position_ids.ndim == 3:  # Qwen3.5's multimodal rotary: a text token's three rows are one position
        position_ids = position_ids[0]
    length = int(position_ids.max()) + 1 if cfg.rotary_reads_length else None
    inverse_frequency = torch.from_numpy(rope_frequencies(cfg, length)).to(x.device)
    angles = position_ids[..., None].to(torch.float64) * inverse_frequency
    if type(module).__name__ != "GptOssRotaryEmbedding":  # gpt-oss's rotation takes one angle per pair, unrepeated
        angles = torch.cat((angles, angles), dim=-1)
    factor = rope_attention_factor(cfg)
    return (factor * angles.cos()).to(x.dtype), (factor * angles.sin()).to(x.dtype)


class TransformersBackend:
    """Hugging Face transformers running the model of one directory (``rosetta check --hf DIR``)."""

    name = "transformers"

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._checked = False

    def availability(self) -> str | None:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as error:
            return f"not installed: {error}"
        return None

    def devices(self) -> list[str]:
        import torch

        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    def device_name(self, device: str) -> str:
        import torch

        return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"

    def supports(self, dtype: str, device: str) -> str | None:
        if dtype not in DTYPES:
            return f"dtype {dtype} is not run by transformers (it runs {', '.join(DTYPES)})"
        return None

    def supports_config(self, cfg: ModelConfig, dtype: str) -> str | None:
        if cfg.linear_attention is not None and dtype == "float64":
            return HYBRID_FLOAT32
        return not_computed_by(cfg, TRANSFORMERS_COLUMN)

    def supports_sublayer(self, sublayer: str) -> str | None:
        if sublayer not in MODEL_CASES:
            return f"transformers runs whole models ({', '.join(MODEL_CASES)}); its sublayers have no common entry point"
        return None

    def load(self, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, device: str) -> TransformersRunner:
        from importers import require_import_of

        if not self._checked:
            require_import_of(self.directory, cfg, params, "transformers")
            self._checked = True
        return TransformersRunner(self.directory, cfg, dtype, device)
