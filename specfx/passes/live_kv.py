"""Transformation pass: attention reads only the live prefix of the static KV buffers.

specfx's KV buffers are ``[B, H, C, D]`` with ``C`` the capacity (a power of two, the trash
slot last), and every attention call reads all ``C`` slots while the mask hides those past each
query's position. When the runtime knows that no query of the graph sees a slot ``>= L``
(``live``: the host's bound on every position of the call, chosen at a sync that exists
anyway), the slots ``L..C-1`` contribute exactly zero weight, so the pass cuts the key axis of
each attention call to its first ``L`` entries. SDPA::

    before:
        %o = call_function[target=scaled_dot_product_attention](args = (%q, %k, %v), kwargs = {attn_mask: %m, ...})
             # q [B, H, T, D], k/v [B, H, C, D], m [B, 1, T, C]
    after:
        %k_live = call_function[target=getitem](args = (%k, (Ellipsis, slice(None, L), slice(None))))  # [B, H, L, D]
        %v_live = call_function[target=getitem](args = (%v, (Ellipsis, slice(None, L), slice(None))))  # [B, H, L, D]
        %m_live = call_function[target=getitem](args = (%m, (Ellipsis, slice(None, L))))               # [B, 1, T, L]
        %o = call_function[target=scaled_dot_product_attention](args = (%q, %k_live, %v_live), kwargs = {attn_mask: %m_live, ...})

HF's eager attention (``matmul(q, kᵀ)``, scaling, softcap, ``+ mask``, ``softmax``, ``.to``,
``dropout``, ``matmul(·, v)``) is the same cut applied to a region: the key axis is the last
dim of every node between the two matmuls; the pass slices ``kᵀ``'s last dim, every outside
operand of the region whose last dim is ``C`` (the mask), and ``v``'s key dim, and recomputes
the region's shapes. The output of either form keeps its shape, so nothing after it changes.

Exactness: a hidden slot has weight ``exp(-inf) = 0`` (bool mask) or ``exp(min - max) = 0``
(additive mask) in the softmax, so removing it changes nothing but the summation order. The
pass cannot see the bound in the graph (it is a runtime fact: the host's maximal position), so
the bound is a *contract* of the caller, who must pass ``live`` only for graphs whose every
attention over ``capacity`` keys masks the slots ``>= live`` (specfx's round and prefill graphs:
``SpeculativeGenerator.live_bound``). Everything else is proven from node meta, and the pass
skips (never guesses) unless: the key/value axis is exactly ``capacity``; the mask is present
with last dim ``capacity`` (an unmasked or ``is_causal`` call would see the live cut as a change
of semantics); dropout is 0; and, for the eager pattern, every node of the region is used only
inside the region (returned attention weights would change shape). Returns the number of
attention calls cut.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from .meta import META_KEYS, infer_meta, refresh_meta

__all__ = ["LiveKV", "live_kv"]

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}
_MATMUL = {torch.matmul, operator.matmul}
# element-wise ops a score region may contain between q·kᵀ and softmax (scaling, softcap, mask)
_EW_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.tanh, torch.add, torch.mul}
_EW_METHODS = {"to", "float", "half", "bfloat16", "type_as", "contiguous"}
_DROPOUT = {torch.nn.functional.dropout}


def _val(node):
    if not isinstance(node, fx.Node):
        return None
    for key in META_KEYS:
        if key in node.meta:
            v = node.meta[key]
            return v if isinstance(v, torch.Tensor) else None
    return None


def _shape(node):
    v = _val(node)
    return tuple(v.shape) if v is not None else None


def _slice(graph: fx.Graph, node: fx.Node, before: fx.Node, index) -> fx.Node:
    with graph.inserting_before(before):
        cut = graph.call_function(operator.getitem, (node, index))
    infer_meta(cut, node)
    return cut


def _keys(live: int):  # [..., L, D]: the key axis is the second to last
    return (Ellipsis, slice(None, live, None), slice(None, None, None))


def _last(live: int):  # [..., L]: the key axis is the last
    return (Ellipsis, slice(None, live, None))


def _sdpa_args(node: fx.Node):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def _cut_sdpa(graph: fx.Graph, node: fx.Node, capacity: int, live: int) -> bool:
    a = _sdpa_args(node)
    k, v, m = a.get("key"), a.get("value"), a.get("attn_mask")
    ks, vs, ms = _shape(k), _shape(v), _shape(m)
    if ks is None or vs is None or ms is None or len(ks) < 3 or len(vs) < 3 or len(ms) < 2:
        return False
    if ks[-2] != capacity or vs[-2] != capacity or ms[-1] != capacity:
        return False
    if a.get("is_causal", False) is not False or a.get("dropout_p", 0.0) not in (0, 0.0):
        return False
    if not isinstance(a.get("dropout_p", 0.0), (int, float)):
        return False
    new = {k: _slice(graph, k, node, _keys(live)), v: _slice(graph, v, node, _keys(live))}
    new[m] = _slice(graph, m, node, _last(live))
    # only the key, value and mask operands change (q could be the same node as k: never for HF)
    positions = {1: k, 2: v, 3: m}
    node.args = tuple(new[x] if positions.get(i) is x else x for i, x in enumerate(node.args))
    node.kwargs = {n: new[x] if n in ("key", "value", "attn_mask") else x for n, x in node.kwargs.items()}
    return True


def _is_ew(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _EW_FUNCTIONS
    return node.op == "call_method" and node.target in _EW_METHODS


def _softmax_last_dim(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _SOFTMAX:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    elif node.op == "call_method" and node.target == "softmax":
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    else:
        return False
    shape = _shape(node)
    return shape is not None and isinstance(dim, int) and dim in (-1, len(shape) - 1)


def _is_matmul(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _MATMUL


def _eager_region(sm: fx.Node, capacity: int):
    """(region nodes in graph order, outside operands to cut on the last dim, kᵀ, v, p·v matmul)
    for the eager attention around softmax node ``sm``, or None if it does not fit."""
    if _shape(sm) is None or _shape(sm)[-1] != capacity:
        return None
    region, outside = [sm], []
    # backwards: element-wise ops down to matmul(q, kᵀ)
    stack, scores = [sm.args[0]], None
    while stack:
        n = stack.pop()
        s = _shape(n)
        if not isinstance(n, fx.Node) or s is None or s[-1] != capacity:
            return None
        if n in region:
            continue
        if _is_matmul(n):
            if scores is not None:
                return None
            kt = n.args[1]
            if _shape(n.args[0]) is None or _shape(kt) is None or _shape(kt)[-1] != capacity:
                return None
            scores = n
            region.append(n)
            continue
        if not _is_ew(n):
            return None
        region.append(n)
        for arg in n.all_input_nodes:
            sa = _shape(arg)
            if sa is None:
                return None
            if len(sa) == 0 or sa[-1] == 1:
                continue  # broadcast along the key axis: unaffected
            if sa[-1] != capacity:
                return None
            if _is_matmul(arg) or _is_ew(arg):
                stack.append(arg)
            else:
                outside.append(arg)
    if scores is None:
        return None
    # forwards: dtype casts and (inactive) dropout down to matmul(p, v)
    cur, pv = sm, None
    while pv is None:
        if len(cur.users) != 1:
            return None
        user = next(iter(cur.users))
        if _is_matmul(user) and user.args[0] is cur:
            v = user.args[1]
            if _shape(v) is None or len(_shape(v)) < 2 or _shape(v)[-2] != capacity:
                return None
            pv = user
        elif (user.op == "call_method" and user.target in _EW_METHODS and user.args[0] is cur) or (
            user.op == "call_function" and user.target in _DROPOUT and user.args[0] is cur and _inactive_dropout(user)
        ):
            region.append(user)
            cur = user
        else:
            return None
    # every region node but the last must be used inside the region only
    inside = set(region) | {pv}
    if any(u not in inside for n in region for u in n.users):
        return None
    if any(o in inside for o in outside):
        return None
    order = {n: i for i, n in enumerate(sm.graph.nodes)}
    region.sort(key=order.__getitem__)
    return region, list(dict.fromkeys(outside)), scores, pv


def _inactive_dropout(node: fx.Node) -> bool:
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return p in (0, 0.0) or training is False


def _cut_eager(graph: fx.Graph, sm: fx.Node, capacity: int, live: int) -> bool:
    found = _eager_region(sm, capacity)
    if found is None:
        return False
    region, outside, scores, pv = found
    kt = scores.args[1]
    scores.args = (scores.args[0], _slice(graph, kt, scores, _last(live)), *scores.args[2:])
    for o in outside:
        users = [n for n in region if o in n.all_input_nodes]  # in graph order
        cut = _slice(graph, o, users[0], _last(live))
        for n in users:
            n.args = fx.node.map_arg(n.args, lambda x, o=o, cut=cut: cut if x is o else x)
            n.kwargs = fx.node.map_arg(n.kwargs, lambda x, o=o, cut=cut: cut if x is o else x)
    v = pv.args[1]
    pv.args = (pv.args[0], _slice(graph, v, pv, _keys(live)), *pv.args[2:])
    for n in region:  # the region's last dim is now live: recompute its meta
        refresh_meta(n)
    return True


def live_kv(gm: fx.GraphModule, capacity: int, live: int) -> int:
    """Cut the key axis of every attention call over ``capacity`` keys to ``live`` (see the
    module docstring for the contract). A no-op when ``live >= capacity``."""
    if live >= capacity:
        return 0
    graph, cut = gm.graph, 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _SDPA:
            cut += _cut_sdpa(graph, node, capacity, live)
        elif _softmax_last_dim(node):
            cut += _cut_eager(graph, node, capacity, live)
    return cut


@dataclass(frozen=True)
class LiveKV:
    """:func:`live_kv` bound to one graph's ``(capacity, live)``, as a pipeline pass."""

    capacity: int
    live: int

    __name__ = "live_kv"

    def __call__(self, gm: fx.GraphModule) -> int:
        return live_kv(gm, self.capacity, self.live)
