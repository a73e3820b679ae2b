"""Capture a runner's forward as one FX graph, then rewrite it with a graph pass.

:func:`capture_forward` traces :meth:`ModelRunner.forward <specfx.model.runner.ModelRunner.forward>`
(static ``SlotCache``, explicit mask and positions) with Dynamo for one shape (batch, tokens,
and for token-tree nodes the tree's size and the queries), applies a transform (an FX pass:
the early-exit cut, the hidden taps) and binds the graph's inputs to what they were traced
against:

- the call's own inputs by name (``ids``, ``positions``, ``slots``; with a tree ``lengths``,
  ``depth``, ``ancestors``);
- the runner's cache tensors by *role* (layer i's keys, the cache's row index...), looked up in
  the runner's current cache at call time, so a capture survives a reallocation of the same
  shape;
- everything else (parameters, buffers) to the tensor itself: the target's own weights, never
  a copy.

The result, a :class:`CapturedForward`, is called like the runner's forward. It is a plain
``fx.GraphModule`` underneath, so a compiled round graph that calls it inlines it (Dynamo
traces a plain GraphModule's code like any function). Capturing is eager work (a Dynamo
trace, about a second for a tiny model): never start one while a round is being compiled.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch
from torch import fx, nn

from specfx.model.cache import SlotCache
from specfx.model.dynamo import back_reference, fresh_code
from specfx.model.masks import TreeView

__all__ = [
    "CaptureError",
    "CapturedForward",
    "ForwardRunner",
    "capture_forward",
    "decoder_blocks",
    "decoder_layer_names",
]


class ForwardRunner(Protocol):
    """What a capture needs of a runner (a :class:`~specfx.model.runner.ModelRunner`, which
    imports this module: the dependency runs one way, runner -> taps -> capture)."""

    model: nn.Module
    cache: SlotCache | None

    @property
    def device(self) -> torch.device: ...

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tree: TreeView | None = None):
        ...


def decoder_blocks(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s decoder blocks, in order (``model.layers.0``, ... or
    ``transformer.h.0``, ...): the children of the outermost ``ModuleList`` of blocks of one
    class holding ``config.num_hidden_layers`` of them, or else the only one whose length
    divides it: a config whose ``num_hidden_layers`` counts sublayers (LongCat-Flash: two
    attention sublayers per block, ``num_hidden_layers = 2 * num_layers``); failing both, the only
    outermost ``ModuleList`` of ``num_hidden_layers`` blocks of several classes (Jamba's attention and
    Mamba layers)."""
    n = model.config.get_text_config().num_hidden_layers
    lists = {name: m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0}

    def outermost(names):  # those not nested in another of ``names``
        return [name for name in names if not any(name.startswith(o + ".") for o in names)]

    one_class = outermost([name for name, m in lists.items() if len({type(x) for x in m}) == 1])
    exact = [name for name in one_class if len(lists[name]) == n]
    dividing = [name for name in one_class if n > 0 and n % len(lists[name]) == 0]
    mixed = [name for name in outermost(list(lists)) if len(lists[name]) == n]
    found = exact[:1] or (dividing if len(dividing) == 1 else []) or (mixed if len(mixed) == 1 else [])
    if not found:
        raise ValueError(
            f"{type(model).__name__}: no ModuleList of config.num_hidden_layers = {n} decoder layers of one "
            f"class (nor a single one whose length divides it, nor a single one of several classes) was found, "
            f"so the decoder layer boundaries (for an early exit or hidden taps) are unknown."
        )
    return [f"{found[0]}.{i}" for i in range(len(lists[found[0]]))]


def decoder_layer_names(model: nn.Module) -> list[str]:
    """:func:`decoder_blocks`, one per ``config.num_hidden_layers`` layer: hidden taps are
    numbered by it (HF's ``hidden_states[i]`` is the input of layer i)."""
    blocks = decoder_blocks(model)
    n = model.config.get_text_config().num_hidden_layers
    if len(blocks) != n:
        raise ValueError(
            f"{type(model).__name__}: config.num_hidden_layers = {n} counts {n // len(blocks)} layers per decoder "
            f"block ({len(blocks)} blocks, {blocks[0].rsplit('.', 1)[0]}), so a hidden state between two of those "
            f"layers lies inside a block, where no tap can read it."
        )
    return blocks


class CaptureError(RuntimeError):
    """The runner's forward could not be captured as one graph (the message says why)."""


