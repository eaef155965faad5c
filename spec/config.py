"""ModelConfig: every architectural choice of the Transformer, validated on construction."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any

from spec.errors import ConfigError

ARCHS = ("encoder-decoder", "decoder-only")
NORM_POSITIONS = ("post", "pre", "output")  # SPEC §5.7: Norm(x + F(x)), x + F(Norm(x)), x + Norm(F(x))
QK_NORM_SCOPES = ("head", "projection")  # SPEC §5.11: over each head's d_k (Qwen3), over all heads (OLMo 2)
NORMS = ("layernorm", "std", "rmsnorm")
POSITIONALS = ("sinusoidal", "sinusoidal-concat", "learned", "rope")
ACTIVATIONS = ("relu", "gelu", "gelu-tanh", "swish")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")  # SPEC §5.12
LAYER_TYPES = ("full", "sliding", "linear")  # SPEC §6: a decoder layer's self-attention sees every earlier key,
# or the last W; "linear": the layer's mixer is gated DeltaNet's recurrence instead (SPEC §5.15)
ROUTER_SOFTMAXES = ("float32", "activation")  # SPEC §5.14: the dtype of the router's softmax

_CHOICES = {
    "arch": ARCHS,
    "norm_position": NORM_POSITIONS,
    "qk_norm_scope": QK_NORM_SCOPES,
    "norm": NORMS,
    "positional": POSITIONALS,
    "activation": ACTIVATIONS,
}


def _check_fields(cls, data: Any, name: str, expected: str) -> None:
    """ConfigError naming what a JSON object lacks or has too many of for the dataclass `cls`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be {expected}, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        raise ConfigError(f"unknown {name} field(s): {', '.join(unknown)}")
    missing = sorted(f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING)
    if missing:
        raise ConfigError(f"missing {name} field(s): {', '.join(missing)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How the rotary frequencies are rescaled for a context longer than the one a model was
    trained at (SPEC §5.12). `kind` names the rule; the other fields are its parameters, with
    the defaults Hugging Face's configs take when a key is absent."""

    kind: str  # one of ROPE_SCALINGS
    factor: float  # how much longer the context is
    original_max_len: int | None = None  # llama3, yarn: the context the frequencies were trained at
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept
    beta_fast: float = 32.0  # yarn: rotations over original_max_len below which a dimension is interpolated...
    beta_slow: float = 1.0  # ... and above which it is kept, a ramp between
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    mscale: float | None = None  # yarn: the temperature's scale, with mscale_all_dim (DeepSeek's)
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn, longrope: cos and sin multiplied by this; None: derived
    short_factor: tuple[float, ...] | None = None  # longrope: ω_i divided by these while a call's length ≤ L...
    long_factor: tuple[float, ...] | None = None  # ... and by these past it (r/2 each)

    @classmethod
    def from_dict(cls, data: Any) -> "RopeScaling":
        _check_fields(cls, data, "rope_scaling", "a JSON object or null")
        lists = {name: tuple(data[name]) for name in ("short_factor", "long_factor")
                 if isinstance(data.get(name), list)}  # JSON arrays: the frozen config holds tuples
        return cls(**{**data, **lists})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureOfExperts:
    """A decoder layer's FFN as `n_experts` gated FFNs of width d_ff and a router that chooses
    `experts_per_token` of them per token (SPEC §5.14: Mixtral, Qwen3-MoE)."""

    n_experts: int  # E
    experts_per_token: int  # k
    renormalize: bool = True  # the k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    router_softmax: str = "float32"  # the router's softmax at least in float32 (half activations widened), or theirs
    # α: the training loss adds α times the load-balancing loss (SPEC §5.14); 0, the default: none
    load_balancing: float = 0.0
    # the width of a shared expert every token takes beside its k, gated by σ(x g) (Qwen2-MoE's and
    # Qwen3-Next's shared_expert_intermediate_size); 0, the default: none
    shared_expert_d_ff: int = 0
    router_bias: bool = False  # the router's logits x R + b (gpt-oss, SPEC §5.16)

    @classmethod
    def from_dict(cls, data: Any) -> "MixtureOfExperts":
        _check_fields(cls, data, "moe", "a JSON object or null")
        return cls(**data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNet:
    """The mixer of the "linear" layers of layer_types: gated DeltaNet's linear attention, a recurrent
    state per value head in place of a KV cache (SPEC §5.15: Qwen3.5, Qwen3-Next)."""

    key_heads: int  # H_k: q and k heads
    value_heads: int  # H_v: v heads, each reading key head h // (H_v / H_k); its own state [d_k, d_v]
    key_head_dim: int  # d_k
    value_head_dim: int  # d_v
    conv_kernel: int = 4  # K: the causal depthwise convolution over q, k and v, K positions wide
    # C: the tokens a chunked prefill takes at once (torch, JAX, the exports); the golden's recurrence
    # has none, and any C computes the same sums (SPEC §5.15). Qwen3.5's kernels take 64.
    chunk_size: int = 64

    @classmethod
    def from_dict(cls, data: Any) -> "GatedDeltaNet":
        _check_fields(cls, data, "linear_attention", "a JSON object or null")
        return cls(**data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The whole architecture of one Transformer. See spec/SPEC.md §1 for each field's meaning.

    Sizes have no defaults; the options default to the paper's base model. Construction
    validates every field and raises ConfigError naming the offending field.
    """

    arch: str = "encoder-decoder"
    d_model: int
    n_heads: int
    d_ff: int
    n_encoder_layers: int = 0  # must be 0 for decoder-only, >= 1 for encoder-decoder
    n_decoder_layers: int
    src_vocab_size: int = 0  # must be 0 for decoder-only (there is no source)
    tgt_vocab_size: int
    max_len: int
    pad_id: int = 0
    norm_position: str = "post"
    norm: str = "layernorm"
    norm_eps: float = 1e-6
    final_norm: bool = False
    positional: str = "sinusoidal"
    embed_scale: bool = True
    embed_norm: bool = False
    activation: str = "relu"
    qkv_bias: bool = True
    bias: bool = True
    head_bias: bool = False
    share_src_tgt_embed: bool = False
    tie_head: bool = False
    dropout: float = 0.0
    label_smoothing: float = 0.0
    # the modern decoder (SPEC §5.11): rotary positions, grouped-query attention, gated FFN
    rope_theta: float = 10000.0  # base of the rotary frequencies (positional="rope")
    rope_fraction: float = 1.0  # the share of each head's dimensions that rotates (partial rotary; 0: none, NoPE)
    rope_scaling: RopeScaling | None = None  # rescaled frequencies for a longer context (SPEC §5.12)
    n_kv_heads: int | None = None  # key/value heads; None: n_heads (multi-head), 1: multi-query
    head_dim: int | None = None  # d_k; None: d_model / n_heads
    gated_ffn: bool = False  # FFN(x) = (act(x W1) ⊙ x W3) W2: SwiGLU with swish, GeGLU with gelu-tanh
    qk_norm: bool = False  # an RMSNorm of each head's q and k before the rotation (Qwen3)
    qk_norm_scope: str = "head"  # "head": over each head's d_k (Qwen3); "projection": over all H·d_k at once (OLMo 2)
    sliding_window: int | None = None  # W: decoder self-attention sees the last W positions only (SPEC §6; Mistral)
    layer_types: tuple[str, ...] | None = None  # per decoder layer, "full" or "sliding" (W); None: all as sliding_window says
    local_rope_theta: float | None = None  # the sliding layers' own θ, unrescaled (Gemma 3); None: as the full layers
    nope_layers: tuple[int, ...] | None = None  # decoder layers that rotate nothing (NoPE: SmolLM3); None: none
    # Gemma's layer (SPEC §5.13)
    attention_softcap: float | None = None  # scores ← c·tanh(scores / c) before the mask (Gemma 2)
    final_softcap: float | None = None  # logits ← c·tanh(logits / c)
    norm_scale_plus_one: bool = False  # RMSNorm multiplies by (1 + scale): a stored 0 is the identity (Gemma)
    post_norms: bool = False  # a pre-norm layer's sublayer outputs normed again before the residual sum (Gemma 2/3)
    query_pre_attention_scalar: float | None = None  # scores divided by √(this) instead of √d_k (Gemma)
    # mixture of experts (SPEC §5.14)
    moe: MixtureOfExperts | None = None  # every decoder layer's FFN a mixture of gated experts; None: one FFN
    # the hybrids (SPEC §5.15: Qwen3.5, Qwen3-Next)
    linear_attention: GatedDeltaNet | None = None  # the mixer of layer_types' "linear" layers
    attention_output_gate: bool = False  # self-attention's heads times σ(x W_gate) before W_o (the gated attention)
    # gpt-oss's attention (SPEC §5.16)
    attention_sinks: bool = False  # a learned logit per head in the self-attention softmax's denominator only
    # its clamped SwiGLU: g = min(x W1 + b1, L), u = clip(x W3 + b3, −L, L), the unit g·σ(α g) ⊙ (u + 1)
    swiglu_limit: float | None = None  # L (gpt-oss: 7)
    swiglu_alpha: float | None = None  # α (gpt-oss: 1.702); given with swiglu_limit

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def d_head(self) -> int:
        """d_k = d_v: head_dim, else d_model / n_heads."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def kv_heads(self) -> int:
        """The key/value heads: n_kv_heads, else n_heads. Query head h reads key/value head
        h // (n_heads / kv_heads)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def rotary_dim(self) -> int:
        """How many of a head's leading dimensions rotate: int(d_head · rope_fraction); 0 without RoPE."""
        return int(self.d_head * self.rope_fraction) if self.positional == "rope" else 0

    @property
    def rotary_reads_length(self) -> bool:
        """Whether a call's rotary frequencies depend on its length, 1 + its largest position
        (longrope, SPEC §5.12): then a cached decode is not the forward where a sequence crosses
        the original context, and its reference is the golden's own cached decode."""
        return self.rope_scaling is not None and self.rope_scaling.kind == "longrope"

    @property
    def switch_lengths(self) -> tuple[int, ...]:
        """The call lengths ℓ at which the model's computation changes rule, each the last length of
        the rule before it: longrope's original context L (ℓ ≤ L takes the short factors, ℓ > L the
        long ones, SPEC §5.12). () where nothing switches; the whole-model cases at_switch and
        past_switch (SPEC §11) run ℓ = L and L + 1."""
        if self.rotary_reads_length:
            return (self.rope_scaling.original_max_len,)
        return ()

    @property
    def swiglu_clamp(self) -> tuple[float, float] | None:
        """gpt-oss's clamped SwiGLU as (L, α) (SPEC §5.16), or None: the plain gated unit."""
        return None if self.swiglu_limit is None else (float(self.swiglu_limit), float(self.swiglu_alpha))

    @property
    def score_scale(self) -> float:
        """The scores' factor: 1 / √query_pre_attention_scalar where given (Gemma), else 1 / √d_k."""
        return 1 / math.sqrt(self.query_pre_attention_scalar or self.d_head)

    def layer(self, index: int) -> "ModelConfig":
        """Decoder layer `index`'s own config (SPEC §6): a uniform one, in which sliding_window is
        kept on a sliding layer only and a sliding layer with local_rope_theta rotates by that θ,
        unrescaled. The config itself for a model whose layers are all alike."""
        return _layer_config(self, index)

    def layer_kind(self, index: int) -> str:
        """Decoder layer `index`'s kind: "full", "sliding" (its window) or "linear" (gated DeltaNet)."""
        if self.layer_types is not None:
            return self.layer_types[index]
        return "full" if self.sliding_window is None else "sliding"

    def first_layers(self, count: int) -> "ModelConfig":
        """This model cut to its first `count` decoder layers, each keeping its kind (a model whose
        remaining layers have no window has no window left, nor a linear mixer without linear layers)."""
        kinds = None if self.layer_types is None else self.layer_types[:count]
        nope = tuple(i for i in self.nope_layers or () if i < count) or None
        changes: dict[str, Any] = {"n_decoder_layers": count, "layer_types": kinds, "nope_layers": nope}
        if kinds is not None and "sliding" not in kinds:
            changes.update(sliding_window=None, local_rope_theta=None)
        if kinds is not None and "linear" not in kinds:
            changes.update(linear_attention=None)
        if kinds is not None and set(kinds) == {"full"}:
            changes.update(layer_types=None)
        return self.replace(**changes)

    def module_config(self, module: str | None) -> "ModelConfig":
        """The config a module computes with: decoder layer i's (layer) for a module under
        "decoder.layers.i", else the model's."""
        parts = (module or "").split(".")
        if len(parts) >= 3 and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
            return self.layer(int(parts[2]))
        return self

    @property
    def cached_layers(self) -> tuple[int | None, ...]:
        """Each decoder layer's row in a preallocated KV cache: the attention layers numbered in
        order, None for a linear layer, which keeps a state instead of keys and values (§5.15)."""
        rows, attention = [], 0
        for i in range(self.n_decoder_layers):
            linear = self.layer_kind(i) == "linear"
            rows.append(None if linear else attention)
            attention += not linear
        return tuple(rows)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each decoder layer's window (None: full causal attention), as layer(i) has it. Read
        without layer(i)'s cache, since the compiled steps read it inside the traced code."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.n_decoder_layers
        return tuple(self.sliding_window if kind == "sliding" else None for kind in self.layer_types)

    @property
    def has_encoder(self) -> bool:
        return self.arch == "encoder-decoder"

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name, default in _ABSENT_WHEN.items():
            if data[name] == default:  # absent, so that a config without it reads as it did before it existed
                del data[name]
        for name in ("layer_types", "nope_layers"):
            if data.get(name) is not None:
                data[name] = list(data[name])
        for name in ("short_factor", "long_factor"):  # longrope's, absent from the other rules likewise
            if data.get("rope_scaling") and data["rope_scaling"][name] is None:
                del data["rope_scaling"][name]
        if data.get("moe") and not data["moe"]["shared_expert_d_ff"]:  # absent without a shared expert
            del data["moe"]["shared_expert_d_ff"]
        if data.get("moe") and not data["moe"]["router_bias"]:  # and without a router bias
            del data["moe"]["router_bias"]
        return data

    def to_json(self) -> str:
        """Canonical JSON: keys sorted, no whitespace, so equal configs give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> "ModelConfig":
        _check_fields(cls, data, "config", "a JSON object")
        if data.get("rope_scaling") is not None:
            data = {**data, "rope_scaling": RopeScaling.from_dict(data["rope_scaling"])}
        if data.get("moe") is not None:
            data = {**data, "moe": MixtureOfExperts.from_dict(data["moe"])}
        if data.get("linear_attention") is not None:
            data = {**data, "linear_attention": GatedDeltaNet.from_dict(data["linear_attention"])}
        for name in ("layer_types", "nope_layers"):
            if isinstance(data.get(name), list):  # a JSON array: the frozen config holds a tuple
                data = {**data, name: tuple(data[name])}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as error:
            raise ConfigError(f"config is not valid JSON: {error}") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# The features the spec defines that not everything computes yet (SPEC §5.15), with what does: the
# rest (the exports, the importers' writer, the golden's backward, the conformance matrix) refuse
# such a config by name (check_computed_by) rather than compute another model.
_FRAMEWORKS = ("impl_numpy", "impl_torch", "impl_jax")
GOLDEN_BACKWARD = "the golden's backward"
HUGGING_FACE_WRITER = "the Hugging Face writer"
TRANSFORMERS_COLUMN = "the transformers column (its directory written by the Hugging Face writer)"
ONNX_EXPORTS = {"torch": "the ONNX export from impl_torch", "jax": "the ONNX export from impl_jax (jax2onnx)"}
_HYBRID_COMPUTERS = (*_FRAMEWORKS, GOLDEN_BACKWARD, HUGGING_FACE_WRITER, TRANSFORMERS_COLUMN, ONNX_EXPORTS["torch"])
# feature -> (its name, what computes it, whether cfg has it)
NEWER_FEATURES: dict[str, tuple[str, tuple[str, ...], Callable[[ModelConfig], bool]]] = {
    "linear_attention": ("gated DeltaNet's linear layers (linear_attention)", _HYBRID_COMPUTERS,
                         lambda cfg: cfg.linear_attention is not None),
    "attention_output_gate": ("the attention's output gate (attention_output_gate)", _HYBRID_COMPUTERS,
                              lambda cfg: cfg.attention_output_gate),
    "shared_expert": ("the mixture of experts' shared expert (moe.shared_expert_d_ff)",
                      (*_FRAMEWORKS, GOLDEN_BACKWARD, HUGGING_FACE_WRITER, TRANSFORMERS_COLUMN, *ONNX_EXPORTS.values()),
                      lambda cfg: cfg.moe is not None and cfg.moe.shared_expert_d_ff > 0),
}


def _missing(cfg: ModelConfig, who: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, what computes it) of each feature of cfg that `who` does not compute yet."""
    return [(name, computers) for name, computers, present in NEWER_FEATURES.values()
            if present(cfg) and who not in computers]


def uncomputed_features(cfg: ModelConfig, who: str) -> tuple[str, ...]:
    """The features of cfg that `who` does not compute yet, by name."""
    return tuple(name for name, _ in _missing(cfg, who))


def not_computed_by(cfg: ModelConfig, who: str) -> str | None:
    """Why `who` (a framework, an export, the golden's backward, ...) cannot compute cfg yet, naming
    the features and what does compute them all; None where it can."""
    missing = _missing(cfg, who)
    if not missing:
        return None
    doers = [doer for doer in missing[0][1] if all(doer in computers for _, computers in missing)]
    named = ", ".join("the golden's forward and cached decode" if doer == "impl_numpy" else doer for doer in doers)
    return (f"{who} does not compute {' or '.join(name for name, _ in missing)} yet: {named} do "
            "(SPEC §5.14, §5.15)")


def check_computed_by(cfg: ModelConfig, who: str) -> None:
    """A ConfigError saying not_computed_by's reason, for a config `who` does not compute yet."""
    if reason := not_computed_by(cfg, who):
        raise ConfigError(reason)


_ABSENT_WHEN = {  # fields newer than the first configs, left out of the JSON at these values
    "rope_scaling": None, "qk_norm_scope": "head", "sliding_window": None, "layer_types": None,
    "local_rope_theta": None, "nope_layers": None,
    "attention_softcap": None, "final_softcap": None, "norm_scale_plus_one": False, "post_norms": False,
    "query_pre_attention_scalar": None, "moe": None, "linear_attention": None, "attention_output_gate": False,
    "attention_sinks": False, "swiglu_limit": None, "swiglu_alpha": None,
}


@functools.lru_cache(maxsize=256)
def _layer_config(cfg: ModelConfig, index: int) -> ModelConfig:
    if not 0 <= index < cfg.n_decoder_layers:
        raise ConfigError(f"decoder layer {index} does not exist: the model has {cfg.n_decoder_layers}")
    if cfg.layer_types is None and cfg.nope_layers is None:
        return cfg
    sliding = cfg.layer_kind(index) == "sliding"
    # a uniform layer: its kind is the model's to say (layer_kind), a linear layer's mixer the model's
    changes: dict[str, Any] = {"layer_types": None, "local_rope_theta": None, "linear_attention": None,
                               "nope_layers": None, "sliding_window": cfg.sliding_window if sliding else None}
    if sliding and cfg.local_rope_theta is not None:
        changes.update(rope_theta=cfg.local_rope_theta, rope_scaling=None)
    if index in (cfg.nope_layers or ()):  # NoPE: rotary over no dimension, which leaves q and k as they are
        changes.update(rope_fraction=0.0, rope_scaling=None)
    return dataclasses.replace(cfg, **changes)


# ---- validation ---------------------------------------------------------------------------

_INT_FIELDS = (
    "d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
    "src_vocab_size", "tgt_vocab_size", "max_len", "pad_id",
)
_BOOL_FIELDS = (
    "final_norm", "embed_scale", "embed_norm", "qkv_bias", "bias", "head_bias", "share_src_tgt_embed", "tie_head",
    "gated_ffn", "qk_norm", "norm_scale_plus_one", "post_norms", "attention_output_gate", "attention_sinks",
)
_OPTIONAL_INT_FIELDS = ("n_kv_heads", "head_dim", "sliding_window")


def _validate(cfg: ModelConfig) -> None:
    # Types first: bool is an int subclass in Python, so it is refused explicitly.
    for name in _INT_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    for name in _BOOL_FIELDS:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
    for name, choices in _CHOICES.items():
        value = getattr(cfg, name)
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    for name in _OPTIONAL_INT_FIELDS:
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer or null, got {value!r}")
    for name in ("norm_eps", "dropout", "label_smoothing", "rope_theta", "rope_fraction"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")

    for name in ("d_model", "n_heads", "d_ff", "n_decoder_layers", "tgt_vocab_size", "max_len"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.head_dim is None and cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads}), or head_dim given"
        )
    if cfg.n_heads % cfg.kv_heads:
        raise ConfigError(f"n_kv_heads ({cfg.kv_heads}) must divide n_heads ({cfg.n_heads}): each key/value "
                          "head serves a whole group of query heads")
    if cfg.positional == "rope":
        if cfg.has_encoder:
            raise ConfigError("positional='rope' is defined for decoder-only models here (its cross-attention "
                              "would have no positions to rotate by); use arch='decoder-only'")
        if not cfg.rope_theta > 1:
            raise ConfigError(f"rope_theta must be greater than 1, got {cfg.rope_theta}")
        if not 0 <= cfg.rope_fraction <= 1:
            raise ConfigError(f"rope_fraction must be in [0, 1] (0: no dimension rotates), got {cfg.rope_fraction}")
        if cfg.rope_fraction > 0 and (cfg.rotary_dim < 2 or cfg.rotary_dim % 2):
            raise ConfigError(f"rope_fraction {cfg.rope_fraction} of head_dim {cfg.d_head} rotates "
                              f"{cfg.rotary_dim} dimensions; it must be an even number, at least 2 (pairs rotate)")
        if cfg.rope_scaling is not None and cfg.rope_fraction == 0:
            raise ConfigError("rope_scaling rescales rotations, and rope_fraction 0 rotates nothing: give one")
        if cfg.rope_scaling is not None:
            _validate_rope_scaling(cfg.rope_scaling)
            if cfg.rope_scaling.kind == "longrope":
                for name in ("short_factor", "long_factor"):
                    if len(getattr(cfg.rope_scaling, name)) != cfg.rotary_dim // 2:
                        raise ConfigError(f"rope_scaling.{name} has {len(getattr(cfg.rope_scaling, name))} factors; "
                                          f"longrope needs one per rotated pair: {cfg.rotary_dim // 2}")
    elif (cfg.rope_theta, cfg.rope_fraction, cfg.rope_scaling) != (10000.0, 1.0, None):
        raise ConfigError("rope_theta, rope_fraction and rope_scaling apply to positional='rope' only, got "
                          f"positional={cfg.positional!r}")
    _validate_layer_kinds(cfg)
    for name in ("attention_softcap", "final_softcap", "query_pre_attention_scalar", "swiglu_limit", "swiglu_alpha"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ConfigError(f"{name} must be a positive number or null, got {value!r}")
    if (cfg.swiglu_limit is None) != (cfg.swiglu_alpha is None):
        raise ConfigError("swiglu_limit and swiglu_alpha are gpt-oss's clamped SwiGLU together: give both or neither")
    if cfg.swiglu_limit is not None and (not cfg.gated_ffn or cfg.activation != "swish"):
        raise ConfigError(f"swiglu_limit clamps a SwiGLU's gate and linear unit: it needs gated_ffn=true and "
                          f"activation='swish', got gated_ffn={cfg.gated_ffn}, activation={cfg.activation!r}")
    if cfg.moe is not None:
        _validate_moe(cfg)
    _validate_hybrid(cfg)
    if cfg.norm_scale_plus_one and cfg.norm != "rmsnorm":
        raise ConfigError(f"norm_scale_plus_one is Gemma's RMSNorm, γ = 1 + scale; it needs norm='rmsnorm', "
                          f"got norm={cfg.norm!r}")
    if cfg.post_norms and cfg.norm_position != "pre":  # with "output" they would be its norms again
        raise ConfigError("post_norms norm each sublayer's output before a pre-norm layer's residual sum "
                          f"(Gemma 2/3); it needs norm_position='pre', got {cfg.norm_position!r}")
    if cfg.post_norms and cfg.has_encoder:
        raise ConfigError("post_norms are defined for decoder-only models here (Gemma 2/3); use arch='decoder-only'")
    if cfg.sliding_window is not None and cfg.has_encoder:
        raise ConfigError("sliding_window restricts a decoder-only model's self-attention (Mistral, Phi-3); "
                          "an encoder-decoder has none here: use arch='decoder-only'")
    if cfg.qk_norm and cfg.norm != "rmsnorm":
        raise ConfigError(f"qk_norm normalises each head's q and k with RMSNorm (Qwen3) and needs norm='rmsnorm', "
                          f"got norm={cfg.norm!r}")
    if cfg.qk_norm_scope != "head" and not cfg.qk_norm:
        raise ConfigError(f"qk_norm_scope {cfg.qk_norm_scope!r} says what the q/k norms normalise over, and qk_norm is "
                          "false: there are none")
    if cfg.attention_sinks and cfg.has_encoder:
        raise ConfigError("attention_sinks are a decoder-only model's self-attention's (gpt-oss); use arch='decoder-only'")
    if cfg.norm_position == "output" and cfg.has_encoder:
        raise ConfigError("norm_position='output' (a norm on each sublayer's output before the residual sum: OLMo 2) "
                          "is defined for decoder-only models here; use arch='decoder-only'")
    if cfg.positional in ("sinusoidal", "sinusoidal-concat") and cfg.d_model % 2:
        raise ConfigError(
            f"d_model must be even for {cfg.positional} positions (sin/cos pairs), got {cfg.d_model}"
        )
    if cfg.norm == "std" and cfg.d_model < 2:
        raise ConfigError("d_model must be at least 2 for norm='std' (unbiased std divides by d-1)")
    if not cfg.norm_eps > 0:
        raise ConfigError(f"norm_eps must be positive, got {cfg.norm_eps}")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout must be in [0, 1), got {cfg.dropout}")
    if not 0 <= cfg.label_smoothing < 1:
        raise ConfigError(f"label_smoothing must be in [0, 1), got {cfg.label_smoothing}")
    if cfg.label_smoothing and cfg.tgt_vocab_size < 3:
        raise ConfigError("label_smoothing needs tgt_vocab_size >= 3: its mass goes to the tokens that are "
                          f"neither the target nor pad, and there are none; got {cfg.tgt_vocab_size}")

    if cfg.arch == "encoder-decoder":
        for name in ("n_encoder_layers", "src_vocab_size"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"{name} must be positive for an encoder-decoder, got {getattr(cfg, name)}")
        if cfg.share_src_tgt_embed and cfg.src_vocab_size != cfg.tgt_vocab_size:
            raise ConfigError(
                "share_src_tgt_embed needs src_vocab_size == tgt_vocab_size, got "
                f"{cfg.src_vocab_size} and {cfg.tgt_vocab_size}"
            )
    else:
        for name in ("n_encoder_layers", "src_vocab_size"):
            if getattr(cfg, name) != 0:
                raise ConfigError(f"{name} must be 0 for a decoder-only model (it has no source), got {getattr(cfg, name)}")
        if cfg.share_src_tgt_embed:
            raise ConfigError("share_src_tgt_embed must be false for a decoder-only model (it has no source)")

    vocabularies = [("tgt_vocab_size", cfg.tgt_vocab_size)]
    if cfg.has_encoder:
        vocabularies.append(("src_vocab_size", cfg.src_vocab_size))
    for name, size in vocabularies:
        if not 0 <= cfg.pad_id < size:
            raise ConfigError(f"pad_id ({cfg.pad_id}) must lie inside the vocabulary: 0 <= pad_id < {name} ({size})")


def _validate_layer_kinds(cfg: ModelConfig) -> None:
    """layer_types and local_rope_theta (SPEC §6): one kind per decoder layer, sliding ones with a window."""
    kinds = cfg.layer_types
    if kinds is not None:
        if not isinstance(kinds, tuple) or len(kinds) != cfg.n_decoder_layers:
            raise ConfigError(f"layer_types must list one kind per decoder layer ({cfg.n_decoder_layers}), "
                              f"got {kinds!r}")
        unknown = sorted({str(kind) for kind in kinds if kind not in LAYER_TYPES})
        if unknown:
            raise ConfigError(f"layer_types must hold {', '.join(LAYER_TYPES[:-1])} or {LAYER_TYPES[-1]}; "
                              f"got {', '.join(unknown)}")
        if "linear" in kinds and cfg.linear_attention is None:
            raise ConfigError("layer_types has linear layers but linear_attention is null: give their gated DeltaNet "
                              "(heads, head sizes, conv_kernel)")
        if "sliding" in kinds and cfg.sliding_window is None:
            raise ConfigError("layer_types has sliding layers but sliding_window is null: give their window W")
        if cfg.sliding_window is not None and "sliding" not in kinds:
            raise ConfigError(f"sliding_window {cfg.sliding_window} is given but no layer of layer_types is sliding")
    _validate_nope_layers(cfg)
    theta = cfg.local_rope_theta
    if theta is None:
        return
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or not theta > 1:
        raise ConfigError(f"local_rope_theta must be a number greater than 1 or null, got {theta!r}")
    if cfg.positional != "rope":
        raise ConfigError(f"local_rope_theta applies to positional='rope' only, got {cfg.positional!r}")
    if kinds is None:
        raise ConfigError("local_rope_theta is the θ of the sliding layers of layer_types; give layer_types")


def _validate_nope_layers(cfg: ModelConfig) -> None:
    """nope_layers (SPEC §5.11): distinct decoder layers, in order, of a rotary model."""
    layers = cfg.nope_layers
    if layers is None:
        return
    if (not isinstance(layers, tuple) or not layers
            or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)):
        raise ConfigError(f"nope_layers must list decoder layer indices (at least one) or be null, got {layers!r}")
    if list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < cfg.n_decoder_layers:
        raise ConfigError(f"nope_layers must be distinct decoder layers in increasing order, each in "
                          f"0 .. {cfg.n_decoder_layers - 1}; got {list(layers)}")
    if cfg.positional != "rope":
        raise ConfigError(f"nope_layers are the layers of a rotary model that do not rotate; positional is "
                          f"{cfg.positional!r}")
    linear = [i for i in layers if cfg.layer_kind(i) == "linear"]
    if linear:
        raise ConfigError(f"nope_layers {linear} are linear layers, which have no rotary to leave out")


def _validate_hybrid(cfg: ModelConfig) -> None:
    """linear_attention and attention_output_gate (SPEC §5.15): a decoder-only model's linear layers
    and its gated self-attention."""
    if cfg.attention_output_gate and cfg.has_encoder:
        raise ConfigError("attention_output_gate gates a decoder-only model's self-attention (Qwen3.5, "
                          "Qwen3-Next); use arch='decoder-only'")
    mixer = cfg.linear_attention
    if mixer is None:
        return
    if not isinstance(mixer, GatedDeltaNet):
        raise ConfigError(f"linear_attention must be a GatedDeltaNet or null, got {mixer!r}")
    for name in ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel", "chunk_size"):
        value = getattr(mixer, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"linear_attention.{name} must be a positive integer, got {value!r}")
    if mixer.value_heads % mixer.key_heads:
        raise ConfigError(f"linear_attention.key_heads ({mixer.key_heads}) must divide value_heads "
                          f"({mixer.value_heads}): each key head serves a whole group of value heads")
    if cfg.layer_types is None or "linear" not in cfg.layer_types:
        raise ConfigError("linear_attention is the mixer of the linear layers of layer_types, and no layer is linear: "
                          "name them in layer_types")
    if cfg.has_encoder:
        raise ConfigError("linear_attention is defined for decoder-only models here (Qwen3.5, Qwen3-Next); "
                          "use arch='decoder-only'")
    if cfg.norm != "rmsnorm" or cfg.norm_position != "pre":
        raise ConfigError("gated DeltaNet's layers are pre-RMSNorm layers (its output norm is an RMSNorm); it needs "
                          f"norm='rmsnorm' and norm_position='pre', got {cfg.norm!r} and {cfg.norm_position!r}")
    if cfg.post_norms:
        raise ConfigError("linear_attention's models here have no post norms (Qwen3.5's and Qwen3-Next's layers); "
                          "a hybrid with them is not in the spec yet")
    if cfg.bias or cfg.dropout:
        raise ConfigError("gated DeltaNet's projections have no biases and no dropout here (Qwen3.5's, Qwen3-Next's); "
                          f"it needs bias=false and dropout=0, got bias={cfg.bias}, dropout={cfg.dropout}")


def _validate_moe(cfg: ModelConfig) -> None:
    """The mixture of experts (SPEC §5.14): gated experts without biases, in a decoder-only model."""
    moe = cfg.moe
    if not isinstance(moe, MixtureOfExperts):
        raise ConfigError(f"moe must be a MixtureOfExperts or null, got {moe!r}")
    for name in ("n_experts", "experts_per_token"):
        value = getattr(moe, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"moe.{name} must be a positive integer, got {value!r}")
    shared = moe.shared_expert_d_ff
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"moe.shared_expert_d_ff (the shared expert's width; 0 for none) must be an integer >= 0, "
                          f"got {shared!r}")
    if moe.n_experts < 2:
        raise ConfigError(f"moe.n_experts must be at least 2 (one expert is a dense FFN), got {moe.n_experts}")
    if moe.experts_per_token > moe.n_experts:
        raise ConfigError(f"moe.experts_per_token ({moe.experts_per_token}) cannot exceed moe.n_experts "
                          f"({moe.n_experts})")
    for name in ("renormalize", "router_bias"):
        if not isinstance(getattr(moe, name), bool):
            raise ConfigError(f"moe.{name} must be true or false, got {getattr(moe, name)!r}")
    if moe.router_softmax not in ROUTER_SOFTMAXES:
        raise ConfigError(f"moe.router_softmax must be one of {', '.join(ROUTER_SOFTMAXES)}; got {moe.router_softmax!r}")
    weight = moe.load_balancing
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"moe.load_balancing (the load-balancing loss's weight in the training loss) must be a "
                          f"finite number >= 0, got {weight!r}")
    if cfg.has_encoder:
        raise ConfigError("moe is defined for decoder-only models here (Mixtral, Qwen3-MoE); use arch='decoder-only'")
    if not cfg.gated_ffn:
        raise ConfigError("moe's experts are gated FFNs (Mixtral's, Qwen3-MoE's, gpt-oss's): it needs gated_ffn=true, "
                          f"got gated_ffn={cfg.gated_ffn}")


