"""The EAGLE drafters' round: a small head that drafts from the target's own hidden states.

EAGLE (Li et al., 2024; SafeAILab/EAGLE) drafts with one decoder layer that reads, at each
position, the token there and the target's feature (hidden state) one position earlier, and
predicts the feature of its own position; the target's LM head turns that prediction into a
draft token. Deeper draft steps feed the head's own output back as the feature. EAGLE-1/2
(:class:`Eagle`) read the target's last hidden state after its final norm; EAGLE-3
(:mod:`specfx.drafters.heads.eagle3`) fuses several layers' hidden states instead. Both share the
cache protocol of :class:`EagleBase`, here: how the head's entries are written and read in the
round. The heads themselves (their modules, checkpoints and binding) are in
:mod:`specfx.drafters.heads.eagle` and :mod:`specfx.drafters.heads.eagle3`.

The cache protocol
------------------
An *entry* at position ``t`` pairs the token ``x_t`` with the feature of position ``t - 1``:
the target's feature for committed positions, the head's own output for drafted ones. Its
output predicts the feature at ``t``, and the LM head on that output the token at ``t + 1``.
Entry ``t`` lives at slot ``t`` of the head's one-layer static KV cache, at position ``t``.
(SafeAILab numbers the entry pairing ``x_t`` with ``f_{t-1}`` as position ``t - 1``; rotary
attention depends only on position differences, so indexing entries by the token's position
is the same attention.) Position 0 has no entry (no feature precedes it): slot 0 is masked
out, the query's own slot always visible so no mask row is empty.

* :meth:`EagleBase.observe` runs after every target forward (prefill, chain round, tree
  round), once the emitted tokens are committed. For each position ``p`` the target just
  processed (real columns: slot == position) it writes the entry at ``p + 1`` (token
  ``ctx.tokens[p + 1]``, feature ``f_p``) in one forward, and stashes that forward's output at
  the new pending position ``ctx.lengths`` (rows without such a column keep their stash).
  Entries past the pending token pair garbage tokens or rejected features; every one of those
  slots is rewritten by a later observe before any query can see it. So after a round the
  head's cache is what it would be had it seen only the emitted tokens, with no catch-up
  forward in propose.
* :meth:`EagleBase.propose` (a chain of K): proposal 1 is the LM head on the stash (the
  entry at the pending position ``L``); step ``i`` writes the entry ``(proposal i, previous
  output)`` at position and slot ``L + i``. Proposals are processed and sampled like the
  target's scores (:func:`specfx.drafters.drafting.draft_chain`), so sampling stays lossless.
* :meth:`EagleBase.propose_tree` (a static :class:`~specfx.trees.types.TokenTree`): node ``n``'s entry
  sits at position ``L + depth[n]`` in scratch slot ``L + n`` and sees the committed entries
  and its ancestors' (the tree mask); its feature is its parent's output (the root's is the
  stash: the root is the pending token, whose entry observe committed at slot ``L``).
  :meth:`commit_tree` moves nothing: the next observe rewrites the accepted path's entries.
* :meth:`EagleBase.propose_dynamic_tree` (EAGLE-2, ``TokenTree.eagle2()``): the same entries,
  grown per row by :func:`specfx.trees.drafting.draft_dynamic_tree`: the ``k`` nodes expanded at a
  depth run as one forward, each reading its parent's output, in the scratch slots and under
  the per-row tree mask that function gives.

Contract for subclasses (EAGLE-1/2 in :mod:`specfx.drafters.heads.eagle`, EAGLE-3 in :mod:`specfx.drafters.heads.eagle3`)
----------------------------------------------------------------------------------------------
* ``taps``: the target hidden states the head reads (see :class:`specfx.drafters.base.Drafter`).
* ``_bind(target)``: build and check the head for ``target`` (a :class:`~specfx.model.runner.ModelRunner`),
  move its own parameters to the target's device and dtype, and set ``state_size`` (S, the width
  of an entry's output and feature input). The base's :meth:`bind` has already set
  ``self.target`` and ``self.mask_format``.
* ``_feature(features) -> [B, T, S]``: the target's taps (one ``[B, T, H]`` tensor each) as the
  feature input of entries (EAGLE-1: the ``"final"`` tap itself; EAGLE-3: its fused taps).
* ``_entry(ids [B, T], feature [B, T, S], positions, slots, tree) -> out [B, T, S]``: one draft
  forward writing the entries' KV at ``slots`` (set ``self.cache.slots`` first; mask with
  :meth:`_entry_mask`; ``tree`` a :class:`~specfx.model.masks.TreeView` or None).
* ``_logits(out) -> [B, T, V]``: draft logits over the target's vocabulary.
* ``_allocate_kv(batch, capacity)``: set ``self.cache`` (default: a one-layer
  :class:`~specfx.model.cache.SlotCache`); the base then allocates the stash and runs one eager
  probe entry (writing only the trash slot) so the KV buffers exist before any compiled graph.
"""

from __future__ import annotations

import torch

from specfx.drafters.base import Drafter, DynamicTreeDrafting
from specfx.drafters.drafting import draft_chain, stash_at
from specfx.model.cache import SlotCache
from specfx.model.dynamo import mark_static
from specfx.model.masks import TreeView, check_attn_implementation, to_format, visible_slots
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_dynamic_tree, draft_tree, level_inputs, tree_view

__all__ = ["EagleBase"]


