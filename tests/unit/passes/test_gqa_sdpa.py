"""The grouped-query pass: SDPA reads the KV heads directly instead of transformers' repeated
copies, bit for bit the same; anything that is not exactly that pattern is left alone."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

import specfx
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import left_padded
from tests.unit.passes.test_passes import capture

F = torch.nn.functional


def _sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


@pytest.mark.parametrize("kv_heads,q_heads", [(2, 4), (1, 8), (3, 3)])
def test_repeated_kv_heads_become_enable_gqa(kv_heads, q_heads):
    torch.manual_seed(0)
    q = torch.randn(2, q_heads, 3, 16)
    k, v = torch.randn(2, kv_heads, 10, 16), torch.randn(2, kv_heads, 10, 16)
    mask = torch.rand(2, 1, 3, 10) > 0.3
    mask[..., 0] = True

    def attend(q, k, v, mask):  # transformers' sdpa_attention_forward, on the CPU with a mask
        n_rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)

    out, records = capture(attend, q, k, v, mask)
    assert torch.equal(out, attend(q, k, v, mask))  # bit for bit
    rewritten = dict(records[0].report.sites)["gqa_sdpa"]
    assert rewritten == (1 if kv_heads != q_heads else 0)  # repeat_kv is a no-op at n_rep = 1
    (call,) = _sdpa_calls(records[0].graph_module)
    assert call.kwargs.get("enable_gqa", False) == (kv_heads != q_heads)
    if rewritten:  # the copies are gone with it
        names = [str(n.target) for n in records[0].graph_module.graph.nodes]
        assert "expand" not in names and "reshape" not in names


def test_other_head_layouts_are_left_alone():
    """A tile along the heads (query head i reads KV head i % 2) is another grouping than
    SDPA's (i // n_rep): the pass does not match it and the call keeps its inputs."""
    q = torch.randn(1, 4, 2, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool)

    def tiled(q, k, v, mask):  # query head i reads KV head i % 2: not SDPA's grouping
        return F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), attn_mask=mask)

    out, records = capture(tiled, q, k, v, mask)
    assert torch.equal(out, tiled(q, k, v, mask))
    assert dict(records[0].report.sites)["gqa_sdpa"] == 0


def test_generation_with_the_pass_equals_generate():
    """A grouped-query target (Llama, 4 query / 2 KV heads) through compiled rounds (specfx
    passes, no Inductor): the round's target attention calls are rewritten, output unchanged."""
    target = tiny_causal_lm("llama")
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    spec = specfx.speculate(target, draft=target, num_speculative_tokens=3, backend="specfx_eager")
    ids, mask = left_padded(target.config.vocab_size, (5, 0, 3), seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    layers = target.config.num_hidden_layers
    (round_graph,) = [g for g in spec.graphs if dict(g.report.sites).get("gqa_sdpa")]
    assert dict(round_graph.report.sites)["gqa_sdpa"] == layers * (3 + 1)  # draft steps + verify
