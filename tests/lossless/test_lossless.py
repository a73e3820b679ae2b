"""Statistical losslessness: speculative samples follow the target's exact distribution.

On a tiny vocabulary the exact distribution of the first ``N`` generated tokens is enumerated
from the target's own logits processed by transformers' warpers; a batch of thousands of rows
is generated speculatively in one call (every row has its own random stream), and a
chi-square test compares the counts with the exact probabilities. Seeds are fixed, so the
test is deterministic; the threshold (p > 1e-3) is what a correct sampler passes and a
sampler with a biased acceptance rule fails by a wide margin (see the negative controls).

Token trees (specfx.trees.types) are checked the same way: a tree of several branches drafted by a
draft model, and a fixed tree whose proposals repeat tokens among siblings and across parents;
the negative control there is the tree walk with a deliberately biased residual.
"""

import itertools
import tempfile

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specfx
from specfx.drafters.base import Drafter, TreeDrafting
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.engine import tree_round
from specfx.sampling.rng import sample_from
from specfx.testing.mtp import fc_mtp_checkpoint
from specfx.testing.tiny import STATEFUL_TINY, perturbed_copy, tiny_causal_lm
from tests.conftest import tiered

V = 6
NEW = 3
ROWS = 6000


def _models():
    target = tiny_causal_lm("llama", vocab_size=V, eos_token_id=None, initializer_range=0.12, seed=3)
    target.generation_config.eos_token_id = None
    draft = perturbed_copy(target, 0.15, seed=4)  # disagrees often: many rejections
    return target, draft


def _exact(target, prompt, warpers):
    """P(x1..xNEW | prompt) for every sequence, with HF's warpers applied at every step."""
    probs = {}
    for seq in itertools.product(range(V), repeat=NEW):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logits = target(ids).logits[0, len(prompt) - 1 : -1].float()
        p = 1.0
        for i, tok in enumerate(seq):
            scores = warpers(ids[:, : len(prompt) + i], logits[i : i + 1].clone())
            p *= float(scores.softmax(-1)[0, tok])
        probs[seq] = p
    return probs


def _chisquare(samples, probs):
    counts = {s: 0 for s in probs}
    for row in samples:
        counts[tuple(row)] += 1
    n = len(samples)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for s, p in probs.items():
        if p * n >= 5:
            obs.append(counts[s])
            exp.append(p * n)
        else:
            rest_o += counts[s]
            rest_e += p * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    elif rest_o:
        return 0.0  # sequences of probability 0 were sampled
    assert len(obs) >= 10, "degenerate distribution: the test would have no power"
    exp = [e * n / sum(exp) for e in exp]  # rounding
    return stats.chisquare(obs, exp).pvalue


CASES = {
    "plain": (dict(), LogitsProcessorList()),
    "temperature-topk-topp": (
        dict(temperature=1.5, top_k=4, top_p=0.9),
        LogitsProcessorList([TemperatureLogitsWarper(1.5), TopKLogitsWarper(4), TopPLogitsWarper(0.9)]),
    ),
}


