#!/usr/bin/env bash
# Issue 30, GPU run 5 (ran 2026-11-26 on an H200: docs/BENCHMARKS.md "GPU run 5"): one `run` call of ~9.5 minutes, items 3 and 4.
# Each step a separate `specfx bench gpu` process given what is left of the deadline (the JSON is
# written after each combination, so a step cut short keeps what it finished):
#   b4-16     8B/1B oracle α = 1 / 0.6 at batch 4 and 16, context 512, live-KV on (default) + profile
#   nolive    the same at batch 16 with the live-KV cut off (what the cut buys on the GPU)
#   ctx4096   8B/1B batch 1 at context 4096: HF static + compile, oracle, the 1B draft
#   small     1B/150M at batch 4 and 16: oracle, the 150M draft, self-draft
#   block     PARD and DFlash compiled on CUDA (gpu_check's drafter section), if 90 s are left
# Results: $OUT/bench_r5_*.json and $OUT/log.txt (at most 8 files come back).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/r5
DEADLINE=$(( $(date +%s) + ${R5_SECONDS:-575} ))
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1

RUN=r5
source "$(dirname "$0")/gpu_step.sh"

# calibrated on run 4 (H200): HF's decode-step compile 30 s, the 8B oracle round 28 s
step b4-16 150 200 --assume layer_s=0.6 --shapes 8b-1b --batches 4,16 --contexts 512 \
  --methods hf_static_compiled,specfx_oracle --alphas 1,0.6 --profile --no-overhead
step nolive 80 110 --assume layer_s=0.6 --shapes 8b-1b --batches 16 --contexts 512 \
  --methods specfx_oracle --alphas 1,0.6 --no-live-kv --no-overhead
step ctx4096 100 150 --assume layer_s=0.6 --shapes 8b-1b --batches 1 --contexts 4096 \
  --methods hf_dynamic,hf_static_compiled,specfx_oracle,specfx_draft --alphas 1 --no-overhead
step small 90 600 --assume layer_s=0.6 --shapes 1b-150m --batches 4,16 --contexts 512 \
  --methods hf_static_compiled,specfx_oracle,specfx_draft,specfx_self --alphas 1 --no-overhead
# issue 28 item 5: the block drafters (PARD, DFlash) compiled on CUDA: greedy equal to generate(),
# one graph, sync-free rounds (gpu_check's drafter section), if 90 s are left
left=$(( DEADLINE - $(date +%s) ))
if (( left >= 90 )); then
  echo "=== block drafters: $(date +%T), ${left}s left" | tee -a "$LOG"
  timeout $(( left - 5 )) python3 -m specfx.cli bench gpu_check --sections drafters --only pard,dflash --deadline-s $(( left - 15 )) \
    --out-dir /tmp/r5 2>&1 | tee -a "$LOG" | grep -v "^USDT"
  cp /tmp/r5/gpu_check.json "$OUT"/gpu_check_block.json 2>/dev/null
else
  echo "=== block drafters: skipped, ${left}s left (needs 90s)" | tee -a "$LOG"
fi
echo "=== done $(date +%T)" | tee -a "$LOG"
