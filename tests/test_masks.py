"""Mask patterns and formats have one home (specfx.masks), used by the target's runner and by
the MTP drafter; long-lived buffers are marked static through graph_utils.mark_static."""

import pytest
import torch
from transformers import PretrainedConfig

from specfx import cache as cache_module
from specfx import mtp as mtp_module
from specfx.masks import build_mask, layer_pattern, to_format, visible_slots


def _config(**kw):
    return PretrainedConfig(**kw)


@pytest.mark.parametrize(
    ("layer_type", "kw", "pattern"),
    [
        ("full_attention", {}, ("full", None)),
        ("sliding_attention", {"sliding_window": 4}, ("sliding", 4)),
        ("chunked_attention", {"attention_chunk_size": 8}, ("chunked", 8)),
    ],
)
def test_layer_pattern_reads_the_size_from_the_config(layer_type, kw, pattern):
    assert layer_pattern(_config(**kw), layer_type, "M") == pattern


@pytest.mark.parametrize(
    ("layer_type", "kw", "match"),
    [
        ("linear_attention", {}, r"M has layers of type 'linear_attention' .* cannot roll back"),
        ("sliding_attention", {"sliding_window": None}, r"M has 'sliding_attention' layers but config.sliding_window is None"),
        ("sliding_attention", {"sliding_window": True}, r"config.sliding_window is True"),
        ("chunked_attention", {"attention_chunk_size": 0}, r"config.attention_chunk_size is 0; .* positive int"),
    ],
)
def test_layer_pattern_refuses_what_it_cannot_mask(layer_type, kw, match):
    with pytest.raises(ValueError, match=match):
        layer_pattern(_config(**kw), layer_type, "M")


def test_formats_of_one_visibility():
    positions = torch.tensor([[2, 5]])  # [B, T]
    visible = visible_slots(positions, 8, ("sliding", 3))  # [B, 1, T, C]
    assert visible[0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0]]
    additive = to_format(visible, "additive", torch.float16)
    assert additive.dtype == torch.float16
    assert torch.equal(additive == 0, visible) and (additive[~visible] == torch.finfo(torch.float16).min).all()
    assert to_format(visible, "bool", torch.float32) is visible
    assert torch.equal(build_mask(positions, 8, "additive", torch.float16, ("sliding", 3)), additive)


def test_mtp_layers_of_a_bad_size_are_a_clear_error(monkeypatch):
    """MTP parsed its layers' patterns itself, with int(getattr(config, attr)): a window of
    None raised a raw TypeError at speculate() time."""
    from specfx.runner import ModelRunner
    from tests.test_mtp import mtp_target

    target, layers = mtp_target("mellum", 1)  # its MTP layer is a sliding-window layer
    runner = ModelRunner(target, role="target")
    monkeypatch.setattr(layers.config, "layer_types", ["sliding_attention"])
    monkeypatch.setattr(layers.config, "sliding_window", None)
    with pytest.raises(ValueError, match=r"draft='mtp': .* MTP layers has 'sliding_attention' layers but config"):
        mtp_module.MTP(layers=layers).bind(runner)


def test_kv_buffers_and_the_mtp_stash_are_marked_static(monkeypatch):
    """CUDA-graph trees copy non-static inputs on every replay and skip graphs whose in-place
    writes hit them; KV buffers and the MTP stash must go through mark_static (a no-op on CPU,
    so the call itself is checked)."""
    marked = []
    monkeypatch.setattr(cache_module, "mark_static", lambda *ts: marked.extend(ts))
    monkeypatch.setattr(mtp_module, "mark_static", lambda *ts: marked.extend(ts))
    from specfx.runner import ModelRunner
    from tests.test_mtp import mtp_target

    target, layers = mtp_target("deepseek_v3", 1)
    spec = mtp_module.MTP(layers=layers)
    runner = ModelRunner(target, role="target")
    runner.allocate(2, 32)
    spec.bind(runner)
    spec.allocate(2, 32)
    ids = {id(t) for t in marked}
    kv = [t for c in (runner.cache, spec.cache) for layer in c.layers for t in (layer.keys, layer.values)]
    assert kv and all(id(t) in ids for t in kv)
    assert id(spec.stash) in ids
