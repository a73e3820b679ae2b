"""The passes on small captured graphs, through the specfx_eager backend (no Inductor)."""

import pytest
import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from specfx.passes import (
    REWRITES,
    ROUND_CHECKS,
    HostSyncError,
    LiveKV,
    PassError,
    Stage,
    capture_transform,
    default_stages,
    make_backend,
    prune_logits,
    remove_dead_code,
    run_passes,
    specfx_eager_backend,
)
from specfx.passes.checks.no_host_sync import check_no_host_sync


def capture(fn, *args):
    records = []
    compiled = torch.compile(fn, backend=make_backend("specfx_eager", records), fullgraph=True)
    return compiled(*args), records


def test_prune_logits_moves_selection_before_linear_and_keeps_values():
    torch.manual_seed(0)
    w = torch.randn(50, 8)

    def head(h):
        logits = torch.nn.functional.linear(h, w)
        return (torch.tanh(logits.float() / 3.0) * 3.0)[:, -1:]

    h = torch.randn(2, 7, 8)
    out, records = capture(head, h)
    assert torch.allclose(out, head(h))
    assert dict(records[0].report.sites)["prune_logits"] == 1
    gm = records[0].graph_module
    lin = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert lin[0].args[0].target.__name__ == "getitem"


def test_prune_logits_leaves_full_use_alone():
    w = torch.randn(5, 4)
    gm = fx.symbolic_trace(lambda h: torch.nn.functional.linear(h, w) + 1)
    assert prune_logits(gm) == 0


def test_dead_logits_are_removed_but_inplace_writes_kept():
    w = torch.randn(20, 4)
    buf = torch.zeros(3)

    def f(h):
        torch.nn.functional.linear(h, w)  # unused: dead
        buf.add_(1)
        return h * 2

    out, records = capture(f, torch.ones(1, 2, 4))
    assert torch.equal(out, torch.full((1, 2, 4), 2.0))
    assert buf.tolist() == [1.0, 1.0, 1.0]
    assert dict(records[0].report.sites)["remove_dead_code"] >= 1
    assert not any("linear" in str(n.target) for n in records[0].graph_module.graph.nodes)


def test_host_sync_check_names_the_op():
    gm = fx.symbolic_trace(lambda x: torch.nonzero(x))
    with pytest.raises(HostSyncError, match="nonzero"):
        check_no_host_sync(gm)


def test_driver_names_failing_pass_and_predecessors():
    gm = fx.symbolic_trace(lambda x: x + 1)

    def broken(gm):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match=r"'broken' failed after passes \['check_no_host_sync'\]: boom"):
        run_passes(gm, passes=(check_no_host_sync, broken))


def shaped(fn, *args) -> fx.GraphModule:
    """``fn`` traced with the shapes of ``args`` in node meta, as a rewriting pass needs them."""
    gm = fx.symbolic_trace(fn)
    ShapeProp(gm).propagate(*args)
    return gm


def test_round_checks_still_raise_for_specfx_own_graphs():
    """make_backend(name, records), as the generator calls it, keeps the round invariants."""
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        capture(lambda x: x.cpu() + 1, torch.ones(2))
    cause = info.value.inner_exception
    assert isinstance(cause, PassError) and isinstance(cause.__cause__, HostSyncError)
    assert "check_no_host_sync" in str(cause) and ".cpu()" in str(cause)


def test_round_checks_off_runs_only_rewrites_and_never_raises_on_host_sync():
    gm = fx.symbolic_trace(lambda x: x.cpu() + 1)
    report = run_passes(gm, round_checks=False)
    assert [name for name, _ in report.sites] == [p.__name__ for p in REWRITES]
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 2.0))


def test_round_checks_on_reject_host_sync_introduced_by_a_pass():
    def adds_item(gm):
        x = next(iter(gm.graph.nodes))
        with gm.graph.inserting_after(x):
            gm.graph.call_method("item", (x,))
        return 1

    gm = fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(PassError, match="'adds_item'.*item"):
        run_passes(gm, passes=(adds_item,))
    gm = fx.symbolic_trace(lambda x: x + 1)
    assert run_passes(gm, passes=(adds_item,), round_checks=False).sites == [("adds_item", 1)]


def test_registered_backends_compile_host_syncing_code():
    """Inductor ("specfx") on the same functions: tests/unit/passes/test_backend_corpus.py."""
    out = torch.compile(lambda x: x.cpu() + 1, backend=specfx_eager_backend, fullgraph=True)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))


