"""``specfx bench`` (the default task): specfx against Hugging Face generation, side by side in one process.

Run ``specfx bench --help`` for the flags; ``specfx bench drafters`` and ``specfx bench selfspec``
are the other tasks (:mod:`specfx.bench.tasks.drafters`, :mod:`specfx.bench.tasks.selfspec`). Models: the shipped demo pair (default), or local
paths (``--target PATH --draft PATH``), or a named drafter (``--draft prompt_lookup``,
``early_exit:N``, ``mtp``: the string is passed to :func:`specfx.speculate` and mapped to HF's
equivalent). Prompts: the demo pair's held-out code prompts, tokenized with the target's
tokenizer and left-padded into batches. Methods, all greedy, same prompts, same number of new
tokens (EOS disabled per call, ``eos_token_id=None``, so every method generates exactly
``--max-new-tokens``; the models' generation_config is never changed):

    hf_dynamic          target.generate()                       (DynamicCache, HF's default; the baseline)
    hf_static           target.generate(cache_implementation="static")
    hf_static_compiled  the same plus a CompileConfig, so HF torch.compiles its decode step
                        (HF auto-compiles only on accelerators; ``_compile_all_devices`` turns it on on CPU)
    hf_assisted@K       target.generate(assistant_model=draft) with K constant draft tokens a round
                        (or prompt_lookup_num_tokens=K / assistant_early_exit=N / use_mtp=True);
                        batch 1 only: HF refuses assisted generation for batch > 1
    specfx_eager@K      specfx.speculate(target, draft, num_speculative_tokens=K, compile=False)
    specfx_compiled@K   the same with compile=True
    specfx_*@auto       with ``--k ...,auto``: num_speculative_tokens="auto" (K per round among 0, i.e. no
                        speculation, and 1, 2, 4, 8, from measured round times; the Ks it ran and its
                        times are listed under the table)

Timing: every method is warmed up once over all batches (graphs compile here, with a
message), then the repeats are interleaved so drift of the machine hits all methods alike. A
method's time is the median over repeats of the wall time for all batches; tokens/s = new
tokens / that time; speedup = hf_dynamic's time / the method's time. Every output is compared
token for token with hf_dynamic's (greedy fp32 must be equal); the command exits with status 1
if one differs.

HF assisted generation reads ``num_assistant_tokens``, its schedule and
``assistant_confidence_threshold`` from the *assistant's* generation_config (passed to
``target.generate()`` they land in the target's config and are ignored), so K, "constant" and
threshold 0 are set on the draft's config (the target's for early exit) during each call and
restored after it (:func:`specfx.bench.harness.hf_assisted`).

Round overhead (``--round-overhead``; DESIGN.md, "Performance, measured honestly"): for each
specfx method with a draft model, after its timed runs, ``overhead = round / (K x draft step +
verify)``, each part the median of ``--micro-iters`` individually timed calls, measured
separately on the generator's own runners and static caches (at the batch's size):

    round       ``spec.round_fn()()`` launched directly after a generate call has finished (the
                fixed-shape round does the same work for finished rows; only its writes are
                masked): the round as launched, without the host loop
    draft step  one 1-token forward of the draft model
    verify      one (K+1)-token forward of the target

For a compiled generator the parts are compiled too (Inductor, ``fullgraph=True``), so the
ratio is the round machinery's cost over the bare forwards it runs. Each part runs in a loop
of itself (its weights stay hot in the CPU caches; a round alternates two models), so the
ratio is an upper bound on the machinery's own cost. The parts write KV past the end of the
last generation; a later generate call rewrites every slot before any query can see it.

Drafters side by side (``--drafters draft,eagle3,eagle,medusa``, demo target only): the shipped
drafters of the demo target (the draft model and the heads in ``specfx/demo/demo_pair/heads``,
MODEL_CARD.md "Heads"), and any drafter name specfx knows with its argument (``prompt_lookup``,
``pard:DIR``, ``dflash:DIR``, ``eagle3:DIR``: a draft trained by ``specfx train``), each run as
``specfx_eager[NAME]@K`` (and ``specfx_compiled[NAME]@K``; ``@auto`` with ``--k ...,auto``) over
the same prompts, every output checked against hf_dynamic's; a K deeper than the drafter can
propose (Medusa's heads, a DFlash block) is listed as not run. At batch 1 HF's counterpart of a
named drafter that has one runs too (``hf_assisted[prompt_lookup]@K``: prompt_lookup_num_tokens=K),
besides ``hf_assisted@K`` with the demo draft model. ``--skip`` takes a method family
(``specfx_eager``, ``hf_assisted``) or one name. ``--tree-budget N`` adds one tree of N nodes per drafter,
``specfx_eager[NAME]@treeN``: EAGLE-2's dynamic tree (``TokenTree.eagle2(budget=N)``) for the
EAGLE heads, ``TokenTree.medusa(budget=N)`` for Medusa, ``TokenTree.topk(depth=N // 2,
branching=2, budget=N)`` for the draft model (the ``specfx bench trees`` shape). bench.md then
ends with a drafters table: α and τ per drafter and K.

Writes ``--out``/bench.json (config, machine, every time, α/τ/per-position acceptance),
bench.md (the table) and bench.png (speed vs K, acceptance by position).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from specfx.bench.harness import (
    BASELINE,
    first_mismatch,
    log,
    run_batches,
    spinner,
    sync_fn,
    torch_threads,
)
from specfx.bench.plot import acceptance_plot
from specfx.bench.tasks.default_methods import build_methods, load_models, make_batches
from specfx.bench.tasks.default_report import drafters_table, markdown_table
from specfx.engine.background import wait_for_graphs
from specfx.engine.timing import call_times

__all__ = ["main", "parse_args", "run", "load_models", "DESCRIPTION"]

DESCRIPTION = (
    "specfx against Hugging Face generation, side by side in one process (the default task).\n"
    "Other tasks: 'specfx bench drafters --help' (prompt lookup and adaptive K against HF's\n"
    "prompt lookup), 'specfx bench selfspec --help' (early exit and MTP heads against HF's),\n"
    "'specfx bench trees --help' (token trees against chains at the same verification budget)."
)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse ``specfx bench`` arguments; adds ``k_values``, ``batch_values`` and ``skip_set``."""
    p = argparse.ArgumentParser(
        prog="specfx bench", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--target", default=None, help="local model directory, safetensors weights (default: the shipped demo target)"
    )
    p.add_argument(
        "--draft",
        default=None,
        help="local model directory (safetensors), or a named drafter: prompt_lookup, early_exit:N, mtp\n"
        "(default: the shipped demo draft, or prompt_lookup when --target is given)",
    )
    p.add_argument("--k", default="2,4,8", help="comma-separated K values, and/or 'auto' (default 2,4,8)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes, e.g. 1,4,16 (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per batch size (cycled to fill batches)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after the warm-up")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--no-compile", action="store_true", help="skip hf_static_compiled and specfx_compiled")
    p.add_argument("--skip", default="", help="comma-separated methods to skip (e.g. hf_static,hf_assisted)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on CPU, where small models are often faster on one;\n"
        "the speedup over HF depends on it, see README 'Performance notes')",
    )
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="output directory")
    p.add_argument(
        "--round-overhead",
        action="store_true",
        help="also time one round against K draft forwards + 1 target forward of K+1 tokens\n"
        "(specfx methods with a draft model; see the module docstring)",
    )
    p.add_argument("--micro-iters", type=int, default=50, help="timed calls per --round-overhead part (default 50)")
    p.add_argument(
        "--drafters",
        default=None,
        help="comma-separated drafters of the demo target to compare side by side: the shipped\n"
        "draft, eagle3, eagle, medusa (MODEL_CARD.md 'Heads') and/or any drafter name specfx knows,\n"
        "with its argument after a colon: prompt_lookup, pard:DIR, dflash:DIR, eagle3:DIR, ...\n"
        "(not with --target/--draft)",
    )
    p.add_argument(
        "--tree-budget",
        type=int,
        default=0,
        help="with --drafters: also one tree of this many nodes per drafter (module docstring)",
    )
    args = p.parse_args(argv)
    ks = [x.strip() for x in args.k.split(",") if x.strip()]
    args.auto = "auto" in ks
    try:
        args.k_values = sorted({int(x) for x in ks if x != "auto"})
        args.batch_values = sorted({int(x) for x in args.batch_sizes.split(",") if x.strip()})
    except ValueError:
        p.error(
            f"--k takes comma-separated integers or 'auto', --batch-sizes integers; got {args.k!r} and {args.batch_sizes!r}"
        )
    if not (args.k_values or args.auto) or not args.batch_values or min(args.k_values + args.batch_values) < 1:
        p.error("--k needs a positive integer or 'auto', --batch-sizes a positive integer")
    if args.max_new_tokens < 1 or args.num_prompts < 1 or args.repeats < 1 or args.micro_iters < 1:
        p.error("--max-new-tokens, --num-prompts, --repeats and --micro-iters must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    args.skip_set = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.drafter_names = []
    if args.drafters is not None:
        from specfx.demo.pair import DEMO_DRAFTERS
        from specfx.drafters.registry import NAMED_DRAFTERS

        args.drafter_names = list(dict.fromkeys(s.strip() for s in args.drafters.split(",") if s.strip()))
        bad = [d for d in args.drafter_names if d not in DEMO_DRAFTERS and d.partition(":")[0] not in NAMED_DRAFTERS]
        if bad or not args.drafter_names:
            p.error(
                f"--drafters takes a comma-separated list of the shipped {','.join(DEMO_DRAFTERS)} and/or drafter "
                f"names ({', '.join(sorted(NAMED_DRAFTERS))}; an argument after a colon, e.g. pard:DIR), "
                f"got {args.drafters!r}"
            )
        if args.target is not None or args.draft is not None:
            p.error("--drafters compares the demo target's shipped drafters: drop --target/--draft")
    if args.tree_budget < 0 or (args.tree_budget and not args.drafter_names):
        p.error("--tree-budget takes a positive node count, and needs --drafters")
    return args


# ----------------------------------------------------------------------------- round overhead
def round_overhead(spec, k: int, batch: dict, max_new_tokens: int, iters: int, compiled: bool, sync) -> dict:
    """Round time vs K draft steps + 1 verify of K+1 tokens, timed separately (module docstring)."""
    draft = getattr(spec.drafter, "runner", None)
    if draft is None:
        return {"error": f"drafter {type(spec.drafter).__name__} has no draft model to time"}
    target = spec.target_runner

    def median_ms(fn) -> float:
        return 1e3 * statistics.median(call_times(fn, iters, warmup=3, sync=sync))

    with torch.no_grad():
        spec.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)  # state as generate leaves it
        out = {"round_ms": median_ms(spec.round_fn())}
        ids = batch["input_ids"]
        rows, dev = ids.shape[0], ids.device
        start = ids.shape[1] + max_new_tokens + 1  # past every slot the generation used
        pos = (start + torch.arange(k + 1, device=dev)).expand(rows, k + 1).contiguous()  # slot == position
        tok = ids[:, : k + 1].contiguous() if ids.shape[1] > k else torch.zeros_like(pos)
        pos_1, tok_1 = pos[:, :1].contiguous(), tok[:, :1].contiguous()

        def part(runner):
            def fwd(t, p):
                return runner.forward(t, p, p)

            return torch.compile(fwd, backend="inductor", fullgraph=True, dynamic=False) if compiled else fwd

        verify, step = part(target), part(draft)
        out["verify_ms"] = median_ms(lambda: verify(tok, pos))
        out["draft_step_ms"] = median_ms(lambda: step(tok_1, pos_1))
    out["parts_ms"] = k * out["draft_step_ms"] + out["verify_ms"]
    out["overhead"] = out["round_ms"] / out["parts_ms"]
    out["parts_compiled"] = compiled
    return out


