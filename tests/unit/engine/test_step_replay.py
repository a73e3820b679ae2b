"""Stopping criteria and streamers see exactly the calls transformers makes (issue 25, item 5).

HF's generate() emits one token per row per step; after each step it calls the stopping
criteria once with every row (``input_ids [B, S + t]``, finished rows extended with the pad
token when an EOS is configured) and then ``streamer.put(next_tokens [B])``. A round emits up
to K + 1 tokens per row, a different number per row; :class:`specfx.engine.step_replay.StepReplay`
replays HF's steps over them. Every test records each call (kind, the tensor, and for the
criteria the length of ``scores``) into one log, for HF's generate() and for specfx, and
compares the logs and outputs (greedy, eager rounds; the draft is a perturbed copy, so rows
accept different numbers of proposals per round).
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import specfx
from tests.conftest import pair, prompt

K = 4
S = 6

pytestmark = pytest.mark.usefixtures("one_thread")


def _speculate(**options):
    target, draft = pair("llama", "perturbed")
    return specfx.speculate(target, draft=draft, num_speculative_tokens=K, **{"compile": False, **options})


@pytest.fixture(scope="module")
def spec():
    return _speculate()


@pytest.fixture(scope="module")
def target(spec):
    return spec.model


class Log(list):
    """One log for every call, in the order made."""

    def entry(self, kind: str, tensor: torch.Tensor | None, extra=None):
        self.append((kind, None if tensor is None else tensor.detach().cpu().clone(), extra))


class Recorder(StoppingCriteria):
    """Records every call; stops a row whose last token is ``token``, and (stateful) every row
    at its ``after``-th call."""

    def __init__(self, log: Log, token: int | None = None, after: int | None = None, new=None):
        self.log, self.token, self.after, self.calls = log, token, after, 0
        self.new = new  # per row: stop once it has this many new tokens

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        self.log.entry("criteria", input_ids, None if scores is None else (len(scores), tuple(scores[-1].shape)))
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.token is not None:
            done |= input_ids[:, -1] == self.token
        if self.after is not None and self.calls >= self.after:
            done[:] = True
        if self.new is not None:
            done |= torch.tensor(self.new[: input_ids.shape[0]]) <= input_ids.shape[1] - S
        return done


class Streamer(BaseStreamer):
    def __init__(self, log: Log):
        self.log = log

    def put(self, value):
        self.log.entry("put", value, (value.dtype, value.device.type))

    def end(self):
        self.log.entry("end", None)


def _same_calls(hf: Log, ours: Log) -> None:
    assert [(k, e) for k, _, e in ours] == [(k, e) for k, _, e in hf]
    for (kind, a, _), (_, b, _) in zip(hf, ours, strict=True):
        assert (a is None and b is None) or (a.shape == b.shape and torch.equal(a, b)), kind


def _run(model, ids, make_criteria, stream: bool, **kw):
    log = Log()
    criteria = make_criteria(log)
    out = model.generate(ids, stopping_criteria=StoppingCriteriaList(criteria) if criteria else None,
                         streamer=Streamer(log) if stream else None, **kw)
    return out, log


def _free_run(target, ids, new):
    return target.generate(ids, max_new_tokens=new, eos_token_id=None, pad_token_id=0)


def _cases(free):
    """name -> (criteria factory, generate kwargs); tokens picked from the free run of row 0
    (batch 3: they end row 0 early, while the others go on or stop elsewhere)."""
    tok = lambda i: int(free[0, S + i])  # noqa: E731
    return {
        "never_stops": (lambda log: [Recorder(log)], dict(eos_token_id=None)),
        "token_with_eos": (lambda log: [Recorder(log, token=tok(6))], dict(eos_token_id=127)),
        "token_without_eos": (lambda log: [Recorder(log, token=tok(6))], dict(eos_token_id=None)),
        "eos_ends_a_row": (lambda log: [Recorder(log)], dict(eos_token_id=tok(5))),
        "stateful_after_9_calls": (lambda log: [Recorder(log, after=9)], dict(eos_token_id=None)),
        "two_criteria": (lambda log: [Recorder(log, token=tok(3)), Recorder(log, after=14)], dict(eos_token_id=None)),
        "first_token": (lambda log: [Recorder(log, token=tok(0))], dict(eos_token_id=2)),
        "rows_stop_apart_with_eos": (lambda log: [Recorder(log, new=[13, 5, 9])], dict(eos_token_id=127)),
        "rows_stop_apart_without_eos": (lambda log: [Recorder(log, new=[13, 5, 9])], dict(eos_token_id=None)),
    }


CASES = ["never_stops", "token_with_eos", "token_without_eos", "eos_ends_a_row", "stateful_after_9_calls",
         "two_criteria", "first_token", "rows_stop_apart_with_eos", "rows_stop_apart_without_eos"]


def _same_as_hf(spec, target, case: str, batch: int) -> Log:
    """Generate with HF and with specfx under ``case``: the same output and the same calls."""
    ids = prompt(S, batch=batch, seed=5)
    make, kw = _cases(_free_run(target, ids, 25))[case]
    kw = dict(max_new_tokens=20, pad_token_id=0, **kw)
    expected, hf_log = _run(target, ids, make, stream=True, **kw)
    got, log = _run(spec, ids, make, stream=True, **kw)
    assert torch.equal(got, expected)
    _same_calls(hf_log, log)
    return hf_log


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_criteria_and_streamer_calls_are_hfs(spec, target, batch, case):
    hf_log = _same_as_hf(spec, target, case, batch)
    assert sum(k == "criteria" for k, _, _ in hf_log) >= 1
    if batch == 3 and case == "never_stops":  # rows really advanced differently per round
        assert len(set(spec.stats.per_row_accepted)) > 1


@pytest.mark.parametrize("rounds_per_sync", [1, 3])
def test_criteria_calls_with_rounds_per_sync(target, rounds_per_sync):
    _same_as_hf(_speculate(rounds_per_sync=rounds_per_sync), target, "token_with_eos", 3)


def test_criteria_calls_with_a_captured_round(target):
    """The replay reads what the round graph returns: the same calls when the round is one
    Dynamo graph (specfx's passes, no Inductor) as when it runs eagerly."""
    spec = _speculate(compile=True, backend="specfx_eager")
    _same_as_hf(spec, target, "rows_stop_apart_without_eos", 3)
    assert len(spec.compile_events) == 1  # the round graph


@pytest.mark.parametrize("batch", [1, 2])
def test_criteria_get_hfs_scores_tuple(spec, target, batch):
    """With return_dict_in_generate and output_scores HF passes its growing tuple of [B, V]
    processed scores; for a row still generating the values are HF's (to float rounding)."""
    ids = prompt(S, batch=batch, seed=5)
    seen = {}

    class Keep(StoppingCriteria):
        def __init__(self, key):
            self.key = key

        def __call__(self, input_ids, scores, **kwargs):
            seen.setdefault(self.key, []).append((input_ids.clone(), tuple(s.clone() for s in scores)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    kw = dict(max_new_tokens=12, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    hf = target.generate(ids, stopping_criteria=StoppingCriteriaList([Keep("hf")]), **kw)
    out = spec.generate(ids, stopping_criteria=StoppingCriteriaList([Keep("spec")]), **kw)
    assert torch.equal(out.sequences, hf.sequences)
    assert len(seen["hf"]) == len(seen["spec"]) == 12
    for (ids_hf, scores_hf), (ids_spec, scores_spec) in zip(seen["hf"], seen["spec"], strict=True):
        assert torch.equal(ids_hf, ids_spec)
        assert len(scores_hf) == len(scores_spec) == ids_hf.shape[1] - S
        for a, b in zip(scores_hf, scores_spec, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_streamer_put_gets_one_token_per_step(spec, target):
    """A hand-written streamer doing int(value) after the prompt: HF sends one token at a time."""

    class IntStreamer(BaseStreamer):
        def __init__(self):
            self.prompt, self.tokens, self.ended = None, [], False

        def put(self, value):
            if self.prompt is None:
                self.prompt = value
            else:
                self.tokens.append(int(value))

        def end(self):
            self.ended = True

    ids = prompt(S, seed=0)
    hf, ours = IntStreamer(), IntStreamer()
    expected = target.generate(ids, max_new_tokens=20, streamer=hf)
    got = spec.generate(ids, max_new_tokens=20, streamer=ours)
    assert torch.equal(got, expected)
    assert ours.tokens == hf.tokens == expected[0, S:].tolist() and ours.ended
    assert spec.stats.emitted > spec.stats.rounds  # rounds did emit several tokens at once


def test_streamer_at_batch_2_gets_hfs_puts(spec, target):
    """HF's generate() streams any batch (put gets next_tokens [B]; finished rows get the pad);
    only its TextStreamer insists on one row."""
    ids = prompt(S, batch=2, seed=3)
    eos = int(_free_run(target, ids, 20)[1, S + 4])
    kw = dict(max_new_tokens=15, eos_token_id=eos, pad_token_id=0)
    expected, hf_log = _run(target, ids, lambda log: None, stream=True, **kw)
    got, log = _run(spec, ids, lambda log: None, stream=True, **kw)
    assert torch.equal(got, expected)
    _same_calls(hf_log, log)
    assert log[1][1].shape == (2,)
