"""Helpers shared by every ``specfx bench`` task: timing, token checks, HF's peers, threads.
Single calls are timed with :func:`specfx.engine.timing.call_times`, the one timing helper.

Timing of :func:`bench_end_to_end` (the per-prompt tasks ``drafters`` and ``selfspec``): every
method is warmed up once over all prompts (graphs compile here, with a message), then the
repeats are interleaved (repeat r runs every method once over all prompts) so drift of the
machine hits all methods alike. A method's time is the median over repeats of the wall time
for all prompts; tokens/s = prompts x new tokens / that time; speedup = the baseline's time /
the method's time. Every output is compared token for token with the baseline's
(``hf_dynamic``).

Nothing here changes a model passed in: HF's assisted-generation settings, which HF reads
from the assistant's ``generation_config``, are set only for the duration of one call
(:func:`hf_assisted`), and EOS is disabled per call (``eos_token_id=None``, :data:`NO_EOS`).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from specfx.engine.background import wait_for_graphs

__all__ = [
    "BASELINE",
    "NO_EOS",
    "add_run_options",
    "bench_end_to_end",
    "cpu_name",
    "first_mismatch",
    "hf_assisted",
    "hf_assisted_kwargs",
    "hf_compile_config",
    "log",
    "median_seconds",
    "n_params",
    "run_all",
    "run_batches",
    "run_meta",
    "spinner",
    "sync_fn",
    "time_method",
    "torch_threads",
]

BASELINE = "hf_dynamic"
# generate() kwargs so every method generates exactly max_new_tokens. Passed per call, never set
# on the model: HF's generate() applies call kwargs last, over the model's generation_config.
NO_EOS = {"eos_token_id": None}


@contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run with ``n`` torch intra-op threads (None: leave as is), restored afterwards; yields
    the count in effect. Small forwards are often faster on 1 thread than on several."""
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def log(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)


@contextmanager
def spinner(desc: str):
    """A progress line that counts elapsed seconds while a long step (a compile) runs."""
    from tqdm.auto import tqdm

    bar = tqdm(desc=desc, total=None, bar_format="{desc}: {elapsed} elapsed", file=sys.stderr, leave=True)
    stop = threading.Event()

    interval = 0.5 if sys.stderr.isatty() else 15.0  # a log file gets a line per refresh

    def tick():
        while not stop.wait(interval):
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.close()


def sync_fn(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def run_batches(fn, batches, sync) -> tuple[float, list[torch.Tensor]]:
    """Seconds for ``fn`` over every batch, and the outputs (on CPU)."""
    sync()
    t0 = time.perf_counter()
    outs = [fn(b) for b in batches]
    sync()
    return time.perf_counter() - t0, [o.cpu() for o in outs]


def time_method(fn, batches, repeats: int, sync=lambda: None) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of ``repeats`` runs over all batches after one warm-up run (and the graphs
    it queued compiled: ``specfx.wait_for_graphs``), and the outputs."""
    run_batches(fn, batches, sync)
    wait_for_graphs()
    times, outs = [], []
    for _ in range(repeats):
        dt, outs = run_batches(fn, batches, sync)
        times.append(dt)
    return statistics.median(times), outs


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn()`` after one untimed call (a micro-timing:
    the caller synchronises inside ``fn`` where the device needs it)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first differing column of two ``[B, S]`` outputs (None if equal)."""
    if a.shape == b.shape and torch.equal(a, b):
        return None
    n = min(a.shape[1], b.shape[1])
    diff = (a[:, :n] != b[:, :n]).any(0).nonzero()
    return int(diff[0]) if diff.numel() else n


def hf_compile_config(device: torch.device):
    from transformers import CompileConfig

    # HF's default mode is "reduce-overhead" (CUDA graphs); there are no CUDA graphs on CPU.
    cc = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")
    cc._compile_all_devices = True  # HF auto-compiles only on accelerators unless this is set
    return cc


ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def hf_assisted_kwargs(draft: str, k: int) -> dict:
    """``target.generate()`` kwargs for HF's counterpart of the named drafter ``draft``."""
    name, _, arg = draft.partition(":")
    if name == "prompt_lookup":
        return {"prompt_lookup_num_tokens": k}
    if name == "early_exit":
        return {"assistant_early_exit": int(arg)}
    if name == "mtp":
        return {"use_mtp": True}
    raise ValueError(f"no HF counterpart known for drafter {draft!r}")


@contextmanager
def hf_assisted(target, draft, k: int) -> Iterator[dict]:
    """Yields ``target.generate()`` kwargs for HF's counterpart of specfx's drafter ``draft``
    (a draft model or a drafter name) with K constant proposals a round.

    HF reads K, its schedule and the confidence threshold from the *assistant's*
    generation_config (the draft model's; the target's own for ``early_exit``), not from
    generate()'s arguments, so they are set there for the duration of the block only and
    restored afterwards: the caller's models leave exactly as they came.
    """
    if isinstance(draft, str):
        kwargs = hf_assisted_kwargs(draft, k)
        holder = target if "assistant_early_exit" in kwargs else None
    else:
        kwargs, holder = {"assistant_model": draft}, draft
    if holder is None:
        yield kwargs
        return
    gc = holder.generation_config
    saved = {name: getattr(gc, name) for name in ASSISTANT_SETTINGS}
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = k, "constant", 0.0
    try:
        yield kwargs
    finally:
        for name, value in saved.items():
            setattr(gc, name, value)


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
    return run_batches(fn, prompts, sync_fn(prompts[0].device))


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
            wait_for_graphs()  # compiled in the background (decision 67): ready before timing
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


def add_run_options(p, json_name: str) -> None:
    """The options the per-prompt tasks (``drafters``, ``selfspec``, ``trees``) share, added to
    the argparse parser ``p``; results go to ``bench_results/<json_name>`` by default."""
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fn-tokens", type=int, nargs=2, default=[40, 90], help="min and max tokens of a function")
    p.add_argument(
        "--no-compile", "--eager", dest="no_compile", action="store_true", help="run specfx eagerly (a quick check)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after the warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="which functions are picked")
    p.add_argument("--json", type=Path, default=Path("bench_results") / json_name, help="where to write results")


def run_meta(t_start: float, load_start, command: str) -> dict:
    """What every task's JSON records about its run: versions, machine, load average at start
    (``load_start``, from ``os.getloadavg()``) and now, wall time since ``t_start``
    (``time.perf_counter()``) and the command."""
    import transformers

    import specfx

    return dict(
        versions={m.__name__: m.__version__ for m in (torch, transformers, specfx)}
        | {"python": platform.python_version()},
        machine=dict(cpu=cpu_name(), cpus=os.cpu_count(), threads=torch.get_num_threads()),
        load_avg=dict(start=load_start, end=os.getloadavg()),
        wall_s=time.perf_counter() - t_start,
        command=command,
    )
