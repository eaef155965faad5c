"""There (GPU): onnxruntime-genai-cuda's models of a random Llama (built here with -e cuda at fp32 and
fp16 by genai_stage.py) through the harness's whole-model cells on CUDA, against the golden.
argv: out.json [device] [folder]."""
import json
import sys
import time
from pathlib import Path

from conformance.adapter import register_backend
from conformance.backends.genai_backend import GenaiBackend, GenaiRunner
from conformance.harness import plan_matrix, run_matrix
from spec.weights import load_weights

out = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
root = Path(sys.argv[3] if len(sys.argv) > 3 else ".device/genai")
cfg, params = load_weights(root / "weights.safetensors")
BUILDS = {"float32": root / "fp32", "float16": root / "fp16"}


class PrebuiltGenai(GenaiBackend):
    """genai's column on models its builder wrote elsewhere (-e cuda: the builder needs
    transformers, which the GPU image lacks)."""

    name = "onnxruntime-genai-cuda"

    def devices(self):
        return [device]

    def supports(self, dtype, device):
        return None if dtype in BUILDS else f"no {dtype} build"

    def load(self, cfg, params, dtype, device):
        return GenaiRunner(BUILDS[dtype], cfg)


register_backend("onnxruntime-genai-cuda", lambda: PrebuiltGenai(root))
if device == "cuda":  # genai's CUDA provider finds cuBLAS and cuDNN by name, as onnxruntime's does
    from export.runner import load_cuda_libraries
    print("loaded", len(load_cuda_libraries()), "CUDA libraries")
import onnxruntime_genai as og  # noqa: E402

start = time.time()
results = run_matrix(cfg, params, plan_matrix(cfg, ["onnxruntime-genai-cuda"], list(BUILDS), [device]))
record = {"onnxruntime_genai": og.__version__, "device": device, "seconds": round(time.time() - start, 1),
          "cells": [{"id": r.test_id, "status": r.status, "reason": (r.reason or "")[:300],
                     "left_out": r.left_out, "max_abs_err": r.max_abs_err, "tol": r.tol} for r in results]}
Path(out).write_text(json.dumps(record, indent=1, default=str))
counts = {}
for r in results:
    counts[r.status] = counts.get(r.status, 0) + 1
print("genai", og.__version__, device, counts)
for r in results:
    if r.status not in ("pass", "PASS", "skip", "SKIP"):
        print(" ", r.test_id, r.status, (r.reason or "")[:200])
