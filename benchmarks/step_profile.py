"""The two decode-step graphs of one export side by side on the CPU: decoder_step, which writes
each step into copies of the whole cache, and decoder_step_in_place, whose GroupQueryAttention
writes it where it reads it (export/in_place_step.py).

    python -m benchmarks.step_profile --preset paper-base --out reports/bench/paper-base-step-profile.json
    python -m benchmarks.step_profile --preset llama-small --quantized int4-b32-sym-head4-al4 --out ...

Greedy generation (batch 8, 64 new tokens, the bench's prompts) runs with each graph from the
same weights in one process: the tokens must be equal, the runs are timed alternately (median of
`repeats`), and one more run of each is profiled by onnxruntime, whose node events give the step
graph's time by op type: the share of the cache copy (ScatterElements) before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks.contenders import BOS_ID, EOS_ID
from benchmarks.run import PLANS, _machine, _versions
from export.cache import exported
from export.graphs import DECODER_STEP, DECODER_STEP_IN_PLACE
from export.runner import CPU, OnnxTransformer, session_options
from spec import conformance_params, get_preset

STEPS = {DECODER_STEP: False, DECODER_STEP_IN_PLACE: True}  # role -> served in place


def op_shares(events: list[dict]) -> dict[str, float]:
    """onnxruntime profile events -> each op type's share of the nodes' kernel time, largest first."""
    by_op: Counter = Counter()
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"]
    total = sum(by_op.values())
    return {op: duration / total for op, duration in by_op.most_common()} if total else {}


def op_runs(events: list[dict]) -> dict[str, int]:
    """onnxruntime profile events -> how many times each op type's kernels ran (no timing in it)."""
    return dict(Counter(event["args"]["op_name"] for event in events
                        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time")))


def compare_steps(preset: str, *, batch: int | None = None, new_tokens: int | None = None,
                  repeats: int = 4, quantized: tuple = ()) -> dict:
    """Both step graphs of the float32 export, or (quantized: spec.quantization schemes) its in-place
    step beside each scheme's quantized export's (export.quantize.quantized_export): what a quantized
    step spends its time on (MatMulNBits against MatMul)."""
    from export.quantize import quantized_export

    cfg = get_preset(preset)
    plan = PLANS.get(preset, PLANS["tiny"])
    batch, new_tokens = batch or plan.generate_batch, new_tokens or plan.new_tokens
    params = conformance_params(cfg, seed=0)
    directory = exported(cfg, params)
    if quantized:  # the float32 in-place step, then each scheme's
        graphs = {DECODER_STEP_IN_PLACE: (directory, DECODER_STEP_IN_PLACE),
                  **{f"{DECODER_STEP_IN_PLACE} {scheme.name}": (quantized_export(cfg, params, scheme),
                                                               DECODER_STEP_IN_PLACE) for scheme in quantized}}
    else:
        graphs = {role: (directory, role) for role in STEPS}
    models = {}
    for label, (folder, role) in graphs.items():
        models[label] = OnnxTransformer(folder, device="cpu")
        if STEPS[role] and not models[label].in_place:
            raise RuntimeError(f"{preset}: this export has no {DECODER_STEP_IN_PLACE} graph")
        models[label].in_place = STEPS[role]
    vocab = cfg.src_vocab_size if cfg.has_encoder else cfg.tgt_vocab_size
    prompt = np.random.default_rng(0).integers(3, vocab, (batch, plan.generate_source))
    arguments = {"src_ids": prompt, "bos_id": BOS_ID} if cfg.has_encoder else {"prompt_ids": prompt}

    def generate(model: OnnxTransformer) -> np.ndarray:
        return model.greedy_generate(**arguments, eos_id=EOS_ID, max_new_tokens=new_tokens)

    tokens = {label: generate(model) for label, model in models.items()}
    first = next(iter(tokens.values()))
    if not quantized and not np.array_equal(*tokens.values()):
        raise RuntimeError(f"{preset}: the two step graphs generated different tokens")
    seconds: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(repeats):
        for label, model in models.items():
            start = time.perf_counter()
            generate(model)
            seconds[label].append(time.perf_counter() - start)
    rows = []
    for label, model in models.items():
        folder, role = graphs[label]
        with tempfile.TemporaryDirectory() as scratch:
            options = session_options(optimization="all", deterministic=False, threads=None,
                                      profile_prefix=str(Path(scratch) / "profile"))
            model.sessions[role] = ort.InferenceSession(str(folder / model.graphs[role]), options, providers=[CPU])
            generate(model)
            events = json.loads(Path(model.sessions[role].end_profiling()).read_text())
        median = statistics.median(seconds[label])
        produced = int((tokens[label] != cfg.pad_id).sum())
        rows.append({"graph": label, "median_seconds": median, "tokens_per_second": produced / median,
                     "same_tokens_as_float32": bool(np.array_equal(tokens[label], first)),
                     "op_shares": op_shares(events), "op_runs": op_runs(events)})
    return {"preset": preset, "batch": batch, "prompt": plan.generate_source, "new_tokens": new_tokens,
            "tokens": int((first != cfg.pad_id).sum()), "same_tokens": all(row["same_tokens_as_float32"] for row in rows),
            "repeats": repeats, "steps": rows, "machine": _machine(quick=True), "versions": _versions()}


def summary(result: dict) -> str:
    equal = "equal from every graph" if result["same_tokens"] else "a quantized graph's tokens its own"
    lines = [f"{result['preset']}: greedy b{result['batch']} x {result['new_tokens']} new tokens "
             f"({result['tokens']} tokens, {equal})"]
    for row in result["steps"]:
        shares = ", ".join(f"{op} {100 * share:.1f}%" for op, share in list(row["op_shares"].items())[:5])
        lines.append(f"  {row['graph']:22} {row['tokens_per_second']:7.0f} tokens/s; kernel time: {shares}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--quantized", metavar="SCHEMES",
                        help="profile the in-place step of these quantized exports beside the float32 one "
                             "(comma-separated, as rosetta bench --quantized)")
    args = parser.parse_args(argv)
    from spec.quantization import parse_scheme

    schemes = tuple(parse_scheme(name) for name in args.quantized.split(",")) if args.quantized else ()
    result = compare_steps(args.preset, quantized=schemes)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
