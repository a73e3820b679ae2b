"""Issue 30 item 2: where the 8B round's device time goes, and what fused weight layouts would buy.

1. Kernel table: specfx's compiled oracle round (α = 1, K = 4) on the 8B Llama shape (bf16,
   batch 1, context 512), one warm generate() call under torch.profiler; device time per kernel
   name in the decode loop (after the first CUDA-graph launch), grouped into GEMMs, attention,
   Inductor's fused kernels and the rest, per round.
2. GEMM layouts: the bf16 projections of one 8B layer at M = 1/5/16/80 rows, as the model runs
   them (q, k, v, o, gate, up, down: 7 GEMMs) and with shared-input weights concatenated (qkv,
   o, gate_up, down: 4 GEMMs), over 8 distinct layers' weights (3.5 GB, far above the L2) in one
   CUDA graph; and the LM head alone. Achieved bandwidth against the measured copy bandwidth.

    python3 benchmarks/gpu_round_kernels.py --out $OUT/round_kernels.json     # on the GPU
    python3 benchmarks/gpu_round_kernels.py --smoke                            # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from specfx.bench.floor import measure_copy_bandwidth
from specfx.bench.oracle import OracleDrafter, greedy_continuation
from specfx.bench.tasks.gpu_combo import make_spec, profile_decode
from specfx.bench.tasks.gpu_plan import build_model


def kind_of(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "triton_mm", "splitk", "cublas")):
        return "gemm"
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "efficient")):
        return "attention"
    if n.startswith("triton_"):
        return "inductor_fused"
    return "other"


def kernel_table(args, dev) -> dict:
    ns = SimpleNamespace(
        device=str(dev), dtype=args.dtype, init_range=0.02, weights="peaked", contexts=[args.context],
        new_tokens=args.new_tokens, k=4, backend=args.backend, rounds_per_sync=1, compile_prefill=False,
        inductor_options=None,
    )  # fmt: skip
    target = build_model(args.shape, ns, 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (1, args.context), generator=g).to(dev)
    mask = torch.ones_like(ids)
    reference = greedy_continuation(target, ids, mask, new_tokens=args.new_tokens + 5)
    spec = make_spec(target, OracleDrafter(1.0, reference), ns, args.context)
    t0 = time.perf_counter()
    spec.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens)
    compile_s = time.perf_counter() - t0
    spec.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        spec.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    rounds = spec.stats.rounds
    events = list(prof.events())
    launches = sorted(e.time_range.start for e in events if e.name == "cudaGraphLaunch")
    start = launches[0] if launches else 0.0
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= start:
            per_name[e.name].append(e.time_range.end - e.time_range.start)
    rows = sorted(((sum(v), len(v), n) for n, v in per_name.items()), reverse=True)
    by_kind: dict[str, float] = defaultdict(float)
    for total, _, n in rows:
        by_kind[kind_of(n)] += total
    total = sum(by_kind.values())
    out = dict(
        shape=args.shape, context=args.context, new_tokens=args.new_tokens, rounds=rounds, compile_s=compile_s,
        kernels_per_round=sum(c for _, c, _ in rows) / max(rounds, 1),
        device_ms_per_round=total / 1e3 / max(rounds, 1),
        by_kind_ms_per_round={k: v / 1e3 / max(rounds, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        top=[dict(name=n[:160], kind=kind_of(n), ms_per_round=t / 1e3 / max(rounds, 1), calls_per_round=c / max(rounds, 1))
             for t, c, n in rows[:30]],
        profile=profile_decode(lambda: spec.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens), spec, dev),
    )  # fmt: skip
    return out


def gemm_layouts(args, dev, bandwidth) -> dict:
    H, KV, inter, V = args.gemm_dims
    dtype = getattr(torch, args.dtype)
    layouts = {
        "separate (q, k, v, o, gate, up, down)": [(H, H), (KV, H), (KV, H), (H, H), (inter, H), (inter, H), (H, inter)],
        "concatenated (qkv, o, gate_up, down)": [(H + 2 * KV, H), (H, H), (2 * inter, H), (H, inter)],
        "lm_head": [(V, H)],
    }
    out = {}
    for name, shapes in layouts.items():
        layers = 1 if name == "lm_head" else args.layers
        weights = [[torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for n, k in shapes] for _ in range(layers)]
        nbytes = layers * sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
        for m in args.rows:
            xs = {k: torch.randn(m, k, device=dev, dtype=dtype) for k in {k for _, k in shapes}}

            def run(weights=weights, xs=xs, shapes=shapes):
                for ws in weights:
                    for (_, k), w in zip(shapes, ws, strict=True):
                        F.linear(xs[k], w)

            # time_graph gives the time of one run(): the LM head is captured `layers` times per graph
            secs = time_graph(run, dev, reps=1 if name != "lm_head" else args.layers)
            out[f"{name} M={m}"] = dict(
                ms_per_layer=1e3 * secs / layers, bytes_per_layer=nbytes // layers,
                fraction_of_copy_bandwidth=nbytes / secs / bandwidth if bandwidth else None,
            )  # fmt: skip
            print(f"  {name:40s} M={m:3d}: {1e3 * secs / layers:8.4f} ms per layer, "
                  f"{out[f'{name} M={m}']['fraction_of_copy_bandwidth']:.2f} of copy bandwidth", flush=True)  # fmt: skip
        del weights
    return out


def time_graph(run, dev, reps: int = 1, iters: int = 10) -> float:
    """Median seconds of one ``run()`` (``reps`` of them captured per graph on CUDA)."""
    if dev.type != "cuda":
        run()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            run()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    p.add_argument("--skip-kernels", action="store_true")
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.smoke else "cuda")
    args.shape, args.context = ("tiny", 24) if args.smoke else ("8b", 512)
    args.new_tokens = 16 if args.smoke else 128
    args.dtype = "float32" if args.smoke else "bfloat16"
    args.backend = "specfx_eager" if args.smoke else "specfx"
    args.gemm_dims = (64, 16, 128, 256) if args.smoke else (4096, 1024, 14336, 128256)
    args.layers = 2 if args.smoke else 8
    args.rows = (1, 5) if args.smoke else (1, 5, 16, 80)
    bandwidth = measure_copy_bandwidth(dev)
    result = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                  copy_bandwidth=bandwidth)  # fmt: skip
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)

    def save():
        if args.out:
            args.out.write_text(json.dumps(result, indent=1, default=str))

    print("GEMM layouts (one layer's projections; 8 layers' distinct weights per CUDA graph):", flush=True)
    with torch.no_grad():
        result["gemm"] = gemm_layouts(args, dev, bandwidth)
    save()
    if not args.skip_kernels:
        result["kernels"] = k = kernel_table(args, dev)
        save()
        print(f"round: {k['rounds']} rounds, {k['kernels_per_round']:.0f} kernels and {k['device_ms_per_round']:.3f} ms "
              f"of device time per round (compile {k['compile_s']:.0f} s); by kind (ms per round): "
              + ", ".join(f"{n} {v:.3f}" for n, v in k["by_kind_ms_per_round"].items()))  # fmt: skip
        for r in k["top"][:20]:
            print(f"  {r['ms_per_round']:7.4f} ms  x{r['calls_per_round']:5.1f}  {r['kind']:15s} {r['name'][:110]}")
        pr = k["profile"]
        print(f"busy {pr.get('busy_fraction')} of the decode loop, {pr.get('gaps_over_20us')} gaps > 20 us, "
              f"idle {pr.get('idle_ms')} ms over {pr.get('span_ms')} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
