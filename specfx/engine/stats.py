"""Acceptance statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpecStats"]


@dataclass
class SpecStats:
    """What speculation achieved.

    ``spec.stats`` holds the last generate() call; ``spec.cumulative_stats`` every call since
    :func:`specfx.speculate`. Counts cover rows that were still generating at a round's start.

    Attributes:
        rounds: rounds run (a round is counted once however many rows it served).
        proposed: proposals verified (K per active row per round).
        accepted: proposals the verification kept. Counted before truncation at EOS or the length
            limit, so it measures the drafter.
        emitted: tokens committed by rounds (accepted + correction/bonus, after truncation);
            the first token, sampled by prefill, is not included.
        row_rounds: rounds counted once per row that was active in them.
        per_position: ``per_position[i]`` = how often proposal i (0-based) was accepted; with a
            token tree, how often a node at depth i + 1 was (also :attr:`per_depth`).
        per_row_accepted / per_row_proposed: the same counts per batch row (last call only).
    """

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    row_rounds: int = 0
    per_position: list[int] = field(default_factory=list)
    per_row_accepted: list[int] = field(default_factory=list)
    per_row_proposed: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / proposed."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """τ = emitted tokens per row-round (mean accepted length + 1)."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        """Acceptance rate of proposal i given rounds (row-rounds) — a decreasing curve. With
        ``num_speculative_tokens="auto"`` rounds with a K <= i count as misses for position i."""
        return [a / self.row_rounds if self.row_rounds else 0.0 for a in self.per_position]

    @property
    def per_depth(self) -> list[int]:
        """``per_depth[i]``: rounds (per row) whose accepted path reached depth i + 1 (a chain's
        depth i + 1 is its proposal i)."""
        return self.per_position

    def merge(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.row_rounds += other.row_rounds
        if len(self.per_position) < len(other.per_position):
            self.per_position += [0] * (len(other.per_position) - len(self.per_position))
        for i, a in enumerate(other.per_position):
            self.per_position[i] += a

    def __repr__(self) -> str:
        return (
            f"SpecStats(rounds={self.rounds}, proposed={self.proposed}, accepted={self.accepted}, "
            f"emitted={self.emitted}, acceptance_rate={self.acceptance_rate:.3f}, "
            f"tokens_per_round={self.tokens_per_round:.3f}, per_position={self.per_position})"
        )
