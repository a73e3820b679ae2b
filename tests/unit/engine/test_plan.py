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
    nodes = [(0,), (1,), (0, 0)]
    spec = specfx.speculate(target, draft="prompt_lookup", tree=nodes, compile=False)
    shape = spec.plan.default
    assert spec.tree == specfx.TokenTree(nodes) and list(spec.plan.shapes) == [None]
    assert (shape.draft_tokens, shape.tree, shape.max_accepted) == (3, spec.tree, 2)
    assert shape.scratch_slots == spec.tree.scratch_slots == spec.k
    assert shape.verifies is spec.tree and shape.graph_id == (spec.tree, GREEDY, False)


def test_short_chain_tree_runs_as_that_chain(target):
    spec = specfx.speculate(target, draft="prompt_lookup", tree=[(0,), (0, 0)], compile=False)
    assert spec.tree is None and spec.spec_config.num_speculative_tokens == 2
    assert list(spec.plan.shapes) == [2] and spec.plan.default.tree is None


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
