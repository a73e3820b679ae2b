"""What a round costs on a hybrid target, and whether "auto" pays for its rollback (issue 29 item 4).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/hybrid_rounds.py --cases qwen3_next-tiny:eager \
        qwen3_next-213m:eager bamba-tiny:eager qwen3_next-tiny:eager:4 qwen3_next-tiny:compiled

(docs/BENCHMARKS.md, "Hybrid targets: what rollback costs"; about 15 min on a loaded 2-core CPU).
Cases are ``model:mode[:batch]`` (batch: ``--batch`` unless given; mode ``eager`` =
``compile=False``, ``compiled`` = the default Inductor backend). Models (random weights, built
from configs, no download): ``qwen3_next-tiny`` (the tests' ``STATEFUL_TINY`` row: 1 GDN + 1
attention layer), ``qwen3_next-213m`` (Qwen3-Next-style: 9 gated-delta-net + 3 attention layers,
hidden 768, 8 experts top-2 and a shared expert, vocab 32000; 213M parameters) and ``bamba-tiny``
(Mamba2 SSD + attention), ``mamba-tiny`` (Mamba1 only) and ``jamba-tiny`` (Mamba1 + attention, MoE),
whose verify forwards step their mixers one position at a time (decision 90). ``--smoke``: the tiny GDN case only, eager, few tokens (the test's mode).

Per case, in one process, batch ``--batch``, greedy, EOS off, the same random prompts and tokens:

    hf            target.generate() (dynamic cache): the baseline
    k0            specfx's own round at K = 0 (plain decoding; "auto" with times that never pay)
    k4@a0, k4@a1  K = 4 rounds with specfx/bench/oracle.py's OracleDrafter at α = 0 and α = 1
    auto@a0/a1    num_speculative_tokens="auto" (K among 0 and 1, 2, 4, 8) with the oracle at α = 0/1
    wait@a0       eager cases: "auto" at α = 0 as before decision 83 (``stop_risk = 0``: K = 0 only
                  after MIN_EVIDENCE row-rounds, however costly the rounds)

timed by specfx/bench/harness.py's ``bench_end_to_end`` (one warm-up, where graphs compile and
"auto" times its rounds; then ``--repeats`` interleaved repeats, medians; every output compared
token for token with hf's). Random weights make acceptance meaningless, hence the oracle.

The round split (K = 4, after the generate calls, rows finished: the shapes and work of a live
round, as "auto" times them). Eager: one round at a time (``spec.round_fn(4)``), the pieces timed
in place by wrapping the generator's own objects for this measurement only: ``draft`` (the
oracle's ``propose``), ``verify`` (the target's K+1-token forward), ``snapshot`` (the state copy
before it), and ``roll_back_state``'s work: ``select`` (decision 91: each row's state picked from
those the verify's single steps passed through) or, for the types verified by one multi-token
forward, ``restore`` and ``replay`` (the snapshot written back, then up to K+1 single-position
mixer steps); rollback = snapshot + restore + replay + select; ``other`` = the round less the
pieces (acceptance, bookkeeping). Every mode: ``round`` (K = 4) and ``round0`` (K = 0) timed
whole, and ``no_rollback``: the same round in a generator whose ``roll_back_state`` only drops the
recorded inputs (wrong output, timing only), so round - no_rollback is the rollback as compiled.
The fastest of ``--split-repeats`` interleaved calls for each entry and piece (load from other
processes only adds time; "auto" times its rounds the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

import specfx
from specfx.bench.harness import NO_EOS, bench_end_to_end, log, run_meta, torch_threads
from specfx.bench.oracle import OracleDrafter, greedy_continuation
from specfx.testing.tiny import STATEFUL_TINY, tiny_causal_lm

K = 4
PIECES = ("draft", "snapshot", "verify", "restore", "replay", "select")
MODELS = {
    "qwen3_next-tiny": ("qwen3_next", dict(STATEFUL_TINY["qwen3_next"])),
    "bamba-tiny": ("bamba", dict(STATEFUL_TINY["bamba"])),
    "mamba-tiny": ("mamba", dict(STATEFUL_TINY["mamba"])),
    "jamba-tiny": ("jamba", dict(STATEFUL_TINY["jamba"])),
    "qwen3_next-213m": (
        "qwen3_next",
        dict(
            num_layers=12,
            vocab_size=32000,
            hidden_size=768,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            initializer_range=0.02,
            max_positions=1024,
        ),
    ),
}


def build(name: str):
    arch, kw = MODELS[name]
    kw = dict(kw)
    return tiny_causal_lm(arch, num_layers=kw.pop("num_layers", 2), vocab_size=kw.pop("vocab_size", 128), **kw)


@contextmanager
def timed_pieces(spec, acc: dict):
    """Wrap the pieces of an eager stateful round on this generator's own objects (instance
    attributes, removed afterwards): each call's seconds are added to ``acc[piece]``."""
    runner = spec.target_runner
    owners = {
        "draft": (spec.drafter, "propose"),
        "snapshot": (runner.state_snapshot, "take"),
        "verify": (runner, "forward"),
        "restore": (runner.state_snapshot, "restore"),
        "replay": (runner.mixer_taps, "replay_steps"),
        "select": (runner.mixer_taps, "select"),
    }

    def wrap(piece, fn):
        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[piece] += time.perf_counter() - begin

        return timed

    for piece, (obj, attr) in owners.items():
        setattr(obj, attr, wrap(piece, getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr in owners.values():
            delattr(obj, attr)


def without_rollback(spec) -> None:
    """Timing only: this generator's rounds keep every verified input in the state (wrong output)."""
    runner = spec.target_runner
    runner.roll_back_state = lambda n, tokens: (runner.mixer_taps.inputs.clear(), runner.mixer_taps.after.clear())


def round_split(specs: dict, compiled: bool, repeats: int) -> dict:
    """Milliseconds (medians) of one round: ``round`` and ``round0`` whole, ``no_rollback``, and,
    eager, the pieces of ``round`` timed in place (see the module docstring)."""
    calls = {
        "round": specs["k4@a0"].round_fn(K),
        "round0": specs["k0"].round_fn(0),
        "no_rollback": specs["no_rollback"].round_fn(K),
    }
    runners = [spec.target_runner for spec in specs.values()]
    for runner in runners:  # compiled rounds record the mixers through hooks generate() attaches
        runner.attach_state_hooks()
    try:
        return _round_split(specs, calls, compiled, repeats)
    finally:
        for runner in runners:
            runner.detach_state_hooks()


def _round_split(specs: dict, calls: dict, compiled: bool, repeats: int) -> dict:
    for fn in calls.values():
        fn(), fn()  # warm (compiled: the graphs exist already, from the generate calls)
    samples = {name: [] for name in (*calls, *(PIECES if not compiled else ()))}
    for _ in range(repeats):
        for name, fn in calls.items():
            acc = dict.fromkeys(PIECES, 0.0)
            with timed_pieces(specs["k4@a0"], acc) if name == "round" and not compiled else nullcontext():
                begin = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - begin)
            if name == "round" and not compiled:
                for piece in PIECES:
                    samples[piece].append(acc[piece])
    # the fastest of each (load from other processes only adds time, as "auto" times rounds)
    ms = {name: 1e3 * min(v) for name, v in samples.items()}
    if not compiled:
        ms["rollback"] = ms["snapshot"] + ms["restore"] + ms["replay"] + ms["select"]
        rest = [r - sum(samples[p][i] for p in PIECES) for i, r in enumerate(samples["round"])]
        ms["other"] = 1e3 * min(rest)  # acceptance and bookkeeping: the round less its pieces
    ms["rollback_compiled_way"] = ms["round"] - ms["no_rollback"]
    return ms


def run_case(case: str, args) -> dict:
    model_name, mode, *batch = case.split(":")
    compiled = mode == "compiled"
    model = build(model_name)
    n, b = args.max_new_tokens, int(batch[0]) if batch else args.batch
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (b, args.prompt_len), generator=g) for _ in range(args.prompts)]
    refs = {id(p): greedy_continuation(model, p, new_tokens=n + 9) for p in prompts}  # 9: "auto"'s K = 8 + 1
    opts = dict(compile=compiled, prefill_buckets=(args.prompt_len,))
    specs = {
        "k0": specfx.speculate(model, num_speculative_tokens="auto", auto_k_times={0: 1.0, K: 100.0}, **opts),
        "k4@a0": specfx.speculate(model, draft=OracleDrafter(0.0), num_speculative_tokens=K, **opts),
        "auto@a0": specfx.speculate(model, draft=OracleDrafter(0.0), num_speculative_tokens="auto", **opts),
        "no_rollback": specfx.speculate(model, draft=OracleDrafter(0.0), num_speculative_tokens=K, **opts),
    }
    specs["k4@a1"], specs["auto@a1"] = specs["k4@a0"], specs["auto@a0"]
    if not compiled:  # (compiled, five more round graphs)
        specs["wait@a0"] = specfx.speculate(model, draft=OracleDrafter(0.0), num_speculative_tokens="auto", **opts)
        specs["wait@a0"].auto_k.stop_risk = 0.0
    without_rollback(specs["no_rollback"])
    greedy = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, **NO_EOS)
    history = {}

    def run_spec(name):
        spec, alpha = specs[name], (1.0 if name.endswith("a1") else 0.0)

        def fn(ids):
            if isinstance(spec.drafter, OracleDrafter):
                spec.drafter.set_alpha(alpha)
                spec.drafter.set_reference(refs[id(ids)])
            out = spec.generate(ids, **greedy)
            if spec.auto_k is not None:
                history[name] = list(spec.auto_k.history)
            return out

        return fn

    methods = {"hf_dynamic": lambda ids: model.generate(ids, **greedy)}
    names = ("k0", "k4@a0", "k4@a1", "auto@a0", "auto@a1", "wait@a0")
    methods |= {name: run_spec(name) for name in names if name in specs}
    log(f"[{case}] {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; warm-up (compiles) ...")
    load = os.getloadavg()
    results = bench_end_to_end(args, methods, prompts)
    specs["no_rollback"].generate(prompts[0], **greedy)  # its graphs (compiled: one more compile)
    split = round_split(specs, compiled, args.split_repeats)
    for res in results.values():
        if "tokens_per_s" in res:
            res["tokens_per_s"] *= b  # the harness counts one row per prompt
    return dict(
        case=case if batch else f"{case}:{b}",
        params_m=sum(p.numel() for p in model.parameters()) / 1e6,
        load=(load, os.getloadavg()),
        methods=results,
        auto_history=history,
        auto_times_ms={str(k): 1e3 * v for k, v in (specs["auto@a0"].auto_k.times or {}).items()},
        split_ms=split,
    )


