"""A float32 export made weight-only quantized by onnxruntime's own MatMulNBitsQuantizer (SPEC §15),
and the weights the quantized graphs store read back under the spec's names, dequantized: the
parameters the deployment really multiplies by, for the golden to run on.

Which weight a MatMul multiplies by is found by content in the float graph (an exporter names its
initializers as it likes: torch's folded transposes are `val_56`), and a MatMulNBits node is tied
to the MatMul it replaced by the output it writes, which the quantizer keeps. The head, tied or
not, is quantized at the scheme's head_bits or left float; a tied head quantized apart from the
embedding it shares is read back as a head of its own (the deployment no longer ties them).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.cache import cache_root, exported
from export.onnx_model import SharedWeights, external_data_files, save
from spec import ModelConfig
from spec.errors import WeightsError
from spec.quantization import (BlockQuantized, QuantizationScheme, block_elements, check_block_quantized,
                                dequantize)

QUANTIZED_OP = "MatMulNBits"
QUANTIZED_ROLES = ("forward", "encoder", "decoder_step", "decoder_step_in_place")  # the graphs it serves
_HEAD = "head.weight"


def weight_names(model: onnx.ModelProto, params: Mapping[str, np.ndarray]) -> dict[str, tuple[str, bool]]:
    """Each MatMul's constant weight [in, out] in a float graph: its output -> (the spec's name of the
    parameter it holds, whether it holds it transposed: a tied head's embedding). A MatMul on a
    constant that is no parameter (none in our exports) is left out. Matched by content: the bytes'
    digest, then exactly."""
    by_content: dict[tuple, tuple[str, bool]] = {}
    for name, value in params.items():
        if np.ndim(value) == 2:
            for transposed in (True, False):  # a square parameter held as is wins over its transpose
                by_content[_content(np.asarray(value).T if transposed else np.asarray(value))] = (name, transposed)
    constants = constant_weights(model)
    found = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in constants:
            continue
        weight = constants[node.input[1]]()
        match = by_content.get(_content(weight))
        if match is not None:
            value = np.asarray(params[match[0]])
            if np.array_equal(value.T if match[1] else value, weight):  # a digest's match, confirmed
                found[node.output[0]] = match
    return found


def constant_weights(model: onnx.ModelProto) -> dict[str, Callable[[], np.ndarray]]:
    """The tensors of a graph that are constants, by name, each read when called: its initializers,
    and a 2-D Transpose of one (torch's export leaves a tied head's `Transpose(embedding)` unfolded
    once the table is large: SmolLM2-135M's 49152 × 576)."""
    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    constants = {name: functools.partial(numpy_helper.to_array, tensor) for name, tensor in stored.items()}
    for node in model.graph.node:
        perm = [helper.get_attribute_value(a) for a in node.attribute if a.name == "perm"]
        if node.op_type == "Transpose" and node.input[0] in stored and perm in ([], [[1, 0]]) \
                and len(stored[node.input[0]].dims) == 2:
            constants[node.output[0]] = lambda tensor=stored[node.input[0]]: numpy_helper.to_array(tensor).T
    return constants


def folded_transposes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a graph whose MatMuls on a Transpose of an initializer take the transposed table as
    an initializer of its own (so that a quantizer, which quantizes constants only, sees the weight)."""
    folded = copy.deepcopy(model)
    initializers = {tensor.name for tensor in folded.graph.initializer}
    constants = constant_weights(folded)
    for node in folded.graph.node:
        if node.op_type == "MatMul" and node.input[1] in constants and node.input[1] not in initializers:
            name = f"{node.input[1]}_folded"
            if name not in initializers:
                folded.graph.initializer.append(numpy_helper.from_array(
                    np.ascontiguousarray(constants[node.input[1]]()), name))
                initializers.add(name)
            node.input[1] = name
    readers = {name for node in folded.graph.node for name in node.input} | {o.name for o in folded.graph.output}
    kept = [node for node in folded.graph.node if node.op_type != "Transpose" or node.output[0] in readers]
    folded.graph.ClearField("node")
    folded.graph.node.extend(kept)
    return folded


def _content(array: np.ndarray) -> tuple:
    contiguous = np.ascontiguousarray(array)
    return contiguous.shape, contiguous.dtype.str, hashlib.sha256(contiguous.tobytes()).hexdigest()


def _is_head(name: str, transposed: bool) -> bool:
    return name == _HEAD or transposed  # the only weight a graph multiplies by transposed is a tied embedding


def quantize_graph(model: onnx.ModelProto, params: Mapping[str, np.ndarray],
                   scheme: QuantizationScheme, reduce_range: bool = False) -> onnx.ModelProto:
    """A copy of a float32 graph whose MatMuls on the model's linear weights are MatMulNBits: the
    head's at scheme.head_bits (or left a float MatMul), every other at scheme.bits; a dynamic
    scheme's are MatMulInteger on int8 weights, their activations quantized at run time (with
    reduce_range, weights of 7 bits: no pair of products saturates an int16, SPEC §15.2)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = folded_transposes(model)
    names = weight_names(model, params)
    matmuls = {node.output[0]: node.name for node in model.graph.node if node.op_type == "MatMul"}
    head = [matmuls[output] for output, (name, transposed) in names.items() if _is_head(name, transposed)]
    other = [node for output, node in matmuls.items() if output not in names]  # not a parameter's product
    if scheme.dynamic:
        return _quantized_dynamically(model, head + other if scheme.head_bits is None else other, reduce_range)
    quantized = model  # folded_transposes made it a copy of its own
    for bits, leave in ((scheme.bits, head + other), (scheme.head_bits, other)):
        if bits is None:
            continue
        quantizer = MatMulNBitsQuantizer(quantized, bits=bits, block_size=scheme.block_size,
                                         is_symmetric=scheme.symmetric, accuracy_level=scheme.accuracy_level,
                                         nodes_to_exclude=leave)
        quantizer.process()
        quantized = quantizer.model.model
    return quantized


