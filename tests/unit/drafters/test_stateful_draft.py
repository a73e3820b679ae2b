"""A draft model with recurrent / linear-attention state (issue 29 item 2, decision 81): its state is
snapshotted before each round's catch-up, its mixers' K + 1 inputs recorded over the round's draft
forwards, and rolled back after verification to each row's emitted count.

A draft's state never changes the target's greedy output (only which proposals are accepted), so
besides output equal to ``generate()`` every eager case checks the draft itself: each round's
proposals must be the draft's own greedy continuation of the row's committed tokens (K full forwards
of the draft, no cache). Without the rollback, or with it off by one, the draft drafts from a state
that absorbed rejected or missing inputs and that check fails. A copy of the target as the draft
accepts every proposal (the n = K edge: all K + 1 inputs replayed); a random draft beside a Llama
target almost none (n = 0: the catch-up's first input only); a perturbed copy some.
"""

import copy
import functools

import pytest
import torch

import specfx
from specfx.drafters.draft_model import DraftModel
from specfx.testing.tiny import STATEFUL_TINY, perturbed_copy, tiny_causal_lm
from tests.conftest import left_padded, prompt

K = 4


@functools.cache
def _model(arch: str, seed: int = 0):
    m = tiny_causal_lm(arch, seed=seed, **STATEFUL_TINY.get(arch, {}))
    m.generation_config.eos_token_id = None  # generate every token asked for
    with torch.no_grad():  # a pad id with a real embedding: only the masks hide padding
        m.get_input_embeddings().weight[0].normal_()
    return m


def _pair(target_arch: str, draft: str):
    """(target, draft model): ``draft`` an architecture (an independent random model), or "copy" /
    "perturbed" (of a stateful target)."""
    target = _model(target_arch)
    if draft == "copy":
        return target, copy.deepcopy(target)
    if draft == "perturbed":
        return target, perturbed_copy(target, 0.03)
    return target, _model(draft, seed=1)


class LoggedDraft(DraftModel):
    """The draft model, logging each round's committed tokens, lengths, finished rows and proposals
    (eager rounds only)."""

    def __init__(self, model):
        super().__init__(model)
        self.log = []

    def propose(self, ctx):
        proposals, q = super().propose(ctx)
        s = ctx.state
        self.log.append((s.tokens.clone(), s.lengths.clone(), (s.live & ~s.finished).clone(), proposals.clone()))
        return proposals, q


def _own_continuation(model, prefix: torch.Tensor, k: int) -> torch.Tensor:
    ids = prefix.unsqueeze(0)
    for _ in range(k):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, -k:]


def _check_proposals(drafter: LoggedDraft) -> None:
    for r, (tokens, lengths, active, proposals) in enumerate(drafter.log):
        for b in active.nonzero().flatten().tolist():
            want = _own_continuation(drafter.model, tokens[b, : int(lengths[b]) + 1], K)
            assert torch.equal(proposals[b], want), f"round {r}, row {b}: drafted {proposals[b].tolist()}, its own greedy continuation is {want.tolist()}"


# (target, draft, inputs); the default tier (10 minutes in all) runs a GDN draft and a Mamba1 draft
# on a left-padded batch (a Mamba2 draft: --full; 33 s on a slow day), a copy of a GDN hybrid target (every proposal accepted: the n = K edge)
# and a perturbed copy on a left-padded batch (partial acceptance); --full the rest
DEFAULT = [
    ("llama", "qwen3_next", "left_padded"),
    ("qwen3_next", "copy", "batch_1"),
    ("qwen3_next", "perturbed", "left_padded"),
    ("llama", "mamba", "left_padded"),  # Mamba1: the catch-up verified by single steps (decision 90)
]
# Not NemotronH or Zamba2 as drafts here: their multi-token path clamps the time step where their single
# steps do not, so "the draft's own greedy continuation" depends on where its prefill ended (no reference
# independent of the chunking); they run as drafts by the same steps as Mamba1
FULL = [
    ("llama", "mamba2", "left_padded"),
    ("llama", "qwen3_next", "batch_1"),
    ("llama", "mamba2", "batch_1"),
    ("qwen3_next", "copy", "left_padded"),
    ("qwen3_next", "perturbed", "batch_1"),
    ("llama", "mamba", "batch_1"),
] + [
    (t, d, i)
    for t, d in [
        ("llama", "falcon_h1"),
        ("llama", "lfm2"),
        ("qwen3_next", "mamba2"),
        ("mamba2", "copy"),
        ("mamba2", "perturbed"),
        ("mamba", "copy"),
    ]
    for i in ("batch_1", "left_padded")
]
INPUTS = {"batch_1": lambda: ((prompt(9, seed=1), None), 20), "left_padded": lambda: (left_padded(10, [3, 0, 6], seed=2), 16)}


