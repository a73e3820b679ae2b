"""Shared timing and HF-baseline helpers for the specialised benchmark scripts
(``bench_drafters.py``, ``bench_selfspec.py``, ``bench_gpu.py``, ``gpu_plan.py``); a library
module, no command line. The general benchmark is ``specfx bench`` (``specfx/bench.py``),
whose helpers are reused here.

Timing of :func:`bench_end_to_end`: every method is warmed up once over all prompts (graphs
compile here, with a message), then the repeats are interleaved (repeat r runs every method
once over all prompts) so drift of the machine hits all methods alike. A method's time is the
median over repeats of the wall time for all prompts; tokens/s = prompts x new tokens / that
time; speedup = the baseline's time / the method's time. Every output is compared token for
token with the baseline's (``hf_dynamic``).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specfx.bench import BASELINE, first_mismatch, hf_compile_config, log, run_batches
from specfx.bench import sync_fn as make_sync

__all__ = [
    "BASELINE",
    "bench_end_to_end",
    "cpu_name",
    "first_mismatch",
    "hf_compile_config",
    "log",
    "make_sync",
    "n_params",
    "run_all",
]


def n_params(model) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_all(fn, prompts) -> tuple[float, list[torch.Tensor]]:
    """Seconds for ``fn`` over every prompt (synchronised on the prompts' device), and the outputs."""
    return run_batches(fn, prompts, make_sync(prompts[0].device))


def bench_end_to_end(args, methods, prompts, after_warmup: Callable[[], None] = lambda: None) -> dict:
    """Warm-up, ``args.repeats`` interleaved timed repeats and token checks of ``methods``
    (name -> fn(ids [1, S]) -> [1, S + new]) over ``prompts``; per-method result dicts."""
    from tqdm.auto import tqdm

    results = {name: {"status": "ok", "times_s": []} for name in methods}
    outputs: dict[str, list[torch.Tensor]] = {}
    for name, fn in methods.items():
        slow = "compiled" in name
        if slow:
            log(f"[warm-up] {name}: compiling on the first call (tens of seconds on CPU) ...")
        t0 = time.perf_counter()
        try:
            _, outputs[name] = run_all(fn, prompts)
        except Exception as e:  # a peer that does not run here is reported, not fatal
            results[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:500]}
            log(f"[warm-up] {name}: FAILED ({results[name]['reason'][:200]}); skipped")
            continue
        results[name]["warmup_s"] = time.perf_counter() - t0
        if slow:
            log(f"[warm-up] {name}: done in {results[name]['warmup_s']:.1f} s (compile + one pass)")

    after_warmup()
    live = [n for n in methods if results[n]["status"] == "ok"]
    bar = tqdm(total=args.repeats * len(live), desc="timed repeats", leave=False)
    for r in range(args.repeats):
        for name in live:
            bar.set_postfix_str(f"repeat {r + 1} {name}")
            dt, outputs[name] = run_all(methods[name], prompts)  # the timed run's tokens are compared
            results[name]["times_s"].append(dt)
            bar.update(1)
    bar.close()

    new_tokens = args.max_new_tokens * len(prompts)
    base = outputs.get(BASELINE)
    for name in live:
        res = results[name]
        res["median_s"] = statistics.median(res["times_s"])
        res["tokens_per_s"] = new_tokens / res["median_s"]
        mism = [first_mismatch(o, b) for o, b in zip(outputs[name], base, strict=True)] if base is not None else []
        res["same_tokens_as_hf_dynamic"] = base is not None and all(m is None for m in mism)
        res["first_mismatch_per_prompt"] = mism
        res["new_tokens_per_prompt"] = [
            int(o.shape[1] - p.shape[1]) for o, p in zip(outputs[name], prompts, strict=True)
        ]
    if BASELINE in live:
        for name in live:
            results[name]["speedup_vs_hf_dynamic"] = results[BASELINE]["median_s"] / results[name]["median_s"]
    return results
