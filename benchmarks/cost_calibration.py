"""The cost model's figures (conformance.plan.cost) against a check that ran: each column's estimated
seconds beside the seconds its cells took, from a `rosetta check --report` folder's report.json
and the weights it checked.

    python -m benchmarks.cost_calibration REPORT.json WEIGHTS.safetensors [--out FOLDER] [--source TEXT]

Writes calibration.md and calibration.json into FOLDER (default: print only)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from conformance.plan.cost import START_SECONDS, case_work, cell_seconds, estimate, load_seconds, matmul_speed
from spec import load_weights


def compare(report: dict, cfg) -> dict:
    """Per column: cells, measured seconds (load included), estimated; and the whole run's wall time."""
    cells = [c for c in report["cells"] if c["status"] in ("pass", "fail", "error")]
    by_column = defaultdict(list)
    for cell in cells:
        by_column[(cell["backend"], cell["dtype"], cell["device"])].append(cell)
    columns = []
    for column, found in sorted(by_column.items()):
        estimated = load_seconds(cfg, column) + sum(cell_seconds(cfg, case_work(cfg, c["sublayer"], c["mask_case"]),
                                                                 column) for c in found)
        measured = sum(c["seconds"] for c in found)
        columns.append({"column": "/".join(column), "cells": len(found), "measured_s": round(measured, 1),
                        "estimated_s": round(estimated, 1), "ratio": round(estimated / max(measured, 1e-9), 2)})
    whole = estimate(cfg, [(c["sublayer"], c["mask_case"], (c["backend"], c["dtype"], c["device"])) for c in cells],
                     workers=2)
    return {"speed_gflops": {"float64": round(matmul_speed("float64") / 1e9, 1),
                             "float32": round(matmul_speed("float32") / 1e9, 1)},
            "columns": columns, "wall_measured_s": report["wall_seconds"], "wall_estimated_s": round(whole.seconds, 1),
            "start_s": START_SECONDS}


def markdown(found: dict, source: str) -> str:
    lines = [f"# The cost model against a check that ran ({source})", "",
             f"NumPy matmul here: {found['speed_gflops']['float64']} GFLOP/s float64, "
             f"{found['speed_gflops']['float32']} float32. Wall time: measured {found['wall_measured_s']:.0f} s, "
             f"estimated {found['wall_estimated_s']:.0f} s (two workers).", "",
             "| column | cells | measured s | estimated s | estimate / measured |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {c['column']} | {c['cells']} | {c['measured_s']} | {c['estimated_s']} | {c['ratio']} |"
              for c in found["columns"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("weights")
    parser.add_argument("--out")
    parser.add_argument("--source", help="what the report is of, for the page's title (default: the weights' name)")
    args = parser.parse_args(argv)
    cfg, _ = load_weights(args.weights, mapped=True)
    found = compare(json.loads(Path(args.report).read_text()), cfg)
    page = markdown(found, args.source or Path(args.weights).name)
    print(page)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(found, indent=1) + "\n")
        (out / "calibration.md").write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
