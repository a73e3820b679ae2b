"""Round graphs compiled in the background while the rounds run eagerly (decision 67).

The worker is held with a blocking job so that each test knows which rounds ran before the
graphs were ready; the graphs are traced with ``specfx_eager`` or a counting backend (no
Inductor: these tests are fast and not marked ``compiled``).
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch

import specfx
from specfx.engine.background import PROVISIONAL_COST, BackgroundCompiler, provisional_times
from specfx.testing.tiny import tiny_causal_lm

PROMPT = torch.tensor([[5, 9, 3, 7, 5, 9, 3, 7, 5, 9, 3, 11, 4]])


class Hold:
    """A job that keeps a generator's worker busy until released."""

    def __init__(self, spec):
        self.started, self.release = threading.Event(), threading.Event()
        spec.graph_cache.background.submit(("hold",), self._job)
        assert self.started.wait(30)

    def _job(self):
        self.started.set()
        self.release.wait(60)


class CountingBackend:
    """A Dynamo backend that runs the captured graph as is and counts its runs."""

    def __init__(self):
        self.compiled = self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm("llama")


def test_rounds_run_eagerly_until_the_graphs_are_ready_then_compiled(target, one_thread):
    backend = CountingBackend()
    spec = specfx.speculate(target, draft="prompt_lookup", backend=backend, background_compile=True)
    ref = target.generate(PROMPT, max_new_tokens=24)
    hold = Hold(spec)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24), ref)
    # every K of "auto" queued; nothing compiled, nothing of it run: all rounds were eager
    assert {key[3] for key in spec.compiling if key[0] == "round"} == {0, 1, 2, 4, 8}
    assert backend.compiled == backend.runs == 0 and spec.compile_events == []
    tokens = spec.state.tokens.clone()
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120)
    assert spec.compiling == []
    assert sorted(e.key[3] for e in spec.compile_events) == [0, 1, 2, 4, 8]
    assert all(e.background for e in spec.compile_events)
    # compiled without running (the timing of "auto" then ran each graph on finished rows)
    assert backend.compiled == 5
    assert torch.equal(spec.state.tokens, tokens)
    assert set(spec.auto_k.times) == {0, 1, 2, 4, 8}
    assert [spec.auto_k.times] == list(spec.round_timer.times_by_shape.values())  # measured, not provisional
    runs = backend.runs
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(spec.generate(PROMPT, max_new_tokens=24), ref)
    assert backend.compiled == 5 and backend.runs > runs  # the rounds ran the compiled graphs


def test_compile_only_call_does_not_run_the_graph(target, one_thread):
    backend = CountingBackend()
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=3, backend=backend, background_compile=True)
    hold = Hold(spec)
    spec.generate(PROMPT, max_new_tokens=8)
    snapshot = {name: t.clone() for name, t in vars(spec.state).items() if isinstance(t, torch.Tensor)}
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120)
    assert backend.compiled == 1 and backend.runs == 0
    for name, t in snapshot.items():
        assert torch.equal(getattr(spec.state, name), t), name


def test_seeded_sampling_is_the_same_eager_and_compiled(target, one_thread):
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=3, backend="specfx_eager", background_compile=True)
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=0)
    hold = Hold(spec)
    torch.manual_seed(7)
    eager = spec.generate(PROMPT, **kwargs)
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120) and len(spec.compile_events) == 1
    torch.manual_seed(7)
    assert torch.equal(spec.generate(PROMPT, **kwargs), eager)


def test_a_variant_outgrown_while_queued_is_never_kept(target, one_thread):
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, backend="specfx_eager", background_compile=True)
    hold = Hold(spec)
    spec.generate(PROMPT, max_new_tokens=8)
    (short,) = [key for key in spec.compiling if key[0] == "round"]
    # a longer call raises the live-KV bound: the queued graph of the old bound is dropped
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=120), target.generate(PROMPT, max_new_tokens=120))
    (long,) = [key for key in spec.compiling if key[0] == "round"]
    assert long[-1] > short[-1]
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120)
    assert [e.key for e in spec.compile_events] == [long] and spec.graph_cache.keys() == [long]