@pytest.mark.parametrize(
    ("case", "k"), tiered([(c, k) for c in sorted(CASES) for k in (1, 3)], [("plain", 3)], several=True)
)
def test_speculative_sampling_matches_exact_distribution(case, k):
    target, draft = _models()
    kwargs, warpers = CASES[case]
    prompt = [1, 4, 2]
    probs = _exact(target, prompt, warpers)
    assert abs(sum(probs.values()) - 1) < 1e-4
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=k, compile=False)
    torch.manual_seed(1234)
    ids = torch.tensor([prompt]).repeat(ROWS, 1)
    out = spec.generate(ids, do_sample=True, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    samples = out[:, len(prompt) :].tolist()
    assert 0.05 < spec.stats.acceptance_rate < 0.95  # both paths (accept, correct) are exercised
    assert _chisquare(samples, probs) > 1e-3


def test_negative_control_draft_distribution_is_rejected():
    """The same test rejects samples from the draft's distribution (so it has power)."""
    target, draft = _models()
    prompt = [1, 4, 2]
    probs = _exact(target, prompt, LogitsProcessorList())
    torch.manual_seed(1234)
    out = draft.generate(torch.tensor([prompt]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, top_k=0, pad_token_id=0)
    assert _chisquare(out[:, len(prompt) :].tolist(), probs) < 1e-6


EOS_NEW, EOS = 4, V - 1


def _exact_with_eos(target, prompt, warpers):
    """P(output) of the first ``EOS_NEW`` tokens when ``EOS`` ends a row (padded with 0 after it,
    as HF pads): the probability of the sequence up to and including the EOS."""
    probs = {}

    def walk(seq, p):
        if len(seq) == EOS_NEW or (seq and seq[-1] == EOS):
            key = tuple(seq + [0] * (EOS_NEW - len(seq)))
            probs[key] = probs.get(key, 0.0) + p
            return
        ids = torch.tensor([prompt + seq])
        with torch.no_grad():
            logits = target(ids).logits[:, -1].float()
        scores = warpers(ids, logits.clone()).softmax(-1)[0]
        for tok in range(V):
            walk(seq + [tok], p * float(scores[tok]))

    walk([], 1.0)
    return probs


@pytest.mark.parametrize("drafter", tiered(["draft", "prompt_lookup"], ["prompt_lookup"]))
def test_sampling_with_eos_in_a_ragged_batch_matches_exact_distribution(drafter):
    """Rows that end on EOS mid-round (proposals after it dropped, the row padded) in a
    left-padded batch of two prompts: each row's output, stop included, follows its prompt's exact
    distribution. Prompt lookup (q one-hot, proposals copied from the row's own prompt, which
    repeats an n-gram) and a draft model; temperature 0.7 as in the chat suite's sampling."""
    target, draft = _models()
    target.generation_config.eos_token_id = EOS
    prompts = ([1, 4, 2, 1, 4], [3, 1, 4])
    rows = 3000
    ids = torch.tensor([[1, 4, 2, 1, 4], [0, 0, 3, 1, 4]]).repeat(rows, 1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]).repeat(rows, 1)
    spec = specfx.speculate(target, draft=draft if drafter == "draft" else drafter, num_speculative_tokens=3, compile=False)
    torch.manual_seed(7)
    out = spec.generate(
        ids, attention_mask=mask, do_sample=True, temperature=0.7, max_new_tokens=EOS_NEW, pad_token_id=0, eos_token_id=EOS
    )
    assert 0.02 < spec.stats.acceptance_rate < 0.95
    new = out[:, 5:]
    assert ((new[:, :-1] == EOS).any(1)).float().mean() > 0.1  # many rows stopped before the last token
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    for i, p in enumerate(prompts):
        probs = _exact_with_eos(target, p, warpers)
        assert abs(sum(probs.values()) - 1) < 1e-4
        assert _chisquare(new[i::2].tolist(), probs) > 1e-3, f"prompt {p}"


def test_negative_control_eos_test_rejects_the_draft_distribution():
    """The EOS-aware test has power: the draft's own samples (with the same EOS and padding) fail it."""
    target, draft = _models()
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    prompt = [3, 1, 4]
    torch.manual_seed(7)
    out = draft.generate(
        torch.tensor([prompt]).repeat(3000, 1), do_sample=True, temperature=0.7, top_k=0, max_new_tokens=EOS_NEW,
        pad_token_id=0, eos_token_id=EOS,
    )  # fmt: skip
    assert _chisquare(out[:, len(prompt) :].tolist(), _exact_with_eos(target, prompt, warpers)) < 1e-6


# --------------------------------------------------------------------------- token trees
# 8192 rows fill the batch bucket (no inert rows); a small prompt bucket and buffer make each
# generate() call several times faster than the defaults at this batch size.
TREE_ROWS = 8192
TREE_OPTIONS = dict(compile=False, min_capacity=16, prefill_buckets=(4,))
BRANCHES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _tree_samples(target, draft, tree, **kwargs):
    """Speculative samples of the first NEW tokens after ``[1, 4, 2]`` with ``tree``, and the
    generator's stats."""
    pinned = len(tree) if isinstance(tree, list) else tree.size  # num_speculative_tokens = the node count: every round
    spec = specfx.speculate(target, draft=draft, tree=tree, num_speculative_tokens=pinned, **TREE_OPTIONS)
    torch.manual_seed(1234)
    ids = torch.tensor([[1, 4, 2]]).repeat(TREE_ROWS, 1)
    out = spec.generate(ids, do_sample=True, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    return out[:, 3:].tolist(), spec.stats


def _assert_both_paths_at_several_depths(stats):
    """Proposals were accepted at depths 1 and 2, and some rounds accepted nothing."""
    per_depth = stats.per_depth
    assert per_depth[0] > 0.05 * stats.row_rounds and per_depth[1] > 0.01 * stats.row_rounds, per_depth
    assert per_depth[0] < 0.95 * stats.row_rounds, per_depth


@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_sampling_matches_exact_distribution(case):
    """A tree of three branches (three candidates at the root, two under the first) drafted by
    a draft model that disagrees often."""
    target, draft = _models()
    kwargs, warpers = CASES[case]
    probs = _exact(target, [1, 4, 2], warpers)
    samples, stats = _tree_samples(target, draft, BRANCHES, **kwargs)
    _assert_both_paths_at_several_depths(stats)
    assert _chisquare(samples, probs) > 1e-3


class FixedTree(TreeDrafting, Drafter):
    """Proposes the same tokens for every node in every round: a deterministic drafter (q is
    one-hot), so any choice of tokens must leave the target's distribution unchanged."""

    name = "fixed_tree"

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)  # [N]

    def propose_tree(self, ctx):
        return self.tokens.to(ctx.tokens.device).expand(ctx.tokens.shape[0], -1)  # [B, N]


# nodes (0,) (1,) (2,) (0,0) (0,1) (1,0) (2,0): the root's first two children repeat token 2,
# (0,0) and (0,1) repeat token 1 under one parent, (2,0) proposes 1 too under another parent,
# and (1,0) hangs under a duplicate that can never be accepted
DUPLICATES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0)]
DUPLICATE_TOKENS = [2, 2, 5, 1, 1, 3, 1]


