"""Lookahead decoding (Fu et al., 2024): Jacobi guesses and an n-gram pool, verified in the
same target forward, with no drafter model.

Each round's target forward (:func:`specfx.engine.tree_round.tree_round_step`) carries, after the
pending token:

* the *verification branch*: up to G n-grams from the row's pool whose first token is the
  pending token (most recent first), laid out as a per-row trie on G * (N - 1) nodes
  (:func:`candidate_trie`: guesses with a common prefix share its nodes), verified and
  accepted like any token tree (greedy: the longest guess the target's argmax agrees with;
  sampling: the tree acceptance's lossless multi-candidate rule, every guess being a
  deterministic proposal);
* the *lookahead branch* (a :class:`~specfx.trees.drafting.Branch`): the Jacobi window, N - 1
  levels of W tokens. Level 0 is the pending token followed by W - 1 guesses; the token at
  level l, column j sits at position ``L + l + j`` and sees the committed prefix, level 0's
  columns up to j, and its own column at levels 1..l (the method's mask). The target's argmax
  at the last level's W tokens is one Jacobi step: each column gives an n-gram (its level-0
  token, then levels 1..N-2, then the new token) that goes into the pool, keyed by its first
  token; the levels shift up by one and the new tokens become the last level.

Verification nodes never see branch tokens (and the reverse), so the verified logits, and so
the output, are those of plain decoding whatever the branch guesses; the branch's KV sits in
scratch slots past the tree's and is never committed.

The pool is a per-row ring of P n-grams ``(key [B, P], ngram [B, P, N-1], stamp [B, P])``: each
round writes its W n-grams over the oldest ones; a lookup takes the most recent entries with
the pending token as key, drops repeats of a more recent entry, and keeps the first G. All of
it is fixed-shape tensor code in the round graph, per row, with no host sync.
"""

from __future__ import annotations

import torch

from specfx.drafters.base import Branching, Drafter, TreeDrafting
from specfx.model.dynamo import mark_static
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import Branch
from specfx.trees.types import MAX_TREE_NODES, TokenTree

__all__ = ["MAX_NGRAM", "Lookahead", "branch_layout", "candidate_trie", "from_name", "pool_candidates"]

MAX_NGRAM = 16  # the Jacobi window has N - 1 levels; longer n-grams only grow the forward
MAX_WINDOW = 64


def branch_layout(window: int, ngram: int) -> tuple[list[int], list[list[bool]]]:
    """The lookahead branch's static tables for W = ``window``, N = ``ngram``: the position
    offset (from the pending token) of each of its ``(N - 1) * W - 1`` tokens, and which of them
    each sees. Token ``e`` is level ``l``, column ``j`` of the window with ``l * W + j = e + 1``
    (level 0, column 0 is the pending token itself, which is not a branch token); its offset is
    ``l + j``; it sees level 0's columns ``1..j``, and column j at levels ``1..l``."""
    cells = [(level, col) for level in range(ngram - 1) for col in range(window)][1:]
    depth = [level + col for level, col in cells]
    sees = [
        [(lv == 0 and 1 <= c <= col) or (1 <= lv <= level and c == col) for lv, c in cells] for level, col in cells
    ]
    return depth, sees


def pool_candidates(
    keys: torch.Tensor, ngrams: torch.Tensor, stamps: torch.Tensor, pending: torch.Tensor, guesses: int
) -> torch.Tensor:
    """``[B, G, N-1]``: up to G distinct pool n-grams keyed by ``pending [B]``, most recent
    first, from ``keys [B, P]``, ``ngrams [B, P, N-1]`` and ``stamps [B, P]`` (write order, -1 =
    empty). Rows with fewer than G fill the rest with other entries (repeats or other keys'):
    proposals that verification simply rejects unless the target agrees with them."""
    b, p = keys.shape
    m = min(p, 4 * guesses)  # distinct ones are looked for among the m most recent matches
    score = torch.where(keys == pending.unsqueeze(1), stamps, -1)
    top, index = score.topk(m, dim=1)  # [B, M], most recent first
    cand = ngrams.gather(1, index.unsqueeze(-1).expand(-1, -1, ngrams.shape[-1]))  # [B, M, N-1]
    earlier = torch.ones(m, m, dtype=torch.bool, device=keys.device).tril(-1)  # [i, j]: j < i
    repeat = ((cand.unsqueeze(2) == cand.unsqueeze(1)).all(-1) & earlier & (top >= 0).unsqueeze(1)).any(-1)
    keep = (top >= 0) & ~repeat  # [B, M]
    rank = torch.arange(m, device=keys.device)
    pick = torch.where(keep, m - rank, -1 - rank).topk(guesses, dim=1).indices  # kept first, in order
    return cand.gather(1, pick.unsqueeze(-1).expand(-1, -1, cand.shape[-1]))


