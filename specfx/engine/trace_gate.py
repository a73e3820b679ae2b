"""The gate between eager model calls and Dynamo's part of a background compile (decision 101).

Dynamo's trace and its guards read the model's Python state as it is at that moment, module globals
included, and torch (2.13) holds ``torch.compiler.is_compiling()`` True process-wide for a whole
compile, so the host thread's eager rounds take the model's compile-time paths meanwhile (decision
101): transformers 5.25's ``kernels`` decorators then keep a dict in a module global for the length
of each forward. A trace that read it mid-forward and guards built after the host had reset it
failed every background compile of a Llama ("Expected dict, got NoneType"). :data:`GATE` keeps the
two apart: the generators' eager calls pass it shared, a worker's Dynamo phases (its trace, then
its guards) pass it alone; Inductor's part of the compile, which reads only the captured graph,
runs beside eager rounds.

On torch 2.11's CUDA build without a GPU, the first trace in a process installs a device guard tied
to its thread (:func:`pin_fake_device_guard`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import torch

__all__ = ["GATE", "GATE_PATIENCE", "TraceGate", "gated", "opens_gate", "pin_fake_device_guard", "prime_inductor"]

logger = logging.getLogger(__name__)

GATE_PATIENCE = 20.0  # s a worker waits for eager calls to end (and they for it) before going on anyway


class TraceGate:
    """Eager model calls of host threads (any number at once) against the Dynamo phases of a
    background compile (one at a time, alone; decision 101).

    A worker waiting for the gate stops new eager calls from starting (no starvation by a host loop
    that calls round after round). Neither side waits longer than ``patience`` seconds: past it,
    it goes on without the gate (the race it guards against costs a foreground compile; a wait
    that never ended would hang the caller), e.g. when an eager call itself waits for Dynamo's
    compile lock, which the worker holds."""

    def __init__(self, patience: float = GATE_PATIENCE):
        self.patience = patience
        self._cond = threading.Condition()
        self._eager = 0  # eager calls under way
        self._waiting = 0  # workers waiting to trace
        self._tracing = False  # a worker is in a Dynamo phase
        self._local = threading.local()  # .depth: this thread is inside eager(); .held: it holds the gate

    @contextlib.contextmanager
    def eager(self):
        """Around an eager call of a model by a host thread (nested calls pass through)."""
        if getattr(self._local, "depth", 0):
            self._local.depth += 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with self._cond:
            self._cond.wait_for(lambda: not (self._tracing or self._waiting), self.patience)
            self._eager += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._eager -= 1
                self._cond.notify_all()

    def acquire(self) -> bool:
        """Hold the gate alone (before a Dynamo phase); False if ``patience`` ran out, or at once
        inside an eager call of this thread (which the hold would wait for)."""
        if getattr(self._local, "depth", 0):
            self._local.held = False
            return False
        with self._cond:
            self._waiting += 1
            try:
                held = self._cond.wait_for(lambda: not (self._eager or self._tracing), self.patience)
            finally:
                self._waiting -= 1
            if held:
                self._tracing = True
            else:
                logger.debug("specfx: a background compile traces beside an eager call (waited %.0f s)", self.patience)
                self._cond.notify_all()  # eager calls waiting behind this worker go on
        self._local.held = held
        return held

    def release(self) -> None:
        """End this thread's hold (no-op if it holds none)."""
        if not getattr(self._local, "held", False):
            return
        self._local.held = False
        with self._cond:
            self._tracing = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def traced(self, inductor: bool = False):
        """Hold the gate alone for a compile's Dynamo phases; Dynamo's compile lock is taken
        first, so that two workers, or a worker and a foreground compile, never hold one each.
        ``inductor``: the compile is Inductor's (:func:`prime_inductor`, under the hold)."""
        if inductor:
            _import_inductor()  # seconds, once: not while holding the gate
        with _dynamo_compile_lock():
            self.acquire()
            try:
                if inductor:
                    prime_inductor()
                yield
            finally:
                self.release()

    @contextlib.contextmanager
    def opened(self):
        """Inside :meth:`traced`: let eager calls run meanwhile (Inductor's part of a compile)."""
        held = getattr(self._local, "held", False)
        self.release()
        try:
            yield
        finally:
            if held:
                self.acquire()


GATE = TraceGate()  # one per process: any generator's eager calls against any worker's trace


def gated(fn: Callable) -> Callable:
    """``fn``, an eager call of a model, made through :data:`GATE`."""

    def call(*args, **kwargs):
        with GATE.eager():
            return fn(*args, **kwargs)

    return call


def _dynamo_compile_lock():
    """Dynamo's process-wide compile lock (an RLock its own compile re-enters), if it has one."""
    import torch._dynamo.convert_frame as convert_frame

    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def opens_gate(backend: Callable) -> Callable:
    """``backend``, run with :data:`GATE` open to eager calls (Inductor reads only the graph)."""

    def wrapped(gm, example_inputs):
        with GATE.opened():
            return backend(gm, example_inputs)

    wrapped.__name__ = getattr(backend, "__name__", "backend")
    return wrapped


_PINNED = threading.Lock()
_pinned = False


def pin_fake_device_guard() -> None:
    """Install, once, the no-op CUDA device guard Dynamo's fake tensors install at their first use
    on a CUDA build of torch without a GPU (``torch._C._ensureCUDADeviceGuardSet``), from this
    thread. On torch 2.11 (CUDA build, no GPU) the guard belongs to the thread that installed it:
    once that thread has ended, the next trace on another thread crashes the process (segfault).
    Workers end when their queue is empty, so a generator's second worker crashed the process
    (decision 101), as would a compile in a caller's thread after another caller's thread ended;
    installed by the thread creating the generator (usually the main thread, which outlives them),
    it stays valid. What the first compile would do anyway; nothing on a CPU build
    or with a GPU."""
    global _pinned
    with _PINNED:
        if _pinned:
            return
        _pinned = True
        ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
        if ensure is not None and torch.version.cuda is not None and not torch.cuda.is_available():
            ensure()


_primed = False


def _import_inductor():
    try:
        import torch._inductor.loop_body  # noqa: F401 (imported for prime_inductor)
    except ImportError:
        pass


def prime_inductor() -> None:
    """Make Inductor's one plain ``torch.fx.symbolic_trace`` of the process now (decision 101).

    Inductor traces a dummy function once per process (``InterpreterShim._dummy_gm``, cached)
    with torch.fx's symbolic tracer, which replaces ``torch.nn.Module.__call__`` process-wide for
    the few milliseconds of that trace: a model call on another thread meanwhile raised
    ``NameError: module is not installed as a submodule`` (a user's ``generate()`` beside the first
    background compile, seen on SmolLM2). Called under the gate's hold, before the first compile's
    trace, so no specfx eager round runs beside it. Inductor's other traces (make_fx's tracer) pass
    a foreign module call through untouched."""
    global _primed
    if _primed:
        return
    _primed = True
    try:
        from torch._inductor.loop_body import InterpreterShim

        dummy = InterpreterShim._dummy_gm
    except (ImportError, AttributeError):  # another torch: nothing to prime
        return
    dummy()
