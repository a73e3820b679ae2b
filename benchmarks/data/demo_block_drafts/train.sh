#!/bin/bash
# How the PARD and DFlash drafts here were trained (session 19, issue 28 item 4; docs/BENCHMARKS.md,
# "Block drafters on the demo target"): the demo target's own training files at the EAGLE-3 head's
# budget, 3,600 steps x 4 windows x 128 tokens, one thread.
#   bash benchmarks/data/demo_block_drafts/train.sh DATA_DIR OUT_DIR    (RESUME=1 continues a run)
# DATA_DIR: the pair's training files (specfx/train/pair.py build_corpus(50), written as files; the
# held-out files of specfx/demo/demo_pair/heldout_files.json left out).
set -euo pipefail
cd "$(dirname "$0")/../../.."
DATA=$1 OUT=$2
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
T="--target specfx/demo/demo_pair/target --data $DATA --batch-size 4 --seq-len 128 --seed 0 --eval-prompts 0 --ckpt-every 100 --steps 3600"
R=${RESUME:+--resume}
python -m specfx.cli train $T --head pard --init specfx/demo/demo_pair/draft --pard-k 16 --pard-token 1 --out "$OUT/pard" $R
python -m specfx.cli train $T --head dflash --dflash-block 17 --dflash-token 1 --draft-layers 1 --dflash-anchors 16 --out "$OUT/dflash" $R
