"""Planning: what ``speculate()`` decides about the rounds before any call, and the round's shape.

:func:`plan_rounds` turns a :class:`~specfx.config.SpecConfig` and a drafter into a
:class:`Plan`: a chain of K proposals, K chosen per round ("auto"), or a token tree (given, or
the drafter's own) run every round or, with ``num_speculative_tokens`` unset, chosen per
window against K = 0 ("auto" for a tree, decision 68); a tree that is a short chain runs as
that chain; rounds deeper than the drafter can draft are refused. Each round graph then receives
one :class:`RoundShape`, the single home of K, the tree, the Mode and what the buffers need for
them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specfx.config import AUTO, MAX_SPECULATIVE_TOKENS, SpecConfig, check_tree_k
from specfx.drafters.base import branch_slots, shape_refusal
from specfx.model.architectures import inductor_miscompiles
from specfx.sampling.processors import GREEDY, Mode
from specfx.trees.types import DynamicTree, TokenTree

__all__ = ["TREE", "Plan", "RoundShape", "check_stateful", "plan_rounds"]

TREE = None  # the key of a tree round in Plan.shapes (and of its time and windows in "auto")


@dataclass(frozen=True)
class RoundShape:
    """What one round graph verifies, fixed when it is traced (a graph constant: one compiled
    graph per distinct shape; Dynamo guards on these values, so they are plain, hashable ones).

    ``draft_tokens``: tokens drafted per round: K of a chain (0: plain decoding, the drafter
    sits out), the node count N of a tree (what ``RoundContext.k`` holds).
    ``tree``: the round's token tree (:class:`TokenTree` or :class:`DynamicTree`); None: a chain.
    ``scratch_slots``: cache slots past the pending token a round writes: K, or the tree's
    scratch slots plus a branch's (lookahead's window).
    ``max_accepted``: proposals one round may accept: K, or the tree's depth.
    ``mode``: what the round computes over the vocabulary (:class:`Mode`: greedy or sampling,
    and the stages in use). ``collect``: the round also returns the scores and logits its
    tokens were chosen from (``output_scores``/``output_logits``).
    """

    draft_tokens: int
    tree: TokenTree | DynamicTree | None
    scratch_slots: int
    max_accepted: int
    mode: Mode = GREEDY
    collect: bool = False

    @classmethod
    def chain(cls, k: int, mode: Mode = GREEDY, collect: bool = False) -> RoundShape:
        """A chain of ``k`` proposals (0: plain decoding)."""
        return cls(k, None, k, k, mode, collect)

    @classmethod
    def of_tree(
        cls, tree: TokenTree | DynamicTree, branch: int = 0, mode: Mode = GREEDY, collect: bool = False
    ) -> RoundShape:
        """A token-tree round; ``branch``: the query tokens a drafter's branch adds after the nodes."""
        return cls(tree.size, tree, tree.scratch_slots + branch, tree.depth, mode, collect)

    def for_call(self, mode: Mode, collect: bool) -> RoundShape:
        """This shape computing ``mode`` (and collecting scores when ``collect``)."""
        return dataclasses.replace(self, mode=mode, collect=collect)

    @property
    def verifies(self) -> int | TokenTree | DynamicTree:
        """What the graph key names the round by: the tree, or K."""
        return self.tree if self.tree is not None else self.draft_tokens

    @property
    def graph_id(self) -> tuple:
        """The part of a graph key this shape selects: ``(K or tree, mode, collect)``."""
        return (self.verifies, self.mode, self.collect)


