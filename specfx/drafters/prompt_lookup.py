"""Prompt lookup (n-gram) drafting, searched on device inside the round graph.

The proposals are the tokens that followed the most recent earlier occurrence of the longest
suffix n-gram (``min_ngram <= n <= max_ngram``) of the row's tokens so far (prompt, generated
tokens and the pending token). No model runs: the drafter costs a few comparisons over the
static token buffer, with fixed shapes, per row, and no host sync.

For a token tree the drafter keeps several earlier matches instead of one (longest n-gram
first, then most recent) and lays their continuations out as a trie: a node's children are
the distinct next tokens of the matches that agree with the node's path, in match order
(:func:`lookup_tree`). The tree's rank-0 spine is exactly the chain's proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specfx.drafters.base import Drafter, TreeDrafting
from specfx.trees.types import TokenTree

__all__ = [
    "MAX_NGRAM",
    "MAX_TREE_MATCHES",
    "PromptLookup",
    "continuations",
    "lookup_matches",
    "lookup_proposals",
    "lookup_tree",
]

MAX_NGRAM = 16  # the search is unrolled over n; longer n-grams only grow the graph
MAX_TREE_MATCHES = 64  # the trie compares every pair of matches per node: [B, nodes, M, M]

_NO_TOKEN = -1  # fills shifted-in columns: equals no token id
_NO_SUFFIX = -2  # stands for a suffix token before position 0: equals nothing either


def lookup_matches(tokens: torch.Tensor, lengths: torch.Tensor, max_ngram: int, min_ngram: int, m: int):
    """The ``m`` best earlier matches of each row's suffix, as fixed-shape tensor code.

    A window ending at ``e < L`` (``L = lengths``) matches with length ``l(e)``, the longest
    ``t <= max_ngram`` such that tokens ``e-t+1..e`` equal tokens ``L-t+1..L``; it counts if
    ``l(e) >= min_ngram``. Matches are ranked by ``l`` (longer first), then by recency (larger
    ``e`` first), so match 0 is the chain's match.

    Args:
        tokens: ``[B, C]`` token buffer, token at position p in column p; columns beyond
            ``lengths`` are stale and never read as tokens.
        lengths: ``[B]`` position of each row's last token (the pending token), >= 0.
        max_ngram, min_ngram: the n-gram sizes tried.
        m: matches kept per row (at most C).

    Returns:
        ends ``[B, M]`` (``M = min(m, C)``): the window ends, best first; a slot without a match
        holds ``L - 1``, which continues with the pending token (period 1).
        ngram ``[B, M]``: each match's length ``l``, 0 for a slot without a match.

    Cost ``O(B * C * max_ngram)`` element comparisons and one top-M over C.
    """
    b, c = tokens.shape
    end = torch.arange(c, device=tokens.device).unsqueeze(0)  # [1, C] end position of a window
    lengths = lengths.unsqueeze(1)  # [B, 1]
    run = torch.ones_like(tokens, dtype=torch.bool)  # [B, C]
    ngram = torch.zeros_like(tokens)  # [B, C] l(e) so far
    for t in range(max_ngram):
        # run[b, e]: tokens e-t..e equal the suffix tokens L-t..L
        suffix_pos = lengths - t
        suffix_tok = tokens.gather(1, suffix_pos.clamp_min(0))
        suffix_tok = torch.where(suffix_pos >= 0, suffix_tok, _NO_SUFFIX)  # [B, 1]
        shifted = F.pad(tokens, (t, 0), value=_NO_TOKEN)[:, :c]  # [B, C]: column e holds token e - t
        run = run & (shifted == suffix_tok)
        ngram = ngram + run  # run only falls as t grows, so the sum is the longest match
    # A window must end before L: then its continuation (position end + 1 <= L) is a real token,
    # and the trivial match of the suffix with itself is excluded.
    valid = (ngram >= min_ngram) & (end < lengths)  # [B, C]
    # longer first, then more recent; distinct per match, and it encodes both (l, e)
    score = torch.where(valid, ngram * c + end, -1)  # [B, C]
    if m == 1:  # the chain: a reduction Inductor fuses (topk runs as its own kernel)
        score = score.amax(dim=1, keepdim=True)
    else:
        score = score.topk(min(m, c), dim=1).values  # [B, M]
    found = score >= 0
    ends = torch.where(found, score % c, lengths - 1)  # no match: period 1 from the pending token
    return ends, torch.where(found, score // c, 0)


def continuations(tokens: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, M, K]``: the K tokens after each match ``ends [B, M]``: token ``i`` of match ``j``
    is the token at ``e_j + 1 + (i mod (L - e_j))``: the copy continues, and where it would run
    past ``L`` it repeats with the period ``L - e_j`` the match implies."""
    b, m = ends.shape
    # [B, M] >= 1 already; clamped because Inductor's vectorised CPU code checks every lane of an
    # integer remainder for a zero divisor, the masked tail lanes (loaded as 0) included: the
    # sampling round at batch 8 raised ZeroDivisionError (session 12)
    period = (lengths.unsqueeze(1) - ends).clamp_min(1)
    i = torch.arange(k, device=tokens.device).view(1, 1, k)
    pos = ends.unsqueeze(-1) + 1 + torch.remainder(i, period.unsqueeze(-1))  # [B, M, K]
    return tokens.gather(1, pos.view(b, m * k)).view(b, m, k)


