#!/usr/bin/env bash
# One call on a machine of several GPUs: build once, then the GPUs work side by side, each
# process seeing only its own GPU (ratios stay within one process's run, so they stay
# comparable). A sweep that takes one GPU an hour takes two GPUs half of it. Two ways:
#
#   QUEUE="layers:resnet50_net:float32:NHWC:1,64 models:resnet50-independent:float16:1,8 ..." \
#     QUEUE_CAP=520 bash scripts/gpu_parallel.sh [cache]
#       Each GPU takes the next item of the queue when it is free (layer_run, model_run and
#       tests_run of scripts/gpu_runs.sh: "tests:test_rewrite,test_solvers" runs the GPU tests
#       `-k "test_rewrite or test_solvers"` selects), until the queue is empty or QUEUE_CAP seconds are spent. The
#       items not started, and those cut at the cap, are listed last ("left:", "cut:"): the
#       next call's queue. A GPU's logs and JSON come back as $OUT/gpu<i>.tgz.
#
#   QUEUE_FILE=benchmarks/sweeps/issue11.queue bash scripts/gpu_parallel.sh   (the same, the
#       items from a file: a command line holds 2000 characters). "probe:..." items run
#       probe_run (scripts/latency_probe.py on one layer case), "selection:..." items
#       selection_run (each plan's compile step by step, cold), "cold:..." items cold_run
#       (a model's first call, cold, plain and fused, a process each), "sets:..." items
#       sets_run (scripts/sets_probe.py: a layer's candidates by input-set count). An item written
#       VAR=value[,VAR=value]@item runs with those variables set (its files named apart).
#
#   SECTIONS_0="layers" LAYER_RUNS_0="..." SECTIONS_1="layers models" MODEL_RUNS_1="..." \
#     bash scripts/gpu_parallel.sh [cache]
#       One scripts/gpu_session.sh per GPU with the sections named for it; every knob named in
#       $knobs below, suffixed _<gpu>, is that GPU's value (without the suffix, every GPU's).
#
# Each GPU gets the carried kernel cache in a folder of its own; `cache` merges the folders
# (their entries are files named by key) into $OUT/jaxfuse-cache.tgz. The GPUs' logs are
# $OUT/gpu<i>.log, printed at the end.
set -uo pipefail
ulimit -c 0  # (a run cut by SIGABRT at its time leaves no core file of a GPU process)
OUT=${OUT:-/tmp/jaxfuse-out}
mkdir -p "$OUT"
py=${PY:-python3}  # (PY: a stand-in for trying the script without a GPU)
# shellcheck source=scripts/gpu_runs.sh
source "$(dirname "$0")/gpu_runs.sh"
knobs="SECTIONS LAYER_RUNS LAYER_MATCH LAYERS_CAP MODEL_RUNS MODEL_SOLVERS MODELS_CAP
  LATENCY_RUNS LATENCY_ARGS LATENCY_FLAGS LATENCY_CAP TESTS_K TESTS_CAP TESTS_WORKERS FIND_RUNS
  FIND_ARGS FIND_CAP NCU_RUNS NCU_CAP FINAL_CAP FINAL_WORKERS"

started=$(mktemp)  # (the cache entries newer than this are the call's own)
# The build (or the carried one), once: its own section list is empty.
OUT="$OUT/build" bash scripts/gpu_session.sh || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
  XLA_PYTHON_CLIENT_PREALLOCATE=false
gpus=$(nvidia-smi -L | wc -l)

# Queue mode: a GPU's worker pops items under a lock until the queue or the time runs out.
queue=$OUT/queue.txt leftovers=$OUT/queue_left.txt
deadline=$(( $(date +%s) + ${QUEUE_CAP:-520} ))
queue_worker() {
  local item left
  while :; do
    item=$(flock "$queue.lock" bash -c 'head -1 "$0"; sed -i 1d "$0"' "$queue")
    [[ -n $item ]] || return 0
    left=$(( deadline - $(date +%s) ))
    if (( left <= 30 )); then echo "left: $item" >> "$leftovers"; continue; fi
    queue_item "$item" "$left"
    (( $? == 124 )) && echo "cut: $item" >> "$leftovers"
  done
}

pids=()
[[ -n ${QUEUE_FILE:-} ]] && QUEUE="$(grep -v '^#' "$QUEUE_FILE") ${QUEUE:-}"
if [[ -n ${QUEUE:-} ]]; then
  tr -s ' \n' '\n' <<< "$QUEUE" | sed '/^$/d' > "$queue"
  for (( i = 0; i < gpus; i++ )); do
    (
      export CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i" JAXFUSE_CACHE_DIR="/tmp/jaxfuse-cache-gpu$i"
      mkdir -p "$OUT" "$JAXFUSE_CACHE_DIR"
      [[ -f .prebuilt/jaxfuse-cache.tgz ]] &&
        tar xzf .prebuilt/jaxfuse-cache.tgz -C "$JAXFUSE_CACHE_DIR" --strip-components=1
      queue_worker
    ) > "$OUT/gpu$i.log" 2>&1 &
    pids+=($!)
  done
else
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
fi
for pid in "${pids[@]}"; do wait "$pid"; done

if [[ " $* " == *" cache "* ]]; then
  # Only the entries this call wrote (a file comes back if it holds at most 16 MiB, and the
  # carried cache outgrew that): scripts/merge_cache.sh adds them to .prebuilt's.
  merged=/tmp/jaxfuse-cache
  rm -rf "$merged" && mkdir -p "$merged/kernels"
  for dir in /tmp/jaxfuse-cache-gpu*; do
    # (not a writer's temporary file, left by a process cut at its time)
    find "$dir/kernels" -type f -newer "$started" ! -name '*.tmp*' \
      -exec cp -n {} "$merged/kernels/" \; 2>/dev/null
  done
  tar czf "$OUT/jaxfuse-cache.tgz" -C /tmp jaxfuse-cache && ls -la "$OUT/jaxfuse-cache.tgz"
fi
for (( i = 0; i < gpus; i++ )); do
  [[ -f $OUT/gpu$i.log ]] && { echo "======== gpu $i"; cat "$OUT/gpu$i.log"; }
  # (at most 8 files come back from a call: a queue's GPU folder goes back as one archive)
  # (and its log goes in it: with the cache's archive, nine files would be one too many)
  if [[ -n ${QUEUE:-} && -d $OUT/gpu$i ]]; then
    mv "$OUT/gpu$i.log" "$OUT/gpu$i/" 2>/dev/null
    tar czf "$OUT/gpu$i.tgz" -C "$OUT" "gpu$i" && rm -rf "${OUT:?}/gpu$i"
  fi
done
if [[ -n ${QUEUE:-} ]]; then
  # What the next call's queue should be: never started, or cut at the cap.
  echo "======== queue"; cat "$leftovers" 2>/dev/null || echo "every item finished"
  rm -f "$queue" "$queue.lock"
fi