def _quantized_dynamically(model: onnx.ModelProto, leave: list[str], reduce_range: bool = False) -> onnx.ModelProto:
    """onnxruntime's quantize_dynamic on every MatMul but `leave`: int8 weights (7-bit with
    reduce_range), symmetric, one scale per tensor; the activations quantized at run time
    (MatMulInteger)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root, level = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.ERROR)  # quantize_dynamic warns on the root logger that we did not pre-process
    try:
        with tempfile.TemporaryDirectory() as folder:
            output = Path(folder) / "quantized.onnx"
            quantize_dynamic(copy.deepcopy(model), output, op_types_to_quantize=["MatMul"],
                             weight_type=QuantType.QInt8, nodes_to_exclude=leave, reduce_range=reduce_range)
            return onnx.load(str(output))
    finally:
        root.setLevel(level)


def stored_weights(model: onnx.ModelProto) -> dict[str, BlockQuantized]:
    """Each MatMulNBits node's weight as SPEC §15 reads it, by the output the node writes."""
    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    weights = {}
    for node in model.graph.node:
        if node.op_type != QUANTIZED_OP:
            continue
        attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
        inputs = list(node.input) + [""] * 4
        missing = [role for role, name in zip(("codes", "scales"), inputs[1:3]) if name not in stored]
        if missing:
            raise WeightsError(f"{node.name}: its {' and '.join(missing)} are not constants of the graph")
        if inputs[3] and inputs[3] not in stored:
            raise WeightsError(f"{node.name}: its zero points are not a constant of the graph")
        weights[node.output[0]] = BlockQuantized(
            k=attributes["K"], n=attributes["N"], bits=attributes["bits"], block_size=attributes["block_size"],
            codes=numpy_helper.to_array(stored[inputs[1]]), scales=numpy_helper.to_array(stored[inputs[2]]),
            zero_points=numpy_helper.to_array(stored[inputs[3]]) if inputs[3] else None)
    return weights


@dataclass(frozen=True)
class StoredWeight:
    """How a deployment stores one parameter: its code width, block size, whether with zero points,
    and how far its dequantization lies from the float parameter, in quantization steps (|scale|)
    at the worst element: round-to-nearest leaves at most half a step, a clipped block edge one."""

    bits: int
    block_size: int | None  # None: one scale per row (torchao's int8)
    symmetric: bool
    steps_from_parameter: float
    not_rounded: str = ""  # where its codes are not the parameter rounded (unrounded), said; "" where all are


@dataclass(frozen=True)
class DeployedWeights:
    """What a quantized deployment multiplies by, under the spec's names: cfg (untied where the head
    was quantized apart from its embedding), params (the quantized ones dequantized, in float64 and
    rounded once to float32: (code − zero point)·scale, a float32 scale times an integer, as a float32
    kernel forms it), and how each quantized parameter is stored."""

    cfg: ModelConfig
    params: dict[str, np.ndarray]
    stored: dict[str, StoredWeight]


