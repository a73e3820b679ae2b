#!/usr/bin/env bash
# Issue 30, GPU run 9 (prepared 2026-12-03, not run yet): what runs 7 and 8 would measure, cut to
# one call that fits a 15-minute lease (a start of a minute or two, this call, and time left over):
#   run(command="bash benchmarks/gpu_run9.sh", timeout_s=560)     (no carry: the tree is enough)
# By value, each step only if its minimum is left of the deadline (R9_SECONDS, default 500):
#   prof1    8B/1B batch 1: HF static + compile and the oracle α = 1, profiled with the finished-
#            flag reads overlapped, not, and overlapped again (item 1: device busy >= 0.95)
#   auto     1B/150M batch 1/4/16: "auto" against HF static + compile (item 3: never below 0.95x),
#            oracle α = 0 (must fall back to K = 0) and α = 0.6, candidates K = 0 and 4
#   hybrid   `specfx bench gpu_check --sections env,hybrid` (run 8's: GDN, short convs, Mamba2,
#            Jamba compiled on CUDA, rollback in rejecting rounds, sync-free warm rounds)
# Results: $OUT/bench_r9_*.json, $OUT/gpu_check.json and $OUT/log.txt.
# CPU checks: GPU_SMOKE=1 bash benchmarks/gpu_run9.sh (tiny models); GPU_DRY=1 (the plan).
set -u
OUT=${OUT:-/tmp/out}
DEADLINE=$(( $(date +%s) + ${R9_SECONDS:-500} ))
LOG="$OUT/log.txt"
RUN=r9
source "$(dirname "$0")/gpu_step.sh"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)" >>"$LOG" 2>&1

# compile constants as runs 6 and 7: the 1B shapes 12 s + 0.75 s per layer, the 8B ones 0.6 s per layer
step prof1 100 150 --assume layer_s=0.6 --shapes 8b-1b --batches 1 --contexts 512 \
  --methods hf_static_compiled,specfx_oracle --alphas 1 --profile --no-overhead
step auto 150 250 --assume graph_s=12 --assume layer_s=0.75 --shapes 1b-150m --batches 1,4,16 --contexts 512 \
  --methods hf_static_compiled,specfx_auto_oracle --auto-alphas 0,0.6 --auto-k-values 4 --no-overhead

left=$(( DEADLINE - $(date +%s) ))
if [[ -n "${GPU_DRY:-}" ]]; then
  echo "=== hybrid (dry run): specfx bench gpu_check --sections env,hybrid with what is left" | tee -a "$LOG"
elif [[ -z "${GPU_SMOKE:-}" ]] && (( left < 90 )); then
  echo "=== hybrid: skipped, ${left}s left (needs 90s)" | tee -a "$LOG"
else
  # the smoke on the CPU leaves out the env section (CUDA's own checks)
  if [[ -n "${GPU_SMOKE:-}" ]]; then where=(--device cpu --backend specfx_eager); left=230; sections=hybrid
  else where=(); sections=env,hybrid; fi
  echo "=== hybrid: $(date +%T), ${left}s left" | tee -a "$LOG"
  timeout $(( left + 5 )) "$PY" -m specfx.cli bench gpu_check --sections "$sections" --deadline-s $(( left - 40 )) \
    --out-dir "$OUT" "${where[@]}" 2>&1 | grep -v "Warning\|warnings.warn" | tee -a "$LOG"
  echo "=== hybrid exit ${PIPESTATUS[0]} $(date +%T)" | tee -a "$LOG"
fi
echo "=== done $(date +%T)" | tee -a "$LOG"
