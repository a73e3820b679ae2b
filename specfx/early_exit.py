"""Early-exit self-speculation: the target's first N layers draft for the whole target.

The drafter is a graph, not a model object: :func:`capture_early_exit` captures the target's
forward through its :class:`~specfx.runner.ModelRunner` (static ``SlotCache``, explicit mask and
positions) with Dynamo, and the :func:`specfx.passes.early_exit.early_exit` pass cuts it after
layer N - 1, feeding layer N - 1's output to the final norm and the LM head. The cut graph's
inputs are bound to the target's own tensors, so:

- **weights are shared**: every parameter the drafter uses *is* a target parameter (no copy, no
  new parameter memory);
- **KV is shared** (LayerSkip-style): the drafter's layers 0..N-1 are the target's layers
  0..N-1, so their KV lives in the target's own cache layers 0..N-1, at the same slots. The
  drafter has no cache and no prefill of its own: the target's prefill and verifications
  write every committed position of those layers, and each draft step writes its proposal's
  entry into them at slot == position.

What is recomputed: the verification forward runs all L layers on all K + 1 tokens, so for
layers < N it rewrites the K entries the draft steps wrote (slots L..L+K-1 for pending
position L) from the same inputs. Skipping that recomputation (starting verification at
layer N from the draft's hidden states) is *not* done: a draft step computes one token at a
time and verification K + 1 at once, which are not bitwise equal in general, and the target's
cache must hold the target's own values for greedy output to equal ``model.generate()``
exactly. Correctness is unaffected by the draft's writes: verification overwrites every slot
the draft wrote before any query reads it, and the mask hides rejected slots afterwards.

Token trees (``speculate(..., tree=...)``): the root's children come from the same one-token
graph at the pending token; then, for each depth whose nodes have children, one call runs
those nodes (node n in scratch slot L + n at position L + depth[n], seeing the committed
prefix and its ancestors: :class:`~specfx.masks.TreeView`). Each such level is a capture of
its own, traced with the tree's tables as inputs and the level's node indices as a constant,
so a tree of depth D adds at most D - 1 captures per (batch bucket, capacity). Verification
rewrites every scratch slot in every layer and the tree round compacts the target's cache,
which is the draft's for layers < N: the drafter has nothing to move itself.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from .drafters import VERIFY_COST, Drafter, draft_chain
from .graph_utils import fresh_code
from .masks import TreeView
from .passes.early_exit import EarlyExitError, early_exit
from .runner import ModelRunner
from .tree import TokenTree
from .tree_round import draft_levels, draft_tree, level_inputs, tree_view

__all__ = ["EarlyExit", "ExitGraph", "capture_early_exit", "decoder_layer_names"]


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s decoder layers, in order (``model.layers.0``, ... or
    ``transformer.h.0``, ...): the children of the ``ModuleList`` holding
    ``config.num_hidden_layers`` blocks of one class."""
    n = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and n > 0:
            if len({type(m) for m in module}) == 1:
                return [f"{name}.{i}" for i in range(n)]
    raise ValueError(
        f"{type(model).__name__}: no ModuleList of config.num_hidden_layers = {n} decoder layers of "
        f"one class was found, so the layer boundary for an early exit is unknown."
    )


