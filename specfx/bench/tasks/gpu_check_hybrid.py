"""The ``hybrid`` section of ``specfx bench gpu_check`` (issue 29's "compiled, one graph" and issue
30 item 4's "a hybrid model" on the device): targets with recurrent / linear-attention state,
compiled on CUDA (Inductor + CUDA graphs), each with rounds that reject so the state is rolled back.

Per case, what :func:`~specfx.bench.tasks.gpu_check_drafters.check_drafter` checks for every
drafter: greedy tokens equal ``model.generate()`` (a left-padded batch of 3, twice: the second call
compiles nothing), the round graphs compiled, Inductor's CUDA-graph skip messages, warm rounds under
``torch.cuda.set_sync_debug_mode("error")`` (the snapshot, the rollback's mixer steps and the
per-row selection must not sync), and a profile of one warm call (one ``cudaGraphLaunch`` a round).

Cases: a gated-delta-net hybrid (``qwen3_next``: one GDN and one attention layer) with a hybrid draft
model (a perturbed copy: rounds accept some proposals and reject the rest), with prompt lookup (a
tiny random model repeats too little: every proposal rejected, the rollback at n = 0 every round)
and with ``"auto"``; LFM2's short convolutions (``lfm2``, conv state only) with the draft model; a
Mamba2 SSD type (``mamba2``); Jamba (Mamba1 + attention), whose verify forwards step its mixers one
position at a time (decision 90), with prompt lookup. Where this torch's Inductor is known to miscompile a type's round
(``ArchSpec.inductor_torch``: Mamba2 and KDA mixers before torch 2.13, decision 84; the GPU image
has torch 2.11), the case checks that ``speculate()`` refuses it with the reason instead, and that
``backend="specfx_eager"`` (traced, not lowered) still runs it exactly on the device.
"""

from __future__ import annotations

import torch

import specfx
from specfx.bench.tasks.gpu_check_drafters import SETTINGS, check_drafter, left_padded, run_cases, skip_log
from specfx.model.architectures import inductor_miscompiles
from specfx.testing.tiny import STATEFUL_TINY, perturbed_copy, tiny_causal_lm

__all__ = ["HYBRID_CASES", "check_hybrid", "section_hybrid"]

K = 4
# (case name, model type, drafter): drafter "draft" (a perturbed hybrid copy), "prompt_lookup" or "auto"
# ("auto" last: it compiles a graph per candidate K, the first to go when the deadline nears)
HYBRID_CASES = (
    ("qwen3_next_draft", "qwen3_next", "draft"),
    ("lfm2_draft", "lfm2", "draft"),
    ("mamba2_draft", "mamba2", "draft"),
    ("qwen3_next_prompt_lookup", "qwen3_next", "prompt_lookup"),
    ("jamba_prompt_lookup", "jamba", "prompt_lookup"),
    ("qwen3_next_auto", "qwen3_next", "auto"),
)


def hybrid_target(arch: str):
    """The tests' tiny stateful target of ``arch`` (EOS off; the pad id given a real embedding, so
    only the 2-D mask hides padding, as in real checkpoints)."""
    model = tiny_causal_lm(arch, **STATEFUL_TINY[arch])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_input_embeddings().weight[0].normal_()
    return model


def _kwargs(how: str, draft) -> dict:
    if how == "draft":
        return dict(draft=draft, num_speculative_tokens=K)
    if how == "prompt_lookup":
        return dict(draft="prompt_lookup", num_speculative_tokens=K)
    return dict(draft=draft, num_speculative_tokens="auto")


def check_refused(name: str, arch: str, target, draft) -> dict:
    """This torch's Inductor miscompiles the type: ``speculate()`` must refuse it saying why, and
    the traced (not lowered) round must still equal ``generate()`` on the device."""
    rec = dict(name=name, arch=arch, inductor="refused by design on torch " + torch.__version__)
    try:
        specfx.speculate(target, draft=draft, num_speculative_tokens=K, backend="specfx")
        rec["refused"] = False
    except ValueError as e:
        rec["refused"] = "Inductor miscompiles" in str(e)
        rec["reason"] = str(e)[:300]
    spec = specfx.speculate(target, draft=draft, num_speculative_tokens=K, backend="specfx_eager")
    ids, mask = left_padded(10, (0, 3, 5), seed=10)
    ids, mask = ids.to(SETTINGS.device), mask.to(SETTINGS.device)
    gen = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    want = target.generate(ids, attention_mask=mask, **gen)
    rec["greedy_equal"] = bool(torch.equal(spec.generate(ids, attention_mask=mask, **gen), want))
    rec["ok"] = rec["refused"] and rec["greedy_equal"]
    return rec


def check_hybrid(name: str, arch: str, how: str, models: dict) -> dict:
    """One case: the target (built once per type, with its draft) checked as a drafter is, or its
    refusal where this torch's Inductor miscompiles the type."""
    if arch not in models:
        target = hybrid_target(arch)
        models[arch] = (target.to(SETTINGS.device), perturbed_copy(target, 0.03).to(SETTINGS.device))
    target, draft = models[arch]
    if SETTINGS.backend == "specfx" and inductor_miscompiles(arch):
        return check_refused(name, arch, target, draft)
    rec = check_drafter(name, _kwargs(how, draft), target, skip_log())
    rec["arch"] = arch
    if how == "draft":  # some proposals rejected: the state was rolled back mid-round
        rec["rolled_back"] = 0 < rec["accepted"] < rec["proposed"]
        rec["ok"] = rec["ok"] and rec["rolled_back"]
    return rec


def section_hybrid(results, deadline):
    """Each case of :data:`HYBRID_CASES` (``SETTINGS.only`` filters by case name); a generator
    yielding after each so the caller can save the JSON."""
    models: dict[str, tuple] = {}
    cases = [(name, lambda n=name, a=arch, h=how: check_hybrid(n, a, h, models)) for name, arch, how in HYBRID_CASES]
    yield from run_cases("hybrid", results.setdefault("hybrid", []), cases, deadline)
