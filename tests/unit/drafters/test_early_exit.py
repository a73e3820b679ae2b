"""Early-exit self-speculation (``draft="early_exit:N"`` / ``specfx.EarlyExit``): greedy
equality with ``model.generate()``, lossless sampling, shared weights and KV, bad input.
Eager rounds except one compiled test."""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import LogitsProcessorList

import specfx
from specfx.testing.tiny import tiny_causal_lm
from tests.conftest import ARCHS, left_padded, prompt, round_backends, tiered
from tests.lossless.test_lossless import NEW, ROWS, _chisquare, _exact, _models

_models_cache = {}


def _target(arch, layers=3):
    key = (arch, layers)
    if key not in _models_cache:
        _models_cache[key] = tiny_causal_lm(arch, num_layers=layers, seed=11)
    return _models_cache[key]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layer", tiered([1, 2], [1]))
def test_greedy_equals_generate(arch, layer, one_thread):
    target = _target(arch)
    spec = specfx.speculate(target, draft=f"early_exit:{layer}", num_speculative_tokens=3, compile=False)
    assert spec.drafter.name == "early_exit" and spec.drafter.layer == layer
    for length, new in [(1, 9), (7, 23), (20, 41)]:
        ids = prompt(length, seed=length)
        assert torch.equal(spec.generate(ids, max_new_tokens=new), target.generate(ids, max_new_tokens=new))
    assert spec.stats.proposed > 0


@pytest.mark.parametrize("arch", tiered(["mistral", "gemma2", "falcon", "gpt_neox", "mixtral", "deepseek_v3"], ["gemma2", "deepseek_v3"]))
def test_generic_cut_on_other_architectures(arch, one_thread):
    """Sliding windows, dict masks + softcapping, parallel attention/MLP, partial rotary, MoE,
    latent attention: the same cut, no per-architecture code."""
    from specfx.model.architectures import ARCHITECTURES

    target = tiny_causal_lm(arch, num_layers=3, **ARCHITECTURES[arch].overrides)
    spec = specfx.speculate(target, draft="early_exit:2", num_speculative_tokens=3, compile=False)
    ids = prompt(10, batch=2, seed=0)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids.masked_fill(mask == 0, 0), **kw), target.generate(ids.masked_fill(mask == 0, 0), **kw))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_left_padded_batch_matches_batched_generate(arch, one_thread):
    target = _target(arch)
    spec = specfx.speculate(target, draft=specfx.EarlyExit(layer=2), num_speculative_tokens=4, compile=False)
    single = prompt(5, seed=8)  # batch 1 first: the batch of 3 then re-allocates and re-captures
    assert torch.equal(spec.generate(single, max_new_tokens=9), target.generate(single, max_new_tokens=9))
    ids, mask = left_padded(10, (4, 0, 7), seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=17, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert len(spec.stats.per_row_accepted) == 3


def test_self_draft_of_identical_layers_is_always_accepted(one_thread):
    """A model whose later layers add nothing (zeroed output projections, so each of those
    blocks is the identity on the residual stream) has an exit after layer 1 that equals the
    whole model: every proposal must be accepted. Built on a copy; the cut is what is tested."""
    target = tiny_causal_lm("llama", num_layers=3, seed=2)
    with torch.no_grad():
        for block in target.model.layers[1:]:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
    spec = specfx.speculate(target, draft="early_exit:1", num_speculative_tokens=4, compile=False)
    ids = prompt(6, seed=3)
    assert torch.equal(spec.generate(ids, max_new_tokens=20), target.generate(ids, max_new_tokens=20))
    assert spec.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", tiered([1, 3], []))
def test_sampling_matches_exact_distribution(k, one_thread):
    target, _ = _models()  # 2 layers, vocabulary 6: exit after layer 1
    prompt_ids = [1, 4, 2]
    probs = _exact(target, prompt_ids, LogitsProcessorList())
    spec = specfx.speculate(target, draft="early_exit:1", num_speculative_tokens=k, compile=False)
    torch.manual_seed(4321)
    out = spec.generate(torch.tensor([prompt_ids]).repeat(ROWS, 1), do_sample=True, max_new_tokens=NEW, pad_token_id=0)
    assert 0.05 < spec.stats.acceptance_rate < 0.95  # accept and correction paths both exercised
    assert _chisquare(out[:, len(prompt_ids) :].tolist(), probs) > 1e-3


def test_no_parameter_memory_added_and_kv_shared(one_thread):
    target = tiny_causal_lm("llama", num_layers=3, seed=6)
    params = {id(p): (p.data_ptr(), p.nbytes) for p in target.parameters()}
    param_bytes = sum(n for _, n in params.values())
    spec = specfx.speculate(target, draft="early_exit:2", num_speculative_tokens=3, compile=False)
    ids = prompt(5, seed=9)
    assert torch.equal(spec.generate(ids, max_new_tokens=12), target.generate(ids, max_new_tokens=12))

    # the target's parameters are the same objects and storage as before
    assert {id(p): (p.data_ptr(), p.nbytes) for p in target.parameters()} == params
    graph = spec.drafter.graph
    cache = spec.target_runner.cache
    kv = {id(t): (i, name) for i, layer in enumerate(cache.layers) for name, t in (("k", layer.keys), ("v", layer.values))}
    owned = {id(t) for t in list(target.parameters()) + list(target.buffers())}
    used_params = [x for x in graph.bound if id(x) in params]
    assert used_params and sum(x.nbytes for x in used_params) <= param_bytes
    # every bound tensor is a target parameter/buffer, a target cache buffer of a layer < N, or
    # the cache's row index; nothing the drafter allocated itself
    for x in graph.bound:
        if id(x) in kv:
            assert kv[id(x)][0] < 2
        else:
            assert id(x) in owned or x is cache.rows, f"unexpected tensor {tuple(x.shape)} in the draft graph"
    assert sorted(v for k, v in kv.items() if any(id(x) == k for x in graph.bound)) == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]
    # the cut graph module owns no tensors of its own beyond scalars
    own = [t for t in list(graph.gm.parameters()) + list(graph.gm.buffers())]
    own += [v for v in vars(graph.gm).values() if isinstance(v, torch.Tensor)]
    assert sum(t.numel() for t in own) <= 16


