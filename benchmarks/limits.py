"""What a model costs (FLOPs counted from the config) and what the machine can do (measured in
the same run), so every timing can also be read as a fraction of the machine's limit.

Counting (multiply-adds × 2; B batch, S source length, T target length, P cached positions,
d = d_model, f = d_ff, V = target vocabulary, a = H·d_k the query heads' width, g = H_kv·d_k the
key/value heads' width (a = g = d in the paper's model); softmax, norms, rotations and embeddings
are not counted — they are O(d) per token against O(d²)):

    encoder layer, per source token:     2da + 2dg (Q,O and K,V) + 2aS (QKᵀ and weights·V) + F
    decoder layer, per target token:     2da + 2dg + 2aT (self-attention, full T×T as computed)
                                       + 2da + 2aS (cross-attention Q, O and its QKᵀ, ·V)
                                       + F
    decoder layer, per source token:     2dg (cross-attention K and V of the memory)
    head, per target token:              dV
    F, the feed-forward:                 2df, or 3df gated (gate, up and down)
    one cached decode step per sequence: the decoder terms with T = 1 and P + 1 keys, no memory K/V.
"""

from __future__ import annotations

import time

import numpy as np

from conformance.plan.cost import ffn_weights
from spec import ModelConfig


def _widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(a, g, F): the query heads' width, the key/value heads' width, the FFN's multiply-adds per token
    (conformance.plan.cost.ffn_weights: a mixture of experts' k experts and router)."""
    a, g = cfg.n_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
    return a, g, ffn_weights(cfg)


def forward_flops(cfg: ModelConfig, batch: int, src_len: int, tgt_len: int) -> float:
    d, v = cfg.d_model, cfg.tgt_vocab_size
    a, g, ffn = _widths(cfg)
    macs = cfg.n_encoder_layers * src_len * (2 * d * a + 2 * d * g + 2 * a * src_len + ffn)
    cross = (2 * d * a + 2 * a * src_len) if cfg.has_encoder else 0
    macs += cfg.n_decoder_layers * tgt_len * (2 * d * a + 2 * d * g + 2 * a * tgt_len + cross + ffn)
    if cfg.has_encoder:
        macs += cfg.n_decoder_layers * src_len * 2 * d * g
    macs += tgt_len * d * v
    return 2.0 * batch * macs


def decode_step_flops(cfg: ModelConfig, batch: int, past_len: int, src_len: int) -> float:
    d, v = cfg.d_model, cfg.tgt_vocab_size
    a, g, ffn = _widths(cfg)
    cross = (2 * d * a + 2 * a * src_len) if cfg.has_encoder else 0
    macs = cfg.n_decoder_layers * (2 * d * a + 2 * d * g + 2 * a * (past_len + 1) + cross + ffn) + d * v
    return 2.0 * batch * macs


def _best_seconds(function, repeats: int) -> float:
    function()  # warm-up: thread pools, first-touch pages
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops_per_second(dtype: str = "float32", size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """The best FLOP/s of a size×size matrix product, by NumPy's BLAS and by torch (MKL/oneDNN):
    the machine's practical compute limit for dense layers of this dtype on this CPU."""
    rate = {}
    a = np.random.default_rng(0).standard_normal((size, size)).astype(dtype)
    rate["numpy"] = 2 * size**3 / _best_seconds(lambda: a @ a, repeats)
    try:
        import torch

        t = torch.from_numpy(a)
        with torch.inference_mode():
            rate["torch"] = 2 * size**3 / _best_seconds(lambda: t @ t, repeats)
    except ImportError:
        pass
    return rate


def memory_bytes_per_second(megabytes: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth (bytes read + bytes written per second) of a large array: the limit of
    memory-bound work such as a decode step at small batch."""
    source = np.ones(megabytes * 2**20 // 8)
    target = np.empty_like(source)
    return 2 * source.nbytes / _best_seconds(lambda: np.copyto(target, source), repeats)


def cuda_matmul_flops_per_second(dtype: str, size: int = 8192, repeats: int = 10) -> float | None:
    """The GEMM limit on the GPU (torch), or None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    t = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype))

    def product():
        t @ t
        torch.cuda.synchronize()

    return 2 * size**3 / _best_seconds(product, repeats)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def streamed_bytes(cfg: ModelConfig, dtype: str = "float32", scheme=None) -> float:
    """The bytes of weights one decode step reads: every parameter but the embedding and position
    tables (a lookup reads a row per token; a tied head reads its table whole) at the dtype's width, and
    a scheme's quantized ones (spec.quantization.quantized_parameters) at their code width with a
    float32 scale per block of each column, and a zero-point code per block where not symmetric (a
    dynamic scheme: one scale per column, as CTranslate2's rows have; onnxruntime's one per tensor is
    a few bytes less). A mixture of experts' every expert is counted: a batch's tokens choose most of
    them."""
    from spec.params import param_shapes
    from spec.quantization import quantized_parameters

    shapes = param_shapes(cfg)
    quantized = quantized_parameters(cfg, scheme) if scheme is not None else {}
    total = 0.0
    for name, shape in shapes.items():
        lookup = name.endswith(("embed.weight", "pos.weight"))  # a row per token read
        head = cfg.tie_head and name == "tgt_embed.weight" and "head.weight" not in quantized
        if name in quantized or (lookup and not head):
            continue
        total += DTYPE_BYTES[dtype] * float(np.prod(shape))
    for name, bits in quantized.items():
        inputs, outputs = shapes["tgt_embed.weight"][::-1] if name not in shapes else shapes[name]
        blocks = 1 if scheme.dynamic else -(-inputs // scheme.block_size)
        zero_points = 0 if scheme.symmetric else outputs * blocks * bits / 8
        total += inputs * outputs * bits / 8 + 4 * outputs * blocks + zero_points
    return total


def generation_roofline(cfg: ModelConfig, batch: int, prompt: int, new_tokens: int, weight_bytes: float,
                        machine: dict) -> float:
    """The tokens/s greedy generation of `new_tokens` after a `prompt` could reach on this machine: each
    step (the prompt's forward the first) takes the slower of reading the weights once at the
    measured copy bandwidth and doing its FLOPs at the measured float32 matrix-product limit."""
    def seconds(flops: float) -> float:
        return max(weight_bytes / machine["copy_bytes_per_second"], flops / machine["matmul_float32_flops"])

    if cfg.has_encoder:  # the source encoded and the first token decoded, then one step per token
        total = seconds(forward_flops(cfg, batch, prompt, 1))
        total += sum(seconds(decode_step_flops(cfg, batch, step, prompt)) for step in range(1, new_tokens))
    else:
        total = seconds(forward_flops(cfg, batch, 0, prompt))
        total += sum(seconds(decode_step_flops(cfg, batch, prompt + step - 1, 0)) for step in range(1, new_tokens))
    return batch * new_tokens / total
