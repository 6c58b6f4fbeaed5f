# Sourced by scripts/gpu_session.sh and scripts/gpu_parallel.sh: one run each, its logs and
# JSON under $OUT, its table printed, within the seconds it is given.
#   layer_run SUITE:DTYPE:LAYOUT:BATCHES[:REGEX] SECONDS
#                                                  (python -m jaxfuse.bench; SUITE and DTYPE
#                                                   may be lists: a,b; REGEX, or else
#                                                   LAYER_MATCH, picks layers by name)
#   model_run MODEL:DTYPE:BATCHES SECONDS          (python -m jaxfuse.bench.end_to_end;
#                                                   MODEL_SOLVERS, default "auto fused")
#   probe_run SUITE/LAYER:DTYPE:LAYOUT:BATCH[:SOLVER] SECONDS
#                                                  (scripts/latency_probe.py --layer: XLA's
#                                                   program and the plan's, SOLVER (fused) by
#                                                   default: wall, dispatch, host events)
#   selection_run SUITE:DTYPE:LAYOUT:BATCH[:REGEX] SECONDS
#                                                  (python -m jaxfuse.bench.selection: each
#                                                   plan's compile in auto mode, step by step,
#                                                   in an empty cache of its own)
#   cold_run MODEL:DTYPE:BATCHES SECONDS           (python -m jaxfuse.bench.cold_start: the
#                                                   model's (or LAYER/LAYOUT's chain's)
#                                                   first call under plain jit and
#                                                   each solver mode, a fresh process and
#                                                   an empty cache each)
#   queue_item [VAR=value[,VAR=value]@]KIND:ARGS SECONDS
#                                                  (one queue item, KIND layers, models,
#                                                   tests, probe, selection or cold, in a
#                                                   subshell
#                                                   with the variables set and its files named
#                                                   apart)
#   tests_run NAME[,NAME...] SECONDS               (the GPU tests `-k "NAME or NAME"` selects,
#                                                   TESTS_WORKERS (4) workers; "all": every
#                                                   GPU test)
# Batches are comma-separated. Both use $py and $OUT, and return the benchmark's exit status
# (124: cut at its time; SIGABRT then has Python print every thread's stack into the log, to
# tell a slow step from a stuck one).

# The line that ends a run: what ran (with its queue item's variables), its status, its time.
finished() {
  echo "${ITEM_SETTINGS:+$ITEM_SETTINGS@}$1 exit $2 in $(( $(date +%s) - $3 )) s"
}

layer_run() {
  local suite dtype layout batches match start tag rc
  IFS=: read -r suite dtype layout batches match <<< "$1"
  tag="${suite//,/-}_${dtype//,/-}_${layout}_${batches//,/_}"
  # (an item's own REGEX names its files apart from the whole suite's)
  [[ -n $match ]] && tag+="_m$(md5sum <<< "$match" | cut -c1-6)"
  tag+=${ITEM_TAG:-}  # (an item run with variables of its own: gpu_parallel.sh)
  match=${match:-${LAYER_MATCH:-}}
  start=$(date +%s)
  # (suites and dtypes may be comma-separated lists: one process, one start-up, for all)
  # shellcheck disable=SC2086
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 "$2" \
    $py -m jaxfuse.bench --suite ${suite//,/ } --batch ${batches//,/ } \
    --dtype ${dtype//,/ } --layout "$layout" ${match:+--layers "$match"} \
    --repeats 10 --json "$OUT/layers_$tag.json" --no-progress > "$OUT/layers_$tag.log" 2>&1
  rc=$?
  finished "$1" "$rc" "$start"
  grep -v -E "^(W|I)[0-9]{4}" "$OUT/layers_$tag.log" | grep -v '^{' | tail -40
  return $rc
}

model_run() {
  local model dtype batches start rc
  IFS=: read -r model dtype batches <<< "$1"
  start=$(date +%s)
  # (rows are printed as they finish: a run cut at its time keeps them)
  # shellcheck disable=SC2086
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 "$2" \
    $py -m jaxfuse.bench.end_to_end --model "$model" --dtype "$dtype" \
    --batch ${batches//,/ } --solver ${MODEL_SOLVERS:-auto fused} \
    --json "$OUT/models_${model}_${dtype}${ITEM_TAG:-}.json" \
    >> "$OUT/models.log" 2>> "$OUT/models_detail.log"
  rc=$?
  finished "$1" "$rc" "$start"
  return $rc
}

# Runs "$@" under a time cap in a process group of its own and ends the whole group after it:
# pytest-xdist's workers outlive a pytest that `timeout` ended and kept running GPU tests
# beside the next section's measurements (session 8, call 4).
capped() {
  local cap=$1; shift
  setsid timeout "$cap" "$@" &
  local pid=$!
  wait "$pid"; local rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  return $rc
}

queue_item() (
  local work=$1 settings name assignments
  if [[ $work == *@* ]]; then
    settings=${work%%@*} work=${work#*@}
    name='[A-Za-z_][A-Za-z0-9_]*=[^,]*'
    if [[ ! $settings =~ ^$name(,$name)*$ ]]; then
      echo "bad queue item (VAR=value[,VAR=value]@item): $1"; exit 2
    fi
    IFS=, read -ra assignments <<< "$settings"
    export "${assignments[@]}" ITEM_SETTINGS="$settings" \
      ITEM_TAG="_e$(md5sum <<< "$settings" | cut -c1-6)"
  fi
  case ${work%%:*} in
    layers) layer_run "${work#*:}" "$2" ;;
    models) model_run "${work#*:}" "$2" ;;
    tests) tests_run "${work#*:}" "$2" ;;
    probe) probe_run "${work#*:}" "$2" ;;
    selection) selection_run "${work#*:}" "$2" ;;
    cold) cold_run "${work#*:}" "$2" ;;
    sets) sets_run "${work#*:}" "$2" ;;
    *) echo "unknown queue item: $1"; exit 2 ;;
  esac
)

