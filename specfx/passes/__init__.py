"""FX graph passes, one per file, run in order by :func:`run_passes`.

Not in the default :data:`PIPELINE`: :func:`early_exit` (cut a captured model forward after
decoder layer N; applied by :class:`specfx.EarlyExit` to its own capture of the target).
"""

from .backend import GraphRecord, make_backend, specfx_backend, specfx_eager_backend
from .dead_code import remove_dead_code
from .driver import PIPELINE, REWRITES, ROUND_CHECKS, PassError, PassReport, run_passes
from .early_exit import EarlyExitError, early_exit
from .no_host_sync import HostSyncError, check_no_host_sync
from .prune_logits import prune_logits
from .static_kv import StaticKVError, check_static_kv

__all__ = [
    "PIPELINE",
    "EarlyExitError",
    "GraphRecord",
    "HostSyncError",
    "PassError",
    "PassReport",
    "REWRITES",
    "ROUND_CHECKS",
    "StaticKVError",
    "check_no_host_sync",
    "check_static_kv",
    "early_exit",
    "make_backend",
    "prune_logits",
    "remove_dead_code",
    "run_passes",
    "specfx_backend",
    "specfx_eager_backend",
]