class EagleBase(DynamicTreeDrafting, Drafter):
    """A drafter that runs a head on the target's features, with its own one-layer static KV
    (see the module docstring for the cache protocol and the subclass contract)."""

    target: ModelRunner
    mask_format: str
    state_size: int
    cache: SlotCache | None = None
    stash: torch.Tensor | None = None  # [B, 1, S] the entry's output at the pending position

    # ----------------------------------------------------------------- setup
    def bind(self, target: ModelRunner) -> None:
        why = target.taps_refusal()
        if why is not None:
            raise ValueError(why)
        self.target = target
        self.mask_format = check_attn_implementation(target.model)
        self._bind(target)

    def _bind(self, target: ModelRunner) -> None:
        raise NotImplementedError

    def _allocate_kv(self, batch_size: int, capacity: int) -> None:
        self.cache = SlotCache(1, batch_size, capacity, self.target.device)

    def allocate(self, batch_size: int, capacity: int) -> None:
        device = self.target.device
        self._allocate_kv(batch_size, capacity)
        self.stash = torch.zeros((batch_size, 1, self.state_size), dtype=self.target.dtype, device=device)
        mark_static(self.stash)  # written in place every round, like the KV buffers
        zeros = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        trash = torch.full_like(zeros, self.cache.trash_slot)
        with torch.no_grad():
            # transformers installs its hidden-state recording lazily on the first
            # output_hidden_states call: do that here, eagerly, not inside a compiled graph
            self.target.forward(zeros, zeros, trash, taps=self.taps)
            self._entry(zeros, self.stash, zeros, trash, None)  # allocates the KV buffers

    # ----------------------------------------------------------------- the head (subclasses)
    def _feature(self, features: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def _entry(self, ids, feature, positions, slots, tree: TreeView | None) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _entry_mask(self, positions: torch.Tensor, tree: TreeView | None, pattern=("full", None)) -> torch.Tensor:
        """``[B, 1, T, C]`` in the target's mask format: the usual causal (or tree) visibility
        within the layer's ``pattern``, without slot 0 (it holds no entry); a chain query always
        sees its own slot, so the probe at position 0 has a non-empty row (SDPA would give NaN).
        Tree queries sit at positions >= 1 and see their own slot through the tree mask."""
        capacity = self.cache.capacity
        visible = visible_slots(positions, capacity, pattern, tree)
        slots = torch.arange(capacity, device=positions.device).view(1, 1, 1, -1)
        if tree is None:
            visible = visible & ((slots >= 1) | (slots == positions.unsqueeze(1).unsqueeze(-1)))
        else:
            visible = visible & (slots >= 1)
        return to_format(visible, self.mask_format, self.target.dtype)

    # ----------------------------------------------------------------- the round
    def observe(self, ctx, features, positions, slots) -> None:
        """Write the entries after the positions the target just processed (``features`` at
        ``positions``/``slots [B, T]``) and stash the output at the pending position."""
        feature = self._feature(features).to(self.stash.dtype)  # [B, T, S]
        capacity = self.cache.capacity
        q_pos = positions + 1  # [B, T]: the entry at p + 1 reads the feature at p
        q_slots = torch.where(slots == positions, q_pos, self.cache.trash_slot).clamp(max=capacity - 1)
        ids = ctx.tokens.gather(1, q_pos.clamp(max=ctx.tokens.shape[1] - 1))  # committed up to the pending token
        out = self._entry(ids, feature, q_pos, q_slots, None)  # [B, T, S]
        stash_at(self.stash, out, q_pos == ctx.lengths.unsqueeze(1))  # one True per row that advanced

    def propose(self, ctx):
        lengths = ctx.lengths.unsqueeze(1)  # [B, 1], the pending position L
        last = self.stash  # [B, 1, S]: the entry output the next step reads as its feature

        def step(i, proposals):
            nonlocal last
            pos = lengths + i  # [B, 1]: proposal i - 1 (0-based) sits at L + i
            last = self._entry(proposals[-1], last, pos, pos, None)
            return self._logits(last)

        return draft_chain(ctx, self._logits(self.stash), step)

    def propose_tree(self, ctx):
        parents = ctx.token_tree.parents
        outputs: dict[int, torch.Tensor] = {0: self.stash}  # node -> its entry's output [B, 1, S]

        def step(queries, tokens):
            ids, pos, slots = level_inputs(ctx, queries, tokens)
            feature = torch.cat([outputs[parents[q]] for q in queries], dim=1)  # [B, T, S]
            out = self._entry(ids, feature, pos, slots, tree_view(ctx, queries))
            for t, q in enumerate(queries):
                outputs[q] = out[:, t : t + 1]
            return self._logits(out)

        return draft_tree(ctx, self._logits(self.stash), step)

    def propose_dynamic_tree(self, ctx):
        # EAGLE-2: the expanded nodes of each depth run as one draft forward, each reading its
        # parent's output (the root's children: the stash), in the scratch slots the tree
        # growth assigns; observe rewrites the accepted path's entries as for a static tree.
        def step(ids, states, positions, slots, view):
            out = self._entry(ids, states, positions, slots, view)  # [B, k, S]
            return self._logits(out), out

        return draft_dynamic_tree(ctx, self._logits(self.stash), self.stash, step)

    def commit_tree(self, src, dst) -> None:
        """Nothing to move: observe rewrites the accepted path's entries from the target's
        features, which is what the head would have computed had it seen only those tokens."""
