"""The field's metrics beside our verdict, on the whole-model cells (forward, decode, generate).

Other checkers of record judge a port by its final output only, with a fixed threshold: the
KL divergence of each token's next-token distribution from the reference's (MaxText's logit
checker), or whether each side's greedy token is among the other's top k where the two part
(vLLM's model tests). We report them so that a user can compare, and say whether each cell would
pass them; our verdict stays the tolerance policy (SPEC §8), which is stricter where it matters
(every logit, not a distribution's summary) and looser where the dtype says it must be.

- KL(golden ‖ backend) per position, = Σ_v p_v (log p_v − log q_v), p and q the softmax of the
  golden's and the backend's logits (in float64); its largest and its mean over the positions;
- top-1 agreement: the share of positions where both argmaxes are the same token;
- top-K containment: the share of positions where each argmax is among the other's K largest;
- generation: the first step where a row's tokens part from the golden's, and whether the
  backend's token there is among the golden's K largest logits at that step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

KL_LIMIT = 1e-4  # MaxText's logit checker, as set for float32 checks: every token's KL at most this
TOP_K = 5  # vLLM's top-k containment, as its model tests call it
CHUNK = 64  # positions at a time: a real vocabulary's float64 softmax is large


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax(x) = x − max x − log Σ exp(x − max x), in float64."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """[N, k] the indices of each row's k largest."""
    k = min(k, logits.shape[-1])
    return np.argpartition(-logits, k - 1, axis=-1)[:, :k]


def logit_metrics(golden: np.ndarray, actual: np.ndarray, rows: np.ndarray | None = None,
                  dtype: str = "float32") -> dict:
    """The field's metrics of logits [..., V] against the golden's; `rows` (boolean over the
    leading axes, adapter.Partial's) keeps the rows a backend computed."""
    golden, actual = np.asarray(golden), np.asarray(actual)
    positions = np.arange(math.prod(golden.shape[:-1]))  # the rows [..., V] compared, flattened
    if rows is not None:
        keep = np.asarray(rows, bool)
        if keep.ndim < golden.ndim and keep.shape == golden.shape[:keep.ndim]:
            positions = positions[np.broadcast_to(keep.reshape(keep.shape + (1,) * (golden.ndim - 1 - keep.ndim)),
                                                  golden.shape[:-1]).reshape(-1)]
    # CHUNK positions at a time, cast there: neither side is copied whole (a real vocabulary's logits
    # are gigabytes at float64)
    golden, actual = golden.reshape(-1, golden.shape[-1]), actual.reshape(-1, actual.shape[-1])
    kl, top1, contained = [], 0, 0
    for start in range(0, positions.size, CHUNK):
        chunk = positions[start:start + CHUNK]
        p_log, q_log = _log_softmax(golden[chunk]), _log_softmax(actual[chunk])
        kl.append((np.exp(p_log) * (p_log - q_log)).sum(axis=-1))
        best_p, best_q = p_log.argmax(axis=-1), q_log.argmax(axis=-1)
        top1 += int((best_p == best_q).sum())
        top_p, top_q = _top_k(p_log, TOP_K), _top_k(q_log, TOP_K)
        contained += int(sum(best_q[i] in top_p[i] and best_p[i] in top_q[i] for i in range(len(best_p))))
    per_position = np.concatenate(kl) if kl else np.zeros(0)
    if not np.all(np.isfinite(per_position)):
        worst = float("inf")
    else:
        worst = float(per_position.max(initial=0.0))
    count = max(1, positions.size)
    return {"kl_max": worst, "kl_mean": float(per_position.mean()) if per_position.size else 0.0,
            "top1": top1 / count, f"top{TOP_K}": contained / count, "positions": int(positions.size),
            "maxtext": worst <= KL_LIMIT if dtype == "float32" else None, "vllm": contained == positions.size}


def generation_metrics(tokens: np.ndarray, golden_tokens: np.ndarray, golden_step_logits: np.ndarray,
                       rows: np.ndarray | None = None) -> dict:
    """Greedy tokens [B, N] against the golden's: the share of steps before each row parts from
    the golden (top-1 agreement of a free run), the first (row, step) where one parts, and whether
    the backend's token there is among the golden's TOP_K at that step (vLLM's criterion)."""
    tokens, golden_tokens = np.asarray(tokens), np.asarray(golden_tokens)
    if tokens.shape != golden_tokens.shape:
        return {"diverged_at": None, "agreed_steps": 0.0, f"top{TOP_K}_at_divergence": None, "vllm": False}
    agreed, total, first, contained = 0, 0, None, True
    for row in range(golden_tokens.shape[0]):
        if rows is not None and np.shape(rows)[:1] == golden_tokens.shape[:1] and not np.asarray(rows)[row].any():
            continue
        differ = np.flatnonzero(tokens[row] != golden_tokens[row])
        step = int(differ[0]) if differ.size else golden_tokens.shape[1]
        agreed, total = agreed + step, total + golden_tokens.shape[1]
        if differ.size:
            inside = int(tokens[row, step]) in _top_k(np.asarray(golden_step_logits)[row, step][None], TOP_K)[0]
            contained = contained and inside
            if first is None or step < first[1]:
                first = (row, step)
    return {"diverged_at": list(first) if first else None, "agreed_steps": agreed / max(1, total),
            f"top{TOP_K}_at_divergence": None if first is None else contained, "vllm": contained}


def field_metrics(sublayer: str, output, reference, rows: np.ndarray | None, dtype: str) -> dict | None:
    """The field's metrics of a whole-model cell's output against the golden's reference; None for
    other cells, or an output that is not of the reference's shape (the cell fails on its own)."""
    if sublayer == "generate":
        golden_tokens, step_logits = reference[0], reference[1]
        return generation_metrics(output, golden_tokens, step_logits, rows)
    if sublayer in ("forward", "decode"):
        if np.shape(output) != np.shape(reference):
            return None
        return logit_metrics(reference, output, rows, dtype)
    return None


def format_field_metrics(cells: list[Mapping]) -> str:
    """A line per whole-model cell: our verdict beside the field's metrics and criteria."""
    lines = [f"{'cell':48s} {'ours':5s} {'max KL':>9s} {'mean KL':>9s} {'top-1':>6s} {'top-5':>6s}  "
             f"MaxText KL≤{KL_LIMIT:g}  vLLM top-{TOP_K}"]
    for cell in cells:
        metrics = cell["field"]
        verdict = {True: "pass", False: "FAIL", None: "-"}
        if "kl_max" in metrics:
            lines.append(f"{cell['id']:48s} {cell['status']:5s} {metrics['kl_max']:9.2e} {metrics['kl_mean']:9.2e} "
                         f"{metrics['top1']:6.3f} {metrics[f'top{TOP_K}']:6.3f}  {verdict[metrics['maxtext']]:17s}  "
                         f"{verdict[metrics['vllm']]}")
        else:
            parted = metrics["diverged_at"]
            where = "no step parts" if parted is None else f"parts at row {parted[0]} step {parted[1]}"
            lines.append(f"{cell['id']:48s} {cell['status']:5s} {where:>32s} {metrics['agreed_steps']:6.3f}  "
                         f"{'-':17s}  {verdict[metrics['vllm']]}")
    return "\n".join(lines)
