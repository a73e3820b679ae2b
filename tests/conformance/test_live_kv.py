"""The conformance matrix with the live-KV pass on (issue 14, item 1; decision 45).

The conformance tests run eagerly (no graph, so no pass). Here the round goes through Dynamo
and the pass pipeline (``backend="specfx_eager"``: the rewritten graph runs without Inductor),
with the live-KV cut on, and must still generate what ``model.generate()`` does: batch 1 and a
left-padded batch past the tiny configs' sliding window, and a token tree. Each test also checks
that the pass cut attention calls (sites > 0) and that the graph read fewer slots than the
buffer holds, so a pass that silently stopped matching would fail here.

LIVE_SUBSET (``--full``; the default tier takes DEFAULT_SUBSET of it): every architecture whose
tiny model runs HF's *eager* attention (the pattern rewrite) plus the SDPA architectures of the
required set (full, sliding, mixed layer types, MoE, ALiBi, parallel blocks). The whole
supported matrix runs with ``SPECFX_LIVE_KV_MATRIX=all`` (outside CI: ~210 Dynamo traces,
~25 min on 2 CPU cores), all but the two architectures whose rounds do not compile at all
(NOT_COMPILABLE).
"""

import os

import pytest
import torch

import specfx
from specfx.sampling.processors import Mode
from specfx.testing.architectures import supported_here
from specfx.testing.tiny import tiny_causal_lm
from specfx.trees.types import TokenTree
from tests.conformance.test_conformance import _pair  # the conformance matrix's target/draft pairs, cached
from tests.conftest import left_padded, prompt, tiered

EAGER_ATTENTION = (
    "gemma2 bloom codegen flint gpt_neox_japanese gpt_oss gptj granite_swa granitemoe_swa mimo_v2_flash "
    "vaultgemma xglm mpt big_bird megatron-bert rembert"
).split()
REQUIRED_SDPA = "llama mistral qwen2 qwen3 gemma phi3 gpt2 gpt_neox opt falcon stablelm mixtral qwen2_moe".split()
LIVE_SUBSET = [a for a in REQUIRED_SDPA + EAGER_ATTENTION if a in supported_here()]
# supported in eager mode, but no round of theirs compiles, with or without the pass
NOT_COMPILABLE = {
    "ctrl": "Dynamo cannot trace its forward (Unsupported python_type() call: it re-registers a buffer)",
    "jetmoe": "its MoE routing calls .item() (the round check refuses the graph)",
}
ALL = [a for a in supported_here() if a not in NOT_COMPILABLE]
# the default tier: SDPA, eager attention with dict masks and softcapping, attention sinks with a
# window; trees: a window (SDPA) and mixed layer types; ALiBi (rowwise: bloom) and the rest: --full
DEFAULT_SUBSET = ("llama",)
# CI adds one model per other mechanism (ALiBi rowwise, a window, softcap, MoE, learned positions,
# parallel attention, dict masks); the rest of LIVE_SUBSET: pytest --full
CI_SUBSET = ("gpt_oss", "bloom", "mistral", "gemma2", "mixtral", "gpt2", "falcon", "granite_swa", "mpt")
DEFAULT_TREES = ()  # live KV under a tree in the default tier: test_drafters_with_live_kv[prompt_lookup-tree]
MATRIX = ALL if os.environ.get("SPECFX_LIVE_KV_MATRIX") == "all" else LIVE_SUBSET
ROWWISE = ("bloom",)  # the rowwise protocol takes no tree mask (refused)
TREE_SLOT_BIAS = ("mpt",)  # ALiBi from key slots: trees refused
# trees: full, sliding (Mistral), mixed layer types with softcap and eager attention (Gemma2),
# MoE with a window (Mixtral), learned positions (GPT-2), eager sliding windows (granite_swa)
TREE_MATRIX = [a for a in MATRIX if a not in ROWWISE + TREE_SLOT_BIAS]
if MATRIX is LIVE_SUBSET:
    TREE_MATRIX = [a for a in ("llama", "mistral", "gemma2", "mixtral", "gpt2", "granite_swa") if a in TREE_MATRIX]
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def _check(spec, target, ids, mask, new, **extra):
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask, **extra)
    expected = target.generate(ids, **kw)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"first differing row: {(got != expected).any(1).nonzero().flatten().tolist()}"


