"""Early exit drafting token trees (``speculate(draft="early_exit:N", tree=...)``): greedy
equality with ``model.generate()`` for a full top-k tree and an irregular one, batch 1 and a
left-padded batch; the level graphs are captured ones, used eagerly too; an exit that equals
the whole model has its whole rank-0 path accepted every round; one compiled round graph.
Eager rounds except one compiled test (Dynamo + the specfx passes, no Inductor)."""

import pytest
import torch

import specfx
from specfx.drafters.base import TreeDrafting
from specfx.drafters.early_exit import ExitGraph, capture_early_exit
from specfx.model.masks import TreeView
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import tiny_causal_lm
from specfx.trees.drafting import draft_levels
from specfx.trees.types import TokenTree
from tests.conftest import left_padded, prompt, tiered

# depth 4; nodes with children at depth 1: (0,), (2,); depth 2: (0, 0), (0, 1); depth 3: (0, 0, 0)
IRREGULAR = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)])
TREES = {"topk(3, 2)": TokenTree.topk(3, 2), "irregular": IRREGULAR}

_models = {}


def _target(arch):
    if arch not in _models:
        _models[arch] = tiny_causal_lm(arch, num_layers=3, seed=11)
    return _models[arch]


def _check_depth_stats(stats, tree):
    """per_depth[i]: rounds whose accepted path reached depth i + 1, so it has D entries, falls
    with depth, never exceeds the rounds, and sums to the accepted count."""
    per_depth = stats.per_depth
    assert len(per_depth) == tree.depth
    assert per_depth == sorted(per_depth, reverse=True)
    assert per_depth[0] <= stats.row_rounds
    assert sum(per_depth) == stats.accepted
    assert stats.proposed == tree.size * stats.row_rounds


