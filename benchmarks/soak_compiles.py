"""Count and time the cold compiles a long-lived compiled generator pays for a mixed workload.

The call mix is the soak test's (tests/soak/test_soak.py): one Inductor-compiled generator (tiny
Llama target, perturbed-copy draft, K = 3), a first request (100 + 156 tokens) that grows the buffers to 512 slots, then the 15
classes (batch 1/2/3 x greedy, greedy + repetition penalty + min length, temperature, top-k,
top-p + penalty) once each, then 48 replays of those classes with new prompts (1..60 tokens,
ragged) and max_new_tokens (1..40). Each call that added a compiled graph counts as a compile;
its cost is its wall time minus the median warm call's. A failing call is counted and the run
goes on. Works on any specfx revision (it reads only ``spec.graphs`` and wall time), so the same
command measures before and after a change (run from the checkout to measure: ``-m`` puts it
first on ``sys.path``; the call mix lives in :mod:`specfx.testing.soak`)::

    python -m benchmarks.soak_compiles --json after.json
    (cd OLD_CHECKOUT && python -m benchmarks.soak_compiles --json before.json)

Run it in a fresh process (it measures cold compiles; Inductor's on-disk FX graph cache makes a
second process warm, see ``--cache-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from specfx.testing.soak import CLASSES, MODES, REPLAYS, growing_request, soak_request


def run(replays: int = REPLAYS) -> dict:
    import specfx
    from specfx.testing.tiny import perturbed_copy, tiny_causal_lm

    target = tiny_causal_lm("llama")
    spec = specfx.speculate(target, draft=perturbed_copy(target, 0.03), num_speculative_tokens=3)
    rng = random.Random(0)
    calls = [((1, "greedy"), growing_request())]
    calls += [(c, soak_request(c[0], rng)) for c in CLASSES]
    calls += [(CLASSES[(7 * i) % len(CLASSES)], soak_request(CLASSES[(7 * i) % len(CLASSES)][0], rng)) for i in range(replays)]
    records = []
    for i, ((batch, mode), (ids, mask, new)) in enumerate(calls):
        before = len(spec.graphs)
        torch.manual_seed(i)
        start = time.monotonic()
        error = None
        try:
            spec.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0, **MODES[mode])
        except Exception as e:  # counted, and the run goes on
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        records.append(dict(call=i, batch=batch, mode=mode, seconds=time.monotonic() - start,
                            compiled=len(spec.graphs) - before, error=error))
        print(f"call {i:3d} batch {batch} {mode:15s} {records[-1]['seconds']:7.2f} s  +{records[-1]['compiled']} graph(s)"
              + (f"  ERROR {error}" if error else ""), flush=True)
    warm = statistics.median(r["seconds"] for r in records if not r["compiled"] and not r["error"])
    compiling = [r for r in records if r["compiled"]]
    first_pass = 1 + len(CLASSES)
    return dict(
        calls=len(records),
        errors=sum(r["error"] is not None for r in records),
        first_error=next((r for r in records if r["error"]), None),
        compiles=sum(r["compiled"] for r in records),
        compiles_after_first_pass=sum(r["compiled"] for r in records[first_pass:]),
        compile_seconds=sum(r["seconds"] - warm for r in compiling),
        max_compile_seconds=max((r["seconds"] - warm for r in compiling), default=0.0),
        warm_call_seconds=warm,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        records=records,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the summary and every call's record here")
    parser.add_argument("--replays", type=int, default=REPLAYS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--cache-dir", help="Inductor cache directory (default: a new empty one, so every "
                        "compile is cold); run twice with the same directory to measure a second, warm process")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="specfx_soak_")
    summary = run(args.replays)
    keys = ("calls", "errors", "compiles", "compiles_after_first_pass", "compile_seconds", "max_compile_seconds", "warm_call_seconds")
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    print("| " + " | ".join(f"{summary[k]:.2f}" if isinstance(summary[k], float) else str(summary[k]) for k in keys) + " |")
    if summary["first_error"]:
        print("first error:", summary["first_error"]["error"], "at call", summary["first_error"]["call"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
