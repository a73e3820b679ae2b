"""Drafters: whatever proposes the K tokens of a round.

A drafter runs inside the round graph, so everything it does is fixed-shape tensor code.
:class:`DraftModel` wraps a small causal LM; drafter-free methods (prompt lookup, early exit,
MTP heads) are listed by name in :data:`NAMED_DRAFTERS` and, to be picked when no draft is
given, with an availability check in :data:`DEFAULT_DRAFTERS`. Both tables are declarative:
their modules are imported when a name is resolved, never registered by importing them.
Drafters that run a model per proposal draft through one loop, :func:`draft_chain`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_tree, level_inputs, tree_view
from specfx.trees.types import DynamicTree

__all__ = [
    "Branching",
    "Drafter",
    "DraftModel",
    "DynamicTreeDrafting",
    "TreeDrafting",
    "branch_slots",
    "shape_refusal",
    "DEFAULT_DRAFTERS",
    "NAMED_DRAFTERS",
    "TREE_DRAFTERS",
    "draft_chain",
    "draft_token",
    "resolve_drafter",
    "stash_at",
]

# The drafters that branch (speculate(tree=...)), named by the refusals of those that do not.
TREE_DRAFTERS = "a draft model, prompt lookup, early exit (draft='early_exit:N'), Medusa or EAGLE heads"


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

    def bind(self, target: ModelRunner) -> None:
        """Check compatibility with the target at ``speculate()`` time."""

    def allocate(self, batch_size: int, capacity: int) -> None:
        """(Re)allocate per-row state for a batch size and buffer capacity. ``batch_size`` is
        the generator's batch bucket (a power of two): rows past a call's own batch are inert,
        finished from the start, and their proposals are never used."""

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

    def prepare_tree(self, tree) -> None:
        """The :class:`~specfx.trees.types.TokenTree` every round will draft, or None for chains:
        called by ``speculate()`` after :meth:`bind` (and the shape checks), before any
        :meth:`allocate`, for drafters that prepare per-shape state for a tree (early exit
        captures a graph per tree level)."""

    # Drafters that fix the round's tree themselves (lookahead: G chains of N - 1) return it
    # here; speculate() then refuses tree= and num_speculative_tokens="auto".
    def round_tree(self):
        """The :class:`~specfx.trees.types.TokenTree` every round of this drafter verifies, or None
        (the default: the round's shape comes from ``tree=`` / ``num_speculative_tokens``)."""
        return None

    def chain_only_reason(self) -> str:
        """Why this drafter drafts chains only (asked only of drafters without
        :class:`TreeDrafting`): the refusal ``speculate(tree=...)`` raises."""
        return (
            f"the {self.name} drafter drafts a chain only, not a token tree; use "
            f"num_speculative_tokens=K without tree=, or a drafter that branches: {TREE_DRAFTERS}."
        )


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


def draft_token(ctx, logits: torch.Tensor, i: int, proposals: list, qs: list) -> torch.Tensor:
    """Proposal ``i`` of a round from draft ``logits [B, 1, V]``: processed like the target's
    scores, then sampled (its distribution appended to ``qs``: q) or argmax (``ctx.choose``);
    the token is appended to ``proposals`` and returned ``[B, 1]``."""
    scores = ctx.process(logits, i, proposals)  # [B, 1, V]
    token, probs = ctx.choose(scores, 1 + i)  # [B, 1], [B, 1, V] | None
    if probs is not None:
        qs.append(probs)
    proposals.append(token)
    return token


class DraftModel(TreeDrafting, Drafter):
    """A smaller HF causal LM sharing the target's vocabulary.

    Cache invariant: at a round's start the draft's KV holds every committed position up to
    ``L - 2`` (L = position of the pending token). The first draft step feeds the two tokens at
    ``L - 1`` and ``L`` (a *catch-up*: position ``L - 1`` is new to the draft exactly when all K
    proposals of the previous round were accepted), then K - 1 single-token steps follow. So the
    draft's cache after a round is what it would be had it seen only the emitted tokens; slots
    of rejected proposals are overwritten before any query can see them.
    """

    name = "draft_model"

    def __init__(self, model):
        self.runner = ModelRunner(model, role="draft")
        self.model = model

    def bind(self, target: ModelRunner) -> None:
        if self.runner.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft and target vocabularies differ: the draft's LM head has {self.runner.vocab_size} "
                f"rows, the target's {target.vocab_size}. Speculative decoding needs a draft trained "
                f"with the target's tokenizer (same vocabulary size and ids)."
            )
        if self.runner.device != target.device:
            raise ValueError(
                f"draft is on {self.runner.device} but target is on {target.device}; move both to one device."
            )

    def allocate(self, batch_size: int, capacity: int) -> None:
        self.runner.allocate(batch_size, capacity)

    def prefill(self, ids, positions, slots) -> None:
        # Only the KV is needed: the last column's logits only (eager), none once compiled (the passes)
        self.runner.forward(ids, positions, slots, last_only=True)

    def _catch_up(self, ctx) -> torch.Tensor:
        lengths = ctx.lengths  # [B]
        pos = torch.stack([lengths - 1, lengths], dim=1)  # [B, 2]
        ids = ctx.tokens.gather(1, pos)  # [B, 2]: last committed token, pending token
        return self.runner.forward(ids, pos, pos)[:, -1:]  # [B, 1, V]

    def propose(self, ctx):
        lengths = ctx.lengths  # [B]
        first = self._catch_up(ctx)

        def step(i, proposals):
            p = (lengths + i).unsqueeze(1)  # [B, 1], the position of proposal i - 1
            return self.runner.forward(proposals[-1], p, p)

        return draft_chain(ctx, first, step)

    def propose_tree(self, ctx):
        # Level by level: all nodes of one depth in one forward, each in its scratch slot
        # L + n at position L + depth, seeing the committed prefix and its own ancestors.
        def step(queries, tokens):
            return self.runner.forward(*level_inputs(ctx, queries, tokens), tree=tree_view(ctx, queries))

        return draft_tree(ctx, self._catch_up(ctx), step)

    def tree_refusal(self) -> str | None:
        return self.runner.tree_refusal()

    def commit_tree(self, src, dst) -> None:
        self.runner.cache.move(src, dst)


