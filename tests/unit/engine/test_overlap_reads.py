"""Overlapped host reads (SpecConfig.overlap_reads, on by default on CUDA): the host launches
round i + 1 before it waits for round i's finished flags. The extra round at the end serves
finished rows only, so outputs, statistics and errors equal those of reading every round.
Run here on the CPU with overlap_reads=True forced (the copy is then synchronous)."""

import pytest
import torch

import specfx
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm
from tests.api.test_long_lived import _nan_model
from tests.conftest import left_padded, prompt


@pytest.fixture(scope="module")
def models():
    target = tiny_causal_lm("llama", initializer_range=0.1)
    return target, perturbed_copy(target, 0.05)


def _stats(spec):
    s = spec.stats
    return (s.rounds, s.proposed, s.accepted, s.emitted, s.row_rounds, list(s.per_position))


@pytest.mark.parametrize("max_new_tokens", [1, 2, 17])
def test_greedy_equal_and_same_stats(models, max_new_tokens, one_thread):
    target, draft = models
    specs = {o: specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False, overlap_reads=o) for o in (False, True)}
    cases = [(prompt(9, seed=1), None), left_padded(10, (0, 4, 7), seed=2)]
    for ids, mask in cases:
        # eos 5 finishes some rows early: later rounds must leave them alone
        kw = dict(max_new_tokens=max_new_tokens, attention_mask=mask, eos_token_id=5, pad_token_id=0)
        want = target.generate(ids, **kw)
        got = {o: spec.generate(ids, **kw) for o, spec in specs.items()}
        assert torch.equal(got[True], want) and torch.equal(got[False], want)
        assert _stats(specs[True]) == _stats(specs[False])


def test_sampling_equal_with_the_same_seed(models, one_thread):
    target, draft = models
    kw = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=40, pad_token_id=0)
    ids, mask = left_padded(8, (0, 3), seed=4)
    out = {}
    for o in (False, True):
        spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False, overlap_reads=o)
        torch.manual_seed(7)
        first = spec.generate(ids, attention_mask=mask, **kw)
        second = spec.generate(ids, attention_mask=mask, **kw)  # the generator's state after an extra round
        out[o] = (first, second)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])


@pytest.mark.parametrize("max_new_tokens", [1, 12])
def test_nan_is_still_raised(max_new_tokens):
    model = _nan_model()
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=2, compile=False, overlap_reads=True)
    model.nan = True
    with pytest.raises(RuntimeError, match="NaN or inf"):
        spec.generate(prompt(6), do_sample=True, max_new_tokens=max_new_tokens, pad_token_id=0)


def test_default_is_on_for_cuda_only(models):
    target, draft = models
    spec = specfx.speculate(target, draft=draft, compile=False)
    assert spec.spec_config.overlap_reads is None and not spec.reads_overlapped(None, False)
    assert not specfx.speculate(target, draft=draft, compile=False, overlap_reads=True).reads_overlapped(object(), False)
    with pytest.raises(ValueError, match="overlap_reads must be None, True or False"):
        specfx.SpecConfig(overlap_reads=1)
