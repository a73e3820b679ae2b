"""Early-exit self-speculation: the target's first N layers draft for the whole target.

The drafter is a graph, not a model object: :func:`capture_early_exit` captures the target's
forward through its :class:`~specfx.model.runner.ModelRunner` (static ``SlotCache``, explicit mask and
positions) with Dynamo, and the :func:`specfx.passes.rewrites.early_exit.early_exit` pass cuts it after
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
prefix and its ancestors: :class:`~specfx.model.masks.TreeView`). Each such level is a capture of
its own, traced with the tree's tables as inputs and the level's node indices as a constant,
so a tree of depth D adds at most D - 1 captures per (batch bucket, capacity). Verification
rewrites every scratch slot in every layer and the tree round compacts the target's cache,
which is the draft's for layers < N: the drafter has nothing to move itself.
"""

from __future__ import annotations

import torch

from specfx.drafters.base import Drafter, TreeDrafting
from specfx.drafters.drafting import draft_chain
from specfx.model.capture import CapturedForward, CaptureError, capture_forward, decoder_blocks
from specfx.model.masks import TreeView
from specfx.model.probe import PROBE_MIN_CAPACITY
from specfx.model.runner import ModelRunner
from specfx.passes.pipeline import capture_transform
from specfx.passes.rewrites.early_exit import EarlyExitError, early_exit
from specfx.trees.drafting import draft_levels, draft_tree, level_inputs, tree_view
from specfx.trees.types import TokenTree

__all__ = ["EarlyExit", "ExitGraph", "capture_early_exit"]


class ExitGraph(CapturedForward):
    """The cut graph and what its inputs are bound to: calling it with ``ids``, ``positions``
    and ``slots`` (``[B, T]``) runs layers 0..N-1, the final norm and the LM head, writes KV of
    layers 0..N-1 into the target's cache at ``slots``, and returns logits ``[B, T, V]``."""

    what = "early-exit graph"

    @property
    def removed(self) -> int:
        """Nodes the cut removed."""
        return self.sites

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tree: TreeView | None = None
    ) -> torch.Tensor:
        return super().__call__(ids, positions, slots, tree)[0]


def capture_early_exit(
    runner: ModelRunner,
    exit_layer: int,
    batch_size: int,
    tokens: int = 1,
    tree: TokenTree | None = None,
    queries: tuple[int, ...] | None = None,
) -> ExitGraph:
    """Capture ``runner.forward`` for ``[batch_size, tokens]`` inputs and cut it after
    ``exit_layer`` layers (:func:`specfx.model.capture.capture_forward`, then the early-exit pass).
    The runner's cache must be allocated; the capture writes only its trash slot.

    With ``tree`` and ``queries`` (indices 1..N of ``tree``'s nodes, one per input column, so
    ``tokens`` is ``len(queries)``): the forward over those token-tree nodes, masked by
    :class:`~specfx.model.masks.TreeView`. Its tensors (``lengths [B]``, ``depth [1, N+1]``,
    ``ancestors [1, N+1, N+1]``) become inputs of the graph; ``queries`` is a constant of it,
    so each set of queries needs a capture of its own."""
    if (tree is None) != (queries is None):
        raise ValueError("capture_early_exit: pass tree= and queries= together (or neither).")
    view = None
    if tree is not None:
        tensors = tree.tensors(runner.device)
        view = TreeView(None, tensors.depth, tensors.ancestors, tuple(queries))  # lengths: the capture's own
    layer_names = decoder_blocks(runner.model)
    cut = capture_transform(  # through the pipeline's one entry; its own error is refused by the caller
        "early_exit", early_exit, raises=(EarlyExitError,), layer_names=layer_names, exit_layer=exit_layer
    )

    try:
        return capture_forward(runner, batch_size, tokens, tree=view, transform=cut, result=ExitGraph)
    except CaptureError as e:
        raise EarlyExitError(f"early exit: {e}") from e


def _check_layer(layer, num_layers: int | None = None, blocks: str = "layers") -> int:
    """``layer`` as N, checked against ``num_layers`` decoder blocks when known (``blocks`` says
    what those are when they are not ``config.num_hidden_layers`` layers)."""
    upper = "num_hidden_layers - 1" if num_layers is None else str(num_layers - 1)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(
            f"early exit layer must be an int N, the number of the target's decoder layers the "
            f"drafter keeps (1 <= N <= {upper}), got {layer!r}."
        )
    if layer < 1 or (num_layers is not None and layer >= num_layers):
        what = "" if num_layers is None else f" (the target has {num_layers} {blocks})"
        raise ValueError(
            f"early exit layer must be in [1, {upper}]{what}, got {layer}: the drafter keeps the "
            f"target's first N layers, so N = 0 keeps nothing and N >= num_hidden_layers is the "
            f"target itself."
        )
    return layer


class EarlyExit(TreeDrafting, Drafter):
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
    runs_target_layers = True

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
        blocks = len(decoder_blocks(target.model))  # fail at speculate() time if the layers cannot be found
        n = target.num_layers
        what = "layers" if blocks == n else f"decoder blocks; config.num_hidden_layers = {n} counts {n // blocks} per block"
        _check_layer(self.layer, blocks, what)
        if target is not self.target:  # a drafter object reused by a new generator: the old captures read the old runner
            self._graphs, self.graph, self.levels = {}, None, {}
        self.target = target
        self._capture_now()

    def _capture_now(self) -> None:
        """Capture and cut the target's forward now, for the first shape a generator allocates
        (one row, ``SpecConfig.min_capacity``'s default), and keep it for that shape: a forward
        Dynamo cannot capture as one graph (DBRX loops over the experts its tokens were routed
        to: data-dependent) or a graph the cut cannot split is refused by ``speculate()``, not
        by the first ``generate()``."""
        try:
            with self.target.scratch_cache(1, PROBE_MIN_CAPACITY):
                self._capture(1, PROBE_MIN_CAPACITY, None)
        except EarlyExitError as e:
            raise ValueError(
                f"draft='early_exit:{self.layer}': {str(e).rstrip('.')}. The early-exit drafter is the target's forward "
                f"captured as one graph and cut after layer {self.layer}; use a drafter that needs no "
                f"capture of the target (a draft model, 'prompt_lookup')."
            ) from e

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
