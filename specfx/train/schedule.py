"""The one learning-rate schedule of specfx's trainers: linear warm-up, then cosine decay to 10 %
of the peak at the last step (``specfx train``'s heads, both phases of the demo pair)."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, peak: float, warmup: int, steps: int) -> float:
    """The learning rate of ``step`` (0-based) of ``steps``: ``peak * (step + 1) / warmup``
    during the ``warmup`` steps, then ``peak * (0.1 + 0.45 * (1 + cos(pi * t)))`` with ``t``
    going from 0 to 1 over the remaining steps (held at 1 past ``steps``, when a resumed run
    extends it)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t, 1.0))))
