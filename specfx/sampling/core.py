"""Logits processing, the counter-based random stream and the rejection sampler.

Everything here is graph-friendly tensor code: no host sync, no data-dependent Python
branches, fixed output shapes. Vocabulary (DESIGN.md): a round verifies K *proposals*; the
first ``n_accepted`` are *accepted*; then one *correction* (sampled from norm(max(0, p - q))
at the first rejection) or *bonus* (sampled from p after all K were accepted) follows, so a
row *emits* ``n_accepted + 1`` tokens.

The processors reproduce transformers' ``RepetitionPenaltyLogitsProcessor``,
``MinLength``/``MinNewTokensLengthLogitsProcessor``, ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper`` in HF's order, batched over positions with the
per-position context a speculative round needs (tokens drafted earlier in the round count as
already generated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "PLACEHOLDER",
    "Mode",
    "SamplingParams",
    "as_mode",
    "process_logits",
    "uniform",
    "sample_from",
    "greedy_verify",
    "rejection_verify",
]

PLACEHOLDER = 0  # fills tokens[B, K+1] past n_emitted; a valid id so nothing indexes out of range
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Mode:
    """What a round graph computes over the vocabulary: a graph constant, one graph per mode.

    ``sample``: sampling (warpers, q, the rejection sampler) or greedy (an argmax).
    ``penalty``: the repetition penalty stage runs (it needs ``[B, T, V]`` presence masks
    built from the row's history and the round's drafts); off when the penalty is 1.
    ``warp``: the top-k/top-p stage runs (two sorts over the vocabulary per scored position);
    off when top_k = 0 and top_p = 1, and always off when greedy (HF warps only when sampling).
    Temperature and the minimum-length EOS mask are elementwise and always run (at their "off"
    values they are exact no-ops), so their values never select a graph.
    """

    sample: bool
    penalty: bool = True
    warp: bool = True

    def __post_init__(self):
        if not self.sample:
            object.__setattr__(self, "warp", False)

    def __bool__(self):  # a Mode where a bool was expected is a bug, not "sampling"
        raise TypeError("Mode has no truth value: read mode.sample")


def as_mode(mode: Mode | bool) -> Mode:
    """A :class:`Mode` from a mode or a bare ``sample`` flag (every stage on: the general graph)."""
    return Mode(mode) if isinstance(mode, bool) else mode


@dataclass(frozen=True)
class SamplingParams:
    """Resolved generation parameters, as HF resolves them (see ``generate_args``).

    Every value lives in a device tensor of the round state (``RoundState.values``); only which
    stages run selects a graph (:meth:`mode`: greedy or sampling, the repetition penalty on or
    off, the top-k/top-p sorts on or off), so temperature, top-k, top-p, the penalty and a
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
        return Mode(self.do_sample, penalty=v["penalty"] != 1.0, warp=v["top_k"] != 0 or v["top_p"] < 1.0)


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
    if not mode.warp:
        return scores
    # top-k: the kth largest via a sort, so k is a tensor; k = 0 (off) keeps all V
    top_k = values["top_k"]
    k = torch.where(top_k > 0, top_k, v).clamp(max=v)
    desc = scores.sort(dim=-1, descending=True).values
    kth = desc.index_select(-1, (k - 1).view(1))
    scores = scores.masked_fill(scores < kth, float("-inf"))
    # top-p (min_tokens_to_keep = 1); off at top_p = 1
    top_p = values["top_p"]
    sorted_scores, order = torch.sort(scores, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = (cum <= (1 - top_p)) & (top_p < 1)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 holding values in [0, 2**32); multipliers < 2**31 keep
    every product inside int64, so it is exact on every backend."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): a pure function of (seed, counter, stream, index).

    Identical in eager and compiled mode and on every device, needs no generator object in
    the graph, and a seed reproduces a whole generation.
    """
    numel = 1
    for s in shape:
        numel *= s
    key = _mix32((seed & _MASK32) ^ _mix32((counter & _MASK32) ^ _mix32(torch.full_like(seed, stream))))
    idx = torch.arange(numel, device=seed.device, dtype=torch.long).view(shape)
    h = _mix32(_mix32(idx ^ key) ^ ((seed >> 32) & _MASK32))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_from(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index ∝ ``weights`` (unnormalised, >= 0) along the last dim: the exponential race
    argmax(w / E), E = -log(u) ~ Exp(1). Exact, and no host sync."""
    return torch.argmax(weights / (-torch.log(u)), dim=-1)


def _emit(proposals: torch.Tensor, n_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """tokens [B, K+1]: accepted proposals, then ``last`` (correction/bonus), then PLACEHOLDER."""
    b, k = proposals.shape
    idx = torch.arange(k + 1, device=proposals.device).unsqueeze(0)  # [1, K+1]
    padded = torch.cat([proposals, proposals.new_full((b, 1), PLACEHOLDER)], dim=1)
    n = n_accepted.unsqueeze(1)
    out = torch.where(idx < n, padded, last.unsqueeze(1))
    return torch.where(idx <= n, out, PLACEHOLDER)


def greedy_verify(target_scores: torch.Tensor, proposals: torch.Tensor):
    """Greedy acceptance: keep proposals while they equal argmax p, then emit argmax p.

    Args:
        target_scores: ``[B, K+1, V]`` processed target logits at the K+1 verified positions.
        proposals: ``[B, K]`` drafted tokens.
    Returns:
        tokens ``[B, K+1]`` (PLACEHOLDER past the emitted ones), n_accepted ``[B]``.
    """
    best = target_scores.argmax(dim=-1)  # [B, K+1]
    accept = proposals == best[:, :-1]
    n_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    last = best.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
    return _emit(proposals, n_accepted, last), n_accepted


def rejection_verify(
    p: torch.Tensor,  # [B, K+1, V] target probabilities
    q: torch.Tensor | None,  # [B, K, V] probabilities the drafter sampled each proposal from; None: one-hot
    proposals: torch.Tensor,  # [B, K]
    u_accept: torch.Tensor,  # [B, K] uniforms
    u_resample: torch.Tensor,  # [B, V] uniforms
):
    """Lossless speculative sampling (Leviathan et al. / Chen et al.); ``q=None`` for a
    deterministic drafter (prompt lookup), whose q is one-hot on its proposals.

    Accept proposal x with probability min(1, p(x)/q(x)) via the strict test ``u·q(x) < p(x)``
    (a token with p(x) = 0 is never accepted); at the first rejection sample the correction
    from norm(max(0, p - q)) (p is not mutated); after K acceptances sample the bonus from p.
    Only the one position a row emits from is resampled: the residual is built for that
    ``[B, V]`` row alone, not for all K + 1.
    Returns tokens ``[B, K+1]`` and n_accepted ``[B]``.
    """
    b, k, v = q.shape if q is not None else (*proposals.shape, p.shape[-1])
    idx = proposals.unsqueeze(-1)
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)
    q_x = 1.0 if q is None else q.gather(-1, idx).squeeze(-1)
    accept = u_accept * q_x < p_x  # q one-hot: u * 1 < p(x)
    n_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    row = n_accepted.view(b, 1, 1)
    p_row = p.gather(1, row.expand(b, 1, v)).squeeze(1)  # [B, V]: p where the row emits
    rejected = n_accepted < k  # else the bonus, sampled from p itself
    at = row.clamp(max=max(k - 1, 0))
    if q is None:
        # max(0, p - one_hot(x)) is p with p(x) set to 0, bit for bit (no [B, K, V] one-hot)
        x = proposals.gather(1, at.view(b, 1)) if k else proposals.new_zeros(b, 1)
        corrected = p_row.scatter(-1, x, 0.0)
    else:
        corrected = (p_row - q.gather(1, at.expand(b, 1, v)).squeeze(1)).clamp_min(0)
    residual = torch.where(rejected.unsqueeze(1), corrected, p_row)
    # p == q up to rounding leaves nothing to resample from; that position is then never
    # rejected in exact arithmetic, so falling back to p changes no probability.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row)
    last = sample_from(residual, u_resample)  # [B]
    return _emit(proposals, n_accepted, last), n_accepted
