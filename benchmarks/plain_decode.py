"""specfx's plain-decoding path (K = 0) against HF's best plain decoding, side by side.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/plain_decode.py --batch 1 --batch 16 [--calls 5]

The demo target, greedy, fp32, EOS off, left-padded held-out prompts. Per batch size, in one
process: HF ``generate(cache_implementation="static")`` with a ``CompileConfig`` (HF compiles
its decode step; the comparison issue 14 asks for), and ``specfx.speculate(target,
num_speculative_tokens="auto", auto_k_times={0: 1.0, 8: 100.0})`` compiled, whose replayed
round times make "auto" run K = 0 (plain decoding through specfx's round) from the first
round. Both are warmed once (graphs compile), then called ``--calls`` times each, interleaved,
and each keeps its fastest call (load only adds time). Prints tokens/s and specfx / HF, and
checks the tokens are identical. One torch thread.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, action="append", help="batch size (repeatable); default 1 and 16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=5, help="timed calls per method (fastest kept)")
    args = p.parse_args(argv)
    import specfx
    from specfx.bench.harness import NO_EOS, hf_compile_config
    from specfx.bench.tasks.default import make_batches
    from specfx.demo.pair import load_demo_pair

    torch.set_num_threads(1)
    target, _, tok = load_demo_pair(torch.device("cpu"), torch.float32)
    n = args.max_new_tokens
    greedy = dict(max_new_tokens=n, do_sample=False, pad_token_id=target.generation_config.pad_token_id, **NO_EOS)
    cc = hf_compile_config(torch.device("cpu"))
    print("| batch | prompt width | HF static + compile tok/s | specfx K = 0 tok/s | specfx / HF | same tokens |")
    print("|---:|---:|---:|---:|---:|---|")
    for b in args.batch or [1, 16]:
        batch = make_batches(tok, target.config.vocab_size, b, b, torch.device("cpu"))[0]
        spec = specfx.speculate(target, num_speculative_tokens="auto", auto_k_times={0: 1.0, 8: 100.0})
        methods = {
            "hf": lambda batch=batch: target.generate(
                **batch, cache_implementation="static", compile_config=cc, **greedy
            ),
            "specfx": lambda batch=batch, spec=spec: spec.generate(**batch, **greedy),
        }
        outs = {name: fn() for name, fn in methods.items()}  # warm: compile
        best = dict.fromkeys(methods, float("inf"))
        for _ in range(args.calls):
            for name, fn in methods.items():
                start = time.perf_counter()
                outs[name] = fn()
                best[name] = min(best[name], time.perf_counter() - start)
        tokens = b * n
        same = torch.equal(outs["hf"], outs["specfx"])
        width = batch["input_ids"].shape[1]
        print(
            f"| {b} | {width} | {tokens / best['hf']:.1f} | {tokens / best['specfx']:.1f} | "
            f"{best['hf'] / best['specfx']:.2f}× | {'yes' if same else 'NO'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
