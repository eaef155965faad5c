"""The probe's backward rows (issue 25): each measures on the CPU, and its verdict says NaN where a
planted gradient holds NaN and zero where it is exactly zero."""

import warnings

import numpy as np
import pytest

from pages.probe import (BACKWARD_KEEP, MASKED_ROW, PROBES, _gradient_verdict, _masked_row_backward_verdict,
                               _masked_row_gradients, _observe, _refusal, probe_devices)

BACKWARD = [p for p in PROBES if p.topic == "fully masked row, backward"]


@pytest.fixture(scope="module")
def observed():
    """Every backward probe on the CPU, and on cuda (which says whether it is there)."""
    return {(probe.primitive, device): _observe(probe, device) for probe in BACKWARD for device in ("cpu", "cuda")}


def test_there_is_a_backward_row_per_primitive():
    assert {p.primitive for p in BACKWARD} == {
        "torch F.scaled_dot_product_attention, each backend", "torch.softmax after masked_fill(-inf)",
        "jax.nn.dot_product_attention", "jax.nn.softmax(where=mask)", "jax.nn.softmax after jnp.where(mask, x, -inf)"}
    assert all(p.per_device and p.spec == "zeros, no NaN" for p in BACKWARD)


@pytest.mark.parametrize("primitive", [p.primitive for p in BACKWARD])
def test_each_backward_probe_measures_on_the_cpu(observed, primitive):
    result = observed[primitive, "cpu"]
    assert result and not result.startswith(("error", "not installed", "no ")), result
    assert "other rows" in result  # the control: what the rows that do attend pull back


def test_the_cpu_observations_of_the_pinned_versions(observed):
    """What torch 2.13 and jax 0.10 do: if a release changes one, update docs/framework-notes.md."""
    sdpa = observed["torch F.scaled_dot_product_attention, each backend", "cpu"]
    assert sdpa.startswith("math: zeros (other rows finite)")
    assert {part.split(":")[0] for part in sdpa.split("; ")} == {"math", "efficient", "flash", "cudnn"}
    assert "dv NaN" in observed["torch.softmax after masked_fill(-inf)", "cpu"]  # pytorch #41508
    assert "dv NaN" in observed["jax.nn.softmax after jnp.where(mask, x, -inf)", "cpu"]  # jax #17117
    assert observed["jax.nn.softmax(where=mask)", "cpu"] == "zeros (other rows finite)"


def test_cuda_rows_say_when_there_is_no_gpu(observed):
    if probe_devices()[1:]:
        pytest.skip("a GPU driver is present: the cuda rows measure")
    assert all(observed[p.primitive, "cuda"].startswith("no cuda device for") for p in BACKWARD)


# ---- planted gradients ------------------------------------------------------------------------

def test_the_gradient_verdict_names_nan_inf_zero_and_size():
    assert _gradient_verdict(np.array([0.0, np.nan, 1.0])) == "NaN"
    assert _gradient_verdict(np.array([0.0, -np.inf])) == "inf"
    assert _gradient_verdict(np.zeros((3, 4), np.float32)) == "zero"
    assert _gradient_verdict(np.array([0.0, -0.25, 1e-30])) == "nonzero up to 2.5e-01"  # tiny is not zero


def test_the_row_verdict_says_zeros_only_when_every_gradient_is_zero():
    zero, nan = np.zeros(4), np.full(4, np.nan)
    assert _masked_row_backward_verdict({"dq": zero, "dk": zero, "dv": zero},
                                        {"dq": zero, "dk": zero, "dv": zero}) == "zeros (other rows finite)"
    assert _masked_row_backward_verdict({"dq": zero, "dk": zero, "dv": nan},
                                        {"dq": zero, "dk": zero, "dv": nan}) \
        == "dq zero, dk zero, dv NaN (other rows give dv NaN)"


def test_the_two_cotangents_are_split_at_the_masked_row():
    """A planted vjp that hands the cotangent back as dq: the masked row's pass sees only that
    row's cotangent, the other rows' pass never sees it."""
    seen = []

    def vjp(cotangent):
        seen.append(cotangent)
        return cotangent, np.zeros_like(cotangent), np.zeros_like(cotangent)

    assert _masked_row_gradients(vjp).startswith("dq nonzero up to")
    on_row, on_others = seen
    others = np.arange(BACKWARD_KEEP.shape[0]) != MASKED_ROW
    assert not BACKWARD_KEEP[MASKED_ROW].any() and BACKWARD_KEEP[others].any(axis=1).all()
    assert on_row[MASKED_ROW].all() and not on_row[others].any()
    assert not on_others[MASKED_ROW].any() and on_others[others].all()
    assert _masked_row_gradients(lambda c: (c * np.nan,) * 3) == \
        "dq NaN, dk NaN, dv NaN (other rows give dq NaN, dk NaN, dv NaN)"


def test_a_refusal_is_one_short_sentence():
    error = RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely due to x.")
    assert _refusal(error) == "refused (RuntimeError: No viable backend for scaled_dot_product_attention was found)"


def test_a_refusal_prefers_the_warning_that_gives_the_reason():
    """As torch's CUDA kernels decline: a heading warning, the reason, then 'No available kernel'."""
    warned = [warnings.WarningMessage(text, UserWarning, "sdp_utils.cpp", 1) for text in (
        "Flash attention kernel not used because:",
        "Flash attention does not support non-null attn_mask. (Triggered internally at sdp_utils.cpp:1)")]
    assert _refusal(RuntimeError("No available kernel. Aborting execution."), warned) \
        == "refused (RuntimeError: Flash attention does not support non-null attn_mask.)"
