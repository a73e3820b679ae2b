"""PARD: K proposals from one draft forward over the window of committed tokens, the pending
token and K - 1 mask tokens (a token tree: the per-depth top guesses of the same forward).
Greedy output equals the target's own; every round's draft logits equal a from-scratch forward
of the committed tokens plus the masks (so no mask KV ever leaks into a committed slot); bad
configurations are refused."""

from __future__ import annotations

import pytest
import torch

import specfx
from specfx.drafters.pard import Pard, from_name
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import left_padded, pair, prompt

MASK = 7  # the tiny models' "mask token" (any id in the vocabulary; PARD checkpoints name theirs)
NO_EOS = dict(do_sample=False, eos_token_id=None)  # some tiny models emit EOS at once: rounds must run
NEW = 24

CASES = {
    "batch1": lambda: (prompt(9, seed=3), None),
    "left_padded": lambda: left_padded(9, [3, 0, 6], seed=2),  # row 2 has a 3-token prompt: L - W < 0
}


def _check_greedy(spec, target, ids, mask, new=NEW):
    kw = dict(max_new_tokens=new, attention_mask=mask, **NO_EOS)
    expected, got = target.generate(ids, **kw), spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"first differing row: {(got != expected).any(1).nonzero().flatten().tolist()}"


class _Recording(Pard):
    """Records every round's draft logits with the state they were drafted from; ``back``
    overrides the window (a leaky drafter, for the negative control)."""

    def __init__(self, model, back: int | None = None, **kw):
        super().__init__(model, **kw)
        self.back = back
        self.rounds = []

    def window(self, ctx):
        return super().window(ctx) if self.back is None else self.back

    def draft_logits(self, ctx):
        logits = super().draft_logits(ctx)
        self.rounds.append((ctx.lengths.clone(), ctx.tokens.clone(), logits.clone()))
        return logits


def _worst_difference(drafter: _Recording, prompt_lengths, new: int) -> tuple[float, int]:
    """The largest difference between a round's draft logits ``[K, V]`` at positions L .. L+K-1 and
    a cache-free forward of the row's committed tokens (positions 0..L) plus K - 1 masks, over
    every row still generating; and how many (round, row) pairs were compared."""
    worst, compared = 0.0, 0
    with torch.no_grad():
        for lengths, tokens, logits in drafter.rounds:
            k = logits.shape[1]
            for b, prompt_length in enumerate(prompt_lengths):
                pending = int(lengths[b])
                if pending + 1 - prompt_length >= new:
                    continue  # finished: carried along
                ids = tokens[b, : pending + 1].tolist() + [drafter.mask_token_id] * (k - 1)
                reference = drafter.model(torch.tensor([ids])).logits[0, pending:]  # [K, V]
                worst = max(worst, (reference - logits[b]).abs().max().item())
                compared += 1
    return worst, compared


# --------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("draft", ["small", "self"])
def test_greedy_equals_hf(draft, case, k, one_thread):
    """An independent 1-layer draft (rejects nearly everything) and the target itself as the
    draft (proposal 0 is always accepted; mask positions mostly rejected)."""
    target, model = pair("llama", draft)
    spec = specfx.speculate(target, draft=Pard(model, mask_token_id=MASK), num_speculative_tokens=k, compile=False)
    _check_greedy(spec, target, *CASES[case]())
    assert spec.stats.proposed > 0


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "mistral"])
def test_greedy_equals_hf_on_the_conformance_subset(arch, case, one_thread):
    """Issue 28 item 5's architectures (llama above), batch 1 and left-padded, a draft that
    accepts some proposals (a perturbed copy of the target)."""
    target, model = pair(arch, "perturbed")
    spec = specfx.speculate(target, draft=Pard(model, mask_token_id=MASK), num_speculative_tokens=3, compile=False)
    _check_greedy(spec, target, *CASES[case]())
    assert spec.stats.proposed > 0


def test_everything_accepted_at_k1_with_the_target_as_draft(one_thread):
    target, _ = pair("llama", "self")
    spec = specfx.speculate(target, draft=Pard(target, mask_token_id=MASK), num_speculative_tokens=1, compile=False)
    ids, mask = CASES["left_padded"]()
    _check_greedy(spec, target, ids, mask)
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.proposed > 0


def test_greedy_equals_hf_with_auto_k(one_thread):
    """With "auto", rounds of K = 1, 2, 4, 8 follow each other: the window is the largest K, so the
    draft cache stays exact across them."""
    target, _ = pair("llama", "self")
    drafter = _Recording(target, mask_token_id=MASK)
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens="auto", compile=False)
    ids, mask = CASES["left_padded"]()
    _check_greedy(spec, target, ids, mask)
    worst, _ = _worst_difference(drafter, mask.sum(dim=1).tolist(), NEW)
    assert worst < 1e-4


