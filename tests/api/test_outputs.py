"""``return_dict_in_generate=True`` outputs in HF's layout (issue 16, item 5).

The returned cache (``cache`` from transformers 5.24 on, ``past_key_values`` before) is
checked the way a user relies on it: continuing from it with the plain
model gives what continuing from HF's own returned cache gives.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

import specfx
from specfx.engine.outputs import build_output_cache, step_tuples
from specfx.model.architectures import ARCHITECTURES, installed
from specfx.model.cache import SlotCache
from specfx.model.hf_names import cache_kwarg, output_cache, output_cache_field
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import left_padded, pair, prompt

pytestmark = pytest.mark.usefixtures("one_thread")

_models = {}


def _model(arch):
    if arch not in _models:
        _models[arch] = tiny_causal_lm(arch, **ARCHITECTURES[arch].overrides)
    return _models[arch]


def _spec(model):
    return specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=3, compile=False)


def _continue(model, cache, sequences, mask, steps=2):
    """Greedy continuation from ``cache`` (which holds all but the last token of
    ``sequences``); returns the logits of each step ``[B, steps, V]``."""
    token = sequences[:, -1:]
    logits = []
    for _ in range(steps):
        out = model(token, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(logits, dim=1)


def _assert_same_continuation(model, ours, theirs, sequences, mask):
    assert type(ours) is DynamicCache
    assert [type(layer) for layer in ours.layers] == [type(layer) for layer in theirs.layers]
    assert ours.get_seq_length() == theirs.get_seq_length() == sequences.shape[1] - 1
    expected = _continue(model, theirs, sequences, mask)
    got = _continue(model, ours, sequences, mask)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def _batch(kind):
    if kind == "batch1":
        ids = prompt(7, seed=2)
        return ids, torch.ones_like(ids)
    if kind == "left_padded_batch3":  # batch bucket 4: the KV buffers hold an inert fourth row
        return left_padded(7, [3, 0, 1], seed=3)
    return left_padded(7, [3, 0], seed=3)


@pytest.mark.parametrize(
    "arch,kind",
    [
        ("llama", "batch1"),
        ("llama", "left_padded_batch2"),
        ("llama", "left_padded_batch3"),
        ("mistral", "left_padded_batch2"),  # sliding window 8, crossed by 7 + 14 tokens
        ("bloom", "left_padded_batch2"),  # ALiBi, rowwise protocol
        ("deepseek_v3", "left_padded_batch2"),  # latent attention: keys and values of different widths
        # sparse attention (decision 94): the indexer's keys are returned too, 21 tokens past its top-k of 8
        pytest.param(
            "deepseek_v32",
            "left_padded_batch2",
            marks=pytest.mark.skipif(not installed("deepseek_v32"), reason="not shipped by the installed transformers"),
        ),
    ],
)
def test_returned_cache_continue_like_hfs(arch, kind):
    model = _model(arch)
    ids, mask = _batch(kind)
    kw = dict(attention_mask=mask, max_new_tokens=14, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    hf = model.generate(ids, **kw)
    out = _spec(model).generate(ids, **kw)
    assert torch.equal(out.sequences, hf.sequences)
    full_mask = torch.cat([mask, torch.ones_like(hf.sequences[:, ids.shape[1] :])], dim=1)
    _assert_same_continuation(model, output_cache(out), output_cache(hf), out.sequences, full_mask)


def test_returned_cache_continue_with_generate():
    model = _model("llama")
    ids, mask = _batch("left_padded_batch2")
    kw = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    out = _spec(model).generate(ids, **kw)
    assert output_cache(out).get_seq_length() == out.sequences.shape[1] - 1
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :])], dim=1)
    more = dict(attention_mask=full_mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    continued = model.generate(out.sequences, **{output_cache_field(): output_cache(out)}, **more)
    assert torch.equal(continued, model.generate(out.sequences, **more))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_returned_cache_of_a_row_that_finished_early(arch):
    """Row 0 stops at an EOS; HF kept forwarding its pad tokens (mask 1) until row 1 ended,
    so its cache holds their KV, and continuing with the usual all-ones mask sees them."""
    model = _model(arch)
    ids, mask = _batch("left_padded_batch2")
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 7 + 4])
    assert eos not in free[1, 7:].tolist() and eos not in free[0, 7 : 7 + 4].tolist()
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=5, return_dict_in_generate=True)
    hf = model.generate(ids, **kw)
    out = _spec(model).generate(ids, **kw)
    assert torch.equal(out.sequences, hf.sequences) and int(out.sequences[0, -1]) == 5
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, 7:])], dim=1)
    _assert_same_continuation(model, output_cache(out), output_cache(hf), out.sequences, full_mask)


class _StopAtLength(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_returned_cache_stop_where_stopping_criteria_stop():
    """A criterion can cut a row inside a round: the cache must end where ``sequences`` ends."""
    model = _model("llama")
    ids, mask = _batch("batch1")
    kw = dict(max_new_tokens=20, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    hf = model.generate(ids, stopping_criteria=StoppingCriteriaList([_StopAtLength(7 + 9)]), **kw)
    out = _spec(model).generate(ids, stopping_criteria=StoppingCriteriaList([_StopAtLength(7 + 9)]), **kw)
    assert torch.equal(out.sequences, hf.sequences) and out.sequences.shape[1] == 7 + 9
    _assert_same_continuation(
        model, output_cache(out), output_cache(hf), out.sequences, torch.ones_like(out.sequences)
    )


# --------------------------------------------------------------------------- building blocks, by hand
def _slot_cache(batch, capacity, layers=2, heads=1, dim=1):
    """A SlotCache whose entry at slot s of row b holds 100 * (b + 1) + s."""
    cache = SlotCache(layers, batch, capacity, torch.device("cpu"))
    marks = 100 * (torch.arange(batch) + 1).view(batch, 1, 1, 1) + torch.arange(capacity).view(1, 1, capacity, 1)
    for layer in cache.layers:
        layer.keys = marks.expand(batch, heads, capacity, dim).float().clone()
        layer.values = -layer.keys
        layer.is_initialized = True
    return cache


def test_build_output_cache_layout():
    """Prompt width 4: row 0 has 2 real prompt tokens and 3 new, row 1 has 4 and 3 new; the
    sequences are 4 + 3 wide, so the cache holds 6 entries per row."""
    model = _model("llama")
    cache = _slot_cache(2, 16)
    sequences = torch.zeros(2, 7, dtype=torch.long)
    pkv = build_output_cache(model, cache, sequences, torch.tensor([2, 4]), torch.tensor([3, 3]))
    keys = pkv.layers[0].keys[:, 0, :, 0]
    assert keys.tolist() == [
        [0, 0, 100, 101, 102, 103],  # 2 pads (zeros), then prompt + new tokens but the last one
        [200, 201, 202, 203, 204, 205],
    ]
    assert torch.equal(pkv.layers[1].values, -pkv.layers[1].keys)


def test_build_output_cache_refuses_a_layer_count_mismatch():
    model = _model("llama")  # 2 layers
    with pytest.raises(ValueError, match=r"cannot return the cache .* 2 layers where specfx keeps 3"):
        build_output_cache(
            model,
            _slot_cache(1, 8, layers=3),
            torch.zeros(1, 3, dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([1]),
        )


def test_step_tuples_one_entry_per_step_zeros_after_a_row_ends():
    v = 5
    first = torch.arange(2 * v, dtype=torch.float).view(2, v)
    r1 = torch.full((2, 3, v), 1.0) + torch.arange(3).view(1, 3, 1) * 0.1
    r2 = torch.full((2, 3, v), 2.0) + torch.arange(3).view(1, 3, 1) * 0.1
    rounds = [(r1, torch.tensor([2, 1])), (r2, torch.tensor([1, 3]))]
    counts = torch.tensor([4, 3])  # row 1 emitted 1 + 1 + 3 but stopped (EOS) at its 3rd token
    steps = step_tuples(first, rounds, counts)
    assert len(steps) == 4 and all(s.shape == (2, v) for s in steps)
    row0 = [s[0, 0].item() for s in steps]
    row1 = [s[1, 0].item() for s in steps]
    assert row0 == pytest.approx([0.0, 1.0, 1.1, 2.0])
    assert row1 == pytest.approx([5.0, 1.0, 2.0, 0.0])  # the step after the row ended: zeros
    assert torch.equal(steps[3][1], torch.zeros(v))


# --------------------------------------------------------------------------- scores and logits
def _scores_call(model, ids, mask=None, **kw):
    return model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True,
                          output_logits=True, pad_token_id=0, **kw)


_OPTIONS = {
    "eager": dict(compile=False),
    "compiled": dict(backend="specfx_eager"),
    # the prompt is padded to a bucket of 16: those columns are not HF's padding
    "compiled_prefill": dict(backend="specfx_eager", compile_prefill=True),
}


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=pytest.mark.full) if v == "compiled_prefill" else v for v in _OPTIONS]
)
def test_output_scores_and_logits_equal_hf_greedy(variant):
    """HF's per-step processed scores and raw logits, from the logits the round verified; a
    row that finished early (EOS) has zeros past its end where HF has values of pad steps.
    With a repetition penalty and a left-padded row, HF's generate() counts the padding ids as
    seen up to transformers 5.22 and not from 5.23 on: the scores follow the installed one."""
    target, draft = pair("llama", "perturbed")
    options = _OPTIONS[variant]
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, **options)
    ids, mask = left_padded(9, [0, 4], seed=11)
    kw = dict(max_new_tokens=14, repetition_penalty=1.3)
    ours, hf = _scores_call(spec, ids, mask, **kw), _scores_call(target, ids, mask, **kw)
    assert torch.equal(ours.sequences, hf.sequences)
    assert len(ours.scores) == len(hf.scores) == len(ours.logits) == len(hf.logits) == 14
    for a, b in zip(ours.scores + ours.logits, hf.scores + hf.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    # an EOS mid-way: the row's entries after its end are zeros (pad-step convention)
    eos = int(hf.sequences[1, ids.shape[1] + 5])
    ours = _scores_call(spec, ids, mask, max_new_tokens=14, eos_token_id=eos)
    hf = _scores_call(target, ids, mask, max_new_tokens=14, eos_token_id=eos)
    assert torch.equal(ours.sequences, hf.sequences)
    ended = [int((ours.sequences[b, ids.shape[1]:] == eos).int().argmax()) + 1 if (ours.sequences[b, ids.shape[1]:] == eos).any() else 14 for b in range(2)]
    for step, (a, b) in enumerate(zip(ours.scores, hf.scores, strict=True)):
        for row in range(2):
            if step < ended[row]:
                assert torch.allclose(a[row], b[row], atol=1e-4, rtol=1e-4)
            else:
                assert not a[row].any()


def test_output_logits_when_sampling_are_the_models_logits():
    """Sampling: each step's raw logits are the model's own for the sampled prefix, and the
    scores carry the warpers (top-k leaves exactly k finite entries)."""
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    ids = prompt(7, seed=2)
    torch.manual_seed(0)
    out = _scores_call(spec, ids, max_new_tokens=8, do_sample=True, top_k=5, temperature=0.7)
    full = target(out.sequences).logits
    for step, logits in enumerate(out.logits):
        assert torch.allclose(logits, full[:, ids.shape[1] - 1 + step], atol=1e-4, rtol=1e-4)
    assert all(int(torch.isfinite(s).sum()) == 5 for s in out.scores)