def lookup_proposals(tokens: torch.Tensor, lengths: torch.Tensor, k: int, max_ngram: int, min_ngram: int = 1):
    """Prompt-lookup proposals for every row, as fixed-shape tensor code.

    Args:
        tokens: ``[B, C]`` token buffer, token at position p in column p; columns beyond
            ``lengths`` are stale and never read as tokens.
        lengths: ``[B]`` position of each row's last token (the pending token), >= 0.
        k: proposals per row.
        max_ngram, min_ngram: the n-gram sizes tried; the longest that matches wins.

    Returns:
        proposals ``[B, K]``: with the suffix n-gram ending at ``L = lengths`` and its most
        recent earlier occurrence ending at ``e < L``, proposal j is the token at
        ``e + 1 + (j mod (L - e))``: the copy continues, and where it would run past ``L`` it
        repeats with the period ``L - e`` the match implies. A row with no match proposes its
        pending token K times.
        ngram ``[B]``: the n-gram size matched, 0 for no match.

    Cost ``O(B * C * max_ngram)`` element comparisons.
    """
    ends, ngram = lookup_matches(tokens, lengths, max_ngram, min_ngram, 1)  # [B, 1]
    return continuations(tokens, lengths, ends, k)[:, 0], ngram[:, 0]


def lookup_tree(
    tokens: torch.Tensor, lengths: torch.Tensor, tree: TokenTree, max_ngram: int, min_ngram: int = 1, matches: int = 8
) -> torch.Tensor:
    """Prompt-lookup tokens for every node of ``tree``: ``[B, N]``, node n's in column n - 1.

    The ``matches`` best earlier matches (:func:`lookup_matches`: longest n-gram, then most
    recent) each continue periodically (:func:`continuations`, D tokens); the tree is filled
    level by level as a trie of these continuations. A node at depth d is *compatible* with
    match j if j's first d tokens are the tokens on the node's path (the root: every match).
    Child ``r`` of a node is the r-th distinct token at depth d + 1 among its compatible
    matches, in match order; so where matches share a prefix they share nodes, and where they
    diverge they fill the siblings. A child with no such token (fewer distinct continuations
    than children, or a node no match reaches) repeats its parent's token, as the chain repeats
    the pending token when nothing matches; such a token may equal a sibling's, which
    acceptance simply rejects on its second try. Node ``(0,) * d`` is the chain's proposal
    ``d - 1`` (:func:`lookup_proposals`).

    Cost: the search, plus ``O(B * N * M^2)`` comparisons for the trie (M = ``matches``).
    """
    ends, ngram = lookup_matches(tokens, lengths, max_ngram, min_ngram, matches)  # [B, M]
    m = ends.shape[1]
    cont = continuations(tokens, lengths, ends, tree.depth)  # [B, M, D]
    earlier = torch.ones(m, m, dtype=torch.bool, device=tokens.device).tril(-1)  # [j, j']: j' < j
    parents, ranks = tree.parents, tree.ranks
    node_tokens = [tokens.gather(1, lengths.unsqueeze(1)).squeeze(1)]  # [B] per node, the root's first
    compatible = [ngram > 0]  # [B, M] per node
    for d in range(1, tree.depth + 1):
        kids = tree.level(d)
        above = sorted({parents[n] for n in kids})  # the nodes at depth d - 1 with children
        col = {p: i for i, p in enumerate(above)}
        x = cont[:, :, d - 1]  # [B, M] each match's token at depth d
        comp = torch.stack([compatible[p] for p in above], dim=1)  # [B, P, M]
        same_earlier = (x.unsqueeze(2) == x.unsqueeze(1)) & earlier  # [B, M, M]
        # first[b, p, j]: j is compatible with p and no earlier compatible match has its token
        first = comp & ~(comp.unsqueeze(2) & same_earlier.unsqueeze(1)).any(-1)  # [B, P, M]
        rank = first.long().cumsum(-1) - 1  # [B, P, M] rank of j's token among distinct ones
        at = torch.tensor([col[parents[n]] for n in kids], device=tokens.device)  # [n_d]
        want = torch.tensor([ranks[n - 1] for n in kids], device=tokens.device).view(1, -1, 1)
        sel = first[:, at] & (rank[:, at] == want)  # [B, n_d, M], at most one j per node
        found = sel.any(-1)  # [B, n_d]
        tok = (sel.long() * x.unsqueeze(1)).sum(-1)  # [B, n_d]
        parent_tok = torch.stack([node_tokens[parents[n]] for n in kids], dim=1)  # [B, n_d]
        tok = torch.where(found, tok, parent_tok)
        comp_kids = comp[:, at] & (x.unsqueeze(1) == tok.unsqueeze(-1)) & found.unsqueeze(-1)  # [B, n_d, M]
        for i, _ in enumerate(kids):
            node_tokens.append(tok[:, i])
            compatible.append(comp_kids[:, i])
    return torch.stack(node_tokens[1:], dim=1)


