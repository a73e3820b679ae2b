"""Drafting a token tree: the helpers a tree drafter uses to fill a round's nodes level by level.

A drafter proposes the tokens of a :class:`~specfx.trees.types.TokenTree` (static) or a
:class:`~specfx.trees.types.DynamicTree` (chosen per round from the drafter's own scores) one
depth level at a time: :func:`draft_levels` lists the levels, :func:`level_inputs` and
:func:`tree_view` give one level's forward its tokens, positions and mask, and
:func:`draft_tree` / :func:`draft_dynamic_tree` run the whole drafting from the root's logits.
A :class:`Branch` adds query tokens the tree's nodes never see (lookahead's Jacobi window).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfx.model.masks import TreeView
from specfx.trees.types import DynamicTree, TokenTree, TreeTensors

__all__ = [
    "Branch", "branch_view", "draft_dynamic_tree", "draft_levels", "draft_positional_tree", "draft_tree", "level_inputs",
    "tree_view",
]  # fmt: skip


@dataclass
class Branch:
    """Extra query tokens of a tree round's target forward (see the module docstring)."""

    ids: torch.Tensor  # [B, E] tokens
    depth: torch.Tensor  # [E] int64, position offsets from the pending token (>= 1)
    sees: torch.Tensor  # [E, E] bool, sees[e, f]: token e attends to token f (itself included)


def branch_view(lengths: torch.Tensor, tree: TreeTensors, branch: Branch) -> TreeView:
    """The mask description of a forward over the root, the N nodes of ``tree`` and then the
    E tokens of ``branch``: the tree's visibility and the branch's, block-diagonal (neither
    sees the other; both see the committed prefix and the root)."""
    r, n1 = tree.depth.shape
    e = branch.depth.shape[0]
    device = tree.depth.device
    depth = torch.cat([tree.depth, branch.depth.view(1, e).expand(r, e)], dim=1)
    top = torch.cat([tree.ancestors, torch.zeros((r, n1, e), dtype=torch.bool, device=device)], dim=2)
    low = torch.cat([torch.zeros((r, e, n1), dtype=torch.bool, device=device), branch.sees.expand(r, e, e)], dim=2)
    return TreeView(lengths, depth, torch.cat([top, low], dim=1), tuple(range(n1 + e)))


def draft_tree(ctx, root_logits: torch.Tensor, step) -> torch.Tensor:
    """Fill every node of ``ctx.token_tree`` level by level: the children of the nodes at depth
    ``d`` are the top-ranked tokens of their processed draft scores. ``root_logits [B, 1, V]``
    are the draft's logits at the pending token; ``step(queries, tokens) -> logits [B, T, V]``
    runs the drafter on the nodes ``queries`` (indices 1..N of one depth, those with children)
    given ``tokens [B, N+1]`` (the pending token, then the nodes drafted so far; 0 elsewhere).
    Returns the node tokens ``[B, N]``."""
    tree = ctx.token_tree
    parents, ranks = tree.parents, tree.ranks
    pending = ctx.tokens.gather(1, ctx.lengths.unsqueeze(1))  # [B, 1]
    columns: list[torch.Tensor | None] = [pending] + [None] * tree.size
    zero = torch.zeros_like(pending)

    def drafted() -> torch.Tensor:  # [B, N+1]: the pending token, the nodes so far, 0 elsewhere
        return torch.cat([c if c is not None else zero for c in columns], dim=1)

    def expand(queries: tuple[int, ...], logits: torch.Tensor) -> None:
        scores = ctx.process_nodes(logits, queries, drafted())  # [B, T, V]
        children = [[m for m in range(1, tree.size + 1) if parents[m] == q] for q in queries]
        width = 1 + max(ranks[m - 1] for kids in children for m in kids)
        top = scores.topk(width, dim=-1).indices  # [B, T, width]
        for t, kids in enumerate(children):
            for m in kids:
                columns[m] = top[:, t, ranks[m - 1] : ranks[m - 1] + 1]

    expand((0,), root_logits)
    for queries in draft_levels(tree):
        expand(queries, step(queries, drafted()))
    return torch.cat(columns[1:], dim=1)


def draft_positional_tree(ctx, logits: torch.Tensor) -> torch.Tensor:
    """Fill ``ctx.token_tree`` from scores that do not see the path: ``logits [B, D, V]``, row
    ``d - 1`` the drafter's scores for the token at depth ``d`` whatever its ancestors (Medusa's
    heads, PARD's mask positions). The node with child ranks ``(r_1, ..., r_d)`` gets the
    ``r_d``-th most likely token of row ``d - 1`` (after the round's processors, with its own
    path as context). Returns the node tokens ``[B, N]``."""
    depths = ctx.token_tree.depths

    def step(queries, tokens):  # every node of one level has depth d: its children read row d
        d = depths[queries[0]]
        return logits[:, d : d + 1].expand(-1, len(queries), -1)

    return draft_tree(ctx, logits[:, :1], step)