class CapturedForward:
    """A captured (and transformed) forward and what its inputs are bound to: calling it with
    ``ids``, ``positions`` and ``slots`` (``[B, T]``, plus ``tree`` for token-tree nodes)
    runs the graph against the runner's current cache and returns the graph's outputs (a
    tuple; the logits ``[B, T, V]`` first)."""

    what = "captured forward"  # how errors name it

    def __init__(
        self,
        gm: fx.GraphModule,
        inputs: list,
        runner: ForwardRunner,
        queries: tuple[int, ...] | None = None,
        sites: int = 0,
    ):
        self.gm = gm
        # per placeholder: a call input by name ("ids", "positions", "slots"; with a tree also
        # "lengths", "depth", "ancestors") | ("kv", layer, "keys" | "values" | "indexer_keys"), ("kv", layer,
        # "compressed", name, 0 | 1) (a compressor's per-token kv | gate, decision 97), ("state", layer,
        # "conv_states" | "recurrent_states", index) or ("cache", None, attribute): a tensor of the
        # runner's *current* cache | a bound target tensor (a parameter)
        self.inputs = inputs
        self._runner = weakref.ref(runner)  # the runner keeps its captures: a strong reference back is a cycle
        self.queries = queries  # the token-tree nodes it runs on (None: a plain causal forward)
        self.sites = sites  # what the transform reported (nodes removed, taps added...)

    @property
    def runner(self) -> ForwardRunner:
        """The runner whose current cache the graph reads (held weakly: it holds its captures)."""
        return back_reference(self._runner, f"{self.what}'s runner")

    def _resolve(self, x, given: dict, cache):
        if isinstance(x, str):
            return given[x]
        if isinstance(x, tuple):  # cache tensors are looked up at call time: the graph survives reallocation
            kind, layer, name, *idx = x
            value = getattr(cache.layers[layer] if kind in ("kv", "state") else cache, name)
            for i in idx:  # a stateful layer's conv or recurrent state (its dict, then the state index); a
                value = value[i]  # compressor's per-token projections (its dict, then kv or gate: decision 97)
            return value
        return x

    @property
    def bound(self) -> list[torch.Tensor]:
        """The tensors the graph reads besides the call's inputs (weights, KV buffers)."""
        cache = self.runner.cache
        return [self._resolve(x, {}, cache) for x in self.inputs if not isinstance(x, str)]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tree: TreeView | None = None
    ) -> tuple:
        """Run the graph; ``tree`` is required, with the captured ``queries``, exactly when
        the graph was captured for token-tree nodes (its tensors are inputs, its queries a
        constant of the graph)."""
        if (tree.queries if tree is not None else None) != self.queries:
            raise ValueError(
                f"this {self.what} was captured for "
                f"{'token-tree nodes ' + str(self.queries) if self.queries else 'a causal forward (no tree)'}, "
                f"but was called with {'tree queries ' + str(tree.queries) if tree else 'no tree'}; "
                f"capture one for those nodes."
            )
        given = {"ids": ids, "positions": positions, "slots": slots}
        if tree is not None:
            given.update(lengths=tree.lengths, depth=tree.depth, ancestors=tree.ancestors)
        cache = self.runner.cache  # the runner's current one, read once per call
        out = self.gm(*[self._resolve(x, given, cache) for x in self.inputs])
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _Recorder:
    """The capturing backend: records the ``GraphModule`` Dynamo hands it and its example inputs.

    One instance serves every capture, and it lets go of what it recorded right after: Dynamo
    keeps each backend it was given in a process-wide table (``eval_frame.cached_backends``)
    until a process-wide reset, so a backend holding the capture (a closure over a list, say)
    would keep every captured graph and the KV buffers it was traced against alive, a few MB
    per reallocation."""

    def __init__(self):
        self.captured: list = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.captured.append((gm, list(example_inputs)))
        return gm.forward

    def take(self) -> list:
        captured, self.captured = self.captured, []
        return captured


_RECORDER = _Recorder()


