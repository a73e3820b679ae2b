"""Speculating models with recurrent / linear-attention state (issue 29, decision 76): greedy
output equal to ``model.generate()`` at batch 1 and on a left-padded batch, with rounds that reject
(so the state is rolled back every round), eager and compiled; what is not supported yet refused at
``speculate()``; the user's model unchanged.

The drafter proposes the reference continuation with every third position wrong, so most rounds
accept some proposals and reject the rest (a tiny random model never repeats itself enough for
prompt lookup to accept anything; that case, every proposal rejected, runs too). Without the
rollback (``ModelRunner.roll_back_state``) every greedy test here fails: the state keeps the
rejected inputs. Compiled: one round graph per batch bucket, traced with ``specfx_eager`` and lowered
by Inductor (the default backend; decision 78).
"""

import functools

import pytest
import torch

import specfx
from specfx.drafters.base import Drafter
from specfx.testing.tiny import STATEFUL_TINY, tiny_causal_lm
from tests.conftest import left_padded, prompt, tiered

TINY = STATEFUL_TINY
K = 4


@functools.cache
def _model(arch):
    m = tiny_causal_lm(arch, **TINY[arch])
    m.generation_config.eos_token_id = None  # generate every token asked for
    with torch.no_grad():  # a pad id with a real embedding (as in real checkpoints, not the tiny
        m.get_input_embeddings().weight[0].normal_()  # config's zero row): only the 2-D mask hides padding
    return m


@pytest.fixture(scope="module", params=sorted(TINY))
def model(request):
    return _model(request.param)


class WrongEveryThird(Drafter):
    """Proposes each row's reference continuation (``table [B, C]``, slot == position), every
    position divisible by 3 replaced by another token: rounds accept 0..2 proposals."""

    name = "wrong_every_third"

    def __init__(self, table: torch.Tensor, vocab: int):
        self.table, self.vocab = table, vocab

    def propose(self, ctx):
        b = ctx.lengths.shape[0]
        pos = ctx.lengths.unsqueeze(1) + 1 + torch.arange(ctx.k)  # [B, K]
        table = self.table[torch.arange(b) % self.table.shape[0]]
        right = table.gather(1, pos.clamp(max=table.shape[1] - 1))
        return torch.where(pos % 3 == 0, (right + 1) % self.vocab, right), None