def test_a_variant_of_a_batch_bucket_no_longer_allocated_waits_for_its_next_call(target, one_thread):
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, backend="specfx_eager", background_compile=True)
    pair = PROMPT.repeat(2, 1)
    hold = Hold(spec)
    spec.generate(pair, max_new_tokens=8)  # queues the batch-2 graph
    spec.generate(PROMPT, max_new_tokens=8)  # reallocates for batch 1: the batch-2 graph cannot be traced now
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120)
    assert {e.key[1] for e in spec.compile_events} == {1}  # skipped, not failed
    assert torch.equal(spec.generate(pair, max_new_tokens=8), target.generate(pair, max_new_tokens=8))
    assert spec.wait_for_graphs(timeout=120)
    assert {e.key[1] for e in spec.compile_events} == {1, 2} and all(e.background for e in spec.compile_events)


def test_a_failed_background_compile_raises_at_the_next_call(target, one_thread):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, backend=broken, background_compile=True)
    ref = target.generate(PROMPT, max_new_tokens=8)
    hold = Hold(spec)  # else the compile may fail before the call ends, and its next window raises
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=8), ref)  # eager meanwhile
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120)
    with pytest.raises(Exception, match="no compiler here"):  # compiled in the foreground: its error surfaces
        spec.generate(PROMPT, max_new_tokens=8)


def test_a_generator_dropped_while_compiling_is_freed(target, one_thread):
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, backend="specfx_eager", background_compile=True)
    hold = Hold(spec)
    spec.generate(PROMPT, max_new_tokens=8)
    compiler, ref = spec.graph_cache.background, weakref.ref(spec)
    del spec
    hold.release.set()
    assert compiler.wait(timeout=120)
    gc.collect()
    assert ref() is None


def test_threads_share_a_generator_while_it_compiles(target, one_thread):
    spec = specfx.speculate(target, draft="prompt_lookup", backend="specfx_eager", background_compile=True)
    prompts = [PROMPT, PROMPT[:, 3:], PROMPT.repeat(2, 1), PROMPT[:, 1:]]
    refs = [target.generate(p, max_new_tokens=16) for p in prompts]
    errors = []

    def work(i):
        try:
            for j in range(3):
                p = (i + j) % len(prompts)
                assert torch.equal(spec.generate(prompts[p], max_new_tokens=16), refs[p])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert spec.wait_for_graphs(timeout=120)


def test_who_compiles_in_the_background(target):
    assert specfx.speculate(target).graph_cache.background is not None  # Inductor on a CPU
    assert specfx.speculate(target, backend="specfx_eager").graph_cache.background is None
    assert specfx.speculate(target, compile=False).graph_cache.background is None
    assert specfx.speculate(target, background_compile=False).graph_cache.background is None
    assert specfx.speculate(target, backend="specfx_eager", background_compile=True).graph_cache.background is not None
    with pytest.raises(ValueError, match="background_compile must be None, True or False"):
        specfx.speculate(target, background_compile="yes")


def test_provisional_times_come_from_the_nearest_measured_capacity():
    greedy, sampling = "greedy", "sampling"
    measured = {(1, 256, greedy, False): {0: 1.0, 4: 1.5}, (1, 1024, greedy, False): {0: 2.0, 4: 2.2}, (4, 512, greedy, False): {0: 9.0, 4: 9.0}}
    widths = {0: 0, 4: 4}
    assert provisional_times(measured, (1, 512, greedy, False), widths) == {0: 1.0, 4: 1.5}
    assert provisional_times(measured, (1, 2048, greedy, False), widths) == {0: 2.0, 4: 2.2}
    assert provisional_times(measured, (1, 512, sampling, False), widths) == {0: 1.0, 4: 1.0 + 4 * PROVISIONAL_COST}
    # a tree (key None) is priced by the tokens its forward adds
    assert provisional_times({}, (1, 256, greedy, False), {0: 0, None: 12}) == {0: 1.0, None: 1.0 + 12 * PROVISIONAL_COST}


