"""The ``specfx`` command. ``specfx demo`` speculates a small random pair on this machine and
checks the output against ``model.generate()``.

A trained demo pair comes later; with random weights acceptance is only meaningful for the
draft kinds used here: ``self`` (the target drafts for itself: α = 1, the machinery's
ceiling) and ``perturbed`` (a noisy copy of the target: partial acceptance).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

__all__ = ["main"]


def _timed(fn, repeats: int = 3):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, sorted(times)[len(times) // 2]


def demo(args) -> int:
    import specfx
    from specfx.models.tiny import perturbed_copy, tiny_causal_lm

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    print(f"specfx demo: random Llama-shaped target (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}) on {device}")
    target = tiny_causal_lm(
        "llama", vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
        intermediate_size=2 * args.hidden, num_attention_heads=8, num_key_value_heads=4, max_positions=1024,
        initializer_range=0.1,
    ).to(device)
    draft = target if args.draft == "self" else perturbed_copy(target, 0.02).to(device)
    ids = torch.randint(3, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed)).to(device)
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    rows = []
    ref, t_hf = _timed(lambda: target.generate(ids, **kw))
    rows.append(("HF generate()", t_hf))
    eager = specfx.speculate(target, draft=draft, num_speculative_tokens=args.k, compile=False)
    out_eager, t_eager = _timed(lambda: eager.generate(ids, **kw))
    rows.append(("specfx eager", t_eager))
    results = {"eager": out_eager}
    spec = eager
    if not args.no_compile:
        spec = specfx.speculate(target, draft=draft, num_speculative_tokens=args.k, compile=True)
        print("compiling the prefill and round graphs (first call; ~30-90 s on a small CPU) ...", flush=True)
        t0 = time.perf_counter()
        spec.generate(ids, **kw)
        print(f"  compiled in {time.perf_counter() - t0:.1f} s")
        out_c, t_c = _timed(lambda: spec.generate(ids, **kw))
        rows.append(("specfx compiled", t_c))
        results["compiled"] = out_c

    new = ref.shape[1] - ids.shape[1]
    print(f"\n{'method':<18}{'tokens/s':>10}{'vs HF':>8}")
    for name, t in rows:
        print(f"{name:<18}{new / t:>10.1f}{t_hf / t:>7.2f}x")
    st = spec.stats
    print(f"\nK = {args.k}, draft = {args.draft}: τ (tokens/round) = {st.tokens_per_round:.2f}, α = {st.acceptance_rate:.2f}")
    ok = all(torch.equal(o, ref) for o in results.values())
    print(f"greedy output identical to HF generate(): {'yes' if ok else 'NO'}")
    if not args.no_compile:
        print("\n" + spec.explain())
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specfx", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="speculate a small random pair and compare with HF generate()")
    d.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    d.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.add_argument("--prompt-len", type=int, default=24)
    d.add_argument("--draft", choices=("self", "perturbed"), default="perturbed")
    d.add_argument("--hidden", type=int, default=256)
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--vocab", type=int, default=2048)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-compile", action="store_true", help="eager rounds only (no Inductor compile)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
