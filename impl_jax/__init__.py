"""The spec's Transformer in JAX/Flax NNX (see model.py). Imports only spec, never another backend."""

from impl_jax.model import (
    ACTIVATIONS,
    ATTENTION_PATHS,
    DTYPES,
    PRECISIONS,
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    Head,
    KVCache,
    MultiHeadAttention,
    Norm,
    Stack,
    Transformer,
    decode_step,
    gelu,
    gelu_tanh,
    greedy_generate,
    layer_norm,
    merge_heads,
    residual,
    scaled_dot_product_attention,
    sinusoidal_table,
    softmax,
    split_heads,
    start_cache,
    std_norm,
    token_embedding,
    view_mask,
)

__all__ = [name for name in dir() if not name.startswith("_") and name != "model"]
