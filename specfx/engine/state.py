"""The generator's device state: allocating :class:`RoundState` per batch bucket and capacity,
reallocating when the models' dtype or device changes, and loading one call into it.
"""

from __future__ import annotations

import logging

import torch

from specfx.engine.chain_round import RoundState
from specfx.engine.graphs import GraphCache
from specfx.request.args import GenerateRequest

__all__ = ["StateSlots", "load_request", "model_signature"]

logger = logging.getLogger(__name__)


def model_signature(*models) -> tuple:
    """dtype and device of every model in play (None entries skipped): a change
    (``model.to(torch.bfloat16)``) makes the allocated buffers and compiled graphs stale."""
    return tuple((m.dtype, m.device) for m in models if m is not None)


class StateSlots:
    """The allocated :class:`RoundState` (``state``) and what it was allocated for: ``shape``,
    ``(batch bucket, capacity)``, and the models' ``signature``; None before the first call or
    after a failed allocation."""

    def __init__(self, min_capacity: int, vocab: int, max_accepted: int):
        self.min_capacity = min_capacity
        self.vocab = vocab
        self.max_accepted = max_accepted  # per-position statistics kept (Plan.max_accepted)
        self.state: RoundState | None = None
        self.shape: tuple[int, int] | None = None
        self.signature: tuple | None = None

    def ensure(self, rows: int, needed: int, signature: tuple, allocate_models, graphs: GraphCache, device) -> bool:
        """Allocate state for ``rows`` rows (a batch bucket) of at least ``needed`` slots;
        ``allocate_models(rows, capacity)`` allocates the models' caches alike. Returns whether
        the models' signature changed (every graph was then dropped, and what was measured on
        the old dtype/device is stale).

        Capacity only grows (doubling from ``min_capacity``); graphs of an outgrown capacity
        are evicted at once. All-or-nothing: if any allocation fails (out of memory, Ctrl-C, a
        failed re-check) no state is left and the next call allocates afresh.
        """
        stale = signature != self.signature
        if stale:
            if self.signature is not None:
                logger.info("specfx: the model's dtype or device changed; reallocating and recompiling")
            self.state, self.shape, self.signature = None, None, None
            graphs.drop_where(lambda key: True)
        cap = max(self.min_capacity, self.shape[1] if self.shape else 0)
        while cap < needed:
            cap *= 2
        if self.shape == (rows, cap):
            return stale
        if self.shape is not None and cap != self.shape[1]:
            graphs.drop_where(lambda key: key[2] != cap)
        self.state, self.shape = None, None
        try:
            allocate_models(rows, cap)
            state = RoundState.allocate(rows, cap, self.vocab, self.max_accepted, device)
        except BaseException:
            self.signature = None  # nothing half-allocated is ever used
            raise
        self.state, self.shape, self.signature = state, (rows, cap), signature
        return stale


def load_request(s: RoundState, req: GenerateRequest, batch: int, device) -> None:
    """Load one call's rows and settings into the state (``batch`` real rows; the rest of
    the bucket are inert rows, finished from the start)."""
    sp = req.sampling
    bucket = s.live.shape[0]
    prompt_lengths = torch.ones(bucket, dtype=torch.long, device=device)
    prompt_lengths[:batch] = req.prompt_lengths
    s.prompt_lengths.copy_(prompt_lengths)
    s.gen_end.copy_(prompt_lengths + req.max_new_tokens)
    s.live.copy_(torch.arange(bucket, device=device) < batch)
    if sp.do_sample:  # HF-style: torch.manual_seed reproduces; greedy leaves the global RNG alone
        s.seed.fill_(int(torch.randint(0, 2**62, (1,))))
    for name, value in sp.device_values().items():
        s.values[name].fill_(value)
    eos = [t for t in sp.eos_token_ids if t >= 0]
    if len(eos) > s.eos_ids.numel():  # rare: a larger buffer (the round recompiles once)
        s.eos_ids = torch.full((1 << (len(eos) - 1).bit_length(),), -1, dtype=torch.long, device=device)
    padded = eos + [-1] * (s.eos_ids.numel() - len(eos))
    s.eos_ids.copy_(torch.tensor(padded, dtype=torch.long))
