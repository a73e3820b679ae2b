"""Sampler units: hand-built p and q, HF processor equivalence, the random stream."""

import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specfx.sampling.accept import greedy_verify, rejection_verify
from specfx.sampling.processors import PLACEHOLDER, TOPK_BOUND, Mode, SamplingParams, as_mode, process_logits
from specfx.sampling.rng import sample_from, uniform


def onehot(idx, v):
    return torch.nn.functional.one_hot(torch.tensor(idx), v).float()


def run(p, q, proposals, n=1, seed=0):
    """Batch n copies of one (p, q, proposals) case through the rejection sampler."""
    b = n
    p = p.expand(b, *p.shape[1:]).contiguous()
    q = q.expand(b, *q.shape[1:]).contiguous()
    proposals = proposals.expand(b, -1).contiguous()
    s = torch.tensor(seed)
    ua = uniform(s, torch.tensor(1), 1, proposals.shape)
    ur = uniform(s, torch.tensor(1), 2, (b, p.shape[-1]))
    return rejection_verify(p, q, proposals, ua, ur)


def test_perfect_match_accepts_all_and_samples_bonus():
    v = 5
    p = torch.stack([onehot(1, v), onehot(3, v), onehot(4, v)]).unsqueeze(0)  # [1, 3, V]
    q = p[:, :2].clone()
    tokens, n_acc = run(p, q, torch.tensor([[1, 3]]), n=50)
    assert (n_acc == 2).all()
    assert (tokens == torch.tensor([1, 3, 4])).all()  # bonus from p at position K+1


def test_early_mismatch_emits_correction_and_placeholders():
    v = 4
    p = torch.stack([onehot(2, v), onehot(1, v), onehot(0, v)]).unsqueeze(0)
    q = torch.stack([onehot(3, v), onehot(1, v)]).unsqueeze(0)  # first proposal has p = 0
    tokens, n_acc = run(p, q, torch.tensor([[3, 1]]), n=50)
    assert (n_acc == 0).all()
    assert (tokens[:, 0] == 2).all()  # correction from norm(max(0, p - q)) = token 2
    assert (tokens[:, 1:] == PLACEHOLDER).all()


