"""A generator used for real: many shapes, threads, modes, failures and model changes between
calls (issue 16, items 1, 6, 7, 8, 9, 11). Each test failed on the generator before the fix."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import specfx
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm
from tests.conftest import left_padded, pair, prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def _hf(target, ids, **kw):
    return target.generate(ids, pad_token_id=0, **kw)


@pytest.mark.full  # traces 8 round graphs (specfx_eager: Dynamo, no Inductor), about 25 s
def test_many_shapes_and_modes_never_hit_the_recompile_limit():
    """Batch sizes 1..6 x greedy/sampling were 12 specialisations of one code object: the 9th
    exceeded Dynamo's recompile limit (FailOnRecompileLimitHit under fullgraph). Now batch sizes
    fall in buckets and each (bucket, mode) has its own graph and code object."""
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=2, backend="specfx_eager")
    for batch in range(1, 7):
        ids = prompt(5 + batch, batch=batch, seed=batch)
        assert torch.equal(spec.generate(ids, max_new_tokens=8), _hf(target, ids, max_new_tokens=8))
        torch.manual_seed(batch)
        out = spec.generate(ids, max_new_tokens=8, do_sample=True, top_k=10, temperature=0.7, eos_token_id=None)
        assert out.shape == (batch, ids.shape[1] + 8)
    assert sorted(e.key[1] for e in spec.compile_events) == [1, 1, 2, 2, 4, 4, 8, 8]  # greedy and sampling


def test_concurrent_threads_get_their_own_tokens():
    """Two threads sharing one generator used to overwrite each other's state (wrong tokens,
    no error): calls are serialised now."""
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    prompts = [prompt(4 + i, seed=50 + i) for i in range(8)]
    expected = [_hf(target, ids, max_new_tokens=12) for ids in prompts]
    results, errors = {}, []

    def worker(indices):
        try:
            for i in indices:
                results[i] = spec.generate(prompts[i], max_new_tokens=12, pad_token_id=0)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(j, 8, 2),)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert all(torch.equal(results[i], expected[i]) for i in range(8))


def test_inference_mode_call_does_not_break_later_calls():
    """A first call under torch.inference_mode() made inference-tensor buffers; every later
    normal call then failed on an in-place update."""
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    ids = prompt(7, seed=3)
    expected = _hf(target, ids, max_new_tokens=10)
    with torch.inference_mode():
        assert torch.equal(spec.generate(ids, max_new_tokens=10, pad_token_id=0), expected)
    assert torch.equal(spec.generate(ids, max_new_tokens=10, pad_token_id=0), expected)
    with torch.inference_mode():
        assert torch.equal(spec.generate(ids, max_new_tokens=10, pad_token_id=0), expected)


def test_failed_reallocation_leaves_a_working_generator():
    """An exception between the target's and the drafter's allocation (out of memory,
    Ctrl-C) used to leave the old shape recorded with new target buffers: later calls failed."""
    target, draft = pair("llama", "perturbed")
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    spec.generate(prompt(5), max_new_tokens=4, pad_token_id=0)
    real_allocate = spec.drafter.allocate

    def out_of_memory(*args):
        raise KeyboardInterrupt  # what Ctrl-C raises mid-allocation

    spec.drafter.allocate = out_of_memory
    ids, mask = left_padded(9, [0, 3])
    with pytest.raises(KeyboardInterrupt):
        spec.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    spec.drafter.allocate = real_allocate
    for x, m in ((prompt(5), None), (ids, mask)):  # the old shape first: its record must be gone
        expected = _hf(target, x, attention_mask=m, max_new_tokens=6)
        assert torch.equal(spec.generate(x, attention_mask=m, max_new_tokens=6, pad_token_id=0), expected)


def _nan_model():
    """A tiny model whose logits turn NaN once ``model.nan`` is set (after speculate(): the
    probe refuses a model that is NaN from the start)."""
    model = copy.deepcopy(tiny_causal_lm("llama"))
    model.nan = False
    model.lm_head.register_forward_hook(lambda m, args, out: out * float("nan") if model.nan else out)
    return model


def test_model_with_nan_logits_is_refused_clearly():
    model = _nan_model()
    model.nan = True
    with pytest.raises(ValueError, match="NaN or inf logits in its own forward"):
        specfx.speculate(model, draft="prompt_lookup", compile=False)


@pytest.mark.parametrize("max_new_tokens", [1, 12])
def test_nan_logits_while_sampling_raise(max_new_tokens):
    """Sampling from NaN probabilities returned token 0 repeated; HF raises. The flag is read
    with the finished flags (no extra sync per round), also after the last round."""
    model = _nan_model()
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=2, compile=False)
    model.nan = True
    with pytest.raises(RuntimeError, match="inf.*nan"):
        model.generate(prompt(6), do_sample=True, max_new_tokens=max_new_tokens, pad_token_id=0)  # HF raises too
    with pytest.raises(RuntimeError, match="NaN or inf"):
        spec.generate(prompt(6), do_sample=True, max_new_tokens=max_new_tokens, pad_token_id=0)


def test_nan_flag_is_per_call():
    """After a NaN call, a later call on a healthy state works (the flag is reset)."""
    model = _nan_model()
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=2, compile=False)
    model.nan = True
    with pytest.raises(RuntimeError):
        spec.generate(prompt(6), do_sample=True, max_new_tokens=5, pad_token_id=0)
    greedy = spec.generate(prompt(6), max_new_tokens=5, pad_token_id=0)  # HF's greedy does not raise either
    assert torch.equal(greedy, _hf(model, prompt(6), max_new_tokens=5))


def test_model_dtype_change_after_first_generate():
    """model.to(dtype) after a first call kept buffers of the old dtype (a persistent SDPA
    dtype error); now the change is detected and everything is reallocated."""
    target = copy.deepcopy(tiny_causal_lm("llama"))
    draft = perturbed_copy(target, 0.03)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=3, compile=False)
    ids = prompt(8, seed=4)
    assert torch.equal(spec.generate(ids, max_new_tokens=10, pad_token_id=0), _hf(target, ids, max_new_tokens=10))
    target.to(torch.float64)
    draft.to(torch.float64)
    assert spec.state.tokens is not None
    out = spec.generate(ids, max_new_tokens=10, pad_token_id=0)
    assert spec.target_runner.cache.layers[0].keys.dtype == torch.float64
    assert torch.equal(out, _hf(target, ids, max_new_tokens=10))


def test_buffers_are_sized_by_the_longest_prompt_not_its_bucket():
    """Real token j of a row sits at slot j whatever the prefill bucket, so a 20-token prompt
    (bucket 64) with 200 new tokens needs 20 + 200 + K + 2 slots: capacity 256, not the 512 a
    bucket-sized buffer took (attention reads every slot of it)."""
    target = tiny_causal_lm("llama")
    spec = specfx.speculate(target, draft=target, num_speculative_tokens=4, compile=False)
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=200, eos_token_id=None)
    assert torch.equal(spec.generate(ids, **kw), target.generate(ids, **kw))
    assert spec.target_runner.cache.capacity == 256
