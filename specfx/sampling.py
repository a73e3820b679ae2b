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
    "SamplingParams",
    "process_logits",
    "uniform",
    "sample_from",
    "greedy_verify",
    "rejection_verify",
]

PLACEHOLDER = 0  # fills tokens[B, K+1] past n_emitted; a valid id so nothing indexes out of range
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """Resolved generation parameters, as HF resolves them (see ``generate_args``).

    Every value lives in a device tensor of the round state (``RoundState.values``); only
    ``do_sample`` selects a graph (greedy rounds skip the warpers' sorts and the sampler, which
    cost more than a small model's forward). Temperature, top-k, top-p, repetition penalty and
    a minimum length never change a compiled graph.
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


def process_logits(
    logits: torch.Tensor,  # [B, T, V] raw model logits
    values: dict[str, torch.Tensor],  # 0-dim tensors: temperature, top_k, top_p, penalty, min_new
    presence: torch.Tensor,  # [B, T, V] bool (or broadcastable): token already in the row's sequence
    gen_index: torch.Tensor,  # [B, T] int64: index among new tokens of the token predicted here
    eos_ids: torch.Tensor,  # [E] int64, -1 = unused entry
    warpers: bool = True,
) -> torch.Tensor:
    """Apply HF's processors and, with ``warpers`` (sampling: HF warps only then), its warpers,
    in HF's order, in float32 (as HF does).

    Every stage always runs with its value from ``values``; at its "off" value (penalty 1,
    min_new 0, temperature 1, top_k 0, top_p 1) a stage returns its input exactly, so one graph
    serves every setting of its mode.
    """
    scores = logits.float()
    v = scores.shape[-1]
    penalty = values["penalty"]
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    scores = torch.where(presence & (penalty != 1), penalised, scores)
    vocab_ids = torch.arange(v, device=scores.device)
    is_eos = (vocab_ids.unsqueeze(0) == eos_ids.unsqueeze(1)).any(dim=0)  # [V]; -1 matches nothing
    too_early = (gen_index < values["min_new"]).unsqueeze(-1)  # [B, T, 1]
    scores = scores.masked_fill(too_early & is_eos, float("-inf"))
    if not warpers:
        return scores
    scores = scores / values["temperature"]
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
    u_resample: torch.Tensor,  # [B, K+1, V] uniforms
):
    """Lossless speculative sampling (Leviathan et al. / Chen et al.); ``q=None`` for a
    deterministic drafter (prompt lookup), whose q is one-hot on its proposals.

    Accept proposal x with probability min(1, p(x)/q(x)) via the strict test ``u·q(x) < p(x)``
    (a token with p(x) = 0 is never accepted); at the first rejection sample the correction
    from norm(max(0, p - q)) (p is not mutated); after K acceptances sample the bonus from p.
    Returns tokens ``[B, K+1]`` and n_accepted ``[B]``.
    """
    k = proposals.shape[1]
    idx = proposals.unsqueeze(-1)
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)
    if q is None:
        # A deterministic drafter (q one-hot on the proposal), without building [B, K, V]:
        # u * 1 < p(x), and max(0, p - one_hot(x)) is p with p(x) set to 0, bit for bit.
        accept = u_accept < p_x
        corrected = p[:, :k].scatter(-1, idx, 0.0)
    else:
        accept = u_accept * q.gather(-1, idx).squeeze(-1) < p_x
        corrected = (p[:, :k] - q).clamp_min(0)
    n_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    residual = torch.cat([corrected, p[:, k:]], dim=1)  # [B, K+1, V]
    # p == q up to rounding leaves nothing to resample from; that position is then never
    # rejected in exact arithmetic, so falling back to p changes no probability.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    candidates = sample_from(residual, u_resample)  # [B, K+1]
    last = candidates.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
    return _emit(proposals, n_accepted, last), n_accepted
