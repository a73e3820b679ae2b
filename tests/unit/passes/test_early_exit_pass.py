"""The early-exit pass on real captured model forwards (Dynamo capture, no Inductor).

Oracle: a deep copy of the model with its decoder-layer list truncated to N layers (the
user's model is never touched) must produce the same logits as the cut graph.
"""

import copy

import pytest
import torch
from torch import fx

from specfx.drafters.early_exit import capture_early_exit
from specfx.model.capture import decoder_layer_names
from specfx.testing.tiny import tiny_causal_lm
from specfx.passes.rewrites.early_exit import EarlyExitError, early_exit, layer_of
from specfx.model.runner import ModelRunner
from tests.conftest import ARCHS, prompt


def _truncated(model, n):
    """A copy of ``model`` whose decoder-layer ModuleList keeps its first n layers."""
    short = copy.deepcopy(model)
    container = decoder_layer_names(short)[0].rsplit(".", 1)[0]
    layers = short.get_submodule(container)
    del layers[n:]
    short.config.num_hidden_layers = n
    return short


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [1, 2])
def test_cut_graph_equals_truncated_model(arch, n, one_thread):
    model = tiny_causal_lm(arch, num_layers=3, seed=5)
    runner = ModelRunner(model, "target")
    runner.allocate(1, 64)
    t = 6
    graph = capture_early_exit(runner, n, batch_size=1, tokens=t)
    ids = prompt(t, seed=n)
    pos = torch.arange(t).unsqueeze(0)
    with torch.no_grad():
        got = graph(ids, pos, pos)
        expected = _truncated(model, n)(ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # and it is not the full model's output (the cut changed something)
    with torch.no_grad():
        assert not torch.allclose(got, model(ids).logits, atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_cut_removes_every_node_of_later_layers_and_their_kv_writes(arch, one_thread):
    model = tiny_causal_lm(arch, num_layers=3)
    runner = ModelRunner(model, "target")
    runner.allocate(1, 32)
    graph = capture_early_exit(runner, 1, batch_size=1)
    names = decoder_layer_names(model)
    layers = [layer_of(node, names) for node in graph.gm.graph.nodes]
    assert 0 in layers and all(i in (None, 0) for i in layers)
    assert graph.removed > 0
    # the only cache buffers left are layer 0's keys and values, bound to the target's tensors
    cache = runner.cache
    kv = [x for x in graph.bound if any(x is b for layer in cache.layers for b in (layer.keys, layer.values))]
    assert len(kv) == 2
    assert kv[0] is cache.layers[0].keys or kv[0] is cache.layers[0].values
    assert all(x is cache.layers[0].keys or x is cache.layers[0].values for x in kv)


def test_decoder_layers_found_by_container_not_by_name():
    assert decoder_layer_names(tiny_causal_lm("llama", num_layers=3))[2] == "model.layers.2"
    assert decoder_layer_names(tiny_causal_lm("gpt2", num_layers=3))[0] == "transformer.h.0"


def test_pass_rejects_out_of_range_layer():
    gm = fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(EarlyExitError, match=r"exit_layer must be in \[1, 2\], got 3"):
        early_exit(gm, layer_names=["a.0", "a.1", "a.2"], exit_layer=3)


def test_pass_names_missing_layer_structure():
    gm = fx.symbolic_trace(lambda x: x + 1)  # symbolic_trace of a lambda: no nn_module_stack
    with pytest.raises(EarlyExitError, match="no graph node was traced inside decoder layer"):
        early_exit(gm, layer_names=["a.0", "a.1"], exit_layer=1)
