"""The golden's mixture-of-experts FFN (impl_numpy/model.py, its VJP in impl_numpy/backward.py)
against transformers' Mixtral and Qwen3-MoE blocks at float64, and its routing rules: ties to the lower index, margins, an expert no
token chose computes nothing, and where "softmax after top-k" is and is not the same model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.tolerance import tolerance
from impl_numpy.model import (mixture_of_experts, router_probabilities, routing_margins, routing_weights, softmax,
                               top_experts)
from tests.bounds import assert_agrees, assert_derivative, assert_differs, central_difference

D, D_FF, E, K, N = 24, 20, 6, 2, 40


def _experts(rng):
    return [{"w1.weight": rng.normal(0, 0.3, (D, D_FF)), "w3.weight": rng.normal(0, 0.3, (D, D_FF)),
             "w2.weight": rng.normal(0, 0.3, (D_FF, D))} for _ in range(E)]


@pytest.fixture
def model():
    rng = np.random.default_rng(0)
    return rng.normal(0, 1.0, (N, D)), rng.normal(0, 0.5, (D, E)), _experts(rng)


def _block_with(block, router, experts):
    """transformers' sparse block in float64 holding our router [d, E] and experts (its fused stacks:
    gate_up_proj [E, 2·d_ff, d] the gate's rows first, down_proj [E, d, d_ff])."""
    import torch

    block = block.double().eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(router.T))
        block.experts.gate_up_proj.copy_(torch.from_numpy(np.stack(
            [np.concatenate([p["w1.weight"].T, p["w3.weight"].T]) for p in experts])))
        block.experts.down_proj.copy_(torch.from_numpy(np.stack([p["w2.weight"].T for p in experts])))
    return block


