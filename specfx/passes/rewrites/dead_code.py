"""Transformation pass: remove computations whose results nobody uses.

After :mod:`prune_logits`, and wherever a forward's logits are not needed at all (the draft's
prefill only fills its KV), the LM head and what feeds only it are dead::

    before: %logits = call_function[target=linear](args = (%h, %w, None))   # no users
    after:  (removed)

A node is removed only when nothing uses it *and* its op is known to be pure: an entry of the
allowlist below, or an ATen overload whose schema mutates nothing and that draws no random
numbers. Everything else is kept, because a name cannot tell all side effects apart:
``F.dropout`` and ``F.batch_norm(training=True)`` have no trailing underscore but draw random
numbers or update running statistics, ``F.relu(x, True)`` writes in place through a
positional flag, ``torch.add(a, b, out=c)`` writes ``c``, a ``call_module`` may be stateful,
and removing an unused ``torch.rand`` would shift every later random number. Returns the
number of nodes removed.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["remove_dead_code"]

# Pure functions and methods found in LM heads, norms, rotary embeddings and the views/casts
# that feed them: none draws random numbers or writes to an argument (other than through an
# ``out=`` keyword, checked in _is_pure).
_PURE_FUNCTIONS = {
    torch._C._nn.linear,
    torch.nn.functional.linear,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.tanh,
    torch.rsqrt,
    torch.exp,
    torch.sin,
    torch.cos,
    torch.pow,
    torch.mean,
    torch.sum,
    torch.softmax,
    torch.log_softmax,
    torch.nn.functional.softmax,
    torch.nn.functional.log_softmax,
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.cat,
    torch.stack,
    torch.where,
    torch.nn.functional.scaled_dot_product_attention,
    torch.nn.functional.gelu,
    torch.nn.functional.layer_norm,
    torch.layer_norm,
    torch.nn.functional.rms_norm,
    operator.getitem,
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    operator.neg,
    operator.matmul,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.eq,
    operator.ne,
}
# Pure only when every listed flag is False: flag -> (its position, its default). Dropout in
# eval mode (``training=False``) is the identity; in training it draws random numbers.
_PURE_UNLESS_FLAGS = {
    torch.nn.functional.silu: {"inplace": (1, False)},
    torch.nn.functional.relu: {"inplace": (1, False)},
    torch.nn.functional.dropout: {"training": (2, True), "inplace": (3, False)},
}
_PURE_METHODS = {
    "float",
    "half",
    "bfloat16",
    "to",
    "type_as",
    "contiguous",
    "clone",
    "view",
    "reshape",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "t",
    "flatten",
    "split",
    "chunk",
    "size",
    "dim",
    "softmax",
    "log_softmax",
    "pow",
    "mean",
    "sum",
    "rsqrt",
    "exp",
    "sin",
    "cos",
    "tanh",
    "neg",
    "masked_fill",
}


def _flag(node: fx.Node, name: str, position: int, default: bool):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


def _is_pure(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _PURE_METHODS and "out" not in node.kwargs
    if node.op != "call_function":
        return False  # placeholders, outputs, attributes, modules: kept
    if isinstance(node.target, torch._ops.OpOverload):
        random = torch.Tag.nondeterministic_seeded in node.target.tags
        return not node.target._schema.is_mutable and not random and not node.is_impure()
    if node.target in _PURE_UNLESS_FLAGS:
        return all(_flag(node, name, *where) is False for name, where in _PURE_UNLESS_FLAGS[node.target].items())
    return node.target in _PURE_FUNCTIONS and "out" not in node.kwargs


def remove_dead_code(gm: fx.GraphModule) -> int:
    removed = 0
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and _is_pure(node):
            gm.graph.erase_node(node)
            removed += 1
    return removed
