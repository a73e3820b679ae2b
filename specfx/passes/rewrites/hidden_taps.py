"""Transformation pass: make a captured causal-LM forward also return chosen hidden states.

Drafters that read the target's hidden states (MTP, Medusa, EAGLE, EAGLE-3) declare *taps*
(``Drafter.taps``); this pass makes the captured forward return ``(logits, *tapped)``, one
``[B, T, H]`` value per tap, taken from the graph where the model computes it anyway:

- ``"layer:i"``: the hidden state *entering* decoder layer ``i`` (HF's
  ``output_hidden_states[i]``). For ``i >= 1`` the one value layer ``i - 1`` hands to layer
  ``i`` (the boundary the early-exit cut finds); for ``i = 0`` the value from outside the
  layers that layer 0 consumes with the residual stream's shape and dtype (the embeddings,
  scaled or summed with position embeddings as the model does it);
- ``"last"``: the value leaving the last layer into what follows (before the final norm);
- ``"final"``: the hidden state the base model returns (the model's top-level submodule that
  holds the decoder layers: ``model`` for ``model.layers.i``; its ``last_hidden_state``, after
  the final norm, which is HF's ``output_hidden_states[-1]``): the one value leaving that
  module for the LM head side. It is the LM head's input in most models, but not in those that
  scale it first (MiniCPM3 divides it by ``logits_scaling``); and the final norm is not always
  next to the layer list (RoBERTa-PreLayerNorm's sits in the base model, outside its
  ``encoder``), hence the base model's output.

Boundaries come from each node's ``nn_module_stack`` and the decoder layers' qualified names
alone, never from an architecture's name. A boundary that more
than one value crosses keeps those with the residual stream's shape and dtype (those of the
value leaving the last layer); anything but exactly one left is an error naming the boundary::

    before (L = 2, taps = ("layer:1", "final")):
        %h0   = add(%attn0, %mlp0)            # model.layers.0   [B, T, H]
        ...                                   # model.layers.1 (reads %h0)
        %h1   = add(%attn1, %mlp1)            # model.layers.1   [B, T, H]
        %norm = mul(%w_norm, %h1_normed)      # model.norm       [B, T, H]
        %logits = linear(%norm, %w_head)      # lm_head          [B, T, V]
        return (%logits,)
    after:
        ...                                   # unchanged
        return (%logits, %h0, %norm)

Nothing is computed twice and no op changes, so the logits are bit for bit those of the
untapped graph. A tapped value that a later op mutates in place is cloned where it is made.
Outputs after the logits stay, after the taps: ``(logits, *tapped, *rest)`` (a stateful target's
recorded mixer inputs, decision 82).
Returns the number of taps. Not part of the default :data:`PIPELINE`: the runner applies it
(through :func:`run_passes`) to its own captures of the target's forward.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from specfx.passes.ops import node_value
from specfx.passes.rewrites.early_exit import layer_map, normalize_module_path

__all__ = ["HiddenTapsError", "check_tap_names", "hidden_taps", "tap_names"]

FINAL, LAST, LAYER = "final", "last", "layer:"


class HiddenTapsError(RuntimeError):
    """The graph does not show the boundary a tap needs (the message says which and why)."""


def tap_names(num_layers: int) -> list[str]:
    """Every valid tap of a model with ``num_layers`` decoder layers."""
    return [FINAL, LAST] + [f"{LAYER}{i}" for i in range(num_layers)]


def check_tap_names(taps, num_layers: int) -> tuple[str, ...]:
    """``taps`` as a tuple, or ValueError naming the bad tap and listing the valid ones."""
    if isinstance(taps, str) or not all(isinstance(t, str) for t in taps):
        raise ValueError(f"taps must be a tuple of tap names (str), got {taps!r}.")
    valid = tap_names(num_layers)
    for tap in taps:
        if tap not in valid:
            listed = ", ".join(repr(v) for v in valid[:4]) + (", ..." if num_layers > 3 else "")
            last = f", {valid[-1]!r}" if num_layers > 2 else ""
            raise ValueError(
                f"unknown hidden-state tap {tap!r}: the target has {num_layers} decoder layers, so the valid "
                f"taps are {listed}{last} ('final': after the final norm; 'last': the last layer's output, "
                f"before it; 'layer:i': the input of decoder layer i, 0 <= i < {num_layers})."
            )
    return tuple(taps)


def _signature(node: fx.Node):
    """(shape, dtype) of the tensor ``node`` makes, or None when unknown or not a tensor."""
    val = node_value(node)
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


def _paths(node: fx.Node) -> set[str]:
    """The dotted module paths ``node`` was traced in (Dynamo's ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return {normalize_module_path(v[0] if isinstance(v, tuple) else str(v)) for v in stack.values()}


def _within(node: fx.Node, path: str) -> bool:
    """Whether ``node`` was traced in the module at ``path`` or one of its submodules (Dynamo
    may leave a module out of the stack when its submodules are there: OPT's ``model``)."""
    return any(p == path or p.startswith(path + ".") for p in _paths(node))


_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}


