"""Exact rollback of recurrent / linear-attention state (specfx.model.recurrent, issue 29's
prototype): after a verify forward of K+1 inputs that accepts n, the state equals the state after
feeding exactly n+1 inputs, per row, on a gated-delta-net model (Qwen3-Next) and a Mamba2 model."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from specfx.model.hf_names import cache_kwarg
from specfx.model.mixer_calls import conv_state_after
from specfx.model.recurrent import MixerTaps, StateSnapshot, stateful_layers
from specfx.testing.tiny import STATEFUL_TINY, tiny_causal_lm

K = 4
TINY = {arch: STATEFUL_TINY[arch] for arch in ("qwen3_next", "mamba2")}
MIXERS = {"qwen3_next": "Qwen3NextGatedDeltaNet", "mamba2": "Mamba2Mixer"}


@pytest.fixture(scope="module", params=sorted(TINY))
def model(request):
    return tiny_causal_lm(request.param, **TINY[request.param])


def _cache_name(model) -> str:
    # Mamba2 takes ``cache_params`` before transformers 5.24 (specfx's cache_kwarg knows only the
    # names of attention models' caches)
    return cache_kwarg(model) or "cache_params"


def _fwd(model, ids, cache=None):
    name = _cache_name(model)
    out = model(input_ids=ids, use_cache=True, **({name: cache} if cache is not None else {}))
    return out.logits, getattr(out, name)


def _states(cache) -> list[torch.Tensor]:
    return [t.clone() for _, _, t in StateSnapshot(cache).tensors]


def _after(model, prompt, verify, n: int) -> list[torch.Tensor]:
    """The reference: the states after the prompt and exactly the first n+1 verify inputs."""
    _, cache = _fwd(model, prompt)
    _fwd(model, verify[:, : n + 1], cache)
    return _states(cache)


def _close(got, want, rtol=1e-5) -> bool:
    return all(float((g - w).abs().max()) <= rtol * float(w.abs().max()) for g, w in zip(got, want, strict=True))


def _inputs(model, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (batch, 12), generator=g)
    verify = torch.randint(3, model.config.vocab_size, (batch, K + 1), generator=g)
    return prompt, verify


def test_mixers_are_found_from_the_cache_layers(model):
    _, cache = _fwd(model, torch.tensor([[5, 6, 7]]))
    taps = MixerTaps(model, cache)
    assert [type(m).__name__ for m in taps.mixers] == [MIXERS[model.config.model_type]] * len(stateful_layers(cache))


@torch.no_grad()
def test_state_after_a_verify_forward_is_not_the_accepted_state(model):
    """The problem itself (and this file's check able to fail): without rollback the state has
    absorbed the rejected inputs."""
    prompt, verify = _inputs(model)
    _, cache = _fwd(model, prompt)
    _fwd(model, verify, cache)
    assert not _close(_states(cache), _after(model, prompt, verify, 1))
    assert _close(_states(cache), _after(model, prompt, verify, K))


@torch.no_grad()
@pytest.mark.parametrize("n", range(K + 1))
def test_conv_state_after_n_from_the_inputs_handed_to_the_cache(model, n):
    class Recording(DynamicCache):
        inputs: dict = {}

        def update_conv_state(self, conv_states, layer_idx, *args, **kwargs):
            self.inputs[layer_idx] = conv_states.clone()
            return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    prompt, verify = _inputs(model)
    cache = Recording(config=model.config)
    cache.inputs = {}
    _fwd(model, prompt, cache)
    old = {i: layer.conv_states[0].clone() for i, layer in stateful_layers(cache)}
    _fwd(model, verify, cache)
    _, ref = _fwd(model, prompt)
    _fwd(model, verify[:, : n + 1], ref)
    for i, layer in stateful_layers(ref):
        got = conv_state_after(old[i], cache.inputs[i], torch.tensor([n]))
        assert _close([got], [layer.conv_states[0]])


def _verified_and_restored(model, prompt, verify):
    """The cache after the prompt, a verify forward whose mixer inputs were recorded, and the
    restore of the pre-verify snapshot: what a rollback starts from."""
    _, cache = _fwd(model, prompt)
    snapshot = StateSnapshot(cache)
    taps = MixerTaps(model, cache)
    with taps.recording():
        _fwd(model, verify, cache)
    snapshot.restore()
    return cache, taps


@torch.no_grad()
@pytest.mark.parametrize("n", range(K + 1))
def test_mixer_replay_gives_the_state_after_n_plus_1_inputs(model, n):
    prompt, verify = _inputs(model)
    cache, taps = _verified_and_restored(model, prompt, verify)
    taps.replay(cache, n + 1)
    assert _close(_states(cache), _after(model, prompt, verify, n))


@torch.no_grad()
def test_mixer_steps_roll_back_each_row_to_its_own_n(model):
    """Fixed shapes, per-row n: K+1 single-position mixer calls with a predicated write."""
    prompt, verify = _inputs(model, batch=2)
    n = torch.tensor([1, 3])
    cache, taps = _verified_and_restored(model, prompt, verify)
    taps.replay_steps(cache, n, K + 1)
    got = _states(cache)
    for row in range(2):
        want = _after(model, prompt[row : row + 1], verify[row : row + 1], int(n[row]))
        assert _close([g[row : row + 1] for g in got], want, rtol=1e-4)


@torch.no_grad()
def test_mixer_steps_walk_the_inputs_of_several_forwards_in_order(model):
    """A stateful draft's round (decision 81): a two-token forward, then single ones, recorded
    together; the steps replay their columns in order, each row to its own n."""
    prompt, verify = _inputs(model, batch=2)
    n = torch.tensor([0, 3])
    _, cache = _fwd(model, prompt)
    snapshot = StateSnapshot(cache)
    taps = MixerTaps(model, cache)
    with taps.recording():
        for cols in (slice(0, 2), *(slice(t, t + 1) for t in range(2, K + 1))):
            _fwd(model, verify[:, cols], cache)
    assert [len(v) for v in taps.inputs.values()] == [K] * len(taps.mixers)
    snapshot.restore()
    taps.replay_steps(cache, n)  # every input recorded: K + 1
    got = _states(cache)
    for row in range(2):
        want = _after(model, prompt[row : row + 1], verify[row : row + 1], int(n[row]))
        assert _close([g[row : row + 1] for g in got], want, rtol=1e-4)


@torch.no_grad()
def test_restore_keeps_the_rows_it_is_told_to(model):
    prompt, verify = _inputs(model, batch=2)
    _, cache = _fwd(model, prompt)
    before = _states(cache)
    snapshot = StateSnapshot(cache)
    _fwd(model, verify, cache)
    after = _states(cache)
    snapshot.restore(keep=torch.tensor([True, False]))
    now = _states(cache)
    assert _close([t[:1] for t in now], [t[:1] for t in after])
    assert _close([t[1:] for t in now], [t[1:] for t in before])


def _slot_forward(model, cache, ids, positions, slots, real):
    """One forward the way specfx drives a model: KV at ``slots``, an explicit 4-D mask for the
    attention layers and the 2-D padding mask for the stateful ones
    (:func:`~specfx.model.recurrent.masks_with_state`)."""
    import inspect

    from specfx.model.masks import build_mask, check_attn_implementation
    from specfx.model.recurrent import masks_with_state

    cache.slots = slots
    pad = None if bool(real.all()) else real.long()  # [B, T]
    kv = build_mask(positions, cache.capacity, check_attn_implementation(model), model.dtype)
    mask = masks_with_state(model.config, kv, pad)
    kw = {"position_ids": positions} if "position_ids" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{_cache_name(model): cache}, **kw)
    return out.logits


def _full(model, seq) -> torch.Tensor:
    return model(input_ids=seq.unsqueeze(0)).logits[0]


@torch.no_grad()
def test_static_state_buffers_run_rounds_like_the_full_forward(model):
    """specfx's cache with static state layers (slot_cache_with_state), a left-padded batch of
    two, a verify forward of K+1, per-row acceptance n = [0, 2] rolled back by the mixers' single
    steps, then the next verify: every logit equals each row's own full forward over the tokens
    it committed."""
    from specfx.model.recurrent import slot_cache_with_state

    g = torch.Generator().manual_seed(3)
    vocab, cap = model.config.vocab_size, 64
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (7, 4)]
    cache = slot_cache_with_state(model.config, 2, cap, model.device)
    trash = torch.full((2, 1), cache.trash_slot)
    _slot_forward(model, cache, torch.zeros((2, 1), dtype=torch.long), torch.zeros_like(trash), trash, trash >= 0)
    for _, layer in stateful_layers(cache):
        layer.start()

    width = max(len(p) for p in prompts)
    # padding with a real token (not pad_token_id, whose embedding is zero): only the 2-D mask
    # keeps it out of the state
    ids = torch.stack([torch.cat([torch.full((width - len(p),), 5), p]) for p in prompts])
    real = torch.stack([torch.arange(width) >= width - len(p) for p in prompts])
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    logits = _slot_forward(model, cache, ids, positions, torch.where(real, positions, cache.trash_slot), real)
    for b, p in enumerate(prompts):
        assert _close([logits[b, -1]], [_full(model, p)[-1]], rtol=1e-4)

    lengths = torch.tensor([len(p) for p in prompts])
    committed = list(prompts)
    for n in (torch.tensor([0, 2]), torch.tensor([1, 1]), torch.tensor([K, 0])):
        pending = logits[:, -1].argmax(-1, keepdim=True)
        verify = torch.cat([pending, torch.randint(3, vocab, (2, K), generator=g)], 1)  # [B, K+1]
        positions = lengths.unsqueeze(1) + torch.arange(K + 1)
        snapshot = StateSnapshot(cache)
        taps = MixerTaps(model, cache)
        with taps.recording():
            logits = _slot_forward(model, cache, verify, positions, positions, positions >= 0)
        for b in range(2):
            want = _full(model, torch.cat([committed[b], verify[b]]))[-(K + 1) :]
            assert _close([logits[b]], [want], rtol=1e-4)
        snapshot.restore()
        taps.replay_steps(cache, n, K + 1)
        committed = [torch.cat([committed[b], verify[b, : int(n[b]) + 1]]) for b in range(2)]
        lengths = lengths + n + 1
        logits = logits.gather(1, n.view(2, 1, 1).expand(-1, 1, logits.shape[-1]))  # the last accepted column


@torch.no_grad()
def test_a_layer_holding_kv_and_state_keeps_both_and_replays_only_its_state_writer():
    """Falcon-H1: an attention and a Mamba2 module share each layer's index. specfx's cache layer
    keeps the KV at slots and the state (decision 79); the innermost modules with a state layer's
    index include the attention, so the mixers are the modules found writing state in a forward."""
    from specfx.model.architectures import ARCHITECTURES
    from specfx.model.recurrent import SlotStateLayer, slot_cache_with_state

    model = tiny_causal_lm("falcon_h1", **ARCHITECTURES["falcon_h1"].overrides)
    cache = slot_cache_with_state(model.config, 1, 16, model.device)
    assert all(isinstance(layer, SlotStateLayer) for layer in cache.layers)
    ids = torch.tensor([[5, 6, 7]])
    positions = torch.arange(3).unsqueeze(0)

    def run():
        _slot_forward(model, cache, ids, positions, positions, positions >= 0)

    run()
    assert {type(m).__name__ for m in MixerTaps(model, cache).mixers} == {"FalconH1Mixer", "FalconH1Attention"}
    assert [type(m).__name__ for m in MixerTaps(model, cache, run=run).mixers] == ["FalconH1Mixer"] * 2
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert cache.nbytes == kv + sum(t.nbytes for t in _states(cache)) > kv
