"""The tree shapes of ``specfx bench trees`` (:mod:`specfx.bench.tasks.trees`) and their
calibration: the draft's rank of the target's token at every position of the calibration split,
the replay of those ranks through a tree (its τ without running it), per-depth accuracies, and the
search for the B-node tree with the highest replayed τ."""

from __future__ import annotations

from collections import Counter

import torch

from specfx.bench.harness import NO_EOS
from specfx.trees.types import TokenTree

__all__ = ["build_shapes", "draft_ranks", "round_accuracies", "search_tree", "simulate"]

MAX_RANK = 4  # children per node the calibrated shapes consider (ranks 0..3)
CALIB_BATCH = 16  # calibration prompts generated at once (left-padded)
MIN_ROUNDS = 20  # rounds below which a depth's measured accuracies are replaced by all depths'


def draft_ranks(
    target, draft, prompts, max_new_tokens: int, pad: int, batch: int = 1
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The target's greedy continuation of every prompt ``[1, S]`` (``[1, S + n]``) and, for
    every new token, its rank among the draft's logits given the tokens before it (0 = the
    draft's best guess). ``ranks[j]`` is new token j's; ``ranks[0]`` (prefill's) is unused.
    ``batch > 1`` generates that many prompts at once, left-padded: faster, but a near-tie
    may then resolve differently than at batch 1 (fine for calibration, not for a replay)."""
    ranks, outs = [], []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(p.shape[1] for p in chunk)
            ids = torch.cat([torch.nn.functional.pad(p, (width - p.shape[1], 0), value=pad) for p in chunk])
            mask = torch.cat([torch.arange(width).ge(width - p.shape[1]).long().unsqueeze(0) for p in chunk])
            out = target.generate(
                ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **NO_EOS
            )  # [b, width + n]
            for row, p in zip(out, chunk, strict=True):
                seq = row[width - p.shape[1] :].unsqueeze(0)  # [1, S + n], padding dropped
                s = p.shape[1]
                logits = draft(seq).logits[0, s - 1 : -1].float()  # [n, V]: row j predicts new token j
                new = seq[0, s:]  # [n]
                ranks.append((logits > logits.gather(1, new.unsqueeze(1))).sum(dim=1).tolist())
                outs.append(seq)
    return ranks, outs


def rounds(nodes: frozenset, ranks: list[list[int]]):
    """Replay specfx's greedy rounds with a tree of ``nodes`` over every rank sequence: yields
    ``(ranks, t, m, emitted)`` per round (pending token = new token t, m accepted nodes,
    emitted = m + 1, cut at the length limit as specfx cuts it)."""
    for r in ranks:
        n, t = len(r), 0
        while t < n - 1:
            path: tuple[int, ...] = ()
            while t + len(path) + 1 < n and path + (r[t + len(path) + 1],) in nodes:
                path = path + (r[t + len(path) + 1],)
            emitted = min(len(path) + 1, n - 1 - t)
            yield r, t, len(path), emitted
            t += emitted


def simulate(tree: TokenTree, ranks: list[list[int]]) -> float:
    """τ (emitted tokens per round) of greedy specfx with ``tree`` on these rank sequences."""
    emitted = n_rounds = 0
    for _, _, _, e in rounds(frozenset(tree.nodes), ranks):
        emitted, n_rounds = emitted + e, n_rounds + 1
    return emitted / max(n_rounds, 1)


def round_accuracies(tree: TokenTree, ranks: list[list[int]]):
    """``acc(depth, rank)`` measured at the rounds of ``tree`` (module docstring), for
    :meth:`TokenTree.from_accuracies`; also the counts behind it ``{depth: [rounds, hits by rank]}``."""
    hits: Counter = Counter()
    reached: Counter = Counter()
    for r, t, m, _ in rounds(frozenset(tree.nodes), ranks):
        for d in range(1, min(m + 2, len(r) - t)):  # depths whose parent the walk reached
            reached[d] += 1
            hits[d, r[t + d]] += 1
    total = sum(reached.values())

    def acc(depth: int, rank: int) -> float:
        if reached[depth] >= MIN_ROUNDS:
            return hits[depth, rank] / reached[depth]
        return sum(c for (_, k), c in hits.items() if k == rank) / max(total, 1)

    counts = {d: [reached[d]] + [hits[d, k] for k in range(MAX_RANK)] for d in sorted(reached)}
    return acc, counts


def _additions(nodes: set) -> list[tuple[int, ...]]:
    """Nodes that can join ``nodes``: children of the root or of a node, rank < MAX_RANK,
    ranks contiguous (child r only next to child r - 1)."""
    out = []
    for parent in [(), *sorted(nodes)]:
        for k in range(MAX_RANK):
            child = parent + (k,)
            if child not in nodes:  # ranks below k are all in
                out.append(child)
                break
    return out


def _removals(nodes: set) -> list[tuple[int, ...]]:
    """Nodes that can leave ``nodes`` keeping a contiguous tree: leaves without a next sibling."""
    return [
        n for n in sorted(nodes)
        if n[:-1] + (n[-1] + 1,) not in nodes and not any(m[:-1] == n for m in nodes)
    ]  # fmt: skip


def search_tree(budget: int, ranks: list[list[int]], starts=(), beam: int = 16) -> TokenTree:
    """The ``budget``-node tree with the highest replayed τ found by a beam search (trees
    grown one node at a time, the ``beam`` best kept at every size) and hill climbing from the
    best of those and ``starts`` (module docstring)."""
    cache: dict[frozenset, float] = {}

    def score(nodes: frozenset) -> float:
        if nodes not in cache:
            cache[nodes] = simulate(TokenTree(sorted(nodes)), ranks)
        return cache[nodes]

    def ranked(trees) -> list[frozenset]:  # best first; ties: the smaller node list first
        return sorted(set(trees), key=lambda t: (-score(t), sorted(t)))

    grown = [frozenset()]
    for _ in range(budget):
        grown = ranked(t | {c} for t in grown for c in _additions(t))[:beam]
    best = ranked([*grown, *(frozenset(t.nodes) for t in starts)])[0]
    while True:
        moves = [(best - {out}) | {add} for out in _removals(best) for add in _additions(best - {out}) if add != out]
        top = ranked(moves)[0] if moves else best
        if score(top) <= score(best) + 1e-12:
            return TokenTree(sorted(best))
        best = top


def build_shapes(args, budget: int, calib: list[list[int]]) -> dict[str, TokenTree]:
    """``{shape: tree}`` at one budget (module docstring)."""
    chain = TokenTree.chain(budget)
    shapes = {"chain": chain}
    if "topk" in args.shapes:
        shapes["topk"] = TokenTree.topk(depth=max(budget // 2, 1), branching=2, budget=budget)
    acc_tree = None
    if "accuracies" in args.shapes or "search" in args.shapes:
        acc, _ = round_accuracies(chain, calib)
        acc_tree = TokenTree.from_accuracies(acc, budget=budget, max_depth=budget, branching=MAX_RANK)
    if "accuracies" in args.shapes:
        shapes["accuracies"] = acc_tree
    if "search" in args.shapes:
        shapes["search"] = search_tree(budget, calib, starts=(chain, acc_tree))
    return {s: t for s, t in shapes.items() if s in args.shapes}
