#!/usr/bin/env bash
# One call on the GPU machine: build, run the GPU tests, benchmark, print short tables last.
# Usage (device tool): bash scripts/gpu_session.sh [tests|bench|e2e|probe|full]...
# Logs, JSON and plots go under $OUT.
set -uo pipefail
modes=" ${*:-full} "
has() { [[ $modes == *" $1 "* || $modes == *" full "* ]]; }
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
$py -m jaxfuse info | head -12

if [[ $modes == *" probe "* ]]; then
  echo "== wgmma probe"; $py scripts/wgmma_probe.py 2>&1 | tail -12
fi
if has tests; then
  echo "== GPU tests"
  start=$(date +%s)
  # Autotuning is exercised by its own tests (and every variant by a forced-variant test).
  JAXFUSE_AUTOTUNE=0 $py -m pytest tests -m gpu -q -p no:cacheprovider --durations=5 \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -15
fi
if [[ $modes == *" final "* ]]; then
  # The last check of a session: the whole GPU suite, four pytest workers sharing the GPU (kernel
  # compilation is CPU-bound), under a hard time cap.
  echo "== final GPU tests ($(nvidia-smi -L | wc -l) GPUs)"
  start=$(date +%s)
  JAXFUSE_AUTOTUNE=0 timeout ${FINAL_CAP:-400} $py -m pytest -m gpu -q -p no:cacheprovider \
    -n ${FINAL_WORKERS:-4} --durations=8 tests > "$OUT/final_tests.log" 2>&1
  echo "pytest exit $? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|Error|Timeout" "$OUT/final_tests.log" | tail -25
fi
if has bench; then
  echo "== layer benchmarks"
  $py -m jaxfuse.bench --suite resnet50 na mobilenet --batch 1 64 --dtype float16 \
    --layout NHWC --json "$OUT/bench_f16_nhwc.json" --plot "$OUT/bench_f16_nhwc.png" \
    --no-progress > "$OUT/bench.log" 2>&1
  echo "bench exit $?"; tail -40 "$OUT/bench.log"
fi
if has e2e; then
  echo "== compile time and host overhead"
  $py -m jaxfuse.bench.compile_time 2>&1 | tail -8
  echo "== end to end: Flax ResNet-50"
  $py -m jaxfuse.bench.end_to_end --model resnet50 --batch 1 8 64 --dtype float16 \
    --json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
  echo "e2e exit $?"; tail -8 "$OUT/e2e.log"
fi
