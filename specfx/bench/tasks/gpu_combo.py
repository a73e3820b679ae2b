"""One combination (pair, batch, context) of the GPU benchmark (:mod:`specfx.bench.tasks.gpu`):
every method warmed up and timed on the same prompts, its tokens compared with HF's, the round
overhead timed in parts, and the bandwidth floor of each method."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import torch

import specfx
from specfx.bench.floor import (
    decode_floor_seconds,
    device_time,
    forward_bytes,
    fraction_of_floor,
    ideal_tokens_per_s,
    round_floor_seconds,
)
from specfx.bench.harness import first_mismatch, hf_compile_config, log, run_all, sync_fn
from specfx.bench.oracle import OracleDrafter, greedy_continuation
from specfx.bench.tasks.gpu_plan import FAMILIES, OVERHEAD_FAMILIES, auto_ks, family, method_rows
from specfx.bench.tasks.gpu_report import fmt
from specfx.config import SpecConfig
from specfx.passes.backend import make_backend

__all__ = ["Combo", "make_spec", "stats_dict"]

BASELINE = "hf_static_compiled"  # speedups are against HF's best plain decode
REFERENCE = "hf_dynamic"  # tokens are compared with HF's default generate()


def row_agreement(out: torch.Tensor, ref: torch.Tensor) -> list[int | None]:
    """First differing index per row (None where the row is identical)."""
    return [first_mismatch(out[i : i + 1], ref[i : i + 1]) for i in range(out.shape[0])]


def stats_dict(stats, k: int) -> dict:
    row_rounds = getattr(stats, "row_rounds", 0) or stats.proposed / k
    return dict(
        acceptance_rate=stats.acceptance_rate,
        tau=stats.emitted / row_rounds if row_rounds else 0.0,
        rounds=stats.rounds,
        proposed=stats.proposed,
        accepted=stats.accepted,
        emitted=stats.emitted,
        per_position=list(stats.per_position),
    )


def busy_in_window(kernels: list[tuple[float, float]], start: float) -> dict:
    """Device time covered by ``kernels`` ((start, end) pairs, µs) from the first kernel that
    starts at or after ``start`` to the last one's end: the busy fraction and the idle gaps."""
    kernels = sorted(k for k in kernels if k[0] >= start)
    busy, gaps, end = 0.0, [], None
    for s, t in kernels:
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    span = (end - kernels[0][0]) if kernels else 0.0
    gaps.sort(reverse=True)
    return dict(
        kernels=len(kernels),
        span_ms=round(span / 1e3, 3),
        busy_ms=round(busy / 1e3, 3),
        busy_fraction=round(busy / span, 4) if span else None,
        gaps_over_20us=sum(1 for g in gaps if g > 20),
        idle_ms=round(sum(gaps) / 1e3, 3),
        largest_gaps_us=[round(g, 1) for g in gaps[:5]],
    )


def profile_decode(fn, spec, device: torch.device) -> dict:
    """One warm ``fn()`` call under torch.profiler: the device's busy fraction in the decode
    loop (from the first round's CUDA-graph launch on; prefill excluded), launches per round,
    the call's wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = sync_fn(device)
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    events = list(prof.events())
    launches = sorted(e.time_range.start for e in events if e.name == "cudaGraphLaunch")
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    out = dict(wall_ms=round(1e3 * wall, 2), rounds=spec.stats.rounds, graph_launches=len(launches))
    if kernels:
        out.update(busy_in_window(kernels, launches[0] if launches else min(k[0] for k in kernels)))
        if out["rounds"]:
            out["device_ms_per_round"] = round(out["busy_ms"] / out["rounds"], 4)
            out["span_ms_per_round"] = round(out["span_ms"] / out["rounds"], 4)
    return out


def round_callable(spec):
    """The generator's compiled round for its (fixed) K."""
    return spec.round_fn()


