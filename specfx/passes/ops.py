"""What a pass may know about a node: the example value Dynamo (``example_value``) or
make_fx/export (``val``) recorded, or the shape ``ShapeProp`` recorded (``tensor_meta``).

Rewriting passes read values from here before they rewrite (:func:`node_value`,
:func:`node_tensor`, :func:`tensor_rank`: the one reader of node meta), and skip a node whose
meta is missing (a graph built by hand, or a node another pass inserted without meta): never
guess. Passes that insert nodes give them meta (:func:`infer_meta`, :func:`refresh_meta`) so
that later passes can read them too.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["META_KEYS", "infer_meta", "node_tensor", "node_value", "refresh_meta", "tensor_rank"]

META_KEYS = ("example_value", "val")


def node_value(node):
    """The example value recorded for ``node``: its meta under the first of :data:`META_KEYS`
    present, whatever it is (a tensor, a tuple of them for a multi-output op, a SymInt...).
    None when ``node`` is not an ``fx.Node`` (a constant argument) or carries no example value;
    ``tensor_meta`` is not read here (:func:`tensor_rank` falls back to it)."""
    if not isinstance(node, fx.Node):
        return None
    for key in META_KEYS:
        if key in node.meta:
            return node.meta[key]
    return None


def node_tensor(node) -> torch.Tensor | None:
    """:func:`node_value` when it is a tensor (its shape, dtype and device are then known),
    else None: what a rewrite reads before it proves a pattern."""
    val = node_value(node)
    return val if isinstance(val, torch.Tensor) else None


def tensor_rank(node) -> int | None:
    """The number of dims of the tensor ``node`` produces, or None when that is not known
    (no meta, not a node, not a tensor)."""
    if not isinstance(node, fx.Node):
        return None
    val = node_value(node)
    if isinstance(val, torch.Tensor):
        return val.dim()
    tm = node.meta.get("tensor_meta")
    shape = getattr(tm, "shape", None)
    return len(shape) if shape is not None else None


def infer_meta(node: fx.Node, like: fx.Node) -> None:
    """Give ``node`` (inserted by a pass) the meta of ``like`` (stack trace, module stack)
    and its own example value, computed from its inputs' fake values, so that later passes
    can read its shape too. Left without a value when the inputs' values are not all known, or
    when fake tensors cannot run the op (torch 2.11's matmul asks a symbolic-shaped tensor for its
    numel under dynamic shapes; 2.13 runs it): a later pass then finds the shape unknown, never wrong."""
    node.meta.update({k: v for k, v in like.meta.items() if k not in (*META_KEYS, "tensor_meta")})
    _compute_or_forget(node, next((k for k in META_KEYS if k in like.meta), None))


def refresh_meta(node: fx.Node) -> None:
    """Recompute ``node``'s example value from its inputs' (after a pass changed an input's
    shape); dropped when it cannot be computed, so that no stale shape is ever read."""
    key = next((k for k in META_KEYS if k in node.meta), None)
    for k in META_KEYS:
        node.meta.pop(k, None)
    node.meta.pop("tensor_meta", None)
    _compute_or_forget(node, key)


def _compute_or_forget(node: fx.Node, key: str | None) -> None:
    try:
        _compute(node, key)
    except Exception:  # an op fake tensors cannot run: its shape stays unknown, never stale
        for k in META_KEYS:
            node.meta.pop(k, None)


def _compute(node: fx.Node, key: str | None) -> None:
    inputs = node.all_input_nodes
    if key is None or not all(isinstance(n.meta.get(key), torch.Tensor) for n in inputs):
        return
    args = fx.node.map_arg(node.args, lambda n: n.meta[key])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta[key])
    # The inputs' own mode, not the ambient one: a backend may run under a fresh fake mode.
    modes = {id(getattr(n.meta[key], "fake_mode", None)): getattr(n.meta[key], "fake_mode", None) for n in inputs}
    fake_mode = next(iter(modes.values())) if len(modes) == 1 else None
    if fake_mode is None:
        return  # real tensors (running the op for real) or mixed modes: leave it unknown
    with fake_mode:
        if node.op == "call_method":
            val = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            val = node.target(*args, **kwargs)
    node.meta[key] = val
