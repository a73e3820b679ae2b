"""Logits processing, as transformers does it, batched over a round's positions.

The processors reproduce transformers' ``RepetitionPenaltyLogitsProcessor``,
``MinLength``/``MinNewTokensLengthLogitsProcessor``, ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper`` in HF's order, batched over positions with the
per-position context a speculative round needs (tokens drafted earlier in the round count as
already generated). :class:`Mode` says which stages a round graph runs (a graph constant);
:class:`SamplingParams` holds one call's values (device tensors: they never select a graph).

Everything here is graph-friendly tensor code: no host sync, no data-dependent Python
branches, fixed output shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GREEDY", "PLACEHOLDER", "TOPK_BOUND", "Mode", "SamplingParams", "as_mode", "process_logits"]

PLACEHOLDER = 0  # fills tokens[B, K+1] past n_emitted; a valid id so nothing indexes out of range
# top_k up to this takes the kth largest score from torch.topk over this many, not from a sort of the
# whole vocabulary (HF's default top_k is 50; a sort of 49k scores cost ~5 ms a position on a CPU)
TOPK_BOUND = 256


@dataclass(frozen=True)
class Mode:
    """What a round graph computes over the vocabulary: a graph constant, one graph per mode.

    ``sample``: sampling (warpers, q, the rejection sampler) or greedy (an argmax).
    ``penalty``: the repetition penalty stage runs (it needs ``[B, T, V]`` presence masks
    built from the row's history and the round's drafts); off when the penalty is 1.
    ``top_k``: the top-k stage: 0 off (top_k = 0); ``n > 0``: every call of the graph has
    ``top_k <= n`` (:data:`TOPK_BOUND`), and the kth largest score comes from ``torch.topk`` over
    ``n``; -1: any top_k, the kth largest from a sort of the vocabulary.
    ``top_p``: the top-p stage runs (a sort of the vocabulary per scored position); off at top_p = 1.
    Both warpers are off when greedy (HF warps only when sampling). Temperature and the
    minimum-length EOS mask are elementwise and always run (at their "off" values they are exact
    no-ops), so their values never select a graph.
    """

    sample: bool
    penalty: bool = True
    top_k: int = -1
    top_p: bool = True

    def __post_init__(self):
        if not self.sample:
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "top_p", False)

    def __bool__(self):  # a Mode where a bool was expected is a bug, not "sampling"
        raise TypeError("Mode has no truth value: read mode.sample")


def as_mode(mode: Mode | bool) -> Mode:
    """A :class:`Mode` from a mode or a bare ``sample`` flag (every stage on: the general graph)."""
    return Mode(mode) if isinstance(mode, bool) else mode


GREEDY = Mode(False, penalty=False)  # argmax, no repetition penalty: the cheapest graph


@dataclass(frozen=True)
class SamplingParams:
    """Resolved generation parameters, as HF resolves them (see ``generate_args``).

    Every value lives in a device tensor of the round state (``RoundState.values``); only which
    stages run selects a graph (:meth:`mode`: greedy or sampling, the repetition penalty on or
    off, top-k by ``torch.topk``, by a sort or off, top-p on or off), so temperature, top-k, top-p, the penalty and a
    minimum length never change a compiled graph within a mode.
    """

    do_sample: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0  # EOS is masked while fewer new tokens than this were generated
    eos_token_ids: tuple[int, ...] = ()

    def device_values(self) -> dict[str, float | int | bool]:
        """What ``RoundState.values`` holds for this call. HF applies the warpers (temperature,
        top-k, top-p) only when sampling, so greedy turns them off (values that are exact
        no-ops in :func:`process_logits`)."""
        s = self.do_sample
        return {
            "temperature": self.temperature if s else 1.0,
            "top_k": self.top_k if s else 0,
            "top_p": self.top_p if s else 1.0,
            "penalty": self.repetition_penalty,
            "min_new": self.min_new_tokens,
        }

    def mode(self) -> Mode:
        """The graph this call needs: stages at their "off" value are left out of it."""
        v = self.device_values()
        top_k = 0 if v["top_k"] == 0 else TOPK_BOUND if v["top_k"] <= TOPK_BOUND else -1
        return Mode(self.do_sample, penalty=v["penalty"] != 1.0, top_k=top_k, top_p=v["top_p"] < 1.0)


def process_logits(
    logits: torch.Tensor,  # [B, T, V] raw model logits
    values: dict[str, torch.Tensor],  # 0-dim tensors: temperature, top_k, top_p, penalty, min_new
    presence: torch.Tensor,  # [B, T, V] bool (or broadcastable): token already in the row's sequence
    gen_index: torch.Tensor,  # [B, T] int64: index among new tokens of the token predicted here
    eos_ids: torch.Tensor,  # [E] int64, -1 = unused entry
    mode: Mode | bool = True,
) -> torch.Tensor:
    """Apply HF's processors and, when sampling (HF warps only then), its warpers, in HF's
    order, in float32 (as HF does). ``mode`` (a :class:`Mode`, or a bare ``sample`` flag for
    every stage) leaves out the stages the call has turned off; ``presence`` may then be None.

    Every stage that runs takes its value from ``values``; at its "off" value (penalty 1,
    min_new 0, temperature 1, top_k 0, top_p 1) a stage returns its input exactly, so one graph
    serves every setting of its mode.
    """
    mode = as_mode(mode)
    scores = logits.float()
    v = scores.shape[-1]
    if mode.penalty:
        penalty = values["penalty"]
        penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores = torch.where(presence & (penalty != 1), penalised, scores)
    vocab_ids = torch.arange(v, device=scores.device)
    is_eos = (vocab_ids.unsqueeze(0) == eos_ids.unsqueeze(1)).any(dim=0)  # [V]; -1 matches nothing
    too_early = (gen_index < values["min_new"]).unsqueeze(-1)  # [B, T, 1]
    scores = scores.masked_fill(too_early & is_eos, float("-inf"))
    if not mode.sample:
        return scores
    scores = scores / values["temperature"]
    if mode.top_k:  # HF's TopKLogitsWarper: keep the scores >= the kth largest (ties kept); 0 keeps all
        top_k = values["top_k"]
        if mode.top_k > 0:  # top_k <= n: the n largest, in descending order, hold the kth
            n = min(mode.top_k, v)
            desc = scores.topk(n, dim=-1).values
            kth = desc.index_select(-1, (top_k.clamp(1, n) - 1).view(1))
            kth = torch.where(top_k > 0, kth, float("-inf"))
        else:
            k = torch.where(top_k > 0, top_k, v).clamp(max=v)
            desc = scores.sort(dim=-1, descending=True).values
            kth = desc.index_select(-1, (k - 1).view(1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if not mode.top_p:
        return scores
    # top-p (min_tokens_to_keep = 1); off at top_p = 1
    top_p = values["top_p"]
    sorted_scores, order = torch.sort(scores, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = (cum <= (1 - top_p)) & (top_p < 1)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
