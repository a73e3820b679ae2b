"""Ragged batches: per-row losslessness of sampling and per-row statistics."""

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

import specfx
from tests.lossless.test_lossless import NEW, _chisquare, _exact, _models


@pytest.mark.full
def test_ragged_batch_sampling_is_lossless_per_row():
    """Two prompts of different lengths, left-padded and interleaved in one batch: each row's
    samples follow that row's exact target distribution."""
    target, draft = _models()
    prompts = ([1, 4, 2], [3, 5])
    rows = 3000
    ids = torch.tensor([[1, 4, 2], [0, 3, 5]]).repeat(rows, 1)  # rows alternate between the prompts
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]]).repeat(rows, 1)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=2, compile=False)
    torch.manual_seed(99)
    out = spec.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95
    for i, p in enumerate(prompts):
        samples = out[i::2, 3:].tolist()
        assert _chisquare(samples, _exact(target, p, LogitsProcessorList())) > 1e-3, f"prompt {p}"


def test_per_row_stats_add_up(one_thread):
    target, draft = _models()
    ids = torch.tensor([[1, 4, 2, 3], [0, 0, 3, 5], [0, 1, 1, 1]])
    mask = (ids != 0).long()
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    spec.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    s = spec.stats
    assert len(s.per_row_accepted) == 3
    assert sum(s.per_row_accepted) == s.accepted and sum(s.per_row_proposed) == s.proposed
    assert all(a <= p for a, p in zip(s.per_row_accepted, s.per_row_proposed, strict=True))


def test_finished_rows_padded_like_hf(one_thread):
    """A row that hits EOS early stays finished and is padded with pad_token_id as HF pads it."""
    from specfx.testing.tiny import perturbed_copy, tiny_causal_lm
    from tests.conftest import prompt

    target = tiny_causal_lm("llama", seed=5)
    target.generation_config.eos_token_id = None
    ids = prompt(9, batch=3, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    eos = int(free[0, 9 + 3])  # row 0's 4th new token becomes the EOS
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=99)
    expected = target.generate(ids, **kw)
    assert (expected == 99).any(), "no row finished early: the test would check nothing"
    spec = specfx.speculate(target, draft=perturbed_copy(target, 0.03), num_speculative_tokens=4, compile=False)
    assert torch.equal(spec.generate(ids, **kw), expected)
