#!/usr/bin/env bash
# Issue 30 (d): `specfx train --device cuda` for the real demo model's EAGLE-3 head
# (SmolLM2-135M-Instruct; recipe benchmarks/smollm2_head_recipe.py: 800 steps x 8 windows x 256
# tokens, cached target features), timed per step against the CPU's 3.0 s/step
# (specfx/demo/smollm2_eagle3/MODEL_CARD.md).
#
# Why several calls: the model exists only as its GGUF (98,362,432 bytes, 93.8 MiB, in
# ~/.cache/specfx/smollm2/), which the GPU machine cannot download, and a call carries at most
# 64 MiB *including the working tree* (~38 MiB of tracked files, the shipped heads among them),
# so ~25 MiB of the file travels per call. `split` cuts it into parts that each fit beside the
# tree; every call but the last deposits its part in /tmp/g6/parts on the warm machine (a warm
# machine keeps /tmp; it is given back ~30 s after a call, so make the calls back to back); the
# last call deposits the last part, joins them, checks the pinned sha256 (specfx.demo.smollm2
# GGUF_SHA256), installs the gguf reader from the carried wheel (not on the GPU image), converts
# (specfx.demo.smollm2.smollm2_dir) and trains. The training data is tracked
# (benchmarks/data/smollm2_self_answers), so it travels with the tree.
#
# HERE (no GPU), once:   bash benchmarks/gpu_train6.sh split
#   writes .gguf_parts/part0..partN-1 (ignored) and .whl/gguf-0.19.0-py3-none-any.whl (ignored),
#   checks each part + the tree + the wheel < 64 MiB and prints the exact calls, i.e. with 4 parts:
#     run(command="bash benchmarks/gpu_train6.sh put",   carry=[".gguf_parts/part0"], timeout_s=60)
#     run(command="bash benchmarks/gpu_train6.sh put",   carry=[".gguf_parts/part1"], timeout_s=60)
#     run(command="bash benchmarks/gpu_train6.sh put",   carry=[".gguf_parts/part2"], timeout_s=60)
#     run(command="G6_SECONDS=420 bash benchmarks/gpu_train6.sh train",
#         carry=[".gguf_parts/part3", ".whl"], timeout_s=480)
#   Each `put` prints which parts /tmp/g6/parts holds; if a reply shows a fresh machine
#   (warm: false) after the first, the earlier parts are gone: start again from part0.
#   Device time: one machine start (1-2 min) + 3 short calls + the training call (predicted
#   ~3-4 min: convert ~20 s, features ~30 s, 800 steps). If it shares a session with
#   benchmarks/gpu_run6.sh, run these first and give gpu_run6.sh what is left (R6_SECONDS).
# HERE, the CPU check of the same path (2 steps on 40 documents, another python if wanted):
#   G6_CHECK=1 PY=/work/venv517/bin/python bash benchmarks/gpu_train6.sh train
#
# Results in $OUT (6 files): log.txt, eval.json (train_seconds_this_run, steps, final metrics),
# history.json (the checkpoint's per-step records), head_config.json, head_bf16.part00/01 (the
# trained head cast to bfloat16 as `smollm2_head_recipe.py ship` does, split under the 16 MiB a
# returned file may have: `cat head_bf16.part0* > model.safetensors`).
set -u
MODE=${1:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PARTS=.gguf_parts
WHEEL_SRC=${G6_WHEEL:-/opt/pypi/files/gguf-0.19.0-py3-none-any.whl}
PY=${PY:-python3}
LIMIT=$((64 * 1024 * 1024))
if [[ -n "${G6_CHECK:-}" ]]; then  # the CPU check: everything under a temporary directory
  G6_TMP=${G6_TMP:-$(mktemp -d /tmp/g6check.XXXX)}
  OUT=${OUT:-$G6_TMP/out}
  G6_DEVICE=${G6_DEVICE:-cpu}
  G6_STEPS=${G6_STEPS:-2}
  G6_DATA_LINES=${G6_DATA_LINES:-40}
fi
G6_TMP=${G6_TMP:-/tmp/g6}
OUT=${OUT:-$G6_TMP/out}
mkdir -p "$OUT" "$G6_TMP/parts"
LOG="$OUT/log.txt"
say() { echo "[gpu_train6 $(date +%T)] $*" | tee -a "$LOG"; }

put() {  # the carried parts into $G6_TMP/parts; list what is there
  local n=0
  for f in "$PARTS"/part*; do
    [[ -f "$f" ]] || continue
    cp "$f" "$G6_TMP/parts/" && n=$((n + 1))
  done
  say "deposited $n part(s); $G6_TMP/parts holds: $(cd "$G6_TMP/parts" && ls -l part* 2>/dev/null | awk '{print $9 "=" $5}' | tr '\n' ' ')"
}

case "$MODE" in
split)
  GGUF=${G6_GGUF:-$HOME/.cache/specfx/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
  [[ -f "$GGUF" ]] || { echo "no GGUF at $GGUF (run: python -c 'from specfx.demo.smollm2 import smollm2_dir; smollm2_dir()')"; exit 1; }
  tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
  untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r stat -c %s | awk '{s += $1} END {print s + 0}')
  wheel=$(stat -c %s "$WHEEL_SRC")
  size=$(stat -c %s "$GGUF")
  room=$(( LIMIT - tree - untracked - wheel - 1024 * 1024 ))  # 1 MiB spare for the docs a session adds
  n=$(( (size + room - 1) / room ))
  rm -rf "$PARTS" && mkdir -p "$PARTS" .whl
  split -n "$n" -d -a 1 "$GGUF" "$PARTS/part"
  cp "$WHEEL_SRC" .whl/
  echo "tree $tree + untracked $untracked bytes; GGUF $size bytes in $n parts:"
  ls -l "$PARTS"
  for f in "$PARTS"/part*; do
    total=$(( tree + untracked + wheel + $(stat -c %s "$f") ))
    (( total < LIMIT )) || { echo "$f: $total bytes would travel, over $LIMIT"; exit 1; }
  done
  sha256sum "$GGUF"
  last=$((n - 1))
  echo "the calls (back to back, one warm machine):"
  for ((i = 0; i < last; i++)); do
    echo "  run(command=\"bash benchmarks/gpu_train6.sh put\", carry=[\"$PARTS/part$i\"], timeout_s=60)"
  done
  echo "  run(command=\"G6_SECONDS=420 bash benchmarks/gpu_train6.sh train\", carry=[\"$PARTS/part$last\", \".whl\"], timeout_s=480)"
  ;;
