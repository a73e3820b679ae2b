#!/usr/bin/env bash
# Issue 30 (d) and issue 28: `specfx train --device cuda` for the real demo model
# (SmolLM2-135M-Instruct) at the EAGLE-3 head's budget, 800 steps x 8 windows x 256 tokens,
# G6_HEAD picking what is trained (default eagle3):
#   eagle3  the EAGLE-3 head, benchmarks/smollm2_head_recipe.py TRAIN (cached target features);
#           CPU 3.0 s/step (specfx/demo/smollm2_eagle3/MODEL_CARD.md); GPU run 6: 0.041 s/step (H100)
#   dflash  the DFlash head, benchmarks/smollm2_pard_recipe.py TRAIN_DFLASH (cached features);
#           CPU 7-11 s/step on the shared CPU (docs/BENCHMARKS.md, DFlash section; stopped at 150)
#   dflash4 the same DFlash with blocks of 5 (K <= 4) and loss decay gamma 4, TRAIN_DFLASH_K4
#           (decision 102: on the demo target this took DFlash's tau at K = 4 from 1.75 to 3.47)
#   pard    the PARD draft: smollm2_pard_recipe's `init` (layers 0, 10, 20, 29 of the converted
#           target, 42.5 M parameters) built on the machine, then its TRAIN flags with
#           `--steps 800 --ckpt-every 100` (the recipe's 45 steps were what the CPU allowed) and
#           --init; CPU 26 s/step on one idle thread (BENCHMARKS, PARD section)
# Issue 28 compares the two block drafters with the EAGLE-3 head at this one budget.
#
# Why several calls: the model exists only as its GGUF (98,362,432 bytes, 93.8 MiB, in
# ~/.cache/specfx/smollm2/), which the GPU machine cannot download, and a call carries at most
# 64 MiB *including the working tree* (~38 MiB of tracked files, the shipped heads among them),
# so ~25 MiB of the file travels per call. `split` cuts it into parts that each fit beside the
# tree; every call but the last deposits its part in /tmp/g6/parts on the warm machine (a warm
# machine keeps /tmp; it is given back ~30 s after a call, so make the calls back to back); the
# first `train` call deposits the last part, joins them, checks the pinned sha256 (specfx.demo.smollm2
# GGUF_SHA256), installs the gguf reader from the carried wheel (not on the GPU image), converts
# (specfx.demo.smollm2.smollm2_dir) into /tmp/g6/cache and trains. A later `train` call on the same
# warm machine finds that conversion and needs no GGUF (no carry); on a fresh machine it stops,
# saying so. The training data is tracked (benchmarks/data/smollm2_self_answers), so it travels.
#
# HERE (no GPU), once:   bash benchmarks/gpu_train6.sh split
#   writes .gguf_parts/part0..partN-1 (ignored) and .whl/gguf-0.19.0-py3-none-any.whl (ignored),
#   checks each part + the tree + the wheel < 64 MiB and prints the put calls (4 parts today).
# The calls (back to back, one warm machine; each `put` prints which parts /tmp/g6/parts holds;
# if a reply shows a fresh machine (warm: false) after the first, the parts are gone: start again
# from part0). Issue 28's session, DFlash and PARD (the EAGLE-3 head was trained in run 6):
#     run(command="bash benchmarks/gpu_train6.sh put", carry=[".gguf_parts/part0"], timeout_s=60)
#     run(command="bash benchmarks/gpu_train6.sh put", carry=[".gguf_parts/part1"], timeout_s=60)
#     run(command="bash benchmarks/gpu_train6.sh put", carry=[".gguf_parts/part2"], timeout_s=60)
#     run(command="G6_HEAD=dflash G6_SECONDS=420 bash benchmarks/gpu_train6.sh train",
#         carry=[".gguf_parts/part3", ".whl"], timeout_s=480)
#     run(command="G6_HEAD=pard G6_SECONDS=540 bash benchmarks/gpu_train6.sh train", timeout_s=600)
#   and, for all three, if >= 3 min of device time are left (no carry: the target is converted):
#     run(command="G6_HEAD=eagle3 G6_SECONDS=240 bash benchmarks/gpu_train6.sh train", timeout_s=300)
# (EAGLE-3 alone, as in run 6: the same four calls with G6_HEAD left out in the fourth.)
# Predicted device time, ESTIMATES scaled from run 6 (eagle3: 72x the CPU per step on an H100;
# its train call took 162 s: convert 38 s, features ~30 s, 800 steps 33 s), not measured:
#   machine start 1-2 min; the 3 puts ~1 min together;
#   dflash ~2.5-4 min: convert ~40 s, features (1,032 windows, 1.8 GB) ~0.5-1 min,
#     800 steps 45-120 s (4-11 s/step on the CPU / 72);
#   pard ~2.5-5 min: init ~15 s, 800 steps ~150 s (26 s/step on one CPU thread ~ 13 s on two,
#     / 72 = 0.18 s/step; it reads no cached features: the target runs every step, in float32)
#     up to ~4 min if float32 matmuls use the H100 worse than the head's did; 8 checkpoints
#     of ~0.5 GB each;
#   eagle3 ~1.5 min (run 6's call without the conversion).
#   DFlash + PARD: ~8-11 min of the 15; all three: ~10-12.5 min. If the PARD call is cut by its
#   deadline (exit 124 in the log), `G6_RESUME=1 G6_HEAD=pard ... train` continues it from its last
#   checkpoint (every 100 steps) while the machine is warm.
# G6_BF16=1 adds `--bf16` (mixed precision: the head's matmuls in bfloat16, its weights and optimizer
# float32); float32 matmuls run on the GPU's float32 units (specfx sets no TF32 flag), so this is the
# way to the bfloat16 tensor cores' rate. Not yet run on a GPU.
# G6_SECONDS: the call's own deadline; training gets it minus the setup and 20 s, and the files are
# packed after it. Give G6_SECONDS = timeout_s - 60 (bfloat16 cast and split: seconds), and
# timeout_s <= what status' budget_left_s shows minus ~30 s, or the machine is taken mid-pack.
# If it shares a session with another GPU script, run these first and give that one what is left.
#
# HERE, the CPU check of the same path (2 steps on G6_DATA_LINES=40 documents a file; under load,
# 12 keeps the feature caching to a few minutes); the second call reuses the first's G6_TMP, so it
# checks the "already converted" path:
#   G6_TMP=/tmp/g6c G6_CHECK=1 G6_HEAD=dflash PY=python bash benchmarks/gpu_train6.sh train
#   G6_TMP=/tmp/g6c G6_CHECK=1 G6_HEAD=pard   PY=python bash benchmarks/gpu_train6.sh train
#   (results in /tmp/g6c/out_dflash, /tmp/g6c/out_pard)
#
# Results in $OUT (at most the 8 files a call returns, each < 16 MiB; benchmarks/gpu_train6_files.py
# `pack`): log.txt; HEAD_results.json (eval.json, the checkpoint's per-step history, the head's or
# draft's config.json and its other small text files, the weights' sha256); HEAD_bf16.part00..
# (the trained weights cast to bfloat16 as `smollm2_head_recipe.py ship` does, in 15 MiB parts:
# eagle3 2, dflash 1 (15.5 MB), pard 6; more than 6 and the log says the weights were not returned).
# HERE, back into a draft directory (parts joined, sha256 checked, config and text files written,
# the PARD draft's tokenizer.json copied from the local SmolLM2 conversion):
#   bash benchmarks/gpu_train6.sh join DIR_OF_RETURNED_FILES OUT_DIR    # G6_HEAD=... if DIR holds several
#   then draft="dflash:OUT_DIR" / "pard:OUT_DIR" / "eagle3:OUT_DIR" (benchmarks/block_drafters.py --drafters)
set -u
MODE=${1:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PARTS=.gguf_parts
WHEEL_SRC=${G6_WHEEL:-/opt/pypi/files/gguf-0.19.0-py3-none-any.whl}
PY=${PY:-python3}
LIMIT=$((64 * 1024 * 1024))
HEAD=${G6_HEAD:-eagle3}
if [[ -n "${G6_CHECK:-}" ]]; then  # the CPU check: everything under a temporary directory
  G6_TMP=${G6_TMP:-$(mktemp -d /tmp/g6check.XXXX)}
  OUT=${OUT:-$G6_TMP/out_$HEAD}  # one per head: checks may share a G6_TMP (the converted target)
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
  echo "  run(command=\"G6_HEAD=dflash G6_SECONDS=420 bash benchmarks/gpu_train6.sh train\", carry=[\"$PARTS/part$last\", \".whl\"], timeout_s=480)"
  echo "  run(command=\"G6_HEAD=pard G6_SECONDS=540 bash benchmarks/gpu_train6.sh train\", timeout_s=600)"
  echo "  (G6_HEAD=eagle3 or left out: the EAGLE-3 head; the first train call carries the last part and .whl, later ones nothing)"
  ;;
put)
  put
  ;;
