"""The pass pipeline: one explicit, ordered list, with lint and invariant checks after each pass."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import fx

from .dead_code import remove_dead_code
from .no_host_sync import check_no_host_sync
from .prune_logits import prune_logits
from .static_kv import check_static_kv

__all__ = ["PIPELINE", "PassError", "PassReport", "run_passes"]

logger = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule], int]

# Order matters: verify what was captured, then rewrite, then clean up. The invariant
# check (no host sync) runs again after every pass.
PIPELINE: tuple[Pass, ...] = (
    check_no_host_sync,
    check_static_kv,
    prune_logits,
    remove_dead_code,
)


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


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass] = PIPELINE) -> PassReport:
    report = PassReport(nodes_before=len(gm.graph.nodes))
    for p in passes:
        name = p.__name__
        try:
            n = p(gm)
            gm.graph.lint()
            check_no_host_sync(gm)
        except Exception as e:
            before = [s for s, _ in report.sites] or ["(none)"]
            raise PassError(f"specfx pass {name!r} failed after passes {before}: {e}") from e
        report.sites.append((name, n))
        logger.debug("pass %s: %d site(s)", name, n)
    gm.recompile()
    report.nodes_after = len(gm.graph.nodes)
    return report
