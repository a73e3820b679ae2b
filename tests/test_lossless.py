"""Statistical losslessness: speculative samples follow the target's exact distribution.

On a tiny vocabulary the exact distribution of the first ``N`` generated tokens is enumerated
from the target's own logits processed by transformers' warpers; a batch of thousands of rows
is generated speculatively in one call (every row has its own random stream), and a
chi-square test compares the counts with the exact probabilities. Seeds are fixed, so the
test is deterministic; the threshold (p > 1e-3) is what a correct sampler passes and a
sampler with a biased acceptance rule fails by a wide margin (see the negative control).
"""

import itertools

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
from specfx.models.tiny import perturbed_copy, tiny_causal_lm

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


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k", [1, 3])
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