def capture_forward(
    runner: ForwardRunner,
    batch_size: int,
    tokens: int = 1,
    tree: TreeView | None = None,
    transform: Callable[[fx.GraphModule], int] | None = None,
    result: type[CapturedForward] = CapturedForward,
    call: Callable | None = None,
) -> CapturedForward:
    """Capture ``runner.forward`` for ``[batch_size, tokens]`` inputs, apply ``transform`` (a
    pass ``GraphModule -> int``, its count kept as ``sites``) and bind the graph's inputs
    (see the module docstring). The runner's cache must be allocated; the capture writes only
    its trash slot (and a stateful model's state: the caller keeps it). ``call(ids, positions,
    slots)``, if given, is traced instead of ``runner.forward`` (no tree): the logits first, then
    further outputs (a stateful target's recorded mixer inputs, decision 82).

    With ``tree`` (a :class:`~specfx.model.masks.TreeView` whose ``queries`` are the token-tree nodes,
    one per input column, so ``tokens`` is ``len(queries)``): the forward over those nodes.
    The tree's tensors (``lengths [B]``, ``depth [R, N+1]``, ``ancestors [R, N+1, N+1]``; only
    their shapes matter here) become inputs of the graph; ``queries`` is a constant of it, so
    each set of queries needs a capture of its own. Raises :class:`CaptureError` when the
    forward is not one graph; errors of ``transform`` propagate."""
    if runner.cache is None or runner.cache.rows.shape[0] != batch_size:
        held = "no cache yet" if runner.cache is None else f"a cache of {runner.cache.rows.shape[0]} rows"
        raise ValueError(
            f"capture_forward: a capture for {batch_size} rows, but the runner has {held}; allocate() it first."
        )
    device = runner.device
    queries = None
    if call is not None and tree is not None:
        raise ValueError("capture_forward: call= is for causal forwards, not token-tree nodes")
    if tree is None:

        def forward(ids, positions, slots):
            return runner.forward(ids, positions, slots) if call is None else call(ids, positions, slots)

    else:
        queries = tuple(tree.queries)
        tokens = len(queries)

        def forward(ids, positions, slots, lengths, depth, ancestors):
            return runner.forward(ids, positions, slots, tree=TreeView(lengths, depth, ancestors, queries))

    ids = torch.zeros((batch_size, tokens), dtype=torch.long, device=device)
    positions = torch.zeros_like(ids)
    slots = torch.full_like(ids, runner.cache.trash_slot)
    given = {"ids": ids, "positions": positions, "slots": slots}  # the call's own inputs, by name
    if tree is not None:
        # lengths 0: every query's slot is the trash slot anyway; the mask is all the tree changes
        given.update(lengths=torch.zeros(batch_size, dtype=torch.long, device=device))
        given.update(depth=tree.depth.clone(), ancestors=tree.ancestors.clone())
    forward = fresh_code(forward)  # a private code object: Dynamo traces it anew, whatever it saw before
    try:
        with torch.no_grad():
            # torch._dynamo.optimize is what torch.compile calls; called directly, Dynamo's
            # backend table holds one entry (the recorder) instead of a wrapper per capture.
            torch._dynamo.optimize(_RECORDER, nopython=True, dynamic=False)(forward)(*given.values())
    except Exception as e:
        lines = [line.strip() for line in str(e).strip().splitlines()]
        # Dynamo names the model's own line that stopped it ("Caused by: for expert_idx in ...")
        where = next((f"; {line}" for line in lines if line.startswith("Caused by:")), "")
        raise CaptureError(
            f"capturing {type(runner.model).__name__}'s forward as one graph failed "
            f"({type(e).__name__}: {lines[0] if lines else ''}{where}); this needs a forward Dynamo traces "
            f"without graph breaks."
        ) from e
    finally:
        captured = _RECORDER.take()
        # The graph is all this capture wants from Dynamo. Its cache entry on the private code
        # object (guards, transformed code, the compiled function installed in this module's
        # globals) would outlive the code object: Dynamo's orig_code_map holds the code strongly
        # from a value whose weak key lives in that very entry, so neither is ever freed. Drop it.
        torch._dynamo.reset_code(forward.__code__)
    ((gm, example_inputs),) = captured
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cache = runner.cache  # its tensors are read at call time (the capture outlives reallocations)
    dynamic = {id(t): ("cache", None, name) for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_initialized", False) and isinstance(getattr(layer, "keys", None), torch.Tensor):
            dynamic.update({id(layer.keys): ("kv", i, "keys"), id(layer.values): ("kv", i, "values")})
            if getattr(layer, "indexer_keys", None) is not None:  # a DSA indexer's keys (decision 94)
                dynamic[id(layer.indexer_keys)] = ("kv", i, "indexer_keys")
            for key, pair in getattr(layer, "compressed", {}).items():  # a KV compressor's projections (decision 97)
                dynamic.update({id(t): ("kv", i, "compressed", key, j) for j, t in enumerate(pair)})
        for name in ("conv_states", "recurrent_states"):  # a stateful layer's buffers, by role too
            for idx, t in (getattr(layer, name, None) or {}).items():
                if isinstance(t, torch.Tensor):
                    dynamic[id(t)] = ("state", i, name, idx)
    dynamic.update({id(x): name for name, x in given.items()})
    binding = {p.name: dynamic.get(id(x), x) for p, x in zip(placeholders, example_inputs, strict=True)}
    sites = transform(gm) if transform is not None else 0
    inputs = [binding[n.name] for n in gm.graph.nodes if n.op == "placeholder"]
    # A plain GraphModule (Dynamo hands out lazily recompiled ones, which it will not inline
    # when the round graph calls this one).
    return result(fx.GraphModule(gm, gm.graph), inputs, runner, queries, sites)
