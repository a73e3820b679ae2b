"""PARD (PARallel Draft, arXiv 2504.18583): a small causal LM sharing the target's vocabulary,
fine-tuned so that one forward over the real tokens followed by K - 1 copies of a *mask token*
predicts K future tokens at once. ``speculate(model, draft=Pard(pard_model))``.

What carries over from the reference implementation (AMD-AGI/PARD at commit
6f279bf3f1680e0b5d71c562ca5b91bdeef4c038, ``pard/pard_infer.py`` and ``pard/pard_train.py``):

* the mask token id is the checkpoint config's ``pard_token`` field (``spd_type`` is
  ``"pard"``; PARD-2 checkpoints set ``"pard2"`` and run here in their target-independent mode:
  the plain causal LM, without the target's hidden-state features);
* the K - 1 mask tokens are appended after the real tokens at consecutive positions (the
  reference's ``cache_position`` continues past the last real token), in one causal forward:
  mask j attends to the real tokens and to the masks before it, as in training, where the mask
  at position p sees the real tokens up to the one it stands after plus the masks between;
* the logits at the last real position and at the K - 1 masks are the K proposals (the
  reference's ``logits[:, -K:]``).
"""

from __future__ import annotations

import torch

from specfx.drafters.base import Drafter, TreeDrafting
from specfx.drafters.draft_model import check_draft_runner
from specfx.drafters.drafting import draft_token
from specfx.drafters.heads.eagle_checkpoint import rope_keys
from specfx.model.load import NO_HUB_KERNELS
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_positional_tree

__all__ = ["Pard", "from_name", "serving_config"]

# The config field naming the mask token, as PARD checkpoints (and the reference's training
# script) write it.
MASK_TOKEN_FIELD = "pard_token"


def mask_token_of(model) -> int | None:
    """The mask token id a PARD checkpoint's config names (``pard_token``), or None."""
    config = model.config
    value = getattr(config, MASK_TOKEN_FIELD, None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), MASK_TOKEN_FIELD, None)
    if isinstance(value, (list, tuple)):  # a list of ids (the training config's form): the first
        value = value[0] if value else None
    return value


def serving_config(config: dict, mask_token_id: int) -> dict:
    """A PARD draft's config.json ``config`` (a dict, as ``save_pretrained`` writes it) made what
    the serving engines read (decision 77 of docs/ARCHITECTURE.md): the mask id as an int
    ``pard_token`` (vLLM's parallel drafting reads it for ``method="draft_model"`` with
    ``parallel_drafting``), ``spd_type`` ``"pard"`` (the reference's), no top-level
    ``mask_token_id`` naming another id (vLLM reads that one first), and the rotary base at the
    top level as well as in ``rope_parameters`` (which readers on transformers 4 ignore)."""
    out = dict(config, pard_token=int(mask_token_id), spd_type="pard")
    if out.get("mask_token_id") is not None:
        out["mask_token_id"] = int(mask_token_id)
    text = out
    if isinstance(out.get("text_config"), dict):  # a composite model: its language model's config
        text = out["text_config"] = dict(out["text_config"])
    if text.get("rope_parameters"):  # a rotary model saved by transformers 5
        for key, value in rope_keys(text).items():
            text.setdefault(key, value)
    return out


