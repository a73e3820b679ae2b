"""The round: K draft steps, one target forward over K+1 tokens, acceptance, bookkeeping.

Written as ordinary fixed-shape tensor code so that torch.compile captures one graph per
round with no host sync. State lives in device tensors of :class:`RoundState` that are
updated in place; nothing is reallocated per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfx.engine.plan import RoundShape
from specfx.model.dynamo import mark_static
from specfx.model.hf_names import penalty_counts_left_padding
from specfx.sampling.accept import greedy_verify, rejection_verify
from specfx.sampling.processors import PLACEHOLDER, process_logits
from specfx.sampling.rng import sample_from, uniform
from specfx.trees.types import TokenTree, TreeTensors

__all__ = ["EOS_SLOTS", "RoundState", "RoundContext", "prefill_step", "round_step"]

# EOS ids the state holds without reallocating (Llama 3 has 3); more reallocate a larger buffer.
EOS_SLOTS = 8

# Random streams. A round draws all its uniforms from one block (one hash chain in the graph,
# not one per draft step: the chains dominated compile time); each use takes its own slice.
_STREAM_PREFILL = 0
_STREAM_ROUND = 999  # never a draft step's own stream (1 + i), whose fallback hashes directly
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
    eos_ids: torch.Tensor  # [E] int64, EOS ids then -1 (unused entries); E fixed (EOS_SLOTS)
    live: torch.Tensor  # [B] bool, False for the inert rows that pad a batch to its bucket
    invalid: torch.Tensor  # [B] bool, sampling met a NaN/inf distribution (read with finished)
    # statistics
    rounds: torch.Tensor  # [] int64
    proposed: torch.Tensor  # [B] int64
    accepted: torch.Tensor  # [B] int64
    emitted: torch.Tensor  # [B] int64
    row_rounds: torch.Tensor  # [B] int64, rounds each row was active in
    per_position: torch.Tensor  # [K] int64 (K = the largest K rounds may use)

    @classmethod
    def allocate(cls, batch: int, capacity: int, vocab: int, k: int, device, eos_slots: int = EOS_SLOTS) -> RoundState:
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
            eos_ids=torch.full((eos_slots,), -1, dtype=torch.long, device=device),
            live=z(batch, dtype=torch.bool),
            invalid=z(batch, dtype=torch.bool),
            rounds=z(),
            proposed=z(batch),
            accepted=z(batch),
            emitted=z(batch),
            row_rounds=z(batch),
            per_position=z(k),
        )
        mark_static(*state.tensors())  # CUDA graphs then write them in place
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

    def __init__(self, state: RoundState, shape: RoundShape, vocab: int):
        self.state = state
        self.shape = shape  # the round's RoundShape (a graph constant)
        self.k = shape.draft_tokens  # proposals this round (a tree's node count)
        self.token_tree = shape.tree  # the round's TokenTree or DynamicTree (None: a chain of K)
        # its tables (a DynamicTree's are the drafter's, set by the round once drafted)
        self.tree_tensors: TreeTensors | None = (
            shape.tree.tensors(state.tokens.device) if isinstance(shape.tree, TokenTree) else None
        )
        self.vocab = vocab
        self.mode = shape.mode  # a graph constant (one graph per mode)
        self.tokens = state.tokens
        self.lengths = state.lengths
        self._block: torch.Tensor | None = None  # [B, K, V] uniforms of this round's draft steps, made on first use

    def uniform(self, stream: int, shape) -> torch.Tensor:
        """Uniforms in (0, 1) for one use in this round. The K draft steps (stream 1 + i,
        ``[B, 1, V]`` each) are rows of one block, made only when a drafter samples; acceptance
        (``[B, K]``) and the one resampled position (``[B, V]``) hash their own streams."""
        b, k, v = self.tokens.shape[0], self.k, self.vocab
        if 1 <= stream <= k and tuple(shape) == (b, 1, v):
            if self._block is None:
                self._block = uniform(self.state.seed, self.state.counter, _STREAM_ROUND, (b, k, v))
            return self._block[:, stream - 1 : stream]
        return uniform(self.state.seed, self.state.counter, stream, tuple(shape))

    def process(self, logits: torch.Tensor, first: int, drafted: list) -> torch.Tensor:
        """Processed scores for ``logits [B, T, V]`` predicting positions
        ``lengths + 1 + first + t``; ``drafted`` are the proposals ``[B, 1]`` made so far this
        round (they count as generated for the repetition penalty)."""
        s = self.state
        b, t, v = logits.shape
        offsets = torch.arange(first, first + t, device=logits.device)
        gen_index = (s.lengths + 1 - s.prompt_lengths).unsqueeze(1) + offsets  # [B, T]
        presence = None  # only the repetition penalty reads it
        if self.mode.penalty:
            presence = (s.seen > 0).unsqueeze(1)  # [B, 1, V]
            vocab_ids = torch.arange(v, device=logits.device)
            index = offsets.view(1, t, 1)
            for j, d in enumerate(drafted[: first + t - 1]):  # d_j counts at positions after j
                presence = presence | ((vocab_ids == d.unsqueeze(-1)) & (index > j))  # [B, T, V]
        return process_logits(logits, s.values, presence, gen_index, s.eos_ids, self.mode)

    def process_nodes(self, logits: torch.Tensor, queries: tuple[int, ...], tokens: torch.Tensor) -> torch.Tensor:
        """Processed scores for ``logits [B, T, V]`` at the token-tree nodes ``queries`` (each
        predicting its children): a node at depth d predicts position ``lengths + 1 + d``, and
        the tokens on its path (``tokens [B, N+1]``: the pending token, then the nodes) count
        as generated for the repetition penalty."""
        s, tree = self.state, self.tree_tensors
        b, t, v = logits.shape
        q = torch.tensor(queries, device=logits.device)
        depth = tree.depth.expand(b, -1)[:, q]  # [B, T]
        gen_index = (s.lengths + 1 - s.prompt_lengths).unsqueeze(1) + depth
        presence = None  # only the repetition penalty reads it
        if self.mode.penalty:
            path = tree.path.expand(b, -1, -1)[:, q, 1:]  # [B, T, D]: ancestors at depths 1..D
            on_path = torch.arange(1, tree.max_depth + 1, device=logits.device) <= depth.unsqueeze(-1)
            path_tokens = tokens.gather(1, path.reshape(b, -1)).view(path.shape)
            drafted = torch.zeros((b, t, v), dtype=torch.int32, device=logits.device).scatter_add_(2, path_tokens, on_path.int())
            presence = (s.seen > 0).unsqueeze(1) | (drafted > 0)
        return process_logits(logits, s.values, presence, gen_index, s.eos_ids, self.mode)

    def choose(self, scores: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next token from processed ``scores [B, T, V]``: sampled from their softmax when
        sampling, else their argmax. Returns ``(token [B, T], probs [B, T, V] or None)``; probs
        is what a sampled token was drawn from (q for a drafter), None when greedy."""
        if not self.mode.sample:
            return scores.argmax(dim=-1), None
        probs = scores.softmax(dim=-1)
        return sample_from(probs, self.uniform(stream, probs.shape)), probs


