"""``num_speculative_tokens="auto"``: choose K per round without recompiling.

Each K in ``SpecConfig.auto_k_values`` has its own compiled round graph (compiled the first
time the policy picks it, never again), so switching K between rounds costs nothing. The host
chooses K only at the points where it already synchronises (every ``rounds_per_sync`` rounds,
to check the finished flags); the counters it needs are read in that same transfer.

Policy. Model each proposal as accepted independently with probability α (given the ones
before it were). From the device counters, every row-round contributes ``accepted``
successes and ``accepted + 1`` trials, minus one trial when all K were accepted (no rejection
was observed). The estimate α̂ = successes / trials is a running ratio in which older windows
decay by ``DECAY`` per sync. Before each window K is set to

    argmax_K  E[emitted | α̂, K] / (1 + c·K),   E[emitted] = (1 - α̂^(K+1)) / (1 - α̂)

(the speed-up formula of Leviathan et al. 2023), where c is the cost of one more proposal
relative to the round's fixed cost (``SpecConfig.auto_k_cost``, default the drafter's
``proposal_cost``). Every call starts from the same prior, and K depends only on acceptance
counts, never on timings: seeded sampling reproduces exactly, and greedy output equals plain
greedy whatever K is chosen.
"""

from __future__ import annotations

__all__ = ["AutoK", "expected_emitted"]

DECAY = 0.8  # weight of the previous estimate per sync window
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # α̂ = 0.5 before anything is measured


def expected_emitted(alpha: float, k: int) -> float:
    """Mean tokens a round emits with K proposals when each is accepted with probability α."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class AutoK:
    """Host-side K controller for one generate() call (see the module docstring)."""

    def __init__(self, k_values: tuple[int, ...], cost: float):
        self.k_values = k_values
        self.cost = cost
        self.reset()

    def reset(self) -> None:
        """Start a generate() call from the prior (the device counters are zero after prefill)."""
        self.successes, self.trials = PRIOR_ACCEPTED, PRIOR_TRIALS
        self._last = (0, 0, 0)  # (accepted, row_rounds, full) counters at the previous read
        self.k = self.choose()
        self.history: list[int] = []  # K of each sync window launched, for inspection and tests

    @property
    def alpha(self) -> float:
        """The current estimate α̂."""
        return self.successes / self.trials

    def choose(self) -> int:
        alpha = self.alpha
        return max(self.k_values, key=lambda k: expected_emitted(alpha, k) / (1.0 + self.cost * k))

    def update(self, accepted: int, row_rounds: int, per_position: list[int]) -> int:
        """Feed the cumulative device counters read at a sync; returns K for the next window."""
        full = per_position[self.k - 1]  # rows that accepted all K (the window ran with self.k)
        d_acc, d_rr, d_full = accepted - self._last[0], row_rounds - self._last[1], full - self._last[2]
        if d_rr > 0:
            self.successes = DECAY * self.successes + d_acc
            self.trials = DECAY * self.trials + d_acc + d_rr - d_full
        self.k = self.choose()
        # per_position[k - 1] of the new K is the baseline for the next window's "full" count
        self._last = (accepted, row_rounds, per_position[self.k - 1])
        return self.k
