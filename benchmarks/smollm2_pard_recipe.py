"""How the PARD draft for SmolLM2-135M-Instruct is made (issue 28 item 4); each step is resumable.
There is no smaller SmolLM2, so the draft is cut from the target itself (layer pruning): its
embeddings, a few of its decoder layers, its final norm and its (tied) LM head, then trained with
PARD's objective (``specfx train --head pard``, ARCHITECTURE decision 73) on the same self-answer
data as the EAGLE-3 head (``benchmarks/data/smollm2_self_answers``) and its trainer defaults
(AdamW, lr 1e-3, 10 warm-up steps, cosine), seeded, checkpointed every 15 steps. Budget: far
below the head's: a step here (8 windows x 256 tokens, about 860 entries per window with COD at
K = 8, a 49,152-way LM head on each) takes 26 s on one idle thread of this CPU (31-57 s on the
shared one) against the head's 3.0 s on two, so its 800 steps would take ~6 h; the run recorded
in docs/BENCHMARKS.md did 45 steps (what fit a session), 1/18 of the head's windows.

    python benchmarks/smollm2_pard_recipe.py pick  WORK     # initial held-out loss of a few layer choices
    python benchmarks/smollm2_pard_recipe.py init  WORK     # WORK/init: the layer-pruned draft (safetensors)
    python benchmarks/smollm2_pard_recipe.py train WORK     # specfx train --head pard (resumes from WORK/pard/ckpt)
    python benchmarks/smollm2_pard_recipe.py dflash WORK    # specfx train --head dflash (resumes from WORK/dflash/ckpt)
    python benchmarks/smollm2_pard_recipe.py dflash4 WORK   # the same, blocks of 5 and loss decay (WORK/dflash4)

``dflash`` trains the other block drafter on the same data, at the EAGLE-3 head's budget (800 steps of
8 x 256 tokens, cached target features): two Qwen3-style layers over taps of target layers chosen
by z-lab's rule for two draft layers, blocks of 9 (the pending token and 8 masks, so K <= 8),
32 random anchors a window, the same mask id. Its draft is WORK/dflash/head (``draft="dflash:..."``).
``dflash4`` is the same with blocks of 5 (K <= 4) and the loss decay gamma 4 (decision 102), in WORK/dflash4.

The trained draft is WORK/pard/head (``draft="pard:WORK/pard/head"``); benchmarks/block_drafters.py
measures it against the other drafters. ``--stop-after N`` after ``train`` ends that run at step N
(checkpointed; ``train`` again continues). Threads: ``OMP_NUM_THREADS`` (1 on the shared CPU).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from specfx.demo.smollm2 import smollm2_dir

DATA = Path(__file__).resolve().parent / "data" / "smollm2_self_answers"
LAYERS = (0, 10, 20, 29)  # every ~10th layer, the first and the last: the lowest initial loss of ``pick``s choices
MASK_TOKEN = 16  # <empty_output>: a special id of SmolLM2's vocabulary that chat text never produces
TRAIN = [
    "--head", "pard", "--pard-k", "8", "--pard-token", str(MASK_TOKEN), "--steps", "45", "--batch-size", "8",
    "--seq-len", "256", "--eval-prompts", "0", "--ckpt-every", "15", "--seed", "0",
]  # fmt: skip
TRAIN_DFLASH = [
    "--head", "dflash", "--dflash-block", "9", "--dflash-token", str(MASK_TOKEN), "--dflash-anchors", "32",
    "--draft-layers", "2", "--steps", "800", "--batch-size", "8", "--seq-len", "256", "--cache-features",
    "--eval-prompts", "0", "--ckpt-every", "50", "--seed", "0",
]  # fmt: skip
# Decision 102: a block drafter is trained for the K it drafts. On the demo target blocks of 5 and the loss
# decay took DFlash's tau at K = 4 from 1.75 to 3.47; this is the same change for SmolLM2 (K <= 4).
TRAIN_DFLASH_K4 = [*TRAIN_DFLASH[:2], "--dflash-block", "5", *TRAIN_DFLASH[4:], "--dflash-gamma", "4"]
CHOICES = ((0, 1), (0, 1, 2, 3), (0, 1, 28, 29), (0, 1, 2, 29), (0, 10, 20, 29), (0, 15, 29))


def layer_pruned(target, layers):
    """A copy of the Llama-style ``target`` keeping only the decoder layers ``layers`` (in order),
    with its embeddings, final norm and LM head: a PARD draft's starting point with the target's
    vocabulary. The layers are renumbered 0 .. len(layers) - 1 (their attention's ``layer_idx``
    too, which indexes the KV cache)."""
    import copy

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = type(target)(config)
    renumber = {src: i for i, src in enumerate(layers)}
    kept = {}
    for name, t in target.state_dict().items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m is None:
            kept[name] = t.clone()
        elif int(m[1]) in renumber:
            kept[f"model.layers.{renumber[int(m[1])]}.{m[2]}"] = t.clone()
    draft.load_state_dict(kept, strict=True)
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def _load_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2_dir()
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(d)


def _heldout_windows(tokenizer, n=8, length=256):
    from specfx.train.data import load_texts, streams

    texts = load_texts([str(DATA / "answers1.jsonl"), str(DATA / "answers2.jsonl")], tokenizer)
    _, held = streams(tokenizer, texts, 50, length)
    return torch.from_numpy(held[: n * length].astype("int64")).view(n, length)


def pick(work: Path) -> None:
    """Held-out next-token loss and top-1 agreement (with the data, the target's own greedy
    answers) of each layer choice before any training, and of the full target."""
    target, tok = _load_target()
    ids = _heldout_windows(tok)
    with torch.no_grad():
        for layers in ((*range(30),), *CHOICES):
            model = target if len(layers) == 30 else layer_pruned(target, layers)
            logits = model(input_ids=ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
            acc = (logits.argmax(-1) == ids[:, 1:]).float().mean().item()
            name = "target (30 layers)" if len(layers) == 30 else f"layers {layers}"
            print(f"{name:28s} loss {loss:7.3f}  top-1 {acc:.3f}", flush=True)


def init(work: Path, layers=LAYERS) -> Path:
    out = work / "init"
    if (out / "model.safetensors").exists():
        return out
    target, tok = _load_target()
    draft = layer_pruned(target, layers)
    draft.config.pard_token = MASK_TOKEN
    draft.config.spd_type = "pard"
    draft.save_pretrained(out)  # safetensors (transformers' default)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in draft.parameters())
    print(f"wrote {out}: layers {layers} of 30, {n / 1e6:.1f} M parameters")
    return out


def train(work: Path, extra=(), head="pard") -> None:
    out = work / head
    # --resume checks every option against the run's, so PARD's --init goes with it too
    start = ["--init", str(init(work))] if head == "pard" else []
    if (out / "ckpt").exists():
        start.append("--resume")
    flags = {"pard": TRAIN, "dflash": TRAIN_DFLASH, "dflash4": TRAIN_DFLASH_K4}[head]
    data = ["--data", str(DATA / "answers1.jsonl"), "--data", str(DATA / "answers2.jsonl")]
    argv = ["-m", "specfx.train", "--target", str(smollm2_dir()), *data, "--out", str(out), *flags, *start, *extra]
    print("+", " ".join(argv), flush=True)
    subprocess.run([sys.executable, *argv], check=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    steps = {
        "pick": pick, "init": init, "train": lambda w: train(w, argv[2:]),
        "dflash": lambda w: train(w, argv[2:], head="dflash"),
        "dflash4": lambda w: train(w, argv[2:], head="dflash4"),
    }  # fmt: skip
    if len(argv) < 2 or argv[0] not in steps:
        print("usage: python benchmarks/smollm2_pard_recipe.py {pick,init,train,dflash,dflash4} WORK [train flags]")
        return 2
    steps[argv[0]](Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