def prefill_step(target, drafter, state: RoundState, shape: RoundShape, vocab: int, ids: torch.Tensor):
    """Prefill target and drafter on the prompt and choose the first new token.

    ``ids [B, P]`` is the prompt left-padded to a bucket length P (so every row's last real
    token is in column P-1 and its logits are the last column's): the caller's own padding
    ids, then -1 in the columns the bucket adds. Real token j of a row sits at
    position and slot j; padding goes to the trash slot and to position 0, so it only sees
    slot 0 (a real token) and nothing real ever sees it. Inert rows (``live`` False) are
    finished from the start. Returns the first token ``[B]``; with ``collect`` also the
    processed scores and raw logits it was chosen from, ``[B, 1, V]`` each. ``shape``: a
    chain of 0 (:class:`~specfx.engine.plan.RoundShape`) whose Mode chooses the first token
    and whose ``collect`` says whether to return the scores.
    """
    s = state
    mode = shape.mode
    b, p = ids.shape
    col = torch.arange(p, device=ids.device).unsqueeze(0)
    pos = col - (p - s.prompt_lengths).unsqueeze(1)  # [B, P], negative on padding
    real = pos >= 0
    slots = torch.where(real, pos, target.cache.trash_slot)
    pos = pos.clamp_min(0)
    # the ids the repetition penalty counts: HF's generate() counts the padding ids too up to
    # transformers 5.22, skips them from 5.23 on (hf_names.penalty_counts_left_padding)
    counted = real | ((ids >= 0) & (ids < vocab)) if penalty_counts_left_padding() else real
    given = torch.where(counted, ids, PLACEHOLDER)
    ids = torch.where(real, ids, PLACEHOLDER)
    if getattr(target, "stateful", False):
        target.reset_state()  # every row restarts from a zero state (= no state)
    out = target.forward(ids, pos, slots, taps=drafter.taps, last_only=True)
    logits, features = out if drafter.taps else (out, None)  # logits [B, 1, V]: the last column's
    drafter.prefill(ids, pos, slots)

    s.tokens.scatter_(1, slots, ids)
    s.seen.zero_()
    s.seen.scatter_add_(1, given, counted.int())
    s.counter.zero_()
    ctx = RoundContext(s, shape, vocab)
    # gen_index of the first token is 0: process() predicts lengths + 1 + first - prompt_len
    s.lengths.copy_(s.prompt_lengths - 1)
    scores = ctx.process(logits, 0, [])  # [B, 1, V]
    first, probs = ctx.choose(scores, _STREAM_PREFILL)
    first = first[:, 0]  # [B]
    if mode.sample:
        s.invalid.copy_(s.live & probs[:, 0].isnan().any(dim=-1))
    else:
        s.invalid.zero_()
    s.lengths.copy_(s.prompt_lengths)
    s.tokens.scatter_(1, s.lengths.unsqueeze(1), first.unsqueeze(1))
    s.seen.scatter_add_(1, first.unsqueeze(1), torch.ones_like(first, dtype=torch.int32).unsqueeze(1))
    is_eos = (first.unsqueeze(1) == s.eos_ids).any(dim=1)
    s.finished.copy_(is_eos | (s.lengths + 1 >= s.gen_end) | ~s.live)
    for t in (s.rounds, s.proposed, s.accepted, s.emitted, s.row_rounds, s.per_position):
        t.zero_()
    if features is not None:
        drafter.observe(ctx, features, pos, slots)  # after the first token is committed
    if shape.collect:
        return first, scores, logits.float()
    return first


