"""generate() arguments HF honours are honoured the same way (issue 16, items 3, 5 and 12).

Each accepted case is compared with the target's own ``generate()`` (greedy, eager rounds);
the refusals (NaN lengths, strings, fractional ids, ...) are in tests/api/test_bad_input.py, whose
cases also check that the model is left untouched.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import specfx
from specfx.request.inputs import infer_attention_mask
from specfx.testing.tiny import tiny_config
from tests.conftest import left_padded, pair, prompt

K = 3
S = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return pair("llama", "perturbed")[0]


@pytest.fixture(scope="module")
def spec(target):
    return specfx.speculate(target, draft=pair("llama", "perturbed")[1], num_speculative_tokens=K, compile=False)


@pytest.fixture(scope="module")
def ids():
    return prompt(S, seed=0)


@pytest.fixture(scope="module")
def free_run(target, ids):
    """30 greedy tokens with no EOS, to pick stop tokens the model really produces."""
    return target.generate(ids, max_new_tokens=30, eos_token_id=None, pad_token_id=0)


def _same_as_hf(spec, target, ids, **kw):
    expected = target.generate(ids, **kw)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected), (got, expected)
    return expected


# --------------------------------------------------------------------------- item 3: the inferred mask
def test_left_padded_batch_without_mask_matches_hf(spec, target):
    """No attention_mask: HF infers it from pad_token_id (0 here, not the EOS 2)."""
    ids, mask = left_padded(7, [3, 0], seed=4)
    out = _same_as_hf(spec, target, ids, max_new_tokens=12)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=12))


def test_explicit_pad_token_id_is_used_for_the_inferred_mask(spec, target):
    ids, _ = left_padded(7, [2, 0], seed=5)
    pad = next(t for t in range(3, 128) if t not in ids.tolist()[0] + ids.tolist()[1])
    ids = ids.masked_fill(ids == 0, pad)  # the padding is this token now, and 0 a real one
    ids[1, 3] = 0
    _same_as_hf(spec, target, ids, max_new_tokens=10, pad_token_id=pad)


@pytest.mark.parametrize("kw", [dict(pad_token_id=2), dict(eos_token_id=[5, 0])], ids=["pad_is_eos", "pad_in_eos_list"])
def test_no_mask_is_inferred_when_pad_is_an_eos_id(spec, target, kw):
    """HF attends to every token then (the pad could be a real EOS): so does specfx."""
    ids, _ = left_padded(7, [2, 0], seed=6)
    ids = ids.masked_fill(ids == 0, kw.get("pad_token_id", 0))
    out = _same_as_hf(spec, target, ids, max_new_tokens=10, **kw)
    attend_all = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, **kw)
    assert torch.equal(out, attend_all)


def _hf_inferred_mask(model, ids, **kw):
    gc, _ = model._prepare_generation_config(None, **kw)
    model._prepare_special_tokens(gc, False, device=ids.device, batch_size=ids.shape[0])
    return model._prepare_attention_mask_for_generation(ids, gc, {})


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(pad_token_id=7),
        dict(pad_token_id=None, eos_token_id=0),
        dict(pad_token_id=0, eos_token_id=[3, 0]),
        dict(pad_token_id=0, eos_token_id=torch.tensor([-1, 4])),
        dict(pad_token_id=0, eos_token_id=-1),
        dict(pad_token_id=0, eos_token_id=None),
    ],
)
def test_infer_attention_mask_is_hfs_rule(target, kw):
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 0, 9], [3, 4, 5, 6]])
    gc, _ = target._prepare_generation_config(None, **kw)
    pad = gc.pad_token_id
    eos = tuple(torch.as_tensor(gc.eos_token_id).flatten().tolist()) if gc.eos_token_id is not None else ()
    pad = eos[0] if pad is None and eos else pad
    assert torch.equal(infer_attention_mask(ids, pad, eos), _hf_inferred_mask(target, ids, **kw))


# --------------------------------------------------------------------------- item 5: HF idioms
@pytest.mark.parametrize("eos", [-1, [-1], torch.tensor([-1])])
def test_negative_eos_never_stops_as_in_hf(spec, target, ids, eos):
    out = _same_as_hf(spec, target, ids, max_new_tokens=15, eos_token_id=eos)
    assert out.shape[1] == S + 15


def test_negative_eos_beside_a_real_one_stops_on_the_real_one(spec, target, ids, free_run):
    stop = int(free_run[0, S + 5])
    out = _same_as_hf(spec, target, ids, max_new_tokens=20, eos_token_id=[-1, stop])
    assert int(out[0, -1]) == stop and out.shape[1] < S + 20


@pytest.mark.parametrize("keep", [0, 1, 4])
def test_logits_to_keep_int_changes_nothing(spec, target, ids, keep):
    _same_as_hf(spec, target, ids, max_new_tokens=8, logits_to_keep=keep)


# --------------------------------------------------------------------------- item 12: numeric arguments
@pytest.mark.parametrize(
    "kw,new",
    [
        (dict(max_new_tokens=10.5), 11),  # HF stops at the first length >= the bound
        (dict(max_new_tokens=10.0), 10),
        (dict(max_new_tokens=0.5), 1),
        (dict(max_new_tokens=np.int64(4)), 4),
        (dict(max_new_tokens=torch.tensor(4)), 4),
        (dict(max_length=S + 6.5), 7),
    ],
    ids=["10.5", "10.0", "0.5", "numpy", "tensor", "max_length_fractional"],
)
def test_numeric_lengths_as_hf(spec, target, ids, kw, new):
    out = _same_as_hf(spec, target, ids, eos_token_id=None, **kw)
    assert out.shape[1] == S + new


def test_lengths_from_a_generation_config_object(spec, target, ids):
    _same_as_hf(spec, target, ids, generation_config=GenerationConfig(max_new_tokens=7.5, eos_token_id=None))


@pytest.mark.parametrize("form", ["float", "float_list", "float_tensor"])
def test_whole_float_eos_is_the_token(spec, target, ids, free_run, form):
    stop = int(free_run[0, S + 4])
    arg = {"float": float(stop), "float_list": [float(stop)], "float_tensor": torch.tensor([float(stop)])}[form]
    out = _same_as_hf(spec, target, ids, max_new_tokens=20, eos_token_id=arg)
    assert int(out[0, -1]) == stop and out.shape[1] == S + 5


def test_sampling_values_are_ignored_when_greedy_as_in_hf(spec, target, ids):
    _same_as_hf(spec, target, ids, max_new_tokens=8, top_k=float("nan"), temperature=float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_float_and_bool_masks_of_zeros_and_ones(spec, target, dtype):
    ids, mask = left_padded(7, [3, 0], seed=8)
    kw = dict(max_new_tokens=10)
    expected = target.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(spec.generate(ids, attention_mask=mask.to(dtype), **kw), expected)


def test_draft_on_the_meta_device_is_refused(target):
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    with pytest.raises(ValueError, match=r"meta device"):
        specfx.speculate(target, draft=draft, compile=False)


def test_target_on_the_meta_device_is_refused():
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    with pytest.raises(ValueError, match=r"meta device"):
        specfx.speculate(target, draft="prompt_lookup", compile=False)


# --------------------------------------------------------------------------- issue 25 item 5: HF idioms
SAMPLING_ONLY = [dict(min_p=0.1), dict(typical_p=0.5), dict(epsilon_cutoff=0.1), dict(eta_cutoff=0.1), dict(top_h=0.5)]


@pytest.mark.parametrize("kw", SAMPLING_ONLY, ids=lambda kw: next(iter(kw)))
def test_sampling_only_warpers_are_ignored_when_greedy(spec, target, ids, kw):
    """HF builds these warpers only when sampling; greedy output is the same with or without them."""
    out = _same_as_hf(spec, target, ids, max_new_tokens=10, **kw)
    assert torch.equal(out, target.generate(ids, max_new_tokens=10))


@pytest.mark.parametrize("kw", SAMPLING_ONLY, ids=lambda kw: next(iter(kw)))
def test_sampling_only_warpers_from_the_models_generation_config(spec, target, ids, kw):
    """A checkpoint's generation_config.json often carries them; greedy calls must still run."""
    gc = target.generation_config
    (name, value), = kw.items()
    saved = getattr(gc, name)
    setattr(gc, name, value)
    try:
        _same_as_hf(spec, target, ids, max_new_tokens=10)
        _same_as_hf(spec, target, ids, max_new_tokens=10, do_sample=False)
    finally:
        setattr(gc, name, saved)


