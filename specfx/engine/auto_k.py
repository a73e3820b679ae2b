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
(each compiled first; in turns, the fastest of 6 after one turn of warm-up, each timed call
right after an untimed one of the same K) on the allocated state
with every row finished (the rounds are inert; prefill then resets everything they touched).
``SpecConfig.auto_k_times`` replaces the measurement with given times, interpolated linearly
for Ks it does not list (:meth:`AutoK.round_time`); ``SpecConfig.auto_k_cost = c`` replaces it
with the model ``t(K) = 1 + c·K``.

Policy. Before each window K is set to

    argmax_K  E[emitted | α̂, K] / t(K),   E[emitted] = (1 - α̂^(K+1)) / (1 - α̂),  E = 1 at K = 0

(the speed-up formula of Leviathan et al. 2023). K = 0 is chosen at once when no K could pay
even if every proposal were accepted ((K + 1) / t(K) <= 1 / t(0): speculation cannot beat
plain decoding on this machine at this batch size); otherwise only after ``MIN_EVIDENCE``
row-rounds of measured acceptance, so one unlucky round never turns speculation off, or sooner
when the rounds cost so much that only a high α pays (a hybrid target's verify forward and state
rollback, decision 83): K = 0 as soon as the call's undecayed counts, under a uniform prior, leave
less than ``STOP_RISK`` chance that α reaches the break-even α of the best K. Once K = 0
is chosen it stays for the rest of the call when the drafter keeps state (a draft model's KV
cache, a head's features): it has not seen the tokens decoded without it. A drafter whose
proposals depend only on the row's committed tokens (``Drafter.resumable``: prompt lookup) is
*probed* instead: after ``HOLD`` windows of K = 0, one window runs at the smallest K; its
acceptance alone (with the prior) chooses again among all candidates, K = 0 included, and each
probe that finds nothing doubles the wait (up to ``MAX_HOLD`` windows). A probe costs one round
at the smallest K instead of K = 0, so the probes cost at most ``t(k_min)/t(0) - 1`` over
``HOLD`` rounds, and text that starts to repeat (a copy, an edit) gets speculation back. When
no K could pay even at α = 1, nothing is probed. The next call starts again from the prior.

A tree round (decision 68). With a token tree (``tree=``, or a drafter's own: lookahead) and
``num_speculative_tokens`` left unset, the candidates are K = 0 and the tree (:class:`TreeAuto`;
key None, as in ``Plan.shapes``, so ``history`` holds 0 or None per window). A tree has no single
α (siblings, per-row tries), but the policy needs only E[emitted] of one shape, and that is what
the counters measure: the decayed mean of ``accepted + 1`` per row-round, τ̂, from the prior of a
chain as deep as the tree (2 row-rounds at α = 0.5's E[emitted]). The tree is chosen while
τ̂ / t(tree) > 1 / t(0); K = 0 at once when even a path accepted to the full depth could not pay
((depth + 1) / t(tree) <= 1 / t(0)). A drafter with state explores first (K = 0 only after
``MIN_EVIDENCE`` row-rounds, then for the rest of the call). A resumable one (lookahead, prompt
lookup) chooses its first window on the prior among the tree and K = 0: where the prior says the
tree does not pay the call starts plainly, and K = 0 is probed with one tree window after ``HOLD``
windows, as after any fall back (decision 68 measures why).
``t(tree)`` is measured like any K; given times or ``auto_k_cost`` without a measured tree time
price it as a chain verifying as many tokens as the tree's forward adds (its scratch slots).

Reproducibility: K depends on the acceptance counts and on the times; the counts are exact
functions of the seed, so seeded sampling reproduces exactly given the same times. The times
of a generator are ``spec.auto_k.times`` after its first call; pass them as
``SpecConfig(auto_k_times=...)`` (or set ``auto_k_cost``) to reproduce a seeded run in another
process or on another machine. Greedy output equals plain greedy whatever K is chosen.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

from specfx.engine.timing import call_times

__all__ = ["TREE", "AutoK", "RoundTimer", "TreeAuto", "auto_policy", "expected_emitted"]

logger = logging.getLogger(__name__)

DECAY = 0.8  # weight of the previous estimate per sync window
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # α̂ = 0.5 before anything is measured
MIN_EVIDENCE = 8  # row-rounds of measured acceptance before K = 0 may be chosen on it
STOP_RISK = 0.01  # ... or sooner, once the chance that any K pays falls below this (decision 83)
HOLD, MAX_HOLD = 8, 64  # resumable drafters: K = 0 windows before a probe (doubling per failed probe)
TREE = None  # a tree round's key among the candidates, in the times and in history (as in Plan.shapes)


def expected_emitted(alpha: float, k: int) -> float:
    """Mean tokens a round emits with K proposals when each is accepted with probability α."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def interpolate(times: Mapping[int, float], k: int) -> float:
    """Piecewise-linear ``t(k)`` through the measured points of chains (constant beyond the
    ends; a tree's time, key None, is not a point of it)."""
    ks = sorted(x for x in times if x is not TREE)
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
    (probes after speculation is turned off; see the module docstring).

    The estimate is a ratio ``successes / trials`` of decayed counts; :meth:`expected` turns it
    into E[emitted] of a candidate and :meth:`best` says what a candidate emits at most. Chains:
    accepted proposals over trials (α̂); :class:`TreeAuto` keeps emitted tokens over row-rounds."""

    def __init__(
        self,
        k_values: tuple,
        cost: float | None = None,
        times: Mapping | None = None,
        *,
        resumable: bool = False,
    ):
        self.k_values = k_values
        self.candidates = (0, *k_values)
        self.cost = cost
        self.times = dict(times) if times else None
        self.resumable = resumable
        self.stop_risk = STOP_RISK  # 0: never stop before MIN_EVIDENCE (benchmarks compare the two)
        self.reset()

    def reset(self, times: Mapping | None = None) -> None:
        """Start a generate() call from the prior (the device counters are zero after prefill);
        ``times``: the round times of this call's graph shape, when measured."""
        if times is not None:
            self.times = dict(times)
        self.successes, self.trials = self.prior()
        self.evidence = 0  # row-rounds measured this call
        self.counted = self.prior()  # (successes, trials) of this call, not decayed: the early stop's evidence
        self.off = False  # K = 0 chosen: speculation is off (for the call, unless resumable)
        self.unpaid = False  # no K could pay even at α = 1: off for the call, never probed
        self.hold, self.held = HOLD, 0  # resumable: K = 0 windows before the next probe, and so far
        self.probing = False  # the window just launched is a probe
        self._last = (0, 0, 0)  # (accepted, row_rounds, full) counters at the previous read
        self.k = self.choose()
        self.history: list = []  # K of each sync window launched (None: a tree), for inspection and tests

    # --------------------------------------------------------------- what a chain of K emits
    @property
    def alpha(self) -> float | None:
        """The current estimate α̂."""
        return self.successes / self.trials

    def prior(self) -> tuple[float, float]:
        """``(successes, trials)`` before anything is measured (α̂ = 0.5)."""
        return PRIOR_ACCEPTED, PRIOR_TRIALS

    def best(self, k) -> float:
        """Tokens a round of ``k`` emits when every proposal is accepted."""
        return k + 1.0

    def expected(self, k) -> float:
        """E[emitted] of a round of ``k`` under the current estimate (1 at K = 0)."""
        return expected_emitted(self.alpha, k)

    def window(self, d_acc: int, d_rr: int, d_full: int) -> tuple[float, float]:
        """One window's ``(successes, trials)`` from its counters: accepted proposals, row-rounds
        and rows that accepted all K (each row-round is a trial more than it accepted, unless
        it accepted all K: no rejection was observed)."""
        return d_acc, d_acc + d_rr - d_full

    def full(self, per_position: list[int]) -> int:
        """Rows so far that accepted all of the current K (the per-position counter at K)."""
        return per_position[self.k - 1] if self.k else 0

    def before_evidence(self) -> tuple:
        """The candidates before ``MIN_EVIDENCE`` row-rounds are measured: a chain explores
        (K = 0 is never chosen on the prior alone), unless :meth:`hopeless`."""
        return self.candidates if self.hopeless() else self.k_values

    def break_even(self) -> float | None:
        """The smallest α at which some K pays (``E[emitted | α, K] / t(K) > 1 / t(0)``), None if
        none can. Expensive rounds (a hybrid's verify forward and state rollback) raise it."""
        t0, lowest = self.round_time(0), None
        for k in self.k_values:
            need = self.round_time(k) / t0  # E[emitted] must exceed this; it rises with α to K + 1
            if need >= self.best(k):
                continue
            lo, hi = 0.0, 1.0
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if expected_emitted(mid, k) > need else (mid, hi)
            lowest = hi if lowest is None else min(lowest, hi)
        return lowest

    def hopeless(self) -> bool:
        """Whether this call's evidence (its undecayed counts, with the prior: a uniform Beta over
        α) leaves less than ``STOP_RISK`` chance that α reaches :meth:`break_even`: then K = 0 need
        not wait for ``MIN_EVIDENCE`` row-rounds. Where rounds are cheap (break-even α low) this
        takes more than ``MIN_EVIDENCE`` rejections and changes nothing; where a round costs
        several plain ones, two or three rejected rounds say enough (decision 83)."""
        alpha = self.break_even()
        if alpha is None or self.evidence == 0:
            return False
        successes, trials = (round(x) for x in self.counted)
        # P(α > x) for α ~ Beta(a, b) with integer a, b: P(Binomial(a + b - 1, x) <= a - 1)
        n = trials - 1
        chance = sum(math.comb(n, j) * alpha**j * (1 - alpha) ** (n - j) for j in range(successes))
        return chance < self.stop_risk

    # --------------------------------------------------------------- the policy
    def round_time(self, k) -> float:
        """t(K): measured (interpolated), or the constant model ``1 + cost·K``."""
        if self.times:
            return interpolate(self.times, k)
        return 1.0 + (self.cost or 0.0) * k

    def choose(self, pool: tuple | None = None):
        if self.off:
            return 0
        t0 = self.round_time(0)
        if all(self.best(k) / self.round_time(k) <= 1.0 / t0 for k in self.k_values):
            self.off = self.unpaid = True  # even α = 1 would not pay
            return 0
        if pool is None:
            pool = self.candidates if self.evidence >= MIN_EVIDENCE else self.before_evidence()
        k = max(pool, key=lambda k: self.expected(k) / self.round_time(k))
        self.off = k == 0
        return k

    def update(self, accepted: int, row_rounds: int, per_position: list[int]):
        """Feed the cumulative device counters read at a sync; returns K for the next window."""
        if row_rounds == self._last[1]:  # no round ran since the last read (the read after prefill)
            return self.k
        if self.off:
            if not self.resumable or self.unpaid:
                return 0
            self.held += 1
            if self.held < self.hold:
                return 0
            # probe: one window at the smallest K, from counters read now
            self.held, self.probing, self.off = 0, True, False
            self.k = self.k_values[0]
            self._last = (accepted, row_rounds, self.full(per_position))
            return self.k
        full = self.full(per_position)  # (the window ran with self.k)
        d_acc, d_rr, d_full = accepted - self._last[0], row_rounds - self._last[1], full - self._last[2]
        successes, trials = self.window(d_acc, d_rr, d_full)
        if self.probing:  # the probe's acceptance alone, with the prior, chooses among every K
            self.probing = False
            prior = self.prior()
            self.successes, self.trials = prior[0] + successes, prior[1] + trials
            self.k = self.choose(self.candidates)
            if self.off:
                self.hold = min(2 * self.hold, MAX_HOLD)
        else:
            if d_rr > 0:
                self.successes = DECAY * self.successes + successes
                self.trials = DECAY * self.trials + trials
                self.evidence += d_rr
                self.counted = (self.counted[0] + successes, self.counted[1] + trials)
            self.k = self.choose()
        # the new K's per-position counter is the baseline for the next window's "full" count
        self._last = (accepted, row_rounds, self.full(per_position))
        return self.k


class TreeAuto(AutoK):
    """The "auto" policy for a token-tree round (see the module docstring): each window runs the tree
    (key :data:`TREE`) or K = 0. ``depth``: the tree's depth D (at most D + 1 tokens per round);
    ``width``: the tokens its forward adds past the pending one (its scratch slots), the K of the
    chain that prices it when no tree time is given or measured. The estimate is τ̂, the decayed
    mean of emitted tokens (``accepted + 1``) per row-round. ``cost``, ``times`` and ``resumable``
    (keyword) as :class:`AutoK`'s."""

    def __init__(self, depth: int, width: int, cost: float | None = None, times: Mapping | None = None, **kw):
        self.depth, self.width = depth, width
        super().__init__((TREE,), cost, times, **kw)

    @property
    def alpha(self) -> None:
        """Not defined for a tree (see :attr:`tau`)."""
        return None

    @property
    def tau(self) -> float:
        """The current estimate τ̂: tokens a tree round emits per row."""
        return self.successes / self.trials

    def prior(self) -> tuple[float, float]:
        """Two row-rounds at what a chain as deep as the tree emits at α = 0.5."""
        return PRIOR_TRIALS * expected_emitted(0.5, self.depth), PRIOR_TRIALS

    def best(self, k) -> float:
        return 1.0 if k == 0 else self.depth + 1.0

    def expected(self, k) -> float:
        return 1.0 if k == 0 else self.tau

    def window(self, d_acc: int, d_rr: int, d_full: int) -> tuple[float, float]:
        return d_acc + d_rr, d_rr  # emitted (before EOS/length cuts), row-rounds

    def full(self, per_position: list[int]) -> int:
        return 0  # unused: τ̂ needs no per-position count

    def before_evidence(self) -> tuple:
        """A resumable drafter's first window is chosen on the prior among the tree and K = 0:
        where the prior says the tree does not pay (a CPU, where a tree round costs about two
        plain ones) the call starts plainly and probes the tree after HOLD windows, instead of
        paying MIN_EVIDENCE tree rounds every call to learn it again. Once the tree runs it
        keeps running until MIN_EVIDENCE row-rounds say otherwise. A drafter with state always
        explores first: K = 0 would end its rounds for the call."""
        return self.candidates if self.resumable and self.evidence == 0 else self.k_values

    def round_time(self, k) -> float:
        """t(0), t(tree): measured (or given under key None); otherwise the chain of ``width``."""
        if k == 0:
            return super().round_time(0)
        if self.times and TREE in self.times:
            return float(self.times[TREE])
        return super().round_time(self.width)


def auto_policy(plan, resumable: bool) -> AutoK | None:
    """The "auto" policy of a :class:`~specfx.engine.plan.Plan` (None when its rounds are
    fixed): a chain's K among 0 and ``auto_k_values``, or a tree against K = 0.
    ``resumable``: the drafter's ``Drafter.resumable``."""
    if not plan.auto:
        return None
    config = plan.config
    if TREE in plan.shapes:
        tree = plan.shape(TREE)
        depth, width = tree.max_accepted, tree.scratch_slots
        return TreeAuto(depth, width, config.auto_k_cost, config.auto_k_times, resumable=resumable)
    return AutoK(config.k_values, config.auto_k_cost, config.auto_k_times, resumable=resumable)


class RoundTimer:
    """The measured round times of "auto": one ``{K: seconds}`` per graph shape (K None: a
    tree round), in :attr:`times_by_shape` (a dict a test may read or overwrite: ``(batch
    bucket, capacity, mode, collect) -> {K: s}``). A call that only raises the live-KV bound
    (decision 45) reuses its shape's timing, and compiles only the Ks it then chooses.

    ``settle``: untimed calls of a K just before each of its timed ones (decision 88). A window
    of a call runs one K round after round; a round timed right after another K's measures
    that K's leftovers too (on a CPU, caches filled by the other graph's tensors): a tiny
    Mamba2 hybrid's plain round timed at 1.05 ms after a K = 8 round, 0.45–0.6 ms after its own."""

    def __init__(self, warmup: int = 1, repeats: int = 6, settle: int = 1):
        self.warmup, self.repeats, self.settle = warmup, repeats, settle
        self.times_by_shape: dict[tuple, dict[int | None, float]] = {}

    def times(self, shape_key: tuple, rounds: Mapping[int | None, Callable[[], object]], sync=None) -> dict:
        """Round times of every candidate K (``rounds``: K -> one round's call, compiled
        already) for ``shape_key``: remembered, or timed now. The Ks take turns, ``warmup``
        turns untimed and ``repeats`` timed, and each K keeps its fastest time: load from other
        processes only ever adds time, and taking turns spreads its drift over every K alike.
        In each turn a K runs ``settle`` untimed rounds before its timed one, as in a window of
        rounds of that K. ``sync`` (CUDA: synchronize) runs inside each timing."""
        times = self.times_by_shape.get(shape_key)
        if times is not None:
            return times
        times = {k: float("inf") for k in rounds}
        for i in range(self.warmup + self.repeats):
            for k, one_round in rounds.items():
                (seconds,) = call_times(one_round, 1, warmup=self.settle, sync=sync)
                if i >= self.warmup:
                    times[k] = min(times[k], seconds)
        self.times_by_shape[shape_key] = times
        logger.info("specfx: auto K round times for %s: %s", shape_key, times)
        return times
