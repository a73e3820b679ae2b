"""Compiling round graphs in the background while the rounds run eagerly (decision 67).

Compiling one round graph of a 30-layer model takes 40-80 s on a small CPU (Inductor's
scheduling, code generation and the C++ compiler; Dynamo's trace is ~3 s of it). Done in the
foreground, "auto" made the first ``generate()`` wait minutes before its first token, and a call
that outgrew the buffers waited as long again. Instead, a variant that is not compiled yet is
queued here and the round runs as plain PyTorch (the same code, eagerly: the same tokens), until
the compiled graph is ready; the next window then uses it.

How a graph is compiled without running it: Dynamo compiles a function on its first call and
then runs it. The worker makes that first call with the real arguments, but the compiled graph
it gets back is wrapped (:class:`CompileOnly`): called from the worker, it raises
:class:`NotRun` before touching any tensor, so the call compiles (the trace reads only the
tensors' metadata, never their values) and changes nothing; Dynamo keeps the compiled entry in
the variant's private code cache, and the generator's next call of it, from its own thread,
finds it there and runs it. A guard that no longer holds by then (the state was reallocated
meanwhile) makes Dynamo compile again in the foreground: slower, never wrong.

One worker thread per generator, started when something is queued and ended when the queue is
empty; a daemon, but an exiting program first drops every queued compile and waits for the one
under way (an ``atexit`` hook, :func:`_finish_at_exit`): interpreter shutdown under a compile
running in a thread raised in it and aborted the process ("terminate called without an active
exception", exit status 134). By then the standard library's executors refuse new work, so a
compile under way usually stops at Inductor's first parallel step instead of finishing; that is
the intent (the graph is not needed any more) and is not reported as a failure
(:func:`exiting`). It runs the compile under the
modes every call of the generator runs in (``no_grad``, outside inference mode: grad mode is
part of the graphs' guards). The variant the host loop asks for next goes to the front of the
queue. Only round graphs compile here: prefill graphs (``compile_prefill``) and callers that
need the graph now (``round_fn()``, the "auto" timing) compile in the foreground, waiting for a
compile already under way rather than starting a second one.

While a worker is in Dynamo's part of a compile, the host threads' eager rounds wait
(:mod:`specfx.engine.trace_gate`, decision 101).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from specfx.engine.trace_gate import GATE, pin_fake_device_guard

__all__ = [
    "PROVISIONAL_COST",
    "BackgroundCompiler",
    "CompileOnly",
    "GuardsFailed",
    "NotRun",
    "exiting",
    "provisional_times",
    "register_background",
    "wait_for_graphs",
]

logger = logging.getLogger(__name__)

PROVISIONAL_COST = 0.1  # t(K) = 1 + 0.1 K while nothing of the batch bucket and mode is measured
SWITCH_INTERVAL = 1e-4  # s: Python's GIL switch interval while a worker compiles (default 5e-3)

_worker = threading.local()  # .compiling: this thread is the worker making a compile-only call


class NotRun(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by a :class:`CompileOnly` graph called from the worker: compiled, not run."""


class CompileOnly:
    """A compiled graph that the background worker's call does not run (it raises
    :class:`NotRun`); every other call runs it. Keeps Dynamo's calling convention (``_boxed_call``)."""

    def __init__(self, graph: Callable):
        self.graph = graph
        if getattr(graph, "_boxed_call", False):
            self._boxed_call = True

    def __call__(self, *args):
        if getattr(_worker, "compiling", False):
            raise NotRun
        return self.graph(*args)


def compile_only(backend: Callable) -> Callable:
    """``backend`` whose graphs are :class:`CompileOnly`; while it runs (Inductor), the gate is
    open to eager calls."""

    def wrapped(gm, example_inputs):
        with GATE.opened():
            graph = CompileOnly(backend(gm, example_inputs))
        _worker.backend_done = True
        return graph

    wrapped.__name__ = getattr(backend, "__name__", "backend")
    return wrapped


