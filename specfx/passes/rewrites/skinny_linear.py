"""Transformation pass (CPU, specfx's own graphs): a linear over a few rows as ``W @ xᵀ``.

A round's verification multiplies a handful of rows (K + 1 per sequence) by every weight of the
model. On the CPU, ``linear(x, W)`` (``x @ Wᵀ``) with so few rows goes to the BLAS's
matrix-vector path or a GEMM blocked for many rows, which reads the weight once per row or
handles the skinny side poorly: measured on this project's 2-vCPU AMD EPYC, one thread, 64
distinct ``[1536, 576]`` weights (streamed from memory, like a model's) took 13.7 / 23.2 / 25.1 /
23.5 ms at M = 1 / 2 / 3 / 5 rows, and SmolLM2's LM head (``[49152, 576]``) 6.8 / 14.8 / 22.1 /
13.9 ms. The same product as ``W @ xᵀ`` — the weight as the GEMM's tall left operand, the rows
as its narrow right one, ``xᵀ`` a transposed *view* — takes 13.9 / 9.3 / 12.8 / 13.9 ms and 6.8
/ 4.5 / 5.9 / 6.7 ms: the BLAS streams the weight once for all rows. One row goes to the
matrix-vector path either way, so a single row is fed twice and one column kept (cheaper than
one row alone: 9.3 against 13.7 ms above)::

    before:  %y = linear(%x, %w, %b)                              # x [..., H], w [V, H]
    after:   %x2 = %x.reshape(M, H)                               # (M = 1: cat([%x2, %x2]))
             %y2 = torch.mm(%w, %x2.t())                          # [V, M]
             %y  = %y2.t().reshape(..., V) (+ %b)                 # (M = 1: %y2[:, :1] first)

The result is the same dot products, summed in the BLAS's other kernel's order (float rounding
only). It runs only where it is proven to pay:

- the input and the weight are float32 tensors on the CPU (on CUDA cuBLAS reads the weight once
  at any M: BENCHMARKS, "GPU run 4");
- the weight is 2-D ``[V, H]`` with at least :data:`MIN_WEIGHT_ELEMENTS` elements; the bias
  absent or 1-D;
- the input's leading dims are static and hold at most :data:`MAX_ROWS` rows.

Only in specfx's own graphs (rounds and prefills, either backend; not user code through the
registered backend). Inductor keeps ``xᵀ`` a strided view for its ``mm`` (a contiguous ``xᵀ``
is 3–4× slower again). SmolLM2's compiled rounds with it: t(0) 34.6 → 31.3 ms, t(1) 49.6 → 31.6,
t(2) 58.1 → 41.0, t(4) 60.7 → 50.5 (decision 71). Returns the number of linears rewritten.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from specfx.passes.ops import infer_meta, node_tensor

__all__ = ["MAX_ROWS", "MIN_WEIGHT_ELEMENTS", "skinny_linear"]

_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
MAX_ROWS = 5  # K + 1 for K <= 4, measured in SmolLM2's rounds (decision 71)
MIN_WEIGHT_ELEMENTS = 1 << 16  # SmolLM2's smallest projection (192 x 576) is above it, and gains


def _operands(lin: fx.Node):
    """(x, w, bias) of a linear node, or None."""
    if lin.op != "call_function" or lin.target not in _LINEAR:
        return None
    args = list(lin.args)
    for i, name in enumerate(("input", "weight", "bias")):
        if name in lin.kwargs:
            while len(args) <= i:
                args.append(None)
            args[i] = lin.kwargs[name]
    if len(args) < 2:
        return None
    return args[0], args[1], args[2] if len(args) > 2 else None


def _rows(x: torch.Tensor) -> int | None:
    lead = x.shape[:-1]
    if not all(isinstance(d, int) for d in lead):
        return None
    return math.prod(lead)


def _fits(x_node, w_node, b_node, lin: fx.Node) -> bool:
    x, w, y = node_tensor(x_node), node_tensor(w_node), node_tensor(lin)
    if x is None or w is None or y is None or x.dim() < 1 or w.dim() != 2:
        return False
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (x, w, y)):
        return False
    if not all(isinstance(d, int) for d in (*w.shape, x.shape[-1])) or w.shape[1] != x.shape[-1]:
        return False
    rows = _rows(x)
    if rows is None or not 1 <= rows <= MAX_ROWS or w.numel() < MIN_WEIGHT_ELEMENTS:
        return False
    if b_node is not None:
        b = node_tensor(b_node)
        if b is None or b.dim() != 1 or b.dtype != torch.float32 or b.device.type != "cpu":
            return False
    return tuple(y.shape) == (*x.shape[:-1], w.shape[0])


def _rewrite(graph: fx.Graph, lin: fx.Node, x: fx.Node, w: fx.Node, b) -> None:
    xv, wv = node_tensor(x), node_tensor(w)
    rows, hidden, out = _rows(xv), wv.shape[1], wv.shape[0]
    with graph.inserting_before(lin):
        steps = []

        def add(kind, target, *args):
            node = graph.create_node(kind, target, args)
            steps.append(node)
            return node

        x2 = add("call_method", "reshape", x, rows, hidden)
        if rows == 1:  # one row takes the matrix-vector path: feed it twice, keep one column
            x2 = add("call_function", torch.cat, [x2, x2])
        acc = add("call_function", torch.mm, w, add("call_method", "t", x2))  # [V, M]
        if rows == 1:
            acc = add("call_function", operator.getitem, acc, (slice(None), slice(0, 1)))
        y = add("call_method", "reshape", add("call_method", "t", acc), *xv.shape[:-1], out)
        if b is not None:
            y = add("call_function", operator.add, y, b)
        for node in steps:
            infer_meta(node, lin)
    lin.replace_all_uses_with(y)
    graph.erase_node(lin)


def skinny_linear(gm: fx.GraphModule) -> int:
    graph = gm.graph
    done = 0
    for lin in list(graph.nodes):
        ops = _operands(lin)
        if ops is None or not isinstance(ops[0], fx.Node) or not isinstance(ops[1], fx.Node):
            continue
        x, w, b = ops
        if b is not None and not isinstance(b, fx.Node):
            continue
        if _fits(x, w, b, lin):
            _rewrite(graph, lin, x, w, b)
            done += 1
    return done
