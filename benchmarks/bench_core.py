"""Core benchmark: specfx against Hugging Face generation on one target/draft pair.

Run ``python benchmarks/bench_core.py --help`` for the flags. One run measures, on the same
prompts (batch 1, one after another) and the same number of new tokens, greedy:

    hf_dynamic          target.generate()                       (DynamicCache, HF's default)
    hf_static           target.generate(cache_implementation="static")
    hf_static_compiled  the same plus a CompileConfig, so HF torch.compiles its decode step
                        (HF auto-compiles only on accelerators; on CPU the config's
                        ``_compile_all_devices`` flag is what turns it on)
    hf_assisted         target.generate(assistant_model=draft) with K constant draft tokens
    specfx_eager        specfx.speculate(target, draft, compile=False).generate()
    specfx_compiled     specfx.speculate(target, draft, compile=True).generate()

Timing: every method is warmed up once over all prompts (this is where graphs compile, with
a message), then the repeats are interleaved (repeat r runs every method once over all
prompts) so that drift of the machine hits all methods alike. A method's time is the
median over repeats of the wall time for all prompts; tokens/s = prompts x new tokens /
that time; speedup = hf_dynamic's time / the method's time. Outputs of every method are
compared token for token with hf_dynamic's (all of them are greedy in fp32, so they must be
equal); the script exits with status 1 if any differs.

HF assisted generation reads ``num_assistant_tokens``, its schedule and
``assistant_confidence_threshold`` from the *assistant's* generation_config (passing
``num_assistant_tokens=`` to ``target.generate()`` sets the target's config, which assisted
generation ignores). So the draft's generation_config gets K, "constant" and threshold 0
(no early stop of a draft run on low confidence), which makes it propose K tokens a round
like specfx. EOS is disabled (``eos_token_id=None``) on both models so that every method
generates exactly ``--max-new-tokens``.

Round overhead (DESIGN.md, "Performance, measured honestly"): overhead = round time /
(K x draft step + 1 target verify), the parts timed separately in the same run, for the
eager generator with eager parts and for the compiled generator with parts compiled by
``torch.compile(backend="inductor", fullgraph=True, dynamic=False)``:

    draft step    ``spec.drafter.runner.forward(ids, pos, pos)``, ids ``[1, 1]``: one
                  1-token draft forward on specfx's static cache (same capacity as in the
                  generate calls above).
    verify        ``spec.target_runner.forward(ids, pos, pos)``, ids ``[1, K+1]``.
    round         ``spec._round_fn()`` called directly, after a generate call has finished.
                  The round is fixed-shape code that does the same work for finished rows
                  (K draft forwards, a (K+1)-token verify, acceptance, bookkeeping); only
                  its writes are masked, so lengths stay put and every buffer index stays
                  in bounds. It is the round as launched, without the host loop.
    round in gen  (time of one generate call - time of its prefill) / rounds of that call:
                  the round plus the host loop (one ``finished.all()`` sync per round) and
                  the final gather, spread over the rounds.

A real round's first draft forward takes 2 tokens (a catch-up of the last committed token),
the other K-1 take 1; that 2-token forward is timed too (``overhead_exact`` in the JSON).
Each part is timed alone, in a loop of itself, so its weights stay hot in the CPU caches;
a round alternates two models. To separate that effect from the machinery's own cost,
``in seq`` times the round's forwards back to back in the round's order (catch-up, K-1
draft steps, verify) with nothing else: round / in seq is the cost of acceptance,
bookkeeping and launching one graph instead of K+1 calls. Parts, in seq and round are
medians of ``--micro-iters`` individually timed calls after warm-up; prefill of
``--micro-iters // 5`` (at least 5); the generate call of ``--repeats`` (at least 3).
The parts write KV at positions past the end of the last generation; a later generate call
rewrites every slot before any query can see it.

On CPU the default is one intra-op thread (``--threads``): on the shared 2-vCPU machine this
was written on, two OpenMP threads made these small forwards no faster and gave outliers
of hundreds of milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig

import specfx
from specfx.models.tiny import perturbed_copy, tiny_causal_lm

try:
    from tqdm.auto import tqdm
except ImportError:  # plain prints instead of a progress bar
    tqdm = None

METHODS = ("hf_dynamic", "hf_static", "hf_static_compiled", "hf_assisted", "specfx_eager", "specfx_compiled")
BASELINE = "hf_dynamic"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--draft",
        choices=("self", "perturbed", "small"),
        default="self",
        help="self: an exact copy of the target (alpha = 1, the machinery's ceiling);\n"
        "perturbed: the target with relative Gaussian noise --noise on every weight;\n"
        "small: an independent random 1-layer model of the same shape and vocabulary",
    )
    p.add_argument("--noise", type=float, default=0.03, help="noise of --draft perturbed")
    p.add_argument("--layers", type=int, default=4, help="target layers")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (target and draft)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2 x hidden)")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    p.add_argument("--k", type=int, default=4, help="K, speculative tokens per round")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts, each run at batch 1")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after the warm-up")
    p.add_argument("--micro-iters", type=int, default=50, help="timed calls per round-overhead part")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: 1 on CPU, untouched elsewhere)"
    )
    p.add_argument(
        "--skip-compiled",
        action="store_true",
        help="skip everything that compiles (hf_static_compiled, specfx_compiled, compiled parts)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "core.json")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    if tqdm is not None:
        tqdm.write(msg)
    else:
        print(msg, flush=True)


def progress(total: int, desc: str):
    if tqdm is not None:
        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)

    class _Plain:  # prints every step instead of drawing a bar
        def __init__(self):
            self.n = 0

        def update(self, k=1):
            self.n += k
            print(f"  {desc}: {self.n}/{total}", flush=True)

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

    return _Plain()


def make_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def median_call_time(fn: Callable[[], object], iters: int, sync: Callable[[], None], warmup: int = 3) -> float:
    """Median seconds of ``iters`` individually timed calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first differing token of two [1, S] sequences (None if equal)."""
    if a.shape == b.shape and torch.equal(a, b):
        return None
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, :n] != b[0, :n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- models
def build_models(args, device: torch.device, dtype: torch.dtype):
    max_positions = 512
    while max_positions < args.prompt_len + args.max_new_tokens + args.k + 2:
        max_positions *= 2
    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 2 * args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_positions=max_positions,
        dtype=dtype,
    )
    target = tiny_causal_lm("llama", num_layers=args.layers, seed=args.seed, **shape)
    if args.draft == "self":
        draft = copy.deepcopy(target)  # same weights, separate module: alpha = 1
    elif args.draft == "perturbed":
        draft = perturbed_copy(target, noise=args.noise, seed=args.seed + 1)
    else:
        draft = tiny_causal_lm("llama", num_layers=1, seed=args.seed + 7, **shape)
    target, draft = target.to(device), draft.to(device)
    for m in (target, draft):
        m.generation_config.eos_token_id = None  # every method generates exactly max_new_tokens
    # Assisted generation reads these from the assistant's config, not from generate()'s kwargs.
    gc = draft.generation_config
    gc.num_assistant_tokens = args.k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    return target, draft


def hf_compile_config(device: torch.device) -> CompileConfig:
    # HF's default mode is "reduce-overhead" (CUDA graphs); there are no CUDA graphs on CPU.
    cc = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else "default")
    cc._compile_all_devices = True  # HF auto-compiles only on accelerators unless this is set
    return cc


def build_methods(args, target, draft, device) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n, k = args.max_new_tokens, args.k
    common = dict(max_new_tokens=n, do_sample=False)
    spec_eager = specfx.speculate(target, draft=draft, num_speculative_tokens=k, compile=False)
    methods = {
        "hf_dynamic": lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), **common),
        "hf_static": lambda ids: target.generate(
            ids, attention_mask=torch.ones_like(ids), cache_implementation="static", **common
        ),
    }
    if not args.skip_compiled:
        cc = hf_compile_config(device)
        methods["hf_static_compiled"] = lambda ids: target.generate(
            ids, attention_mask=torch.ones_like(ids), cache_implementation="static", compile_config=cc, **common
        )
    methods["hf_assisted"] = lambda ids: target.generate(
        ids, attention_mask=torch.ones_like(ids), assistant_model=draft, **common
    )
    methods["specfx_eager"] = lambda ids: spec_eager.generate(ids, max_new_tokens=n)
    specs = {"eager": spec_eager}
    if not args.skip_compiled:
        spec_compiled = specfx.speculate(target, draft=draft, num_speculative_tokens=k, compile=True)
        methods["specfx_compiled"] = lambda ids: spec_compiled.generate(ids, max_new_tokens=n)
        specs["compiled"] = spec_compiled
    return methods, specs


# ----------------------------------------------------------------------------- end to end
def run_all(fn, prompts) -> tuple[float, list[torch.Tensor]]:
    """Seconds for ``fn`` over every prompt (synchronised), and the outputs."""
    sync = make_sync(prompts[0].device)
    sync()
    t0 = time.perf_counter()
    outs = [fn(p) for p in prompts]
    sync()
    return time.perf_counter() - t0, [o.cpu() for o in outs]


def bench_end_to_end(args, methods, prompts, after_warmup: Callable[[], None] = lambda: None) -> dict:
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
    bar = progress(args.repeats * len(live), "timed repeats")
    for r in range(args.repeats):
        for name in live:
            bar.set_postfix_str(f"repeat {r + 1} {name}")
            dt, outs = run_all(methods[name], prompts)
            results[name]["times_s"].append(dt)
            outputs[name] = outs  # the timed run's tokens are the ones compared
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


# ----------------------------------------------------------------------------- round overhead
def bench_round(args, spec, compiled_parts: bool, prompt: torch.Tensor, sync) -> dict:
    """Round time and the parts of the overhead ratio for one generator (see module docstring)."""
    k, iters = args.k, args.micro_iters
    out = {}
    with torch.inference_mode():
        # Prefill alone: state as generate() leaves it, prompt left-padded to its bucket.
        spec.generate(prompt, max_new_tokens=args.max_new_tokens)
        bucket = spec.spec_config.bucket(prompt.shape[1])
        padded = torch.nn.functional.pad(prompt, (bucket - prompt.shape[1], 0))
        out["prefill_ms"] = 1e3 * median_call_time(lambda: spec._prefill_fn(padded), max(5, iters // 5), sync)

        # One whole generate call, then the rounds it ran.
        gen_times = []
        for _ in range(max(3, args.repeats)):
            sync()
            t0 = time.perf_counter()
            spec.generate(prompt, max_new_tokens=args.max_new_tokens)
            sync()
            gen_times.append(time.perf_counter() - t0)
        rounds = spec.stats.rounds
        out["generate_ms"] = 1e3 * statistics.median(gen_times)
        out["rounds_per_generate"] = rounds
        out["round_in_generate_ms"] = (out["generate_ms"] - out["prefill_ms"]) / rounds

        # Rounds launched directly on the finished state (same work, writes masked).
        out["round_ms"] = 1e3 * median_call_time(spec._round_fn, iters, sync)

        # The parts, on the generator's own runners and static caches.
        target, draft = spec.target_runner, spec.drafter.runner
        dev = prompt.device
        start = prompt.shape[1] + args.max_new_tokens + 1  # past everything the generation used
        g = torch.Generator().manual_seed(args.seed)
        tok = torch.randint(3, args.vocab, (1, k + 1), generator=g).to(dev)
        pos_v = (start + torch.arange(k + 1)).unsqueeze(0).to(dev)  # [1, K+1]
        pos_1, pos_2 = pos_v[:, :1].clone(), pos_v[:, :2].clone()  # [1, 1], [1, 2]
        tok_1, tok_2 = tok[:, :1].clone(), tok[:, :2].clone()

        def call(runner):
            def fwd(ids, pos):
                return runner.forward(ids, pos, pos)

            return torch.compile(fwd, backend="inductor", fullgraph=True, dynamic=False) if compiled_parts else fwd

        t_fwd, d_fwd1, d_fwd2 = call(target), call(draft), call(draft)
        out["verify_ms"] = 1e3 * median_call_time(lambda: t_fwd(tok, pos_v), iters, sync)
        out["draft_step_ms"] = 1e3 * median_call_time(lambda: d_fwd1(tok_1, pos_1), iters, sync)
        out["draft_catchup_ms"] = 1e3 * median_call_time(lambda: d_fwd2(tok_2, pos_2), iters, sync)

        def in_sequence():
            # The round's forwards in the round's order, without acceptance or bookkeeping.
            d_fwd2(tok_2, pos_2)
            for _ in range(k - 1):
                d_fwd1(tok_1, pos_1)
            t_fwd(tok, pos_v)

        out["parts_in_sequence_ms"] = 1e3 * median_call_time(in_sequence, iters, sync)

    parts = k * out["draft_step_ms"] + out["verify_ms"]
    exact = out["draft_catchup_ms"] + (k - 1) * out["draft_step_ms"] + out["verify_ms"]
    out["parts_ms"] = parts
    out["overhead"] = out["round_ms"] / parts
    out["overhead_exact"] = out["round_ms"] / exact
    out["overhead_in_generate"] = out["round_in_generate_ms"] / parts
    out["round_over_sequence"] = out["round_ms"] / out["parts_in_sequence_ms"]
    out["parts_compiled"] = compiled_parts
    return out


# ----------------------------------------------------------------------------- report
def print_report(args, meta, results, stats, rounds) -> None:
    print()
    print(
        f"specfx core benchmark: draft={args.draft}, K={args.k}, {args.num_prompts} prompts x "
        f"{args.prompt_len} tokens -> {args.max_new_tokens} new tokens each, greedy, {args.dtype}, {args.device}"
    )
    print(
        f"target: llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} "
        f"({meta['target_params'] / 1e6:.2f} M params); draft: {meta['draft_desc']} "
        f"({meta['draft_params'] / 1e6:.2f} M params)"
    )
    print(f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['threads']} thread(s), {meta['cpu']}")
    print(f"medians of {args.repeats} interleaved repeats after one warm-up\n")

    hdr = f"{'method':<20}{'time (s)':>10}{'tokens/s':>11}{'vs HF dyn':>11}  same tokens as HF greedy"
    print(hdr)
    print("-" * len(hdr))
    for name in METHODS:
        r = results.get(name)
        if r is None:
            print(f"{name:<20}{'(skipped: --skip-compiled)':>32}")
            continue
        if r["status"] != "ok":
            print(f"{name:<20}  not run: {r['reason'][:90]}")
            continue
        same = (
            "yes" if r["same_tokens_as_hf_dynamic"] else f"NO (first diff per prompt: {r['first_mismatch_per_prompt']})"
        )
        print(
            f"{name:<20}{r['median_s']:>10.3f}{r['tokens_per_s']:>11.1f}{r.get('speedup_vs_hf_dynamic', float('nan')):>10.2f}x  {same}"
        )

    print()
    for mode, s in stats.items():
        print(
            f"specfx {mode:<9} alpha (acceptance) = {s['acceptance_rate']:.3f}, tau (tokens/round) = "
            f"{s['tokens_per_round']:.3f}, rounds = {s['rounds']}, per-position accepted = {s['per_position']}"
        )

    if rounds:
        print(f"\nround overhead = round / (K x draft step + verify), K = {args.k}; times in ms")
        hdr = (
            f"{'generator':<10}{'parts':>9}{'draft step':>11}{'catch-up':>9}{'verify':>8}{'K*d+v':>8}"
            f"{'round':>8}{'overhead':>9}{'in seq':>8}{'round/seq':>10}{'round in gen':>13}{'overhead':>9}"
            f"{'prefill':>8}"
        )
        print(hdr)
        print("-" * len(hdr))
        for mode, o in rounds.items():
            if "error" in o:
                print(f"{mode:<10}  not measured: {o['error'][:100]}")
                continue
            print(
                f"{mode:<10}{'inductor' if o['parts_compiled'] else 'eager':>9}{o['draft_step_ms']:>11.3f}"
                f"{o['draft_catchup_ms']:>9.3f}{o['verify_ms']:>8.3f}{o['parts_ms']:>8.3f}{o['round_ms']:>8.3f}"
                f"{o['overhead']:>8.2f}x{o['parts_in_sequence_ms']:>8.3f}{o['round_over_sequence']:>9.2f}x"
                f"{o['round_in_generate_ms']:>13.3f}{o['overhead_in_generate']:>8.2f}x{o['prefill_ms']:>8.3f}"
            )
        print(
            "draft step / catch-up / verify: each forward timed alone, in a loop of itself;\n"
            "in seq: the round's forwards back to back (catch-up, K-1 steps, verify), no acceptance or bookkeeping;\n"
            "round in gen: (generate - prefill) / rounds, i.e. with the host loop"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    sync = make_sync(device)

    target, draft = build_models(args, device, dtype)
    draft_desc = {
        "self": "exact copy of the target",
        "perturbed": f"perturbed copy of the target (noise {args.noise})",
        "small": "independent random 1-layer llama",
    }[args.draft]
    g = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(3, args.vocab, (1, args.prompt_len), generator=g).to(device) for _ in range(args.num_prompts)
    ]
    methods, specs = build_methods(args, target, draft, device)

    t_start = time.perf_counter()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    # Graphs captured by each compiled generator: a count that grows after the warm-up
    # would mean the timed runs recompiled.
    graphs = {mode: {} for mode in specs}

    def count_graphs(when: str) -> None:
        for mode, spec in specs.items():
            graphs[mode][when] = len(spec.graphs)

    results = bench_end_to_end(args, methods, prompts, after_warmup=lambda: count_graphs("after_warmup"))
    count_graphs("after_timed_runs")

    stats = {}
    for mode, spec in specs.items():
        if results[f"specfx_{mode}"]["status"] == "ok":
            # spec.stats is the last generate call; the timed runs all saw the same prompts.
            spec.generate(prompts[0], max_new_tokens=args.max_new_tokens)
            s = spec.stats
            stats[mode] = dict(
                acceptance_rate=s.acceptance_rate,
                tokens_per_round=s.tokens_per_round,
                rounds=s.rounds,
                proposed=s.proposed,
                accepted=s.accepted,
                emitted=s.emitted,
                per_position=s.per_position,
                prompt=0,
            )

    rounds = {}
    for mode, spec in specs.items():
        if mode not in stats:
            continue
        compiled = mode == "compiled"
        if compiled:
            log("[round overhead] compiling the draft-step and verify forwards with inductor ...")
        try:
            rounds[mode] = bench_round(args, spec, compiled, prompts[0], sync)
        except Exception as e:
            rounds[mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
            log(f"[round overhead] {mode}: FAILED: {rounds[mode]['error'][:200]}")

    meta = dict(
        target_params=n_params(target),
        draft_params=n_params(draft),
        draft_desc=draft_desc,
        torch=torch.__version__,
        transformers=transformers.__version__,
        specfx=specfx.__version__,
        python=platform.python_version(),
        cpu=cpu_name(),
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        load_avg_start=load_start,
        load_avg_end=os.getloadavg() if hasattr(os, "getloadavg") else None,
        wall_s=time.perf_counter() - t_start,
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    )
    print_report(args, meta, results, stats, rounds)
    if "compiled" in graphs:
        g = graphs["compiled"]
        print(
            f"specfx_compiled graphs captured: {g['after_warmup']} after the warm-up, "
            f"{g['after_timed_runs']} after the timed runs"
        )
    print(f"\ntotal benchmark time {meta['wall_s']:.0f} s")
    if meta["load_avg_start"] is not None:
        # Other processes on the machine skew every number; the load average shows them.
        start, end = ("/".join(f"{x:.2f}" for x in meta[key]) for key in ("load_avg_start", "load_avg_end"))
        print(f"load average (1/5/15 min): {start} at start, {end} at end, on {meta['cpu_count']} CPUs")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.json.write_text(
        json.dumps(
            dict(
                config=config,
                meta=meta,
                methods=results,
                spec_stats=stats,
                round_overhead=rounds,
                graphs_captured=graphs,
            ),
            indent=2,
        )
    )
    print(f"results written to {args.json}")
    ok = all(r["status"] != "ok" or r["same_tokens_as_hf_dynamic"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
