"""EAGLE-2 dynamic trees (TokenTree.eagle2 / DynamicTree): the drafter chooses each row's tree
every round; verification, the walk and compaction take its per-row tables.

The drafter here is a bigram table (draft logits depend on the last token only), so the tree
growth can be checked against a plain-Python reference of EAGLE-2's selection rule, and the
round against model.generate() and the exact sampling distribution. EAGLE heads
(tests/models/test_eagle*.py) run the same rounds with real draft forwards.
"""

import pytest
import torch

import specfx
from specfx.drafters.base import Drafter, DynamicTreeDrafting
from specfx.trees.drafting import draft_dynamic_tree
from specfx.trees.types import DynamicTree, TokenTree, TreeTensors
from tests.conftest import left_padded, prompt
from tests.lossless.test_lossless import CASES, _chisquare, _exact, _models


class Bigram(DynamicTreeDrafting, Drafter):
    """Draft logits ``table[token]`` for the token at a node (no KV, no state): deterministic,
    so any tree it grows keeps sampling lossless."""

    name = "bigram"

    def __init__(self, table: torch.Tensor, record: bool = False):
        self.table = table  # [V, V]
        self.views = [] if record else None  # (ids, positions, slots, view) of each step

    def propose_dynamic_tree(self, ctx):
        table = self.table.to(ctx.tokens.device)
        pending = ctx.tokens.gather(1, ctx.lengths.unsqueeze(1))  # [B, 1]
        root_state = torch.zeros((pending.shape[0], 1, 1), device=pending.device)

        def step(ids, states, positions, slots, view):
            if self.views is not None:
                self.views.append((ids, positions, slots, view))
            return table[ids], states

        return draft_dynamic_tree(ctx, table[pending], root_state, step)


def bigram_of(model, vocab: int) -> torch.Tensor:
    """The model's next-token logits after each single token: a bigram approximation of it."""
    with torch.no_grad():
        return model(torch.arange(vocab).unsqueeze(1)).logits[:, -1].float()


def reference_tree(table: torch.Tensor, pending: int, spec: DynamicTree):
    """EAGLE-2's selection in plain Python for one row: returns (tokens, parents) with node
    numbers in candidate order. Candidates are (score, id, token, parent id)."""
    logp = table.float().log_softmax(-1)
    k = spec.branching
    cands = []  # (id, token, parent_id, score)
    top = logp[pending].topk(k)
    for s, t in zip(top.values, top.indices.tolist(), strict=True):
        cands.append((len(cands) + 1, t, 0, s))  # scores stay float32 tensors, summed as the graph does
    frontier = cands[:]
    for _ in range(1, spec.depth):
        level = []
        for cid, tok, _, score in frontier:
            top = logp[tok].topk(k)
            for s, t in zip(top.values, top.indices.tolist(), strict=True):
                level.append((len(cands) + len(level) + 1, t, cid, score + s))
        cands += level
        frontier = sorted(level, key=lambda c: -float(c[3]))[:k]
    chosen = sorted(sorted(cands, key=lambda c: -float(c[3]))[: spec.budget], key=lambda c: c[0])
    node = {c[0]: i + 1 for i, c in enumerate(chosen)}
    return [c[1] for c in chosen], [0] + [node.get(c[2], 0) if c[2] else 0 for c in chosen]


class _Ctx:
    def __init__(self, tokens, lengths, tree):
        self.tokens, self.lengths, self.token_tree = tokens, lengths, tree


@pytest.mark.parametrize("spec", [DynamicTree(8, 3, 3), DynamicTree(12, 4, 2), DynamicTree(5, 2, 4)])
def test_growth_matches_reference_and_is_a_tree(spec):
    torch.manual_seed(0)
    vocab = 11
    table = torch.randn(vocab, vocab) * 3
    tokens = torch.tensor([[3, 7, 1, 0, 0, 0], [2, 9, 0, 0, 0, 0]])
    lengths = torch.tensor([2, 1])  # pending tokens 1 and 9
    drafter = Bigram(table, record=True)
    ids, parents = drafter.propose_dynamic_tree(_Ctx(tokens, lengths, spec))
    assert ids.shape == (2, spec.budget) and parents.shape == (2, spec.budget + 1)
    for row, pending in enumerate([1, 9]):
        want_tokens, want_parents = reference_tree(table, pending, spec)
        assert ids[row].tolist() == want_tokens
        assert parents[row].tolist() == want_parents
        assert all(parents[row, n] < n for n in range(1, spec.budget + 1))  # parents precede children
    # the draft forwards: k nodes per depth 1..D-1, at position L + d, in scratch slots L + f
    assert len(drafter.views) == spec.depth - 1
    for d, (_, positions, slots, view) in enumerate(drafter.views, start=1):
        k = spec.branching
        assert positions.tolist() == [[int(lengths[r]) + d] * k for r in range(2)]
        assert slots.tolist() == [[int(lengths[r]) + f for f in range((d - 1) * k + 1, d * k + 1)] for r in range(2)]
        assert view.queries == tuple(range((d - 1) * k + 1, d * k + 1))
        # each expanded node sees itself and its expanded ancestors only (depths 1..d)
        anc = view.ancestors[:, list(view.queries)]  # [B, k, F+1]
        assert (anc.sum(-1) == d + 1).all()


