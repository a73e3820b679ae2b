"""DeepSeek-V4's compressed-KV attention (issue 29, decision 97): greedy output equal to
``model.generate()`` with rounds that accept and reject, at batch 1, on a batch of equal-length
prompts and from a one-token prompt, eager and compiled; what cannot run exactly refused with its cause.

Its compressors pool windows of per-token projections into KV entries (heavily compressed: every 8
tokens here; compressed sparse: every 4, overlapping, an indexer choosing 3 of them per query) that
HF keeps in cache layers of their own. specfx keeps the projections at slots like KV and pools every
window again on each forward; a query sees a window once it is at or past its last token, so rejected
proposals and unwritten slots are never pooled into anything a query sees. The tiny model's position
biases, attention sinks and hash-routing table are random (their initial values are zeros).
"""

import functools

import pytest
import torch
import transformers

import specfx
from specfx.model.architectures import ARCHITECTURES, installed
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm
from tests.conftest import WrongEveryThird, prompt

pytestmark = pytest.mark.skipif(
    not installed("deepseek_v4"), reason=f"model type 'deepseek_v4' is not in transformers {transformers.__version__}"
)
K = 4


@functools.cache
def _model(seed: int = 0):
    m = tiny_causal_lm("deepseek_v4", seed=seed, **ARCHITECTURES["deepseek_v4"].overrides)
    m.generation_config.eos_token_id = None  # generate every token asked for
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "position_bias" in name or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, m.config.n_routed_experts, b.shape, generator=g))
    return m


def _check(ids, new, backend=None, spec=None):
    model = _model()
    expected = model.generate(ids, max_new_tokens=new, do_sample=False)
    table = torch.cat([expected, expected.new_zeros((expected.shape[0], K + 2))], dim=1)
    drafter = WrongEveryThird(table, model.config.vocab_size)
    options = dict(compile=False) if backend is None else dict(backend=backend)
    spec = spec or specfx.speculate(model, draft=drafter, num_speculative_tokens=K, **options)
    got = spec.generate(ids, max_new_tokens=new, do_sample=False)
    assert torch.equal(got, expected), f"rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
    assert 0 < spec.stats.accepted < spec.stats.proposed  # rounds accepted some and rejected some
    return spec


@pytest.mark.parametrize(
    "ids",
    [prompt(9, seed=1), pytest.param(prompt(11, batch=3, seed=2), marks=pytest.mark.full), prompt(1, seed=3)],
    ids=["batch_1", "equal_length_batch", "one_token_prompt"],
)
@torch.no_grad()
def test_greedy_equals_generate_with_rejecting_rounds(ids, one_thread):
    """40 new tokens cross five heavily compressed windows and ten sparse ones."""
    _check(ids, 40)


@pytest.mark.full  # the default tier: batch 1, the refusals, the compiled round
@torch.no_grad()
def test_draft_model_auto_k_and_the_model_as_a_draft(one_thread):
    """A perturbed copy drafting (every draft step a one-token forward of a V4 model), "auto" K (rounds
    of K = 0: one-token verify forwards), and prompt lookup."""
    model = _model()
    ids = prompt(10, batch=2, seed=5)
    expected = model.generate(ids, max_new_tokens=30, do_sample=False)
    for draft, k in ((perturbed_copy(model, 0.05), 3), (perturbed_copy(model, 0.05), None), ("prompt_lookup", 3)):
        spec = specfx.speculate(model, draft=draft, num_speculative_tokens=k, compile=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=30, do_sample=False), expected), (draft, k)
    assert spec.stats.rounds > 0


@torch.no_grad()
def test_one_query_forwards_would_see_every_pooled_window(one_thread, monkeypatch):
    """Negative control for ``ArchSpec.min_queries``: at a single query HF's heavily compressed layers
    build no bias over the pooled entries (its cache holds complete windows only), so without the padding
    query specfx's entries of incomplete windows would be seen; the incremental-decoding probe (whose
    verify-like chunks include one-token forwards) catches it and refuses."""
    monkeypatch.setattr("specfx.model.runner.min_queries", lambda model_type: 1)
    with pytest.raises(ValueError, match="does not decode incrementally like its full forward"):
        specfx.speculate(_model(), draft="prompt_lookup", compile=False)


@torch.no_grad()
def test_left_padded_batches_are_refused_because_hf_generates_otherwise(one_thread):
    """HF's compressors pool windows of cache positions, padding included: its output for a left-padded
    row differs from the same prompt alone (asserted here, the reason for the refusal)."""
    model = _model()
    ids = prompt(12, batch=2, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    padded = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)[1, 12:]
    alone = model.generate(ids[1:, 5:], max_new_tokens=30, do_sample=False)[0, 7:]
    assert not torch.equal(padded, alone)
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, compile=False)
    with pytest.raises(ValueError, match=r"prompts of unequal lengths .*\[7, 12\].*include the padding"):
        spec.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)


