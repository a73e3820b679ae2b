"""Drafting helpers shared by drafters: one proposal (:func:`draft_token`), the K-step draft
loop of every drafter that runs a model per proposal (:func:`draft_chain`: a draft model, an
early exit, MTP and EAGLE heads), and the per-row stash of a feature at the pending position
(:func:`stash_at`: MTP, Medusa and EAGLE heads). Tree drafting's counterparts are in
:mod:`specfx.trees.drafting`.

All of it runs inside the round graph: fixed shapes, no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["draft_chain", "draft_token", "stash_at"]


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