def test_tree_tables_of_a_grown_tree():
    spec = DynamicTree(10, 3, 3)
    table = torch.randn(9, 9) * 3
    tokens = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    _, parents = Bigram(table).propose_dynamic_tree(_Ctx(tokens, torch.tensor([2]), spec))
    tt = TreeTensors.from_parents(parents, spec.depth)
    assert int(tt.depth.max()) <= spec.depth
    for n in range(1, spec.budget + 1):  # a node's depth is its parent's + 1
        assert int(tt.depth[0, n]) == int(tt.depth[0, int(parents[0, n])]) + 1


def test_eagle2_builder_and_validation():
    assert TokenTree.eagle2() == DynamicTree(60, 6, 10)
    assert TokenTree.eagle2(budget=16).size == 16
    assert DynamicTree(16, 5, 2).scratch_slots == 16 and DynamicTree(4, 6, 10).scratch_slots == 50
    with pytest.raises(ValueError, match="only 6 candidates"):
        DynamicTree(7, 2, 2)
    with pytest.raises(ValueError, match="at most 128 nodes"):
        TokenTree.eagle2(budget=129)
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        TokenTree.eagle2(depth=0)


def test_drafters_that_cannot_grow_it_are_refused(one_thread):
    target, draft = _models()
    with pytest.raises(ValueError, match=r"draft_model drafter cannot grow a dynamic tree .*specfx.Eagle"):
        specfx.speculate(target, draft=draft, tree=TokenTree.eagle2(budget=8), compile=False)
    with pytest.raises(ValueError, match="prompt_lookup drafter cannot grow a dynamic tree"):
        specfx.speculate(target, draft="prompt_lookup", tree=TokenTree.eagle2(budget=8), compile=False)
    with pytest.raises(ValueError, match="branching=10 .* vocabulary of 6"):
        specfx.speculate(target, draft=Bigram(bigram_of(draft, 6)), tree=TokenTree.eagle2(budget=8), compile=False)


def _llama():
    from specfx.testing.tiny import tiny_causal_lm

    return tiny_causal_lm("llama")


def hinted(table: torch.Tensor, sequences: torch.Tensor, bonus: float = 8.0) -> torch.Tensor:
    """``table`` with each transition a -> b seen in ``sequences [B, T]`` made likely: a
    drafter that often agrees with the target on these prompts (so deep paths get accepted),
    and is still wrong wherever a token was followed by different tokens."""
    table = table.clone()
    for row in sequences.tolist():
        for a, b in zip(row[:-1], row[1:], strict=True):
            table[a, b] += bonus
    return table


@pytest.mark.parametrize("spec", [DynamicTree(8, 3, 3), DynamicTree(16, 5, 2)])
def test_greedy_equals_hf(spec, one_thread):
    target = _llama()
    vocab = target.config.vocab_size
    cases, wants = [(prompt(10, seed=3), None), left_padded(10, [0, 3, 5], seed=1)], []
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    for ids, mask in cases:
        wants.append(target.generate(ids, attention_mask=mask, **kwargs))
    table = hinted(bigram_of(target, vocab), torch.cat([w[:, -20:] for w in wants]))
    spec_gen = specfx.speculate(target, draft=Bigram(table), tree=spec, num_speculative_tokens=spec.size, compile=False)
    for (ids, mask), want in zip(cases, wants, strict=True):
        assert torch.equal(spec_gen.generate(ids, attention_mask=mask, **kwargs), want)
    per_depth = spec_gen.cumulative_stats.per_depth
    assert per_depth[1] > 0, per_depth  # paths of two nodes were accepted (and moved to committed slots)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampling_matches_exact_distribution(case):
    target, draft = _models()
    kwargs, warpers = CASES[case]
    probs = _exact(target, [1, 4, 2], warpers)
    spec = specfx.speculate(
        target, draft=Bigram(bigram_of(draft, 6)), tree=DynamicTree(6, 3, 2), num_speculative_tokens=6, compile=False,
        min_capacity=16, prefill_buckets=(4,)
    )
    torch.manual_seed(1234)
    out = spec.generate(torch.tensor([[1, 4, 2]]).repeat(8192, 1), do_sample=True, max_new_tokens=3, pad_token_id=0, **kwargs)
    per_depth = spec.stats.per_depth
    assert per_depth[1] > 0.01 * spec.stats.row_rounds and per_depth[0] < 0.95 * spec.stats.row_rounds, per_depth
    assert _chisquare(out[:, 3:].tolist(), probs) > 1e-3


@pytest.mark.compiled
def test_compiled_one_graph(one_thread):
    target = _llama()
    vocab = target.config.vocab_size
    # traced by Dynamo with specfx's passes (EAGLE's dynamic tree runs under Inductor in test_eagle.py)
    tree = DynamicTree(8, 3, 3)
    spec = specfx.speculate(target, draft=Bigram(bigram_of(target, vocab)), tree=tree, num_speculative_tokens=8, backend="specfx_eager")
    for length, pads in [(10, [0, 2]), (13, [4, 0])]:
        ids, mask = left_padded(length, pads, seed=length)
        kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(spec.generate(ids, **kwargs), target.generate(ids, **kwargs))
    assert len(spec.graphs) == 1, "recompiled for new batch contents"
