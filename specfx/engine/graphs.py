"""The compiled graphs of one generator: an LRU of graph variants, the backend, the live-KV bound.

A *variant* is one compiled graph: ``(kind, batch bucket, capacity, *what, live)`` where
``kind`` is "round" or "prefill", ``what`` the round's ``RoundShape.graph_id`` (K or tree, Mode,
collect) or the prefill's (prompt bucket, Mode, collect), and ``live`` the KV slots its
attention reads (decision 45). Each variant gets its own code object (a private Dynamo cache, so
no variant counts against another's recompile limit and each compiles exactly once) and lives
in an LRU of ``max_graphs`` entries; evicting one releases what Dynamo compiled for it.
"""

from __future__ import annotations

import logging
import threading
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from specfx.engine.background import BackgroundCompiler, GuardsFailed, compile_only, exiting, run_compile_only
from specfx.engine.trace_gate import GATE, opens_gate, pin_fake_device_guard
from specfx.model.dynamo import back_reference, fresh_code, release_code
from specfx.passes.backend import GraphRecords, make_backend
from specfx.passes.rewrites.live_kv import LiveKV

__all__ = ["LIVE_BACKENDS", "CompileEvent", "GraphCache", "quarter_octave"]

logger = logging.getLogger(__name__)

# backends that run specfx's pass pipeline, hence the live-KV cut (decision 45)
LIVE_BACKENDS = ("specfx", "specfx_eager")
GUARD_RETRIES = 2  # a background compile whose guards failed is made again, this many times (decision 101)


@dataclass
class CompileEvent:
    """One graph variant compiled by a generator: its key and the wall time of its first call
    (tracing, the passes, Inductor, plus one run; in the background: without the run)."""

    key: tuple
    seconds: float
    background: bool = False


