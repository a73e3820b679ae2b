"""The incremental-decoding probe (specfx.model.admission and specfx.model.probe, at ModelRunner() and allocate):
models specfx cannot run exactly are refused, at speculate() or when the buffers grow; models
it runs exactly are not."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specfx
from specfx.model.admission import check_incremental
from specfx.model.cache import SlotCache
from specfx.model.hf_names import cache_kwarg
from specfx.model.masks import MaskPlan
from specfx.model.probe import REL_TOL, STATE_TAIL, attention_spans, compare, probe_length
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import STATEFUL_TINY, perturbed_copy, tiny_causal_lm
from tests.conftest import prompt

REFUSED = r"does not decode incrementally like its full forward"


def _gpt_neo(window_size: int = 256):
    """The issue's GPT-Neo: alternating global/local layers; its local window is cut from the
    cache's key length (the buffer capacity), not from position_ids."""
    cfg = AutoConfig.for_model(
        "gpt_neo",
        vocab_size=99,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=window_size,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _perturb_incremental(model, fn):
    """Make ``model`` misbehave only when driven through specfx's cache: ``fn(cache, logits)``
    edits the logits in place. Returns the hook handle."""

    def hook(module, args, kwargs, output):
        cache = kwargs.get(cache_kwarg(module))
        if isinstance(cache, SlotCache):
            fn(cache, output.logits)

    return model.register_forward_hook(hook, with_kwargs=True)


def test_gpt_neo_refused_at_speculate(one_thread):
    """Regression: before the strict probe, speculate() accepted this model and generate()
    differed from model.generate() from new token 99 on (300 new tokens, 512-slot buffers)."""
    neo = _gpt_neo()
    with pytest.raises(ValueError, match=REFUSED + r".*at 512 slots.*GPT-Neo's local attention"):
        specfx.speculate(neo, draft="prompt_lookup", num_speculative_tokens=2, compile=False)


@pytest.mark.parametrize("window", [8, 100])
def test_gpt_neo_window_below_and_above_the_minimum_probe_refused(window, one_thread):
    """A window inside the minimum probe length, and one the probe must grow to cross."""
    with pytest.raises(ValueError, match=REFUSED):
        ModelRunner(_gpt_neo(window), "target")


def test_window_longer_than_the_minimum_probe_is_crossed_and_accepted(one_thread):
    """An exact model (Mistral's sliding window, built by specfx's masks) with a window of 100:
    the probe grows past it and accepts; greedy output past the window equals HF's."""
    target = tiny_causal_lm("mistral", sliding_window=100)
    runner = ModelRunner(target, "target")
    assert runner.probe_length > 100 and runner.probed_capacity == 256
    spec = specfx.speculate(target, draft=perturbed_copy(target, 0.03), num_speculative_tokens=3, compile=False)
    ids = prompt(12, seed=2)
    kw = dict(max_new_tokens=110, do_sample=False, eos_token_id=None)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))


def test_slightly_wrong_incremental_path_refused(one_thread):
    """Logits off by 0.1% of their scale keep every argmax (greedy output unchanged) but change
    the sampling distribution: refused. The old tolerance (10% of the logits' spread) let it
    through."""
    target = tiny_causal_lm("llama")
    handle = _perturb_incremental(target, lambda cache, logits: logits.mul_(1 + 1e-3))
    try:
        with pytest.raises(ValueError, match=REFUSED + r".*tolerance.*argmax different at 0"):
            ModelRunner(target, "target")
    finally:
        handle.remove()


def test_float_noise_below_the_tolerance_accepted(one_thread):
    """Negative control: a relative error of 1e-6 (summation-order noise) is not a refusal."""
    target = tiny_causal_lm("llama")
    handle = _perturb_incremental(target, lambda cache, logits: logits.mul_(1 + 1e-6))
    try:
        assert ModelRunner(target, "target").probed_capacity == 256
    finally:
        handle.remove()