def test_background_compiler_queue_order_and_wait():
    compiler, done, gate = BackgroundCompiler(), [], threading.Event()
    compiler.submit("a", lambda: (gate.wait(30), done.append("a")))
    compiler.submit("b", lambda: done.append("b"))
    compiler.submit("c", lambda: done.append("c"), first=True)  # ahead of b (a has started or is first)
    compiler.submit("b", lambda: done.append("b twice"))  # queued once
    assert compiler.busy("b") and not compiler.wait(timeout=0.05)
    gate.set()
    assert compiler.wait(timeout=30)
    assert done in (["a", "c", "b"], ["c", "a", "b"]) and not compiler.busy()


def test_the_switch_interval_is_short_only_while_a_worker_compiles():
    import sys

    from specfx.engine.background import SWITCH_INTERVAL

    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        compiler, gate, seen = BackgroundCompiler(), threading.Event(), []
        compiler.submit("a", lambda: (seen.append(sys.getswitchinterval()), gate.wait(30)))
        gate.set()
        assert compiler.wait(timeout=30)
        assert seen == [pytest.approx(SWITCH_INTERVAL)] and sys.getswitchinterval() == pytest.approx(0.004)  # restored
        # changed by someone else while the worker ran: left as they set it
        compiler.submit("b", lambda: sys.setswitchinterval(0.002))
        assert compiler.wait(timeout=30) and sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(saved)


def test_a_tree_under_auto_compiles_in_the_background_too(target, one_thread):
    spec = specfx.speculate(target, draft="lookahead", backend="specfx_eager", background_compile=True)
    ref = target.generate(PROMPT, max_new_tokens=24)
    hold = Hold(spec)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24), ref)  # provisional times for K = 0 and the tree
    assert {key[3] for key in spec.compiling if key[0] == "round"} == {0, spec.tree}
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120)
    assert set(spec.auto_k.times) == {0, None}
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24), ref)


@pytest.mark.full
def test_eager_rounds_capture_taps_while_another_thread_compiles(target, one_thread):
    """torch holds one process-wide "compiling" flag (``torch.compiler.is_compiling()``) while any
    thread compiles. An EAGLE-3 head's eager prefill of a new prompt width captures the target's
    tapped forward then; that must not be taken for a capture inside a compiled graph (found on
    SmolLM2: the shipped head's second call raised while the worker compiled)."""
    head = specfx.Eagle3.random(target, draft_vocab_size=64, seed=0, layer_ids=[0, 1, 2])
    spec = specfx.speculate(target, draft=head, backend=CountingBackend(), background_compile=True)
    hold = Hold(spec)  # nothing compiles: every round and prefill runs eagerly
    longer = torch.cat([PROMPT, PROMPT], dim=1)
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True  # as while the worker (or any thread) is in Dynamo
    try:
        assert torch.compiler.is_compiling()
        for prompt in (PROMPT, longer):  # a new prefill width each: a new tapped capture
            assert torch.equal(spec.generate(prompt, max_new_tokens=8), target.generate(prompt, max_new_tokens=8))
    finally:
        torch.compiler._is_compiling_flag = old
        hold.release.set()
    assert spec.wait_for_graphs(timeout=120)


