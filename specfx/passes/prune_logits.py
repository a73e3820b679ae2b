"""Transformation pass: compute a projection (the LM head) only at the positions that are used.

A causal LM computes logits for every input position; a round often needs only some (the
draft's catch-up step uses its last position, prefill only the last column). When the only
use of ``linear(h)`` — possibly through position-wise ops such as ``.float()``, a softcap
``tanh(x / c) * c`` — is a selection along the sequence dim, the selection moves before the
linear, so the ``[*, V]`` matmul runs on the selected positions only::

    before:
        %logits = call_function[target=linear](args = (%h, %w, None))         # [B, T, V]
        %last   = call_function[target=getitem](args = (%logits, (slice(None), slice(-1, None))))  # [B, 1, V]
    after:
        %h_sel  = call_function[target=getitem](args = (%h, (slice(None), slice(-1, None))))     # [B, 1, H]
        %logits = call_function[target=linear](args = (%h_sel, %w, None))     # [B, 1, V]

Linear acts per position, so the result is identical. Returns the number of linears pruned.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["prune_logits"]

_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
_POSITIONWISE_METHODS = {"float", "to", "contiguous", "type_as"}
_POSITIONWISE_FUNCTIONS = {torch.tanh, operator.truediv, operator.mul, operator.add, operator.sub, torch.softmax}


def _scalar_operands(node: fx.Node, chain_input: fx.Node) -> bool:
    others = [a for a in node.args if a is not chain_input] + list(node.kwargs.values())
    return all(not isinstance(a, fx.Node) for a in others)


def _is_positionwise(node: fx.Node, chain_input: fx.Node) -> bool:
    if node.op == "call_method" and node.target in _POSITIONWISE_METHODS:
        return node.args[0] is chain_input and _scalar_operands(node, chain_input)
    if node.op == "call_function" and node.target in _POSITIONWISE_FUNCTIONS:
        if node.target is torch.softmax:
            return False  # over the vocab dim only if dim=-1; not worth the risk
        return _scalar_operands(node, chain_input)
    return False


def _sequence_selection(node: fx.Node, chain_input: fx.Node):
    """The index if ``node`` selects positions along dim 1 and keeps the last dim whole."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[0] is not chain_input:
        return None
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) < 2:
        return None
    if index[0] != slice(None, None, None):
        return None
    sel = index[1]
    if not (isinstance(sel, int) or (isinstance(sel, slice) and not any(isinstance(x, fx.Node) for x in (sel.start, sel.stop, sel.step)))):
        return None
    if any(x not in (slice(None, None, None), Ellipsis) for x in index[2:]):
        return None
    return index


def prune_logits(gm: fx.GraphModule) -> int:
    graph = gm.graph
    pruned = 0
    for lin in list(graph.nodes):
        if lin.op != "call_function" or lin.target not in _LINEAR:
            continue
        chain, cur = [], lin
        while len(cur.users) == 1:
            user = next(iter(cur.users))
            index = _sequence_selection(user, cur)
            if index is not None:
                break
            if not _is_positionwise(user, cur):
                index = None
                break
            chain.append(user)
            cur = user
        else:
            continue
        if index is None:
            continue
        select = user
        with graph.inserting_before(lin):
            h_sel = graph.call_function(operator.getitem, (lin.args[0], index))
            new = graph.call_function(lin.target, (h_sel, *lin.args[1:]), dict(lin.kwargs))
        prev_old, prev_new = lin, new
        for op in chain:
            with graph.inserting_after(prev_new):
                args = tuple(prev_new if a is prev_old else a for a in op.args)
                copy = graph.create_node(op.op, op.target, args, dict(op.kwargs))
            prev_old, prev_new = op, copy
        select.replace_all_uses_with(prev_new)
        for dead in [select, *reversed(chain), lin]:
            graph.erase_node(dead)
        pruned += 1
    return pruned
