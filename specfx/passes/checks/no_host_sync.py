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

from specfx.passes.ops import node_tensor

__all__ = ["HostSyncError", "FORBIDDEN_FUNCTIONS", "FORBIDDEN_METHODS", "OPAQUE_HOST_SYNCS", "check_no_host_sync", "opaque_host_syncs"]


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
# Custom ops that read device values on the host inside their (opaque) implementation, with
# what to do instead. Not an error (on a CPU a sync costs nothing, and the op computes the
# right thing), but no CUDA graph can be captured around them: see ``opaque_host_syncs``.
OPAQUE_HOST_SYNCS = {
    # transformers' MoE experts under torch.compile in a dtype other than bfloat16: reads the
    # per-expert token counts with .tolist() (transformers/integrations/moe.py)
    "transformers::grouped_mm_fallback": (
        "transformers' grouped-mm fallback for MoE experts (used under torch.compile when the "
        "weights are not bfloat16) reads the expert counts on the host; load the model in "
        "bfloat16, or call model.set_experts_implementation('batched_mm') before speculate()"
    ),
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
        val = node_tensor(arg)
        return val is not None and val.dtype == torch.bool
    if isinstance(arg, (tuple, list)):
        return any(_is_bool_tensor(a) for a in arg)
    return False


def _repeats_known(node: fx.Node) -> bool:
    """``repeat_interleave`` with integer repeats, or with ``output_size`` given, has an output
    shape the host knows: no sync. Only tensor repeats without ``output_size`` read the device."""
    if node.kwargs.get("output_size") is not None:
        return True
    if len(node.args) < 2 and "repeats" not in node.kwargs:  # torch.repeat_interleave(repeats)
        return False
    repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else None)  # (self, repeats, ...)
    return repeats is not None and not isinstance(repeats, fx.Node)


def offending_nodes(gm: fx.GraphModule) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        if node.target in (torch.repeat_interleave, torch.Tensor.repeat_interleave, "repeat_interleave") and _repeats_known(node):
            continue
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


def _op_name(target) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def opaque_host_syncs(gm: fx.GraphModule) -> dict[str, str]:
    """The :data:`OPAQUE_HOST_SYNCS` ops ``gm`` calls: ``{op name: what to do instead}``."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = _op_name(node.target)
            if name is not None:
                name = name.split(".")[0]
                if name in OPAQUE_HOST_SYNCS:
                    found[name] = OPAQUE_HOST_SYNCS[name]
    return found