# ----------------------------------------------------------------------------- the run
def bench_batch(args, methods, specs, batches, sync) -> dict:
    from tqdm.auto import tqdm

    results = {name: {"status": "ok", "times_s": []} for name in methods}
    outputs: dict[str, list[torch.Tensor]] = {}
    for name, fn in methods.items():
        t0 = time.perf_counter()
        try:
            if "compiled" in name:
                with spinner(f"[warm-up] {name}: compiling (tens of seconds on CPU)"):
                    _, outputs[name] = run_batches(fn, batches, sync)
                    wait_for_graphs()  # compiled in the background (decision 67): ready before timing
            else:
                _, outputs[name] = run_batches(fn, batches, sync)
        except Exception as e:  # a peer that does not run here is reported, not fatal
            results[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500]}
            log(f"[warm-up] {name}: not run ({results[name]['reason'][:160]})")
            continue
        results[name]["warmup_s"] = time.perf_counter() - t0
    live = [n for n in methods if results[n]["status"] == "ok"]
    bar = tqdm(total=args.repeats * len(live), desc="timed repeats", leave=False, file=sys.stderr)
    for r in range(args.repeats):
        for name in live:
            bar.set_postfix_str(f"repeat {r + 1} {name}")
            dt, outputs[name] = run_batches(methods[name], batches, sync)
            results[name]["times_s"].append(dt)
            bar.update(1)
    bar.close()

    new_tokens = args.max_new_tokens * sum(b["input_ids"].shape[0] for b in batches)
    base = outputs.get(BASELINE)
    for name in live:
        res = results[name]
        res["median_s"] = statistics.median(res["times_s"])
        res["tokens_per_s"] = new_tokens / res["median_s"]
        if base is not None:
            mism = [first_mismatch(o, b) for o, b in zip(outputs[name], base, strict=True)]
            res["same_tokens_as_hf_dynamic"] = all(m is None for m in mism)
            res["first_mismatch_per_batch"] = mism
        if name in specs:
            s = specs[name].cumulative_stats  # warm-up and repeats: the same batches each time
            res["stats"] = dict(
                acceptance_rate=s.acceptance_rate,
                tokens_per_round=s.tokens_per_round,
                per_position_rate=s.per_position_rate,
                proposed=s.proposed,
                accepted=s.accepted,
                rounds=s.rounds,
            )
            auto = specs[name].auto_k
            if auto is not None:  # the last call's Ks (one per window) and the round times it chose from
                used = {k: auto.history.count(k) for k in sorted(set(auto.history))}
                res["auto_k"] = dict(
                    windows_per_k=used, round_times_ms={k: 1e3 * t for k, t in (auto.times or {}).items()}
                )
    if BASELINE in live:
        for name in live:
            results[name]["speedup_vs_hf_dynamic"] = results[BASELINE]["median_s"] / results[name]["median_s"]
    if args.round_overhead:
        for name in (n for n in live if n in specs and n.partition("@")[2].isdigit()):
            compiled, k = "compiled" in name, int(name.partition("@")[2])
            wait = spinner(f"[round overhead] {name}: compiling the parts") if compiled else nullcontext()
            try:
                with wait:
                    o = round_overhead(
                        specs[name], k, batches[-1], args.max_new_tokens, args.micro_iters, compiled, sync
                    )
            except Exception as e:  # reported in the table, not fatal
                o = {"error": f"{type(e).__name__}: {e}"[:500]}
            results[name]["round_overhead"] = o
    return results


