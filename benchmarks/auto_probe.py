"""Prompt lookup with "auto": probing after K = 0 (decision 48) against a sticky "off", side by side.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/auto_probe.py [specfx bench drafters flags]

The methods, prompts, timing and checks of ``specfx bench drafters`` (the demo target, the
stdlib ``edit`` and ``complete`` prompts, batch 1, greedy, fp32, warm-up then interleaved
repeats, medians, every output compared with HF greedy's), with ``--lookahead none`` and
``--ks 4`` unless given, plus ``specfx_auto_sticky``: the same "auto" generator as
``specfx_auto`` (the default, ``speculate(target, draft=PromptLookup(...))``) with probing
switched off (``spec.auto_k.resumable = False``), i.e. "auto" as it was before probing: once
K = 0 is chosen it stays for the call. Prints the drafters table per task.
"""

from __future__ import annotations

import sys

import torch


def main(argv=None) -> int:
    import specfx
    from specfx.bench import drafters
    from specfx.bench.harness import NO_EOS, bench_end_to_end, log, torch_threads
    from specfx.bench.stdlib_code import load_target, pick_functions, task_prompt

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--lookahead" not in argv:
        argv += ["--lookahead", "none"]
    if "--ks" not in argv:
        argv += ["--ks", "4"]
    args = drafters.parse_args(argv)
    target, encode, desc = load_target(args.target)
    with torch_threads(args.threads):
        pad = target.generation_config.pad_token_id or 0
        picked, _ = pick_functions(encode, args.fn_tokens, args.num_prompts, args.seed)
        prompts = {t: [torch.tensor([encode(task_prompt(t, n, src))]) for _, n, src in picked] for t in args.tasks}
        bucket = -(-max(p.shape[1] for ps in prompts.values() for p in ps) // 64) * 64
        methods, specs = drafters.build_methods(args, target, bucket, pad)
        sticky = specfx.speculate(
            target,
            draft=specfx.PromptLookup(max_ngram=args.max_ngram),
            auto_k_values=tuple(args.auto_values),
            prefill_buckets=(bucket,),
            compile=not args.no_compile,
        )
        sticky.auto_k.resumable = False
        specs["specfx_auto_sticky"] = sticky
        n = args.max_new_tokens
        methods["specfx_auto_sticky"] = lambda ids: sticky.generate(ids, max_new_tokens=n, pad_token_id=pad, **NO_EOS)
        print(f"auto_probe: {desc}; {torch.get_num_threads()} torch thread(s); {args.command}", flush=True)
        failed = False
        for task, ps in prompts.items():
            log(f"[{task}] warm-up and {args.repeats} timed repeats of {len(methods)} methods ...")
            results = bench_end_to_end(args, methods, ps, after_warmup=lambda: drafters.compile_every_k(specs))
            ok = {m: f for m, f in methods.items() if results[m]["status"] == "ok"}
            drafters.print_task(task, results, drafters.acceptance(args, ok, specs, target, ps), args.ks)
            failed |= any(r["status"] == "ok" and not r["same_tokens_as_hf_dynamic"] for r in results.values())
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
