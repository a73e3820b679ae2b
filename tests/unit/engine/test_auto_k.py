"""``num_speculative_tokens="auto"``: the K policy, greedy equality while K changes, seeded
reproducibility and losslessness, one graph per K and no recompiles, bad configuration."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

import specfx
from specfx.engine import auto_k
from specfx.engine.auto_k import (
    HOLD,
    MAX_HOLD,
    MIN_EVIDENCE,
    TREE,
    AutoK,
    RoundTimer,
    TreeAuto,
    expected_emitted,
    interpolate,
)
from tests.conftest import left_padded, pair, prompt
from tests.lossless.test_lossless import _chisquare, _exact, _models
from tests.unit.drafters.test_prompt_lookup import _copying, _repeating_prompt


# --------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_expected_emitted_is_the_truncated_geometric_mean(alpha, k):
    # P(emitted >= i + 1) = alpha^i for i = 0..K
    assert expected_emitted(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def _run(policy: AutoK, accepted_of, windows: int, rows: int) -> list:
    """Simulate windows of one round each in which every row accepts ``accepted_of(K)`` of the
    round's proposals (K None: the tree). Returns the round of each window. The counters are
    cumulative over the policy's call, as the device's are."""
    positions = policy.depth if isinstance(policy, TreeAuto) else max(policy.k_values)
    counters = policy.__dict__.setdefault("_test_counters", [0, 0, [0] * positions])
    acc, rr, per_position = counters
    ran = []
    for _ in range(windows):
        ran.append(policy.k)
        rr += rows
        accepted = accepted_of(policy.k)
        acc += rows * accepted
        for i in range(accepted):
            per_position[i] += rows
        policy.update(acc, rr, per_position)
    counters[:2] = acc, rr
    return ran


def _feed(policy: AutoK, accept_all: bool, windows: int, rows: int = 1) -> list[int]:
    """Windows in which every row accepts all K, or none."""
    return _run(policy, lambda k: k if accept_all else 0, windows, rows)


def test_policy_moves_to_the_largest_k_when_everything_is_accepted():
    policy = AutoK((1, 2, 4, 8), cost=0.05)
    first = policy.k
    _feed(policy, accept_all=True, windows=10)
    assert policy.alpha > 0.95
    assert policy.k == 8 and first < 8


def test_policy_turns_speculation_off_when_nothing_is_accepted():
    """K = 0 only after MIN_EVIDENCE row-rounds of measured acceptance (never on the prior or
    one unlucky round), then for the rest of the call."""
    policy = AutoK((1, 2, 4, 8), cost=0.05)
    ks = _feed(policy, accept_all=False, windows=MIN_EVIDENCE + 3)
    assert min(ks[:MIN_EVIDENCE]) >= 1 and ks[MIN_EVIDENCE:] == [0, 0, 0]  # not before the evidence
    assert policy.k == 0 and policy.off and policy.alpha < 0.1
    policy.update(10**6, 10**6, [10**6] * 8)  # whatever the counters say now: off for the call
    assert policy.k == 0
    policy.reset()
    assert policy.k > 0 and not policy.off  # the next call starts from the prior


def test_policy_turns_speculation_off_at_once_when_no_k_can_pay():
    # (K + 1) / t(K) <= 1 / t(0) for every K: even alpha = 1 loses to plain decoding
    assert AutoK((1, 2, 4, 8), cost=1.0).k == 0
    assert AutoK((1, 2, 4, 8), times={0: 1.0, 8: 20.0}).k == 0
    assert AutoK((1, 2, 4, 8), times={0: 1.0, 8: 2.0}).k > 0


def test_policy_stops_exploring_early_when_rounds_cost_several_plain_ones():
    """A hybrid target's round (verify forward + state rollback; benchmarks/hybrid_rounds.py) costs
    several plain rounds: only α above ~0.86 pays, so two rejected rounds leave under STOP_RISK
    chance that any K pays and K = 0 comes before MIN_EVIDENCE (decision 83). Rounds that accept
    still speculate; cheap rounds still wait for MIN_EVIDENCE."""
    hybrid = {0: 1.0, 1: 2.4, 2: 2.8, 4: 3.8, 8: 6.5}
    policy = AutoK((1, 2, 4, 8), times=hybrid)
    assert policy.break_even() == pytest.approx(0.862, abs=1e-3)
    ks = _feed(policy, accept_all=False, windows=MIN_EVIDENCE)
    assert ks.index(0) == 2 < MIN_EVIDENCE and set(ks[2:]) == {0} and policy.off
    assert min(_feed(AutoK((1, 2, 4, 8), times=hybrid), accept_all=True, windows=MIN_EVIDENCE)) >= 1
    cheap = _feed(AutoK((1, 2, 4, 8), times={0: 1.0, 8: 1.4}), accept_all=False, windows=MIN_EVIDENCE + 1)
    assert cheap.index(0) == MIN_EVIDENCE
    assert AutoK((1, 2, 4, 8), times={0: 1.0, 8: 20.0}).break_even() is None  # no K pays: off at once


def test_round_times_are_interpolated_between_measured_ks():
    times = {0: 1.0, 4: 2.0, 8: 6.0}
    assert [interpolate(times, k) for k in (0, 2, 4, 6, 8, 10)] == [1.0, 1.5, 2.0, 4.0, 6.0, 6.0]
    policy = AutoK((1, 2, 4, 8), times={0: 1.0, 8: 3.0})
    assert policy.round_time(4) == 2.0 and policy.round_time(0) == 1.0


def test_round_timer_times_each_k_right_after_a_round_of_the_same_k(monkeypatch):
    # decision 88: in a call a window runs one K round after round, so a timed round follows one
    # of its own K, never another K's (whose tensors left the caches cold: 2x on a tiny hybrid)
    calls, timed = [], []

    def fake_call_times(fn, repeats, *, warmup=0, sync=None):
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(repeats):
            fn()
            timed.append(len(calls) - 1)  # the index of the call just timed
            out.append(1.0 + len(calls))  # later calls "slower": the minimum is each K's first timed call
        return out

    monkeypatch.setattr(auto_k, "call_times", fake_call_times)
    timer = RoundTimer()
    rounds = {k: (lambda k=k: calls.append(k)) for k in (0, 1, 4)}
    times = timer.times(("shape",), rounds)
    assert len(timed) == (timer.warmup + timer.repeats) * len(rounds)
    for i in timed:
        assert i > 0 and calls[i - 1] == calls[i]  # an untimed round of the same K just before
    first_timed = {}
    for i in timed[timer.warmup * len(rounds) :]:
        first_timed.setdefault(calls[i], 1.0 + i + 1)
    assert times == first_timed  # each K's fastest timed call; warm-up turns not counted
    assert timer.times(("shape",), {}) is times  # remembered per shape


def test_policy_maximises_the_modelled_speedup():
    for cost in (0.0, 0.05, 0.3, 0.9):
        policy = AutoK((1, 2, 3, 4, 6, 8), cost=cost)
        best = max(policy.k_values, key=lambda k: expected_emitted(policy.alpha, k) / (1 + cost * k))
        assert policy.k == best
    policy = AutoK((1, 2, 4, 8), times={0: 1.0, 8: 2.6})
    _feed(policy, accept_all=True, windows=MIN_EVIDENCE)
    assert policy.evidence == MIN_EVIDENCE
    best = max((0, 1, 2, 4, 8), key=lambda k: (expected_emitted(policy.alpha, k) if k else 1) / policy.round_time(k))
    assert policy.k == best == 8


def test_policy_probes_again_when_the_drafter_is_resumable():
    """A drafter without state (prompt lookup) is probed after HOLD windows of K = 0: one
    window at the smallest K. A probe that accepts nothing turns speculation off again for twice
    as long (up to MAX_HOLD); one that accepts everything turns it back on."""
    policy = AutoK((1, 2, 4, 8), cost=0.4, resumable=True)  # a probe finding nothing: α̂ = 1/3, K = 0 pays
    ks = _feed(policy, accept_all=False, windows=MIN_EVIDENCE + HOLD + 1)
    off = ks.index(0)
    assert off == MIN_EVIDENCE and ks[off:] == [0] * HOLD + [1]  # then one probe at K = 1, failing
    hold = HOLD
    for probe in range(6):  # failed probes: 2x the wait each time, capped
        hold = min(2 * hold, MAX_HOLD)
        assert policy.hold == hold
        assert _feed(policy, accept_all=False, windows=hold) == [0] * hold and policy.k == 1
        if probe < 5:
            assert _feed(policy, accept_all=False, windows=1) == [1]
    assert policy.hold == MAX_HOLD
    ks = _feed(policy, accept_all=True, windows=3)  # the probe accepts: speculation is back
    assert ks[0] == 1 and min(ks[1:]) >= 1 and ks[2] > 1 and not policy.off


def test_policy_never_probes_when_the_drafter_keeps_state_or_no_k_can_pay():
    stateful = AutoK((1, 2, 4, 8), cost=0.05)
    assert _feed(stateful, accept_all=False, windows=MIN_EVIDENCE + 4 * MAX_HOLD)[MIN_EVIDENCE:] == [0] * 4 * MAX_HOLD
    unpaid = AutoK((1, 2, 4, 8), cost=1.0, resumable=True)
    assert _feed(unpaid, accept_all=True, windows=4 * MAX_HOLD) == [0] * 4 * MAX_HOLD


def test_policy_restarts_from_the_prior_each_call():
    policy = AutoK((1, 2, 4, 8), cost=0.05)
    start = policy.k
    _feed(policy, accept_all=True, windows=10)
    policy.reset()
    assert policy.k == start and policy.history == []


# --------------------------------------------------------------------------- the policy for a tree
def _feed_tree(policy: TreeAuto, accepted: int, windows: int, rows: int = 1) -> list:
    """Windows in which every row's accepted path is ``accepted`` deep when the tree runs (K = 0
    rounds accept nothing). Returns the round of each window (None: the tree)."""
    return _run(policy, lambda k: accepted if k is TREE else 0, windows, rows)


def test_tree_policy_keeps_the_tree_while_it_pays():
    """τ̂ (emitted per row-round) 3 at depth 2 against t(tree) / t(0) = 1.8: the tree every window."""
    policy = TreeAuto(depth=2, width=11, times={0: 1.0, TREE: 1.8})
    assert policy.candidates == (0, TREE) and policy.k is TREE and policy.alpha is None
    assert policy.tau == pytest.approx(expected_emitted(0.5, 2))  # the prior of a chain as deep
    assert _feed_tree(policy, accepted=2, windows=30) == [TREE] * 30
    assert policy.tau > 2.9 and not policy.off


def test_tree_policy_falls_back_to_plain_decoding_when_the_tree_cannot_pay():
    """Nothing accepted: K = 0 after MIN_EVIDENCE row-rounds (never before), then for the rest of
    the call when the drafter keeps state; at once, and never probed, when even full acceptance
    (depth + 1 tokens) could not pay."""
    policy = TreeAuto(depth=2, width=11, times={0: 1.0, TREE: 1.8})
    ran = _feed_tree(policy, accepted=0, windows=MIN_EVIDENCE + 3 * MAX_HOLD)
    assert ran[:MIN_EVIDENCE] == [TREE] * MIN_EVIDENCE and set(ran[MIN_EVIDENCE:]) == {0}
    assert policy.off and policy.tau < 1.1
    for times in ({0: 1.0, TREE: 3.0}, {0: 1.0, 8: 3.0}):  # 3 / 3.0 <= 1 / 1.0 (given, or priced as a chain of 8)
        unpaid = TreeAuto(depth=2, width=8, times=times, resumable=True)
        assert unpaid.unpaid and _feed_tree(unpaid, accepted=2, windows=2 * MAX_HOLD) == [0] * 2 * MAX_HOLD
    policy.reset()
    assert policy.k is TREE and policy.history == []  # the next call starts from the prior


def test_a_read_with_no_round_since_the_last_is_not_a_window():
    """The host reads the counters once after prefill, before any round: that read must not
    count as a K = 0 window (nor as evidence)."""
    policy = TreeAuto(depth=2, width=11, times={0: 1.0, TREE: 1.8}, resumable=True)
    for _ in range(3):
        assert policy.update(0, 0, [0, 0]) == 0
    assert policy.held == 0 and policy.evidence == 0


def test_tree_policy_probes_a_resumable_drafter():
    """Lookahead (resumable): the tree competes with K = 0 from the first window. The prior
    (τ = 1.75 at depth 2) against t(tree) / t(0) = 1.8 says plain decoding: the call starts at
    K = 0 and probes the tree after HOLD windows; nothing accepted doubles the wait (up to
    MAX_HOLD), a probe that accepts the full depth brings the tree back."""
    policy = TreeAuto(depth=2, width=11, times={0: 1.0, TREE: 1.8}, resumable=True)
    assert policy.k == 0 and policy.off and not policy.unpaid
    assert _feed_tree(policy, accepted=0, windows=HOLD + 1) == [0] * HOLD + [TREE]
    hold = HOLD
    for _ in range(4):
        hold = min(2 * hold, MAX_HOLD)
        assert policy.hold == hold and _feed_tree(policy, accepted=0, windows=hold) == [0] * hold
        assert policy.k is TREE and _feed_tree(policy, accepted=0, windows=1) == [TREE]
    assert policy.hold == MAX_HOLD
    _feed_tree(policy, accepted=0, windows=MAX_HOLD)
    assert _feed_tree(policy, accepted=2, windows=5) == [TREE] * 5 and not policy.off


def test_tree_policy_starts_on_the_tree_where_the_prior_says_it_pays():
    """t(tree) / t(0) = 1.5 < 1.75: a resumable drafter starts on the tree, which then runs
    MIN_EVIDENCE row-rounds before the counts may turn it off (then probed); one whose tree
    keeps accepting stays on it."""
    policy = TreeAuto(depth=2, width=11, times={0: 1.0, TREE: 1.5}, resumable=True)
    ran = _feed_tree(policy, accepted=0, windows=MIN_EVIDENCE + HOLD + 1)
    assert ran == [TREE] * MIN_EVIDENCE + [0] * HOLD + [TREE]
    paying = TreeAuto(depth=2, width=11, times={0: 1.0, TREE: 1.5}, resumable=True)
    assert _feed_tree(paying, accepted=1, windows=20) == [TREE] * 20  # τ = 2 > 1.5


def test_tree_round_time_given_measured_or_priced_as_a_chain():
    assert TreeAuto(2, 11, times={0: 1.0, TREE: 1.7}).round_time(TREE) == 1.7
    at_11 = 2.0 + 3.0 * 7 / 12  # the chain of the tree's 11 scratch slots, between K = 4 and 16
    assert TreeAuto(2, 11, times={0: 1.0, 4: 2.0, 16: 5.0}).round_time(TREE) == pytest.approx(at_11)
    assert TreeAuto(2, 11, cost=0.1).round_time(TREE) == pytest.approx(2.1)
    assert AutoK((1, 2), times={0: 1.0, TREE: 9.0, 2: 2.0}).round_time(1) == 1.5  # a tree's time is no chain's point


# --------------------------------------------------------------------------- generation
def test_greedy_equals_generate_while_k_changes(one_thread):
    target = _copying("llama")  # copies (α -> 1) after entering its cycle; random before
    # given times (a cheap drafter), so which Ks run does not depend on this machine's load
    spec = specfx.speculate(target, num_speculative_tokens="auto", auto_k_times={0: 1.0, 8: 1.4}, compile=False)
    seen = set()
    for seed, new in [(0, 40), (1, 25), (2, 60)]:
        ids = _repeating_prompt(seed, length=10, span=10)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
        seen |= set(spec.auto_k.history)
        assert spec.stats.row_rounds == spec.stats.rounds  # batch 1
        assert spec.stats.tokens_per_round == spec.stats.emitted / spec.stats.rounds
    assert len(seen) > 1, "the policy never changed K: the test would not exercise switching"


def test_prompt_lookup_gets_speculation_back_after_turning_it_off(one_thread):
    """The copying model's output is random before it enters its cycle (prompt lookup accepts
    little: speculation goes off), then copies: the probe finds that and speculation resumes.
    Output equals generate() throughout."""
    target = _copying("llama")
    spec = specfx.speculate(target, draft="prompt_lookup", auto_k_times={0: 1.0, 8: 2.0}, compile=False)
    ids = prompt(6, seed=0)
    kw = dict(max_new_tokens=80, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    history = spec.auto_k.history
    off = history.index(0)
    assert history[off : off + HOLD] == [0] * HOLD and history[off + HOLD] == 1  # held, then probed
    assert max(history[off + HOLD :]) == 8  # ... and the copy is drafted at the largest K


def test_auto_with_a_draft_model_and_a_left_padded_batch(one_thread):
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens="auto", auto_k_values=(1, 3, 5), compile=False)
    ids, mask = left_padded(10, (4, 0, 7), seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert set(spec.auto_k.history) <= {0, 1, 3, 5}  # which ones depends on the measured times
    assert len(spec.stats.per_position) == 5


def test_seeded_sampling_reproduces_with_auto(one_thread):
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens="auto", compile=False)
    ids = prompt(8, seed=3)
    kw = dict(do_sample=True, max_new_tokens=30, temperature=0.9)
    torch.manual_seed(7)
    a, ka = spec.generate(ids, **kw), list(spec.auto_k.history)
    torch.manual_seed(7)
    b, kb = spec.generate(ids, **kw), list(spec.auto_k.history)
    assert torch.equal(a, b) and ka == kb  # K depends on acceptance and on times measured once per shape


@pytest.mark.full
def test_sampling_with_auto_matches_exact_distribution():
    target, draft = _models()
    prompt_ids = [1, 4, 2]
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    spec = specfx.speculate(
        target, draft=draft, num_speculative_tokens="auto", auto_k_values=(1, 2), auto_k_cost=0.2, compile=False
    )
    torch.manual_seed(99)
    out = spec.generate(torch.tensor([prompt_ids]).repeat(6000, 1), do_sample=True, max_new_tokens=3, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95
    assert len(set(spec.auto_k.history)) >= 2  # K switched between the rounds
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


@pytest.mark.compiled
def test_one_graph_per_k_and_no_recompiles(one_thread):
    """Dynamo-captured rounds (specfx passes, no Inductor, to keep it fast): each candidate K
    has exactly one round graph per live-KV bound, compiled once; the first call compiles and
    times all of them, a call that raises the bound compiles only the Ks it uses; later calls
    with any prompt add none."""
    target = _copying("llama")
    spec = specfx.speculate(target, num_speculative_tokens="auto", auto_k_values=(1, 4), backend="specfx_eager")
    used = set()
    counts = []
    chosen = {}  # live bound -> the Ks its calls ran
    for seed, new in [(0, 40), (1, 30), (2, 50), (3, 20), (0, 40)]:
        ids = _repeating_prompt(seed, length=10, span=10)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
        used |= set(spec.auto_k.history)
        chosen.setdefault(spec.live_kv_bound, set()).update(spec.auto_k.history)
        counts.append(len(spec.graphs))
        # The first call timed every K. Later calls choose from those times: fixed here, so that
        # which Ks they choose (and so compile at a raised bound) does not depend on the load.
        for key in spec.round_timer.times_by_shape:
            spec.round_timer.times_by_shape[key] = {0: 1.0e-3, 1: 1.3e-3, 4: 2.0e-3}
        # nothing but round graphs (prefill runs eagerly), one per (K, live bound)
        keys = [e.key for e in spec.compile_events]
        assert len(spec.graphs) == len(keys) == len(set(keys)) and {k[0] for k in keys} == {"round"}
        bounds = sorted({k[-1] for k in keys})
        assert {k[3] for k in keys if k[-1] == bounds[0]} == {0, 1, 4}  # all timed at the first call
        for bound in bounds[1:]:  # a raised bound compiles the Ks its calls chose, not all three
            assert {k[3] for k in keys if k[-1] == bound} == chosen[bound]
    assert len(bounds) == 2 and len(spec.round_timer.times_by_shape) == 1  # one timing for both bounds
    assert used <= {0, 1, 4} and spec.auto_k.times.keys() == {0, 1, 4}
    assert counts[-1] == counts[-2] == counts[-3]  # warm: nothing compiled any more


# --------------------------------------------------------------------------- the default
def test_auto_is_the_default_for_chains_cut_to_what_the_drafter_can_propose(one_thread):
    """num_speculative_tokens left out: "auto" among (0, 1, 2, 4, 8), or among the Ks Medusa's
    heads reach; with a tree (given, or lookahead's own) "auto" between the tree and K = 0; an
    explicit K stays that K (a tree's node count pins the tree). The graph cache scales with the
    rounds a call may use."""
    target, draft = pair("llama", "small")
    spec = specfx.speculate(target, draft=draft, compile=False)
    assert spec.spec_config.num_speculative_tokens == "auto" and spec.spec_config.auto_k_values == (1, 2, 4, 8)
    assert spec.auto_k is not None and not spec.auto_k.resumable and spec.max_graphs == 16 * 5
    assert specfx.speculate(target, compile=False).auto_k.resumable  # prompt lookup: probed after K = 0
    medusa = specfx.Medusa.random(target.config.hidden_size, target.config.vocab_size, num_heads=3)
    heads = specfx.speculate(target, draft=medusa, compile=False)
    assert heads.spec_config.auto_k_values == (1, 2) and heads.auto_k.candidates == (0, 1, 2)
    ids = prompt(8, seed=1)
    kw = dict(max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert torch.equal(heads.generate(ids, **kw), target.generate(ids, **kw))
    assert set(heads.auto_k.history) <= {0, 1, 2}
    tree = specfx.speculate(target, draft=draft, tree=[(0,), (1,), (0, 0)], compile=False)  # the tree or K = 0
    assert tree.auto_k.candidates == (0, None) and tree.tree is not None and tree.max_graphs == 16 * 2
    assert not tree.auto_k.resumable  # a draft model keeps a cache
    pinned = specfx.speculate(target, draft=draft, tree=[(0,), (1,), (0, 0)], num_speculative_tokens=3, compile=False)
    assert pinned.auto_k is None and pinned.max_graphs == 16
    lookahead = specfx.speculate(target, draft="lookahead:4,3,2", compile=False)
    assert lookahead.auto_k.candidates == (0, None) and lookahead.auto_k.resumable and lookahead.tree is not None
    fixed = specfx.speculate(target, draft=draft, num_speculative_tokens=4, compile=False)
    assert fixed.auto_k is None and fixed.k == 4 and fixed.max_graphs == 16
    assert specfx.speculate(target, draft=draft, compile=False, max_graphs=3).max_graphs == 3
    with pytest.raises(ValueError, match=r"auto_k_values=\(4, 8\) asks for up to 8 proposals .* at most 3"):
        specfx.speculate(target, draft=medusa, auto_k_values=(4, 8), compile=False)  # none reachable: refused


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            dict(num_speculative_tokens="Auto"),
            r"num_speculative_tokens must be an int in \[1, 16\], got 'Auto'.*'auto'",
        ),
        (dict(num_speculative_tokens="auto", auto_k_values=()), r"auto_k_values must be a tuple of increasing ints"),
        (dict(num_speculative_tokens="auto", auto_k_values=(4, 2)), r"auto_k_values .* got \(4, 2\)"),
        (dict(num_speculative_tokens="auto", auto_k_values=(0, 2)), r"auto_k_values .* in \[1, 16\]"),
        (dict(num_speculative_tokens="auto", auto_k_values=[1, 2]), r"auto_k_values must be a tuple"),
        (dict(num_speculative_tokens="auto", auto_k_values=(1, 17)), r"auto_k_values .* got \(1, 17\)"),
        (dict(num_speculative_tokens="auto", auto_k_cost=-0.1), r"auto_k_cost must be None or a finite number >= 0"),
        (dict(num_speculative_tokens="auto", auto_k_cost="low"), r"auto_k_cost .* got 'low'"),
        (dict(num_speculative_tokens="auto", auto_k_times={4: 1.0, 8: 2.0}), r"auto_k_times must map K \(0 and"),
        (dict(num_speculative_tokens="auto", auto_k_times={0: 1.0}), r"auto_k_times must map"),
        (dict(num_speculative_tokens="auto", auto_k_times={0: 1.0, 4: -2.0}), r"positive round time"),
        (dict(num_speculative_tokens="auto", auto_k_times=[(0, 1.0), (4, 2.0)]), r"auto_k_times must map"),
        (dict(num_speculative_tokens="auto", auto_k_cost=0.1, auto_k_times={0: 1.0, 4: 2.0}), r"pass one of them"),
    ],
)
def test_bad_auto_configuration(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        specfx.SpecConfig(**kwargs)
    target = pair("llama", "self")[0]
    with pytest.raises(ValueError, match=pattern):
        specfx.speculate(target, compile=False, **kwargs)


def test_round_times_are_measured_once_per_shape_and_reproduce_elsewhere(one_thread):
    """Default: every candidate K is timed before the first call of a shape (inert
    rounds: outputs stay equal to generate()); auto_k_times replays them in another generator,
    which then picks the same Ks and, seeded, samples the same tokens; auto_k_cost replaces the
    timing with the fixed model."""
    target, draft = pair("llama", "perturbed")
    ids = prompt(8, seed=3)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens="auto", auto_k_values=(1, 3), compile=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=20), target.generate(ids, max_new_tokens=20))
    times = spec.auto_k.times
    assert times.keys() == {0, 1, 3} and all(t > 0 for t in times.values())
    spec.generate(ids, max_new_tokens=20)
    assert spec.auto_k.times == times  # not measured again for the same shape
    kw = dict(do_sample=True, max_new_tokens=30)
    torch.manual_seed(5)
    a, ka = spec.generate(ids, **kw), list(spec.auto_k.history)
    sampled = spec.auto_k.times  # the sampling round is another graph, timed on its first call
    assert sampled.keys() == {0, 1, 3}
    other = specfx.speculate(
        target, draft=draft, num_speculative_tokens="auto", auto_k_values=(1, 3), auto_k_times=sampled, compile=False
    )
    torch.manual_seed(5)
    assert torch.equal(other.generate(ids, **kw), a) and other.auto_k.history == ka
    fixed = specfx.speculate(target, num_speculative_tokens="auto", auto_k_cost=0.5, compile=False)
    fixed.generate(ids, max_new_tokens=5)
    assert fixed.auto_k.cost == 0.5 and fixed.auto_k.times is None


@pytest.mark.parametrize("batch", [1, 3])
def test_a_given_tree_falls_back_to_plain_decoding_and_stays_there(one_thread, batch):
    """tree= with num_speculative_tokens unset: "auto" between the tree and K = 0. An independent
    random draft model accepts almost nothing: the tree runs until MIN_EVIDENCE row-rounds, then
    K = 0 for the rest of the call (the draft's cache lags: never probed). Output equals
    generate(); pinned (num_speculative_tokens = the node count) the tree runs every round."""
    target, draft = pair("llama", "small")
    ids, mask = left_padded(10, (4, 0, 7)[:batch], seed=4) if batch > 1 else (prompt(8, seed=2), None)
    kw = dict(attention_mask=mask, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, **kw)
    nodes = [(0,), (1,), (0, 0), (1, 0)]
    spec = specfx.speculate(target, draft=draft, tree=nodes, auto_k_times={0: 1.0, None: 1.5}, compile=False)
    assert torch.equal(spec.generate(ids, **kw), expected)
    history = spec.auto_k.history
    on = -(-MIN_EVIDENCE // batch)  # windows until MIN_EVIDENCE row-rounds
    assert history[:on] == [None] * on and set(history[on:]) == {0} and len(history) > on
    pinned = specfx.speculate(target, draft=draft, tree=nodes, num_speculative_tokens=4, compile=False)
    assert torch.equal(pinned.generate(ids, **kw), expected) and pinned.stats.proposed == 4 * pinned.stats.row_rounds


@pytest.mark.parametrize("batch", [1, 3])
def test_auto_turns_speculation_off_and_output_stays_exact(one_thread, batch):
    """Rounds that cannot pay (given times) run K = 0 from the first round: plain decoding
    through the same cache, nothing proposed; rounds that could pay but accept little turn
    speculation off after MIN_EVIDENCE row-rounds, with a draft model whose cache then lags
    (never used again in the call). Greedy output equals generate() either way."""
    target, draft = pair("llama", "small")  # an independent random draft: almost nothing accepted
    ids, mask = left_padded(10, (4, 0, 7)[:batch], seed=4) if batch > 1 else (prompt(8, seed=2), None)
    kw = dict(attention_mask=mask, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, **kw)
    never = specfx.speculate(
        target, draft=draft, num_speculative_tokens="auto", auto_k_times={0: 1.0, 8: 50.0}, compile=False
    )
    assert torch.equal(never.generate(ids, **kw), expected)
    assert set(never.auto_k.history) == {0} and never.stats.proposed == 0
    assert never.stats.tokens_per_round == 1.0
    later = specfx.speculate(
        target, draft=draft, num_speculative_tokens="auto", auto_k_times={0: 1.0, 8: 1.6}, compile=False
    )
    assert torch.equal(later.generate(ids, **kw), expected)
    history = later.auto_k.history
    assert history[0] > 0 and history[-1] == 0 and 0 not in history[: -(-MIN_EVIDENCE // batch)]
    assert history[history.index(0) :] == [0] * (len(history) - history.index(0))  # off stays off
