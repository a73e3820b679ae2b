"""Releasing a generator frees its buffers at once (decision 93).

The CI run of 031a895 lost a pytest worker: every 6000-row generator of the lossless tests kept
its KV buffers (about 2 GB) after the test, because each cache layer held its cache (a reference
cycle), and only Python's cyclic collector, which runs rarely, freed them: the worker reached the
machine's 24 GB. Here the cyclic collector is off while the generator is dropped, so its buffers
must go by reference counting alone. Dynamo's traces leave cyclic garbage of their own that
points at what they traced (collected by Python's collector, not owned by specfx); each test
collects it once, after the generator's last call, before dropping the generator.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import specfx
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.testing.tiny import STATEFUL_TINY, perturbed_copy, tiny_causal_lm
from tests.conftest import pair, prompt


def _buffers(runner) -> list[torch.Tensor]:
    """Every KV and state buffer of ``runner``'s cache."""
    out = []
    for layer in runner.cache.layers:
        out += [
            t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)
        ]
        for name in ("conv_states", "recurrent_states"):
            out += [t for t in (getattr(layer, name, None) or {}).values() if isinstance(t, torch.Tensor)]
    return out


def _stateful():
    target = tiny_causal_lm("qwen3_next", **STATEFUL_TINY["qwen3_next"])
    return target, perturbed_copy(target, 0.03)  # a draft with state of its own (rolled back too)


CASES = {
    "draft_model": lambda: (pair("llama", "perturbed"), {}),
    "prompt_lookup_tree": lambda: (
        (pair("llama", "perturbed")[0], "prompt_lookup"),
        {"tree": specfx.TokenTree.topk(3, 2, 6), "num_speculative_tokens": 6},
    ),
    "eagle3_head": lambda: ((t := pair("llama", "perturbed")[0], Eagle3.random(t, layer_ids=[0, 1, 1], seed=1)), {}),
    "stateful": lambda: (_stateful(), {}),
    "compiled": lambda: (
        pair("llama", "perturbed"),
        {"compile": True, "backend": "specfx_eager", "background_compile": False},
    ),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if c in ("compiled", "eagle3_head") else c for c in sorted(CASES)])
def test_dropping_a_generator_frees_its_buffers_without_the_cyclic_collector(case):
    (target, draft), options = CASES[case]()
    spec = specfx.speculate(target, draft=draft, **{"num_speculative_tokens": 3, "compile": False, **options})
    del draft  # a drafter object (the EAGLE-3 head) holds the target's runner once bound, as its owner may
    ids = prompt(7, batch=2, seed=3)
    torch.manual_seed(0)
    spec.generate(ids, max_new_tokens=8, do_sample=True)
    spec.generate(ids, max_new_tokens=8)
    runners = [spec.target_runner] + [r for r in (getattr(spec.drafter, "runner", None),) if r is not None]
    buffers = [weakref.ref(t) for r in runners for t in _buffers(r)]
    assert len(buffers) >= 4  # KV (or state) of every layer, at least
    owners = [weakref.ref(spec)] + [weakref.ref(r.cache) for r in runners]
    del runners
    gc.collect()  # Dynamo's garbage from the traces above (not specfx's)
    gc.disable()
    try:
        del spec
        alive = [i for i, ref in enumerate(owners + buffers) if ref() is not None]
    finally:
        gc.enable()
    assert alive == [], f"{len(alive)} of the generator's objects and buffers outlived it (a reference cycle)"
