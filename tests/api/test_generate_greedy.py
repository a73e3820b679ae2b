"""End-to-end greedy equality with model.generate() (eager rounds; compiled in test_compiled)."""

import pytest
import torch

import specfx
from tests.conftest import ARCHS, left_padded, pair, prompt, tiered


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft", ["self", "perturbed", "small"])
def test_greedy_equals_generate(arch, draft):
    target, d = pair(arch, draft)
    spec = specfx.speculate(target, draft=d, num_speculative_tokens=3, compile=False)
    for length, new in [(1, 9), (7, 23), (20, 41)]:
        ids = prompt(length, seed=length)
        expected = target.generate(ids, max_new_tokens=new, do_sample=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=new, do_sample=False), expected)
    if draft == "self":
        assert spec.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", tiered([1, 2, 5, 8], [2, 5]))
def test_any_k_and_lengths_not_multiple_of_k_plus_1(k):
    target, d = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=d, num_speculative_tokens=k, compile=False)
    for new in (1, 2, k, k + 1, k + 2, 3 * k + 2):
        ids = prompt(5, seed=new)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))


def test_stops_at_eos_exactly_where_hf_stops():
    target, d = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=d, num_speculative_tokens=4, compile=False)
    stopped = 0
    for seed in range(12):
        ids = prompt(6, seed=seed)
        # pick an EOS the model actually produces mid-way, as int and as a list
        free = target.generate(ids, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
        eos = int(free[0, 6 + 10])
        for eos_arg in (eos, [127, eos]):
            expected = target.generate(ids, max_new_tokens=30, eos_token_id=eos_arg)
            got = spec.generate(ids, max_new_tokens=30, eos_token_id=eos_arg)
            assert torch.equal(got, expected)
            stopped += expected.shape[1] < 36
    assert stopped > 0


def test_repetition_penalty_and_min_new_tokens_match():
    target, d = pair("qwen2", "perturbed")
    spec = specfx.speculate(target, draft=d, num_speculative_tokens=4, compile=False)
    ids = prompt(9, seed=1)
    for kw in (dict(repetition_penalty=1.3), dict(repetition_penalty=0.7), dict(min_new_tokens=25, eos_token_id=[2, 5, 9])):
        assert torch.equal(spec.generate(ids, max_new_tokens=30, **kw), target.generate(ids, max_new_tokens=30, **kw))


def test_left_padded_batch_matches_batched_generate():
    target, d = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=d, num_speculative_tokens=3, compile=False)
    ids, mask = left_padded(10, (4, 0, 7), seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=17, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert len(spec.stats.per_row_accepted) == 3


def test_generation_defaults_from_generation_config():
    target, d = pair("gpt2", "perturbed")
    spec = specfx.speculate(target, draft=d, compile=False)
    ids = prompt(4, seed=2)
    assert torch.equal(spec.generate(ids), target.generate(ids))  # HF default: 20 new tokens
    assert torch.equal(spec.generate(ids, max_length=15), target.generate(ids, max_length=15))
