"""Lookahead's default ("auto": the tree or K = 0 per window, decision 68) against specfx's own
K = 0 round and HF greedy, on SmolLM2-135M-Instruct (issue 27, item 5).

    PYTHONPATH=. python benchmarks/lookahead_auto.py [--repeats 3] [--max-new-tokens 128]
        [--sweep 2,2,1 3,2,2 4,3,2 ...] [--json out.json]

One process, one torch thread, float32, greedy, batch 1: four chat prompts through the model's
chat template, one after another, EOS off (every call generates exactly --max-new-tokens).

    hf                model.generate()
    k0                specfx.speculate(model, num_speculative_tokens="auto", auto_k_times={0: 1.0, 8: 100.0}):
                      no K can pay on those times, so every round is K = 0 (specfx's plain decoding)
    lookahead         specfx.speculate(model, draft="lookahead"): the default, "auto" (tree or K = 0)
    lookahead_pinned  the same with num_speculative_tokens=4 (its node count): the tree every round,
                      what the default was before decision 68

specfx generators are compiled (backend "specfx"). Warm-up: every method once over the prompts
(graphs compile; "auto" times its rounds), then ``spec.wait_for_graphs()`` where it exists; then
--repeats passes, each timing every method over all prompts in turn (interleaved, so load drifts
over every method alike). tokens/s = prompts x tokens / a method's median total; every output is
compared token for token with hf's. Prints the load average before and after.

``--sweep W,N,G ...``: lookahead's sizes on this CPU. Per triple: τ of its tree run every round
(eager: the same tokens and counts as compiled), and the compiled round times t(0) and t(tree)
that "auto" measures; the tree pays where τ · t(0) / t(tree) > 1 (the predicted speed over K = 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, with an example in Python.",
    "List ten tips for staying productive when working from home.",
    "What are the main differences between TCP and UDP?",
]


def chat_inputs(tok) -> list[torch.Tensor]:
    """``[1, S]`` input ids of each prompt as a user turn, with the assistant's turn opened."""
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        out.append(ids if isinstance(ids, torch.Tensor) else ids["input_ids"])  # a BatchEncoding in transformers 5
    return out


def tree_share(spec) -> str:
    history = spec.auto_k.history
    return f"{sum(k is None for k in history)}/{len(history)}"


