"""The CUDA check of issue 15, items 1 and 2, in one command on a GPU machine.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out-dir $OUT --deadline-s 420

Sections (each guarded: a failure is recorded with its traceback and the next section runs;
the JSON is rewritten after each):

- ``env``: versions, device, the device-to-device copy bandwidth.
- ``drafters``: every drafter compiled on CUDA (tiny fp32 Llama pair, Inductor + CUDA graphs):
  draft model, prompt lookup, early exit, MTP, a static tree, an EAGLE-2 dynamic tree, Medusa,
  EAGLE, EAGLE-3. Per drafter: greedy tokens equal ``model.generate()`` (batch 1 and a
  left-padded batch of 3), the round graphs compiled (one per shape, no recompile on a second
  call), Inductor's CUDA-graph skip messages, warm rounds under
  ``torch.cuda.set_sync_debug_mode("error")``, and a profile of one warm ``generate()``:
  ``cudaGraphLaunch`` calls against rounds run, and the device's busy fraction between the
  first and last kernel of the decode loop (idle gaps = host waits).
- ``sampling``: a compiled sampling round on CUDA (runs, finite, tokens in the vocabulary).
- ``bf16``: the reduced-precision rule (``specfx.testing.precision``) on CUDA in bfloat16 for a
  conformance subset, eager, batch 1 and a left-padded batch; Llama also compiled.

Nothing here asserts timing; ``ok`` fields are correctness results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import specfx  # noqa: E402
from specfx.testing.precision import check_greedy_agreement  # noqa: E402
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm  # noqa: E402
from specfx.trees.types import TokenTree  # noqa: E402

DEV = torch.device("cuda")
BACKEND = "specfx"
ONLY: list = []
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
BF16_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "mixtral", "olmo2", "granite")


def prompt(length, batch=1, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def left_padded(length, pads, seed=0, vocab=128):
    ids = prompt(length, batch=len(pads), vocab=vocab, seed=seed)
    mask = (torch.arange(length) >= torch.tensor(pads).unsqueeze(1)).long()
    return ids * mask, mask


class SkipLog(logging.Handler):
    """Collects Inductor's "skipping cudagraphs due to ..." messages."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        msg = record.getMessage()
        if "cudagraph" in msg.lower() and "skip" in msg.lower():
            self.messages.append(msg[:400])