@pytest.mark.parametrize("family, renormalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_the_golden_is_transformers_block_at_float64(model, family, renormalize):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    x, router, experts = model
    common = dict(hidden_size=D, intermediate_size=D_FF, moe_intermediate_size=D_FF, num_experts_per_tok=K,
                  hidden_act="silu")
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        config = transformers.MixtralConfig(num_local_experts=E, router_jitter_noise=0.0, **common)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        config = transformers.Qwen3MoeConfig(num_experts=E, norm_topk_prob=renormalize, **common)
    block = _block_with(Block(config), router, experts)
    with torch.no_grad():
        theirs = block(torch.from_numpy(x)[None]).numpy()[0]
    ours = mixture_of_experts(x, router, experts, K, renormalize, "swish")
    # transformers takes the router's softmax in float32 (Mixtral's .float(), Qwen3's dtype=float): its
    # probabilities are within float32's router tolerance (n = D) of ours, so no choice flips where every
    # margin is more than twice that
    assert routing_margins(router_probabilities(x, router), K).min() > 2 * tolerance("float32", D, 1)
    # and the block is within float32's tolerance of the ffn sublayer (n = max(D, D_FF)), relative to
    # the output's own size (above the policy's floor of 1)
    assert_agrees(theirs, ours, n=max(D, D_FF), dtype="float32")
    assert np.abs(ours).max() > 1.0


D_SHARED = 28


@pytest.mark.parametrize("family", ["qwen3_next", "qwen2_moe"])
def test_the_shared_expert_is_transformers_block_at_float64(model, family):
    """SPEC §5.14's shared expert: Σ_j w_j · FFN_top_j(x) + σ(x g) · FFN_shared(x), Qwen3-Next's and
    Qwen2-MoE's sparse block with its shared_expert and shared_expert_gate (renormalised as Qwen3-Next's
    norm_topk_prob; Qwen2-MoE's default leaves the k weights as they are)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from impl_numpy.model import experts_ffn, mixture_of_experts
    from spec import MixtureOfExperts, ModelConfig

    x, router, experts = model
    rng = np.random.default_rng(1)
    shared = {"w1.weight": rng.normal(0, 0.3, (D, D_SHARED)), "w3.weight": rng.normal(0, 0.3, (D, D_SHARED)),
              "w2.weight": rng.normal(0, 0.3, (D_SHARED, D))}
    gate = rng.normal(0, 0.5, (D, 1))
    renormalize = family == "qwen3_next"
    common = dict(hidden_size=D, moe_intermediate_size=D_FF, shared_expert_intermediate_size=D_SHARED,
                  num_experts=E, num_experts_per_tok=K, norm_topk_prob=renormalize, hidden_act="silu")
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block
        config = transformers.Qwen3NextConfig(**common)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        config = transformers.Qwen2MoeConfig(**common)
    block = _block_with(Block(config), router, experts)
    with torch.no_grad():
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            getattr(block.shared_expert, theirs).weight.copy_(torch.from_numpy(shared[f"{ours}.weight"].T))
        block.shared_expert_gate.weight.copy_(torch.from_numpy(gate.T))
        theirs = block(torch.from_numpy(x)[None]).numpy()[0]
    cfg = ModelConfig(arch="decoder-only", d_model=D, n_heads=4, d_ff=D_FF, n_decoder_layers=1, tgt_vocab_size=11,
                      max_len=16, norm="rmsnorm", norm_position="pre", positional="rope", activation="swish",
                      gated_ffn=True, bias=False, embed_scale=False,
                      moe=MixtureOfExperts(n_experts=E, experts_per_token=K, renormalize=renormalize,
                                           shared_expert_d_ff=D_SHARED))
    ffn = {"router.weight": router, "shared_expert_gate.weight": gate,
           **{f"experts.{e}.{name}": value for e, p in enumerate(experts) for name, value in p.items()},
           **{f"shared_expert.{name}": value for name, value in shared.items()}}
    ours = experts_ffn(cfg, ffn, x[None])[0]
    assert routing_margins(router_probabilities(x, router), K).min() > 2 * tolerance("float32", D, 1)
    assert_agrees(theirs, ours, n=max(D, D_FF, D_SHARED), dtype="float32")
    # the shared part is a good share of the output: without it the block is far from theirs
    assert_differs(theirs, mixture_of_experts(x, router, experts, K, renormalize, "swish"), n=max(D, D_SHARED),
                   dtype="float32")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=7), st.integers(1, 7))
def test_ties_go_to_the_lower_index_and_the_largest_come_first(levels, k):
    probabilities = np.asarray(levels, dtype=np.float64)[None]
    k = min(k, probabilities.shape[-1])
    chosen = top_experts(probabilities, k)[0]
    order = sorted(range(len(levels)), key=lambda expert: (-levels[expert], expert))
    assert list(chosen) == order[:k]


def test_margins_are_the_gap_past_the_kth_and_a_tie_has_none():
    probabilities = np.array([[0.4, 0.1, 0.3, 0.2], [0.3, 0.3, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]])
    assert np.allclose(routing_margins(probabilities, 2), [0.1, 0.1, 0.0])
    assert np.allclose(routing_margins(probabilities, 1), [0.1, 0.0, 0.0])
    assert np.allclose(routing_margins(probabilities, 4), [0.1, 0.2, 0.25])


def test_an_expert_no_token_chose_computes_nothing(model):
    x, router, experts = model
    x, router = np.abs(x), router.copy()
    router[:, 5] = -np.abs(router).max()  # positive tokens: expert 5's logit is below every other's
    assert 5 not in top_experts(router_probabilities(x, router), K)
    broken = [*experts[:5], {name: np.full_like(value, np.nan) for name, value in experts[5].items()}]
    assert np.array_equal(mixture_of_experts(x, router, broken, K, True, "swish"),
                          mixture_of_experts(x, router, experts, K, True, "swish"))


def test_softmax_after_top_k_is_mixtrals_model_and_not_qwen3_moes(model):
    """Renormalised top-k probabilities are the softmax of the top-k logits (the partition function
    cancels), so a port that takes the softmax after the top-k computes Mixtral exactly; without
    the renormalisation (Qwen3-MoE's norm_topk_prob false) it computes another model."""
    x, router, _ = model
    logits = x @ router
    probabilities = softmax(logits)
    chosen = top_experts(probabilities, K)
    after = softmax(np.take_along_axis(logits, chosen, axis=-1))
    # a softmax over the E experts: n = E
    assert_agrees(after, routing_weights(probabilities, chosen, renormalize=True), n=E)
    assert_differs(after, routing_weights(probabilities, chosen, renormalize=False), n=E)


def test_bad_arguments_are_refused_by_name(model):
    x, router, experts = model
    with pytest.raises(ValueError, match="k = 7 experts per token: there are 6"):
        top_experts(router_probabilities(x, router), 7)
    with pytest.raises(ValueError, match="the router scores 6 experts; 5 are given"):
        mixture_of_experts(x, router, experts[:5], K, True, "swish")


# ---- the backward pass ----------------------------------------------------------------------

def _loss(x, router, experts, renormalize, direction):
    return float((mixture_of_experts(x, router, experts, K, renormalize, "swish") * direction).sum())


STEP = 1e-6
# the rounding of ⟨MoE(x), direction⟩: the block, then the inner product's N·D terms (its longest sum)
ROUNDING = tolerance("float64", N * D, 2)


def _along(x, router, experts, renormalize, direction, value, index):
    """s ↦ ⟨MoE(x), direction⟩ with value[index] moved by s: value is x, the router or an expert's
    weights, changed in place and restored."""
    def moved(s):
        original = value[index]
        value[index] = original + s
        try:
            return _loss(x, router, experts, renormalize, direction)
        finally:
            value[index] = original
    return moved


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_vjp_is_central_differences_with_the_choices_held(model, renormalize):
    """∂ of ⟨MoE(x), g⟩ against central differences (h = 1e-6, and 2h for their truncation): the
    chosen experts do not change within 2h (every margin is far larger), so top-k is a constant
    there, as the VJP takes it."""
    from impl_numpy.backward import mixture_of_experts_vjp

    x, router, experts = model
    direction = np.random.default_rng(1).normal(size=x.shape)
    d_x, (d_router, _), expert_grads = mixture_of_experts_vjp(x, router, experts, K, renormalize, "swish", direction)
    rng = np.random.default_rng(2)
    for name, value, gradient in [("x", x, d_x), ("router", router, d_router),
                                  ("expert 3 w1", experts[3]["w1.weight"], expert_grads[3]["w1.weight"]),
                                  ("expert 0 w2", experts[0]["w2.weight"], expert_grads[0]["w2.weight"])]:
        for index in [tuple(rng.integers(0, size) for size in value.shape) for _ in range(6)]:
            assert_derivative(gradient[index], _along(x, router, experts, renormalize, direction, value, index), STEP,
                              ROUNDING, what=f"{name} {index}")
    # the router's gradient flows through the chosen weights: beyond rounding of zero (a gradient: twice the
    # block's depth; its longest sum over the N tokens)
    assert_differs(d_router, np.zeros_like(d_router), n=max(N, D, D_FF), depth=2)


def test_an_expert_no_token_chose_gets_a_zero_gradient(model):
    from impl_numpy.backward import mixture_of_experts_vjp

    x, router, experts = model
    x, router = np.abs(x), router.copy()
    router[:, 5] = -np.abs(router).max()
    used = set(top_experts(router_probabilities(x, router), K).ravel())
    assert 5 not in used and len(used) >= 2
    _, _, expert_grads = mixture_of_experts_vjp(x, router, experts, K, True, "swish", np.ones_like(x))
    for expert, grads in enumerate(expert_grads):
        assert all(gradient.any() == (expert in used) for gradient in grads.values()), expert


def test_central_differences_catch_a_vjp_that_forgets_the_renormalisation(model):
    """The check above can fail: the router's gradient of Mixtral taken as if unnormalised."""
    from impl_numpy.backward import mixture_of_experts_vjp

    x, router, experts = model
    direction = np.random.default_rng(1).normal(size=x.shape)
    _, (planted, _), _ = mixture_of_experts_vjp(x, router, experts, K, False, "swish", direction)
    index = (3, 2)
    numeric, bound = central_difference(_along(x, router, experts, True, direction, router, index), STEP, ROUNDING)
    assert abs(planted[index] - numeric) > bound  # assert_derivative fails on it