@pytest.mark.full
def test_an_exiting_program_drops_queued_compiles_and_waits_for_the_running_one(tmp_path):
    """Interpreter shutdown under a compile in the worker thread aborted the process (exit
    status 134, "terminate called without an active exception"); now the exit waits for the job
    under way and drops the queued ones."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import pathlib, threading, time
        from specfx.engine.background import BackgroundCompiler
        out = pathlib.Path({str(tmp_path)!r})
        started = threading.Event()
        def running():
            started.set()
            time.sleep(1.5)
            (out / "running").write_text("done")
        compiler = BackgroundCompiler()
        compiler.submit("a", running)
        compiler.submit("b", lambda: (out / "queued").write_text("ran"))
        assert started.wait(30)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "running").read_text() == "done"  # waited for
    assert not (tmp_path / "queued").exists()  # dropped
    assert "stopping the round-graph compile under way" in result.stderr


def test_wait_returns_after_the_switch_interval_is_restored(monkeypatch):
    """wait() (every job) returns only once the worker has ended and given the switch interval
    back: a slow exit must not leave the caller seeing the shortened interval (CI saw this race)."""
    import sys
    import time

    from specfx.engine import background

    class SlowExit(background._SwitchInterval):
        def exit(self):
            time.sleep(0.2)
            super().exit()

    monkeypatch.setattr(background, "_SWITCH", SlowExit())
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        compiler = BackgroundCompiler()
        compiler.submit("a", lambda: None)
        assert compiler.wait(timeout=30)
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(saved)


@pytest.mark.full
def test_a_real_compile_cut_short_by_exit_is_not_reported_as_a_failure():
    """A script that generates once and ends while "auto"'s round graphs compile: the exit stops
    the compile under way (the interpreter refuses Inductor's thread pools by then) and that is
    expected, not a failed compile to be retried "in the foreground" (the old warning)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, specfx
        from specfx.testing.tiny import tiny_causal_lm
        spec = specfx.speculate(tiny_causal_lm("llama", seed=1), num_speculative_tokens="auto")
        spec.generate(torch.randint(3, 100, (1, 12)), max_new_tokens=8, do_sample=False)
    """)
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    assert "stopping the round-graph compile under way" in result.stderr  # a compile was cut short
    assert "failed" not in result.stderr and "foreground" not in result.stderr, result.stderr


class Shared:
    """Module state an eager forward holds a dict in while it runs, as transformers 5.25's ``kernels``
    decorators do (``_ACTIVE_KERNEL_FUNCS``): a trace that iterates it guards on its keys' order."""

    value = None


SHARED = Shared()


def reads_shared(owner, x):
    d = SHARED.value
    if d is not None:
        for k in d:
            x = x + d[k]
    return x * 2


def test_a_background_trace_never_reads_an_eager_call_half_way(one_thread):
    """Decision 101. Without the gate the worker traced while the eager call held the dict, and
    built its guards after the call had reset it: the compile failed (Dynamo: "Expected dict, got
    NoneType"). With it, the trace waits for the eager call to end."""
    from specfx.engine.background import GATE
    from specfx.engine.graphs import GraphCache

    in_backend, reset = threading.Event(), threading.Event()

    def backend(gm, example_inputs):
        in_backend.set()  # the trace is over: what it read is in the graph
        assert reset.wait(30)  # the guards are built after the eager call below has reset the state
        return gm.forward

    class Owner:
        pass

    owner, x = Owner(), torch.ones(3)
    cache = GraphCache(backend, 4, False, owner=owner, background=True)
    key = ("round", 1, 8, 0)
    with GATE.eager():  # what a generator's eager round runs under
        SHARED.value = {"a": 1.0}
        assert cache.variant(key, reads_shared, owner, (x,)) is None  # queued: the worker starts now
        traced_beside_us = in_backend.wait(2)
        SHARED.value = None
        reset.set()
    assert cache.wait(60)
    assert not traced_beside_us and key not in cache._failed
    fn = cache.ready(key)
    assert fn is not None and torch.equal(fn(x), x * 2)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def test_guards_failed_by_an_ungated_model_call_are_compiled_again(one_thread, caplog):
    """Decision 101. A model call specfx does not gate (the user's own, e.g. HF ``generate()`` on
    another thread) changed the state between the trace and the guards: the compile is made again
    in the background, not left to the foreground, and torch's error log of it is not shown."""
    from specfx.engine.graphs import GraphCache

    in_backend, reset, traces = threading.Event(), threading.Event(), []

    def backend(gm, example_inputs):
        traces.append(len(gm.graph.nodes))
        in_backend.set()
        assert reset.wait(30)
        return gm.forward

    class Owner:
        pass

    owner, x = Owner(), torch.ones(3)
    cache = GraphCache(backend, 4, False, owner=owner, background=True)
    key = ("round", 1, 8, 0)
    SHARED.value = {"a": 1.0}  # the user's forward, under way (not through the gate)
    assert cache.variant(key, reads_shared, owner, (x,)) is None
    assert in_backend.wait(30)  # traced with the dict
    SHARED.value = None  # the user's forward ended before the guards
    torch_errors = Records()
    logging.getLogger("torch._guards").addHandler(torch_errors)  # torch's loggers do not propagate to caplog's
    try:
        with caplog.at_level(logging.INFO):
            reset.set()
            assert cache.wait(60)
    finally:
        logging.getLogger("torch._guards").removeHandler(torch_errors)
    assert len(traces) == 2 and traces[0] > traces[1]  # traced again, without the dict's additions
    assert key not in cache._failed and [e.key for e in cache.compile_events] == [key]
    assert torch.equal(cache.ready(key)(x), x * 2)
    assert "compiling it again" in caplog.text and torch_errors.records == []


def test_eager_rounds_of_a_compiling_generator_pass_the_gate(target, one_thread, monkeypatch):
    from specfx.engine import background

    entered = []
    real = background.GATE.eager
    monkeypatch.setattr(background.GATE, "eager", lambda: (entered.append(1), real())[1])
    spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, backend="specfx_eager", background_compile=True)
    hold = Hold(spec)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=12), target.generate(PROMPT, max_new_tokens=12))
    assert len(entered) >= 1 + 12 // 3  # the prefill and every (eager) round
    hold.release.set()
    assert spec.wait_for_graphs(timeout=120)


