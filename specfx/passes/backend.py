"""The ``specfx`` torch.compile backend: the pass pipeline, then Inductor.

Registered under the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="specfx")`` works without importing specfx first. The registered
backends compile *any* function: they run only :data:`specfx.passes.REWRITES` (logit pruning,
dead-code removal; each reads node shapes and skips what it cannot prove, lint after each),
then plain Inductor. ``specfx_eager`` runs the same passes and executes the rewritten graph
without Inductor (for debugging and fast tests).

specfx's own graphs (rounds, prefills, captured forwards) come through
``make_backend(name, records)``, whose ``round_graphs=True`` default also runs the round
checks (no host sync, static KV: a graph that breaks them raises :class:`PassError`) and, when
the inputs live on a CUDA device, has Inductor capture a CUDA graph (``triton.cudagraphs``,
patched for that compile only). Neither is right for user code: ``x.cpu() + 1`` is a valid
function, and a CUDA graph reuses its output memory on the next call.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import fx

from specfx.passes.checks.no_host_sync import opaque_host_syncs
from specfx.passes.pipeline import PassReport, run_passes
from specfx.passes.rewrites.live_kv import LiveKV

__all__ = ["GraphRecord", "GraphRecords", "make_backend", "specfx_backend", "specfx_eager_backend"]


@dataclass
class GraphRecord:
    """One captured graph: its size and what the passes did to it."""

    nodes: int
    report: PassReport
    ops: Counter = field(default_factory=Counter)
    compiler: str = "inductor"
    graph_module: fx.GraphModule | None = field(default=None, repr=False)  # after the passes

    def summary(self) -> str:
        top = ", ".join(f"{k}×{v}" for k, v in self.ops.most_common(6))
        return (
            f"{self.nodes} nodes ({self.report.nodes_before} captured) compiled by {self.compiler}; "
            f"passes: {self.report}; top ops: {top}"
        )


class GraphRecords(list):
    """The :class:`GraphRecord` s of one generator (a list that can be referenced weakly)."""


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def make_backend(
    inner: str = "specfx",
    records: list | None = None,
    *,
    round_graphs: bool = True,
    live: LiveKV | None = None,
    options: dict | None = None,
):
    """A backend that records each graph in ``records``. ``inner`` is "specfx" (Inductor
    after the passes) or "specfx_eager" (run the rewritten graph as is); any other name is
    looked up as an ordinary Dynamo backend and used without the passes.

    ``round_graphs`` says the graphs are specfx's own (rounds, prefills, captured forwards):
    the round invariants are checked and, on CUDA, Inductor captures a CUDA graph. Pass False
    for arbitrary user code, as the registered ``specfx``/``specfx_eager`` backends do.

    ``live`` (specfx's own graphs only): attention reads only the first ``live.live`` of
    ``live.capacity`` KV slots (:mod:`specfx.passes.rewrites.live_kv`); the caller vouches that no query
    of the graph sees a slot past it.

    ``options``: Inductor config patches for these compiles only (``SpecConfig.inductor_options``),
    merged under the CUDA-graph patch this function adds."""
    if inner not in ("specfx", "specfx_eager"):
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(inner)

    # Dynamo keeps every backend it is handed for the life of the process, so the backend holds
    # its records weakly (a GraphRecords list dies with its generator).
    records_ref = weakref.ref(records) if isinstance(records, GraphRecords) else (lambda: records)

    def backend(gm: fx.GraphModule, example_inputs):
        # skinny_linear: specfx's own graphs only (a CPU float32 kernel choice measured on its rounds)
        report = run_passes(gm, round_checks=round_graphs, live=live, own_graph=round_graphs)
        ops = Counter(_op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        records = records_ref()
        if records is not None:
            compiler = "inductor" if inner == "specfx" else "eager"
            records.append(GraphRecord(len(gm.graph.nodes), report, ops, compiler, gm))
        if inner == "specfx_eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        cuda = round_graphs and any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
        syncs = opaque_host_syncs(gm) if cuda else {}
        if syncs:
            warnings.warn(
                "specfx: this round cannot run as a CUDA graph, so it is compiled without one (correct, "
                "but the host waits inside every round): " + "; ".join(syncs.values()) + ".",
                stacklevel=2,
            )
        patches = dict(options or {})
        if cuda and not syncs:
            patches["triton.cudagraphs"] = True
        return compile_fx(gm, example_inputs, config_patches=patches)

    backend.__name__ = inner
    return backend


# The registered backends: any user function, so rewrites only (see the module docstring).
specfx_backend = make_backend("specfx", round_graphs=False)
specfx_eager_backend = make_backend("specfx_eager", round_graphs=False)
