"""The hidden-taps pass and the runner's tapped forward (Dynamo captures, no Inductor).

Oracle: HF's own ``output_hidden_states`` (``hidden_states[i]`` = the input of decoder layer
i, ``[-1]`` = after the final norm) and a forward hook on the last decoder layer ("last").
The conformance matrix (tests/conformance/test_conformance.py) runs the tree forward on every
architecture; this file covers the pass itself, the causal (prefill-shaped) forward, the
per-shape captures and the compiled round.
"""

import pytest
import torch
from torch import fx, nn

import specfx
from specfx.drafters.base import Drafter
from specfx.drafters.prompt_lookup import PromptLookup
from specfx.model.architectures import ARCHITECTURES
from specfx.model.capture import capture_forward, decoder_layer_names
from specfx.model.runner import ModelRunner
from specfx.passes import HiddenTapsError, PassError, hidden_taps
from specfx.passes.rewrites.early_exit import layer_of
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import ARCHS, left_padded, prompt

TAPS = ("layer:0", "layer:1", "layer:2", "last", "final")


def _runner(arch="llama", batch=2, capacity=64):
    runner = ModelRunner(tiny_causal_lm(arch, num_layers=3, seed=5, **ARCHITECTURES[arch].overrides), "target")
    runner.allocate(batch, capacity)
    return runner


def _hf(model, ids):
    """HF's hidden states of ``ids [1, S]`` by tap name (the last layer's output from a hook)."""
    last = model.get_submodule(decoder_layer_names(model)[-1])
    seen = []
    hook = last.register_forward_hook(lambda module, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return {"last": seen[-1], "final": hidden[-1], **{f"layer:{i}": h for i, h in enumerate(hidden[:-1])}}


def _assert_equal_to_hf(got, expected):
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


def test_pass_returns_the_boundaries_of_the_captured_graph(one_thread):
    """The graph returns (logits, *taps) and each tap is the node at its boundary: layer:i
    (i >= 1) made in layer i - 1, layer:0 and final outside the layers, last in the last layer."""
    runner = _runner()
    names = decoder_layer_names(runner.model)
    taps = ("final", "layer:2", "layer:0", "last", "layer:2")

    def tap(gm):
        return hidden_taps(gm, layer_names=names, taps=taps)

    graph = capture_forward(runner, 2, 5, transform=tap)
    assert graph.sites == len(taps)
    out = graph.gm.graph.output_node().args[0]
    assert len(out) == 1 + len(taps)
    assert out[0].meta["example_value"].shape == (2, 5, runner.vocab_size)
    final, layer2, layer0, last, again = out[1:]
    assert again is layer2  # a tap asked twice is one node, returned twice
    assert [layer_of(n, names) for n in (final, layer2, layer0, last)] == [None, 1, None, 2]
    assert "embed" in str(layer0.meta["nn_module_stack"]) and "norm" in str(final.meta["nn_module_stack"])


@pytest.mark.parametrize("arch", (*ARCHS, "gemma2", "mpt"))
def test_causal_forward_of_a_left_padded_batch_equals_hf(arch, one_thread):
    """The prefill-shaped forward: a left-padded batch of 2 (prompts of 5 and 8 tokens, padding
    in the trash slot); every real position's taps equal HF's for that row alone, and the
    logits are bit for bit the untapped forward's (gemma2: a mask per layer type and
    softcapping; mpt: ALiBi, whose tree forward the matrix cannot check)."""
    runner = _runner(arch)
    ids, mask = left_padded(8, (3, 0), seed=2)
    pos = (mask.cumsum(dim=1) - 1).clamp_min(0)
    slots = torch.where(mask.bool(), pos, runner.cache.trash_slot)
    with torch.no_grad():
        logits, features = runner.forward(ids, pos, slots, taps=TAPS)
        assert torch.equal(logits, runner.forward(ids, pos, slots))
    assert [f.shape for f in features] == [(2, 8, runner.model.config.hidden_size)] * len(TAPS)
    for b in range(2):
        real = mask[b].bool()
        expected = _hf(runner.model, ids[b, real].unsqueeze(0))
        for tap, got in zip(TAPS, features, strict=True):
            _assert_equal_to_hf(got[b, real], expected[tap][0])
    # negative control: neighbouring boundaries differ, so the comparisons above can fail
    assert not torch.allclose(features[1], features[2]) and not torch.allclose(features[3], features[4])


def test_bad_tap_names_are_refused_with_the_valid_ones():
    runner = _runner()
    valid = r"valid taps are 'final', 'last', 'layer:0', 'layer:1', 'layer:2'"
    with pytest.raises(
        ValueError, match=r"unknown hidden-state tap 'layer:3': the target has 3 decoder layers.*" + valid
    ):
        runner.check_taps(("layer:3",))
    with pytest.raises(ValueError, match=r"unknown hidden-state tap 'hidden'.*0 <= i < 3"):
        runner.check_taps(("final", "hidden"))
    with pytest.raises(ValueError, match=r"tuple of tap names"):
        runner.check_taps("final")
    zeros = torch.zeros((2, 1), dtype=torch.long)
    with pytest.raises(ValueError, match=r"unknown hidden-state tap 'layer:-1'"):
        runner.forward(zeros, zeros, zeros, taps=("layer:-1",))
    assert not runner.taps.graphs  # refused before any capture

    class BadTaps(Drafter):
        name = "bad_taps"
        taps = ("layer:7",)

    with pytest.raises(ValueError, match=r"unknown hidden-state tap 'layer:7'.*valid taps"):
        specfx.speculate(runner.model, draft=BadTaps(), compile=False)


def test_graph_without_layer_structure_is_a_clear_error():
    gm = fx.symbolic_trace(lambda x: x + 1)  # symbolic_trace of a lambda: no nn_module_stack
    with pytest.raises(HiddenTapsError, match="no graph node was traced inside decoder layer"):
        hidden_taps(gm, layer_names=["model.layers.0", "model.layers.1"], taps=("final",))
    with pytest.raises(ValueError, match=r"unknown hidden-state tap 'layer:2'"):
        hidden_taps(gm, layer_names=["model.layers.0", "model.layers.1"], taps=("layer:2",))


class _TwoStreams(nn.Module):
    """A toy LM whose layers hand each other two [B, T, H] values (a hidden state and a
    separate residual): no single hidden state crosses a layer boundary."""

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, h, r):
            return h * self.w + r, r * 2

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_TwoStreams.Layer(), _TwoStreams.Layer()])

        def forward(self, x):
            h, r = x * 3, x + 1
            for layer in self.layers:
                h, r = layer(h, r)
            return h

    def __init__(self):
        super().__init__()
        self.model = _TwoStreams.Decoder()

    def forward(self, x):
        return self.model(x) * 2