def profile_generate(fn, rounds_before, spec):
    """Profile one warm call: cudaGraphLaunch count, kernels, device busy fraction, gaps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches = sum(1 for e in prof.events() if e.name == "cudaGraphLaunch")
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
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
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    gaps.sort(reverse=True)
    return dict(
        graph_launches=launches,
        rounds=spec.stats.rounds,
        device_kernels=len(kernels),
        span_us=round(span, 1),
        busy_fraction=round(busy / span, 3) if span else None,
        gaps_over_20us=sum(1 for g in gaps if g > 20),
        largest_gaps_us=[round(g, 1) for g in gaps[:5]],
    )


def drafter_cases():
    """(name, build(target, draft) -> speculate kwargs)."""
    from specfx.drafters.heads.eagle import Eagle
    from specfx.drafters.heads.eagle3 import Eagle3
    from specfx.drafters.heads.medusa import Medusa

    def medusa(t, d):
        c = t.config.get_text_config()
        return dict(draft=Medusa.random(c.hidden_size, t.get_output_embeddings().weight.shape[0], num_heads=3), num_speculative_tokens=3)

    return [
        ("draft_model", lambda t, d: dict(draft=d, num_speculative_tokens=4)),
        ("prompt_lookup", lambda t, d: dict(draft="prompt_lookup", num_speculative_tokens=4)),
        ("early_exit", lambda t, d: dict(draft="early_exit:1", num_speculative_tokens=3)),
        ("tree_draft_model", lambda t, d: dict(draft=d, tree=TREE)),
        ("medusa_tree", lambda t, d: dict(medusa(t, d), tree=TREE, num_speculative_tokens=None)),
        ("eagle_chain", lambda t, d: dict(draft=Eagle.random(t, seed=1), num_speculative_tokens=3)),
        ("eagle_dynamic_tree", lambda t, d: dict(draft=Eagle.random(t, seed=1), tree=TokenTree.eagle2(budget=8, depth=3, branching=3))),
        ("eagle3_tree", lambda t, d: dict(draft=Eagle3.random(t, draft_vocab_size=96, seed=1, layer_ids=[1, 2, 3]), tree=TREE)),
    ]


def check_drafter(name, kwargs, target, skiplog, batch1=False):
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    rec = dict(name=name)
    skiplog.messages.clear()
    t0 = time.monotonic()
    spec = specfx.speculate(target, compile=True, backend=BACKEND, **kwargs)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    ok = True
    for length, pads in [(10, (0, 3, 5)), (7, (2, 0, 0))]:  # second call: new contents, same shapes
        ids, mask = left_padded(length, pads, seed=length)
        ids, mask = ids.to(DEV), mask.to(DEV)
        want = target.generate(ids, attention_mask=mask, **gen)
        got = spec.generate(ids, attention_mask=mask, **gen)
        ok &= bool(torch.equal(got, want))
    if batch1:  # a second round graph (batch bucket 1)
        ids, mask = prompt(12, seed=3).to(DEV), None
        ok &= bool(torch.equal(spec.generate(ids, **gen), target.generate(ids, **gen)))
    gen["attention_mask"] = mask
    rec["greedy_equal"] = ok
    rec["compile_events"] = [str(e.key) for e in spec.compile_events]
    rec["first_calls_s"] = round(time.monotonic() - t0, 1)
    rec["cudagraph_skips"] = list(skiplog.messages)
    # warm again at batch 1 (already compiled), then rounds under the sync detector
    spec.generate(ids, **gen)
    if DEV.type != "cuda":
        rec["ok"] = ok
        return rec
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn = spec.round_fn()
        for _ in range(3):
            fn()
        rec["sync_free_rounds"] = True
    except Exception as e:  # noqa: BLE001
        rec["sync_free_rounds"] = False
        rec["sync_error"] = f"{type(e).__name__}: {e}"[:600]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    rec["profile"] = profile_generate(lambda: spec.generate(ids, **gen), 0, spec)
    rec["compile_events_after"] = [str(e.key) for e in spec.compile_events]
    rec["ok"] = ok and rec["sync_free_rounds"] and not rec["cudagraph_skips"]
    return rec


def section_drafters(results, deadline):
    skiplog = SkipLog()
    if DEV.type == "cuda":  # process-wide logging: only in the GPU run, not in the CPU smoke test
        for lname in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.utils"):
            logging.getLogger(lname).addHandler(skiplog)
        torch._logging.set_logs(perf_hints=True)  # "skipping cudagraphs due to ..." is a perf hint
    target = tiny_causal_lm("llama", num_layers=4).to(DEV)
    draft = perturbed_copy(tiny_causal_lm("llama", num_layers=4), 0.03).to(DEV)
    out = results.setdefault("drafters", [])
    for name, build in drafter_cases():
        if ONLY and name not in ONLY:
            continue
        if time.monotonic() > deadline:
            out.append(dict(name=name, skipped="deadline"))
            continue
        t0 = time.monotonic()
        try:
            rec = check_drafter(name, build(target, draft), target, skiplog, batch1=name == "draft_model")
        except Exception:  # noqa: BLE001
            rec = dict(name=name, ok=False, error=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.monotonic() - t0, 1)
        out.append(rec)
        print(f"[drafters] {name}: ok={rec.get('ok')} {rec.get('seconds')} s "
              f"events={rec.get('compile_events_after')} skips={len(rec.get('cudagraph_skips', []))} "
              f"profile={rec.get('profile')} err={(rec.get('error') or rec.get('sync_error') or '')[-400:]}", flush=True)
        yield
    # MTP: needs a transformers with MtpModel
    if time.monotonic() < deadline and (not ONLY or "mtp" in ONLY):
        t0 = time.monotonic()
        try:
            from specfx.drafters import mtp as mtp_module

            if mtp_module.mtp_support() is None:
                rec = dict(name="mtp", skipped="this transformers has no MtpModel")
            else:
                from tests.unit.drafters.test_mtp import mtp_target

                mt, layers = mtp_target("glm4_moe", 2)
                mt = mt.to(DEV)
                layers = layers.to(DEV)
                rec = check_drafter("mtp", dict(draft=specfx.MTP(layers=layers), num_speculative_tokens=3), mt, skiplog)
        except Exception:  # noqa: BLE001
            rec = dict(name="mtp", ok=False, error=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.monotonic() - t0, 1)
        out.append(rec)
        print(f"[drafters] mtp: ok={rec.get('ok')} {rec}"[:1500], flush=True)


def section_moe(results, deadline):
    """Mixtral compiled on CUDA: float32 with transformers' default experts (a host-syncing
    fallback op: compiled without a CUDA graph, with a warning), float32 with batched_mm
    experts, and bfloat16 (native grouped mm)."""
    import warnings

    out = results.setdefault("moe", [])
    skiplog = SkipLog()
    logging.getLogger("torch._inductor").addHandler(skiplog)
    for label, dtype, experts in [("fp32_default", torch.float32, None), ("fp32_batched_mm", torch.float32, "batched_mm"),
                                  ("bf16_default", torch.bfloat16, None)]:  # fmt: skip
        if time.monotonic() > deadline:
            out.append(dict(name=label, skipped="deadline"))
            continue
        t0 = time.monotonic()
        try:
            target = tiny_causal_lm("mixtral", num_layers=2, dtype=dtype, initializer_range=0.3)
            draft = perturbed_copy(target, 0.03).to(DEV)
            target = target.to(DEV)
            if experts:
                target.set_experts_implementation(experts)
                draft.set_experts_implementation(experts)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if dtype == torch.float32:
                    rec = check_drafter(label, dict(draft=draft, num_speculative_tokens=3), target, skiplog)
                else:
                    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=True, backend=BACKEND)
                    ids, mask = left_padded(10, (0, 3, 5), seed=10)
                    ids, mask = ids.to(DEV), mask.to(DEV)
                    kw = dict(max_new_tokens=24, do_sample=False, attention_mask=mask, eos_token_id=None, pad_token_id=0)
                    ref = target.generate(ids, **kw)
                    got = spec.generate(ids, **kw)
                    d = check_greedy_agreement(target, got, ref, mask)
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        spec.round_fn()()
                        sync_free = True
                    except Exception as e:  # noqa: BLE001
                        sync_free = f"{type(e).__name__}: {e}"[:400]
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    rec = dict(name=label, near_tie_rule=all(x.near_tie for x in d), exact_rows=3 - len(d),
                               sync_free_rounds=sync_free, cudagraph_skips=list(skiplog.messages))  # fmt: skip
                    rec["ok"] = rec["near_tie_rule"] and sync_free is True
            rec["warnings"] = [str(w.message)[:300] for w in caught if "specfx" in str(w.message)]
        except Exception:  # noqa: BLE001
            rec = dict(name=label, ok=False, error=traceback.format_exc()[-2500:])
        rec["seconds"] = round(time.monotonic() - t0, 1)
        out.append(rec)
        print(f"[moe] {label}: {json.dumps(rec, default=str)[:1200]}", flush=True)


def section_moe_bf16(results):
    """Why compiled bf16 Mixtral diverges: the divergences of specfx (compiled, default and
    batched_mm experts) and of HF's own compiled static-cache generate from HF eager."""
    from transformers import CompileConfig

    out = results.setdefault("moe_bf16", [])
    ids, mask = left_padded(10, (0, 3, 5), seed=10)
    ids, mask = ids.to(DEV), mask.to(DEV)
    kw = dict(max_new_tokens=24, do_sample=False, attention_mask=mask, eos_token_id=None, pad_token_id=0)
    for label in ("specfx_default", "specfx_batched_mm", "specfx_eager_mode", "hf_static_compiled"):
        try:
            target = tiny_causal_lm("mixtral", num_layers=2, dtype=torch.bfloat16, initializer_range=0.3)
            draft = perturbed_copy(target, 0.03).to(DEV)
            target = target.to(DEV)
            if label == "specfx_batched_mm":
                target.set_experts_implementation("batched_mm")
                draft.set_experts_implementation("batched_mm")
            ref = target.generate(ids, **kw)
            if label == "hf_static_compiled":
                cc = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
                got = target.generate(ids, cache_implementation="static", compile_config=cc, **kw)
            else:
                spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=label != "specfx_eager_mode")
                got = spec.generate(ids, **kw)
            d = check_greedy_agreement(target, got, ref, mask)
            rec = dict(name=label, divergences=[dict(row=x.row, index=x.index, tokens=x.tokens, gap=x.gap, tol=x.tolerance) for x in d])
        except Exception:  # noqa: BLE001
            rec = dict(name=label, error=traceback.format_exc()[-1500:])
        out.append(rec)
        print(f"[moe_bf16] {json.dumps(rec, default=str)[:900]}", flush=True)


