"""The round times ``num_speculative_tokens="auto"`` chooses K with, per call of a generator.

Given (``SpecConfig.auto_k_times`` or ``auto_k_cost``: the policy has them), remembered for the
call's graph shape (batch bucket, capacity, mode, collect: a call that only raises the live-KV
bound, decision 45, reuses them), or timed now by :class:`~specfx.engine.auto_k.RoundTimer`: each
round graph is compiled (with a progress bar: minutes on a CPU) and run on the allocated state
with every row finished, so the rounds change nothing a generation reads (prefill then rewrites
the tokens, counters, caches and drafter state they touched). Compiling in the background
(decision 67), graphs not ready yet are queued instead and the call runs with
:func:`~specfx.engine.background.provisional_times`; the first call after they are ready (or
``wait_for_graphs()``) times them.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers.utils import logging as hf_logging

from specfx.engine.background import provisional_times
from specfx.sampling.processors import Mode

__all__ = ["auto_k_times"]

logger = logging.getLogger(__name__)


def auto_k_times(gen, mode: Mode, collect: bool) -> dict[int, float] | None:
    """Round times of every candidate (K = 0 and ``auto_k_values``, or K = 0 and a tree) for ``gen``'s (a
    :class:`~specfx.api.SpeculativeGenerator`) current graph shape in ``mode``; None when the
    configuration gives them."""
    config = gen.spec_config
    if config.auto_k_times is not None or config.auto_k_cost is not None:
        return None
    key = (*gen.state_slots.shape, mode, collect)
    rounds = {}
    if key not in gen.round_timer.times_by_shape:
        shapes = {k: gen.round_shape(k, mode, collect) for k in gen.plan.shapes}  # 0, then auto_k_values
        cache = gen.graph_cache
        if cache.background is not None:
            if not all(cache.ready(gen.graph_key("round", *s.graph_id)) for s in shapes.values()):
                for shape in reversed(shapes.values()):  # queued so that K = 0 compiles first
                    gen._variant("round", shape)
                widths = {k: s.scratch_slots for k, s in shapes.items()}
                return provisional_times(gen.round_timer.times_by_shape, key, widths)
        gen.state.finished.fill_(True)
        gen.state.lengths.copy_(gen.state.prompt_lengths)  # this call's rows (each >= 1), as prefill leaves them
        fns = {k: gen._variant("round", shape, now=True) for k, shape in shapes.items()}
        new = [k for k in shapes if getattr(fns[k], "uncompiled", False)]
        if config.compile and new:  # a wait of minutes on a CPU: say what it is, with progress
            logger.info("specfx: 'auto' compiles and times a round graph per K in %s (once per shape)", tuple(shapes))
            for k in hf_logging.tqdm(new, desc="specfx: compiling the round graph of each K ('auto')", unit="graph"):
                fns[k](shapes[k])
        rounds = {k: functools.partial(fns[k], shapes[k]) for k in shapes}
    sync = functools.partial(torch.cuda.synchronize, gen.device) if gen.device.type == "cuda" else None
    return gen.round_timer.times(key, rounds, sync)