def _assert_cut(spec):
    live = [e.key[-1] for e in spec.compile_events]
    assert live and all(n < spec.state_slots.shape[1] for n in live), (live, spec.state_slots.shape)
    sites = [dict(g.report.sites).get("live_kv", 0) for g in spec.graphs]
    assert sites and all(n > 0 for n in sites), f"live_kv sites per graph: {sites}"


@pytest.mark.parametrize("arch", tiered(MATRIX, DEFAULT_SUBSET, ci=CI_SUBSET))
def test_greedy_equals_hf_with_live_kv(arch, one_thread):
    target, draft = _pair(arch)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, backend="specfx_eager", live_kv=16)
    _check(spec, target, prompt(12, seed=3), None, 40)
    _check(spec, target, *left_padded(10, [2, 4, 0], seed=5), 30)
    _assert_cut(spec)


@pytest.mark.parametrize("arch", tiered(TREE_MATRIX, DEFAULT_TREES))
def test_tree_greedy_equals_hf_with_live_kv(arch, one_thread):
    target, draft = _pair(arch)
    spec = specfx.speculate(target, draft=draft, tree=TREE, num_speculative_tokens=TREE.size, backend="specfx_eager", live_kv=16)
    no_eos = dict(eos_token_id=None)
    _check(spec, target, prompt(12, seed=3), None, 30, **no_eos)
    _check(spec, target, *left_padded(10, [2, 4, 0], seed=5), 24, **no_eos)
    _assert_cut(spec)


def test_live_bound_only_grows_and_evicts_outgrown_graphs(one_thread):
    """Like the capacity, the live bound only grows: a longer call raises it (and evicts the
    graphs of the old bound), a shorter one after it reuses the larger graph (no compile)."""
    target, draft = _pair("llama")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, backend="specfx_eager")
    _check(spec, target, prompt(12, seed=3), None, 20)  # 12 + 20 + 5 -> 64 of 256 slots
    greedy = Mode(False, penalty=False)  # HF's defaults: greedy, no penalty, no sorts
    assert [e.key for e in spec.compile_events] == [("round", 1, 256, 3, greedy, False, 64)]
    _check(spec, target, prompt(12, seed=4), None, 80)  # 12 + 80 + 5 = 97 -> 112 (quarter octaves above 64)
    assert spec.compile_events[-1].key[-1] == 112 and spec.graph_cache.keys() == [("round", 1, 256, 3, greedy, False, 112)]
    _check(spec, target, prompt(6, seed=5), None, 10)
    assert len(spec.compile_events) == 2 and spec.graph_cache.keys()[0][-1] == 112
    _assert_cut(spec)


def test_live_kv_false_reads_the_whole_buffer(one_thread):
    target, draft = _pair("llama")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, backend="specfx_eager", live_kv=False)
    _check(spec, target, prompt(12, seed=3), None, 20)
    assert [e.key[-1] for e in spec.compile_events] == [256]
    assert all("live_kv" not in dict(g.report.sites) for g in spec.graphs)


def test_live_bound_rounds_up_by_quarter_octaves():
    """At most 25 % more slots than a call can reach, at most four bounds per doubling."""
    from specfx.api import quarter_octave

    assert [quarter_octave(n, 64) for n in (1, 64, 65, 81, 97, 128, 129, 167, 257, 500)] == [
        64, 64, 80, 96, 112, 128, 160, 192, 320, 512,
    ]  # fmt: skip
    assert quarter_octave(9, 16) == 16 and quarter_octave(17, 16) == 20
    for n in range(1, 5000):
        b = quarter_octave(n, 64)
        assert n <= b <= max(64, 1.25 * n + 8)