@pytest.mark.parametrize(
    ("draft", "error", "match"),
    [
        ("early_exit", ValueError, r"needs the exit layer: draft='early_exit:N'"),
        ("early_exit:two", ValueError, r"must be an integer N"),
        ("early_exit:0", ValueError, r"must be in \[1, num_hidden_layers - 1\], got 0"),
        ("early_exit:3", ValueError, r"must be in \[1, 2\] \(the target has 3 layers\), got 3"),
        ("early_exit:7", ValueError, r"must be in \[1, 2\] \(the target has 3 layers\), got 7"),
    ],
)
def test_bad_exit_layer_is_a_clear_error(draft, error, match):
    target = _target("llama")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(error, match=match):
        specfx.speculate(target, draft=draft, compile=False)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert target.config.num_hidden_layers == 3


def _dbrx():
    return tiny_causal_lm("dbrx", num_layers=2, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2))


def test_forward_dynamo_cannot_capture_is_refused_at_speculate(one_thread):
    """DBRX's experts run in a loop over the experts tokens were routed to (data-dependent):
    its forward cannot be captured as one graph. speculate() says so, not the first generate()."""
    target = _dbrx()
    with pytest.raises(ValueError, match=r"early_exit:1.*DbrxForCausalLM.s forward as one graph failed.*data-dependent.*modeling_dbrx"):
        specfx.speculate(target, draft="early_exit:1", compile=False)
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=3, compile=False)
    ids = prompt(6, seed=1)
    assert torch.equal(spec.generate(ids, max_new_tokens=10), target.generate(ids, max_new_tokens=10))


def _longcat(blocks, dense=False):
    model = tiny_causal_lm("longcat_flash", num_layers=blocks, num_key_value_heads=4, head_dim=8, zero_expert_num=2,
                           moe_topk=2, seed=5)
    if dense:  # its MoE shortcut made a dense MLP (that MoE's expert loop cannot be captured); the blocks stay
        from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMLP

        torch.manual_seed(5)
        for block in model.model.layers:
            block.mlp = LongcatFlashMLP(model.config)
    return model


