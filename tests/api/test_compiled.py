"""Compiled rounds: one graph, no graph breaks, no recompiles once warm, no host sync.

Inductor compiles on CPU take tens of seconds per graph, so this module builds one compiled
generator and runs every check against it (module-scoped fixture). It compiles in the caller's
thread (``background_compile=False``): with the CPU default (background compiles) the first
greedy call and the sampling call would run eagerly while their graphs compile, and these tests
would compare eager rounds with eager rounds.
"""

import pytest
import torch

import specfx
from specfx.passes.checks.no_host_sync import offending_nodes
from tests.conftest import pair, prompt

pytestmark = pytest.mark.compiled


@pytest.fixture(scope="module")
def compiled():
    target, d = pair("llama", "perturbed")
    spec = specfx.speculate(
        target, draft=d, num_speculative_tokens=3, compile=True, compile_prefill=True, background_compile=False
    )
    ids = prompt(9, seed=1)
    first = spec.generate(ids, max_new_tokens=30)
    return spec, target, d, ids, first


def test_compiled_greedy_equals_generate(compiled):
    spec, target, _, ids, first = compiled
    assert torch.equal(first, target.generate(ids, max_new_tokens=30))


def test_one_round_graph_and_one_prefill_graph(compiled):
    spec = compiled[0]
    # fullgraph=True would have raised on any graph break; one graph per compiled function
    assert len(spec.graphs) == 2
    round_graph = max(spec.graphs, key=lambda g: g.nodes)
    assert round_graph.report.sites[1] == ("check_static_kv", 2 * 2 * (3 + 1))  # (k, v) x layers x forwards
    assert dict(round_graph.report.sites)["prune_logits"] >= 1
    assert "graph 1:" in spec.explain()


def test_round_graph_has_no_host_sync_ops(compiled):
    for g in compiled[0].graphs:
        assert offending_nodes(g.graph_module) == []
        ops = " ".join(g.ops)
        for forbidden in ("nonzero", ".item", ".tolist", "masked_select"):
            assert forbidden not in ops


def test_warm_calls_with_new_lengths_compile_nothing(compiled):
    spec, target, _, _, _ = compiled
    before = len(spec.graphs)
    for length, new in [(3, 7), (14, 19), (9, 30)]:  # same prefill bucket (16), any max_new_tokens
        ids = prompt(length, seed=length + 100)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
    assert len(spec.graphs) == before


@pytest.mark.full  # the sampling round and prefill lowered (about 85 s); CI's newest run includes it
@pytest.mark.ci
def test_compiled_sampling_reproduces_eager_stream(compiled):
    spec, target, d, ids, _ = compiled
    eager = specfx.speculate(target, draft=d, num_speculative_tokens=3, compile=False)
    kw = dict(max_new_tokens=25, do_sample=True, temperature=0.8, top_p=0.9)
    greedy_graphs = len(spec.graphs)
    torch.manual_seed(5)
    a = spec.generate(ids, **kw)
    assert len(spec.graphs) == greedy_graphs + 2  # the sampling round and prefill, compiled and run in that call
    torch.manual_seed(5)
    b = eager.generate(ids, **kw)
    assert torch.equal(a, b)  # the counter-based stream is identical in both modes
    torch.manual_seed(6)
    assert not torch.equal(a, spec.generate(ids, **kw))


def test_backend_name_resolves_through_entry_point():
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: (x * 2).sum(-1), backend='specfx_eager')\n"
        "assert f(torch.ones(2, 3)).tolist() == [6.0, 6.0]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_warm_rounds_do_not_sync():
    target, d = pair("llama", "perturbed")
    target, d = target.cuda(), d.cuda()
    spec = specfx.speculate(target, draft=d, num_speculative_tokens=3, compile=True)
    ids = prompt(9).cuda()
    expected = target.generate(ids, max_new_tokens=20)
    assert torch.equal(spec.generate(ids, max_new_tokens=20), expected)
    spec.generate(ids, max_new_tokens=20)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            spec.round_fn()()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    target.cpu(), d.cpu()