RATIO_COLUMNS = (
    "case", "HF tok/s", "K=0 / HF", "K=4 α=0 / HF", "K=4 α=1 / HF", "auto α=1 / HF", "auto α=0 / HF",
    "auto α=0 / K=0", "auto α=0 / best plain", "before 83: auto α=0 / K=0", "same tokens", "load",
)  # fmt: skip
SPLIT_COLUMNS = (
    "case", "round K=0 ms", "round K=4 ms", "draft", "verify", "rollback (snapshot + restore + replay + select)", "other",
    "rollback share", "round − no-rollback round", "auto's t(0), t(4) ms", "auto's Ks α=0 / α=1 / before 83 α=0",
)  # fmt: skip


def markdown(columns: tuple, cells: list[list[str]]) -> str:
    """A table: the first column left-aligned, the rest right-aligned."""
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in cells)])


def ratio_cells(r: dict) -> list[str]:
    m = r["methods"]
    tps = {k: v.get("tokens_per_s", float("nan")) for k, v in m.items()}
    hf, best_plain = tps["hf_dynamic"], max(tps["hf_dynamic"], tps["k0"])
    same = all(v.get("same_tokens_as_hf_dynamic", False) for k, v in m.items() if k != "hf_dynamic")
    ratios = [tps[name] / hf for name in ("k0", "k4@a0", "k4@a1", "auto@a1", "auto@a0")]
    ratios += [tps["auto@a0"] / tps["k0"], tps["auto@a0"] / best_plain, tps.get("wait@a0", float("nan")) / tps["k0"]]
    load = "–".join(f"{x[0]:.1f}" for x in r["load"])
    return [r["case"], f"{hf:.1f}", *(f"{x:.2f}" for x in ratios), "yes" if same else "NO", load]


