# Sourced by the GPU run scripts (benchmarks/gpu_run4.sh ... gpu_run7.sh): `step`, one
# `specfx bench gpu` process per step, given what is left of the run's deadline.
# The sourcing script sets RUN (the tag prefix, e.g. r7), DEADLINE (epoch seconds), LOG and OUT;
# PY defaults to python3. GPU_DRY=1 prints each step's plan (--dry-run) instead of running it;
# GPU_SMOKE=1 runs each step's flags on the tiny CPU models (--smoke: shapes, batches, contexts
# and compile-time assumptions are the smoke's). Each step's JSON is written after every
# combination, so a step cut short keeps what it finished, and is copied to $OUT.
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "/tmp/$RUN"

step() {  # step TAG MIN_SECONDS MAX_SECONDS ARGS...
  local tag=$1 need=$2 cap=$3
  shift 3
  if [[ -n "${GPU_DRY:-}" ]]; then
    echo "=== $tag (dry run)" | tee -a "$LOG"
    "$PY" -m specfx.cli bench gpu --dry-run --budget-s $(( cap - 25 )) "$@" 2>&1 | tee -a "$LOG"
    return
  fi
  if [[ -n "${GPU_SMOKE:-}" ]]; then
    echo "=== $tag (smoke)" | tee -a "$LOG"
    local args=() skip=0
    for a in "$@"; do
      if (( skip )); then skip=0; continue; fi
      case "$a" in --shapes|--batches|--contexts|--assume) skip=1; continue ;; esac
      args+=("$a")
    done
    "$PY" -m specfx.cli bench gpu --smoke --batches 2 --repeats 1 --out-dir "/tmp/$RUN" --tag "${RUN}_$tag" "${args[@]}" 2>&1 \
      | tee -a "$LOG" | grep -v "Warning\|warnings.warn"
    echo "=== $tag exit ${PIPESTATUS[0]}" | tee -a "$LOG"
    return
  fi
  local left=$(( DEADLINE - $(date +%s) ))
  (( left > cap )) && left=$cap
  if (( left < need )); then
    echo "=== $tag: skipped, ${left}s left (needs ${need}s)" | tee -a "$LOG"
    return
  fi
  echo "=== $tag: $(date +%T), ${left}s left" | tee -a "$LOG"
  timeout $(( left + 5 )) "$PY" -m specfx.cli bench gpu --budget-s $(( left - 25 )) --out-dir "/tmp/$RUN" \
    --tag "${RUN}_$tag" "$@" 2>&1 | tee -a "$LOG" | grep -v "^USDT"
  cp "/tmp/$RUN/bench_${RUN}_$tag.json" "$OUT"/ 2>/dev/null
}
