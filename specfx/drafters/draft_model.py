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
from specfx.sampling.processors import PLACEHOLDER
from specfx.trees.drafting import draft_tree, level_inputs, tree_view

__all__ = ["DraftModel", "check_draft_runner"]


def check_draft_runner(runner: ModelRunner, target: ModelRunner, what: str) -> None:
    """ValueError unless a draft model's runner fits ``target``: the same vocabulary and device
    (``what`` names the draft in the message: "draft", "PARD draft")."""
    if runner.vocab_size != target.vocab_size:
        raise ValueError(
            f"{what} and target vocabularies differ: the draft's LM head has {runner.vocab_size} "
            f"rows, the target's {target.vocab_size}. Speculative decoding needs a draft trained "
            f"with the target's tokenizer (same vocabulary size and ids)."
        )
    if runner.device != target.device:
        raise ValueError(f"{what} is on {runner.device} but target is on {target.device}; move both to one device.")


class DraftModel(TreeDrafting, Drafter):
    """A smaller HF causal LM sharing the target's vocabulary.

    Cache invariant: at a round's start the draft's KV holds every committed position up to
    ``L - 2`` (L = position of the pending token). The first draft step feeds the two tokens at
    ``L - 1`` and ``L`` (a *catch-up*: position ``L - 1`` is new to the draft exactly when all K
    proposals of the previous round were accepted), then K - 1 single-token steps follow. So the
    draft's cache after a round is what it would be had it seen only the emitted tokens; slots
    of rejected proposals are overwritten before any query can see them.

    A draft with recurrent or linear-attention state (decision 81) cannot overwrite: its state
    absorbs every input. It holds the same invariant (the state after positions ``0 .. L - 2``
    exactly): the prefill leaves the prompt's last token out, and each round records the K + 1
    inputs of its forwards (``L - 1``, ``L``, proposals 1 .. K - 1) from a snapshot taken before
    the catch-up; :meth:`commit_chain` rolls the state back to the first n of them, n the row's
    emitted count, which ends at the new ``L - 2``. Chains only (trees: one state per branch).
    """

    name = "draft_model"

    def __init__(self, model):
        self.runner = ModelRunner(model, role="draft")
        self.model = model

    def bind(self, target: ModelRunner) -> None:
        check_draft_runner(self.runner, target, "draft")

    def allocate(self, batch_size: int, capacity: int) -> None:
        self.runner.allocate(batch_size, capacity)

    def prefill(self, ids, positions, slots) -> None:
        # Only the KV is needed: the last column's logits only (eager), none once compiled (the passes)
        if self.runner.stateful:
            ids, positions, slots = self._without_last(ids, positions, slots)
            self.runner.reset_state()  # every row restarts from a zero state (= no state)
        self.runner.forward(ids, positions, slots, last_only=True)

    def _without_last(self, ids, positions, slots):
        """The prompt ``[B, P]`` (left-padded) shifted one column right: each row's last token
        dropped, one more padding column in front (same width, still left-padded: a state never
        sees padding after a real token), so the state ends at position ``L - 2``; the first
        round's catch-up feeds the last token."""
        fills = ((ids, PLACEHOLDER), (positions, 0), (slots, self.runner.cache.trash_slot))
        return tuple(torch.cat([torch.full_like(x[:, :1], v), x[:, :-1]], dim=1) for x, v in fills)

    def _catch_up(self, ctx) -> torch.Tensor:
        lengths = ctx.lengths  # [B]
        pos = torch.stack([lengths - 1, lengths], dim=1)  # [B, 2]
        ids = ctx.tokens.gather(1, pos)  # [B, 2]: last committed token, pending token
        return self.runner.forward(ids, pos, pos)[:, -1:]  # [B, 1, V]

    def propose(self, ctx):
        lengths = ctx.lengths  # [B]
        if self.runner.stateful:  # the round's K + 1 inputs, for commit_chain's rollback
            self.runner.start_recording()
        first = self._catch_up(ctx)

        def step(i, proposals):
            p = (lengths + i).unsqueeze(1)  # [B, 1], the position of proposal i - 1
            return self.runner.forward(proposals[-1], p, p)

        drafted = draft_chain(ctx, first, step)
        if self.runner.stateful:
            self.runner.stop_recording()
        return drafted

    def commit_chain(self, n: torch.Tensor) -> None:
        # inputs L - 1, L, then proposals 1 .. K - 1: the first n end at the new L - 2 (n = 0 for
        # rows already finished: the snapshot, unchanged)
        if self.runner.stateful:
            self.runner.roll_back_state(n)

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
