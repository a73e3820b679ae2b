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

HF's eager attention is the same cut applied to a *key-axis region*: it starts at the scores
(``matmul(q, kᵀ)`` or ``bmm``, or ``baddbmm(bias, q, kᵀ)`` as function or method) and follows
the key axis (the last dim) forward through element-wise ops (scaling, softcap, ``+ mask``,
``masked_fill``, a ``max`` clamp, casts), a last-dim softmax, inactive dropout, views that keep
the last dim, an attention-sink ``cat`` and its ``[..., :-1]``, and last-dim ``logsumexp`` /
``max`` (whose results do not depend on hidden keys), to ``matmul``/``bmm`` with ``v``. The pass
slices ``kᵀ``'s last dim (and a bias of that width), every outside operand of the region whose
last dim is ``C`` (masks, ALiBi), ``v``'s key dim, rewrites a literal ``C`` in a view to ``L``,
and recomputes the region's meta. The output of either form keeps its shape, so nothing after
it changes.

Exactness: a hidden slot has weight ``exp(-inf) = 0`` (bool mask) or ``exp(min - max) = 0``
(additive mask) in the softmax, so removing it changes nothing but the summation order. The
pass cannot see the bound in the graph (it is a runtime fact: the host's maximal position), so
the bound is a *contract* of the caller, who must pass ``live`` only for graphs whose every
attention over ``capacity`` keys masks the slots ``>= live`` (specfx's round and prefill graphs:
``SpeculativeGenerator.live_bound``). Everything else is proven from node meta, and the pass
skips (never guesses) unless: the key/value axis is exactly ``capacity``; the mask is present
with last dim ``capacity`` (an unmasked or ``is_causal`` call would see the live cut as a change
of semantics); dropout is 0 (SDPA) or inactive (eager); and, for the eager pattern, every use of
a region node is one listed above (returned attention weights, a softmax over another dim or a
``mean`` over the keys leave the call alone). Returns the number of attention calls cut.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from specfx.passes.ops import infer_meta, node_tensor, refresh_meta

__all__ = ["LiveKV", "live_kv"]

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}
_MATMUL = {torch.matmul, operator.matmul}
# element-wise ops a score region may contain between q·kᵀ and softmax (scaling, softcap, mask)
_EW_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, torch.tanh, torch.add, torch.mul, torch.maximum,
}  # fmt: skip
_EW_METHODS = {"to", "float", "half", "bfloat16", "type_as", "contiguous", "masked_fill"}
_DROPOUT = {torch.nn.functional.dropout}
_BADDBMM = {torch.baddbmm}
_CAT = {torch.cat, torch.concat, torch.concatenate}
_REDUCTIONS = {torch.logsumexp, torch.amax, torch.max}
_FULL = slice(None, None, None)


def _shape(node):
    v = node_tensor(node)
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
        if node.target is torch.max:  # max(x, other): element-wise (a clamp, as XGLM's)
            return len(node.args) == 2 and isinstance(node.args[1], fx.Node) and not node.kwargs
        return node.target in _EW_FUNCTIONS
    return node.op == "call_method" and node.target in _EW_METHODS


def _dim_arg(node: fx.Node, position: int = 1):
    return node.kwargs.get("dim", node.args[position] if len(node.args) > position else None)


def _last_dim(node: fx.Node, dim) -> bool:
    shape = _shape(node)
    return shape is not None and isinstance(dim, int) and dim in (-1, len(shape) - 1)


