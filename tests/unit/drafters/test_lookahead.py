"""Lookahead decoding (draft="lookahead"): the branch's layout and mask against the method's
definition, the Jacobi step against plain forwards of the sequences each column sees, the pool
lookup on hand-made pools, greedy equality with plain greedy (batch 1, left-padded batch,
several W/N/G, eager and one compiled round), pool hits on a small vocabulary, chi-square
losslessness, "auto" between the tree and plain decoding, and the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

import specfx
from specfx.drafters.lookahead import Lookahead, branch_layout, candidate_trie, pool_candidates
from specfx.engine.auto_k import HOLD, MIN_EVIDENCE
from specfx.passes.checks.no_host_sync import offending_nodes
from specfx.trees.types import TreeTensors
from tests.conftest import left_padded, pair, prompt, round_backends, tiered
from tests.lossless.test_lossless import _chisquare, _exact, _models
from tests.unit.drafters.test_prompt_lookup import _repeating_prompt

CONFIGS = [(4, 3, 2), (3, 2, 1), (5, 4, 3)]  # (W, N, G): N = 2 has one level, G = 1 one chain


# --------------------------------------------------------------------------- static layout
def test_branch_layout_is_the_methods_mask():
    # W = 3, N = 3: level 0 = [pending, a1, a2], level 1 = [b0, b1, b2]; branch tokens a1 a2 b0 b1 b2
    depth, sees = branch_layout(3, 3)
    assert depth == [1, 2, 1, 2, 3]  # level l, column j at L + l + j
    t, f = True, False
    assert sees == [
        [t, f, f, f, f],  # a1: level 0 up to itself
        [t, t, f, f, f],  # a2
        [f, f, t, f, f],  # b0: level 0 up to column 0 (the pending token, always visible), itself
        [t, f, f, t, f],  # b1: a1, itself
        [t, t, f, f, t],  # b2: a1 a2, itself
    ]
    depth, sees = branch_layout(2, 4)  # levels 0..2 of 2 columns: a1 | b0 b1 | c0 c1
    assert depth == [1, 1, 2, 2, 3]
    assert sees[3] == [f, t, f, t, f]  # c0: b0 (its column), itself
    assert sees[4] == [t, f, t, f, t]  # c1: a1, b1, itself


def test_round_tree_is_g_chains():
    la = Lookahead(window=4, ngram=3, guesses=2)
    assert la.round_tree().nodes == ((0,), (1,), (0, 0), (1, 0))
    assert la.branch_slots == 2 * 4 - 1


# --------------------------------------------------------------------------- the pool
def test_pool_candidates_most_recent_first_distinct_and_keyed():
    keys = torch.tensor([[5, 5, 7, 5, 5, -1]])
    ngrams = torch.tensor([[[1, 2], [3, 4], [9, 9], [1, 2], [6, 6], [0, 0]]])
    stamps = torch.tensor([[0, 1, 2, 3, 4, -1]])
    got = pool_candidates(keys, ngrams, stamps, torch.tensor([5]), 3)
    # key 5 by recency: [6 6] (4), [1 2] (3), [3 4] (1), [1 2] (0, a repeat); key 7 never
    assert got.tolist() == [[[6, 6], [1, 2], [3, 4]]]
    # fewer distinct hits than G: the hits come first
    got = pool_candidates(keys, ngrams, stamps, torch.tensor([7]), 2)
    assert got[0, 0].tolist() == [9, 9]
    # rows are independent
    two = pool_candidates(keys.repeat(2, 1), ngrams.repeat(2, 1, 1), stamps.repeat(2, 1), torch.tensor([7, 5]), 1)
    assert two.tolist() == [[[9, 9]], [[6, 6]]]


def test_candidate_trie_shares_prefixes():
    cand = torch.tensor([[[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]]])  # G = 4 guesses of 3
    tokens, parents = candidate_trie(cand)
    # nodes 1-4: depth 1 of guesses 0-3; 5-8 depth 2; 9-12 depth 3
    assert tokens.tolist() == [[1, 1, 1, 7, 2, 2, 5, 8, 3, 4, 6, 9]]
    # depth 1: all under the root (guesses 1, 2 repeat guess 0's "1": siblings tried after it);
    # depth 2: guesses 0-2 share "1" -> under node 1; guess 3 under its own node 4;
    # depth 3: guesses 0, 1 share "1 2" -> under node 5; guess 2 under node 7; guess 3 under node 8
    assert parents.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 4, 5, 5, 7, 8]]
    tt = TreeTensors.from_parents(parents, 3)
    # the path to guess 1's last token runs through guess 0's first two nodes
    assert tt.path[0, 10].tolist() == [0, 1, 5, 10]
    # a greedy walk where the target continues 1 5 6: the longest guess, guess 2, is accepted
    from specfx.sampling.accept import tree_accept

    want = {0: 1, 1: 5, 7: 6, 11: 0}  # argmax at the root, at node 1, at node 7, at node 11
    scores = torch.full((1, 13, 10), -1.0)
    for node, tok in want.items():
        scores[0, node, tok] = 1.0
    stop, last, _ = tree_accept(scores, torch.cat([torch.tensor([[0]]), tokens], dim=1), tt, False)
    assert (int(stop), int(last)) == (11, 0)


class _Recording(Lookahead):
    """Records, per round, the committed tokens, the pending position, the window before the
    Jacobi step and the new tokens, and the pool after it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds = []

    def observe_branch(self, ctx, root_logits, logits):
        before = (ctx.tokens.clone(), ctx.lengths.clone(), self.traj.clone())
        super().observe_branch(ctx, root_logits, logits)
        self.rounds.append((*before, self.traj[:, -1].clone(), self.keys.clone(), self.ngrams.clone()))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_jacobi_step_and_pool_update_match_plain_forwards(cfg, one_thread):
    """Every new token of the window is the target's argmax after the committed prefix and
    the tokens its column sees (level 0's columns 1..j, then column j of levels 1..N-2), as a
    plain forward computes it: the branch's mask and positions are the method's. Each round's
    W n-grams are in the pool afterwards, and the levels shift up."""
    w, n, g = cfg
    target = pair("llama", "self")[0]
    la = _Recording(w, n, g)
    spec = specfx.speculate(target, draft=la, num_speculative_tokens=g * (n - 1), compile=False)  # the tree every round
    ids = _repeating_prompt(4, length=10)
    spec.generate(ids, max_new_tokens=8, do_sample=False)
    assert len(la.rounds) >= 3
    for i, (tokens, lengths, traj, new, keys, ngrams) in enumerate(la.rounds):
        length = int(lengths[0])
        prefix = tokens[0, : length + 1].tolist()
        for j in range(w):
            seen = traj[0, 0, 1 : j + 1].tolist() + traj[0, 1:, j].tolist()
            with torch.no_grad():
                logits = target(torch.tensor([prefix + seen])).logits[0, -1]
            assert int(new[0, j]) == int(logits.argmax()), (i, j)
        first = [prefix[-1]] + traj[0, 0, 1:].tolist()
        grams = {(first[j], *traj[0, 1:, j].tolist(), int(new[0, j])) for j in range(w)}
        pool = {(int(k), *v) for k, v in zip(keys[0].tolist(), ngrams[0].tolist(), strict=True)}
        assert grams <= pool
        if i + 1 < len(la.rounds):
            after = la.rounds[i + 1][2]
            assert torch.equal(after[:, :-1], traj[:, 1:]) and torch.equal(after[:, -1], new)


