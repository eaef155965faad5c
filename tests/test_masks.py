import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import impl_numpy as golden
from spec import (ConfigError, InputError, causal_mask, combine_masks, conformance_params, decoder_self_mask,
                  get_preset, normalize_mask, padding_mask)
from spec.inputs import check_activations, mask_shape_4d
from tests.bounds import assert_agrees, assert_differs, model_bounds


def test_padding_mask_marks_real_keys():
    mask = padding_mask(np.array([[5, 6, 0], [0, 7, 0]]), pad_id=0)
    assert mask.shape == (2, 1, 1, 3)
    assert mask[:, 0, 0].tolist() == [[True, True, False], [False, True, False]]


def test_causal_mask_lower_triangle_and_offset():
    assert causal_mask(3)[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    step = causal_mask(1, 4)  # one new query after 3 cached positions sees all 4 keys
    assert step.shape == (1, 1, 1, 4) and step.all()
    chunk = causal_mask(2, 5)[0, 0]
    assert chunk.tolist() == [[True, True, True, True, False], [True] * 5]


def test_a_sliding_window_of_w_keys_includes_the_querys_own():
    """SPEC §6: i − W < j ≤ i. W = 2 over 4 positions: each query sees itself and the one before."""
    rows = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert causal_mask(4, window=2)[0, 0].astype(int).tolist() == rows
    assert causal_mask(1, 6, window=3)[0, 0, 0].tolist() == [False, False, False, True, True, True]


@given(q_len=st.integers(1, 9), cached=st.integers(0, 9), window=st.integers(1, 12))
def test_the_window_is_the_last_w_positions_up_to_each_query(q_len, cached, window):
    k_len = q_len + cached
    mask = causal_mask(q_len, k_len, window=window)[0, 0]
    for i in range(q_len):
        position = cached + i
        assert [j for j in range(k_len) if mask[i, j]] == list(range(max(0, position - window + 1), position + 1))
    if window >= k_len:  # a window as long as the sequence hides nothing causal attention shows
        assert (mask == causal_mask(q_len, k_len)[0, 0]).all()


def test_the_decoder_mask_keeps_the_window_and_the_padding():
    keep = np.array([[False, True, True, True, True]])
    assert decoder_self_mask(keep, window=2)[0, 0].astype(int).tolist() == [
        [0, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def test_a_window_is_a_decoder_only_models_and_positive():
    cfg = get_preset("mistral-tiny")
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer or null, got 0"):
        cfg.replace(sliding_window=0)
    with pytest.raises(ConfigError, match="sliding_window restricts a decoder-only model's self-attention"):
        get_preset("tiny").replace(sliding_window=4)


def test_the_golden_decodes_a_windowed_model_as_its_forward():
    """Steps of one, then a chunk, after the window has moved past the first keys: the cache holds
    every position and each step's mask hides the keys before its window (SPEC §6, §7)."""
    cfg = get_preset("mistral-tiny")
    params = conformance_params(cfg)
    ids = np.random.default_rng(3).integers(1, cfg.tgt_vocab_size, (2, 11))
    ids[1, :2] = cfg.pad_id
    keep = ids != cfg.pad_id
    want = golden.forward(cfg, params, None, ids, tgt_keep=keep)
    p = golden.cast_params(cfg, params)
    cache, got = golden.start_cache(cfg, p, 2), []
    for begin, end in ((0, 3), (3, 4), (4, 5), (5, 11)):
        logits, cache = golden.decode_step(cfg, p, cache, ids[:, begin:end], keep[:, begin:end])
        got.append(logits)
    assert_agrees(np.concatenate(got, axis=1), want, **model_bounds(cfg, 11))
    # without the window: the same logits while every key is in it (positions 0-3 of a window of 4), others after
    plain = golden.forward(cfg.replace(sliding_window=None), params, None, ids, tgt_keep=keep)
    assert_differs(plain[:, 4:], want[:, 4:], **model_bounds(cfg, 11))
    assert_agrees(plain[:, :4], want[:, :4], **model_bounds(cfg, 11))


def test_combine_is_and_and_none_is_no_restriction():
    a = np.array([True, False, True])
    b = np.array([[True, True, False]])
    assert combine_masks(a, None, b).tolist() == [[True, False, False]]
    assert combine_masks(None, None) is None


def test_decoder_self_mask():
    keep = np.array([[False, True, True]])  # a left-padded target
    mask = decoder_self_mask(keep)[0, 0]
    assert mask.tolist() == [[False, False, False], [False, True, False], [False, True, True]]


@pytest.mark.parametrize("shape, expected", [
    ((5,), (1, 1, 1, 5)),
    ((4, 5), (1, 1, 4, 5)),
    ((2, 4, 5), (2, 1, 4, 5)),
    ((2, 1, 4, 5), (2, 1, 4, 5)),
    ((2, 3, 4, 5), (2, 3, 4, 5)),
    ((1, 1, 1, 5), (1, 1, 1, 5)),
    ((2, 1, 1, 5), (2, 1, 1, 5)),
])
def test_accepted_mask_shapes(shape, expected):
    mask = np.ones(shape, bool)
    assert mask_shape_4d(mask, 2, 3, 4, 5) == expected
    assert normalize_mask(mask, 2, 3, 4, 5).shape == expected


@pytest.mark.parametrize("mask, message", [
    (np.ones((4, 6), bool), "does not fit"),
    (np.ones((3, 4, 5), bool), "does not fit"),
    (np.ones((2, 2, 4, 5), bool), "does not fit"),
    (np.ones((2, 3, 4, 1), bool), "does not fit"),  # the key axis never broadcasts
    (np.ones((1, 2, 3, 4, 5), bool), "rank 1 to 4"),
    (np.ones((4, 5), np.float32), "boolean keep-mask"),
    (np.zeros((4, 5), np.int64), "boolean keep-mask"),
    ([[True]], "must be an array"),
])
def test_refused_masks(mask, message):
    with pytest.raises(InputError, match=message):
        mask_shape_4d(mask, 2, 3, 4, 5)


def test_activation_checks():
    check_activations(np.zeros((2, 3, 8), np.float32), "x", 8)
    with pytest.raises(InputError, match=r"shape \[batch, length, 8\]"):
        check_activations(np.zeros((2, 3, 7), np.float32), "x", 8)
    with pytest.raises(InputError, match="floating-point"):
        check_activations(np.zeros((2, 3, 8), np.int32), "x", 8)
