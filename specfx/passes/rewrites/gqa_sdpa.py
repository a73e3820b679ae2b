"""Transformation pass: grouped-query attention without copying the KV heads (CPU).

transformers' SDPA attention repeats each key/value head for its group of query heads before
the call (``repeat_kv``: a new axis, ``expand``, ``reshape``) unless it may pass
``enable_gqa=True``, which it does only where no mask is given (``use_gqa_in_sdpa``). A round
always passes a mask, so every attention call of every round materialises ``n_rep`` copies of
the whole static KV buffer, ``[B, H_q, C, D]`` for K and for V. On the CPU that copy costs more
than the attention itself (batch 16, capacity 256, 4 query / 2 KV heads: 2.1 ms per call
against 0.57 ms with ``enable_gqa``), and SDPA's CPU kernel reads grouped heads natively::

    before:
        %k5  = call_function[target=getitem](args = (%k, (slice(None), slice(None), None, slice(None), slice(None))))
        %ke  = call_method[target=expand](args = (%k5, B, H_kv, n_rep, C, D))
        %kr  = call_method[target=reshape](args = (%ke, B, H_kv * n_rep, C, D))
        ... the same for v ...
        %o   = call_function[target=scaled_dot_product_attention](args = (%q, %kr, %vr), kwargs = {attn_mask: %m, ...})
    after:
        %o   = call_function[target=scaled_dot_product_attention](args = (%q, %k, %v), kwargs = {attn_mask: %m, ..., enable_gqa: True})

SDPA's grouped-query semantics are query head ``i`` reading KV head ``i // n_rep``, which is
what ``expand`` on a new axis after the KV heads followed by a reshape builds: the result is
bit for bit the same. The pass reads every shape from node meta and skips (never guesses)
unless: ``k`` and ``v`` both come from exactly that pattern (a new axis at dim 2 of a 4-D
tensor, expanded there, reshaped to merge it into the heads) with the same group size; the
query has ``H_kv * n_rep`` heads; ``enable_gqa`` is not already set; and the query is on the
CPU. On CUDA, SDPA with a mask and ``enable_gqa`` falls back to its math kernel (transformers'
reason for not passing it), so CUDA graphs are left as they are. The repeated tensors, now
unused, are removed by the dead-code pass after it. Returns the number of calls rewritten.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from specfx.passes.ops import node_tensor

__all__ = ["gqa_sdpa"]

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_FULL = slice(None, None, None)


def _repeated_heads(node) -> tuple[fx.Node, int] | None:
    """``(x, n_rep)`` when ``node`` is ``x[:, :, None].expand(B, H, n_rep, S, D).reshape(B,
    H * n_rep, S, D)`` for a 4-D ``x`` (shapes from meta), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    new_axis = expand.args[0]
    if not (
        isinstance(new_axis, fx.Node)
        and new_axis.op == "call_function"
        and new_axis.target is operator.getitem
        and isinstance(new_axis.args[1], tuple)
    ):
        return None
    index = new_axis.args[1]
    if index[:3] != (_FULL, _FULL, None) or any(i != _FULL and i is not Ellipsis for i in index[3:]):
        return None
    base = new_axis.args[0]
    x, x5, xe, xr = node_tensor(base), node_tensor(new_axis), node_tensor(expand), node_tensor(node)
    if any(v is None for v in (x, x5, xe, xr)) or x.dim() != 4:
        return None
    b, h, s, d = x.shape
    if tuple(x5.shape) != (b, h, 1, s, d) or xe.dim() != 5:
        return None
    n_rep = xe.shape[2]
    if tuple(xe.shape) != (b, h, n_rep, s, d) or tuple(xr.shape) != (b, h * n_rep, s, d):
        return None
    return base, int(n_rep)


def gqa_sdpa(gm: fx.GraphModule) -> int:
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target in _SDPA):
            continue
        if len(node.args) < 3 or node.kwargs.get("enable_gqa"):
            continue
        q, k, v = node.args[:3]
        qv = node_tensor(q)
        rk, rv = _repeated_heads(k), _repeated_heads(v)
        if qv is None or rk is None or rv is None or rk[1] != rv[1] or qv.device.type != "cpu":
            continue
        (kb, n_rep), (vb, _) = rk, rv
        if qv.dim() != 4 or qv.shape[1] != node_tensor(kb).shape[1] * n_rep:
            continue
        node.args = (q, kb, vb, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
