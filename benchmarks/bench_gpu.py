"""GPU benchmark (issue 6): specfx against Hugging Face generation on Llama-shaped models.

Run ``python benchmarks/bench_gpu.py --help`` for the flags; ``--smoke`` runs the same code on
tiny models on the CPU (fp32) in a few minutes, ``--dry-run`` prints the plan and its predicted
runtime without building a model. docs/BENCHMARKS.md ("GPU benchmark (issue 6)") has the method
and the commands.

For each target/draft pair (random weights, built from ``LlamaConfig`` directly on the device
in bf16, no download), batch size B and context length (the prompt length), one process
measures on the same random prompts and the same number of new tokens, greedy:

    hf_dynamic          target.generate()                       (DynamicCache, HF's default)
    hf_static_compiled  target.generate(cache_implementation="static", compile_config=...)
    hf_assisted         target.generate(assistant_model=draft), K constant draft tokens (B = 1)
    specfx_draft        specfx.speculate(target, draft).generate()            (compiled)
    specfx_oracle_<α>   specfx with benchmarks/oracle.py's OracleDrafter at α (one generator)
    specfx_self         specfx.speculate(target, draft=target): α = 1 with a full-size draft

Every method is warmed up once (graphs compile there), then the timed repeats are interleaved;
tokens/s = B x new tokens / median wall time of a generate() call (prefill included). Outputs
are compared with hf_dynamic's row by row; in fp32 they must be equal (exit status 1 otherwise),
in bf16 a near-tie may legitimately decode differently and the agreement is reported.

specfx generators get ``prefill_buckets=(context,)`` and a KV capacity fitted to
context + new tokens + K + 2, like HF's static cache (max_length), and run prefill eagerly
(HF also compiles only its decode step); the rounds are compiled (on CUDA: Inductor + CUDA
graphs through the ``specfx`` backend).

Round overhead = round time / (K x draft step + verify), each timed alone on the device
(CUDA events, median): ``round`` is ``spec.round_fn()()`` called on the finished state after a
generate call; the parts are ``runner.forward`` of the same generator family compiled with the
same ``specfx`` backend: verify = target over K+1 tokens, step = target over 1 token, draft =
draft over 1 token, all B rows, at the end of the context. The oracle's parts are the verify
alone (it reads no model); self-draft's draft step is the target step.

Floor (benchmarks/floor.py): bytes read per forward over the measured copy bandwidth; ideal
tokens/s = B x τ / round floor (specfx) or B / decode floor (HF), at the mean context
(prompt + new tokens / 2); "of floor" = measured / ideal.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import specfx  # noqa: E402
from benchmarks.common import first_mismatch, hf_compile_config, log, make_sync, run_all  # noqa: E402
from benchmarks.floor import (  # noqa: E402
    decode_floor_seconds,
    device_time,
    forward_bytes,
    fraction_of_floor,
    ideal_tokens_per_s,
    measure_copy_bandwidth,
    round_floor_seconds,
)
from benchmarks.gpu_plan import ASSUMED, METHODS, PAIRS, Predictor, build_model, method_rows, plan, print_plan  # noqa: E402
from benchmarks.gpu_report import fmt, meta_info, print_summary, write  # noqa: E402
from benchmarks.oracle import OracleDrafter, greedy_continuation  # noqa: E402
from specfx.passes.backend import make_backend  # noqa: E402

BASELINE = "hf_static_compiled"  # speedups are against HF's best plain decode
REFERENCE = "hf_dynamic"  # tokens are compared with HF's default generate()
MIN_COMBO_S = 60.0  # a combination is not started with less time left than this


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU in fp32 (checks the script)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and predicted runtime; build nothing")
    p.add_argument(
        "--shapes", default=None, help=f"pairs, comma-separated, from {sorted(PAIRS)} (default: 8b-1b,1b-150m)"
    )
    p.add_argument("--batches", default=None, help="batch sizes (default: 1,4,16)")
    p.add_argument("--contexts", default=None, help="prompt lengths (default: 512,4096)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--alphas", default="1,0.8,0.6", help="oracle acceptance probabilities")
    p.add_argument("--k", type=int, default=4, help="K, proposals per round")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (default 128; smoke 16)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per method after the warm-up")
    p.add_argument("--micro-iters", type=int, default=20, help="timed calls per round / part")
    p.add_argument(
        "--no-overhead", action="store_true", help="skip the round-overhead parts (saves 3 compiles per combination)"
    )
    p.add_argument(
        "--compile-prefill", action="store_true", help="compile specfx's prefill too (one graph per generator)"
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=("specfx", "specfx_eager"),
        help="specfx's compile backend (default specfx: passes + Inductor, CUDA graphs on CUDA);\n"
        "specfx_eager captures the same graphs but runs them without Inductor (the smoke default:\n"
        "it checks the script in a minute; HF's compile then uses backend='eager' too)",
    )
    p.add_argument(
        "--rounds-per-sync", type=int, default=1, help="specfx rounds between host reads of the finished flags"
    )
    p.add_argument("--device", default=None, help="default: cuda (smoke: cpu)")
    p.add_argument(
        "--dtype", default=None, choices=("bfloat16", "float16", "float32"), help="default: bfloat16 (smoke: float32)"
    )
    p.add_argument("--init-range", type=float, default=0.02, help="initializer_range of the random weights")
    p.add_argument(
        "--weights",
        default="peaked",
        choices=("peaked", "random"),
        help="peaked (default): random weights whose greedy token is decided by a wide logit margin\n"
        "(see gpu_plan.peak_logits), so bf16 kernels agree and the oracle's alpha holds; random:\n"
        "plain random init, whose near-flat logits make bf16 argmaxes flip between kernels",
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="skip what would end past this many seconds")
    p.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a planning constant ({', '.join(ASSUMED['cuda'])})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out-dir", type=Path, default=Path(__file__).parent / "results", help="where the JSON and markdown go"
    )
    p.add_argument("--tag", default="gpu", help="file names: bench_<tag>.json / .md")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.shapes = _list(args.shapes or ("tiny" if smoke else "8b-1b,1b-150m"), str)
    args.batches = _list(args.batches or ("1,2" if smoke else "1,4,16"), int)
    args.contexts = _list(args.contexts or ("24" if smoke else "512,4096"), int)
    args.methods = _list(args.methods, str)
    args.alphas = _list(args.alphas, float)
    args.new_tokens = args.new_tokens or (16 if smoke else 128)
    args.device = args.device or ("cpu" if smoke else "cuda")
    args.dtype = args.dtype or ("float32" if smoke else "bfloat16")
    args.backend = args.backend or ("specfx_eager" if smoke else "specfx")
    for name in args.shapes:
        if name not in PAIRS:
            p.error(f"--shapes: unknown pair {name!r}; choose from {sorted(PAIRS)}")
    for m in args.methods:
        if m not in METHODS:
            p.error(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
    if any(not 0 <= a <= 1 for a in args.alphas):
        p.error("--alphas must lie in [0, 1]")
    args.assumed = dict(ASSUMED["cuda" if args.device.startswith("cuda") else "cpu"])
    if args.backend == "specfx_eager":  # graphs are captured, not compiled: seconds, not minutes
        args.assumed.update(graph_s=1.0, layer_s=0.3)
    for item in args.assume:
        key, _, value = item.partition("=")
        if key not in args.assumed:
            p.error(f"--assume: unknown key {key!r}; choose from {', '.join(args.assumed)}")
        args.assumed[key] = float(value)
    return args


def _list(text: str, kind):
    return [kind(x) for x in str(text).split(",") if x.strip()]


# ----------------------------------------------------------------------------- one combination
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


def round_callable(spec):
    """The generator's compiled round for its (fixed) K."""
    return spec.round_fn()