def test_tree_with_duplicate_tokens_matches_exact_distribution():
    target, _ = _models()
    probs = _exact(target, [1, 4, 2], LogitsProcessorList())
    samples, stats = _tree_samples(target, FixedTree(DUPLICATE_TOKENS), DUPLICATES)
    _assert_both_paths_at_several_depths(stats)
    assert _chisquare(samples, probs) > 1e-3


def _assert_walk_fails_chisquare(monkeypatch, walk):
    """With ``walk`` in place of the tree round's acceptance, the three-branch tree's samples
    (accepted at several depths) fail the chi-square by far: the test has power against it."""
    monkeypatch.setattr(tree_round, "tree_accept", walk)
    target, draft = _models()
    probs = _exact(target, [1, 4, 2], LogitsProcessorList())
    samples, stats = _tree_samples(target, draft, BRANCHES)
    _assert_both_paths_at_several_depths(stats)
    assert _chisquare(samples, probs) < 1e-6


def test_negative_control_tree_residual_not_renormalised(monkeypatch):
    """The tree test has power: the same walk, but with the token after the accepted path drawn
    from the target's distribution at the stop node without removing the children rejected
    there (the renormalisation after a rejection skipped), fails the chi-square by far."""

    def biased(scores, tokens, tree, sample, u_accept=None, u_residual=None):
        stop, last, p = real(scores, tokens, tree, sample, u_accept, u_residual)
        at_stop = p.gather(1, stop.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)  # [B, V]
        return stop, sample_from(at_stop, u_residual), p

    real = tree_round.tree_accept
    _assert_walk_fails_chisquare(monkeypatch, biased)