def section_sampling(results):
    target = tiny_causal_lm("llama", num_layers=4).to(DEV)
    draft = perturbed_copy(tiny_causal_lm("llama", num_layers=4), 0.03).to(DEV)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=4, compile=True, backend=BACKEND)
    ids = prompt(10, batch=4, seed=5).to(DEV)
    kw = dict(max_new_tokens=32, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    a = spec.generate(ids, **kw)
    torch.manual_seed(0)
    b = spec.generate(ids, **kw)
    rec = dict(
        shape=list(a.shape),
        in_vocab=bool(((a >= 0) & (a < 128)).all()),
        reproducible=bool(torch.equal(a, b)),
        alpha=spec.stats.accepted / max(1, spec.stats.proposed),
        compile_events=[str(e.key) for e in spec.compile_events],
    )
    rec["ok"] = rec["in_vocab"] and rec["reproducible"]
    results["sampling"] = rec
    print(f"[sampling] {rec}", flush=True)


def section_bf16(results, deadline):
    out = results.setdefault("bf16", [])
    for arch in BF16_ARCHS:
        if time.monotonic() > deadline:
            out.append(dict(arch=arch, skipped="deadline"))
            continue
        for compiled in (False, True) if arch == "llama" else (False,):
            rec = dict(arch=arch, compiled=compiled)
            try:
                target = tiny_causal_lm(arch, initializer_range=0.05, dtype=torch.bfloat16, seed=2)
                draft = perturbed_copy(target, 0.05).to(DEV)
                target = target.to(DEV)
                spec = specfx.speculate(target, draft=draft, num_speculative_tokens=4, compile=compiled, backend=BACKEND)
                divs, rows, exact = [], 0, 0
                for ids, mask in [(prompt(12, seed=s), None) for s in range(3)] + [left_padded(10, (4, 1, 0), seed=8)]:
                    ids = ids.to(DEV)
                    mask = None if mask is None else mask.to(DEV)
                    kw = dict(max_new_tokens=32, do_sample=False, attention_mask=mask)
                    ref = target.generate(ids, **kw)
                    got = spec.generate(ids, **kw)
                    d = check_greedy_agreement(target, got, ref, mask)
                    divs += [dict(row=x.row, index=x.index, gap=x.gap, tol=x.tolerance, near_tie=x.near_tie) for x in d]
                    rows += got.shape[0]
                    exact += got.shape[0] - len(d)
                rec.update(rows=rows, exact_rows=exact, divergences=divs, ok=all(x["near_tie"] for x in divs))
            except Exception:  # noqa: BLE001
                rec.update(ok=False, error=traceback.format_exc()[-2500:])
            out.append(rec)
            print(f"[bf16] {arch} compiled={compiled}: ok={rec.get('ok')} rows={rec.get('rows')} exact={rec.get('exact_rows')} "
                  f"{(rec.get('error') or '')[-600:]}", flush=True)


def section_env(results):
    x = torch.randn(256 * 1024 * 1024, device=DEV)  # 1 GiB of fp32
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    del x, y
    import transformers
    import triton

    results["env"] = dict(
        torch=torch.__version__, transformers=transformers.__version__, triton=triton.__version__,
        device=torch.cuda.get_device_name(), python=sys.version.split()[0],
        copy_bandwidth_TBps=round(2 * 1024**3 / times[len(times) // 2] / 1e12, 2),
    )  # fmt: skip
    print(f"[env] {results['env']}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--deadline-s", type=float, default=420)
    p.add_argument("--sections", default="env,drafters,moe,sampling,bf16")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no sync/profile checks)")
    p.add_argument("--backend", default="specfx", help="specfx_eager: trace without Inductor (smoke)")
    p.add_argument("--only", default="", help="comma-separated drafter cases to run (default all)")
    args = p.parse_args(argv)
    global DEV, BACKEND, ONLY
    DEV, BACKEND, ONLY = torch.device(args.device), args.backend, [x for x in args.only.split(",") if x]
    deadline = time.monotonic() + args.deadline_s
    out = Path(args.out_dir) / "gpu_check.json"
    results: dict = {}

    def save():
        out.write_text(json.dumps(results, indent=1, default=str))

    sections = args.sections.split(",")
    for name in sections:
        t0 = time.monotonic()
        try:
            if name == "env":
                section_env(results)
            elif name == "drafters":
                for _ in section_drafters(results, deadline):
                    save()
            elif name == "moe":
                section_moe(results, deadline)
            elif name == "moe_bf16":
                section_moe_bf16(results)
            elif name == "sampling":
                section_sampling(results)
            elif name == "bf16":
                section_bf16(results, deadline)
        except Exception:  # noqa: BLE001
            results[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"[{name}] FAILED\n{results[f'{name}_error']}", flush=True)
        results.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 1)
        save()
    bad = [r.get("name") or r.get("arch") for r in results.get("drafters", []) + results.get("bf16", []) if r.get("ok") is False]
    print(f"total {sum(results['seconds'].values()):.0f} s; not ok: {bad}", flush=True)
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
