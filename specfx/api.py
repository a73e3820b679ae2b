"""``speculate()`` and the generator it returns: the HF stand-in and the host loop around
compiled rounds. Each job the loop needs is an object of :mod:`specfx.engine`: planning
(:mod:`~specfx.engine.plan`), the graph LRU (:mod:`~specfx.engine.graphs`), the state
(:mod:`~specfx.engine.state`), host reads and the output (:mod:`~specfx.engine.host`), "auto" K
(:mod:`~specfx.engine.auto_k`)."""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable

import torch

from specfx.config import SpecConfig
from specfx.drafters.registry import resolve_drafter
from specfx.engine.auto_k import RoundTimer, auto_policy
from specfx.engine.auto_times import auto_k_times
from specfx.engine.background import register_background, wait_for_graphs
from specfx.engine.chain_round import RoundState, prefill_step, round_step
from specfx.engine.graphs import CompileEvent, GraphCache, quarter_octave
from specfx.engine.host import OverlappedReads, finish, make_replay, overlap_reads, read_stats, sync_finished
from specfx.engine.plan import RoundShape, check_stateful, plan_rounds
from specfx.engine.state import StateSlots, load_request, model_signature
from specfx.engine.stats import SpecStats
from specfx.engine.trace_gate import gated
from specfx.engine.tree_round import tree_round_step
from specfx.model.hf_names import penalty_counts_left_padding
from specfx.model.runner import ModelRunner, state_hooks
from specfx.passes.backend import GraphRecord
from specfx.request.args import resolve_generate_args
from specfx.sampling.processors import GREEDY, Mode, as_mode

__all__ = ["CompileEvent", "SpeculativeGenerator", "quarter_octave", "speculate", "wait_for_graphs"]  # the last three re-exported

logger = logging.getLogger(__name__)


def speculate(
    model,
    draft=None,
    *,
    num_speculative_tokens: int | str | None = None,
    tree=None,
    compile: bool = True,
    backend="specfx",
    **options,
):
    """Wrap an HF causal LM for speculative generation.

    Args:
        model: the target, a transformers causal LM (``AutoModelForCausalLM``). It is used as
            is: no weights are copied and nothing in it is changed.
        draft: the drafter: a smaller causal LM with the same vocabulary, a drafter name
            (``"prompt_lookup"``, ``"name:arg"``; see ``specfx.drafters.registry.NAMED_DRAFTERS``), a
            :class:`specfx.drafters.base.Drafter`, or None (default): the first available of
            ``specfx.drafters.registry.DEFAULT_DRAFTERS`` (MTP heads when the model has them, otherwise
            prompt lookup). ``spec.method`` names the choice.
        num_speculative_tokens: K, proposals per round, or "auto": K chosen per round from the
            measured acceptance and round times among 0 (plain decoding) and ``auto_k_values``
            (one compiled round graph per value). None (default): "auto", with ``auto_k_values``
            cut to what the drafter can propose. With a tree (``tree=``, or lookahead's own),
            None or "auto" chooses per round between the tree and K = 0, and an int must be the
            tree's node count: the tree every round.
        tree: verify a token tree instead of a chain of K: a :class:`specfx.TokenTree` or a list
            of nodes in vLLM's convention (``[(0,), (1,), (0, 0)]``: each node a tuple of child
            ranks from the pending token). Drafters that branch: a draft model, prompt lookup,
            early exit.
        compile: compile each round into one graph (True), or run it eagerly (False).
        backend: torch.compile backend for those graphs ("specfx", "specfx_eager", or any).
        **options: further :class:`SpecConfig` fields (rounds_per_sync, prefill_buckets, ...).

    Returns:
        A :class:`SpeculativeGenerator`, which behaves like ``model`` and whose ``generate()``
        takes ``model.generate()``'s arguments.
    """
    config = SpecConfig(
        num_speculative_tokens=num_speculative_tokens, tree=tree, compile=compile, backend=backend, **options
    )
    return SpeculativeGenerator(model, draft, config)