@pytest.mark.parametrize(
    "kw",
    [dict(suppress_tokens=[]), dict(begin_suppress_tokens=[]), dict(cache_implementation="dynamic")],
    ids=["suppress_tokens_empty", "begin_suppress_tokens_empty", "cache_implementation_dynamic"],
)
def test_settings_that_change_nothing_are_accepted(spec, target, ids, kw):
    out = _same_as_hf(spec, target, ids, max_new_tokens=10, **kw)
    assert torch.equal(out, target.generate(ids, max_new_tokens=10))


@pytest.mark.parametrize("name", ["output_hidden_states", "output_attentions"])
def test_output_hidden_states_and_attentions_without_a_dict_change_nothing(spec, target, ids, name):
    """HF computes them and drops them when return_dict_in_generate is off: the tensor is the same."""
    _same_as_hf(spec, target, ids, max_new_tokens=8, **{name: True})


def test_num_return_sequences_is_a_batch_of_each_prompt_repeated(spec, target):
    """HF repeats each prompt num_return_sequences times in a row (repeat_interleave); specfx runs
    that batch: the same layout as HF, and, seeded alike, exactly the batch written out by hand."""
    ids, mask = left_padded(7, [3, 0], seed=4)
    kw = dict(do_sample=True, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    hf = target.generate(ids, attention_mask=mask, num_return_sequences=3, **kw)
    torch.manual_seed(11)
    out = spec.generate(ids, attention_mask=mask, num_return_sequences=3, **kw)
    assert out.shape == hf.shape == (6, 7 + 12)
    assert torch.equal(out[:, :7], hf[:, :7]) and torch.equal(out[:, :7], ids.repeat_interleave(3, dim=0))
    torch.manual_seed(11)
    by_hand = spec.generate(ids.repeat_interleave(3, dim=0), attention_mask=mask.repeat_interleave(3, dim=0), **kw)
    assert torch.equal(out, by_hand)
    torch.manual_seed(11)
    assert torch.equal(spec.generate(ids, attention_mask=mask, num_return_sequences=3, **kw), out)  # seeded
    for group in out.view(2, 3, -1):  # samples of one prompt, each with its own random stream
        assert len({tuple(row[7:].tolist()) for row in group}) > 1


def test_num_return_sequences_samples_the_target_distribution(one_thread):
    """2000 sequences of one prompt against the exact distribution of their first two tokens."""
    from tests.lossless.test_lossless import V, _chisquare, _models

    target, draft = _models()
    prompt_ids = [1, 4, 2]
    probs = {}
    for seq in itertools.product(range(V), repeat=2):
        with torch.no_grad():
            logits = target(torch.tensor([prompt_ids + list(seq)])).logits[0, 2:4].float()
        probs[seq] = float(logits[0].softmax(-1)[seq[0]] * logits[1].softmax(-1)[seq[1]])
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=1, compile=False)
    torch.manual_seed(7)
    out = spec.generate(torch.tensor([prompt_ids]), do_sample=True, num_return_sequences=2000, max_new_tokens=2,
                        pad_token_id=0)
    assert out.shape == (2000, 5)
    assert spec.stats.accepted > 0 and spec.stats.accepted < spec.stats.proposed  # accept and correct both ran
    assert _chisquare(out[:, 3:].tolist(), probs) > 1e-3