def stash_at(stash: torch.Tensor, values: torch.Tensor, at: torch.Tensor) -> None:
    """Write, per row, the column of ``values [B, T, H]`` where ``at [B, T]`` is True (at most
    one per row) into ``stash [B, 1, H]`` or ``[B, H]``, in place; rows with no True column
    (finished rows, padding) keep their stash. Fixed shapes, no host sync: the observe step
    of every drafter that keeps a feature of the pending position (MTP, Medusa, EAGLE)."""
    index = at.int().argmax(dim=1).view(-1, 1, 1).expand(-1, 1, values.shape[-1])
    found = at.any(dim=1).view(-1, 1, 1)
    column = values.gather(1, index).to(stash.dtype)  # [B, 1, H]
    if stash.dim() == 2:
        column, found = column.squeeze(1), found.squeeze(1)
    stash.copy_(torch.where(found, column, stash))


def draft_chain(ctx, first_logits: torch.Tensor, step: Callable[[int, list], torch.Tensor]):
    """The K-step draft loop of every drafter that runs a model per proposal (a draft model,
    an early exit, MTP heads): proposal 0 from ``first_logits [B, 1, V]``, proposal ``i``
    (``1 <= i < K``) from ``step(i, proposals) -> logits [B, 1, V]``, where ``proposals`` holds
    the ``i`` tokens ``[B, 1]`` drafted so far (the last one is the step's input). Each is
    processed and sampled or argmaxed by :func:`draft_token`.

    Returns proposals ``[B, K]`` and q ``[B, K, V]``, the distributions the proposals were
    sampled from (None when greedy: nothing was sampled)."""
    proposals: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    logits = first_logits
    for i in range(ctx.k):
        if i > 0:  # no step after the last proposal: its logits would go unused
            logits = step(i, proposals)
        draft_token(ctx, logits, i, proposals, qs)
    return torch.cat(proposals, dim=1), torch.cat(qs, dim=1) if qs else None