def deployed_weights(cfg: ModelConfig, params: Mapping[str, np.ndarray],
                     graphs: Mapping[str, tuple[onnx.ModelProto, onnx.ModelProto]]) -> DeployedWeights:
    """The parameters quantized graphs store, from {role: (float graph, its quantized copy)}: each
    MatMulNBits weight dequantized (spec.quantization.dequantize) under the name of the parameter
    that the float graph's MatMul writing the same output held. A weight tied to no parameter, or
    one parameter stored two ways (the forward's and the decoder_step's), is refused by name."""
    deployed = dict(params)
    stored: dict[str, StoredWeight] = {}
    tied = False
    for role, (float_model, quantized_model) in graphs.items():
        names = weight_names(float_model, params)
        for output, weight in stored_weights(quantized_model).items():
            if output not in names:
                raise WeightsError(f"the {role} graph's {QUANTIZED_OP} writing {output!r} replaced no MatMul on a "
                                   "parameter of the model")
            name, transposed = names[output]
            target = _HEAD if transposed else name  # a tied head quantized: a head of its own now
            check_block_quantized(weight, f"{target} (the {role} graph's {QUANTIZED_OP} writing {output!r})")
            exact = dequantize(weight)  # [K, N] = [in, out], float64
            tied |= transposed
            value = exact.astype(np.float32)
            if target in stored and not np.array_equal(deployed[target], value):
                raise WeightsError(f"{target}: the {role} graph stores it quantized otherwise than another graph")
            parameter = np.asarray(params[name], np.float64)
            parameter = parameter.T if transposed else parameter
            deployed[target] = value
            stored[target] = _stored(weight, parameter, exact)
    return DeployedWeights(replace(cfg, tie_head=False) if tied else cfg, deployed, stored)


def _stored(weight: BlockQuantized, parameter: np.ndarray, exact: np.ndarray) -> StoredWeight:
    """How a MatMulNBits weight stores `parameter` [K, N] (`exact`: its dequantization)."""
    codes, scales, zero = block_elements(weight)
    return StoredWeight(weight.bits, weight.block_size, weight.zero_points is None,
                        float((np.abs(exact - parameter) / block_steps(weight)).max(initial=0.0)),
                        unrounded(parameter, codes, scales, zero, (0, 2**weight.bits - 1), weight.bits))


# the parameters a builder may pack into one product, along its output axis, by their names' endings
PACKED = (("self_attn.q.weight", "self_attn.k.weight", "self_attn.v.weight"), ("ffn.w1.weight", "ffn.w3.weight"))
EMBEDDING_OP = "GatherBlockQuantized"


