"""``specfx bench drafters``: specfx prompt lookup and lookahead against HF prompt lookup and HF greedy.

Run ``specfx bench drafters --help`` for the flags. One run measures, on the same
prompts (batch 1, one after another), the same number of new tokens, greedy, fp32:

    hf_dynamic       target.generate()                                     (the baseline, 1.00x)
    hf_lookup_k{K}   target.generate(prompt_lookup_num_tokens=K, max_matching_ngram_size=N)
    specfx_k{K}      specfx.speculate(target, draft=PromptLookup(max_ngram=N), num_speculative_tokens=K)
    specfx_auto      the same with num_speculative_tokens="auto" (K per round among --auto-values)
    lookahead_W_N_G  specfx.speculate(target, draft=Lookahead(window=W, ngram=N, guesses=G)), one per
                     --lookahead value (none with --lookahead none): the default, "auto" between
                     the tree and K = 0 (decision 68)

specfx generators are compiled (backend "specfx": passes + Inductor) unless ``--no-compile``.

Task: input-grounded code from the Python standard library (offline), the ``edit`` and
``complete`` prompts of :mod:`specfx.bench.stdlib_code`.

Timing and checks are :func:`specfx.bench.harness.bench_end_to_end`'s: warm-up over all prompts
(graphs compile there; every K of "auto" is compiled then too), then interleaved timed
repeats, medians; tokens/s = prompts x new tokens / time; every output is compared token for
token with hf_dynamic's and the command exits with status 1 if one differs. EOS is disabled per call so
every method generates exactly ``--max-new-tokens``.

Acceptance, from an untimed pass over the same prompts:
    specfx  α = accepted / proposed, τ = emitted / rounds (``spec.stats``; the first token,
            from prefill, is not in a round). A row without a match still proposes K tokens.
    HF      counted with a forward pre-hook on the target: every target forward is one round
            (the first also prefills); proposals = tokens fed beyond the one pending token;
            accepted = new tokens - forwards; τ = new tokens / forwards. HF proposes nothing
            when there is no match, so its α counts only rounds with a match.
    fwd/tok target forwards per new token, for every method (prefill included): the cost of
            verification, comparable across methods.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch

from specfx.bench.counters import hf_forwards
from specfx.bench.harness import (
    BASELINE,
    NO_EOS,
    add_run_options,
    bench_end_to_end,
    log,
    n_params,
    run_meta,
    torch_threads,
)
from specfx.bench.stdlib_code import default_target, load_target, pick_functions, task_prompt

__all__ = ["main", "parse_args"]

DESCRIPTION = (
    "Prompt lookup (fixed K and auto) and lookahead decoding against HF's prompt_lookup_num_tokens and\n"
    "HF greedy, on code from the Python standard library (edit: the output copies the prompt;\n"
    "complete: new code)."
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specfx bench drafters", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--target",
        default=default_target(),
        help="a local model directory (safetensors; its tokenizer is used) or 'random' (a random\n"
        "6-layer llama over UTF-8 bytes: nothing copies, so α is meaningless; default: the demo\n"
        "pair's target when present)",
    )
    p.add_argument("--tasks", nargs="+", default=["edit", "complete"], choices=("edit", "complete"))
    p.add_argument("--num-prompts", type=int, default=6, help="prompts per task, each run at batch 1")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="fixed K values (specfx and HF)")
    p.add_argument("--auto-values", type=int, nargs="+", default=[1, 2, 4, 8], help="auto_k_values of specfx_auto")
    p.add_argument("--max-ngram", type=int, default=3, help="PromptLookup max_ngram = HF max_matching_ngram_size")
    p.add_argument(
        "--lookahead",
        nargs="+",
        default=["4,3,2", "8,4,8"],
        help="lookahead configurations W,N,G (window, ngram, guesses), one method each; 'none' for none",
    )
    add_run_options(p, "drafters.json")
    args = p.parse_args(argv)
    try:
        args.lookahead = [] if args.lookahead == ["none"] else [_wng(v) for v in args.lookahead]
    except ValueError:
        p.error(f"--lookahead takes W,N,G triples of ints such as 8,4,8 (or 'none'), got {args.lookahead}")
    args.command = "specfx bench drafters " + " ".join(sys.argv[3:] if argv is None else argv)
    if min(args.num_prompts, args.max_new_tokens, args.repeats, args.threads, *args.ks, *args.auto_values) < 1:
        p.error("--num-prompts, --max-new-tokens, --repeats, --threads, --ks and --auto-values must be >= 1")
    return args


def _wng(text: str) -> tuple[int, int, int]:
    w, n, g = (int(x) for x in text.split(","))
    return w, n, g


# ----------------------------------------------------------------------------- acceptance
def acceptance(args, methods, specs, target, prompts) -> dict:
    """α, τ and forwards per new token of every method, from one untimed pass."""
    out = {}
    n = args.max_new_tokens
    for name, fn in methods.items():
        if name in specs:
            spec = specs[name]
            tot, hist = Counter(), Counter()
            for p in prompts:
                fn(p)
                s = spec.stats
                tot.update(dict(proposed=s.proposed, accepted=s.accepted, emitted=s.emitted, rounds=s.rounds))
                if spec.auto_k is not None:
                    hist.update(spec.auto_k.history)
            out[name] = dict(
                alpha=tot["accepted"] / max(tot["proposed"], 1),
                tau=tot["emitted"] / max(tot["rounds"], 1),
                forwards_per_token=(tot["rounds"] + len(prompts)) / (n * len(prompts)),
                k_histogram=dict(sorted(hist.items())) or None,
            )
        else:
            forwards, proposed = hf_forwards(fn, target, prompts)
            accepted = n * len(prompts) - forwards
            out[name] = dict(
                alpha=accepted / proposed if proposed else None,
                tau=n * len(prompts) / forwards,
                forwards_per_token=forwards / (n * len(prompts)),
                k_histogram=None,
            )
    return out


def build_methods(args, target, bucket: int, pad: int):
    import specfx

    n = args.max_new_tokens
    common = dict(max_new_tokens=n, do_sample=False, pad_token_id=pad, **NO_EOS)
    methods = {BASELINE: lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), **common)}
    for k in args.ks:
        methods[f"hf_lookup_k{k}"] = lambda ids, k=k: target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            prompt_lookup_num_tokens=k,
            max_matching_ngram_size=args.max_ngram,
            **common,
        )
    drafter = specfx.PromptLookup(max_ngram=args.max_ngram)
    options = dict(prefill_buckets=(bucket,), compile=not args.no_compile)
    specs = {}
    for k in args.ks:
        specs[f"specfx_k{k}"] = specfx.speculate(target, draft=drafter, num_speculative_tokens=k, **options)
    specs["specfx_auto"] = specfx.speculate(
        target, draft=drafter, num_speculative_tokens="auto", auto_k_values=tuple(args.auto_values), **options
    )
    for w, ng, g in args.lookahead:
        specs[f"lookahead_{w}_{ng}_{g}"] = specfx.speculate(
            target, draft=specfx.Lookahead(window=w, ngram=ng, guesses=g), **options
        )
    for name, spec in specs.items():
        methods[name] = lambda ids, spec=spec: spec.generate(ids, max_new_tokens=n, pad_token_id=pad, **NO_EOS)
    return methods, specs


def compile_every_k(specs) -> None:
    """Compile the round graph of every K of the auto generators now, not in a timed run.
    A round after a finished call is safe: it does the same work with its writes masked."""
    for spec in specs.values():
        if spec.auto_k is not None and spec.spec_config.compile:
            for k in spec.plan.shapes:  # K = 0 and each K, or K = 0 and the tree (key None)
                with torch.no_grad():  # as in generate(): grad mode is part of the graphs' guards
                    spec.round_fn(k)()


# ----------------------------------------------------------------------------- report
def print_task(task: str, results: dict, acc: dict, ks) -> None:
    print(f"\n## task: {task}\n")
    print(
        "| method | tokens/s | vs HF greedy | vs HF lookup (same K) | τ | α | fwd/tok | K used (auto) | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        if res["status"] != "ok":
            print(f"| {name} | failed: {res['reason'][:80]} | | | | | | | |")
            continue
        a = acc[name]
        k = name.rsplit("_k", 1)[-1] if "_k" in name else None
        peer = results.get(f"hf_lookup_k{k}") if k and not name.startswith("hf_") else None
        vs_peer = f"{peer['median_s'] / res['median_s']:.2f}x" if peer and peer["status"] == "ok" else ""
        alpha = f"{a['alpha']:.2f}" if a["alpha"] is not None else "-"
        hist = ", ".join(f"{kk}:{c}" for kk, c in a["k_histogram"].items()) if a["k_histogram"] else ""
        print(
            f"| {name} | {res['tokens_per_s']:.1f} | {res.get('speedup_vs_hf_dynamic', float('nan')):.2f}x | "
            f"{vs_peer} | {a['tau']:.2f} | {alpha} | {a['forwards_per_token']:.2f} | {hist} | "
            f"{'yes' if res['same_tokens_as_hf_dynamic'] else 'NO'} |"
        )


def main(argv=None) -> int:
    """``specfx bench drafters``: returns 0, or 1 if a method's tokens differ from HF greedy."""
    args = parse_args(argv)
    try:
        target, encode, desc = load_target(args.target)
    except ValueError as e:  # a bad --target: the message says what to pass instead
        raise SystemExit(f"specfx bench drafters: error: {e}") from None
    with torch_threads(args.threads):
        return run(args, target, encode, desc)