def test_blocks_of_several_layers_are_the_exit_boundaries(one_thread):
    """LongCat-Flash: each decoder block holds two attention sublayers (two cache layers), and
    config.num_hidden_layers counts those: 6 for the 3 blocks of model.layers. N counts blocks."""
    target, layer = _longcat(3, dense=True), 2
    assert target.config.num_hidden_layers == 6 and len(target.model.layers) == 3
    spec = specfx.speculate(target, draft=f"early_exit:{layer}", num_speculative_tokens=3, compile=False)
    ids, mask = left_padded(8, (3, 0), seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert spec.stats.proposed > 0
    # the draft's KV is the target's cache layers of its blocks: 2 per block
    kv = {id(t): i for i, c in enumerate(spec.target_runner.cache.layers) for t in (c.keys, c.values)}
    assert sorted({kv[id(x)] for x in spec.drafter.graph.bound if id(x) in kv}) == list(range(2 * layer))


def test_longcat_flash_moe_is_refused_where_it_cannot_be_captured_and_exact_where_it_can(one_thread):
    """Before transformers 5.25 its real MoE loops over the experts tokens were routed to (data-
    dependent): the forward cannot be captured, refused at speculate() with that reason. From 5.25
    its experts use transformers' shared experts implementation, which captures: then the cut
    graph runs, and greedy output equals generate() on a left-padded batch."""
    target = _longcat(2)
    if Version(transformers.__version__) < Version("5.25"):
        with pytest.raises(ValueError, match=r"LongcatFlashForCausalLM's forward as one graph failed.*data-dependent"):
            specfx.speculate(target, draft="early_exit:1", compile=False)
        return
    spec = specfx.speculate(target, draft="early_exit:1", num_speculative_tokens=3, compile=False)
    ids, mask = left_padded(8, (3, 0), seed=2)
    kw = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert spec.stats.proposed > 0


def test_blocks_of_several_layers_bound_the_exit_layer(one_thread):
    with pytest.raises(ValueError, match=r"must be in \[1, 1\] \(the target has 2 decoder blocks; config.num_hidden_layers = 4"):
        specfx.speculate(_longcat(2), draft="early_exit:2", compile=False)


def test_early_exit_constructor_type_errors():
    with pytest.raises(TypeError, match="must be an int N"):
        specfx.EarlyExit(layer="2")
    with pytest.raises(TypeError, match="must be an int N"):
        specfx.EarlyExit(layer=True)
    with pytest.raises(ValueError, match="got -1"):
        specfx.EarlyExit(layer=-1)


@pytest.mark.parametrize("backend", round_backends())
def test_compiled_greedy_equals_generate_and_stays_warm(backend, one_thread):
    target = tiny_causal_lm("llama", num_layers=2, seed=11)
    spec = specfx.speculate(
        target, draft="early_exit:1", num_speculative_tokens=2, compile_prefill=True, backend=backend, background_compile=False
    )
    ids = prompt(8, batch=2, seed=1)
    assert torch.equal(spec.generate(ids, max_new_tokens=12), target.generate(ids, max_new_tokens=12))
    graphs = len(spec.graphs)
    assert graphs == 2  # one prefill graph, one round graph (fullgraph: no breaks)
    round_graph = max(spec.graphs, key=lambda g: g.nodes)
    # KV writes: 2 draft steps x 1 layer + verify x 2 layers, keys and values
    assert dict(round_graph.report.sites)["check_static_kv"] == 2 * (2 * 1 + 2)
    ids = prompt(5, batch=2, seed=2)
    assert torch.equal(spec.generate(ids, max_new_tokens=9), target.generate(ids, max_new_tokens=9))
    assert len(spec.graphs) == graphs  # warm: nothing recompiled


@pytest.mark.full
def test_reallocations_free_old_kv_buffers_and_reuse_captures(one_thread):
    """A reallocation must free the KV buffers it replaces (issue 16 item 10: ~5 MB kept per
    reallocation, because Dynamo kept each capture's backend, cache entry and compiled function,
    which held the buffers, forever); one capture per (batch bucket, capacity) is kept and reused,
    reading the current cache's buffers at call time."""
    import gc
    import weakref

    from torch import fx

    target = tiny_causal_lm("llama", num_layers=2, seed=3)
    spec = specfx.speculate(target, draft="early_exit:1", num_speculative_tokens=2, compile=False)
    old_buffers, graphs, live_graph_modules = [], [], []
    for i in range(6):  # batch 1, 2, 1, ...: a reallocation per call
        ids = prompt(6, batch=1 + i % 2, seed=i)
        assert torch.equal(spec.generate(ids, max_new_tokens=3), target.generate(ids, max_new_tokens=3))
        old_buffers.append(weakref.ref(spec.target_runner.cache.layers[0].keys))
        graphs.append(spec.drafter.graph)
        gc.collect()
        if i in (1, 5):  # after both shapes were captured, and four reallocations later (a heap scan is slow)
            live_graph_modules.append(sum(isinstance(o, fx.GraphModule) for o in gc.get_objects()))
    assert [r() is not None for r in old_buffers] == [False] * 5 + [True]
    assert len({id(g) for g in graphs}) == 2 and graphs[0] is graphs[2] is graphs[4]
    assert live_graph_modules[1] == live_graph_modules[0]  # flat, not one more per reallocation


@pytest.mark.compiled
@pytest.mark.full
@pytest.mark.ci
def test_alternating_batch_sizes_compile_each_round_once(one_thread):
    """A new capture per reallocation changed the graph module class the round graph guards on:
    every switch of batch size recompiled the round, and the 9th failed (recompile limit)."""
    target = tiny_causal_lm("llama", num_layers=2, seed=3)
    spec = specfx.speculate(target, draft="early_exit:1", num_speculative_tokens=2, backend="specfx_eager")
    for i in range(12):
        ids = prompt(6, batch=1 + i % 2, seed=i)
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):
            out = spec.generate(ids, max_new_tokens=4)
        assert torch.equal(out, target.generate(ids, max_new_tokens=4))
    assert len(spec.compile_events) == 2


def test_hidden_taps_refuse_blocks_of_several_layers():
    """Taps are numbered by config.num_hidden_layers (HF's hidden_states[i] is layer i's input):
    inside a LongCat block there is no boundary to tap, so the layer names are refused."""
    from transformers import AutoModelForCausalLM

    from specfx.model.capture import decoder_blocks, decoder_layer_names
    from specfx.testing.tiny import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("longcat_flash", num_layers=2))
    assert decoder_blocks(model) == ["model.layers.0", "model.layers.1"]
    with pytest.raises(ValueError, match=r"num_hidden_layers = 4 counts 2 layers per decoder block \(2 blocks, model.layers\)"):
        decoder_layer_names(model)
