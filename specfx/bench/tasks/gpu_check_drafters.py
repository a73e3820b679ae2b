"""The ``drafters`` section of ``specfx bench gpu_check`` (:mod:`specfx.bench.tasks.gpu_check`):
every drafter compiled on the device, greedy tokens against ``model.generate()``, one round
graph per shape, Inductor's CUDA-graph skips, warm rounds under the sync detector, and a
profile of one warm call; with the prompts and the settings every section shares."""

from __future__ import annotations

import logging
import time
import traceback
from types import SimpleNamespace

import torch

import specfx
from specfx.bench.tasks.gpu_combo import busy_in_window
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm
from specfx.trees.types import TokenTree

__all__ = ["SETTINGS", "SkipLog", "check_drafter", "left_padded", "prompt", "run_cases", "section_drafters", "skip_log"]

# What main() was asked for: the device, the compile backend, the drafter cases to run (empty: all)
SETTINGS = SimpleNamespace(device=torch.device("cuda"), backend="specfx", only=[])
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def prompt(length, batch=1, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def left_padded(length, pads, seed=0, vocab=128):
    ids = prompt(length, batch=len(pads), vocab=vocab, seed=seed)
    mask = (torch.arange(length) >= torch.tensor(pads).unsqueeze(1)).long()
    return ids * mask, mask


class SkipLog(logging.Handler):
    """Collects Inductor's "skipping cudagraphs due to ..." messages, and specfx's own warnings
    (a background compile that failed, so its rounds ran eagerly until a foreground compile)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []
        self.specfx_warnings = []

    def emit(self, record):
        msg = record.getMessage()
        if record.name.startswith("specfx") and record.levelno >= logging.WARNING:
            self.specfx_warnings.append(head_and_tail(msg))
        elif "cudagraph" in msg.lower() and "skip" in msg.lower():
            self.messages.append(msg[:400])


def head_and_tail(text: str, head: int = 600, tail: int = 2400) -> str:
    """A long message for the JSON: its head and its tail (Dynamo's errors end with the user code
    it was tracing, which says where an unsupported operation came from)."""
    return text if len(text) <= head + tail else text[:head] + " [...] " + text[-tail:]


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
    window = busy_in_window(kernels, start=float("-inf"))
    return dict(
        graph_launches=launches,
        rounds=spec.stats.rounds,
        device_kernels=len(kernels),
        span_us=round(window["span_ms"] * 1e3, 1),
        busy_fraction=None if window["busy_fraction"] is None else round(window["busy_fraction"], 3),
        gaps_over_20us=window["gaps_over_20us"],
        largest_gaps_us=window["largest_gaps_us"],
    )


def drafter_cases():
    """(name, build(target, draft) -> speculate kwargs)."""
    from specfx.drafters.heads.eagle import Eagle
    from specfx.drafters.heads.eagle3 import Eagle3
    from specfx.drafters.heads.medusa import Medusa

    def medusa(t, d):
        c = t.config.get_text_config()
        return dict(
            draft=Medusa.random(c.hidden_size, t.get_output_embeddings().weight.shape[0], num_heads=3),
            num_speculative_tokens=3,
        )

    return [
        ("draft_model", lambda t, d: dict(draft=d, num_speculative_tokens=4)),
        # a PARD block draft: one forward of window + K tokens per round (mask id: any id the prompts avoid)
        ("pard", lambda t, d: dict(draft=specfx.Pard(d, mask_token_id=1), num_speculative_tokens=4)),
        # a DFlash block draft over the target's tapped hidden states: one block forward per round
        ("dflash", lambda t, d: dict(draft=specfx.DFlash.random(t, block_size=5, seed=1), num_speculative_tokens=4)),
        ("prompt_lookup", lambda t, d: dict(draft="prompt_lookup", num_speculative_tokens=4)),
        ("early_exit", lambda t, d: dict(draft="early_exit:1", num_speculative_tokens=3)),
        # trees pinned (num_speculative_tokens = the node count): the tree every round, never "auto"'s K = 0
        ("tree_draft_model", lambda t, d: dict(draft=d, tree=TREE, num_speculative_tokens=TREE.size)),
        ("medusa_tree", lambda t, d: dict(medusa(t, d), tree=TREE, num_speculative_tokens=TREE.size)),
        ("eagle_chain", lambda t, d: dict(draft=Eagle.random(t, seed=1), num_speculative_tokens=3)),
        (
            "eagle_dynamic_tree",
            lambda t, d: dict(
                draft=Eagle.random(t, seed=1), tree=TokenTree.eagle2(budget=8, depth=3, branching=3), num_speculative_tokens=8
            ),
        ),
        (
            "eagle3_tree",
            lambda t, d: dict(
                draft=Eagle3.random(t, draft_vocab_size=96, seed=1, layer_ids=[1, 2, 3]),
                tree=TREE,
                num_speculative_tokens=TREE.size,
            ),
        ),
    ]


def torch_counts(since: dict | None = None) -> dict:
    """Process-wide compile counters torch keeps (read only): Dynamo's graphs and graph breaks, and
    Inductor's CUDA-graph skips, which it counts even where the skip's log message is not enabled;
    ``since``: an earlier reading, subtracted (one case's share)."""
    from torch._dynamo.utils import counters

    now = {
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def check_drafter(name, kwargs, target, skiplog, batch1=False):
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    rec = dict(name=name)
    before = torch_counts()
    skiplog.messages.clear()
    skiplog.specfx_warnings.clear()
    t0 = time.monotonic()
    spec = specfx.speculate(target, compile=True, backend=SETTINGS.backend, **kwargs)
    gen = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    ok = True
    for length, pads in [(10, (0, 3, 5)), (7, (2, 0, 0))]:  # second call: new contents, same shapes
        ids, mask = left_padded(length, pads, seed=length)
        ids, mask = ids.to(SETTINGS.device), mask.to(SETTINGS.device)
        want = target.generate(ids, attention_mask=mask, **gen)
        got = spec.generate(ids, attention_mask=mask, **gen)
        ok &= bool(torch.equal(got, want))
    if batch1:  # a second round graph (batch bucket 1)
        ids, mask = prompt(12, seed=3).to(SETTINGS.device), None
        ok &= bool(torch.equal(spec.generate(ids, **gen), target.generate(ids, **gen)))
    gen["attention_mask"] = mask
    rec["greedy_equal"] = ok
    rec["accepted"], rec["proposed"] = spec.stats.accepted, spec.stats.proposed  # the last call's
    rec["compile_events"] = [str(e.key) for e in spec.compile_events]
    rec["first_calls_s"] = round(time.monotonic() - t0, 1)
    rec["cudagraph_skips"] = list(skiplog.messages)
    # warm again at batch 1 (already compiled), then rounds under the sync detector
    spec.generate(ids, **gen)
    if SETTINGS.device.type != "cuda":
        spec.round_fn()()  # the round the CUDA path runs under the sync detector (a hybrid's failed there in run 9)
        rec["torch_counts"] = torch_counts(since=before)
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
        rec["sync_error"] = head_and_tail(f"{type(e).__name__}: {e}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    rec["profile"] = profile_generate(lambda: spec.generate(ids, **gen), 0, spec)
    rec["compile_events_after"] = [str(e.key) for e in spec.compile_events]
    rec["specfx_warnings"] = list(skiplog.specfx_warnings)
    rec["torch_counts"] = torch_counts(since=before)
    rec["ok"] = ok and rec["sync_free_rounds"] and not rec["cudagraph_skips"]
    return rec


_SKIPLOG: SkipLog | None = None


def skip_log() -> SkipLog:
    """The process's collector of Inductor's CUDA-graph skip messages, attached to Inductor's
    loggers on first use in a CUDA run (process-wide logging: only there, never in the CPU smoke
    test); every section that checks graphs shares it."""
    global _SKIPLOG
    if _SKIPLOG is None:
        _SKIPLOG = SkipLog()
        if SETTINGS.device.type == "cuda":
            for lname in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.utils", "specfx"):
                logging.getLogger(lname).addHandler(_SKIPLOG)
            torch._logging.set_logs(perf_hints=True)  # "skipping cudagraphs due to ..." is a perf hint
    return _SKIPLOG


def run_cases(section: str, out: list, cases, deadline):
    """Run ``cases`` (``(name, check() -> record)`` pairs; ``SETTINGS.only`` filters by name) in
    turn until ``deadline``, appending each record (a failure: its traceback) to ``out`` and
    printing one line; yields after each so the caller can save the JSON."""
    for name, check in cases:
        if SETTINGS.only and name not in SETTINGS.only:
            continue
        if time.monotonic() > deadline:
            out.append(dict(name=name, skipped="deadline"))
            continue
        t0 = time.monotonic()
        try:
            rec = check()
        except Exception:  # noqa: BLE001
            rec = dict(name=name, ok=False, error=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.monotonic() - t0, 1)
        out.append(rec)
        print(
            f"[{section}] {name}: ok={rec.get('ok')} {rec.get('seconds')} s "
            f"events={rec.get('compile_events_after')} skips={len(rec.get('cudagraph_skips', []))} "
            f"profile={rec.get('profile')} "
            f"err={(rec.get('error') or rec.get('sync_error') or rec.get('reason') or '')[-400:]}",
            flush=True,
        )
        yield


def section_drafters(results, deadline):
    skiplog = skip_log()
    target = tiny_causal_lm("llama", num_layers=4).to(SETTINGS.device)
    draft = perturbed_copy(tiny_causal_lm("llama", num_layers=4), 0.03).to(SETTINGS.device)
    cases = [
        (name, lambda name=name, build=build: check_drafter(
            name, build(target, draft), target, skiplog, batch1=name == "draft_model"))
        for name, build in drafter_cases()
    ]  # fmt: skip
    out = results.setdefault("drafters", [])
    yield from run_cases("drafters", out, cases, deadline)
    # MTP: needs a transformers with MtpModel
    if time.monotonic() < deadline and (not SETTINGS.only or "mtp" in SETTINGS.only):
        t0 = time.monotonic()
        try:
            from specfx.drafters import mtp as mtp_module

            if mtp_module.mtp_support() is None:
                rec = dict(name="mtp", skipped="this transformers has no MtpModel")
            else:
                from specfx.testing.mtp import mtp_target

                mt, layers = mtp_target("glm4_moe", 2)
                mt = mt.to(SETTINGS.device)
                layers = layers.to(SETTINGS.device)
                rec = check_drafter("mtp", dict(draft=specfx.MTP(layers=layers), num_speculative_tokens=3), mt, skiplog)
        except Exception:  # noqa: BLE001
            rec = dict(name="mtp", ok=False, error=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.monotonic() - t0, 1)
        out.append(rec)
        print(f"[drafters] mtp: ok={rec.get('ok')} {rec}"[:1500], flush=True)
