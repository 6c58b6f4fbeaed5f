#!/usr/bin/env bash
# One call on a machine of several GPUs: build once, then one scripts/gpu_session.sh per GPU,
# side by side, each seeing only its own GPU (its ratios are within its own run, so they stay
# comparable). A sweep that takes one GPU an hour takes two GPUs half of it.
#
#   SECTIONS_0="layers" LAYER_RUNS_0="..." SECTIONS_1="layers models" MODEL_RUNS_1="..." \
#     bash scripts/gpu_parallel.sh [cache]
#
# Every gpu_session.sh knob named below, suffixed _<gpu>, is that GPU's run's value; without
# the suffix a knob is every run's. Each run gets the carried kernel cache in a folder of its
# own; `cache` merges the runs' folders (their entries are files named by key) into
# $OUT/jaxfuse-cache.tgz. Each run's log is $OUT/gpu<i>.log; its files are under $OUT/gpu<i>/.
set -uo pipefail
OUT=${OUT:-/tmp/jaxfuse-out}
mkdir -p "$OUT"
knobs="SECTIONS LAYER_RUNS LAYER_MATCH LAYERS_CAP MODEL_RUNS MODEL_SOLVERS MODELS_CAP
  LATENCY_RUNS LATENCY_ARGS LATENCY_FLAGS LATENCY_CAP TESTS_K TESTS_CAP TESTS_WORKERS FIND_RUNS
  FIND_ARGS FIND_CAP NCU_RUNS NCU_CAP FINAL_CAP FINAL_WORKERS"

# The build (or the carried one), once: its own section list is empty.
OUT="$OUT/build" bash scripts/gpu_session.sh || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

gpus=$(nvidia-smi -L | wc -l)
pids=()
for (( i = 0; i < gpus; i++ )); do
  settings=()
  for knob in $knobs; do
    per_gpu="${knob}_$i"
    [[ -n ${!per_gpu+set} ]] && settings+=("$knob=${!per_gpu}")
  done
  sections=SECTIONS_$i
  [[ -n ${!sections:-} ]] || { echo "gpu $i: no SECTIONS_$i, idle"; continue; }
  # (word splitting of the section list is meant)
  # shellcheck disable=SC2086
  env "${settings[@]}" CUDA_VISIBLE_DEVICES="$i" OUT="$OUT/gpu$i" NO_BUILD=1 \
    JAXFUSE_CACHE_DIR="/tmp/jaxfuse-cache-gpu$i" \
    bash scripts/gpu_session.sh ${!sections} > "$OUT/gpu$i.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

if [[ " $* " == *" cache "* ]]; then
  merged=/tmp/jaxfuse-cache
  rm -rf "$merged" && mkdir -p "$merged"
  for dir in /tmp/jaxfuse-cache-gpu*; do cp -rn "$dir/." "$merged/"; done
  tar czf "$OUT/jaxfuse-cache.tgz" -C /tmp jaxfuse-cache && ls -la "$OUT/jaxfuse-cache.tgz"
fi
for (( i = 0; i < gpus; i++ )); do
  [[ -f $OUT/gpu$i.log ]] && { echo "======== gpu $i"; cat "$OUT/gpu$i.log"; }
done
