"""Block drafters (PARD, DFlash) against the other drafters on SmolLM2-135M-Instruct (issue 28
item 4): one run, same prompts, greedy, side by side, then where a block drafter's round spends
its time.

Part 1 is ``specfx bench suite`` (:mod:`specfx.bench.tasks.suite`: warm-up, interleaved repeats,
medians, every greedy output checked token for token against HF ``generate()``) over the given
generators: HF ``generate()``, HF prompt lookup (batch 1), and one specfx generator per
``--drafters`` item: ``default`` (prompt lookup, "auto" K), ``NAME:ARG`` (``draft="NAME:ARG"``,
"auto" K) or ``...@K`` (a fixed K). Any drafter name specfx knows works (``dflash:DIR`` for a
DFlash draft). The tables give per category tokens/s ratios to HF ``generate()``
and to HF prompt lookup, τ (tokens per round) and the token check; ``suite.json`` keeps every time.

Part 2, the round's split for each block drafter (``pard:``, ``dflash:``) at each fixed K of the
run: eager forwards of the round's shapes after a prefill of ``--context`` tokens, timed alone
(median of ``--profile-repeats``): the draft's one forward (PARD: over W + K tokens, W = K, its
window, decision 72; DFlash: its whole block over the cached context; logits at K positions), the target's verification over K + 1 tokens, and the target's plain
1-token step. (round = draft + verify) / step is the τ a round needs to pay back against plain
decoding. Then the compiled rounds' times that "auto" measured in part 1 (t(K) per K): a
block drafter's t(K) minus the default's (prompt lookup, whose draft costs next to nothing) is
its draft's cost inside the compiled round, on a quiet machine (each generator measures its
rounds at its own moment: under a changing load the difference is noise; its t(K) / t(0) is not).

Printed first: every generator side by side, one table per batch size (tokens/s over HF
``generate()``'s per category, τ in brackets, the mean, the token check); ``--report-only --out
DIR`` prints it again from an earlier run's ``suite.json``.

    PYTHONPATH=. python benchmarks/block_drafters.py \\
        --drafters default,eagle3:specfx/demo/smollm2_eagle3,pard:$HOME/.cache/specfx/smollm2-pard/pard/head@4,\\
pard:$HOME/.cache/specfx/smollm2-pard/pard/head@8,pard:$HOME/.cache/specfx/smollm2-pard/pard/head@16,\\
pard:$HOME/.cache/specfx/smollm2-pard/pard/head --num-prompts 1 --batch-sizes 1,4 --repeats 1

(the PARD draft: ``benchmarks/smollm2_pard_recipe.py``). One torch thread unless ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from specfx.bench.harness import median_seconds, torch_threads
from specfx.bench.tasks import suite
from specfx.bench.tasks.suite_prompts import load_suite

BLOCK_DRAFTERS = ("pard", "dflash")  # the drafters whose round is one draft forward over a block (part 2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="default", help="comma-separated: default, NAME[:ARG][@K] (see suite --help)")
    p.add_argument("--num-prompts", type=int, default=1, help="the first N prompts of each category (default 1)")
    p.add_argument("--categories", default=",".join(suite.CATEGORIES))
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=256, help="part 2: tokens before the round (default 256)")
    p.add_argument("--profile-repeats", type=int, default=9, help="part 2: timed forwards per shape (median)")
    p.add_argument("--report-only", action="store_true", help="print the tables of an earlier run's --out")
    p.add_argument("--no-compile", action="store_true", help="eager rounds (a smoke run; not for timings)")
    p.add_argument("--out", type=Path, default=Path("bench_results") / "block_drafters")
    return p.parse_args(argv)


def suite_argv(args) -> list[str]:
    return [
        "--drafters", args.drafters, "--num-prompts", str(args.num_prompts), "--categories", args.categories,
        "--batch-sizes", args.batch_sizes, "--max-new-tokens", str(args.max_new_tokens), "--repeats",
        str(args.repeats), "--modes", "greedy", "--skip", "hf_early_exit", "--threads", str(args.threads),
        "--out", str(args.out), *(["--no-compile"] if args.no_compile else []),
    ]  # fmt: skip


def median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def forward_ms(model, context: torch.Tensor, tokens: torch.Tensor, keep: int, repeats: int) -> float:
    """Eager ``model`` over ``tokens [B, n]`` after a cache of ``context [B, P]``, logits at the last ``keep``."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
        p = context.shape[1]
        pos = torch.arange(p, p + tokens.shape[1]).expand(tokens.shape[0], -1)

        def step():
            model(input_ids=tokens, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=keep)
            cache.crop(-tokens.shape[1])

        return median_ms(step, repeats)


def dflash_block_ms(head, model, ctx: torch.Tensor, k: int, repeats: int) -> float:
    """One DFlash draft forward as its round runs it (``DFlash.propose``): the whole block
    (the pending token and ``block_size - 1`` masks, embedded with the target's table) through
    the draft layers over a cached context of ``ctx [B, P]``'s length, then the target's LM head
    at K block positions. The context's keys and values (written by ``observe``, one entry a
    verified token) are random here: their values do not change the time."""
    from specfx.model.cache import SlotCache

    b, p = ctx.shape
    n, h = head.block_size, head.hidden_size
    with torch.no_grad():
        cache = SlotCache(len(head.layers), b, p + n + 1, ctx.device)
        cache.slots = torch.arange(p).expand(b, -1)
        head.write_context(torch.randn(b, p, h), cache.slots, cache)
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        ids = torch.cat([ctx[:, -1:], torch.full((b, n - 1), head.mask_token_id)], 1)
        positions = p + torch.arange(n).expand(b, -1)
        visible = (torch.arange(cache.capacity) < p).expand(b, -1)

        def step():
            out = head.block(embed(ids), positions, cache, visible)
            lm_head(out[:, 1 : 1 + k])

        return median_ms(step, repeats)