def test_negative_control_tree_siblings_not_renormalised(monkeypatch):
    """The issue's negative control: children accepted with their probability under the
    distribution they were *drafted* from (p at the node, as if each sibling were the only
    proposal) instead of p renormalised after the earlier siblings' rejections. Every later
    sibling is then under-accepted, and the chi-square fails by far."""

    def independent_siblings(scores, tokens, tree, sample, u_accept=None, u_residual=None):
        b, n1, v = scores.shape
        parent = tree.parent.expand(b, -1)[:, 1:]
        p = scores.softmax(dim=-1)
        p_node = p.reshape(b, n1 * v).gather(1, parent * v + tokens[:, 1:])  # [B, N]
        cur = torch.zeros(b, dtype=torch.long)
        for n in range(1, n1):
            cur = torch.where((parent[:, n - 1] == cur) & (u_accept[:, n - 1] < p_node[:, n - 1]), n, cur)
        at_stop = p.gather(1, cur.view(b, 1, 1).expand(b, 1, v)).squeeze(1)
        kids = (parent == cur.unsqueeze(1)).to(p.dtype)
        removed = torch.zeros_like(at_stop).scatter_add(1, tokens[:, 1:], kids) > 0
        return cur, sample_from(at_stop.masked_fill(removed, 0.0), u_residual), p

    _assert_walk_fails_chisquare(monkeypatch, independent_siblings)


