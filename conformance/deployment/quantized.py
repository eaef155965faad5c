"""A weight-only quantized deployment, judged twice (SPEC §15).

1. **implementation**: the quantized graphs against the golden (float64) run on the weights they
   store, dequantized (export.quantize.deployed_weights), within the tolerance policy of their
   float32 compute. A failure is the kernel's, the exporter's or the dequantization's, never
   "quantization noise".
2. **cost**: the same output against the float golden on the original weights, measured, not
   judged by a tolerance: per real token the KL divergence of the quantized model's next-token
   distribution from the float one's, the share of tokens whose top-1 agrees, the logits' relative
   error. A budget (`kl=1e-2,top1=0.99`) turns the cost into a verdict.
The columns' makers and runners (onnxruntime's quantizer, onnxruntime-genai's builder, CTranslate2,
torchao) are conformance.deployment.quantized_serving's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conformance.adapter import Partial
from conformance.backends.numpy_backend import golden_output
from conformance.cases import applicable_cases, build_case
from conformance.diagnosis.localize import Localization, localize
from conformance.deployment.quantized_serving import column_name, served
from conformance.tolerance import Comparison, compare, compare_generation, tolerance
from spec import ModelConfig
from spec.quantization import QuantizationScheme, quantized_parameters

# the cases a quantized column runs: the whole model's teacher-forced logits and its cached decode
QUANTIZED_CASES = ("forward-none", "forward-pad_right", "forward-long", "decode-incremental", "decode-pad_right",
                   "generate-none", "generate-pad_left")
BUDGET_KEYS = {"kl": "the most mean KL divergence (nats per token) from the float golden",
               "top1": "the least share of tokens whose top-1 agrees with the float golden's"}


def parse_budget(text: str) -> dict[str, float]:
    """'kl=1e-2,top1=0.99' -> {'kl': 0.01, 'top1': 0.99}; an unknown key or a value out of range is
    refused by name."""
    budget = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        key, equals, value = part.partition("=")
        if not equals or key not in BUDGET_KEYS:
            raise ValueError(f"quantization budget {part!r}: give KEY=VALUE with KEY one of "
                             + "; ".join(f"{k} ({what})" for k, what in BUDGET_KEYS.items()))
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"quantization budget {key}={value!r}: not a number") from None
        if not math.isfinite(number) or number < 0 or key == "top1" and number > 1:
            wanted = "a share in [0, 1]" if key == "top1" else "a finite KL ≥ 0"
            raise ValueError(f"quantization budget {key}={value}: {wanted}")
        budget[key] = number
    if not budget:
        raise ValueError("quantization budget is empty: give kl=..., top1=... or both")
    return budget


@dataclass(frozen=True)
class Cost:
    """What quantization cost on one case's logits, against the float golden, over its real tokens."""

    tokens: int
    kl_mean: float  # nats per token: Σ p_float (log p_float − log p_quantized)
    kl_max: float
    top1: float  # the share of tokens whose argmax agrees
    relative_error: float  # ‖logits − float logits‖ / ‖float logits‖

    def within(self, budget: Mapping[str, float]) -> list[str]:
        """What the cost breaks of a budget (parse_budget), said with the figures; [] within it."""
        broken = []
        if "kl" in budget and self.kl_mean > budget["kl"]:
            broken.append(f"mean KL {self.kl_mean:.3g} > {budget['kl']:.3g}")
        if "top1" in budget and self.top1 < budget["top1"]:
            broken.append(f"top-1 agreement {self.top1:.4g} < {budget['top1']:.4g}")
        return broken


def cost(logits: np.ndarray, float_logits: np.ndarray, real: np.ndarray) -> Cost:
    """The Cost of logits [B, T, V] against the float golden's, over the tokens real [B, T] marks
    (KL and top-1 as the field's metrics take them: conformance.diagnosis.field_metrics.logit_metrics)."""
    from conformance.diagnosis.field_metrics import logit_metrics

    metrics = logit_metrics(float_logits, logits, real)
    quantized, reference = np.asarray(logits, np.float64)[real], np.asarray(float_logits, np.float64)[real]
    size = np.linalg.norm(reference)
    return Cost(tokens=metrics["positions"], kl_mean=metrics["kl_mean"], kl_max=metrics["kl_max"],
                top1=metrics["top1"], relative_error=float(np.linalg.norm(quantized - reference) / size) if size else 0.0)


