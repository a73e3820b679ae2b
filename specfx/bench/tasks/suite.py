"""``specfx bench suite``: SmolLM2-135M-Instruct on a Spec-Bench-style chat suite, specfx against HF.

Run ``specfx bench suite --help`` for the flags. The prompts are the project's own
(``specfx/bench/prompts/suite.jsonl``, original text): eight categories in the manner of
Spec-Bench -- multi-turn conversation (a list of messages with a previous assistant turn),
translation, summarisation, question answering over a passage, math reasoning,
retrieval-augmented answering over numbered documents, code writing and code editing -- eight
prompts each, rendered with the model's chat template. The model is SmolLM2-135M-Instruct
(:func:`specfx.demo.smollm2.load_smollm2`), float32. Methods, one process, one run:

    hf_dynamic        model.generate()                          (DynamicCache; the baseline)
    hf_prompt_lookup  model.generate(prompt_lookup_num_tokens=10)            (batch 1 only)
    hf_early_exit     model.generate(assistant_early_exit=N), K constant proposals a round
                      (``--early-exit N --early-exit-k K``, default 8 and 3: the fastest of
                      N in {8, 15, 22} x K in {3, HF's default} on two of these prompts; K is
                      set on the model's generation_config for each call only,
                      :func:`specfx.bench.harness.hf_assisted`)             (batch 1 only)
    specfx            specfx.speculate(model): prompt lookup, "auto" K
    specfx[NAME]      specfx.speculate(model, draft=NAME), one per ``--drafters`` name
    specfx[NAME@K]    the same with num_speculative_tokens=K (a fixed K; without @K: "auto")

HF refuses assisted generation at batch > 1: its two speculative methods are "n/a" there.
Each mode of ``--modes`` (greedy; sample: temperature 0.7, ``torch.manual_seed(seed + i)``
before the i-th call of a category, so every repeat draws the same way) runs at each of
``--batch-sizes`` (a category's prompts are left-padded together, B at a time; the last batch
is filled by cycling the category's prompts). EOS is kept: a chat answer ends when the model
says so, and the tokens a row generated (up to and including its EOS) are counted.
specfx's generators are compiled unless ``--no-compile``; each (mode, batch size) gets fresh ones.

Timing: every method is warmed up over every category first (graphs compile there; a specfx
generator first runs the widest batch, since its buffers and live-KV bound only grow and each
growth compiles its graphs again; then ``spec.wait_for_graphs()`` where it has it); then ``--repeats`` interleaved repeats
(repeat r runs category by category and, inside a category, prompt by prompt, every method on
each prompt in turn, so that a change of load mid-category falls on every method). A method's
speed on a category is the median over repeats of tokens generated / seconds. Greedy outputs
are compared token for token with hf_dynamic's (warm-up and every repeat); the command exits
with status 1 if a specfx output differs (an HF peer that differs is reported, not fatal).

The report (:mod:`.suite_report`) gives, per category, the ratio of each specfx method's speed
to hf_dynamic's, to hf_prompt_lookup's and to HF's best speculative option (the faster of
prompt lookup and early exit on that category), τ (tokens per round, ``spec.stats``) and the
mean over categories, with issue 27's batch-1 targets, PASS/FAIL. It writes ``--out``/suite.json
(every time and count), suite.md (the tables) and suite.png (per-category ratio bars; needs
matplotlib). ``--quick`` is a smoke run (1 prompt a category, 8 new tokens, greedy, batch 1,
eager, 1 repeat; 72 s for all eight categories on a busy 2-core machine, ~20 s with two
``--categories``). The prompts are loaded, rendered and batched by :mod:`.suite_prompts`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specfx.bench.harness import BASELINE, first_mismatch, hf_assisted, log, n_params, run_meta, sync_fn, torch_threads
from specfx.bench.tasks.suite_prompts import CATEGORIES, count_new_tokens, load_suite, make_batches, render
from specfx.bench.tasks.suite_report import markdown_report, specfx_differences, suite_plot, summarise
from specfx.engine.stats import SpecStats

__all__ = [
    "CATEGORIES",
    "MODES",
    "count_new_tokens",
    "load_suite",
    "main",
    "make_batches",
    "parse_args",
    "render",
    "run",
]

MODES = ("greedy", "sample")
DESCRIPTION = (
    "SmolLM2-135M-Instruct on the project's Spec-Bench-style chat suite (8 categories x 8 prompts):\n"
    "specfx against HF generate(), HF prompt lookup and HF early exit, greedy and sampling, batch 1\n"
    "and 8, per-category tokens/s ratios, tau and issue 27's batch-1 targets (PASS/FAIL)."
)
QUICK = dict(num_prompts=1, max_new_tokens=8, repeats=1, modes="greedy", batch_sizes="1")  # where not given


def _csv(text: str) -> list[str]:
    return list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))


def parse_args(argv=None) -> argparse.Namespace:
    """Parse ``specfx bench suite`` arguments; adds ``category_list``, ``mode_list``,
    ``batch_values``, ``drafter_list``, ``skip_set`` and ``command``."""
    p = argparse.ArgumentParser(
        prog="specfx bench suite", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated (default: all eight)")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of each category (default all)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (EOS kept: answers may end sooner)")
    p.add_argument("--modes", default=None, help="comma-separated: greedy, sample (default both)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats after the warm-up (default 3)")
    p.add_argument(
        "--drafters",
        default="default",
        help="comma-separated specfx generators: 'default' (specfx.speculate(model)) and/or drafter\n"
        "names passed as draft=NAME, e.g. default,lookahead (default: default); NAME@K fixes K\n"
        "(num_speculative_tokens=K, e.g. pard:DIR@8), else K is 'auto'",
    )
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="HF prompt lookup's K (HF's default 10)")
    p.add_argument("--early-exit", type=int, default=8, help="N of HF's assistant_early_exit=N (default 8)")
    p.add_argument("--early-exit-k", type=int, default=3, help="HF early exit's constant proposals a round (default 3)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of a category's first call")
    p.add_argument("--skip", default="", help="comma-separated methods to skip, e.g. hf_early_exit")
    p.add_argument("--no-compile", action="store_true", help="run specfx eagerly (same tokens, no compile time)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 prompt a category, 8 tokens, greedy, batch 1, eager, 1 repeat\n"
        "(flags given explicitly win: --quick --batch-sizes 1,8)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=Path, default=None, help="a JSONL suite of the same format (default: shipped)")
    p.add_argument("--out", type=Path, default=Path("bench_results") / "suite", help="output directory")
    args = p.parse_args(argv)
    args.command = "specfx bench suite " + " ".join(sys.argv[3:] if argv is None else argv)
    for name, value in (QUICK if args.quick else {}).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.no_compile = args.no_compile or args.quick
    args.max_new_tokens = 128 if args.max_new_tokens is None else args.max_new_tokens
    args.repeats = 3 if args.repeats is None else args.repeats
    args.modes = "greedy,sample" if args.modes is None else args.modes
    args.batch_sizes = "1,8" if args.batch_sizes is None else args.batch_sizes
    args.category_list = _csv(args.categories)
    if not args.category_list or set(args.category_list) - set(CATEGORIES):
        p.error(f"--categories takes a comma-separated subset of {','.join(CATEGORIES)}, got {args.categories!r}")
    args.mode_list = _csv(args.modes)
    if not args.mode_list or set(args.mode_list) - set(MODES):
        p.error(f"--modes takes greedy, sample or greedy,sample, got {args.modes!r}")
    try:
        args.batch_values = sorted({int(x) for x in _csv(args.batch_sizes)})
    except ValueError:
        p.error(f"--batch-sizes takes comma-separated integers such as 1,8, got {args.batch_sizes!r}")
    args.drafter_list = _csv(args.drafters)
    positive = [args.max_new_tokens, args.repeats, args.threads, args.prompt_lookup_num_tokens, args.early_exit_k]
    if not args.batch_values or min(args.batch_values) < 1 or min(positive) < 1 or args.early_exit < 1:
        p.error(
            "--batch-sizes, --max-new-tokens, --repeats, --threads, --prompt-lookup-num-tokens, --early-exit and "
            "--early-exit-k must be >= 1"
        )
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    from specfx.drafters.registry import NAMED_DRAFTERS

    def known(item: str) -> bool:
        name, at, k = item.rpartition("@") if "@" in item else (item, "", "")
        fixed_k = not at or (k.isdigit() and int(k) >= 1)
        return fixed_k and (name == "default" or name.partition(":")[0] in NAMED_DRAFTERS)

    if not args.drafter_list or not all(map(known, args.drafter_list)):
        p.error(
            f"--drafters takes 'default' and/or drafter names ({', '.join(sorted(NAMED_DRAFTERS))}; an argument "
            f"after a colon, e.g. early_exit:8; a fixed K after @, e.g. pard:DIR@8), got {args.drafters!r}"
        )
    if args.temperature <= 0:
        p.error(f"--temperature must be > 0 (greedy is --modes greedy), got {args.temperature}")
    args.skip_set = set(_csv(args.skip))
    return args


# ----------------------------------------------------------------------------- methods
def build_methods(args, model, batch: int, mode: str) -> tuple[dict, dict]:
    """(name -> fn(inputs) -> [B, S + new], name -> specfx generator) for one mode and batch size."""
    import specfx

    kwargs = dict(max_new_tokens=args.max_new_tokens, pad_token_id=model.generation_config.pad_token_id)
    kwargs |= dict(do_sample=True, temperature=args.temperature) if mode == "sample" else dict(do_sample=False)
    methods = {BASELINE: lambda b: model.generate(**b, **kwargs)}
    if batch == 1:  # HF refuses assisted generation at batch > 1: "n/a" in the report
        k_lookup = args.prompt_lookup_num_tokens
        methods["hf_prompt_lookup"] = lambda b: model.generate(**b, prompt_lookup_num_tokens=k_lookup, **kwargs)

        def early_exit(b):
            with hf_assisted(model, f"early_exit:{args.early_exit}", args.early_exit_k) as assisted:
                return model.generate(**b, **assisted, **kwargs)

        methods["hf_early_exit"] = early_exit
    specs = {}
    for drafter in args.drafter_list:
        name = "specfx" if drafter == "default" else f"specfx[{drafter}]"
        drafter, at, k = drafter.rpartition("@") if "@" in drafter else (drafter, "", "")
        draft = None if drafter == "default" else drafter
        fixed = dict(num_speculative_tokens=int(k)) if at else {}  # without @K: speculate()'s default, "auto"
        try:
            spec = specs[name] = specfx.speculate(model, draft=draft, compile=not args.no_compile, **fixed)
        except (ValueError, TypeError) as e:  # a drafter that does not apply is reported as not run
            methods[name] = lambda b, e=e: _raise(e)
            continue
        methods[name] = lambda b, spec=spec: spec.generate(**b, **kwargs)
    skip = {m for m in methods if m in args.skip_set or m.partition("[")[0] in args.skip_set}
    return {m: f for m, f in methods.items() if m not in skip}, {m: s for m, s in specs.items() if m not in skip}


def _raise(e: Exception):
    raise e


# ----------------------------------------------------------------------------- timing
def run_category(fn, batches, sync, seeds, spec=None) -> tuple[float, list[torch.Tensor], SpecStats | None]:
    """Seconds of ``fn`` over ``batches`` (each call timed alone; seeding and stats outside the
    clock), the outputs (on CPU) and, for a specfx generator ``spec``, its merged stats."""
    seconds, outs, stats = 0.0, [], SpecStats() if spec is not None else None
    for b, seed in zip(batches, seeds, strict=True):
        if seed is not None:
            torch.manual_seed(seed)
        sync()
        t0 = time.perf_counter()
        out = fn(b)
        sync()
        seconds += time.perf_counter() - t0
        outs.append(out.cpu())
        if stats is not None:
            stats.merge(spec.stats)
    return seconds, outs, stats


def bench_config(args, methods, specs, batches: dict, mode: str, eos_ids: set[int], sync) -> dict:
    """Warm-up, interleaved repeats and token checks of ``methods`` over ``batches`` (category ->
    batches) in one mode; name -> ``{"status", "graphs_compiled_while_timed", "categories": {...}}``."""
    from tqdm.auto import tqdm

    cats = list(batches)
    seeds = {c: [args.seed + i if mode == "sample" else None for i in range(len(batches[c]))] for c in cats}
    widths = {c: [b["input_ids"].shape[1] for b in batches[c]] for c in cats}
    results = {name: {"status": "ok", "categories": {}} for name in methods}
    reference: dict[str, list[torch.Tensor]] = {}  # hf_dynamic's greedy outputs
    widest = max((b for c in cats for b in batches[c]), key=lambda b: b["input_ids"].shape[1])
    for name, fn in methods.items():
        t0 = time.perf_counter()
        log(f"[{mode}, batch {widest['input_ids'].shape[0]}] warm-up {name} ...")
        try:
            if name in specs:  # buffers and live-KV bound only grow: size them once, compile once
                fn(widest)
            for c in cats:
                _, outs, _ = run_category(fn, batches[c], sync, seeds[c])
                results[name]["categories"][c] = {"times_s": [], "tokens": [], "mismatches": []}
                if name == BASELINE:
                    reference[c] = outs
                elif mode == "greedy" and BASELINE in reference:
                    results[name]["categories"][c]["mismatches"].append(_mismatches(outs, reference[c]))
            wait = getattr(specs.get(name), "wait_for_graphs", None)
            if wait is not None:
                wait()
        except Exception as e:  # a peer that does not run here is reported, not fatal
            results[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500], "categories": {}}
            log(f"  {name}: not run ({results[name]['reason'][:160]})")
            continue
        results[name]["warmup_s"] = time.perf_counter() - t0
    live = [n for n in methods if results[n]["status"] == "ok"]
    compiled = {n: len(specs[n].compile_events) for n in live if n in specs}  # append-only: evictions count too
    bar = tqdm(total=args.repeats * len(cats) * len(live), desc="timed repeats", leave=False, file=sys.stderr)
    for r in range(args.repeats):
        for c in cats:
            # methods interleaved prompt by prompt, so that a change of the machine's load in the
            # middle of a category falls on every method alike
            runs = {name: ([], [], SpecStats() if name in specs else None) for name in live}
            bar.set_postfix_str(f"repeat {r + 1} {c}")
            for i, b in enumerate(batches[c]):
                for name in live:
                    seconds, outs, stats = run_category(methods[name], [b], sync, seeds[c][i : i + 1], specs.get(name))
                    runs[name][0].append(seconds)
                    runs[name][1].extend(outs)
                    if stats is not None:
                        runs[name][2].merge(stats)
            for name in live:
                times, outs, stats = runs[name]
                res = results[name]["categories"][c]
                res["times_s"].append(sum(times))
                res["tokens"].append(sum(count_new_tokens(o, w, eos_ids) for o, w in zip(outs, widths[c], strict=True)))
                if mode == "greedy" and name != BASELINE and c in reference:
                    res["mismatches"].append(_mismatches(outs, reference[c]))
                if stats is not None:
                    res.setdefault("_stats", SpecStats()).merge(stats)
                bar.update(1)
    bar.close()
    for name in live:
        if name in specs:
            events = specs[name].compile_events
            results[name]["graphs_compiled_while_timed"] = len(events) - compiled[name]
            results[name]["compile_s"] = sum(e.seconds for e in events)
            auto = specs[name].auto_k
            if auto is not None and auto.times:  # "auto"'s measured round time per K (K = 0: plain decoding)
                results[name]["round_times_s"] = {str(k): t for k, t in auto.times.items()}
        for res in results[name]["categories"].values():
            _finish(res, mode, compared=name != BASELINE and bool(reference))
    return results


def _mismatches(outs, reference) -> list[int | None]:
    return [first_mismatch(o, ref) for o, ref in zip(outs, reference, strict=True)]


def _finish(res: dict, mode: str, compared: bool) -> None:
    """Medians and the token check of one method on one category, in place."""
    res["tokens_per_s"] = statistics.median(n / t for n, t in zip(res["tokens"], res["times_s"], strict=True))
    res["median_s"] = statistics.median(res["times_s"])
    stats = res.pop("_stats", None)
    if stats is not None:
        res["tau"], res["alpha"], res["rounds"] = stats.tokens_per_round, stats.acceptance_rate, stats.rounds
    if mode == "greedy" and compared:
        firsts = [m for run in res["mismatches"] for m in run if m is not None]
        res["same_tokens_as_hf_dynamic"] = not firsts
        res["first_mismatch"] = min(firsts) if firsts else None
    res.pop("mismatches")


# ----------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    """``specfx bench suite``: returns 0, or 1 if a specfx greedy output differs from HF generate()'s."""
    args = parse_args(argv)
    from specfx.demo.smollm2 import load_smollm2

    try:
        model, tokenizer = load_smollm2(torch.float32, args.device)
    except (OSError, RuntimeError, ImportError) as e:  # offline without the file: the message says what to do
        raise SystemExit(f"specfx bench suite: error: {e}") from None
    with torch_threads(args.threads):
        return run(args, model, tokenizer, "SmolLM2-135M-Instruct")


