"""The generator stands in for the wrapped model: attributes, calling, and generate()'s HF
arguments, each compared with the target's own ``generate()`` (greedy, eager rounds)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import specfx
from tests.conftest import pair, prompt

K = 4
S = 6  # prompt length used throughout; prompt(S, seed=0) never hits the default EOS (2) in 40 tokens


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    return pair("llama", "perturbed")


@pytest.fixture(scope="module")
def target(models):
    return models[0]


@pytest.fixture(scope="module")
def spec(models):
    target, draft = models
    return specfx.speculate(target, draft=draft, num_speculative_tokens=K, compile=False)


@pytest.fixture(scope="module")
def ids():
    return prompt(S, seed=0)


@pytest.fixture(scope="module")
def free_run(target, ids):
    """40 greedy tokens with no EOS, to pick stop tokens the model really produces."""
    out = target.generate(ids, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == S + 40
    return out


def _first_index(row: torch.Tensor, tok: int) -> int:
    return int((row == tok).nonzero()[0, 0])


# --------------------------------------------------------------------------- the model facade
def test_config_device_generation_config_are_the_targets(spec, target):
    assert spec.config is target.config
    assert spec.model is target
    assert spec.device == target.device
    assert isinstance(spec.device, torch.device)
    assert spec.generation_config is target.generation_config


def test_attribute_forwarding(spec, target):
    assert spec.get_input_embeddings() is target.get_input_embeddings()
    assert spec.get_output_embeddings() is target.get_output_embeddings()
    assert spec.lm_head is target.lm_head
    assert spec.dtype == target.dtype
    assert spec.num_parameters() == target.num_parameters()
    assert spec.can_generate() == target.can_generate()
    with pytest.raises(AttributeError):
        spec.no_such_attribute_anywhere  # noqa: B018
    assert not hasattr(spec, "no_such_attribute_anywhere")


def test_call_returns_the_targets_logits(spec, target, ids):
    with torch.no_grad():
        expected = target(ids)
        got = spec(ids)
        assert type(got) is type(expected)
        assert torch.equal(got.logits, expected.logits)
        mask = torch.ones_like(ids)
        assert torch.equal(spec(input_ids=ids, attention_mask=mask).logits, target(input_ids=ids, attention_mask=mask).logits)


def test_target_forward_unchanged_by_generate(spec, target, ids):
    with torch.no_grad():
        before = target(ids).logits.clone()
    spec.generate(ids, max_new_tokens=15)
    with torch.no_grad():
        assert torch.equal(target(ids).logits, before)


def test_repr_and_explain_in_eager_mode(spec):
    r = repr(spec)
    assert "SpeculativeGenerator" in r
    assert "LlamaForCausalLM" in r
    assert f"K={K}" in r
    assert "draft_model" in r
    assert "eager" in r
    text = spec.explain()
    assert isinstance(text, str)
    assert text.splitlines()[0] == r
    assert "eager" in text.splitlines()[1]


# --------------------------------------------------------------------------- generate() signature
def test_generate_inputs_positional_keyword_and_input_ids(spec, target, ids):
    expected = target.generate(ids, max_new_tokens=12)
    assert torch.equal(target.generate(inputs=ids, max_new_tokens=12), expected)
    assert torch.equal(target.generate(input_ids=ids, max_new_tokens=12), expected)
    assert torch.equal(spec.generate(ids, max_new_tokens=12), expected)
    assert torch.equal(spec.generate(inputs=ids, max_new_tokens=12), expected)
    assert torch.equal(spec.generate(input_ids=ids, max_new_tokens=12), expected)
    mask = torch.ones_like(ids)
    assert torch.equal(
        spec.generate(ids, attention_mask=mask, max_new_tokens=12),
        target.generate(ids, attention_mask=mask, max_new_tokens=12),
    )


def test_output_is_a_long_tensor_on_the_models_device(spec, target, ids):
    out = spec.generate(ids, max_new_tokens=5)
    expected = target.generate(ids, max_new_tokens=5)
    assert out.dtype == expected.dtype == torch.long
    assert out.device == expected.device
    assert torch.equal(out, expected)


def test_return_dict_in_generate(spec, target, ids):
    plain = spec.generate(ids, max_new_tokens=9)
    hf = target.generate(ids, max_new_tokens=9, return_dict_in_generate=True)
    out = spec.generate(ids, max_new_tokens=9, return_dict_in_generate=True)
    assert type(out) is type(hf) is GenerateDecoderOnlyOutput
    assert torch.equal(out.sequences, plain)
    assert torch.equal(out["sequences"], plain)
    assert torch.equal(out.sequences, hf.sequences)
    assert out.scores is None and hf.scores is None


def test_return_dict_in_generate_from_generation_config(spec, target, ids):
    gc = GenerationConfig(max_new_tokens=7, return_dict_in_generate=True)
    hf = target.generate(ids, generation_config=gc)
    out = spec.generate(ids, generation_config=gc)
    assert type(out) is type(hf) is GenerateDecoderOnlyOutput
    assert out.sequences.shape[1] == S + 7
    assert torch.equal(out.sequences, hf.sequences)


@pytest.mark.parametrize(
    "make_config,extra",
    [
        (lambda eos: GenerationConfig(max_new_tokens=7), {}),
        (lambda eos: GenerationConfig(max_new_tokens=7, do_sample=False), {}),
        (lambda eos: GenerationConfig(max_new_tokens=30, eos_token_id=eos, pad_token_id=0), {}),
        (lambda eos: GenerationConfig(max_length=S + 11), {}),
        (lambda eos: GenerationConfig(max_new_tokens=7), {"max_new_tokens": 13}),
        (lambda eos: GenerationConfig(max_new_tokens=20, repetition_penalty=1.3), {}),
        (lambda eos: GenerationConfig(max_new_tokens=25, min_new_tokens=20, eos_token_id=eos), {}),
        (lambda eos: GenerationConfig(), {}),
    ],
    ids=["max_new_tokens", "explicit_greedy", "eos_and_pad", "max_length", "kwarg_overrides_config",
         "repetition_penalty", "min_new_tokens", "empty_config"],
)
def test_generation_config_argument(spec, target, ids, free_run, make_config, extra):
    eos = int(free_run[0, S + 10])
    gc = make_config(eos)
    before = gc.to_dict()
    expected = target.generate(ids, generation_config=gc, **extra)
    got = spec.generate(ids, generation_config=gc, **extra)
    assert torch.equal(got, expected)
    assert gc.to_dict() == before, "generate() must not modify the caller's GenerationConfig"


def test_changes_to_spec_generation_config_apply_like_hf(spec, target, ids):
    gc = spec.generation_config  # the target's own object
    saved = gc.max_new_tokens, gc.repetition_penalty
    try:
        gc.max_new_tokens, gc.repetition_penalty = 8, 1.4
        expected = target.generate(ids)
        assert expected.shape[1] == S + 8
        assert torch.equal(spec.generate(ids), expected)
    finally:
        gc.max_new_tokens, gc.repetition_penalty = saved


@pytest.mark.parametrize("max_length", [S + 1, S + 2, S + K + 1, S + 15, S + 33])
def test_max_length(spec, target, ids, max_length):
    expected = target.generate(ids, max_length=max_length)
    assert expected.shape[1] == max_length
    assert torch.equal(spec.generate(ids, max_length=max_length), expected)


def test_default_length_from_generation_config(spec, target, ids):
    assert torch.equal(spec.generate(ids), target.generate(ids))


@pytest.mark.parametrize("new", [1, 2, K, K + 1, 17])
def test_max_new_tokens(spec, target, ids, new):
    expected = target.generate(ids, max_new_tokens=new)
    assert expected.shape[1] == S + new
    assert torch.equal(spec.generate(ids, max_new_tokens=new), expected)


# --------------------------------------------------------------------------- eos / pad
@pytest.mark.parametrize("form", ["int", "list", "list_two", "tensor"])
def test_eos_token_id_int_and_list(spec, target, ids, free_run, form):
    eos = int(free_run[0, S + 10])
    other = int(free_run[0, S + 14])
    arg = {"int": eos, "list": [127, eos], "list_two": [other, eos], "tensor": torch.tensor([eos])}[form]
    expected = target.generate(ids, max_new_tokens=30, eos_token_id=arg)
    got = spec.generate(ids, max_new_tokens=30, eos_token_id=arg)
    assert torch.equal(got, expected)
    assert expected.shape[1] < S + 30  # it did stop early
    assert int(expected[0, -1]) in ([eos, other] if form == "list_two" else [eos])


def test_eos_disabled_with_none(spec, target, ids, free_run):
    eos = int(free_run[0, S + 10])
    target.generation_config.eos_token_id, saved = eos, target.generation_config.eos_token_id
    try:
        expected = target.generate(ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
        assert expected.shape[1] == S + 20
        assert torch.equal(spec.generate(ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0), expected)
    finally:
        target.generation_config.eos_token_id = saved


def _batch_with_early_eos(target):
    """Two unpadded rows where the model's default EOS (2) ends row 0 early and not row 1."""
    a = prompt(4, seed=3)  # greedy hits EOS at new token 15
    b = prompt(4, seed=0)
    ids = torch.cat([a, b])
    free = target.generate(ids, max_new_tokens=25, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 4 + 8])
    assert eos not in free[1, 4:].tolist() and eos not in free[0, 4 : 4 + 8].tolist()
    return ids, eos


