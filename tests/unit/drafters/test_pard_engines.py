"""Train here, serve there: a PARD draft saved by specfx (``PardTrain.save``) drafts in vLLM what it
drafts in specfx. vLLM's layout of a parallel-drafting step (the verified tokens re-fed, the bonus
token, K - 1 mask tokens at consecutive positions, the bonus and mask rows sampled, a KV cache that
persists across steps) is restated in tests/unit/drafters/pard_engine_layout.py from vLLM 0.33.0
(decision 85). specfx's :class:`~specfx.drafters.pard.Pard` and the restated vLLM request are
driven over the same committed tokens with an acceptance schedule that leaves mask KV at positions
later accepted; every step's K draft logits must agree."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from specfx.drafters.pard import Pard
from specfx.model.runner import ModelRunner
from specfx.testing.tiny import tiny_causal_lm
from specfx.train.pard import PardTrain
from tests.unit.drafters.pard_engine_layout import VllmPardRequest, parallel_drafting_token_id

K = 4
MASK = 250
PROMPT = 5
SCHEDULE = (1, 0, 3, 4, 2, 0, 1)  # accepted proposals per round: 4 = all, the bonus after the last mask
SEQ = torch.randint(3, 240, (PROMPT + sum(n + 1 for n in SCHEDULE) + 1,), generator=torch.Generator().manual_seed(3))


def _steps():
    """(first position the target verified, pending position L) of every round."""
    out, start, pending = [(0, PROMPT)], PROMPT, PROMPT
    for accepted in SCHEDULE:
        start, pending = pending, pending + accepted + 1
        out.append((start, pending))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-layer PARD draft as ``specfx train --head pard`` saves it, its weights spread out as
    training would (a fresh one's logits are nearly flat and its mask rows all propose the mask:
    weak for comparing greedy proposals); what it proposes is arbitrary, the layouts' agreement
    is what is checked."""
    target = tiny_causal_lm("llama", vocab_size=256, num_layers=2)
    head = PardTrain(ModelRunner(target, "target"), None, 0, 2, 64, None, K, MASK, 0.7, 0.2)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in head.module.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    path = head.save(tmp_path_factory.mktemp("pard"))
    return path, json.loads((path / "config.json").read_text())


@torch.no_grad()
def _specfx_logits(model) -> list[torch.Tensor]:
    """specfx's PARD drafter itself: the prompt prefilled, then each round's draft forward
    (``Pard.draft_logits``) at the schedule's pending positions; per round ``[K, V]``."""
    drafter = Pard(model)
    drafter.allocate(1, 64)
    pos = torch.arange(PROMPT)[None]
    drafter.prefill(SEQ[None, :PROMPT], pos, pos)
    state = SimpleNamespace(per_position=torch.zeros(K))  # the generator's largest K: the window
    ctx = lambda pending: SimpleNamespace(  # noqa: E731  (a chain round: no token tree)
        k=K, token_tree=None, lengths=torch.tensor([pending]), tokens=SEQ[None], state=state
    )
    return [drafter.draft_logits(ctx(pending))[0] for _, pending in _steps()]


def _vllm_logits(model, mask_id: int, refeed: bool = True) -> list[torch.Tensor]:
    """vLLM's steps over the same schedule; ``refeed=False``: after the prompt, each step feeds
    only the bonus token and the masks (stops at the first step that would read a slot never
    written)."""
    request, out = VllmPardRequest(model, mask_id, K), []
    for start, pending in _steps():
        try:
            out.append(request.step(SEQ[start:pending].tolist(), start, int(SEQ[pending]), refeed or start == 0))
        except AssertionError:
            if refeed:
                raise
            break
    return out


def test_vllm_drafts_what_specfx_drafts(saved, one_thread):
    path, config = saved
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # vLLM loads it by its architecture
    assert config["architectures"] == ["LlamaForCausalLM"] and parallel_drafting_token_id(config) == MASK
    ours, theirs = _specfx_logits(model), _vllm_logits(model, parallel_drafting_token_id(config))
    for mine, got in zip(ours, theirs, strict=True):
        assert torch.allclose(mine, got, atol=1e-5, rtol=1e-4)
        assert mine.argmax(-1).tolist() == got.argmax(-1).tolist()


def test_a_step_that_does_not_refeed_the_verified_tokens_reads_mask_kv(saved, one_thread):
    """Negative control: feeding only the bonus token and the masks after the prompt (an
    autoregressive draft's catch-up) leaves the previous step's mask KV where a proposal was
    accepted (the schedule's first round accepts one); the comparison sees it."""
    path, config = saved
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ours, theirs = _specfx_logits(model), _vllm_logits(model, parallel_drafting_token_id(config), refeed=False)
    assert len(theirs) >= 3
    assert torch.allclose(ours[0], theirs[0], atol=1e-5)  # the prompt's step is the same
    worst = max((mine - got).abs().max().item() for mine, got in zip(ours, theirs, strict=False))  # theirs may stop
    assert worst > 1e-3