def test_prune_logits_skips_feature_selection_on_2d_linear():
    w = torch.randn(8, 4)
    gm = shaped(lambda x: torch.nn.functional.linear(x, w)[:, :2], torch.randn(3, 4))
    assert prune_logits(gm) == 0


def test_prune_logits_skips_without_shape_meta():
    w = torch.randn(8, 4)
    gm = fx.symbolic_trace(lambda h: torch.nn.functional.linear(h, w)[:, -1])
    assert prune_logits(gm) == 0


def test_prune_logits_prunes_3d_with_shape_meta_and_records_new_shapes():
    w = torch.randn(8, 4)
    h = torch.randn(2, 5, 4)
    gm = shaped(lambda h: (torch.nn.functional.linear(h, w) * 2.0)[:, -1, :], h)
    assert prune_logits(gm) == 1
    gm.recompile()
    assert torch.allclose(gm(h), (torch.nn.functional.linear(h, w) * 2.0)[:, -1, :])


@pytest.mark.parametrize(
    "chain",
    [
        pytest.param(lambda y, b: y + b, id="tensor-operand"),  # b [5, 8] broadcasts per position
        pytest.param(lambda y, b: torch.softmax(y, dim=1), id="softmax-over-positions"),
        pytest.param(lambda y, b: y.sum(-1, keepdim=True), id="reduction"),
    ],
)
def test_prune_logits_skips_ops_that_are_not_positionwise(chain):
    w, b = torch.randn(8, 4), torch.randn(5, 8)
    h = torch.randn(2, 5, 4)

    def f(h, b):
        return chain(torch.nn.functional.linear(h, w), b)[:, -1]

    gm = shaped(f, h, b)
    assert prune_logits(gm) == 0


@pytest.mark.parametrize(
    "side_effect",
    [
        pytest.param(lambda x, s: torch.nn.functional.dropout(x, 0.5, True), id="dropout"),
        pytest.param(lambda x, s: torch.rand(3), id="rand"),
        pytest.param(lambda x, s: torch.nn.functional.batch_norm(x, s, s.clone(), training=True), id="batch_norm"),
        pytest.param(lambda x, s: torch.nn.functional.relu(s, True), id="relu-inplace-positional"),
        pytest.param(lambda x, s: torch.add(x[0], 1, out=s), id="out-kwarg"),
        pytest.param(lambda x, s: s.__setitem__(0, 5.0), id="setitem"),
    ],
)
def test_dead_code_keeps_side_effects_without_a_trailing_underscore(side_effect):
    def f(x, s):
        side_effect(x, s)
        return x * 2

    gm = fx.symbolic_trace(f)
    before = len(gm.graph.nodes)
    remove_dead_code(gm)
    assert len(gm.graph.nodes) == before


@pytest.mark.parametrize(
    "dead",
    [
        pytest.param(lambda x: torch.nn.functional.dropout(x, 0.1, False), id="eval-dropout"),
        pytest.param(lambda x: torch.nn.functional.silu(x), id="silu"),
        pytest.param(lambda x: torch.nn.functional.relu(x, inplace=False), id="relu"),
        pytest.param(lambda x: x.float().view(-1).softmax(-1), id="view-chain"),
    ],
)
def test_dead_code_removes_unused_pure_ops(dead):
    def f(x):
        dead(x)
        return x * 2

    gm = fx.symbolic_trace(f)
    assert remove_dead_code(gm) >= 1
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]


def test_opaque_host_syncing_ops_are_found_in_a_moe_graph():
    """transformers' MoE experts in float32 under torch.compile call a custom op that reads
    expert counts with .tolist(): the backend must see it (on CUDA it then compiles the round
    without a CUDA graph and warns, instead of crashing at capture)."""
    from specfx.passes.checks.no_host_sync import opaque_host_syncs
    from specfx.testing.tiny import tiny_causal_lm

    model = tiny_causal_lm("mixtral")
    seen = []

    def backend(gm, example_inputs):
        seen.append(opaque_host_syncs(gm))
        return gm.forward

    f = torch.compile(lambda ids: model(ids).logits, backend=backend, fullgraph=True)
    with torch.no_grad():
        f(torch.randint(3, 100, (1, 5)))
    assert list(seen[0]) == ["transformers::grouped_mm_fallback"]
    assert "bfloat16" in seen[0]["transformers::grouped_mm_fallback"]
    seen.clear()
    dense = tiny_causal_lm("llama")
    g = torch.compile(lambda ids: dense(ids).logits, backend=backend, fullgraph=True)
    with torch.no_grad():
        g(torch.randint(3, 100, (1, 5)))
    assert seen == [{}]