def truncate(s: RoundState, out: torch.Tensor, n_accepted: torch.Tensor, active: torch.Tensor):
    """Cut a round's ``out [B, W]`` (accepted tokens, then the correction/bonus) at the length
    limit and at the first EOS; rows already finished emit nothing. Returns ``(out, n [B],
    emitted [B, W], done [B])``: out with PLACEHOLDER past n, the emitted count, its mask, and
    which rows finish with this round."""
    idx = torch.arange(out.shape[1], device=out.device).unsqueeze(0)
    remaining = s.gen_end - (s.lengths + 1)  # tokens a row may still add
    n = torch.minimum(n_accepted + 1, remaining)
    eos_hit = (out.unsqueeze(-1) == s.eos_ids).any(dim=-1) & (idx < n.unsqueeze(1))
    has_eos = eos_hit.any(dim=1)
    n = torch.where(has_eos, eos_hit.int().argmax(dim=1) + 1, n)
    n = torch.where(active, n, 0)
    emitted = idx < n.unsqueeze(1)
    return torch.where(emitted, out, PLACEHOLDER), n, emitted, active & (has_eos | (n >= remaining))


def commit(s: RoundState, out: torch.Tensor, n: torch.Tensor, emitted: torch.Tensor, done: torch.Tensor) -> None:
    """Append the emitted tokens after each row's pending token and advance the row."""
    idx = torch.arange(out.shape[1], device=out.device).unsqueeze(0)
    write = (s.lengths.unsqueeze(1) + 1 + idx).clamp(max=s.tokens.shape[1] - 1)
    s.tokens.scatter_(1, write, torch.where(emitted, out, s.tokens.gather(1, write)))
    s.seen.scatter_add_(1, out, emitted.int())
    s.finished.copy_(s.finished | done)
    s.lengths.add_(n)