# --------------------------------------------------------------------------- stop_strings with tokenizer=
def _tokenizer():
    """An offline tokenizer for the tiny models' 128 ids: special tokens 0-2, then one- and
    two-letter strings (a WordLevel model from the tokenizers library; nothing downloaded)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = [chr(97 + i) for i in range(26)] + [a + b for a in "abcde" for b in "fghijklmnopqrstuvwxyz"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{p: 3 + i for i, p in enumerate(pieces[:125])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # text encodes letter by letter
    tok.decoder = decoders.Fuse()  # tokens decode to their letters, concatenated
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _spanning_stop_string(tokenizer, ids: list[int], i: int) -> str:
    """The last letter of token i and the first of token i + 1: a stop string across two tokens."""
    a, b = tokenizer.convert_ids_to_tokens([ids[i], ids[i + 1]])
    return a[-1] + b[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_stop_strings_with_tokenizer_stop_where_hf_stops(spec, target, batch):
    tokenizer = _tokenizer()
    ids = prompt(S, batch=batch, seed=0)
    free = target.generate(ids, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    stop = _spanning_stop_string(tokenizer, free[0, S:].tolist(), 8)
    kw = dict(max_new_tokens=30, stop_strings=stop, tokenizer=tokenizer, pad_token_id=0)
    out = _same_as_hf(spec, target, ids, **kw)
    assert out.shape[1] < S + 30 and stop in tokenizer.decode(out[0, S:], skip_special_tokens=True)
    _same_as_hf(spec, target, ids, **{**kw, "stop_strings": [stop, "zz"], "eos_token_id": None})


def test_stop_strings_from_the_models_generation_config(spec, target, ids, free_run):
    tokenizer = _tokenizer()
    gc = target.generation_config
    gc.stop_strings = _spanning_stop_string(tokenizer, free_run[0, S:].tolist(), 5)
    try:
        out = _same_as_hf(spec, target, ids, max_new_tokens=30, tokenizer=tokenizer)
        assert out.shape[1] < S + 30
        with pytest.raises(ValueError, match=r"stop strings.*pass the model's tokenizer to the `tokenizer` argument"):
            spec.generate(ids, max_new_tokens=30)
    finally:
        gc.stop_strings = None


def test_tokenizer_without_stop_strings_changes_nothing(spec, target, ids):
    _same_as_hf(spec, target, ids, max_new_tokens=10, tokenizer=_tokenizer())


def test_text_streamer_prints_what_hf_prints(spec, target, ids, free_run):
    """transformers' TextIteratorStreamer decodes the puts as they come: the same text as HF's."""
    from transformers import TextIteratorStreamer

    tokenizer = _tokenizer()
    stop = _spanning_stop_string(tokenizer, free_run[0, S:].tolist(), 9)
    texts = []
    for model in (target, spec):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        model.generate(ids, max_new_tokens=30, stop_strings=stop, tokenizer=tokenizer, streamer=streamer)
        texts.append("".join(streamer))
    assert texts[0] == texts[1] and stop in texts[0]