def _candidates(cfg: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[tuple[str, ...], np.ndarray]:
    """What a quantized product may multiply by, [in, out]: each linear parameter, one layer's packed
    groups (PACKED) side by side, and a tied head (the embedding transposed)."""
    linear = {name: np.asarray(value) for name, value in params.items()
              if np.ndim(value) == 2 and not name.endswith(("embed.weight", "pos.weight"))}
    found = {(name,): value for name, value in linear.items()}
    for group in PACKED:
        for name in linear:
            if name.endswith(group[0]):
                names = tuple(name.removesuffix(group[0]) + ending for ending in group)
                if all(part in linear for part in names):
                    found[names] = np.concatenate([linear[part] for part in names], axis=1)
    if cfg.tie_head:
        found[(_HEAD,)] = np.asarray(params["tgt_embed.weight"]).T
    return found


def deployed_by_content(cfg: ModelConfig, params: Mapping[str, np.ndarray],
                        model: onnx.ModelProto) -> tuple[DeployedWeights, dict[str, tuple[str, bool]]]:
    """The parameters a quantized graph that was not traced from our export stores (onnxruntime-genai's
    builder names its weights its own way and packs q, k, v into one product): each MatMulNBits weight
    matched to the parameter, or the packed group of one layer, that its dequantization lies within one
    quantization step of at every element (a quantization of nothing else lies so near), split back
    under the spec's names. A tied embedding that a GatherBlockQuantized reads from the head's own
    stored tensors stays tied to the deployed head; one read from other tensors is refused, and so is a
    weight that matches no parameter. Also each product's output -> (the name it is reported under,
    False), for the product-by-product localization."""
    candidates = _candidates(cfg, params)
    deployed, stored, names = dict(params), {}, {}
    nodes = {node.output[0]: node for node in model.graph.node if node.op_type == QUANTIZED_OP}
    head_scales = head_codes = None
    for output, weight in stored_weights(model).items():
        check_block_quantized(weight, f"the {QUANTIZED_OP} writing {output!r}")
        exact, steps = dequantize(weight), block_steps(weight)
        matches = [group for group, value in candidates.items() if value.shape == exact.shape
                   and np.max(np.abs(exact - value) / steps) <= within_a_step(weight.bits)]
        if len(matches) != 1:
            raise WeightsError(f"the {QUANTIZED_OP} writing {output!r} ([{weight.k}, {weight.n}]) lies within one "
                               f"quantization step of {len(matches)} of the model's parameters "
                               f"({', '.join('+'.join(group) for group in matches) or 'none'}); one is needed")
        group = matches[0]
        if group == (_HEAD,):
            head_codes, head_scales = nodes[output].input[1:3]
        widths = np.cumsum([0] + [candidates[(name,)].shape[1] for name in group])
        codes, scales, zero = block_elements(weight)
        for name, start, stop in zip(group, widths[:-1], widths[1:]):
            part, parameter = exact[:, start:stop], candidates[(name,)]
            deployed[name] = part.astype(np.float32)
            stored[name] = StoredWeight(
                weight.bits, weight.block_size, weight.zero_points is None,
                float((np.abs(part - parameter) / steps[:, start:stop]).max(initial=0.0)),
                unrounded(parameter, codes[:, start:stop], scales[:, start:stop], zero[:, start:stop],
                          (0, 2**weight.bits - 1), weight.bits))
        names[output] = ("+".join(group), False)
    lookups = [node for node in model.graph.node if node.op_type == EMBEDDING_OP]
    reshaped = {node.output[0]: node.input[0] for node in model.graph.node if node.op_type == "Reshape"}
    for node in lookups:  # its table: the head's own codes (the builder reshapes them) and scales
        attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
        head = stored.get(_HEAD)
        if not (cfg.tie_head and node.input[2] == head_scales and head is not None
                and reshaped.get(node.input[0], node.input[0]) == head_codes
                and (attributes.get("bits", 4), attributes.get("block_size"), attributes.get("quantize_axis"))
                == (head.bits, head.block_size, 1)):
            raise WeightsError(f"{node.name}: an embedding quantized otherwise than the head ({EMBEDDING_OP} on "
                               f"{node.input[0]!r} and {node.input[2]!r}, {attributes}) is not read here")
    if not (cfg.tie_head and _HEAD in stored):
        return DeployedWeights(cfg, deployed, stored), names
    if lookups:  # the lookup reads the head's own codes: still one table
        deployed["tgt_embed.weight"] = deployed.pop(_HEAD).T.copy()
        return DeployedWeights(cfg, deployed, stored), names
    return DeployedWeights(replace(cfg, tie_head=False), deployed, stored), names  # the head quantized apart


def graphs_of(cfg: ModelConfig, params: Mapping[str, np.ndarray],
              directory: Path) -> dict[str, tuple[onnx.ModelProto, onnx.ModelProto]]:
    """A quantized export's graphs by role, each beside its float twin from the float export."""
    source = exported(cfg, params, framework="torch", dtype="float32")
    return {role: (onnx.load(str(source / file)), onnx.load(str(directory / file)))
            for role, file in json.loads((directory / "manifest.json").read_text())["graphs"].items()}


def within_a_step(bits: int) -> float:
    """How far, in quantization steps, a stored weight may lie from the parameter it was made from:
    one (round to nearest leaves half a step inside a block, a clipped block edge one), and the
    float32 rounding of the quotient w / scale that chose the code, |w / scale| ≤ 2^bits steps times
    float32's unit roundoff 2^-24."""
    return 1 + 2**bits * 2.0**-24


def block_steps(weight: BlockQuantized) -> np.ndarray:
    """[K, N]: each element's quantization step, |scale| of its column and block (the smallest
    positive float where a scale is 0: a block of zeros)."""
    return np.maximum(np.abs(block_elements(weight)[1]), np.finfo(np.float64).tiny)


def unrounded(parameter: np.ndarray, codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
              codes_range: tuple[int, int], bits: int) -> str:
    """Where a weight's codes are not its parameter rounded (SPEC §15.1), said; "" where every one is.
    Element by element, q = w / scale + z is the code the parameter asks for: round to nearest
    stores a code within half of it (ties either way), give or take the float32 rounding of the
    quotient (within_a_step's 2^bits · 2⁻²⁴). A code further is clipped only at the edge of the
    range, on the side beyond it (the code rounding asks for does not exist); anything else is
    another rule (a quantizer that truncates: up to a whole code off, all on one side)."""
    parameter, scales = np.asarray(parameter, np.float64), np.asarray(scales, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        asked = np.where(scales != 0, parameter / np.where(scales != 0, scales, 1.0) + zero_points, np.nan)
    off = asked - codes  # [K, N] in codes
    rounded = np.abs(off) <= 0.5 + (within_a_step(bits) - 1)
    clipped = ((codes == codes_range[1]) & (off > 0)) | ((codes == codes_range[0]) & (off < 0))
    zero_block = (scales == 0) & (parameter == 0)  # a block of zeros: any code is 0 times its scale
    missed = ~(rounded | clipped | zero_block)
    if not missed.any():
        return ""
    worst = np.unravel_index(int(np.nanargmax(np.where(missed, np.abs(off), -1.0))), off.shape)
    below = int((missed & (off > 0)).sum())
    return (f"{int(missed.sum())} of {missed.size} codes are not its elements rounded (the worst at "
            f"{[int(i) for i in worst]}: w / scale + z = {asked[worst]:.4f}, code {int(codes[worst])}; {below} of "
            f"them below the code asked for)")


def quantized_export(cfg: ModelConfig, params: Mapping[str, np.ndarray], scheme: QuantizationScheme,
                     directory: str | Path | None = None) -> Path:
    """The torch float32 export (export.cache) with its QUANTIZED_ROLES graphs quantized by
    the scheme, written as a directory OnnxTransformer serves, its manifest naming the scheme and
    what made it (onnxruntime's version, this file's digest). directory None: kept beside the float
    export in the cache, made again when the quantizer or this code changed."""
    source = exported(cfg, params, framework="torch", dtype="float32")
    manifest = json.loads((source / "manifest.json").read_text())
    if directory is None:
        root = cache_root()
        directory = (root / f"{source.name}-{scheme.name}") if root is not None else \
            Path(tempfile.mkdtemp(prefix="rosetta-quantized-"))
    directory = Path(directory)
    made_by = {"quantization": scheme.name, "quantizer": _quantizer_version()}

    def current() -> bool:
        try:
            written = json.loads((directory / "manifest.json").read_text())
        except (OSError, ValueError):
            return False
        return all(written.get(key) == value for key, value in made_by.items())

    if current():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory.parent))
    try:
        graphs, weights = {}, SharedWeights(staging)
        for role, file in manifest["graphs"].items():
            if role not in QUANTIZED_ROLES:
                continue  # the routed and in-place graphs stay with the float export
            graphs[role] = file
            save(quantize_graph(onnx.load(str(source / file)), params, scheme), staging / file, weights)
        (staging / "manifest.json").write_text(json.dumps(
            {**manifest, "graphs": graphs, "external_data": external_data_files(staging, graphs.values()), **made_by},
            indent=2) + "\n")
        # as export.cache's entries: one that another process (a test worker beside this one) made
        # meanwhile is kept, whole, since it may be reading it; only a stale or broken one is replaced
        if not current():
            shutil.rmtree(directory, ignore_errors=True)
            try:
                staging.rename(directory)
            except OSError:  # another process's rename came first
                if not current():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def quantized_products(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                       read: onnx.ModelProto | None = None) -> dict[str, tuple[np.ndarray, ...]]:
    """Each MatMulNBits node of a quantized graph run on `feeds` (onnxruntime, CPU): by the output it
    writes, (its input A, its output Y, its weight as SPEC §15 reads it from `read`, the graph as
    written, where that is not the one run: a kernel planted to read it otherwise), so that a product
    can be held to A·dequantize(B) one node at a time."""
    import onnxruntime as ort

    traced = copy.deepcopy(model)
    nodes = [node for node in traced.graph.node if node.op_type == QUANTIZED_OP]
    graph_outputs = {output.name for output in traced.graph.output}
    wanted = [name for node in nodes for name in (node.input[0], node.output[0])]
    traced.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                               for name in dict.fromkeys(wanted) if name not in graph_outputs)
    session = ort.InferenceSession(traced.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    values = dict(zip(names, session.run(None, {name: feeds[name] for name in (i.name for i in session.get_inputs())})))
    weights = stored_weights(model if read is None else read)
    return {node.output[0]: (values[node.input[0]], values[node.output[0]], weights[node.output[0]]) for node in nodes}


def _quantizer_version() -> str:
    """What a quantized export depends on besides the float one: onnxruntime's quantizer and this file."""
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__}, {hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]}"
