import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from spec import (
    FORMAT_VERSION,
    WeightsError,
    get_preset,
    init_params,
    load_weights,
    params_digest,
    save_weights,
)
from pages.refusals import changed_tensors, weights_metadata

TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def params():
    return init_params(TINY)


@pytest.fixture
def weights_file(tmp_path, params):
    path = tmp_path / "tiny.safetensors"
    save_weights(path, TINY, params)
    return path


def test_round_trip_is_bit_exact(weights_file, params):
    cfg, loaded = load_weights(weights_file)
    assert cfg == TINY
    assert params_digest(loaded) == params_digest(params)
    assert all(loaded[k].dtype == np.float32 and np.array_equal(loaded[k], params[k]) for k in params)


def test_expected_config_must_match(weights_file):
    load_weights(weights_file, expected_config=TINY)
    with pytest.raises(WeightsError, match="d_ff: file has 256, expected 128"):
        load_weights(weights_file, expected_config=TINY.replace(d_ff=128))


def _write_raw(path, tensors, metadata):
    save_file(tensors, str(path), metadata=metadata)


_metadata = weights_metadata  # the refusals catalogue's makers: one way to build a bad file
_tensors = changed_tensors


def test_missing_file(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        load_weights(tmp_path / "nope.safetensors")


def test_directory(tmp_path):
    with pytest.raises(WeightsError, match="not a regular file"):
        load_weights(tmp_path)


@pytest.mark.parametrize("content, message", [
    (b"", "only 0 bytes"),
    (b"\x01\x02", "only 2 bytes"),
    (b"PK\x03\x04" + b"\0" * 60, "not a safetensors file"),  # a zip (a torch .pt) file
    (struct.pack("<Q", 10) + b"{not json!", "not valid JSON"),
    (struct.pack("<Q", 6) + b"[1, 2]", "not a JSON object"),
    (struct.pack("<Q", 2) + b"{}", "no metadata"),
])
def test_not_a_weights_file(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match=message):
        load_weights(path)


def test_truncated_file(weights_file):
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[:-100])
    with pytest.raises(WeightsError, match="truncated"):
        load_weights(weights_file)


def test_truncated_inside_header(weights_file):
    weights_file.write_bytes(weights_file.read_bytes()[:50])
    with pytest.raises(WeightsError, match="truncated"):
        load_weights(weights_file)


def test_corrupted_tensor_bytes(weights_file):
    data = bytearray(weights_file.read_bytes())
    data[-7] ^= 0x40
    weights_file.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="SHA-256|non-finite"):
        load_weights(weights_file)


@pytest.mark.parametrize("changes, message", [
    ({"tgt_embed__weight": None}, "missing: tgt_embed.weight"),
    ({"extra__weight": np.zeros(3, np.float32)}, "unexpected: extra.weight"),
    ({"encoder__layers__0__ffn__w1__weight": np.zeros((256, 64), np.float32)},
     r"encoder.layers.0.ffn.w1.weight: shape \[256, 64\], expected \[64, 256\]"),
    ({"decoder__layers__1__ffn_norm__scale": np.ones(64, np.float64)}, "dtype float64, expected float32"),
    ({"decoder__layers__1__ffn_norm__scale": np.ones(64, np.float16)}, "dtype float16, expected float32"),
    ({"decoder__layers__1__ffn_norm__scale": np.ones(64, np.int32)}, "dtype int32, expected float32"),
    ({"decoder__layers__1__ffn_norm__bias": np.full(64, np.nan, np.float32)}, "64 non-finite"),
    ({"decoder__layers__1__ffn_norm__bias": np.full(64, np.inf, np.float32)}, "non-finite"),
])
def test_bad_tensors_are_refused(tmp_path, params, changes, message):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, _tensors(params, **changes), _metadata())
    with pytest.raises(WeightsError, match=message):
        load_weights(path)


def test_every_offender_is_listed_at_once(tmp_path, params):
    path = tmp_path / "bad.safetensors"
    tensors = _tensors(params, tgt_embed__weight=None, extra=np.zeros(1, np.float32),
                       encoder__layers__0__ffn__w1__bias=np.zeros(3, np.float32))
    _write_raw(path, tensors, _metadata())
    with pytest.raises(WeightsError) as error:
        load_weights(path)
    text = str(error.value)
    assert "missing: tgt_embed.weight" in text and "unexpected: extra" in text and "w1.bias: shape [3]" in text


@pytest.mark.parametrize("metadata, message", [
    (None, "no metadata"),
    (_metadata(format="something-else"), "'format' is 'something-else'"),
    (_metadata(format_version="two"), "'format_version' is 'two'"),
    (_metadata(format_version="0"), "not a valid version"),
    (_metadata(format_version=str(FORMAT_VERSION + 1)), f"version {FORMAT_VERSION + 1}.*Upgrade"),
    (_metadata(config=None), "no 'config'"),
    (_metadata(config="{broken"), "stored config is invalid.*not valid JSON"),
    (_metadata(config=json.dumps({**TINY.to_dict(), "n_heads": 5})), "stored config is invalid.*divisible"),
])
def test_bad_metadata_is_refused(tmp_path, params, metadata, message):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, dict(params), metadata)
    with pytest.raises(WeightsError, match=message):
        load_weights(path)


def test_config_that_does_not_match_the_tensors(tmp_path, params):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, dict(params), _metadata(TINY.replace(d_ff=128)))
    with pytest.raises(WeightsError, match=r"ffn.w1.weight: shape \[64, 256\], expected \[64, 128\]"):
        load_weights(path)


def test_save_refuses_bad_params_and_leaves_no_file(tmp_path, params):
    path = tmp_path / "out.safetensors"
    with pytest.raises(WeightsError, match="missing: tgt_embed.weight"):
        save_weights(path, TINY, _tensors(params, tgt_embed__weight=None))
    bad = _tensors(params, tgt_embed__weight=np.full((80, 64), np.nan, np.float32))
    with pytest.raises(WeightsError, match="non-finite"):
        save_weights(path, TINY, bad)
    assert list(tmp_path.iterdir()) == []


def test_save_into_missing_folder(tmp_path, params):
    with pytest.raises(WeightsError, match="does not exist"):
        save_weights(tmp_path / "no" / "w.safetensors", TINY, params)


def test_no_pickle_anywhere_in_the_source():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    forbidden = ["torch" + ".load(", "pickle" + ".load", "np" + ".load("]  # split so this file passes
    for path in root.glob("*/**/*.py"):
        if ".venv" in path.parts:
            continue
        text = path.read_text()
        assert not [word for word in forbidden if word in text], path
