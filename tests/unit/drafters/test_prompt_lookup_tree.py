"""Prompt-lookup token trees: the trie of several earlier matches against a pure-Python
reference and on hand-made buffers, the chain as the tree's rank-0 spine, greedy equality with
plain greedy (batch 1, left-padded batch, one compiled round), a tree beating the chain where
earlier continuations differ, and sampling with a tree."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LogitsProcessorList

import specfx
from specfx.drafters.prompt_lookup import MAX_TREE_MATCHES, lookup_matches, lookup_proposals, lookup_tree
from specfx.passes.checks.no_host_sync import offending_nodes
from specfx.trees.types import TokenTree
from tests.conftest import left_padded, round_backends
from tests.lossless.test_lossless import _chisquare, _exact, _models
from tests.unit.drafters.test_prompt_lookup import MODELS, _copying, _repeating_prompt

# the tree of the examples: two root children, a deeper rank-0 spine
SMALL = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])
TREES = {"small": SMALL, "topk3x2": TokenTree.topk(3, 2)}


# --------------------------------------------------------------------------- the trie
def _reference(seq: list[int], tree: TokenTree, max_ngram: int, min_ngram: int, matches: int) -> list[int]:
    """Slow reference: list every earlier window end with its match length, keep the best
    ``matches`` (longest, then most recent), continue each periodically, and fill the nodes in
    order: child r of a node is the r-th distinct next token of the matches that agree with
    the node's path; without one, the parent's token."""
    last = len(seq) - 1
    found = []
    for e in range(last):
        n = 0
        while n < max_ngram and e - n >= 0 and seq[e - n] == seq[last - n]:
            n += 1
        if n >= min_ngram:
            found.append((n, e))
    found.sort(key=lambda ne: (-ne[0], -ne[1]))
    conts = [[seq[e + 1 + i % (last - e)] for i in range(tree.depth)] for _, e in found[:matches]]
    token, compatible = {(): seq[last]}, {(): list(range(len(conts)))}
    for node in tree.nodes:
        parent, d = node[:-1], len(node)
        distinct = []
        for j in compatible[parent]:
            if conts[j][d - 1] not in distinct:
                distinct.append(conts[j][d - 1])
        if node[-1] < len(distinct):
            token[node] = distinct[node[-1]]
            compatible[node] = [j for j in compatible[parent] if conts[j][d - 1] == token[node]]
        else:
            token[node], compatible[node] = token[parent], []
    return [token[node] for node in tree.nodes]


@pytest.mark.parametrize("tree", [SMALL, TokenTree.topk(3, 3), TokenTree.medusa(20), TokenTree.chain(5)], ids=repr)
@pytest.mark.parametrize("max_ngram,min_ngram,matches", [(3, 1, 8), (2, 2, 3), (1, 1, 1), (4, 1, 40)])
def test_tree_matches_reference(tree, max_ngram, min_ngram, matches):
    rng = random.Random(max_ngram * 100 + min_ngram * 10 + matches)
    b, c = 12, 40
    for vocab in (2, 3, 6):
        lengths = [rng.randrange(0, c - 1) for _ in range(b)]
        lengths[0], lengths[1] = 0, 1  # a one-token row and a two-token row
        # columns past a row's length hold stale garbage from a small, overlapping alphabet
        tokens = torch.tensor([[rng.randrange(vocab) for _ in range(c)] for _ in range(b)])
        got = lookup_tree(tokens, torch.tensor(lengths), tree, max_ngram, min_ngram, matches)
        assert got.shape == (b, tree.size)
        for row in range(b):
            seq = tokens[row, : lengths[row] + 1].tolist()
            assert got[row].tolist() == _reference(seq, tree, max_ngram, min_ngram, matches), seq


#               0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
DIVERGING = [1, 2, 5, 6, 9, 1, 2, 7, 8, 9, 1, 2, 5, 3, 1, 2]
# the suffix "1 2" occurs ending at 11, 6 and 1 (most recent first), continued by
#   5 3 1 (e = 11),   7 8 9 (e = 6),   5 6 9 (e = 1)
# so matches 0 and 2 share the prefix 5 and diverge after it
BRANCHY = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])


def _batch(*rows: list[int], width: int = 20, stale: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((len(rows), width), stale)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return tokens, torch.tensor([len(row) - 1 for row in rows])


def test_matches_are_ranked_longest_then_most_recent():
    #        0  1  2  3  4  5  6  7  8
    tokens, lengths = _batch([4, 1, 2, 8, 1, 2, 9, 3, 2])  # suffix "3 2": "2" at 2 and 5, no "3 2"
    ends, ngram = lookup_matches(tokens, lengths, 3, 1, 4)
    assert (ends.tolist(), ngram.tolist()) == ([[5, 2, 7, 7]], [[1, 1, 0, 0]])  # empty slots: L - 1
    tokens, lengths = _batch([4, 1, 2, 8, 1, 2, 9, 1, 2])  # now "1 2" ends at 2 and 5 too
    ends, ngram = lookup_matches(tokens, lengths, 3, 1, 3)
    assert (ends.tolist(), ngram.tolist()) == ([[5, 2, 7]], [[2, 2, 0]])
    ends, ngram = lookup_matches(tokens, lengths, 3, 2, 1)
    assert (ends.tolist(), ngram.tolist()) == ([[5]], [[2]])


def test_trie_shares_prefixes_and_fills_siblings_from_diverging_matches():
    tokens, lengths = _batch(DIVERGING)
    # nodes: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0) (0,1,0)
    # root children: 5 (matches 0, 2), 7 (match 1), then none left: the pending token 2;
    # under 5 the matches diverge: 3 (match 0), 6 (match 2); under 7: 8; then 1 and 9
    assert lookup_tree(tokens, lengths, BRANCHY, 3).tolist() == [[5, 7, 2, 3, 6, 8, 1, 9]]
    # one match: the chain 5 3 1 on the spine; every other node repeats its parent's token
    assert lookup_tree(tokens, lengths, BRANCHY, 3, matches=1).tolist() == [[5, 2, 2, 3, 5, 2, 1, 5]]
    # the spine is the chain's proposal
    spine = lookup_tree(tokens, lengths, TokenTree.topk(3, 2), 3)[:, [0, 2, 6]]
    assert torch.equal(spine, lookup_proposals(tokens, lengths, 3, 3)[0])


def test_batch_rows_fill_their_own_tries():
    tokens, lengths = _batch(
        DIVERGING,  # several matches, shared and diverging prefixes
        [4, 5, 6, 7],  # no match (the stale 7s after it would match "7" if read)
        [9],  # a single token
        [3, 4, 3, 4, 3],  # two matches (ends 2 and 0) with the same continuation 4 3 4 3
    )
    got = lookup_tree(tokens, lengths, BRANCHY, 3)
    assert got.tolist() == [
        [5, 7, 2, 3, 6, 8, 1, 9],
        [7] * 8,
        [9] * 8,
        # (0,) 4, (1,) (2,) the pending 3; (0,0) 3, (0,1) its parent's 4; (1,0) 3; (0,0,0) 4, (0,1,0) 4
        [4, 3, 3, 3, 4, 3, 4, 4],
    ]


def test_tree_spine_is_the_chain_on_random_buffers():
    rng = random.Random(5)
    tree = TokenTree.topk(4, 3, budget=30)
    spine = [tree.nodes.index((0,) * d) for d in range(1, tree.depth + 1)]
    tokens = torch.tensor([[rng.randrange(3) for _ in range(30)] for _ in range(16)])
    lengths = torch.tensor([rng.randrange(30) for _ in range(16)])
    got = lookup_tree(tokens, lengths, tree, 3, 1, 5)
    assert torch.equal(got[:, spine], lookup_proposals(tokens, lengths, tree.depth, 3, 1)[0])


@pytest.mark.parametrize(
    "value,pattern",
    [
        (0, r"tree_matches must be an int in \[1, 64\], got 0"),
        (MAX_TREE_MATCHES + 1, r"tree_matches must be an int in \[1, 64\], got 65"),
        (2.0, r"tree_matches must be an int .* got 2.0"),
        (True, r"tree_matches must be an int .* got True"),
    ],
)
def test_bad_tree_matches(value, pattern):
    with pytest.raises(ValueError, match=pattern):
        specfx.PromptLookup(tree_matches=value)


# --------------------------------------------------------------------------- generation
@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("model", ["llama-random", "gpt2-copying"])
def test_tree_greedy_equals_plain(model, tree, one_thread):
    target = MODELS[model]()
    spec = specfx.speculate(target, draft="prompt_lookup", tree=TREES[tree], num_speculative_tokens=TREES[tree].size, compile=False)
    assert spec.tree == TREES[tree]
    for seed, new in [(0, 30), (1, 17)]:
        ids = _repeating_prompt(seed)
        assert torch.equal(
            spec.generate(ids, max_new_tokens=new, do_sample=False),
            target.generate(ids, max_new_tokens=new, do_sample=False),
        )
    assert spec.stats.proposed == spec.stats.row_rounds * TREES[tree].size


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("model", ["llama-random", "gpt2-copying"])
def test_tree_left_padded_batch_matches_batched_generate(model, tree, one_thread):
    target = MODELS[model]()
    spec = specfx.speculate(target, draft=specfx.PromptLookup(max_ngram=2), tree=TREES[tree], compile=False)
    ids, mask = left_padded(14, [5, 0, 3], seed=2, vocab=8)  # a small alphabet: many diverging matches
    kw = dict(attention_mask=mask, max_new_tokens=25, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))


def _diverging_prompt(target) -> torch.Tensor:
    """``a b c d ...`` (the model's own greedy continuation of ``a``), then ``a b`` followed by
    other tokens, then ``a``: prefill emits ``b``, and the suffix ``a b`` has two earlier
    matches of equal length. The most recent (the chain's) continues with the other tokens,
    the older one (a tree's second branch) with ``c d ...``, what the model emits."""
    own = target.generate(torch.tensor([[5]]), max_new_tokens=7, do_sample=False)[0].tolist()
    other = [t for t in range(20, 120, 7) if t not in own][:6]
    return torch.tensor([own + own[:2] + other + own[:1]])


def test_tree_accepts_more_than_the_chain_where_earlier_continuations_differ(one_thread):
    target = _copying("llama")  # its next token depends only on the current one
    ids = _diverging_prompt(target)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert expected[0, ids.shape[1] : ids.shape[1] + 5].tolist() == ids[0, 1:6].tolist(), "precondition: it copies"
    tau = {}
    for name, tree in [("chain", TokenTree.chain(4)), ("tree", TokenTree.topk(4, 2))]:
        spec = specfx.speculate(target, draft="prompt_lookup", tree=tree, num_speculative_tokens=tree.size, compile=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=24, do_sample=False), expected)
        tau[name] = spec.stats.tokens_per_round
    assert tau["tree"] > tau["chain"], tau


def test_tree_sampling_respects_max_new_tokens(one_thread):
    target = MODELS["gpt2-copying"]()
    spec = specfx.speculate(target, draft="prompt_lookup", tree=SMALL, compile=False)
    ids, mask = left_padded(12, [0, 4], seed=3, vocab=8)
    for new in (1, 9, 20):
        out = spec.generate(
            ids, attention_mask=mask, do_sample=True, max_new_tokens=new, eos_token_id=None, pad_token_id=0
        )
        assert out.shape == (2, 12 + new)
        assert torch.equal(out[:, :12], ids)
        assert spec.stats.emitted == 2 * (new - 1)  # the first token comes from prefill


@pytest.mark.full  # the default tier: the draft model's, EAGLE-3's and Medusa's trees (tests/lossless, heads)
def test_tree_sampling_matches_exact_distribution():
    """Chi-square against the enumerated target distribution (harness of test_lossless): on
    a 6-token vocabulary the trie often repeats a sibling's token, which acceptance must reject."""
    target, _ = _models()
    prompt_ids = [1, 4, 2, 1, 4]
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    spec = specfx.speculate(target, draft="prompt_lookup", tree=TokenTree.topk(2, 2), num_speculative_tokens=6, compile=False)
    torch.manual_seed(4321)
    out = spec.generate(torch.tensor([prompt_ids]).repeat(6000, 1), do_sample=True, max_new_tokens=3, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


# --------------------------------------------------------------------------- compiled
@pytest.mark.parametrize("backend", round_backends())
def test_compiled_prompt_lookup_tree_round(backend, one_thread):
    """One compiled tree round: greedy equality on two prompts, one graph, no host-sync ops."""
    target = _copying("llama")
    spec = specfx.speculate(
        target, draft="prompt_lookup", tree=SMALL, num_speculative_tokens=SMALL.size, backend=backend, background_compile=False
    )
    for seed in (0, 1):
        ids = _repeating_prompt(seed, length=14)
        assert torch.equal(spec.generate(ids, max_new_tokens=24), target.generate(ids, max_new_tokens=24))
    assert len(spec.graphs) == 1
    assert offending_nodes(spec.graphs[0].graph_module) == []
    assert spec.stats.accepted > 0
