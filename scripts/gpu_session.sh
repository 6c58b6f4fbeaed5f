#!/usr/bin/env bash
# One call on the GPU machine: build (or reuse a carried build), then the sections asked for,
# each under its own time cap, printing short tables last. Logs, JSON and plots go under $OUT.
#
#   bash scripts/gpu_session.sh SECTION...     sections: tests final layers models latency ncu find probe
#                                               sweep xla cache
#
# Knobs (environment): TESTS_CAP, TESTS_WORKERS, TESTS_ARGS, TESTS_K (a pytest -k expression), FINAL_CAP, LAYERS_CAP, MODELS_CAP
# (seconds); LAYER_SUITES, LAYER_BATCH, LAYER_DTYPES, LAYER_LAYOUTS, LAYER_FILTERS, LAYER_WDTYPE
# (float32: plans keep float32 filters), LAYER_RUNS (instead: suite:dtype:layout:batches runs,
# e.g. "mobilenetv2:bfloat16:NHWC:64 resnet50:float32:NHWC:1,64"), LAYER_MATCH (a
# regular expression on layer names); MODEL_RUNS, a list of
# model:dtype:batches runs (e.g. "resnet50:bfloat16:1,64 mobilenet:float32:64") done in order
# until MODELS_CAP is spent; MODEL_SOLVERS, the fused program's solver modes (default "auto
# fused"; "xla" times the rewrite with every chain left to XLA); LATENCY_RUNS (model:dtype:batch
# runs of scripts/latency_probe.py, given LATENCY_ARGS too) under each of LATENCY_FLAGS ("|"-separated XLA_FLAGS sets)
# and each of LATENCY_ENVS ("|"-separated sets of VAR=value words; an empty set leads, as a trailing one
# is dropped: e.g. "|JAXFUSE_AUTOTUNE=0");
# NCU_RUNS, layer:dtype:batch[:layout[:filters[:chain[:filter dtype]]]] runs of scripts/ncu_layer.py profiled by Nsight
# Compute, the fused kernel and XLA's kernels of the same layer (NCU_CAP seconds in all);
# NCU_SOURCE=1: also a PC-sampling pass per fused kernel, its hottest SASS lines printed
# (scripts/ncu_hotspots.py); LAYER_CHAIN ("0", "1" or "0 1"): layer runs whose K ops are
# independent (0) or each waiting for the previous one (1: --chain, as in a network);
# SWEEP_ARGS, arguments of scripts/variant_sweep.py (every kernel variant forced; by default
# MobileNetV2's depthwise layers; SWEEP_CAP);
# FIND_RUNS, layer:dtype:batch[:layout] runs of scripts/find_probe.py (the find step's timings;
# FIND_CAP; FIND_ARGS: more arguments, e.g. --kernels; FIND_TAIL: lines printed a run;
# FIND_HLO=1: the optimized HLO of XLA's candidate and of the benchmark's program, in $OUT/hlo);
# XLA_RUNS, layer:dtype:batch runs of scripts/xla_kernels.py (XLA's kernels for the unfused case).
#
# Reusing a build: the first call copies the extension into $OUT; carry it back in a later call
# as .prebuilt/ (git-ignored, named in the device tool's `carry`). It is used only while csrc/
# is unchanged (its tree hash is stored beside it), so kernel edits always rebuild.
# Reusing the kernel cache: the section `cache` (give it last) packs the kernel cache (kernels,
# tuning and solver decisions) into $OUT/jaxfuse-cache.tgz; carried back as
# .prebuilt/jaxfuse-cache.tgz it starts the next call warm. Its keys hold the kernel sources'
# hash and the device, so entries of edited kernels are simply not found.
set -uo pipefail
ulimit -c 0  # (a probe cut by SIGABRT at its cap leaves no core file of a GPU process)
OUT=${OUT:-/tmp/jaxfuse-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# (scripts/gpu_parallel.sh gives each of its runs a cache of its own)
export JAXFUSE_CACHE_DIR="${JAXFUSE_CACHE_DIR:-/tmp/jaxfuse-cache}"; rm -rf "$JAXFUSE_CACHE_DIR"
if [[ -f .prebuilt/jaxfuse-cache.tgz ]]; then
  mkdir -p "$JAXFUSE_CACHE_DIR" &&
    tar xzf .prebuilt/jaxfuse-cache.tgz -C "$JAXFUSE_CACHE_DIR" --strip-components=1 &&
    echo "kernel cache: carried ($(du -sh "$JAXFUSE_CACHE_DIR" | cut -f1))"
fi
py=python3
# shellcheck source=scripts/gpu_runs.sh
source "$(dirname "$0")/gpu_runs.sh"
sections=" $* "
has() { [[ $sections == *" $1 "* ]]; }

echo "== build"
start=$(date +%s)
if [[ ${NO_BUILD:-0} == 1 ]]; then
  echo "no build: jaxfuse as the caller left it (scripts/gpu_parallel.sh builds once)"
else
  csrc_hash=$(git rev-parse HEAD:csrc 2>/dev/null || echo none)
  if [[ -n $(git status --porcelain csrc 2>/dev/null) ]]; then csrc_hash="dirty-$(date +%s)"; fi
  prebuilt=$(ls .prebuilt/_jaxfuse_ext*.so 2>/dev/null | head -1)
  # REUSE_BUILD=1 trusts a carried build whatever the hash says (the copied tree's csrc can read
  # as modified to git there although its files are the committed ones).
  # A carried build that does not load here (one built on another machine, against another
  # C++ runtime) is set aside, and the extension built.
  if [[ -n $prebuilt && ( "${REUSE_BUILD:-0}" == 1 ||
        "$(cat .prebuilt/csrc_hash 2>/dev/null)" == "$csrc_hash" ) ]] &&
     cp "$prebuilt" jaxfuse/ &&
     PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $py -c "import jaxfuse._jaxfuse_ext" \
       2> "$OUT/carried_build.log"; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "reused the carried build of csrc $csrc_hash"
  else
    [[ -s $OUT/carried_build.log ]] && { echo "the carried build does not load:";
                                         tail -3 "$OUT/carried_build.log"; }
    rm -f jaxfuse/_jaxfuse_ext*.so
    $py -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/build.log" 2>&1 \
      || { tail -40 "$OUT/build.log"; exit 1; }
    so=$($py -c "import jaxfuse._jaxfuse_ext as m; print(m.__file__)")
    cp "$so" "$OUT/" && echo "$csrc_hash" > "$OUT/csrc_hash"
    echo "built in $(( $(date +%s) - start )) s"
  fi
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
$py -m jaxfuse info | head -8

if has probe; then
  echo "== wgmma probe"; $py scripts/wgmma_probe.py 2>&1 | tail -12
fi
if has tests; then
  echo "== GPU tests"
  start=$(date +%s)
  # Autotuning is exercised by its own tests (and every variant by a forced-variant test).
  # shellcheck disable=SC2086
  JAXFUSE_AUTOTUNE=0 capped "${TESTS_CAP:-240}" $py -m pytest tests -m gpu -q \
    -p no:cacheprovider -n "${TESTS_WORKERS:-4}" --durations=5 ${TESTS_ARGS:-} \
    ${TESTS_K:+-k "$TESTS_K"} > "$OUT/tests.log" 2>&1
  echo "pytest exit $? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -15
fi
if has final; then
  # The last check of a session: the whole GPU suite, four pytest workers sharing the GPU (kernel
  # compilation is CPU-bound), under a hard time cap (420 s reached 93% of it in session 10,
  # with six workers: leave the call room for 520 and the build).
  echo "== final GPU tests ($(nvidia-smi -L | wc -l) GPUs)"
  start=$(date +%s)
  JAXFUSE_AUTOTUNE=0 capped "${FINAL_CAP:-520}" $py -m pytest -m gpu -q -p no:cacheprovider \
    -n "${FINAL_WORKERS:-4}" --durations=8 tests > "$OUT/final_tests.log" 2>&1
  echo "pytest exit $? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|FAILED|Error|Timeout" "$OUT/final_tests.log" | tail -25
fi
if has layers && [[ -n ${LAYER_RUNS:-} ]]; then
  # Several configurations in one call: suite:dtype:layout:batches runs (batches
  # comma-separated), in order until LAYERS_CAP is spent; a table and JSON each.
  echo "== layer benchmarks, runs (forced kernel and auto against XLA)"
  deadline=$(( $(date +%s) + ${LAYERS_CAP:-300} ))
  for run in $LAYER_RUNS; do
    left=$(( deadline - $(date +%s) ))
    (( left > 20 )) || { echo "skipped $run: out of time"; continue; }
    layer_run "$run" "$left"
  done
elif has layers; then
  echo "== layer benchmarks (forced kernel and auto against XLA)"
  deadline=$(( $(date +%s) + ${LAYERS_CAP:-300} ))
  for chain in ${LAYER_CHAIN:-0}; do
    start=$(date +%s)
    tag=$([[ $chain == 1 ]] && echo _chain)
    (( deadline - start > 20 )) || { echo "skipped chain=$chain: out of time"; continue; }
    # shellcheck disable=SC2086
    timeout $(( deadline - start )) $py -m jaxfuse.bench --suite ${LAYER_SUITES:-resnet50 na} \
      --batch ${LAYER_BATCH:-1 64} --dtype ${LAYER_DTYPES:-bfloat16} \
      --layout ${LAYER_LAYOUTS:-NHWC} ${LAYER_FILTERS:+--filter-layout $LAYER_FILTERS} \
      ${LAYER_WDTYPE:+--filter-dtype $LAYER_WDTYPE} $([[ $chain == 1 ]] && echo --chain) \
      ${LAYER_MATCH:+--layers "$LAYER_MATCH"} --repeats 10 --json "$OUT/layers$tag.json" \
      --plot "$OUT/layers$tag.png" --no-progress > "$OUT/layers$tag.log" 2>&1
    echo "bench${tag} exit $? in $(( $(date +%s) - start )) s"
    # (the table itself: the logs go back only inside logs.tgz)
    grep -v -E "^(W|I)[0-9]{4}" "$OUT/layers$tag.log" | tail -60
  done
fi
if has models; then
  echo "== end to end: Flax models, plain jit vs jit(fuse(apply)) auto and forced"
  deadline=$(( $(date +%s) + ${MODELS_CAP:-300} ))
  for run in ${MODEL_RUNS:-resnet50:bfloat16:1,64}; do
    left=$(( deadline - $(date +%s) ))
    (( left > 20 )) || { echo "skipped $run: out of time"; continue; }
    model_run "$run" "$left"
  done
  cat "$OUT/models.log"
fi
if has latency; then
  echo "== latency: host work and kernels per call, under each XLA_FLAGS set"
  deadline=$(( $(date +%s) + ${LATENCY_CAP:-300} ))
  IFS='|' read -ra flag_sets <<< "${LATENCY_FLAGS:-}"
  (( ${#flag_sets[@]} )) || flag_sets=("")
  IFS='|' read -ra env_sets <<< "${LATENCY_ENVS:-}"
  (( ${#env_sets[@]} )) || env_sets=("")
  for run in ${LATENCY_RUNS:-resnet50:bfloat16:1}; do
    IFS=: read -r model dtype batch <<< "$run"
    for envs in "${env_sets[@]}"; do
      for flags in "${flag_sets[@]}"; do
        left=$(( deadline - $(date +%s) ))
        (( left > 20 )) || { echo "skipped $run [$envs] [$flags]: out of time"; continue; }
        [[ -z $envs ]] || echo "== environment: $envs" >> "$OUT/latency.log"
        # (SIGABRT at the cap: Python's fault handler prints every thread's stack.)
        # shellcheck disable=SC2086
        env $envs XLA_FLAGS="$flags" PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 "$left" \
          $py scripts/latency_probe.py --model "$model" --dtype "$dtype" --batch "$batch" \
          ${LATENCY_ARGS:-} >> "$OUT/latency.log" 2>> "$OUT/latency_detail.log"
        echo "$run [$envs] [$flags] exit $?"
      done
    done
  done
  cat "$OUT/latency.log"
fi
if has ncu; then
  echo "== Nsight Compute: fused kernel and XLA's kernels per layer"
  deadline=$(( $(date +%s) + ${NCU_CAP:-240} ))
  ncu_sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
  stalls="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
  for run in ${NCU_RUNS:-r50_l3_3x3_256:bfloat16:256}; do
    IFS=: read -r layer dtype batch layout filters chain wdtype <<< "$run"
    for which in fused xla; do
      left=$(( deadline - $(date +%s) ))
      (( left > 20 )) || { echo "skipped $run $which: out of time"; continue; }
      report="$OUT/ncu_${layer}_${dtype}_${batch}${wdtype:+_w$wdtype}_${which}.txt"
      cmd=($py scripts/ncu_layer.py --layer "$layer" --dtype "$dtype" --batch "$batch"
           --layout "${layout:-NHWC}" ${filters:+--filter-layout "$filters"} --chain "${chain:-CBNA}"
           ${wdtype:+--filter-dtype "$wdtype"} --which "$which" --calls 1)
      # shellcheck disable=SC2086
      timeout "$left" ncu --profile-from-start off --clock-control none $ncu_sections $stalls \
        "${cmd[@]}" > "$report" 2>&1 \
        || timeout "$left" ncu --profile-from-start off --clock-control none $ncu_sections \
          "${cmd[@]}" > "$report" 2>&1
      echo "-- $run $which (exit $?)"
      left=$(( deadline - $(date +%s) ))
      if [[ ${NCU_SOURCE:-0} == 1 && $which == fused ]] && (( left > 20 )); then
        rep="${report%_fused.txt}_${layout:-NHWC}_${chain:-CBNA}_source"
        timeout "$left" ncu --profile-from-start off --clock-control none \
          --section SourceCounters -f -o "$rep" "${cmd[@]}" > /dev/null 2>&1
        timeout 60 ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>&1
        rm -f "$rep.ncu-rep"
        $py scripts/ncu_hotspots.py "$rep.csv" --top 30
      fi
      grep -E "^kernel:|^  [a-zA-Z_0-9]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Ipc Active|No Eligible|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Shared Memory Configuration Size|stalled_(long_scoreboard|barrier|wait|math_pipe_throttle|mio_throttle|short_scoreboard|lg_throttle|sleeping|dispatch_stall|not_selected|selected|membar|no_instruction)_per" "$report" | head -60
    done
  done
fi
if has find; then
  echo "== the find step's timings per candidate"
  deadline=$(( $(date +%s) + ${FIND_CAP:-180} ))
  for run in ${FIND_RUNS:-r50_l1_1x1_64:float32:256}; do
    IFS=: read -r layer dtype batch layout <<< "$run"
    left=$(( deadline - $(date +%s) ))
    (( left > 20 )) || { echo "skipped $run: out of time"; continue; }
    timeout "$left" $py scripts/find_probe.py --layer "$layer" --dtype "$dtype" --batch "$batch" \
      --layout "${layout:-NHWC}" ${FIND_ARGS:-} ${FIND_HLO:+--hlo "$OUT/hlo"} 2>&1 | grep -v "^W[0-9]" | tee -a "$OUT/find.log" | tail -"${FIND_TAIL:-24}"
  done
fi
if has sweep; then
  echo "== kernel variants, each forced"
  # A process per variant (and one for the autotuned choice), each compiling and timing every
  # layer: MobileNetV2's six depthwise layers at batch 64 took more than 150 s (session 8).
  # shellcheck disable=SC2086
  timeout "${SWEEP_CAP:-360}" $py scripts/variant_sweep.py ${SWEEP_ARGS:---suite mobilenetv2} \
    --json "$OUT/sweep.json" > "$OUT/sweep.log" 2> "$OUT/sweep_detail.log"
  echo "sweep exit $?"; cat "$OUT/sweep.log"
fi
if has xla; then
  echo "== XLA's own kernels for benchmark cases (block shapes from its PTX)"
  for run in ${XLA_RUNS:-NA_C256_H56:bfloat16:1}; do
    IFS=: read -r layer dtype batch <<< "$run"
    timeout 120 $py scripts/xla_kernels.py "$layer" --dtype "$dtype" --batch "$batch" \
      --out "$OUT/xla_${layer}_${dtype}_${batch}" 2>&1 | grep -v "^W[0-9]" | head -40
  done
fi
if has cache; then
  tar czf "$OUT/jaxfuse-cache.tgz" -C "$(dirname "$JAXFUSE_CACHE_DIR")" \
    "$(basename "$JAXFUSE_CACHE_DIR")" && ls -la "$OUT/jaxfuse-cache.tgz"
fi
# At most 8 files come back from a call: the logs, JSON and plots go back as one archive beside
# the build and the kernel cache.
logs=$(mktemp)
(cd "$OUT" && ls | grep -v -E '\.so$|^csrc_hash$|^jaxfuse-cache\.tgz$|^logs\.tgz$' > "$logs"
 if [[ -s $logs ]]; then
   rm -f logs.tgz  # (an earlier run's, where $OUT is reused)
   tar czf logs.tgz -T "$logs" && xargs rm -rf < "$logs"
 fi)
rm -f "$logs"