probe_run() {
  local layer dtype layout batch solver start rc log
  IFS=: read -r layer dtype layout batch solver <<< "$1"
  start=$(date +%s)
  log="$OUT/probe_$(tr -c 'A-Za-z0-9_' _ <<< "$1" | cut -c1-60)${ITEM_TAG:-}.log"
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 "$2" \
    $py scripts/latency_probe.py --layer "$layer" --dtype "$dtype" --layout "$layout" \
    --batch "$batch" --solver "${solver:-fused}" > "$log" 2>&1
  rc=$?
  finished "$1" "$rc" "$start"
  grep -E "^(==|--)" "$log" | cut -c1-300
  return $rc
}

selection_run() {
  local suite dtype layout batch match tag cache start rc
  IFS=: read -r suite dtype layout batch match <<< "$1"
  tag="${suite}_${dtype}_${layout}_${batch}"
  [[ -n $match ]] && tag+="_m$(md5sum <<< "$match" | cut -c1-6)"
  tag+=${ITEM_TAG:-}
  cache=$(mktemp -d)  # (cold: nothing compiled or decided before)
  start=$(date +%s)
  JAXFUSE_CACHE_DIR=$cache PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 "$2" \
    $py -m jaxfuse.bench.selection --suite "$suite" --dtype "$dtype" --layout "$layout" \
    --batch "$batch" ${match:+--layers "$match"} --json "$OUT/selection_$tag.json" \
    > "$OUT/selection_$tag.log" 2>&1
  rc=$?
  rm -rf "$cache"
  finished "$1" "$rc" "$start"
  grep -v -E "^(W|I)[0-9]{4}" "$OUT/selection_$tag.log" | tail -60
  return $rc
}

cold_run() {
  local model dtype batches tag start rc
  IFS=: read -r model dtype batches <<< "$1"
  tag="${model//\//-}_${dtype}_${batches//,/_}${ITEM_TAG:-}"
  start=$(date +%s)
  # shellcheck disable=SC2086
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 "$2" \
    $py -m jaxfuse.bench.cold_start --model "$model" --dtype "$dtype" \
    --batch ${batches//,/ } --json "$OUT/cold_$tag.json" > "$OUT/cold_$tag.log" 2>&1
  rc=$?
  finished "$1" "$rc" "$start"
  tail -20 "$OUT/cold_$tag.log"
  return $rc
}

sets_run() {
  local layer dtype layout batch counts tag start rc
  IFS=: read -r layer dtype layout batch counts <<< "$1"
  tag="${layer}_${dtype}_${layout}_${batch}${ITEM_TAG:-}"
  start=$(date +%s)
  # shellcheck disable=SC2086
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 "$2" \
    $py scripts/sets_probe.py --layer "$layer" --dtype "$dtype" --layout "$layout" \
    --batch "$batch" ${counts:+--sets ${counts//,/ }} > "$OUT/sets_$tag.log" 2>&1
  rc=$?
  finished "$1" "$rc" "$start"
  grep -v -E "^(W|I)[0-9]{4}" "$OUT/sets_$tag.log" | tail -12
  return $rc
}

tests_run() {
  local start rc log
  start=$(date +%s)
  log="$OUT/tests_$(tr -c 'A-Za-z0-9_' _ <<< "$1" | cut -c1-40)${ITEM_TAG:-}.log"
  # (autotuning has tests of its own, and every variant a forced-variant test)
  local select=(-k "${1//,/ or }")
  [[ $1 == all ]] && select=()
  JAXFUSE_AUTOTUNE=0 capped "$2" $py -m pytest tests -m gpu -q -p no:cacheprovider \
    -n "${TESTS_WORKERS:-4}" \
    "${select[@]}" > "$log" 2>&1
  rc=$?
  finished "tests '$1'" "$rc" "$start"
  grep -E "passed|failed|FAILED|Error" "$log" | tail -15
  return $rc
}