def test_repeat_interleave_syncs_only_with_tensor_repeats():
    """Integer repeats (or an output_size) give a shape the host knows; tensor repeats do not.
    (transformers' batched_mm MoE experts use integer repeats: that round must be accepted.)"""

    class M(torch.nn.Module):
        def forward(self, x, r):
            a = x.repeat_interleave(2, dim=0)
            b = torch.repeat_interleave(x, 3, dim=1)
            c = x.repeat_interleave(r, dim=0)
            d = torch.repeat_interleave(r)
            e = x.repeat_interleave(r, dim=0, output_size=5)
            f = x.repeat_interleave(repeats=4)
            return a, b, c, d, e, f

    from specfx.passes.checks.no_host_sync import offending_nodes

    bad = offending_nodes(fx.symbolic_trace(M()))
    assert [b.split(":")[0] for b in bad] == ["repeat_interleave_2", "repeat_interleave_3"]


# --------------------------------------------------------------------------- named stages
def test_default_stages_put_live_kv_before_dead_code_removal():
    names = [s.name for s in default_stages(round_checks=False)]
    assert names == [p.__name__ for p in REWRITES]
    names = [s.name for s in default_stages(round_checks=True, live=LiveKV(8, 4))]
    assert names == [p.__name__ for p in ROUND_CHECKS] + ["prune_logits", "gqa_sdpa", "live_kv", "remove_dead_code"]
    gm = fx.symbolic_trace(lambda x: x + 1)
    report = run_passes(gm, live=LiveKV(8, 4))
    assert [name for name, _ in report.sites] == names


def test_a_stage_is_reported_under_its_name_and_may_let_its_own_error_through():
    class CutError(RuntimeError):
        pass

    def cut(gm, where):
        if where < 0:
            raise CutError("nowhere to cut")
        return where

    gm = fx.symbolic_trace(lambda x: x + 1)
    assert run_passes(gm, [Stage("the_cut", lambda g: cut(g, 3))], round_checks=False).sites == [("the_cut", 3)]
    assert capture_transform("the_cut", cut, where=2)(gm) == 2
    with pytest.raises(PassError, match=r"'the_cut' failed after passes \['\(none\)'\]: nowhere"):
        capture_transform("the_cut", cut, where=-1)(gm)
    with pytest.raises(CutError, match="nowhere to cut"):
        capture_transform("the_cut", cut, raises=(CutError,), where=-1)(gm)
    with pytest.raises(ValueError, match="live= only with the default pipeline"):
        run_passes(gm, [Stage("the_cut", lambda g: 0)], live=LiveKV(8, 4))


def _kv_graph(grown: str) -> fx.GraphModule:
    """A forward writing new keys into a static buffer in place, then concatenating the buffer with
    other entries: ``grown`` says where the concatenation goes."""
    import operator

    g = fx.Graph()
    keys, new, slots, extra, q = (g.placeholder(n) for n in ("keys", "new", "slots", "extra", "q"))
    g.call_function(operator.setitem, (keys, (slice(None), slots), new))
    full = g.call_function(torch.cat, ([keys, extra],), {"dim": 1})
    scores = g.call_function(torch.matmul, (q, g.call_method("transpose", (full, 1, 2))))
    if grown == "returned":
        g.output((scores, g.call_method("view", (full, -1))))
    else:
        if grown == "copied":
            g.call_method("copy_", (keys, full))
        g.output(scores)
    return fx.GraphModule(torch.nn.Module(), g)


def test_static_kv_check_refuses_a_grown_cache_only():
    """A buffer concatenated into what the graph returns, or copied back, is a cache grown instead of
    written (refused); one read into a larger tensor that only attention consumes is not
    (DeepSeek-V4's pooled window entries, decision 97)."""
    from specfx.passes import StaticKVError, check_static_kv

    assert check_static_kv(_kv_graph("attention only")) == 1
    for grown in ("returned", "copied"):
        with pytest.raises(StaticKVError, match="concatenates static KV buffer"):
            check_static_kv(_kv_graph(grown))