# --------------------------------------------------------------------------- the cache invariant
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("k", [2, 4])
def test_draft_logits_equal_a_fresh_forward_every_round(arch, k, one_thread):
    """Every round's K draft logits equal those of a cache-free forward over the committed tokens
    and the masks: the draft's cache held no mask KV at a committed position (slots that held
    masks in one round and accepted tokens in the next were rewritten), short prompts included."""
    target = pair(arch, "self")[0]
    drafter = _Recording(target, mask_token_id=MASK)
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=k, compile=False)
    ids, mask = CASES["left_padded"]()
    _check_greedy(spec, target, ids, mask)
    worst, compared = _worst_difference(drafter, mask.sum(dim=1).tolist(), NEW)
    assert compared >= 15
    assert worst < 1e-4
    assert spec.stats.accepted > 0  # rounds did commit slots that held mask KV


@pytest.mark.parametrize("back", [0, 1])
def test_a_window_too_short_leaks_mask_kv_and_the_check_sees_it(back, one_thread):
    """Negative control for the check above: a drafter that rewrites only the pending token (0)
    or one committed token before it (1, a draft model's catch-up) reads mask KV at accepted
    positions; greedy output is still right (only acceptance suffers), but the logits differ."""
    target = pair("llama", "self")[0]
    drafter = _Recording(target, back=back, mask_token_id=MASK)
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=4, compile=False)
    ids, mask = CASES["left_padded"]()
    _check_greedy(spec, target, ids, mask)
    worst, _ = _worst_difference(drafter, mask.sum(dim=1).tolist(), NEW)
    assert worst > 1e-2


# --------------------------------------------------------------------------- token trees
# a sparse tree of depth 4 (three guesses at depth 1, two under the first) and a full top-2 tree
TREES = {
    "sparse": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    "topk": specfx.TokenTree.topk(3, 2),
}


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_greedy_equals_hf(case, tree, one_thread):
    """A perturbed copy of the target drafts the tree (its guesses are right at some depths and
    ranks, wrong at others); its cache stays exact between rounds: every round's logits at the
    pending token and the D - 1 masks equal a cache-free forward. With "auto" (tree= alone) too."""
    target, model = pair("llama", "perturbed")
    drafter = _Recording(model, mask_token_id=MASK)
    shape = specfx.TokenTree(TREES[tree])  # every round the tree (no "auto": its timing rounds run on scratch state)
    spec = specfx.speculate(target, draft=drafter, tree=shape, num_speculative_tokens=shape.size, compile=False)
    ids, mask = CASES[case]()
    _check_greedy(spec, target, ids, mask)
    depth = shape.depth
    assert all(logits.shape[1] == depth for _, _, logits in drafter.rounds)
    lengths = (mask.sum(dim=1) if mask is not None else torch.full((ids.shape[0],), ids.shape[1])).tolist()
    worst, compared = _worst_difference(drafter, lengths, NEW)
    assert compared >= 8 and worst < 1e-4
    assert spec.stats.accepted > 0
    _check_greedy(
        specfx.speculate(target, draft=Pard(model, mask_token_id=MASK), tree=shape, compile=False), target, ids, mask
    )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "mistral"])
def test_tree_greedy_equals_hf_on_the_conformance_subset(arch, one_thread):
    target, model = pair(arch, "perturbed")
    tree = TREES["sparse"]  # every round (no "auto", which may turn the tree off)
    spec = specfx.speculate(
        target, draft=Pard(model, mask_token_id=MASK), tree=tree, num_speculative_tokens=len(tree), compile=False
    )
    _check_greedy(spec, target, *CASES["left_padded"]())
    assert spec.stats.proposed > 0


def test_tree_accepts_second_guesses(one_thread):
    """A tree's extra children are the draft's second and third guesses at each depth: with the
    same draft the sparse tree accepts more depth-1 proposals than the chain of the same depth
    (rank-1 and rank-2 children hit when rank 0 misses)."""
    target, model = pair("llama", "perturbed")
    ids, mask = CASES["left_padded"]()
    depth1 = {}
    tree = dict(tree=TREES["sparse"], num_speculative_tokens=len(TREES["sparse"]))
    for key, shape in (("chain", dict(num_speculative_tokens=4)), ("tree", tree)):
        spec = specfx.speculate(target, draft=Pard(model, mask_token_id=MASK), compile=False, **shape)
        _check_greedy(spec, target, ids, mask)
        depth1[key] = spec.cumulative_stats.per_depth[0] / spec.cumulative_stats.row_rounds
    assert depth1["tree"] > depth1["chain"], depth1


def test_dynamic_trees_are_refused():
    target, model = pair("llama", "small")
    with pytest.raises(ValueError, match=r"cannot grow a dynamic tree"):
        specfx.speculate(target, draft=Pard(model, mask_token_id=MASK), tree=specfx.TokenTree.eagle2(), compile=False)


