"""Heads on targets with hyper-connections (DeepSeek-V4, HY-V4: ``hc_mult`` streams between their
decoder layers). Between layers such a model carries ``[B, T, hc_mult, H]``, not one state per token:
a head reading intermediate layers (EAGLE-3, DFlash) is refused at ``speculate()`` with that cause (it
raised a RuntimeError inside the first forward before), so is EAGLE-1 (its layer is the target's own
layer class, which takes the streams), and Medusa, reading only the last hidden state (after the
model's own stream mixing and final norm), runs with greedy output equal to ``generate()``.
"""

import functools

import pytest
import torch

import specfx
from specfx.drafters.heads.dflash import DFlash
from specfx.drafters.heads.eagle import Eagle
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.drafters.heads.medusa import Medusa
from specfx.model.architectures import ARCHITECTURES, installed
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import prompt

ARCHS = [
    pytest.param(a, marks=pytest.mark.skipif(not installed(a), reason=f"model type {a!r} is not installed"))
    for a in ("deepseek_v4", "hy_v4")
]


@functools.cache
def _target(arch: str):
    m = tiny_causal_lm(arch, num_layers=3, **ARCHITECTURES[arch].overrides)
    m.generation_config.eos_token_id = None  # generate every token asked for
    return m


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "eagle"])
@torch.no_grad()
def test_heads_reading_the_streams_are_refused(arch, kind, one_thread):
    target = _target(arch)
    streams = target.config.get_text_config().hc_mult
    assert streams > 1  # the tiny config keeps the streams the refusal is about
    with pytest.raises(ValueError, match=rf"{streams} hyper-connection streams .*\[batch, tokens, {streams}, hidden\]"):
        if kind == "eagle":
            head = Eagle.random(target)
        elif kind == "eagle3":
            head = Eagle3.random(target, layer_ids=[0, 1, 2])
        else:
            head = DFlash.random(target, layer_ids=[0, 1])
        specfx.speculate(target, draft=head, num_speculative_tokens=3, compile=False)


@pytest.mark.full  # the default tier: the refusals
@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_medusa_reading_the_last_hidden_state_runs(arch, one_thread):
    target = _target(arch)
    tc = target.config.get_text_config()
    head = Medusa.random(tc.hidden_size, tc.vocab_size, num_heads=3)
    ids = prompt(8, seed=4)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    spec = specfx.speculate(target, draft=head, num_speculative_tokens=3, compile=False)
    assert torch.equal(spec.generate(ids, max_new_tokens=16, do_sample=False), expected)
    assert spec.stats.rounds > 0
