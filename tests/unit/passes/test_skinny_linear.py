"""skinny_linear: in specfx's own graphs, a CPU float32 linear over a few rows becomes
``W @ xᵀ`` (one row fed twice); the values stay the linear's (float rounding aside), and
everything it cannot prove (dtype, device, rows, size, shapes) is left alone."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

import specfx
import specfx.passes.rewrites.skinny_linear as skinny_module
from specfx.passes import make_backend
from specfx.passes.pipeline import default_stages, run_passes
from specfx.testing.tiny import tiny_causal_lm


@pytest.fixture
def small_threshold(monkeypatch):
    """Rewrite the tiny test weights too (the real threshold is 64k elements)."""
    monkeypatch.setattr(skinny_module, "MIN_WEIGHT_ELEMENTS", 64)


_CAPTURES = itertools.count()


def capture(fn, *args, own_graph=True):
    """Capture ``fn`` with Dynamo and run the default pipeline on it (own_graph=...) eagerly."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(run_passes(gm, round_checks=False, own_graph=own_graph))
        return gm.forward

    # a fresh code object per capture: Dynamo's cache (and its recompile limit) is per code object
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_CAPTURES)}")
    fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)

    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return out, dict(seen[0].sites)


@pytest.mark.parametrize("rows", [(1, 1), (1,), (1, 3), (2, 2), (5,)])
@pytest.mark.parametrize("bias", [False, True])
def test_rewrites_and_keeps_the_values(small_threshold, rows, bias):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    x = torch.randn(*rows, 16, generator=g)

    def f(x):
        return torch.nn.functional.linear(x, w, b if bias else None).float() * 2

    out, sites = capture(f, x)
    assert sites["skinny_linear"] == 1
    torch.testing.assert_close(out, f(x), rtol=1e-5, atol=1e-5)


def test_leaves_alone_what_does_not_fit(small_threshold):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 16, generator=g)
    cases = {
        "too many rows": (torch.randn(1, 6, 16, generator=g), w),  # 6 rows > MAX_ROWS (5)
        "bfloat16": (torch.randn(1, 2, 16, generator=g).bfloat16(), w.bfloat16()),
        "small weight": (torch.randn(1, 2, 4, generator=g), torch.randn(8, 4, generator=g)),  # 32 < 64
    }
    for name, (x, weight) in cases.items():
        _, sites = capture(lambda x, weight=weight: torch.nn.functional.linear(x, weight), x)
        assert sites["skinny_linear"] == 0, name


def test_not_in_user_graphs(small_threshold):
    w = torch.randn(40, 16)
    _, sites = capture(lambda x: torch.nn.functional.linear(x, w), torch.randn(1, 2, 16), own_graph=False)
    assert "skinny_linear" not in sites
    assert "skinny_linear" not in [s.name for s in default_stages()]
    with pytest.raises(ValueError, match="own_graph="):
        run_passes(torch.fx.symbolic_trace(lambda x: x + 1), [], own_graph=True)


def test_the_real_threshold_spares_small_weights():
    assert skinny_module.MIN_WEIGHT_ELEMENTS == 1 << 16
    w = torch.randn(512, 64)  # 32k elements: a weight that sits in the cache
    _, sites = capture(lambda x: torch.nn.functional.linear(x, w), torch.randn(1, 2, 64))
    assert sites["skinny_linear"] == 0


@pytest.mark.compiled
@pytest.mark.full
@pytest.mark.ci
def test_greedy_output_unchanged_with_every_linear_rewritten(small_threshold):
    """A compiled generator whose every projection (and LM head) is rewritten gives HF's tokens."""
    model = tiny_causal_lm("llama", seed=0)
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=2, background_compile=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=10), ref)
    sites = [dict(g.report.sites).get("skinny_linear", 0) for g in spec.graphs]
    assert max(sites) > 0


def test_backend_runs_it_only_for_its_own_graphs(small_threshold, monkeypatch):
    stages = []
    real = run_passes

    def spy(gm, *a, **kw):
        stages.append(kw.get("own_graph"))
        return real(gm, *a, **kw)

    monkeypatch.setattr("specfx.passes.backend.run_passes", spy)
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", lambda gm, inputs, **kw: gm.forward)
    w = torch.randn(40, 16)

    def round_graph(x):
        return torch.nn.functional.linear(x, w)

    def user_code(x):  # a separate code object: its own Dynamo cache
        return torch.nn.functional.linear(x, w)

    torch.compile(round_graph, backend=make_backend("specfx", round_graphs=True))(torch.randn(1, 2, 16))
    torch.compile(user_code, backend=make_backend("specfx", round_graphs=False))(torch.randn(1, 2, 16))
    assert stages == [True, False]
