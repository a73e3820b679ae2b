"""The cache's name on the installed transformers (``cache`` from 5.24 on, ``past_key_values``
before): resolved from the callable, never written by hand, and no deprecation from specfx.

On transformers 5.24 the old name still works through ``@deprecate_kwarg`` (a FutureWarning)
and ``ModelOutput.past_key_values`` (a logged deprecation); a decoder layer given the old name
takes it into ``**kwargs`` and silently runs without a cache. So every drafter's generate() runs
here with FutureWarning as an error and transformers' log captured.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings

import pytest
import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

import specfx
from specfx.drafters.heads.eagle import Eagle
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.drafters.heads.medusa import Medusa
from specfx.model.hf_names import CACHE_KWARGS, cache_kwarg, output_cache, output_cache_field
from specfx.testing.mtp import mtp_target
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import left_padded, pair


def _installed_name() -> str:
    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def test_the_name_is_read_from_each_callable():
    model = tiny_causal_lm("llama")
    name = _installed_name()
    assert cache_kwarg(model.forward) == name
    assert cache_kwarg(model) == name  # a module: its forward
    assert cache_kwarg(model.model.layers[0]) == name  # decoder layers were renamed too
    assert cache_kwarg(model.model.layers[0].self_attn) == name
    assert {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)} & set(CACHE_KWARGS) == {
        output_cache_field()
    }


def test_a_forward_without_a_cache_and_an_old_style_forward():
    def old(input_ids, past_key_values=None, **kwargs): ...

    def new(input_ids, cache=None, past_key_values=None): ...

    def none(input_ids, **kwargs): ...

    assert cache_kwarg(old) == "past_key_values"  # remote code on a new transformers
    assert cache_kwarg(new) == "cache"  # the new name wins where both exist
    assert cache_kwarg(none) is None


def _drafters(tmp_path):
    target, draft = pair("llama")
    eagle_dir, eagle3_dir, medusa_dir = (tmp_path / n for n in ("eagle", "eagle3", "medusa"))
    Eagle.random(target, seed=1).save(eagle_dir)
    Eagle3.random(target, draft_vocab_size=64, seed=1, layer_ids=[0, 1, 2]).save(eagle3_dir)
    config = target.config
    Medusa.random(config.hidden_size, config.vocab_size, num_heads=3, seed=1).save(medusa_dir)
    mtp, layers = mtp_target("deepseek_v3", 1)
    return [
        (target, draft),
        (target, "prompt_lookup"),
        (target, "lookahead"),
        (target, "early_exit:1"),
        (target, specfx.Eagle(eagle_dir)),
        (target, specfx.Eagle3(eagle3_dir)),
        (target, specfx.Medusa(medusa_dir)),
        (mtp, specfx.MTP(layers=layers)),
    ]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.full  # a warnings check on the newest transformers: CI's --full run
def test_no_deprecation_from_any_drafter(tmp_path, one_thread):
    """Every drafter, greedy and sampling, returning the cache: no FutureWarning, no logged
    deprecation, and the cache in the field the installed transformers names."""
    handler = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        for target, draft in _drafters(tmp_path):
            ids, mask = left_padded(8, [2, 0], seed=3)
            k = 4 if draft == "lookahead" else 2  # lookahead's own tree: K is its node count (pinned)
            spec = specfx.speculate(target, draft=draft, num_speculative_tokens=k, compile=False)
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                for sample in (False, True):
                    out = spec.generate(
                        ids, attention_mask=mask, max_new_tokens=6, do_sample=sample, return_dict_in_generate=True
                    )
                    assert output_cache(out) is getattr(out, output_cache_field())
                    assert output_cache(out).get_seq_length() == out.sequences.shape[1] - 1
    finally:
        hf_logger.removeHandler(handler)
    deprecations = [m for m in handler.messages if "deprecat" in m.lower()]
    assert not deprecations, deprecations


@pytest.mark.parametrize("name", CACHE_KWARGS)
def test_generate_refuses_either_cache_argument(name):
    target, draft = pair("llama")
    spec = specfx.speculate(target, draft=draft, compile=False)
    with pytest.raises(ValueError, match=rf"generate\(\): {name} is not supported: specfx owns the cache"):
        spec.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, **{name: object()})
