"""The drafter interface: :class:`Drafter`, and the capabilities a drafter has by its type.

A drafter proposes the tokens of a round. It runs inside the round graph, so everything it does
on the round's path (``observe``, ``propose``, ...) is fixed-shape tensor code with no host sync.
What it can draft is its type: every :class:`Drafter` drafts chains of K; one that also drafts
static token trees mixes in :class:`TreeDrafting`, one that grows EAGLE-2's dynamic trees
:class:`DynamicTreeDrafting`, one that adds query tokens of its own to the tree round's target
forward :class:`Branching`. The engine asks these through :func:`shape_refusal` and
:func:`branch_slots`, never through flags.

Where to add a drafter
----------------------
1. A module of its own in :mod:`specfx.drafters` (``specfx/drafters/my_drafter.py``; a head over
   the target's hidden states in :mod:`specfx.drafters.heads`, its checkpoint layout beside it).
2. Subclass :class:`Drafter` and implement at least :meth:`Drafter.propose`; ``bind`` (check the
   target), ``allocate`` (per-row state), ``prefill`` and ``observe`` as it needs them. Set
   ``taps`` to read the target's hidden states, ``max_depth`` if it cannot draft past some depth,
   ``resumable`` if its proposals depend on the committed tokens only.
3. To draft token trees: ``class MyDrafter(TreeDrafting, Drafter)`` and implement
   :meth:`TreeDrafting.propose_tree` (and ``commit_tree`` if it keeps per-row KV); EAGLE-2
   dynamic trees: :class:`DynamicTreeDrafting`; extra tokens in the target's forward:
   :class:`Branching`. A drafter that runs a model per proposal drafts its chain with
   :func:`specfx.drafters.drafting.draft_chain`, its tree with
   :func:`specfx.trees.drafting.draft_tree`.
4. For ``draft="my_drafter"`` / ``"my_drafter:ARG"``: a ``from_name(arg)`` factory in the module
   and one line in :data:`specfx.drafters.registry.NAMED_DRAFTERS` (``"name": "module:from_name"``;
   the module is imported only when the name is resolved). For it to be picked without ``draft=``,
   an entry in :data:`specfx.drafters.registry.DEFAULT_DRAFTERS`. Export the class from
   ``specfx/drafters/__init__.py`` (``__all__`` and its lazy ``_LAZY`` table) and, if it is public
   API, from ``specfx/__init__.py``.
5. Tests in ``tests/unit/drafters/test_my_drafter.py`` (heads: ``tests/unit/drafters/heads/``):
   at least that greedy output equals the target's own (``model.generate()``), chains and, if it
   drafts them, trees; add it to the drafter table of ``tests/conformance/test_live_kv.py`` to
   run it under a live-KV bound with the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specfx.trees.types import DynamicTree

if TYPE_CHECKING:
    from specfx.model.runner import ModelRunner

__all__ = ["Branching", "Drafter", "DynamicTreeDrafting", "TREE_DRAFTERS", "TreeDrafting", "branch_slots", "shape_refusal"]

# The drafters that branch (speculate(tree=...)), named by the refusals of those that do not.
TREE_DRAFTERS = (
    "a draft model, prompt lookup, early exit (draft='early_exit:N'), a PARD or DFlash draft, Medusa or EAGLE heads"
)


class Drafter:
    """Interface. ``ctx`` is the :class:`specfx.engine.chain_round.RoundContext` of the running round."""

    name = "drafter"
    # The target hidden states the drafter reads (see specfx.taps): () for none; else the round
    # asks the target's forward for these taps and calls observe() with them, in this order.
    taps: tuple[str, ...] = ()
    # The most tokens past the pending one the drafter can propose along one path (Medusa: one
    # per head), or None for no limit: speculate() refuses a K ("auto"'s included) or a tree
    # depth beyond it.
    max_depth: int | None = None
    # True when proposals depend only on the row's committed tokens (no KV, no features): the
    # drafter may sit out rounds of plain decoding and propose again, so "auto" probes for
    # speculation paying again after turning it off (specfx.engine.auto_k). False: it keeps state that
    # K = 0 rounds leave behind, and "auto" keeps speculation off for the rest of the call.
    resumable = False
    # True when drafting runs the target's own layers (early exit): it would advance a stateful
    # target's recurrent state, which only the round's verify forward may (decision 76).
    runs_target_layers = False

    # ----------------------------------------------------------------- setup (host, at speculate())
    def bind(self, target: ModelRunner) -> None:
        """Check compatibility with the target at ``speculate()`` time."""

    def allocate(self, batch_size: int, capacity: int) -> None:
        """(Re)allocate per-row state for a batch size and buffer capacity. ``batch_size`` is
        the generator's batch bucket (a power of two): rows past a call's own batch are inert,
        finished from the start, and their proposals are never used."""

    # ----------------------------------------------------------------- the round shape (host)
    def round_tree(self):
        """The :class:`~specfx.trees.types.TokenTree` every round of this drafter verifies, or None
        (the default: the round's shape comes from ``tree=`` / ``num_speculative_tokens``).
        Drafters that fix the round's tree themselves (lookahead: G chains of N - 1) return it;
        speculate() then refuses tree=, and "auto" chooses between that tree and K = 0."""
        return None

    def prepare_tree(self, tree) -> None:
        """The :class:`~specfx.trees.types.TokenTree` every round will draft, or None for chains:
        called by ``speculate()`` after :meth:`bind` (and the shape checks), before any
        :meth:`allocate`, for drafters that prepare per-shape state for a tree (early exit
        captures a graph per tree level)."""

    def stateful_target_refusal(self, model) -> str | None:
        """Why this drafter cannot draft for ``model``, a target keeping recurrent or
        linear-attention state, or None (the default) when it can: ``speculate()`` refuses with it.
        (A drafter running the target's own layers is refused before this: ``runs_target_layers``.)"""
        return None

    def chain_only_reason(self) -> str:
        """Why this drafter drafts chains only (asked by :func:`shape_refusal` only of drafters
        without :class:`TreeDrafting`): the refusal ``speculate(tree=...)`` raises."""
        return (
            f"the {self.name} drafter drafts a chain only, not a token tree; use "
            f"num_speculative_tokens=K without tree=, or a drafter that branches: {TREE_DRAFTERS}."
        )

    # ----------------------------------------------------------------- the round (in the graph)
    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """See the prompt: ids/positions/slots ``[B, P]`` (padding goes to the trash slot)."""

    def observe(self, ctx, features: tuple[torch.Tensor, ...], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Only for drafters with ``taps``: the target's hidden states ``features`` (one ``[B, T,
        H]`` tensor per tap, in the order of ``taps``) for the tokens its forward just processed
        at ``positions``/``slots [B, T]``; called at the end of prefill and of every round, after
        the emitted tokens and lengths are committed (MTP, Medusa and EAGLE heads). After a tree
        round, column i is the accepted path's node at depth i (position ``L + i``), already
        moved to slot ``L + i``; columns past the accepted path hold rejected nodes."""

    def propose(self, ctx) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return proposals ``[B, K]`` and the probabilities ``q [B, K, V]`` each was sampled
        from (None for a deterministic drafter: q is then one-hot on the proposal)."""
        raise NotImplementedError

    def commit_chain(self, n: torch.Tensor) -> None:
        """After a chain round's verification (K > 0): ``n [B]`` tokens emitted per row (0 for rows
        already finished). Only for drafters whose state cannot simply be overwritten next round
        (a draft model with recurrent state rolls it back here, decision 81)."""


class TreeDrafting:
    """Capability mixin: the drafter drafts static token trees (``speculate(tree=TokenTree)``).

    ``class MyDrafter(TreeDrafting, Drafter)``; the round calls :meth:`propose_tree` instead of
    ``propose`` and, after acceptance, :meth:`commit_tree`."""

    def propose_tree(self, ctx) -> torch.Tensor:
        """A token for every node of ``ctx.token_tree``: ``[B, N]``, node n's in column n - 1.
        Child ``r`` of a node must be a deterministic choice (the drafter's r-th most likely
        token there): tree verification treats every proposal as one-hot. A drafter may also
        return ``(tokens, parents [B, N+1])``: each row's own tree of N nodes (parents before
        children, no deeper than ``ctx.token_tree``), verified in its place (lookahead's trie)."""
        raise NotImplementedError

    def commit_tree(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """After a tree round: move any per-row KV of the accepted path from slots ``src
        [B, D]`` to ``dst [B, D]`` (see :meth:`specfx.model.cache.SlotCache.move`)."""

    def tree_refusal(self) -> str | None:
        """Why this instance cannot draft trees after all (its model cannot run them), or None."""
        return None


class DynamicTreeDrafting(TreeDrafting):
    """Capability mixin: the drafter grows EAGLE-2's dynamic trees (``TokenTree.eagle2()``),
    re-scoring every node it drafts with the path's context."""

    def propose_dynamic_tree(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """This round's tree for every row: node tokens ``[B, N]`` and parents ``[B, N+1]``
        (parents before children; see :func:`specfx.trees.drafting.draft_dynamic_tree`)."""
        raise NotImplementedError


class Branching:
    """Capability mixin: extra query tokens in the tree round's target forward (lookahead's
    Jacobi branch). Their outputs are never accepted, their KV goes to scratch slots past the
    tree's and is never committed, and no tree node sees them. Not with taps (speculate()
    refuses the pair)."""

    branch_slots = 0  # scratch slots the branch writes past the tree's (its token count E)

    def branch(self, ctx):
        """A :class:`specfx.trees.drafting.Branch` of ``branch_slots`` tokens to run in this tree
        round's target forward."""
        raise NotImplementedError

    def observe_branch(self, ctx, root_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's raw logits at the pending token ``[B, 1, V]`` and at the branch's tokens
        ``[B, E, V]``, right after the round's forward (before acceptance is committed)."""


def branch_slots(drafter: Drafter) -> int:
    """Scratch slots a drafter's branch adds to a tree round (0 without :class:`Branching`)."""
    return drafter.branch_slots if isinstance(drafter, Branching) else 0


def shape_refusal(drafter: Drafter, tree) -> str | None:
    """Why ``drafter`` cannot draft rounds of this shape (a TokenTree, a DynamicTree, or None for
    a chain), or None if it can: the capability is the drafter's type."""
    if tree is None:
        return None
    if isinstance(tree, DynamicTree):
        if not isinstance(drafter, DynamicTreeDrafting):
            return (
                f"the {drafter.name} drafter cannot grow a dynamic tree (TokenTree.eagle2()), which needs a drafter "
                f"that re-scores every node it drafts with the path's context (EAGLE heads: specfx.Eagle, "
                f"specfx.Eagle3); use a static tree (a TokenTree) or a chain with this drafter."
            )
        return drafter.tree_refusal()
    if not isinstance(drafter, TreeDrafting):
        return drafter.chain_only_reason()
    return drafter.tree_refusal()