class GuardsFailed(Exception):  # noqa: N818 (names what happened, like NotRun)
    """A background compile failed after its backend had compiled the graph, i.e. while Dynamo
    built its guards: the state the trace read had changed meanwhile (decision 101: a model call
    on another thread that specfx does not gate). The same compile again usually succeeds, and
    cheaply: Inductor's cache has the graph."""


class _WorkerGuardErrors(logging.Filter):
    """Drops torch's "Error while creating guard" records emitted by a worker's compile-only
    call (the worker retries it and reports what remains: :class:`GuardsFailed`); other threads'
    records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_worker, "compiling", False)


_GUARD_LOG = logging.getLogger("torch._guards")


def run_compile_only(compiled_fn: Callable, *args, inductor: bool = False) -> None:
    """Make the first (compiling) call of ``compiled_fn`` without running its graph; an error
    after the backend has compiled the graph is raised as :class:`GuardsFailed`. ``inductor``:
    its backend is Inductor's (``TraceGate.traced``)."""
    _worker.compiling, _worker.backend_done = True, False
    quiet = _WorkerGuardErrors()
    _GUARD_LOG.addFilter(quiet)  # for this call only; it filters this thread's records only
    try:
        with torch.inference_mode(False), torch.no_grad(), GATE.traced(inductor):
            compiled_fn(*args)
    except NotRun:
        return
    except Exception as e:
        if _worker.backend_done:
            raise GuardsFailed(f"{type(e).__name__}: {e}") from e
        raise
    finally:
        _GUARD_LOG.removeFilter(quiet)
        _worker.compiling = False
    raise RuntimeError("specfx: the background compile ran the graph instead of only compiling it")


class _SwitchInterval:
    """Python's GIL switch interval, shortened while any worker compiles.

    An eager round is ~1000 small torch ops, and each releases the GIL; while the worker runs
    Inductor's Python (most of a compile), the host thread then waits for the GIL after every op
    until the worker is made to yield, up to the switch interval (5 ms by default): eager rounds
    ran 3-7x slower. At 0.1 ms they run ~3x faster than that (measured on SmolLM2, one thread;
    decision 67). Set when the first worker starts, restored when the last one ends (unless
    someone else has changed it meanwhile): a process-wide setting, held only while specfx
    compiles in the background."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._saved: float | None = None
        self._ours: float | None = None

    def enter(self) -> None:
        with self._lock:
            self._active += 1
            if self._active == 1 and sys.getswitchinterval() > SWITCH_INTERVAL:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL)
                self._ours = sys.getswitchinterval()  # as Python stores it (microseconds)

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._saved is not None:
                if sys.getswitchinterval() == self._ours:  # not changed by anyone else meanwhile
                    sys.setswitchinterval(self._saved)
                self._saved = None


_SWITCH = _SwitchInterval()


class BackgroundCompiler:
    """A queue of compile jobs (``key -> job()``) run one at a time on a worker thread."""

    def __init__(self, name: str = "specfx-compile"):
        pin_fake_device_guard()  # from the thread that creates the generator, before any worker
        self.name = name
        self._cond = threading.Condition()
        self._queue: OrderedDict[Hashable, Callable[[], None]] = OrderedDict()
        self._running: Hashable | None = None  # the key being compiled now
        self._thread: threading.Thread | None = None

    def submit(self, key: Hashable, job: Callable[[], None], *, first: bool = False) -> None:
        """Queue ``job`` under ``key`` (once; ``first``: move it to the front of the queue)."""
        with self._cond:
            if key == self._running:
                return
            if key not in self._queue:
                self._queue[key] = job
            if first:
                self._queue.move_to_end(key, last=False)
            if self._thread is None:
                _at_exit(self)
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()

    def cancel(self, key: Hashable) -> None:
        """Forget ``key`` if it has not started (a started compile finishes; its caller drops it)."""
        with self._cond:
            self._queue.pop(key, None)

    def pending(self) -> list:
        """Keys queued or compiling, the one compiling first."""
        with self._cond:
            return ([self._running] if self._running is not None else []) + list(self._queue)

    def busy(self, key: Hashable | None = None) -> bool:
        """Whether ``key`` (None: anything) is queued or compiling."""
        with self._cond:
            if key is None:
                return self._running is not None or bool(self._queue)
            return key == self._running or key in self._queue

    def wait(self, key: Hashable | None = None, timeout: float | None = None) -> bool:
        """Wait until ``key`` is done, or with None until every job is and the worker has ended
        (so the switch interval it shortened is restored); False if ``timeout`` s passed first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._thread is None if key is None else not (key == self._running or key in self._queue),
                timeout,
            )

    def _work(self) -> None:
        _SWITCH.enter()
        ended = False
        try:
            ended = self._drain()
        finally:
            if not ended:  # _drain raised: still give the switch interval back, and end
                _SWITCH.exit()
                with self._cond:
                    self._thread = None
                    self._cond.notify_all()

    def _drain(self) -> bool:
        while True:
            with self._cond:
                if not self._queue:
                    # restore the switch interval before anyone waiting sees the worker gone
                    _SWITCH.exit()
                    self._thread = None
                    self._cond.notify_all()
                    return True
                key, job = self._queue.popitem(last=False)
                self._running = key
            try:
                job()
            except Exception:  # the job reports its own failures; never kill the worker
                logger.exception("specfx: background compile of %s failed", key)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()