@dataclass(frozen=True)
class Plan:
    """The rounds a generator runs, decided once by :func:`plan_rounds`.

    ``config``: the SpecConfig as resolved (a drafter's own tree filled in, a short-chain tree
    replaced by its K, the default "auto" with its values cut to the drafter's depth, or
    "auto" for a tree).
    ``shapes``: the round shapes a call may run, keyed by K (0 included for "auto"); a tree's
    under key :data:`TREE` (None), with K = 0 beside it when "auto" chooses between them.
    ``auto``: the round is chosen per sync window among ``shapes``.
    """

    config: SpecConfig
    shapes: dict
    auto: bool

    @property
    def tree(self) -> TokenTree | DynamicTree | None:
        return self.default.tree

    @property
    def default(self) -> RoundShape:
        """The round a call runs unless "auto" chooses: the tree, or the largest K."""
        return self.shapes[None] if None in self.shapes else self.shapes[max(self.shapes)]

    @property
    def scratch_slots(self) -> int:
        """Slots the buffers keep past the pending token: the most any round writes."""
        return max(s.scratch_slots for s in self.shapes.values())

    @property
    def max_accepted(self) -> int:
        """Per-position statistics kept: the most proposals any round may accept."""
        return max(s.max_accepted for s in self.shapes.values())

    def shape(self, k: int | None = None) -> RoundShape:
        """The shape of K (a chain), or the default round (K None: the tree, else the largest K)."""
        return self.default if k is None else self.shapes[k]


def plan_rounds(config: SpecConfig, drafter, target_runner) -> Plan:
    """Decide the rounds for ``drafter`` on ``target_runner``'s model; ValueError for a round
    they cannot run (a tree the model or drafter refuses, a depth beyond the drafter's).

    ``num_speculative_tokens`` says whether the round is fixed: an int runs a chain of K every
    round, or the tree every round (the int is then its node count, as vLLM's
    ``num_speculative_tokens`` with ``speculative_token_tree``); unset or "auto", the round is
    chosen per sync window among K = 0 and a chain's ``auto_k_values``, or the tree."""
    own_tree = drafter.round_tree()  # a drafter that fixes the round's shape (lookahead)
    if own_tree is not None:
        if config.tree is not None:
            raise ValueError(
                f"the {drafter.name} drafter fixes each round's shape itself ({own_tree.size} nodes); "
                f"drop tree= (set the drafter's own parameters instead)."
            )
        check_tree_k(config.num_speculative_tokens, own_tree, f"draft={drafter.name!r}")
        config = dataclasses.replace(config, tree=own_tree)
    if branch_slots(drafter) and drafter.taps:  # taps are captured per forward shape (N + 1 tokens)
        raise ValueError(f"the {drafter.name} drafter both reads hidden-state taps and adds a branch; unsupported.")
    tree = config.tree
    fixed = config.num_speculative_tokens not in (None, AUTO)
    # a tree that is a short chain runs as that chain (a drafter's own tree always runs as a tree):
    # every round when K is given, else "auto" between it and K = 0
    if own_tree is None and tree is not None and tree.is_chain and tree.size <= MAX_SPECULATIVE_TOKENS:
        k = dict(num_speculative_tokens=tree.size)
        if not fixed:
            k = dict(num_speculative_tokens=AUTO, auto_k_values=(tree.size,))
        config, tree = dataclasses.replace(config, tree=None, **k), None
    if tree is not None:
        for why in (target_runner.tree_refusal(), shape_refusal(drafter, tree)):
            if why is not None:
                where = f"draft={drafter.name!r} (it verifies a token tree each round)" if own_tree else "tree=..."
                raise ValueError(f"speculate({where}): {why}")
    if isinstance(tree, DynamicTree) and tree.branching > target_runner.vocab_size:
        raise ValueError(
            f"speculate(tree={tree!r}): branching={tree.branching} exceeds the target's vocabulary "
            f"of {target_runner.vocab_size} tokens; lower branching."
        )
    if config.num_speculative_tokens is None and tree is None:
        config = default_auto(config, drafter.max_depth)
    check_depth(config, tree, drafter)
    if tree is not None:
        shapes = {TREE: RoundShape.of_tree(tree, branch_slots(drafter))}
        if fixed:
            return Plan(config, shapes, auto=False)
        # "auto" for a tree: the tree or plain decoding, per window (decision 68)
        config = dataclasses.replace(config, num_speculative_tokens=AUTO)
        return Plan(config, {0: RoundShape.chain(0), **shapes}, auto=True)
    auto = config.num_speculative_tokens == AUTO
    if auto:
        check_chain_times(config.auto_k_times)
    ks = (0, *config.k_values) if auto else config.k_values
    return Plan(config, {k: RoundShape.chain(k) for k in ks}, auto=auto)


