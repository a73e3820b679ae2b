"""FX graph passes, one per file, run as named stages by :func:`run_passes`, the one entry
(README.md beside this file: the pipeline's invariants and how to add a pass).

Not in the default :data:`PIPELINE` (applied to specfx's own captures of the target's forward,
through :func:`capture_transform`): :func:`early_exit` (cut after decoder layer N;
:class:`specfx.EarlyExit`) and :func:`hidden_taps` (also return chosen hidden states; the
runner's ``forward(..., taps=...)``); and the optional ``live_kv`` stage (attention over the first
``live`` KV slots; run on specfx's round and prefill graphs with
``run_passes(..., live=LiveKV(capacity, live))``).
"""

from specfx.passes.backend import GraphRecord, make_backend, specfx_backend, specfx_eager_backend
from specfx.passes.checks.no_host_sync import HostSyncError, check_no_host_sync
from specfx.passes.checks.static_kv import StaticKVError, check_static_kv
from specfx.passes.pipeline import (
    PIPELINE,
    REWRITES,
    ROUND_CHECKS,
    PassError,
    PassReport,
    Stage,
    capture_transform,
    default_stages,
    run_passes,
)
from specfx.passes.rewrites.dead_code import remove_dead_code
from specfx.passes.rewrites.early_exit import EarlyExitError, early_exit
from specfx.passes.rewrites.gqa_sdpa import gqa_sdpa
from specfx.passes.rewrites.hidden_taps import HiddenTapsError, check_tap_names, hidden_taps
from specfx.passes.rewrites.live_kv import LiveKV, live_kv
from specfx.passes.rewrites.prune_logits import prune_logits
from specfx.passes.rewrites.skinny_linear import skinny_linear

__all__ = [
    "PIPELINE",
    "EarlyExitError",
    "GraphRecord",
    "HiddenTapsError",
    "HostSyncError",
    "LiveKV",
    "PassError",
    "PassReport",
    "REWRITES",
    "ROUND_CHECKS",
    "Stage",
    "StaticKVError",
    "check_no_host_sync",
    "check_static_kv",
    "capture_transform",
    "check_tap_names",
    "default_stages",
    "early_exit",
    "gqa_sdpa",
    "hidden_taps",
    "live_kv",
    "make_backend",
    "prune_logits",
    "remove_dead_code",
    "run_passes",
    "skinny_linear",
    "specfx_backend",
    "specfx_eager_backend",
]