def test_a_second_worker_compiles_after_the_first_has_ended():
    """Decision 101. On torch 2.11's CUDA build without a GPU (CI's minimum leg), the first trace
    in a worker installed a device guard that died with the worker, and the next worker's trace
    crashed the process (exit status 139). In a fresh process: its first trace is a worker's."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, specfx
        from specfx.testing.tiny import tiny_causal_lm
        target, prompt = tiny_causal_lm("llama"), torch.tensor([[5, 9, 3, 7, 5, 9, 3, 7, 5, 9, 3, 11, 4]])
        spec = specfx.speculate(target, draft="prompt_lookup", num_speculative_tokens=2, backend="specfx_eager",
                                background_compile=True)
        for n in (8, 200):  # the longer call raises the live-KV bound: a new graph, compiled by a new worker
            assert torch.equal(spec.generate(prompt, max_new_tokens=n), target.generate(prompt, max_new_tokens=n))
            assert spec.wait_for_graphs(60) and spec.graph_cache.background._thread is None  # the worker ended
        print(sorted(e.key[-1] for e in spec.compile_events if e.background))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    bounds = eval(result.stdout.strip().splitlines()[-1])
    assert len(bounds) == 2 and bounds[0] < bounds[1]


def test_inductors_one_plain_fx_trace_runs_under_the_gate():
    """Decision 101. torch.fx's plain symbolic tracer replaces ``nn.Module.__call__`` process-wide
    while it traces, and Inductor runs it once per process (a dummy graph); a model call on another
    thread meanwhile raised NameError. It now runs first, under the gate's hold, and is cached."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch.fx._symbolic_trace as st
        from specfx.engine.trace_gate import GATE
        seen, trace = [], st.Tracer.trace
        def spy(self, *args, **kwargs):
            if type(self) is st.Tracer:
                seen.append(GATE._tracing and GATE._local.held)
            return trace(self, *args, **kwargs)
        st.Tracer.trace = spy
        with GATE.traced(inductor=True):
            pass
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()  # what Inductor calls in a compile's code generation
        print(seen)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[True]"
