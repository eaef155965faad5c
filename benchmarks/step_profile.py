"""The two decode-step graphs of one export side by side on the CPU: decoder_step, which writes
each step into copies of the whole cache, and decoder_step_in_place, whose GroupQueryAttention
writes it where it reads it (export/in_place_step.py).

    python -m benchmarks.step_profile --preset paper-base --out reports/bench/paper-base-step-profile.json

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
from spec import get_preset, init_params

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
                  repeats: int = 4) -> dict:
    cfg = get_preset(preset)
    plan = PLANS.get(preset, PLANS["tiny"])
    batch, new_tokens = batch or plan.generate_batch, new_tokens or plan.new_tokens
    params = init_params(cfg, seed=0)
    directory = exported(cfg, params)
    models = {}
    for role, in_place in STEPS.items():
        models[role] = OnnxTransformer(directory, device="cpu")
        if in_place and not models[role].in_place:
            raise RuntimeError(f"{preset}: this export has no {DECODER_STEP_IN_PLACE} graph")
        models[role].in_place = in_place
    vocab = cfg.src_vocab_size if cfg.has_encoder else cfg.tgt_vocab_size
    prompt = np.random.default_rng(0).integers(3, vocab, (batch, plan.generate_source))
    arguments = {"src_ids": prompt, "bos_id": BOS_ID} if cfg.has_encoder else {"prompt_ids": prompt}

    def generate(model: OnnxTransformer) -> np.ndarray:
        return model.greedy_generate(**arguments, eos_id=EOS_ID, max_new_tokens=new_tokens)

    tokens = {role: generate(model) for role, model in models.items()}
    if not np.array_equal(*tokens.values()):
        raise RuntimeError(f"{preset}: the two step graphs generated different tokens")
    produced = int((tokens[DECODER_STEP] != cfg.pad_id).sum())
    seconds: dict[str, list[float]] = {role: [] for role in models}
    for _ in range(repeats):
        for role, model in models.items():
            start = time.perf_counter()
            generate(model)
            seconds[role].append(time.perf_counter() - start)
    rows = []
    for role, model in models.items():
        with tempfile.TemporaryDirectory() as folder:
            options = session_options(optimization="all", deterministic=False, threads=None,
                                      profile_prefix=str(Path(folder) / "profile"))
            model.sessions[role] = ort.InferenceSession(str(directory / model.graphs[role]), options, providers=[CPU])
            generate(model)
            events = json.loads(Path(model.sessions[role].end_profiling()).read_text())
        median = statistics.median(seconds[role])
        rows.append({"graph": role, "median_seconds": median, "tokens_per_second": produced / median,
                     "op_shares": op_shares(events), "op_runs": op_runs(events)})
    return {"preset": preset, "batch": batch, "prompt": plan.generate_source, "new_tokens": new_tokens,
            "tokens": produced, "same_tokens": True, "repeats": repeats, "steps": rows,
            "machine": _machine(quick=True), "versions": _versions()}


def summary(result: dict) -> str:
    lines = [f"{result['preset']}: greedy b{result['batch']} x {result['new_tokens']} new tokens "
             f"({result['tokens']} tokens, equal from both graphs)"]
    for row in result["steps"]:
        shares = ", ".join(f"{op} {100 * share:.1f}%" for op, share in list(row["op_shares"].items())[:5])
        lines.append(f"  {row['graph']:22} {row['tokens_per_second']:7.0f} tokens/s; kernel time: {shares}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = compare_steps(args.preset)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
