#!/bin/bash
# The GPU session's check in one command (issue 42). Arg 1: seconds this command may take.
# Everything goes to $OUT/gpu.tgz (reports/gpu/<device>/ and the logs) and $OUT/summary.txt.
set -u
LIMIT=${1:-540}
S=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - S) )); }
say() { echo "[$(( $(date +%s) - S ))s] $*" | tee -a "$OUT/summary.txt"; }
pack() { tar czf "$OUT/gpu.tgz" reports/gpu /tmp/logs 2>/dev/null; }
trap pack EXIT
mkdir -p /tmp/ortp /tmp/site /tmp/logs
L=/tmp/logs
cp .device/ort/part-03 /tmp/ortp/
ls -la /tmp/ortp > $L/pieces.txt
cat /tmp/ortp/part-0* | xz -d -T0 | tar -x -C /tmp/site || { say "unpack failed"; cat $L/pieces.txt; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .device/wheels/*.whl .device/extra/*.whl > $L/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false ROSETTA_ONNX_CACHE=/tmp/onnxcache
say "installed"
nvidia-smi > $L/nvidia-smi.txt 2>&1
python3 - > $L/sanity.txt 2>&1 <<'EOF'
import onnxruntime as ort
import export.runner as runner
print(ort.__file__, ort.__version__, ort.get_available_providers())
print("cuda_available:", runner.cuda_available())
print("loaded:", runner.load_cuda_libraries())
import torch, jax
print("torch", torch.__version__, torch.cuda.get_device_name(0), "jax", jax.__version__, jax.devices())
EOF
cat $L/sanity.txt | tee -a "$OUT/summary.txt"
D=reports/gpu/$(python3 -c "from rosetta.gpu import folder_name; from conformance.machine import device_facts; print(folder_name(device_facts('cuda')['name']))")
mkdir -p $D
say "folder $D"
# Phase A, side by side (16 cores, one GPU; correctness only, nothing timed)
A=$(( LIMIT - ${BENCH_SECONDS:-200} ))
say "phase A for ${A}s"
timeout $A python3 -m rosetta gpu --jobs 8 --bench-preset none > $L/gpu-job.txt 2>&1 &
timeout $A python3 -m pytest -m gpu tests/test_torch.py tests/test_jax.py tests/test_export.py -p no:cacheprovider \
    -q -rs --durations=15 > $L/pytest-gpu.txt 2>&1 &
timeout $A python3 .device/generate_check.py $L/generate.json > $L/generate.txt 2>&1 &
wait
pkill -f conformance.executors.local_pool  # a stopped check's workers must not run beside the bench
say "phase A done"
python3 -c "
import json; r = json.load(open('$D/environment.json'))
for s in r['steps']: print(s['name'], s['exit_code'], s['seconds'], s['headline'][:150])
" 2>&1 | tee -a "$OUT/summary.txt"
say "pytest: $(tail -n 1 $L/pytest-gpu.txt)"
grep -E "FAILED|ERROR" $L/pytest-gpu.txt | head -n 8 | tee -a "$OUT/summary.txt"
cat $L/generate.txt | tee -a "$OUT/summary.txt"
pack
# Phase B, alone: the GPU bench (written after each contender)
B=$(( $(left) - 25 ))
say "bench for ${B}s"
if [ $B -gt 60 ]; then
  timeout $B python3 -m rosetta bench --preset paper-base --devices cuda --matrix-backends none --out $D/bench \
    --contenders torch-cuda-float16,onnxruntime-cuda-float16,torch.compile-reduce-overhead-cuda-float16,jax-cuda-float16,torch.compile-cuda-float16,onnxruntime-cuda-float32,torch-cuda-bfloat16,jax-cuda-bfloat16,torch-cuda-float32,jax-cuda-float32 \
    > $L/bench.txt 2>&1
  say "bench exit $?"
  grep -E "prepared|skipped" $L/bench.txt | tee -a "$OUT/summary.txt"
  sed -n '/## Targets/,/## Not/p' $D/bench/bench.md 2>/dev/null | tee -a "$OUT/summary.txt"
fi
say "end"