def _is_softmax(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _SOFTMAX:
        return _last_dim(node, _dim_arg(node))
    return node.op == "call_method" and node.target == "softmax" and _last_dim(node, _dim_arg(node))


def _inactive_dropout(node: fx.Node) -> bool:
    if not (node.op == "call_function" and node.target in _DROPOUT):
        return False
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return p in (0, 0.0) or training is False


def _is_reduction(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _REDUCTIONS and not _is_ew(node)
    return node.op == "call_method" and node.target in ("logsumexp", "amax", "max")


def _is_pv(node: fx.Node) -> bool:
    """``matmul(p, v)`` / ``bmm(p, v)``: the probabilities times the values."""
    return node.op == "call_function" and node.target in (*_MATMUL, torch.bmm) and len(node.args) == 2 and not node.kwargs


def _source(node: fx.Node, capacity: int):
    """``(key operand, bias operand or None)`` if ``node`` computes attention scores whose last
    dim is the key axis: ``matmul(q, kᵀ)`` or ``baddbmm(bias, q, kᵀ)`` (function or method, as
    GPT-NeoX-Japanese and Bloom call it); else None."""
    if node.op not in ("call_function", "call_method") or (_shape(node) or (None,))[-1] != capacity:
        return None
    args, kwargs = node.args, node.kwargs
    if node.op == "call_function" and node.target in (*_MATMUL, torch.bmm) and len(args) == 2 and not kwargs:
        a, b, extra = args[0], args[1], None
    elif node.target in _BADDBMM or (node.op == "call_method" and node.target == "baddbmm"):
        names = ("input", "batch1", "batch2")
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        if len(bound) != 3:
            return None
        extra, a, b = bound["input"], bound["batch1"], bound["batch2"]
        if _shape(extra) is None or (len(_shape(extra)) > 0 and _shape(extra)[-1] not in (1, capacity)):
            return None
    else:
        return None
    sa, sb = _shape(a), _shape(b)
    if sa is None or sb is None or sb[-1] != capacity or sa[-1] == capacity:
        return None  # q's last dim is the head dim; equal to the capacity it is ambiguous: skip
    return b, extra


def _cut_last(index, ext: int) -> bool:
    """True if ``x[index]`` on a region node drops exactly its ``ext`` extra columns (an attention
    sink's: ``[..., :-1]``) and keeps the leading dims whole."""
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
        return False
    if any(i is not Ellipsis and i != _FULL for i in index[:-1]):
        return False
    last = index[-1]
    return last.start is None and last.step is None and ext > 0 and last.stop == -ext


def _region(src: fx.Node, capacity: int):
    """Follow the key axis forward from the scores ``src`` through the ops HF's eager attention
    applies (module docstring). Returns ``(region {node: extra columns}, outside operands to
    cut, shapes to rewrite, p·v matmuls)`` or None if any use of the axis is not understood."""
    region, outside, views, exits, seen_softmax = {src: 0}, [], [], [], False
    for node in list(src.graph.nodes)[list(src.graph.nodes).index(src) + 1 :]:
        inside = [a for a in node.all_input_nodes if a in region]
        if not inside:
            continue
        shape = _shape(node)
        first = node.args[0] if node.args else None
        if len(inside) == 1 and first in region and _is_pv(node) and region[first] == 0:
            v = node.args[1]  # p·v: the key axis is v's second to last dim; the output has none
            if _shape(v) is None or len(_shape(v)) < 2 or _shape(v)[-2] != capacity or v in region:
                return None
            exits.append(node)
            continue
        if _is_reduction(node) and first in region and len(inside) == 1:
            if not _last_dim(first, _dim_arg(node)):
                return None
            if node.target in ("max", torch.max) and any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
                return None  # max's indices would be slot numbers
            continue  # logsumexp/max over the keys (a softmax's shift, sinks): hidden keys change nothing
        if shape is None:
            return None
        if node.op == "call_function" and node.target in _CAT and _last_dim(node, _dim_arg(node)):
            seq = node.args[0]
            if not isinstance(seq, (list, tuple)) or seq[0] not in region or region[seq[0]] != 0:
                return None
            if any(x in region for x in seq[1:]):
                return None
            region[node] = shape[-1] - capacity
            continue
        if node.op == "call_function" and node.target is operator.getitem and first in region:
            if not _cut_last(node.args[1], region[first]):
                return None
            region[node] = 0
            continue
        if node.op == "call_method" and node.target in ("view", "reshape") and first in region:
            dims = node.args[1:] if not isinstance(node.args[1], (tuple, list)) else tuple(node.args[1])
            ext = region[first]
            if len(inside) != 1 or not dims or dims[-1] not in (capacity + ext, -1) or shape[-1] != capacity + ext:
                return None
            if any(d == -1 for d in dims[:-1]) or any(isinstance(d, fx.Node) for d in dims):
                return None  # an inferred leading dim would absorb the cut
            region[node] = ext
            if dims[-1] != -1:
                views.append(node)
            continue
        if not (_is_ew(node) or _is_softmax(node) or _inactive_dropout(node)):
            return None
        exts = {region[a] for a in inside}
        if len(exts) != 1 or shape[-1] != capacity + next(iter(exts)):
            return None
        ext = exts.pop()
        for a in node.all_input_nodes:
            if a in region:
                continue
            sa = _shape(a)
            if sa is None:
                return None
            if len(sa) == 0 or sa[-1] == 1:
                continue  # broadcast along the key axis
            if sa[-1] != capacity or ext != 0:
                return None
            outside.append(a)
        seen_softmax |= _is_softmax(node)
        region[node] = ext
    if not seen_softmax or not exits:
        return None
    return region, list(dict.fromkeys(outside)), views, exits


def _cut_eager(graph: fx.Graph, src: fx.Node, capacity: int, live: int) -> bool:
    found = _source(src, capacity)
    region = _region(src, capacity) if found is not None else None
    if region is None:
        return False
    region, outside, views, exits = region
    key, extra = found
    swap = {key: _slice(graph, key, src, _last(live))}
    if extra is not None and len(_shape(extra)) > 0 and _shape(extra)[-1] == capacity:
        swap[extra] = _slice(graph, extra, src, _last(live))
    src.args = fx.node.map_arg(src.args, lambda x: swap.get(x, x))
    src.kwargs = fx.node.map_arg(src.kwargs, lambda x: swap.get(x, x))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for o in outside:
        users = sorted((n for n in region if o in n.all_input_nodes), key=order.__getitem__)
        cut = _slice(graph, o, users[0], _last(live))
        for n in users:
            n.args = fx.node.map_arg(n.args, lambda x, o=o, cut=cut: cut if x is o else x)
            n.kwargs = fx.node.map_arg(n.kwargs, lambda x, o=o, cut=cut: cut if x is o else x)
    for n in views:
        ext = region[n]
        if isinstance(n.args[1], (tuple, list)):
            n.args = (n.args[0], type(n.args[1])((*n.args[1][:-1], live + ext)))
        else:
            n.args = (*n.args[:-1], live + ext)
    for n in exits:
        n.args = (n.args[0], _slice(graph, n.args[1], n, _keys(live)))
    for n in sorted(region, key=order.__getitem__):  # the key axis is now live long: new meta
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
        elif _source(node, capacity) is not None:
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
