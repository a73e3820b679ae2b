"""Verification pass: KV storage is static and written in place.

The runtime hands the model a ``SlotCache`` whose ``update`` writes the new keys/values into
preallocated buffers at per-row slots (``buf[rows, :, slots] = new``). In the captured graph
that is an in-place indexed write into a graph input, never a ``cat`` that grows a cache::

    %setitem = call_function[target=operator.setitem](args = (%L_keys_0_, (%rows, slice(None), %slots), %k))

The pass returns the number of such write sites (0 when the graph has no model forward) and
raises if a buffer that is written in place is also concatenated or reassigned.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["StaticKVError", "check_static_kv"]


class StaticKVError(RuntimeError):
    """A KV buffer is grown or copied instead of written in place."""


_GROWING = {torch.cat, torch.concat, torch.concatenate, torch.stack}


def check_static_kv(gm: fx.GraphModule) -> int:
    writes = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.setitem:
            buf = node.args[0]
            if isinstance(buf, fx.Node) and buf.op == "placeholder" and isinstance(node.args[1], tuple):
                writes.append(buf)
    written = set(writes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _GROWING:
            seq = node.args[0] if node.args else ()
            grown = [a for a in seq if isinstance(a, fx.Node) and a in written]
            if grown:
                raise StaticKVError(f"{node.name} concatenates static KV buffer(s) {[a.name for a in grown]}")
    return len(writes)
