"""``specfx train --head dflash``: DFlash's block objective (z-lab, arXiv 2602.06036) for a draft
over the target's tapped hidden states (:class:`specfx.drafters.heads.dflash.DFlash`).

z-lab's repository (z-lab/dflash at 44947fbf71114e241c96de194f4b382b5dd330d0) ships the draft
model and its inference, not its training code ("the training recipe soon"). The objective here
follows the paper and the open trainer that writes z-lab's layout, SpecForge
(sgl-project/SpecForge at 507da3e55d0072a3718c53f3baa702b6986e9b33, ``specforge/core/dflash.py``,
``OnlineDFlashModel``), fact for fact:

* *anchors*: per window, up to ``--dflash-anchors`` positions ``a`` drawn at random without
  replacement among ``0 .. T - block_size`` (sorted), from a generator seeded with
  ``(seed, step)``; evaluation takes them evenly spread instead, so it is deterministic; with
  ``--assistant-only-loss`` each row draws its own, first among its marked positions (SpecForge
  draws them on its loss mask), and only labels in assistant turns are scored;
* each anchor's *block*: the real token ``x_a`` then ``block_size - 1`` mask tokens, at positions
  ``a .. a + block_size - 1``, embedded with the target's embedding (not trained);
* attention: a block's queries see the context (``hidden_norm(fc(taps))`` of the window's
  tokens) strictly before its anchor, as at inference where the pending token's hidden state
  does not exist yet, and their own block bidirectionally; blocks never see each other;
* block position ``k = 1 .. block_size - 1`` predicts ``x_{a+k}`` (hard labels from the data,
  through the target's LM head, not trained); position 0 (the anchor) and labels past the window
  carry no loss; the loss is the weighted mean cross-entropy, weight ``exp(-(k - 1) / gamma)``
  with ``--dflash-gamma`` (off by default, as SpecForge's ``loss_decay_gamma=None``);
* ``--dflash-distill w`` (not the reference's: its labels are hard) mixes in the target's
  distribution at the label's predecessor, ``(1 - w)`` hard plus ``w`` soft cross-entropy per
  entry, as ``--pard-distill`` does for PARD (the EAGLE heads' loss is the soft one).

The context's keys are computed afresh per window (no cache); the forward is
:meth:`~specfx.drafters.heads.dflash_head.DFlashHead.blocks`, the layers the drafter runs, so what
is saved (:meth:`DFlash.save`, z-lab's layout) is what ``speculate()`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specfx.drafters.heads.dflash import DFlash
from specfx.train.heads import TrainHead

__all__ = ["DFlashTrain", "block_layout"]


def block_layout(length: int, block_size: int, anchors: torch.Tensor):
    """For anchors ``[N]`` (or ``[B, N]``, a row's own) in a window of ``length`` tokens:
    ``(positions [N*n], visible [N*n, length], within [N*n, N*n], offset [N*n])`` (n =
    block_size; positions and visible with the anchors' leading ``B``): each block query's
    position, the context it sees (tokens strictly before its anchor), the block it sees (its
    own), and its offset k in the block."""
    n, count = block_size, anchors.shape[-1]
    offset = torch.arange(n, device=anchors.device).repeat(count)  # [N*n]
    anchor = anchors.repeat_interleave(n, dim=-1)  # [..., N*n]
    visible = torch.arange(length, device=anchors.device) < anchor.unsqueeze(-1)
    block = torch.arange(count, device=anchors.device).repeat_interleave(n)
    return anchor + offset, visible, block.unsqueeze(1) == block.unsqueeze(0), offset


def at_positions(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``rows [B, T]`` at block positions ``pos [N*n]`` or ``[B, N*n]`` (past the window: the last)."""
    return rows.gather(1, pos.clamp(max=rows.shape[1] - 1).expand(rows.shape[0], -1))


class DFlashTrain(TrainHead):
    """A DFlash draft (``--head dflash``): ``--init DIR`` or a fresh one for the target
    (``--dflash-block``, ``--draft-layers``, the reference's default taps, ``--dflash-token``),
    trained on its block objective against the data's tokens."""

    kind = "dflash"

    def __init__(self, runner, init, seed, block_size, layers, mask_token, anchors, gamma, taps=None, distill=0.0):
        if init is not None:
            if taps is not None:
                raise ValueError("--dflash-taps: an --init draft reads the taps its config names; leave the flag out.")
            drafter = DFlash(init)
        else:
            vocab = runner.model.get_input_embeddings().weight.shape[0]
            token = vocab - 1 if mask_token is None else mask_token
            if taps is not None and len(set(taps)) != len(taps):  # the range is bind()'s to check
                raise ValueError(f"--dflash-taps {taps}: name each target layer once.")
            drafter = DFlash.random(
                runner.model, block_size=block_size, num_layers=layers, layer_ids=taps, mask_token_id=token, seed=seed
            )
        drafter.bind(runner)
        self.drafter, self.taps, self.module = drafter, drafter.taps, drafter.head.train()
        self.seed, self.anchors, self.gamma, self.distill = seed, anchors, gamma, float(distill)
        self.mask_token = drafter.head.mask_token_id
        self.depth_acc: list[float] = []

    def draw_anchors(self, length: int, step: int | None, device, mask=None) -> torch.Tensor:
        """``[N]`` sorted anchors in ``0 .. length - block_size``: random at a training step,
        evenly spread when evaluating. At a training step with label masks ``mask [B, T]``
        (``--assistant-only-loss``), ``[B, N]``: each row's own, drawn first among its marked
        positions (as SpecForge draws them on its loss mask), then among the rest."""
        last = length - self.drafter.head.block_size
        n = min(self.anchors, last + 1)
        if step is None:
            return torch.linspace(0, last, n, device=device).round().long().unique()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if mask is None:
            return torch.randperm(last + 1, generator=g)[:n].sort().values.to(device)
        keys = torch.rand(mask.shape[0], last + 1, generator=g) + (mask[:, : last + 1].cpu() == 0)  # marked first
        return keys.argsort(dim=1)[:, :n].sort(dim=1).values.to(device)

    def block_logits(self, ids, features, anchors):
        """Draft logits ``[B, N*n, V]`` of the blocks at ``anchors [N]`` over windows ``ids [B, T]``
        with the target's tapped ``features``, and the layout (:func:`block_layout`)."""
        head, drafter = self.drafter.head, self.drafter
        b, t = ids.shape
        pos, visible, within, offset = block_layout(t, head.block_size, anchors)
        states = torch.cat([features[i] for i in drafter.tap_order], dim=-1).to(head.fc.weight.dtype)
        context = head.context(states)  # [B, T, H]
        blocks = torch.where(offset == 0, at_positions(ids, pos), self.mask_token)  # [B, N*n]
        with torch.no_grad():  # the target's embedding module as the round calls it, not trained
            noise = drafter.target.model.get_input_embeddings()(blocks).to(context.dtype)
        ctx_pos = torch.arange(t, device=ids.device).expand(b, -1)
        out = head.blocks(noise, pos.expand(b, -1), context, ctx_pos, visible.expand(b, -1, -1), within)
        lm = drafter.target.model.get_output_embeddings()  # read detached: never trained
        bias = lm.bias.detach() if getattr(lm, "bias", None) is not None else None
        return F.linear(out, lm.weight.detach(), bias), (pos, offset)

    def loss(self, ids, features, logits, step=None, mask=None):
        b, t = ids.shape
        block_size = self.drafter.head.block_size
        draft, (pos, offset) = self.block_logits(ids, features, self.draw_anchors(t, step, ids.device, mask))
        labels = at_positions(ids, pos)  # [B, N*n]: block position k predicts x_{a+k}
        scored = ((offset > 0) & (pos < t)).expand(b, -1)  # [B, N*n]: not the anchor, not past the window
        if mask is not None:  # --assistant-only-loss: only labels in assistant turns
            scored = scored & (at_positions(mask, pos) > 0)
        weight = scored.float()
        if self.gamma:
            weight = weight * torch.exp(-(offset - 1).clamp(min=0).float() / self.gamma)
        ce = F.cross_entropy(draft.float().flatten(0, 1), labels.flatten(), reduction="none").view(b, -1)
        if self.distill > 0:  # block position k predicts x_{a+k}: the target's distribution at position a + k - 1
            at = (pos - 1).clamp(min=0, max=t - 1).expand(b, -1)
            teacher = logits.gather(1, at.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, N*n, V]
            soft = -(F.softmax(teacher.float(), -1) * F.log_softmax(draft.float(), -1)).sum(-1)
            ce = (1 - self.distill) * ce + self.distill * soft
        loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
        hit = (draft.argmax(-1) == labels) & scored
        self.depth_acc = [
            (hit[:, offset == k].sum() / scored[:, offset == k].sum().clamp(min=1)).item() for k in range(1, block_size)
        ]
        return loss, (hit.sum() / scored.sum().clamp(min=1)).item()