class Pard(TreeDrafting, Drafter):
    """A PARD draft model: K proposals from one draft forward of fixed shape per round.

    Each round's draft forward feeds ``W + K`` tokens per row (``W``: the largest K any round of
    the generator may use, at least this round's K): the committed tokens at positions
    ``L - W .. L - 1``, the pending token at ``L`` and K - 1 mask tokens at ``L + 1 .. L + K - 1``,
    each at slot == position. Proposal i comes from the logits at ``L + i``.

    Cache invariant: at a round's start the draft's KV holds the committed tokens' KV at every
    position up to ``L - W - 1`` (L = position of the pending token). Slots from ``L - W`` on may
    hold *mask* KV written by the previous round, which is scratch and never read as committed:
    the previous round wrote real KV up to its own pending position ``L'`` and mask KV at
    ``L' + 1 .. L' + K' - 1``; it emitted ``n <= K' + 1 <= W + 1`` tokens, so ``L = L' + n`` and
    ``L - W <= L' + 1``: the window rewrites every slot that changed from a mask to an accepted
    token (rewriting a slot with the same token at the same position gives the same KV). Within
    the forward each layer writes the window's KV before any query reads it, and a query at
    position p sees slots ``<= p`` only, so no query ever reads a stale mask slot. After the
    round the draft's cache is what it would be had it seen only the emitted tokens up to ``L``
    (past it: scratch, overwritten by the next round before any query reaches it).

    Positions before a row's first token (a short prompt, ``L - W < 0``) are fed at position 0
    to the trash slot, like prefill's padding: they see slot 0 only and nothing real sees them.

    K = 0 rounds ("auto"'s plain decoding) leave the draft's cache behind, so the drafter is not
    ``resumable``.

    Token trees (``speculate(tree=TokenTree)``, decision 100): the same forward with D - 1 masks
    (D: the tree's depth) gives one distribution per depth that does not depend on the path (the
    masks stand where the path's tokens would), so the node with child ranks ``(r_1, ..., r_d)``
    gets the ``r_d``-th most likely token at depth d, as Medusa fills its trees from its heads.
    The window is then the round's largest depth: a tree round accepts at most D proposals, so
    the invariant above holds with D for K. Tree nodes are deterministic choices (q one-hot), so
    sampling stays lossless.
    """

    name = "pard"

    def __init__(self, model, mask_token_id: int | None = None):
        if mask_token_id is None:
            mask_token_id = mask_token_of(model)
        if mask_token_id is None:
            raise ValueError(
                f"Pard: {type(model).__name__}'s config has no {MASK_TOKEN_FIELD!r} field, so the mask token "
                f"PARD appends after the real tokens is unknown; a PARD checkpoint names it there. Pass it as "
                f"Pard(model, mask_token_id=ID) (the id the draft was trained with), or use the model as an "
                f"ordinary draft model: speculate(target, draft=model)."
            )
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int):
            raise ValueError(f"Pard: mask_token_id must be an int token id, got {mask_token_id!r}.")
        self.runner = ModelRunner(model, role="draft")
        if self.runner.stateful:
            raise ValueError(
                f"Pard: {type(model).__name__} keeps recurrent or linear-attention state, which would absorb "
                f"the mask tokens PARD appends every round; specfx rolls a draft's state back only along "
                f"its own chain (decision 81). Use it as an ordinary draft model: speculate(target, draft=model)."
            )
        self.model = model
        if not 0 <= mask_token_id < self.runner.vocab_size:
            raise ValueError(
                f"Pard: mask_token_id={mask_token_id} is outside the draft's vocabulary (0..{self.runner.vocab_size - 1}); "
                f"pass the id the draft was trained with (its config's {MASK_TOKEN_FIELD!r})."
            )
        self.mask_token_id = mask_token_id

    def __repr__(self) -> str:
        return f"Pard({type(self.model).__name__}, mask_token_id={self.mask_token_id})"

    def bind(self, target: ModelRunner) -> None:
        check_draft_runner(self.runner, target, "PARD draft")

    def allocate(self, batch_size: int, capacity: int) -> None:
        self.runner.allocate(batch_size, capacity)

    def prefill(self, ids, positions, slots) -> None:
        # Only the KV is needed (positions 0 .. P - 1; the pending token is written by the first round)
        self.runner.forward(ids, positions, slots, last_only=True)

    def window(self, ctx) -> int:
        """W: committed positions before the pending one each round rewrites. The most proposals
        any round of this generator may accept (K, a tree's depth; the state keeps one statistic
        per position, a graph constant), so that rounds of different K ("auto") keep the
        invariant too."""
        return max(depth_of(ctx), ctx.state.per_position.shape[0])

    def draft_logits(self, ctx) -> torch.Tensor:
        """The one draft forward of a round: logits ``[B, K, V]`` at positions ``L .. L + K - 1``
        (K: the chain's length, or the tree's depth)."""
        k, back = depth_of(ctx), self.window(ctx)
        lengths = ctx.lengths  # [B]
        offsets = torch.arange(-back, k, device=lengths.device)  # [W + K]
        pos = lengths.unsqueeze(1) + offsets  # [B, W + K]
        real = pos >= 0
        committed = torch.minimum(pos, lengths.unsqueeze(1)).clamp_min(0)  # in range for the gather
        ids = torch.where(offsets > 0, self.mask_token_id, ctx.tokens.gather(1, committed))
        slots = torch.where(real, pos, self.runner.cache.trash_slot)
        logits = self.runner.forward(ids, pos.clamp_min(0), slots)  # [B, W + K, V]
        return logits[:, back:]

    def propose(self, ctx):
        logits = self.draft_logits(ctx)  # [B, K, V]
        proposals: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for i in range(ctx.k):
            # q at position L + i comes from this forward alone (masks, not the earlier
            # proposals, stand before it): sampling from it is still exact rejection sampling
            draft_token(ctx, logits[:, i : i + 1], i, proposals, qs)
        return torch.cat(proposals, dim=1), torch.cat(qs, dim=1) if qs else None

    def propose_tree(self, ctx) -> torch.Tensor:
        return draft_positional_tree(ctx, self.draft_logits(ctx))  # [B, D, V]: depth d from position L + d - 1


def depth_of(ctx) -> int:
    """Proposals along one path this round: the chain's K or the tree's depth."""
    return ctx.k if ctx.token_tree is None else ctx.token_tree.depth


def from_name(arg: str | None) -> Pard:
    """``draft="pard:DIR"``: a PARD checkpoint directory (safetensors weights; no remote code),
    its mask token from the config's ``pard_token``."""
    if not arg:
        raise ValueError(
            "draft='pard' needs the PARD checkpoint's directory: draft='pard:/path/to/pard-model', or pass "
            "draft=specfx.drafters.pard.Pard(model) with a loaded model."
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(arg, use_safetensors=True, trust_remote_code=False, **NO_HUB_KERNELS)
    return Pard(model.eval())
