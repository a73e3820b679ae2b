"""The conformance matrix, generated from specfx.model.architectures.ARCHITECTURES.

Every supported architecture, eager mode: greedy equality with ``model.generate()`` at batch 1
and for a left-padded batch (generating past the tiny configs' sliding window of 8), as a
draft for a Llama target (cross-architecture pair sharing the vocabulary), and a sampling run.
The compiled subset (COMPILED_SUBSET) runs the same greedy check through the compiled round.
Refused architectures must raise a clear ValueError at ``speculate()``.

Token trees: every supported architecture but those on the rowwise fallback protocol (Bloom)
generates what ``model.generate()`` does with a tree (batch 1 and a left-padded batch, past the
sliding window); the rowwise ones are refused with a clear ValueError. The compiled subset
(gemma2: dict masks, softcapping, eager attention; mixtral: MoE routing, sliding window) runs
the tree compiled too; bloom, the subset's third, is on the rowwise protocol (refused).

Full matrix outside CI: ``python -m specfx.testing.architectures --sweep``.
"""

import inspect
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specfx
from specfx.model.architectures import (
    ARCHITECTURES,
    COMPILED_SUBSET,
    REPRESENTATIVE,
    decodes_incrementally,
    installed,
)
from specfx.model.masks import TreeView
from specfx.testing.architectures import supported_here
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm
from specfx.trees.types import TokenTree
from tests.conftest import left_padded, prompt, round_backends, tiered

SUPPORTED = supported_here()
_models = {}


def _pair(arch):
    if arch not in _models:
        target = tiny_causal_lm(arch, **ARCHITECTURES[arch].overrides)
        _models[arch] = (target, perturbed_copy(target, 0.03))
    return _models[arch]


def _ragged(batch=3, length=10):
    """Rows padded by 2, 4, ..., the last one unpadded."""
    return left_padded(length, [2 * (b + 1) for b in range(batch - 1)] + [0], seed=5)


def _check_greedy(spec, target, ids, mask, new, **extra):
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask, **extra)
    expected = target.generate(ids, **kw)
    got = spec.generate(ids, **kw)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"first differing row: {(got != expected).any(1).nonzero().flatten().tolist()}"


def test_table_covers_the_required_set():
    required = (
        "llama mistral qwen2 qwen3 gemma gemma2 phi3 gpt2 gpt_neox opt falcon stablelm bloom mixtral qwen2_moe".split()
    )
    assert set(required) <= set(ARCHITECTURES)
    assert all(ARCHITECTURES[a].status in ("supported", "refused", "unsupported") for a in ARCHITECTURES)
    assert all(ARCHITECTURES[a].reason for a in ARCHITECTURES if ARCHITECTURES[a].status != "supported")


@pytest.mark.parametrize("arch", tiered(SUPPORTED, REPRESENTATIVE))
def test_greedy_equals_hf(arch, one_thread):
    target, draft = _pair(arch)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    _check_greedy(spec, target, prompt(12, seed=3), None, 40)
    ids, mask = _ragged()
    _check_greedy(spec, target, ids, mask, 30)
    stats = spec.stats
    assert len(stats.per_row_accepted) == 3 and sum(stats.per_row_accepted) == stats.accepted


@pytest.mark.parametrize("arch", tiered(SUPPORTED, REPRESENTATIVE))
def test_as_draft_of_a_llama_target(arch, one_thread):
    target, _ = _pair("llama")
    draft, _ = _pair(arch)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=2, compile=False)
    _check_greedy(spec, target, prompt(9, seed=4), None, 20)


@pytest.mark.parametrize("arch", tiered(SUPPORTED, REPRESENTATIVE))
def test_sampling_run(arch, one_thread):
    """Self-draft sampling: target and drafter distributions coincide, so rejection sampling
    accepts (almost) every proposal; the call is reproducible under torch.manual_seed."""
    target, _ = _pair(arch)
    spec = specfx.speculate(target, draft=target, num_speculative_tokens=3, compile=False)
    ids, mask = _ragged()
    kw = dict(max_new_tokens=16, do_sample=True, top_k=20, temperature=0.9, attention_mask=mask)
    torch.manual_seed(11)
    first = spec.generate(ids, **kw)
    torch.manual_seed(11)
    second = spec.generate(ids, **kw)
    assert torch.equal(first, second)
    assert first.shape[0] == 3 and int(first.max()) < target.config.get_text_config().vocab_size
    assert spec.stats.acceptance_rate > 0.95