_COMPILERS: weakref.WeakSet = weakref.WeakSet()  # compilers that have started a worker
_EXIT_HOOK = threading.Lock()
_exit_hook_registered = False
_exiting = threading.Event()  # set by _finish_at_exit: the interpreter is shutting down


def exiting() -> bool:
    """Whether the program is exiting: a background compile that fails now failed because the
    interpreter refuses new work (executors shut down), which is expected and not worth a warning."""
    return _exiting.is_set()


def _at_exit(compiler: BackgroundCompiler) -> None:
    """Track ``compiler`` for :func:`_finish_at_exit` (registered once, at the first worker)."""
    global _exit_hook_registered
    with _EXIT_HOOK:
        if not _exit_hook_registered:
            atexit.register(_finish_at_exit)
            _exit_hook_registered = True
        _COMPILERS.add(compiler)


def _finish_at_exit() -> None:
    """At interpreter exit: drop every queued compile and wait for those under way (they end
    soon: the interpreter refuses the thread pools they would use, see the module docstring)."""
    _exiting.set()
    compilers = list(_COMPILERS)
    for c in compilers:
        with c._cond:
            c._queue.clear()
    running = [c for c in compilers if c.busy()]
    if running:
        print("specfx: stopping the round-graph compile under way before exiting", file=sys.stderr, flush=True)
    for c in running:
        c.wait()


def provisional_times(measured: dict[tuple, dict], key: tuple, widths: dict) -> dict:
    """Round times "auto" uses while a shape's graphs compile in the background, until the first
    call after they are ready times them: those measured for the same batch bucket, mode and
    collect at the nearest buffer capacity (``measured``: ``RoundTimer.times_by_shape``, keys
    ``(rows, capacity, mode, collect)``), else ``t = 1 + PROVISIONAL_COST * w`` for a round whose
    forward verifies ``w`` tokens past the pending one (``widths``: candidate -> w; K for a
    chain, a tree's scratch slots). The rounds run meanwhile are partly eager, partly compiled:
    no measurement fits them better."""
    rows, capacity, *rest = key
    near = [(abs(c - capacity), t) for (r, c, *o), t in measured.items() if r == rows and o == rest]
    if near:
        return dict(min(near, key=lambda x: x[0])[1])
    return {k: 1.0 + PROVISIONAL_COST * w for k, w in widths.items()}


_GENERATORS: weakref.WeakSet = weakref.WeakSet()  # the live generators that compile in the background


def register_background(generator) -> None:
    """Let :func:`wait_for_graphs` wait for ``generator`` (held weakly)."""
    _GENERATORS.add(generator)


def wait_for_graphs(timeout: float | None = None) -> bool:
    """Wait until every live generator's background compiles are done (and "auto" has timed
    them: ``SpeculativeGenerator.wait_for_graphs``); False if ``timeout`` s passed first. For
    benchmarks (after a warm-up) and tests; ``specfx.wait_for_graphs``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for generator in list(_GENERATORS):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not generator.wait_for_graphs(left):
            return False
    return True
