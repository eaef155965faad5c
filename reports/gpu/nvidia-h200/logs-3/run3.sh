#!/bin/bash
# Issue 42, third lease (one device call after three that carried onnxruntime-gpu's first pieces):
# install; (1) pytest -m gpu alone, its 4-minute target; (2) the bench alone: the onnxruntime
# contenders with and without CUDA graphs beside torch eager and reduce-overhead; (3) side by side,
# the checks not yet run on a GPU: qwen3-tiny, qwen3-moe-tiny, char-lm's onnx columns, then
# qwen2-tiny and mixtral-tiny as time allows. Arg 1: seconds for the whole. Everything into
# $OUT/gpu3.tgz and $OUT/summary.txt.
set -u
LIMIT=${1:-520}
S=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - S) )); }
say() { echo "[$(( $(date +%s) - S ))s] $*" | tee -a "$OUT/summary.txt"; }
L=/tmp/logs3
D=reports/gpu/nvidia-h200
pack() { tar czf "$OUT/gpu3.tgz" $D/check-* $D/bench-3 $L 2>/dev/null; }
trap pack EXIT
mkdir -p /tmp/ortp /tmp/site $L
cp .device/ort/part-03 /tmp/ortp/
ls -la /tmp/ortp > $L/pieces.txt
cat /tmp/ortp/part-0* | xz -d -T0 | tar -x -C /tmp/site || { say "unpack failed"; cat $L/pieces.txt | tee -a "$OUT/summary.txt"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/wheels/*.whl > $L/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false ROSETTA_ONNX_CACHE=/tmp/onnxcache
say "installed"
nvidia-smi > $L/nvidia-smi.txt 2>&1
python3 - > $L/environment.json 2>&1 <<PY
import json, onnxruntime as ort
from conformance.machine import device_facts, framework_versions
print(json.dumps({**device_facts("cuda"), "versions": framework_versions(), "onnxruntime_providers": ort.get_available_providers()}, indent=1, default=str))
PY
grep -E '"name"|"driver"|onnxruntime-gpu|"torch"|"jax"' $L/environment.json | tr -d '\n' | tee -a "$OUT/summary.txt"; echo
# (1) alone
T=$(date +%s)
timeout 200 python3 -m pytest -m gpu tests/test_torch.py tests/test_jax.py tests/test_export.py tests/test_fixed_greedy.py \
    -n 8 -p no:cacheprovider -q -rs --durations=15 > $L/pytest-gpu.txt 2>&1
say "pytest -m gpu exit $? in $(( $(date +%s) - T ))s: $(tail -n 1 $L/pytest-gpu.txt)"
grep -E "^FAILED|^ERROR" $L/pytest-gpu.txt | head -n 8 | cut -c1-300 | tee -a "$OUT/summary.txt"
pack
# (2) alone
T=$(date +%s)
timeout 150 python3 -m rosetta bench --preset paper-base --devices cuda --matrix-backends none --out $D/bench-3 \
    --contenders torch-cuda-float16,onnxruntime-cuda-float16,onnxruntime-cuda-graph-float16,torch.compile-reduce-overhead-cuda-float16 \
    > $L/bench.txt 2>&1
say "bench exit $? in $(( $(date +%s) - T ))s"
grep -E "^\| (onnxruntime|torch)[^|]*\| (near|equal|tokens)" $D/bench-3/bench.md | cut -c1-200 | tee -a "$OUT/summary.txt"
grep -E "greedy generation|forward b64" $D/bench-3/bench.md | cut -c1-220 | tee -a "$OUT/summary.txt"
pack
# (3) side by side (nothing timed)
B=torch,torch-math,jax,jax-math,onnx,onnx-jax
check() {  # preset backends jobs seconds [--backward]
  timeout $4 python3 -m rosetta check --preset $1 --backends $2 --devices cuda --jobs $3 ${5:-} \
      --report $D/check-$1 --quiet > $L/check-$1.txt 2>&1
  say "check-$1 exit $?: $(grep -E 'passed|failed' $L/check-$1.txt | tail -n 1)"
}
A=$(( $(left) - 15 ))
say "checks for ${A}s"
check qwen3-tiny $B 4 $A --backward &
check qwen3-moe-tiny $B 4 $A --backward &
check char-lm onnx,onnx-jax 2 $A &
wait
A=$(( $(left) - 15 ))
if [ $A -gt 60 ]; then
  check qwen2-tiny $B 4 $A --backward &
  check mixtral-tiny $B 4 $A --backward &
  wait
fi
pkill -f conformance.executors.local_pool
for f in $L/check-*.txt; do grep -E "FAIL|ERROR" $f | head -n 4 | cut -c1-250 | tee -a "$OUT/summary.txt"; done
say "end"
