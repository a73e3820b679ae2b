"""HF's per-step host calls (stopping criteria, streamer), replayed over what rounds emit.

transformers' ``generate()`` emits one token per row per step and after each step, in this
order: extends ``input_ids`` by ``next_tokens [B]`` (a row already finished gets
``pad_token_id`` instead, when an EOS criterion is present), calls the stopping criteria once
with every row (``input_ids [B, S + t]``, ``scores``), then ``streamer.put(next_tokens)``
(a ``[B]`` CPU tensor), and stops once no row is unfinished. A round emits 1..K+1 tokens per
row, a different number per row, so calling criteria per row or per round would show a
stateful criterion (or a streamer) something HF never shows it. :class:`StepReplay` keeps each
row's emitted tokens on the host and replays HF's steps, one call each, as soon as every row
that still contributes real tokens has emitted its token for that step::

    round 1 emits   row 0: a b c      row 1: x          -> step 1 (a, x)
    round 2 emits   row 0: d          row 1: y z w      -> steps 2..4 (b, y) (c, z) (d, w)

It runs on the host after the round's read (the compiled round stays sync-free) and only
when a call has criteria or a streamer. A streamer that also defines ``put_round(n_emitted)``
(specfx's own hook; HF never calls it) gets each round's ``[B]`` emitted counts (the prefill
counts as a round of 1) before that round's steps: of a row's n tokens, the first n - 1 were
drafted and accepted (the demo marks them). Where HF pads finished rows, a row the criteria stop
is frozen on the device (the generator finishes it); where HF does not pad (no EOS id
configured), the row goes on generating, as it does in HF, until every row is finished.
"""

from __future__ import annotations

from collections import deque

import torch

__all__ = ["StepReplay"]


class StepReplay:
    """HF's steps over the tokens a generation emits.

    Args:
        prompt: ``[B, S]`` the (left-padded) prompt, HF's ``input_ids`` before the first step.
        max_new_tokens: the step at which HF's max-length criterion stops every row.
        eos: EOS ids (non-negative) that finish a row, as HF's EOS criterion does.
        pad: the token a finished row is extended with when ``pads_finished``.
        pads_finished: HF's ``has_eos_stopping_criteria`` (some criterion has an
            ``eos_token_id``): finished rows are extended with ``pad`` and stop contributing.
        criteria: a ``StoppingCriteriaList`` called once per step, or None.
        streamer: HF's streamer protocol (``put``/``end``), or None.
        scores: pass the criteria HF's ``scores`` tuple (``return_dict_in_generate`` with
            ``output_scores``) instead of None: one ``[B, V]`` tensor per step so far; a row's
            values at a step where HF forwarded its pad token are zeros (specfx runs no pad steps).
    """

    def __init__(self, prompt, max_new_tokens: int, eos, pad, pads_finished: bool, criteria, streamer, scores: bool):
        self.sequences = prompt  # [B, S + steps]: HF's input_ids after `steps` steps
        self.steps = 0
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(eos)
        self.pad = pad
        self.pads_finished = pads_finished
        self.criteria = criteria
        self.streamer = streamer
        self.scores: tuple[torch.Tensor, ...] | None = () if scores else None
        batch = prompt.shape[0]
        self.running = [True] * batch  # HF's unfinished_sequences
        self.ends: list[int | None] = [None] * batch  # the step a padded row finished at
        self._tokens = [deque() for _ in range(batch)]  # emitted, not yet replayed
        self._values = [deque() for _ in range(batch)]  # their scores [V] (with scores)

    @property
    def done(self) -> bool:
        return not any(self.running)

    def start(self) -> None:
        if self.streamer is not None:
            self.streamer.put(self.sequences.cpu())

    def feed(self, tokens: torch.Tensor, n_emitted: list[int], scores: torch.Tensor | None = None) -> list[int]:
        """Take a round's ``tokens [B, T]`` (row b's first ``n_emitted[b]`` are real; with
        scores, ``scores [B, T, V]`` chose them) and replay every step now complete. Returns the
        rows that finished in those steps and must be frozen on the device (none when HF does
        not pad finished rows: they go on generating)."""
        rows = tokens.tolist()
        if hasattr(self.streamer, "put_round"):
            self.streamer.put_round(list(n_emitted))
        for b, n in enumerate(n_emitted):
            self._tokens[b].extend(rows[b][:n])
            if self.scores is not None:
                self._values[b].extend(scores[b, :n].unbind(0))
        stopped = []
        while not self.done and all(self._tokens[b] for b in self._contributing()):
            stopped += self._step()
        return stopped if self.pads_finished else []

    def _contributing(self) -> list[int]:
        """Rows whose next token is a real one (not HF's pad)."""
        return [b for b, running in enumerate(self.running) if running or not self.pads_finished]

    def _step(self) -> list[int]:
        contributing = set(self._contributing())
        batch = len(self.running)
        nxt = [self._tokens[b].popleft() if b in contributing else self.pad for b in range(batch)]
        next_tokens = torch.tensor(nxt, dtype=torch.long)  # [B]
        self.sequences = torch.cat([self.sequences, next_tokens.to(self.sequences.device)[:, None]], dim=1)
        self.steps += 1
        if self.scores is not None:
            step = [self._values[b].popleft() if b in contributing else None for b in range(batch)]
            like = next(v for v in step if v is not None)
            self.scores += (torch.stack([like.new_zeros(like.shape) if v is None else v for v in step]),)
        hit = [False] * batch
        if self.criteria is not None:
            hit = torch.as_tensor(self.criteria(self.sequences, self.scores)).expand(batch).tolist()
        finished = []
        for b in range(batch):
            if self.running[b] and (hit[b] or nxt[b] in self.eos or self.steps >= self.max_new_tokens):
                self.running[b] = False
                self.ends[b] = self.steps
                finished.append(b)
                if self.pads_finished:
                    self._tokens[b].clear()
                    self._values[b].clear()
        if self.streamer is not None:
            self.streamer.put(next_tokens)
        return finished

    def counts(self) -> list[int]:
        """New tokens per row in HF's output: up to the step a padded row finished, else every
        step replayed (the rows HF does not pad run to the last step)."""
        return [end if end is not None and self.pads_finished else self.steps for end in self.ends]

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
