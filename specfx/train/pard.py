"""``specfx train --head pard``: PARD's training objective (An et al., arXiv 2504.18583) for a
small causal LM over the target's vocabulary, so that one forward over the real tokens followed
by K - 1 mask tokens predicts K future tokens (:class:`specfx.drafters.pard.Pard`).

Facts from the reference training script (AMD-AGI/PARD at commit
6f279bf3f1680e0b5d71c562ca5b91bdeef4c038, ``pard/pard_train.py``, its data collator), rebuilt
here as a list of entries rather than copies of the sequence:

* a window ``x_0 .. x_{T-1}`` becomes one sequence of *entries*: the real tokens (depth 0, at
  position t, predicting ``x_{t+1}``: the ordinary next-token loss, which the reference keeps)
  and, for each real token t and depth ``j = 1 .. K - 1``, a mask token at position ``t + j``
  predicting ``x_{t+1+j}`` (K: the reference's ``para_num``, 8 in its example configs; the
  mask id: ``unused_tokenids``, one id repeated there, saved as ``config.pard_token``);
* entry (t, j) attends to the real tokens ``0 .. t`` and to the masks (t, 1 .. j): what the
  drafter's forward sees at inference, where the masks follow the last real token at
  consecutive positions. One explicit 4-D float mask (0 / -inf) and explicit position ids;
* COD (conditional drop-token): depth j keeps ``int(T * max(r**j, r_min))`` mask entries, drawn
  at random among the anchors t kept at depth j - 1 (so every kept mask has its whole chain of
  shallower masks); real tokens are always kept. The reference's ``down_sample_ration`` r = 0.7
  and ``down_sample_ration_min`` r_min = 0.2 (example configs; the script's defaults, 1 and 0,
  turn COD off). One draw per batch, as the reference's, from a generator seeded with
  ``(seed, step)``; evaluation keeps every entry;
* the loss is the mean cross-entropy over every kept entry against the data's token (hard
  labels, no distillation: PARD's draft is target-independent). ``--pard-distill w`` (not the
  reference's; default 0) mixes in the target's distribution where the entry's token is
  predicted: ``(1 - w) CE(data token) + w CE(softmax(target logits at position t + j))``, the
  target's next-token distribution given the real tokens up to ``t + j`` (what a chain of
  accepted proposals would have given it), as ``--head draft`` distils a draft model.

Differences, deliberately: entries whose target lies past the window are not built (the
reference builds them with label -100), nor the reference's masks with no real token before
them (its copy ``j`` at column ``j - 1``, trained to predict ``x_j`` from masks alone); the
reference also drops the loss on end-of-sequence tokens (its pad token), windows of a token
stream here have none to drop.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F

from specfx.drafters.pard import mask_token_of, serving_config
from specfx.train.heads import DraftTrain, soft_ce

__all__ = ["PardTrain", "cod_keep", "default_mask_token", "pard_layout"]


def cod_keep(length: int, k: int, ratio: float, minimum: float, rng: np.random.Generator | None) -> list[np.ndarray]:
    """The anchors t kept at each mask depth ``j = 1 .. k - 1`` (sorted arrays; index ``j - 1``).

    Depth j's candidates are the anchors kept at depth ``j - 1`` whose target ``x_{t+1+j}`` lies
    in the window (``t <= length - 2 - j``); it keeps ``int(length * max(ratio**j, minimum))``
    of them at random (``rng`` None or ratio 1: all)."""
    prev = np.arange(length)
    kept = []
    for j in range(1, k):
        cand = prev[prev <= length - 2 - j]
        if rng is not None and ratio < 1:
            n = min(len(cand), int(length * max(ratio**j, minimum)))
            cand = np.sort(rng.permutation(cand)[:n])
        kept.append(cand)
        prev = cand
    return kept


def pard_layout(ids: torch.Tensor, k: int, mask_token: int, kept: list[np.ndarray]):
    """The training sequence of windows ``ids [B, T]``: ``(input_ids [B, S], position_ids [B, S],
    attention_mask [B, 1, S, S] float 0/-inf, labels [B, S], depth [S])``. Entries: the T real
    tokens, then for each depth j the masks standing after the anchors ``kept[j - 1]``."""
    b, t = ids.shape
    device = ids.device  # the layout is built where the windows are: torch.where mixes no devices (CUDA)
    anchor = [np.arange(t)] + list(kept)
    anchors = torch.from_numpy(np.concatenate(anchor)).long().to(device)
    depth = torch.cat([torch.full((len(a),), j, dtype=torch.long, device=device) for j, a in enumerate(anchor)])
    pos = anchors + depth
    s = len(anchors)
    tokens = torch.where(depth == 0, ids[:, anchors.clamp(max=t - 1)], torch.full((b, s), mask_token, device=device))
    target_at = (anchors + 1 + depth).clamp(max=t - 1)
    labels = ids[:, target_at].clone()
    labels[:, (anchors + 1 + depth) > t - 1] = -100  # the last real token predicts nothing here
    # query (a, j) sees real keys at anchors <= a, and masks (a, 1..j) of its own anchor
    qa, qd = anchors[:, None], depth[:, None]
    ka, kd = anchors[None, :], depth[None, :]
    visible = ((kd == 0) & (ka <= qa)) | ((kd >= 1) & (ka == qa) & (kd <= qd))
    mask = torch.zeros(s, s, device=device).masked_fill(~visible, float("-inf"))
    return tokens, pos.expand(b, -1), mask.expand(b, 1, s, s), labels, depth


def default_mask_token(config, tokenizer) -> int:
    """The mask id when ``--pard-token`` is not given: the vocabulary must stay the target's, so
    an existing id the tokenizer never produces: the first id past the tokenizer's vocabulary when
    the embedding table is padded beyond it (as Qwen's PARD drafts use 151665), else the
    config's pad token when it is neither BOS nor EOS, else the last id."""
    vocab = config.get_text_config().vocab_size
    if tokenizer is not None and len(tokenizer) < vocab:
        return len(tokenizer)
    tc = config.get_text_config()
    specials = {getattr(tc, "bos_token_id", None), getattr(tc, "eos_token_id", None)}
    pad = getattr(tc, "pad_token_id", None)
    if isinstance(pad, int) and pad not in specials:
        return pad
    return vocab - 1


class PardTrain(DraftTrain):
    """A PARD draft (``--head pard``): the ``--head draft`` model (``--init`` or a fresh small
    Llama), trained on PARD's objective against the data's tokens; reads neither the target's
    features nor its logits (with ``distill`` > 0 it reads the logits). The mask id: ``--pard-token``, else an ``--init`` PARD draft's own
    ``pard_token``, else :func:`default_mask_token`. Saved with ``config.pard_token`` and ``config.spd_type = "pard"``,
    the layout :class:`~specfx.drafters.pard.Pard`, vLLM and SGLang read."""

    kind = "pard"
    reads_target = False

    def __init__(self, runner, init, seed, layers, hidden, tokenizer, k, mask_token, cod_ratio, cod_min, distill=0.0):
        super().__init__(runner, init, seed, layers, hidden, tokenizer)
        vocab = self.module.config.get_text_config().vocab_size
        if mask_token is None:  # an --init PARD draft keeps its own; else the default
            mask_token = mask_token_of(self.module)
        if mask_token is None:
            mask_token = default_mask_token(runner.model.config, tokenizer)
        if not 0 <= mask_token < vocab:
            raise ValueError(f"--pard-token {mask_token} is outside the draft's vocabulary (0..{vocab - 1}).")
        if vocab != runner.vocab_size:
            raise ValueError(f"--init: the draft's vocabulary ({vocab}) is not the target's ({runner.vocab_size}).")
        self.module.config.pard_token = int(mask_token)
        self.module.config.spd_type = "pard"
        self.k, self.mask_token, self.seed = k, int(mask_token), seed
        self.cod_ratio, self.cod_min = cod_ratio, cod_min
        self.distill = float(distill)
        self.reads_target = self.distill > 0  # the target's logits, no taps
        self.depth_acc: list[float] = []

    def save(self, path):
        """``save_pretrained`` (the tokenizer too), its config.json made what vLLM reads
        (:func:`~specfx.drafters.pard.serving_config`)."""
        path = super().save(path)
        file = path / "config.json"
        config = serving_config(json.loads(file.read_text()), self.mask_token)
        file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return path

    def loss(self, ids, features, logits, step=None, mask=None):
        rng = None if step is None else np.random.default_rng([self.seed, step, 7])
        kept = cod_keep(ids.shape[1], self.k, self.cod_ratio, self.cod_min, rng)
        tokens, pos, attention, labels, depth = pard_layout(ids, self.k, self.mask_token, kept)
        if mask is not None:  # --assistant-only-loss: entry (t, j)'s label is token t + 1 + j
            labels = labels.masked_fill(mask[:, (pos[0] + 1).clamp(max=ids.shape[1] - 1)] == 0, -100)
        out = self.module(input_ids=tokens, position_ids=pos, attention_mask=attention).logits
        loss = F.cross_entropy(out.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        valid = labels >= 0
        if not valid.any():  # no assistant label in these windows: nothing to learn (not NaN)
            loss = out.float().sum() * 0
        if self.distill > 0:  # entry (t, j) predicts x_{t+1+j}: the target's logits at position t + j
            teacher = logits[:, pos[0].clamp(max=ids.shape[1] - 1)]  # [B, S, V]
            loss = (1 - self.distill) * loss + self.distill * soft_ce(out[valid], teacher[valid])
        hit = (out.argmax(-1) == labels) & valid
        self.depth_acc = [
            (hit[:, depth == j].sum() / valid[:, depth == j].sum().clamp(min=1)).item() for j in range(self.k)
        ]
        return loss, (hit.sum() / valid.sum().clamp(min=1)).item()
