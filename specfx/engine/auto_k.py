"""``num_speculative_tokens="auto"``: choose K per round, K = 0 (no speculation) included,
without recompiling.

Each candidate K (0 and ``SpecConfig.auto_k_values``) has its own compiled round graph,
compiled the first time it is needed and never again, so switching K between rounds costs
nothing. K = 0 is plain decoding through the same static cache: one token per row, the drafter
sits out. The host chooses K only at the points where it already synchronises (every
``rounds_per_sync`` rounds, to check the finished flags); the counters it needs are read in that
same transfer.

Acceptance. Model each proposal as accepted independently with probability α (given the ones
before it were). From the device counters, every row-round contributes ``accepted`` successes
and ``accepted + 1`` trials, minus one trial when all K were accepted (no rejection was
observed). The estimate α̂ = successes / trials is a running ratio in which older windows decay
by ``DECAY`` per sync; every call starts from the same prior (α̂ = 0.5).

Cost. ``t(K)``, the time of one round with K proposals, is measured: before the first call of
a graph shape (batch bucket, capacity, mode) the generator times every candidate's round
(each compiled first; in turn, the fastest of 7 after 2 warm-up calls) on the allocated state
with every row finished (the rounds are inert; prefill then resets everything they touched).
``SpecConfig.auto_k_times`` replaces the measurement with given times, interpolated linearly
for Ks it does not list (:meth:`AutoK.round_time`); ``SpecConfig.auto_k_cost = c`` replaces it
with the model ``t(K) = 1 + c·K``.

Policy. Before each window K is set to

    argmax_K  E[emitted | α̂, K] / t(K),   E[emitted] = (1 - α̂^(K+1)) / (1 - α̂),  E = 1 at K = 0

(the speed-up formula of Leviathan et al. 2023). K = 0 is chosen at once when no K could pay
even if every proposal were accepted ((K + 1) / t(K) <= 1 / t(0): speculation cannot beat
plain decoding on this machine at this batch size); otherwise only after ``MIN_EVIDENCE``
row-rounds of measured acceptance, so one unlucky round never turns speculation off. Once K = 0
is chosen it stays for the rest of the call when the drafter keeps state (a draft model's KV
cache, a head's features): it has not seen the tokens decoded without it. A drafter whose
proposals depend only on the row's committed tokens (``Drafter.resumable``: prompt lookup) is
*probed* instead: after ``HOLD`` windows of K = 0, one window runs at the smallest K; its
acceptance alone (with the prior) chooses again among all candidates, K = 0 included, and each
probe that finds nothing doubles the wait (up to ``MAX_HOLD`` windows). A probe costs one round
at the smallest K instead of K = 0, so the probes cost at most ``t(k_min)/t(0) - 1`` over
``HOLD`` rounds, and text that starts to repeat (a copy, an edit) gets speculation back. When
no K could pay even at α = 1, nothing is probed. The next call starts again from the prior.

Reproducibility: K depends on the acceptance counts and on the times; the counts are exact
functions of the seed, so seeded sampling reproduces exactly given the same times. The times
of a generator are ``spec.auto_k.times`` after its first call; pass them as
``SpecConfig(auto_k_times=...)`` (or set ``auto_k_cost``) to reproduce a seeded run in another
process or on another machine. Greedy output equals plain greedy whatever K is chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from specfx.engine.timing import call_times

__all__ = ["AutoK", "RoundTimer", "expected_emitted"]

logger = logging.getLogger(__name__)

DECAY = 0.8  # weight of the previous estimate per sync window
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # α̂ = 0.5 before anything is measured
MIN_EVIDENCE = 8  # row-rounds of measured acceptance before K = 0 may be chosen on it
HOLD, MAX_HOLD = 8, 64  # resumable drafters: K = 0 windows before a probe (doubling per failed probe)


def expected_emitted(alpha: float, k: int) -> float:
    """Mean tokens a round emits with K proposals when each is accepted with probability α."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def interpolate(times: Mapping[int, float], k: int) -> float:
    """Piecewise-linear ``t(k)`` through the measured points (constant beyond the ends)."""
    ks = sorted(times)
    if k <= ks[0]:
        return float(times[ks[0]])
    for lo, hi in zip(ks, ks[1:], strict=False):
        if k <= hi:
            return times[lo] + (times[hi] - times[lo]) * (k - lo) / (hi - lo)
    return float(times[ks[-1]])