# name -> factory(argument or None) -> Drafter, for ``draft="name"`` or ``draft="name:arg"``.
# A factory is a callable or a ``"module:attribute"`` reference, imported when the name is
# resolved: the table is the one place drafters are declared, and no module has to be
# imported first (or register itself as a side effect of being imported).
NAMED_DRAFTERS: dict[str, str | Callable[[str | None], Drafter]] = {
    "prompt_lookup": "specfx.drafters.prompt_lookup:from_name",
    "lookahead": "specfx.drafters.lookahead:from_name",
    "early_exit": "specfx.drafters.early_exit:from_name",
    "mtp": "specfx.drafters.mtp:from_name",
    "medusa": "specfx.drafters.heads.medusa:from_name",  # draft="medusa:DIR"
    "eagle": "specfx.drafters.heads.eagle:from_name",  # draft="eagle:DIR" (EAGLE-1/2)
    "eagle3": "specfx.drafters.heads.eagle3:from_name",  # draft="eagle3:DIR"
}


def _always(model) -> bool:
    return True


# What ``speculate(model)`` uses without ``draft=``: the first ``(name, available(model))``
# whose check passes, built as ``NAMED_DRAFTERS[name](None)``; a check is a callable or a
# ``"module:attribute"`` reference. Methods that need model parts (MTP heads) come first;
# prompt lookup needs nothing from the model, so it is the fallback.
DEFAULT_DRAFTERS: list[tuple[str, str | Callable[[object], bool]]] = [
    ("mtp", "specfx.drafters.mtp:has_mtp"),
    ("prompt_lookup", _always),
]


def _load(ref):
    """A callable from the tables above: itself, or ``"module:attribute"`` imported now."""
    if callable(ref):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _looks_like_a_path(draft: str) -> bool:
    # a hub id ("org/name") or a file-system path; no drafter name has a slash
    return "/" in draft or os.sep in draft or os.path.exists(draft)


def _named(draft: str) -> Drafter:
    name, _, arg = draft.partition(":")
    if name not in NAMED_DRAFTERS:
        known = ", ".join(repr(n) for n in sorted(NAMED_DRAFTERS)) or "none"
        if _looks_like_a_path(draft):
            raise ValueError(
                f"draft={draft!r} looks like a path or a Hugging Face hub id, but draft= takes a model "
                f"object, not where to load one from: load the draft model first, e.g. "
                f"draft=AutoModelForCausalLM.from_pretrained({draft!r}) (a smaller causal LM sharing the "
                f"target's vocabulary). A Medusa or EAGLE head directory is named with its kind: "
                f"draft='medusa:{draft}', 'eagle:{draft}' or 'eagle3:{draft}'. Named drafters: {known}."
            )
        raise ValueError(
            f"unknown drafter {draft!r}. Named drafters: {known} (an argument follows a colon, "
            f"e.g. 'prompt_lookup:3'); or pass a draft model (a causal LM sharing the target's "
            f"vocabulary; a model name is not loaded for you: draft=AutoModelForCausalLM.from_pretrained(name)) "
            f"or a specfx Drafter instance."
        )
    return _load(NAMED_DRAFTERS[name])(arg or None)


def resolve_drafter(draft, model) -> Drafter:
    """Turn ``speculate()``'s ``draft=`` into a :class:`Drafter` (not yet bound).

    ``draft`` is a Drafter (used as is), a name from :data:`NAMED_DRAFTERS` (``"name"`` or
    ``"name:arg"``), a causal LM (wrapped in :class:`DraftModel`), or None: the first entry of
    :data:`DEFAULT_DRAFTERS` available for ``model`` (the target).
    """
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str):
        return _named(draft)
    if draft is None:
        for name, available in DEFAULT_DRAFTERS:
            if _load(available)(model):
                return _named(name)
        raise ValueError(
            "speculate(): no default drafter is available for this model; pass draft=, a smaller "
            "causal LM sharing the target's vocabulary, or a drafter name."
        )
    return DraftModel(draft)