def _validate_rope_scaling(scaling: RopeScaling) -> None:
    """Each rule's parameters, as SPEC §5.12 needs them."""
    if not isinstance(scaling, RopeScaling):
        raise ConfigError(f"rope_scaling must be a RopeScaling or null, got {scaling!r}")
    if scaling.kind not in ROPE_SCALINGS:
        raise ConfigError(f"rope_scaling.kind must be one of {', '.join(ROPE_SCALINGS)}; got {scaling.kind!r}")
    optional = ("mscale", "mscale_all_dim", "attention_factor")  # null: derived (SPEC §5.12)
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", *optional):
        value = getattr(scaling, name)
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"rope_scaling.{name} must be a finite number, got {value!r}")
    if not isinstance(scaling.truncate, bool):
        raise ConfigError(f"rope_scaling.truncate must be true or false, got {scaling.truncate!r}")
    if not scaling.factor > 0:
        raise ConfigError(f"rope_scaling.factor must be positive, got {scaling.factor}")
    if scaling.kind == "linear":
        return
    length = scaling.original_max_len
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ConfigError(f"rope_scaling.original_max_len must be a positive integer for {scaling.kind}, got {length!r}")
    if scaling.kind == "llama3" and not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
        raise ConfigError(f"rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor (the smoothing between "
                          f"them divides by their difference), got {scaling.low_freq_factor} and "
                          f"{scaling.high_freq_factor}")
    if scaling.kind == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = getattr(scaling, name)
            if not isinstance(factors, tuple) or not all(
                    isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0
                    for f in factors):
                raise ConfigError(f"rope_scaling.{name} must be a list of positive numbers (one per rotated pair), "
                                  f"got {factors!r}")
    elif scaling.short_factor is not None or scaling.long_factor is not None:
        raise ConfigError(f"rope_scaling.short_factor and long_factor are longrope's; {scaling.kind} has none")
    if scaling.attention_factor is not None and not scaling.attention_factor > 0:
        raise ConfigError(f"rope_scaling.attention_factor must be positive, got {scaling.attention_factor}")
    if scaling.kind == "yarn":
        if not 0 < scaling.beta_slow < scaling.beta_fast:
            raise ConfigError(f"rope_scaling: yarn needs 0 < beta_slow < beta_fast, got {scaling.beta_slow} and "
                              f"{scaling.beta_fast}")
