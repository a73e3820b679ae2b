"""Bad input raises a clear ValueError / TypeError and leaves the wrapped model untouched.

Every case checks, after the error, that the target's parameters and buffers are bit-identical,
that ``target.generate()`` returns what it returned before, and (for errors raised by a
generator that was already in use) that the generator itself still generates exactly that.
Eager mode only (compile=False).
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSeq2SeqLM,
    DynamicCache,
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer

import specfx
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import pair, prompt

VOCAB = 128
MAX_POS = 256
K_MAX = specfx.MAX_SPECULATIVE_TOKENS


# --------------------------------------------------------------------------- helpers
def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_same_state(model, snapshot) -> None:
    now = model.state_dict()
    assert list(now) == list(snapshot), "the set of parameters/buffers changed"
    for name, before in snapshot.items():
        after = now[name]
        assert after.dtype == before.dtype and after.device == before.device, name
        assert torch.equal(after, before), f"{name} changed"


_REFERENCE_IDS = prompt(6, seed=11, vocab=64)  # valid for every model used here (vocab 64 or 128)
_REFERENCE: dict[int, torch.Tensor] = {}


def _reference_output(model) -> torch.Tensor:
    """``model.generate(ids, max_new_tokens=10)`` recorded the first time the model is seen in
    this module, i.e. before any bad input reached it."""
    key = id(model)
    if key not in _REFERENCE:
        _REFERENCE[key] = model.generate(_REFERENCE_IDS, max_new_tokens=10)
    return _REFERENCE[key]


class Guard:
    """Record the target's (and others') state and greedy output; check both after the error."""

    def __init__(self, target, *others, spec=None):
        self.target = target
        self.models = (target, *others)
        self.snapshots = [_snapshot(m) for m in self.models]
        self.training = [m.training for m in self.models]
        self.gen_config = target.generation_config.to_dict()
        self.attn = target.config._attn_implementation
        self.ids = _REFERENCE_IDS
        self.expected = _reference_output(target)
        self.spec = spec

    def check(self) -> None:
        for model, snap, training in zip(self.models, self.snapshots, self.training, strict=False):
            _assert_same_state(model, snap)
            assert model.training == training
        assert self.target.generation_config.to_dict() == self.gen_config
        assert self.target.config._attn_implementation == self.attn
        assert torch.equal(self.target.generate(self.ids, max_new_tokens=10), self.expected)
        if self.spec is not None:  # the generator itself is not left broken either
            assert torch.equal(self.spec.generate(self.ids, max_new_tokens=10), self.expected)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    return pair("llama", "perturbed")


@pytest.fixture(scope="module")
def spec(models):
    target, draft = models
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=4, compile=False)
    # warm: state allocated and a call completed before any bad call reaches it
    assert torch.equal(spec.generate(_REFERENCE_IDS, max_new_tokens=10), _reference_output(target))
    return spec


def _t5():
    config = AutoConfig.for_model(
        "t5", d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=VOCAB
    )
    torch.manual_seed(0)
    return AutoModelForSeq2SeqLM.from_config(config).eval()


def _base_model(target):
    torch.manual_seed(0)
    return AutoModel.from_config(target.config).eval()


# --------------------------------------------------------------------------- speculate(): models
def test_draft_vocabulary_mismatch(models):
    target, _ = models
    small_vocab = tiny_causal_lm("llama", vocab_size=64)
    guard = Guard(target, small_vocab)
    with pytest.raises(ValueError, match=r"vocabular.*64.*128"):
        specfx.speculate(target, draft=small_vocab, num_speculative_tokens=4, compile=False)
    guard.check()


def test_target_vocabulary_smaller_than_draft(models):
    _, draft = models
    small_vocab = tiny_causal_lm("llama", vocab_size=64)
    guard = Guard(small_vocab, draft)
    with pytest.raises(ValueError, match=r"vocabular.*128.*64"):
        specfx.speculate(small_vocab, draft=draft, num_speculative_tokens=4, compile=False)
    guard.check()


NOT_CAUSAL_LM = {
    # name: (factory(target) -> object, exception, regex)
    "base_model_without_lm_head": (_base_model, ValueError, r"not a causal LM.*AutoModelForCausalLM"),
    "torch_linear": (lambda t: torch.nn.Linear(4, 4), TypeError, r"PreTrainedModel.*got Linear"),
    "none_object": (lambda t: object(), TypeError, r"PreTrainedModel.*got object"),
}


@pytest.mark.parametrize("kind", list(NOT_CAUSAL_LM))
def test_target_is_not_a_causal_lm(models, kind):
    target, draft = models
    factory, exc, pattern = NOT_CAUSAL_LM[kind]
    bad = factory(target)
    guard = Guard(target, draft)
    with pytest.raises(exc, match=r"^target.*" + pattern):
        specfx.speculate(bad, draft=draft, num_speculative_tokens=4, compile=False)
    guard.check()


@pytest.mark.parametrize("kind", list(NOT_CAUSAL_LM))
def test_draft_is_not_a_causal_lm(models, kind):
    target, _ = models
    factory, exc, pattern = NOT_CAUSAL_LM[kind]
    bad = factory(target)
    guard = Guard(target)
    with pytest.raises(exc, match=r"^draft.*" + pattern):
        specfx.speculate(target, draft=bad, num_speculative_tokens=4, compile=False)
    guard.check()


def test_draft_unknown_name(models):
    target, _ = models
    guard = Guard(target)
    with pytest.raises(ValueError, match=r"unknown drafter 'gpt2'.*draft model"):
        specfx.speculate(target, draft="gpt2", num_speculative_tokens=4, compile=False)
    guard.check()


def test_target_is_none(models):
    _, draft = models
    with pytest.raises(TypeError, match=r"target must be a transformers PreTrainedModel.*got NoneType"):
        specfx.speculate(None, draft=draft, num_speculative_tokens=4, compile=False)


def test_encoder_decoder_target(models):
    _, draft = models
    t5 = _t5()
    guard = Guard(draft, t5)
    with pytest.raises(ValueError, match=r"target .*T5ForConditionalGeneration.* encoder-decoder"):
        specfx.speculate(t5, draft=draft, num_speculative_tokens=4, compile=False)
    guard.check()


def test_encoder_decoder_draft(models):
    target, _ = models
    t5 = _t5()
    guard = Guard(target, t5)
    with pytest.raises(ValueError, match=r"draft .*T5ForConditionalGeneration.* encoder-decoder"):
        specfx.speculate(target, draft=t5, num_speculative_tokens=4, compile=False)
    guard.check()


# draft=None is not an error: the default drafter (tests/unit/drafters/test_prompt_lookup.py); nor is
# num_speculative_tokens=None: the default, "auto" (tests/unit/engine/test_auto_k.py).


# --------------------------------------------------------------------------- speculate(): K
@pytest.mark.parametrize(
    "k",
    [0, -1, 1.5, True, False, "4", 4.0, K_MAX + 1, 1000],
    ids=["zero", "negative", "float", "bool_true", "bool_false", "string", "float_integral", "above_max", "huge"],
)
def test_num_speculative_tokens_invalid(models, k):
    target, draft = models
    guard = Guard(target, draft)
    pattern = rf"num_speculative_tokens must be an int in \[1, {K_MAX}\], got {re.escape(repr(k))}"
    with pytest.raises(ValueError, match=pattern):
        specfx.speculate(target, draft=draft, num_speculative_tokens=k, compile=False)
    with pytest.raises(ValueError, match=pattern):
        specfx.SpecConfig(num_speculative_tokens=k, compile=False)
    guard.check()


@pytest.mark.parametrize("k", [1, K_MAX])
def test_num_speculative_tokens_bounds_accepted(models, k):
    target, draft = models
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=k, compile=False)
    ids = prompt(6, seed=3)
    assert torch.equal(spec.generate(ids, max_new_tokens=10), target.generate(ids, max_new_tokens=10))
    assert len(spec.stats.per_position) == k


# --------------------------------------------------------------------------- SpecConfig
SPEC_CONFIG_CASES = [
    # (kwargs, exception, regex)
    (dict(rounds_per_sync=0), ValueError, r"rounds_per_sync must be an int >= 1, got 0"),
    (dict(rounds_per_sync=-2), ValueError, r"rounds_per_sync must be an int >= 1, got -2"),
    (dict(rounds_per_sync=1.5), ValueError, r"rounds_per_sync must be an int >= 1, got 1.5"),
    (dict(rounds_per_sync=True), ValueError, r"rounds_per_sync must be an int >= 1, got True"),
    (dict(prefill_buckets=()), ValueError, r"prefill_buckets must be increasing positive ints"),
    (dict(prefill_buckets=(64, 16)), ValueError, r"prefill_buckets must be increasing positive ints"),
    (dict(prefill_buckets=(16, 16)), ValueError, r"prefill_buckets must be increasing positive ints"),
    (dict(prefill_buckets=(0, 16)), ValueError, r"prefill_buckets must be increasing positive ints"),
    (dict(prefill_buckets=(16.0, 64)), ValueError, r"prefill_buckets must be increasing positive ints"),
    (dict(min_capacity=4), ValueError, r"min_capacity must be an int >= 8, got 4"),
    (dict(min_capacity="256"), ValueError, r"min_capacity must be an int >= 8"),
    (dict(compile="yes"), TypeError, r"compile must be True or False, got 'yes'"),
    (dict(compile=1), TypeError, r"compile must be True or False, got 1"),
    (dict(compile=None), TypeError, r"compile must be True or False, got None"),
    (dict(backend=3), TypeError, r"backend must be a backend name or a callable, got 3"),
    (dict(num_speculative_tokens=0), ValueError, r"num_speculative_tokens must be an int"),
]


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    SPEC_CONFIG_CASES,
    ids=[f"{next(iter(kw))}={next(iter(kw.values()))!r}" for kw, _, _ in SPEC_CONFIG_CASES],
)
def test_spec_config_validation(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        specfx.SpecConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [c for c in SPEC_CONFIG_CASES if "compile" not in c[0] and "num_speculative_tokens" not in c[0]],
)
def test_speculate_forwards_spec_config_validation(models, kwargs, exc, pattern):
    target, draft = models
    guard = Guard(target, draft)
    with pytest.raises(exc, match=pattern):
        specfx.speculate(target, draft=draft, num_speculative_tokens=4, compile=False, **kwargs)
    guard.check()


def test_speculate_unknown_option(models):
    target, draft = models
    guard = Guard(target, draft)
    with pytest.raises(TypeError, match=r"unknown_option"):
        specfx.speculate(target, draft=draft, compile=False, unknown_option=1)
    guard.check()


def test_spec_config_is_frozen():
    config = specfx.SpecConfig(compile=False)
    with pytest.raises(Exception, match=r"cannot assign to field 'rounds_per_sync'"):
        config.rounds_per_sync = 0  # type: ignore[misc]


# --------------------------------------------------------------------------- generate(): prompts
class _Recorder(BaseStreamer):
    def __init__(self):
        self.values = []
        self.ended = 0

    def put(self, value):
        self.values.append(value)

    def end(self):
        self.ended += 1


def _ids(length=6, seed=0, batch=1):
    return prompt(length, batch=batch, seed=seed)


def _mask_right_padded():
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, -2:] = 0
    return mask


def _mask_middle_hole():
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 2] = 0
    return mask


# name -> (callable(spec, draft) performing the bad call, exception, regex)
GENERATE_CASES = {
    # prompts
    "empty_prompt": (lambda s, d: s.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=5),
                     ValueError, r"prompt is empty \(shape \(1, 0\)\)"),
    "empty_batch": (lambda s, d: s.generate(torch.zeros((0, 6), dtype=torch.long), max_new_tokens=5),
                    ValueError, r"prompt is empty"),
    "float_ids": (lambda s, d: s.generate(_ids().float(), max_new_tokens=5),
                  TypeError, r"input_ids must hold integer token ids, got dtype torch.float32"),
    "bool_ids": (lambda s, d: s.generate(_ids().bool(), max_new_tokens=5),
                 TypeError, r"input_ids must hold integer token ids, got dtype torch.bool"),
    "ids_as_list": (lambda s, d: s.generate(_ids().tolist(), max_new_tokens=5),
                    TypeError, r"input_ids must be a torch.LongTensor .*got list"),
    "ids_3d": (lambda s, d: s.generate(_ids().unsqueeze(0), max_new_tokens=5),
               ValueError, r"input_ids must be \[batch, length\], got shape \(1, 1, 6\)"),
    "id_equal_to_vocab": (lambda s, d: s.generate(torch.tensor([[5, 9, VOCAB]]), max_new_tokens=5),
                          ValueError, rf"token id {VOCAB} is outside the model's vocabulary \[0, {VOCAB}\)"),
    "id_far_above_vocab": (lambda s, d: s.generate(torch.tensor([[5, 100000, 9]]), max_new_tokens=5),
                           ValueError, rf"token id 100000 is outside the model's vocabulary \[0, {VOCAB}\)"),
    "negative_id": (lambda s, d: s.generate(torch.tensor([[5, -1, 9]]), max_new_tokens=5),
                    ValueError, rf"token id -1 is outside the model's vocabulary \[0, {VOCAB}\)"),
    "no_prompt": (lambda s, d: s.generate(max_new_tokens=5),
                  ValueError, r"input_ids is required"),
    "prompt_given_twice": (lambda s, d: s.generate(_ids(), input_ids=_ids(), max_new_tokens=5),
                           ValueError, r"either positionally or as input_ids="),
    "inputs_embeds": (lambda s, d: s.generate(inputs_embeds=torch.zeros(1, 6, 64), max_new_tokens=5),
                      ValueError, r"inputs_embeds is not supported"),
    # lengths
    "prompt_plus_new_exceeds_max_positions": (
        lambda s, d: s.generate(_ids(250), max_new_tokens=7),
        ValueError, rf"250.*7.*257 exceeds the model's max_position_embeddings={MAX_POS}"),
    "prompt_alone_exceeds_max_positions": (
        lambda s, d: s.generate(_ids(MAX_POS + 1), max_new_tokens=1),
        ValueError, rf"exceeds the model's max_position_embeddings={MAX_POS}"),
    "max_length_exceeds_max_positions": (
        lambda s, d: s.generate(_ids(), max_length=300),
        ValueError, rf"300 exceeds the model's max_position_embeddings={MAX_POS}"),
    "max_new_tokens_negative": (lambda s, d: s.generate(_ids(), max_new_tokens=-1),
                                ValueError, r"max_new_tokens.*-1"),
    "max_new_tokens_zero": (lambda s, d: s.generate(_ids(), max_new_tokens=0),
                            ValueError, r"max_new_tokens.*0"),
    "max_length_equal_to_prompt": (lambda s, d: s.generate(_ids(), max_length=6),
                                   ValueError, r"max_length.* 6"),
    "max_length_below_prompt": (lambda s, d: s.generate(_ids(), max_length=3),
                                ValueError, r"max_length.* 3"),
    # sampling parameters
    "temperature_zero_sampling": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, temperature=0.0),
                                  ValueError, r"temperature.*> 0.*got 0.0"),
    "temperature_negative_sampling": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, temperature=-0.5),
                                      ValueError, r"temperature.*> 0.*got -0.5"),
    "temperature_nan_sampling": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, temperature=float("nan")),
                                 ValueError, r"temperature.*nan"),
    "top_p_zero": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, top_p=0.0),
                   ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    "top_p_above_one": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, top_p=1.5),
                        ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    "top_p_negative": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, top_p=-0.1),
                       ValueError, r"top_p must be in \(0, 1\], got -0.1"),
    "top_k_negative": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, top_k=-1),
                       ValueError, r"top_k.*-1"),
    "repetition_penalty_zero": (lambda s, d: s.generate(_ids(), max_new_tokens=5, repetition_penalty=0.0),
                                ValueError, r"repetition_penalty must be > 0, got 0.0"),
    "repetition_penalty_negative": (lambda s, d: s.generate(_ids(), max_new_tokens=5, repetition_penalty=-1.0),
                                    ValueError, r"repetition_penalty must be > 0, got -1.0"),
    "eos_outside_vocab": (lambda s, d: s.generate(_ids(), max_new_tokens=5, eos_token_id=VOCAB),
                          ValueError, rf"eos_token_id {VOCAB} is outside the vocabulary"),
    # unknown arguments
    "unknown_kwarg": (lambda s, d: s.generate(_ids(), max_new_tokens=5, foo=1),
                      TypeError, r"unexpected or unsupported argument\(s\) \['foo'\]"),
    "misspelled_max_new_tokens": (lambda s, d: s.generate(_ids(), max_new_token=5),
                                  TypeError, r"\['max_new_token'\]"),
    # unsupported features
    "num_beams": (lambda s, d: s.generate(_ids(), max_new_tokens=5, num_beams=2),
                  ValueError, r"num_beams=2 is not supported"),
    "num_return_sequences_greedy": (lambda s, d: s.generate(_ids(), max_new_tokens=5, num_return_sequences=2),
                                    ValueError, r"num_return_sequences"),
    "no_repeat_ngram_size": (lambda s, d: s.generate(_ids(), max_new_tokens=5, no_repeat_ngram_size=2),
                             ValueError, r"no_repeat_ngram_size=2 is not supported"),
    # sampling-only warpers are ignored when greedy (as HF does) but refused when sampling
    "min_p_sampling": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, min_p=0.1),
                       ValueError, r"min_p=0.1 is not supported"),
    "typical_p_sampling": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, typical_p=0.5),
                           ValueError, r"typical_p=0.5 is not supported"),
    "suppress_tokens_not_empty": (lambda s, d: s.generate(_ids(), max_new_tokens=5, suppress_tokens=[7]),
                                  ValueError, r"suppress_tokens=\[7\] is not supported"),
    "cache_implementation_static": (lambda s, d: s.generate(_ids(), max_new_tokens=5, cache_implementation="static"),
                                    ValueError, r"cache_implementation='static' is not supported"),
    "token_healing": (lambda s, d: s.generate(_ids(), max_new_tokens=5, token_healing=True),
                      ValueError, r"token_healing=True is not supported"),
    "output_hidden_states_returned": (
        lambda s, d: s.generate(_ids(), max_new_tokens=5, output_hidden_states=True, return_dict_in_generate=True),
        ValueError, r"output_hidden_states=True is not supported: specfx does not return"),
    "output_attentions_returned": (
        lambda s, d: s.generate(_ids(), max_new_tokens=5, output_attentions=True, return_dict_in_generate=True),
        ValueError, r"output_attentions=True is not supported: specfx does not return"),
    "logits_processor": (
        lambda s, d: s.generate(_ids(), max_new_tokens=5,
                                logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])),
        ValueError, r"logits_processor is not supported"),
    "assistant_model": (lambda s, d: s.generate(_ids(), max_new_tokens=5, assistant_model=d),
                        ValueError, r"assistant_model is not supported.*draft="),
    "prefix_allowed_tokens_fn": (
        lambda s, d: s.generate(_ids(), max_new_tokens=5, prefix_allowed_tokens_fn=lambda b, ids: [3]),
        ValueError, r"prefix_allowed_tokens_fn is not supported"),
    # a cache to continue from: HF's argument is `cache` from transformers 5.24 on, `past_key_values` before
    "cache": (lambda s, d: s.generate(_ids(), max_new_tokens=5, cache=DynamicCache()),
              ValueError, r"generate\(\): cache is not supported: specfx owns the cache"),
    "past_key_values": (lambda s, d: s.generate(_ids(), max_new_tokens=5, past_key_values=DynamicCache()),
                        ValueError, r"generate\(\): past_key_values is not supported: specfx owns the cache"),
    # attention masks
    "attention_mask_right_padding": (
        lambda s, d: s.generate(_ids(), attention_mask=_mask_right_padded(), max_new_tokens=5),
        ValueError, r"left-padded"),
    "attention_mask_hole_in_the_middle": (
        lambda s, d: s.generate(_ids(), attention_mask=_mask_middle_hole(), max_new_tokens=5),
        ValueError, r"left-padded"),
    "attention_mask_wrong_length": (
        lambda s, d: s.generate(_ids(), attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=5),
        ValueError, r"attention_mask must be a tensor shaped like input_ids \(1, 6\)"),
    "attention_mask_wrong_batch": (
        lambda s, d: s.generate(_ids(), attention_mask=torch.ones(2, 6, dtype=torch.long), max_new_tokens=5),
        ValueError, r"attention_mask must be a tensor shaped like input_ids \(1, 6\)"),
    "attention_mask_as_list": (
        lambda s, d: s.generate(_ids(), attention_mask=[[1] * 6], max_new_tokens=5),
        ValueError, r"attention_mask must be a tensor shaped like input_ids"),
    "attention_mask_not_binary": (
        lambda s, d: s.generate(_ids(), attention_mask=torch.full((1, 6), 2), max_new_tokens=5),
        ValueError, r"attention_mask must hold only 0 and 1"),
    "attention_mask_row_all_zero": (
        lambda s, d: s.generate(_ids(batch=2), attention_mask=torch.tensor([[1] * 6, [0] * 6]), max_new_tokens=5),
        ValueError, r"no real tokens"),
    "attention_mask_fractional": (  # HF would use 0.9 as fractional positions: refused, not truncated to 0
        lambda s, d: s.generate(_ids(), attention_mask=torch.full((1, 6), 0.9), max_new_tokens=5),
        ValueError, r"attention_mask must hold only 0 and 1 .*got 0\.9"),
    "inferred_mask_not_left_padded": (  # no mask: pad id 0 inside the prompt makes HF's inferred mask a hole
        lambda s, d: s.generate(torch.tensor([[5, 0, 9, 7]]), max_new_tokens=5),
        ValueError, r"left-padded.*inferred from pad_token_id=0"),
    "inferred_mask_row_all_padding": (
        lambda s, d: s.generate(torch.tensor([[5, 6, 9], [0, 0, 0]]), max_new_tokens=5),
        ValueError, r"no real tokens.*inferred from pad_token_id=0"),
    # argument types and values (HF: raw Python/torch errors, or runs on a meaningless value)
    "max_new_tokens_nan": (lambda s, d: s.generate(_ids(), max_new_tokens=float("nan")),
                           ValueError, r"max_new_tokens must be a finite number of tokens, got nan"),
    "max_new_tokens_inf": (lambda s, d: s.generate(_ids(), max_new_tokens=float("inf")),
                           ValueError, r"max_new_tokens must be a finite number of tokens, got inf"),
    "max_length_nan": (lambda s, d: s.generate(_ids(), max_length=float("nan")),
                       ValueError, r"max_length must be a finite number of tokens"),
    "max_new_tokens_str": (lambda s, d: s.generate(_ids(), max_new_tokens="10"),
                           TypeError, r"max_new_tokens must be a number, got str '10'"),
    "max_new_tokens_tensor_of_two": (lambda s, d: s.generate(_ids(), max_new_tokens=torch.tensor([3, 4])),
                                     TypeError, r"max_new_tokens must be a single number"),
    "min_new_tokens_fractional": (lambda s, d: s.generate(_ids(), max_new_tokens=5, min_new_tokens=2.5),
                                  ValueError, r"min_new_tokens must be a non-negative integer, got 2.5"),
    "min_length_str": (lambda s, d: s.generate(_ids(), max_new_tokens=5, min_length="8"),
                       TypeError, r"min_length must be an int, got str"),
    "eos_fractional": (lambda s, d: s.generate(_ids(), max_new_tokens=5, eos_token_id=66.5),
                       ValueError, r"eos_token_id must hold whole token ids, got 66.5"),
    "eos_nan": (lambda s, d: s.generate(_ids(), max_new_tokens=5, eos_token_id=float("nan")),
                ValueError, r"eos_token_id must hold whole token ids, got nan"),
    "eos_str": (lambda s, d: s.generate(_ids(), max_new_tokens=5, eos_token_id="2"),
                TypeError, r"eos_token_id must be a number, got str"),
    "pad_fractional": (lambda s, d: s.generate(_ids(), max_new_tokens=5, pad_token_id=0.5),
                       ValueError, r"pad_token_id must hold whole token ids, got 0.5"),
    "top_k_nan": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, top_k=float("nan")),
                  ValueError, r"top_k must be a whole number >= 0 .*got nan"),
    "top_k_fractional": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, top_k=2.5),
                         ValueError, r"top_k must be a whole number >= 0 .*got 2.5"),
    "top_k_str": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, top_k="4"),
                  TypeError, r"top_k must be an int, got str"),
    "temperature_str": (lambda s, d: s.generate(_ids(), max_new_tokens=5, do_sample=True, temperature="0.5"),
                        TypeError, r"temperature must be a number, got str"),
    "repetition_penalty_str": (lambda s, d: s.generate(_ids(), max_new_tokens=5, repetition_penalty="1.2"),
                               TypeError, r"repetition_penalty must be a number, got str"),
    "max_time_str": (lambda s, d: s.generate(_ids(), max_new_tokens=5, max_time="1"),
                     TypeError, r"max_time must be a number, got str"),
    "generation_config_dict": (lambda s, d: s.generate(_ids(), generation_config={"max_new_tokens": 3}),
                               TypeError, r"generation_config must be a transformers.GenerationConfig, got dict"),
    "logits_to_keep_tensor": (lambda s, d: s.generate(_ids(), max_new_tokens=5, logits_to_keep=torch.tensor([0])),
                              ValueError, r"logits_to_keep=.* is not supported"),
    "logits_to_keep_negative": (lambda s, d: s.generate(_ids(), max_new_tokens=5, logits_to_keep=-1),
                                ValueError, r"logits_to_keep=-1 is not supported"),
    # stopping criteria transformers would use instead of its own max length / EOS
    "max_length_criteria_beyond_max_length": (
        lambda s, d: s.generate(_ids(), max_new_tokens=5, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(40)])),
        ValueError, r"MaxLengthCriteria\(max_length=40\), which transformers uses instead of its own max_length=11"),
    "eos_criteria_without_the_eos_ids": (
        lambda s, d: s.generate(_ids(), max_new_tokens=5, eos_token_id=2,
                                stopping_criteria=StoppingCriteriaList([EosTokenCriteria(7)])),
        ValueError, r"EosTokenCriteria without every eos_token_id \[2\]"),
    "criteria_with_eos_attribute_and_no_pad": (
        lambda s, d: s.generate(_ids(), max_new_tokens=5, eos_token_id=None, pad_token_id=None,
                                stopping_criteria=StoppingCriteriaList([EosTokenCriteria(7)])),
        ValueError, r"a stopping criterion has an eos_token_id, .* Pass pad_token_id="),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_rejects(models, spec, case):
    target, draft = models
    call, exc, pattern = GENERATE_CASES[case]
    guard = Guard(target, draft, spec=spec)
    with pytest.raises(exc, match=pattern):
        call(spec, draft)
    guard.check()


def test_streamer_untouched_when_rejected(models, spec):
    target, draft = models
    guard = Guard(target, draft, spec=spec)
    streamer = _Recorder()
    with pytest.raises(ValueError, match=r"num_beams=2 is not supported"):
        spec.generate(_ids(batch=2), streamer=streamer, max_new_tokens=5, num_beams=2)
    assert streamer.values == [] and streamer.ended == 0
    guard.check()


def test_rejected_call_keeps_stats(models, spec):
    target, draft = models
    ids = _ids(seed=5)
    spec.generate(ids, max_new_tokens=12)
    stats, cumulative = repr(spec.stats), repr(spec.cumulative_stats)
    with pytest.raises(ValueError, match=r"num_beams=2 is not supported"):
        spec.generate(ids, max_new_tokens=12, num_beams=2)
    assert repr(spec.stats) == stats
    assert repr(spec.cumulative_stats) == cumulative


def test_boundary_prompt_plus_new_equal_to_max_positions_is_accepted(models, spec):
    target, _ = models
    ids = _ids(MAX_POS - 6, seed=2)
    expected = target.generate(ids, max_new_tokens=6, eos_token_id=None)
    assert expected.shape[1] == MAX_POS
    assert torch.equal(spec.generate(ids, max_new_tokens=6, eos_token_id=None), expected)