# --------------------------------------------------------------------------- configuration
def test_mask_token_read_from_the_config():
    model = tiny_causal_lm("llama", num_layers=1, seed=7)
    model.config.pard_token = 5
    assert Pard(model).mask_token_id == 5
    assert Pard(model, mask_token_id=9).mask_token_id == 9  # given explicitly: wins


def test_missing_mask_token_is_refused():
    model = tiny_causal_lm("llama", num_layers=1, seed=7)
    with pytest.raises(ValueError, match=r"no 'pard_token' field.*mask_token_id=ID"):
        Pard(model)


@pytest.mark.parametrize("bad", [-1, 128, 1.5])
def test_mask_token_outside_the_vocabulary_is_refused(bad):
    model = tiny_causal_lm("llama", num_layers=1, seed=7)
    with pytest.raises(ValueError, match=r"mask_token_id"):
        Pard(model, mask_token_id=bad)


def test_vocabulary_mismatch_is_refused():
    target = pair("llama", "self")[0]
    other = tiny_causal_lm("llama", num_layers=1, seed=7, vocab_size=96)
    with pytest.raises(ValueError, match=r"vocabularies differ"):
        specfx.speculate(target, draft=Pard(other, mask_token_id=MASK), num_speculative_tokens=3, compile=False)


def test_named_without_a_directory_is_refused():
    with pytest.raises(ValueError, match=r"pard:/path/to/pard-model"):
        from_name(None)


def test_named_loads_a_checkpoint_directory(tmp_path, one_thread):
    target, model = pair("llama", "small")
    model.config.pard_token = MASK
    try:
        model.save_pretrained(tmp_path)
    finally:
        del model.config.pard_token
    spec = specfx.speculate(target, draft=f"pard:{tmp_path}", num_speculative_tokens=3, compile=False)
    assert spec.method == "pard" and spec.drafter.mask_token_id == MASK
    _check_greedy(spec, target, *CASES["batch1"]())


# --------------------------------------------------------------------------- sampling
def test_sampling_is_reproducible_with_a_seed(one_thread):
    target, model = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=Pard(model, mask_token_id=MASK), num_speculative_tokens=3, compile=False)
    ids, mask = CASES["left_padded"]()
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(spec.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW, eos_token_id=None))
    assert torch.equal(outs[0], outs[1])
    new = outs[0][:, ids.shape[1] :]
    assert new.shape == (3, NEW) and int(new.min()) >= 0 and int(new.max()) < target.config.vocab_size
    assert spec.stats.proposed > 0


# --------------------------------------------------------------------------- compiled
@pytest.mark.compiled
def test_compiled_greedy_equals_hf_in_one_graph(one_thread):
    """Traced as one round graph (specfx_eager keeps it short): greedy equality on two prompt
    shapes, and the second call compiles nothing new."""
    target, _ = pair("llama", "self")
    drafter = Pard(target, mask_token_id=MASK)
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=3, backend="specfx_eager")
    _check_greedy(spec, target, *CASES["left_padded"]())
    n = len(spec.graphs)
    _check_greedy(spec, target, *left_padded(12, [2, 0, 5], seed=4), new=16)
    assert len(spec.graphs) == n == 1, f"{len(spec.graphs)} graphs"
    assert spec.stats.accepted > 0


@pytest.mark.compiled
def test_compiled_tree_greedy_equals_hf_in_one_graph(one_thread):
    target, model = pair("llama", "perturbed")
    tree = TREES["sparse"]
    spec = specfx.speculate(
        target,
        draft=Pard(model, mask_token_id=MASK),
        tree=tree,
        num_speculative_tokens=len(tree),
        backend="specfx_eager",
    )
    _check_greedy(spec, target, *CASES["left_padded"]())
    _check_greedy(spec, target, *left_padded(12, [2, 0, 5], seed=4), new=16)
    assert len(spec.graphs) == 1, f"{len(spec.graphs)} graphs"
    assert spec.stats.accepted > 0


@pytest.mark.compiled
def test_compiled_sampling_equals_eager(one_thread):
    """The sampling round traced as one graph draws the same tokens as the eager round from the
    same seed (the random stream is counter-based; specfx_eager runs the same ops)."""
    target, model = pair("llama", "perturbed")
    ids, mask = CASES["left_padded"]()
    outs = []
    for compiled in (False, True):
        shape = dict(backend="specfx_eager") if compiled else dict(compile=False)
        spec = specfx.speculate(target, draft=Pard(model, mask_token_id=MASK), num_speculative_tokens=3, **shape)
        torch.manual_seed(5)
        outs.append(spec.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW, eos_token_id=None))
        assert spec.stats.accepted > 0
    assert len(spec.graphs) == 1
    assert torch.equal(outs[0], outs[1])
