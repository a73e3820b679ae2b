"""FX graph passes, one per file, run in order by :func:`run_passes`.

Not in the default :data:`PIPELINE` (applied to specfx's own captures of the target's forward):
:func:`early_exit` (cut after decoder layer N; :class:`specfx.EarlyExit`) and
:func:`hidden_taps` (also return chosen hidden states; the runner's ``forward(..., taps=...)``),
and :func:`live_kv` (attention over the first ``live`` KV slots; run on specfx's round and
prefill graphs with ``run_passes(..., live=LiveKV(capacity, live))``).
"""

from specfx.passes.backend import GraphRecord, make_backend, specfx_backend, specfx_eager_backend
from specfx.passes.rewrites.dead_code import remove_dead_code
from specfx.passes.pipeline import PIPELINE, REWRITES, ROUND_CHECKS, PassError, PassReport, run_passes
from specfx.passes.rewrites.early_exit import EarlyExitError, early_exit
from specfx.passes.rewrites.gqa_sdpa import gqa_sdpa
from specfx.passes.rewrites.hidden_taps import HiddenTapsError, check_tap_names, hidden_taps
from specfx.passes.rewrites.live_kv import LiveKV, live_kv
from specfx.passes.checks.no_host_sync import HostSyncError, check_no_host_sync
from specfx.passes.rewrites.prune_logits import prune_logits
from specfx.passes.checks.static_kv import StaticKVError, check_static_kv

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
    "StaticKVError",
    "check_no_host_sync",
    "check_static_kv",
    "check_tap_names",
    "early_exit",
    "gqa_sdpa",
    "hidden_taps",
    "live_kv",
    "make_backend",
    "prune_logits",
    "remove_dead_code",
    "run_passes",
    "specfx_backend",
    "specfx_eager_backend",
]
