"""Speculating models with recurrent / linear-attention state (issue 29, decision 76): greedy
output equal to ``model.generate()`` at batch 1 and on a left-padded batch, with rounds that reject
(so the state is rolled back every round), eager and compiled; what is not supported yet refused at
``speculate()``; the user's model unchanged.

The drafter proposes the reference continuation with every third position wrong, so most rounds
accept some proposals and reject the rest (a tiny random model never repeats itself enough for
prompt lookup to accept anything; that case, every proposal rejected, runs too). Without the
rollback (``ModelRunner.roll_back_state``) every greedy test here fails: the state keeps the
rejected inputs. Compiled: one round graph per batch bucket, traced with ``specfx_eager`` and lowered
by Inductor (the default backend; decision 78).
"""

import functools

import pytest
import torch
import transformers
from packaging.version import Version

import specfx
from specfx.model.architectures import ARCHITECTURES, installed
from specfx.testing.tiny import STATEFUL_TINY, tiny_causal_lm
from tests.conftest import WrongEveryThird, left_padded, prompt

# Every state row of the architecture table (its tiny config from the row) and LFM2's hybrid configs
TINY = STATEFUL_TINY
K = 4


# The default tier runs a gated-delta-net hybrid and short convs; --full runs every type (CI's newest run
# too, but for the compiled round's and the draft model's per-type repeats: CI_TYPES).
DEFAULT_TIER = {"qwen3_next", "lfm2"}  # mamba2 and the rest: --full (and CI's eager run)


def _param(name: str, default=DEFAULT_TIER):
    """A type the installed transformers does not ship is skipped, saying so (bailing_hybrid, lara_mini and
    lfm3 are new in 5.24): a missing type, never a failing one. Types outside ``default`` (None: none)
    are marked ``full``."""
    missing = not installed(name)
    reason = f"model type {name!r} is not in transformers {transformers.__version__}"
    marks = [pytest.mark.skipif(missing, reason=reason)]
    if default is not None and name not in default:
        marks.append(pytest.mark.full)
    return pytest.param(name, marks=marks)


def _ci(param):
    """``param`` marked ``ci`` as well: a --full Inductor test CI runs too (decision 96)."""
    return pytest.param(*param.values, marks=[*param.marks, pytest.mark.ci])


def _matrix(ci):
    """Every type, the default tier's unmarked, ``ci``'s marked ``full`` and the others ``full`` and
    ``exhaustive``: a per-type repeat CI leaves to ``pytest --full`` (decision 96)."""
    params = [_param(name) for name in sorted(TINY)]
    return [
        p if p.values[0] in DEFAULT_TIER or p.values[0] in ci else pytest.param(*p.values, marks=[*p.marks, pytest.mark.exhaustive])
        for p in params
    ]


# CI's newest run: the default tier's types and one Mamba1, one Mamba2 and one parallel (attention and state
# in one layer) hybrid; every type: pytest --full
CI_TYPES = ("mamba", "mamba2", "falcon_h1")


@functools.cache
def _model(arch):
    m = tiny_causal_lm(arch, **TINY[arch])
    m.generation_config.eos_token_id = None  # generate every token asked for
    with torch.no_grad():  # a pad id with a real embedding (as in real checkpoints, not the tiny
        m.get_input_embeddings().weight[0].normal_()  # config's zero row): only the 2-D mask hides padding
    return m


@pytest.fixture(scope="module", params=[_param(name) for name in sorted(TINY)])
def model(request):
    return _model(request.param)


