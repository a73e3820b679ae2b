"""The live-KV pass (specfx/passes/rewrites/live_kv.py) on small functions: it cuts SDPA and HF's eager
attention pattern to the first ``live`` key slots when the mask hides the rest (same output),
and leaves alone every call it cannot prove safe from the graph's shapes."""

import math

import pytest
import torch
import torch.nn.functional as F

from specfx.passes import LiveKV
from specfx.passes.backend import GraphRecords, make_backend

B, H, T, C, D, LIVE = 2, 4, 3, 32, 8, 8


def _compiled(fn, live=LIVE, capacity=C):
    torch._dynamo.reset()
    records = GraphRecords()
    backend = make_backend("specfx_eager", records, round_graphs=False, live=LiveKV(capacity, live))
    return torch.compile(fn, backend=backend, fullgraph=True), records


def _sites(records) -> int:
    return sum(dict(r.report.sites)["live_kv"] for r in records)


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, C, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, C, D, generator=g, dtype=dtype)
    positions = torch.tensor([[3, 4, 5], [5, 6, 7]])  # every position < LIVE
    visible = torch.arange(C).view(1, 1, 1, C) <= positions.view(B, 1, T, 1)  # [B, 1, T, C]
    return q, k, v, visible


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=0.3)


def _eager(q, k, v, mask):
    """HF's eager attention (llama/gemma2-style: scaling, softcap, additive mask sliced to the
    key length, float32 softmax, cast, inactive dropout)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * (1 / math.sqrt(D))
    scores = torch.tanh(scores / 50.0) * 50.0
    scores = scores + mask[:, :, :, : k.shape[-2]]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=0.0, training=False)
    return torch.matmul(probs, v)


def _additive(visible, dtype=torch.float32):
    return torch.where(visible, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def test_sdpa_is_cut_and_unchanged():
    q, k, v, visible = _inputs()
    fn, records = _compiled(_sdpa)
    torch.testing.assert_close(fn(q, k, v, visible), _sdpa(q, k, v, visible), rtol=1e-6, atol=1e-6)
    assert _sites(records) == 1
    (sdpa,) = [n for n in records[0].graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    keys = sdpa.args[1] if len(sdpa.args) > 1 else sdpa.kwargs["key"]
    assert keys.meta["example_value"].shape[-2] == LIVE


def test_eager_pattern_is_cut_and_unchanged():
    q, k, v, visible = _inputs(1)
    mask = _additive(visible)
    fn, records = _compiled(_eager)
    torch.testing.assert_close(fn(q, k, v, mask), _eager(q, k, v, mask), rtol=1e-6, atol=1e-6)
    assert _sites(records) == 1
    softmax = [n for n in records[0].graph_module.graph.nodes if "softmax" in str(n.target)]
    assert softmax and all(n.meta["example_value"].shape[-1] == LIVE for n in softmax)


def test_the_cut_really_drops_the_slots_past_live():
    """Negative control: with a mask that shows slots past ``live`` (a broken contract), the cut
    graph differs from eager, so the equality above is not vacuous."""
    q, k, v, _ = _inputs(2)
    everything = torch.ones(B, 1, T, C, dtype=torch.bool)
    fn, records = _compiled(_sdpa)
    assert not torch.allclose(fn(q, k, v, everything), _sdpa(q, k, v, everything), atol=1e-4)
    assert _sites(records) == 1


def _causal(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _unmasked(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v)


def _dropout(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)


def _eager_returning_weights(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) + mask
    probs = F.softmax(scores, dim=-1)
    return torch.matmul(probs, v), probs  # the weights leave the region: their shape must not change


def _eager_other_axis(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) + mask
    return torch.matmul(F.softmax(scores, dim=-2), v)


@pytest.mark.parametrize("fn", [_causal, _unmasked, _dropout, _eager_returning_weights, _eager_other_axis])
def test_what_cannot_be_proven_is_left_alone(fn):
    q, k, v, visible = _inputs(3)
    mask = visible if fn in (_causal, _unmasked, _dropout) else _additive(visible)
    compiled, records = _compiled(fn)
    if fn is not _dropout:  # dropout draws random numbers: compare only the rewrite count
        torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask))
    else:
        compiled(q, k, v, mask)
    assert _sites(records) == 0


def test_other_key_lengths_and_a_live_bound_at_capacity_are_left_alone():
    q, k, v, visible = _inputs(4)
    fn, records = _compiled(_sdpa, capacity=C * 2)  # the keys are not a buffer of that capacity
    torch.testing.assert_close(fn(q, k, v, visible), _sdpa(q, k, v, visible))
    assert _sites(records) == 0
    fn, records = _compiled(_sdpa, live=C)
    fn(q, k, v, visible)
    assert _sites(records) == 0


def test_gqa_and_a_broadcast_mask():
    """enable_gqa keys (fewer heads) and a mask broadcast over heads and queries."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 2, D, generator=g)
    k, v = torch.randn(1, 2, C, D, generator=g), torch.randn(1, 2, C, D, generator=g)
    mask = (torch.arange(C) < LIVE - 1).view(1, 1, 1, C)

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    compiled, records = _compiled(fn)
    torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask), rtol=1e-6, atol=1e-6)
    assert _sites(records) == 1


def _eager_sinks(q, k, v, mask):
    """GPT-OSS-style attention sinks: one extra logit per head, dropped after the softmax."""
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
    sinks = torch.linspace(-1, 1, H).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    probs = F.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def _eager_lse(q, k, v, mask):
    """Granite-SWA-style: a logsumexp over the keys scales the output (a sink as a gate)."""
    scores = torch.matmul(q, k.transpose(2, 3)) + mask
    gate = torch.sigmoid(torch.logsumexp(scores, dim=-1) - 0.5).unsqueeze(-1)
    return torch.matmul(F.softmax(scores, dim=-1), v) * gate


def _eager_baddbmm(q, k, v, mask):
    """GPT-NeoX-Japanese-style: scores by baddbmm on [B*H, T, C], viewed back to 4-D."""
    b, h, t, d = q.shape
    base = torch.zeros(b * h, t, C)
    scores = torch.baddbmm(base, q.reshape(b * h, t, d), k.reshape(b * h, C, d).transpose(1, 2), beta=1.0, alpha=0.3)
    scores = scores.view(b, h, t, C) + mask
    return torch.matmul(F.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("fn", [_eager_sinks, _eager_lse, _eager_baddbmm])
def test_eager_variants_are_cut_and_unchanged(fn):
    q, k, v, visible = _inputs(6)
    mask = _additive(visible)
    compiled, records = _compiled(fn)
    torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask), rtol=1e-6, atol=1e-6)
    assert _sites(records) == 1