def run(args, model, tokenizer, desc: str) -> int:
    """Benchmark ``model`` (a chat model with ``tokenizer``'s chat template) on the suite
    (``args`` from :func:`parse_args`); writes ``args.out`` and returns the exit status."""
    t_start, load_start = time.perf_counter(), os.getloadavg()
    suite = load_suite(args.prompts)
    missing = [c for c in args.category_list if c not in suite]
    if missing:
        raise SystemExit(f"specfx bench suite: error: the suite has no prompts in {missing}")
    prompts = {c: suite[c][: args.num_prompts] for c in args.category_list}
    device = torch.device(args.device)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    print(f"specfx bench suite: {desc}, {n_params(model) / 1e6:.1f} M parameters; float32, {device}", flush=True)
    print(f"command: {args.command}")
    print(f"torch threads: {torch.get_num_threads()}; load average at start: {_load(load_start)}", flush=True)
    print(
        f"{sum(map(len, prompts.values()))} prompts in {len(prompts)} categories; modes {args.mode_list}, "
        f"batch sizes {args.batch_values}, {args.max_new_tokens} new tokens at most, {args.repeats} repeat(s), "
        f"specfx {'eager' if args.no_compile else 'compiled'}",
        flush=True,
    )
    sync = sync_fn(device)
    runs: dict[str, dict[str, dict]] = {}
    for mode in args.mode_list:
        for batch in args.batch_values:
            batches = {c: make_batches(tokenizer, ps, batch, device) for c, ps in prompts.items()}
            methods, specs = build_methods(args, model, batch, mode)
            results = bench_config(args, methods, specs, batches, mode, eos_ids, sync)
            runs.setdefault(mode, {})[str(batch)] = dict(methods=results, summary=summarise(results, batch))
            del methods, specs  # the next configuration builds its own generators

    meta = dict(model=desc, params=n_params(model), device=str(device), **run_meta(t_start, load_start, args.command))
    config = {
        k: (str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()
    }
    config["prompt_ids"] = {c: [p["id"] for p in ps] for c, ps in prompts.items()}
    report = markdown_report(runs, args, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "suite.json").write_text(json.dumps(dict(config=config, meta=meta, runs=runs), indent=1))
    (args.out / "suite.md").write_text(report)
    png = suite_plot(args.out / "suite.png", runs)
    print(report)
    print(f"load average at end: {_load(meta['load_avg']['end'])}; total {meta['wall_s']:.0f} s")
    print(f"wrote {args.out / 'suite.json'}, {args.out / 'suite.md'}" + (f", {png}" if png else ""))
    differs = specfx_differences(runs)
    if differs:
        print(f"ERROR: specfx's greedy output differs from HF generate()'s: {'; '.join(differs)}", file=sys.stderr)
    return 1 if differs else 0


def _load(avg) -> str:
    return " ".join(f"{x:.2f}" for x in avg)
