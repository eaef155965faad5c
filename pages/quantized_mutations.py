"""The quantized deployment's mistakes (`rosetta mutations --quantized`, docs/quantized-mutations.md):
each planted in llama-tiny's int4 export (blocks of 16, the head at 8 bits) and run through the
quantized column's checks (conformance.deployment.quantized): each must be caught and localized to its parameter.

A mistake is planted in one of two places:
- **the kernel**: it reads the stored tensors otherwise than SPEC §15 says (nibbles swapped, a zero
  point off by one, the scales along the wrong axis, a block size the quantizer did not use, int8
  activations where the deployment says float). The graph onnxruntime runs is rewritten so that its
  correct kernel computes what the wrong one would, while the golden reads the file as written:
  the implementation reference fails, and product by product the first wrong one is named.
- **the export**: the file stores otherwise than the scheme says (a layer left float, the head at 4
  bits, two layers' weights swapped, a block size its codes were not made in). The kernel and the
  golden read the same file, so the implementation reference cannot see it: the stored-weights
  check names the parameter, or the reading refuses the file by name.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec import ModelConfig, conformance_params, get_preset
from spec.errors import WeightsError
from spec.quantization import BlockQuantized, QuantizationScheme

PRESET = "llama-tiny"
SCHEME = QuantizationScheme(4, 16, True, head_bits=8)  # blocks of 16: each column of K = 48 holds three

# plant(float graph, quantized graph, params) -> the quantized graph with the mistake in it
Plant = Callable[..., object]


@dataclass(frozen=True)
class QuantizedMistake:
    name: str
    mistake: str
    where: str  # "kernel": what onnxruntime runs is planted, the file read as written; "export": the file is
    plant: Plant | None
    expected: str  # the parameter the checks must name first
    exported_as: QuantizationScheme | None = None  # the export made with another scheme than the one judged


def _rewritten_weights(rewrite: Callable[[BlockQuantized], BlockQuantized | None]) -> Plant:
    """A plant giving every MatMulNBits node rewrite(its weight) in place of its stored tensors (None:
    that node left as it is), the node's attributes following the rewritten weight."""
    from onnx import helper, numpy_helper

    from export.onnx_model import without_unused_initializers
    from export.quantize import QUANTIZED_OP, stored_weights

    def plant(float_graph, quantized, params):
        weights = stored_weights(quantized)
        for node in quantized.graph.node:
            wrong = rewrite(weights[node.output[0]]) if node.op_type == QUANTIZED_OP else None
            if wrong is None:
                continue
            inputs = list(node.input) + [""] * (4 - len(node.input))
            for index, role in ((1, "codes"), (2, "scales"), (3, "zero_points")):
                value = getattr(wrong, role)
                if value is None:
                    continue
                inputs[index] = f"{node.output[0]}.planted_{role}"
                quantized.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), inputs[index]))
            node.input[:] = inputs[:4 if inputs[3] else 3]
            for attribute in node.attribute:
                if attribute.name in ("K", "N", "bits", "block_size"):
                    attribute.CopyFrom(helper.make_attribute(attribute.name, getattr(
                        wrong, {"K": "k", "N": "n"}.get(attribute.name, attribute.name))))
        return without_unused_initializers(quantized)
    return plant


def swap_nibbles(weight: BlockQuantized) -> BlockQuantized | None:
    """Each byte's two 4-bit codes exchanged (element 2i read from the high nibble)."""
    if weight.bits != 4:
        return None  # an 8-bit weight has no nibbles to swap
    return dataclasses.replace(weight, codes=((weight.codes & 0x0F) << 4) | (weight.codes >> 4))


