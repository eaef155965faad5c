"""What a check will cost, estimated before it runs (`rosetta check --budget`, conformance.plan.budget).

A cell's cost is its floating-point work, counted from the config and the case's shapes the way
a matmul counts (2 per multiply-add: the projections, the FFN, the attention's scores and sums,
the head), divided by the speed this machine measures for a matmul of a few rows at that
precision, times the backend's efficiency against it, plus the backend's cost per module
call (eager dispatch, a compiled program's first run). A column pays once to load its runner
(weights into the framework, an ONNX export), a case once for the golden's float64 reference
(and, for the generate cases, the golden's choice of rows).

The backend figures are calibrated on a 2-core machine from every cell of a check of SmolLM2-135M's
shape, two workers at once (`python -m benchmarks.cost_calibration REPORT WEIGHTS` sets each
column's estimate beside its measured seconds; reports/bench/cost-calibration/); they are
estimates to choose cells by, not measurements: the report sets the plan's estimate beside the
time the check took.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from conformance.cases import (BATCH, CHUNK_CASES, FAR_POSITION, GENERATION_CANDIDATES, LONG_PROMPT, MAX_NEW_TOKENS,
                               SRC_LEN, TGT_LEN, TEXT_CASES, TRAINING_STEPS, chunk_case_length, forward_of, is_gradient,
                               is_training)
from conformance.plan.memory import BYTES
from conformance.text import LONG_TEXT, NEW_TOKENS
from spec import ModelConfig
from spec.params import count_params

Column = tuple[str, str, str]

# ---- floating-point work ----------------------------------------------------------------------


def attention_weights(cfg: ModelConfig) -> int:
    """Multiplies per position of one attention's projections: q and o over H heads, k and v over H_kv."""
    return 2 * cfg.d_model * cfg.d_head * (cfg.n_heads + cfg.kv_heads)


def ffn_weights(cfg: ModelConfig) -> int:
    """Multiplies per position of one FFN: W1 and W2, and W3 where it is gated; in a mixture of
    experts, its router's and the k experts' each token runs, and the shared expert's and its gate's."""
    matrices = 3 if cfg.gated_ffn else 2
    one = matrices * cfg.d_model * cfg.d_ff
    if cfg.moe is None:
        return one
    shared = matrices * cfg.d_model * cfg.moe.shared_expert_d_ff + cfg.d_model if cfg.moe.shared_expert_d_ff else 0
    return cfg.moe.experts_per_token * one + cfg.d_model * cfg.moe.n_experts + shared


def calls_per_layer(cfg: ModelConfig) -> int:
    """Module calls one layer makes: attention, FFN, two norms; a mixture of experts' each expert
    too (the plain loop calls every expert a token chose, and the golden does)."""
    return 4 + (cfg.moe.n_experts if cfg.moe else 0)


def attention_scores(cfg: ModelConfig, queries: int, keys: int) -> int:
    """Multiplies of QKᵀ and of the weights times V, over every query head."""
    return 2 * queries * keys * cfg.n_heads * cfg.d_head


def layer_flops(cfg: ModelConfig, positions: int, keys: int, cross_keys: int = 0) -> int:
    """One layer run on `positions` new positions against `keys` keys each (and `cross_keys` of a
    source, in a decoder layer of an encoder-decoder)."""
    multiplies = positions * (attention_weights(cfg) + ffn_weights(cfg)) + attention_scores(cfg, positions, keys)
    if cross_keys:
        multiplies += positions * attention_weights(cfg) + attention_scores(cfg, positions, cross_keys)
    return 2 * multiplies


def linear_attention_flops(cfg: ModelConfig, positions: int) -> int:
    """A hybrid's gated DeltaNet (SPEC §5.15) on `positions` positions: its projections (q, k, v, z,
    β, the decay, o), its convolutions and the state's read and write per value head."""
    mixer = cfg.linear_attention
    keys, values = mixer.key_heads * mixer.key_head_dim, mixer.value_heads * mixer.value_head_dim
    projections = cfg.d_model * (2 * keys + 3 * values + 2 * mixer.value_heads)
    state = 3 * mixer.value_heads * mixer.key_head_dim * mixer.value_head_dim
    return 2 * positions * (projections + mixer.conv_kernel * (2 * keys + values) + state)


def head_flops(cfg: ModelConfig, positions: int) -> int:
    """The output projection onto the vocabulary."""
    return 2 * positions * cfg.d_model * cfg.tgt_vocab_size


