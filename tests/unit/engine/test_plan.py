"""Planning (:mod:`specfx.engine.plan`): chain or tree, a short tree run as a chain, the depth
refusal, the default "auto" cut to the drafter's depth, and the RoundShape each round gets.
Eager generators on a tiny model: nothing compiles."""

import dataclasses

import pytest

import specfx
from specfx.drafters.prompt_lookup import PromptLookup
from specfx.engine.plan import RoundShape
from specfx.sampling.processors import GREEDY, Mode
from specfx.testing.tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("llama", seed=0)


def _shallow(depth):
    """Prompt lookup limited to ``depth`` tokens along a path (as Medusa is by its head count)."""

    class Shallow(PromptLookup):
        max_depth = depth

    return Shallow()


def test_fixed_k_is_one_chain_shape(target):
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=3, compile=False)
    plan = spec.plan
    assert not plan.auto and plan.tree is None and list(plan.shapes) == [3]
    assert plan.default == RoundShape(3, None, 3, 3, GREEDY, False)
    assert (plan.scratch_slots, plan.max_accepted, spec.k, spec.max_graphs) == (3, 3, 3, 16)


def test_auto_has_a_shape_per_k_and_k_zero(target):
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens="auto", auto_k_values=(1, 4), compile=False)
    plan = spec.plan
    assert plan.auto and spec.auto_k is not None
    assert list(plan.shapes) == [0, 1, 4] and plan.default.draft_tokens == 4
    assert plan.shape(0) == RoundShape.chain(0) and plan.shape(0).max_accepted == 0
    assert spec.max_graphs == 16 * 3  # 16 per K a round may use


def test_tree_plan_and_its_shape(target):
    """A tree with num_speculative_tokens unset: "auto" between the tree (key None) and K = 0;
    num_speculative_tokens = its node count: the tree every round."""
    nodes = [(0,), (1,), (0, 0)]
    spec = specfx.speculate(target, draft="prompt_lookup", tree=nodes, compile=False)
    shape = spec.plan.default
    assert spec.tree == specfx.TokenTree(nodes) and list(spec.plan.shapes) == [0, None] and spec.plan.auto
    assert spec.plan.shape(0) == RoundShape.chain(0) and spec.plan.shape(None) is shape
    assert spec.spec_config.num_speculative_tokens == "auto" and spec.max_graphs == 16 * 2
    assert (shape.draft_tokens, shape.tree, shape.max_accepted) == (3, spec.tree, 2)
    assert shape.scratch_slots == spec.tree.scratch_slots == spec.k
    assert shape.verifies is spec.tree and shape.graph_id == (spec.tree, GREEDY, False)
    fixed = specfx.speculate(target, draft="prompt_lookup", tree=nodes, num_speculative_tokens=3, compile=False)
    assert list(fixed.plan.shapes) == [None] and not fixed.plan.auto and fixed.auto_k is None
    assert fixed.plan.default == shape and fixed.max_graphs == 16
    explicit = specfx.speculate(target, draft="prompt_lookup", tree=nodes, num_speculative_tokens="auto", compile=False)
    assert explicit.plan == spec.plan


def test_tree_k_must_be_its_node_count(target):
    nodes = [(0,), (1,), (0, 0)]
    with pytest.raises(ValueError, match=r"tree of 3 nodes.* pass num_speculative_tokens=3 to run the tree every"):
        specfx.speculate(target, draft="prompt_lookup", tree=nodes, num_speculative_tokens=2, compile=False)
    with pytest.raises(ValueError, match=r"draft='lookahead', num_speculative_tokens=5\): each round verifies a tree"):
        specfx.speculate(target, draft="lookahead:4,3,2", num_speculative_tokens=5, compile=False)
    big = [(g,) + (0,) * d for g in range(6) for d in range(3)]  # 18 nodes: an int above 16 is allowed with a tree
    pinned = specfx.speculate(target, draft="prompt_lookup", tree=big, num_speculative_tokens=18, compile=False)
    assert pinned.auto_k is None and pinned.plan.default.draft_tokens == 18


def test_lookahead_plans_auto_against_k_zero_unless_its_node_count_is_given(target):
    spec = specfx.speculate(target, draft="lookahead:4,3,2", compile=False)
    assert spec.plan.auto and list(spec.plan.shapes) == [0, None]
    tree = spec.plan.shape(None)
    assert tree.tree == spec.drafter.round_tree() and tree.scratch_slots == 4 + spec.drafter.branch_slots
    assert spec.auto_k.resumable and spec.auto_k.depth == 2 and spec.auto_k.width == tree.scratch_slots
    fixed = specfx.speculate(target, draft="lookahead:4,3,2", num_speculative_tokens=4, compile=False)
    assert not fixed.plan.auto and list(fixed.plan.shapes) == [None] and fixed.auto_k is None


def test_short_chain_tree_runs_as_that_chain(target):
    spec = specfx.speculate(target, draft="prompt_lookup", tree=[(0,), (0, 0)], num_speculative_tokens=2, compile=False)
    assert spec.tree is None and spec.spec_config.num_speculative_tokens == 2
    assert list(spec.plan.shapes) == [2] and spec.plan.default.tree is None
    auto = specfx.speculate(target, draft="prompt_lookup", tree=[(0,), (0, 0)], compile=False)
    assert auto.tree is None and auto.spec_config.num_speculative_tokens == "auto"
    assert list(auto.plan.shapes) == [0, 2] and auto.auto_k.candidates == (0, 2)


def test_chain_auto_times_need_a_k(target):
    with pytest.raises(ValueError, match=r"auto_k_times=\{0: 1.0, None: 2.0\}\): 'auto' chooses a chain's K here"):
        specfx.speculate(target, draft="prompt_lookup", auto_k_times={0: 1.0, None: 2.0}, compile=False)


def test_depth_refused(target):
    with pytest.raises(ValueError, match="proposes at most 2"):
        specfx.speculate(target, draft=_shallow(2), num_speculative_tokens=3, compile=False)
    with pytest.raises(ValueError, match="the tree is 3 deep"):
        specfx.speculate(target, draft=_shallow(2), tree=[(0,), (1,), (0, 0), (0, 0, 0)], compile=False)


def test_default_auto_values_cut_to_max_depth(target):
    spec = specfx.speculate(target, draft=_shallow(3), compile=False)
    assert spec.spec_config.num_speculative_tokens == "auto"
    assert spec.spec_config.auto_k_values == (1, 2) and list(spec.plan.shapes) == [0, 1, 2]


def test_round_shape_is_a_hashable_constant_per_call(target):
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, compile=False)
    sampling = Mode(True, penalty=False)
    shape = spec.round_shape(None, sampling, True)
    assert shape is spec.round_shape(None, Mode(True, penalty=False), True)  # the same object every call
    assert shape == dataclasses.replace(spec.plan.default, mode=sampling, collect=True)
    assert hash(shape) == hash(spec.plan.default.for_call(sampling, True))
    assert shape.graph_id == (2, sampling, True) and shape != spec.plan.default
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.draft_tokens = 3
