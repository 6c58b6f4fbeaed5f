#!/usr/bin/env bash
# One call on the GPU machine: build, run the GPU tests, benchmark, print a short table last.
# Usage (device tool): bash scripts/gpu_session.sh [quick|tests|bench|full]
# Writes logs, JSON and plots under $OUT.
set -uo pipefail
mode=${1:-full}
OUT=${OUT:-/tmp/jaxfuse-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXFUSE_CACHE_DIR="/tmp/jaxfuse-cache-$$"; rm -rf "$JAXFUSE_CACHE_DIR"
py=python3

echo "== build"
start=$(date +%s)
$py -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
$py -m jaxfuse info

if [[ $mode == full || $mode == quick ]]; then
  echo "== wgmma probe"
  $py scripts/wgmma_probe.py 2>&1 | tail -12
fi

if [[ $mode == tests || $mode == full || $mode == quick ]]; then
  echo "== GPU tests"
  sel=(-m gpu); [[ $mode == quick ]] && sel+=(-k "tensor_core or depthwise or runtime or chain")
  $py -m pytest tests "${sel[@]}" -q -p no:cacheprovider -x --durations=5 \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?"; tail -25 "$OUT/tests.log"
fi

if [[ $mode == bench || $mode == full ]]; then
  echo "== benchmarks"
  $py -m jaxfuse.bench --suite resnet50 na mobilenet --batch 1 64 --dtype float16 \
    --layout NHWC --json "$OUT/bench_f16_nhwc.json" --plot "$OUT/bench_f16_nhwc.png" \
    --no-progress > "$OUT/bench.log" 2>&1
  echo "bench exit $?"; tail -40 "$OUT/bench.log"
fi