@pytest.mark.parametrize("bad", [12, 4, 0, -64, "yes", None, 64.0])
def test_live_kv_must_be_a_bool_or_a_power_of_two(bad):
    with pytest.raises(ValueError, match="live_kv must be True, False or a power of two >= 8"):
        specfx.SpecConfig(live_kv=bad)


def _drafters():
    """Drafters whose own forwards read KV (draft model, early exit, MTP, EAGLE, EAGLE-3, PARD, DFlash) or
    read the target's hidden states through captured forwards (Medusa), and prompt lookup."""
    from specfx.testing.mtp import BUILT, mtp_target
    from tests.unit.drafters.test_mtp import MtpModel

    cases = {
        "early_exit": lambda t: "early_exit:1",
        "prompt_lookup": lambda t: "prompt_lookup",
        "eagle": lambda t: specfx.Eagle.random(t, seed=1),
        "eagle3": lambda t: specfx.Eagle3.random(t, draft_vocab_size=96, seed=1, layer_ids=[1, 2, 3]),
        "medusa": lambda t: specfx.Medusa.random(t.config.hidden_size, 128, num_heads=3),
        "pard": lambda t: specfx.Pard(t, mask_token_id=7),  # the target as its own PARD draft
        "dflash": lambda t: specfx.DFlash.random(t, block_size=4, num_layers=2, layer_ids=[0, 2, 3], seed=1),
    }
    out = {name: (lambda make=make: (tiny_causal_lm("llama", num_layers=4), make)) for name, make in cases.items()}
    if MtpModel is not None:

        def mtp():
            # Mellum's is a sliding-window MTP layer; transformers builds it from 5.20 on
            arch = "mellum" if "mellum" in BUILT else "glm4_moe"
            target, layers = mtp_target(arch, 1)
            return target, lambda t: specfx.MTP(layers=layers)

        out["mtp"] = mtp
    return out


DRAFTERS = _drafters()


# MTP heads and DFlash draft chains only (ARCHITECTURE "Limits today")
DRAFTER_CASES = [(n, s) for n in sorted(DRAFTERS) for s in ("chain", "tree") if (n, s) not in (("mtp", "tree"), ("dflash", "tree"))]


# the default tier: a tree (prompt lookup); every family: --full
DEFAULT_DRAFTER_CASES = [("prompt_lookup", "tree")]


# CI's newest run: every family's chain; the trees but prompt lookup's (the tree tests above run live KV under
# trees on every mechanism): pytest --full
CI_DRAFTER_CASES = [c for c in DRAFTER_CASES if c[1] == "chain"]


@pytest.mark.parametrize(("name", "shape"), tiered(DRAFTER_CASES, DEFAULT_DRAFTER_CASES, several=True, ci=CI_DRAFTER_CASES))
def test_drafters_with_live_kv(name, shape, one_thread):
    target, make = DRAFTERS[name]()
    round_shape = dict(num_speculative_tokens=3) if shape == "chain" else dict(tree=TREE, num_speculative_tokens=TREE.size)
    spec = specfx.speculate(target, draft=make(target), backend="specfx_eager", live_kv=16, **round_shape)
    kwargs = dict(eos_token_id=None, pad_token_id=0)
    _check(spec, target, prompt(12, seed=3), None, 30, **kwargs)
    _check(spec, target, *left_padded(10, [3, 0], seed=5), 20, **kwargs)
    _assert_cut(spec)


def test_compiled_prefill_is_cut_too(one_thread):
    target, draft = _pair("mistral")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, backend="specfx_eager", compile_prefill=True)
    _check(spec, target, *left_padded(10, [2, 4, 0], seed=5), 30)
    assert sorted(e.key[0] for e in spec.compile_events) == ["prefill", "round"]
    _assert_cut(spec)
