"""Mask patterns and formats have one home (specfx.model.masks), used by the target's runner and by
the MTP drafter; long-lived buffers are marked static through graph_utils.mark_static; token-tree
masks (a node sees the committed prefix and its ancestors) match a brute-force reference."""

import random

import pytest
import torch
from transformers import PretrainedConfig

from specfx.drafters import mtp as mtp_module
from specfx.model import cache as cache_module
from specfx.model.masks import MaskPlan, TreeView, build_mask, layer_pattern, to_format, visible_slots
from specfx.trees.types import TreeTensors
from tests.unit.trees.test_tree import SIX_PARENTS, random_parents, reference_tables


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
    from specfx.model.runner import ModelRunner
    from specfx.testing.mtp import BUILT, mtp_target

    # Mellum's MTP layer is a sliding-window layer (transformers builds it from 5.20 on); the
    # config is patched to one either way
    target, layers = mtp_target("mellum" if "mellum" in BUILT else "glm4_moe", 1)
    runner = ModelRunner(target, role="target")
    monkeypatch.setattr(layers.config, "layer_types", ["sliding_attention"], raising=False)
    monkeypatch.setattr(layers.config, "sliding_window", None, raising=False)
    with pytest.raises(ValueError, match=r"draft='mtp': .* MTP layers has 'sliding_attention' layers but config"):
        mtp_module.MTP(layers=layers).bind(runner)


def test_kv_buffers_and_the_mtp_stash_are_marked_static(monkeypatch):
    """CUDA-graph trees copy non-static inputs on every replay and skip graphs whose in-place
    writes hit them; KV buffers and the MTP stash must go through mark_static (a no-op on CPU,
    so the call itself is checked)."""
    marked = []
    monkeypatch.setattr(cache_module, "mark_static", lambda *ts: marked.extend(ts))
    monkeypatch.setattr(mtp_module, "mark_static", lambda *ts: marked.extend(ts))
    from specfx.model.runner import ModelRunner
    from specfx.testing.mtp import mtp_target

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


# --------------------------------------------------------------------------- token-tree masks
def _tree_reference(lengths, parents, queries, capacity, pattern):
    """visible[b][t][j] by brute force: node q = queries[t] of row b sits at position
    L + depth[q] and sees committed slots 0..L (positions = slots) and the slots L + m of its
    ancestors m (itself included; positions L + depth[m]); the window or chunk is measured
    between the query's position and the key's."""
    kind, size = pattern
    out = []
    for b, length in enumerate(lengths):
        parent = parents[b if len(parents) > 1 else 0]
        n = len(parent) - 1
        depth, ancestors, _ = reference_tables(parent, n)
        rows = []
        for q in queries:
            pos = length + depth[q]
            row = []
            for j in range(capacity):
                if j <= length:
                    visible, key = True, j
                elif j <= length + n:
                    visible, key = ancestors[q][j - length], length + depth[j - length]
                else:
                    visible, key = False, j
                if kind == "sliding":
                    visible = visible and key > pos - size
                elif kind == "chunked":
                    visible = visible and key // size == pos // size
                row.append(visible)
            rows.append(row)
        out.append(rows)
    return out


def _tree_case(parents, lengths, queries):
    """(TreeView, positions [B, T]) for ``parents`` ([N+1] lists, one or one per row)."""
    tables = TreeTensors.from_parents(torch.tensor(parents), len(parents[0]) - 1)
    lengths = torch.tensor(lengths)
    q = torch.tensor(queries)
    positions = lengths.unsqueeze(1) + tables.depth.expand(len(lengths), -1)[:, q]  # [B, T]
    return TreeView(lengths, tables.depth, tables.ancestors, tuple(queries)), positions


TREE_PATTERNS = [("full", None), ("sliding", 3), ("sliding", 1), ("chunked", 4)]


@pytest.mark.parametrize("pattern", TREE_PATTERNS, ids=lambda p: f"{p[0]}{p[1] or ''}")
@pytest.mark.parametrize(
    ("per_row", "queries"),
    [(False, range(7)), (False, (3, 4, 5)), (True, range(7)), (True, (2, 6))],
    ids=["one-tree-all-nodes", "one-tree-one-level", "tree-per-row-all-nodes", "tree-per-row-some-nodes"],
)
def test_tree_visibility_matches_brute_force(pattern, per_row, queries):
    """Rows at L = 0, 5, 13 and 23 (23 + 6 = 29 = capacity - 3: the last tree slot right
    before two stale slots and the trash slot); the trash slot is never visible."""
    rng = random.Random(1)
    lengths, capacity = [0, 5, 13, 23], 32
    parents = (
        [list(SIX_PARENTS)] if not per_row else [list(SIX_PARENTS)] + [random_parents(6, rng) for _ in lengths[1:]]
    )
    view, positions = _tree_case(parents, lengths, list(queries))
    visible = visible_slots(positions, capacity, pattern, view)  # [B, 1, T, C]
    assert visible.shape == (4, 1, len(queries), capacity)
    assert visible[:, 0].tolist() == _tree_reference(lengths, parents, list(queries), capacity, pattern)
    assert not visible[..., capacity - 1].any()


def test_tree_masks_per_layer_type():
    """A model with sliding and full layers gets one tree mask per layer type, each the
    visibility of its own pattern."""
    view, positions = _tree_case([list(SIX_PARENTS)], [9, 4], list(range(7)))
    plan = MaskPlan(None, {"sliding_attention": ("sliding", 2), "full_attention": ("full", None)})
    masks = plan.build(positions, 24, "additive", torch.float32, view)
    assert set(masks) == {"sliding_attention", "full_attention"}
    for layer_type, pattern in plan.by_type.items():
        assert torch.equal(masks[layer_type] == 0, visible_slots(positions, 24, pattern, view))
    assert not torch.equal(masks["sliding_attention"], masks["full_attention"])