@pytest.mark.parametrize("backend", round_backends())
@pytest.mark.parametrize("arch", tiered(COMPILED_SUBSET, ("gemma2",)))
def test_compiled_greedy_equals_hf(arch, backend, one_thread):
    target, draft = _pair(arch)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, backend=backend, background_compile=False)
    ids, mask = _ragged(batch=2)
    _check_greedy(spec, target, ids, mask, 30)
    n = len(spec.graphs)
    _check_greedy(spec, target, *_ragged(batch=2, length=13), 25)  # new contents, same batch size
    assert len(spec.graphs) == n, "recompiled for new batch contents"


# Token trees. Models on the rowwise 2-D-mask protocol cannot take a tree's mask.
ROWWISE = ("bloom",)
# MPT's ALiBi bias comes from key *slots*, not positions, so where a tree node's slot differs
# from its position (siblings) the tree forward itself differs from HF's forward of the path:
# the runner's tree probe refuses trees for it.
TREE_SLOT_BIAS = ("mpt",)
TREE = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # second children at depths 1 and 2


@pytest.mark.parametrize("arch", tiered([a for a in SUPPORTED if a not in ROWWISE + TREE_SLOT_BIAS], REPRESENTATIVE))
def test_tree_greedy_equals_hf(arch, one_thread):
    target, draft = _pair(arch)
    spec = specfx.speculate(target, draft=draft, tree=TREE, num_speculative_tokens=TREE.size, compile=False)  # pinned
    no_eos = dict(eos_token_id=None)  # some tiny models emit EOS at once: rounds must run
    _check_greedy(spec, target, prompt(10, seed=3), None, 12, **no_eos)
    _check_greedy(spec, target, *_ragged(batch=2), 12, **no_eos)  # prompts of 8 and 10 tokens: past a window of 8
    per_depth = spec.cumulative_stats.per_depth
    assert per_depth[1] > 0, per_depth  # paths of two nodes were accepted (and moved to committed slots)


@pytest.mark.parametrize("arch", TREE_SLOT_BIAS)
def test_slot_biased_models_refuse_trees(arch, one_thread):
    """The tree probe catches a model whose tree verification differs from its full forward
    (chains stay exact: it is in test_greedy_equals_hf), as target and as draft."""
    target, draft = _pair(arch)
    refusal = r"\(\w+ForCausalLM\) does not verify a token tree like its own full forward \(max \|logit difference\|"
    with pytest.raises(ValueError, match=r"speculate\(tree=...\): target " + refusal):
        specfx.speculate(target, draft=draft, tree=TREE, compile=False)
    with pytest.raises(ValueError, match=r"speculate\(tree=...\): draft " + refusal):
        specfx.speculate(_pair("llama")[0], draft=target, tree=TREE, compile=False)


@pytest.mark.parametrize("arch", ROWWISE)
def test_rowwise_fallback_refuses_trees(arch):
    """As target or as draft, with the reason; a tree forward through the runner is refused too."""
    target, draft = _pair(arch)
    runner = specfx.model.runner.ModelRunner(target, "target")
    assert runner.protocol == "rowwise_2d"
    refusal = r"\(\w+ForCausalLM\) needs a 2-D padding mask .* cannot be given a token tree's mask; use a chain"
    assert runner.tree_refusal() is not None
    with pytest.raises(ValueError, match=r"speculate\(tree=...\): target " + refusal):
        specfx.speculate(target, draft=draft, tree=TREE, compile=False)
    llama = _pair("llama")[0]
    assert specfx.model.runner.ModelRunner(llama, "target").tree_refusal() is None
    with pytest.raises(ValueError, match=r"speculate\(tree=...\): draft " + refusal):
        specfx.speculate(llama, draft=target, tree=TREE, compile=False)
    runner.allocate(1, 16)
    zeros = torch.zeros((1, 2), dtype=torch.long)
    tables = TREE.tensors("cpu")
    with pytest.raises(ValueError, match=r"target " + refusal):
        runner.forward(zeros, zeros, zeros, tree=TreeView(zeros[:, 0], tables.depth, tables.ancestors, (0, 1)))


@pytest.mark.parametrize("backend", round_backends())
# compiled trees in the default tier: early exit's, the tree tests' (tests/unit); the conformance subset: --full
@pytest.mark.parametrize("arch", tiered([a for a in COMPILED_SUBSET if a not in ROWWISE], ()))
def test_compiled_tree_greedy_equals_hf(arch, backend, one_thread):
    target, draft = _pair(arch)
    spec = specfx.speculate(  # the tree every round, compiled in the caller's thread (graphs counted below)
        target, draft=draft, tree=TREE, num_speculative_tokens=TREE.size, backend=backend, background_compile=False
    )
    _check_greedy(spec, target, *_ragged(batch=2), 20)
    n = len(spec.graphs)
    _check_greedy(spec, target, *_ragged(batch=2, length=13), 16)  # new contents, same batch size
    assert len(spec.graphs) == n == 1, "recompiled for new batch contents"