@dataclass(frozen=True)
class Work:
    """What one run of a cell computes: its FLOPs and the module calls it makes (each layer's
    attention, FFN and norms, the head: where eager frameworks pay per call)."""

    flops: float
    calls: int
    golden_choice: float = 0.0  # FLOPs the golden spends choosing the case's inputs (generate rows)


def _stack(cfg: ModelConfig, positions: int) -> tuple[float, int]:
    """(FLOPs, calls) of the model's stacks on `positions` target positions of BATCH rows (and
    the source's, through the encoder)."""
    src = SRC_LEN if cfg.has_encoder else 0
    linear = sum(cfg.layer_kind(i) == "linear" for i in range(cfg.n_decoder_layers))  # a hybrid's (SPEC §5.15)
    mixing = linear * (linear_attention_flops(cfg, positions) + 2 * positions * ffn_weights(cfg)) if linear else 0
    flops = BATCH * (cfg.n_encoder_layers * layer_flops(cfg, src, src) + mixing
                     + (cfg.n_decoder_layers - linear) * layer_flops(cfg, positions, positions, src))
    return flops, (cfg.n_encoder_layers + cfg.n_decoder_layers) * calls_per_layer(cfg)


def case_work(cfg: ModelConfig, sublayer: str, mask_case: str, text_lengths: Sequence[int] = (),
              long_text: int = LONG_TEXT) -> Work:
    """The work of one cell of (sublayer, mask_case), from the case's shapes (conformance.cases):
    a gradient case three times its forward's (the forward and twice its size backward), a
    training case the loss's three times for each of its steps. text_lengths: the prompts' token
    counts, for the text cases."""
    if is_gradient(sublayer) or is_training(sublayer):
        forward = case_work(cfg, "loss" if is_training(sublayer) else forward_of(sublayer), mask_case,
                            text_lengths, long_text)
        steps = TRAINING_STEPS if sublayer == "train_steps" else 1
        return Work(3 * steps * forward.flops, 3 * steps * forward.calls, forward.golden_choice)
    d = cfg.d_model
    tokens = BATCH * TGT_LEN
    if sublayer in ("embedding", "positional", "norm"):
        return Work(10 * tokens * d, 1)
    if sublayer == "attention":
        return Work(2 * BATCH * attention_scores(cfg, TGT_LEN, TGT_LEN + PAST_KEYS), 1)
    if sublayer in ("mha", "mha_cross"):
        return Work(2 * tokens * attention_weights(cfg) + 2 * BATCH * attention_scores(cfg, TGT_LEN, SRC_LEN + 3), 1)
    if sublayer in ("ffn", "ffn_block", "experts"):
        return Work(2 * tokens * ffn_weights(cfg), 1)
    if sublayer == "router":
        return Work(2 * tokens * d * cfg.moe.n_experts, 1)
    if sublayer == "linear_attn":
        return Work(BATCH * linear_attention_flops(cfg, positions(cfg, sublayer, mask_case)), 1)
    if sublayer in ("encoder_layer", "decoder_layer"):
        return Work(BATCH * layer_flops(cfg, TGT_LEN, SRC_LEN + 3, SRC_LEN * cfg.has_encoder), calls_per_layer(cfg))
    if sublayer in ("logits", "log_probs"):
        return Work(BATCH * head_flops(cfg, TGT_LEN), 1)
    length = positions(cfg, sublayer, mask_case, text_lengths, long_text)
    if sublayer in ("encoder", "decoder", "forward", "loss"):
        flops, calls = _stack(cfg, length)
        head = BATCH * head_flops(cfg, length) if sublayer in ("forward", "loss") else 0
        return Work(flops + head, calls + 1)
    if sublayer == "decode":  # the prefix at once, then a step per position: a forward's FLOPs, more calls
        flops, calls = _stack(cfg, length)
        return Work(flops + BATCH * head_flops(cfg, length), calls * 5 + 1)
    if sublayer == "generate":
        new = NEW_TOKENS if mask_case in TEXT_CASES else MAX_NEW_TOKENS
        flops, calls = _stack(cfg, length)
        work = Work(flops + BATCH * head_flops(cfg, new), calls * new + new)
        if mask_case in TEXT_CASES:
            return work
        # the golden runs GENERATION_CANDIDATES rows for each one chosen (conformance.cases)
        return Work(work.flops, work.calls, GENERATION_CANDIDATES * work.flops)
    raise KeyError(f"unknown sublayer {sublayer!r}")