def zero_point_off_by_one(weight: BlockQuantized) -> BlockQuantized:
    """A symmetric weight's implicit zero point 2^(bits−1) taken as 2^(bits−1) + 1."""
    per_byte = 8 // weight.bits
    code = 2 ** (weight.bits - 1) + 1
    byte = sum(code << (weight.bits * i) for i in range(per_byte))  # the code in every slot of a byte
    return dataclasses.replace(weight, zero_points=np.full((weight.n, -(-weight.blocks // per_byte)), byte, np.uint8))


def scales_on_the_wrong_axis(weight: BlockQuantized) -> BlockQuantized:
    """The [N, blocks] scales read as [blocks, N]."""
    scales = np.asarray(weight.scales).reshape(-1, weight.n).T.reshape(weight.scales.shape).copy()
    return dataclasses.replace(weight, scales=scales)


def blocks_read_twice_as_long(weight: BlockQuantized) -> BlockQuantized | None:
    """The codes made in blocks of B read in blocks of 2B: the same bytes, each column's first half of
    its scales taken for its blocks (where a column's blocks pair up; the others left as they are)."""
    if weight.blocks % 2:
        return None
    bytes_per_block = weight.codes.shape[-1] * 2
    scales = np.asarray(weight.scales).reshape(-1)[:weight.n * weight.blocks // 2]
    return dataclasses.replace(weight, block_size=2 * weight.block_size,
                               codes=weight.codes.reshape(weight.n, weight.blocks // 2, bytes_per_block),
                               scales=scales.reshape(weight.n, weight.blocks // 2))


def int8_activations(float_graph, quantized, params):
    """Every MatMulNBits at accuracy_level 4 (its input rounded to int8 per block, onnxruntime-genai's
    builder's default) where the deployment says 0 (the activations in float32)."""
    from onnx import helper

    from export.quantize import QUANTIZED_OP

    for node in quantized.graph.node:
        if node.op_type == QUANTIZED_OP:
            kept = [attribute for attribute in node.attribute if attribute.name != "accuracy_level"]
            node.ClearField("attribute")
            node.attribute.extend([*kept, helper.make_attribute("accuracy_level", 4)])
    return quantized


def _output_of(float_graph, params, parameter: str) -> str:
    from export.quantize import weight_names

    return next(output for output, (name, _) in weight_names(float_graph, params).items() if name == parameter)


def left_in_float(parameter: str) -> Plant:
    """The float graph's MatMul on `parameter` put back in place of its MatMulNBits."""
    from export.onnx_model import without_unused_initializers

    def plant(float_graph, quantized, params):
        output = _output_of(float_graph, params, parameter)
        matmul, = [node for node in float_graph.graph.node if node.op_type == "MatMul" and node.output[0] == output]
        weight, = [tensor for tensor in float_graph.graph.initializer if tensor.name == matmul.input[1]]
        nodes = [matmul if node.output[0] == output else node for node in quantized.graph.node]
        quantized.graph.ClearField("node")
        quantized.graph.node.extend(nodes)
        quantized.graph.initializer.append(weight)
        return without_unused_initializers(quantized)
    return plant


def weights_swapped(first: str, second: str) -> Plant:
    """Two MatMulNBits nodes of one shape wired to each other's stored weights (an exporter that mixes
    up w1 and w3)."""
    def plant(float_graph, quantized, params):
        nodes = {node.output[0]: node for node in quantized.graph.node}
        one, other = (nodes[_output_of(float_graph, params, name)] for name in (first, second))
        for index in (1, 2):  # the codes and the scales
            one.input[index], other.input[index] = other.input[index], one.input[index]
        return quantized
    return plant


def codes_truncated(float_graph, quantized, params):
    """Every MatMulNBits weight's codes made again by a quantizer that truncates: ⌊w / scale + z⌋ (clipped
    to the range) where onnxruntime rounds to the nearest; its scales and zero points kept."""
    from onnx import numpy_helper

    from export.quantize import QUANTIZED_OP, stored_weights, weight_names
    from spec.quantization import block_elements

    weights, names = stored_weights(quantized), weight_names(float_graph, params)
    tensors = {tensor.name: tensor for tensor in quantized.graph.initializer}
    for node in quantized.graph.node:
        if node.op_type != QUANTIZED_OP:
            continue
        weight = weights[node.output[0]]
        name, transposed = names[node.output[0]]
        parameter = np.asarray(params[name], np.float64)
        _, scales, zero = block_elements(weight)  # [K, N]
        codes = np.clip(np.floor((parameter.T if transposed else parameter) / scales + zero), 0, 2**weight.bits - 1)
        per_block = np.zeros((weight.n, weight.blocks * weight.block_size), np.uint8)  # past K: the padding's 0
        per_block[:, :weight.k] = codes.T
        slots = per_block.reshape(weight.n, weight.blocks, -1, 8 // weight.bits).astype(np.uint8)
        packed = sum(slots[..., i] << (weight.bits * i) for i in range(8 // weight.bits))  # low bits first
        tensors[node.input[1]].CopyFrom(numpy_helper.from_array(packed.astype(np.uint8), node.input[1]))
    return quantized


def block_size_attribute_doubled(float_graph, quantized, params):
    """The first MatMulNBits' block_size attribute written twice what its codes were made in."""
    from export.quantize import QUANTIZED_OP

    node = next(node for node in quantized.graph.node if node.op_type == QUANTIZED_OP)
    next(attribute for attribute in node.attribute if attribute.name == "block_size").i *= 2
    return quantized


_FIRST = "decoder.layers.0.self_attn.k.weight"  # the forward graph's first quantized product
QUANTIZED_MISTAKES = (
    QuantizedMistake("nibbles_swapped", "the kernel reads each byte's two 4-bit codes the other way round", "kernel",
                     _rewritten_weights(swap_nibbles), _FIRST),
    QuantizedMistake("zero_point_off_by_one", "the kernel takes a symmetric weight's zero point as 9 rather than 8 "
                     "(129 rather than 128 for the 8-bit head)", "kernel",
                     _rewritten_weights(zero_point_off_by_one), _FIRST),
    QuantizedMistake("scales_wrong_axis", "the kernel reads the [N, blocks] scales as [blocks, N]", "kernel",
                     _rewritten_weights(scales_on_the_wrong_axis), _FIRST),
    QuantizedMistake("block_size_mismatched", "the kernel reads codes quantized in blocks of 16 as blocks of 32 (a "
                     "block size mismatched between quantizer and kernel; only the FFNs' w2, K = 88 in six blocks, "
                     "pair up)", "kernel", _rewritten_weights(blocks_read_twice_as_long),
                     "decoder.layers.0.ffn.w2.weight"),
    QuantizedMistake("int8_activations", "the kernel runs at accuracy_level 4 (activations rounded to int8) where the "
                     "deployment says 0", "kernel", int8_activations, _FIRST),
    QuantizedMistake("layer_left_float", "a linear layer the scheme quantizes left in float", "export",
                     left_in_float("decoder.layers.1.ffn.w1.weight"), "decoder.layers.1.ffn.w1.weight"),
    QuantizedMistake("head_int4", "the head quantized at 4 bits where the scheme says 8", "export", None,
                     "head.weight", exported_as=dataclasses.replace(SCHEME, head_bits=4)),
    QuantizedMistake("weights_swapped", "two layers of one shape wired to each other's stored weights (w1 and w3)",
                     "export", weights_swapped("decoder.layers.1.ffn.w1.weight", "decoder.layers.1.ffn.w3.weight"),
                     "decoder.layers.1.ffn.w1.weight"),
    QuantizedMistake("block_size_attribute", "a block_size attribute twice what its codes were made in", "export",
                     block_size_attribute_doubled, _FIRST),
    QuantizedMistake("codes_truncated", "a quantizer that truncates w / scale + z where onnxruntime's rounds to the "
                     "nearest (its scales and zero points kept)", "export", codes_truncated,
                     "decoder.layers.0.self_attn.q.weight"),
)


@dataclass(frozen=True)
class PlantedDeployment:
    """A quantized export with a mistake planted: its runner, the weights the golden reads (the file
    as written where the mistake is the kernel's), and the graphs by role: (float, read, run)."""

    runner: object
    deployed: object
    graphs: dict


def planted_deployment(cfg: ModelConfig, params: Mapping[str, np.ndarray], scheme: QuantizationScheme,
                       directory: Path, plant: Plant | None = None, *, in_the_kernel: bool = False,
                       exported_as: QuantizationScheme | None = None) -> PlantedDeployment:
    """The scheme's quantized export (made as `exported_as` where given) copied to `directory`, each
    quantized graph passed through plant(float graph, quantized graph, params) and written back; the
    golden's weights read from the planted graphs, or, in_the_kernel, from the graphs as exported."""
    from conformance.backends.onnx_backend import OnnxRunner
    from export.onnx_model import save
    from export.quantize import deployed_weights, graphs_of, quantized_export
    from export.runner import OnnxTransformer

    shutil.copytree(quantized_export(cfg, params, exported_as or scheme), directory)
    files = json.loads((directory / "manifest.json").read_text())["graphs"]
    graphs = {}
    for role, (float_graph, quantized) in graphs_of(cfg, params, directory).items():
        run = quantized if plant is None else plant(float_graph, copy.deepcopy(quantized), params)
        if plant is not None:
            save(run, directory / files[role])
        graphs[role] = (float_graph, quantized if in_the_kernel else run, run)
    deployed = deployed_weights(cfg, params, {role: (float_graph, read) for role, (float_graph, read, _) in
                                              graphs.items()})
    runner = OnnxRunner(OnnxTransformer(directory, device="cpu"), f"onnx-{scheme.name}")
    return PlantedDeployment(runner, deployed, graphs)


@dataclass(frozen=True)
class QuantizedVerdict:
    mistake: QuantizedMistake
    implementation: float | None  # forward-none's max|error| / tolerance against the golden on what it read
    kl_mean: float | None  # forward-none's cost: mean KL to the float golden per real token
    stored: list[str]  # the stored-weights check's lines
    first_product: str | None  # the first product over its tolerance, in graph order
    refused: str = ""  # the reading's refusal

    @property
    def named(self) -> str | None:
        """The parameter the checks name first: the refusal's, the first wrong product, or the stored check's."""
        if self.refused:
            return self.refused.split(" (")[0]
        return self.first_product or (self.stored[0].split(":")[0] if self.stored else None)

    @property
    def caught(self) -> bool:
        return bool(self.refused or self.stored or self.first_product) or not (self.implementation or 0) <= 1

    @property
    def localized(self) -> bool:
        return self.named == self.mistake.expected


def run_quantized_mistake(cfg: ModelConfig, params: Mapping[str, np.ndarray], mistake: QuantizedMistake,
                          scheme: QuantizationScheme = SCHEME) -> QuantizedVerdict:
    from conformance.deployment.quantized import judge_quantized, products, stored_as_scheme

    with tempfile.TemporaryDirectory(prefix="rosetta-quantized-mistake-") as scratch:
        try:
            planted = planted_deployment(cfg, params, scheme, Path(scratch) / "deployment", mistake.plant,
                                         in_the_kernel=mistake.where == "kernel", exported_as=mistake.exported_as)
        except WeightsError as error:
            return QuantizedVerdict(mistake, None, None, [], None, str(error))
        cell, = judge_quantized(cfg, params, scheme, planted.runner, planted.deployed, cases=("forward-none",))
        float_graph, read, run = planted.graphs["forward"]
        found = products(cfg, params, scheme, float_graph, read, served=run)
    first = next((product.parameter for product in found if product.failed), None)
    return QuantizedVerdict(mistake, cell.implementation.ratio, cell.cost.kl_mean,
                            stored_as_scheme(cfg, scheme, planted.deployed), first)


def run_quantized_gallery(mistakes=QUANTIZED_MISTAKES) -> list[QuantizedVerdict]:
    """Every mistake of QUANTIZED_MISTAKES (or those given) planted in turn in llama-tiny's export."""
    cfg = get_preset(PRESET)
    params = conformance_params(cfg)
    return [run_quantized_mistake(cfg, params, mistake) for mistake in mistakes]


def quantized_gallery_table(verdicts: list[QuantizedVerdict]) -> str:
    lines = ["| mutation | the mistake | planted in | forward-none vs the golden on what it read | its KL to the "
             "float golden | stored-weights check | named first | verdict |", "|---|---|---|---:|---:|---|---|---|"]
    for v in verdicts:
        verdict = "caught, localized" if v.caught and v.localized else ("caught, NOT localized" if v.caught else "MISSED")
        implementation = "refused" if v.refused else f"{v.implementation:.3g}× tol"
        kl = "-" if v.kl_mean is None else f"{v.kl_mean:.3g}"
        stored = v.refused or (f"{len(v.stored)} line(s): {v.stored[0]}" if v.stored else "as the scheme says")
        lines.append(f"| `{v.mistake.name}` | {v.mistake.mistake} | the {v.mistake.where} | {implementation} | {kl} | "
                     f"{stored} | `{v.named or '-'}` | {verdict} |")
    return "\n".join(lines)


def quantized_gallery_page(verdicts: list[QuantizedVerdict]) -> str:
    """docs/quantized-mutations.md (`rosetta mutations --quantized --markdown FILE`)."""
    return "\n".join([
        f"# Quantized deployment mistakes ({PRESET}, {SCHEME.name})", "",
        "Generated by `rosetta mutations --quantized --markdown docs/quantized-mutations.md`; a test checks it. "
        "Each mistake is planted in our float32 export of llama-tiny quantized by onnxruntime's "
        "MatMulNBitsQuantizer, and the column's checks run on forward-none (SPEC §15.1). A mistake planted in "
        "*the kernel* rewrites the graph onnxruntime runs so that its correct kernel computes what a kernel "
        "reading the stored tensors wrongly would, while the golden reads the file as written: the implementation "
        "reference fails (max|error| / tolerance, above 1), and each MatMulNBits product held to its own input "
        "times the weight it stores names the first wrong one. A mistake planted in *the export* is in the file "
        "itself: the kernel and the golden read the same tensors, the implementation reference passes, and the "
        "stored-weights check names the parameter stored otherwise than the scheme says, or the reading refuses "
        "the file by name. The cost (KL to the float golden) is reported beside, never a verdict here. The "
        "mistakes planted in the golden's own reading of the layout are tests/test_quantized_deployment.py's.", "",
        quantized_gallery_table(verdicts), ""])