def _table(ref: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's real tokens of ``generate()``'s output, left-aligned (position == column)."""
    pads = [0] * len(ref) if mask is None else (mask == 0).sum(1).tolist()
    rows = [r[p:] for r, p in zip(ref, pads, strict=True)]
    width = max(len(r) for r in rows) + K + 2
    return torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])


def _check(model, ids, mask, new, draft=None):
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask)
    expected = model.generate(ids, **kw)
    draft = draft or WrongEveryThird(_table(expected, mask), model.config.vocab_size)
    spec = specfx.speculate(model, draft=draft, num_speculative_tokens=K, compile=False)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
    return spec.stats


@torch.no_grad()
def test_greedy_equals_generate_at_batch_1_with_rejecting_rounds(model, one_thread):
    stats = _check(model, prompt(9, seed=1), None, 30)
    assert 0 < stats.accepted < stats.proposed  # rounds accepted some and rejected some


@torch.no_grad()
def test_greedy_equals_generate_on_a_left_padded_batch(model, one_thread):
    ids, mask = left_padded(10, [3, 0, 6], seed=2)
    stats = _check(model, ids, mask, 24)
    assert 0 < stats.accepted < stats.proposed


@torch.no_grad()
def test_prompt_lookup_rejecting_every_proposal(model, one_thread):
    """A repetitive prompt: prompt lookup proposes every round and the random model rejects
    nearly all of it, so every round rolls the state back to the pending token alone."""
    ids = torch.tensor([[5, 6, 7, 8, 9] * 3 + [5, 6]])
    stats = _check(model, ids, None, 20, draft="prompt_lookup")
    assert stats.proposed > stats.accepted


@torch.no_grad()
def test_attention_draft_model_and_auto_k(model, one_thread):
    """A draft model (attention only, its own KV) drives the same rollback; "auto" K mixes in
    rounds of K = 0, which keep their one input and roll nothing back."""
    draft = tiny_causal_lm("llama", vocab_size=model.config.vocab_size)
    ids, mask = left_padded(8, [2, 0], seed=6)
    for k in (3, None):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        spec = specfx.speculate(model, draft=draft, num_speculative_tokens=k, compile=False)
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False), expected)


@torch.no_grad()
def test_sampling_runs(model, one_thread):
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, compile=False)
    torch.manual_seed(0)
    out = spec.generate(prompt(8, seed=7), max_new_tokens=12, do_sample=True, temperature=0.8)
    assert out.shape == (1, 20) and spec.stats.rounds > 0


@torch.no_grad()
def test_the_users_model_is_unchanged(model, one_thread):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _check(model, prompt(8, seed=4), None, 12)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_refused_as_a_draft_model(model):
    target = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match=r"state.*stateful draft model is not supported"):
        specfx.speculate(target, draft=model, compile=False)


def _compiled_check(model, backend):
    """Batch 1, then two left-padded batches of one bucket, each equal to ``generate()`` with rounds
    that accept some proposals and reject the rest; one round graph per batch bucket, and the second
    batch of the bucket compiles nothing (``error_on_recompile``)."""
    drafter = WrongEveryThird(torch.zeros((4, 64), dtype=torch.long), model.config.vocab_size)
    spec = specfx.speculate(model, draft=drafter, num_speculative_tokens=K, backend=backend)
    cases = (((prompt(9, seed=1), None), 20), (left_padded(10, [3, 0, 6], seed=2), 16), (left_padded(12, [2, 0, 5], seed=4), 14))
    for i, ((ids, mask), new) in enumerate(cases):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        table = _table(expected, mask)
        drafter.table.zero_()
        drafter.table[: table.shape[0], : table.shape[1]] = table  # in place: the graph's input
        with torch._dynamo.config.patch(error_on_recompile=i == 2):
            got = spec.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert torch.equal(got, expected), f"case {i}: rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
        assert 0 < spec.stats.accepted < spec.stats.proposed
    assert len(spec.graphs) == 2, f"{len(spec.graphs)} graphs"  # batch 1 and the bucket of 4
    assert {g.compiler for g in spec.graphs} == {"inductor" if backend == "specfx" else "eager"}
    assert all(not m._forward_pre_hooks for m in model.modules())


@torch.no_grad()
def test_compiled_round_is_one_graph_and_equals_generate(model, one_thread):
    """The round traced as one graph (``specfx_eager``): the mixer hooks are attached around the
    compiled calls, not traced."""
    _compiled_check(model, "specfx_eager")


@pytest.mark.compiled
@pytest.mark.parametrize("arch", tiered(sorted(TINY), ["mamba2", "qwen3_next"]))
@torch.no_grad()
def test_inductor_round_is_one_graph_and_equals_generate(arch, one_thread):
    """The same with the default backend (Inductor, decision 78): the state buffers, the snapshot and
    the mixer steps' in-place writes compile into the round graph like the KV writes."""
    _compiled_check(_model(arch), "specfx")


@torch.no_grad()
def test_returning_the_cache_is_refused(model, one_thread):
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, compile=False)
    with pytest.raises(ValueError, match=r"cannot return the cache.*recurrent.*return_dict_in_generate=False"):
        spec.generate(prompt(6, seed=8), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(compile=True, background_compile=True), r"traced in the background.*Leave background_compile unset"),
        (dict(compile=False, tree=specfx.TokenTree([(0,), (1,), (0, 0)])), r"chain only.*no tree="),
        (dict(compile=False, draft="early_exit:1"), r"runs the target's layers"),
    ],
)
def test_what_is_not_supported_yet_is_refused(model, options, match):
    options = {"draft": "prompt_lookup", **options}
    with pytest.raises(ValueError, match=match):
        specfx.speculate(model, **options)


def test_state_without_hf_linear_attention_layers_stays_refused():
    m = tiny_causal_lm("mamba", hidden_size=32, state_size=4)
    with pytest.raises(ValueError, match=r"recurrent or linear-attention state"):
        specfx.speculate(m, draft="prompt_lookup", compile=False)


def test_conv_layers_of_a_model_not_marked_stateful_stay_refused():
    """LFM2's short-conv layers keep state, yet the model does not set ``_is_stateful``: refused as
    before (its conv layers' type has no mask), not driven without a rollback."""
    m = tiny_causal_lm("lfm2", layer_types=["conv", "full_attention"])
    assert not m._is_stateful
    with pytest.raises(ValueError, match=r"layers of type 'conv'.*cannot roll back"):
        specfx.speculate(m, draft="prompt_lookup", compile=False)