def quarter_octave(needed: int, smallest: int) -> int:
    """``needed`` rounded up to ``smallest`` (a power of two), or above it to a multiple of a
    quarter of the power of two below it: 64 -> 64, 65 -> 80, 129 -> 160, 257 -> 320."""
    if needed <= smallest:
        return smallest
    step = max(1, (1 << (needed - 1).bit_length()) // 8)  # needed in (2^(n-1), 2^n]: quarter of 2^(n-1)
    return -(-needed // step) * step


def bind_weakly(impl: Callable, owner) -> Callable:
    """``impl`` bound to ``owner`` as a method is, but holding it weakly, in a function with a private
    code object (:func:`~specfx.model.dynamo.fresh_code`: Dynamo keeps that variant's compiled graph
    and guards on it; ``impl`` is inlined into its trace). ``owner`` keeps its compiled variants, so a
    method bound strongly would make a cycle that keeps every buffer of a freed generator alive until
    Python's cyclic collector happens to run (decision 93)."""
    owner_ref = weakref.ref(owner)

    def bound(*args):
        return impl(back_reference(owner_ref, "compiled graph's generator"), *args)

    return fresh_code(bound)


def _release_all(codes: dict) -> None:
    release_code(*codes.values())
    codes.clear()


class GraphCache:
    """The compiled variants of one generator (an LRU of ``max_graphs``), the backend they are
    compiled with, what they recorded (``records``: ``spec.graphs``), the compile events
    (``spec.compile_events``) and the live-KV bound.

    Accessors for tests and tools: :meth:`keys` (the variants kept, least recently used first)
    and :meth:`code` (a variant's private code object, whose Dynamo cache holds its graph).
    """

    def __init__(
        self,
        backend,
        max_graphs: int,
        live_kv: bool | int,
        owner=None,
        background: bool = False,
        inductor_options: dict | None = None,
    ):
        pin_fake_device_guard()  # any compile, foreground ones in a caller's thread too (decision 101)
        self.records = GraphRecords()
        self.backend_name = backend if isinstance(backend, str) else None
        self.inductor_options = inductor_options  # SpecConfig.inductor_options: patches for our compiles only
        self.backend = (
            make_backend(backend, self.records, options=inductor_options) if isinstance(backend, str) else backend
        )
        self.max_graphs = max_graphs
        self.live_kv = live_kv  # SpecConfig.live_kv: False, True (from 64) or the smallest bound
        self.compile_events: list[CompileEvent] = []
        self._variants: OrderedDict[tuple, Callable] = OrderedDict()  # key -> compiled fn (LRU)
        self._codes: dict[tuple, types.CodeType] = {}  # key -> its private code object
        self._live: tuple[int, int] | None = None  # (capacity, live-KV bound); None: no call yet
        # compiling in the background (decision 67): the worker, and the lock it and the host share
        self.background = BackgroundCompiler() if background else None
        self._lock = threading.RLock()
        self._wanted: set[tuple] = set()  # variants queued or compiling in the background
        self._failed: set[tuple] = set()  # variants whose background compile failed
        # owner -> (batch bucket, capacity) of its allocated state; None: never reallocated
        self.state_shape: Callable | None = None
        # Dynamo never frees a compiled code object's cache: release ours when the owner goes
        weakref.finalize(self if owner is None else owner, _release_all, self._codes)

    # ----------------------------------------------------------------- accessors
    def keys(self) -> list[tuple]:
        """The variants kept, least recently used first."""
        return list(self._variants)

    def __len__(self) -> int:
        return len(self._variants)

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._variants)

    def code(self, key: tuple) -> types.CodeType:
        """The private code object of variant ``key`` (its Dynamo cache holds the graph)."""
        return self._codes[key]

    # ----------------------------------------------------------------- the live-KV bound
    def live_bound(self, needed: int, capacity: int) -> int:
        """The KV slots a call's attention reads (issue 14, decision 45): ``needed`` (the
        call's last position + 2: prompt width + max_new_tokens + the round's scratch slots + 2;
        every slot from there on is masked) rounded up to ``SpecConfig.live_kv``'s smallest
        bucket (64 by default), above it to a quarter-octave step (64, 80, 96, 112, 128, 160,
        ..., 256, 320, ...: at most 25 % more slots than needed, at most four bounds per
        doubling), and to the capacity at most (no cut); the capacity when ``live_kv=False``."""
        if self.live_kv is False:
            return capacity
        return min(quarter_octave(needed, 64 if self.live_kv is True else self.live_kv), capacity)

    def live_slots(self, capacity: int) -> int:
        """The bound graphs of this capacity are compiled for (the capacity before any call)."""
        if self._live is None or self._live[0] != capacity:
            return capacity
        return self._live[1]

    def grow_live(self, capacity: int, bound: int) -> None:
        """Make the live-KV bound at least ``bound``. Like the capacity, it only grows (decision
        45): a warm generator serving a mixed workload keeps one graph per batch bucket and mode,
        and the graphs of an outgrown bound are evicted at once."""
        live = bound if self._live is None or self._live[0] != capacity else max(bound, self._live[1])
        if self._live != (capacity, live):
            self.drop_where(lambda key: key[-1] != live)
            self._live = (capacity, live)

    # ----------------------------------------------------------------- variants
    def key(self, kind: str, rows: int, capacity: int, *what) -> tuple:
        """The variant a compiled graph serves: ``(kind, batch bucket, capacity, *what, live)``."""
        return (kind, rows, capacity, *what, self.live_slots(capacity))

    def _compiler(self, key: tuple) -> Callable:
        """The backend variant ``key`` compiles with (its live-KV cut, decision 45)."""
        capacity, live = key[2], key[-1]
        if live < capacity and self.backend_name in LIVE_BACKENDS:
            return make_backend(
                self.backend_name, self.records, live=LiveKV(capacity, live), options=self.inductor_options
            )
        return self.backend

    def ready(self, key: tuple) -> Callable | None:
        """The compiled callable of variant ``key`` if it is compiled (now most recently used)."""
        with self._lock:
            fn = self._variants.get(key)
            if fn is not None:
                self._variants.move_to_end(key)
            return fn

    def variant(self, key: tuple, impl: Callable, owner, args: tuple | None = None) -> Callable | None:
        """The compiled callable of variant ``key``: ``impl`` (a function of ``owner`` and the
        graph's arguments) compiled on first use, or the one kept (now most recently used).

        With a background compiler and ``args`` (the arguments of the graph's next call): None
        while the variant is not compiled yet; it is queued (first in line: the caller needs it
        next) and compiles on the worker, and the caller runs ``impl`` eagerly meanwhile."""
        fn = self.ready(key)
        if fn is not None:
            return fn
        if self.background is not None and args is not None and key not in self._failed:
            self._submit(key, impl, owner, args)
            return None
        if self.background is not None and self.background.busy(key):
            self.background.wait(key)  # a compile already under way: wait for it, do not start another
            fn = self.ready(key)
            if fn is not None:
                return fn
        return self._foreground(key, impl, owner)

    def _foreground(self, key: tuple, impl: Callable, owner) -> Callable:
        """Compile variant ``key`` on its first call, in the caller's thread."""
        bound = bind_weakly(impl, owner)
        self._codes[key] = bound.__code__
        compiled_fn = torch.compile(bound, backend=opens_gate(self._compiler(key)), fullgraph=True, dynamic=False)

        def first_call(*args):
            # the host loop may call this object several times (rounds_per_sync > 1)
            if not first_call.uncompiled:
                return compiled_fn(*args)
            logger.info("specfx: compiling the %s graph for %s (first use of this variant)", key[0], key[1:])
            start = time.monotonic()
            try:
                with GATE.traced(self.backend_name == "specfx"):  # no eager call beside the trace (decision 101)
                    result = compiled_fn(*args)
            except BaseException:
                self.drop(key)  # a failed compile is retried next time, not kept
                raise
            first_call.uncompiled = False
            self.compile_events.append(CompileEvent(key, time.monotonic() - start))
            if key in self._variants:
                self._variants[key] = compiled_fn
            return result

        first_call.uncompiled = True  # until its first call returns
        with self._lock:
            self._variants[key] = first_call
            self._evict()
        return first_call

    def _submit(self, key: tuple, impl: Callable, owner, args: tuple) -> None:
        """Queue variant ``key`` on the background compiler, first in line."""
        owner_ref = weakref.ref(owner)

        def job():
            for attempt in range(1 + GUARD_RETRIES):
                owner = owner_ref()
                if owner is None or not self._current(owner, key):  # its state is gone: queued again when needed
                    self._forget(key)
                    return
                if not self._compile_in_background(key, impl, owner, args, retry=attempt < GUARD_RETRIES):
                    return
                del owner

        with self._lock:
            self._wanted.add(key)
        self.background.submit(key, job, first=True)

    def _compile_in_background(self, key: tuple, impl: Callable, owner, args: tuple, retry: bool) -> bool:
        """One background compile of variant ``key``; True: compile it again (its guards failed)."""
        code = bind_weakly(impl, owner)
        compiled_fn = torch.compile(code, backend=compile_only(self._compiler(key)), fullgraph=True, dynamic=False)
        logger.info("specfx: compiling the %s graph for %s in the background", key[0], key[1:])
        start = time.monotonic()
        try:
            run_compile_only(compiled_fn, *args, inductor=self.backend_name == "specfx")
        except Exception as e:
            release_code(code.__code__)
            if not self._current(owner, key):  # the state was reallocated under the trace
                self._forget(key)
                return False
            if retry and isinstance(e, GuardsFailed):
                logger.info("specfx: the guards of the %s graph for %s failed (%s); compiling it again", key[0], key[1:], e)
                return True
            # the foreground compile of the next call raises it where it belongs (at exit
            # there is none: the interpreter refused the compile's thread pools, as intended)
            log = logger.debug if exiting() else logger.warning
            log("specfx: the background compile of %s failed (%s); it will compile in the foreground", key, e)
            with self._lock:
                self._wanted.discard(key)
                self._failed.add(key)
            return False
        with self._lock:
            if key not in self._wanted:  # dropped meanwhile (an outgrown bound, evicted)
                release_code(code.__code__)
                return False
            self._wanted.discard(key)
            self._codes[key] = code.__code__
            self._variants[key] = compiled_fn
            self.compile_events.append(CompileEvent(key, time.monotonic() - start, background=True))
            self._evict()
        return False

    def _forget(self, key: tuple) -> None:
        with self._lock:
            self._wanted.discard(key)

    def _current(self, owner, key: tuple) -> bool:
        """Whether ``owner``'s allocated state is the one variant ``key`` is for (batch bucket
        and capacity): a trace reads the state, and a generator holds one bucket's at a time."""
        if self.state_shape is None:
            return True
        shape = self.state_shape(owner)
        return shape is not None and tuple(shape) == tuple(key[1:3])

    def compiling(self) -> list[tuple]:
        """The variants queued or compiling in the background, the one compiling first."""
        return self.background.pending() if self.background is not None else []

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every background compile; False if ``timeout`` s passed first."""
        return True if self.background is None else self.background.wait(None, timeout)

    def _evict(self) -> None:
        while len(self._variants) > self.max_graphs:
            evicted = next(iter(self._variants))
            logger.info("specfx: evicting the compiled graph for %s (max_graphs=%d)", evicted, self.max_graphs)
            self.drop(evicted)

    def drop(self, key: tuple) -> None:
        """Forget a variant and free what Dynamo compiled for it (one queued is cancelled)."""
        with self._lock:
            self._variants.pop(key, None)
            self._wanted.discard(key)
            self._failed.discard(key)
            code = self._codes.pop(key, None)
        if self.background is not None:
            self.background.cancel(key)
        if code is not None:
            release_code(code)

    def drop_where(self, outgrown: Callable[[tuple], bool]) -> None:
        """Drop every variant (kept or queued) whose key ``outgrown`` says no call will use again."""
        with self._lock:
            keys = [k for k in (*self._variants, *self._wanted) if outgrown(k)]
        for key in keys:
            self.drop(key)
