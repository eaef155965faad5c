"""The spec's Transformer in PyTorch (see model.py). Imports only spec, never another backend."""

from impl_torch.model import (
    ACTIVATIONS,
    ATTENTION_PATHS,
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    Head,
    KVCache,
    MultiHeadAttention,
    Norm,
    Stack,
    Transformer,
    compiled_step,
    decode_step,
    greedy_generate,
    layer_norm,
    merge_heads,
    residual,
    rms_norm,
    scaled_dot_product_attention,
    sinusoidal_table,
    smoothed_targets,
    softmax,
    split_heads,
    start_cache,
    std_norm,
    token_cross_entropy,
    token_embedding,
    view_mask,
)

__all__ = [name for name in dir() if not name.startswith("_") and name != "model"]