train)
  DEADLINE=$(( $(date +%s) + ${G6_SECONDS:-420} ))
  case "$HEAD" in
  eagle3) recipe_flags=smollm2_head_recipe.TRAIN; extra=(); cpu="3.0"; cpu_label="2 threads, MODEL_CARD.md" ;;
  dflash) recipe_flags=smollm2_pard_recipe.TRAIN_DFLASH; extra=(); cpu="7-11"; cpu_label="the shared CPU, BENCHMARKS' DFlash section" ;;
  dflash4) recipe_flags=smollm2_pard_recipe.TRAIN_DFLASH_K4; extra=(); cpu="7-11"; cpu_label="as dflash (blocks of 5: a little less)" ;;
  pard)   # the recipe's 45 steps were what fit the CPU; here the EAGLE-3 head's budget (argparse keeps the last)
    recipe_flags=smollm2_pard_recipe.TRAIN; extra=(--steps 800 --ckpt-every 100); cpu="26"; cpu_label="one idle thread, BENCHMARKS' PARD section" ;;
  *) echo "G6_HEAD=$HEAD: expected eagle3, dflash, dflash4 or pard"; exit 2 ;;
  esac
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv >>"$LOG" 2>&1
  if [[ -n "${G6_CHECK:-}" ]]; then  # here: the parts split above play the calls' deposits
    [[ -d "$PARTS" ]] || { echo "run 'bash benchmarks/gpu_train6.sh split' first"; exit 1; }
  fi
  put
  read -r pinned name model_dir source_file < <("$PY" -c "from specfx.demo import smollm2 as s; print(s.GGUF_SHA256, s.GGUF_NAME, s.MODEL_DIR_NAME, s.SOURCE_FILE)") || exit 1
  export SPECFX_CACHE="$G6_TMP/cache"
  mkdir -p "$SPECFX_CACHE/smollm2"
  if [[ -f "$SPECFX_CACHE/$model_dir/$source_file" ]]; then  # smollm2_dir's own test of a finished conversion
    say "converted target already in $SPECFX_CACHE/$model_dir (an earlier train call on this warm machine): join, sha256 and conversion skipped, no GGUF needed"
  else
    if ! ls "$G6_TMP"/parts/part* >/dev/null 2>&1; then
      say "no converted target in $SPECFX_CACHE and no GGUF parts in $G6_TMP/parts: this machine is fresh (or was given back); send the parts first: the put calls, then this call with the last part and .whl (bash benchmarks/gpu_train6.sh split prints them)"
      exit 1
    fi
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
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  t0=$(date +%s)
  target=$("$PY" -c "from specfx.demo.smollm2 import smollm2_dir; print(smollm2_dir(fetch=False))" 2>"$G6_TMP/convert.log")
  rc=$?
  tr '\r' '\n' <"$G6_TMP/convert.log" | grep -v '%|\|^\s*$' >>"$LOG"  # without the progress bars
  (( rc == 0 )) || { say "conversion failed (exit $rc)"; exit 1; }
  say "target ready in $(( $(date +%s) - t0 )) s: $target"
  data=benchmarks/data/smollm2_self_answers
  if [[ -n "${G6_DATA_LINES:-}" ]]; then  # the CPU check: a few documents, features in seconds
    mkdir -p "$G6_TMP/data"
    for f in answers1 answers2; do head -n "$G6_DATA_LINES" "$data/$f.jsonl" >"$G6_TMP/data/$f.jsonl"; done
    data=$G6_TMP/data
  fi
  read -r -a recipe < <("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from ${recipe_flags%.*} import ${recipe_flags#*.} as f; print(' '.join(f))")
  steps=()
  [[ -n "${G6_STEPS:-}" ]] && steps=(--steps "$G6_STEPS")  # overrides the recipe's (argparse keeps the last)
  [[ -n "${G6_BF16:-}" ]] && extra+=(--bf16)  # mixed precision (session 38): the head's matmuls in bfloat16
  run_dir="$G6_TMP/smollm2-$HEAD"
  start=()
  if [[ -n "${G6_RESUME:-}" && -f "$run_dir/ckpt/meta.json" ]]; then  # a call cut by its deadline on this warm machine
    start=(--resume)
    say "resuming $run_dir from its checkpoint (step $("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['step'])" "$run_dir/ckpt/meta.json"))"
  else
    rm -rf "$run_dir"
    if [[ "$HEAD" == pard ]]; then  # the layer-pruned copy of the target the draft starts from
      t0=$(date +%s)
      "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from smollm2_pard_recipe import init; init(Path(sys.argv[1]))" \
        "$G6_TMP/pard_work" 2>&1 | grep -v '%|' | tee -a "$LOG"
      [[ -f "$G6_TMP/pard_work/init/model.safetensors" ]] || { say "the PARD init draft was not built"; exit 1; }
      say "PARD init draft built in $(( $(date +%s) - t0 )) s: $G6_TMP/pard_work/init"
      start=(--init "$G6_TMP/pard_work/init")
    fi
  fi
  left=$(( DEADLINE - $(date +%s) - 20 ))
  say "training: specfx train ${recipe[*]} ${extra[*]} ${steps[*]} ${start[*]} --device ${G6_DEVICE:-cuda} (${left} s left)"
  t0=$(date +%s)
  timeout "$left" "$PY" -m specfx.train --target "$target" --data "$data/answers1.jsonl" --data "$data/answers2.jsonl" \
    --out "$run_dir" "${recipe[@]}" "${extra[@]}" "${steps[@]}" "${start[@]}" --device "${G6_DEVICE:-cuda}" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' >"$G6_TMP/train.log"
  rc=${PIPESTATUS[0]}
  grep -v '%|' "$G6_TMP/train.log" | tail -n 40 | tee -a "$LOG"
  grep '%|' "$G6_TMP/train.log" | awk 'NR % 50 == 0' | tail -n 20 >>"$LOG"  # progress samples (caching, steps)
  say "specfx train exit $rc after $(( $(date +%s) - t0 )) s (features cached where the recipe says so, then trained)"
  (( rc == 124 )) && say "cut by the deadline (G6_SECONDS): G6_RESUME=1 with the same G6_HEAD continues from the last checkpoint on this warm machine"
  # log.txt + HEAD_results.json + the bfloat16 weights in <= 6 parts: the 8 files a call returns
  "$PY" benchmarks/gpu_train6_files.py pack "$HEAD" "$run_dir" "$OUT" "$cpu" "$cpu_label" 2>&1 | tee -a "$LOG"
  ;;
join)  # here: the returned files back into a draft directory
  [[ $# -eq 3 ]] || { echo "usage: bash benchmarks/gpu_train6.sh join DIR_OF_RETURNED_FILES OUT_DIR"; exit 2; }
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/gpu_train6_files.py join "$2" "$3" ${G6_HEAD:+"$G6_HEAD"}
  ;;
*)
  echo "usage: bash benchmarks/gpu_train6.sh {split|put|train|join DIR OUT_DIR}  (see the header)"
  exit 2
  ;;
esac
