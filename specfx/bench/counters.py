"""Counting a model's forwards in HF's generation, for the acceptance of HF's methods
(``specfx bench drafters`` and ``selfspec``), which HF does not report.

One forward pre-hook on a module records the tokens fed to each call. Hooked on the model
itself it counts every forward (``input_ids [B, S]``); hooked on the last decoder layer it
counts only full-depth forwards (``hidden_states [B, S, H]``), which is what an early-exit
draft's shallow forwards must not be counted as.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["ForwardCounter", "hf_forwards"]


class ForwardCounter:
    """Counts the forwards of ``module`` and the tokens fed to each (dimension 1 of its first
    input: ``input_ids`` or ``hidden_states``) while open; ``close()`` removes the hook."""

    def __init__(self, module: torch.nn.Module):
        self.lengths: list[int] = []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        first = kwargs.get("input_ids", kwargs.get("hidden_states"))
        if first is None and args:
            first = args[0]
        self.lengths.append(int(first.shape[1]))

    def close(self) -> None:
        self.handle.remove()


def hf_forwards(fn: Callable[[torch.Tensor], object], module: torch.nn.Module, prompts) -> tuple[int, int]:
    """Run ``fn`` (an HF generate call) on every prompt ``[1, S]``, counting the forwards of
    ``module`` (the target, or its last decoder layer): (forwards, tokens proposed). Each
    forward verifies the tokens fed beyond the pending one; the first also prefills."""
    counter = ForwardCounter(module)
    proposed = forwards = 0
    try:
        for p in prompts:
            counter.lengths.clear()
            fn(p)
            lens = counter.lengths
            forwards += len(lens)
            proposed += (lens[0] - p.shape[1]) + sum(x - 1 for x in lens[1:])
    finally:
        counter.close()
    return forwards, proposed
