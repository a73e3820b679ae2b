"""What the host loop reads back between rounds, and how a call's output is assembled.

The rounds run on the device with no host sync; the host reads only (a) the finished and NaN
flags between rounds (with "auto", the acceptance counters in the same transfer), either at
once (:func:`sync_finished`) or one round late behind the next launch (:class:`OverlappedReads`),
and (b) the tokens and statistics once at the end (:func:`finish`).
"""

from __future__ import annotations

import torch

from specfx.engine.chain_round import RoundState
from specfx.engine.stats import SpecStats
from specfx.engine.step_replay import StepReplay
from specfx.request.args import GenerateRequest

__all__ = ["OverlappedReads", "finish", "make_replay", "overlap_reads", "raise_invalid", "read_stats", "sync_finished"]


def make_replay(req: GenerateRequest, collect: bool) -> StepReplay | None:
    """HF's per-step calls for a call with stopping criteria or a streamer (step_replay)."""
    if req.streamer is None and req.stopping_criteria is None:
        return None
    eos, pad = req.sampling.eos_token_ids, req.pad_token_id
    scores = collect and req.output_scores  # HF passes its scores tuple only then
    return StepReplay(req.input_ids, req.max_new_tokens, eos, pad, req.pads_finished, req.stopping_criteria,
                      req.streamer, scores)


def overlap_reads(wanted: bool | None, device: torch.device, replay, collect: bool, auto: bool) -> bool:
    """Whether a call reads the finished flags one round late (``SpecConfig.overlap_reads``,
    ``wanted``; None: on CUDA only)."""
    if replay is not None or collect or auto:
        return False  # these read every round's tokens or counters
    return device.type == "cuda" if wanted is None else wanted


def raise_invalid(s: RoundState):
    rows = torch.nonzero(s.invalid).flatten().tolist()
    raise RuntimeError(
        f"generate(): the target's next-token distribution of row(s) {rows} contains NaN or inf "
        f"while sampling (transformers raises here too: 'probability tensor contains either inf, "
        f"nan or element < 0'). The model produced non-finite logits: check its weights and dtype "
        f"(float16 overflow is a common cause; try bfloat16 or float32)."
    )


def sync_finished(s: RoundState, auto_k) -> bool:
    """The host's read between rounds: are all rows finished? The NaN flag comes back in
    the same transfer, and with "auto" (``auto_k``, else None) the acceptance counters that
    choose the next K."""
    head = [s.finished.all().long(), s.invalid.any().long()]
    if auto_k is None:
        done, invalid = torch.stack(head).tolist()
    else:
        head += [s.accepted.sum(), s.row_rounds.sum()]
        done, invalid, accepted, row_rounds, *per_position = torch.cat([torch.stack(head), s.per_position]).tolist()
        auto_k.update(accepted, row_rounds, per_position)
    if invalid:
        raise_invalid(s)
    return bool(done)


class OverlappedReads:
    """The finished flags read one round late: :meth:`start` copies (all finished, any
    invalid) to the host behind the rounds launched so far; :meth:`done` waits for such a copy.
    On CUDA: a pinned buffer (two, used in turn, so the copy in flight never overwrites the one
    being read) and an event."""

    def __init__(self):
        self._pinned = None  # two pinned host buffers (CUDA), allocated on first use

    def start(self, s: RoundState):
        head = torch.stack([s.finished.all(), s.invalid.any()])
        if not head.is_cuda:
            return head, None
        if self._pinned is None:
            self._pinned = [torch.empty(2, dtype=torch.bool, pin_memory=True) for _ in range(2)]
        buf = self._pinned[0]
        self._pinned.reverse()
        buf.copy_(head, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return buf, event

    @staticmethod
    def done(s: RoundState, pending) -> bool:
        buf, event = pending
        if event is not None:
            event.synchronize()
        done, invalid = buf.tolist()
        if invalid:
            raise_invalid(s)
        return bool(done)


def read_stats(s: RoundState, batch: int) -> SpecStats:
    """The call's statistics from the device counters (one read, at the end)."""
    return SpecStats(
        rounds=int(s.rounds),
        proposed=int(s.proposed.sum()),
        accepted=int(s.accepted.sum()),
        emitted=int(s.emitted.sum()),
        row_rounds=int(s.row_rounds.sum()),
        per_position=s.per_position.tolist(),
        per_row_accepted=s.accepted[:batch].tolist(),
        per_row_proposed=s.proposed[:batch].tolist(),
    )


def finish(s: RoundState, req: GenerateRequest, batch: int, caps: list[int | None], steps, model, cache):
    """The output: row b's new tokens, at most ``caps[b]`` (the step replay's counts), padded,
    after the prompt: a ``[B, S + new]`` LongTensor, or HF's output object when
    ``return_dict_in_generate`` (with ``cache``, the target's, and ``steps``' scores)."""
    if bool(s.invalid.any()):  # the last round's flag (the loop may end without a read)
        raise_invalid(s)
    lengths = s.lengths[:batch].cpu()
    prompt = req.prompt_lengths.cpu()
    tokens = s.tokens[:batch].cpu()
    counts = (lengths + 1 - prompt).tolist()
    counts = [c if cap is None else min(c, cap) for c, cap in zip(counts, caps, strict=True)]
    width = max(counts)
    pad = req.pad_token_id if req.pad_token_id is not None else 0
    new = torch.full((len(counts), width), pad, dtype=torch.long)
    for b, c in enumerate(counts):
        p = int(prompt[b])
        new[b, :c] = tokens[b, p : p + c]
    sequences = torch.cat([req.input_ids, new.to(s.tokens.device)], dim=1)
    if req.return_dict_in_generate:
        from specfx.engine.outputs import generate_output  # HF's output classes, imported only when asked for

        return generate_output(model, cache, req, sequences, torch.tensor(counts), steps)
    return sequences
