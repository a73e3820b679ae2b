"""The pass pipeline: one entry, :func:`run_passes`, running named stages in order, with a lint
(and, for specfx's own round graphs, the round-invariant check) after each.

Every graph specfx rewrites goes through it: the backends' round, prefill and user graphs
(:mod:`specfx.passes.backend`) and the captures of the target's forward (the hidden taps,
:mod:`specfx.model.taps`; the early-exit cut, :mod:`specfx.drafters.early_exit`), the latter
through :func:`capture_transform`. See ``specfx/passes/README.md`` for the invariants.

Two kinds of passes, kept apart because a user's graph is not a round:

- :data:`ROUND_CHECKS` verify the invariants of a round (no host sync, static KV). They raise
  on graphs that break them, which is right for specfx's own round/prefill graphs and wrong
  for arbitrary user code (``x.cpu() + 1`` is a fine function, not a broken round).
- :data:`REWRITES` are semantics-preserving on any graph: they read node shapes before they
  rewrite and skip what they cannot prove.

The default stages (:func:`default_stages`), in order: the round checks (with ``round_checks``),
``prune_logits``, ``gqa_sdpa``, the optional ``live_kv`` and ``skinny_linear`` stages (the latter
for specfx's own graphs only: a CPU kernel choice), ``remove_dead_code``. ``live_kv``
(cut attention to the first ``live`` KV slots, :class:`~.rewrites.live_kv.LiveKV`) depends on a
runtime fact the graph cannot show, so it runs only when the caller, who knows every position
stays below ``live``, gives ``live=``; it comes after ``gqa_sdpa``, which must see transformers'
``repeat_kv`` copies feeding SDPA as they are, not sliced (the cut then applies to the KV buffers
themselves), and before dead-code removal, since the cut leaves the full-length views it replaced
dead.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import fx

from specfx.passes.checks.no_host_sync import check_no_host_sync
from specfx.passes.checks.static_kv import check_static_kv
from specfx.passes.rewrites.dead_code import remove_dead_code
from specfx.passes.rewrites.gqa_sdpa import gqa_sdpa
from specfx.passes.rewrites.live_kv import LiveKV
from specfx.passes.rewrites.prune_logits import prune_logits
from specfx.passes.rewrites.skinny_linear import skinny_linear

__all__ = [
    "PIPELINE",
    "REWRITES",
    "ROUND_CHECKS",
    "PassError",
    "PassReport",
    "Stage",
    "capture_transform",
    "default_stages",
    "run_passes",
]

logger = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule], int]  # rewrites or checks the graph in place; returns its sites

ROUND_CHECKS: tuple[Pass, ...] = (check_no_host_sync, check_static_kv)
_BEFORE_LIVE_KV: tuple[Pass, ...] = (prune_logits, gqa_sdpa)
_AFTER_LIVE_KV: tuple[Pass, ...] = (remove_dead_code,)  # last: cleans up after every rewrite
REWRITES: tuple[Pass, ...] = _BEFORE_LIVE_KV + _AFTER_LIVE_KV
# Order matters: verify what was captured, then rewrite, then clean up.
PIPELINE: tuple[Pass, ...] = ROUND_CHECKS + REWRITES


class PassError(RuntimeError):
    """A pass failed or broke an invariant; the message names it and the passes before it."""


@dataclass(frozen=True)
class Stage:
    """One pass under the name the report and errors give it. ``raises``: error types of the
    pass that propagate as they are, for a caller that reports them in its own words (the
    early-exit drafter turns :class:`~.rewrites.early_exit.EarlyExitError` into a refusal);
    every other error becomes a :class:`PassError` naming the stage and those before it."""

    name: str
    run: Pass
    raises: tuple[type[BaseException], ...] = ()

    @classmethod
    def of(cls, p: Pass | Stage) -> Stage:
        """``p`` as a stage: a stage as is, a plain pass under its ``__name__``."""
        return p if isinstance(p, Stage) else cls(p.__name__, p)


@dataclass
class PassReport:
    """Sites each pass reported (changed, or verified for check passes), in order."""

    sites: list[tuple[str, int]] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    def __str__(self) -> str:
        return ", ".join(f"{name}={n}" for name, n in self.sites)


def default_stages(*, round_checks: bool = True, live: LiveKV | None = None, own_graph: bool = False) -> list[Stage]:
    """specfx's pipeline: :data:`ROUND_CHECKS` (with ``round_checks``), then :data:`REWRITES`
    with the ``live_kv`` stage before dead-code removal when ``live`` is given, and
    ``skinny_linear`` after it for specfx's own graphs (``own_graph``: a kernel choice measured
    on its rounds, not applied to user code)."""
    optional = ((live,) if live is not None else ()) + ((skinny_linear,) if own_graph else ())
    checks = ROUND_CHECKS if round_checks else ()
    return [Stage.of(p) for p in (*checks, *_BEFORE_LIVE_KV, *optional, *_AFTER_LIVE_KV)]


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[Pass | Stage] | None = None,
    *,
    round_checks: bool = True,
    live: LiveKV | None = None,
    own_graph: bool = False,
) -> PassReport:
    """Run ``passes`` (plain passes or :class:`Stage` s) in order, default
    :func:`default_stages` (``round_checks``, ``live`` and ``own_graph`` pick its optional stages), linting
    the graph after each and, with ``round_checks``, re-checking that no pass introduced a host
    sync. Raises :class:`PassError` naming the failing stage (but see :attr:`Stage.raises`)."""
    if passes is None:
        stages = default_stages(round_checks=round_checks, live=live, own_graph=own_graph)
    elif live is not None:
        raise ValueError("run_passes: give live= only with the default pipeline (passes=None)")
    elif own_graph:
        raise ValueError("run_passes: give own_graph= only with the default pipeline (passes=None)")
    else:
        stages = [Stage.of(p) for p in passes]
    report = PassReport(nodes_before=len(gm.graph.nodes))
    for stage in stages:
        try:
            n = stage.run(gm)
            gm.graph.lint()
            if round_checks:
                check_no_host_sync(gm)
        except stage.raises:
            raise
        except Exception as e:
            before = [s for s, _ in report.sites] or ["(none)"]
            raise PassError(f"specfx pass {stage.name!r} failed after passes {before}: {e}") from e
        report.sites.append((stage.name, n))
        logger.debug("pass %s: %d site(s)", stage.name, n)
    gm.recompile()
    report.nodes_after = len(gm.graph.nodes)
    return report


def capture_transform(
    name: str, pass_: Callable[..., int], *, raises: tuple[type[BaseException], ...] = (), **options
) -> Pass:
    """A transform for :func:`specfx.model.capture.capture_forward`: ``pass_(gm, **options)``
    run as the one stage ``name`` of :func:`run_passes`, without round checks (a captured forward
    is not a round), returning the pass's count. ``raises``: see :attr:`Stage.raises`."""
    stage = Stage(name, functools.partial(pass_, **options), raises)

    def transform(gm: fx.GraphModule) -> int:
        return run_passes(gm, [stage], round_checks=False).sites[0][1]

    return transform