class SpeculativeGenerator:
    """A target model plus a drafter, generating speculatively.

    Attribute access, ``config``, ``device``, ``generation_config`` and calling the object are
    forwarded to the target, so it can stand in for the model.

    Long-lived use: ``generate()`` calls are serialised by a lock (threads may share one
    generator), run outside ``torch.inference_mode`` and grad mode whatever the caller's, and
    keep one compiled graph per *variant* (batch bucket, buffer capacity, K, greedy or
    sampling; see ``graph_key``) in an LRU of ``max_graphs`` entries. Sampling settings
    (temperature, top-k, top-p, penalties, EOS ids) are device values: they never select a graph.
    """

    def __init__(self, model, draft, config: SpecConfig):
        penalty_counts_left_padding()  # read eagerly: the prefill graphs read it as a constant
        self.target_runner = ModelRunner(model, role="target")
        self.drafter = resolve_drafter(draft, model)
        # the runners whose recurrent state rounds roll back (decisions 76, 81): the target's, a draft model's
        self.state_runners = [r for r in (self.target_runner, getattr(self.drafter, "runner", None)) if r and r.stateful]
        for runner in self.state_runners:
            check_stateful(runner, self.drafter, config)
        self.drafter.bind(self.target_runner)
        self.target_runner.check_taps(self.drafter.taps)  # the hidden states it reads exist
        self.plan = plan_rounds(config, self.drafter, self.target_runner)
        self.spec_config = config = self.plan.config
        self.tree = self.plan.tree  # a tree round, or None: a chain of K
        self.drafter.prepare_tree(self.tree)
        # "auto" (a chain's K, or a tree against K = 0), else None; .history lists the Ks used
        self.auto_k = auto_policy(self.plan, self.drafter.resumable)
        self.round_timer = RoundTimer()  # "auto": measured round times per graph shape
        # proposals per round at most (buffers keep this many scratch slots past the pending token)
        self.k = self.plan.scratch_slots
        self.vocab = self.target_runner.vocab_size
        self._last_mode = GREEDY  # the last call's graph mode (round_fn's default)
        self._last_collect = False  # whether the last call collected scores (its graphs' variant)
        self._shapes: dict[tuple, RoundShape] = {}  # (K, mode, collect) -> the one object passed to its graph
        # compiled graphs kept (SpecConfig.max_graphs; None: 16 per K a round may use)
        max_graphs = config.max_graphs or 16 * len(self.plan.shapes)
        background = config.background_compile
        if background is None:  # decision 67: where a compile costs minutes and is measured
            background = config.compile and config.backend == "specfx" and self.device.type == "cpu"
            # a stateful model's round is traced only while its mixer hooks are attached (decision 76)
            background = background and not self.state_runners
        self.graph_cache = GraphCache(
            config.backend,
            max_graphs,
            config.live_kv,
            owner=self,
            background=background,
            inductor_options=config.inductor_options,
        )
        if background:
            self.graph_cache.state_shape = SpeculativeGenerator._state_shape
            register_background(self)
        self.state_slots = StateSlots(config.min_capacity, self.vocab, self.plan.max_accepted)
        self._reads = OverlappedReads()
        self._lock = threading.RLock()
        self.stats = SpecStats()
        self.cumulative_stats = SpecStats()

    def _state_shape(self) -> tuple[int, int] | None:
        """(batch bucket, capacity) of the allocated state."""
        return self.state_slots.shape

    @property
    def state(self) -> RoundState | None:
        """The allocated round state (None before the first call)."""
        return self.state_slots.state

    @property
    def graphs(self) -> list[GraphRecord]:
        """What the backend recorded of each captured graph (:meth:`explain`)."""
        return self.graph_cache.records

    @property
    def compile_events(self) -> list[CompileEvent]:
        return self.graph_cache.compile_events

    @property
    def max_graphs(self) -> int:
        return self.graph_cache.max_graphs

    @property
    def live_kv_bound(self) -> int | None:
        """The KV slots the current graphs' attention reads (None before the first call)."""
        shape = self.state_slots.shape
        return None if shape is None else self.graph_cache.live_slots(shape[1])

    # ----------------------------------------------------------------- the wrapped model
    @property
    def model(self):
        return self.target_runner.model

    @property
    def config(self):
        return self.model.config

    @property
    def method(self) -> str:
        """The speculation method in use: the drafter's name ("draft_model", "prompt_lookup", "mtp", ...)."""
        return self.drafter.name

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def generation_config(self):
        return self.model.generation_config

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        # Only reached for names this object does not define: forward to the target.
        if name.startswith("__") or name in ("target_runner", "drafter"):
            raise AttributeError(name)
        return getattr(self.target_runner.model, name)

    def __repr__(self) -> str:
        mode = f"compiled ({self.spec_config.backend})" if self.spec_config.compile else "eager"
        k = f"auto{self.spec_config.k_values}" if self.auto_k is not None else self.k
        shape = f"tree={self.tree.size} nodes, depth {self.tree.depth}" if self.tree is not None else f"K={k}"
        return f"SpeculativeGenerator(target={type(self.model).__name__}, drafter={self.drafter.name}, {shape}, {mode})"

    # ----------------------------------------------------------------- graphs
    def _prefill_impl(self, shape: RoundShape, ids):
        return prefill_step(self.target_runner, self.drafter, self.state, shape, self.vocab, ids)

    def _round_impl(self, shape: RoundShape):
        step = round_step if shape.tree is None else tree_round_step
        return step(self.target_runner, self.drafter, self.state, shape, self.vocab)

    def round_shape(self, k: int | None, mode: Mode, collect: bool) -> RoundShape:
        """The round of K (None: the tree, or the largest K) for a call's mode: one object per
        (K, mode, collect), so each graph sees the same constant every call."""
        key = (k, mode, collect)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self.plan.shape(k).for_call(mode, collect)
        return shape

    def graph_key(self, kind: str, *what) -> tuple:
        """The variant a compiled graph serves: ``(kind, batch bucket, capacity, *what, live)``
        (what: ``RoundShape.graph_id`` for a round, K or tree, mode and collect; prompt bucket,
        mode and collect for a prefill; live: the KV slots its attention reads, :meth:`live_bound`)."""
        return self.graph_cache.key(kind, *self.state_slots.shape, *what)

    def live_bound(self, prompt_width: int, max_new_tokens: int) -> int:
        """The KV slots a call's attention reads (issue 14, decision 45): no query of the call
        is at a position past ``prompt_width + max_new_tokens + K`` (tree: its scratch slots),
        so attention may stop before slot ``prompt_width + max_new_tokens + K + 2``; rounded
        up by :meth:`specfx.engine.graphs.GraphCache.live_bound`."""
        return self.graph_cache.live_bound(prompt_width + max_new_tokens + self.k + 2, self.state_slots.shape[1])

    def _variant(self, kind: str, shape: RoundShape, bucket: int | None = None, *, now: bool = False) -> Callable:
        """The callable for one graph variant (a round of ``shape``, or the prefill of prompt ``bucket`` in
        ``shape``'s mode): eager (never beside a compile's trace, decision 101), or compiled on first use
        (:class:`GraphCache`); compiling in the background (decision 67), a round not compiled yet runs
        eagerly meanwhile, unless ``now`` (compile it here, or wait for the compile under way)."""
        impl = SpeculativeGenerator._round_impl if kind == "round" else SpeculativeGenerator._prefill_impl
        eager = gated(types.MethodType(impl, self))
        if not (self.spec_config.compile and (kind == "round" or self.spec_config.compile_prefill)):
            return eager
        self._prepare_taps(shape, bucket)
        what = shape.graph_id if kind == "round" else (bucket, shape.mode, shape.collect)
        args = (shape,) if kind == "round" and not now else None
        fn = self.graph_cache.variant(self.graph_key(kind, *what), impl, self, args)
        return eager if fn is None else fn  # None: still compiling, run it eagerly

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Wait until the round graphs compiling in the background (``SpecConfig.background_compile``,
        decision 67) are ready; False if ``timeout`` seconds passed first. With "auto", the last
        call's graphs are then timed (as the next call would). Benchmarks call it after a
        warm-up so that the timed calls run compiled graphs only."""
        if not self.graph_cache.wait(timeout):
            return False
        if self.auto_k is not None and self.state is not None:  # time them now, not in the next call
            with self._lock, torch.inference_mode(False), torch.no_grad():
                times = self._auto_k_times(self._last_mode, self._last_collect)
                if times is not None:  # what spec.auto_k.times shows now (the next call starts from them)
                    self.auto_k.times = dict(times)
        return True

    @property
    def compiling(self) -> list[tuple]:
        """The graph variants queued or compiling in the background (the one compiling first)."""
        return self.graph_cache.compiling()

    def _prepare_taps(self, shape: RoundShape, bucket: int | None) -> None:
        """Capture the target's tapped forward for the shape this graph calls it with (the
        prompt bucket, K + 1 or a tree's N + 1 tokens), eagerly, before Dynamo traces the graph
        (a capture cannot start inside that trace); a no-op once captured."""
        taps, batch = self.drafter.taps, self.state_slots.shape[0]
        if bucket is not None:
            self.target_runner.prepare_taps(batch, bucket, taps)
        elif shape.tree is not None:
            self.target_runner.prepare_taps(batch, shape.tree.size + 1, taps, tree=shape.tree)
        elif shape.draft_tokens > 0:  # K = 0 rounds (plain decoding) read no taps
            # a stateful target's verify forward also returns its mixers' inputs (decision 82)
            self.target_runner.prepare_taps(batch, shape.draft_tokens + 1, taps, record=self.target_runner.stateful)

    def round_fn(self, k: int | None = None, sample: Mode | bool | None = None, collect: bool = False) -> Callable:
        """One round of the allocated state (after a ``generate()`` call) as a callable returning
        ``(tokens [B, K+1], n_emitted [B])``; for benchmarks. K defaults to the largest K (or the tree);
        ``sample`` chooses the sampling round with every processing stage in the graph (True), the
        greedy one (False), or a Mode; None (default): the last call's graph."""
        if self.state is None:
            raise RuntimeError("round_fn(): no state yet; call generate() once first.")
        shape = self.round_shape(k, self._last_mode if sample is None else as_mode(sample), collect)

        def one_round():
            # the modes generate() runs in: grad mode is part of the graph's guards, so a round
            # called under another mode would recompile instead of replaying the graph
            hooks = state_hooks(self.state_runners, attach=self.spec_config.compile)  # as generate() has them
            with self._lock, torch.inference_mode(False), torch.no_grad(), hooks:
                return self._variant("round", shape, now=True)(shape)

        return one_round

    def explain(self) -> str:
        """What was done to the model: the passes applied to each captured graph and its size."""
        lines = [repr(self)]
        if not self.spec_config.compile:
            lines.append("eager mode: rounds run as plain PyTorch; no graph is captured or rewritten.")
        elif not self.graphs:
            lines.append("no graph captured yet: graphs are captured on the first generate() call.")
        for i, g in enumerate(self.graphs):
            lines.append(f"graph {i}: {g.summary()}")
        if len(self.graph_cache):
            lines.append("compiled variants kept (kind, batch bucket, capacity, ...): " + ", ".join(map(str, self.graph_cache)))
        return "\n".join(lines)

    def reads_overlapped(self, replay, collect: bool) -> bool:
        """Whether a call reads the finished flags one round late (SpecConfig.overlap_reads)."""
        return overlap_reads(self.spec_config.overlap_reads, self.device, replay, collect, self.auto_k is not None)

    # ----------------------------------------------------------------- generate
    def generate(self, inputs=None, **kwargs):
        """Speculative drop-in for ``model.generate()``.

        Takes HF's arguments with HF's defaults from ``model.generation_config``: input_ids
        (or ``inputs``), attention_mask (left padding), max_new_tokens, max_length,
        min_new_tokens, min_length, do_sample, temperature, top_k, top_p, repetition_penalty,
        eos_token_id (int or list), pad_token_id, generation_config, streamer,
        stopping_criteria, stop_strings with tokenizer, num_return_sequences (sampling),
        max_time, return_dict_in_generate (with output_scores, output_logits), logits_to_keep;
        the streamer and criteria see HF's calls, one step at a time (:mod:`specfx.engine.step_replay`). Returns what HF returns: a ``[B, S + new]`` LongTensor,
        or a ``GenerateDecoderOnlyOutput`` with ``sequences``, the cache to continue from (a
        ``DynamicCache`` in the field HF's installed release uses: ``cache`` from transformers
        5.24 on, ``past_key_values`` before) and, when asked, ``scores``/``logits``.
        Arguments it cannot honour raise ``ValueError`` naming the argument.

        Safe to call from several threads (calls are serialised) and under
        ``torch.inference_mode()`` or ``torch.no_grad()`` alike.
        """
        # One mode for every call: buffers made under inference_mode would refuse the in-place
        # updates of a later normal call, and grad mode is part of the compiled graphs' guards.
        with self._lock, torch.inference_mode(False), torch.no_grad():
            with state_hooks(self.state_runners, attach=False):  # attached in _generate once allocated; removed after
                return self._generate(inputs, kwargs)

    def _generate(self, inputs, kwargs):
        tr = self.target_runner
        req = resolve_generate_args(self.model, tr.vocab_size, tr.max_positions, inputs, kwargs)
        batch, seq_len = req.input_ids.shape
        bucket = self._prefill_width(seq_len)
        rows = self.spec_config.batch_bucket(batch)
        # real token j of a row sits at slot j whatever the prompt bucket (padding goes to the
        # trash slot), so the longest prompt, not its bucket, sizes the buffers: attention reads
        # every slot of them (or, compiled, the live ones: decision 45)
        self._ensure_state(rows, seq_len + req.max_new_tokens + self.k + 2)
        for runner in self.state_runners if self.spec_config.compile else ():  # compiled rounds record
            runner.attach_state_hooks()  # the stateful models' mixers through hooks attached before tracing
        self.graph_cache.grow_live(self.state_slots.shape[1], self.live_bound(seq_len, req.max_new_tokens))
        load_request(self.state, req, batch, self.device)
        # [rows, bucket]: columns past HF's own width hold -1 (never a token: the repetition
        # penalty must not count them where it counts the caller's padding, chain_round.prefill_step)
        ids = torch.nn.functional.pad(req.input_ids, (bucket - seq_len, 0), value=-1)
        ids = torch.nn.functional.pad(ids, (0, 0, 0, rows - batch))
        collect = req.return_dict_in_generate and (req.output_scores or req.output_logits)
        steps = [] if collect else None  # per round: (scores, logits [B, T, V], n_emitted [B])

        mode = self._last_mode = req.sampling.mode()
        self._last_collect = collect  # the graph variant: greedy/sampling and the stages in use
        if self.auto_k is not None:
            self.auto_k.reset(self._auto_k_times(mode, collect))
        replay = make_replay(req, collect)
        if replay is not None:
            replay.start()  # the prompt first, as HF puts it
        start = time.monotonic()
        prefill = self._shapes.setdefault(("prefill", mode, collect), RoundShape.chain(0, mode, collect))  # no proposals
        first = self._variant("prefill", prefill, bucket)(prefill, ids)
        if collect:
            first, scores, logits = first
            steps.append((scores[:batch].clone(), logits[:batch].clone(), torch.ones(batch, dtype=torch.long)))
        first = first[:batch]
        if replay is not None:
            self._freeze(replay.feed(first.cpu()[:, None], [1] * batch, steps and steps[-1][0]))

        rounds_left = req.max_new_tokens  # every round emits >= 1 token per active row
        shape = self.round_shape(None, mode, collect)
        overlap = self.reads_overlapped(replay, collect)
        pending = None  # overlapped reads: the previous batch of rounds' flags, on their way to the host
        while rounds_left > 0 and not (replay is not None and replay.done) and (overlap or not sync_finished(self.state, self.auto_k)):
            if self.auto_k is not None:
                self.auto_k.history.append(self.auto_k.k)
                shape = self.round_shape(self.auto_k.k, mode, collect)
            round_fn = self._variant("round", shape)
            for _ in range(min(self.spec_config.rounds_per_sync, rounds_left)):
                result = round_fn(shape)
                out, n = result[0][:batch], result[1][:batch]
                rounds_left -= 1
                if collect:
                    steps.append((result[2][:batch].clone(), result[3][:batch].clone(), n.clone()))
                if replay is not None:  # HF's steps over this round's tokens: criteria, streamer
                    self._freeze(replay.feed(out.cpu(), n.tolist(), steps and steps[-1][0]))
                    if replay.done:
                        break
            if overlap:
                flags = self._reads.start(self.state)
                if pending is not None and self._reads.done(self.state, pending):
                    break  # the rounds just launched serve finished rows only: inert
                pending = flags
            if req.max_time is not None and time.monotonic() - start > req.max_time:
                break
        caps = [None] * batch
        if replay is not None:
            replay.end()
            caps = replay.counts()
        output = finish(self.state, req, batch, caps, steps, self.model, tr.cache)
        self.stats = read_stats(self.state, batch)
        self.cumulative_stats.merge(self.stats)
        return output

    def _prefill_width(self, seq_len: int) -> int:
        """The width prompts are left-padded to for prefill: a prompt bucket
        (``SpecConfig.prefill_buckets``) where a graph is made per width (a compiled prefill, or
        hidden-state taps, captured per shape), else the longest prompt itself: an eager
        prefill padded from 104 to 256 columns did 2.5x the work."""
        if (self.spec_config.compile and self.spec_config.compile_prefill) or self.drafter.taps:
            return self.spec_config.bucket(seq_len)
        return seq_len

    def _ensure_state(self, rows: int, needed: int) -> None:
        """State for ``rows`` rows of at least ``needed`` slots (:class:`StateSlots`); a new
        dtype or device also forgets the round times measured on the old one."""
        signature = model_signature(self.model, getattr(self.drafter, "model", None))

        def allocate_models(batch, capacity):
            self.target_runner.allocate(batch, capacity)
            self.drafter.allocate(batch, capacity)

        if self.state_slots.ensure(rows, needed, signature, allocate_models, self.graph_cache, self.device):
            self.round_timer.times_by_shape.clear()

    def _freeze(self, rows: list[int]) -> None:
        """Finish rows on the device (a stopping criterion stopped them: nothing more is generated)."""
        if rows:
            self.state.finished[rows] = True

    def _auto_k_times(self, mode: Mode, collect: bool) -> dict[int, float] | None:
        """The round times "auto" uses this call (:func:`specfx.engine.auto_times.auto_k_times`)."""
        return auto_k_times(self, mode, collect)
