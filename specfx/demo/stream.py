"""Streamers of ``specfx demo``: which emitted tokens were drafted and accepted, marked in colour
(or with « ») after the fact (:func:`render_marked`) or while they are generated
(:class:`PrintingMarkingStreamer`).

specfx calls a streamer as HF does (``put`` with the prompt, then one ``put`` per step, then
``end``) and, when the streamer has it, ``put_round(n_emitted)`` before each round's tokens: the
marks come from that count.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import TextIO

import torch

__all__ = ["ACCEPTED_ON", "ACCEPTED_OFF", "PLAIN_ON", "PLAIN_OFF", "MarkingStreamer", "PrintingMarkingStreamer",
           "marks", "render_marked"]  # fmt: skip

ACCEPTED_ON, ACCEPTED_OFF = "\033[1;32m", "\033[0m"  # bold green on a terminal
PLAIN_ON, PLAIN_OFF = "«", "»"


def marks(color: bool) -> tuple[str, str]:
    """The strings put around a run of accepted tokens: ANSI bold green, or « and »."""
    return (ACCEPTED_ON, ACCEPTED_OFF) if color else (PLAIN_ON, PLAIN_OFF)


class MarkingStreamer:
    """An HF-style streamer (``put``/``end``) that records which emitted tokens were drafted
    and accepted. specfx puts one token per step, as HF does, and tells this streamer each
    round's emitted count first (``put_round``, batch 1): of a round's n tokens the first n - 1
    are accepted proposals, the last the target's correction or bonus token (prefill's token
    is a round of one). The first put is the prompt."""

    def __init__(self):
        self.tokens: list[tuple[int, bool]] = []  # (token id, drafted and accepted)
        self._puts = 0
        self._marks: deque[bool] = deque()  # the current round's, one per token still to come

    def put_round(self, n_emitted: list[int]) -> None:
        """The emitted count of each row in the round whose tokens come next (row 0 is used)."""
        n = n_emitted[0]
        self._marks = deque([True] * (n - 1) + [False])

    def put(self, value: torch.Tensor) -> None:
        """The prompt (first call), then one step's token."""
        self._puts += 1
        if self._puts == 1:
            return  # the prompt
        for t in value.reshape(-1).tolist():
            self.tokens.append((t, self._marks.popleft() if self._marks else False))

    def end(self) -> None:
        """The generation is over (nothing to flush: the tokens are recorded)."""


def render_marked(tokenizer, tokens: list[tuple[int, bool]], color: bool) -> str:
    """The completion with runs of accepted tokens wrapped in colour (or « »)."""
    on, off = marks(color)
    out, i = [], 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and tokens[j][1] == tokens[i][1]:
            j += 1
        text = tokenizer.decode([t for t, _ in tokens[i:j]])
        out.append(f"{on}{text}{off}" if tokens[i][1] else text)
        i = j
    return "".join(out)


class PrintingMarkingStreamer(MarkingStreamer):
    """A :class:`MarkingStreamer` that also writes the answer to ``file`` as it is generated
    (batch 1), as ``transformers.TextStreamer(tokenizer, skip_prompt=True)`` does, with the
    drafted-and-accepted tokens marked.

    Each step decodes the whole answer so far (special tokens skipped: the chat's end-of-turn
    token is not shown) and writes what is new; text that ends inside a multi-byte character
    (a trailing U+FFFD) waits for the next token. New text takes the mark of the token that
    completed it; a run of accepted tokens is marked once, around the whole run.
    """

    def __init__(self, tokenizer, color: bool, file: TextIO | None = None):
        super().__init__()
        self.tokenizer = tokenizer
        self.on, self.off = marks(color)
        self.file = file
        self._shown = 0  # characters of the decoded answer written so far
        self._open = False  # inside a run of accepted tokens (its opening mark written)

    def put(self, value: torch.Tensor) -> None:
        """Record the step's token (see :class:`MarkingStreamer`) and write the new text."""
        before = len(self.tokens)
        super().put(value)
        if len(self.tokens) > before:
            self._write(final=False)

    def end(self) -> None:
        """Write what is left, close an open run of accepted tokens and end the line."""
        self._write(final=True)
        self._out().write((self.off if self._open else "") + "\n")
        self._open = False
        self._out().flush()

    def _out(self) -> TextIO:
        return self.file if self.file is not None else sys.stdout  # read late: pytest's capsys swaps it

    def _write(self, final: bool) -> None:
        text = self.tokenizer.decode([t for t, _ in self.tokens], skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return  # a character split across tokens: wait for the rest of it
        new = text[self._shown :]
        if not new:
            return
        self._shown = len(text)
        accepted = bool(self.tokens) and self.tokens[-1][1]
        if accepted != self._open:  # a run of accepted tokens starts or ends here
            new = (self.on if accepted else self.off) + new
            self._open = accepted
        self._out().write(new)
        self._out().flush()
