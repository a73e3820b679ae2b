"""``speculate()`` and the generator it returns: the host loop around compiled rounds."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging as hf_logging

from specfx.engine.auto_k import AutoK
from specfx.config import AUTO, MAX_SPECULATIVE_TOKENS, SpecConfig
from specfx.drafters.base import branch_slots, shape_refusal
from specfx.drafters.registry import resolve_drafter
from specfx.request.args import GenerateRequest, resolve_generate_args
from specfx.model.dynamo import fresh_code, release_code
from specfx.model.hf_names import penalty_counts_left_padding
from specfx.passes.backend import GraphRecord, GraphRecords, make_backend
from specfx.passes.rewrites.live_kv import LiveKV
from specfx.engine.chain_round import RoundState, prefill_step, round_step
from specfx.model.runner import ModelRunner
from specfx.sampling.core import Mode
from specfx.engine.stats import SpecStats
from specfx.engine.step_replay import StepReplay
from specfx.trees.types import DynamicTree, TokenTree
from specfx.engine.tree_round import tree_round_step

__all__ = ["CompileEvent", "SpeculativeGenerator", "speculate"]

logger = logging.getLogger(__name__)

# backends that run specfx's pass pipeline, hence the live-KV cut (decision 45)
LIVE_BACKENDS = ("specfx", "specfx_eager")


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
            (``"prompt_lookup"``, ``"name:arg"``; see ``specfx.drafters.base.NAMED_DRAFTERS``), a
            :class:`specfx.drafters.base.Drafter`, or None (default): the first available of
            ``specfx.drafters.base.DEFAULT_DRAFTERS`` (MTP heads when the model has them, otherwise
            prompt lookup). ``spec.method`` names the choice.
        num_speculative_tokens: K, proposals per round, or "auto": K chosen per round from the
            measured acceptance and round times among 0 (plain decoding) and ``auto_k_values``
            (one compiled round graph per value). None (default): "auto", with ``auto_k_values``
            cut to what the drafter can propose; ignored when a tree sets the round.
        tree: verify a token tree instead of a chain of K: a :class:`specfx.TokenTree` or a list
            of nodes in vLLM's convention (``[(0,), (1,), (0, 0)]``: each node a tuple of child
            ranks from the pending token). Replaces ``num_speculative_tokens``. Drafters that
            branch: a draft model, prompt lookup, early exit.
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


def release_code_map(codes: dict) -> None:
    release_code(*codes.values())
    codes.clear()


@dataclass
class CompileEvent:
    """One graph variant compiled by a generator: its key and the wall time of its first call
    (tracing, the passes, Inductor, plus one run)."""

    key: tuple
    seconds: float


def quarter_octave(needed: int, smallest: int) -> int:
    """``needed`` rounded up to ``smallest`` (a power of two), or above it to a multiple of a
    quarter of the power of two below it: 64 -> 64, 65 -> 80, 129 -> 160, 257 -> 320."""
    if needed <= smallest:
        return smallest
    step = max(1, (1 << (needed - 1).bit_length()) // 8)  # needed in (2^(n-1), 2^n]: quarter of 2^(n-1)
    return -(-needed // step) * step


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
        self.drafter.bind(self.target_runner)
        self.target_runner.check_taps(self.drafter.taps)  # the hidden states it reads exist
        own_tree = self.drafter.round_tree()  # a drafter that fixes the round's shape (lookahead)
        if own_tree is not None:
            if config.tree is not None or config.num_speculative_tokens == AUTO:
                raise ValueError(
                    f"the {self.drafter.name} drafter fixes each round's shape itself ({own_tree.size} nodes); "
                    f"drop tree= and num_speculative_tokens='auto' (set the drafter's own parameters instead)."
                )
            config = dataclasses.replace(config, tree=own_tree)
        if branch_slots(self.drafter) and self.drafter.taps:  # taps are captured per forward shape (N + 1 tokens)
            raise ValueError(f"the {self.drafter.name} drafter both reads hidden-state taps and adds a branch; unsupported.")
        self.spec_config = config
        # a tree round, or None: a chain of K (a tree that is a short chain runs as that chain)
        self.tree = config.tree
        if own_tree is None and self.tree is not None and self.tree.is_chain and self.tree.size <= MAX_SPECULATIVE_TOKENS:
            config = dataclasses.replace(config, num_speculative_tokens=self.tree.size, tree=None)
            self.spec_config, self.tree = config, None
        if self.tree is not None:
            for why in (self.target_runner.tree_refusal(), shape_refusal(self.drafter, self.tree)):
                if why is not None:
                    where = f"draft={self.drafter.name!r} (it verifies a token tree each round)" if own_tree else "tree=..."
                    raise ValueError(f"speculate({where}): {why}")
        if isinstance(self.tree, DynamicTree) and self.tree.branching > self.target_runner.vocab_size:
            raise ValueError(
                f"speculate(tree={self.tree!r}): branching={self.tree.branching} exceeds the target's vocabulary "
                f"of {self.target_runner.vocab_size} tokens; lower branching."
            )
        if config.num_speculative_tokens is None and self.tree is None:
            config = self.spec_config = self._default_auto(config)
        self._check_depth(config)
        self.drafter.prepare_tree(self.tree)
        self.auto_k = None  # AutoK for num_speculative_tokens="auto"; .history lists the Ks used
        if config.num_speculative_tokens == AUTO:
            resumable = self.drafter.resumable
            self.auto_k = AutoK(config.k_values, config.auto_k_cost, config.auto_k_times, resumable=resumable)
        # compiled graphs kept (SpecConfig.max_graphs; None: 16 per K a round may use)
        per_k = 1 if self.tree is not None else len(config.k_values) + (self.auto_k is not None)
        self.max_graphs = config.max_graphs or 16 * per_k
        self._round_times: dict[tuple, dict[int, float]] = {}  # "auto": (rows, capacity, mode, collect) -> {K: s}
        self._last_mode = Mode(False, penalty=False)  # the last call's graph mode (round_fn's default)
        # proposals per round at most (buffers keep this many scratch slots past the pending token)
        self.k = max(config.k_values) if self.tree is None else self.tree.scratch_slots + branch_slots(self.drafter)
        self._positions = self.k if self.tree is None else self.tree.depth  # accepted per round at most
        self.vocab = self.target_runner.vocab_size
        self.state: RoundState | None = None
        self._shape: tuple[int, int] | None = None  # (batch bucket, capacity) of the allocated state
        self._live: tuple[int, int] | None = None  # (capacity, live-KV bound) (_grow_live); None: no call yet
        self._signature: tuple | None = None  # dtypes/devices of the models when state was allocated
        self.graphs: list[GraphRecord] = GraphRecords()
        self._backend = make_backend(config.backend, self.graphs) if isinstance(config.backend, str) else config.backend
        self._variants: OrderedDict[tuple, Callable] = OrderedDict()  # graph_key -> compiled fn (LRU)
        self._codes: dict[tuple, types.CodeType] = {}  # graph_key -> its private code object
        # Dynamo never frees a compiled code object's cache: release ours when this generator goes
        weakref.finalize(self, release_code_map, self._codes)
        self.compile_events: list[CompileEvent] = []
        self._lock = threading.RLock()
        self._pinned = None  # overlapped reads' host buffers (CUDA)
        self.stats = SpecStats()
        self.cumulative_stats = SpecStats()

    def _default_auto(self, config: SpecConfig) -> SpecConfig:
        """``num_speculative_tokens`` left at its default for a chain: "auto", among the
        ``auto_k_values`` the drafter can propose (all of them when none is too deep for it;
        when every one is, they stay, and :meth:`_check_depth` says so)."""
        limit = self.drafter.max_depth
        values = tuple(k for k in config.auto_k_values if limit is None or k <= limit) or config.auto_k_values
        return dataclasses.replace(config, num_speculative_tokens=AUTO, auto_k_values=values)

    def _check_depth(self, config: SpecConfig) -> None:
        """Refuse rounds deeper than the drafter can draft (``Drafter.max_depth``)."""
        limit = self.drafter.max_depth
        if limit is None:
            return
        if self.tree is not None:
            if self.tree.depth > limit:
                raise ValueError(
                    f"speculate(tree=...): the tree is {self.tree.depth} deep, but the {self.drafter.name} "
                    f"drafter proposes at most {limit} tokens along a path; use a tree of depth <= {limit}."
                )
            return
        if max(config.k_values) > limit:
            auto = config.num_speculative_tokens == AUTO
            asked = f"auto_k_values={config.auto_k_values}" if auto else f"num_speculative_tokens={config.num_speculative_tokens}"
            raise ValueError(
                f"speculate(): {asked} asks for up to {max(config.k_values)} proposals per round, but the "
                f"{self.drafter.name} drafter proposes at most {limit}; pass "
                f"{'auto_k_values= with values' if auto else 'num_speculative_tokens='} <= {limit}."
            )

    # ----------------------------------------------------------------- the wrapped model
    @property
    def model(self):
        return self.target_runner.model

    @property
    def config(self):
        return self.model.config

    @property
    def method(self) -> str:
        """The speculation method in use: the drafter's name ("draft_model", "prompt_lookup",
        "early_exit", "mtp", ...)."""
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
    def _prefill_impl(self, ids, sample: bool, collect: bool):
        return prefill_step(self.target_runner, self.drafter, self.state, ids, self.vocab, sample, collect)

    def _round_impl(self, k, sample: bool, collect: bool):
        if isinstance(k, (TokenTree, DynamicTree)):
            return tree_round_step(self.target_runner, self.drafter, self.state, k, self.vocab, sample, collect)
        return round_step(self.target_runner, self.drafter, self.state, k, self.vocab, sample, collect)

    def graph_key(self, kind: str, *extra) -> tuple:
        """The variant a compiled graph serves: ``(kind, batch bucket, capacity, *extra, live)``
        (extra: K, sampling and collect for a round; prompt bucket, sampling and collect for a
        prefill; live: the KV slots its attention reads, :meth:`live_bound`)."""
        return (kind, *self._shape, *extra, self._live_slots())

    def live_bound(self, prompt_width: int, max_new_tokens: int) -> int:
        """The KV slots a call's attention reads (issue 14, decision 45): no query of the call
        is at a position past ``prompt_width + max_new_tokens + K`` (tree: its scratch slots),
        so every slot from ``prompt_width + max_new_tokens + K + 2`` on is masked, and attention
        may stop before it. Rounded up to ``SpecConfig.live_kv``'s smallest bucket (64 by
        default), above it to a quarter-octave step (64, 80, 96, 112, 128, 160, ..., 256, 320,
        ...: at most 25 % more slots than needed, at most four bounds per doubling), and to the
        capacity at most (no cut); the capacity when ``live_kv=False``."""
        capacity = self._shape[1]
        smallest = self.spec_config.live_kv
        if smallest is False:
            return capacity
        return min(
            quarter_octave(prompt_width + max_new_tokens + self.k + 2, 64 if smallest is True else smallest), capacity
        )

    def _live_slots(self) -> int:
        if self._live is None or self._live[0] != self._shape[1]:
            return self._shape[1]
        return self._live[1]

    def _grow_live(self, bound: int) -> None:
        """Make the live-KV bound at least ``bound``. Like the capacity, it only grows (decision
        45): a warm generator serving a mixed workload keeps one graph per batch bucket and mode,
        and the graphs of an outgrown bound are evicted at once."""
        capacity = self._shape[1]
        live = bound if self._live is None or self._live[0] != capacity else max(bound, self._live[1])
        if self._live != (capacity, live):
            for key in [k for k in self._variants if k[-1] != live]:
                self._drop(key)
            self._live = (capacity, live)

    def _variant(self, kind: str, *extra) -> Callable:
        """The callable for one graph variant: eager, or compiled on first use. Each variant
        gets its own code object (a private Dynamo cache, so no variant counts against
        another's recompile limit) and lives in an LRU of ``max_graphs`` entries."""
        impl = SpeculativeGenerator._round_impl if kind == "round" else SpeculativeGenerator._prefill_impl
        compiled = self.spec_config.compile and (kind == "round" or self.spec_config.compile_prefill)
        if not compiled:
            return types.MethodType(impl, self)
        self._prepare_taps(kind, extra[0])
        key = self.graph_key(kind, *extra)
        fn = self._variants.get(key)
        if fn is not None:
            self._variants.move_to_end(key)
            return fn
        code = fresh_code(impl)
        self._codes[key] = code.__code__
        bound = types.MethodType(code, self)
        backend = self._backend
        capacity, live = self._shape[1], self._live_slots()
        if live < capacity and isinstance(self.spec_config.backend, str) and self.spec_config.backend in LIVE_BACKENDS:
            backend = make_backend(self.spec_config.backend, self.graphs, live=LiveKV(capacity, live))
        compiled_fn = torch.compile(bound, backend=backend, fullgraph=True, dynamic=False)

        def first_call(*args):
            # the host loop may call this object several times (rounds_per_sync > 1)
            if not first_call.uncompiled:
                return compiled_fn(*args)
            logger.info("specfx: compiling the %s graph for %s (first use of this variant)", kind, key[1:])
            start = time.monotonic()
            try:
                result = compiled_fn(*args)
            except BaseException:
                self._drop(key)  # a failed compile is retried next time, not kept
                raise
            first_call.uncompiled = False
            self.compile_events.append(CompileEvent(key, time.monotonic() - start))
            if key in self._variants:
                self._variants[key] = compiled_fn
            return result

        first_call.uncompiled = True  # until its first call returns
        self._variants[key] = first_call
        while len(self._variants) > self.max_graphs:
            evicted = next(iter(self._variants))
            logger.info("specfx: evicting the compiled graph for %s (max_graphs=%d)", evicted, self.max_graphs)
            self._drop(evicted)
        return first_call

    def _prepare_taps(self, kind: str, shape) -> None:
        """Capture the target's tapped forward for the shape this graph calls it with (the
        prompt bucket, K + 1 or a tree's N + 1 tokens), eagerly, before Dynamo traces the graph
        (a capture cannot start inside that trace); a no-op once captured."""
        taps, batch = self.drafter.taps, self._shape[0]
        if kind == "prefill":
            self.target_runner.prepare_taps(batch, shape, taps)
        elif isinstance(shape, (TokenTree, DynamicTree)):
            self.target_runner.prepare_taps(batch, shape.size + 1, taps, tree=shape)
        elif shape > 0:  # K = 0 rounds (plain decoding) read no taps
            self.target_runner.prepare_taps(batch, shape + 1, taps)

    def _drop(self, key: tuple) -> None:
        """Forget a variant and free what Dynamo compiled for it."""
        self._variants.pop(key, None)
        code = self._codes.pop(key, None)
        if code is not None:
            release_code(code)

    def round_fn(self, k: int | None = None, sample: bool | None = None, collect: bool = False) -> Callable:
        """One round of the allocated state (after a ``generate()`` call) as a callable
        returning ``(tokens [B, K+1], n_emitted [B])``; for benchmarks. K defaults to the
        largest K; ``sample`` chooses the sampling round with every processing stage in the
        graph (True) or the greedy one (False); None (default): the last call's graph."""
        if self.state is None:
            raise RuntimeError("round_fn(): no state yet; call generate() once first.")
        k = self._round_shape() if k is None else k
        sample = self._last_mode if sample is None else sample

        def one_round():
            # the modes generate() runs in: grad mode is part of the graph's guards, so a round
            # called under another mode would recompile instead of replaying the graph
            with self._lock, torch.inference_mode(False), torch.no_grad():
                return self._variant("round", k, sample, collect)(k, sample, collect)

        return one_round

    def _round_shape(self):
        """What a round verifies by default: the tree, or K (the largest K for "auto")."""
        return self.tree if self.tree is not None else self.k

    def explain(self) -> str:
        """What was done to the model: the passes applied to each captured graph and its size."""
        lines = [repr(self)]
        if not self.spec_config.compile:
            lines.append("eager mode: rounds run as plain PyTorch; no graph is captured or rewritten.")
        elif not self.graphs:
            lines.append("no graph captured yet: graphs are captured on the first generate() call.")
        for i, g in enumerate(self.graphs):
            lines.append(f"graph {i}: {g.summary()}")
        if self._variants:
            lines.append("compiled variants kept (kind, batch bucket, capacity, ...): " + ", ".join(map(str, self._variants)))
        return "\n".join(lines)

    # ----------------------------------------------------------------- state
    def _model_signature(self) -> tuple:
        """dtype and device of every model in play: a change (``model.to(torch.bfloat16)``)
        makes the allocated buffers and compiled graphs stale."""
        models = [self.model, getattr(self.drafter, "model", None)]
        return tuple((m.dtype, m.device) for m in models if m is not None)

    def _prefill_width(self, seq_len: int) -> int:
        """The width prompts are left-padded to for prefill: a prompt bucket
        (``SpecConfig.prefill_buckets``) where a graph is made per width (a compiled prefill, or
        hidden-state taps, captured per shape), else the longest prompt itself: an eager
        prefill padded from 104 to 256 columns did 2.5x the work."""
        if (self.spec_config.compile and self.spec_config.compile_prefill) or self.drafter.taps:
            return self.spec_config.bucket(seq_len)
        return seq_len

    def _ensure_state(self, batch: int, needed: int) -> None:
        """Allocate state for ``batch`` rows (a batch bucket) of at least ``needed`` slots.

        Capacity only grows (power-of-two steps from ``min_capacity``); graphs of an outgrown
        capacity are evicted at once. All-or-nothing: if any allocation fails (out of memory,
        Ctrl-C, a failed re-check) the generator is left with no state and the next call
        allocates afresh.
        """
        signature = self._model_signature()
        if signature != self._signature:
            if self._signature is not None:
                logger.info("specfx: the model's dtype or device changed; reallocating and recompiling")
            self.state, self._shape, self._signature = None, None, None
            for key in list(self._variants):
                self._drop(key)
            self._round_times.clear()  # measured on the old dtype/device
        cap = max(self.spec_config.min_capacity, self._shape[1] if self._shape else 0)
        while cap < needed:
            cap *= 2
        if self._shape == (batch, cap):
            return
        if self._shape is not None and cap != self._shape[1]:
            for key in [k for k in self._variants if k[2] != cap]:
                self._drop(key)
        self.state, self._shape = None, None
        try:
            self.target_runner.allocate(batch, cap)
            self.drafter.allocate(batch, cap)
            state = RoundState.allocate(batch, cap, self.vocab, self._positions, self.device)
        except BaseException:
            self._signature = None  # nothing half-allocated is ever used
            raise
        self.state, self._shape, self._signature = state, (batch, cap), signature

    def _load_request(self, req: GenerateRequest, batch: int) -> None:
        """Load one call's rows and settings into the state (``batch`` real rows; the rest of
        the bucket are inert rows, finished from the start)."""
        s, sp = self.state, req.sampling
        bucket = s.live.shape[0]
        prompt_lengths = torch.ones(bucket, dtype=torch.long, device=self.device)
        prompt_lengths[:batch] = req.prompt_lengths
        s.prompt_lengths.copy_(prompt_lengths)
        s.gen_end.copy_(prompt_lengths + req.max_new_tokens)
        s.live.copy_(torch.arange(bucket, device=self.device) < batch)
        if sp.do_sample:  # HF-style: torch.manual_seed reproduces; greedy leaves the global RNG alone
            s.seed.fill_(int(torch.randint(0, 2**62, (1,))))
        for name, value in sp.device_values().items():
            s.values[name].fill_(value)
        eos = [t for t in sp.eos_token_ids if t >= 0]
        if len(eos) > s.eos_ids.numel():  # rare: a larger buffer (the round recompiles once)
            s.eos_ids = torch.full((1 << (len(eos) - 1).bit_length(),), -1, dtype=torch.long, device=self.device)
        padded = eos + [-1] * (s.eos_ids.numel() - len(eos))
        s.eos_ids.copy_(torch.tensor(padded, dtype=torch.long))

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
        self._grow_live(self.live_bound(seq_len, req.max_new_tokens))
        self._load_request(req, batch)
        # [rows, bucket]: columns past HF's own width hold -1 (never a token: the repetition
        # penalty must not count them where it counts the caller's padding, round.prefill_step)
        ids = torch.nn.functional.pad(req.input_ids, (bucket - seq_len, 0), value=-1)
        ids = torch.nn.functional.pad(ids, (0, 0, 0, rows - batch))
        collect = req.return_dict_in_generate and (req.output_scores or req.output_logits)
        steps = [] if collect else None  # per round: (scores, logits [B, T, V], n_emitted [B])

        sample = req.sampling.mode()  # the graph variant: greedy/sampling and the stages in use
        self._last_mode = sample
        if self.auto_k is not None:
            self.auto_k.reset(self._auto_k_times(sample, collect))
        replay = self._replay(req, collect)
        if replay is not None:
            replay.start()  # the prompt first, as HF puts it
        start = time.monotonic()
        first = self._variant("prefill", bucket, sample, collect)(ids, sample, collect)
        if collect:
            first, scores, logits = first
            steps.append((scores[:batch].clone(), logits[:batch].clone(), torch.ones(batch, dtype=torch.long)))
        first = first[:batch]
        if replay is not None:
            self._freeze(replay.feed(first.cpu()[:, None], [1] * batch, steps and steps[-1][0]))

        rounds_left = req.max_new_tokens  # every round emits >= 1 token per active row
        auto, k = self.auto_k, self._round_shape()
        overlap = self._overlap_reads(replay, collect)
        pending = None  # overlapped reads: the previous batch of rounds' flags, on their way to the host
        while rounds_left > 0 and not (replay is not None and replay.done) and (overlap or not self._sync_finished()):
            if auto is not None:
                k = auto.k
                auto.history.append(k)
            round_fn = self._variant("round", k, sample, collect)
            for _ in range(min(self.spec_config.rounds_per_sync, rounds_left)):
                result = round_fn(k, sample, collect)
                out, n = result[0][:batch], result[1][:batch]
                rounds_left -= 1
                if collect:
                    steps.append((result[2][:batch].clone(), result[3][:batch].clone(), n.clone()))
                if replay is not None:  # HF's steps over this round's tokens: criteria, streamer
                    self._freeze(replay.feed(out.cpu(), n.tolist(), steps and steps[-1][0]))
                    if replay.done:
                        break
            if overlap:
                flags = self._flags_to_host()
                if pending is not None and self._flags_done(pending):
                    break  # the rounds just launched serve finished rows only: inert
                pending = flags
            if req.max_time is not None and time.monotonic() - start > req.max_time:
                break
        if replay is None:
            return self._finish(req, batch, [None] * batch, steps)
        replay.end()
        return self._finish(req, batch, replay.counts(), steps)

    def _replay(self, req: GenerateRequest, collect: bool) -> StepReplay | None:
        """HF's per-step calls for a call with stopping criteria or a streamer (step_replay)."""
        if req.streamer is None and req.stopping_criteria is None:
            return None
        eos, pad = req.sampling.eos_token_ids, req.pad_token_id
        scores = collect and req.output_scores  # HF passes its scores tuple only then
        return StepReplay(req.input_ids, req.max_new_tokens, eos, pad, req.pads_finished, req.stopping_criteria,
                          req.streamer, scores)

    def _freeze(self, rows: list[int]) -> None:
        """Finish rows on the device (a stopping criterion stopped them: nothing more is generated)."""
        if rows:
            self.state.finished[rows] = True

    def _auto_k_times(self, mode, collect, warmup: int = 2, repeats: int = 7) -> dict[int, float] | None:
        """Round times of every candidate K (0 and ``auto_k_values``) for this call's graph
        shape, for "auto" (:mod:`specfx.engine.auto_k`): given (``auto_k_times``, ``auto_k_cost``:
        None, the policy has them), remembered, or timed now. Timing runs each round graph
        (compiling it first) on the allocated state with every row finished, so the rounds
        change nothing a generation reads: prefill then rewrites the tokens, counters, caches
        and drafter state they touched. The Ks are timed in turn, ``repeats`` times after
        ``warmup`` calls each, and each K keeps its fastest time: load from other processes
        only ever adds time, and taking turns spreads its drift over every K alike."""
        config = self.spec_config
        if config.auto_k_times is not None or config.auto_k_cost is not None:
            return None
        # one timing per batch bucket, capacity and mode: a call that only raises the live-KV
        # bound (decision 45) reuses it, and compiles only the Ks it then chooses
        key = (*self._shape, mode, collect)
        times = self._round_times.get(key)
        if times is None:
            self.state.finished.fill_(True)
            self.state.lengths.copy_(self.state.prompt_lengths)  # this call's rows (each >= 1), as prefill leaves them
            ks = (0, *config.k_values)
            fns = {k: self._variant("round", k, mode, collect) for k in ks}
            new = [k for k in ks if getattr(fns[k], "uncompiled", False)]
            if config.compile and new:  # a wait of minutes on a CPU: say what it is, with progress
                logger.info("specfx: 'auto' compiles and times a round graph per K in %s (once per shape)", ks)
                for k in hf_logging.tqdm(new, desc="specfx: compiling the round graph of each K ('auto')", unit="graph"):
                    fns[k](k, mode, collect)
            times = {k: float("inf") for k in ks}
            for i in range(warmup + repeats):
                for k in ks:
                    begin = time.perf_counter()
                    fns[k](k, mode, collect)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    if i >= warmup:
                        times[k] = min(times[k], time.perf_counter() - begin)
            self._round_times[key] = times
            logger.info("specfx: auto K round times for %s: %s", key, times)
        return times

    def _overlap_reads(self, replay, collect) -> bool:
        """Whether this call reads the finished flags one round late (SpecConfig.overlap_reads)."""
        if replay is not None or collect or self.auto_k is not None:
            return False  # these read every round's tokens or counters
        wanted = self.spec_config.overlap_reads
        return self.device.type == "cuda" if wanted is None else wanted

    def _flags_to_host(self):
        """Start copying (all finished, any invalid) to the host behind the rounds launched so
        far; returns what :meth:`_flags_done` waits on. On CUDA: a pinned buffer (two, used in
        turn, so the copy in flight never overwrites the one being read) and an event."""
        s = self.state
        head = torch.stack([s.finished.all(), s.invalid.any()])
        if not head.is_cuda:
            return head, None
        if self._pinned is None:
            self._pinned = [torch.empty(2, dtype=torch.bool, pin_memory=True) for _ in range(2)]
        buf = self._pinned[0]
        self._pinned.reverse()
        buf.copy_(head, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return buf, event

    def _flags_done(self, pending) -> bool:
        buf, event = pending
        if event is not None:
            event.synchronize()
        done, invalid = buf.tolist()
        if invalid:
            self._raise_invalid()
        return bool(done)

    def _sync_finished(self) -> bool:
        """The host's read between rounds: are all rows finished? The NaN flag comes back in
        the same transfer, and with "auto" the acceptance counters that choose the next K."""
        s = self.state
        head = [s.finished.all().long(), s.invalid.any().long()]
        if self.auto_k is None:
            done, invalid = torch.stack(head).tolist()
        else:
            head += [s.accepted.sum(), s.row_rounds.sum()]
            done, invalid, accepted, row_rounds, *per_position = torch.cat([torch.stack(head), s.per_position]).tolist()
            self.auto_k.update(accepted, row_rounds, per_position)
        if invalid:
            self._raise_invalid()
        return bool(done)

    def _raise_invalid(self):
        rows = torch.nonzero(self.state.invalid).flatten().tolist()
        raise RuntimeError(
            f"generate(): the target's next-token distribution of row(s) {rows} contains NaN or inf "
            f"while sampling (transformers raises here too: 'probability tensor contains either inf, "
            f"nan or element < 0'). The model produced non-finite logits: check its weights and dtype "
            f"(float16 overflow is a common cause; try bfloat16 or float32)."
        )

    def _finish(self, req: GenerateRequest, batch: int, caps: list[int | None], steps):
        """The output: row b's new tokens, at most ``caps[b]`` (the step replay's counts), padded."""
        s = self.state
        if bool(s.invalid.any()):  # the last round's flag (the loop may end without a read)
            self._raise_invalid()
        lengths = s.lengths[:batch].cpu()
        prompt = req.prompt_lengths.cpu()
        tokens = s.tokens[:batch].cpu()
        counts = (lengths + 1 - prompt).tolist()
        counts = [c if cap is None else min(c, cap) for c, cap in zip(counts, caps, strict=True)]
        width = max(counts)
        pad = req.pad_token_id if req.pad_token_id is not None else 0
        new = torch.full((len(counts), width), pad, dtype=torch.long)
        for b, c in enumerate(counts):
            p = int(prompt[b])
            new[b, :c] = tokens[b, p : p + c]
        sequences = torch.cat([req.input_ids, new.to(self.device)], dim=1)
        self._read_stats(batch)
        if req.return_dict_in_generate:
            from specfx.engine.outputs import generate_output  # HF's output classes, imported only when asked for

            return generate_output(self.model, self.target_runner.cache, req, sequences, torch.tensor(counts), steps)
        return sequences

    def _read_stats(self, batch: int) -> None:
        s = self.state
        stats = SpecStats(
            rounds=int(s.rounds),
            proposed=int(s.proposed.sum()),
            accepted=int(s.accepted.sum()),
            emitted=int(s.emitted.sum()),
            row_rounds=int(s.row_rounds.sum()),
            per_position=s.per_position.tolist(),
            per_row_accepted=s.accepted[:batch].tolist(),
            per_row_proposed=s.proposed[:batch].tolist(),
        )
        self.stats = stats
        self.cumulative_stats.merge(stats)