def _dynamo_graph(module, *args) -> fx.GraphModule:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(module, backend=record, fullgraph=True, dynamic=False)(*args)
    return graphs[0]


def test_ambiguous_boundary_is_a_clear_error():
    gm = _dynamo_graph(_TwoStreams(), torch.ones(1, 3, 4))
    names = ["model.layers.0", "model.layers.1"]
    with pytest.raises(
        HiddenTapsError, match=r"expected one hidden state to cross from decoder layer 0 into layer 1, found 2"
    ):
        hidden_taps(gm, layer_names=names, taps=("layer:1",))
    with pytest.raises(HiddenTapsError, match=r"cross from the embeddings into decoder layer 0, found 2"):
        hidden_taps(gm, layer_names=names, taps=("layer:0",))
    assert hidden_taps(gm, layer_names=names, taps=("last", "final")) == 2  # one value leaves the last layer


class _InPlace(nn.Module):
    """A toy LM whose second layer scales its input in place (``h.mul_(2)``)."""

    class Layer(nn.Module):
        def __init__(self, in_place: bool):
            super().__init__()
            self.in_place = in_place

        def forward(self, h):
            return (h.mul_(2) if self.in_place else h * 3) + 1

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_InPlace.Layer(False), _InPlace.Layer(True)])

        def forward(self, x):
            h = x + 0
            for layer in self.layers:
                h = layer(h)
            return h

    def __init__(self):
        super().__init__()
        self.model = _InPlace.Decoder()

    def forward(self, x):
        return self.model(x) * 2


def test_a_tap_mutated_in_place_later_is_the_value_it_had():
    x = torch.arange(12.0).view(1, 3, 4)
    gm = _dynamo_graph(_InPlace(), x)
    assert hidden_taps(gm, layer_names=["model.layers.0", "model.layers.1"], taps=("layer:0", "layer:1")) == 2
    logits, entering0, entering1 = gm(x.clone())
    torch.testing.assert_close(entering0, x)
    torch.testing.assert_close(entering1, x * 3 + 1)  # before layer 1 doubled it in place
    torch.testing.assert_close(logits, ((x * 3 + 1) * 2 + 1) * 2)


def test_pass_errors_name_the_pass_in_the_runner(monkeypatch, one_thread):
    """A model whose graph the pass cannot read is refused at capture with a ValueError naming
    the pass (the PassError is its cause)."""
    runner = _runner()
    monkeypatch.setattr("specfx.model.taps.decoder_layer_names", lambda model: ["nowhere.0", "nowhere.1", "nowhere.2"])
    zeros = torch.zeros((2, 1), dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"cannot be tapped: specfx pass 'hidden_taps' failed.*no graph node was traced inside decoder"
    ) as refused:
        runner.forward(zeros, zeros, torch.full_like(zeros, runner.cache.trash_slot), taps=("final",))
    assert isinstance(refused.value.__cause__, PassError)


