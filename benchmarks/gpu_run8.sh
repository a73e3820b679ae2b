#!/usr/bin/env bash
# Issue 30 item 4 / issue 29 on the device, GPU run 8 (prepared 2026-11-27, not run yet): one `run`
# call of ~4 minutes, after gpu_run7.sh (or alone when run 7's results exist):
#   run(command="bash benchmarks/gpu_run8.sh", timeout_s=300)     (no carry: the tree is enough)
# What no GPU run has checked: targets with recurrent / linear-attention state compiled on CUDA
# (Inductor + CUDA graphs): a gated-delta-net hybrid (qwen3_next) with a hybrid draft model,
# prompt lookup and "auto"; LFM2 short convs; Mamba2 SSD (torch 2.11's Inductor is refused for
# it by design, decision 84: the case checks the refusal and runs the traced round instead); Jamba
# (Mamba1 + attention, its verify stepping the mixers one position at a time, decision 90).
# Per case: greedy = generate() on a left-padded batch twice (the second compiles nothing),
# rounds that reject (state rolled back), CUDA-graph skips, warm rounds under the sync detector,
# one profiled call (cudaGraphLaunch per round, device busy fraction).
# Results: $OUT/gpu_check.json and $OUT/log.txt.
# CPU check: GPU_SMOKE=1 bash benchmarks/gpu_run8.sh (device cpu, backend specfx_eager).
set -u
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/log.txt"
if [[ -n "${GPU_SMOKE:-}" ]]; then
  where=(--device cpu --backend specfx_eager)
else
  where=()
  nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)" >>"$LOG" 2>&1
timeout 285 "$PY" -m specfx.cli bench gpu_check --sections env,hybrid --deadline-s 230 --out-dir "$OUT" "${where[@]}" 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee -a "$LOG"
echo "=== hybrid exit ${PIPESTATUS[0]} $(date +%T)" | tee -a "$LOG"
