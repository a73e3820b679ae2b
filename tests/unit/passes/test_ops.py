"""The one reader of node meta (specfx.passes.ops): Dynamo's ``example_value`` or make_fx's
``val``, the first present; a tensor only where the caller asks for one; nothing guessed."""

import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from specfx.passes.ops import node_tensor, node_value, tensor_rank


def _nodes():
    gm = fx.symbolic_trace(lambda x: x + 1)
    return gm, [n for n in gm.graph.nodes]


def test_reads_the_first_key_present_whatever_it_holds():
    _, (x, add, _) = _nodes()
    t = torch.zeros(2, 3)
    x.meta["val"] = t
    assert node_value(x) is t and node_tensor(x) is t
    x.meta["example_value"] = (t, t)  # Dynamo's key comes first, even when it holds a tuple
    assert node_value(x) == (t, t) and node_tensor(x) is None
    assert node_value(add) is None and node_tensor(add) is None  # no meta: unknown
    assert node_value(3) is None and node_tensor("x") is None  # not a node


def test_tensor_rank_falls_back_to_shape_prop():
    gm, (x, add, _) = _nodes()
    assert tensor_rank(add) is None
    ShapeProp(gm).propagate(torch.zeros(2, 3, 4))
    assert node_value(add) is None  # tensor_meta is a shape, not a value
    assert tensor_rank(add) == 3
    add.meta["example_value"] = torch.zeros(5)
    assert tensor_rank(add) == 1  # the example value wins
