"""Training data from the demo target's own greedy outputs, for the block drafters (issue 28, session 32).

    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/demo_target_outputs.py 1024 OUT.jsonl

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
    main(int(sys.argv[1]), sys.argv[2])