class ExitGraph:
    """The cut graph and what its inputs are bound to: calling it with ``ids``, ``positions``
    and ``slots`` (``[B, T]``) runs layers 0..N-1, the final norm and the LM head, writes KV of
    layers 0..N-1 into the target's cache at ``slots``, and returns logits ``[B, T, V]``."""

    def __init__(
        self, gm: fx.GraphModule, inputs: list, removed: int, runner: ModelRunner, queries: tuple[int, ...] | None = None
    ):
        self.gm = gm
        # per placeholder: a call input by name ("ids", "positions", "slots"; with a tree also
        # "lengths", "depth", "ancestors") | ("kv", layer, "keys" | "values") or ("cache", None,
        # attribute): a tensor of the runner's *current* cache | a bound target tensor (a parameter)
        self.inputs = inputs
        self.removed = removed  # nodes the cut removed
        self.runner = runner
        self.queries = queries  # the token-tree nodes it runs on (None: a plain causal forward)

    def _resolve(self, x, given: dict):
        if isinstance(x, str):
            return given[x]
        if isinstance(x, tuple):  # cache tensors are looked up at call time: the graph survives reallocation
            kind, layer, name = x
            cache = self.runner.cache
            return getattr(cache.layers[layer] if kind == "kv" else cache, name)
        return x

    @property
    def bound(self) -> list[torch.Tensor]:
        return [self._resolve(x, {}) for x in self.inputs if not isinstance(x, str)]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tree: TreeView | None = None
    ) -> torch.Tensor:
        """Run the cut graph; ``tree`` is required, with the captured ``queries``, exactly when
        the graph was captured for token-tree nodes (its tensors are inputs, its queries a
        constant of the graph)."""
        if (tree.queries if tree is not None else None) != self.queries:
            raise ValueError(
                f"this early-exit graph was captured for "
                f"{'token-tree nodes ' + str(self.queries) if self.queries else 'a causal forward (no tree)'}, "
                f"but was called with {'tree queries ' + str(tree.queries) if tree else 'no tree'}; "
                f"capture one for those nodes (capture_early_exit(..., tree=..., queries=...))."
            )
        given = {"ids": ids, "positions": positions, "slots": slots}
        if tree is not None:
            given.update(lengths=tree.lengths, depth=tree.depth, ancestors=tree.ancestors)
        out = self.gm(*[self._resolve(x, given) for x in self.inputs])
        return out[0] if isinstance(out, (tuple, list)) else out


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


def capture_early_exit(
    runner: ModelRunner,
    exit_layer: int,
    batch_size: int,
    tokens: int = 1,
    tree: TokenTree | None = None,
    queries: tuple[int, ...] | None = None,
) -> ExitGraph:
    """Capture ``runner.forward`` for ``[batch_size, tokens]`` inputs and cut it after
    ``exit_layer`` layers. The runner's cache must be allocated; the capture writes only its
    trash slot.

    With ``tree`` and ``queries`` (indices 1..N of ``tree``'s nodes, one per input column, so
    ``tokens`` is ``len(queries)``): the forward over those token-tree nodes, masked by
    :class:`~specfx.masks.TreeView`. Its tensors (``lengths [B]``, ``depth [1, N+1]``,
    ``ancestors [1, N+1, N+1]``) become inputs of the graph; ``queries`` is a constant of it,
    so each set of queries needs a capture of its own."""
    if (tree is None) != (queries is None):
        raise ValueError("capture_early_exit: pass tree= and queries= together (or neither).")
    device = runner.device
    if tree is None:

        def forward(ids, positions, slots):
            return runner.forward(ids, positions, slots)

    else:
        tokens = len(queries)

        def forward(ids, positions, slots, lengths, depth, ancestors):
            return runner.forward(ids, positions, slots, tree=TreeView(lengths, depth, ancestors, queries))

    ids = torch.zeros((batch_size, tokens), dtype=torch.long, device=device)
    positions = torch.zeros_like(ids)
    slots = torch.full_like(ids, runner.cache.trash_slot)
    given = {"ids": ids, "positions": positions, "slots": slots}  # the call's own inputs, by name
    if tree is not None:
        tensors = tree.tensors(device)
        # lengths 0: every query's slot is the trash slot anyway; the mask is all the tree changes
        given.update(lengths=torch.zeros(batch_size, dtype=torch.long, device=device))
        given.update(depth=tensors.depth, ancestors=tensors.ancestors)
    forward = fresh_code(forward)  # a private code object: Dynamo traces it anew, whatever it saw before
    try:
        with torch.no_grad():
            # torch._dynamo.optimize is what torch.compile calls; called directly, Dynamo's
            # backend table holds one entry (the recorder) instead of a wrapper per capture.
            torch._dynamo.optimize(_RECORDER, nopython=True, dynamic=False)(forward)(*given.values())
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise EarlyExitError(
            f"early exit: capturing {type(runner.model).__name__}'s forward as one graph failed "
            f"({type(e).__name__}: {first}); the cut needs a forward Dynamo traces without graph breaks."
        ) from e
    finally:
        captured = _RECORDER.take()
        # The graph is all this capture wants from Dynamo. Its cache entry on the private code
        # object (guards, transformed code, the compiled function installed in this module's
        # globals) would outlive the code object: Dynamo's orig_code_map holds the code strongly
        # from a value whose weak key lives in that very entry, so neither is ever freed. Drop it.
        torch._dynamo.reset_code(forward.__code__)
    (gm, example_inputs), = captured
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cache = runner.cache  # its tensors are read at call time (the capture outlives reallocations)
    dynamic = {id(t): ("cache", None, name) for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}
    for i, layer in enumerate(cache.layers):
        if layer.is_initialized:
            dynamic.update({id(layer.keys): ("kv", i, "keys"), id(layer.values): ("kv", i, "values")})
    dynamic.update({id(x): name for name, x in given.items()})
    binding = {p.name: dynamic.get(id(x), x) for p, x in zip(placeholders, example_inputs, strict=True)}
    removed = early_exit(gm, layer_names=decoder_layer_names(runner.model), exit_layer=exit_layer)
    inputs = [binding[n.name] for n in gm.graph.nodes if n.op == "placeholder"]
    # A plain GraphModule (Dynamo hands out lazily recompiled ones, which it will not inline
    # when the round graph calls this one).
    return ExitGraph(fx.GraphModule(gm, gm.graph), inputs, removed, runner, queries)