put)
  put
  ;;
train)
  DEADLINE=$(( $(date +%s) + ${G6_SECONDS:-420} ))
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
  if [[ -n "${G6_CHECK:-}" ]]; then  # here: the parts split above play the calls' deposits
    [[ -d "$PARTS" ]] || { echo "run 'bash benchmarks/gpu_train6.sh split' first"; exit 1; }
  fi
  put
  pinned=$("$PY" -c "from specfx.demo.smollm2 import GGUF_SHA256; print(GGUF_SHA256)") || exit 1
  name=$("$PY" -c "from specfx.demo.smollm2 import GGUF_NAME; print(GGUF_NAME)")
  export SPECFX_CACHE="$G6_TMP/cache"
  mkdir -p "$SPECFX_CACHE/smollm2"
  target_gguf="$SPECFX_CACHE/smollm2/$name"
  cat $(ls "$G6_TMP"/parts/part* | sort -V) >"$target_gguf.join"
  got=$(sha256sum "$target_gguf.join" | cut -d' ' -f1)
  if [[ "$got" != "$pinned" ]]; then
    say "joined GGUF has sha256 $got, not the pinned $pinned: a part is missing or broken; resend them (put)"
    exit 1
  fi
  mv "$target_gguf.join" "$target_gguf"
  say "GGUF reassembled, sha256 ok ($(stat -c %s "$target_gguf") bytes)"
  if ! "$PY" -c "import gguf" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$G6_TMP/site" .whl/gguf-*.whl || exit 1
    export PYTHONPATH="$G6_TMP/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  t0=$(date +%s)
  target=$("$PY" -c "from specfx.demo.smollm2 import smollm2_dir; print(smollm2_dir(fetch=False))" 2>"$G6_TMP/convert.log")
  rc=$?
  tr '\r' '\n' <"$G6_TMP/convert.log" | grep -v '%|\|^\s*$' >>"$LOG"  # without the progress bars
  (( rc == 0 )) || { say "conversion failed (exit $rc)"; exit 1; }
  say "converted in $(( $(date +%s) - t0 )) s: $target"
  data=benchmarks/data/smollm2_self_answers
  if [[ -n "${G6_DATA_LINES:-}" ]]; then  # the CPU check: a few documents, features in seconds
    mkdir -p "$G6_TMP/data"
    for f in answers1 answers2; do head -n "$G6_DATA_LINES" "$data/$f.jsonl" >"$G6_TMP/data/$f.jsonl"; done
    data=$G6_TMP/data
  fi
  read -r -a recipe < <("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from smollm2_head_recipe import TRAIN; print(' '.join(TRAIN))")
  steps=()
  [[ -n "${G6_STEPS:-}" ]] && steps=(--steps "$G6_STEPS")  # overrides the recipe's (argparse keeps the last)
  run_dir="$G6_TMP/smollm2-eagle3"
  rm -rf "$run_dir"
  left=$(( DEADLINE - $(date +%s) - 20 ))
  say "training: specfx train ${recipe[*]} ${steps[*]} --device ${G6_DEVICE:-cuda} (${left} s left)"
  t0=$(date +%s)
  timeout "$left" "$PY" -m specfx.train --target "$target" --data "$data/answers1.jsonl" --data "$data/answers2.jsonl" \
    --out "$run_dir" "${recipe[@]}" "${steps[@]}" --device "${G6_DEVICE:-cuda}" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' >"$G6_TMP/train.log"
  rc=${PIPESTATUS[0]}
  grep -v '%|' "$G6_TMP/train.log" | tail -n 40 | tee -a "$LOG"
  grep '%|' "$G6_TMP/train.log" | awk 'NR % 50 == 0' | tail -n 20 >>"$LOG"  # progress samples (caching, steps)
  say "specfx train exit $rc after $(( $(date +%s) - t0 )) s (features cached, then trained)"
  cp "$run_dir/eval.json" "$OUT/eval.json" 2>/dev/null
  cp "$run_dir/ckpt/meta.json" "$OUT/history.json" 2>/dev/null
  if [[ -f "$run_dir/head/model.safetensors" ]]; then
    cp "$run_dir/head/config.json" "$OUT/head_config.json"
    "$PY" - "$run_dir/head/model.safetensors" "$G6_TMP/head_bf16.safetensors" <<'EOF'
import sys
import torch
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1])
save_file({n: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for n, v in t.items()}, sys.argv[2],
          metadata={"format": "pt"})
EOF
    split -b 15M -d -a 2 "$G6_TMP/head_bf16.safetensors" "$OUT/head_bf16.part"
    sha256sum "$G6_TMP/head_bf16.safetensors" | tee -a "$LOG"
  fi
  "$PY" - "$OUT/eval.json" <<'EOF' | tee -a "$LOG"
import json, sys
try:
    e = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("no eval.json: the run did not finish (see the log; ckpt/ holds the last checkpoint)")
per = e["train_seconds_this_run"] / max(e["steps"], 1)
print(f"{e['steps']} steps in {e['train_seconds_this_run']} s: {per:.3f} s/step ({3.0 / per:.3g}x the CPU's 3.0 s/step); "
      f"final {e['final']}")
EOF
  ;;
*)
  echo "usage: bash benchmarks/gpu_train6.sh {split|put|train}  (see the header)"
  exit 2
  ;;
esac
