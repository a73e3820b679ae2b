"""Prompt lookup (n-gram) drafting, searched on device inside the round graph.

The proposals are the tokens that followed the most recent earlier occurrence of the longest
suffix n-gram (``min_ngram <= n <= max_ngram``) of the row's tokens so far (prompt, generated
tokens and the pending token). No model runs: the drafter costs a few comparisons over the
static token buffer, with fixed shapes, per row, and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .drafters import Drafter

__all__ = ["MAX_NGRAM", "PromptLookup", "lookup_proposals"]

MAX_NGRAM = 16  # the search is unrolled over n; longer n-grams only grow the graph

_NO_TOKEN = -1  # fills shifted-in columns: equals no token id
_NO_SUFFIX = -2  # stands for a suffix token before position 0: equals nothing either


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
    b, c = tokens.shape
    end = torch.arange(c, device=tokens.device).unsqueeze(0)  # [1, C] end position of a window
    lengths = lengths.unsqueeze(1)  # [B, 1]
    # A window must end before L: then its continuation (position end + 1 <= L) is a real token,
    # and the trivial match of the suffix with itself is excluded.
    before = end < lengths  # [B, C]
    run = torch.ones_like(before)
    best_end = torch.full_like(lengths, -1)  # [B, 1]
    best_n = torch.zeros_like(lengths)
    for t in range(max_ngram):
        # run[b, e]: tokens e-t..e equal the suffix tokens L-t..L
        suffix_pos = lengths - t
        suffix_tok = tokens.gather(1, suffix_pos.clamp_min(0))
        suffix_tok = torch.where(suffix_pos >= 0, suffix_tok, _NO_SUFFIX)  # [B, 1]
        shifted = F.pad(tokens, (t, 0), value=_NO_TOKEN)[:, :c]  # [B, C]: column e holds token e - t
        run = run & (shifted == suffix_tok)
        n = t + 1
        if n >= min_ngram:
            last = torch.where(run & before, end, -1).amax(dim=1, keepdim=True)  # [B, 1] most recent
            found = last >= 0
            best_end = torch.where(found, last, best_end)  # longer n-grams overwrite shorter ones
            best_n = torch.where(found, n, best_n)
    matched = best_n > 0
    best_end = torch.where(matched, best_end, lengths - 1)  # no match: period 1 from the pending token
    period = lengths - best_end  # [B, 1] >= 1
    j = torch.arange(k, device=tokens.device).unsqueeze(0)  # [1, K]
    proposals = tokens.gather(1, best_end + 1 + torch.remainder(j, period))  # [B, K]
    return proposals, best_n.squeeze(1)


@dataclass(frozen=True)
class PromptLookup(Drafter):
    """Prompt lookup decoding (n-gram drafting): no draft model, proposals copied from the
    row's own tokens.

    ``specfx.speculate(model, draft="prompt_lookup")`` or
    ``draft=PromptLookup(max_ngram=3, min_ngram=1)``; ``draft="prompt_lookup:N"`` sets
    ``max_ngram=N``. Proposals are the tokens that followed the most recent earlier
    occurrence of the longest suffix n-gram with ``min_ngram <= n <= max_ngram`` (see
    :func:`lookup_proposals`). They are deterministic (q is one-hot), so greedy output equals
    plain greedy decoding and sampling keeps the target's distribution exactly.

    Differences from transformers' ``prompt_lookup_num_tokens`` (which only change speed):
    HF takes the *first* (leftmost) occurrence and proposes fewer than K tokens when the
    sequence ends sooner; specfx takes the most recent occurrence, always proposes K tokens
    (continuing the copy periodically past the end), and HF's default n-gram size is 2
    (``max_matching_ngram_size``), specfx's 3.

    Attributes:
        max_ngram: longest suffix n-gram searched (1..MAX_NGRAM).
        min_ngram: shortest suffix n-gram that counts as a match (1..max_ngram).
    """

    max_ngram: int = 3
    min_ngram: int = 1

    name = "prompt_lookup"

    def __post_init__(self):
        for field in ("max_ngram", "min_ngram"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_NGRAM:
                raise ValueError(
                    f"PromptLookup {field} must be an int in [1, {MAX_NGRAM}], got {v!r}. Typical: max_ngram=3, min_ngram=1."
                )
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"PromptLookup min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram}); "
                f"lower min_ngram or raise max_ngram."
            )

    def propose(self, ctx):
        proposals, _ = lookup_proposals(ctx.tokens, ctx.lengths, ctx.k, self.max_ngram, self.min_ngram)
        return proposals, None


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
