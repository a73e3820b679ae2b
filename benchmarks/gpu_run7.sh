#!/usr/bin/env bash
# Issue 30, GPU run 7 (prepared 2026-11-26, not run yet): one `run` call of ~9.5 minutes,
#   run(command="bash benchmarks/gpu_run7.sh", timeout_s=600)     (no carry: the tree is enough)
# What run 6 (docs/BENCHMARKS.md "GPU run 6") could not give, by value:
#   auto     "auto" against HF static + compile at batch 1/4/16/64 (item 3: never below 0.95x),
#            1B/150M, oracle α = 0 (must fall back to K = 0) and α = 0.6, candidates K = 0 and 4.
#            Run 6 never compiled it: torch 2.11's fake tensors failed on the K = 0 round's split
#            of an empty tensor (fixed since, decision 80; reproduced and checked on the CPU with
#            torch 2.11).
#   prof1    8B/1B batch 1: HF static + compile and the oracle α = 1, profiled with the
#            finished-flag reads overlapped, not, and overlapped again (item 1: device busy
#            >= 0.95 at batch 1; the third call tells the setting from the calls' order, which
#            made run 6's batch-16 profile ambiguous)
#   auto8b   8B/1B batch 1, "auto" with the real 1B draft (α ≈ 0 on random weights: its draft
#            prefill and the rounds before K = 0 are paid), candidates K = 0 and 4, if 200 s are left
# Results: $OUT/bench_r7_*.json and $OUT/log.txt (4 files).
# CPU checks: GPU_SMOKE=1 bash benchmarks/gpu_run7.sh (tiny models, --smoke), GPU_DRY=1 (the
# real shapes' plan and predicted times); with torch 2.11 for the GPU image's version, e.g.
#   GPU_SMOKE=1 PY=/path/to/venv-with-torch-2.11/bin/python bash benchmarks/gpu_run7.sh
set -u
OUT=${OUT:-/tmp/out}
DEADLINE=$(( $(date +%s) + ${R7_SECONDS:-570} ))
LOG="$OUT/log.txt"
RUN=r7
source "$(dirname "$0")/gpu_step.sh"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)" >>"$LOG" 2>&1

# compile constants as run 6: the 1B shapes 12 s + 0.75 s per layer, the 8B ones 0.6 s per layer
step auto 150 330 --assume graph_s=12 --assume layer_s=0.75 --shapes 1b-150m --batches 1,4,16,64 --contexts 512 \
  --methods hf_static_compiled,specfx_auto_oracle --auto-alphas 0,0.6 --auto-k-values 4 --no-overhead
step prof1 100 150 --assume layer_s=0.6 --shapes 8b-1b --batches 1 --contexts 512 \
  --methods hf_static_compiled,specfx_oracle --alphas 1 --profile --no-overhead
step auto8b 200 300 --assume layer_s=0.6 --shapes 8b-1b --batches 1 --contexts 512 \
  --methods hf_static_compiled,specfx_auto --auto-k-values 4 --no-overhead
echo "=== done $(date +%T)" | tee -a "$LOG"