# --------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("cfg", tiered(CONFIGS, CONFIGS[:2]), ids=str)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_equals_plain(arch, cfg, one_thread):
    target = pair(arch, "self")[0]
    spec = specfx.speculate(target, draft=Lookahead(*cfg), num_speculative_tokens=cfg[2] * (cfg[1] - 1), compile=False)
    assert spec.method == "lookahead"
    for seed, new in [(0, 30), (1, 17)]:
        ids = _repeating_prompt(seed)
        assert torch.equal(
            spec.generate(ids, max_new_tokens=new, do_sample=False),
            target.generate(ids, max_new_tokens=new, do_sample=False),
        )
    assert spec.stats.proposed == spec.stats.row_rounds * cfg[2] * (cfg[1] - 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_left_padded_batch_matches_batched_generate(arch, one_thread):
    target = pair(arch, "self")[0]
    spec = specfx.speculate(target, draft="lookahead:4,3,3", compile=False)
    ids, mask = left_padded(14, [5, 0, 3], seed=2, vocab=8)
    kw = dict(attention_mask=mask, max_new_tokens=25, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_committed_kv_equals_a_fresh_prefill(arch, one_thread):
    """The branch's KV (scratch slots past the tree's) is never committed: after lookahead
    rounds with accepted guesses the target's KV at every committed slot equals a fresh
    prefill of the emitted tokens (gemma2: sliding-window and full layers, left padding)."""
    from tests.unit.trees.test_tree import _assert_cache_matches, _fresh_kv

    target = pair(arch, "self")[0]
    spec = specfx.speculate(target, draft="lookahead:4,3,3", num_speculative_tokens=6, compile=False)
    ids, mask = left_padded(12, [4, 0, 2], seed=5, vocab=8)
    kw = dict(attention_mask=mask, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert spec.stats.accepted > 0, spec.stats  # some guesses' KV was moved into place
    lengths = spec.state.lengths[:3].tolist()
    tokens = spec.state.tokens[:3, : max(lengths)]
    _assert_cache_matches(spec.target_runner.cache, _fresh_kv(target, tokens), lengths)


def test_return_dict_matches_hf(one_thread):
    """Per-step scores and logits are those of the verified path (the branch's columns are
    cut off before acceptance), with a repetition penalty, batch 2."""
    target = pair("llama", "self")[0]
    spec = specfx.speculate(target, draft="lookahead:4,3,2", compile=False)
    ids, mask = left_padded(9, [0, 3], seed=11, vocab=8)
    kw = dict(attention_mask=mask, max_new_tokens=12, repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
    kw.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    ours, hf = spec.generate(ids, **kw), target.generate(ids, **kw)
    assert torch.equal(ours.sequences, hf.sequences)
    for a, b in zip(ours.scores + ours.logits, hf.scores + hf.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


CONFORMANCE = ("mistral", "qwen3", "gemma2", "phi3", "gpt_neox", "opt", "falcon", "mixtral", "qwen2_moe")


@pytest.mark.parametrize("arch", tiered(CONFORMANCE, ("gemma2", "mixtral", "falcon")))
def test_conformance_subset_greedy_equals_hf(arch, one_thread):
    """The conformance matrix's tree check with lookahead: batch 1 and a ragged left-padded
    batch (prompts past a sliding window of 8 where the model has one), eager."""
    from tests.conformance.test_conformance import _check_greedy, _pair, _ragged
    from tests.conftest import prompt

    target, _ = _pair(arch)
    spec = specfx.speculate(target, draft="lookahead:4,3,3", compile=False)
    no_eos = dict(eos_token_id=None)
    _check_greedy(spec, target, prompt(10, seed=3), None, 16, **no_eos)
    _check_greedy(spec, target, *_ragged(batch=2), 16, **no_eos)


@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_models_that_refuse_trees_refuse_lookahead(arch):
    from tests.conformance.test_conformance import _pair

    with pytest.raises(ValueError, match=r"speculate\(draft='lookahead' \(it verifies a token tree each round\)\): "):
        specfx.speculate(_pair(arch)[0], draft="lookahead", compile=False)


def test_pool_hits_on_a_small_vocabulary(one_thread):
    """On a 6-token vocabulary the Jacobi window soon finds the n-grams the target emits:
    guesses are accepted (τ > 1.5), and the output is still plain greedy's."""
    target, _ = _models()
    ids = torch.tensor([[1, 4, 2, 1, 4]])
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    for cfg in [(4, 3, 2), (8, 4, 8)]:
        # "auto" on given times where the tree pays from τ = 1.2 (an int K cannot pin (8, 4, 8)'s
        # 24 nodes: SpecConfig caps K at 16 before it knows the drafter's tree)
        spec = specfx.speculate(target, draft=Lookahead(*cfg), auto_k_times={0: 1.0, None: 1.2}, compile=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0), expected)
        assert set(spec.auto_k.history) == {None}  # the tree every round
        assert spec.stats.tokens_per_round > 1.5, (cfg, spec.stats)
        assert spec.stats.per_position[1] > 0  # two-token guesses accepted too


# --------------------------------------------------------------------------- sampling
@pytest.mark.full
def test_sampling_matches_exact_distribution():
    """Chi-square against the enumerated target distribution (harness of test_lossless)."""
    target, _ = _models()
    prompt_ids = [1, 4, 2, 1, 4]
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    la = Lookahead(window=3, ngram=3, guesses=2)
    spec = specfx.speculate(target, draft=la, num_speculative_tokens=4, compile=False)  # the tree every round
    torch.manual_seed(4321)
    out = spec.generate(torch.tensor([prompt_ids]).repeat(6000, 1), do_sample=True, max_new_tokens=3, pad_token_id=0)
    assert spec.stats.accepted > 500  # guesses were accepted, and rejected: both paths tested
    assert spec.stats.acceptance_rate < 0.95
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


# --------------------------------------------------------------------------- "auto": the tree or K = 0
def test_auto_falls_back_to_plain_decoding_where_nothing_repeats(one_thread):
    """On a random model's text the target agrees with no guess. Lookahead is resumable, so
    "auto" (the default) chooses its first window on the prior: where the tree pays on it
    (t(tree) / t(0) = 1.5 < τ 1.75) it runs MIN_EVIDENCE rounds, then K = 0, with one probe of the
    tree after HOLD windows; where the prior says it does not (1.8) the call starts plainly and
    probes; where even a full-depth path could not pay (3.0) the tree never runs. Given times,
    so the choices do not depend on the load; output equals generate() throughout."""
    target = pair("llama", "self")[0]
    ids = prompt(8, seed=2)
    kw = dict(max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, **kw)
    histories = {}
    for tree_time in (1.5, 1.8, 3.0):
        spec = specfx.speculate(target, draft="lookahead:4,3,2", auto_k_times={0: 1.0, None: tree_time}, compile=False)
        assert spec.auto_k.resumable and spec.spec_config.num_speculative_tokens == "auto"
        assert torch.equal(spec.generate(ids, **kw), expected)
        assert spec.stats.accepted == 0, spec.stats  # the premise: nothing the pool guesses is right
        assert spec.stats.proposed == 4 * spec.auto_k.history.count(None)
        histories[tree_time] = spec.auto_k.history
    on = MIN_EVIDENCE + HOLD + 1
    assert histories[1.5][:on] == [None] * MIN_EVIDENCE + [0] * HOLD + [None]  # the tree (key None), K = 0, a probe
    assert histories[1.8][: 1 + HOLD] == [0] * HOLD + [None] and histories[1.8].count(None) <= 3
    assert set(histories[3.0]) == {0}  # (depth + 1) / t(tree) = 3 / 3.0 <= 1 / t(0): never


def test_auto_keeps_the_tree_where_guesses_are_accepted(one_thread):
    """On a 6-token vocabulary the Jacobi window soon finds the target's n-grams: τ̂ stays above
    t(tree) / t(0), so every window runs the tree, as num_speculative_tokens = its node count
    forces it to; both equal generate()."""
    target, _ = _models()
    ids = torch.tensor([[1, 4, 2, 1, 4]])
    kw = dict(max_new_tokens=60, pad_token_id=0)
    expected = target.generate(ids, **kw)
    spec = specfx.speculate(target, draft="lookahead:4,3,2", auto_k_times={0: 1.0, None: 1.5}, compile=False)
    assert torch.equal(spec.generate(ids, **kw), expected)
    assert set(spec.auto_k.history) == {None} and spec.auto_k.tau > 1.5 and spec.stats.tokens_per_round > 1.5
    fixed = specfx.speculate(target, draft="lookahead:4,3,2", num_speculative_tokens=4, compile=False)
    assert fixed.auto_k is None and torch.equal(fixed.generate(ids, **kw), expected)
    assert fixed.stats.emitted == spec.stats.emitted and fixed.stats.rounds == spec.stats.rounds  # the same rounds


def test_auto_measures_both_rounds_and_its_times_reproduce_a_seeded_run(one_thread):
    """Without given times the generator times the tree and K = 0 (keys None and 0) before its
    first call; passing them as auto_k_times makes another generator choose the same rounds,
    so seeded sampling reproduces."""
    target, _ = _models()
    ids = torch.tensor([[1, 4, 2, 1, 4]])
    spec = specfx.speculate(target, draft="lookahead:4,3,2", compile=False)
    kw = dict(do_sample=True, max_new_tokens=30, pad_token_id=0)
    torch.manual_seed(3)
    out, history = spec.generate(ids, **kw), list(spec.auto_k.history)
    assert spec.auto_k.times.keys() == {0, None} and all(t > 0 for t in spec.auto_k.times.values())
    other = specfx.speculate(target, draft="lookahead:4,3,2", auto_k_times=spec.auto_k.times, compile=False)
    torch.manual_seed(3)
    assert torch.equal(other.generate(ids, **kw), out) and other.auto_k.history == history


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(window=0), r"window must be an int in \[1, 64\], got 0"),
        (dict(ngram=1), r"ngram must be an int in \[2, 16\], got 1"),
        (dict(guesses=2.0), r"guesses must be an int .* got 2.0"),
        (dict(ngram=True), r"ngram must be an int .* got True"),
        (dict(guesses=50, ngram=4), r"verifies 150 tokens per round; at most 128"),
        (dict(window=8, pool=4), r"pool must be an int in \[8, 65536\], got 4"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Lookahead(**kwargs)


def test_named_and_refused_combinations():
    target = pair("llama", "self")[0]
    spec = specfx.speculate(target, draft="lookahead:5,3,2", compile=False)
    assert (spec.drafter.window, spec.drafter.ngram, spec.drafter.guesses) == (5, 3, 2)
    assert spec.tree == spec.drafter.round_tree()
    with pytest.raises(ValueError, match=r"'lookahead:x': the argument is window\[,ngram\[,guesses\]\]"):
        specfx.speculate(target, draft="lookahead:x", compile=False)
    with pytest.raises(ValueError, match=r"lookahead drafter fixes each round's shape itself"):
        specfx.speculate(target, draft="lookahead", tree=[(0,), (1,)], compile=False)
    assert specfx.speculate(target, draft="lookahead", num_speculative_tokens="auto", compile=False).plan.auto
    with pytest.raises(ValueError, match=r"each round verifies a tree of 4 nodes.* num_speculative_tokens=4"):
        specfx.speculate(target, draft="lookahead", num_speculative_tokens=2, compile=False)


def test_a_branch_with_taps_is_refused():
    class Tapping(Lookahead):
        taps = ("final",)

    target = pair("llama", "self")[0]
    with pytest.raises(ValueError, match=r"both reads hidden-state taps and adds a branch"):
        specfx.speculate(target, draft=Tapping(), compile=False)


# --------------------------------------------------------------------------- compiled
@pytest.mark.parametrize("backend", round_backends())
def test_compiled_lookahead_round(backend, one_thread):
    """Compiled rounds: greedy equality on two batch-1 prompts (the second call
    compiles nothing: one graph) and on a left-padded batch of 2 (its own batch bucket: one
    more graph), no host-sync ops in either, guesses accepted."""
    target, _ = _models()
    la = Lookahead(window=4, ngram=3, guesses=2)
    spec = specfx.speculate(target, draft=la, num_speculative_tokens=4, backend=backend, background_compile=False)  # one graph: the tree
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    for prompt_ids in ([1, 4, 2, 1, 4], [3, 3, 5, 1, 2, 1]):
        ids = torch.tensor([prompt_ids])
        assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
        assert spec.stats.accepted > 0
    assert len(spec.graphs) == 1
    ids = torch.tensor([[5, 5, 1, 4, 2, 1, 4], [3, 3, 3, 5, 1, 2, 1]])
    mask = (torch.arange(7) >= torch.tensor([[2], [0]])).long()
    assert torch.equal(spec.generate(ids, attention_mask=mask, **kw), target.generate(ids, attention_mask=mask, **kw))
    assert len(spec.graphs) == 2
    for g in spec.graphs:
        assert offending_nodes(g.graph_module) == []
