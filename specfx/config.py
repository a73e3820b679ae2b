"""User-facing configuration."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO", "MAX_SPECULATIVE_TOKENS", "SpecConfig", "check_inductor_options", "check_tree_k"]

MAX_SPECULATIVE_TOKENS = 16  # K above this unrolls too much for a round graph to pay off
AUTO = "auto"  # num_speculative_tokens="auto": K chosen per round among auto_k_values


@dataclass(frozen=True)
class SpecConfig:
    """How :func:`specfx.speculate` builds the generator.

    Attributes:
        num_speculative_tokens: K, proposals per round (1..MAX_SPECULATIVE_TOKENS), or "auto":
            K is chosen before each round among 0 (no speculation: plain decoding through the
            same cache) and ``auto_k_values``, from the acceptance measured so far in the call
            and the measured time of a round (one round graph per value, so no recompiles; see
            :mod:`specfx.engine.auto_k` for the policy). None (default): "auto", with
            ``auto_k_values`` cut to the K the drafter can propose (Medusa: its head count).
            With a tree (``tree=``, or a drafter's own, like lookahead's): None or "auto" chooses
            per window between the tree and K = 0 (plain decoding); an int runs the tree every
            round and must be its node count N (as vLLM's ``num_speculative_tokens`` with a
            ``speculative_token_tree``).
        compile: compile each round (and prefill) into one graph; False runs the same code eagerly.
        backend: the torch.compile backend for those graphs ("specfx": the pass pipeline then
            Inductor; "specfx_eager": the passes, then the graph runs eagerly; or any Dynamo backend).
        rounds_per_sync: rounds launched between host reads of the finished flags (>= 1).
            Larger values sync less; finished rows idle in the extra rounds.
        overlap_reads: read the finished flags one round late: launch round i + 1, then wait
            for round i's flags (copied to pinned host memory behind it), so the device always
            has the next round queued and never waits on the host. A generation then ends one
            (inert) round later than it could. None (default): on for CUDA, off elsewhere (on a
            CPU a launch is the work itself, so there is nothing to overlap). Streamers,
            stopping criteria, output_scores/logits and "auto" read every round, as before.
        prefill_buckets: prompt lengths prefill is compiled for; a prompt is left-padded up to
            the next bucket (longer prompts use multiples of the largest bucket) where a graph is
            made per width (``compile_prefill``, or a drafter with hidden-state taps); an eager
            prefill otherwise runs at the longest prompt's width.
        min_capacity: smallest KV-buffer length per row; buffers grow in powers of two.
        auto_k_values: the K values "auto" chooses from (increasing, each in
            1..MAX_SPECULATIVE_TOKENS); each one used costs one compiled round graph.
        auto_k_cost: for "auto", a fixed cost model instead of timing rounds: one more proposal
            (a draft step plus one more verified position) costs ``auto_k_cost`` times a round
            of K = 0 (a tree: as many as the tokens its forward adds, its scratch slots).
            None (default): measured (``auto_k_times``, or timed by the generator).
        auto_k_times: for "auto", round times per K (any unit; at least K = 0 and one other K,
            interpolated linearly between; key None: a tree round's time) instead of timing the
            rounds; e.g. a generator's measured ``spec.auto_k.times``, to reproduce its K choices
            (and so a seeded sampling run) exactly elsewhere. None (default): timed before the
            first call of each graph shape.
        compile_prefill: also compile prefill (one graph per batch bucket, prompt bucket and
            capacity). False (default): prefill, one forward per call, runs eagerly, so new
            prompt lengths never compile anything.
        max_graphs: compiled round/prefill graphs kept per generator (least recently used
            evicted first, with the memory they hold); a graph whose buffer capacity is
            outgrown is evicted at once. None (default): 16 per K a round may use (16 for a
            fixed K or a tree, 80 for "auto" with the default ``auto_k_values``).
        live_kv: attention reads only the KV slots a call can see (the ``live_kv`` graph pass,
            :mod:`specfx.passes.rewrites.live_kv`): the first ``L`` of the buffer's slots, ``L`` the
            call's last position (prompt width + max_new_tokens + K + 2) rounded up to the
            smallest bucket, 64 (True, default) or the int given, and above it to a quarter-octave
            step (64, 80, 96, 112, 128, 160, ...: at most 25 % more slots than needed;
            :func:`specfx.engine.graphs.quarter_octave`), and to the capacity at most. One
            compiled graph per such bound. False: attention reads the whole buffer. Only
            the "specfx"/"specfx_eager" backends run the pass; output is the same either way.
        tree: a token tree (:class:`specfx.TokenTree`, or a list of nodes such as
            ``[(0,), (1,), (0, 0)]``) verified instead of a chain: in the windows "auto" chooses
            it (``num_speculative_tokens`` unset), or every round (``num_speculative_tokens`` =
            its node count); a tree that is a chain of K is exactly K. None: a chain.
        background_compile: compile round graphs on a worker thread while the rounds run
            eagerly (the same code: the same tokens), switching to each graph once it is ready,
            so no call waits minutes for a compile (decision 67; ``spec.wait_for_graphs()``
            waits for them). None (default): on with the "specfx" backend (Inductor) on a CPU,
            off elsewhere (on CUDA it is not measured yet). True/False force it (any backend).
        inductor_options: Inductor settings for specfx's own graphs only (rounds, prefills), e.g.
            ``{"coordinate_descent_tuning": True}`` or ``{"max_autotune": True}``: applied as the
            ``config_patches`` of each of those compiles, never to Inductor's process-wide config,
            so they do not outlive a compile or reach other code. Keys are
            ``torch._inductor.config`` names (dotted for nested ones, as ``"triton.cudagraphs"``).
            Needs the "specfx" backend. None (default): Inductor's defaults (plus CUDA graphs on
            CUDA).
    """

    num_speculative_tokens: int | str | None = None
    compile: bool = True
    backend: Any = "specfx"
    rounds_per_sync: int = 1
    overlap_reads: bool | None = None
    prefill_buckets: tuple[int, ...] = (16, 64, 256, 1024)
    min_capacity: int = 256
    auto_k_values: tuple[int, ...] = (1, 2, 4, 8)
    auto_k_cost: float | None = None
    auto_k_times: Any = None
    compile_prefill: bool = False
    max_graphs: int | None = None
    live_kv: bool | int = True
    tree: Any = None
    background_compile: bool | None = None
    inductor_options: Any = None

    def __post_init__(self):
        k = self.num_speculative_tokens
        top = MAX_SPECULATIVE_TOKENS
        if self.tree is not None:
            from specfx.trees.types import MAX_TREE_NODES, DynamicTree, TokenTree

            if not isinstance(self.tree, DynamicTree):
                object.__setattr__(self, "tree", TokenTree(self.tree))
            top = max(top, MAX_TREE_NODES)  # with a tree, K is its node count
        if k is not None and k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= top):
            raise ValueError(
                f"num_speculative_tokens must be an int in [1, {top}], got {k!r}. "
                f"Typical values are 2 to 8; or {AUTO!r} to choose K per round."
            )
        if self.tree is not None:
            check_tree_k(k, self.tree, "tree=...")
        a = self.auto_k_values
        if (
            not isinstance(a, tuple)
            or not a
            or any(isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_SPECULATIVE_TOKENS for x in a)
            or list(a) != sorted(set(a))
        ):
            raise ValueError(
                f"auto_k_values must be a tuple of increasing ints in [1, {MAX_SPECULATIVE_TOKENS}], got {a!r} "
                f"(e.g. (1, 2, 4, 8))."
            )
        c = self.auto_k_cost
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c < float("inf")):
            raise ValueError(f"auto_k_cost must be None or a finite number >= 0, got {c!r}.")
        t = self.auto_k_times
        if t is not None:
            if c is not None:
                raise ValueError("auto_k_cost and auto_k_times are two cost models for 'auto'; pass one of them.")
            ok = isinstance(t, Mapping) and 0 in t and len(t) >= 2
            ok = ok and all(
                k is None or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_SPECULATIVE_TOKENS)
                for k in t
            )
            ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < float("inf") for v in t.values())
            if not ok:
                raise ValueError(
                    f"auto_k_times must map K (0 and at least one K in [1, {MAX_SPECULATIVE_TOKENS}], or None for a "
                    f"tree round) to a positive round time, e.g. {{0: 1.0, 8: 2.5}} (a generator's "
                    f"spec.auto_k.times), got {t!r}."
                )
            object.__setattr__(self, "auto_k_times", {k if k is None else int(k): float(v) for k, v in t.items()})
        for name in ("compile", "compile_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        g = self.max_graphs
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(
                f"max_graphs must be None or an int >= 1 (compiled graphs kept per generator), got {g!r}."
            )
        r = self.rounds_per_sync
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"rounds_per_sync must be an int >= 1, got {r!r}.")
        if not (self.overlap_reads is None or isinstance(self.overlap_reads, bool)):
            raise ValueError(f"overlap_reads must be None, True or False, got {self.overlap_reads!r}.")
        if not (self.background_compile is None or isinstance(self.background_compile, bool)):
            raise ValueError(f"background_compile must be None, True or False, got {self.background_compile!r}.")
        b = self.prefill_buckets
        if not b or any(not isinstance(x, int) or x < 1 for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"prefill_buckets must be increasing positive ints, got {b!r}.")
        if not isinstance(self.min_capacity, int) or self.min_capacity < 8:
            raise ValueError(f"min_capacity must be an int >= 8, got {self.min_capacity!r}.")
        lk = self.live_kv
        if not (isinstance(lk, bool) or (isinstance(lk, int) and lk >= 8 and lk & (lk - 1) == 0)):
            raise ValueError(
                f"live_kv must be True, False or a power of two >= 8 (the smallest live-KV bucket), got {lk!r}."
            )
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"backend must be a backend name or a callable, got {self.backend!r}.")
        if self.inductor_options is not None:
            object.__setattr__(self, "inductor_options", check_inductor_options(self.inductor_options, self.backend))

    @property
    def k_values(self) -> tuple[int, ...]:
        """The K values rounds may use: ``auto_k_values`` for "auto" (and the default, None),
        else ``(K,)``."""
        k = self.num_speculative_tokens
        return self.auto_k_values if k is None or k == AUTO else (k,)

    @staticmethod
    def batch_bucket(batch: int) -> int:
        """Batch sizes run in power-of-two buckets (inert padding rows fill the rest), so a
        new batch size compiles at most once per bucket."""
        return 1 << (batch - 1).bit_length()

    def bucket(self, length: int) -> int:
        for b in self.prefill_buckets:
            if length <= b:
                return b
        top = self.prefill_buckets[-1]
        return -(-length // top) * top


def check_inductor_options(options, backend) -> dict:
    """``SpecConfig.inductor_options`` as a plain dict, or a ValueError naming what is wrong."""
    if not isinstance(options, Mapping):
        raise ValueError(
            f"inductor_options must be a dict of torch._inductor.config settings, e.g. "
            f"{{'coordinate_descent_tuning': True}}, got {options!r}."
        )
    if backend != "specfx":
        raise ValueError(
            f"inductor_options apply to Inductor compiles, which only backend='specfx' runs; got backend={backend!r}. "
            "Use backend='specfx', or drop inductor_options."
        )
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = [k for k in options if not isinstance(k, str) or k not in known]
    if unknown:
        raise ValueError(
            f"inductor_options: {unknown!r} are not torch._inductor.config settings "
            "(nested ones are dotted, e.g. 'triton.cudagraphs')."
        )
    return dict(options)


def check_tree_k(k, tree, where: str) -> None:
    """With a tree, an int ``num_speculative_tokens`` is its node count and runs the tree every
    round; refuse any other int (None and "auto" pass: the tree or K = 0 per window)."""
    if isinstance(k, int) and not isinstance(k, bool) and k != tree.size:
        raise ValueError(
            f"speculate({where}, num_speculative_tokens={k}): each round verifies a tree of {tree.size} nodes, "
            f"and with a tree num_speculative_tokens is its node count; pass num_speculative_tokens={tree.size} "
            f"to run the tree every round, or leave it unset ('auto': the tree, or plain decoding in the "
            f"windows where the tree does not pay)."
        )