@pytest.mark.parametrize("pad", [5, 0, None])
def test_pad_token_id_fills_finished_rows(spec, target, pad):
    ids, eos = _batch_with_early_eos(target)
    kw = dict(max_new_tokens=25, eos_token_id=eos, pad_token_id=pad)
    expected = target.generate(ids, **kw)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected)
    fill = eos if pad is None else pad
    assert expected[0, 4 + 9 :].tolist() == [fill] * (expected.shape[1] - 4 - 9)


# --------------------------------------------------------------------------- streamer
class Recorder(BaseStreamer):
    def __init__(self):
        self.events: list = []

    def put(self, value):
        self.events.append(("put", value.detach().cpu().clone()))

    def end(self):
        self.events.append(("end", None))

    @property
    def puts(self) -> list[torch.Tensor]:
        return [v for e, v in self.events if e == "put"]

    def generated(self) -> list[int]:
        return [t for v in self.puts[1:] for t in v.flatten().tolist()]


def _check_stream(rec: Recorder, ids: torch.Tensor, out: torch.Tensor) -> None:
    assert rec.events[-1] == ("end", None)
    assert [e for e, _ in rec.events].count("end") == 1
    assert rec.puts[0].tolist() == ids.tolist()  # the prompt first, as HF sends it ([1, S])
    assert rec.generated() == out[0, ids.shape[1] :].tolist()


