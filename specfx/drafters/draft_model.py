"""A draft model as the drafter: a smaller Hugging Face causal LM sharing the target's
vocabulary, run through its own :class:`~specfx.model.runner.ModelRunner` (its own static KV),
drafting chains (:func:`specfx.drafters.drafting.draft_chain`) and static token trees
(:func:`specfx.trees.drafting.draft_tree`). ``speculate(model, draft=small_model)`` wraps the
model in :class:`DraftModel` (:func:`specfx.drafters.registry.resolve_drafter`).
"""

from __future__ import annotations

import torch

from specfx.drafters.base import Drafter, TreeDrafting
from specfx.drafters.drafting import draft_chain
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_tree, level_inputs, tree_view

__all__ = ["DraftModel"]


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
