"""The passes on small captured graphs, through the specfx_eager backend (no Inductor)."""

import pytest
import torch
from torch import fx

from specfx.passes import HostSyncError, PassError, make_backend, prune_logits, run_passes
from specfx.passes.no_host_sync import check_no_host_sync


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
