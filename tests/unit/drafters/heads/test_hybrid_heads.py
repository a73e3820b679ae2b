"""Heads that read the target's hidden states (EAGLE-3, DFlash, Medusa, EAGLE) on targets with
recurrent state (decision 82): greedy output equal to ``model.generate()`` at batch 1 and on a
left-padded batch, eager and compiled with Inductor (one round graph per batch bucket, no
recompile), chains only.

The heads are attention-only (their own KV); what they need of a stateful target is its verify
forward with the hidden-state taps *and* the state recorded for the rollback: a tapped forward is a
captured graph, which calls no module, so its graph returns the mixers' inputs itself. Random heads
reject nearly every proposal, so every round rolls the state back; a Medusa head proposing the
reference continuation (every third position wrong, or none) runs rounds that accept some or all.
Each greedy test fails with the round's rollback removed.
"""

import functools

import pytest
import torch

import specfx
from specfx.drafters.heads.dflash import DFlash
from specfx.drafters.heads.eagle import Eagle
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.drafters.heads.medusa import Medusa
from specfx.testing.tiny import STATEFUL_TINY, tiny_causal_lm
from tests.conftest import left_padded, prompt, tiered
from tests.unit.model.test_hybrid_speculate import _table

K = 3  # DFlash's block of 4: K + 1
# Mamba2 SSD (state only), a gated-delta-net hybrid, Mamba1 + attention (verified by single steps: decision 90)
ARCHS = ("mamba2", "qwen3_next", "jamba")
HEADS = ("dflash", "eagle", "eagle3", "medusa")

pytestmark = pytest.mark.filterwarnings("ignore::specfx.drafters.heads.checkpoint.HeadLayoutWarning")


@functools.cache
def _target(arch: str):
    """A tiny ``arch`` target of four layers (three distinct taps), a pad id with a real embedding."""
    config = dict(STATEFUL_TINY[arch])
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"] * 2
    m = tiny_causal_lm(arch, num_layers=4, **config)
    m.generation_config.eos_token_id = None
    with torch.no_grad():  # only the 2-D mask hides padding
        m.get_input_embeddings().weight[0].normal_()
    return m


def _head(kind: str, target):
    """A random head of ``kind`` for ``target`` (as the heads' own tests build them)."""
    if kind == "eagle3":
        return Eagle3.random(target, draft_vocab_size=100, layer_ids=[1, 2, 3])
    if kind == "dflash":
        return DFlash.random(target, block_size=K + 1, layer_ids=[0, 2])
    if kind == "eagle":
        return Eagle.random(target)
    return Medusa.random(target.config.hidden_size, target.config.vocab_size, num_heads=K)


def _cases():
    return (((prompt(9, seed=1), None), 16), (left_padded(10, [3, 0, 6], seed=2), 14))


def _assert_equal(spec, target, ids, mask, new):
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask)
    expected = target.generate(ids, **kw)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
    return expected


_PAIRS = [(a, h) for a in ARCHS for h in HEADS if h != "eagle" or a == "qwen3_next"]


@pytest.mark.parametrize(
    ("arch", "kind"),
    tiered(
        _PAIRS,
        [],
        several=True,
        ci=[("qwen3_next", "eagle3"), ("qwen3_next", "eagle"), ("jamba", "medusa"), ("mamba2", "dflash")],
    ),
)
@torch.no_grad()
def test_greedy_equals_generate_with_rejecting_rounds(arch, kind, one_thread):
    target = _target(arch)
    spec = specfx.speculate(target, draft=_head(kind, target), num_speculative_tokens=K, compile=False)
    # the default pair also decodes one row; the others the left-padded batch only (the harder case)
    for (ids, mask), new in _cases() if (arch, kind) == ("qwen3_next", "eagle3") else _cases()[1:]:
        _assert_equal(spec, target, ids, mask, new)
        assert spec.stats.accepted < spec.stats.proposed  # rejected proposals were rolled back
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in target.modules())  # the user's model keeps no hook


class ReferenceMedusa(Medusa):
    """Medusa's taps and stash, proposing each row's reference continuation (``table [B, C]``),
    every position divisible by ``wrong`` replaced by another token (None: none)."""

    def propose(self, ctx):
        b = ctx.lengths.shape[0]
        pos = ctx.lengths.unsqueeze(1) + 1 + torch.arange(ctx.k)  # [B, K]
        table = self.table[torch.arange(b) % self.table.shape[0]]
        right = table.gather(1, pos.clamp(max=table.shape[1] - 1))
        if self.wrong is None:
            return right, None
        return torch.where(pos % self.wrong == 0, (right + 1) % self.vocab_size, right), None


@pytest.mark.parametrize("arch", tiered(ARCHS, (), ci=("qwen3_next",)))  # --full: every state kind
@pytest.mark.parametrize("wrong", [3, None])
@torch.no_grad()
def test_rounds_accepting_some_or_all(arch, wrong, one_thread):
    """The tapped verify forward rolled back to every n, K + 1 included (every proposal accepted)."""
    target = _target(arch)
    base = Medusa.random(target.config.hidden_size, target.config.vocab_size, num_heads=K)
    drafter = ReferenceMedusa.from_weights(base.weight, base.bias, base.lm_head)
    drafter.wrong = wrong
    for (ids, mask), new in _cases():
        drafter.table = _table(target.generate(ids, max_new_tokens=new, do_sample=False, attention_mask=mask), mask)
        spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=K, compile=False)
        _assert_equal(spec, target, ids, mask, new)
        if wrong is None:
            assert spec.stats.per_position[K - 1] > 0  # rounds accepted all K proposals
        else:
            assert 0 < spec.stats.accepted < spec.stats.proposed


@pytest.mark.full
@pytest.mark.compiled
@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@torch.no_grad()
def test_inductor_round_is_one_graph_and_equals_generate(kind, one_thread):
    """Compiled with Inductor (decision 78): the tapped verify forward that returns the mixers' inputs
    is inlined into the round graph; batch 1, then two left-padded batches of one bucket, the second
    under ``error_on_recompile``."""
    target = _target("qwen3_next")
    spec = specfx.speculate(target, draft=_head(kind, target), num_speculative_tokens=K)
    cases = (*_cases(), (left_padded(12, [2, 0, 5], seed=4), 12))
    for i, ((ids, mask), new) in enumerate(cases):
        with torch._dynamo.config.patch(error_on_recompile=i == 2):
            _assert_equal(spec, target, ids, mask, new)
    assert len(spec.graphs) == 2 and {g.compiler for g in spec.graphs} == {"inductor"}
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in target.modules())


@pytest.mark.parametrize(
    ("arch", "draft", "match"),
    [
        ("mamba2", "mtp", r"MTP layers \(MtpModel\) are built from the target's own decoder-layer class"),
        ("mamba2", "eagle", r"every layer type of this target.*keeps recurrent or linear-attention state"),
        ("jamba", "eagle", r"derives its layer types from other fields.*Use an EAGLE-3 or DFlash draft"),
    ],
)
def test_what_cannot_run_exactly_is_refused(arch, draft, match):
    """MTP without a layout of its own (transformers' MtpModel layers are the target's class, which may
    keep state; Qwen3-Next's run, decision 86); EAGLE-1 on a target whose every layer keeps state (its
    layer would keep state of its own) or whose layer types cannot be set (Jamba's are derived)."""
    target = _target(arch)
    with pytest.raises(ValueError, match=match):
        specfx.speculate(target, draft=_head(draft, target) if draft == "eagle" else draft, compile=False)