@dataclass(frozen=True)
class GenerationCost:
    """What quantization cost a greedy generation: where its tokens part from the float golden's."""

    rows: int
    rows_parted: int
    first_parted: int | None  # the first step at which any row's token differs; None: every token the same

    def within(self, budget: Mapping[str, float]) -> list[str]:
        return []  # the budget bounds the logits' cost; a generation's parting is reported

    def describe(self) -> str:
        if self.first_parted is None:
            return "the float golden's tokens"
        return f"parts at step {self.first_parted} ({self.rows_parted} of {self.rows} rows)"


def generation_cost(tokens: np.ndarray, float_tokens: np.ndarray) -> GenerationCost:
    """Where greedy tokens [B, N] part from the float golden's."""
    differ = np.asarray(tokens) != np.asarray(float_tokens)
    parted = differ.any(axis=1)
    steps = [int(np.flatnonzero(row)[0]) for row in differ if row.any()]
    return GenerationCost(rows=len(differ), rows_parted=int(parted.sum()), first_parted=min(steps) if steps else None)


@dataclass(frozen=True)
class QuantizedCell:
    """One case of one quantized column: the implementation verdict and the cost."""

    column: str  # onnx-int4-b32-sym
    case: str  # forward-pad_right
    implementation: Comparison | None  # None: a dynamic scheme's, whose int8 products the golden does not compute
    cost: Cost | GenerationCost | None  # None: the case left out whole (left_out says why)
    over_budget: list[str] = field(default_factory=list)
    left_out: str = ""  # the rows the runner could not compute the spec's way, and why (adapter.Partial)

    @property
    def ran(self) -> bool:
        return self.cost is not None

    @property
    def passed(self) -> bool:
        return (self.implementation is None or self.implementation.passed) and not self.over_budget


def compute_mode(scheme: QuantizationScheme) -> str:
    """The tolerance policy's mode for a scheme's kernel (conformance.tolerance): float32, or, at
    accuracy_level 4, int8-activations."""
    return "int8-activations" if scheme.accuracy_level == 4 else "float32"


