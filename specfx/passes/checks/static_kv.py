"""Verification pass: KV storage is static and written in place.

The runtime hands the model a ``SlotCache`` whose ``update`` writes the new keys/values into
preallocated buffers at per-row slots (``buf[rows, :, slots] = new``). In the captured graph
that is an in-place indexed write into a graph input, never a ``cat`` that grows a cache::

    %setitem = call_function[target=operator.setitem](args = (%L_keys_0_, (%rows, slice(None), %slots), %k))

The pass returns the number of such write sites (0 when the graph has no model forward) and
raises if a buffer that is written in place is also concatenated into a value the graph returns or
copies into an input (a cache grown by concatenation).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["StaticKVError", "check_static_kv"]


class StaticKVError(RuntimeError):
    """A KV buffer is grown or copied instead of written in place."""


_GROWING = {torch.cat, torch.concat, torch.concatenate, torch.stack}
# ops whose result is their input under another shape: a grown buffer passed through them is still it
_VIEWS = {"view", "reshape", "transpose", "permute", "contiguous", "clone", "flatten", "unsqueeze", "squeeze"}


def _leaves_the_graph(node: fx.Node) -> bool:
    """Whether ``node``'s value (or a view of it) is returned by the graph or copied into one of its
    inputs: what a cache grown by concatenation does to persist."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                return True
            if user.op == "call_method" and user.target == "copy_" and user.args[1] is n:
                return True
            if user.op == "call_function" and user.target is operator.setitem and user.args[2] is n:
                return True
            if (user.op == "call_method" and user.target in _VIEWS) or (
                user.op == "call_function" and user.target is operator.getitem
            ):
                todo.append(user)
    return False


def check_static_kv(gm: fx.GraphModule) -> int:
    """The number of in-place KV writes; StaticKVError where a buffer written in place is also
    concatenated into a value that leaves the graph (a cache grown instead of written). A buffer
    read into a larger tensor that only attention consumes is not a cache: DeepSeek-V4 appends its
    pooled window entries to its keys that way (decision 97)."""
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
            if grown and _leaves_the_graph(node):
                raise StaticKVError(f"{node.name} concatenates static KV buffer(s) {[a.name for a in grown]}")
    return len(writes)
