"""How the shipped EAGLE-3 head for SmolLM2-135M-Instruct (``specfx/demo/smollm2_eagle3``) was
made, step by step; each step is resumable and skips what is already done.

    python benchmarks/smollm2_head_recipe.py data  WORK     # prompts, the target's own answers (~20 min)
    python benchmarks/smollm2_head_recipe.py train WORK     # specfx train --head eagle3 (resumable)
    python benchmarks/smollm2_head_recipe.py ship  WORK     # bfloat16 copy into specfx/demo/smollm2_eagle3
    python benchmarks/head_tau.py --head specfx/demo/smollm2_eagle3 --out WORK/head_tau.json

``data``: stage-1 prompts (:mod:`specfx.train.chat_prompts`: stdlib code tasks, math
templates, passage requests, multi-turn openers), the target's greedy answers
(:mod:`specfx.train.respond`), stage-2 prompts built on those answers (summaries, passage and
retrieval questions, translations, follow-ups) and their answers. ``train``: the command
below. ``ship``: the trained head's floating tensors cast to bfloat16 (the size budget; the
head runs in the target's dtype once bound), the vocabulary maps and config kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specfx.demo.smollm2 import smollm2_dir

SHIPPED = Path(__file__).resolve().parent.parent / "specfx" / "demo" / "smollm2_eagle3"
TRAIN = [
    "--head", "eagle3", "--steps", "800", "--batch-size", "8", "--seq-len", "256", "--draft-vocab-size", "8192",
    "--cache-features", "--eval-prompts", "0", "--ckpt-every", "50", "--seed", "0",
]  # fmt: skip


def run(*argv: str) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run([sys.executable, *argv], check=True)


def data(work: Path) -> None:
    target = str(smollm2_dir())
    d = work / "data"
    d.mkdir(parents=True, exist_ok=True)
    answer = ["--target", target, "--max-new-tokens", "192", "--threads", "2"]
    run("-m", "specfx.train.chat_prompts", "stage1", str(work / "prompts1.jsonl"))
    run("-m", "specfx.train.respond", *answer, "--batch-size", "48", "--prompts", str(work / "prompts1.jsonl"),
        "--out", str(d / "answers1.jsonl"))  # fmt: skip
    run("-m", "specfx.train.chat_prompts", "stage2", str(d / "answers1.jsonl"), str(work / "prompts2.jsonl"))
    run("-m", "specfx.train.respond", *answer, "--batch-size", "32", "--prompts", str(work / "prompts2.jsonl"),
        "--out", str(d / "answers2.jsonl"))  # fmt: skip


def train(work: Path) -> None:
    out = work / "smollm2-eagle3"
    data = ["--data", str(work / "data" / "answers1.jsonl"), "--data", str(work / "data" / "answers2.jsonl")]
    resume = ["--resume"] if (out / "ckpt").exists() else []
    run("-m", "specfx.train", "--target", str(smollm2_dir()), *data, "--out", str(out), *TRAIN, *resume)


def ship(work: Path) -> None:
    head = work / "smollm2-eagle3" / "head"
    SHIPPED.mkdir(parents=True, exist_ok=True)
    tensors = load_file(head / "model.safetensors")
    cast = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    save_file(cast, SHIPPED / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((head / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (SHIPPED / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    size = (SHIPPED / "model.safetensors").stat().st_size
    print(f"shipped {SHIPPED} ({size / 1e6:.1f} MB)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    steps = {"data": data, "train": train, "ship": ship}
    if len(argv) != 2 or argv[0] not in steps:
        print("usage: python benchmarks/smollm2_head_recipe.py {data,train,ship} WORK")
        return 2
    steps[argv[0]](Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