@dataclass(frozen=True)
class PromptLookup(TreeDrafting, Drafter):
    """Prompt lookup decoding (n-gram drafting): no draft model, proposals copied from the
    row's own tokens.

    ``specfx.speculate(model, draft="prompt_lookup")`` or
    ``draft=PromptLookup(max_ngram=3, min_ngram=1)``; ``draft="prompt_lookup:N"`` sets
    ``max_ngram=N``. Proposals are the tokens that followed the most recent earlier
    occurrence of the longest suffix n-gram with ``min_ngram <= n <= max_ngram`` (see
    :func:`lookup_proposals`). They are deterministic (q is one-hot), so greedy output equals
    plain greedy decoding and sampling keeps the target's distribution exactly.

    Token trees (``speculate(..., tree=...)``): the branches come from up to ``tree_matches``
    earlier matches (longest n-gram first, then most recent), laid out as a trie of their
    continuations (see :func:`lookup_tree`): where the earlier occurrences of the suffix went
    on differently, the tree verifies each of those continuations in the same round, and its
    rank-0 spine is the chain's proposal. A tree helps where the text repeats with variations
    (code, templates, edits); on text with one earlier continuation per suffix the extra
    branches repeat a parent's token and are rejected at no cost but their verification.

    Differences from transformers' ``prompt_lookup_num_tokens`` (which only change speed):
    HF takes the *first* (leftmost) occurrence and proposes fewer than K tokens when the
    sequence ends sooner; specfx takes the most recent occurrence, always proposes K tokens
    (continuing the copy periodically past the end), and HF's default n-gram size is 2
    (``max_matching_ngram_size``), specfx's 3.

    Attributes:
        max_ngram: longest suffix n-gram searched (1..MAX_NGRAM).
        min_ngram: shortest suffix n-gram that counts as a match (1..max_ngram).
        tree_matches: earlier matches a token tree draws its branches from (1..MAX_TREE_MATCHES;
            unused by a chain).
    """

    max_ngram: int = 3
    min_ngram: int = 1
    tree_matches: int = 8

    name = "prompt_lookup"
    resumable = True  # reads only the row's tokens: auto's K = 0 rounds leave nothing behind

    def __post_init__(self):
        for field, top in (("max_ngram", MAX_NGRAM), ("min_ngram", MAX_NGRAM), ("tree_matches", MAX_TREE_MATCHES)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                raise ValueError(
                    f"PromptLookup {field} must be an int in [1, {top}], got {v!r}. Typical: max_ngram=3, "
                    f"min_ngram=1, tree_matches=8."
                )
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"PromptLookup min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram}); "
                f"lower min_ngram or raise max_ngram."
            )

    def propose(self, ctx):
        proposals, _ = lookup_proposals(ctx.tokens, ctx.lengths, ctx.k, self.max_ngram, self.min_ngram)
        return proposals, None

    def propose_tree(self, ctx):
        # No KV to keep: commit_tree stays the base class's no-op.
        return lookup_tree(ctx.tokens, ctx.lengths, ctx.token_tree, self.max_ngram, self.min_ngram, self.tree_matches)


def from_name(arg: str | None) -> PromptLookup:
    if arg is None:
        return PromptLookup()
    try:
        n = int(arg)
    except ValueError:
        raise ValueError(
            f"draft='prompt_lookup:{arg}': the argument is max_ngram, an int in [1, {MAX_NGRAM}] "
            f"(e.g. 'prompt_lookup:3')."
        ) from None
    return PromptLookup(max_ngram=n)