def _mutated(node: fx.Node) -> bool:
    """Whether a later op writes into ``node``'s tensor in place (``x.add_(...)``, ``x += ...``)."""
    for user in node.users:
        if not user.args or user.args[0] is not node:
            continue
        if user.op == "call_method" and user.target.endswith("_") and not user.target.endswith("__"):
            return True
        if user.op == "call_function" and (
            user.target in _INPLACE_FUNCTIONS or getattr(user.target, "__name__", "").endswith("_")
        ):
            return True
    return False


def _one(candidates: list[fx.Node], residual, what: str) -> fx.Node:
    """The value crossing a boundary: the only candidate, or the only one with the residual
    stream's (shape, dtype)."""
    if len(candidates) != 1 and residual is not None:
        candidates = [n for n in candidates if _signature(n) == residual]
    if len(candidates) != 1:
        found = ", ".join(f"{n.name} {_signature(n)}" for n in candidates) or "none"
        raise HiddenTapsError(
            f"expected one hidden state to cross {what}, found {len(candidates)} ({found}); this model's "
            f"layers exchange more (or other) values than a hidden state"
        )
    return candidates[0]


def hidden_taps(gm: fx.GraphModule, *, layer_names: list[str], taps) -> int:
    """Make ``gm`` return ``(logits, *tapped)`` (see the module docstring).

    Args:
        gm: a captured forward of the whole model (logits as its first output).
        layer_names: qualified names of the decoder layers in order (``model.layers.0`` ...).
        taps: tap names (``"final"``, ``"last"``, ``"layer:i"``); ValueError lists the valid ones.
    """
    num_layers = len(layer_names)
    taps = check_tap_names(taps, num_layers)
    graph = gm.graph
    nodes = list(graph.nodes)
    layer, by_layer = layer_map(nodes, layer_names, HiddenTapsError("the hidden taps need"))
    output = graph.output_node()
    outs = output.args[0]
    logits, *rest = outs if isinstance(outs, (tuple, list)) else (outs,)

    def leaving(i: int, into, what: str, residual) -> fx.Node:
        return _one([n for n in by_layer[i] if any(into(u) for u in n.users)], residual, what)

    last = num_layers - 1
    # Only what the logits are computed from: a recording capture also returns the stateful mixers'
    # inputs (views of layers' values, made after the forward), which are no boundary.
    to_logits = _ancestors(logits)
    # What follows the layers: nodes outside every layer placed after the last layer's nodes.
    last_pos = nodes.index(by_layer[last][-1])
    tail = {n for n in nodes[last_pos + 1 :] if layer[n] is None and n.op != "output" and n in to_logits}
    leaving_last = leaving(last, lambda u: u in tail, f"from decoder layer {last} into the final norm", None)
    residual = _signature(leaving_last)

    def entering(i: int) -> fx.Node:
        if i > 0:
            return leaving(i - 1, lambda u: layer[u] == i, f"from decoder layer {i - 1} into layer {i}", residual)
        outside = [n for n in nodes if layer[n] is None and any(layer[u] == 0 for u in n.users)]
        outside = [n for n in outside if _signature(n) == residual]
        return _one(outside, None, "from the embeddings into decoder layer 0")

    def final() -> fx.Node:
        name, base = _base_path(by_layer[0], layer_names[0])
        inside = [n for n in nodes if n.op not in ("placeholder", "output") and _within(n, base)]
        crossing = [n for n in inside if any(u in to_logits and not _within(u, base) for u in n.users)]
        return _one(crossing, residual, f"out of the base model ({name})")

    found: dict[str, fx.Node] = {}
    for tap in taps:
        if tap not in found:
            found[tap] = leaving_last if tap == LAST else final() if tap == FINAL else entering(int(tap[len(LAYER) :]))
    for tap, node in found.items():
        if _mutated(node):  # its value at the end of the graph would not be the one tapped
            with graph.inserting_after(node):
                found[tap] = graph.call_method("clone", (node,))
            found[tap].meta.update(node.meta)
    output.args = ((logits, *(found[t] for t in taps), *rest),)
    graph.lint()
    gm.recompile()
    return len(taps)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen, todo = {node}, [node]
    while todo:
        for n in todo.pop().all_input_nodes:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _base_path(layer0: list[fx.Node], layer0_name: str) -> tuple[str, str]:
    """The base model, the model's top-level submodule holding the decoder layers (``model``
    for ``model.layers.0`` and for OPT's ``model.decoder.layers.0``, ``transformer`` for
    ``transformer.h.0``), as ``(qualified name, path in the graph's naming)``, e.g. ``("model",
    "L['runner'].model.model")``: the path found from a layer-0 node's
    (``L['runner'].model.model.layers.0``)."""
    parts = layer0_name.split(".")
    if len(parts) < 3:
        raise HiddenTapsError(
            f"the 'final' tap is what the base model (the submodule holding the decoder layers) returns, "
            f"but the layers ({layer0_name}) sit directly in the model"
        )
    base = parts[0]
    for node in layer0:
        for path in _paths(node):
            if path.endswith("." + layer0_name):
                return base, path[: -len(layer0_name)] + base
    raise HiddenTapsError(f"no node of {layer0_name} carries its module path; the base model is not found")
