"""Training data from the demo target's own greedy outputs, for the block drafters (issue 28, session 32).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/demo_target_outputs.py 1024 OUT.jsonl
    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/demo_target_outputs.py 2048 OUT.jsonl defs

``defs`` (session 33): prompts shaped like the demo's instead (``heldout_prompts``' rule over the
training files: a ``def`` line and the 5 lines after it, every such place, drawn at random), each
continued for 96 tokens.

32-token prefixes cut at random from the demo pair's training files (``build_corpus(50)["train"]``: the
held-out files the prompts come from are left out), each continued by the demo target's greedy decoding
for 160 tokens (what a greedy round verifies), 128 prefixes a batch, seed 0; written as JSONL
``{"text"}`` for ``specfx train --data``. The target is loaded as stored (float16; ``load_demo_pair``
would cast it to float32). The block drafters' objectives take hard labels from the data, so trained on
the corpus they learn the data's next tokens; trained on these they learn the target's, as the EAGLE-3
head does from the target's distribution (docs/BENCHMARKS.md "Block drafters trained on the target's
outputs"). 1,024 prefixes took about 4 minutes on 2 threads.
"""

import json
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specfx.demo.pair import DEMO_PAIR_DIR
from specfx.train.pair_corpus import build_corpus


def def_prompts(docs: list[str], n: int, rng: random.Random, lines: int = 6) -> list[str]:
    """``n`` prompts drawn from every place in ``docs`` where ``heldout_prompts`` could cut one."""
    places = []
    for text in docs:
        rows = text.splitlines(keepends=True)
        for i in range(len(rows) - lines):
            if rows[i].lstrip().startswith("def ") and all(t.strip() for t in rows[i : i + lines]):
                places.append("".join(rows[i : i + lines]).rstrip("\n"))
    return rng.sample(places, min(n, len(places)))


def main_defs(n: int, out: str) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    path = DEMO_PAIR_DIR / "target"
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = def_prompts([text for _, text in build_corpus(50)["train"]], n, rng)
    with open(out, "w") as f:
        for done in range(0, len(prompts), 64):
            batch = tok(prompts[done : done + 64], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out_ids = model.generate(
                    **batch, max_new_tokens=96, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id
                )
            pads = (batch.attention_mask == 0).sum(1).tolist()
            for row, pad in zip(out_ids.tolist(), pads, strict=True):
                f.write(json.dumps({"text": tok.decode(row[pad:])}) + "\n")
            print(done + 64, flush=True)


def main(n: int, out: str) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    path = DEMO_PAIR_DIR / "target"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    docs = [tok(text, add_special_tokens=False).input_ids for _, text in build_corpus(50)["train"]]
    docs = [d for d in docs if len(d) > 64]
    with open(out, "w") as f:
        for done in range(0, n, 128):
            prefixes = []
            for _ in range(128):
                d = rng.choice(docs)
                start = rng.randrange(0, len(d) - 32)
                prefixes.append(d[start : start + 32])
            ids = torch.tensor(prefixes)
            with torch.no_grad():
                out_ids = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=160,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=tok.pad_token_id,
                )
            for row in out_ids.tolist():
                f.write(json.dumps({"text": tok.decode(row)}) + "\n")
            print(done + 128, flush=True)


if __name__ == "__main__":
    (main_defs if sys.argv[3:] == ["defs"] else main)(int(sys.argv[1]), sys.argv[2])