STREAM_CASES = {
    "plain": dict(max_new_tokens=20),
    "one_token": dict(max_new_tokens=1),
    "eos": "eos",
    "stopping_criteria": "criteria",
}


@pytest.mark.parametrize("rounds_per_sync", [1, 3])
@pytest.mark.parametrize("case", list(STREAM_CASES))
def test_streamer_gets_prompt_then_exactly_the_generated_tokens(models, target, ids, free_run, case, rounds_per_sync):
    spec = specfx.speculate(models[0], draft=models[1], num_speculative_tokens=K, compile=False,
                            rounds_per_sync=rounds_per_sync)
    kw = STREAM_CASES[case]
    if kw == "eos":
        kw = dict(max_new_tokens=30, eos_token_id=int(free_run[0, S + 7]))
    elif kw == "criteria":
        kw = dict(max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopOnToken(int(free_run[0, S + 7]))]))
    hf_rec, rec = Recorder(), Recorder()
    expected = target.generate(ids, streamer=hf_rec, **kw)
    got = spec.generate(ids, streamer=rec, **kw)
    assert torch.equal(got, expected)
    _check_stream(hf_rec, ids, expected)  # the harness itself, on HF
    _check_stream(rec, ids, got)
    assert rec.generated() == hf_rec.generated()


# --------------------------------------------------------------------------- stopping criteria
class StopOnToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.length, dtype=torch.bool)


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _criteria_cases(free_run):
    tok = lambda i: int(free_run[0, S + i])  # noqa: E731
    return {
        "token_mid": [StopOnToken(tok(7))],
        "token_first": [StopOnToken(tok(0))],
        "token_second": [StopOnToken(tok(1))],
        "token_at_round_boundary": [StopOnToken(tok(K))],
        "length": [StopAtLength(S + 9)],
        "length_first_token": [StopAtLength(S + 1)],
        "token_or_length": [StopOnToken(tok(12)), StopAtLength(S + 9)],
        "never": [Never()],
    }


CRITERIA_NAMES = ["token_mid", "token_first", "token_second", "token_at_round_boundary", "length",
                  "length_first_token", "token_or_length", "never"]


@pytest.mark.parametrize("name", CRITERIA_NAMES)
def test_stopping_criteria_stop_where_hf_stops(spec, target, ids, free_run, name):
    criteria = _criteria_cases(free_run)[name]
    kw = dict(max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, stopping_criteria=StoppingCriteriaList(criteria), **kw)
    got = spec.generate(ids, stopping_criteria=StoppingCriteriaList(criteria), **kw)
    assert torch.equal(got, expected)
    if name != "never":
        assert expected.shape[1] < S + 30


def _batch_criteria(target):
    ids = prompt(5, batch=2, seed=9)
    free = target.generate(ids, max_new_tokens=25, eos_token_id=None, pad_token_id=0)
    assert 2 not in free[:, 5:].tolist()[0] + free[:, 5:].tolist()[1]  # the default EOS never comes
    tok = int(free[1, 5 + 6])  # ends row 1 early (row 0 never produces it)
    assert tok not in free[0, 5:].tolist() and tok not in free[1, 5 : 5 + 6].tolist()
    return ids, StoppingCriteriaList([StopOnToken(tok), StopAtLength(5 + 20)])