def test_sliding_window_is_exercised(one_thread):
    """Negative control: with its window the tiny Mistral generates something else than without
    it, so the equality tests above really check sliding-window masks past the window."""
    target, _ = _pair("mistral")
    no_window = tiny_causal_lm("mistral", sliding_window=None)
    no_window.load_state_dict(target.state_dict())
    ids = prompt(12, seed=3)
    a = target.generate(ids, max_new_tokens=40, do_sample=False)
    b = no_window.generate(ids, max_new_tokens=40, do_sample=False)
    assert not torch.equal(a, b)


def test_mixed_layer_types_get_a_mask_per_type():
    target, _ = _pair("gemma2")
    runner = specfx.model.runner.ModelRunner(target, "target")
    assert runner.mask_plan.by_type == {"sliding_attention": ("sliding", 8), "full_attention": ("full", None)}


# model type -> config overrides giving a small instance; each must be refused at speculate().
REFUSED = {
    "rwkv": dict(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64, vocab_size=64),
    # qwen3_next, falcon_h1 and (verified by single steps, decision 90) mamba and jamba run as targets
    # (decisions 76, 79) and as draft models (81) since: tests/unit/model/test_hybrid_speculate.py,
    # tests/unit/drafters/test_stateful_draft.py
    "xlnet": dict(d_model=32, n_layer=2, n_head=2, d_inner=32, vocab_size=64),
    "openai-gpt": dict(n_embd=32, n_layer=2, n_head=2, vocab_size=64),
}


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_with_a_reason(arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **REFUSED[arch])).eval()
    with pytest.raises(ValueError, match=r"recurrent|linear-attention|KV cache|layers of type"):
        specfx.speculate(model, draft=model, compile=False)


_GENERIC = r"does not decode incrementally.*is_decoder=True.*position_ids"
_LATER = r"does not decode incrementally.*because its full forward attends to later tokens \(its logits for the first"


@pytest.mark.parametrize(
    "arch, overrides, match",
    [
        ("bert", dict(is_decoder=False), _LATER + r".*load the model with is_decoder=True"),
        ("mvp", {}, _GENERIC),
        # positions from the cache length; transformers 5.17's also attends to later tokens
        ("roformer", {}, _GENERIC + "|" + _LATER),
        ("gpt_neo", ARCHITECTURES["gpt_neo"].overrides, _GENERIC),
        ("moshi", {}, _GENERIC),
        # its first half's logits move with later tokens by a few 1e-4 of their scale, near the tolerance: whether the probe's
        # half-length forward shows it depends on the CPU's summation order, so either message is its cause
        ("hrm_text", {}, _GENERIC + "|" + _LATER),
    ],
)
def test_incremental_probe_refuses(arch, overrides, match):
    """Bidirectional heads, models that take positions from the cache length, GPT-Neo (window
    cut from the buffer length), Moshi (forward and cache disagree on the window) and HRM (a
    position's logits depend on later tokens) decode differently through specfx's hooks than
    their own full forward: refused up front. A forward that attends to later tokens within half
    the probe is named as the cause."""
    model = tiny_causal_lm(arch, **overrides)
    with pytest.raises(ValueError, match=match):
        specfx.speculate(model, draft=model, compile=False)


IF_CAUSAL = [a for a, s in ARCHITECTURES.items() if s.if_causal and installed(a)]


@pytest.mark.parametrize("arch", IF_CAUSAL)
def test_supported_only_where_the_installed_implementation_is_causal(arch, one_thread):
    """BigBird, MegatronBert and RemBert are causal as decoders from transformers 5.18 on; 5.17's
    attend to later tokens even with is_decoder=True. Read off HF's own path (its cached decoding
    against its full forward), not a version: where it decodes incrementally the row is in the
    matrix above; where not, HF's own generate() differs from greedy decoding with its forward, and
    speculate() refuses the model, naming the cause and the upgrade."""
    assert decodes_incrementally(tiny_causal_lm("bert"))  # the check can say both
    assert not decodes_incrementally(tiny_causal_lm("bert", is_decoder=False))
    target = _pair(arch)[0]
    if decodes_incrementally(target):
        assert arch in SUPPORTED  # test_greedy_equals_hf checks its tokens
        assert specfx.speculate(target, draft=target, compile=False).target_runner.probed_capacity > 0
    else:
        assert arch not in SUPPORTED
        ids = prompt(12, seed=3)
        greedy = ids
        with torch.no_grad():
            for _ in range(10):
                greedy = torch.cat([greedy, target(greedy).logits[:, -1:].argmax(-1)], dim=1)
        assert not torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None), greedy)
        refusal = _LATER + r".*sets is_decoder=True, yet the implementation in transformers \S+ attends bidirectionally"
        with pytest.raises(ValueError, match=refusal + r".*upgrade transformers"):
            specfx.speculate(target, draft=target, compile=False)


