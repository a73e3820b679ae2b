"""The round: K draft steps, one target forward over K+1 tokens, acceptance, bookkeeping.

Written as ordinary fixed-shape tensor code so that torch.compile captures one graph per
round with no host sync. State lives in device tensors of :class:`RoundState` that are
updated in place; nothing is reallocated per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .sampling import PLACEHOLDER, greedy_verify, process_logits, rejection_verify, sample_from, uniform

__all__ = ["RoundState", "RoundContext", "prefill_step", "round_step"]

_STREAM_PREFILL = 0
_STREAM_ACCEPT = 1000
_STREAM_RESAMPLE = 1001


@dataclass
class RoundState:
    """Per-row device state of one generation (shapes fixed for a batch size and capacity)."""

    tokens: torch.Tensor  # [B, C] int64, slot == position; the pending token sits at lengths
    lengths: torch.Tensor  # [B] int64, position of the pending token (= KV entries committed)
    prompt_lengths: torch.Tensor  # [B] int64
    gen_end: torch.Tensor  # [B] int64, prompt length + max_new_tokens
    finished: torch.Tensor  # [B] bool
    seen: torch.Tensor  # [B, V] int32, occurrences of each token (repetition penalty)
    seed: torch.Tensor  # [] int64
    counter: torch.Tensor  # [] int64, rounds run (the random stream's counter)
    values: dict  # 0-dim tensors: temperature, top_k, top_p, penalty, min_new
    eos_ids: torch.Tensor  # [E] int64 (E >= 1; -1 when there is no EOS)
    # statistics
    rounds: torch.Tensor  # [] int64
    proposed: torch.Tensor  # [B] int64
    accepted: torch.Tensor  # [B] int64
    emitted: torch.Tensor  # [B] int64
    row_rounds: torch.Tensor  # [B] int64, rounds each row was active in
    per_position: torch.Tensor  # [K] int64 (K = the largest K rounds may use)

    @classmethod
    def allocate(cls, batch: int, capacity: int, vocab: int, k: int, device) -> RoundState:
        def z(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        values = {
            "temperature": z(dtype=torch.float32),
            "top_k": z(),
            "top_p": z(dtype=torch.float32),
            "penalty": z(dtype=torch.float32),
            "min_new": z(),
        }
        state = cls(
            tokens=z(batch, capacity),
            lengths=z(batch),
            prompt_lengths=z(batch),
            gen_end=z(batch),
            finished=z(batch, dtype=torch.bool),
            seen=z(batch, vocab, dtype=torch.int32),
            seed=z(),
            counter=z(),
            values=values,
            eos_ids=torch.full((1,), -1, dtype=torch.long, device=device),
            rounds=z(),
            proposed=z(batch),
            accepted=z(batch),
            emitted=z(batch),
            row_rounds=z(batch),
            per_position=z(k),
        )
        if torch.device(device).type == "cuda":
            # Static addresses: CUDA graphs may then write these in place.
            for t in state.tensors():
                torch._dynamo.mark_static_address(t)
        return state

    def tensors(self):
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if isinstance(v, dict):
                yield from v.values()
            else:
                yield v


class RoundContext:
    """What a drafter and the verifier share inside one round (or prefill)."""

    def __init__(self, state: RoundState, k: int, flags: tuple[bool, ...], vocab: int):
        self.state = state
        self.k = k
        self.flags = flags
        self.do_sample = flags[0]
        self.vocab = vocab
        self.tokens = state.tokens
        self.lengths = state.lengths

    def uniform(self, stream: int, shape) -> torch.Tensor:
        return uniform(self.state.seed, self.state.counter, stream, tuple(shape))

    def process(self, logits: torch.Tensor, first: int, drafted: list) -> torch.Tensor:
        """Processed scores for ``logits [B, T, V]`` predicting positions
        ``lengths + 1 + first + t``; ``drafted`` are the proposals made so far this round
        (they count as generated for the repetition penalty)."""
        s = self.state
        b, t, v = logits.shape
        offsets = torch.arange(first, first + t, device=logits.device)
        gen_index = (s.lengths + 1 - s.prompt_lengths).unsqueeze(1) + offsets  # [B, T]
        presence = None
        if self.flags[1]:
            presence = (s.seen > 0).unsqueeze(1).expand(b, t, v)
            if drafted:
                d = torch.cat(drafted, dim=1)  # [B, k']
                seen_d = F.one_hot(d, v).cumsum(dim=1) > 0  # [B, k', V]: any of d_0..d_j
                before = torch.cat([torch.zeros_like(seen_d[:, :1]), seen_d], dim=1)  # any of d_<j
                presence = presence | before[:, first : first + t]
        return process_logits(logits, self.flags, s.values, presence, gen_index, s.eos_ids)


def prefill_step(target, drafter, state: RoundState, ids: torch.Tensor, flags, vocab: int) -> torch.Tensor:
    """Prefill target and drafter on the prompt and choose the first new token.

    ``ids [B, P]`` is the prompt left-padded to a bucket length P (so every row's last real
    token is in column P-1 and its logits are the last column's). Real token j of a row sits at
    position and slot j; padding goes to the trash slot and to position 0, so it only sees
    slot 0 (a real token) and nothing real ever sees it. Returns the first token ``[B]``.
    """
    s = state
    b, p = ids.shape
    col = torch.arange(p, device=ids.device).unsqueeze(0)
    pos = col - (p - s.prompt_lengths).unsqueeze(1)  # [B, P], negative on padding
    real = pos >= 0
    slots = torch.where(real, pos, target.cache.trash_slot)
    pos = pos.clamp_min(0)
    ids = torch.where(real, ids, PLACEHOLDER)
    out = target.forward(ids, pos, slots, return_hidden=drafter.needs_hidden)
    logits, hidden = out if drafter.needs_hidden else (out, None)
    logits = logits[:, -1:]  # [B, 1, V]
    drafter.prefill(ids, pos, slots)

    s.tokens.scatter_(1, slots, ids)
    s.seen.zero_()
    s.seen.scatter_add_(1, ids, real.int())
    s.counter.zero_()
    ctx = RoundContext(s, 0, flags, vocab)
    # gen_index of the first token is 0: process() predicts lengths + 1 + first - prompt_len
    s.lengths.copy_(s.prompt_lengths - 1)
    scores = ctx.process(logits, 0, [])[:, 0]  # [B, V]
    if flags[0]:
        first = sample_from(scores.softmax(dim=-1), ctx.uniform(_STREAM_PREFILL, scores.shape))
    else:
        first = scores.argmax(dim=-1)
    s.lengths.copy_(s.prompt_lengths)
    s.tokens.scatter_(1, s.lengths.unsqueeze(1), first.unsqueeze(1))
    s.seen.scatter_add_(1, first.unsqueeze(1), torch.ones_like(first, dtype=torch.int32).unsqueeze(1))
    is_eos = (first.unsqueeze(1) == s.eos_ids).any(dim=1)
    s.finished.copy_(is_eos | (s.lengths + 1 >= s.gen_end))
    for t in (s.rounds, s.proposed, s.accepted, s.emitted, s.row_rounds, s.per_position):
        t.zero_()
    if hidden is not None:
        drafter.observe(ctx, hidden, pos, slots)  # after the first token is committed
    return first


def round_step(target, drafter, state: RoundState, k: int, flags, vocab: int):
    """One speculative round for every row; finished rows are carried along unchanged.

    Returns:
        tokens ``[B, K+1]``: emitted tokens, PLACEHOLDER past ``n_emitted``.
        n_emitted ``[B]``: 0 for rows already finished, else 1..K+1 (after EOS/length truncation).
    """
    s = state
    s.counter.add_(1)
    ctx = RoundContext(s, k, flags, vocab)
    active = ~s.finished
    lengths = s.lengths

    proposals, q = drafter.propose(ctx)  # [B, K], [B, K, V] | None
    pending = s.tokens.gather(1, lengths.unsqueeze(1))  # [B, 1]
    ids = torch.cat([pending, proposals], dim=1)  # [B, K+1]
    pos = lengths.unsqueeze(1) + torch.arange(k + 1, device=ids.device)  # [B, K+1]
    verified = target.forward(ids, pos, pos, return_hidden=drafter.needs_hidden)
    logits, hidden = verified if drafter.needs_hidden else (verified, None)
    scores = ctx.process(logits, 0, list(proposals.split(1, dim=1)))
    if flags[0]:
        p = scores.softmax(dim=-1)
        if q is None:
            q = F.one_hot(proposals, vocab).to(p.dtype)
        out, n_accepted = rejection_verify(
            p, q, proposals, ctx.uniform(_STREAM_ACCEPT, proposals.shape), ctx.uniform(_STREAM_RESAMPLE, p.shape)
        )
    else:
        out, n_accepted = greedy_verify(scores, proposals)

    # Truncate at the length limit and at the first EOS; freeze finished rows.
    idx = torch.arange(k + 1, device=ids.device).unsqueeze(0)
    remaining = s.gen_end - (lengths + 1)  # tokens a row may still add
    n = torch.minimum(n_accepted + 1, remaining)
    eos_hit = (out.unsqueeze(-1) == s.eos_ids).any(dim=-1) & (idx < n.unsqueeze(1))
    has_eos = eos_hit.any(dim=1)
    n = torch.where(has_eos, eos_hit.int().argmax(dim=1) + 1, n)
    n = torch.where(active, n, 0)
    out = torch.where(idx < n.unsqueeze(1), out, PLACEHOLDER)

    write = (lengths.unsqueeze(1) + 1 + idx).clamp(max=s.tokens.shape[1] - 1)
    s.tokens.scatter_(1, write, torch.where(idx < n.unsqueeze(1), out, s.tokens.gather(1, write)))
    if flags[1]:
        s.seen.scatter_add_(1, out, (idx < n.unsqueeze(1)).int())
    s.finished.copy_(s.finished | (active & (has_eos | (n >= remaining))))
    s.lengths.add_(n)
    if hidden is not None:
        drafter.observe(ctx, hidden, pos, pos)  # after the emitted tokens are committed

    # statistics (device-side; read once per generate call)
    act = active.long()
    s.rounds.add_(act.amax())
    s.proposed.add_(act * k)
    s.accepted.add_(act * n_accepted)
    s.emitted.add_(n)
    s.row_rounds.add_(act)
    s.per_position[:k].add_(((idx[:, :k] < n_accepted.unsqueeze(1)) & active.unsqueeze(1)).long().sum(dim=0))
    return out, n