def make_spec(target, draft, args, ctx: int):
    needed = ctx + args.new_tokens + args.k + 2
    spec = specfx.speculate(
        target,
        draft=draft,
        num_speculative_tokens=args.k,
        compile=True,
        backend=args.backend,
        prefill_buckets=(ctx,),
        min_capacity=-(-needed // 64) * 64,
        rounds_per_sync=args.rounds_per_sync,
        # HF compiles only its decode step too; a prefill graph per context costs compile time
        compile_prefill=args.compile_prefill,
    )
    return spec


class Combo:
    """Everything measured for one (pair, batch, context)."""

    def __init__(self, args, target, draft, pair, batch, ctx, bandwidth, predicted, deadline):
        self.args, self.target, self.draft = args, target, draft
        self.pair, self.batch, self.ctx = pair, batch, ctx
        self.bandwidth, self.predicted, self.deadline = bandwidth, predicted, deadline
        self.sync = make_sync(torch.device(args.device))
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
            fns["hf_static_compiled"] = lambda x: target.generate(
                x, cache_implementation="static", compile_config=cc, **common
            )

        def spec_fn(name, spec, before=None):
            def fn(x):
                if before is not None:
                    before()
                out = spec.generate(x, attention_mask=mask, max_new_tokens=n)
                self.stats[name] = stats_dict(spec.stats, k)
                return out

            return fn

        oracle_rows = [r for r in rows if r.startswith("specfx_oracle")]
        if oracle_rows:
            log(f"[{self.label}] oracle reference: target's greedy continuation ({n + k + 1} tokens)")
            reference = greedy_continuation(target, ids, mask, new_tokens=n + k + 1)
            oracle = OracleDrafter(args.alphas[0], reference)
            spec = self.specs["specfx_oracle"] = make_spec(target, oracle, args, self.ctx)
            for row, alpha in zip(oracle_rows, args.alphas, strict=True):
                fns[row] = spec_fn(row, spec, functools.partial(oracle.set_alpha, alpha))
        if "specfx_draft" in rows:
            self.specs["specfx_draft"] = make_spec(target, draft, args, self.ctx)
            fns["specfx_draft"] = spec_fn("specfx_draft", self.specs["specfx_draft"])
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
        checkpoint(result)
        result["round_overhead"] = self.round_overhead() if self.specs and not args.no_overhead else {}
        return result

    # ------------------------------------------------------------------------- overhead
    def round_overhead(self) -> dict:
        args, k, b = self.args, self.args.k, self.batch
        live = {
            m: s
            for m, s in self.specs.items()
            if any(self.results.get(r, {}).get("status") == "ok" for r in self.results if r.startswith(m))
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
                backend = make_backend(args.backend)

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
            family = "specfx_oracle" if name.startswith("specfx_oracle") else name
            if family in rounds:
                ideal = ideal_tokens_per_s(res["spec_stats"]["tau"], rounds[family], b)
            elif name in ("hf_dynamic", "hf_static_compiled"):
                ideal = ideal_tokens_per_s(1.0, decode, b)
            else:
                continue  # hf_assisted: its τ is not exposed
            res["ideal_tokens_per_s"] = ideal
            res["fraction_of_floor"] = fraction_of_floor(res["tokens_per_s"], ideal)
        return out


def main(argv=None) -> int:
    args = parse_args(argv)
    predictor = Predictor(args)
    predicted_total = print_plan(args, predictor)
    if args.dry_run:
        return 0
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # tiny models: threads only add jitter (see benchmarks/common.py)
    bandwidth = measure_copy_bandwidth(dev)
    log(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    meta = meta_info(args, bandwidth)
    meta["predicted_total_s"] = predicted_total
    combos, skipped = [], []

    def checkpoint(partial: dict) -> None:  # partial results survive a kill at the time limit
        write(args, meta, [*combos, partial], skipped)

    for pair in args.shapes:
        todo = [(b, c) for (p, b, c) in plan(args) if p == pair]
        if deadline - time.perf_counter() < MIN_COMBO_S:
            skipped += [f"{pair} B={b} ctx={c}" for b, c in todo]
            continue
        t_name, d_name = PAIRS[pair]
        log(f"[{pair}] building random-weight models {t_name} and {d_name} ...")
        target = build_model(t_name, args, args.seed)
        draft = build_model(d_name, args, args.seed + 1)
        for b, c in todo:
            pred = predictor.combo(pair, b, c)
            if deadline - time.perf_counter() < MIN_COMBO_S:
                skipped.append(f"{pair} B={b} ctx={c}")
                log(f"[{pair} B={b} ctx={c}] skipped: {deadline - time.perf_counter():.0f} s left")
                continue
            # within a combination, each method is skipped when its own prediction no longer fits
            t0 = time.perf_counter()
            combo = Combo(args, target, draft, pair, b, c, bandwidth, predictor.steps(pair, b, c), deadline)
            result = combo.run(checkpoint)
            result["wall_s"], result["predicted_s"] = time.perf_counter() - t0, pred
            combos.append(result)
            del combo
            write(args, meta, combos, skipped)
            torch._dynamo.reset()  # frees compiled graphs (and their CUDA graph pools) between combinations
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del target, draft
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    meta["wall_s"] = time.perf_counter() - t_start
    write(args, meta, combos, skipped)
    print_summary(args, meta, combos, skipped, predicted_total)
    exact = args.dtype == "float32"
    bad = [
        f"{c['pair']} B={c['batch']} ctx={c['context']} {n}"
        for c in combos
        for n, r in c["methods"].items()
        if r.get("status") == "ok" and r.get("same_tokens_as_hf_dynamic") is False
    ]
    if bad:
        print(
            (
                "tokens differ from hf_dynamic (fp32: a bug): "
                if exact
                else "tokens differ from hf_dynamic (bf16 near-ties?): "
            )
            + ", ".join(bad)
        )
    return 1 if exact and bad else 0


if __name__ == "__main__":
    sys.exit(main())
