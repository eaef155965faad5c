"""Canonical parameter names and shapes, the deterministic init, and parameter-set checks.

Matrices use the paper's layout, y = x @ W + b, so every weight is [in, out].
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import numpy as np

from spec.config import ModelConfig
from spec.errors import WeightsError

PARAM_DTYPE = np.dtype("float32")  # the dtype of canonical parameters and of weight files
# norms that multiply by their scale as stored whatever norm_scale_plus_one says: gated DeltaNet's
# output norm (SPEC §5.15; Qwen3.5's (1 + w) norms are the layers' and the heads')
PLAIN_SCALES = ("linear_attn.norm.scale",)


def _attention_shapes(prefix: str, cfg: ModelConfig, self_attention: bool) -> dict[str, tuple[int, ...]]:
    """q [d, H·d_k], k and v [d, H_kv·d_k], o [H·d_k, d]; Qwen3's per-head q/k norms [d_k] in
    self-attention (OLMo 2's over the whole projection)."""
    d, queries, keys = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
    widths = {"q": queries, "k": keys, "v": keys}
    shapes: dict[str, tuple[int, ...]] = {}
    for projection in ("q", "k", "v", "o"):
        shapes[f"{prefix}.{projection}.weight"] = (queries, d) if projection == "o" else (d, widths[projection])
        has_bias = cfg.bias if projection == "o" else cfg.qkv_bias
        if has_bias:
            shapes[f"{prefix}.{projection}.bias"] = (d,) if projection == "o" else (widths[projection],)
    if cfg.qk_norm and self_attention:  # OLMo 2's norm all of q's heads at once: [H·d_k], k's [H_kv·d_k]
        whole = cfg.qk_norm_scope == "projection"
        shapes[f"{prefix}.q_norm.scale"] = (queries if whole else cfg.d_head,)
        shapes[f"{prefix}.k_norm.scale"] = (keys if whole else cfg.d_head,)
    if cfg.attention_sinks and self_attention:  # SPEC §5.16: one logit per query head
        shapes[f"{prefix}.sinks"] = (cfg.n_heads,)
    if cfg.attention_output_gate and self_attention:  # SPEC §5.15: σ(x W_gate) [d, H·d_k] on the heads
        shapes[f"{prefix}.gate.weight"] = (d, queries)
        if cfg.qkv_bias:
            shapes[f"{prefix}.gate.bias"] = (queries,)
    return shapes


def _gated_delta_net_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """SPEC §5.15: q and k [d, H_k·d_k], v and the output gate z [d, H_v·d_v], each of q, k, v's causal
    depthwise convolution [channels, K], β's and the decay's projections [d, H_v], the decay's bias
    and log rate [H_v], the gated output norm's scale [d_v], o [H_v·d_v, d]."""
    mixer, d = cfg.linear_attention, cfg.d_model
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    return {f"{prefix}.q.weight": (d, keys), f"{prefix}.k.weight": (d, keys), f"{prefix}.v.weight": (d, values),
            f"{prefix}.q_conv.weight": (keys, mixer.conv_kernel), f"{prefix}.k_conv.weight": (keys, mixer.conv_kernel),
            f"{prefix}.v_conv.weight": (values, mixer.conv_kernel),
            f"{prefix}.z.weight": (d, values), f"{prefix}.beta.weight": (d, mixer.value_heads),
            f"{prefix}.decay.weight": (d, mixer.value_heads), f"{prefix}.decay.bias": (mixer.value_heads,),
            f"{prefix}.decay.log_rate": (mixer.value_heads,), f"{prefix}.norm.scale": (mixer.value_head_dim,),
            f"{prefix}.o.weight": (values, d)}


def _norm_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A norm's scale γ, and its bias β but for RMSNorm, which has none."""
    if cfg.norm == "rmsnorm":
        return {f"{prefix}.scale": (cfg.d_model,)}
    return {f"{prefix}.scale": (cfg.d_model,), f"{prefix}.bias": (cfg.d_model,)}


def _ffn_shapes(prefix: str, cfg: ModelConfig, d_ff: int | None = None) -> dict[str, tuple[int, ...]]:
    """W1 [d, d_ff] (activated), W3 [d, d_ff] (the gated FFN's linear unit), W2 [d_ff, d]; d_ff the
    config's unless given (a shared expert's)."""
    d_ff = cfg.d_ff if d_ff is None else d_ff
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.w1.weight": (cfg.d_model, d_ff)}
    if cfg.bias:
        shapes[f"{prefix}.w1.bias"] = (d_ff,)
    if cfg.gated_ffn:
        shapes[f"{prefix}.w3.weight"] = (cfg.d_model, d_ff)
        if cfg.bias:
            shapes[f"{prefix}.w3.bias"] = (d_ff,)
    shapes[f"{prefix}.w2.weight"] = (d_ff, cfg.d_model)
    if cfg.bias:
        shapes[f"{prefix}.w2.bias"] = (cfg.d_model,)
    return shapes


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical parameter name of the config and its shape, in canonical order."""
    d = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.has_encoder and not cfg.share_src_tgt_embed:
        shapes["src_embed.weight"] = (cfg.src_vocab_size, d)
    shapes["tgt_embed.weight"] = (cfg.tgt_vocab_size, d)
    if cfg.positional == "learned":
        if cfg.has_encoder:
            shapes["src_pos.weight"] = (cfg.max_len, d)
        shapes["tgt_pos.weight"] = (cfg.max_len, d)
    if cfg.has_encoder and cfg.embed_norm:
        shapes.update(_norm_shapes("encoder.embed_norm", cfg))
    for i in range(cfg.n_encoder_layers):
        layer = f"encoder.layers.{i}"
        shapes.update(_attention_shapes(f"{layer}.self_attn", cfg, True))
        shapes.update(_norm_shapes(f"{layer}.self_attn_norm", cfg))
        shapes.update(_ffn_shapes(f"{layer}.ffn", cfg))
        shapes.update(_norm_shapes(f"{layer}.ffn_norm", cfg))
    if cfg.has_encoder and cfg.final_norm:
        shapes.update(_norm_shapes("encoder.norm", cfg))
    if cfg.embed_norm:
        shapes.update(_norm_shapes("decoder.embed_norm", cfg))
    for i in range(cfg.n_decoder_layers):
        layer = f"decoder.layers.{i}"
        if cfg.layer_kind(i) == "linear":  # SPEC §5.15: gated DeltaNet in self-attention's place
            shapes.update(_gated_delta_net_shapes(f"{layer}.linear_attn", cfg))
            shapes.update(_norm_shapes(f"{layer}.linear_attn_norm", cfg))
        else:
            shapes.update(_attention_shapes(f"{layer}.self_attn", cfg, True))
            shapes.update(_norm_shapes(f"{layer}.self_attn_norm", cfg))
        if cfg.post_norms:
            shapes.update(_norm_shapes(f"{layer}.self_attn_post_norm", cfg))
        if cfg.has_encoder:
            shapes.update(_attention_shapes(f"{layer}.cross_attn", cfg, False))
            shapes.update(_norm_shapes(f"{layer}.cross_attn_norm", cfg))
        if cfg.moe is None:
            shapes.update(_ffn_shapes(f"{layer}.ffn", cfg))
        else:  # §5.14: the router, then each expert's gated FFN, then the shared expert and its gate
            shapes[f"{layer}.ffn.router.weight"] = (d, cfg.moe.n_experts)
            if cfg.moe.router_bias:  # gpt-oss's (SPEC §5.16)
                shapes[f"{layer}.ffn.router.bias"] = (cfg.moe.n_experts,)
            for expert in range(cfg.moe.n_experts):
                shapes.update(_ffn_shapes(f"{layer}.ffn.experts.{expert}", cfg))
            if cfg.moe.shared_expert_d_ff:
                shapes.update(_ffn_shapes(f"{layer}.ffn.shared_expert", cfg, cfg.moe.shared_expert_d_ff))
                shapes[f"{layer}.ffn.shared_expert_gate.weight"] = (d, 1)
        shapes.update(_norm_shapes(f"{layer}.ffn_norm", cfg))
        if cfg.post_norms:
            shapes.update(_norm_shapes(f"{layer}.ffn_post_norm", cfg))
    if cfg.final_norm:
        shapes.update(_norm_shapes("decoder.norm", cfg))
    if not cfg.tie_head:
        shapes["head.weight"] = (d, cfg.tgt_vocab_size)
    if cfg.head_bias:
        shapes["head.bias"] = (cfg.tgt_vocab_size,)
    return shapes


def count_params(cfg: ModelConfig) -> int:
    """Number of scalar parameters (shared and tied tensors counted once)."""
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


# ---- deterministic init -------------------------------------------------------------------

def _name_stream(seed: int, name: str) -> np.random.Generator:
    """An independent PCG64 stream per (seed, parameter name); see SPEC.md §4."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 32, 4)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *words])))


def _uniform(stream: np.random.Generator, shape: tuple[int, ...], limit: float) -> np.ndarray:
    return limit * (2.0 * stream.random(shape) - 1.0)  # U(-limit, limit), float64


def _normal(stream: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    # Box-Muller from the generator's doubles: documented and portable, unlike a library's
    # normal sampler whose algorithm may change between NumPy versions.
    count = math.prod(shape)
    u1 = stream.random(count)
    u2 = stream.random(count)
    radius = np.sqrt(-2.0 * np.log1p(-u1))  # 1 - u1 lies in (0, 1], so the log is finite
    return (std * radius * np.cos(2.0 * math.pi * u2)).reshape(shape)


def _check_seed(seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be a non-negative integer below 2**63, got {seed!r}")


def init_params(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 parameters: Xavier-uniform matrices, N(0, std=d^-0.5) embeddings
    (token and learned-position tables), zero biases, unit norm scales (a stored 0 where the
    norm multiplies by 1 + scale, Gemma's)."""
    _check_seed(seed)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        stream = _name_stream(int(seed), name)
        if name.endswith("embed.weight") or name.endswith("pos.weight"):
            values = _normal(stream, shape, cfg.d_model ** -0.5)
        elif name.endswith(PLAIN_SCALES):
            values = np.ones(shape)
        elif name.endswith(".scale"):
            values = np.full(shape, 0.0 if cfg.norm_scale_plus_one else 1.0)
        elif name.endswith("_conv.weight"):  # a depthwise kernel [channels, K]: each channel's fan-in is K
            values = _uniform(stream, shape, shape[1] ** -0.5)
        elif name.endswith("decay.log_rate"):  # A = exp(log_rate) drawn from U(1, 16) (SPEC §5.15)
            values = np.log(1.0 + 15.0 * stream.random(shape))
        elif name.endswith(".bias") or name.endswith(".sinks"):  # a sink of 0 adds exp(0) to the denominator
            values = np.zeros(shape)
        else:  # a [in, out] matrix
            fan_in, fan_out = shape
            values = _uniform(stream, shape, math.sqrt(6.0 / (fan_in + fan_out)))
        params[name] = values.astype(PARAM_DTYPE)
    return params


# ---- conformance weights ------------------------------------------------------------------

# The paper's initialisation hides whole classes of parameters: a zero bias that is dropped, a
# unit norm scale that is ignored, leave every output unchanged. The conformance matrix runs on
# weights in which every tensor is drawn away from its trivial value (SPEC.md §4.1).
CONFORMANCE_BIAS = 0.2  # biases (attention, FFN, head, norms): U(-0.2, 0.2)
CONFORMANCE_SCALE = 0.2  # norm scales: U(1 - 0.2, 1 + 0.2)
CONFORMANCE_SINK = 1.5  # attention sinks (SPEC §5.16): U(-1.5, 1.5), from a sink that takes little to one that takes most
# Greedy decoding of a random Transformer repeats one token when what a step changes (its token,
# its position) is small beside what every step shares (SPEC.md §4.1). Two things share it out:
# - an attention of nearly uniform weights averages its values, one vector for every query: each
#   such sublayer halves the token's share of the residual stream, and after 6 layers it is gone.
#   Smaller value and output matrices keep the stream's own token in it;
# - ReLU, GELU and swish have a positive mean, so an FFN output matrix W2 [d_ff, d] adds about
#   E[act]·Σ_j W2[j, :], one vector for every position, step and source. Centring W2 over its input
#   axis removes it; a stronger FFN, a random function of the step's own input, then weighs more.
CONFORMANCE_GAINS = {  # × the Xavier limit of these [in, out] matrices, by "module.matrix"
    "ffn.w1": 3.0, "ffn.w2": 3.0,
    "self_attn.v": 0.5, "self_attn.o": 0.5,
    "cross_attn.v": 0.7, "cross_attn.o": 0.7,  # less: the source would weigh less than the token
}
CENTRED_OVER_INPUTS = ("ffn.w2.weight",)
# A post norm (Gemma's, SPEC §5.13) sets the size of its sublayer's output whatever the matrices before
# it are, so the gains that keep a step's own token in the stream move onto it: the FFN's ×3, the
# attention's ×0.5 (without them the tiny Gemmas' greedy runs repeat one token, as above).
POST_NORM_GAINS = {"ffn_post_norm": 3.0, "self_attn_post_norm": 0.5}


def _role(name: str) -> str:
    """A parameter's "module.matrix.kind", an expert's (the shared one's too) as its FFN's (SPEC §5.14):
    decoder.layers.0.ffn.experts.3.w2.weight -> ffn.w2.weight."""
    parts = name.split(".")
    if "experts" in parts:
        at = parts.index("experts")
        del parts[at:at + 2]
    if "shared_expert" in parts:
        parts.remove("shared_expert")
    return ".".join(parts[-3:])


def _gain(name: str) -> float:
    return CONFORMANCE_GAINS.get(_role(name).rsplit(".", 1)[0], 1.0)


def conformance_params(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 parameters in which every tensor matters: init_params' matrices
    (the FFN's ×3, its output matrix centred over its inputs; attention's values and
    output ×0.5, ×0.7 across) and embeddings, with biases drawn from U(-0.2, 0.2) and norm
    scales from U(0.8, 1.2) (the scale applied: a stored U(-0.2, 0.2) where the norm multiplies
    by 1 + scale), post norms' times POST_NORM_GAINS. The weights `rosetta check --preset` and
    the tests run on."""
    _check_seed(seed)
    params: dict[str, np.ndarray] = {}
    for name, value in init_params(cfg, seed).items():
        stream = _name_stream(int(seed), name)  # the stream init_params leaves unread for these
        if name.endswith(".scale"):
            gain = POST_NORM_GAINS.get(name.split(".")[-2], 1.0)
            applied = gain * (1.0 + _uniform(stream, value.shape, CONFORMANCE_SCALE))  # γ about the gain
            plus_one = cfg.norm_scale_plus_one and not name.endswith(PLAIN_SCALES)
            value = applied - 1.0 if plus_one else applied  # Gemma stores γ − 1
        elif name.endswith("decay.log_rate"):
            pass  # init_params' rates, each its own already
        elif name.endswith(".bias"):
            value = _uniform(stream, value.shape, CONFORMANCE_BIAS)
        elif name.endswith(".sinks"):
            value = _uniform(stream, value.shape, CONFORMANCE_SINK)
        elif not (name.endswith("embed.weight") or name.endswith("pos.weight")):  # a [in, out] matrix
            value = _gain(name) * value.astype(np.float64)
            if _role(name).endswith(CENTRED_OVER_INPUTS):
                value = value - value.mean(axis=0, keepdims=True)  # Σ_j W2[j, :] = 0
        params[name] = value.astype(PARAM_DTYPE)
    return params


# ---- parameter-set checks -----------------------------------------------------------------

def check_params(
    cfg: ModelConfig,
    params: Mapping[str, object],
    *,
    dtype: np.dtype | None = PARAM_DTYPE,
    where: str = "parameters",
) -> None:
    """Refuse a parameter set that does not match the config, listing every offender at once:
    missing, unexpected, mis-shaped, wrong-dtype and non-finite tensors."""
    if not isinstance(params, Mapping):
        raise WeightsError(f"{where} must be a mapping of name -> array, got {type(params).__name__}")
    expected = param_shapes(cfg)
    problems: list[str] = []
    missing = [name for name in expected if name not in params]
    unexpected = sorted(name for name in params if name not in expected)
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected: " + ", ".join(map(str, unexpected)))
    for name, shape in expected.items():
        if name not in params:
            continue
        value = params[name]
        if not isinstance(value, np.ndarray):
            problems.append(f"{name}: expected a numpy array, got {type(value).__name__}")
            continue
        if tuple(value.shape) != shape:
            problems.append(f"{name}: shape {list(value.shape)}, expected {list(shape)}")
        if dtype is not None and value.dtype != dtype:
            problems.append(f"{name}: dtype {value.dtype}, expected {np.dtype(dtype)}")
        elif not np.issubdtype(value.dtype, np.floating):
            problems.append(f"{name}: dtype {value.dtype}, expected a floating dtype")
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            bad = int(value.size - np.isfinite(value).sum())
            problems.append(f"{name}: {bad} non-finite value(s) (NaN or Inf)")
    if problems:
        raise WeightsError(f"{where} do not match the config:\n  " + "\n  ".join(problems))


def params_digest(params: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over names, dtypes, shapes and little-endian bytes, in sorted name order."""
    digest = hashlib.sha256()
    for name in sorted(params):
        value = np.ascontiguousarray(params[name])
        digest.update(name.encode("utf-8") + b"\0")
        digest.update(f"{value.dtype.newbyteorder('<').str}{list(value.shape)}".encode() + b"\0")
        digest.update(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
    return digest.hexdigest()


def params_under(params: Mapping[str, np.ndarray], prefix: str) -> Mapping[str, np.ndarray]:
    """The parameters below one module, names relative to it:
    params_under(p, "encoder.layers.0.ffn") -> {"w1.weight": ..., "w1.bias": ..., ...}.
    A mapping that makes its tensors as they are read (impl_numpy.cast.CastOnRead) gives its own
    view instead, so that taking a module's parameters reads none of them."""
    if hasattr(params, "under"):
        return params.under(prefix)
    start = prefix + "."
    return {name[len(start):]: value for name, value in params.items() if name.startswith(start)}