def test_growth_past_every_probed_capacity_is_probed(one_thread):
    """A model exact at 256 slots but not at 512: accepted at speculate(), refused with a clear
    error when generate() grows the buffers, and still usable at the probed capacity after."""
    target = tiny_causal_lm("llama", max_positions=1024)

    def wrong_past_256(cache, logits):
        if cache.capacity > 256:
            logits[..., 5] += 10.0

    handle = _perturb_incremental(target, wrong_past_256)
    try:
        spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, compile=False)
        ids = prompt(10, seed=1)
        kw = dict(do_sample=False, eos_token_id=None)
        with pytest.raises(ValueError, match=REFUSED + r" when its KV buffers grew to 512 slots"):
            spec.generate(ids, max_new_tokens=300, **kw)
        assert spec.target_runner.probed_capacity == 256
        assert torch.equal(spec.generate(ids, max_new_tokens=20, **kw), target.generate(ids, max_new_tokens=20, **kw))
    finally:
        handle.remove()


def test_growth_probe_runs_once_per_new_capacity(one_thread):
    runner = ModelRunner(tiny_causal_lm("llama", max_positions=1024), "target")
    runner.allocate(2, 512)
    assert runner.probed_capacity == 512 and runner.cache.capacity == 512
    runner.allocate(1, 256)  # smaller than a probed capacity: no probe, new buffers
    assert runner.probed_capacity == 512 and runner.cache.capacity == 256


def test_attention_spans_from_config():
    """Spans come from the mask plan and from any window/chunk-size attribute of the config
    (GPT-Neo's window_size, Llama 4's attention_chunk_size); a disabled window is no span."""
    full = MaskPlan(("full", None), None)
    assert attention_spans(AutoConfig.for_model("gpt_neo", window_size=300), full) == [300]
    assert attention_spans(AutoConfig.for_model("llama4_text", attention_chunk_size=64), full) == [64]
    assert attention_spans(AutoConfig.for_model("qwen2", use_sliding_window=False), full) == []
    neo = AutoConfig.for_model("gpt_neo", window_size=300, max_position_embeddings=2048)
    assert probe_length(neo, full, 2048) == 308  # the verify-like tail straddles the window
    assert probe_length(neo, full, 200) == 200  # no position can cross more


def test_compare_near_tie_may_flip_but_errors_may_not():
    ref = torch.tensor([[5.0, 5.0 - 1e-5, 0.0]] * 4)  # [L=4, V=3], a near-tie at every position
    got = torch.cat([ref, ref[:1]])  # row 1 (PAD=3) covers the first L - 3 positions
    assert compare(got, ref, torch.float32) is None
    tie_flipped = got.clone()
    tie_flipped[:, 1] += 2e-5  # within the tolerance: the argmax may flip at a near-tie
    assert compare(tie_flipped, ref, torch.float32) is None
    off = got.clone()
    off[2, 2] += 5.0 * REL_TOL[torch.float32] * 2
    assert "1 of 5 positions over it" in compare(off, ref, torch.float32)
    nan = got.clone()
    nan[4, 0] = float("nan")
    assert "position 0 of row 1" in compare(nan, ref, torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_probe_compares_the_recurrent_state_itself(arch, one_thread):
    """A model with recurrent state passes the probe through its rollback (chunks rolled back to
    their accepted inputs, one rejected entirely). A rollback that undoes the last chunk, which no
    later logit reads, is still refused: the state at the end is compared with the model's own."""
    runner = ModelRunner(tiny_causal_lm(arch, **STATEFUL_TINY[arch]), "target")
    assert runner.probed_capacity > 0  # admitted
    real, calls = runner.roll_back_state, []

    def last_chunk_undone(n, tokens):
        calls.append(tokens)
        real(n * 0 if len(calls) == len(STATE_TAIL) else n, tokens)

    runner.roll_back_state = last_chunk_undone
    with pytest.raises(ValueError, match=REFUSED + r".*state tensor \d+ .*differs from the model's own state"):
        check_incremental(runner, runner.probed_capacity)
    assert len(calls) == len(STATE_TAIL)
