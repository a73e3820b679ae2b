"""The benchmark helpers, for the GPU scripts (``bench_gpu.py``, ``gpu_plan.py``): they live in
``specfx/bench/harness.py`` with the ``specfx bench`` tasks that share them."""

from specfx.bench.harness import (
    BASELINE,
    bench_end_to_end,
    cpu_name,
    first_mismatch,
    hf_compile_config,
    log,
    n_params,
    run_all,
)
from specfx.bench.harness import sync_fn as make_sync

__all__ = [
    "BASELINE",
    "bench_end_to_end",
    "cpu_name",
    "first_mismatch",
    "hf_compile_config",
    "log",
    "make_sync",
    "n_params",
    "run_all",
]
