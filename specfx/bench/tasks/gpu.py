"""GPU benchmark (issue 6): specfx against Hugging Face generation on Llama-shaped models.

Run ``specfx bench gpu --help`` (from a checkout without installing: ``python3 -m specfx.cli bench
gpu --help``) for the flags; ``--smoke`` runs the same code on
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
    specfx_oracle_<α>   specfx with specfx/bench/oracle.py's OracleDrafter at α (one generator)
    specfx_self         specfx.speculate(target, draft=target): α = 1 with a full-size draft
    specfx_auto         specfx with the draft and num_speculative_tokens="auto" (K per window among 0
                        and --auto-k-values; each K a round graph, compiled and timed in the first call)
    specfx_auto_oracle_<α>  "auto" with the oracle at each --auto-alphas (α = 0: nothing pays, "auto"
                        must fall back to K = 0; issue 30 asks >= 0.95x HF static + compile)

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

Floor (specfx/bench/floor.py): bytes read per forward over the measured copy bandwidth; ideal
tokens/s = B x τ / round floor (specfx) or B / decode floor (HF), at the mean context
(prompt + new tokens / 2); "of floor" = measured / ideal.

Modules: this one (flags, the loop over combinations), :mod:`.gpu_combo` (one combination's
measurements), :mod:`.gpu_plan` (shapes, runtime prediction), :mod:`.gpu_report` (tables, files).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from specfx.bench.floor import measure_copy_bandwidth
from specfx.bench.harness import log
from specfx.bench.tasks.gpu_combo import Combo
from specfx.bench.tasks.gpu_plan import ASSUMED, METHODS, PAIRS, Predictor, build_model, plan, print_plan
from specfx.bench.tasks.gpu_report import meta_info, print_summary, write
from specfx.config import SpecConfig

__all__ = ["main", "parse_args"]

MIN_COMBO_S = 60.0  # a combination is not started with less time left than this


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specfx bench gpu", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
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
    p.add_argument(
        "--auto-k-values",
        default=",".join(map(str, SpecConfig.auto_k_values)),
        help='the Ks "auto" chooses from besides 0 (specfx_auto, specfx_auto_oracle: SpecConfig.auto_k_values;\n'
        "default the library's); each one is a round graph compiled and timed in the first call",
    )
    p.add_argument(
        "--auto-alphas", default="0,0.6", help="the oracle's acceptance probabilities for specfx_auto_oracle"
    )
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
    p.add_argument(
        "--inductor-options",
        default=None,
        metavar="KEY=VALUE,...",
        help="Inductor settings for every compile of the run, scoped to those compiles: specfx's\n"
        "(SpecConfig.inductor_options), HF's (CompileConfig.options) and the round-overhead parts;\n"
        "e.g. coordinate_descent_tuning=1 (values: 1/0/true/false, ints, floats, strings)",
    )
    p.add_argument(
        "--no-live-kv",
        action="store_true",
        help="specfx's attention reads the whole KV buffer (SpecConfig.live_kv=False), to measure the live-KV cut",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one warm call of each specfx method (torch.profiler): device busy fraction of the\n"
        "decode loop, CUDA-graph launches per round, the largest idle gaps; with the finished-flag reads\n"
        "overlapped (the CUDA default) and not",
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
        "--out-dir", type=Path, default=Path("benchmarks") / "results", help="where the JSON and markdown go"
    )
    p.add_argument("--tag", default="gpu", help="file names: bench_<tag>.json / .md")
    args = p.parse_args(argv)
    args.command = "specfx bench gpu " + " ".join(sys.argv[3:] if argv is None else argv)
    smoke = args.smoke
    args.shapes = _list(args.shapes or ("tiny" if smoke else "8b-1b,1b-150m"), str)
    args.batches = _list(args.batches or ("1,2" if smoke else "1,4,16"), int)
    args.contexts = _list(args.contexts or ("24" if smoke else "512,4096"), int)
    args.methods = _list(args.methods, str)
    args.alphas = _list(args.alphas, float)
    args.auto_alphas = _list(args.auto_alphas, float)
    args.auto_k_values = tuple(_list(args.auto_k_values, int))
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
    if any(not 0 <= a <= 1 for a in args.alphas + args.auto_alphas):
        p.error("--alphas and --auto-alphas must lie in [0, 1]")
    try:
        SpecConfig(num_speculative_tokens="auto", auto_k_values=args.auto_k_values)
    except ValueError as e:
        p.error(f"--auto-k-values: {e}")
    try:
        args.inductor_options = _options(args.inductor_options)
        if args.inductor_options:
            from specfx.config import check_inductor_options

            check_inductor_options(args.inductor_options, "specfx")
    except ValueError as e:
        p.error(f"--inductor-options: {e}")
    args.assumed = dict(ASSUMED["cuda" if args.device.startswith("cuda") else "cpu"])
    if args.backend == "specfx_eager":  # graphs are captured, not compiled: seconds, not minutes
        args.assumed.update(graph_s=1.0, layer_s=0.3)
    for item in args.assume:
        key, _, value = item.partition("=")
        if key not in args.assumed:
            p.error(f"--assume: unknown key {key!r}; choose from {', '.join(args.assumed)}")
        args.assumed[key] = float(value)
    return args


def _options(text: str | None) -> dict:
    """``"a=1,b.c=false,d=x"`` -> ``{"a": True, "b.c": False, "d": "x"}`` (1/0 read as booleans)."""
    out = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        v = value.strip()
        low = v.lower()
        if low in ("1", "true", "0", "false"):
            out[key.strip()] = low in ("1", "true")
            continue
        for kind in (int, float):
            try:
                out[key.strip()] = kind(v)
                break
            except ValueError:
                pass
        else:
            out[key.strip()] = v
    return out


def _list(text: str, kind):
    return [kind(x) for x in str(text).split(",") if x.strip()]


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
        torch.set_num_threads(1)  # tiny models: threads only add jitter
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
