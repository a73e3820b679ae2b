"""Acceptance: which proposals a round keeps, and the token emitted after them.

Vocabulary (DESIGN.md): a round verifies K *proposals*; the first ``n_accepted`` are
*accepted*; then one *correction* (sampled from norm(max(0, p - q)) at the first rejection) or
*bonus* (sampled from p after all K were accepted) follows, so a row *emits* ``n_accepted + 1``
tokens. A chain round accepts with :func:`greedy_verify` or :func:`rejection_verify`; a
token-tree round walks its tree with :func:`tree_accept`; both lay out what a row emits with
:func:`emit_tokens`.

Everything here is graph-friendly tensor code: no host sync, no data-dependent Python
branches, fixed output shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specfx.sampling.processors import PLACEHOLDER
from specfx.sampling.rng import sample_from

if TYPE_CHECKING:
    from specfx.trees.types import TreeTensors

__all__ = ["emit_tokens", "greedy_verify", "rejection_verify", "tree_accept"]


def emit_tokens(proposals: torch.Tensor, n_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """tokens [B, K+1]: accepted proposals, then ``last`` (correction/bonus), then PLACEHOLDER."""
    b, k = proposals.shape
    idx = torch.arange(k + 1, device=proposals.device).unsqueeze(0)  # [1, K+1]
    padded = torch.cat([proposals, proposals.new_full((b, 1), PLACEHOLDER)], dim=1)
    n = n_accepted.unsqueeze(1)
    out = torch.where(idx < n, padded, last.unsqueeze(1))
    return torch.where(idx <= n, out, PLACEHOLDER)


def greedy_verify(target_scores: torch.Tensor, proposals: torch.Tensor):
    """Greedy acceptance: keep proposals while they equal argmax p, then emit argmax p.

    Args:
        target_scores: ``[B, K+1, V]`` processed target logits at the K+1 verified positions.
        proposals: ``[B, K]`` drafted tokens.
    Returns:
        tokens ``[B, K+1]`` (PLACEHOLDER past the emitted ones), n_accepted ``[B]``.
    """
    best = target_scores.argmax(dim=-1)  # [B, K+1]
    accept = proposals == best[:, :-1]
    n_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    last = best.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
    return emit_tokens(proposals, n_accepted, last), n_accepted


def rejection_verify(
    p: torch.Tensor,  # [B, K+1, V] target probabilities
    q: torch.Tensor | None,  # [B, K, V] probabilities the drafter sampled each proposal from; None: one-hot
    proposals: torch.Tensor,  # [B, K]
    u_accept: torch.Tensor,  # [B, K] uniforms
    u_resample: torch.Tensor,  # [B, V] uniforms
):
    """Lossless speculative sampling (Leviathan et al. / Chen et al.); ``q=None`` for a
    deterministic drafter (prompt lookup), whose q is one-hot on its proposals.

    Accept proposal x with probability min(1, p(x)/q(x)) via the strict test ``u·q(x) < p(x)``
    (a token with p(x) = 0 is never accepted); at the first rejection sample the correction
    from norm(max(0, p - q)) (p is not mutated); after K acceptances sample the bonus from p.
    Only the one position a row emits from is resampled: the residual is built for that
    ``[B, V]`` row alone, not for all K + 1.
    Returns tokens ``[B, K+1]`` and n_accepted ``[B]``.
    """
    b, k, v = q.shape if q is not None else (*proposals.shape, p.shape[-1])
    idx = proposals.unsqueeze(-1)
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)
    q_x = 1.0 if q is None else q.gather(-1, idx).squeeze(-1)
    accept = u_accept * q_x < p_x  # q one-hot: u * 1 < p(x)
    n_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    row = n_accepted.view(b, 1, 1)
    p_row = p.gather(1, row.expand(b, 1, v)).squeeze(1)  # [B, V]: p where the row emits
    rejected = n_accepted < k  # else the bonus, sampled from p itself
    at = row.clamp(max=max(k - 1, 0))
    if q is None:
        # max(0, p - one_hot(x)) is p with p(x) set to 0, bit for bit (no [B, K, V] one-hot)
        x = proposals.gather(1, at.view(b, 1)) if k else proposals.new_zeros(b, 1)
        corrected = p_row.scatter(-1, x, 0.0)
    else:
        corrected = (p_row - q.gather(1, at.expand(b, 1, v)).squeeze(1)).clamp_min(0)
    residual = torch.where(rejected.unsqueeze(1), corrected, p_row)
    # p == q up to rounding leaves nothing to resample from; that position is then never
    # rejected in exact arithmetic, so falling back to p changes no probability.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row)
    last = sample_from(residual, u_resample)  # [B]
    return emit_tokens(proposals, n_accepted, last), n_accepted


def tree_accept(
    scores: torch.Tensor,  # [B, N+1, V] processed target scores at the root and every node
    tokens: torch.Tensor,  # [B, N+1] the pending token, then the node tokens
    tree: TreeTensors,  # the round's tables (only ``parent [1 or B, N+1]`` is read)
    sample: bool,
    u_accept: torch.Tensor | None = None,  # [B, N] uniforms, one per node (sampling)
    u_residual: torch.Tensor | None = None,  # [B, V] uniforms (sampling)
):
    """Walk the tree from the root; returns ``(stop [B], last [B], probs [B, N+1, V] | None)``:
    the deepest accepted node (0 = none accepted), the token emitted after the accepted path,
    and the target's probabilities (sampling).

    Greedy: at each node take the first child (in rank order) equal to the target's argmax
    there; ``last`` is the argmax at the stop node.

    Sampling (multi-candidate speculative sampling with one-hot proposals, as in SpecInfer):
    at a node with target distribution p, try its children in order; child c is accepted with
    probability p'(c), where p' is p with the children rejected so far at this node set to 0
    and renormalised; after an acceptance the walk continues at c with c's own distribution.
    If every child is rejected (or the node is a leaf) ``last`` is sampled from p' (p with
    all of the node's children removed). Each token's total probability at a node is then
    exactly p(token): c1 is emitted with p(c1); c2 with (1 - p(c1)) * p(c2) / (1 - p(c1)); and
    a token that is no child with (1 - sum p(children)) * p(x) / (1 - sum p(children)).
    A token proposed twice under one node is rejected on its second try (p' is 0 there).

    The walk is one pass over the nodes in index order: node n is tried iff its parent is the
    current node, which holds because parents precede children and siblings are in rank order.
    """
    b, n1, v = scores.shape
    parent = tree.parent.expand(b, -1)[:, 1:]  # [B, N]
    node_tokens = tokens[:, 1:]  # [B, N]
    cur = torch.zeros(b, dtype=torch.long, device=scores.device)
    if not sample:
        best = scores.argmax(dim=-1)  # [B, N+1]
        hit = node_tokens == best.gather(1, parent)  # [B, N]
        for n in range(1, n1):
            cur = torch.where((parent[:, n - 1] == cur) & hit[:, n - 1], n, cur)
        return cur, best.gather(1, cur.unsqueeze(1)).squeeze(1), None
    p = scores.softmax(dim=-1)  # [B, N+1, V]
    p_node = p.reshape(b, n1 * v).gather(1, parent * v + node_tokens)  # [B, N]: p(token) at its parent
    earlier = torch.ones(n1 - 1, n1 - 1, dtype=torch.bool, device=scores.device).tril(-1)
    dup = ((parent.unsqueeze(2) == parent.unsqueeze(1)) & (node_tokens.unsqueeze(2) == node_tokens.unsqueeze(1)) & earlier).any(-1)
    p_node = torch.where(dup, 0.0, p_node)
    rejected = torch.zeros(b, dtype=p.dtype, device=scores.device)  # mass rejected at the current node
    for n in range(1, n1):
        tried = parent[:, n - 1] == cur
        pn = p_node[:, n - 1]
        accept = tried & (u_accept[:, n - 1] * (1 - rejected) < pn)  # u < p(c) / (1 - rejected), strict
        cur = torch.where(accept, n, cur)
        rejected = torch.where(accept, 0.0, torch.where(tried, rejected + pn, rejected))
    at_stop = p.gather(1, cur.view(b, 1, 1).expand(b, 1, v)).squeeze(1)  # [B, V]
    kids = (parent == cur.unsqueeze(1)).to(p.dtype)  # [B, N]: all tried and rejected
    removed = torch.zeros_like(at_stop).scatter_add(1, node_tokens, kids) > 0
    residual = at_stop.masked_fill(removed, 0.0)
    # rounding can leave nothing (the children held all the mass): then no child was rejected
    # in exact arithmetic, and sampling p changes no probability
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, at_stop)
    return cur, sample_from(residual, u_residual), p
