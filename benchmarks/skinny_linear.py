"""The skinny_linear pass on the real model (CPU): same run, same prompts, side by side.

SmolLM2-135M-Instruct (float32, one thread), greedy, up to 128 new tokens (EOS kept), batch 1,
the first N prompts of each chat-suite category. Rows:

    HF generate()                 the baseline
    specfx default, BLAS          speculate(model): prompt lookup, "auto" K, every projection through F.linear
    specfx default, skinny        the same with the skinny_linear pass (W @ xᵀ; the default since it landed)
    round times                   each generator's measured t(K) ("auto"'s timings), ms

The "blas" row is made by raising ``skinny_linear.MIN_WEIGHT_ELEMENTS`` for the generator's
compiles (a benchmark switch, not an option). Every specfx output is checked against HF's.

    python benchmarks/skinny_linear.py --num-prompts 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import specfx
import specfx.passes.rewrites.skinny_linear as skinny
from specfx.bench.tasks.suite_prompts import count_new_tokens, load_suite, make_batches
from specfx.demo.smollm2 import load_smollm2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--categories", default=None, help="comma-separated; default all")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_smollm2()
    eos = {model.generation_config.eos_token_id} if isinstance(model.generation_config.eos_token_id, int) else set(
        model.generation_config.eos_token_id or []
    )
    suite = load_suite()
    cats = args.categories.split(",") if args.categories else list(suite)
    specs = {}
    real = skinny.MIN_WEIGHT_ELEMENTS
    for name, threshold in (("skinny", real), ("blas", 1 << 62)):
        skinny.MIN_WEIGHT_ELEMENTS = threshold
        spec = specfx.speculate(model)
        # compile and time every graph "auto" uses now, under this threshold (prompt widths vary: the
        # round graphs do not, the KV capacity may grow once)
        (enc,) = make_batches(tok, [suite[cats[0]][0]], 1, "cpu")
        t0 = time.perf_counter()
        spec.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
        spec.wait_for_graphs()
        print(f"{name}: graphs ready in {time.perf_counter() - t0:.0f} s; round times (ms) "
              f"{ {k: round(v * 1e3, 1) for k, v in spec.auto_k.times.items()} }", flush=True)  # fmt: skip
        specs[name] = spec
    skinny.MIN_WEIGHT_ELEMENTS = real
    totals = {m: [0, 0.0] for m in ("hf", "blas", "skinny")}
    per_cat = {}
    for cat in cats:
        times = {m: [] for m in totals}
        tokens = {}
        for prompt in suite[cat][: args.num_prompts]:
            (enc,) = make_batches(tok, [prompt], 1, "cpu")
            width = enc["input_ids"].shape[1]
            outs = {}
            for _ in range(args.repeats):
                for m in totals:
                    runner = model if m == "hf" else specs[m]
                    fn = lambda runner=runner, enc=enc: runner.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)  # noqa: E731
                    t0 = time.perf_counter()
                    outs[m] = fn()
                    times[m].append(time.perf_counter() - t0)
            for m in ("blas", "skinny"):
                if not torch.equal(outs[m], outs["hf"]):
                    print(f"MISMATCH {cat} {m}", flush=True)
                    return 1
            n = count_new_tokens(outs["hf"], width, eos)
            tokens[prompt.get("id", len(tokens))] = n
            for m in totals:
                totals[m][0] += n * args.repeats
        for m in totals:
            totals[m][1] += sum(times[m])
        med = {m: statistics.median(times[m]) for m in totals}
        per_cat[cat] = med
        print(f"{cat:22s} specfx/HF: blas {med['hf'] / med['blas']:.2f}x  skinny {med['hf'] / med['skinny']:.2f}x  "
              f"(skinny/blas {med['blas'] / med['skinny']:.2f}x; HF {med['hf'] * 1e3:.0f} ms/call)", flush=True)  # fmt: skip
    hf_rate = totals["hf"][0] / totals["hf"][1]
    for m in ("blas", "skinny"):
        rate = totals[m][0] / totals[m][1]
        print(f"all categories: specfx default ({m}) {rate:.1f} tok/s = {rate / hf_rate:.2f}x HF generate() {hf_rate:.1f} tok/s")
    ratios = {m: statistics.mean(per_cat[c]["hf"] / per_cat[c][m] for c in cats) for m in ("blas", "skinny")}
    print(f"mean of per-category ratios: blas {ratios['blas']:.2f}x, skinny {ratios['skinny']:.2f}x; "
          f"threads 1; command: python benchmarks/skinny_linear.py {' '.join(argv or sys.argv[1:])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
