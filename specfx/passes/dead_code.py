"""Transformation pass: remove computations whose results nobody uses.

After :mod:`prune_logits`, and wherever a forward's logits are not needed at all (the draft's
prefill only fills its KV), the LM head and what feeds only it are dead::

    before: %logits = call_function[target=linear](args = (%h, %w, None))   # no users
    after:  (removed)

In-place writes (KV buffers, round state) are side effects and always kept. Returns the
number of nodes removed.
"""

from __future__ import annotations

import operator

from torch import fx

__all__ = ["remove_dead_code"]

_INPLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ior, operator.iand, operator.ixor, operator.ifloordiv,
}


def _has_side_effect(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output", "get_attr"):
        return True
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):  # in-place ops: copy_, scatter_, add_ ...
        return True
    return node.is_impure()


def remove_dead_code(gm: fx.GraphModule) -> int:
    removed = 0
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and not _has_side_effect(node):
            gm.graph.erase_node(node)
            removed += 1
    return removed
