import numpy as np
import pytest

from spec import InputError, causal_mask, combine_masks, decoder_self_mask, normalize_mask, padding_mask
from spec.inputs import check_activations, mask_shape_4d


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
