"""Soak: one compiled generator serving a long mixed workload, as a chat server or a notebook
session would use it (issue 16).

One Inductor-compiled generator takes 60+ calls mixing batch sizes (1, 2, 3: buckets 1, 2, 4),
prompt lengths (1..60, ragged within a batch), max_new_tokens (1..40) and every sampling
setting. Checked: no call fails; greedy output equals HF's; sampled output equals an eager
generator's with the same seed; after one pass over each class, replaying compiles nothing
(``error_on_recompile``); the compiled graphs stay within the documented policy (one round
graph per batch bucket and mode at the current capacity and live-KV bound, at most ``max_graphs``); resident memory is flat
over the second half.
"""

from __future__ import annotations

import random

import pytest
import torch

import specfx
from specfx.sampling.processors import TOPK_BOUND, Mode
from specfx.testing.soak import CLASSES, MODES, REPLAYS, growing_request, soak_request
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm

GREEDY = Mode(False, penalty=False)  # the graph mode of HF's defaults: greedy, no penalty, no sorts

pytestmark = [pytest.mark.compiled, pytest.mark.usefixtures("one_thread")]

def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.fixture(scope="module")
def soak():
    target = tiny_causal_lm("llama")
    draft = perturbed_copy(target, 0.03)
    # foreground compiles: the policy below counts what each call compiled. Compiling in the
    # background, a batch bucket's graphs compile only while its state is allocated, so a
    # workload that switches buckets every call leaves most of them eager (decision 67, limits)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, background_compile=False)
    eager = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    return target, spec, eager


def _check(call: int, target, spec, eager, batch: int, mode: str, rng: random.Random) -> None:
    ids, mask, new = soak_request(batch, rng)
    kwargs = dict(attention_mask=mask, max_new_tokens=new, pad_token_id=0, **MODES[mode])
    torch.manual_seed(call)
    out = spec.generate(ids, **kwargs)
    if kwargs.get("do_sample"):
        torch.manual_seed(call)
        assert torch.equal(out, eager.generate(ids, **kwargs)), f"call {call}: compiled sampling != eager"
    else:
        assert torch.equal(out, target.generate(ids, **kwargs)), f"call {call}: greedy != HF"


@pytest.mark.full
def test_long_lived_generator_serves_a_mixed_workload(soak):
    target, spec, eager = soak
    rng = random.Random(0)
    # a long first request grows the buffers once (capacity 512), before any graph compiles
    ids, _, new = growing_request()
    assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
    for call, (batch, mode) in enumerate(CLASSES):
        _check(call, target, spec, eager, batch, mode, rng)
    compiled = len(spec.compile_events)
    # the policy: one round graph per batch bucket and graph mode at the current capacity and
    # live-KV bound (both only grow: 100 + 156 + K + 2 = 261 tokens -> 512 slots, 320 read). The
    # modes of MODES: greedy; greedy with a penalty; sampling (HF's default top_k=50, and top_k=20:
    # top-k by torch.topk, decision 87); and sampling with a penalty and top_p (top_k 50 too)
    modes = {
        Mode(False, penalty=False),
        Mode(False, penalty=True),
        Mode(True, penalty=False, top_k=TOPK_BOUND, top_p=False),
        Mode(True, penalty=True, top_k=TOPK_BOUND, top_p=True),
    }
    assert {e.key for e in spec.compile_events} == {("round", b, 512, 3, m, False, 320) for b in (1, 2, 4) for m in modes}
    assert len(spec.graph_cache) <= spec.max_graphs == 16  # max_graphs=None: 16 per K (one K here)

    rss = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(REPLAYS):
            batch, mode = CLASSES[(7 * i) % len(CLASSES)]
            _check(100 + i, target, spec, eager, batch, mode, rng)
            rss.append(_rss_mb())
    assert len(spec.compile_events) == compiled  # warm: nothing compiled
    half = REPLAYS // 2
    assert max(rss[half:]) - rss[half] < 32, f"resident memory grew over the second half: {rss[half]:.0f} -> {max(rss[half:]):.0f} MB"


def test_lru_policy_evicts_beyond_max_graphs(one_thread):
    """With max_graphs=2, a third batch bucket evicts the least recently used round graph."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    target = tiny_causal_lm("llama")
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, max_graphs=2, backend="specfx_eager")
    codes = {}
    for batch in (1, 2, 4, 1):
        ids = torch.randint(3, 128, (batch, 5), generator=torch.Generator().manual_seed(batch))
        assert torch.equal(spec.generate(ids, max_new_tokens=6), target.generate(ids, max_new_tokens=6))
        codes.setdefault(batch, spec.graph_cache.code(("round", batch, 256, 2, GREEDY, False, 64)))
    assert spec.graph_cache.keys() == [("round", 4, 256, 2, GREEDY, False, 64), ("round", 1, 256, 2, GREEDY, False, 64)]
    assert [e.key[1] for e in spec.compile_events] == [1, 2, 4, 1]  # batch 1 was evicted, then compiled again
    # what Dynamo compiled for an evicted variant is freed, not merely forgotten
    assert _debug_get_cache_entry_list(codes[2]) == [] and _debug_get_cache_entry_list(codes[1]) == []
    assert len(_debug_get_cache_entry_list(spec.graph_cache.code(("round", 1, 256, 2, GREEDY, False, 64)))) == 1


def test_each_compile_is_recorded_once_with_several_rounds_per_sync(one_thread):
    """The host loop calls a new variant's callable once per round between syncs: the compile
    used to be recorded (and logged) once per call."""
    target = tiny_causal_lm("llama")
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, rounds_per_sync=3, backend="specfx_eager")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(spec.generate(ids, max_new_tokens=12), target.generate(ids, max_new_tokens=12))
    assert [e.key for e in spec.compile_events] == [("round", 1, 256, 2, GREEDY, False, 64)]
