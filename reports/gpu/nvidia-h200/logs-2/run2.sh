#!/bin/bash
# Issue 42, second H200 call: install, then (B) the genai-cuda column and the CUDA-graph probe, alone,
# then (A) side by side: tiny's onnx columns (the use_tf32=0 fix), the modern presets with --backward,
# and pytest -m gpu. Arg 1: seconds. Everything into $OUT/gpu2.tgz and $OUT/summary.txt.
set -u
LIMIT=${1:-520}
S=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - S) )); }
say() { echo "[$(( $(date +%s) - S ))s] $*" | tee -a "$OUT/summary.txt"; }
L=/tmp/logs2
pack() { tar czf "$OUT/gpu2.tgz" reports/gpu $L 2>/dev/null; }
trap pack EXIT
mkdir -p /tmp/ortp /tmp/site $L
cp .device/ort/part-04 /tmp/ortp/
ls -la /tmp/ortp > $L/pieces.txt
cat /tmp/ortp/part-0* | xz -d -T0 | tar -x -C /tmp/site || { say "unpack failed"; cat $L/pieces.txt | tee -a "$OUT/summary.txt"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .device/wheels/*.whl .device/extra/*.whl > $L/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false ROSETTA_ONNX_CACHE=/tmp/onnxcache
say "installed"
nvidia-smi > $L/nvidia-smi.txt 2>&1
D=reports/gpu/$(python3 -c "from rosetta.gpu import folder_name; from conformance.machine import device_facts; print(folder_name(device_facts('cuda')['name']))")
mkdir -p $D
python3 - > $L/environment.json 2>&1 <<PY
import json, onnxruntime as ort, onnxruntime_genai as og
from conformance.machine import device_facts, framework_versions
print(json.dumps({**device_facts("cuda"), "versions": framework_versions(), "onnxruntime_providers": ort.get_available_providers(),
                  "onnxruntime_genai": og.__version__}, indent=1, default=str))
PY
head -c 600 $L/environment.json | tee -a "$OUT/summary.txt"; echo
say "folder $D"
# Phase B, alone
timeout 60 python3 .device/scripts/genai_check.py $L/genai-cuda.json > $L/genai-cuda.txt 2>&1
say "genai-cuda exit $?"; tail -n 12 $L/genai-cuda.txt | tee -a "$OUT/summary.txt"
timeout 110 python3 .device/scripts/cuda_graph_probe.py $L/cuda-graph.json paper-base float16 64 > $L/cuda-graph.txt 2>&1
say "cuda-graph exit $?"; grep -v "^\s*$" $L/cuda-graph.txt | grep -v "W:onnxruntime" | tail -n 8 | cut -c1-600 | tee -a "$OUT/summary.txt"
pack
# Phase A, side by side (nothing timed)
A=$(( $(left) - 20 ))
say "phase A for ${A}s"
B=torch,torch-math,jax,jax-math,onnx,onnx-jax
timeout $A python3 -m rosetta check --preset tiny --backends onnx,onnx-jax --devices cuda --jobs 2 \
    --report $D/check-tiny-onnx --quiet > $L/check-tiny-onnx.txt 2>&1 &
for p in llama-tiny qwen3-tiny qwen2-tiny; do
  timeout $A python3 -m rosetta check --preset $p --backends $B --devices cuda --backward --jobs 4 \
      --report $D/check-$p --quiet > $L/check-$p.txt 2>&1 &
done
timeout $A python3 -m pytest -m gpu tests/test_torch.py tests/test_jax.py tests/test_export.py -p no:cacheprovider \
    -q -rs --durations=10 > $L/pytest-gpu.txt 2>&1 &
wait
pkill -f conformance.executors.local_pool
say "phase A done"
for f in check-tiny-onnx check-llama-tiny check-qwen3-tiny check-qwen2-tiny; do
  say "$f: $(grep -E 'passed|failed' $L/$f.txt | tail -n 1)"
done
say "pytest: $(tail -n 1 $L/pytest-gpu.txt)"
grep -E "^FAILED|^ERROR" $L/pytest-gpu.txt | head -n 8 | cut -c1-300 | tee -a "$OUT/summary.txt"
for f in check-tiny-onnx check-llama-tiny check-qwen3-tiny check-qwen2-tiny; do
  grep -E "FAIL|ERROR" $L/$f.txt | head -n 4 | cut -c1-250 | tee -a "$OUT/summary.txt"
done
say "end"