def draft_dynamic_tree(ctx, root_logits: torch.Tensor, root_state: torch.Tensor, step):
    """Grow this round's EAGLE-2 tree (``ctx.token_tree``, a :class:`~specfx.trees.types.DynamicTree`
    of budget N, depth D, branching k) per row, and return ``(tokens [B, N], parents [B, N+1])``:
    the node tokens and each node's parent (0 = the root), parents before children.

    ``root_logits [B, 1, V]`` are the draft's logits at the pending token and ``root_state [B,
    1, S]`` what its children read (an EAGLE head's output there). ``step(ids, states,
    positions, slots, view) -> (logits [B, k, V], states [B, k, S])`` runs the drafter on the k
    nodes expanded at one depth d (1..D-1): their tokens ``ids [B, k]``, their parents' states,
    at position ``L + d``, in scratch slots ``L + f`` where f = (d-1)k+1 .. dk numbers the
    expanded nodes, with ``view`` (a :class:`~specfx.model.masks.TreeView` over the expanded nodes,
    per-row tables) showing each the committed prefix and its own expanded ancestors.

    Scores are the draft's raw log-probabilities (no temperature or warpers), summed along a
    path; the tree is fixed before verification and every node is a deterministic choice, so
    any such rule keeps sampling lossless. Ties go to the earlier candidate (a stable sort), so
    a parent always outranks its children and the N chosen form a tree."""
    spec: DynamicTree = ctx.token_tree
    k, depth, n = spec.branching, spec.depth, spec.size
    b = root_logits.shape[0]
    device = root_logits.device
    lengths = ctx.lengths.unsqueeze(1)  # [B, 1]
    score, token = root_logits[:, 0].float().log_softmax(-1).topk(k, dim=-1)  # [B, k] depth 1
    tokens, scores = [token], [score]
    parents = [torch.zeros((b, k), dtype=torch.long, device=device)]  # candidate ids, 0 = the root
    # the expanded nodes ("frontier"), k per depth 1..D-1, numbered f = 1..(D-1)k; their tables
    expanded = (depth - 1) * k
    f_depth = torch.tensor([0] + [d for d in range(1, depth) for _ in range(k)], device=device).unsqueeze(0)
    f_anc = torch.eye(expanded + 1, dtype=torch.bool, device=device).expand(b, -1, -1)
    f_cand = torch.arange(1, k + 1, device=device).expand(b, k)  # candidate id of each frontier node
    f_parent = torch.zeros((b, k), dtype=torch.long, device=device)  # its parent's frontier number
    f_token, f_score = token, score
    f_state = root_state.expand(b, k, root_state.shape[-1])
    next_id = k + 1  # the first candidate id of the next depth
    for d in range(1, depth):
        level = tuple(range((d - 1) * k + 1, d * k + 1))
        rows = torch.tensor(level, device=device)
        own = torch.arange(expanded + 1, device=device) == rows.view(1, k, 1)  # [1, k, F+1]: itself
        inherited = f_anc.gather(1, f_parent.unsqueeze(-1).expand(b, k, expanded + 1))  # its parent's row
        f_anc = f_anc.index_copy(1, rows, inherited | own)
        view = TreeView(ctx.lengths, f_depth, f_anc, level)
        logits, out = step(f_token, f_state, (lengths + d).expand(b, k), lengths + rows, view)
        child_score, child = logits.float().log_softmax(-1).topk(k, dim=-1)  # [B, k, k]
        cum = (f_score.unsqueeze(-1) + child_score).reshape(b, k * k)
        child = child.reshape(b, k * k)
        tokens.append(child)
        scores.append(cum)
        parents.append(f_cand.unsqueeze(-1).expand(b, k, k).reshape(b, k * k))
        if d < depth - 1:  # the next frontier: the k best of these k * k
            f_score, pick = cum.topk(k, dim=-1)  # [B, k]
            f_token = child.gather(1, pick)
            f_cand = next_id + pick
            f_parent = rows[pick // k]  # frontier numbers of their parents
            f_state = out.gather(1, (pick // k).unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        next_id += k * k
    token, score, parent = torch.cat(tokens, dim=1), torch.cat(scores, dim=1), torch.cat(parents, dim=1)  # [B, M]
    best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n]
    chosen = best.sort(dim=1).values  # candidate order: depths in order, parents first
    # node number of each candidate id (0: the root, or not chosen)
    node_of = torch.zeros((b, token.shape[1] + 1), dtype=torch.long, device=device)
    node_of = node_of.scatter(1, chosen + 1, torch.arange(1, n + 1, device=device).expand(b, n))
    node_parent = node_of.gather(1, parent.gather(1, chosen))  # [B, N]
    zero = torch.zeros((b, 1), dtype=torch.long, device=device)
    return token.gather(1, chosen), torch.cat([zero, node_parent], dim=1)


def draft_levels(tree: TokenTree) -> list[tuple[int, ...]]:
    """The ``queries`` of each ``step`` :func:`draft_tree` makes after the root, in order: for
    each depth d = 1..D-1, the nodes of depth d that have children (depths without any are
    skipped). A drafter that prepares per-shape state (captured graphs) for a tree needs these."""
    levels = (tuple(n for n in tree.level(d) if tree.has_children(n)) for d in range(1, tree.depth))
    return [q for q in levels if q]


def level_inputs(ctx, queries: tuple[int, ...], tokens: torch.Tensor):
    """A drafter forward's ``(ids, positions, slots)``, ``[B, T]`` each, over the nodes
    ``queries`` of this round's tree given ``tokens [B, N+1]`` (as :func:`draft_tree`'s step
    receives them): node n's token, at position ``L + depth[n]`` in scratch slot ``L + n``."""
    lengths = ctx.lengths.unsqueeze(1)  # [B, 1]
    q = torch.tensor(queries, device=tokens.device)
    return tokens[:, q], lengths + ctx.tree_tensors.depth[:, q], lengths + q


def tree_view(ctx, queries: tuple[int, ...]) -> TreeView:
    """The mask description of a forward over the nodes ``queries`` of this round's tree."""
    t = ctx.tree_tensors
    return TreeView(ctx.lengths, t.depth, t.ancestors, queries)
