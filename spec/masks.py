"""Mask semantics (SPEC.md §6): boolean keep-masks, True = may attend, combined by AND.

All helpers return arrays that broadcast against attention scores [B, H, Q, K].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spec.inputs import mask_shape_4d


def padding_mask(ids: np.ndarray, pad_id: int) -> np.ndarray:
    """Keys that are real tokens: [B, K] ids -> [B, 1, 1, K]."""
    return key_mask(np.asarray(ids) != pad_id)


def start_is_real(cfg: Any, side: str, offset: int = 0) -> bool:
    """Whether position 0 of these ids is an encoder-decoder's start token, which always counts as
    a real token whatever its id (SPEC.md §6: Marian starts decoding with the pad token)."""
    return cfg.has_encoder and side == "tgt" and offset == 0


def real_tokens(cfg: Any, ids: np.ndarray, side: str, offset: int = 0) -> np.ndarray:
    """Which tokens are real [B, L]: id != pad_id, except an encoder-decoder's target position 0
    (the start token), which is always real. side 'src' | 'tgt'; offset = the first id's position."""
    keep = np.asarray(ids) != cfg.pad_id
    if start_is_real(cfg, side, offset):
        keep[:, 0] = True
    return keep


def key_mask(keep: np.ndarray) -> np.ndarray:
    """A per-token keep vector [B, K] (True = real token) as an attention mask [B, 1, 1, K]."""
    keep = np.asarray(keep, dtype=bool)
    return keep[:, None, None, :]


def causal_mask(q_len: int, k_len: int | None = None, offset: int | None = None,
                window: int | None = None) -> np.ndarray:
    """Query i (at absolute position offset + i) may attend key j iff j <= offset + i, and, with a
    sliding window of W keys, offset + i - W < j: [1, 1, Q, K].

    By default the queries are the last q_len of k_len positions (offset = k_len - q_len), which
    is the incremental-decoding case; q_len == k_len gives the usual lower triangle."""
    k_len = q_len if k_len is None else k_len
    offset = k_len - q_len if offset is None else offset
    query_positions = offset + np.arange(q_len)[:, None]
    key_positions = np.arange(k_len)[None, :]
    keep = key_positions <= query_positions
    if window is not None:
        keep &= key_positions > query_positions - window  # the last W positions, the query's own included
    return keep[None, None]


def combine_masks(*masks: np.ndarray | None) -> np.ndarray | None:
    """AND of the given masks (None means 'no restriction'); None if all are None."""
    present = [np.asarray(m, dtype=bool) for m in masks if m is not None]
    if not present:
        return None
    combined = present[0]
    for mask in present[1:]:
        combined = np.logical_and(combined, mask)
    return combined


def normalize_mask(mask: Any, batch: int, heads: int, q_len: int, k_len: int, name: str = "mask") -> np.ndarray | None:
    """Validate a user keep-mask and view it as [B|1, H|1, Q|1, K] (None stays None)."""
    if mask is None:
        return None
    return np.asarray(mask).reshape(mask_shape_4d(mask, batch, heads, q_len, k_len, name))


# ---- the masks each part of the model uses --------------------------------------------------

def encoder_self_mask(src_keep: np.ndarray) -> np.ndarray:
    """Encoder self-attention: every query may attend every real source token. [B, 1, 1, S]"""
    return key_mask(src_keep)


def decoder_self_mask(tgt_keep: np.ndarray, q_len: int | None = None, window: int | None = None) -> np.ndarray:
    """Decoder self-attention: causal (within the last `window` positions, where the config has a
    sliding window) AND real target tokens. tgt_keep [B, K] covers every key (cached ones too); the
    queries are the last q_len positions. [B, 1, Q, K]"""
    k_len = np.shape(tgt_keep)[1]
    return combine_masks(causal_mask(q_len or k_len, k_len, window=window), key_mask(tgt_keep))


def cross_mask(src_keep: np.ndarray) -> np.ndarray:
    """Cross-attention: every decoder query may attend every real source token. [B, 1, 1, S]"""
    return key_mask(src_keep)