def split_cells(r: dict) -> list[str]:
    s, t = r["split_ms"], r["auto_times_ms"]
    if "verify" in s:  # eager: the pieces timed in place
        rollback = (
            f"{s['rollback']:.2f} ({s['snapshot']:.3f} + {s['restore']:.3f} + {s['replay']:.2f} + {s['select']:.2f})"
        )
        pieces = [f"{s['draft']:.2f}", f"{s['verify']:.2f}", rollback, f"{s['other']:.2f}"]
        share = s["rollback"] / s["round"]
    else:  # compiled: one graph; the rollback is the round less the round without it
        pieces, share = ["–"] * 4, s["rollback_compiled_way"] / s["round"]
    ks = " / ".join(_ks(r["auto_history"].get(name, [])) for name in ("auto@a0", "auto@a1", "wait@a0"))
    times = ", ".join(f"{t[k]:.2f}" if k in t else "–" for k in ("0", str(K)))
    return [
        r["case"], f"{s['round0']:.2f}", f"{s['round']:.2f}", *pieces, f"{share:.0%}",
        f"{s['rollback_compiled_way']:.2f}", times, ks,
    ]  # fmt: skip


def _ks(history: list) -> str:
    """Windows per K, in order of first use: ``4×8, 0×57``."""
    counts: dict = {}
    for k in history:
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k}×{c}" for k, c in counts.items())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cases", nargs="*", default=["qwen3_next-tiny:compiled", "qwen3_next-tiny:eager", "qwen3_next-213m:eager"]
    )
    p.add_argument("--smoke", action="store_true", help="qwen3_next-tiny eager, 12 tokens, 1 repeat (the test's mode)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed end-to-end repeats (medians)")
    p.add_argument("--split-repeats", type=int, default=30, help="timed rounds per split entry (fastest kept)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("bench_results") / "hybrid_rounds.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.cases, args.prompts, args.max_new_tokens = ["qwen3_next-tiny:eager"], 1, 12
        args.repeats, args.split_repeats = 1, 3
    args.command = " ".join(["python", *sys.argv]) if argv is None else "hybrid_rounds " + " ".join(argv)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    start, load = time.perf_counter(), os.getloadavg()
    with torch_threads(args.threads) as threads:
        rows = []
        for case in args.cases:
            rows.append(run_case(case, args))
            meta = run_meta(start, load, args.command)
            report = dict(meta=meta, args={k: str(v) for k, v in vars(args).items()}, cases=rows)
            if not args.smoke:  # after each case: a later case's failure keeps the earlier ones
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1, default=str))
    print(
        f"hybrid_rounds: batch {args.batch}, K = {K}, {args.max_new_tokens} new tokens, {args.prompts} prompt(s) "
        f"of {args.prompt_len}, {threads} torch thread(s); {args.command}"
    )
    print(
        f"versions {meta['versions']}; {meta['machine']['cpu']} ({meta['machine']['cpus']} cpus); "
        f"load {meta['load_avg']['start'][0]:.1f} → {meta['load_avg']['end'][0]:.1f}"
    )
    print(markdown(RATIO_COLUMNS, [ratio_cells(r) for r in rows]))
    print()
    print(markdown(SPLIT_COLUMNS, [split_cells(r) for r in rows]))
    return report


if __name__ == "__main__":
    report = main()
    ok = all(
        v.get("same_tokens_as_hf_dynamic", False)
        for r in report["cases"]
        for k, v in r["methods"].items()
        if k != "hf_dynamic"
    )
    raise SystemExit(0 if ok else 1)