def sweep(model, prompts, triples, greedy, c) -> list[dict]:
    """τ (tree every round, eager) and compiled t(0), t(tree) per lookahead size."""
    import specfx

    rows = []
    for w, n, g in triples:
        name = f"lookahead:{w},{n},{g}"
        # the tree every window: it pays on these times whatever τ is (an int K cannot pin more than 16 nodes)
        eager = specfx.speculate(model, draft=name, auto_k_times={0: 1.0, None: 1e-3}, compile=False)
        emitted = rounds = 0
        for ids in prompts:
            eager.generate(ids, attention_mask=torch.ones_like(ids), **greedy)
            emitted, rounds = emitted + eager.stats.emitted, rounds + eager.stats.rounds
        compiled = specfx.speculate(model, draft=name, **c)
        start = time.perf_counter()
        compiled.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), **greedy)  # compiles K = 0 and the tree, and times both
        wait = getattr(compiled, "wait_for_graphs", None)
        if wait is not None:
            wait()
        t = compiled.auto_k.times
        tau = emitted / rounds
        row = dict(config=(w, n, g), nodes=g * (n - 1), forward=1 + g * (n - 1) + (n - 1) * w - 1, tau=tau,
                   t0_ms=1e3 * t[0], tree_ms=1e3 * t[None], ratio=t[None] / t[0], predicted=tau * t[0] / t[None],
                   setup_s=time.perf_counter() - start)  # fmt: skip
        print(f"  sweep {name}: τ {tau:.3f}, t(tree)/t(0) {row['ratio']:.2f}, predicted {row['predicted']:.2f}x K = 0")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sweep", nargs="*", default=[], help="lookahead sizes W,N,G to sweep (see above)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-compile", action="store_true", help="eager rounds (a quick check of the script)")
    args = p.parse_args(argv)
    import specfx
    from specfx.demo.smollm2 import load_smollm2

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    model, tok = load_smollm2(torch.float32, "cpu")
    prompts = chat_inputs(tok)
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)  # fmt: skip
    c = dict(compile=not args.no_compile)
    specs = {
        "k0": specfx.speculate(model, num_speculative_tokens="auto", auto_k_times={0: 1.0, 8: 100.0}, **c),
        "lookahead": specfx.speculate(model, draft="lookahead", **c),
        "lookahead_pinned": specfx.speculate(model, draft="lookahead", num_speculative_tokens=4, **c),
    }
    methods = {"hf": lambda ids: model.generate(ids, attention_mask=torch.ones_like(ids), **greedy)}
    for name, spec in specs.items():
        methods[name] = lambda ids, spec=spec: spec.generate(ids, attention_mask=torch.ones_like(ids), **greedy)

    expected, outs, setup = {}, {}, {}
    history = {}
    for name, fn in methods.items():  # warm-up: compiles, and "auto" times its rounds
        start = time.perf_counter()
        outs[name] = [fn(ids) for ids in prompts]
        if name in specs and getattr(specs[name], "wait_for_graphs", None) is not None:
            specs[name].wait_for_graphs()
        setup[name] = time.perf_counter() - start
        print(f"warm-up {name}: {setup[name]:.1f} s", flush=True)
    expected = outs["hf"]
    totals = {name: [] for name in methods}
    for r in range(args.repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            got, shares = [], []
            for ids in prompts:
                got.append(fn(ids))
                if name == "lookahead":
                    shares.append(tree_share(specs[name]))
            totals[name].append(time.perf_counter() - start)
            outs[name] = got
            if shares:
                history[r] = shares
        print(f"repeat {r}: " + ", ".join(f"{n} {totals[n][-1]:.2f} s" for n in methods), flush=True)
    load_after = os.getloadavg()
    tokens = len(prompts) * args.max_new_tokens
    same = {name: all(torch.equal(a, b) for a, b in zip(outs[name], expected, strict=True)) for name in methods}
    speed = {name: tokens / statistics.median(totals[name]) for name in methods}
    print(f"\nload average before {load_before}, after {load_after}; {os.cpu_count()} CPUs, 1 torch thread")
    print(f"lookahead's auto times {specs['lookahead'].auto_k.times}; tree windows per prompt {history}")
    print("| method | tok/s (median of totals) | x K = 0 | x HF | fastest total s | same tokens as HF |")
    print("|---|---:|---:|---:|---:|---|")
    for name in methods:
        print(f"| {name} | {speed[name]:.1f} | {speed[name] / speed['k0']:.2f} | {speed[name] / speed['hf']:.2f} | "
              f"{min(totals[name]):.2f} | {same[name]} |")  # fmt: skip
    rows = sweep(model, prompts, [tuple(int(x) for x in s.split(",")) for s in args.sweep], greedy, c)
    if rows:
        print("\n| W,N,G | nodes | forward tokens | τ (tree every round) | t(0) ms | t(tree) ms | t(tree)/t(0) | τ·t(0)/t(tree) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {','.join(map(str, r['config']))} | {r['nodes']} | {r['forward']} | {r['tau']:.3f} | {r['t0_ms']:.1f} | "
                  f"{r['tree_ms']:.1f} | {r['ratio']:.2f} | {r['predicted']:.2f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(load_before=load_before, load_after=load_after, totals=totals, tokens_per_s=speed,
                           same=same, setup_s=setup, auto_times={str(k): v for k, v in specs["lookahead"].auto_k.times.items()},
                           tree_windows=history, sweep=rows), f, indent=1)  # fmt: skip
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