def _table(ref: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's real tokens of ``generate()``'s output, left-aligned (position == column)."""
    pads = [0] * len(ref) if mask is None else (mask == 0).sum(1).tolist()
    rows = [r[p:] for r, p in zip(ref, pads, strict=True)]
    width = max(len(r) for r in rows) + K + 2
    return torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])


def _check(model, ids, mask, new, draft=None):
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask)
    expected = model.generate(ids, **kw)
    draft = draft or WrongEveryThird(_table(expected, mask), model.config.vocab_size)
    spec = specfx.speculate(model, draft=draft, num_speculative_tokens=K, compile=False)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
    return spec.stats


@torch.no_grad()
def test_greedy_equals_generate_at_batch_1_with_rejecting_rounds(model, one_thread):
    stats = _check(model, prompt(9, seed=1), None, 30)
    assert 0 < stats.accepted < stats.proposed  # rounds accepted some and rejected some


@torch.no_grad()
def test_greedy_equals_generate_on_a_left_padded_batch(model, one_thread):
    ids, mask = left_padded(10, [3, 0, 6], seed=2)
    stats = _check(model, ids, mask, 24)
    assert 0 < stats.accepted < stats.proposed


@torch.no_grad()
def test_prompt_lookup_rejecting_every_proposal(model, one_thread):
    """A repetitive prompt: prompt lookup proposes every round and the random model rejects
    nearly all of it, so every round rolls the state back to the pending token alone."""
    ids = torch.tensor([[5, 6, 7, 8, 9] * 3 + [5, 6]])
    stats = _check(model, ids, None, 20, draft="prompt_lookup")
    assert stats.proposed > stats.accepted


@pytest.mark.parametrize("arch", _matrix(("mamba2", "falcon_h1")))
@torch.no_grad()
def test_attention_draft_model_and_auto_k(arch, one_thread):
    """A draft model (attention only, its own KV) drives the same rollback; "auto" K mixes in
    rounds of K = 0, which keep their one input and roll nothing back."""
    model = _model(arch)
    draft = tiny_causal_lm("llama", vocab_size=model.config.vocab_size)
    ids, mask = left_padded(8, [2, 0], seed=6)
    for k in (3, None):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        spec = specfx.speculate(model, draft=draft, num_speculative_tokens=k, compile=False)
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False), expected)


@torch.no_grad()
def test_sampling_runs(model, one_thread):
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, compile=False)
    torch.manual_seed(0)
    out = spec.generate(prompt(8, seed=7), max_new_tokens=12, do_sample=True, temperature=0.8)
    assert out.shape == (1, 20) and spec.stats.rounds > 0


@torch.no_grad()
def test_the_users_model_is_unchanged(model, one_thread):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _check(model, prompt(8, seed=4), None, 12)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _compiled_check(model, backend, batch_one: bool = True):
    """Batch 1 (unless not ``batch_one``), then two left-padded batches of one bucket, each equal to
    ``generate()`` with rounds that accept some proposals and reject the rest; one round graph per
    batch bucket, and the second batch of the bucket compiles nothing (``error_on_recompile``)."""
    drafter = WrongEveryThird(torch.zeros((4, 64), dtype=torch.long), model.config.vocab_size)
    spec = specfx.speculate(model, draft=drafter, num_speculative_tokens=K, backend=backend)
    cases = (((prompt(9, seed=1), None), 20), (left_padded(10, [3, 0, 6], seed=2), 16), (left_padded(12, [2, 0, 5], seed=4), 14))
    cases = cases if batch_one else cases[1:]
    for i, ((ids, mask), new) in enumerate(cases):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        table = _table(expected, mask)
        drafter.table.zero_()
        drafter.table[: table.shape[0], : table.shape[1]] = table  # in place: the graph's input
        with torch._dynamo.config.patch(error_on_recompile=i == len(cases) - 1):  # the bucket's second batch
            got = spec.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert torch.equal(got, expected), f"case {i}: rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
        assert 0 < spec.stats.accepted < spec.stats.proposed
    assert len(spec.graphs) == 1 + batch_one, f"{len(spec.graphs)} graphs"  # (batch 1 and) the bucket of 4
    with torch._dynamo.config.patch(error_on_recompile=True):  # a benchmark's round replays the warm graph:
        tokens, _ = spec.round_fn()()[:2]  # the mixer hooks attached around it as around generate()'s rounds
    assert tokens.shape[1] == K + 1
    assert {g.compiler for g in spec.graphs} == {"inductor" if backend == "specfx" else "eager"}
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("arch", _matrix(CI_TYPES))
@torch.no_grad()
def test_compiled_round_is_one_graph_and_equals_generate(arch, one_thread):
    """The round traced as one graph (``specfx_eager``): the mixer hooks are attached around the
    compiled calls, not traced."""
    _compiled_check(_model(arch), "specfx_eager")


@pytest.mark.compiled
@pytest.mark.parametrize(  # Inductor on every type: --full; Qwen3-Next's in CI's run too
    "arch", [_ci(_param(name, default=set())) if name == "qwen3_next" else _param(name, default=set()) for name in sorted(TINY)]
)
@torch.no_grad()
def test_inductor_round_is_one_graph_and_equals_generate(arch, request, one_thread):
    """The same with the default backend (Inductor, decision 78): the state buffers, the snapshot and
    the mixer steps' in-place writes compile into the round graph like the KV writes. The default tier
    lowers the left-padded batches only (one graph: an Inductor compile costs 50-100 s on a fresh
    2-core machine; the ``specfx_eager`` test above runs batch 1 too); ``--full`` batch 1 as well."""
    model = _model(arch)
    oldest = ARCHITECTURES[arch].inductor_torch
    if oldest and torch.__version__ < oldest:  # torch 2.11's Inductor corrupts memory here: refused (decision 84)
        with pytest.raises(ValueError, match=rf"Inductor miscompiles the round of model type '{arch}'.*backend='specfx_eager'"):
            specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, backend="specfx")
        spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, backend="specfx_eager")
        ids = prompt(9, seed=1)
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(spec.generate(ids, max_new_tokens=8, do_sample=False), expected)
        return
    _compiled_check(model, "specfx", batch_one=request.config.getoption("--full"))


# Types whose multi-token forward does not continue a cached state as their own single-token decoding
# does (Mamba1's scan starts from zero; Zamba2's chunked path clamps the time step, and NemotronH's did
# until transformers 5.25 moved its mixer onto a scan that clamps in both paths: there the probe must
# find the multi-token forward exact and not step)
STEPPED = {"mamba", "falcon_mamba", "jamba", "zamba", "zamba2"}
if Version(transformers.__version__) < Version("5.25"):
    STEPPED.add("nemotron_h")


@pytest.mark.parametrize("arch", [_param(name, default={"mamba", "nemotron_h", "qwen3_next"}) for name in sorted(TINY)])
@torch.no_grad()
def test_the_probe_verifies_by_single_steps_exactly_where_the_multi_token_forward_differs(arch, one_thread):
    """Decision 90: the incremental-decoding probe, whose reference for a stateful model is its own
    decoding (prefill, then one token at a time, as generate() runs it), tries the multi-token verify
    forward first and the mixers' single steps only when it fails. Negative control: with the steps
    turned off, the probe refuses every stepped type (their greedy tests above need the steps)."""
    from specfx.model.admission import check_incremental
    from specfx.model.runner import ModelRunner

    runner = ModelRunner(_model(arch), "target")
    assert runner.state_steps == (arch in STEPPED)
    if arch in STEPPED:
        runner.state_steps = False  # a later capacity's probe keeps the choice: no retry with steps
        with pytest.raises(ValueError, match="does not decode incrementally"):
            check_incremental(runner, 2 * runner.probed_capacity)


@pytest.mark.parametrize("arch", [_param(name, default={"mamba", "nemotron_h", "qwen3_next"}) for name in sorted(TINY)])
@torch.no_grad()
def test_a_stepped_verify_rolls_back_by_selecting_the_states_it_passed_through(arch, one_thread, monkeypatch):
    """Decision 91: where the verify stepped the mixers, the rollback selects each row's state from
    those the steps kept (no mixer call); every other type restores the snapshot and replays. Output
    = generate() on a left-padded batch whose rows accept different numbers of proposals."""
    from specfx.model.recurrent import MixerTaps

    calls = {"select": 0, "replay_steps": 0}

    def counting(name, fn):
        def counted(self, *args, **kwargs):
            calls[name] += 1
            return fn(self, *args, **kwargs)

        return counted

    for name in calls:
        monkeypatch.setattr(MixerTaps, name, counting(name, getattr(MixerTaps, name)))
    model, (ids, mask) = _model(arch), left_padded(10, [3, 0, 6], seed=2)
    kw = dict(max_new_tokens=16, do_sample=False, attention_mask=mask)
    expected = model.generate(ids, **kw)
    draft = WrongEveryThird(_table(expected, mask), model.config.vocab_size)
    spec = specfx.speculate(model, draft=draft, num_speculative_tokens=K, compile=False)
    calls.update(select=0, replay_steps=0)  # the rounds' rollbacks only (the probe's are its own)
    assert torch.equal(spec.generate(ids, **kw), expected)
    assert 0 < spec.stats.accepted < spec.stats.proposed
    rollbacks = calls["select"] + calls["replay_steps"]
    assert rollbacks > 0 and calls["select" if arch in STEPPED else "replay_steps"] == rollbacks, calls


@torch.no_grad()
def test_returning_the_cache_is_refused(model, one_thread):
    spec = specfx.speculate(model, draft="prompt_lookup", num_speculative_tokens=K, compile=False)
    with pytest.raises(ValueError, match=r"cannot return the cache.*recurrent.*return_dict_in_generate=False"):
        spec.generate(prompt(6, seed=8), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(compile=True, background_compile=True), r"traced in the background.*Leave background_compile unset"),
        (dict(compile=False, tree=specfx.TokenTree([(0,), (1,), (0, 0)])), r"chain only.*no tree="),
        (dict(compile=False, draft="early_exit:1"), r"runs the target's layers"),
    ],
)
def test_what_is_not_supported_yet_is_refused(model, options, match):
    options = {"draft": "prompt_lookup", **options}
    with pytest.raises(ValueError, match=match):
        specfx.speculate(model, **options)


# Types refused with their precise reason (the table's), built tiny as the table's rows say
REFUSED = ("inkling_text", "qwen4_exp_text")
REASONS = {
    "qwen4_exp_text": r"'qwen4_exp_text' exactly: its QSA indexer .*indexer_position_ids.*torch.nonzero",
    "inkling_text": r"'inkling_text' exactly: attention whose relative-position bias.*not from position_ids",
}


@pytest.mark.parametrize("name", [_param(name, default=None) for name in REFUSED])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_types_that_cannot_run_exactly_are_refused_with_the_reason(name, role):
    m = tiny_causal_lm(name, **ARCHITECTURES[name].overrides)
    assert ARCHITECTURES[name].status == "refused" and ARCHITECTURES[name].stateful
    target, draft = (m, "prompt_lookup") if role == "target" else (tiny_causal_lm("llama"), m)
    with pytest.raises(ValueError, match=REASONS[name]):
        specfx.speculate(target, draft=draft, compile=False)
