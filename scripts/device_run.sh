#!/usr/bin/env bash
# The GPU readings on a GPU machine, from the project's root: scripts/check_gpu.py, then
# scripts/bench_gpu.py, each under its own time limit, results into $OUT (default
# outputs/device). Optional: .device/whl/*.whl (packages the GPU image lacks, installed with the
# project without resolving) and .device/evabyte_hf (EvaByte's remote code; or set
# MTPC_EVABYTE_CODE). docs/BENCHMARKS.md, "GPU readings".
#   bash scripts/device_run.sh [extra bench_gpu.py arguments]
# CHECK_S / BENCH_S: the time limits (300 + 270 s: together under a 10-minute call; 0 skips
# that script). check_gpu.py's compiled-engine lines (inductor, CUDA graphs: its default on
# CUDA) come last, ~10 cold graphs per target: a cut keeps every earlier line; for all of them
# and the whole bench, two calls: BENCH_S=0 CHECK_S=570, then CHECK_S=0 BENCH_S=570.
# bench_gpu.py rewrites its JSON after every part: a timeout keeps them.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
OUT=${OUT:-outputs/device}
D=$PWD/.device
py=${PYTHON:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -d "$D/whl" ]; then
  $py -m pip install -q --no-index --no-deps --no-compile "$D"/whl/*.whl 2>&1 | grep -v WARNING | tail -2
  $py -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
fi
code=${MTPC_EVABYTE_CODE:-}
if [ -z "$code" ] && [ -d "$D/evabyte_hf" ]; then code=$D/evabyte_hf; fi
eva=(); if [ -n "$code" ]; then eva=(--evabyte-code "$code"); fi
if [ "${CHECK_S:-300}" != 0 ]; then
  timeout "${CHECK_S:-300}" $py scripts/check_gpu.py "${eva[@]}" > "$OUT/check_gpu.txt" 2>&1
  echo "check_gpu rc=$?"
  grep -E "^(PASS|FAIL|SKIP)" "$OUT/check_gpu.txt"
fi
if [ "${BENCH_S:-270}" != 0 ]; then
  timeout "${BENCH_S:-270}" $py scripts/bench_gpu.py "${eva[@]}" --out "$OUT/bench_gpu.json" "$@" \
    > "$OUT/bench_gpu.md" 2> "$OUT/bench_gpu.log"
  echo "bench_gpu rc=$?"
  sed -n '/^| /p; /^FAILED/p; /^SKIPPED/p' "$OUT/bench_gpu.md"
fi
