#!/usr/bin/env bash
# Issue 30, fourth GPU run (one `run` call, ~9.5 minutes): 8B target / 1B draft shapes, bf16, batch 1,
# context 512, K = 4, 128 new tokens. In order, each step a separate process that writes its JSON
# as it goes, each given what is left of the deadline:
#   A  default Inductor: HF generate, HF static cache + compile, specfx oracle α = 1 / 0.6, and a
#      profile of one warm call with the finished-flag reads overlapped and not (item 1)
#   B  coordinate_descent_tuning scoped to the compiles (SpecConfig.inductor_options; HF gets the
#      same CompileConfig.options): the same rows plus the round-overhead parts (item 2)
#   C  Inductor freezing + coordinate descent (weights as constants: Inductor may fuse/relayout them)
#   D  max_autotune GEMMs + coordinate descent, if time is left
# Results: $OUT/bench_r4_{default,cdt,freeze,autotune}.json and $OUT/log.txt.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/r4
DEADLINE=$(( $(date +%s) + ${R4_SECONDS:-575} ))
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} >>"$LOG" 2>&1

RUN=r4
source "$(dirname "$0")/gpu_step.sh"

B1=(--shapes 8b-1b --batches 1 --contexts 512)  # every step of run 4
step default 120 170 "${B1[@]}" --assume layer_s=0.6 --methods hf_dynamic,hf_static_compiled,specfx_oracle --alphas 1,0.6 --profile --no-overhead
step cdt 150 230 "${B1[@]}" --assume layer_s=1.2 --methods hf_dynamic,hf_static_compiled,specfx_oracle --alphas 1,0.6 --profile \
  --inductor-options coordinate_descent_tuning=1
step freeze 110 150 "${B1[@]}" --assume layer_s=1.2 --methods hf_dynamic,specfx_oracle --alphas 1 --repeats 2 \
  --inductor-options freezing=1,coordinate_descent_tuning=1
step autotune 120 600 "${B1[@]}" --assume layer_s=2 --methods hf_dynamic,specfx_oracle --alphas 1 --repeats 2 --no-overhead \
  --inductor-options max_autotune=1,coordinate_descent_tuning=1
echo "=== done $(date +%T)" | tee -a "$LOG"
