"""An oracle drafter with a controlled acceptance rate, for benchmarking the machinery.

Random-weight models give meaningless acceptance (a random draft of a random target accepts
almost nothing), so the speed of specfx at a realistic acceptance rate cannot be measured with
them directly. The oracle knows the target's own greedy continuation (computed once, before
the benchmark, by the target's greedy ``generate``) and proposes, at each drafted position, the
target's greedy token with probability α and a token guaranteed to differ otherwise. Its cost
is one gather: a round with the oracle is the target's verification plus the machinery, so
α = 1 measures the machinery's ceiling (every round emits K + 1 tokens).

Not public API: a tool of ``specfx bench gpu`` (:mod:`specfx.bench.tasks.gpu`) and the tests.

Usage::

    reference = greedy_continuation(target, input_ids, attention_mask, new_tokens=n + k + 1)
    oracle = OracleDrafter(alpha=0.8, reference=reference)
    spec = specfx.speculate(target, draft=oracle, num_speculative_tokens=k)
    spec.generate(input_ids, attention_mask=attention_mask, max_new_tokens=n)
    oracle.set_alpha(0.6)          # an in-place write: the compiled round is reused as is
"""

from __future__ import annotations

import torch

from specfx.config import SpecConfig
from specfx.drafters.base import Drafter
from specfx.sampling.processors import PLACEHOLDER

__all__ = ["OracleDrafter", "greedy_continuation", "expected_acceptance"]

# Random streams of the oracle's decisions. round.py uses 0 (prefill), 1..K (draft sampling),
# 1000 (acceptance) and 1001 (resampling); K <= 16, so these never collide with them.
STREAM_HIT = 2000
STREAM_MISS = 2001


class OracleDrafter(Drafter):
    """Proposes the target's greedy continuation, each token kept with probability α.

    α is the per-token probability that a proposal is the target's greedy token. For each of
    the K drafted positions ``lengths + 1 .. lengths + K`` of a row the oracle draws
    ``u ~ U(0, 1)`` from the round's counter-based stream (``ctx.uniform``, stream 2000) and
    proposes the reference token if ``u < α``, else ``(reference + 1 + r) mod V`` with
    ``r ∈ [0, V - 2]`` drawn from stream 2001 (never the reference token). Greedy verification
    keeps proposals up to the first miss, so the accepted length of a round is truncated
    geometric: ``P(accepted >= i) = α**i`` for ``i <= K``, and the expected acceptance rate is
    :func:`expected_acceptance` ``(α, K)``; τ = expected accepted + 1.

    Greedy only, for that meaning of α. Under sampling the oracle is still a deterministic
    drafter given its own random stream (q = None, one-hot on the proposal), so specfx's output
    still follows the target's distribution exactly, but α then no longer sets the acceptance.

    The reference must be the continuation the run will actually produce: greedy decoding
    with the same model, prompts and padding. Where the run diverges from it (in bf16 a
    near-tie can decode differently in a (K+1)-token verification than in HF's 1-token decode
    steps) the later proposals are wrong and acceptance drops, which ``spec.stats`` shows.

    Device state: ``buffer [B, C]`` int64 (slot == position, like ``RoundState.tokens``) and
    ``alpha`` (a 0-dim float32 tensor), both written in place by :meth:`set_reference` and
    :meth:`set_alpha`, so a compiled round (and its CUDA graph) sees new values without
    recompiling. The oracle does no prefill and keeps no KV cache.

    Args:
        alpha: probability in [0, 1] that a proposal is the reference token.
        reference: ``[B, N]`` int64, position-indexed (row b's token at position p in column
            p; see :func:`greedy_continuation`). May be set later with :meth:`set_reference`.
    """

    name = "oracle"

    def __init__(self, alpha: float, reference: torch.Tensor | None = None):
        self._alpha_value = _check_alpha(alpha)
        self._reference = None if reference is None else _check_reference(reference)
        self.vocab_size: int | None = None
        self.device: torch.device | None = None
        self.alpha: torch.Tensor | None = None  # [] float32
        self.buffer: torch.Tensor | None = None  # [B, C] int64

    # ----------------------------------------------------------------- Drafter interface
    def bind(self, target) -> None:
        self.vocab_size = target.vocab_size
        self.device = torch.device(target.device)
        self.alpha = torch.tensor(self._alpha_value, dtype=torch.float32, device=self.device)
        if self.device.type == "cuda":
            torch._dynamo.mark_static_address(self.alpha)

    def allocate(self, batch_size: int, capacity: int) -> None:
        if self.device is None:
            raise RuntimeError("OracleDrafter.allocate() before bind(): pass it to specfx.speculate(draft=...).")
        self.buffer = torch.full((batch_size, capacity), PLACEHOLDER, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            # The round's CUDA graph reads the buffer in place; refills must not move it.
            torch._dynamo.mark_static_address(self.buffer)
        if self._reference is not None:
            self._fill()

    def propose(self, ctx):
        b, c = self.buffer.shape
        if ctx.lengths.shape[0] != b:
            raise ValueError(f"the oracle's reference has {b} rows but the batch has {ctx.lengths.shape[0]}.")
        v = self.vocab_size
        offsets = torch.arange(1, ctx.k + 1, device=self.buffer.device)  # [K]
        pos = (ctx.lengths.unsqueeze(1) + offsets).clamp(max=c - 1)  # [B, K]
        oracle = self.buffer.gather(1, pos)  # [B, K]
        hit = ctx.uniform(STREAM_HIT, (b, ctx.k)) < self.alpha  # [B, K]
        r = (ctx.uniform(STREAM_MISS, (b, ctx.k)) * (v - 1)).long().clamp(max=v - 2)  # [B, K] in [0, V-2]
        miss = (oracle + 1 + r) % v  # never the reference token
        return torch.where(hit, oracle, miss), None

    # ----------------------------------------------------------------- control
    def set_alpha(self, alpha: float) -> None:
        """Change α in place (no recompilation of a compiled round)."""
        self._alpha_value = _check_alpha(alpha)
        if self.alpha is not None:
            self.alpha.fill_(self._alpha_value)

    def set_reference(self, reference: torch.Tensor) -> None:
        """Use a new position-indexed reference ``[B, N]`` (written into the buffer in place)."""
        self._reference = _check_reference(reference)
        if self.buffer is not None:
            self._fill()

    def _fill(self) -> None:
        ref = self._reference
        b, c = self.buffer.shape  # b: the batch bucket (real rows first, then inert rows)
        if ref.shape[0] > b or b > SpecConfig.batch_bucket(ref.shape[0]):
            raise ValueError(
                f"the oracle's reference has {ref.shape[0]} rows but generate() runs a batch of {b}; "
                f"compute the reference for the same input_ids (greedy_continuation) and set_reference() it."
            )
        n = min(ref.shape[1], c)
        self.buffer.fill_(PLACEHOLDER)  # inert rows past the reference's propose placeholders
        self.buffer[: ref.shape[0], :n].copy_(ref[:, :n])


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1] (the per-token hit probability), got {alpha!r}.")
    return float(alpha)


