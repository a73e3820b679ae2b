#!/bin/bash
# How pard_target_outputs/ was trained (session 32, issue 28; docs/BENCHMARKS.md "Block drafters trained on
# the target's outputs"): train.sh's PARD run, same budget and flags (3,600 steps x 4 windows x 128 tokens,
# from the demo draft, --pard-k 16, mask id 1), on the demo target's greedy continuations of training-file
# prefixes instead of the files themselves. The DFlash run alike is in the same section (not kept: it gained
# little). Two threads (9.7 min for PARD); the thread count does not change the budget.
#   bash benchmarks/data/demo_block_drafts/train_target_outputs.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=$1
export PYTHONPATH=$PWD OMP_NUM_THREADS=2
mkdir -p "$OUT"
python benchmarks/demo_target_outputs.py 1024 "$OUT/greedy.jsonl"
T="--target specfx/demo/demo_pair/target --data $OUT/greedy.jsonl --batch-size 4 --seq-len 128 --seed 0 --eval-prompts 0 --ckpt-every 300 --steps 3600"
python -m specfx.cli train $T --head pard --init specfx/demo/demo_pair/draft --pard-k 16 --pard-token 1 --out "$OUT/pard"
python -m specfx.cli train $T --head dflash --dflash-block 17 --dflash-token 1 --draft-layers 1 --dflash-anchors 16 --out "$OUT/dflash"
