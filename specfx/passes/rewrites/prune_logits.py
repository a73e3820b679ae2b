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

Linear acts on the last dim only, so the result is identical — provided the selection never
touches the last dim. The pass reads every shape from node meta before it rewrites and skips
(never guesses) unless all of these hold:

- ``h`` is at least 3-D ``[B, T, ..., H]``, the weight is 2-D ``[V, H]``, the bias absent or
  1-D, and the linear's output has ``h``'s rank;
- the selection is ``[:, i]`` or ``[:, a:b:c]`` with static ``i``/``a``/``b``/``c`` followed only
  by full slices or ``...``, so it selects on dim 1 (the sequence dim) and nothing else;
- every op between the linear and the selection is element-wise with Python scalars only
  (no tensor operand, hence no broadcasting) and keeps the rank.

``linear(x[3, 4], w[8, 4])[:, :2]`` selects output *features* (dim 1 of a 2-D output is its
last dim) and is left alone. Returns the number of linears pruned.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from specfx.passes.ops import infer_meta, tensor_rank

__all__ = ["prune_logits"]

_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
_POSITIONWISE_METHODS = {"float", "half", "bfloat16", "to", "contiguous"}
_POSITIONWISE_FUNCTIONS = {torch.tanh, operator.truediv, operator.mul, operator.add, operator.sub, operator.neg}
_FULL = slice(None, None, None)


def _scalar(a) -> bool:
    return a is None or isinstance(a, (bool, int, float, torch.dtype, torch.device, str))


def _is_positionwise(node: fx.Node, chain_input: fx.Node, rank: int) -> bool:
    """Element-wise on ``chain_input`` with scalar operands only, and rank-preserving."""
    if node.op == "call_method" and node.target in _POSITIONWISE_METHODS:
        if node.args[0] is not chain_input:
            return False
    elif not (node.op == "call_function" and node.target in _POSITIONWISE_FUNCTIONS):
        return False
    others = [a for a in node.args if a is not chain_input] + list(node.kwargs.values())
    return all(_scalar(a) for a in others) and tensor_rank(node) == rank


def _static(x) -> bool:
    return x is None or isinstance(x, int)


def _sequence_selection(node: fx.Node, chain_input: fx.Node, rank: int):
    """The index if ``node`` selects positions along dim 1 only, else None."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[0] is not chain_input:
        return None
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) < 2 or index[0] != _FULL:
        return None
    sel, rest = index[1], index[2:]
    if isinstance(sel, bool) or not (
        isinstance(sel, int) or (isinstance(sel, slice) and all(_static(x) for x in (sel.start, sel.stop, sel.step)))
    ):
        return None
    if any(x is not Ellipsis and x != _FULL for x in rest) or sum(x is Ellipsis for x in rest) > 1:
        return None
    if len(index) - (Ellipsis in rest) > rank:
        return None  # more indices than dims: eager raises, leave it to raise
    expected = rank - 1 if isinstance(sel, int) else rank
    return index if tensor_rank(node) == expected else None


def _prunable_linear(lin: fx.Node) -> int | None:
    """The output rank of ``lin`` if its shapes are known and fit ``[B, T, ..., H] @ [V, H]ᵀ``."""
    if lin.op != "call_function" or lin.target not in _LINEAR or not lin.args:
        return None
    args = list(lin.args) + [lin.kwargs.get(k) for k in ("weight", "bias") if k in lin.kwargs]
    x, w = args[0], args[1] if len(args) > 1 else None
    bias = args[2] if len(args) > 2 else None
    rank = tensor_rank(x)
    if rank is None or rank < 3 or tensor_rank(w) != 2 or tensor_rank(lin) != rank:
        return None
    if bias is not None and tensor_rank(bias) != 1:
        return None
    return rank


def _find_chain(lin: fx.Node, rank: int):
    """(position-wise ops after ``lin``, the selection node, its index) or None."""
    chain, cur = [], lin
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        index = _sequence_selection(user, cur, rank)
        if index is not None:
            return chain, user, index
        if not _is_positionwise(user, cur, rank):
            return None
        chain.append(user)
        cur = user
    return None


def _rewrite(graph: fx.Graph, lin: fx.Node, chain: list[fx.Node], select: fx.Node, index) -> None:
    with graph.inserting_before(lin):
        h_sel = graph.call_function(operator.getitem, (lin.args[0], index))
        infer_meta(h_sel, select)
        new = graph.call_function(lin.target, (h_sel, *lin.args[1:]), dict(lin.kwargs))
        infer_meta(new, lin)
    prev_old, prev_new = lin, new
    for op in chain:
        with graph.inserting_after(prev_new):
            args = tuple(prev_new if a is prev_old else a for a in op.args)
            copy = graph.create_node(op.op, op.target, args, dict(op.kwargs))
            infer_meta(copy, op)
        prev_old, prev_new = op, copy
    select.replace_all_uses_with(prev_new)
    for dead in [select, *reversed(chain), lin]:
        graph.erase_node(dead)


def prune_logits(gm: fx.GraphModule) -> int:
    graph = gm.graph
    pruned = 0
    for lin in list(graph.nodes):
        rank = _prunable_linear(lin)
        found = _find_chain(lin, rank) if rank is not None else None
        if found is not None:
            _rewrite(graph, lin, *found)
            pruned += 1
    return pruned
