"""τ of a head (or any drafter) on SmolLM2-135M-Instruct, per kind of prompt: the model card's table.

The prompts are the chat suite's (``specfx/bench/prompts/suite.jsonl``: 8 kinds x 8 prompts),
which no training prompt repeats (``specfx.train.chat_prompts.check_disjoint``). Each kind's
prompts run as one left-padded batch, greedy, eager (τ does not depend on compiling), once per
setting: K = 2, 4, 8 and an EAGLE-2 tree of 16 nodes (pinned: every round); every output is checked against HF
``generate()``'s (fp32) and a mismatch fails the run. Prints a table and writes JSON.

    python benchmarks/head_tau.py --head specfx/demo/smollm2_eagle3 --out runs/head_tau.json
    PYTHONPATH=. python benchmarks/head_tau.py --draft dflash:DIR --shapes 2,4,medusa-16

``--draft`` takes any drafter ``speculate(draft=...)`` takes by name (``dflash:DIR``, ``pard:DIR``,
``eagle3:DIR``); ``--shapes`` as in demo_block_tau.py (chains ``K``, static trees ``medusa-N``,
``topk-D-B-N``, dynamic ``eagle2-N`` for EAGLE heads), each pinned for every round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import specfx
from benchmarks.demo_block_tau import round_shape
from specfx.bench.tasks.suite_prompts import load_suite, make_batches
from specfx.demo.smollm2 import load_smollm2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--head", help="an EAGLE-3 head directory")
    who.add_argument("--draft", help="any drafter by name: dflash:DIR, pard:DIR, eagle3:DIR")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per kind (default all 8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="2,4,8,eagle2-16", help="comma-separated: K, medusa-N, topk-D-B-N, eagle2-N")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    suite = load_suite()
    # each shape pinned (num_speculative_tokens set: unset is "auto", which may run K = 0)
    settings = {f"K={s}" if s.isdigit() else s: round_shape(s) for s in args.shapes.split(",")}
    rows, failures, start = {kind: {} for kind in suite}, 0, time.monotonic()
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    inputs, refs = {}, {}
    for kind, prompts in suite.items():  # one left-padded batch per kind, and HF's answer to it
        picked = prompts[: args.num_prompts]
        (inputs[kind],) = make_batches(tok, picked, len(picked), model.device)
        with torch.no_grad():
            refs[kind] = model.generate(**inputs[kind], **gen)
    for name, kw in settings.items():  # one generator per setting (capturing the model is its cost)
        spec = specfx.speculate(model, draft=args.draft or specfx.Eagle3(args.head), compile=False, **kw)
        for kind, enc in inputs.items():
            out = spec.generate(**enc, **gen)
            same = out.shape == refs[kind].shape and torch.equal(out, refs[kind])
            failures += not same
            st = spec.stats  # this call's
            rows[kind][name] = {"tau": round(st.tokens_per_round, 3), "identical": same,
                                "per_depth": [round(r, 3) for r in st.per_position_rate]}  # fmt: skip
            print(f"{kind:15s} {name:6s} tau {st.tokens_per_round:.2f}  identical={same}", flush=True)
    names = list(settings)
    print("\n| kind | " + " | ".join(f"τ {n}" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for kind, r in rows.items():
        print(f"| {kind} | " + " | ".join(f"{r[n]['tau']:.2f}" for n in names) + " |")
    mean = {n: sum(r[n]["tau"] for r in rows.values()) / len(rows) for n in names}
    print("| mean | " + " | ".join(f"{mean[n]:.2f}" for n in names) + " |")
    result = {
        "command": "python benchmarks/head_tau.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "threads": args.threads, "seconds": round(time.monotonic() - start), "per_kind": rows, "mean": mean,
        "all_identical": failures == 0,
    }  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{'all outputs identical to HF generate()' if not failures else f'{failures} MISMATCHES'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