def test_captures_are_kept_per_shape_and_dropped_with_the_capacity(one_thread):
    runner = _runner(capacity=32)
    runner.prepare_taps(2, 3, ("final",))
    first = dict(runner.taps.graphs)
    runner.prepare_taps(2, 3, ("final",))  # captured already: nothing new
    runner.prepare_taps(2, 3, ("final", "layer:1"))  # other taps: a capture of its own
    assert len(runner.taps.graphs) == 2 and all(runner.taps.graphs[k] is g for k, g in first.items())
    runner.allocate(2, 32)  # reallocated, same shape: the captures serve the new buffers
    assert len(runner.taps.graphs) == 2
    ids = prompt(3, batch=2, seed=1)
    pos = torch.arange(3).expand(2, -1)
    with torch.no_grad():
        logits, (final,) = runner.forward(ids, pos, pos, taps=("final",))
        assert torch.equal(logits, runner.forward(ids, pos, pos))
    _assert_equal_to_hf(final[0], _hf(runner.model, ids[:1])["final"][0])
    runner.allocate(2, 64)  # grown: the old capacity's captures go
    assert runner.taps.graphs == {}


def test_a_shape_missed_before_compiling_is_an_internal_error(one_thread):
    runner = _runner()
    ids = prompt(3, batch=2, seed=1)
    pos = torch.arange(3).expand(2, -1)

    def forward(ids, pos):
        return runner.forward(ids, pos, pos, taps=("final",))

    with pytest.raises(Exception, match=r"specfx internal error.*not captured beforehand.*prepare_taps"):
        torch.compile(forward, backend="eager", fullgraph=True)(ids, pos)
    runner.prepare_taps(2, 3, ("final",))
    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        logits, (final,) = compiled(ids, pos)
        expected_logits, (expected,) = runner.forward(ids, pos, pos, taps=("final",))
    assert torch.equal(logits, expected_logits) and torch.equal(final, expected)


@pytest.mark.compiled
def test_compiled_mtp_round_does_not_recompile_for_another_prompt_length(one_thread):
    """The tapped forward of a new prompt bucket is captured eagerly (prefill runs eagerly);
    the compiled round graph, which inlined the round's own capture, is not traced again."""
    from specfx.testing.mtp import mtp_target

    target, layers = mtp_target("deepseek_v3", 1)
    spec = specfx.speculate(target, draft=specfx.MTP(layers=layers), num_speculative_tokens=2, backend="specfx_eager")
    ids = prompt(6, batch=2, seed=1)
    assert torch.equal(spec.generate(ids, max_new_tokens=10), target.generate(ids, max_new_tokens=10))
    assert [e.key[0] for e in spec.compile_events] == ["round"]
    captured = len(spec.target_runner.taps.graphs)
    ids = prompt(20, batch=2, seed=2)  # another prefill bucket (16 -> 64)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(spec.generate(ids, max_new_tokens=10), target.generate(ids, max_new_tokens=10))
    assert len(spec.target_runner.taps.graphs) == captured + 1  # the new bucket's prefill
    assert len(spec.compile_events) == 1


class _TappingLookup(PromptLookup):
    """Prompt lookup that also reads two hidden states, as tree heads (EAGLE) will: observe()
    keeps the pending token's "final" features in a static buffer."""

    taps = ("layer:1", "final")

    def allocate(self, batch_size, capacity):
        super().allocate(batch_size, capacity)
        self.seen = torch.zeros((batch_size, 1, 64))

    def observe(self, ctx, features, positions, slots):
        self.seen.copy_(features[1][:, :1])


@pytest.mark.compiled
def test_compiled_tree_round_with_taps_is_one_graph_and_stays_warm(one_thread):
    """The tree verification's tapped capture is prepared before the round compiles (the tree
    key), the round is one graph, and a second call recompiles nothing."""
    from specfx.trees.types import TokenTree

    target = tiny_causal_lm("llama", num_layers=3, seed=5)
    drafter = _TappingLookup()
    tree = TokenTree([(0,), (1,), (0, 0)])
    spec = specfx.speculate(target, draft=drafter, tree=tree, num_speculative_tokens=tree.size, backend="specfx_eager")
    ids, mask = left_padded(10, (0, 3), seed=7)
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert [e.key[0] for e in spec.compile_events] == ["round"]
    trees = [k[3] for k in spec.target_runner.taps.graphs if k[3] is not None]
    assert trees == [(1, tree.size, tuple(range(tree.size + 1)))]
    assert drafter.seen.abs().sum() > 0  # observe() ran with the features
    ids, mask = left_padded(7, (2, 0), seed=8)
    kw["attention_mask"] = mask
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert len(spec.compile_events) == 1