def check_chain_times(times) -> None:
    """The "auto" of chains needs the time of at least one K >= 1 (key None is a tree's)."""
    if times is not None and not any(k for k in times if k is not TREE):
        raise ValueError(
            f"speculate(auto_k_times={times}): 'auto' chooses a chain's K here, but the times hold none for "
            f"a K >= 1 (key None is a tree round's time); add one, e.g. {{0: 1.0, 8: 2.5}}."
        )


def default_auto(config: SpecConfig, max_depth: int | None) -> SpecConfig:
    """``num_speculative_tokens`` left at its default for a chain: "auto", among the
    ``auto_k_values`` the drafter can propose (all of them when none is too deep for it;
    when every one is, they stay, and :func:`check_depth` says so)."""
    values = tuple(k for k in config.auto_k_values if max_depth is None or k <= max_depth) or config.auto_k_values
    return dataclasses.replace(config, num_speculative_tokens=AUTO, auto_k_values=values)


def check_depth(config: SpecConfig, tree, drafter) -> None:
    """Refuse rounds deeper than the drafter can draft (``Drafter.max_depth``)."""
    limit = drafter.max_depth
    if limit is None:
        return
    if tree is not None:
        if tree.depth > limit:
            raise ValueError(
                f"speculate(tree=...): the tree is {tree.depth} deep, but the {drafter.name} "
                f"drafter proposes at most {limit} tokens along a path; use a tree of depth <= {limit}."
            )
        return
    if max(config.k_values) > limit:
        auto = config.num_speculative_tokens == AUTO
        asked = (
            f"auto_k_values={config.auto_k_values}"
            if auto
            else f"num_speculative_tokens={config.num_speculative_tokens}"
        )
        raise ValueError(
            f"speculate(): {asked} asks for up to {max(config.k_values)} proposals per round, but the "
            f"{drafter.name} drafter proposes at most {limit}; pass "
            f"{'auto_k_values= with values' if auto else 'num_speculative_tokens='} <= {limit}."
        )


def check_stateful(runner, drafter, config) -> None:
    """ValueError for what a target with recurrent or linear-attention state cannot run yet
    (decisions 76, 78, 82 and 86: chain rounds, eager or compiled in the foreground, with a drafter that
    does not run the target's layers, heads reading its hidden states included, MTP where its layers keep
    attention KV only; trees are refused by the runner's own tree refusal)."""
    who = f"{runner.role} ({type(runner.model).__name__}) keeps recurrent or linear-attention state"
    if drafter.runs_target_layers:
        raise ValueError(
            f"{who}, which specfx rolls back only after its own verify forward: the {drafter.name!r} drafter "
            f"runs the target's layers, which would advance that state. Use a draft model or "
            f"draft='prompt_lookup'."
        )
    # the other drafters reading hidden states run exactly (decision 82); MTP where its layers keep KV only (86)
    why = drafter.stateful_target_refusal(runner.model)
    if why is not None:
        raise ValueError(f"{who}: {why}. Use EAGLE-3, DFlash or Medusa heads, a draft model or draft='prompt_lookup'.")
    if config.compile and config.background_compile:
        raise ValueError(
            f"{who}, recorded during a compiled round by hooks attached only while generate() runs: "
            f"a round graph traced in the background could miss them. Leave background_compile unset "
            f"(compiled in the foreground) or pass compile=False to speculate()."
        )
    model_type = getattr(runner.model.config, "model_type", None)
    oldest = inductor_miscompiles(model_type)
    if config.compile and config.backend in ("specfx", "inductor") and oldest:
        raise ValueError(
            f"{who}: torch {torch.__version__}'s Inductor miscompiles the round of model type {model_type!r} "
            f"(the compiled kernel corrupts memory; seen on the CPU with torch 2.11, and torch {oldest} compiles "
            f"it correctly: decision 84). Upgrade torch to >= {oldest}, or pass backend='specfx_eager' (the "
            f"same one round graph, run without Inductor) or compile=False to speculate()."
        )
