"""Verification pass: the graph contains nothing that synchronises with the host.

A round must run without the host waiting on the device: no ``.item()``, ``.tolist()``,
``nonzero``, boolean-mask indexing, ``.cpu()`` or any other op whose output shape or value
the host needs. This pass changes nothing; it raises on the first offending node::

    before/after: (unchanged)
    offending:    %nz = call_function[target=torch.nonzero](args = (%mask,))  -> HostSyncError
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["HostSyncError", "FORBIDDEN_FUNCTIONS", "FORBIDDEN_METHODS", "check_no_host_sync"]


class HostSyncError(RuntimeError):
    """The graph would synchronise with the host."""


FORBIDDEN_FUNCTIONS = {
    torch.nonzero,
    torch.masked_select,
    torch.unique,
    torch.unique_consecutive,
    torch.argwhere,
    torch.repeat_interleave,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.item.default,
}
FORBIDDEN_METHODS = {
    "item",
    "tolist",
    "nonzero",
    "numpy",
    "cpu",
    "masked_select",
    "unique",
    "argwhere",
    "repeat_interleave",
    "__bool__",
    "__int__",
    "__float__",
}


def _is_bool_tensor(arg) -> bool:
    if isinstance(arg, fx.Node):
        val = arg.meta.get("example_value", arg.meta.get("val"))
        return isinstance(val, torch.Tensor) and val.dtype == torch.bool
    if isinstance(arg, (tuple, list)):
        return any(_is_bool_tensor(a) for a in arg)
    return False


def offending_nodes(gm: fx.GraphModule) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in FORBIDDEN_FUNCTIONS:
            bad.append(f"{node.name}: {getattr(node.target, '__name__', node.target)}")
        elif node.op == "call_method" and node.target in FORBIDDEN_METHODS:
            bad.append(f"{node.name}: .{node.target}()")
        elif node.op == "call_function" and node.target is operator.getitem and _is_bool_tensor(node.args[1]):
            bad.append(f"{node.name}: boolean-mask indexing")
    return bad


def check_no_host_sync(gm: fx.GraphModule) -> int:
    """Raise :class:`HostSyncError` listing every host-synchronising node; return 0 (no change)."""
    bad = offending_nodes(gm)
    if bad:
        raise HostSyncError("graph synchronises with the host at: " + "; ".join(bad))
    return 0
