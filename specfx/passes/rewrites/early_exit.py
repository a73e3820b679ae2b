"""Transformation pass: cut a captured causal-LM graph after decoder layer N (early exit).

The graph is a whole model forward captured by Dynamo (embeddings, the decoder layers, the
final norm, the LM head). Each node's ``nn_module_stack`` names the module it came from, so
the node's decoder layer is known from the layer container alone (the ``ModuleList`` of
``config.num_hidden_layers`` blocks: ``model.layers`` in Llama, ``transformer.h`` in GPT-2).
No architecture is named anywhere. The pass

1. finds the hidden state leaving layer ``N - 1`` (the value layer ``N - 1`` produces and layer
   ``N`` consumes) and the one leaving the last layer (consumed by what follows the layers:
   the final norm, then the LM head and whatever the model does to logits);
2. feeds the first to everything that consumed the second;
3. erases every node of layers ``N..L-1``, their KV writes included, and then whatever became
   dead (e.g. their weights' placeholders and the ops only they used)::

    before (L = 3, N = 1):
        %h0   = add(%attn0, %mlp0)            # model.layers.0   [B, T, H]
        ...                                   # model.layers.1, model.layers.2 (KV writes: setitem)
        %h2   = add(%attn2, %mlp2)            # model.layers.2   [B, T, H]
        %norm = mul(%w_norm, %h2_normed)      # model.norm, computed from %h2
        %logits = linear(%norm, %w_head)      # lm_head          [B, T, V]
    after:
        %h0   = add(%attn0, %mlp0)            # model.layers.0   [B, T, H]
        %norm = mul(%w_norm, %h0_normed)      # model.norm, now computed from %h0
        %logits = linear(%norm, %w_head)      # lm_head          [B, T, V]

The result computes the first N layers, the final norm and the LM head with the target's own
parameters (they stay graph inputs bound to the same tensors; nothing is copied). Returns the
number of nodes removed. Not part of the default :data:`PIPELINE`: it is applied by
:class:`specfx.EarlyExit` to its own capture of the target.
"""

from __future__ import annotations

import re

from torch import fx

from specfx.passes.rewrites.dead_code import remove_dead_code

__all__ = ["EarlyExitError", "early_exit", "layer_map", "layer_of", "normalize_module_path"]


class EarlyExitError(RuntimeError):
    """The graph cannot be cut where asked (the message says why)."""


def normalize_module_path(path: str) -> str:
    """Dynamo's module path (``G['r'].model.layers[0]`` or ``..._modules['layers']._modules['0']``)
    in dotted form (``G['r'].model.layers.0``), so it can be matched against qualified names."""
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)


def layer_of(node: fx.Node, layer_names: list[str]) -> int | None:
    """Index of the decoder layer ``node`` was traced in (``layer_names[i]`` is the qualified
    name of layer i in the model, e.g. ``model.layers.3``), or None outside the layers."""
    if node.op in ("placeholder", "get_attr", "output"):
        return None  # inputs are shared (Dynamo tags a placeholder with its first user's module)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    suffixes = {"." + name: i for i, name in enumerate(layer_names)}
    for value in stack.values():
        path = normalize_module_path(value[0] if isinstance(value, tuple) else str(value))
        for suffix, i in suffixes.items():
            if path.endswith(suffix):
                return i
    return None


def layer_map(nodes: list[fx.Node], layer_names: list[str], error: Exception) -> tuple[dict, dict]:
    """``(layer, by_layer)``: each node's decoder layer (None outside the layers) and each
    layer's nodes in graph order. Raises ``error`` (its message says who needs the layers)
    with the layers no node was traced in."""
    layer = {n: layer_of(n, layer_names) for n in nodes}
    by_layer: dict[int, list[fx.Node]] = {}
    for n, i in layer.items():
        if i is not None:
            by_layer.setdefault(i, []).append(n)
    missing = [i for i in range(len(layer_names)) if i not in by_layer]
    if missing:
        raise type(error)(
            f"no graph node was traced inside decoder layer(s) {missing} ({layer_names[missing[0]]}); "
            f"the capture does not show the layer structure {error}"
        )
    return layer, by_layer


def _crossing(nodes_in: list[fx.Node], consumer) -> list[fx.Node]:
    """Nodes of a layer that some node satisfying ``consumer`` uses."""
    return [n for n in nodes_in if any(consumer(u) for u in n.users)]


def early_exit(gm: fx.GraphModule, *, layer_names: list[str], exit_layer: int) -> int:
    """Cut ``gm`` after ``exit_layer`` decoder layers (see the module docstring).

    Args:
        gm: a captured forward of the whole model (logits as its output).
        layer_names: qualified names of the decoder layers in order (``model.layers.0`` ...).
        exit_layer: N, the number of layers kept, ``1 <= N < len(layer_names)``.
    """
    num_layers = len(layer_names)
    if not 1 <= exit_layer < num_layers:
        raise EarlyExitError(f"exit_layer must be in [1, {num_layers - 1}], got {exit_layer}")
    graph = gm.graph
    nodes = list(graph.nodes)
    layer, by_layer = layer_map(nodes, layer_names, EarlyExitError("the cut needs"))

    last = num_layers - 1
    # What follows the layers: nodes outside every layer placed after the last layer's nodes.
    last_pos = nodes.index(by_layer[last][-1])
    tail = {n for n in nodes[last_pos + 1 :] if layer[n] is None}
    leaving_last = _crossing(by_layer[last], lambda u: u in tail)
    leaving_cut = _crossing(by_layer[exit_layer - 1], lambda u: layer.get(u) == exit_layer)
    if len(leaving_last) != 1 or len(leaving_cut) != 1:
        raise EarlyExitError(
            f"expected one hidden state to leave each decoder layer, found {len(leaving_cut)} leaving "
            f"layer {exit_layer - 1} into layer {exit_layer} and {len(leaving_last)} leaving the last layer "
            f"into the final norm; this model's layers exchange more than a hidden state"
        )
    src, dst = leaving_last[0], leaving_cut[0]
    for user in [u for u in src.users if u in tail]:
        user.replace_input_with(src, dst)

    cut = {n for n, i in layer.items() if i is not None and i >= exit_layer}
    removed = 0
    for n in reversed(nodes):
        if n not in cut:
            continue
        outside = [u for u in n.users if u not in cut]
        if outside:
            raise EarlyExitError(
                f"{n.name} (decoder layer {layer[n]}) is used by {outside[0].name} outside the removed "
                f"layers; the graph cannot be cut after layer {exit_layer - 1}"
            )
        graph.erase_node(n)
        removed += 1
    removed += remove_dead_code(gm)
    for n in list(graph.nodes):  # inputs only the removed layers used (their weights, their KV)
        if n.op == "placeholder" and not n.users:
            graph.erase_node(n)
            removed += 1
    graph.lint()
    gm.recompile()
    return removed
