"""FX graph passes, one per file, run in order by :func:`run_passes`."""

from .backend import GraphRecord, make_backend, specfx_backend, specfx_eager_backend
from .dead_code import remove_dead_code
from .driver import PIPELINE, PassError, PassReport, run_passes
from .no_host_sync import HostSyncError, check_no_host_sync
from .prune_logits import prune_logits
from .static_kv import StaticKVError, check_static_kv

__all__ = [
    "PIPELINE",
    "GraphRecord",
    "HostSyncError",
    "PassError",
    "PassReport",
    "StaticKVError",
    "check_no_host_sync",
    "check_static_kv",
    "make_backend",
    "prune_logits",
    "remove_dead_code",
    "run_passes",
    "specfx_backend",
    "specfx_eager_backend",
]