def test_stopping_criteria_batch(spec, target):
    # With an EOS configured (the model's default, 2), HF pads rows its criteria finished.
    ids, criteria = _batch_criteria(target)
    kw = dict(max_new_tokens=25, pad_token_id=0, stopping_criteria=criteria)
    expected = target.generate(ids, **kw)
    assert expected[1, 5 + 7 :].eq(0).all()  # row 1 padded after its stop token
    assert torch.equal(spec.generate(ids, **kw), expected)


def test_stopping_criteria_batch_without_eos(spec, target):
    # Without any EOS, HF's _sample does not pad rows the criteria finished: they keep
    # generating until every row is done, and so do specfx's (tests/unit/engine/test_step_replay.py).
    ids, criteria = _batch_criteria(target)
    kw = dict(max_new_tokens=25, eos_token_id=None, pad_token_id=0, stopping_criteria=criteria)
    expected = target.generate(ids, **kw)
    assert not expected[1, 5 + 7 :].eq(0).all()  # row 1 went on after its stop token
    assert torch.equal(spec.generate(ids, **kw), expected)


def test_stopping_criteria_and_eos_together(spec, target, ids, free_run):
    eos = int(free_run[0, S + 11])
    tok = int(free_run[0, S + 6])
    for stop, e in ((tok, eos), (eos, tok)):
        kw = dict(max_new_tokens=30, eos_token_id=e, stopping_criteria=StoppingCriteriaList([StopOnToken(stop)]))
        assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))


# --------------------------------------------------------------------------- stats
def _check_consistent(stats: specfx.SpecStats, k: int) -> None:
    assert 0 <= stats.accepted <= stats.proposed
    assert len(stats.per_position) == k
    assert sum(stats.per_position) == stats.accepted
    assert all(a >= b for a, b in zip(stats.per_position, stats.per_position[1:], strict=False))  # i+1 needs i
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.proposed if stats.proposed else 0.0)
    assert 0.0 <= stats.acceptance_rate <= 1.0
    row_rounds = stats.proposed / k
    assert stats.tokens_per_round == pytest.approx(stats.emitted / row_rounds if row_rounds else 0.0)
    assert row_rounds <= stats.emitted <= row_rounds * (k + 1)


@pytest.mark.parametrize("draft_kind", ["self", "perturbed", "small"])
def test_stats_consistent_batch_1(draft_kind):
    target, draft = pair("llama", draft_kind)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=K, compile=False)
    ids = prompt(S, seed=0)
    new = 23
    expected = target.generate(ids, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    out = spec.generate(ids, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, expected)
    st = spec.stats
    _check_consistent(st, K)
    assert st.emitted == out.shape[1] - S - 1 == new - 1  # the first token comes from prefill
    assert st.proposed == st.rounds * K
    assert st.tokens_per_round == pytest.approx(st.emitted / st.rounds)
    assert st.per_row_accepted == [st.accepted] and st.per_row_proposed == [st.proposed]
    if draft_kind == "self":
        assert st.acceptance_rate == 1.0
        assert st.per_position == [st.rounds] * K


def test_stats_reset_per_call_and_cumulative_accumulates(models):
    target, draft = models
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=K, compile=False)
    assert (spec.cumulative_stats.rounds, spec.cumulative_stats.proposed, spec.cumulative_stats.emitted) == (0, 0, 0)
    kw = dict(eos_token_id=None, pad_token_id=0)
    runs = []
    for seed, new in ((0, 25), (4, 9), (7, 1)):
        ids = prompt(S, seed=seed)
        out = spec.generate(ids, max_new_tokens=new, **kw)
        assert torch.equal(out, target.generate(ids, max_new_tokens=new, **kw))
        st = spec.stats
        _check_consistent(st, K)
        assert st.emitted == new - 1  # this call only
        runs.append(st)
    assert runs[-1].rounds == runs[-1].proposed == runs[-1].accepted == 0  # one token: prefill only
    assert runs[0] is not runs[1]  # a fresh object per call
    assert runs[0].emitted == 24 and runs[1].emitted == 8  # earlier snapshots not mutated later
    cum = spec.cumulative_stats
    assert cum.rounds == sum(r.rounds for r in runs)
    assert cum.proposed == sum(r.proposed for r in runs)
    assert cum.accepted == sum(r.accepted for r in runs)
    assert cum.emitted == sum(r.emitted for r in runs)
    assert cum.per_position == [sum(r.per_position[i] for r in runs) for i in range(K)]
    _check_consistent(cum, K)


def test_stats_batch_rows(models):
    target, draft = models
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=K, compile=False)
    ids = prompt(S, batch=3, seed=2)
    kw = dict(max_new_tokens=15, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    st = spec.stats
    _check_consistent(st, K)
    assert len(st.per_row_accepted) == len(st.per_row_proposed) == 3
    assert sum(st.per_row_accepted) == st.accepted
    assert sum(st.per_row_proposed) == st.proposed
    assert st.emitted == 3 * (15 - 1)
