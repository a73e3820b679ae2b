"""Token trees: the shape of a round that verifies several candidates per position.

A tree is a list of nodes, each a tuple of child ranks from the root (the round's pending
token), in vLLM's ``speculative_token_tree`` convention: ``(0,)`` is the root's most likely
child, ``(0, 1)`` the second most likely child of ``(0,)``. A chain of K is
``[(0,), (0, 0), ...]``. Nodes are kept sorted by depth, then lexicographically, so a parent
always precedes its children and siblings appear in rank order; node ``n`` (1-based) is
verified at column ``n`` of the target's forward (column 0 is the root) and written to KV slot
``L + n`` (``L`` = the pending token's position) while it is a candidate.

:class:`TokenTree` validates a tree and derives the static tables a round needs; the round
itself works on :class:`TreeTensors` (``parent``, ``depth``, ``ancestors``, ``path``), which a
drafter could one day supply per row (fixed node count, data-dependent parents) without a new
graph: nothing in verification, acceptance or compaction reads the Python tuples.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["MAX_TREE_NODES", "DynamicTree", "TokenTree", "TreeTensors"]

# Nodes one round verifies at most: the target's forward grows by one column per node, and the
# acceptance walk is unrolled over nodes. EAGLE's and Medusa's default trees have 60-63.
MAX_TREE_NODES = 128


def _node(x, i: int) -> tuple[int, ...]:
    if isinstance(x, (str, bytes)) or not isinstance(x, Iterable):
        raise TypeError(f"tree node {i} must be a tuple of child ranks such as (0, 1), got {x!r}.")
    node = tuple(x)
    if not node or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in node):
        raise ValueError(
            f"tree node {i} must be a non-empty tuple of ints >= 0 (child ranks from the root, "
            f"e.g. (0,) or (0, 1)), got {x!r}."
        )
    return node


def _positive_ints(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}.")


@dataclass(frozen=True)
class TokenTree:
    """A validated token tree (see the module docstring for the convention).

    Build one from a list of nodes (``TokenTree([(0,), (1,), (0, 0)])``) or with
    :meth:`chain`, :meth:`topk`, :meth:`from_accuracies`, :meth:`medusa`, :meth:`eagle`.

    Attributes:
        nodes: the nodes, sorted by depth then lexicographically (node ``n`` is ``nodes[n-1]``).
    """

    nodes: tuple[tuple[int, ...], ...]

    def __init__(self, nodes):
        if isinstance(nodes, TokenTree):
            nodes = nodes.nodes
        if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Iterable):
            raise TypeError(
                f"tree must be a list of nodes (tuples of child ranks, e.g. [(0,), (1,), (0, 0)]) or a "
                f"specfx.TokenTree, got {type(nodes).__name__}."
            )
        parsed = [_node(x, i) for i, x in enumerate(nodes)]
        if not parsed:
            raise ValueError("tree must have at least one node, e.g. [(0,)] (a chain of one proposal).")
        if len(parsed) > MAX_TREE_NODES:
            raise ValueError(
                f"tree has {len(parsed)} nodes; at most {MAX_TREE_NODES} are verified per round (the "
                f"target's forward grows by one column per node). Use a smaller tree, e.g. "
                f"TokenTree.topk(depth=4, branching=2, budget=16)."
            )
        seen = set()
        for node in parsed:
            if node in seen:
                raise ValueError(f"tree node {node} appears twice; each node must be listed once.")
            seen.add(node)
        for node in parsed:
            if len(node) > 1 and node[:-1] not in seen:
                raise ValueError(
                    f"tree node {node} has no parent: {node[:-1]} is not in the tree. Every node's "
                    f"parent (the node without its last rank) must be listed too."
                )
        object.__setattr__(self, "nodes", tuple(sorted(parsed, key=lambda n: (len(n), n))))

    # ------------------------------------------------------------------ builders
    @classmethod
    def chain(cls, k: int) -> TokenTree:
        """K proposals in a line: what ``num_speculative_tokens=K`` means."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"a chain needs an int length >= 1, got {k!r}.")
        return cls([(0,) * d for d in range(1, k + 1)])

    @classmethod
    def from_accuracies(cls, accuracies: Callable[[int, int], float], budget: int, max_depth: int, branching: int):
        """The ``budget`` nodes (fewer if the full tree of ``max_depth`` and ``branching`` has
        fewer) with the highest expected acceptance, where a node's is the
        product of ``accuracies(depth, rank)`` along its path (depth 1-based; how often the
        drafter's rank-``rank`` guess at that depth is the target's token). This is how
        Medusa and EAGLE derive their trees from measured head accuracies; with accuracies that
        fall with rank and depth the chosen set is always a valid tree."""
        _positive_ints(budget=budget, max_depth=max_depth, branching=branching)
        if budget > MAX_TREE_NODES:
            raise ValueError(f"budget must be at most {MAX_TREE_NODES} nodes, got {budget}.")
        chosen: list[tuple[int, ...]] = []
        # best-first: a node enters the frontier once its parent and its previous sibling are chosen
        frontier = [(-float(accuracies(1, 0)), (0,))]
        while frontier and len(chosen) < budget:
            neg, node = heapq.heappop(frontier)
            chosen.append(node)
            score = -neg
            depth, rank = len(node), node[-1]
            if rank + 1 < branching:  # the next sibling
                parent_score = score / max(float(accuracies(depth, rank)), 1e-30)
                sibling = node[:-1] + (rank + 1,)
                heapq.heappush(frontier, (-parent_score * float(accuracies(depth, rank + 1)), sibling))
            if depth < max_depth:  # the first child
                heapq.heappush(frontier, (-score * float(accuracies(depth + 1, 0)), node + (0,)))
        return cls(chosen)

    @classmethod
    def topk(cls, depth: int, branching: int, budget: int | None = None) -> TokenTree:
        """Top-``branching`` children per node down to ``depth``; with ``budget``, only that
        many nodes, chosen best-first under an acceptance model in which rank ``r`` is
        accepted with probability ``0.6 * 0.4**r`` at every depth (lower ranks and shallower
        nodes first). Without ``budget``: the full tree (``branching + ... + branching**depth``
        nodes, which must not exceed MAX_TREE_NODES)."""
        _positive_ints(depth=depth, branching=branching)  # before budget, which may be derived
        if budget is None:
            budget = sum(branching**d for d in range(1, depth + 1))
            if budget > MAX_TREE_NODES:
                raise ValueError(
                    f"topk(depth={depth}, branching={branching}) has {budget} nodes, more than "
                    f"{MAX_TREE_NODES}; pass budget= to keep the best ones."
                )
        return cls.from_accuracies(lambda d, r: 0.6 * 0.4**r, budget, depth, branching)

    @classmethod
    def medusa(cls, budget: int = 63) -> TokenTree:
        """A Medusa-style sparse tree of ``budget`` nodes: depth up to 4 (Medusa's default head
        count), top-10 per head, under per-head accuracies that fall with depth (a head further
        ahead is less accurate) and with rank."""
        top1 = (0.75, 0.5, 0.38, 0.3)
        return cls.from_accuracies(lambda d, r: top1[d - 1] * 0.35**r, budget, len(top1), 10)

    @staticmethod
    def eagle2(budget: int = 60, depth: int = 6, branching: int = 10) -> DynamicTree:
        """EAGLE-2's dynamic tree: a different tree every round and row, grown from the draft's
        own confidence (see :class:`DynamicTree`); only drafters that can score nodes as they
        draft them (EAGLE heads) take it. Defaults: the EAGLE-2 paper's 60 nodes, depth 6 and
        top-10 expansion."""
        return DynamicTree(budget, depth, branching)

    @classmethod
    def eagle(cls, budget: int = 63) -> TokenTree:
        """An EAGLE-style tree of ``budget`` nodes: depth up to 5, top-10 per node, under
        accuracies of an autoregressive head (flatter over depth than Medusa's heads)."""
        return cls.from_accuracies(lambda d, r: 0.8 * 0.9 ** (d - 1) * 0.3**r, budget, 5, 10)

    # ------------------------------------------------------------------ structure
    @property
    def size(self) -> int:
        """N, the number of nodes (proposals verified per round)."""
        return len(self.nodes)

    @property
    def depth(self) -> int:
        """D, the deepest node's depth: a round emits at most D + 1 tokens."""
        return len(self.nodes[-1])

    @property
    def is_chain(self) -> bool:
        return all(node == (0,) * len(node) for node in self.nodes) and self.depth == self.size

    @property
    def parents(self) -> tuple[int, ...]:
        """``parents[n]`` for n = 0..N: the parent's index (0 = the root; the root's is 0)."""
        index = {node: i + 1 for i, node in enumerate(self.nodes)}
        return (0,) + tuple(index.get(node[:-1], 0) for node in self.nodes)

    @property
    def depths(self) -> tuple[int, ...]:
        """``depths[n]`` for n = 0..N (the root's is 0)."""
        return (0,) + tuple(len(node) for node in self.nodes)

    @property
    def ranks(self) -> tuple[int, ...]:
        """``ranks[n]`` for n = 1..N at index n - 1: which of its parent's guesses a node is."""
        return tuple(node[-1] for node in self.nodes)

    def level(self, d: int) -> tuple[int, ...]:
        """Indices (1..N) of the nodes at depth ``d``."""
        return tuple(i + 1 for i, node in enumerate(self.nodes) if len(node) == d)

    def has_children(self, n: int) -> bool:
        parents = self.parents
        return any(parents[m] == n for m in range(1, self.size + 1))

    @property
    def scratch_slots(self) -> int:
        """KV slots past the pending token a round writes (one per node)."""
        return self.size

    def tensors(self, device) -> TreeTensors:
        return TreeTensors.from_parents(torch.tensor(self.parents, device=device).unsqueeze(0), self.depth)

    def __repr__(self) -> str:
        if self.is_chain:
            return f"TokenTree.chain({self.size})"
        return f"TokenTree({list(self.nodes)})"


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's context-dependent token tree: the shape of a round whose tree the drafter
    chooses per row and per round from its own scores (``TokenTree.eagle2()``).

    Each round (:func:`specfx.trees.drafting.draft_dynamic_tree`): the root's top ``branching``
    draft tokens are the depth-1 candidates; at each depth ``d < depth`` the ``branching``
    candidates of depth ``d`` with the highest cumulative draft log-probability (the sum along
    their path) are expanded, each into its top ``branching`` children, giving
    ``branching**2`` candidates at depth ``d + 1``. Of all ``branching + (depth - 1) *
    branching**2`` candidates the ``budget`` best by cumulative log-probability are verified,
    as a tree: a child never scores above its parent, so the chosen set holds every chosen
    node's ancestors. Shapes are fixed (``budget`` nodes, ``depth - 1`` draft forwards of
    ``branching`` nodes); only the tree's tables (parents, depths, ancestors) are data, made
    on the device with no host sync.
    """

    budget: int
    depth: int
    branching: int

    def __post_init__(self):
        _positive_ints(budget=self.budget, depth=self.depth, branching=self.branching)
        if self.budget > MAX_TREE_NODES:
            raise ValueError(
                f"TokenTree.eagle2(budget={self.budget}): at most {MAX_TREE_NODES} nodes are verified per round."
            )
        if self.budget > self.candidates:
            raise ValueError(
                f"TokenTree.eagle2(budget={self.budget}, depth={self.depth}, branching={self.branching}) has only "
                f"{self.candidates} candidates (branching + (depth - 1) * branching**2) to choose {self.budget} "
                f"nodes from; lower budget or raise depth/branching."
            )

    @property
    def candidates(self) -> int:
        return self.branching + (self.depth - 1) * self.branching**2

    @property
    def size(self) -> int:
        """N, the nodes verified per round."""
        return self.budget

    @property
    def is_chain(self) -> bool:
        return False

    @property
    def scratch_slots(self) -> int:
        """KV slots past the pending token a round writes: the verified nodes, and the nodes
        the drafter expands (``branching`` per depth below the last)."""
        return max(self.budget, (self.depth - 1) * self.branching)

    def __repr__(self) -> str:
        return f"TokenTree.eagle2(budget={self.budget}, depth={self.depth}, branching={self.branching})"


@dataclass
class TreeTensors:
    """A tree as device tensors, for verification, acceptance and compaction. The leading dim
    ``R`` is 1 (one tree for every row, broadcast) or B (a tree per row)."""

    parent: torch.Tensor  # [R, N+1] int64, parent[:, 0] = 0
    depth: torch.Tensor  # [R, N+1] int64
    ancestors: torch.Tensor  # [R, N+1, N+1] bool, ancestors[r, n, m]: m is n or an ancestor of n (root included)
    path: torch.Tensor  # [R, N+1, D+1] int64, path[r, n, d]: n's ancestor at depth d (n itself past its depth)
    max_depth: int  # D

    @classmethod
    def from_parents(cls, parent: torch.Tensor, max_depth: int) -> TreeTensors:
        """Derive the tables from ``parent [R, N+1]`` (parents precede children) with tensor
        ops only, so a per-row tree made in a graph needs no host work."""
        r, n1 = parent.shape
        nodes = torch.arange(n1, device=parent.device).expand(r, n1)
        chain = [nodes]  # chain[j][r, n]: n's ancestor j generations up (the root stays the root)
        for _ in range(max_depth):
            chain.append(parent.gather(1, chain[-1]))
        up = torch.stack(chain, dim=-1)  # [R, N+1, D+1]
        depth = (up[..., :-1] != 0).sum(dim=-1)  # generations until the root
        ancestors = (up.unsqueeze(2) == nodes.view(r, 1, n1, 1)).any(dim=-1)  # [R, N+1, N+1]
        # path[n, d] = up[n, depth[n] - d] for d <= depth[n], else n
        d = torch.arange(max_depth + 1, device=parent.device).view(1, 1, -1)
        back = (depth.unsqueeze(-1) - d).clamp_min(0)
        path = torch.where(d <= depth.unsqueeze(-1), up.gather(2, back), nodes.unsqueeze(-1))
        return cls(parent, depth, ancestors, path, max_depth)

    @property
    def size(self) -> int:
        return self.parent.shape[1] - 1
