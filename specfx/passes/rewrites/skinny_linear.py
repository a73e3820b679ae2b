"""Transformation pass (CPU, Inductor only): a linear over a few rows and a large weight as one
streaming reduction, weight-row outer.

A round's verification multiplies a handful of rows (K + 1 per sequence) by each weight; the
LM head's is the largest (SmolLM2: 49152 × 576). On the CPU, the BLAS a linear calls runs such a
product as one matrix-vector product per row below about four rows, reading the whole weight
once per row, and a ``[V, H]`` row-major weight through its slowest path: measured on this
project's 2-vCPU AMD EPYC, one thread, ``linear([M, 576], [49152, 576])`` took 6.8 / 13.5 / 20.2
/ 13.2 ms at M = 1 / 2 / 3 / 5 (docs/BENCHMARKS.md). Written as an element-wise product summed
over ``H`` with the weight's rows outermost::

    before:  %y = linear(%x, %w, %b)                                   # x [..., H], w [V, H]
    after:   %x2 = %x.reshape(M, H)
             %y2 = (%w.unsqueeze(1) * %x2.unsqueeze(0)).sum(-1)        # [V, M]
             %y  = %y2.t().reshape(..., V) (+ %b)

Inductor's C++ backend compiles the product and the sum into one vectorised loop that reads
each weight row once for all M rows (never materialising ``[V, M, H]``): 2.9 / 3.9 / 4.4 / 4.8 ms
for the same shapes. The result is the same sum in another order (float rounding only).

The pass rewrites only what it can prove from node meta, and only where it pays:

- the input and the weight are float32 tensors on the CPU (bf16/fp16 would sum in low
  precision; on CUDA cuBLAS's GEMV is at the floor for such shapes);
- the weight is 2-D ``[V, H]`` with at least :data:`MIN_WEIGHT_ELEMENTS` elements (below it the
  weight sits in the cache and the BLAS call is as fast or faster: measured at 576 × 576 and
  1536 × 576); the bias absent or 1-D;
- the input's leading dims are static and hold at most :data:`MAX_ROWS` rows: in SmolLM2's round
  graphs the rewrite made rounds of 1 / 2 / 3 rows 1.1 / 4.5 / 11.3 ms faster, 5 rows tied and 9 rows
  lost 5 ms (in isolation it won at 9 rows too: the whole graph decides).

It runs only in graphs Inductor compiles (the ``specfx`` backend): run eagerly, the rewritten
graph would materialise the ``[V, M, H]`` product. Returns the number of linears rewritten.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from specfx.passes.ops import infer_meta, node_tensor

__all__ = ["MAX_ROWS", "MIN_WEIGHT_ELEMENTS", "skinny_linear"]

_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
MAX_ROWS = 4  # in SmolLM2's round graphs: 1-3 rows gain, 5 rows tie, 9 rows lose (decision 71)
MIN_WEIGHT_ELEMENTS = 1 << 22  # 4M float32 elements (16 MB): far above a core's L2


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
        wu = add("call_method", "unsqueeze", w, 1)
        xu = add("call_method", "unsqueeze", x2, 0)
        prod = add("call_function", operator.mul, wu, xu)
        acc = add("call_method", "sum", prod, -1)
        yt = add("call_method", "t", acc)
        y = add("call_method", "reshape", yt, *xv.shape[:-1], out)
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
