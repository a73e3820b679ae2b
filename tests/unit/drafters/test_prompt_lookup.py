"""Prompt lookup: the on-device search against a pure-Python reference, greedy equality with
plain greedy and with HF's ``prompt_lookup_num_tokens``, sampling losslessness, acceptance on
a model whose output copies, the zero-config default, bad arguments, and one compiled round."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LogitsProcessorList

import specfx
from specfx.drafters.prompt_lookup import MAX_NGRAM, lookup_proposals
from specfx.drafters.registry import DEFAULT_DRAFTERS, NAMED_DRAFTERS
from specfx.passes.checks.no_host_sync import offending_nodes
from specfx.testing.tiny import tiny_causal_lm
from tests.api.test_bad_input import Guard
from tests.conftest import pair, prompt, tiered
from tests.lossless.test_lossless import _chisquare, _exact, _models


# --------------------------------------------------------------------------- the search
def _reference(seq: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """Slow reference: for n from long to short, scan every earlier window of the sequence and
    take the last one equal to the suffix; then extend the sequence by copying with the shift
    the match implies (each new token equals the one ``shift`` positions before it)."""
    last = len(seq) - 1
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > len(seq):
            continue
        suffix = seq[-n:]
        ends = [e for e in range(n - 1, last) if seq[e - n + 1 : e + 1] == suffix]
        if ends:
            shift = last - ends[-1]
            ext = list(seq)
            for _ in range(k):
                ext.append(ext[len(ext) - shift])
            return ext[len(seq) :], n
    return [seq[-1]] * k, 0


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (1, 1), (4, 2), (5, 5)])
@pytest.mark.parametrize("vocab", [2, 3, 6])
def test_search_matches_reference(max_ngram, min_ngram, vocab):
    rng = random.Random(vocab * 100 + max_ngram * 10 + min_ngram)
    b, c, k = 12, 40, 5
    for _ in range(20):
        lengths = [rng.randrange(0, c - 1) for _ in range(b)]
        lengths[0], lengths[1] = 0, 1  # a one-token row and a two-token row
        # columns past a row's length hold stale garbage from a small, overlapping alphabet
        tokens = torch.tensor([[rng.randrange(vocab) for _ in range(c)] for _ in range(b)])
        got, n = lookup_proposals(tokens, torch.tensor(lengths), k, max_ngram, min_ngram)
        for row in range(b):
            seq = tokens[row, : lengths[row] + 1].tolist()
            want, want_n = _reference(seq, k, max_ngram, min_ngram)
            assert got[row].tolist() == want, (seq, got[row].tolist(), want)
            assert int(n[row]) == want_n


def test_search_takes_the_most_recent_occurrence_of_the_longest_ngram():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13
    seq = [7, 1, 2, 8, 5, 1, 2, 9, 3, 2, 4, 6, 1, 2]
    tokens = torch.tensor([seq + [0] * 6])
    proposals, n = lookup_proposals(tokens, torch.tensor([13]), 3, max_ngram=3, min_ngram=1)
    # "1 2" occurs ending at 2 and at 6 (most recent: 6, followed by 9 3 2); no earlier "6 1 2"
    assert n.tolist() == [2]
    assert proposals.tolist() == [[9, 3, 2]]
    # with max_ngram=1 the last "2" before position 13 ends at 9, followed by 4 6 1
    proposals, n = lookup_proposals(tokens, torch.tensor([13]), 3, max_ngram=1, min_ngram=1)
    assert (n.tolist(), proposals.tolist()) == ([1], [[4, 6, 1]])


def test_search_no_match_proposes_the_pending_token_and_ignores_stale_columns():
    seq = [4, 5, 6, 7]
    tokens = torch.tensor([seq + [7, 7, 6, 7]])  # stale columns would match "6 7" if read
    proposals, n = lookup_proposals(tokens, torch.tensor([3]), 4, max_ngram=3, min_ngram=1)
    assert n.tolist() == [0]
    assert proposals.tolist() == [[7, 7, 7, 7]]


def test_search_continues_a_period_past_the_end():
    tokens = torch.tensor([[3, 4, 3, 4, 3] + [9] * 8])
    proposals, n = lookup_proposals(tokens, torch.tensor([4]), 6, max_ngram=3, min_ngram=1)
    assert n.tolist() == [3]
    assert proposals.tolist() == [[4, 3, 4, 3, 4, 3]]


# --------------------------------------------------------------------------- greedy equality
def _copying(arch: str):
    """A tiny model whose output depends only on the current token (attention outputs and
    absolute positions zeroed): greedy decoding iterates a function on the vocabulary, so it
    soon cycles and the continuation copies earlier spans, as prompt lookup assumes."""
    model = tiny_causal_lm(arch, seed=11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "attn.c_proj.weight", "attn.c_proj.bias", "wpe.weight")):
                p.zero_()
    return model


def _repeating_prompt(seed: int, length: int = 24, span: int = 7) -> torch.Tensor:
    """A prompt that repeats a span, so the suffix n-grams have earlier occurrences."""
    base = prompt(span, seed=seed)[0].tolist()
    return torch.tensor([(base * (length // span + 1))[:length]])


MODELS = {
    "llama-random": lambda: pair("llama", "self")[0],
    "gpt2-random": lambda: pair("gpt2", "self")[0],
    "llama-copying": lambda: _copying("llama"),
    "gpt2-copying": lambda: _copying("gpt2"),
}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_and_hf_prompt_lookup(model, k, one_thread):
    target = MODELS[model]()
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=k, compile=False)
    for seed, new in [(0, 30), (1, 17), (2, 45)]:
        ids = _repeating_prompt(seed)
        plain = target.generate(ids, max_new_tokens=new, do_sample=False)
        hf_lookup = target.generate(ids, max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=k)
        assert torch.equal(hf_lookup, plain)
        assert torch.equal(spec.generate(ids, max_new_tokens=new, do_sample=False), plain)


@pytest.mark.parametrize("model", ["llama-random", "gpt2-copying"])
def test_left_padded_batch_matches_batched_generate(model, one_thread):
    target = MODELS[model]()
    spec = specfx.speculate(target, draft=specfx.PromptLookup(max_ngram=2), num_speculative_tokens=3, compile=False)
    ids = torch.cat([_repeating_prompt(s, length=12, span=4) for s in range(3)])
    mask = (torch.arange(12) >= torch.tensor([[5], [0], [3]])).long()  # left padding of 5, 0, 3
    ids = ids * mask
    kw = dict(attention_mask=mask, max_new_tokens=25, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))


def test_copying_output_is_accepted(one_thread):
    """When the continuation is a copy of earlier tokens, proposals are accepted: τ > 1.5."""
    target = _copying("llama")
    start = torch.tensor([[5]])
    ids = target.generate(start, max_new_tokens=47, do_sample=False)  # [1, 48], enters its cycle
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)
    continuation = expected[0, 48:].tolist()
    assert set(continuation) <= set(ids[0].tolist()), "precondition: the model's continuation copies the prompt"
    spec = specfx.speculate(target, num_speculative_tokens=4, compile=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=40, do_sample=False), expected)
    assert spec.stats.tokens_per_round > 1.5
    assert spec.stats.acceptance_rate > 0.5


# --------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("k", tiered([1, 3], []))
def test_sampling_matches_exact_distribution(k):
    """Chi-square against the enumerated target distribution (harness of test_lossless)."""
    target, _ = _models()
    prompt_ids = [1, 4, 2, 1, 4]  # "1 4" recurs: proposals start with 2 (then a period)
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=k, compile=False)
    torch.manual_seed(4321)
    ids = torch.tensor([prompt_ids]).repeat(6000, 1)
    out = spec.generate(ids, do_sample=True, max_new_tokens=3, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95  # accepted and corrected tokens both occur
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


# --------------------------------------------------------------------------- default and names
def test_default_drafter_is_prompt_lookup_without_mtp():
    target = pair("llama", "self")[0]
    guard = Guard(target)
    spec = specfx.speculate(target, compile=False)
    assert spec.method == "prompt_lookup"
    assert isinstance(spec.drafter, specfx.PromptLookup)
    assert DEFAULT_DRAFTERS[-1][0] == "prompt_lookup"
    ids = _repeating_prompt(3)
    assert torch.equal(spec.generate(ids, max_new_tokens=12), target.generate(ids, max_new_tokens=12))
    guard.check()


def test_method_names_the_drafter():
    target, draft = pair("llama", "perturbed")
    assert specfx.speculate(target, draft=draft, compile=False).method == "draft_model"
    assert specfx.speculate(target, draft="prompt_lookup", compile=False).method == "prompt_lookup"
    spec = specfx.speculate(target, draft="prompt_lookup:5", compile=False)
    assert spec.drafter == specfx.PromptLookup(max_ngram=5, min_ngram=1)
    assert "prompt_lookup" in NAMED_DRAFTERS


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(max_ngram=0), r"max_ngram must be an int in \[1, 16\], got 0"),
        (dict(max_ngram=MAX_NGRAM + 1), r"max_ngram must be an int in \[1, 16\], got 17"),
        (dict(max_ngram=2.0), r"max_ngram must be an int .* got 2.0"),
        (dict(max_ngram=True), r"max_ngram must be an int .* got True"),
        (dict(min_ngram=0), r"min_ngram must be an int .* got 0"),
        (dict(min_ngram="1"), r"min_ngram must be an int .* got '1'"),
        (dict(max_ngram=2, min_ngram=3), r"min_ngram \(3\) must not exceed max_ngram \(2\)"),
    ],
)
def test_bad_prompt_lookup_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        specfx.PromptLookup(**kwargs)


@pytest.mark.parametrize(
    "draft,pattern",
    [
        ("prompt-lookup", r"unknown drafter 'prompt-lookup'. Named drafters: .*'prompt_lookup'"),
        ("ngram", r"unknown drafter 'ngram'"),
        ("prompt_lookup:x", r"'prompt_lookup:x': the argument is max_ngram, an int in \[1, 16\]"),
        ("prompt_lookup:0", r"max_ngram must be an int in \[1, 16\], got 0"),
    ],
)
def test_bad_drafter_names(draft, pattern):
    target = pair("llama", "self")[0]
    guard = Guard(target)
    with pytest.raises(ValueError, match=pattern):
        specfx.speculate(target, draft=draft, compile=False)
    guard.check()


# --------------------------------------------------------------------------- compiled
@pytest.mark.compiled
@pytest.mark.full
@pytest.mark.ci
def test_compiled_prompt_lookup_round(one_thread):
    """One Inductor-compiled generator: greedy equality, one round graph and one prefill graph,
    no host-sync ops, and a warm call with another prompt compiles nothing."""
    target = _copying("llama")
    spec = specfx.speculate(target, num_speculative_tokens=4, compile=True, compile_prefill=True, background_compile=False)
    for seed in (0, 1):
        ids = _repeating_prompt(seed, length=14)
        assert torch.equal(spec.generate(ids, max_new_tokens=24), target.generate(ids, max_new_tokens=24))
        assert len(spec.graphs) == 2
    for g in spec.graphs:
        assert offending_nodes(g.graph_module) == []
    assert spec.stats.accepted > 0