def candidate_trie(cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay ``cand [B, G, D]`` (G guesses of D tokens per row) out as a trie on the G-chain
    tree's N = G * D nodes: returns ``(tokens [B, N], parents [B, N+1])`` with node
    ``(d - 1) * G + g + 1`` holding guess g's token at depth d (depth-major, as the static tree).

    Guess g's node at depth d hangs under the node at depth d - 1 of the first guess sharing
    its first d - 1 tokens, so guesses with a common prefix share the path to it and the walk
    can follow any guess as far as the target agrees with it (greedy: the longest matching
    guess). A node whose first d tokens repeat an earlier guess's is a repeated sibling of that
    guess's node: the walk tries the earlier one first, and a repeat is never accepted (its
    probability is 0 in the sampling walk)."""
    b, g, d = cand.shape
    same = (cand.unsqueeze(2) == cand.unsqueeze(1)).long().cumprod(dim=-1)  # [B, G, G', D]: first t+1 equal
    first = same.argmax(dim=2)  # [B, G, D]: the first guess sharing g's first t + 1 tokens
    base = torch.arange(d - 1, device=cand.device).view(1, d - 1, 1) * g + 1  # node number of (0, depth t + 1)
    above = first[:, :, : d - 1].transpose(1, 2) + base  # [B, D-1, G]: parents of depths 2..D
    parents = torch.cat([torch.zeros((b, 1 + g), dtype=torch.long, device=cand.device), above.reshape(b, -1)], dim=1)
    return cand.transpose(1, 2).reshape(b, g * d), parents


def _int_in(name: str, v, low: int, high: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(
            f"Lookahead {name} must be an int in [{low}, {high}], got {v!r}. Typical: "
            f"Lookahead(window=4, ngram=3, guesses=2)."
        )


class Lookahead(Branching, TreeDrafting, Drafter):
    """Lookahead decoding: ``specfx.speculate(model, draft="lookahead")`` or
    ``draft=specfx.Lookahead(window=W, ngram=N, guesses=G)`` (see the module docstring).

    Each round verifies up to G pool n-grams (a tree of G chains of N - 1: at most N tokens
    emitted per round) and runs the W x (N - 1) Jacobi window in the same target forward, so a
    round's forward has ``G * (N - 1) + W * (N - 1)`` tokens. No draft model, no training; the
    output is exactly the target's (greedy: token for token; sampling: its distribution).
    ``tree=`` does not apply: the drafter fixes the round's shape. With ``num_speculative_tokens``
    unset, "auto" runs that tree or plain decoding (K = 0) per window, whichever pays on the
    measured round times (decision 68); ``num_speculative_tokens=G * (N - 1)`` runs it every round.

    Attributes:
        window: W, Jacobi columns (n-grams harvested per round).
        ngram: N, n-gram length (N - 1 Jacobi levels; N - 1 tokens verified per guess).
        guesses: G, pool n-grams verified per round.
        pool: P, n-grams kept per row (a ring: the oldest are overwritten); default 64 * W.
    """

    name = "lookahead"
    # Resumable: every state it keeps (the pool, the Jacobi window) is guesses that the round
    # verifies; the branch's KV is written afresh each round and never committed. After K = 0
    # windows the guesses are stale, which lowers acceptance but never changes the output.
    resumable = True

    def __init__(self, window: int = 4, ngram: int = 3, guesses: int = 2, pool: int | None = None):
        _int_in("window", window, 1, MAX_WINDOW)
        _int_in("ngram", ngram, 2, MAX_NGRAM)
        _int_in("guesses", guesses, 1, MAX_TREE_NODES)
        if guesses * (ngram - 1) > MAX_TREE_NODES:
            raise ValueError(
                f"Lookahead(guesses={guesses}, ngram={ngram}) verifies {guesses * (ngram - 1)} tokens per round; at "
                f"most {MAX_TREE_NODES} are verified. Lower guesses or ngram."
            )
        pool = 64 * window if pool is None else pool
        _int_in("pool", pool, max(guesses, window), 1 << 16)
        self.window, self.ngram, self.guesses, self.pool = window, ngram, guesses, pool
        self.tree = TokenTree([(g,) + (0,) * d for g in range(guesses) for d in range(ngram - 1)])
        self.branch_slots = (ngram - 1) * window - 1
        self._layout = branch_layout(window, ngram)
        self.device = None
        self.traj = self.keys = self.ngrams = self.stamps = self.clock = None

    def __repr__(self) -> str:
        return f"Lookahead(window={self.window}, ngram={self.ngram}, guesses={self.guesses}, pool={self.pool})"

    def round_tree(self) -> TokenTree:
        return self.tree

    def bind(self, target: ModelRunner) -> None:
        self.device = target.device

    def allocate(self, batch_size: int, capacity: int) -> None:
        b, n1, w, p, d = batch_size, self.ngram - 1, self.window, self.pool, self.device
        self.traj = torch.zeros((b, n1, w), dtype=torch.long, device=d)  # level 0, column 0 unused
        self.keys = torch.full((b, p), -1, dtype=torch.long, device=d)
        self.ngrams = torch.zeros((b, p, n1), dtype=torch.long, device=d)
        self.stamps = torch.full((b, p), -1, dtype=torch.long, device=d)
        self.clock = torch.zeros((), dtype=torch.long, device=d)  # n-grams written so far
        mark_static(self.traj, self.keys, self.ngrams, self.stamps, self.clock)

    def prefill(self, ids, positions, slots) -> None:
        # An empty pool, and a window of prompt tokens picked by a fixed stride (the method
        # starts from random prompt tokens; any start keeps the output exact).
        b, p = ids.shape
        real = slots == positions  # padding goes to the trash slot at position 0
        count = real.sum(dim=1, keepdim=True).clamp_min(1)  # [B, 1]
        j = torch.arange(self.traj[0].numel(), device=ids.device).unsqueeze(0)
        pick = (p - 1) - torch.remainder(j * 7 + 3, count)  # [B, (N-1) W] real columns
        self.traj.copy_(ids.gather(1, pick).view(self.traj.shape))
        self.keys.fill_(-1)
        self.stamps.fill_(-1)
        self.clock.zero_()

    def propose_tree(self, ctx) -> torch.Tensor:
        pending = ctx.tokens.gather(1, ctx.lengths.unsqueeze(1)).squeeze(1)  # [B]
        cand = pool_candidates(self.keys, self.ngrams, self.stamps, pending, self.guesses)  # [B, G, N-1]
        return candidate_trie(cand)

    def branch(self, ctx) -> Branch:
        device = self.traj.device
        depth, sees = self._layout
        ids = self.traj.reshape(self.traj.shape[0], -1)[:, 1:]  # [B, E]
        return Branch(ids, torch.tensor(depth, device=device), torch.tensor(sees, device=device))

    def observe_branch(self, ctx, root_logits, logits) -> None:
        b, w = self.traj.shape[0], self.window
        new = torch.cat([root_logits, logits], dim=1)[:, -w:].argmax(dim=-1)  # [B, W]: one Jacobi step
        pending = ctx.tokens.gather(1, ctx.lengths.unsqueeze(1))  # [B, 1], before the round commits
        first = torch.cat([pending, self.traj[:, 0, 1:]], dim=1)  # [B, W] each column's level-0 token
        rest = torch.cat([self.traj[:, 1:], new.unsqueeze(1)], dim=1)  # [B, N-1, W]: levels 1.., then new
        at = torch.remainder(self.clock + torch.arange(w, device=new.device), self.pool)  # [W] oldest entries
        self.keys.index_copy_(1, at, first)
        self.ngrams.index_copy_(1, at, rest.transpose(1, 2))
        self.stamps.index_copy_(1, at, (self.clock + torch.arange(w, device=new.device)).expand(b, w))
        self.clock.add_(w)
        self.traj.copy_(rest)  # levels shift up by one; the new tokens are the last level


def from_name(arg: str | None) -> Lookahead:
    """``draft="lookahead"`` or ``"lookahead:W,N,G"``."""
    if arg is None:
        return Lookahead()
    try:
        values = [int(x) for x in arg.split(",")]
        if not 1 <= len(values) <= 3:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"draft='lookahead:{arg}': the argument is window[,ngram[,guesses]], ints (e.g. 'lookahead:8,4,8')."
        ) from None
    return Lookahead(*values)