PAST_KEYS = 4  # the attention cases' keys beyond the queries, at most (the 'incremental' and lq_ne_lk cases)


def positions(cfg: ModelConfig, sublayer: str, mask_case: str, text_lengths: Sequence[int] = (),
              long_text: int = LONG_TEXT) -> int:
    """The target positions of a case: a model-level case's (conformance.cases._model_ids,
    _text_inputs), else TGT_LEN (a sublayer's case runs a few)."""
    if mask_case in CHUNK_CASES:  # a hybrid's (linear_attn's too)
        return min(chunk_case_length(cfg, mask_case), cfg.max_len)
    if sublayer not in ("encoder", "decoder", "forward", "loss", "decode", "generate") and mask_case not in TEXT_CASES:
        return TGT_LEN
    if mask_case == "text":
        longest = max(text_lengths, default=TGT_LEN)
        return longest + (NEW_TOKENS if sublayer == "generate" else 0)
    if mask_case == "text_long":
        return long_text
    if sublayer == "generate":
        return (SRC_LEN if cfg.has_encoder else 3) + MAX_NEW_TOKENS
    length = {"far": FAR_POSITION + 3, "long": LONG_PROMPT, "single_token": 1}.get(mask_case, TGT_LEN)
    return min(length, cfg.max_len)


def logit_rows(cfg: ModelConfig, sublayer: str, mask_case: str, text_lengths: Sequence[int] = (),
               long_text: int = LONG_TEXT) -> int:
    """The positions whose logits a case's output holds: a forward's or a loss's every position, a
    decoding's steps after its prefix (conformance.cases: decode-far's 2 after 1,001 positions), a
    generation's one step at a time (its output is tokens); none for a sublayer's hidden states."""
    length = positions(cfg, sublayer, mask_case, text_lengths, long_text)
    if sublayer == "decode":
        return 2 if mask_case == "far" else 4 if mask_case in TEXT_CASES else length - min(2, length - 1)
    if sublayer == "generate":
        return 1
    return length if sublayer in ("forward", "loss") else 0


# ---- this machine's speed -----------------------------------------------------------------------


SPEED_WIDTH = 1024  # the matmul measured: [64, 1024] x [1024, 4096], a few positions through a projection


@functools.cache
def matmul_speed(dtype: str) -> float:
    """FLOP/s of NumPy's matmul on this machine at float64 (dtype 'float64') or float32 (any other),
    on the cells' kind of shape: few rows. The median of twenty timings: steady within a few
    percent from run to run on an idle machine, and little moved by a process busy beside it
    for part of the time (a worker importing its framework)."""
    rng = np.random.default_rng(0)
    kind = np.float64 if dtype == "float64" else np.float32
    a = rng.standard_normal((64, SPEED_WIDTH)).astype(kind)
    b = rng.standard_normal((SPEED_WIDTH, 4 * SPEED_WIDTH)).astype(kind)
    a @ b  # the first call pays for the library's set-up
    timings = []
    for _ in range(20):
        start = time.perf_counter()
        a @ b
        timings.append(time.perf_counter() - start)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / statistics.median(timings)


@dataclass(frozen=True)
class Backend:
    """A backend's figures against NumPy's matmul at the same precision, with the processes of a
    run sharing the cores (calibrated, module docstring)."""

    efficiency: float = 0.3  # its matmul work at this share of NumPy's speed, float32 and float64
    bfloat16: float = 0.2  # in bfloat16 and float16 (which NumPy has no fast matmul for)
    float16: float = 0.1
    seconds_per_call: float = 2e-3  # dispatch per module call
    seconds_per_cell: float = 0.02  # a cell's fixed cost: inputs, the comparison
    load_seconds_per_gigabyte: float = 4.0  # the weights into the framework, per GB at the column's dtype
    load_seconds: float = 1.0
    export_seconds_per_billion: float = 0.0  # an export not yet cached, per billion parameters