def block_profile(args, model, tokenizer, drafters: list[str]) -> list[str]:
    """Part 2: the eager draft / verify / step times of each block drafter at its fixed K."""
    from specfx.drafters.heads.dflash import DFlash
    from specfx.model.load import load_causal_lm

    suite_prompts = load_suite()
    text = " ".join(suite_prompts[c][0]["messages"][-1]["content"] for c in suite_prompts)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : args.context]
    lines = [
        f"round split (eager forwards, context {ids.shape[1]} tokens, median of {args.profile_repeats}; "
        "ms; need τ = (draft + verify) / step)",
        "| drafter | B | K | draft (one forward) | verify (K+1) | step (1) | draft/verify | need τ |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    drafts = {}
    for item in drafters:
        spec, at, k = item.rpartition("@")
        if not at or spec.partition(":")[0] not in BLOCK_DRAFTERS:
            continue
        kind, path = spec.partition(":")[::2]
        k = int(k)
        for b in map(int, args.batch_sizes.split(",")):
            ctx = ids.expand(b, -1)
            if kind == "pard":
                draft = drafts.setdefault(path, load_causal_lm(path).eval())
                mask = int(getattr(draft.config, "pard_token", 0))
                window = torch.cat([ctx[:, -k - 1 :], torch.full((b, k - 1), mask)], 1)  # W = K, pending, K - 1 masks
                d = forward_ms(draft, ctx[:, : -k - 1], window, k, args.profile_repeats)
            else:
                d = dflash_block_ms(drafts.setdefault(path, DFlash(path).head), model, ctx, k, args.profile_repeats)
            v = forward_ms(model, ctx[:, : -k - 1], ctx[:, -k - 1 :], k + 1, args.profile_repeats)
            s = forward_ms(model, ctx[:, :-1], ctx[:, -1:], 1, args.profile_repeats)
            lines.append(f"| {kind} | {b} | {k} | {d:.1f} | {v:.1f} | {s:.1f} | {d / v:.2f} | {(d + v) / s:.2f} |")
    return lines


def compiled_round_times(out: Path) -> list[str]:
    """Part 2b: "auto"'s measured compiled round times t(K) of each generator in ``suite.json``."""
    runs = json.loads((out / "suite.json").read_text())["runs"]
    lines = ['compiled round times measured by "auto" (ms), per generator and batch size:']
    for batch, run in runs.get("greedy", {}).items():
        base = run["methods"].get("specfx", {}).get("round_times_s", {})
        for name, res in run["methods"].items():
            times = res.get("round_times_s")
            if not times:
                continue
            parts = []
            for k, t in sorted(
                times.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)
            ):
                extra = f" ({(t - base[k]) * 1e3:+.1f} vs default)" if name != "specfx" and k in base else ""
                parts.append(f"t({k}) {t * 1e3:.1f}{extra}")
            lines.append(f"  batch {batch} {name}: " + ", ".join(parts))
    return lines


def side_by_side(out: Path) -> list[str]:
    """Every generator of ``suite.json`` in one table per batch size: tokens/s over HF ``generate()``'s
    per category (τ in brackets), their mean, and the token check."""
    runs = json.loads((out / "suite.json").read_text())["runs"]
    lines = []
    for batch, run in runs.get("greedy", {}).items():
        methods = run["methods"]
        hf = {c: r["tokens_per_s"] for c, r in methods[suite.BASELINE]["categories"].items()}
        lines += [
            f"batch {batch}: tokens/s over HF generate()'s (τ), HF generate() tok/s "
            + " ".join(f"{c} {v:.1f}" for c, v in hf.items()),
            "| generator | " + " | ".join(hf) + " | mean | τ mean | same tokens as HF |",
            "|---|" + "---:|" * (len(hf) + 2) + "---|",
        ]
        for name, res in methods.items():
            cats = res.get("categories", {})
            if res.get("status") != "ok" or set(cats) != set(hf):
                lines.append(f"| {name} | not run: {res.get('reason', '?')[:80]} |")
                continue
            ratios = [cats[c]["tokens_per_s"] / hf[c] for c in hf]
            taus = [cats[c].get("tau") for c in hf]
            cells = [f"{r:.2f}x" + (f" ({t:.2f})" if t is not None else "") for r, t in zip(ratios, taus, strict=True)]
            tau = f"{statistics.mean(taus):.2f}" if None not in taus else "-"
            same = (
                "ref"
                if name == suite.BASELINE
                else ("yes" if all(cats[c].get("same_tokens_as_hf_dynamic", True) for c in hf) else "NO")
            )
            lines.append(f"| {name} | {' | '.join(cells)} | **{statistics.mean(ratios):.2f}x** | {tau} | {same} |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:
        print("\n".join(side_by_side(args.out) + compiled_round_times(args.out)))
        return 0
    from specfx.demo.smollm2 import load_smollm2

    command = "python benchmarks/block_drafters.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: {command}\nload average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    sargs = suite.parse_args(suite_argv(args))
    sargs.command = command
    model, tokenizer = load_smollm2(torch.float32, "cpu")
    with torch_threads(args.threads):
        status = suite.run(sargs, model, tokenizer, "SmolLM2-135M-Instruct")
        lines = side_by_side(args.out) + block_profile(args, model, tokenizer, sargs.drafter_list)
        lines += compiled_round_times(args.out)
    print("\n".join(lines))
    print(f"torch threads {args.threads}; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    (args.out / "block_profile.md").write_text("\n".join(lines) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
