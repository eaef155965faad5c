"""A weight-only quantized deployment judged twice (SPEC §15, export/quantize.py,
conformance/deployment/quantized.py): our float32 export quantized by onnxruntime's own MatMulNBitsQuantizer
agrees with the golden run on the weights it stores (the implementation reference), and what the
quantization cost against the float golden is measured; each planted mistake is caught by the
check it belongs to: a wrong reading of the layout by the implementation reference, a deployment
that stores otherwise than its scheme by the stored-weights check."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conformance.backends.numpy_backend import golden_output
from conformance.cases import build_case
from conformance.deployment.quantized import (QUANTIZED_CASES, Cost, GenerationCost, cost, format_quantized, generation_cost,
                                  judge_quantized, parse_budget, real_tokens, stored_as_scheme)
from conformance.tolerance import compare
from spec import conformance_params, get_preset
from spec.errors import WeightsError
from spec.quantization import QuantizationScheme
from tests.bounds import assert_agrees

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

import export.quantize as quantize  # noqa: E402
from export.cache import exported  # noqa: E402
from pages.quantized_mutations import (left_in_float, planted_deployment, scales_on_the_wrong_axis,  # noqa: E402
                                       weights_swapped, zero_point_off_by_one)

SCHEMES = {"int4-b32-sym": QuantizationScheme(4, 32, True), "int4-b32-zp-head8": QuantizationScheme(4, 32, False, 8),
           "int8-b128-sym": QuantizationScheme(8, 128, True)}


def _deployment(preset, scheme, tmp_path, plant=None):
    """(cfg, params, runner, deployed): the preset's quantized export (its quantized graphs passed
    through plant(float graph, quantized graph, params) first), served and read back."""
    cfg = get_preset(preset)
    params = conformance_params(cfg)
    planted = planted_deployment(cfg, params, scheme, tmp_path / scheme.name, plant)
    return cfg, params, planted.runner, planted.deployed


def _stored_cost(cfg, params, stored_cfg, stored_params, case_name):
    """The cost of the golden run on stored_params against the float golden, on a logits case: what
    quantization costs before any kernel computes it (both goldens in float64)."""
    sublayer, mask_case = case_name.split("-", 1)
    inputs = build_case(cfg, params, sublayer, mask_case).inputs
    return cost(golden_output(stored_cfg, stored_params, sublayer, inputs),
                golden_output(cfg, params, sublayer, inputs), real_tokens(cfg, sublayer, inputs))


def _assert_the_cost_is_the_stored_weights(cfg, params, deployed, cells):
    """A weight-only deployment costs what its stored weights cost, whatever the kernel's rounding:
    per logits cell, |KL(p‖q) − KL(p‖q′)| ≤ max_i |log q_i − log q′_i| ≤ 2·max|Δlogits| (log-softmax
    moves by at most twice the largest logit change), where q′ is the golden's on the stored weights
    and max|Δlogits| the cell's implementation max_abs_err; the KLs' own float64 rounding (about
    V·u·max|log p|, some 1e-13) is far below it. Each generation is the stored weights' tokens where
    the implementation accepted no near-tie. And quantizing the weights costs something: KL > 0."""
    for cell in cells:
        assert not cell.left_out, (cell.case, cell.left_out)  # every row computed: each cost is over all its tokens
        sublayer, mask_case = cell.case.split("-", 1)
        if isinstance(cell.cost, GenerationCost):
            inputs = build_case(cfg, params, sublayer, mask_case).inputs
            stored = generation_cost(golden_output(deployed.cfg, deployed.params, sublayer, inputs)[0],
                                     golden_output(cfg, params, sublayer, inputs)[0])
            assert cell.implementation.reason or cell.cost == stored, (cell.case, cell.cost, stored)
            continue
        stored = _stored_cost(cfg, params, deployed.cfg, deployed.params, cell.case)
        moved = 2 * cell.implementation.max_abs_err
        assert stored.kl_mean > 0, cell.case
        assert abs(cell.cost.kl_mean - stored.kl_mean) <= moved, (cell.case, cell.cost.kl_mean, stored.kl_mean, moved)
        assert abs(cell.cost.kl_max - stored.kl_max) <= moved, (cell.case, cell.cost.kl_max, stored.kl_max, moved)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_quantized_export_computes_the_golden_on_the_weights_it_stores(tmp_path, name):
    """llama-tiny at 4 bits (symmetric, and with zero points and an 8-bit head) and 8 bits: every
    cell within float32's tolerance of the golden on the dequantized weights, with SPEC §8's
    headroom (at most half of it; measured 0.03-0.09), the stored weights as the scheme says, and
    the cost measured: the stored weights' own, KL > 0, the kernel moving it by no more than its
    rounding allows."""
    scheme = SCHEMES[name]
    cfg, params, runner, deployed = _deployment("llama-tiny", scheme, tmp_path)
    cells = judge_quantized(cfg, params, scheme, runner, deployed)
    assert [cell.case for cell in cells] == list(QUANTIZED_CASES)
    for cell in cells:
        assert cell.implementation.passed, (cell.case, cell.implementation)
        assert cell.implementation.ratio < 0.5  # SPEC §8: a correct implementation stays within half its tolerance
    assert stored_as_scheme(cfg, scheme, deployed) == []
    assert set(deployed.stored) == {n for n in params if n.endswith(".weight") and params[n].ndim == 2
                                    and "embed" not in n and (scheme.head_bits or n != "head.weight")}
    logits = [cell.cost for cell in cells if isinstance(cell.cost, Cost)]
    assert len(logits) == 5 and all(spent.tokens > 0 and 0 <= spent.top1 <= 1 for spent in logits)
    _assert_the_cost_is_the_stored_weights(cfg, params, deployed, cells)
    generations = [cell.cost for cell in cells if isinstance(cell.cost, GenerationCost)]
    # the stored weights' tokens (float64 goldens on exact data): 8 bits keeps the float golden's here, 4 parts at once
    assert len(generations) == 2
    assert all((spent.first_parted is None) == (scheme.bits == 8) for spent in generations), generations


def test_a_tied_head_quantized_is_a_head_of_its_own(tmp_path):
    """qwen2-tiny ties its head to the embedding: quantized at 8 bits, the head is read back as a
    head.weight of its own (the embedding stays float) and the golden runs untied on it."""
    scheme = QuantizationScheme(4, 32, True, head_bits=8)
    cfg, params, runner, deployed = _deployment("qwen2-tiny", scheme, tmp_path)
    assert cfg.tie_head and not deployed.cfg.tie_head
    assert deployed.stored["head.weight"].bits == 8 and "tgt_embed.weight" not in deployed.stored
    assert np.array_equal(deployed.params["tgt_embed.weight"], params["tgt_embed.weight"])
    cells = judge_quantized(cfg, params, scheme, runner, deployed, cases=("forward-pad_right",))
    assert cells[0].implementation.passed and stored_as_scheme(cfg, scheme, deployed) == []


def _swap_nibbles(weight):
    return dataclasses.replace(weight, codes=((weight.codes & 0x0F) << 4) | (weight.codes >> 4))


@pytest.mark.parametrize("misreading", [_swap_nibbles, zero_point_off_by_one, scales_on_the_wrong_axis],
                         ids=["nibbles swapped", "zero point off by one", "scales on the wrong axis"])
def test_a_wrong_reading_of_the_layout_fails_the_implementation_reference(tmp_path, monkeypatch, misreading):
    """The golden's reading of what the graph stores, planted wrong in every weight: the kernel's
    logits are then beyond float32's tolerance of the golden's (llama-tiny, int4 symmetric; blocks of
    16 so that each column holds several blocks, for the scales to have an axis to be read along
    wrongly)."""
    dequantize = quantize.dequantize
    monkeypatch.setattr(quantize, "dequantize", lambda weight: dequantize(misreading(weight)))
    scheme = QuantizationScheme(4, 16, True)
    cfg, params, runner, deployed = _deployment("llama-tiny", scheme, tmp_path)
    cell, = judge_quantized(cfg, params, scheme, runner, deployed, cases=("forward-none",))
    assert not cell.implementation.passed, cell.implementation.ratio


def test_a_deployment_that_stores_otherwise_than_its_scheme_is_named(tmp_path):
    """A layer left in float, a head at 4 bits where the scheme says 8, and two layers' weights
    swapped: each named by the stored-weights check (the swap is not the implementation reference's
    to see: the kernel computes what the golden reads; the cost sees it: above the right
    deployment's, and its logits beyond float32's tolerance of the right deployment's)."""
    scheme = QuantizationScheme(4, 32, True, head_bits=8)
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    w1, w3 = "decoder.layers.1.ffn.w1.weight", "decoder.layers.1.ffn.w3.weight"

    _, _, _, deployed = _deployment("llama-tiny", scheme, tmp_path / "float", left_in_float(w1))
    assert stored_as_scheme(cfg, scheme, deployed) == [
        "decoder.layers.1.ffn.w1.weight: left in float; the scheme quantizes it at 4 bits"]

    _, _, _, deployed = _deployment("llama-tiny", QuantizationScheme(4, 32, True, head_bits=4), tmp_path / "head4")
    assert stored_as_scheme(cfg, scheme, deployed) == [
        "head.weight: stored at 4 bits in blocks of 32, symmetric; the scheme says 8 bits in blocks of 32, symmetric"]

    _, _, runner, deployed = _deployment("llama-tiny", scheme, tmp_path / "swapped", weights_swapped(w1, w3))
    problems = stored_as_scheme(cfg, scheme, deployed)
    assert [line.split(":")[0] for line in problems] == ["decoder.layers.1.ffn.w1.weight",
                                                          "decoder.layers.1.ffn.w3.weight"]
    assert all("quantization steps from the parameter" in line for line in problems)
    cell, = judge_quantized(cfg, params, scheme, runner, deployed, cases=("forward-none",))
    assert cell.implementation.passed
    # the right deployment's stored weights: the swapped pair wired back (each node's own codes and scales)
    right = {**deployed.params, w1: deployed.params[w3], w3: deployed.params[w1]}
    right_cost = _stored_cost(cfg, params, deployed.cfg, right, "forward-none")
    # more than the right weights cost, by more than the kernel's rounding moves a KL (2·max|Δlogits|)
    assert cell.cost.kl_mean > right_cost.kl_mean + 2 * cell.implementation.max_abs_err, (cell.cost, right_cost)
    case = build_case(cfg, params, "forward", "none")
    told_apart = compare(runner.run("forward", case.inputs), golden_output(deployed.cfg, right, "forward", case.inputs),
                         case.tolerance(cfg, "float32"), case.floor)
    assert not told_apart.passed, told_apart


def test_a_block_size_the_codes_do_not_have_is_refused_by_name(tmp_path):
    """The graph's block_size attribute made 64 where the codes were made in blocks of 32: the
    codes' shape no longer matches, and the reading refuses, naming the weight's field."""
    def plant(float_graph, quantized, params):
        node = next(node for node in quantized.graph.node if node.op_type == "MatMulNBits")
        next(a for a in node.attribute if a.name == "block_size").i = 64
        return quantized
    with pytest.raises(WeightsError, match=r"codes are uint8 \[\d+, 2, 16\]; .* need uint8 \[\d+, 1, 32\]"):
        _deployment("llama-tiny", QuantizationScheme(4, 32, True), tmp_path, plant)


def test_a_generation_s_cost_is_where_its_tokens_part():
    from conformance.deployment.quantized import generation_cost

    float_tokens = np.array([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    assert generation_cost(float_tokens, float_tokens) == GenerationCost(3, 0, None)
    tokens = float_tokens.copy()
    tokens[1, 2:] = 0
    tokens[2, 3] = 0
    assert generation_cost(tokens, float_tokens) == GenerationCost(3, 2, 2)
    assert GenerationCost(3, 2, 2).describe() == "parts at step 2 (2 of 3 rows)"


def test_the_cost_and_its_budget():
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((2, 3, 7))
    same = cost(reference, reference, np.ones((2, 3), bool))
    assert same.kl_mean == same.kl_max == same.relative_error == 0 and same.top1 == 1 and same.tokens == 6
    flipped = reference.copy()
    flipped[0, 0] = -flipped[0, 0]  # the first token's distribution turned over: its top-1 changes
    real = np.array([[True, True, False], [True, False, False]])
    spent = cost(flipped, reference, real)
    assert spent.tokens == 3 and spent.top1 == pytest.approx(2 / 3)
    # KL(p‖q) = Σ p (log p − log q) of the turned-over token, by its definition: n = V = 7, depth 3 (the
    # log-softmax's two reductions, as the log_probs case counts them, then the KL's own sum)
    p, q = (np.exp(z - z.max()) / np.exp(z - z.max()).sum() for z in (reference[0, 0], flipped[0, 0]))
    assert_agrees(spent.kl_max, np.sum(p * (np.log(p) - np.log(q))), n=7, depth=3, what="the KL")
    assert spent.kl_mean == pytest.approx(spent.kl_max / 3)  # the other two tokens' KL is exactly 0
    # the budget's definitions: a cost equal to its budget keeps it (kl_mean > kl breaks it, top1 < top1 does)
    assert spent.within({"kl": spent.kl_mean, "top1": spent.top1}) == []
    assert spent.within({"kl": 0.0, "top1": 1.0}) == [f"mean KL {spent.kl_mean:.3g} > 0",
                                                       "top-1 agreement 0.6667 < 1"]


@pytest.mark.parametrize("text, message", [
    ("kl=1e-2,top1=0.99", None), ("top1=1", None),
    ("", "empty"), ("kl", "give KEY=VALUE"), ("ppl=3", "give KEY=VALUE with KEY one of kl"),
    ("kl=abc", "not a number"), ("kl=-1", "a finite KL"), ("kl=nan", "a finite KL"),
    ("top1=1.5", r"a share in \[0, 1\]"),
])
def test_the_budget_is_read_or_refused_by_name(text, message):
    if message is None:
        assert set(parse_budget(text)) <= {"kl", "top1"}
    else:
        with pytest.raises(ValueError, match=message):
            parse_budget(text)


@pytest.mark.parametrize("fields, message", [
    ({"bits": 2}, "bits = 2; the spec reads 4 and 8-bit codes"), ({"bits": True}, "bits = True"),
    ({"head_bits": 3}, "head_bits = 3"), ({"block_size": 48}, "block_size = 48"), ({"block_size": 8}, "block_size = 8"),
    ({"symmetric": "yes"}, "symmetric = 'yes'"), ({"accuracy_level": 1}, "levels 0 .* and 4"),
    ({"dynamic": True, "bits": 8, "accuracy_level": 4}, "a dynamic scheme has no accuracy_level"),
    ({"builder": "llama.cpp"}, "builder = 'llama.cpp'; one of onnxruntime, onnxruntime-genai"),
    ({"builder": "onnxruntime-genai"}, "its -p int4 \\(genai-int4"),
    ({"builder": "torchao", "bits": 4}, "torchao: its weight-only int8"),
])
def test_a_scheme_the_spec_lacks_is_refused_by_name(fields, message):
    with pytest.raises(WeightsError, match=message):
        QuantizationScheme(**fields)
    assert QuantizationScheme().name == "int4-b32-sym"
    assert QuantizationScheme(8, 128, False, 8).name == "int8-b128-zp-head8"


@pytest.mark.parametrize("text, scheme", [
    ("int4", QuantizationScheme(4, 32, True)), ("int8-b128-zp", QuantizationScheme(8, 128, False)),
    ("INT4-b64-sym-head8", QuantizationScheme(4, 64, True, 8)), ("int4-b32-zp-head8", SCHEMES["int4-b32-zp-head8"]),
    ("int4-al4", QuantizationScheme(4, accuracy_level=4)), ("dynamic-int8", QuantizationScheme(8, dynamic=True)),
    ("dynamic-int8-head8", QuantizationScheme(8, head_bits=8, dynamic=True)),
    ("genai-int4", QuantizationScheme(4, 32, True, 4, 4, builder="onnxruntime-genai")),
    ("ctranslate2-int8_float32", QuantizationScheme(8, head_bits=8, dynamic=True, builder="ctranslate2-int8_float32")),
    ("torchao-int8", QuantizationScheme(8, builder="torchao")),
])
def test_a_scheme_is_read_by_its_name(text, scheme):
    from spec.quantization import parse_scheme

    assert parse_scheme(text) == scheme and parse_scheme(scheme.name) == scheme


@pytest.mark.parametrize("text, message", [("fp8", "starts with int4 or int8"), ("int3", "bits = 3"),
                                           ("dynamic-int4", "is dynamic-int8"),
                                           ("dynamic-int8-head4", "is dynamic-int8"),
                                           ("int4-g32", "'g32' is none of"), ("int4-b24", "block_size = 24"),
                                           ("genai-int8", "is read at genai-int4"),
                                           ("ctranslate2-int16", "are ctranslate2-int8 and")])
def test_a_scheme_name_the_spec_lacks_is_refused_by_name(text, message):
    from spec.quantization import parse_scheme

    with pytest.raises(WeightsError, match=message):
        parse_scheme(text)


def test_rosetta_check_quantized_reports_both_references_and_judges_the_budget(tmp_path, capsys):
    """`rosetta check --quantized`: the columns in the terminal and report.json, the exit code 0 where
    the budget is kept (int8's, top1=0: every share of tokens is at least 0) and 1 where it is broken
    (int4's, kl=0: every deployment whose cost is above 0 breaks it)."""
    from rosetta.main import main

    base = ["check", "--preset", "llama-tiny", "--jobs", "1", "--backends", "numpy-float32", "--dtypes", "float32",
            "-k", "forward-none"]
    assert main([*base, "--quantized", "int8-b128", "--quant-budget", "top1=0",
                 "--report", str(tmp_path / "kept")]) == 0
    report = json.loads((tmp_path / "kept" / "report.json").read_text())
    column, = report["quantized"]
    assert column["column"] == "onnx-int8-b128-sym" and column["passed"] and column["stored"] == []
    assert [cell["case"] for cell in column["cells"]] == list(QUANTIZED_CASES)
    assert all(cell["implementation"]["ratio"] <= 1 for cell in column["cells"])  # each passes: within its tolerance
    assert all(cell["cost"]["kl_mean"] > 0 for cell in column["cells"] if not cell["case"].startswith("generate"))
    assert [cell["cost"] for cell in column["cells"][-2:]] == [{"rows": 3, "rows_parted": 0, "first_parted": None}] * 2
    assert "## Quantized deployments" in (tmp_path / "kept" / "report.md").read_text()
    capsys.readouterr()
    assert main([*base, "--quantized", "int4", "--quant-budget", "kl=0"]) == 1
    out = capsys.readouterr().out
    assert "onnx-int4-b32-sym: FAIL: over the cost budget in 5 of 7 cases" in out
    assert "implementation fails" not in out


@pytest.mark.parametrize("arguments, message", [
    (["--quantized", "int3"], "bits = 3"), (["--quantized", "int4", "--quant-budget", "ppl=2"], "KEY=VALUE"),
    (["--quant-budget", "kl=1"], "give --quantized SCHEMES"),
    (["--quantized", "genai-int4"], "is onnxruntime-genai's builder's model of a Hugging Face directory"),
    (["--quantized", "ctranslate2-int8"], "is CTranslate2's converter's model of a Hugging Face directory"),
])
def test_rosetta_check_refuses_a_quantized_request_it_cannot_read(arguments, message, capsys):
    from rosetta.main import main

    assert main(["check", "--preset", "llama-tiny", "--jobs", "1", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_the_cost_is_placed_stage_by_stage(tmp_path):
    """The golden on the stored weights against the golden, stage by stage: every quantized layer
    costs on its own (beyond float32's tolerance of the stage: rounding would not explain it), the
    float embedding and norm nothing, the head only where the scheme quantizes it; the chained
    cost grows up the stack."""
    from conformance.deployment.quantized import stage_costs

    for scheme, head_costs in ((QuantizationScheme(4, 32, True), False), (QuantizationScheme(8, 128, False, 8), True)):
        cfg, params, _, deployed = _deployment("llama-tiny", scheme, tmp_path / scheme.name)
        stages = {stage.name: stage for stage in stage_costs(cfg, params, deployed).stages}
        assert list(stages) == ["tgt embedding", "decoder.layers.0", "decoder.layers.1", "decoder.norm", "head"]
        assert stages["tgt embedding"].isolated_ratio == stages["decoder.norm"].isolated_ratio == 0
        assert stages["decoder.layers.0"].isolated_ratio > 1 and stages["decoder.layers.1"].isolated_ratio > 1
        # a float head computes on the float model's input what the golden does: exactly the same, 0
        assert (stages["head"].isolated_ratio > 1) if head_costs else stages["head"].isolated_ratio == 0
        assert stages["head"].chained_ratio > stages["decoder.layers.1"].chained_ratio


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny"])
def test_accuracy_level_4_is_judged_with_its_activations_rounded_to_int8(tmp_path, monkeypatch, preset):
    """accuracy_level 4 rounds each MatMulNBits input to int8 per block (scale max|a|/127): float32's
    tolerance fails it (measured 1,000-4,600 times over), the int8-activations mode (u = 1/254)
    passes it (measured 0.34-0.61 of it); a misread layout still fails there."""
    from conformance.cases import build_case

    scheme = QuantizationScheme(8, 128, True, accuracy_level=4)
    cfg, params, runner, deployed = _deployment(preset, scheme, tmp_path / "right")
    cells = [cell for cell in judge_quantized(cfg, params, scheme, runner, deployed)
             if not cell.case.startswith("generate")]
    for cell in cells:
        assert cell.implementation.passed, (cell.case, cell.implementation.ratio)
        case = build_case(cfg, params, *cell.case.split("-", 1))
        float32 = cell.implementation.tol * case.tolerance(cfg, "float32") / case.tolerance(cfg, "int8-activations")
        assert cell.implementation.max_abs_err > float32  # the int8 rounding is real: float32's policy would fail it
    dequantize = quantize.dequantize
    monkeypatch.setattr(quantize, "dequantize", lambda weight: dequantize(_swap_nibbles(weight)))
    cfg, params, runner, deployed = _deployment(preset, scheme, tmp_path / "misread")
    cell, = judge_quantized(cfg, params, scheme, runner, deployed, cases=("forward-none",))
    assert not cell.implementation.passed, cell.implementation.ratio


def test_a_quantized_weight_tied_to_no_parameter_is_refused_by_name(tmp_path):
    """A MatMulNBits whose output no float MatMul on a parameter writes (renamed here, with its
    readers) is named, never guessed."""
    def plant(float_graph, quantized, params):
        node = next(node for node in quantized.graph.node if node.op_type == "MatMulNBits")
        old = node.output[0]
        for reader in quantized.graph.node:
            reader.input[:] = ["renamed" if name == old else name for name in reader.input]
        node.output[0] = "renamed"
        return quantized
    with pytest.raises(WeightsError, match="the forward graph's MatMulNBits writing 'renamed' replaced no MatMul on a "
                                           "parameter of the model"):
        _deployment("llama-tiny", QuantizationScheme(), tmp_path, plant)


def test_a_wrong_reading_of_one_weight_is_localized_to_its_product(monkeypatch):
    """The golden's reading planted wrong only for the weights of K = d_ff (the FFNs' w2): the column
    fails, and product by product the first wrong one is named, decoder.layers.0.ffn.w2.weight, every
    product before it within its tolerance."""
    from conformance.deployment.quantized import check_quantized

    cfg = get_preset("qwen2-tiny")
    dequantize = quantize.dequantize
    monkeypatch.setattr(quantize, "dequantize", lambda weight: dequantize(
        _swap_nibbles(weight) if weight.k == cfg.d_ff else weight))
    column, = check_quantized(cfg, conformance_params(cfg), [QuantizationScheme(4, 32, True, head_bits=8)])
    assert not column.passed and not column.error
    names = [product.parameter for product in column.products]
    first = next(index for index, product in enumerate(column.products) if product.failed)
    assert names[first] == "decoder.layers.0.ffn.w2.weight"  # over its tolerance (failed), every product before within
    assert {product.parameter for product in column.products if product.failed} == {
        "decoder.layers.0.ffn.w2.weight", "decoder.layers.1.ffn.w2.weight"}
    assert "head.weight" in names  # the tied head, quantized at 8 bits, read as a head of its own
    assert "first wrong product: decoder.layers.0.ffn.w2.weight" in format_quantized([column])


def test_a_tied_head_left_as_a_transpose_of_the_embedding_is_quantized_too(tmp_path):
    """torch's export leaves a large tied head as MatMul(h, Transpose(embedding)) (SmolLM2-135M's:
    the real-size check found its head 'left in float' where the scheme said 8 bits, the quantizer
    taking constants only). Planted so on qwen2-tiny, the transpose is folded before quantizing and
    read back: the head is stored at 8 bits, and the column computes the golden on it."""
    from onnx import helper as onnx_helper

    from conformance.deployment.quantized import products

    cfg = get_preset("qwen2-tiny")
    params = conformance_params(cfg)
    source = exported(cfg, params)
    float_graph = onnx.load(str(source / "forward.onnx"))
    names = quantize.weight_names(float_graph, params)
    head_output = next(output for output, (name, transposed) in names.items() if transposed)
    table = next(node.input[0] for node in float_graph.graph.node if node.op_type == "Gather")
    head = next(node for node in float_graph.graph.node if node.op_type == "MatMul" and node.output[0] == head_output)
    head.input[1] = "head_transposed"
    index = list(float_graph.graph.node).index(head)
    float_graph.graph.node.insert(index, onnx_helper.make_node("Transpose", [table], ["head_transposed"], perm=[1, 0]))
    assert quantize.weight_names(float_graph, params)[head_output] == ("tgt_embed.weight", True)
    scheme = QuantizationScheme(4, 32, True, head_bits=8)
    quantized = quantize.quantize_graph(float_graph, params, scheme)
    assert not any(node.op_type == "Transpose" and node.output[0] == "head_transposed" for node in quantized.graph.node)
    deployed = quantize.deployed_weights(cfg, params, {"forward": (float_graph, quantized)})
    assert deployed.stored["head.weight"].bits == 8 and not deployed.cfg.tie_head
    found = products(cfg, params, scheme, float_graph, quantized)
    assert "head.weight" in [product.parameter for product in found] and not any(p.failed for p in found)


def test_a_quantized_export_is_made_again_when_what_made_it_changed(tmp_path, monkeypatch):
    """The directory is reused for the same scheme made by the same quantizer and code, and made
    again otherwise (a stale one kept SmolLM2-135M's head float after the fix that quantizes it)."""
    cfg = get_preset("llama-tiny")
    params = conformance_params(cfg)
    scheme = QuantizationScheme()
    first = quantize.quantized_export(cfg, params, scheme, tmp_path / "q")
    made = (first / "forward.onnx").stat().st_mtime_ns
    assert quantize.quantized_export(cfg, params, scheme, tmp_path / "q") == first
    assert (first / "forward.onnx").stat().st_mtime_ns == made
    monkeypatch.setattr(quantize, "_quantizer_version", lambda: "another quantizer")
    quantize.quantized_export(cfg, params, scheme, tmp_path / "q")
    assert (first / "forward.onnx").stat().st_mtime_ns != made
    assert json.loads((first / "manifest.json").read_text())["quantizer"] == "another quantizer"


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_torchao_int8_is_judged_on_the_weights_it_stores(preset):
    """torchao's weight-only int8 on impl_torch's linear layers (a scale per output row, activations
    float32): every case within float32's tolerance of the golden on the weights it stores, each
    nn.Linear's product within its own, the head left float as the scheme says; the cost measured,
    the stored weights' own."""
    pytest.importorskip("torchao")
    from conformance.deployment.quantized import check_quantized
    from conformance.deployment.quantized_serving import served
    from spec.quantization import TORCHAO_INT8

    cfg = get_preset(preset)
    params = conformance_params(cfg)
    column, = check_quantized(cfg, params, [TORCHAO_INT8])
    assert column.name == "torchao-int8" and column.passed, format_quantized([column])
    linear = [name for name, value in params.items()
              if np.ndim(value) == 2 and not name.endswith("embed.weight") and name != "head.weight"]
    assert sorted(product.parameter for product in column.products) == sorted(linear)
    _, deployed, _ = served(cfg, params, TORCHAO_INT8, "cpu")  # the weights torchao stores, quantized again
    _assert_the_cost_is_the_stored_weights(cfg, params, deployed, column.cells)


def test_torchao_int8_misread_fails_where_it_is_misread(monkeypatch):
    """The golden's reading of torchao's rows planted wrong for the FFNs' w2 (each row's scale taken
    from the row after it): the column fails, the first wrong product is decoder.layers.0.ffn.w2.weight;
    a layout the spec does not read is refused by name."""
    pytest.importorskip("torchao")
    import spec.quantization as layouts
    from conformance.deployment.quantized import check_quantized
    from spec.quantization import TORCHAO_INT8, RowQuantized, dequantize_rows

    cfg = get_preset("llama-tiny")
    right = layouts.dequantize_rows
    monkeypatch.setattr(layouts, "dequantize_rows", lambda weight, name="weight": right(
        dataclasses.replace(weight, scales=np.roll(weight.scales, 1, axis=0)) if name.endswith("ffn.w2.weight")
        else weight, name))
    column, = check_quantized(cfg, conformance_params(cfg), [TORCHAO_INT8])
    first = next(product for product in column.products if product.failed)
    assert not column.passed and first.parameter == "decoder.layers.0.ffn.w2.weight"
    with pytest.raises(WeightsError, match=r"w: codes are int16 \[3, 4\]; the spec reads int8"):
        dequantize_rows(RowQuantized(np.zeros((3, 4), np.int16), np.ones((3, 1), np.float32)), "w")
    with pytest.raises(WeightsError, match="zero points other than 0"):
        dequantize_rows(RowQuantized(np.zeros((3, 4), np.int8), np.ones((3, 1), np.float32), np.ones(3, np.int8)), "w")