def _check_reference(reference) -> torch.Tensor:
    if not isinstance(reference, torch.Tensor) or reference.dim() != 2 or reference.dtype != torch.long:
        got = (
            f"{reference.dtype} tensor of shape {tuple(reference.shape)}"
            if isinstance(reference, torch.Tensor)
            else type(reference).__name__
        )
        raise TypeError(f"reference must be an int64 tensor [batch, positions] (see greedy_continuation), got {got}.")
    return reference


def greedy_continuation(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, new_tokens: int):
    """The target's greedy continuation, position-indexed for :class:`OracleDrafter`.

    Runs ``model.generate`` once, greedy, with EOS disabled (so rows continue past an EOS the
    run itself would stop at: proposals there are then still the target's greedy tokens) and
    the model's other generation defaults (as ``spec.generate`` uses them). Pass
    ``new_tokens = max_new_tokens + K + 1`` so that proposals of the last round, which reach K
    positions past the generation's end, are covered too.

    Args:
        input_ids: ``[B, S]`` prompts, left-padded where ``attention_mask`` has zeros.
        attention_mask: ``[B, S]`` (1 = real token) or None (no padding).
    Returns:
        ``[B, S + new_tokens]`` int64 on the model's device: row b's token at position p
        (p = 0 for its first real token) in column p; PLACEHOLDER past the row's end.
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}.")
    b, s = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask.to(torch.long)
    pad = (s - mask.sum(dim=1)).cpu()  # [B] left padding per row
    cols = torch.arange(s)
    if not torch.equal(mask.cpu(), (cols.unsqueeze(0) >= pad.unsqueeze(1)).long()):
        raise ValueError("attention_mask must be left padding (zeros, then ones) as for batched generate().")
    # Keyword arguments, not a generation_config: transformers fills a passed config's None
    # fields (eos_token_id=None among them) from the model's defaults.
    pad_id = model.generation_config.pad_token_id
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        num_beams=1,
        eos_token_id=None,
        max_new_tokens=new_tokens,
        pad_token_id=PLACEHOLDER if pad_id is None else pad_id,
    )  # [B, S + new]
    width = out.shape[1]
    idx = torch.arange(width).unsqueeze(0) + pad.unsqueeze(1)  # [B, W]: column of position p
    valid = idx < width
    ref = out.cpu().gather(1, idx.clamp(max=width - 1))
    return torch.where(valid, ref, PLACEHOLDER).to(out.device)


def expected_acceptance(alpha: float, k: int) -> tuple[float, float]:
    """(expected acceptance rate, expected τ) of the oracle at per-token hit probability α.

    Accepted length A of a round is truncated geometric: ``P(A >= i) = α**i`` for i <= K, so
    ``E[A] = Σ_{i=1..K} α**i``; acceptance rate = E[A] / K; τ = E[A] + 1 (before truncation at
    the generation's end).
    """
    mean = sum(alpha**i for i in range(1, k + 1))
    return mean / k, mean + 1.0