def real_tokens(cfg: ModelConfig, sublayer: str, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """[B, T'] the positions of a case's logits that are real tokens (a decode's after its prefix)."""
    from spec.masks import real_tokens as keep_of

    keep = keep_of(cfg, np.asarray(inputs["tgt_ids"]), "tgt")
    return keep[:, inputs["prefix"]:] if sublayer == "decode" else keep


def judge_quantized(cfg: ModelConfig, params: Mapping[str, np.ndarray], scheme: QuantizationScheme, runner,
                    deployed, cases: Sequence[str] = QUANTIZED_CASES,
                    budget: Mapping[str, float] | None = None) -> list[QuantizedCell]:
    """Each case run by `runner` (a quantized export's, conformance.backends.onnx_backend.OnnxRunner)
    judged against the golden on `deployed` (export.quantize.DeployedWeights; None for a dynamic
    scheme: no implementation reference) and measured against the float golden on `params`."""
    column = column_name(scheme)
    cells = []
    for name in cases:
        sublayer, mask_case = name.split("-", 1)
        if mask_case not in applicable_cases(cfg, sublayer):
            continue  # forward-long: rotary configs only
        case = build_case(cfg, params, sublayer, mask_case)
        output, compared, left_out = runner.run(sublayer, case.inputs), None, ""
        if isinstance(output, Partial):  # only some rows are the spec's computation: those are judged and measured
            if not np.any(output.compared):  # none: the case is recorded as left out, with why
                cells.append(QuantizedCell(column, name, None, None, left_out=output.describe()))
                continue
            output, compared, left_out = output.output, np.asarray(output.compared), output.describe()
        output = np.asarray(output)
        relative, implementation = case.tolerance(cfg, compute_mode(scheme)), None
        if sublayer == "generate":  # tokens: equal, or a near-tie of the golden's (SPEC §8)
            if deployed is not None:
                tokens, step_logits = golden_output(deployed.cfg, deployed.params, sublayer, case.inputs)
                implementation = compare_generation(output, tokens, step_logits, relative, case.inputs["eos_id"],
                                                    compared)
            rows = slice(None) if compared is None else compared
            spent = generation_cost(output[rows], golden_output(cfg, params, sublayer, case.inputs)[0][rows])
        else:
            if deployed is not None:
                implementation = compare(output, golden_output(deployed.cfg, deployed.params, sublayer, case.inputs),
                                         relative, case.floor, compared)
            real = real_tokens(cfg, sublayer, case.inputs)
            if compared is not None:  # [B] rows, or [B, steps] of a decode
                real = real & (compared[:, None] if compared.ndim == 1 else compared)
            spent = cost(output, golden_output(cfg, params, sublayer, case.inputs), real)
        cells.append(QuantizedCell(column, name, implementation, spent, spent.within(budget or {}), left_out))
    return cells


def stored_as_scheme(cfg: ModelConfig, scheme: QuantizationScheme, deployed) -> list[str]:
    """What a deployment (export.quantize.DeployedWeights) stores otherwise than the scheme says, a
    line per parameter: a linear layer left in float, a parameter quantized that the scheme leaves
    float, another code width, block size or zero-point choice, a weight further than one step
    from its parameter (round-to-nearest leaves half a step, a clipped block edge one: further is
    not this parameter's quantization). [] where it stores what the scheme says."""
    from export.quantize import within_a_step

    wanted = quantized_parameters(cfg, scheme)
    problems = [f"{name}: quantized ({weight.bits} bits); the scheme leaves it in float"
                for name, weight in deployed.stored.items() if name not in wanted]
    for name, bits in wanted.items():
        weight = deployed.stored.get(name)
        if weight is None:
            problems.append(f"{name}: left in float; the scheme quantizes it at {bits} bits")
            continue
        stored = (weight.bits, weight.block_size, weight.symmetric)
        if stored != (bits, None if scheme.builder == "torchao" else scheme.block_size, scheme.symmetric):
            problems.append(f"{name}: stored at {_layout(*stored)}; the scheme says "
                            f"{_layout(bits, scheme.block_size, scheme.symmetric)}")
        if weight.steps_from_parameter > within_a_step(weight.bits):
            problems.append(f"{name}: {weight.steps_from_parameter:.3g} quantization steps from the parameter at its "
                            "worst element (round to nearest leaves at most one): not this parameter's quantization")
        elif weight.not_rounded:
            problems.append(f"{name}: {weight.not_rounded}: a quantizer that does not round to nearest")
    return problems


def _layout(bits: int, block_size: int | None, symmetric: bool) -> str:
    blocks = "a scale per row" if block_size is None else f"in blocks of {block_size}"
    return f"{bits} bits {blocks}, {'symmetric' if symmetric else 'with zero points'}"


@dataclass(frozen=True)
class Product:
    """One quantized product of a graph held to the golden: the parameter it multiplies by, and its
    largest error against A·dequantize(B) over that product's tolerance (SPEC §8 at depth 1)."""

    parameter: str
    ratio: float

    @property
    def failed(self) -> bool:
        return not self.ratio <= 1.0


@dataclass(frozen=True)
class QuantizedColumn:
    """One quantized deployment's check: its scheme, what it stores otherwise than the scheme says,
    its cells, or the error that stopped it (an export the quantizer or the reader refused)."""

    name: str  # onnx-int4-b32-sym
    scheme: QuantizationScheme
    stored: list[str]
    cells: list[QuantizedCell]
    seconds: float
    error: str = ""
    stages: Localization | None = None  # where the cost arises (stage_costs)
    products: list[Product] = field(default_factory=list)  # the implementation, product by product
    int8_path: str = ""  # activations quantized at run time: the CPU's int8 products (SPEC §15.2), which set the cost
    budget: Mapping[str, float] = field(default_factory=dict)  # what judged its cost (parse_budget); {}: nothing

    @property
    def verdict(self) -> str:
        """error, fail, ran nothing (no case compared anything), measured (no golden computes its products
        and no budget judged its cost: nothing was judged), or ok: the matrix's rule, that a column that
        ran nothing is not a pass, and a cost is a measurement until a budget makes it a verdict."""
        ran = [cell for cell in self.cells if cell.ran]
        if self.error:
            return "error"
        if (not self.stored and all(cell.passed for cell in ran)
                and not any(product.failed for product in self.products)):
            if not ran:
                return "ran nothing"
            return "measured" if all(cell.implementation is None for cell in ran) and not self.budget else "ok"
        return "fail"

    @property
    def passed(self) -> bool:
        return self.verdict in ("ok", "measured")


def check_quantized(cfg: ModelConfig, params: Mapping[str, np.ndarray], schemes: Sequence[QuantizationScheme],
                    budget: Mapping[str, float] | None = None, device: str = "cpu",
                    directory: str | Path | None = None) -> list[QuantizedColumn]:
    """Each scheme's column: our torch float32 export quantized by onnxruntime's own quantizer
    (export.quantize.quantized_export), or onnxruntime-genai's builder's int4 model of `directory`
    (the Hugging Face directory the weights came from), its stored weights read back and held to the
    scheme (stored_as_scheme), its cells judged twice (judge_quantized)."""
    import time

    columns = []
    for scheme in schemes:
        start, name = time.perf_counter(), column_name(scheme)
        try:
            runner, deployed, graphs = served(cfg, params, scheme, device, directory)
            cells = judge_quantized(cfg, params, scheme, runner, deployed, budget=budget)
            if deployed is None:  # dynamic: its stored int8 weights are in a layout the spec does not read
                columns.append(QuantizedColumn(name, scheme, [], cells, time.perf_counter() - start,
                                               int8_path=_int8_path(device), budget=dict(budget or {})))
                continue
            found = (linear_products(cfg, params, scheme, runner, deployed) if scheme.builder == "torchao"
                     else products(cfg, params, scheme, *graphs["forward"]))
            columns.append(QuantizedColumn(name, scheme, stored_as_scheme(cfg, scheme, deployed), cells,
                                           time.perf_counter() - start, stages=stage_costs(cfg, params, deployed),
                                           products=found, budget=dict(budget or {})))
        except Exception as error:  # noqa: BLE001 - a column that cannot run is reported, the others still run
            columns.append(QuantizedColumn(name, scheme, [], [], time.perf_counter() - start,
                                           f"{type(error).__name__}: {error}"))
    return columns


def _int8_path(device: str) -> str:
    """What sets a dynamic column's cost besides its scheme: the CPU's int8 products (SPEC §15.2)."""
    from conformance.machine import int8_path

    if device != "cpu":
        return f"the {device} device's int8 kernels, which SPEC §15.2 does not describe"
    return int8_path().describe()


def products(cfg: ModelConfig, params: Mapping[str, np.ndarray], scheme: QuantizationScheme,
             float_model, quantized_model, served=None, names: Mapping[str, tuple[str, bool]] | None = None,
             ) -> list[Product]:
    """The implementation reference localized to the quantized product: each MatMulNBits node of the
    forward graph, run on forward-none's inputs, against its own input times the weight it stores,
    dequantized (in graph order: the first to fail is the first wrong product). served: the graph
    onnxruntime runs where it is not quantized_model as written (pages.quantized_mutations' kernel
    mistakes). names: each product's output -> (its parameter, transposed) where no float graph
    (float_model None) holds them: onnxruntime-genai's graph, fed its own inputs with an empty cache."""
    import export.quantize as reading  # its dequantize: the reading deployed_weights gave the golden
    from spec.masks import real_tokens as keep_of

    inputs = build_case(cfg, params, "forward", "none").inputs
    feeds = {"tgt_ids": np.asarray(inputs["tgt_ids"], np.int64), "tgt_keep": keep_of(cfg, inputs["tgt_ids"], "tgt")}
    if cfg.has_encoder:
        feeds.update(src_ids=np.asarray(inputs["src_ids"], np.int64), src_keep=keep_of(cfg, inputs["src_ids"], "src"))
    if float_model is None:
        feeds = _genai_feeds(cfg, quantized_model, feeds["tgt_ids"])
    names = reading.weight_names(float_model, params) if names is None else names
    found = []
    for output, (a, y, weight) in reading.quantized_products(
            quantized_model if served is None else served, feeds, read=quantized_model).items():
        expected = np.asarray(a, np.float64) @ reading.dequantize(weight)
        relative = tolerance(compute_mode(scheme), weight.k, 1)
        name, transposed = names.get(output, (output, False))
        found.append(Product("head.weight" if transposed else name, compare(y, expected, relative).ratio))
    return found


def _genai_feeds(cfg: ModelConfig, model, ids: np.ndarray) -> dict[str, np.ndarray]:
    """onnxruntime-genai's decoder inputs for unpadded rows `ids` and an empty cache: its input ids,
    its attention mask (ones), and each layer's past keys and values [B, kv heads, 0, head size]."""
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for graph_input in model.graph.input:
        if graph_input.name.startswith("past_key_values"):
            feeds[graph_input.name] = np.zeros((len(ids), cfg.kv_heads, 0, cfg.d_head), np.float32)
    return feeds


def stage_costs(cfg: ModelConfig, params: Mapping[str, np.ndarray], deployed) -> Localization:
    """Where quantization's cost arises, stage by stage (conformance.diagnosis.localize on forward-pad_right):
    the golden on the deployed weights held to the golden on the float ones, in float32 tolerances
    of each stage: isolated, a stage's own quantization on the float model's input; chained, the cost
    carried up to it. Both goldens run in float64, so every figure is quantization's, none rounding's."""
    from conformance.backends.numpy_backend import NumpyRunner

    case = build_case(cfg, params, "forward", "pad_right")
    return localize(cfg, params, NumpyRunner(deployed.cfg, deployed.params), "float32", case.inputs["src_ids"],
                    case.inputs["tgt_ids"])


def linear_products(cfg: ModelConfig, params: Mapping[str, np.ndarray], scheme: QuantizationScheme, runner,
                     deployed) -> list[Product]:
    """The torchao column's products, one by one: each quantized nn.Linear's input and output caught by
    a forward hook on forward-none, held to input · the weight it stores (+ its bias)."""
    import torch

    caught = {}

    def catch(path):
        def hook(module, inputs, output) -> None:  # None: the output goes on unchanged
            caught.setdefault(path, (inputs[0].detach().numpy(), output.detach().numpy()))
        return hook

    hooks = [module.register_forward_hook(catch(path))
             for path, module in runner.model.named_modules() if isinstance(module, torch.nn.Linear)]
    try:
        runner.run("forward", build_case(cfg, params, "forward", "none").inputs)
    finally:
        for hook in hooks:
            hook.remove()
    found = []
    for path, (a, y) in caught.items():
        weight = deployed.params[f"{path}.weight"]
        expected = np.asarray(a, np.float64) @ weight + np.asarray(deployed.params.get(f"{path}.bias", 0.0), np.float64)
        relative = tolerance(compute_mode(scheme), weight.shape[0], 1)
        found.append(Product(f"{path}.weight", compare(y, expected, relative).ratio))
    return found


def quantized_as_dict(column: QuantizedColumn) -> dict:
    """A column as report.json writes it."""
    return {"column": column.name, "scheme": column.scheme.name, "verdict": column.verdict, "passed": column.passed,
            "error": column.error, "budget": dict(column.budget),
            "seconds": round(column.seconds, 2), "stored": column.stored, "int8_path": column.int8_path,
            "stages": column.stages.to_dict()["stages"] if column.stages else [],
            "products": [{"parameter": product.parameter, "ratio": product.ratio} for product in column.products],
            "cells": [{"case": cell.case, "passed": cell.passed,
                       "implementation": None if cell.implementation is None else {
                           "passed": cell.implementation.passed, "max_abs_err": cell.implementation.max_abs_err,
                           "tol": cell.implementation.tol, "ratio": cell.implementation.ratio,
                           "reason": cell.implementation.reason},
                       "cost": dataclasses.asdict(cell.cost) if cell.ran else None, "left_out": cell.left_out,
                       "over_budget": cell.over_budget} for cell in column.cells]}


def format_quantized(columns: Sequence[QuantizedColumn]) -> str:
    """The quantized columns as text: per column a line of verdict, then per case the implementation
    error / tolerance and the cost figures."""
    lines = []
    for column in columns:
        lines.append(f"{column.name}: {_verdict(column)}")
        lines += [f"  stored otherwise than the scheme: {problem}" for problem in column.stored]
        if column.int8_path:
            lines.append(f"  int8 products on this machine: {column.int8_path}; the cost depends on them "
                         "(SPEC §15.2: where VPMADDUBSW saturates, it is larger)")
        if column.products:
            worst = max(column.products, key=lambda product: product.ratio)
            lines += [f"  product by product (each quantized product against its input times the weight it stores): "
                      f"{sum(product.failed for product in column.products)} of {len(column.products)} fail; largest "
                      f"{worst.ratio:.3g} of its tolerance ({worst.parameter})"]
        ran = [cell for cell in column.cells if cell.ran]
        if ran:
            head = ("case", "implementation (error / tolerance)", "mean KL", "max KL", "top-1", "relative error",
                    "budget")
            rows = [(cell.case, _implementation(cell.implementation), *_cost_columns(cell.cost),
                     "; ".join(cell.over_budget) or "-") for cell in ran]
            widths = [max(len(text) for text in part) for part in zip(head, *rows)]
            lines += ["  " + "  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip()
                      for row in (head, *rows)]
        lines += [f"  {cell.case}, left out{'' if cell.ran else ' whole'}: {cell.left_out}"
                  for cell in column.cells if cell.left_out]
        if column.stages:
            lines += ["  the cost stage by stage, in float32 tolerances (the golden on the stored weights against the "
                      "golden; isolated: the stage's own, chained: carried up to it):",
                      *("    " + line for line in _stage_table(column.stages).splitlines())]
    return "\n".join(lines)


def _verdict(column: QuantizedColumn) -> str:
    """'ok', 'measured' (nothing judged), what failed (the column's error, the implementation, the stored
    weights, the budget) or that it ran nothing."""
    verdict = column.verdict
    if verdict == "error":
        return f"ERROR ({column.error})"
    if verdict == "ran nothing":
        return "RAN NOTHING: every case was left out whole (below): nothing was compared"
    if verdict == "measured":
        return ("measured, not judged: no golden computes its products (its activations are quantized at run time) "
                "and no --quant-budget judges its cost")
    ran = [cell for cell in column.cells if cell.ran]
    wrong = [cell for cell in ran if cell.implementation is not None and not cell.implementation.passed]
    over = [cell for cell in ran if cell.over_budget]
    parts = [f"implementation fails in {len(wrong)} of {len(ran)} cases"] if wrong else []
    if first := next((product for product in column.products if product.failed), None):
        parts.append(f"first wrong product: {first.parameter} ({first.ratio:.3g} of its tolerance)")
    parts += [f"{len(column.stored)} weight(s) stored otherwise than the scheme"] if column.stored else []
    parts += [f"over the cost budget in {len(over)} of {len(ran)} cases"] if over else []
    return "ok" if not parts else "FAIL: " + "; ".join(parts)


def _cost_columns(spent: Cost | GenerationCost) -> tuple[str, str, str, str]:
    """(mean KL, max KL, top-1, relative error) as text; a generation's parting in their place."""
    if isinstance(spent, GenerationCost):
        return "-", "-", "-", f"greedy tokens: {spent.describe()}"
    return f"{spent.kl_mean:.3g}", f"{spent.kl_max:.3g}", f"{spent.top1:.4g}", f"{spent.relative_error:.3g}"


def _stage_table(stages: Localization) -> str:
    """The stages' cost, the stage whose own cost is largest marked."""
    costliest = max((stage for stage in stages.stages if stage.isolated_ratio is not None),
                    key=lambda stage: stage.isolated_ratio, default=None)
    lines = [f"{'stage':<20} {'isolated':>10} {'chained':>10}"]
    for stage in stages.stages:
        flag = "  <- largest own cost" if stage is costliest and stage.isolated_ratio else ""
        lines.append(f"{stage.name:<20} {_figure(stage.isolated_ratio):>10} {_figure(stage.chained_ratio):>10}{flag}")
    return "\n".join(lines)


def _figure(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3g}"


def _implementation(comparison: Comparison | None) -> str:
    if comparison is None:
        return "n/a: int8 activations at run time"
    return f"{'ok' if comparison.passed else 'FAIL'} {comparison.ratio:.3g}"
