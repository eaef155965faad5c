"""Validation of what callers hand a model: token ids, masks, activations, lengths.

Every backend calls these before its framework sees the input, so the same bad input gets the
same InputError and message everywhere. They only read ``.shape``, ``.dtype`` and min/max, so
they accept NumPy, PyTorch and JAX arrays alike.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from spec.config import ModelConfig
from spec.errors import InputError


def dtype_name(x: Any) -> str:
    """'int64', 'bool', 'float32', 'bfloat16'... for a NumPy, PyTorch or JAX array."""
    return str(getattr(x, "dtype", type(x).__name__)).rsplit(".", 1)[-1]


def is_integer_dtype(name: str) -> bool:
    return name.startswith(("int", "uint"))


def is_float_dtype(name: str) -> bool:
    return name.startswith(("float", "bfloat"))


def _shape(x: Any, name: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise InputError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(int(n) for n in x.shape)


def check_token_ids(ids: Any, vocab_size: int, name: str = "ids") -> tuple[int, int]:
    """Token ids must be an integer array [batch, length], batch >= 1, length >= 1, every id in
    [0, vocab_size). Returns (batch, length)."""
    shape = _shape(ids, name)
    kind = dtype_name(ids)
    if not is_integer_dtype(kind):
        raise InputError(f"{name} must hold integer token ids, got dtype {kind}")
    if len(shape) != 2:
        raise InputError(f"{name} must have shape [batch, length] (rank 2), got shape {list(shape)}")
    if shape[0] == 0:
        raise InputError(f"{name} is an empty batch (shape {list(shape)}); batch must be at least 1")
    if shape[1] == 0:
        raise InputError(f"{name} has zero-length sequences (shape {list(shape)}); length must be at least 1")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InputError(f"{name} contains token id {bad}, outside the vocabulary [0, {vocab_size})")
    return shape[0], shape[1]


def check_positions(cfg: ModelConfig, length: int, offset: int = 0, name: str = "ids") -> None:
    """Learned positions exist for 0..max_len-1 only; sinusoidal positions are defined for any
    position (SPEC.md §5), so only learned positions limit the length."""
    if offset < 0:
        raise InputError(f"{name}: position offset must be non-negative, got {offset}")
    if cfg.positional == "learned" and offset + length > cfg.max_len:
        raise InputError(
            f"{name} reaches position {offset + length - 1}, past the learned position table "
            f"(max_len {cfg.max_len}: positions 0..{cfg.max_len - 1})"
        )


def check_same_batch(src_batch: int, tgt_batch: int) -> None:
    if src_batch != tgt_batch:
        raise InputError(f"src_ids and tgt_ids batch sizes differ: {src_batch} vs {tgt_batch}")


def check_activations(x: Any, name: str, d_model: int, rank: int = 3) -> tuple[int, ...]:
    """A float array whose last axis is d_model, e.g. [batch, length, d_model]."""
    shape = _shape(x, name)
    kind = dtype_name(x)
    if not is_float_dtype(kind):
        raise InputError(f"{name} must be a floating-point array, got dtype {kind}")
    if len(shape) != rank or shape[-1] != d_model:
        raise InputError(f"{name} must have shape [batch, length, {d_model}], got {list(shape)}")
    return shape


def mask_shape_4d(
    mask: Any, batch: int, heads: int, q_len: int, k_len: int, name: str = "mask"
) -> tuple[int, int, int, int]:
    """Check a boolean keep-mask (True = may attend) and give the 4-D shape to view it as.

    Accepted (SPEC.md §6): [K], [Q, K], [B, Q, K], [B, H, Q, K]; any axis but K may be 1 and
    then broadcasts. The result is [B|1, H|1, Q|1, K].
    """
    shape = _shape(mask, name)
    kind = dtype_name(mask)
    if kind != "bool":
        raise InputError(
            f"{name} must be a boolean keep-mask (True = may attend), got dtype {kind}; "
            "additive float masks are not accepted because their polarity is ambiguous"
        )
    if not 1 <= len(shape) <= 4:
        raise InputError(f"{name} must have rank 1 to 4 ([K], [Q,K], [B,Q,K], [B,H,Q,K]), got shape {list(shape)}")
    full = (1,) * (4 - len(shape)) + shape
    if len(shape) == 3:  # [B, Q, K]: no head axis
        full = (shape[0], 1, shape[1], shape[2])
    wanted = (batch, heads, q_len, k_len)
    for axis, (got, want) in enumerate(zip(full, wanted)):
        if got != want and not (got == 1 and axis < 3):
            raise InputError(
                f"{name} of shape {list(shape)} does not fit attention of shape "
                f"[batch {batch}, heads {heads}, queries {q_len}, keys {k_len}]"
            )
    return full  # type: ignore[return-value]


# ---- the checks of one model call, shared by every implementation ----------------------------

def check_model_inputs(cfg: ModelConfig, src_ids: Any, tgt_ids: Any, tgt_offset: int = 0) -> None:
    """A teacher-forced call: ids of both sides, their lengths, and equal batches."""
    if cfg.has_encoder:
        if src_ids is None:
            raise InputError("an encoder-decoder model needs src_ids")
        src_batch, src_length = check_token_ids(src_ids, cfg.src_vocab_size, "src_ids")
        check_positions(cfg, src_length, 0, "src_ids")
    elif src_ids is not None:
        raise InputError("a decoder-only model takes no src_ids (pass None)")
    tgt_batch, tgt_length = check_token_ids(tgt_ids, cfg.tgt_vocab_size, "tgt_ids")
    check_positions(cfg, tgt_length, tgt_offset, "tgt_ids")
    if cfg.has_encoder:
        check_same_batch(src_batch, tgt_batch)


def check_targets(cfg: ModelConfig, targets: Any, tgt_ids: Any) -> None:
    """The loss's target ids: token ids shaped like the decoder's inputs (pad_id = no target)."""
    check_token_ids(targets, cfg.tgt_vocab_size, "targets")
    if _shape(targets, "targets") != _shape(tgt_ids, "tgt_ids"):
        raise InputError(f"targets must be shaped like tgt_ids {list(_shape(tgt_ids, 'tgt_ids'))}, "
                         f"got {list(_shape(targets, 'targets'))}")


def check_source(cfg: ModelConfig, src_ids: Any, batch: int | None = None) -> int:
    """Source ids for an encoder (a cache's cross-attention); returns the batch."""
    src_batch, src_length = check_token_ids(src_ids, cfg.src_vocab_size, "src_ids")
    check_positions(cfg, src_length, 0, "src_ids")
    if batch is not None:
        check_same_batch(src_batch, batch)
    return src_batch


def check_keep(keep: Any, ids: Any, name: str) -> None:
    """An explicit keep-vector (True = real token) must be boolean and shaped like its ids."""
    shape = _shape(keep, name)
    if dtype_name(keep) != "bool" or shape != tuple(int(n) for n in ids.shape):
        raise InputError(f"{name} must be a boolean array of shape {list(ids.shape)}, got "
                         f"{dtype_name(keep)} {list(shape)}")


def check_decode_step(cfg: ModelConfig, tgt_ids: Any, cache_length: int, cache_batch: int) -> None:
    """The next tokens fed after `cache_length` cached ones."""
    batch, length = check_token_ids(tgt_ids, cfg.tgt_vocab_size, "tgt_ids")
    check_positions(cfg, length, cache_length, "tgt_ids")
    if batch != cache_batch:
        raise InputError(f"tgt_ids batch {batch} differs from the cache's {cache_batch}")


def check_cache_capacity(cfg: ModelConfig, capacity: Any) -> int:
    """A preallocated KV cache's capacity: a positive number of positions, cut to the table's
    max_len where positions are learned (positions past the table are refused at decode time)."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise InputError(f"cache capacity must be a positive integer (positions), got {capacity!r}")
    return min(int(capacity), cfg.max_len) if cfg.positional == "learned" else int(capacity)


def check_cache_room(capacity: int, length: int, n_new: int) -> None:
    """n_new more positions after `length` must fit a preallocated cache of `capacity`."""
    if length + n_new > capacity:
        raise InputError(f"the cache holds {capacity} positions; {length} are used and {n_new} more do not "
                         f"fit (start the cache with a larger capacity)")


class CacheWrites:
    """Which caches over one set of buffers written in place are still whole (impl_torch's
    preallocated cache, the onnxruntime runner's pair of buffers). A cache stays valid while it is
    the newest one or an ancestor of it: continuing an ancestor rewrites only the positions after
    its length (a rewind). A cache left on another branch would read positions since
    overwritten, so using it is refused, never silently wrong."""

    def __init__(self):
        self.chain, self.issued = [0], 0  # versions from the empty cache to the newest, increasing

    def check(self, version: int) -> None:
        at = bisect.bisect_left(self.chain, version)
        if at == len(self.chain) or self.chain[at] != version:
            raise InputError("this cache's buffers were since written by a decode step from another branch "
                             "(decode_step writes in place): copy() a cache before continuing it two ways")

    def advance(self, version: int) -> int:
        """The version of the cache a step from `version` makes; later versions are dropped."""
        self.issued += 1
        del self.chain[bisect.bisect_right(self.chain, version):]
        self.chain.append(self.issued)
        return self.issued


def check_generation(cfg: ModelConfig, src_ids: Any, prompt_ids: Any, bos_id: Any, max_new_tokens: Any) -> tuple[int, int]:
    """Greedy generation's arguments (SPEC.md §7); returns (batch, length of the first chunk fed)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if cfg.has_encoder:
        if isinstance(bos_id, bool) or not isinstance(bos_id, int) or not 0 <= bos_id < cfg.tgt_vocab_size:
            raise InputError(f"an encoder-decoder model needs bos_id inside the target vocabulary, got {bos_id!r}")
        batch, first_length = check_source(cfg, src_ids), 1
    else:
        if prompt_ids is None or src_ids is not None:
            raise InputError("a decoder-only model generates from prompt_ids (and takes no src_ids)")
        batch, first_length = check_token_ids(prompt_ids, cfg.tgt_vocab_size, "prompt_ids")
    check_positions(cfg, first_length + max_new_tokens - 1, 0, "generated sequence")
    return batch, first_length