@pytest.mark.parametrize(
    ("draft", "options", "match"),
    [
        ("prompt_lookup", dict(tree=[(0,), (1,), (0, 0)]), r"pools windows of consecutive KV slots .* chain"),
        ("eagle3", {}, r"carries \d hyper-connection streams .* 'layer:0', 'layer:1', 'layer:2' are \[batch, tokens, \d"),
    ],
)
@torch.no_grad()
def test_what_cannot_run_exactly_is_refused_with_its_cause(draft, options, match, one_thread):
    from specfx.drafters.heads.eagle3 import Eagle3

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        if draft == "eagle3":
            draft = Eagle3.random(model, layer_ids=[0, 1, 2])
        spec = specfx.speculate(
            model, draft=draft, num_speculative_tokens=3 if not options else None, compile=False, **options
        )
        spec.generate(prompt(9, seed=1), max_new_tokens=8, do_sample=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.full  # the default tier: batch 1, the refusals, the compiled round
@torch.no_grad()
def test_the_returned_cache_continues_as_hfs(one_thread):
    """``return_dict_in_generate``: the cache HF's own forward builds over the sequence (its compressor
    layers keep running pooled entries specfx does not hold), continued like the one HF's generate() returns."""
    model = _model()
    ids = prompt(9, batch=2, seed=7)
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, compile=False)
    got = spec.generate(ids, max_new_tokens=21, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, max_new_tokens=21, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref.sequences)
    step = torch.cat([ref.sequences[:, -1:], prompt(1, batch=2, seed=8)], dim=1)
    a = model(step, past_key_values=got.past_key_values).logits
    b = model(step, past_key_values=ref.past_key_values).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.full  # the default tier: batch 1, the refusals, the compiled round
@torch.no_grad()
def test_sampling_runs_and_the_users_model_is_unchanged(one_thread):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = specfx.speculate(model, draft=perturbed_copy(model, 0.05), num_speculative_tokens=K, compile=False)
    torch.manual_seed(0)
    out = spec.generate(prompt(8, seed=9), max_new_tokens=16, do_sample=True, temperature=0.8)
    assert out.shape == (1, 24) and spec.stats.rounds > 0
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _compiled(backend):
    """Two batches of one bucket, equal to ``generate()`` with rejecting rounds: one round graph, and
    the second batch compiles nothing (``error_on_recompile``)."""
    model = _model()
    table = torch.zeros((4, 64), dtype=torch.long)
    drafter = WrongEveryThird(table, model.config.vocab_size)
    spec = specfx.speculate(model, draft=drafter, num_speculative_tokens=K, backend=backend, background_compile=False)
    for i, ids in enumerate((prompt(9, batch=3, seed=1), prompt(12, batch=3, seed=4))):
        expected = model.generate(ids, max_new_tokens=20, do_sample=False)
        table.zero_()
        table[:3, : expected.shape[1]] = expected  # in place: the graph's input
        with torch._dynamo.config.patch(error_on_recompile=i == 1):
            got = spec.generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(got, expected), f"batch {i}"
        assert 0 < spec.stats.accepted < spec.stats.proposed
    assert len(spec.graphs) == 1, f"{len(spec.graphs)} graphs"
    assert {g.compiler for g in spec.graphs} == {"inductor" if backend == "specfx" else "eager"}


@torch.no_grad()
def test_compiled_round_is_one_graph_and_equals_generate(one_thread):
    _compiled("specfx_eager")


@pytest.mark.compiled
@pytest.mark.full
@pytest.mark.ci
@torch.no_grad()
def test_inductor_round_is_one_graph_and_equals_generate(one_thread):
    """The pooling of every window and the indexer's top-k lowered by Inductor."""
    _compiled("specfx")


@pytest.mark.full  # the default tier: batch 1, the refusals, the compiled round
@torch.no_grad()
def test_early_exit_across_reallocations(one_thread):
    """Early exit drafts with a capture of the target's first layer, hyper-connection head, norm and LM
    head; its graph reads the compressors' buffers of the runner's current cache, so it stays right when
    a new batch bucket reallocates them."""
    model = _model()
    spec = specfx.speculate(model, draft="early_exit:1", num_speculative_tokens=3, compile=False)
    for ids in (prompt(9, seed=1), prompt(10, batch=3, seed=2), prompt(8, seed=3)):
        expected = model.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=24, do_sample=False), expected)
        assert spec.stats.accepted > 0
        # greedy output is exact whatever the draft reads: check what it reads (layer 0's buffers, current)
        current = {id(t) for pair in spec.target_runner.cache.layers[0].compressed.values() for t in pair}
        graphs = list(spec.drafter._graphs.values())
        assert len(current) == 2 and graphs and all(current <= {id(t) for t in g.bound} for g in graphs)