@pytest.mark.parametrize("case", tiered(sorted(CASES), []))
def test_pard_sampling_matches_exact_distribution(case):
    """PARD's proposals at mask positions are sampled from q_i, which does not depend on the
    proposals before them (decision 72): the samples still follow the target's distribution."""
    target, draft = _models()
    kwargs, warpers = CASES[case]
    prompt = [1, 4, 2]
    probs = _exact(target, prompt, warpers)
    spec = specfx.speculate(target, draft=specfx.Pard(draft, mask_token_id=V - 1), num_speculative_tokens=2, compile=False)
    torch.manual_seed(1234)
    out = spec.generate(torch.tensor([prompt]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    assert 0.05 < spec.stats.acceptance_rate < 0.95
    assert spec.stats.per_position[1] > 0  # proposals at the mask position were accepted too
    assert _chisquare(out[:, len(prompt) :].tolist(), probs) > 1e-3


@pytest.mark.parametrize("case", tiered(sorted(CASES), ["plain"]))
def test_pard_tree_sampling_matches_exact_distribution(case):
    """PARD's token tree (its per-depth guesses of one mask forward, every node a deterministic
    choice): the three-branch tree's samples follow the target's distribution."""
    target, draft = _models()
    kwargs, warpers = CASES[case]
    probs = _exact(target, [1, 4, 2], warpers)
    samples, stats = _tree_samples(target, specfx.Pard(draft, mask_token_id=V - 1), BRANCHES, **kwargs)
    _assert_both_paths_at_several_depths(stats)
    assert _chisquare(samples, probs) > 1e-3


@pytest.mark.parametrize("case", tiered(sorted(CASES), ["plain"]))
def test_dflash_tree_sampling_matches_exact_distribution(case):
    """DFlash's token tree (its block positions' ranked guesses, decision 103; every node a
    deterministic choice): the three-branch tree's samples follow the target's distribution."""
    target, _ = _models()
    kwargs, warpers = CASES[case]
    probs = _exact(target, [1, 4, 2], warpers)
    drafter = specfx.DFlash.random(target, block_size=4, num_layers=1, layer_ids=[0, 1], mask_token_id=V - 1, seed=2)
    samples, stats = _tree_samples(target, drafter, BRANCHES, **kwargs)
    _assert_both_paths_at_several_depths(stats)
    assert _chisquare(samples, probs) > 1e-3


@pytest.mark.parametrize("case", tiered(sorted(CASES), [], ci=["plain"]))  # the warped case: pytest --full
def test_dflash_sampling_matches_exact_distribution(case):
    """DFlash drafts its block greedily, as its reference does whatever the temperature (q
    one-hot on each proposal; decision 74), from the target's hidden states: the samples still
    follow the target's distribution."""
    target, _ = _models()
    kwargs, warpers = CASES[case]
    prompt = [1, 4, 2]
    probs = _exact(target, prompt, warpers)
    drafter = specfx.DFlash.random(target, block_size=3, num_layers=1, layer_ids=[0, 1], mask_token_id=V - 1, seed=2)
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=2, compile=False)
    torch.manual_seed(1234)
    ids = torch.tensor([prompt]).repeat(ROWS, 1)
    out = spec.generate(ids, do_sample=True, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    assert 0.05 < spec.stats.acceptance_rate < 0.95
    assert spec.stats.per_position[1] > 0  # the second proposal of a block was accepted too
    assert _chisquare(out[:, len(prompt) :].tolist(), probs) > 1e-3


# --------------------------------------------------------------------------- recurrent state
STATE_OPTIONS = dict(num_speculative_tokens=3, compile=False, min_capacity=16, prefill_buckets=(4,))


def _stateful_samples(arch, kwargs, keep_every_input=False, stateful_draft=False, head=False, mtp=False):
    """Speculative samples of the first NEW tokens after ``[1, 4, 2]`` from a tiny ``arch`` target
    with recurrent state (decision 76), drafted by a random attention-only model (rounds accept 0..3
    proposals, so the state is rolled back to each row's own n every round), and the generator's
    stats. ``keep_every_input``: the rollback replaced by one that keeps all K+1 verified inputs in
    the state (what a round without rollback does), after ``speculate()``'s probe has admitted it.
    ``stateful_draft``: drafted by a perturbed copy of the target instead, whose own state is rolled
    back every round too (decision 81). ``head``: drafted by a random EAGLE-3 head instead, reading
    the target's hidden states (decision 82). ``mtp``: the same target saved with random MTP layers of
    its table row's layout and loaded back, drafted by them (``draft="mtp"``, decision 86)."""
    config = dict(eos_token_id=None, initializer_range=0.12, **_STATEFUL[arch])
    with tempfile.TemporaryDirectory() as directory:  # draft="mtp" reads the layers from the checkpoint
        if mtp:
            target, _ = fc_mtp_checkpoint(arch, 1, directory, vocab=V, seed=3, **config)
        else:
            target = tiny_causal_lm(arch, vocab_size=V, seed=3, **config)
        target.generation_config.eos_token_id = None
        draft = _stateful_draft(target, stateful_draft, head, mtp)
        spec = specfx.speculate(target, draft=draft, **STATE_OPTIONS)
    if keep_every_input:
        real = spec.target_runner.roll_back_state
        spec.target_runner.roll_back_state = lambda n, tokens: real(torch.full_like(n, tokens), tokens)
    torch.manual_seed(1234)
    out = spec.generate(torch.tensor([[1, 4, 2]]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, pad_token_id=0, **kwargs)
    return target, out[:, 3:].tolist(), spec.stats


def _stateful_draft(target, stateful_draft, head, mtp):
    if mtp:
        return "mtp"
    if head:
        return Eagle3.random(target, layer_ids=[0, 1, 1], seed=5)
    if stateful_draft:
        return perturbed_copy(target, 0.15, seed=4)
    return tiny_causal_lm("llama", vocab_size=V, eos_token_id=None, initializer_range=0.12, seed=4)


# one GDN hybrid (a gated-delta-net layer beside an attention layer), Mamba2 (state only; its torch scan
# pads every forward to a whole chunk: 8, not 256, keeps 6000 rows fast) and Mamba1 (state only, verified by
# its single-token steps: decision 90)
_STATEFUL = {
    "qwen3_next": STATEFUL_TINY["qwen3_next"],
    "mamba2": dict(STATEFUL_TINY["mamba2"], chunk_size=8),
    "mamba": STATEFUL_TINY["mamba"],
}


# --full runs every case; CI's newest run each type plain and Mamba1's warped case (the warpers act on the
# logits, not on the state the round rolls back: the other two types' warped cases are pytest --full's)
@pytest.mark.parametrize(
    ("arch", "case"),
    tiered(
        [(a, c) for a in sorted(_STATEFUL) for c in sorted(CASES)],
        [],
        several=True,
        ci=[(a, "plain") for a in _STATEFUL] + [("mamba", "temperature-topk-topp")],
    ),
)
def test_stateful_target_sampling_matches_exact_distribution(arch, case):
    """Rejection sampling against a target whose recurrent state is rolled back every round: the
    samples follow the target's exact distribution (its full forward over each sequence)."""
    kwargs, warpers = CASES[case]
    target, samples, stats = _stateful_samples(arch, kwargs)
    probs = _exact(target, [1, 4, 2], warpers)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert stats.per_position[2] > 0  # some rounds accepted all three: every n occurs
    assert _chisquare(samples, probs) > 1e-3


@pytest.mark.full
@pytest.mark.exhaustive  # the drafter variants of the stateful proof: pytest --full
def test_stateful_draft_sampling_matches_exact_distribution():
    """A draft model with recurrent state of its own (decision 81) before a stateful target: both
    states rolled back to each row's own n every round, and the samples still follow the target's
    exact distribution (q is what the draft sampled from its rolled-back state)."""
    target, samples, stats = _stateful_samples("qwen3_next", {}, stateful_draft=True)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert stats.per_position[2] > 0  # some rounds accepted all three: every n occurs
    assert _chisquare(samples, _exact(target, [1, 4, 2], LogitsProcessorList())) > 1e-3


@pytest.mark.full
def test_negative_control_state_not_rolled_back():
    """The stateful test has power: with the state keeping every verified input (the rejected
    proposals too), the same samples fail the chi-square by far."""
    target, samples, stats = _stateful_samples("qwen3_next", {}, keep_every_input=True)
    assert stats.acceptance_rate < 0.95  # rejected proposals went into the state
    assert _chisquare(samples, _exact(target, [1, 4, 2], LogitsProcessorList())) < 1e-6


@pytest.mark.full
@pytest.mark.exhaustive
@pytest.mark.parametrize("arch", ["qwen3_next"])
def test_stateful_target_sampling_with_an_eagle3_head_matches_exact_distribution(arch):
    """The same with an EAGLE-3 head (decision 82): its verify forward is the tapped capture that
    returns the mixers' inputs for the rollback."""
    target, samples, stats = _stateful_samples(arch, {}, head=True)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert _chisquare(samples, _exact(target, [1, 4, 2], LogitsProcessorList())) > 1e-3


@pytest.mark.full
@pytest.mark.exhaustive
def test_stateful_target_sampling_with_mtp_layers_matches_exact_distribution():
    """The same drafted by the target's MTP layers (decision 86: specfx's ``FcMtpLayers``, read from the
    checkpoint), which chain on the target's last hidden state from the tapped verify forward that
    returns the mixers' inputs for the rollback."""
    target, samples, stats = _stateful_samples("qwen3_next", {}, mtp=True)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert stats.per_position[2] > 0  # some rounds accepted all three: every n occurs
    assert _chisquare(samples, _exact(target, [1, 4, 2], LogitsProcessorList())) > 1e-3