def make_spec(target, draft, args, ctx: int, auto: bool = False):
    """A compiled generator fitted to the combination; ``auto``: num_speculative_tokens="auto"
    among K = 0 and ``args.auto_k_values`` (each K a round graph, compiled and timed in the first call)."""
    values = getattr(args, "auto_k_values", None) or SpecConfig.auto_k_values  # (benchmarks/ pass a namespace)
    needed = ctx + args.new_tokens + max(args.k, *values) + 2
    spec = specfx.speculate(
        target,
        draft=draft,
        num_speculative_tokens="auto" if auto else args.k,
        auto_k_values=values,
        compile=True,
        backend=args.backend,
        prefill_buckets=(ctx,),
        min_capacity=-(-needed // 64) * 64,
        rounds_per_sync=args.rounds_per_sync,
        # HF compiles only its decode step too; a prefill graph per context costs compile time
        compile_prefill=args.compile_prefill,
        live_kv=not getattr(args, "no_live_kv", False),
        # Inductor settings only where Inductor compiles (--smoke's specfx_eager does not)
        inductor_options=(getattr(args, "inductor_options", None) or None) if args.backend == "specfx" else None,
    )
    return spec


class Combo:
    """Everything measured for one (pair, batch, context)."""

    def __init__(self, args, target, draft, pair, batch, ctx, bandwidth, predicted, deadline):
        self.args, self.target, self.draft = args, target, draft
        self.pair, self.batch, self.ctx = pair, batch, ctx
        self.bandwidth, self.predicted, self.deadline = bandwidth, predicted, deadline
        self.sync = sync_fn(torch.device(args.device))
        self.specs: dict[str, object] = {}
        self.stats: dict[str, dict] = {}
        self.results: dict[str, dict] = {}

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def build_methods(self, ids):
        args, target, draft, n, k = self.args, self.target, self.draft, self.args.new_tokens, self.args.k
        mask = torch.ones_like(ids)
        common = dict(attention_mask=mask, max_new_tokens=n, do_sample=False)
        fns = {}
        rows = method_rows(args, self.batch)
        if "hf_dynamic" in rows:
            fns["hf_dynamic"] = lambda x: target.generate(x, **common)
        if "hf_static_compiled" in rows:
            cc = hf_compile_config(torch.device(args.device))
            if args.backend == "specfx_eager":
                cc.backend = "eager"  # capture without Inductor, like specfx_eager
            elif getattr(args, "inductor_options", None):
                # the same tuning as specfx's graphs; torch.compile takes a mode or options, not both:
                # "reduce-overhead" is Inductor's CUDA graphs
                cc.options = dict(args.inductor_options)
                if cc.mode == "reduce-overhead":
                    cc.options["triton.cudagraphs"] = True
                cc.mode = None
            fns["hf_static_compiled"] = lambda x: target.generate(
                x, cache_implementation="static", compile_config=cc, **common
            )

        def spec_fn(name, spec, before=None):
            def fn(x):
                if before is not None:
                    before()
                out = spec.generate(x, attention_mask=mask, max_new_tokens=n)
                self.stats[name] = stats_dict(spec.stats, k)
                if spec.auto_k is not None:  # the call's K per window and the round times it chose from
                    hist = spec.auto_k.history
                    self.stats[name]["auto_k"] = dict(
                        windows_per_k={kk: hist.count(kk) for kk in sorted(set(hist))},
                        round_times_ms={kk: 1e3 * t for kk, t in (spec.auto_k.times or {}).items()},
                    )
                return out

            return fn

        if any(family(r) in FAMILIES for r in rows):
            reach = n + max(auto_ks(args) + (k,)) + 1  # the last round's proposals reach K past the end
            log(f"[{self.label}] oracle reference: target's greedy continuation ({reach} tokens)")
            reference = greedy_continuation(target, ids, mask, new_tokens=reach)
        for fam, alphas in (("specfx_oracle", args.alphas), ("specfx_auto_oracle", args.auto_alphas)):
            fam_rows = [r for r in rows if family(r) == fam]
            if fam_rows:  # one generator per family, alpha changed in place
                oracle = OracleDrafter(alphas[0], reference)
                spec = self.specs[fam] = make_spec(target, oracle, args, self.ctx, auto=fam == "specfx_auto_oracle")
                for row, alpha in zip(fam_rows, alphas, strict=True):
                    fns[row] = spec_fn(row, spec, functools.partial(oracle.set_alpha, alpha))
        for name, auto in (("specfx_draft", False), ("specfx_auto", True)):
            if name in rows:
                self.specs[name] = make_spec(target, draft, args, self.ctx, auto=auto)
                fns[name] = spec_fn(name, self.specs[name])
        if "hf_assisted" in rows:
            gc_ = draft.generation_config  # assisted generation reads K from the assistant's config
            gc_.num_assistant_tokens, gc_.num_assistant_tokens_schedule = k, "constant"
            gc_.assistant_confidence_threshold = 0.0
            fns["hf_assisted"] = lambda x: target.generate(x, assistant_model=draft, **common)
        if "specfx_self" in rows:
            self.specs["specfx_self"] = make_spec(target, target, args, self.ctx)
            fns["specfx_self"] = spec_fn("specfx_self", self.specs["specfx_self"])
        return fns

    @property
    def label(self) -> str:
        return f"{self.pair} B={self.batch} ctx={self.ctx}"

    def run(self, checkpoint=lambda partial: None) -> dict:
        """Measure every method; ``checkpoint`` gets the result before the round-overhead
        step (so a run killed at its time limit keeps the end-to-end numbers)."""
        args = self.args
        g = torch.Generator().manual_seed(args.seed + self.batch * 7919 + self.ctx)
        vocab = self.target.config.vocab_size
        ids = torch.randint(3, vocab, (self.batch, self.ctx), generator=g).to(args.device)
        fns = self.build_methods(ids)
        self._ids = ids
        outputs = {}
        for name, fn in fns.items():
            compile_s, call_s = self.predicted.get(name, (0.0, 0.0))
            if self.time_left() < compile_s + call_s:
                self.results[name] = {
                    "status": "skipped",
                    "reason": f"budget: predicted {compile_s + call_s:.0f} s, {self.time_left():.0f} s left",
                }
                log(f"[{self.label}] {name}: skipped (budget)")
                continue
            log(f"[{self.label}] warm-up {name} (predicted compile {compile_s:.0f} s) ...")
            t0 = time.perf_counter()
            try:
                _, outs = run_all(fn, [ids])
            except Exception as e:  # a method that fails here is reported, not fatal
                self.results[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:800]}
                log(f"[{self.label}] {name}: FAILED: {self.results[name]['reason'][:300]}")
                continue
            warm = time.perf_counter() - t0
            self.results[name] = {
                "status": "ok",
                "warmup_s": warm,
                "predicted_compile_s": compile_s,
                "predicted_call_s": call_s,
                "times_s": [],
            }
            outputs[name] = outs[0]
            log(f"[{self.label}] warm-up {name}: {warm:.1f} s")

        live = [m for m in fns if self.results.get(m, {}).get("status") == "ok"]
        for r in range(args.repeats):
            if r > 0 and self.time_left() < sum(self.results[m]["times_s"][-1] for m in live):
                log(f"[{self.label}] budget: stopping after {r} timed repeat(s)")
                break
            for name in list(live):
                try:
                    dt, outs = run_all(fns[name], [ids])
                except Exception as e:
                    self.results[name] = {"status": "error", "reason": f"timed call: {type(e).__name__}: {e}"[:800]}
                    log(f"[{self.label}] {name}: FAILED in a timed call: {self.results[name]['reason'][:300]}")
                    live.remove(name)
                    continue
                self.results[name]["times_s"].append(dt)
                outputs[name] = outs[0]

        ref = outputs.get(REFERENCE)
        for name in live:
            res = self.results[name]
            res["median_s"] = statistics.median(res["times_s"])
            res["tokens_per_s"] = self.batch * args.new_tokens / res["median_s"]
            if ref is not None:
                mism = row_agreement(outputs[name], ref)
                res["first_mismatch_per_row"] = mism
                res["same_tokens_as_hf_dynamic"] = all(m is None for m in mism)
            if name in self.stats:
                res["spec_stats"] = self.stats[name]
        base = self.results.get(BASELINE, {})
        for name in live:
            if "median_s" in base:
                self.results[name]["speedup_vs_hf_static_compiled"] = base["median_s"] / self.results[name]["median_s"]
        result = dict(pair=self.pair, batch=self.batch, context=self.ctx, methods=self.results, floor=self.floor())
        for name in live:
            r = self.results[name]
            log(
                f"[{self.label}] {name}: {r['tokens_per_s']:.1f} tok/s, "
                f"{fmt(r.get('speedup_vs_hf_static_compiled'), '.2f')}x HF static+compile, "
                f"tau {fmt(r.get('spec_stats', {}).get('tau'), '.2f')}, same tokens {r.get('same_tokens_as_hf_dynamic')}"
            )
        if args.profile:
            result["profile"] = self.profile(fns)
        checkpoint(result)
        result["round_overhead"] = self.round_overhead() if self.specs and not args.no_overhead else {}
        return result

    # ------------------------------------------------------------------------- profile
    def profile(self, fns) -> dict:
        """Each specfx generator's first row profiled warm with the finished-flag reads
        overlapped, not, and overlapped again (``SpecConfig.overlap_reads``: a host-loop
        setting, same graphs; the third call separates the setting from the calls' order, which
        GPU run 6 could not)."""
        out = {}
        dev = torch.device(self.args.device)
        for fam, spec in self.specs.items():
            row = next((r for r in fns if family(r) == fam and self.results.get(r, {}).get("status") == "ok"), None)
            if row is None or self.time_left() < 30:
                continue
            config = spec.spec_config
            try:  # "auto" reads its counters every round: overlap_reads changes nothing there
                for i, overlap in enumerate((True,) if spec.auto_k is not None else (True, False, True)):
                    spec.spec_config = dataclasses.replace(config, overlap_reads=overlap)
                    p = profile_decode(lambda row=row: fns[row](self._ids), spec, dev)
                    key = f"{row}|overlap_reads={overlap}" + ("|again" if i == 2 else "")
                    out[key] = p
                    log(
                        f"[{self.label}] profile {row} {key.split('|', 1)[1]}: busy {p.get('busy_fraction')}, "
                        f"{p['graph_launches']} graph launches / {p['rounds']} rounds, "
                        f"{p.get('span_ms_per_round')} ms per round, largest gaps {p.get('largest_gaps_us')} us"
                    )
            except Exception as e:  # reported, not fatal
                out[f"{row}|error"] = f"{type(e).__name__}: {e}"[:800]
                log(f"[{self.label}] profile {row} FAILED: {out[f'{row}|error'][:300]}")
            finally:
                spec.spec_config = config
        return out

    # ------------------------------------------------------------------------- overhead
    def round_overhead(self) -> dict:
        args, k, b = self.args, self.args.k, self.batch
        live = {  # fixed-K generators only: an "auto" round has no single K to price in parts
            m: s
            for m, s in self.specs.items()
            if m in OVERHEAD_FAMILIES
            and any(self.results.get(r, {}).get("status") == "ok" for r in self.results if family(r) == m)
        }
        if not live:
            return {}
        parts_compile = self.predicted.get("parts", (0.0, 0.0))[0]
        if self.time_left() < parts_compile:
            log(f"[{self.label}] round overhead: skipped (budget: parts predicted {parts_compile:.0f} s)")
            return {"skipped": "budget"}
        log(f"[{self.label}] round overhead: compiling the parts (predicted {parts_compile:.0f} s) ...")
        dev = torch.device(args.device)
        iters = args.micro_iters
        out = {}
        try:
            with torch.no_grad():
                for name, spec in live.items():
                    out[f"round_ms[{name}]"] = 1e3 * device_time(round_callable(spec), dev, iters)
                any_spec = next(iter(live.values()))
                start = self.ctx + args.new_tokens + 1  # past everything a generation used
                pos = (start + torch.arange(k + 1, device=dev)).unsqueeze(0).expand(b, k + 1).contiguous()
                tok = torch.randint(3, self.target.config.vocab_size, (b, k + 1), device=dev)
                opts = getattr(args, "inductor_options", None) if args.backend == "specfx" else None
                backend = make_backend(args.backend, options=opts or None)

                def part(runner, t):
                    fwd = torch.compile(
                        lambda i, p: runner.forward(i, p, p), backend=backend, fullgraph=True, dynamic=False
                    )
                    ids_t, pos_t = tok[:, :t].contiguous(), pos[:, :t].contiguous()
                    return 1e3 * device_time(lambda: fwd(ids_t, pos_t), dev, iters)

                out["verify_ms"] = part(any_spec.target_runner, k + 1)
                if "specfx_self" in live:
                    out["target_step_ms"] = part(any_spec.target_runner, 1)
                if "specfx_draft" in live:
                    out["draft_step_ms"] = part(live["specfx_draft"].drafter.runner, 1)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"[:800]
            log(f"[{self.label}] round overhead FAILED: {out['error'][:300]}")
            return out
        parts = {
            "specfx_draft": lambda: k * out["draft_step_ms"] + out["verify_ms"],
            "specfx_oracle": lambda: out["verify_ms"],
            "specfx_self": lambda: k * out["target_step_ms"] + out["verify_ms"],
        }
        for name in live:
            out[f"parts_ms[{name}]"] = parts[name]()
            out[f"overhead[{name}]"] = out[f"round_ms[{name}]"] / out[f"parts_ms[{name}]"]
        # achieved bandwidth of the verification (bytes it must read / its time)
        verify_bytes = forward_bytes(self.target, b, k + 1, start).total
        out["verify_fraction_of_bandwidth"] = verify_bytes / (out["verify_ms"] / 1e3) / self.bandwidth
        return out

    # ------------------------------------------------------------------------- floor
    def floor(self) -> dict:
        args, k, b = self.args, self.args.k, self.batch
        mid = self.ctx + args.new_tokens // 2
        bw = self.bandwidth
        decode = decode_floor_seconds(self.target, batch=b, context=mid, bandwidth=bw)
        rounds = {
            "specfx_draft": round_floor_seconds(self.target, self.draft, k=k, batch=b, context=mid, bandwidth=bw),
            "specfx_oracle": round_floor_seconds(self.target, None, k=k, batch=b, context=mid, bandwidth=bw),
            "specfx_self": round_floor_seconds(self.target, self.target, k=k, batch=b, context=mid, bandwidth=bw),
        }
        out = dict(
            context_mean=mid,
            bandwidth=bw,
            target_bytes_step=forward_bytes(self.target, b, 1, mid).total,
            draft_bytes_step=forward_bytes(self.draft, b, 1, mid).total,
            decode_floor_ms=1e3 * decode,
            round_floor_ms={m: 1e3 * s for m, s in rounds.items()},
        )
        for name, res in self.results.items():
            if res.get("status") != "ok":
                continue
            fam = family(name)
            if fam in rounds:
                ideal = ideal_tokens_per_s(res["spec_stats"]["tau"], rounds[fam], b)
            elif name in ("hf_dynamic", "hf_static_compiled"):
                ideal = ideal_tokens_per_s(1.0, decode, b)
            else:
                continue  # hf_assisted: its τ is not exposed; "auto": no single round to price
            res["ideal_tokens_per_s"] = ideal
            res["fraction_of_floor"] = fraction_of_floor(res["tokens_per_s"], ideal)
        return out