def run(args, target, encode, desc: str) -> int:
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    print(f"specfx bench drafters: {desc}; float32, {torch.get_num_threads()} torch thread(s)", flush=True)
    pad = target.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    picked, n_pool = pick_functions(encode, args.fn_tokens, args.num_prompts, args.seed)
    prompts = {
        task: [torch.tensor([encode(task_prompt(task, name, src))]) for _, name, src in picked] for task in args.tasks
    }
    longest = max(p.shape[1] for ps in prompts.values() for p in ps)
    bucket = -(-longest // 64) * 64
    log(f"target: {desc}; {n_pool} functions in held-out stdlib files, using {[f'{f}:{n}' for f, n, _ in picked]}")
    log(
        f"prompt lengths: { {t: [p.shape[1] for p in ps] for t, ps in prompts.items()} } tokens; prefill bucket {bucket}"
    )

    methods, specs = build_methods(args, target, bucket, pad)
    report = {}
    failed = False
    for task, ps in prompts.items():
        log(f"[{task}] warm-up and {args.repeats} timed repeats of {len(methods)} methods ...")
        graphs = {}

        def after_warmup(graphs=graphs):
            compile_every_k(specs)
            graphs.update({n: len(s.graphs) for n, s in specs.items()})

        results = bench_end_to_end(args, methods, ps, after_warmup=after_warmup)
        recompiled = {n: len(s.graphs) - graphs[n] for n, s in specs.items() if len(s.graphs) != graphs[n]}
        acc = acceptance(args, {n: m for n, m in methods.items() if results[n]["status"] == "ok"}, specs, target, ps)
        print_task(task, results, acc, args.ks)
        if recompiled:
            print(f"graphs compiled during the timed runs (should be none): {recompiled}")
        failed |= any(r["status"] == "ok" and not r["same_tokens_as_hf_dynamic"] for r in results.values())
        report[task] = dict(results=results, acceptance=acc, graphs_compiled_during_timing=recompiled)

    meta = dict(
        target=desc,
        target_params=n_params(target),
        functions=[f"{f}:{n}" for f, n, _ in picked],
        prompt_lengths={t: [p.shape[1] for p in ps] for t, ps in prompts.items()},
        max_new_tokens=args.max_new_tokens,
        max_ngram=args.max_ngram,
        auto_values=args.auto_values,
        lookahead=args.lookahead,
        **run_meta(t_start, load_start, args.command),
    )
    m = meta["machine"]
    print(f"\ntarget: {desc}, {meta['target_params'] / 1e6:.2f} M parameters; {m['cpu']}, {m['threads']} thread(s)")
    print(
        f"total {meta['wall_s']:.0f} s; load average {load_start[0]:.2f} at start, {meta['load_avg']['end'][0]:.2f} at end"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(meta=meta, tasks=report), indent=1, default=str))
    print(f"wrote {args.json}")
    if failed:
        print("ERROR: some method's tokens differ from HF greedy", file=sys.stderr)
        return 1
    return 0