BACKENDS: dict[str, Backend] = {
    "numpy-float32": Backend(efficiency=0.37, seconds_per_call=1.4e-3, seconds_per_cell=0.005,
                             load_seconds_per_gigabyte=2.0),
    "torch": Backend(efficiency=0.34, bfloat16=0.39, float16=0.09, seconds_per_call=1.5e-3, seconds_per_cell=0.005),
    "torch-math": Backend(efficiency=0.26, bfloat16=0.41, float16=0.07, seconds_per_call=5e-4, seconds_per_cell=0.005),
    # each new shape compiles a program: JAX pays per call what the others pay per run
    "jax": Backend(efficiency=0.2, bfloat16=0.21, float16=0.19, seconds_per_call=5e-3, seconds_per_cell=0.03,
                   load_seconds=5.0),
    "jax-math": Backend(efficiency=0.21, bfloat16=0.26, float16=0.17, seconds_per_call=2.5e-3, seconds_per_cell=0.01,
                        load_seconds=4.0),
    # the export (a trace, the graph written and checked, a session made) is most of a column's load
    "onnx": Backend(efficiency=0.26, bfloat16=0.26, float16=0.26, seconds_per_call=7e-4, load_seconds_per_gigabyte=22.0,
                    load_seconds=5.0),
    "onnx-jax": Backend(efficiency=0.2, bfloat16=0.2, float16=0.2, seconds_per_call=3e-4,
                        load_seconds_per_gigabyte=15.0, load_seconds=5.0, export_seconds_per_billion=1000.0),
    # in this process beside the workers: its Python shares the harness's interpreter
    "transformers": Backend(efficiency=0.21, bfloat16=0.28, float16=0.07, seconds_per_call=7e-3, seconds_per_cell=0.0),
    "onnxruntime-genai": Backend(efficiency=0.35, seconds_per_call=3e-3, seconds_per_cell=0.0,
                                 load_seconds_per_gigabyte=45.0, load_seconds=10.0),
}
START_SECONDS = 20.0  # a check's own start: the model read, the workers' weights file written
GOLDEN = Backend(efficiency=0.34, seconds_per_call=1.5e-3)


def backend_figures(name: str) -> Backend:
    """A backend's figures; one this module does not know gets the middling defaults."""
    return BACKENDS.get(name, Backend())


def cell_seconds(cfg: ModelConfig, work: Work, column: Column) -> float:
    """The estimated seconds of one cell on `column` (its load not counted)."""
    name, dtype, _ = column
    figures = backend_figures(name)
    speed = matmul_speed("float64" if dtype == "float64" else "float32")
    speed *= {"bfloat16": figures.bfloat16, "float16": figures.float16}.get(dtype, figures.efficiency)
    return work.flops / speed + work.calls * figures.seconds_per_call + figures.seconds_per_cell


def load_seconds(cfg: ModelConfig, column: Column, cold: bool = False) -> float:
    """The estimated seconds to load a column's runner: its weights at its dtype, and its export
    where it is `cold` (not cached: jax2onnx takes minutes over a real checkpoint)."""
    name, dtype, _ = column
    figures = backend_figures(name)
    gigabytes = count_params(cfg) * BYTES.get(dtype, 4) / 1e9
    export = figures.export_seconds_per_billion * count_params(cfg) / 1e9 if cold else 0.0
    return figures.load_seconds + figures.load_seconds_per_gigabyte * gigabytes + export


def golden_seconds(cfg: ModelConfig, work: Work) -> float:
    """The golden's float64 reference of a case, and its choice of the case's inputs."""
    speed = matmul_speed("float64") * GOLDEN.efficiency
    return (work.flops + work.golden_choice) / speed + work.calls * GOLDEN.seconds_per_call


@dataclass
class Estimate:
    """A set of cells' estimated cost: the columns' loads, the cells, the golden's references,
    and the wall time on `workers` processes."""

    loads: float = 0.0
    cells: float = 0.0
    golden: float = 0.0
    workers: int = 1

    @property
    def seconds(self) -> float:
        return START_SECONDS + (self.golden + self.loads + self.cells) / self.workers


def estimate(cfg: ModelConfig, cells: Iterable[tuple[str, str, Column]], workers: int = 1,
             text_lengths: Sequence[int] = (), cold: Container[Column] = ()) -> Estimate:
    """The estimate of running `cells` ((sublayer, mask case, column) each) on `workers` processes;
    the columns in `cold` export first."""
    total, columns, cases = Estimate(workers=max(1, workers)), set(), set()
    for sublayer, mask_case, column in cells:
        work = case_work(cfg, sublayer, mask_case, text_lengths)
        total.cells += cell_seconds(cfg, work, column)
        if column not in columns:
            columns.add(column)
            total.loads += load_seconds(cfg, column, column in cold)
        if (sublayer, mask_case) not in cases:
            cases.add((sublayer, mask_case))
            total.golden += golden_seconds(cfg, work)
    return total