def _check_layer(layer, num_layers: int | None = None) -> int:
    upper = "num_hidden_layers - 1" if num_layers is None else str(num_layers - 1)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(
            f"early exit layer must be an int N, the number of the target's decoder layers the "
            f"drafter keeps (1 <= N <= {upper}), got {layer!r}."
        )
    if layer < 1 or (num_layers is not None and layer >= num_layers):
        what = "" if num_layers is None else f" (the target has {num_layers} layers)"
        raise ValueError(
            f"early exit layer must be in [1, {upper}]{what}, got {layer}: the drafter keeps the "
            f"target's first N layers, so N = 0 keeps nothing and N >= num_hidden_layers is the "
            f"target itself."
        )
    return layer


class EarlyExit(Drafter):
    """Self-speculation by early exit: the target's first ``layer`` decoder layers, followed by
    its final norm and LM head, propose K tokens or a token tree's nodes (child r of a node:
    the exit's r-th most likely token there); ``draft="early_exit:N"`` or
    ``draft=specfx.EarlyExit(layer=N)``.

    Built from the target's captured graph by a graph pass (no per-architecture code), sharing
    the target's weights and, for layers < N, its KV cache (see the module docstring for what is
    shared and what verification recomputes). ``q`` is the draft's processed distribution, so
    sampling stays lossless; greedy output equals the target's.
    """

    name = "early_exit"

    def __init__(self, layer: int):
        self.layer = _check_layer(layer)
        self.target: ModelRunner | None = None
        self.token_tree: TokenTree | None = None  # the tree rounds draft (None: chains)
        self.graph: ExitGraph | None = None  # the causal forward on one token: chain steps, a tree's root
        self.levels: dict[tuple[int, ...], ExitGraph] = {}  # a tree level's queries -> its capture
        # (batch bucket, capacity, None | (tree size N, a level's queries)) -> capture
        self._graphs: dict[tuple, ExitGraph] = {}

    def __repr__(self) -> str:
        return f"EarlyExit(layer={self.layer})"

    def bind(self, target: ModelRunner) -> None:
        _check_layer(self.layer, target.num_layers)
        decoder_layer_names(target.model)  # fail at speculate() time if the layers cannot be found
        self.target = target

    def prepare_tree(self, tree: TokenTree | None) -> None:
        self.token_tree = tree
        self.levels = {}

    def allocate(self, batch_size: int, capacity: int) -> None:
        # One capture per (batch bucket, capacity, tree level), reused after a reallocation of
        # the same shape: it reads the KV buffers of the target's current cache at call time,
        # and a compiled round guards on the graph module's class (a new capture would
        # recompile every round graph that calls it). A tree adds one capture per depth
        # 1..D-1 whose nodes have children (its queries are a constant of the graph): at most
        # D - 1 per shape.
        tree = self.token_tree
        levels = [(tree.size, q) for q in draft_levels(tree)] if tree is not None else []
        # captures for an outgrown capacity or another tree's levels: dropped
        self._graphs = {k: g for k, g in self._graphs.items() if k[1] == capacity and (k[2] is None or k[2] in levels)}
        self.graph = self._capture(batch_size, capacity, None)
        self.levels = {level[1]: self._capture(batch_size, capacity, level) for level in levels}

    def _capture(self, batch_size: int, capacity: int, level: tuple | None) -> ExitGraph:
        """The capture for ``level``: None (the causal forward on one token) or ``(N,
        queries)``, a level of the current tree of N nodes (the graph depends on the tree only
        through N, its tables' size, and the queries; the tables themselves are inputs)."""
        key = (batch_size, capacity, level)
        if key not in self._graphs:
            tree, queries = (None, None) if level is None else (self.token_tree, level[1])
            self._graphs[key] = capture_early_exit(self.target, self.layer, batch_size, tree=tree, queries=queries)
        return self._graphs[key]

    def prefill(self, ids, positions, slots) -> None:
        """Nothing to do: the draft's KV for layers < N is the target's, filled by its prefill."""

    def proposal_cost(self, target: ModelRunner) -> float:
        return VERIFY_COST + self.layer / target.num_layers

    def _root(self, ctx) -> torch.Tensor:
        """The draft's logits ``[B, 1, V]`` at the pending token (position and slot L)."""
        pending = ctx.lengths.unsqueeze(1)  # [B, 1]
        # KV of layers < N is written at the input's slot == position (see the module docstring)
        return self.graph(ctx.tokens.gather(1, pending), pending, pending)

    def propose(self, ctx):
        pending = ctx.lengths.unsqueeze(1)  # [B, 1], the pending token's position L

        def step(i, proposals):
            pos = pending + i  # [B, 1], the position of proposal i - 1
            return self.graph(proposals[-1], pos, pos)

        return draft_chain(ctx, self._root(ctx), step)

    supports_tree = True

    def propose_tree(self, ctx):
        # The root from the pending token (as a chain's first step), then level by level: the
        # nodes of one depth that have children in one call of that level's capture, each in
        # its scratch slot L + n at position L + depth, seeing the committed prefix and its
        # ancestors only; their layers < N KV goes to the target's cache at those slots.
        def step(queries, tokens):
            if queries not in self.levels:
                raise RuntimeError(
                    f"early exit: no captured graph for tree level {queries} of {ctx.token_tree!r}; "
                    f"prepare_tree() must be given the round's tree before allocate()."
                )
            return self.levels[queries](*level_inputs(ctx, queries, tokens), tree=tree_view(ctx, queries))

        return draft_tree(ctx, self._root(ctx), step)

    def commit_tree(self, src, dst) -> None:
        """Nothing to move: the draft's KV is the target's cache for layers < N, which the tree
        round compacts itself (``target.cache.move``). What the draft wrote to the scratch slots
        L..L+N does not survive anyway: verification runs every layer on every node and
        rewrites all of those slots before the move."""


def from_name(arg: str | None) -> EarlyExit:
    if arg is None:
        raise ValueError(
            "draft='early_exit' needs the exit layer: draft='early_exit:N' keeps the target's first N "
            "decoder layers (1 <= N <= num_hidden_layers - 1), e.g. 'early_exit:4'."
        )
    try:
        layer = int(arg)
    except ValueError:
        raise ValueError(
            f"draft='early_exit:{arg}': the exit layer must be an integer N (1 <= N <= num_hidden_layers - 1), "
            f"e.g. 'early_exit:4'."
        ) from None
    return EarlyExit(layer=layer)
