"""The pass pipeline: one explicit, ordered list, with a lint (and, for specfx's own graphs,
the round-invariant check) after each pass.

Two kinds of passes, kept apart because a user's graph is not a round:

- :data:`ROUND_CHECKS` verify the invariants of a round (no host sync, static KV). They raise
  on graphs that break them, which is right for specfx's own round/prefill graphs and wrong
  for arbitrary user code (``x.cpu() + 1`` is a fine function, not a broken round).
- :data:`REWRITES` are semantics-preserving on any graph: they read node shapes before they
  rewrite and skip what they cannot prove.

One rewrite depends on a runtime fact the graph cannot show: :class:`~.live_kv.LiveKV` (cut
attention to the first ``live`` KV slots) is run only on specfx's own graphs, whose caller
knows every position stays below ``live``; ``run_passes(..., live=LiveKV(capacity, live))``
puts it after the other rewrites and before dead-code removal: ``gqa_sdpa`` must see
transformers' ``repeat_kv`` copies feeding SDPA as they are, not sliced (the cut then applies to
the KV buffers themselves), and the cut leaves the full-length views it replaced dead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import fx

from specfx.passes.rewrites.dead_code import remove_dead_code
from specfx.passes.rewrites.gqa_sdpa import gqa_sdpa
from specfx.passes.rewrites.live_kv import LiveKV
from specfx.passes.checks.no_host_sync import check_no_host_sync
from specfx.passes.rewrites.prune_logits import prune_logits
from specfx.passes.checks.static_kv import check_static_kv

__all__ = ["PIPELINE", "REWRITES", "ROUND_CHECKS", "PassError", "PassReport", "run_passes"]

logger = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule], int]

ROUND_CHECKS: tuple[Pass, ...] = (check_no_host_sync, check_static_kv)
# remove_dead_code stays last: run_passes inserts the live-KV cut right before it
REWRITES: tuple[Pass, ...] = (prune_logits, gqa_sdpa, remove_dead_code)
# Order matters: verify what was captured, then rewrite, then clean up.
PIPELINE: tuple[Pass, ...] = ROUND_CHECKS + REWRITES


class PassError(RuntimeError):
    """A pass failed or broke an invariant; the message names it and the passes before it."""


@dataclass
class PassReport:
    """Sites each pass reported (changed, or verified for check passes), in order."""

    sites: list[tuple[str, int]] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    def __str__(self) -> str:
        return ", ".join(f"{name}={n}" for name, n in self.sites)


def run_passes(
    gm: fx.GraphModule, passes: Sequence[Pass] | None = None, *, round_checks: bool = True, live: LiveKV | None = None
) -> PassReport:
    """Run ``passes`` in order (default: :data:`PIPELINE` with ``round_checks``, else
    :data:`REWRITES`; with ``live``, that pass right before dead-code removal), linting the graph
    after each and, with ``round_checks``, re-checking that no pass introduced a host sync.
    Raises :class:`PassError` naming the failing pass."""
    if passes is None:
        rewrites = REWRITES if live is None else (*REWRITES[:-1], live, REWRITES[-1])
        passes = (ROUND_CHECKS if round_checks else ()) + rewrites
    elif live is not None:
        raise ValueError("run_passes: give live= only with the default pipeline (passes=None)")
    report = PassReport(nodes_before=len(gm.graph.nodes))
    for p in passes:
        name = p.__name__
        try:
            n = p(gm)
            gm.graph.lint()
            if round_checks:
                check_no_host_sync(gm)
        except Exception as e:
            before = [s for s, _ in report.sites] or ["(none)"]
            raise PassError(f"specfx pass {name!r} failed after passes {before}: {e}") from e
        report.sites.append((name, n))
        logger.debug("pass %s: %d site(s)", name, n)
    gm.recompile()
    report.nodes_after = len(gm.graph.nodes)
    return report