def main(argv=None) -> int:
    """``specfx bench``: returns 0, or 1 if a method's greedy output differs from HF's."""
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    try:
        target, draft, tok, desc = load_models(args, device, dtype)
    except ValueError as e:  # a bad --target/--draft: the message says what to pass instead
        raise SystemExit(f"specfx bench: error: {e}") from None
    return run(args, target, draft, tok, desc, argv)


def run(args, target, draft, tok, desc: str, argv=None) -> int:
    """Benchmark loaded models (``args`` from :func:`parse_args`); writes ``args.out`` and returns
    the exit status. ``target`` and ``draft`` leave unchanged, generation_config included."""
    import transformers

    import specfx

    device = torch.device(args.device)
    with torch_threads(args.threads or (1 if device.type == "cpu" else None)) as threads:
        print(f"specfx bench: {desc}; {args.dtype}, {device}, {threads} torch thread(s)", flush=True)
        sync = sync_fn(device)
        t_start = time.perf_counter()
        runs = {}
        for batch in args.batch_values:
            log(f"== batch {batch} ==")
            batches = make_batches(tok, target.config.vocab_size, batch, args.num_prompts, device)
            methods, specs = build_methods(args, target, draft, batch, device)
            runs[batch] = bench_batch(args, methods, specs, batches, sync)

    meta = dict(
        models=desc,
        target_params=sum(p.numel() for p in target.parameters()),
        draft=args.draft or ("demo drafters " + ",".join(args.drafter_names) if args.drafter_names else "demo draft"),
        torch=torch.__version__,
        transformers=transformers.__version__,
        specfx=specfx.__version__,
        python=platform.python_version(),
        machine=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        threads=threads,
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        load_avg_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
        wall_s=time.perf_counter() - t_start,
        command="specfx bench " + " ".join(sys.argv[2:] if argv is None else argv),
    )
    config = {
        k: (str(v) if isinstance(v, Path) else sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(dict(config=config, meta=meta, runs=runs), indent=2))
    table = markdown_table(runs)
    if args.drafter_names:
        table += "\n" + drafters_table(runs, args.drafter_names)
    header = (
        f"{desc}; greedy, {args.dtype}, {args.device}, {threads} torch thread(s), {args.max_new_tokens} new tokens, "
        f"torch {meta['torch']}, transformers {meta['transformers']}\n\n`{meta['command']}`\n\n"
    )
    (args.out / "bench.md").write_text(header + table)

    # speed vs K at the smallest batch, acceptance by position per K (eager stats)
    b0 = args.batch_values[0]
    speeds: dict[str, dict] = {}
    per_position = {}
    for name, r in runs[b0].items():
        if r["status"] != "ok":
            continue
        method, _, k = name.partition("@")
        if k.isdigit():
            speeds.setdefault(method, {})[int(k)] = r["tokens_per_s"]
            if "stats" in r and method.startswith("specfx_eager"):
                per_position[f"{method[len('specfx_eager') :]} K = {k}".strip()] = r["stats"]["per_position_rate"]
    for name in ("hf_dynamic", "hf_static", "hf_static_compiled"):
        r = runs[b0].get(name)
        if r and r["status"] == "ok":
            speeds[name] = {k: r["tokens_per_s"] for k in args.k_values}
    png = acceptance_plot(args.out / "bench.png", per_position, speeds, f"Speed vs K (batch {b0})", x_label="K")
    print(header + table)
    print(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}" + (f", {png}" if png else ""))
    ok = all(r.get("same_tokens_as_hf_dynamic", True) for res in runs.values() for r in res.values())
    if not ok:
        print("ERROR: some method's greedy output differs from hf_dynamic's (see bench.json)")
    return 0 if ok else 1
