#!/bin/bash
# How pard_target_outputs/ was trained (session 32, issue 28; docs/BENCHMARKS.md "Block drafters trained on
# the target's outputs"): train.sh's PARD run, same budget and flags (3,600 steps x 4 windows x 128 tokens,
# from the demo draft, --pard-k 16, mask id 1), on the demo target's greedy continuations of training-file
# prefixes instead of the files themselves. Two threads (9.7 min for PARD); the thread count does not change
# the budget. The DFlash draft kept (dflash_target_outputs/, sessions 36-37; docs/BENCHMARKS.md "DFlash trained
# for K = 4 on the target's outputs") is the last command's, its weights then cast to float16 (the same tau):
# blocks of 5 (K <= 4), 2 layers reading target layers 0, 1 and 2, 64 anchors a window, loss decay gamma 4
# (session 37, one thread: tau 3.62 at K = 4 with seed 0, kept; 3.38 with --seed 1; 32 anchors: 3.47).
# (Session 32's DFlash alike, blocks of 17, one layer, the middle layer's tap, 16 anchors, gained little.)
#   bash benchmarks/data/demo_block_drafts/train_target_outputs.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$1
export PYTHONPATH=$PWD OMP_NUM_THREADS=2
mkdir -p "$OUT"
python benchmarks/demo_target_outputs.py 1024 "$OUT/greedy.jsonl"
T="--target specfx/demo/demo_pair/target --data $OUT/greedy.jsonl --batch-size 4 --seq-len 128 --seed 0 --eval-prompts 0 --ckpt-every 300 --steps 3600"
python -m specfx.cli train $T --head pard --init specfx/demo/demo_pair/draft --pard-k 16 --pard-token 1 --out "$OUT/pard"
python -m specfx.cli train $T --head dflash --dflash-block 5 --dflash-token 1 --draft-layers 2 --dflash-taps 0 1 2 \
  --dflash-anchors 64 --dflash-gamma 4 --out "$OUT/dflash"