@pytest.mark.parametrize("arch", tiered(["llama", "gpt2"], ["llama"]))
@pytest.mark.parametrize("name", tiered(list(TREES), []))
def test_tree_greedy_equals_generate(arch, name, one_thread, monkeypatch):
    tree = TREES[name]
    target = _target(arch)
    calls = []  # the queries of every ExitGraph call (None: the causal one-token graph)
    original = ExitGraph.__call__

    def spy(self, *args, tree=None):
        calls.append(tree.queries if tree is not None else None)
        return original(self, *args, tree=tree)

    monkeypatch.setattr(ExitGraph, "__call__", spy)
    spec = specfx.speculate(target, draft="early_exit:2", tree=tree, num_speculative_tokens=tree.size, compile=False)
    assert spec.tree == tree and isinstance(spec.drafter, TreeDrafting)
    ids = prompt(9, seed=3)
    assert torch.equal(spec.generate(ids, max_new_tokens=30), target.generate(ids, max_new_tokens=30))
    _check_depth_stats(spec.stats, tree)
    # eager rounds draft with the captured graphs: the root's, then one per level, every round
    levels = draft_levels(tree)
    assert list(spec.drafter.levels) == levels
    assert calls == [None, *levels] * spec.stats.rounds

    ids, mask = left_padded(11, (4, 0, 7), seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=25, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    _check_depth_stats(spec.stats, tree)
    assert len(spec.stats.per_row_accepted) == 3


@pytest.mark.full
def test_exit_equal_to_the_model_accepts_the_whole_rank0_path(one_thread):
    """Later layers zeroed (each block the identity on the residual stream): the exit after
    layer 1 is the whole model, so every level must draft from the right context (its
    ancestors' KV at their scratch slots, positions by depth) for the rank-0 path to be
    accepted to the full depth every round."""
    target = tiny_causal_lm("llama", num_layers=3, seed=2)
    with torch.no_grad():
        for block in target.model.layers[1:]:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
    spec = specfx.speculate(target, draft="early_exit:1", tree=IRREGULAR, num_speculative_tokens=IRREGULAR.size, compile=False)
    ids, mask = left_padded(8, (0, 3), seed=6)
    kw = dict(attention_mask=mask, max_new_tokens=26, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    stats = spec.stats
    assert stats.per_depth == [stats.row_rounds] * IRREGULAR.depth
    assert stats.accepted == IRREGULAR.depth * stats.row_rounds


def test_level_graph_is_the_runners_tree_forward_cut(one_thread):
    """A level capture equals the runner's own tree forward of a model truncated to N layers:
    same inputs, same mask; it refuses a call with other queries or without the tree."""
    from tests.unit.passes.test_early_exit_pass import _truncated

    model = tiny_causal_lm("llama", num_layers=3, seed=5)
    runner = ModelRunner(model, "target")
    runner.allocate(2, 64)
    short = ModelRunner(_truncated(model, 2), "target")
    short.allocate(2, 64)
    tree = IRREGULAR
    queries = draft_levels(tree)[1]  # depth 2: nodes 4 and 5
    graph = capture_early_exit(runner, 2, batch_size=2, tree=tree, queries=queries)
    tables = tree.tensors("cpu")
    lengths = torch.tensor([5, 9])
    view = TreeView(lengths, tables.depth, tables.ancestors, queries)
    q = torch.tensor(queries)
    ids = prompt(len(queries), batch=2, seed=1)
    pos, slots = lengths.unsqueeze(1) + tables.depth[:, q], lengths.unsqueeze(1) + q
    context = prompt(20, batch=2, seed=2)  # committed prefix and ancestors' KV in both caches
    for r in (runner, short):
        with torch.no_grad():
            r.forward(context, torch.arange(20).expand(2, -1), torch.arange(20).expand(2, -1))
    with torch.no_grad():
        got = graph(ids, pos, slots, tree=view)
        expected = short.forward(ids, pos, slots, tree=view)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"captured for token-tree nodes \(4, 5\).*tree queries \(1, 3\)"):
        graph(ids, pos, slots, tree=TreeView(lengths, tables.depth, tables.ancestors, (1, 3)))
    with pytest.raises(ValueError, match=r"called with no tree"):
        graph(ids, pos, slots)
    with pytest.raises(ValueError, match="tree= and queries= together"):
        capture_early_exit(runner, 2, batch_size=2, tree=tree)


@pytest.mark.full  # the capture cache's bookkeeping; the tree rounds themselves are tested above
def test_level_captures_are_kept_per_shape_and_dropped_with_the_tree(one_thread):
    """Batch buckets 1 and 2 keep their captures (a switch back reuses them: a compiled round
    would otherwise recompile); another tree's levels replace the old tree's."""
    target = _target("llama")
    drafter = specfx.EarlyExit(layer=1)
    spec = specfx.speculate(target, draft=drafter, tree=IRREGULAR, compile=False)
    seen = []
    for batch in (1, 2, 1):
        ids = prompt(6, batch=batch, seed=batch)
        assert torch.equal(spec.generate(ids, max_new_tokens=8), target.generate(ids, max_new_tokens=8))
        seen.append(dict(drafter.levels))
    assert all(seen[0][q] is seen[2][q] for q in seen[0]) and seen[0][(1, 3)] is not seen[1][(1, 3)]
    assert len(drafter._graphs) == 2 * (1 + len(draft_levels(IRREGULAR)))
    other = TokenTree.topk(2, 2)
    spec = specfx.speculate(target, draft=drafter, tree=other, compile=False)
    ids = prompt(6, seed=1)
    assert torch.equal(spec.generate(ids, max_new_tokens=8), target.generate(ids, max_new_tokens=8))
    assert list(drafter.levels) == draft_levels(other) == [(1, 2)]
    assert {k[2] for k in drafter._graphs} == {None, (other.size, (1, 2))}


@pytest.mark.compiled
def test_compiled_tree_round_is_one_graph_and_stays_warm(one_thread):
    target = _target("llama")
    spec = specfx.speculate(target, draft="early_exit:1", tree=IRREGULAR, num_speculative_tokens=IRREGULAR.size, backend="specfx_eager")
    ids, mask = left_padded(10, (0, 3), seed=7)
    kw = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert [e.key[0] for e in spec.compile_events] == ["round"]
    round_graph = max(spec.graphs, key=lambda g: g.nodes)
    levels = len(draft_levels(IRREGULAR))
    # KV writes, keys and values: the root and each level through layer 0 only, the verification
    # through all 3 layers, the accepted path's compaction in all 3
    assert dict(round_graph.report.sites)["check_static_kv"] == 2 * ((1 + levels) * 1 + 3 + 3)
    _check_depth_stats(spec.stats, IRREGULAR)
    ids, mask = left_padded(7, (2, 0), seed=8)
    kw["attention_mask"] = mask
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert len(spec.compile_events) == 1  # warm: nothing recompiled
