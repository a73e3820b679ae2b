"""Tokens/s of drafters with chains and token trees on the demo pair's 12 held-out prompts, against
HF ``generate()`` in the same run (issue 28, session 34).

    PYTHONPATH=. python benchmarks/demo_tree_speed.py --shapes 4,medusa-16 pard:DIR eagle3 prompt_lookup

Each (drafter, shape) is a compiled generator (``speculate()``'s default backend) running that shape
every round (no "auto"); one warm-up pass over the prompts (compiles), then ``--repeats`` timed passes
interleaved with HF ``generate()`` (``specfx.bench.harness.bench_end_to_end``: medians, every output
compared with HF's). 64 new tokens, greedy, EOS kept, one torch thread. Shapes and drafter names as
``benchmarks/demo_block_tau.py``; ``prompt_lookup`` too. Prints one line per generator: × HF and τ.
"""

import argparse
import os
import time

import torch

import specfx
from benchmarks.demo_block_tau import drafter, round_shape
from specfx.bench.harness import BASELINE, bench_end_to_end
from specfx.demo.pair import demo_prompts, load_demo_pair


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafters", nargs="+")
    p.add_argument("--shapes", default="4")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.max_new_tokens = 64
    torch.set_num_threads(1)
    target, draft, tok = load_demo_pair()
    prompts = [tok(q["text"], return_tensors="pt").input_ids for q in demo_prompts()]
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    def call(gen):
        return lambda ids: gen.generate(ids, attention_mask=torch.ones_like(ids), **kw)

    methods, specs = {BASELINE: call(target)}, {}
    for name in args.drafters:
        for shape in args.shapes.split(","):
            d = "prompt_lookup" if name == "prompt_lookup" else drafter(name, draft)
            try:
                spec = specfx.speculate(target, draft=d, **round_shape(shape))
            except ValueError as e:
                print(f"{name} {shape}: refused ({str(e)[:80]}...)", flush=True)
                continue
            key = f"specfx compiled {name} {shape}"
            methods[key], specs[key] = call(spec), spec
    started, load = time.time(), os.getloadavg()[0]
    results = bench_end_to_end(args, methods, prompts)
    print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f}, {time.time() - started:.0f} s", flush=True)
    hf = results[BASELINE]
    print(f"HF generate(): {hf['tokens_per_s']:.1f} tok/s", flush=True)
    for key, spec in specs.items():
        r = results[key]
        if r["status"] != "ok":
            print(f"{key}: {r['reason'][:200]}", flush=True)
            continue
        st = spec.cumulative_stats
        print(
            f"{key}: {r['tokens_per_s']:.1f} tok/s, {r['speedup_vs_hf_dynamic']:.2f}x HF, tau {st.tokens_per_round:.2f}, "
            f"same tokens {r['same_tokens_as_hf_dynamic']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