class AutoK:
    """Host-side K controller of a generator (see the module docstring). ``cost``: the constant
    model ``t(K) = 1 + cost·K``; else ``times`` (given, or measured by the generator and set with
    :meth:`reset`). ``resumable``: the drafter may sit out K = 0 windows and propose again
    (probes after speculation is turned off; see the module docstring)."""

    def __init__(
        self,
        k_values: tuple[int, ...],
        cost: float | None = None,
        times: Mapping[int, float] | None = None,
        *,
        resumable: bool = False,
    ):
        self.k_values = k_values
        self.candidates = (0, *k_values)
        self.cost = cost
        self.times = dict(times) if times else None
        self.resumable = resumable
        self.reset()

    def reset(self, times: Mapping[int, float] | None = None) -> None:
        """Start a generate() call from the prior (the device counters are zero after prefill);
        ``times``: the round times of this call's graph shape, when measured."""
        if times is not None:
            self.times = dict(times)
        self.successes, self.trials = PRIOR_ACCEPTED, PRIOR_TRIALS
        self.evidence = 0  # row-rounds measured this call
        self.off = False  # K = 0 chosen: speculation is off (for the call, unless resumable)
        self.unpaid = False  # no K could pay even at α = 1: off for the call, never probed
        self.hold, self.held = HOLD, 0  # resumable: K = 0 windows before the next probe, and so far
        self.probing = False  # the window just launched is a probe
        self._last = (0, 0, 0)  # (accepted, row_rounds, full) counters at the previous read
        self.k = self.choose()
        self.history: list[int] = []  # K of each sync window launched, for inspection and tests

    @property
    def alpha(self) -> float:
        """The current estimate α̂."""
        return self.successes / self.trials

    def round_time(self, k: int) -> float:
        """t(K): measured (interpolated), or the constant model ``1 + cost·K``."""
        if self.times:
            return interpolate(self.times, k)
        return 1.0 + (self.cost or 0.0) * k

    def choose(self, pool: tuple[int, ...] | None = None) -> int:
        if self.off:
            return 0
        t0 = self.round_time(0)
        if all((k + 1) / self.round_time(k) <= 1.0 / t0 for k in self.k_values):
            self.off = self.unpaid = True  # even α = 1 would not pay
            return 0
        alpha = self.alpha
        if pool is None:
            pool = self.candidates if self.evidence >= MIN_EVIDENCE else self.k_values
        k = max(pool, key=lambda k: (expected_emitted(alpha, k) if k else 1.0) / self.round_time(k))
        self.off = k == 0
        return k

    def update(self, accepted: int, row_rounds: int, per_position: list[int]) -> int:
        """Feed the cumulative device counters read at a sync; returns K for the next window."""
        if self.off:
            if not self.resumable or self.unpaid:
                return 0
            self.held += 1
            if self.held < self.hold:
                return 0
            # probe: one window at the smallest K, from counters read now
            self.held, self.probing, self.off = 0, True, False
            self.k = self.k_values[0]
            self._last = (accepted, row_rounds, per_position[self.k - 1])
            return self.k
        full = per_position[self.k - 1]  # rows that accepted all K (the window ran with self.k)
        d_acc, d_rr, d_full = accepted - self._last[0], row_rounds - self._last[1], full - self._last[2]
        if self.probing:  # the probe's acceptance alone, with the prior, chooses among every K
            self.probing = False
            self.successes, self.trials = PRIOR_ACCEPTED + d_acc, PRIOR_TRIALS + d_acc + d_rr - d_full
            self.k = self.choose(self.candidates)
            if self.off:
                self.hold = min(2 * self.hold, MAX_HOLD)
        else:
            if d_rr > 0:
                self.successes = DECAY * self.successes + d_acc
                self.trials = DECAY * self.trials + d_acc + d_rr - d_full
                self.evidence += d_rr
            self.k = self.choose()
        # per_position[k - 1] of the new K is the baseline for the next window's "full" count
        self._last = (accepted, row_rounds, per_position[self.k - 1] if self.k else 0)
        return self.k


class RoundTimer:
    """The measured round times of "auto": one ``{K: seconds}`` per graph shape, in
    :attr:`times_by_shape` (a dict a test may read or overwrite: ``(batch bucket, capacity,
    mode, collect) -> {K: s}``). A call that only raises the live-KV bound (decision 45) reuses
    its shape's timing, and compiles only the Ks it then chooses."""

    def __init__(self, warmup: int = 2, repeats: int = 7):
        self.warmup, self.repeats = warmup, repeats
        self.times_by_shape: dict[tuple, dict[int, float]] = {}

    def times(self, shape_key: tuple, rounds: Mapping[int, Callable[[], object]], sync=None) -> dict[int, float]:
        """Round times of every candidate K (``rounds``: K -> one round's call, compiled
        already) for ``shape_key``: remembered, or timed now. The Ks are timed in turn,
        ``repeats`` times after ``warmup`` calls each, and each K keeps its fastest time: load
        from other processes only ever adds time, and taking turns spreads its drift over every
        K alike. ``sync`` (CUDA: synchronize) runs inside each timing."""
        times = self.times_by_shape.get(shape_key)
        if times is not None:
            return times
        times = {k: float("inf") for k in rounds}
        for i in range(self.warmup + self.repeats):
            for k, one_round in rounds.items():
                (seconds,) = call_times(one_round, 1, sync=sync)
                if i >= self.warmup:
                    times[k] = min(times[k], seconds)
        self.times_by_shape[shape_key] = times
        logger.info("specfx: auto K round times for %s: %s", shape_key, times)
        return times
