"""The token-tree round: draft a tree, verify every node in one target forward, walk it.

Same contract as :func:`specfx.engine.chain_round.round_step` (fixed shapes, no host sync, per-row
progress, finished rows carried along), with a :class:`~specfx.trees.types.TokenTree` of N nodes and
depth D in place of a chain of K:

1. the drafter proposes a token for every node (child ``r`` of a node is the drafter's
   ``r``-th most likely token there: deterministic, so q is one-hot per child);
2. one target forward over ``[pending, node 1, ..., node N]``: node ``n`` at position
   ``L + depth[n]``, written to scratch slot ``L + n``, seeing the committed prefix and its own
   ancestors (:func:`specfx.model.masks.visible_slots`);
3. the walk (:func:`specfx.sampling.accept.tree_accept`) from the root picks the accepted path and the token after
   it;
4. the accepted path's KV moves from its scratch slots to the committed slots
   ``L + 1 .. L + m`` (target and drafter caches), so every cache is what it would be had the
   model seen only the emitted tokens.

A drafter may add a :class:`Branch` to the forward (lookahead decoding's Jacobi window): E
more query tokens after the nodes, in scratch slots ``L + N + 1 .. L + N + E``, at the
positions and with the visibility among themselves the branch gives (each also sees the
committed prefix). No node sees a branch token and no branch token sees a node, so the
verification's logits are the same with or without it; the branch's logits go to
:meth:`~specfx.drafters.base.Branching.observe_branch`, and its KV is never committed.
"""

from __future__ import annotations

import torch

from specfx.drafters.base import Branching
from specfx.engine.chain_round import RoundContext, commit, record, truncate
from specfx.engine.plan import RoundShape
from specfx.sampling.accept import emit_tokens, tree_accept
from specfx.sampling.rng import uniform
from specfx.trees.drafting import branch_view, tree_view
from specfx.trees.types import DynamicTree, TreeTensors

__all__ = ["tree_round_step"]

_STREAM_TREE_ACCEPT = 1002
_STREAM_TREE_RESIDUAL = 1003


def tree_round_step(target, drafter, state, shape: RoundShape, vocab: int):
    """One token-tree round for every row (see the module docstring). With a
    :class:`~specfx.trees.types.DynamicTree` the drafter also chooses each row's tree
    (:meth:`~specfx.drafters.base.DynamicTreeDrafting.propose_dynamic_tree`), and its tables replace the static
    ones for verification, the walk and compaction.

    ``shape`` (:class:`~specfx.engine.plan.RoundShape`) holds the tree, the Mode and whether
    to collect scores.

    Returns tokens ``[B, D+1]`` (emitted, PLACEHOLDER past ``n_emitted``) and n_emitted ``[B]``;
    with ``shape.collect`` also the processed scores and raw logits each emitted token was chosen
    from, ``[B, D+1, V]`` each (the root's, then the accepted path's nodes').
    """
    s = state
    tree, sample = shape.tree, shape.mode.sample
    s.counter.add_(1)
    ctx = RoundContext(s, shape, vocab)
    n, d = tree.size, tree.depth
    b = s.tokens.shape[0]
    active = ~s.finished
    lengths = s.lengths

    if isinstance(tree, DynamicTree):
        proposals, parents = drafter.propose_dynamic_tree(ctx)  # [B, N], [B, N+1]
        ctx.tree_tensors = TreeTensors.from_parents(parents, d)
    else:
        proposals = drafter.propose_tree(ctx)  # [B, N], or with per-row parents [B, N+1]
        if isinstance(proposals, tuple):
            proposals, parents = proposals
            ctx.tree_tensors = TreeTensors.from_parents(parents, d)
    tt = ctx.tree_tensors
    pending = s.tokens.gather(1, lengths.unsqueeze(1))  # [B, 1]
    ids = torch.cat([pending, proposals], dim=1)  # [B, N+1]
    nodes = tuple(range(n + 1))
    pos = lengths.unsqueeze(1) + tt.depth  # [B, N+1]
    branch = drafter.branch(ctx) if isinstance(drafter, Branching) else None
    if branch is None:
        forward_ids, forward_pos, view = ids, pos, tree_view(ctx, nodes)
    else:  # the branch's tokens after the nodes, in the slots after theirs
        forward_ids = torch.cat([ids, branch.ids], dim=1)
        forward_pos = torch.cat([pos.expand(b, -1), lengths.unsqueeze(1) + branch.depth], dim=1)
        view = branch_view(lengths, tt, branch)
    slots = lengths.unsqueeze(1) + torch.arange(forward_ids.shape[1], device=ids.device)  # [B, N+1(+E)]
    verified = target.forward(forward_ids, forward_pos, slots, tree=view, taps=drafter.taps)
    logits, features = verified if drafter.taps else (verified, None)
    if branch is not None:
        drafter.observe_branch(ctx, logits[:, :1], logits[:, n + 1 :])
        logits = logits[:, : n + 1]
    scores = ctx.process_nodes(logits, nodes, ids)
    u_accept = u_residual = None
    if sample:
        u_accept = uniform(s.seed, s.counter, _STREAM_TREE_ACCEPT, (b, n))
        u_residual = uniform(s.seed, s.counter, _STREAM_TREE_RESIDUAL, (b, vocab))
    stop, last, p = tree_accept(scores, ids, tt, sample, u_accept, u_residual)
    path = tt.path.expand(b, -1, -1).gather(1, stop.view(b, 1, 1).expand(b, 1, d + 1)).squeeze(1)  # [B, D+1]
    n_accepted = tt.depth.expand(b, -1).gather(1, stop.unsqueeze(1)).squeeze(1)  # [B]
    out = emit_tokens(ids.gather(1, path)[:, 1:], n_accepted, last)  # [B, D+1]

    out, n_emit, emitted, done = truncate(s, out, n_accepted, active)
    if sample:
        at_path = p.gather(1, path.unsqueeze(-1).expand(-1, -1, vocab))  # [B, D+1, V]
        s.invalid.copy_(s.invalid | (at_path.isnan().any(dim=-1) & emitted).any(dim=1))

    # The accepted path's KV: scratch slots L + path[i] -> committed slots L + i (i = 1..m).
    depth_ids = torch.arange(1, d + 1, device=ids.device).unsqueeze(0)  # [1, D]
    moved = depth_ids <= torch.where(active, n_accepted, 0).unsqueeze(1)
    dst = lengths.unsqueeze(1) + depth_ids
    src = torch.where(moved, lengths.unsqueeze(1) + path[:, 1:], dst)
    target.cache.move(src, dst)
    drafter.commit_tree(src, dst)
    at = lengths.unsqueeze(1) + torch.arange(d + 1, device=ids.device)  # [B, D+1], before commit() moves lengths
    commit(s, out, n_emit, emitted, done)
    if features is not None:  # the accepted path's features, the node at depth i in column i (now at slot L + i)
        along = path.unsqueeze(-1)
        drafter.observe(ctx, tuple(f.gather(1, along.expand(-1, -1, f.shape[-1])) for f in features), at, at)
    record(s, active, n, n_accepted, n_emit, shape.max_accepted)
    if shape.collect:
        take = path.unsqueeze(-1).expand(-1, -1, vocab)
        return out, n_emit, scores.gather(1, take), logits.float().gather(1, take)
    return out, n_emit
