"""``num_speculative_tokens="auto"``: the K policy, greedy equality while K changes, seeded
reproducibility and losslessness, one graph per K and no recompiles, bad configuration."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

import specfx
from specfx.auto_k import AutoK, expected_emitted
from tests.conftest import left_padded, pair, prompt
from tests.test_lossless import _chisquare, _exact, _models
from tests.test_prompt_lookup import _copying, _repeating_prompt


# --------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_expected_emitted_is_the_truncated_geometric_mean(alpha, k):
    # P(emitted >= i + 1) = alpha^i for i = 0..K
    assert expected_emitted(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def _feed(policy: AutoK, accept_all: bool, windows: int, rows: int = 1) -> None:
    """Simulate windows of one round each: every row accepts all K, or none."""
    acc = rr = 0
    per_position = [0] * max(policy.k_values)
    for _ in range(windows):
        k = policy.k
        rr += rows
        if accept_all:
            acc += rows * k
            for i in range(k):
                per_position[i] += rows
        policy.update(acc, rr, per_position)


def test_policy_moves_to_the_largest_k_when_everything_is_accepted():
    policy = AutoK((1, 2, 4, 8), cost=0.05)
    first = policy.k
    _feed(policy, accept_all=True, windows=10)
    assert policy.alpha > 0.95
    assert policy.k == 8 and first < 8


def test_policy_moves_to_the_smallest_k_when_nothing_is_accepted():
    policy = AutoK((1, 2, 4, 8), cost=0.05)
    _feed(policy, accept_all=False, windows=10)
    assert policy.alpha < 0.1
    assert policy.k == 1


def test_policy_maximises_the_modelled_speedup():
    for cost in (0.0, 0.05, 0.3, 1.0):
        policy = AutoK((1, 2, 3, 4, 6, 8), cost=cost)
        best = max(policy.k_values, key=lambda k: expected_emitted(policy.alpha, k) / (1 + cost * k))
        assert policy.k == best
    # an expensive proposal never pays at alpha = 0.5: the smallest K
    assert AutoK((1, 2, 4, 8), cost=1.0).k == 1


def test_policy_restarts_from_the_prior_each_call():
    policy = AutoK((1, 2, 4, 8), cost=0.05)
    start = policy.k
    _feed(policy, accept_all=True, windows=10)
    policy.reset()
    assert policy.k == start and policy.history == []


# --------------------------------------------------------------------------- generation
def test_greedy_equals_generate_while_k_changes(one_thread):
    target = _copying("llama")  # copies (α -> 1) after entering its cycle; random before
    spec = specfx.speculate(target, num_speculative_tokens="auto", compile=False)
    seen = set()
    for seed, new in [(0, 40), (1, 25), (2, 60)]:
        ids = _repeating_prompt(seed, length=10, span=10)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
        seen |= set(spec.auto_k.history)
        assert spec.stats.row_rounds == spec.stats.rounds  # batch 1
        assert spec.stats.tokens_per_round == spec.stats.emitted / spec.stats.rounds
    assert len(seen) > 1, "the policy never changed K: the test would not exercise switching"


def test_auto_with_a_draft_model_and_a_left_padded_batch(one_thread):
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens="auto", auto_k_values=(1, 3, 5), compile=False)
    ids, mask = left_padded(10, (4, 0, 7), seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert set(spec.auto_k.history) <= {1, 3, 5}
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
    assert torch.equal(a, b) and ka == kb  # K depends on acceptance only, never on timing


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
    assert set(spec.auto_k.history) == {1, 2}  # K switched between the rounds
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


@pytest.mark.compiled
def test_one_graph_per_k_and_no_recompiles(one_thread):
    """Dynamo-captured rounds (specfx passes, no Inductor, to keep it fast): each K used adds
    exactly one round graph, once; later calls with any prompt add none."""
    target = _copying("llama")
    spec = specfx.speculate(target, num_speculative_tokens="auto", auto_k_values=(1, 4), backend="specfx_eager")
    used = set()
    counts = []
    for seed, new in [(0, 40), (1, 30), (2, 50), (3, 20), (0, 40)]:
        ids = _repeating_prompt(seed, length=10, span=10)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
        used |= set(spec.auto_k.history)
        counts.append(len(spec.graphs))
        assert len(spec.graphs) == len(used)  # one round graph per K used so far (prefill runs eagerly)
    assert used == {1, 4}
    assert counts[-1] == counts[-2] == counts[-3]  # warm: nothing compiled any more


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(num_speculative_tokens="Auto"), r"num_speculative_tokens must be an int in \[1, 16\], got 'Auto'.*'auto'"),
        (dict(num_speculative_tokens="auto", auto_k_values=()), r"auto_k_values must be a tuple of increasing ints"),
        (dict(num_speculative_tokens="auto", auto_k_values=(4, 2)), r"auto_k_values .* got \(4, 2\)"),
        (dict(num_speculative_tokens="auto", auto_k_values=(0, 2)), r"auto_k_values .* in \[1, 16\]"),
        (dict(num_speculative_tokens="auto", auto_k_values=[1, 2]), r"auto_k_values must be a tuple"),
        (dict(num_speculative_tokens="auto", auto_k_values=(1, 17)), r"auto_k_values .* got \(1, 17\)"),
        (dict(num_speculative_tokens="auto", auto_k_cost=-0.1), r"auto_k_cost must be None or a finite number >= 0"),
        (dict(num_speculative_tokens="auto", auto_k_cost="low"), r"auto_k_cost .* got 'low'"),
    ],
)
def test_bad_auto_configuration(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        specfx.SpecConfig(**kwargs)
    target = pair("llama", "self")[0]
    with pytest.raises(ValueError, match=pattern):
        specfx.speculate(target, compile=False, **kwargs)


def test_default_cost_is_the_drafters_estimate():
    target, perturbed = pair("llama", "perturbed")
    small = pair("llama", "small")[1]
    cost = {}
    for name, draft in [("lookup", "prompt_lookup"), ("same size", perturbed), ("1 layer", small)]:
        cost[name] = specfx.speculate(target, draft=draft, num_speculative_tokens="auto", compile=False).auto_k.cost
    assert cost["lookup"] == specfx.drafters.VERIFY_COST
    assert cost["same size"] == pytest.approx(specfx.drafters.VERIFY_COST + 1.0)
    assert cost["lookup"] < cost["1 layer"] < cost["same size"]
    spec = specfx.speculate(target, num_speculative_tokens="auto", auto_k_cost=0.5, compile=False)
    assert spec.auto_k.cost == 0.5
