"""Where a compiled round's time goes: torch.profiler over warm rounds of the demo pair.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/profile_round.py --batch 1 --k 4 [--k 0]

Builds ``specfx.speculate(demo target, demo draft, num_speculative_tokens=K)`` compiled, runs
one greedy generate call on held-out prompts (the state a generation leaves; K = 0 is the
plain-decoding round "auto" falls back to), then profiles ``--rounds`` calls of
``spec.round_fn()`` (the fixed-shape round keeps doing its work for finished rows) and prints
the ops by self CPU time, grouped: the target's and draft's matrix products, attention,
Inductor's fused kernels, and the rest, each as a share of the round. One torch thread.
"""

from __future__ import annotations

import argparse
import collections

import torch

GROUPS = (  # (label, substrings of a profiler event name), first match wins
    ("matmul (mm/addmm/bmm/linear)", ("mm", "linear", "matmul")),
    ("attention (sdpa)", ("scaled_dot_product", "_flash", "attention")),
    ("Inductor fused kernels", ("cpp_fused", "triton_", "kernel_cpp")),
    ("copies/index/scatter", ("copy", "index", "scatter", "gather", "cat")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for label, keys in GROUPS:
        if any(k in low for k in keys):
            return label
    return "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, action="append", help="K (repeatable; 0 = plain decoding); default 4")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=12, help="individual ops listed per K")
    args = p.parse_args(argv)
    import specfx
    from specfx.bench.tasks.default import make_batches
    from specfx.demo.pair import load_demo_pair

    torch.set_num_threads(1)
    target, draft, tok = load_demo_pair(torch.device("cpu"), torch.float32)
    batch = make_batches(tok, target.config.vocab_size, args.batch, args.batch, torch.device("cpu"))[0]
    for k in args.k or [4]:
        spec = specfx.speculate(target, draft=draft, num_speculative_tokens=max(k, 1), compile=True)
        spec.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None)
        fn = spec.round_fn(k=k)
        for _ in range(5):
            fn()  # compile (K = 0 is a graph of its own) and warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.rounds):
                fn()
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events)
        per_round_ms = total / args.rounds / 1e3
        print(f"\n== batch {args.batch}, K = {k}: {per_round_ms:.3f} ms of profiled CPU time per round ==")
        groups: dict[str, float] = collections.defaultdict(float)
        for e in events:
            groups[group_of(e.key)] += e.self_cpu_time_total
        for label, t in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {label:32s} {100 * t / total:5.1f} %  {t / args.rounds / 1e3:7.3f} ms/round")
        print(f"  top {args.top} ops by self CPU time:")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
            print(f"    {e.key[:60]:60s} {100 * e.self_cpu_time_total / total:5.1f} %  calls/round {e.count / args.rounds:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
