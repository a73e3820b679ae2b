"""The CUDA check of issue 15, items 1 and 2, in one command on a GPU machine.

    PYTHONUNBUFFERED=1 python3 -m specfx.cli bench gpu_check --out-dir $OUT --deadline-s 420

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
- ``hybrid`` (not in the default list): targets with recurrent / linear-attention state, each
  case checked as a drafter is, rounds rejecting so the state rolls back
  (:mod:`.gpu_check_hybrid`).
- ``sampling``: a compiled sampling round on CUDA (runs, finite, tokens in the vocabulary).
- ``bf16``: the reduced-precision rule (``specfx.testing.precision``) on CUDA in bfloat16 for a
  conformance subset, eager, batch 1 and a left-padded batch; Llama also compiled.

Nothing here asserts timing; ``ok`` fields are correctness results. The ``drafters`` section and
the shared prompts and settings are in :mod:`.gpu_check_drafters`.
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

import torch

import specfx
from specfx.bench.tasks.gpu_check_drafters import (
    SETTINGS,
    SkipLog,
    check_drafter,
    left_padded,
    prompt,
    section_drafters,
)
from specfx.bench.tasks.gpu_check_hybrid import section_hybrid
from specfx.testing.precision import check_greedy_agreement
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm

__all__ = ["main"]

BF16_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2", "mixtral", "olmo2", "granite")


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
            draft = perturbed_copy(target, 0.03).to(SETTINGS.device)
            target = target.to(SETTINGS.device)
            if experts:
                target.set_experts_implementation(experts)
                draft.set_experts_implementation(experts)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if dtype == torch.float32:
                    rec = check_drafter(label, dict(draft=draft, num_speculative_tokens=3), target, skiplog)
                else:
                    spec = specfx.speculate(
                        target, draft=draft, num_speculative_tokens=3, compile=True, backend=SETTINGS.backend
                    )
                    ids, mask = left_padded(10, (0, 3, 5), seed=10)
                    ids, mask = ids.to(SETTINGS.device), mask.to(SETTINGS.device)
                    kw = dict(
                        max_new_tokens=24, do_sample=False, attention_mask=mask, eos_token_id=None, pad_token_id=0
                    )
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
    ids, mask = ids.to(SETTINGS.device), mask.to(SETTINGS.device)
    kw = dict(max_new_tokens=24, do_sample=False, attention_mask=mask, eos_token_id=None, pad_token_id=0)
    for label in ("specfx_default", "specfx_batched_mm", "specfx_eager_mode", "hf_static_compiled"):
        try:
            target = tiny_causal_lm("mixtral", num_layers=2, dtype=torch.bfloat16, initializer_range=0.3)
            draft = perturbed_copy(target, 0.03).to(SETTINGS.device)
            target = target.to(SETTINGS.device)
            if label == "specfx_batched_mm":
                target.set_experts_implementation("batched_mm")
                draft.set_experts_implementation("batched_mm")
            ref = target.generate(ids, **kw)
            if label == "hf_static_compiled":
                cc = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
                got = target.generate(ids, cache_implementation="static", compile_config=cc, **kw)
            else:
                spec = specfx.speculate(
                    target, draft=draft, num_speculative_tokens=3, compile=label != "specfx_eager_mode"
                )
                got = spec.generate(ids, **kw)
            d = check_greedy_agreement(target, got, ref, mask)
            rec = dict(
                name=label,
                divergences=[dict(row=x.row, index=x.index, tokens=x.tokens, gap=x.gap, tol=x.tolerance) for x in d],
            )
        except Exception:  # noqa: BLE001
            rec = dict(name=label, error=traceback.format_exc()[-1500:])
        out.append(rec)
        print(f"[moe_bf16] {json.dumps(rec, default=str)[:900]}", flush=True)


def section_sampling(results):
    target = tiny_causal_lm("llama", num_layers=4).to(SETTINGS.device)
    draft = perturbed_copy(tiny_causal_lm("llama", num_layers=4), 0.03).to(SETTINGS.device)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=4, compile=True, backend=SETTINGS.backend)
    ids = prompt(10, batch=4, seed=5).to(SETTINGS.device)
    kw = dict(
        max_new_tokens=32, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, eos_token_id=None, pad_token_id=0
    )
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
                draft = perturbed_copy(target, 0.05).to(SETTINGS.device)
                target = target.to(SETTINGS.device)
                spec = specfx.speculate(
                    target, draft=draft, num_speculative_tokens=4, compile=compiled, backend=SETTINGS.backend
                )
                divs, rows, exact = [], 0, 0
                for ids, mask in [(prompt(12, seed=s), None) for s in range(3)] + [left_padded(10, (4, 1, 0), seed=8)]:
                    ids = ids.to(SETTINGS.device)
                    mask = None if mask is None else mask.to(SETTINGS.device)
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
            print(
                f"[bf16] {arch} compiled={compiled}: ok={rec.get('ok')} rows={rec.get('rows')} exact={rec.get('exact_rows')} "
                f"{(rec.get('error') or '')[-600:]}",
                flush=True,
            )


def section_env(results):
    x = torch.randn(256 * 1024 * 1024, device=SETTINGS.device)  # 1 GiB of fp32
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
    p = argparse.ArgumentParser(prog="specfx bench gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--deadline-s", type=float, default=420)
    p.add_argument("--sections", default="env,drafters,moe,sampling,bf16")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no sync/profile checks)")
    p.add_argument("--backend", default="specfx", help="specfx_eager: trace without Inductor (smoke)")
    p.add_argument("--only", default="", help="comma-separated drafter / hybrid cases to run (default all)")
    args = p.parse_args(argv)
    SETTINGS.device, SETTINGS.backend = torch.device(args.device), args.backend
    SETTINGS.only = [x for x in args.only.split(",") if x]
    deadline = time.monotonic() + args.deadline_s
    out = Path(args.out_dir) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
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
            elif name == "hybrid":
                for _ in section_hybrid(results, deadline):
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
    bad = [
        r.get("name") or r.get("arch")
        for r in results.get("drafters", []) + results.get("hybrid", []) + results.get("bf16", [])
        if r.get("ok") is False
    ]
    print(f"total {sum(results['seconds'].values()):.0f} s; not ok: {bad}", flush=True)
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