def test_zero_probability_token_never_accepted():
    p = torch.tensor([[[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]])
    q = torch.tensor([[[0.0, 0.0, 1.0]]])  # drafter always proposes token 2, which p forbids
    tokens, n_acc = run(p, q, torch.tensor([[2]]), n=2000)
    assert (n_acc == 0).all()
    assert (tokens[:, 0] != 2).all()


def test_disjoint_supports_always_reject_and_resample_from_p():
    v = 4
    p = torch.tensor([[[0.5, 0.5, 0, 0], [0.25] * 4]])
    q = torch.tensor([[[0, 0, 0.5, 0.5]]])
    proposals = torch.tensor([[2]])
    tokens, n_acc = run(p, q, proposals, n=4000)
    assert (n_acc == 0).all()
    counts = torch.bincount(tokens[:, 0], minlength=v)
    assert counts[2] == 0 and counts[3] == 0
    assert stats.chisquare(counts[:2].numpy(), [2000, 2000]).pvalue > 1e-3


def test_all_accepted_bonus_follows_p():
    v = 3
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    tokens, n_acc = run(p, q, torch.tensor([[1]]), n=6000)
    assert (n_acc == 1).all()
    counts = torch.bincount(tokens[:, 1], minlength=v).numpy()
    assert stats.chisquare(counts, [1200, 1800, 3000]).pvalue > 1e-3


def test_single_position_output_is_exactly_p():
    """One proposal from q, then the emitted first token must follow p exactly."""
    v = 5
    p = torch.tensor([[[0.1, 0.4, 0.0, 0.3, 0.2], [0.2] * 5]])
    q1 = torch.tensor([0.3, 0.1, 0.4, 0.1, 0.1])
    n = 20000
    u = uniform(torch.tensor(5), torch.tensor(0), 9, (n, v))
    proposals = sample_from(q1.expand(n, v), u).unsqueeze(1)
    tokens, _ = run(p, q1.view(1, 1, v), proposals, n=n, seed=11)
    counts = torch.bincount(tokens[:, 0], minlength=v).numpy()
    assert counts[2] == 0
    keep = p[0, 0] > 0
    assert stats.chisquare(counts[keep.numpy()], (p[0, 0][keep] * n).numpy()).pvalue > 1e-3


def test_greedy_verify_prefix_and_correction():
    scores = torch.tensor([[[0, 5, 1.0], [3, 0, 0], [0, 0, 9], [1, 0, 0]]])
    tokens, n_acc = greedy_verify(scores, torch.tensor([[1, 0, 1]]))
    assert n_acc.tolist() == [2]
    assert tokens.tolist() == [[1, 0, 2, PLACEHOLDER]]
    tokens, n_acc = greedy_verify(scores, torch.tensor([[1, 0, 2]]))
    assert n_acc.tolist() == [3] and tokens.tolist() == [[1, 0, 2, 0]]


def test_uniform_stream_is_uniform_and_reproducible():
    u = uniform(torch.tensor(123), torch.tensor(7), 3, (200_000,))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert torch.equal(u, uniform(torch.tensor(123), torch.tensor(7), 3, (200_000,)))
    assert not torch.equal(u, uniform(torch.tensor(123), torch.tensor(8), 3, (200_000,)))
    assert not torch.equal(u, uniform(torch.tensor(124), torch.tensor(7), 3, (200_000,)))


def test_exponential_race_samples_proportionally():
    w = torch.tensor([1.0, 2.0, 0.0, 5.0])
    n = 40000
    idx = sample_from(w.expand(n, 4), uniform(torch.tensor(1), torch.tensor(2), 3, (n, 4)))
    counts = torch.bincount(idx, minlength=4).numpy()
    assert counts[2] == 0
    assert stats.chisquare(counts[[0, 1, 3]], [n / 8, n / 4, n * 5 / 8]).pvalue > 1e-3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, temperature=0.7),
        SamplingParams(do_sample=True, top_k=5),
        SamplingParams(do_sample=True, top_p=0.8),
        SamplingParams(do_sample=True, temperature=1.3, top_k=10, top_p=0.9, repetition_penalty=1.5),
        SamplingParams(do_sample=False, repetition_penalty=0.8),
        SamplingParams(do_sample=False),
    ],
    ids=["temperature", "top_k", "top_p", "all", "greedy-penalty", "greedy"],
)
@pytest.mark.parametrize("pruned", [False, True], ids=["every-stage", "call-mode"])
def test_processors_match_transformers(params, pruned):
    """HF's processors, with every stage in the graph (the general mode) and with only the
    stages the call's mode keeps (SamplingParams.mode(): penalty 1 and top-k/top-p off leave
    theirs out)."""
    torch.manual_seed(0)
    b, v = 3, 50
    logits = torch.randn(b, v) * 3
    history = torch.randint(0, v, (b, 7))
    hf = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        hf.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            hf.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            hf.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            hf.append(TopPLogitsWarper(params.top_p))
    expected = hf(history, logits.clone())
    presence = torch.zeros(b, v, dtype=torch.bool).scatter_(1, history, True).unsqueeze(1)
    values = {name: torch.tensor(value) for name, value in params.device_values().items()}
    mode = params.mode() if pruned else params.do_sample
    if pruned and not mode.penalty:
        presence = None  # never read when the penalty stage is left out
    got = process_logits(logits.unsqueeze(1), values, presence, torch.zeros(b, 1, dtype=torch.long), torch.tensor([2]), mode)
    assert torch.equal(got[:, 0].isinf(), expected.isinf())
    finite = ~expected.isinf()
    assert torch.allclose(got[:, 0][finite], expected[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 50, TOPK_BOUND, TOPK_BOUND + 1, 700])