@pytest.mark.parametrize(("target_arch", "draft", "inputs"), DEFAULT + [pytest.param(*c, marks=pytest.mark.full) for c in FULL])
@torch.no_grad()
def test_greedy_equals_generate_and_the_draft_drafts_from_its_exact_state(target_arch, draft, inputs, one_thread):
    target, draft_model = _pair(target_arch, draft)
    (ids, mask), new = INPUTS[inputs]()
    kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask)
    expected = target.generate(ids, **kw)
    drafter = LoggedDraft(draft_model)
    spec = specfx.speculate(target, draft=drafter, num_speculative_tokens=K, compile=False)
    got = spec.generate(ids, **kw)
    assert torch.equal(got, expected), f"rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
    _check_proposals(drafter)
    stats = spec.stats
    if draft == "copy":  # every round accepts all K: the rollback replays all K + 1 inputs
        assert stats.accepted == stats.proposed > 0
    elif draft == "perturbed":  # every n from 0 to K occurs
        assert 0 < stats.accepted < stats.proposed and stats.per_position[K - 1] > 0
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in draft_model.modules())


@torch.no_grad()
def test_auto_k_with_a_stateful_draft(one_thread):
    """"auto" mixes in rounds of K = 0, in which the draft sits out (its state then lags, so
    speculation stays off for the rest of the call, as for any draft model)."""
    target, draft = _pair("qwen3_next", "perturbed")
    ids, mask = left_padded(8, [2, 0], seed=6)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=None, compile=False)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False), expected)


# traced as one graph (specfx_eager: seconds); lowered by Inductor, the default backend: about 5 min
# on 2 busy cores, so --full
BACKENDS = [
    pytest.param("specfx_eager", marks=pytest.mark.full),
    pytest.param("specfx", marks=[pytest.mark.compiled, pytest.mark.full]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_compiled_round_is_one_graph_and_drafts_as_eager(backend, one_thread):
    """Compiled: batch 1 (Inductor only), then two left-padded batches of one bucket (the second
    compiles nothing), each equal to ``generate()`` and accepting exactly as many proposals as the
    eager rounds (whose draft state the test above checks): the draft's snapshot, its recording
    hooks (attached around the compiled calls, not traced) and its replayed mixer steps are in the
    one round graph."""
    target, draft = _pair("qwen3_next", "perturbed")
    eager = specfx.speculate(target, draft=draft, num_speculative_tokens=K, compile=False)
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=K, backend=backend)
    cases = (((prompt(9, seed=1), None), 20), (left_padded(10, [3, 0, 6], seed=2), 16), (left_padded(12, [2, 0, 5], seed=4), 14))
    cases = cases if backend == "specfx" else cases[1:]  # the default tier: one bucket's graph only
    for i, ((ids, mask), new) in enumerate(cases, start=3 - len(cases)):
        kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask)
        expected = target.generate(ids, **kw)
        eager.generate(ids, **kw)
        with torch._dynamo.config.patch(error_on_recompile=i == 2):
            got = spec.generate(ids, **kw)
        assert torch.equal(got, expected), f"case {i}: rows differing: {(got != expected).any(1).nonzero().flatten().tolist()}"
        assert 0 < spec.stats.accepted < spec.stats.proposed
        assert (spec.stats.accepted, spec.stats.proposed) == (eager.stats.accepted, eager.stats.proposed)
    assert len(spec.graphs) == len(cases) - 1, f"{len(spec.graphs)} graphs"  # (batch 1 and) the bucket of 4
    assert {g.compiler for g in spec.graphs} == {"inductor" if backend == "specfx" else "eager"}
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in (*target.modules(), *draft.modules()))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(tree=specfx.TokenTree([(0,), (1,), (0, 0)])), r"draft \(Qwen3NextForCausalLM\) keeps recurrent.*chain only"),
        (dict(compile=True, background_compile=True), r"draft \(Qwen3NextForCausalLM\).*traced in the background"),
    ],
)
def test_what_a_stateful_draft_cannot_run_is_refused(options, match):
    with pytest.raises(ValueError, match=match):
        specfx.speculate(_model("llama"), draft=_model("qwen3_next", seed=1), **{"compile": False, **options})


def test_pard_refuses_a_stateful_draft():
    with pytest.raises(ValueError, match=r"Pard: Qwen3NextForCausalLM keeps recurrent.*mask tokens.*ordinary draft model"):
        specfx.Pard(_model("qwen3_next", seed=1), mask_token_id=3)