def test_bloom_falls_back_to_the_rowwise_protocol():
    """Bloom cannot take a 4-D mask (its ALiBi comes from a 2-D one); the probe picks the
    per-row 2-D protocol instead, and the equality tests above check it."""
    target, _ = _pair("bloom")
    assert specfx.model.runner.ModelRunner(target, "target").protocol == "rowwise_2d"
    assert specfx.model.runner.ModelRunner(_pair("llama")[0], "target").protocol == "mask_4d"


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_long_generation_past_window_and_capacity(arch, one_thread):
    """300 tokens with a window of 8: far past the window, and past the first buffer capacity
    (256), so the state is reallocated mid-life of the generator."""
    target = tiny_causal_lm(arch, max_positions=1024)
    spec = specfx.speculate(target, draft=perturbed_copy(target, 0.03), num_speculative_tokens=4, compile=False)
    kw = dict(max_new_tokens=300, do_sample=False, eos_token_id=None)
    ids = prompt(12, seed=9)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert spec.state.tokens.shape[1] > 256


# Refused model types of transformers 5.24 whose tiny configs build as they are (lara_mini, once here, runs
# since decision 79: tests/unit/model/test_hybrid_speculate.py)
NEW_REFUSED = [a for a in ("inkling2_loop_text",) if installed(a)]


@pytest.mark.parametrize("arch", NEW_REFUSED)
def test_new_types_refused_with_the_tables_reason(arch):
    model = tiny_causal_lm(arch, **ARCHITECTURES[arch].overrides)
    with pytest.raises(ValueError, match=re.escape(ARCHITECTURES[arch].reason)):
        specfx.speculate(model, draft=model, compile=False)


@pytest.mark.parametrize(
    "arch",
    [a for a, s in ARCHITECTURES.items() if s.status == "unsupported" and a != "gemma3n_text" and installed(a)],
)
def test_declared_unsupported_refused(arch):
    """Failures no generic check catches are declared in the table and refused with the reason."""
    model = tiny_causal_lm(arch, **ARCHITECTURES[arch].overrides)
    with pytest.raises(ValueError, match=r"is not supported by specfx: "):
        specfx.speculate(model, draft=model, compile=False)


# Hidden taps (specfx.passes.rewrites.hidden_taps): what drafters reading the target's hidden states get,
# from one capture per architecture (a token-tree verification; the causal forward is covered
# in tests/unit/passes/test_hidden_taps.py). Dynamo cannot capture CTRL's forward (it reassigns a
# registered buffer, self.pos_encoding): refused with the reason.
UNCAPTURABLE = ("ctrl",)
# Dory runs its recurrent layer twice, re-entering it from the input section's normalised
# output: no single hidden state crosses each layer boundary, so the taps pass refuses it.
LOOPED = tuple(a for a in ("dory",) if installed(a))
TAPS = ("layer:0", "layer:1", "last", "final")


class _Tapping(specfx.drafters.base.Drafter):
    """A drafter that reads the target's final hidden state (speculate() checks its taps)."""

    name = "tapping"
    taps = ("final",)


def _hf_hidden(model, ids):
    """HF's own forward of ``ids [1, S]`` at positions 0..S-1, by tap name: hidden_states[i]
    (the input of layer i), [-1] (after the final norm) and the last layer's output (a hook)."""
    from specfx.model.capture import decoder_layer_names

    last = model.get_submodule(decoder_layer_names(model)[-1])
    seen = []
    hook = last.register_forward_hook(lambda module, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
    kw = {}
    if "position_ids" in inspect.signature(model.forward).parameters:  # as the probe runs it: positions 0..S-1
        kw["position_ids"] = torch.arange(ids.shape[1]).unsqueeze(0)
    try:
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True, **kw).hidden_states
    finally:
        hook.remove()
    return {"last": seen[-1], "final": hidden[-1], **{f"layer:{i}": h for i, h in enumerate(hidden[:-1])}}


