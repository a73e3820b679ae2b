"""Hidden-state taps: the runner's forward, captured and rewritten to also return hidden states.

Drafters that read the target's hidden states (MTP, Medusa, EAGLE) call
``ModelRunner.forward(..., taps=("final", "layer:3", ...))``. That forward is a capture of the
runner's own forward (:func:`specfx.model.capture.capture_forward`) rewritten by the hidden-taps
pass (:func:`specfx.passes.rewrites.hidden_taps.hidden_taps`), one capture per shape it serves
(:meth:`TapCaptures.key`). Its logits are bit for bit the untapped forward's.

Captures are eager work (a Dynamo trace of their own): :meth:`TapCaptures.prepare` makes them
before a round graph that calls them is compiled. They read the runner's current cache at call
time, so one survives a reallocation of the same capacity (:meth:`TapCaptures.keep`).

A stateful target's verify forward is captured *recording* (decision 82): its graph also returns
the inputs its stateful mixers received (a captured graph calls no module, so the mixers' hooks
cannot record while it runs), which :meth:`TapCaptures.forward` hands to the runner's
:class:`~specfx.model.recurrent.MixerTaps` for the rollback. A capture runs the model once: the
state it writes is put back afterwards, since a capture may be made between rounds.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch

from specfx.model.admission import taps_refusal
from specfx.model.capture import CapturedForward, CaptureError, capture_forward, decoder_layer_names
from specfx.model.dynamo import back_reference
from specfx.model.masks import TreeView
from specfx.model.recurrent import StateSnapshot
from specfx.passes.pipeline import PassError, capture_transform
from specfx.passes.rewrites.hidden_taps import check_tap_names, hidden_taps
from specfx.trees.types import DynamicTree, TokenTree, TreeTensors

__all__ = ["TapCaptures"]


class TapCaptures:
    """One runner's tapped captures: ``graphs`` maps :meth:`key` to the captured forward
    returning ``(logits, *tapped)``, for the ``(dtype, device)`` in ``signature``."""

    def __init__(self, runner):
        self._runner = weakref.ref(runner)  # a ModelRunner (not imported: runner -> taps is the one direction)
        self.graphs: dict[tuple, CapturedForward] = {}
        self.signature: tuple | None = None  # (dtype, device) the captures were made for

    @property
    def runner(self):
        """The runner these captures belong to (held weakly: it holds them)."""
        return back_reference(self._runner, "tap table's runner")

    def keep(self, capacity: int) -> None:
        """After an allocation of ``capacity`` slots: captures of this capacity stay (they read
        the current cache's tensors at call time, and a compiled round that inlined one would
        recompile for a new one); those of an outgrown capacity, or of another dtype or device, go."""
        signature = (self.runner.dtype, self.runner.device)
        if signature != self.signature:
            self.graphs, self.signature = {}, signature
        self.graphs = {k: g for k, g in self.graphs.items() if k[2] == capacity}

    def check(self, taps) -> None:
        """ValueError unless drafters can read the hidden states ``taps`` of this model: the
        names must be valid for its layers and the model must run in one forward (at
        ``speculate()`` time, so a bad drafter fails before any capture)."""
        if not taps:
            return
        why = taps_refusal(self.runner)
        if why is not None:
            raise ValueError(why)
        check_tap_names(taps, self.runner.num_layers)
        decoder_layer_names(self.runner.model)  # the layer boundaries must be findable

    def key(self, batch_size: int, tokens: int, tree: TreeView | TokenTree | None, taps, record: bool = False) -> tuple:
        """The shape a tapped capture serves: ``(batch, tokens, capacity, tree, taps, record)``, tree
        None or ``(rows of its tables, N, queries)``, record whether it returns the mixers' inputs."""
        if isinstance(tree, TokenTree):  # a round's verification: every node, one table for all rows
            tree = (1, tree.size, tuple(range(tree.size + 1)))
        elif isinstance(tree, DynamicTree):  # the same, with a table per row
            tree = (batch_size, tree.size, tuple(range(tree.size + 1)))
        elif tree is not None:
            tree = (tree.depth.shape[0], tree.depth.shape[1] - 1, tuple(tree.queries))
        return (batch_size, tokens, self.runner.cache.capacity, tree, tuple(taps), record)

    def prepare(
        self, batch_size: int, tokens: int, taps, tree: TokenTree | DynamicTree | None = None, record: bool = False
    ) -> None:
        """Capture, now and eagerly, the tapped forward of ``[batch_size, tokens]`` inputs (with
        ``tree``: a verification of all its nodes; ``record``: a stateful target's verify forward,
        returning its mixers' inputs) unless it is captured already. A compiled
        graph calling ``forward(..., taps=...)`` must find its capture ready: capturing is a
        Dynamo trace of its own, which cannot run while a round is being compiled."""
        if not taps or self.graphs.get(self.key(batch_size, tokens, tree, taps, record)) is not None:
            return
        device = self.runner.device
        view = None
        if tree is not None:
            if isinstance(tree, DynamicTree):  # per-row tables, traced as inputs: any tree of that shape
                parents = torch.zeros((batch_size, tree.size + 1), dtype=torch.long, device=device)
                tables = TreeTensors.from_parents(parents, tree.depth)
            else:
                tables = tree.tensors(device)
            lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
            view = TreeView(lengths, tables.depth, tables.ancestors, tuple(range(tree.size + 1)))
        self._capture(batch_size, tokens, view, taps, record)

    def forward(self, ids, positions, slots, tree: TreeView | None, taps, record: bool = False) -> tuple:
        """ids, positions, slots ``[B, T]`` -> ``(logits [B, T, V], (hidden [B, T, H] per tap))``
        through the capture for this shape (captured now when outside a compiled graph); with
        ``record``, the stateful mixers' inputs are left in the runner's ``mixer_taps`` too."""
        key = self.key(ids.shape[0], ids.shape[1], tree, taps, record)
        graph = self.graphs.get(key)
        if graph is None:
            # not torch.compiler.is_compiling(): that is one process-wide flag, True while any thread
            # compiles (a background compile, decision 67); this one is True only in Dynamo's trace
            if torch.compiler.is_dynamo_compiling():
                raise RuntimeError(
                    f"specfx internal error: forward(taps={tuple(taps)}) inside a compiled graph for a shape "
                    f"(batch, tokens, capacity, tree, taps) = {key} that was not captured beforehand; "
                    f"ModelRunner.prepare_taps() must run eagerly before the graph is compiled."
                )
            graph = self._capture(ids.shape[0], ids.shape[1], tree, taps, record)
        logits, *outs = graph(ids, positions, slots, tree)
        if record:  # what the mixers' hooks record in an eager forward, from the graph's extra outputs
            self.runner.mixer_taps.load(graph.recorded, outs[len(taps) :], self.runner.cache)
        return logits, tuple(outs[: len(taps)])

    def _capture(self, batch_size: int, tokens: int, tree: TreeView | None, taps, record=False) -> CapturedForward:
        runner = self.runner
        self.check(taps)
        # through the pipeline's one entry: the graph is linted after the pass
        transform = capture_transform(
            "hidden_taps", hidden_taps, layer_names=decoder_layer_names(runner.model), taps=taps
        )
        mixers = runner.mixer_taps if record else None
        kept = StateSnapshot(runner.cache) if getattr(runner, "stateful", False) else None  # its forward writes the state

        def recording(ids, positions, slots):  # traced: the logits, then the mixers' recorded inputs
            mixers.inputs.clear()  # this forward's only: the hooks append per forward (decision 81)
            return (runner.forward(ids, positions, slots), *mixers.flat_inputs())

        try:
            with mixers.recording() if record else nullcontext():
                graph = capture_forward(
                    runner, batch_size, tokens, tree=tree, transform=transform, call=recording if record else None
                )
            if record:  # where the graph's extra outputs go, from what the hooks recorded while it ran
                graph.recorded = mixers.template(runner.cache)
        except CaptureError as e:
            raise ValueError(
                f"{runner.role} ({type(runner.model).__name__}): the hidden-state taps {tuple(taps)} need its forward "
                f"captured as one graph, and {e} Drafters that read no hidden states (a draft model, "
                f"prompt lookup) can serve it."
            ) from e
        except PassError as e:  # the layer boundaries are not where the taps pass looks (looped layers)
            raise ValueError(
                f"{runner.role} ({type(runner.model).__name__}): its hidden states {tuple(taps)} cannot be tapped: "
                f"{e}. Drafters that read no hidden states (a draft model, prompt lookup) can serve it."
            ) from e
        finally:
            if kept is not None:
                kept.restore()
            if mixers is not None:
                mixers.inputs.clear()
        self.graphs[self.key(batch_size, tokens, tree, taps, record)] = graph
        return graph