@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_top_k_over_a_vocabulary_larger_than_the_bound_matches_transformers(top_k, top_p):
    """A vocabulary larger than TOPK_BOUND: top_k up to the bound takes its kth largest score from
    torch.topk, above it from a sort; both keep exactly HF's tokens, ties at the kth score
    included (every tied score kept, as HF keeps them), with top-p after them."""
    torch.manual_seed(1)
    v = 1000
    logits = torch.randn(4, 2, v) * 3
    logits[0, 0, :400] = 2.5  # 400 scores tied around every small kth
    logits[1, 1] = logits[1, 1].round()  # many ties everywhere
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=top_k, top_p=top_p)
    hf = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(top_k)])
    if top_p < 1.0:
        hf.append(TopPLogitsWarper(top_p))
    expected = hf(None, logits.reshape(8, v).clone()).reshape(4, 2, v)
    values = {name: torch.tensor(value) for name, value in params.device_values().items()}
    mode = params.mode()
    assert mode.top_k == (TOPK_BOUND if top_k <= TOPK_BOUND else -1)
    got = process_logits(logits, values, None, torch.zeros(4, 2, dtype=torch.long), torch.tensor([2]), mode)
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.equal(got[~expected.isinf()], expected[~expected.isinf()])


def _values(**overrides):
    values = SamplingParams(do_sample=False).device_values() | overrides
    return {name: torch.tensor(value) for name, value in values.items()}


def test_settings_off_are_exact_no_ops():
    """One graph serves every setting of a mode only if each stage at its off value returns its
    input bit for bit (greedy output must equal HF's exactly)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 40) * 5
    logits[0, 1, 7] = float("-inf")
    presence = torch.rand(2, 3, 40) > 0.5
    eos = torch.tensor([3, -1, -1, -1])
    for sample in (False, True):
        out = process_logits(logits, _values(), presence, torch.zeros(2, 3, dtype=torch.long), eos, sample)
        assert torch.equal(out, logits.float())


def test_mode_leaves_out_only_stages_that_are_off():
    """SamplingParams.mode(): the penalty stage only when the penalty is not 1, top-k only when
    sampling with top_k (by torch.topk up to TOPK_BOUND, else by a sort), top-p's sort only when
    sampling with top_p < 1; greedy never warps; a Mode is no bool."""
    assert SamplingParams(do_sample=False).mode() == Mode(False, penalty=False, top_k=0, top_p=False)
    assert SamplingParams(do_sample=False, top_k=5, top_p=0.5).mode() == Mode(False, penalty=False)
    assert SamplingParams(do_sample=False, repetition_penalty=1.2).mode() == Mode(False, penalty=True)
    assert SamplingParams(do_sample=True).mode() == Mode(True, penalty=False, top_k=0, top_p=False)
    assert SamplingParams(do_sample=True, top_k=50).mode() == Mode(True, penalty=False, top_k=TOPK_BOUND, top_p=False)
    assert SamplingParams(do_sample=True, top_k=TOPK_BOUND + 1).mode().top_k == -1
    assert SamplingParams(do_sample=True, top_p=0.9).mode() == Mode(True, penalty=False, top_k=0, top_p=True)
    assert as_mode(True) == Mode(True, penalty=True, top_k=-1, top_p=True)
    with pytest.raises(TypeError, match="mode.sample"):
        bool(Mode(True))


def test_min_new_tokens_masks_eos_only_early():
    logits = torch.zeros(1, 3, 6)
    no_presence = torch.zeros(1, 1, 6, dtype=torch.bool)
    out = process_logits(logits, _values(min_new=2), no_presence, torch.tensor([[0, 1, 2]]), torch.tensor([2, 4, -1]))
    assert out[0, 0, 2].isinf() and out[0, 1, 4].isinf()
    assert not out[0, 2].isinf().any()
    assert not out[0, :, [0, 1, 3, 5]].isinf().any()


def test_deterministic_drafter_q_none_equals_one_hot_q():
    """q=None (a deterministic drafter) takes the same decisions and draws, bit for bit, as an
    explicit one-hot q [B, K, V], without building it."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 4, 11
    p = torch.rand(b, k + 1, v, generator=g) ** 3
    p = p / p.sum(-1, keepdim=True)
    proposals = torch.randint(0, v, (b, k), generator=g)
    s = torch.tensor(7)
    ua = uniform(s, torch.tensor(1), 1, proposals.shape)
    ur = uniform(s, torch.tensor(1), 2, (b, v))
    with_q = rejection_verify(p, torch.nn.functional.one_hot(proposals, v).float(), proposals, ua, ur)
    without = rejection_verify(p, None, proposals, ua, ur)
    assert torch.equal(with_q[0], without[0]) and torch.equal(with_q[1], without[1])
    assert 0 < int(without[1].sum()) < b * k  # acceptances and rejections both happen