def _tree_taps(arch):
    """The runner's tapped tree verification (every node of TREE) after the left-padded prompts
    of a batch of 2 (8 and 10 tokens) were prefilled: (model, prompts, mask, node tokens, features)."""
    target = _pair(arch)[0]
    runner = specfx.model.runner.ModelRunner(target, "target")
    runner.allocate(2, 64)
    ids, mask = _ragged(batch=2)
    lengths = mask.sum(dim=1)  # [2]
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
    tables = TREE.tensors("cpu")
    nodes = prompt(TREE.size + 1, batch=2, seed=8)  # [2, N+1]: the pending token, then the nodes
    view = TreeView(lengths, tables.depth, tables.ancestors, tuple(range(TREE.size + 1)))
    tree_pos = lengths.unsqueeze(1) + tables.depth
    slots = lengths.unsqueeze(1) + torch.arange(TREE.size + 1)
    with torch.no_grad():
        runner.forward(ids, pos, torch.where(mask.bool(), pos, runner.cache.trash_slot))  # the prompts' KV
        logits, features = runner.forward(nodes, tree_pos, slots, tree=view, taps=TAPS)
        assert torch.equal(logits, runner.forward(nodes, tree_pos, slots, tree=view)), "tapping changed the logits"
    return target, ids, mask, nodes, features


@pytest.mark.parametrize(
    "arch",
    [
        pytest.param(a, marks=pytest.mark.xfail(strict=True, reason="ALiBi from slots: tree forward != HF (trees are refused for MPT; its causal taps: tests/unit/passes/test_hidden_taps.py)"))
        if a in TREE_SLOT_BIAS
        else a if a in REPRESENTATIVE else pytest.param(a, marks=pytest.mark.full)
        for a in SUPPORTED
        if a not in ROWWISE + UNCAPTURABLE + LOOPED
    ],
)
def test_taps_equal_hf_hidden_states(arch, one_thread):
    """Every node's taps equal HF's output_hidden_states of its row's prompt followed by the
    node's path (root .. node), and the tapped forward's logits are bit for bit the untapped
    one's. One HF forward per leaf covers the nodes on its path."""
    target, ids, mask, nodes, features = _tree_taps(arch)
    assert [f.shape[:2] for f in features] == [(2, TREE.size + 1)] * len(TAPS)
    assert not torch.allclose(features[0], features[1])  # neighbouring boundaries differ: the checks can fail
    tables = TREE.tensors("cpu")
    paths, depth = tables.path[0], tables.depth[0]  # [N+1, D+1], [N+1]
    leaves = [n for n in range(1, TREE.size + 1) if not TREE.has_children(n)]
    for b in range(2):
        real = ids[b, mask[b].bool()]
        for leaf in leaves:
            path = paths[leaf, : int(depth[leaf]) + 1]  # root .. leaf
            expected = _hf_hidden(target, torch.cat([real, nodes[b, path]]).unsqueeze(0))
            for tap, got in zip(TAPS, features, strict=True):
                ref = expected[tap][0, len(real) :]  # [len(path), H]
                scale = max(1.0, float(ref.abs().max()))
                torch.testing.assert_close(
                    got[b, path], ref, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, t=tap: f"{t}: {m}"
                )


@pytest.mark.parametrize("arch", UNCAPTURABLE)
def test_taps_refused_where_the_forward_cannot_be_captured(arch, one_thread):
    with pytest.raises(ValueError, match=r"hidden-state taps .* need its forward captured as one graph.*Unsupported"):
        _tree_taps(arch)


@pytest.mark.parametrize("arch", LOOPED)
def test_taps_and_early_exit_refused_for_looped_layers(arch, one_thread):
    with pytest.raises(ValueError, match=r"cannot be tapped: .*hidden_taps.*decoder layer 0 into layer 1"):
        _tree_taps(arch)
    with pytest.raises(ValueError, match=r"early_exit:1.*expected one hidden state to leave each decoder layer"):
        specfx.speculate(_pair(arch)[0], draft="early_exit:1", compile=False)


@pytest.mark.parametrize("arch", ROWWISE)
def test_rowwise_fallback_refuses_taps(arch):
    """At speculate() time for a drafter that reads hidden states, and in the runner's forward."""
    target, _ = _pair(arch)
    runner = specfx.model.runner.ModelRunner(target, "target")
    refusal = r"target \(\w+ForCausalLM\) needs a 2-D padding mask .* hidden states cannot be tapped in one forward"
    with pytest.raises(ValueError, match=refusal):
        runner.check_taps(("final",))
    with pytest.raises(ValueError, match=refusal):
        specfx.speculate(target, draft=_Tapping(), compile=False)
    runner.allocate(1, 16)
    zeros = torch.zeros((1, 2), dtype=torch.long)
    with pytest.raises(ValueError, match=refusal):
        runner.forward(zeros, zeros, zeros, taps=("final",))
