"""The ``specfx`` command: ``specfx demo``, ``specfx bench`` (:mod:`specfx.bench`) and
``specfx train`` (:mod:`specfx.train`).

The ``--help`` texts are :data:`DESCRIPTION` and the argparse help strings: plain text, since
argparse prints them as they are.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import deque
from pathlib import Path

import torch

__all__ = ["main", "demo", "MarkingStreamer", "DESCRIPTION"]

DESCRIPTION = (
    "specfx demo completes held-out code prompts with the shipped demo pair (a small Llama-style "
    "target and a much smaller draft trained on the Python standard library; see "
    "specfx/demo/demo_pair/MODEL_CARD.md), marks the drafted-and-accepted tokens, times HF "
    "generate(), HF assisted generation and specfx on the same prompts, checks that specfx's "
    "greedy output is identical to HF's, and writes a plot. --draft eagle3|eagle|medusa drafts with "
    "the heads shipped for the same target instead (trained with specfx train; MODEL_CARD.md 'Heads'). specfx bench is the benchmark "
    "(specfx bench --help); specfx train trains a Medusa, EAGLE or EAGLE-3 head or a draft model for your own target "
    "(specfx train --help)."
)

ACCEPTED_ON, ACCEPTED_OFF = "\033[1;32m", "\033[0m"  # bold green on a terminal
PLAIN_ON, PLAIN_OFF = "«", "»"


class MarkingStreamer:
    """An HF-style streamer (``put``/``end``) that records which emitted tokens were drafted
    and accepted. specfx puts one token per step, as HF does, and tells this streamer each
    round's emitted count first (``put_round``, batch 1): of a round's n tokens the first n - 1
    are accepted proposals, the last the target's correction or bonus token (prefill's token
    is a round of one). The first put is the prompt."""

    def __init__(self):
        self.tokens: list[tuple[int, bool]] = []  # (token id, drafted and accepted)
        self._puts = 0
        self._marks: deque[bool] = deque()  # the current round's, one per token still to come

    def put_round(self, n_emitted: list[int]) -> None:
        n = n_emitted[0]
        self._marks = deque([True] * (n - 1) + [False])

    def put(self, value: torch.Tensor) -> None:
        self._puts += 1
        if self._puts == 1:
            return  # the prompt
        for t in value.reshape(-1).tolist():
            self.tokens.append((t, self._marks.popleft() if self._marks else False))

    def end(self) -> None:
        pass


def render_marked(tokenizer, tokens: list[tuple[int, bool]], color: bool) -> str:
    """The completion with runs of accepted tokens wrapped in colour (or « »)."""
    on, off = (ACCEPTED_ON, ACCEPTED_OFF) if color else (PLAIN_ON, PLAIN_OFF)
    out, i = [], 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and tokens[j][1] == tokens[i][1]:
            j += 1
        text = tokenizer.decode([t for t, _ in tokens[i:j]])
        out.append(f"{on}{text}{off}" if tokens[i][1] else text)
        i = j
    return "".join(out)


def assisted(target, draft, k: int, ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """HF assisted generation with K constant proposals; the draft's generation_config is
    changed for this call only."""
    from specfx.bench.harness import hf_assisted

    with hf_assisted(target, draft, k) as kw:
        return target.generate(ids, **kw, **kwargs)


def demo(args) -> int:
    """``specfx demo``: see :data:`DESCRIPTION` and ``specfx demo --help``."""
    import specfx
    from specfx.bench.harness import spinner, time_method, torch_threads
    from specfx.bench.plot import acceptance_plot
    from specfx.demo.pair import DEMO_PAIR_DIR, demo_drafter, demo_prompts, load_demo_pair

    device = torch.device(args.device)
    # small forwards are often faster on one thread (README, "Performance notes")
    with torch_threads(args.threads if device.type == "cpu" else None) as threads:
        with spinner("loading the demo pair"):
            target, draft, tok = load_demo_pair(device)
        n_t = sum(p.numel() for p in target.parameters()) / 1e6
        if args.draft == "draft":
            n_d = sum(p.numel() for p in draft.parameters()) / 1e6
            what = f"draft {n_d:.2f} M params"
        else:
            n_d = head_params(DEMO_PAIR_DIR / "heads" / args.draft) / 1e6
            what = f"{args.draft} head {n_d:.2f} M params"
        print(
            f"specfx demo: target {n_t:.1f} M params, {what} (trained on the Python stdlib), "
            f"K = {args.k}, {'sampling' if args.sample else 'greedy'}, {device}, {target.dtype} "
            f"(shipped as float16), {threads} torch thread(s)"
        )
        texts = args.prompt or [p["text"] for p in demo_prompts()[: args.num_prompts]]
        prompts = [tok(t, return_tensors="pt").input_ids.to(device) for t in texts]
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, pad_token_id=tok.pad_token_id)
        if args.sample:
            kw.update(temperature=args.temperature, top_p=0.95)

        def seeded(fn):
            def run(ids):
                torch.manual_seed(args.seed)
                return fn(ids)

            return run

        def drafter():  # a head binds to one generator: a fresh one per speculate()
            return demo_drafter(args.draft, draft)

        try:
            eager = specfx.speculate(target, draft=drafter(), num_speculative_tokens=args.k, compile=False)
        except (ValueError, FileNotFoundError) as e:  # a missing head, or K deeper than Medusa's heads
            raise SystemExit(f"specfx demo: error: {e}") from None
        methods = {"HF generate()": seeded(lambda ids: target.generate(ids, **kw))}
        if args.draft == "draft":  # HF's assisted generation takes a draft model, not these heads
            methods[f"HF assisted (K={args.k})"] = seeded(lambda ids: assisted(target, draft, args.k, ids, kw))
        methods["specfx eager"] = seeded(lambda ids: eager.generate(ids, **kw))
        spec = eager
        if not args.no_compile:
            spec = specfx.speculate(target, draft=drafter(), num_speculative_tokens=args.k, compile=True)
            with spinner("compiling the prefill and round graphs (first call; ~1 min on a small CPU)"):
                spec.generate(prompts[0], **kw)
            methods["specfx compiled"] = seeded(lambda ids: spec.generate(ids, **kw))

        rows, outputs = {}, {}
        for name, fn in methods.items():
            with spinner(f"timing {name}"):
                t, outs = time_method(fn, prompts, args.repeats)
            rows[name] = sum(o.shape[1] - p.shape[1] for o, p in zip(outs, prompts, strict=True)) / t
            outputs[name] = outs
        spec.cumulative_stats = type(spec.stats)()  # the stats below: one marked pass over the prompts

        color = sys.stdout.isatty() and not args.no_color
        mark = f"{ACCEPTED_ON}green{ACCEPTED_OFF}" if color else f"{PLAIN_ON}between these marks{PLAIN_OFF}"
        print(f"\ncompletions (drafted-and-accepted tokens in {mark}):")
        for i, ids in enumerate(prompts):
            streamer = MarkingStreamer()
            torch.manual_seed(args.seed)
            spec.generate(ids, streamer=streamer, **kw)
            print(f"\n--- prompt {i + 1} ---\n{texts[i]}", end="")
            print("" if texts[i].endswith("\n") else "\n", end="")
            print("--- completion ---")
            print(render_marked(tok, streamer.tokens, color))

    base = rows["HF generate()"]
    print(f"\n{'method':<22}{'tokens/s':>10}{'vs HF generate()':>18}")
    for name, tps in rows.items():
        print(f"{name:<22}{tps:>10.1f}{tps / base:>17.2f}x")
    st = spec.cumulative_stats
    print(
        f"\nτ (tokens per round) = {st.tokens_per_round:.2f}, α (acceptance rate) = {st.acceptance_rate:.2f}, K = {args.k}"
    )
    print("acceptance by position: " + ", ".join(f"{r:.2f}" for r in st.per_position_rate))
    ref = outputs["HF generate()"]
    same = all(
        all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
        for name, outs in outputs.items()
        if name.startswith("specfx")
    )
    if args.sample:
        print(
            "sampling: outputs differ from HF's draw by design; the distribution is the target's (tests/lossless/test_lossless.py)"
        )
    else:
        print(f"greedy output identical to HF generate(): {'yes' if same else 'NO'}")
    png = acceptance_plot(
        args.plot,
        {f"specfx K = {args.k}": st.per_position_rate},
        rows,
        f"Speed ({args.max_new_tokens} new tokens, {device})",
    )
    if png is not None:
        print(f"plot: {png.resolve()}")
    return 0 if same or args.sample else 1


def head_params(path: Path) -> int:
    """Parameters stored in a head directory's safetensors files: its floating-point tensors
    (EAGLE-3's integer/boolean vocabulary maps are not parameters)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                t = st.get_slice(key)
                n += math.prod(t.get_shape()) if t.get_dtype() in ("F16", "BF16", "F32", "F64") else 0
    return n


def main(argv=None) -> int:
    """Entry point of the ``specfx`` console script."""
    parser = argparse.ArgumentParser(prog="specfx", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="complete held-out code with the shipped pair; compare with HF")
    d.add_argument("--device", default="cpu", help="torch device (default cpu)")
    d.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: held-out code)")
    d.add_argument("--num-prompts", type=int, default=3, help="held-out prompts to use when no --prompt is given")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--k", type=int, default=4, help="K, proposals per round")
    d.add_argument(
        "--draft",
        default="draft",
        choices=("draft", "eagle3", "eagle", "medusa"),
        help="the drafter: the shipped draft model (default) or a head shipped for the demo target",
    )
    d.add_argument("--sample", action="store_true", help="sample (temperature, top-p 0.95) instead of greedy")
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=2, help="timed runs per method after a warm-up")
    d.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1; the speedup depends on it)")
    d.add_argument("--no-compile", action="store_true", help="eager rounds only (skips the ~1 min compile)")
    d.add_argument("--no-color", action="store_true", help="mark accepted tokens with « » even on a terminal")
    d.add_argument("--plot", type=Path, default=Path("specfx_demo.png"), help="where to write the PNG")
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
    if min(args.k, args.max_new_tokens, args.num_prompts, args.repeats, args.threads) < 1:
        parser.error("--k, --max-new-tokens, --num-prompts, --repeats and --threads must be >= 1")
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