def record(s: RoundState, active: torch.Tensor, proposed: int, n_accepted: torch.Tensor, n: torch.Tensor, depth: int) -> None:
    """Device-side statistics (read once per generate call): ``proposed`` proposals per active
    row, ``n_accepted [B]`` of them on the accepted path, ``n [B]`` emitted, and per position
    (depth) ``1..depth`` whether the accepted path reached it."""
    act = active.long()
    s.rounds.add_(act.amax())
    s.proposed.add_(act * proposed)
    s.accepted.add_(act * n_accepted)
    s.emitted.add_(n)
    s.row_rounds.add_(act)
    reached = torch.arange(depth, device=n.device).unsqueeze(0) < n_accepted.unsqueeze(1)
    s.per_position[:depth].add_((reached & active.unsqueeze(1)).long().sum(dim=0))


def round_step(target, drafter, state: RoundState, shape: RoundShape, vocab: int):
    """One speculative round for every row; finished rows are carried along unchanged.
    ``shape`` (:class:`~specfx.engine.plan.RoundShape`, a chain) holds K
    (``shape.draft_tokens``), the Mode and whether to collect scores. K = 0 is plain decoding
    through the same state: no drafter, one token verified per row.

    Returns:
        tokens ``[B, K+1]``: emitted tokens, PLACEHOLDER past ``n_emitted``.
        n_emitted ``[B]``: 0 for rows already finished, else 1..K+1 (after EOS/length truncation).
        with ``shape.collect``: the processed scores and raw logits of the K+1 verified positions
        ``[B, K+1, V]`` each (emitted token i was chosen from position i).
    """
    s = state
    k, sample = shape.draft_tokens, shape.mode.sample
    s.counter.add_(1)
    ctx = RoundContext(s, shape, vocab)
    active = ~s.finished
    lengths = s.lengths

    if k > 0:
        proposals, q = drafter.propose(ctx)  # [B, K], [B, K, V] | None
    else:  # plain decoding: the drafter sits out (its state then lags; see auto_k)
        proposals, q = lengths.new_zeros(lengths.shape[0], 0), None
    taps = drafter.taps if k > 0 else ()
    pending = s.tokens.gather(1, lengths.unsqueeze(1))  # [B, 1]
    ids = torch.cat([pending, proposals], dim=1)  # [B, K+1]
    pos = lengths.unsqueeze(1) + torch.arange(k + 1, device=ids.device)  # [B, K+1]
    # recurrent state (decision 76): the verify forward absorbs all K+1 inputs, so it is recorded
    # and rolled back below to each row's emitted count (K = 0 keeps its one input: no rollback)
    roll_back = getattr(target, "stateful", False) and k > 0
    if roll_back:
        verified = target.verify_recording(ids, pos, pos, taps)  # heads' taps too (decision 82)
    else:
        verified = target.forward(ids, pos, pos, taps=taps)
    logits, features = verified if taps else (verified, None)
    # no split of a zero-width tensor at K = 0: torch 2.11's fake tensors raise IndexError on it
    # (GPU run 6, CUDA); 2.13 returns one empty chunk. Either way nothing was drafted.
    scores = ctx.process(logits, 0, list(proposals.split(1, dim=1)) if k > 0 else [])
    if sample:
        p = scores.softmax(dim=-1)
        b = proposals.shape[0]
        u_accept, u_resample = ctx.uniform(_STREAM_ACCEPT, proposals.shape), ctx.uniform(_STREAM_RESAMPLE, (b, vocab))
        out, n_accepted = rejection_verify(p, q, proposals, u_accept, u_resample)
    else:
        out, n_accepted = greedy_verify(scores, proposals)

    out, n, emitted, done = truncate(s, out, n_accepted, active)
    if roll_back:  # the state after each row's first n inputs: the pending token and n - 1 accepted
        target.roll_back_state(n, k + 1)
    if k > 0:  # the drafter's own state after the emitted tokens (a stateful draft model, decision 81)
        drafter.commit_chain(n)
    if sample:  # HF raises when it samples from a NaN distribution; flag it for the host's next read
        s.invalid.copy_(s.invalid | (p.isnan().any(dim=-1) & emitted).any(dim=1))

    commit(s, out, n, emitted, done)
    if features is not None:
        drafter.observe(ctx, features, pos, pos)  # after the emitted tokens are committed
    record(s, active, k, n_accepted, n, shape.max_accepted)
    if shape.collect:
        return out, n, scores, logits.float()
    return out, n
