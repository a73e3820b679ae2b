"""Timing host calls: one helper for every measurement specfx makes (``"auto"`` K's round
times, ``specfx bench``, the investigations in ``benchmarks/``)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["call_times"]


def call_times(fn: Callable[[], object], repeats: int, *, warmup: int = 0, sync: Callable[[], object] | None = None) -> list[float]:
    """Seconds each of ``repeats`` calls of ``fn`` took, after ``warmup`` untimed calls.

    ``sync`` (``torch.cuda.synchronize`` on a GPU) runs after every call and inside its timing,
    so queued device work is counted where it was launched. Callers reduce the list as their
    measurement needs: the minimum where load from other processes only ever adds time
    (``"auto"`` K), the median for a benchmark's reported figure.
    """
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - begin)
    return times
