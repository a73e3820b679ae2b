#!/usr/bin/env bash
# Issue 30, GPU run 6 (ran 2026-11-26 on an H100: docs/BENCHMARKS.md "GPU run 6"): one `run` call of ~9.5 minutes,
#   run(command="bash benchmarks/gpu_run6.sh", timeout_s=600)     (no carry: the tree is enough)
# or, sharing a session with benchmarks/gpu_train6.sh (run that first), R6_SECONDS=<what is left
# minus ~60 s> in front. Steps by value, each a separate `specfx bench gpu` process given what is
# left of the deadline (the JSON is written after each combination, so a step cut short keeps
# what it finished); a step is skipped when less than its minimum is left:
#   b16live  8B/1B batch 16, context 512, live-KV cut ON (run 5 had it off): HF static + compile
#            and the oracle α = 1 / 0.6 in one process, with a profile of the oracle's decode loop
#   auto     "auto" against HF static + compile at batch 1/4/16/64 (issue 30: never below 0.95x),
#            1B/150M, the oracle at α = 0 (nothing pays: "auto" must fall back to K = 0 after
#            8 row-rounds of evidence) and α = 0.6; candidates K = 0 and 4 (--auto-k-values 4:
#            two round graphs per batch; the library's default 1,2,4,8 would compile five, ~100 s
#            more per batch, for the same timed calls: with free proposals "auto" explores at
#            K = 4 either way and α = 0.6 runs K = 4 either way)
#   small16  1B/150M batch 16: HF static + compile, oracle α = 1, the 150M draft, self-draft
#   auto8b   if ~200 s are left: 8B/1B batch 1, "auto" with the real 1B draft (α ≈ 0: its cost
#            and prefill are paid before K = 0), candidates K = 0 and 4
# Results: $OUT/bench_r6_*.json and $OUT/log.txt (5 files; at most 8 come back).
# CPU check of every step's arguments: R6_SMOKE=1 bash benchmarks/gpu_run6.sh (tiny models, --smoke),
# and R6_DRY=1 bash benchmarks/gpu_run6.sh (the real shapes' plan and predicted times, --dry-run).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/r6
DEADLINE=$(( $(date +%s) + ${R6_SECONDS:-570} ))
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1
PY=${PY:-python3}

RUN=r6
GPU_DRY=${R6_DRY:-}; GPU_SMOKE=${R6_SMOKE:-}  # the names run 6 was checked with
source "$(dirname "$0")/gpu_step.sh"

# compile constants: run 5 (H200) measured the 8B round 50 s and HF's 8B step 37-41 s (graph_s 20 +
# layer_s 0.6 x 32 = 39); the 1B shapes 19-24 s per 16-layer graph and 62 s for the 150M draft's
# 64-layer round (graph_s 12, layer_s 0.75)
step b16live 110 170 --assume layer_s=0.6 --shapes 8b-1b --batches 16 --contexts 512 \
  --methods hf_static_compiled,specfx_oracle --alphas 1,0.6 --profile --no-overhead
step auto 150 350 --assume graph_s=12 --assume layer_s=0.75 --shapes 1b-150m --batches 1,4,16,64 --contexts 512 \
  --methods hf_static_compiled,specfx_auto_oracle --auto-alphas 0,0.6 --auto-k-values 4 --no-overhead
step small16 90 260 --assume graph_s=12 --assume layer_s=0.75 --shapes 1b-150m --batches 16 --contexts 512 \
  --methods hf_static_compiled,specfx_oracle,specfx_draft,specfx_self --alphas 1 --no-overhead
step auto8b 200 300 --assume layer_s=0.6 --shapes 8b-1b --batches 1 --contexts 512 \
  --methods hf_static_compiled,specfx_auto --auto-k-values 4 --no-overhead
echo "=== done $(date +%T)" | tee -a "$LOG"
