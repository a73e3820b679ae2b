"""The heads as ``specfx train`` trains them: each a full-sequence, teacher-forced forward over
a window of the target's features, with the loss its method defines. The trained modules are
the drafters' own (:class:`~specfx.drafters.heads.medusa.Medusa`, :class:`~specfx.drafters.heads.eagle.Eagle`,
:class:`~specfx.drafters.heads.eagle3.Eagle3`), bound to the target's runner, so what is saved with
their ``save()`` is exactly what ``speculate()`` runs. The target's embeddings and LM head are
read detached: the target is never trained and its ``.grad`` never touched.

Notation: a window holds tokens ``x_0 .. x_{T-1}``; the target's forward over it gives logits
``z_t`` (its distribution for ``x_{t+1}``) and the tapped features ``f_t``.

* **Medusa** (Cai et al.): head ``i`` at ``f_t`` predicts the token at ``t + 2 + i``; its label
  is the target's own (greedy) token there, ``argmax z_{t+1+i}``, cross-entropy per head.
* **EAGLE-1** (Li et al.): the entry at ``t`` reads ``(x_t, f_{t-1})`` and predicts ``f_t``:
  smooth-L1 regression on the feature plus 0.1 x cross-entropy of the target's LM head on the
  prediction against the target's distribution ``softmax(z_t)``. The input features carry the
  method's data augmentation, uniform noise U(-0.1, 0.1) (``--feature-noise``), the regression
  targets none.
* **EAGLE-3** (training-time test): step 0 is the teacher-forced pass on the fused features;
  step ``k`` feeds each position the head's own step ``k - 1`` output from the position
  before, and its queries attend as they will at draft depth ``k``: to step-0 entries up to
  ``t - k`` and to the entries of steps ``1..k`` along their own diagonal. Each step's loss is
  the cross-entropy against the target's distribution restricted to the draft vocabulary,
  weighted ``0.8**k``.
* **draft** (``--head draft``): a separate small causal LM, cross-entropy against ``softmax(z_t)``
  at every position (distillation; KL up to a constant).
* **pard** (``--head pard``, :mod:`specfx.train.pard`): the same small causal LM on PARD's
  objective: real tokens plus mask tokens in one forward, hard labels from the data.
* **dflash** (``--head dflash``, :mod:`specfx.train.dflash`): a DFlash draft on its block
  objective: blocks at random anchors over the target's tapped context, hard labels from the data.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfx.drafters.heads.eagle import Eagle
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.drafters.heads.medusa import Medusa
from specfx.model.masks import to_format, visible_slots
from specfx.model.runner import ModelRunner

__all__ = ["HEADS", "TrainHead", "MedusaTrain", "EagleTrain", "Eagle3Train", "DraftTrain"]


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``logits`` against ``softmax(target_logits)``, mean over positions (over
    the positions ``weight`` marks, when given)."""
    p = F.softmax(target_logits.float(), dim=-1)
    ce = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return ce.mean() if weight is None else weighted_mean(ce, weight)


def weighted_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``values``' mean over the entries ``weight`` (broadcast to them) marks."""
    weight = weight.to(values.dtype).expand_as(values)
    return (values * weight).sum() / weight.sum().clamp(min=1e-6)


def label_weight(mask: torch.Tensor | None, shift: int, length: int) -> torch.Tensor | None:
    """``--assistant-only-loss``: for label masks ``mask [B, T]`` over a window's tokens, ``[B,
    length]`` float weights of the entries whose label is the token ``shift`` ahead of their
    position (past the window, where the label is the target's next token: the window's last
    mask, so a mask of ones is no mask); None without masks (every entry counts)."""
    if mask is None:
        return None
    ahead = torch.cat([mask[:, shift:], mask[:, -1:].expand(-1, shift)], dim=1)
    return ahead[:, :length].float()


def top1(pred: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None) -> float:
    """Top-1 agreement of ``pred`` logits with ``labels`` (over the entries ``weight`` marks)."""
    hit = (pred.argmax(-1) == labels).float()
    return (hit.mean() if weight is None else weighted_mean(hit, weight)).item()


class TrainHead:
    """A head being trained: ``module`` holds the trained parameters (its ``named_parameters``
    name the checkpoint tensors), ``taps`` what it reads, ``loss(ids, features, logits, step, mask)``
    the method's loss with a top-1 agreement with the target (``step``: the training step, for
    seeded augmentation; None when evaluating; ``mask [B, T]``: ``--assistant-only-loss``'s label
    masks, only entries whose label token it marks count; None: all), ``save(dir)`` the public layout."""

    kind: str
    taps: tuple[str, ...]
    module: nn.Module
    drafter: object

    def loss(self, ids, features, logits, step: int | None = None, mask=None) -> tuple[torch.Tensor, float]:
        raise NotImplementedError

    def save(self, path: Path) -> Path:
        return self.drafter.save(path)


class _Params(nn.Module):
    """Named tensors as trainable parameters (Medusa's heads are plain tensors)."""

    def __init__(self, **tensors):
        super().__init__()
        for name, t in tensors.items():
            if t is not None:
                setattr(self, name, nn.Parameter(t.detach().clone()))


class MedusaTrain(TrainHead):
    kind = "medusa"

    def __init__(self, runner: ModelRunner, init: str | None, num_heads: int, num_layers: int, seed: int,
                 layout: str = "vllm", base_model: str | None = None):  # fmt: skip
        self.layout, self.base_model = layout, base_model  # how save() writes it (Medusa.save)
        model = runner.model
        if init is not None:
            heads = Medusa(init)
        else:  # Medusa's initialisation: identity blocks, each head starting from the target's LM head (a copy)
            head = model.get_output_embeddings().weight.detach().float()  # [V, H]
            n, m, h = num_heads, num_layers, head.shape[1]
            heads = Medusa.from_weights(torch.zeros(n, m, h, h), torch.zeros(n, m, h), head.clone().repeat(n, 1, 1))
        heads.bind(runner)
        bias = heads.bias if heads.bias is not None else torch.zeros(heads.weight.shape[:3], dtype=heads.weight.dtype)
        self.module = _Params(weight=heads.weight, bias=bias.to(heads.weight), lm_head=heads.lm_head)
        self.drafter, self.taps = heads, heads.taps

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [B, T, H]`` -> ``[B, T, N, V]``: every head at every position."""
        p = self.module
        n = p.weight.shape[0]
        x = hidden.unsqueeze(2).expand(-1, -1, n, -1)  # [B, T, N, H]
        for j in range(p.weight.shape[1]):
            x = x + F.silu(torch.einsum("btnh,nkh->btnk", x, p.weight[:, j]) + p.bias[:, j])
        if p.lm_head.shape[0] == 1:
            return x @ p.lm_head[0].T
        return torch.einsum("btnh,nvh->btnv", x, p.lm_head)

    def loss(self, ids, features, logits, step=None, mask=None):
        labels = logits.argmax(-1)  # [B, T]: the target's own tokens for t + 1
        out = self.logits(features[0])  # [B, T, N, V]
        n, t = out.shape[2], out.shape[1]
        losses = []
        for i in range(min(n, t - 1)):  # head i at t predicts t + 2 + i = argmax z_{t+1+i}
            pred = out[:, : t - 1 - i, i]
            weight = label_weight(mask, 2 + i, t - 1 - i)
            if weight is None:
                losses.append(F.cross_entropy(pred.flatten(0, 1).float(), labels[:, 1 + i :].flatten()))
            else:
                ce = F.cross_entropy(pred.float().transpose(1, 2), labels[:, 1 + i :], reduction="none")
                losses.append(weighted_mean(ce, weight))
        acc = top1(out[:, : t - 1, 0], labels[:, 1:], label_weight(mask, 2, t - 1))
        return torch.stack(losses).mean(), acc

    def save(self, path):
        p = self.module
        heads = Medusa.from_weights(p.weight.detach(), p.bias.detach(), p.lm_head.detach())
        return heads.save(path, self.layout, base_model_name_or_path=self.base_model)


class _EagleCommon(TrainHead):
    """Shared by EAGLE-1 and EAGLE-3: the entries of a window at positions ``1 .. T-1``."""

    @staticmethod
    def entry_inputs(ids: torch.Tensor):
        b, t = ids.shape
        pos = torch.arange(1, t, device=ids.device).expand(b, -1)  # [B, T-1]
        return ids[:, 1:], pos


class EagleTrain(_EagleCommon):
    kind = "eagle"

    def __init__(self, runner: ModelRunner, init: str | None, seed: int, noise: float = 0.0):
        # from scratch without an fc bias: vLLM's EAGLE fc has none (docs/HEADS.md)
        head = Eagle(init) if init is not None else Eagle.random(runner.model, seed=seed, fc_bias=False)
        self.seed, self.noise = seed, noise
        head.bind(runner)
        head.fc.train()
        head.layer.train()
        self.module = nn.ModuleDict({"fc": head.fc, "layer": head.layer})
        self.drafter, self.taps = head, head.taps

    def entries(self, ids: torch.Tensor, f: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """The entries at positions ``1 .. T-1`` of windows ``ids [B, T]`` with the target's
        features ``f [B, T, H]``, teacher-forced: ``[B, T-1, H]``, the predictions of ``f_1 .. f_{T-1}``.
        At a training ``step`` the input features carry EAGLE's augmentation: uniform noise in
        ``(-noise, noise)``, seeded by ``(seed, step)``, so the head learns to draft from the
        slightly wrong features it feeds itself at depth > 1."""
        head = self.drafter
        tokens, pos = self.entry_inputs(ids)
        with torch.no_grad():  # the target's embedding module as the round calls it (Gemma scales it), not trained
            embeds = head.embed(tokens).to(f.dtype)
        inputs = f[:, :-1]
        if step is not None and self.noise > 0:
            g = torch.Generator(device=f.device).manual_seed(self.seed * 1_000_003 + step)
            u = torch.rand(inputs.shape, generator=g, device=f.device, dtype=torch.float32)
            inputs = inputs + ((2 * u - 1) * self.noise).to(inputs.dtype)
        x = head.fc(torch.cat([embeds, inputs], dim=-1))  # [B, T-1, H]
        kwargs = {"layer_type": head.layer_type} if head.per_layer_rope else {}
        rope = head.rotary(x, pos, **kwargs)
        n = pos.shape[1]
        mask = to_format(visible_slots(pos - 1, n, head.pattern), head.mask_format, x.dtype)  # keys: positions 1..T-1
        out = head.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out

    def loss(self, ids, features, logits, step=None, mask=None):
        head = self.drafter
        f = features[0]
        out = self.entries(ids, f, step)
        lm = head.lm_head  # the target's, read detached (its .grad never touched)
        draft = F.linear(out, lm.weight.detach(), lm.bias.detach() if getattr(lm, "bias", None) is not None else None)
        z = logits[:, 1:]
        w = label_weight(mask, 2, out.shape[1])  # entry i stands at position i + 1: its label is token i + 2
        if w is None:
            regress = F.smooth_l1_loss(out.float(), f[:, 1:].float())
        else:
            regress = weighted_mean(F.smooth_l1_loss(out.float(), f[:, 1:].float(), reduction="none").mean(-1), w)
        loss = regress + 0.1 * soft_ce(draft, z, w)
        return loss, top1(draft, z.argmax(-1), w)


class _StepKV:
    """The KV an EAGLE-3 training step attends to: every earlier step's keys and values, then
    its own (stands in for the one-layer cache ``Eagle3Attention`` writes to)."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.layers = [self]

    def update(self, k, v):
        self.keys.append(k)
        self.values.append(v)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)


def ttt_mask(n: int, step: int, device) -> torch.Tensor:
    """bool ``[1, 1, n, (step + 1) n]``: query ``i`` of step ``step`` sees step 0's keys
    ``s <= i - step`` and step ``j >= 1``'s key ``s == i - step + j`` (its draft path)."""
    i = torch.arange(n, device=device).view(n, 1)
    s = torch.arange(n, device=device).view(1, n)
    blocks = [s <= i - step] + [s == i - step + j for j in range(1, step + 1)]
    return torch.cat(blocks, dim=1).view(1, 1, n, (step + 1) * n)


def draft_vocabulary(stream: np.ndarray, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``stream`` (ties: lower id first; ids never seen
    fill up by id), in increasing order: an EAGLE-3 draft vocabulary chosen from the data."""
    counts = np.bincount(stream.astype(np.int64), minlength=vocab)[:vocab]
    order = np.lexsort((np.arange(vocab), -counts))  # by count descending, then id
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))


class Eagle3Train(_EagleCommon):
    kind = "eagle3"

    def __init__(self, runner: ModelRunner, init: str | None, seed: int, draft_vocab_size: int | None,
                 stream: np.ndarray, ttt_steps: int, sizes: dict | None = None):  # fmt: skip
        model = runner.model
        if init is not None:
            head = Eagle3(init)
        else:
            vocab = runner.vocab_size
            size = min(vocab, draft_vocab_size or 32000)
            layers = runner.num_layers
            # the default taps (inputs of layers 2, L//2, L-3) repeat a layer below 7 layers, which vLLM, SGLang
            # and SafeAILab capture only once: there, three distinct boundaries (the last three) instead
            ids = None if layers >= 7 else [max(0, layers - 3) + i for i in range(3)]
            head = Eagle3.random(model, draft_vocab_size=size, seed=seed, layer_ids=ids, **(sizes or {}))
            chosen = draft_vocabulary(stream, vocab, size)
            with torch.no_grad():
                head.head.d2t.copy_(chosen - torch.arange(size))
                head.head.t2d.zero_()
                head.head.t2d[chosen] = True
        head.bind(runner)
        h = head.head
        self.module = nn.ModuleDict({"fc": h.fc, "midlayer": h.midlayer, "norm": h.norm, "lm_head": h.lm_head}).train()
        self.drafter, self.taps, self.steps = head, head.taps, ttt_steps
        self.draft_ids = h.target_ids()  # [V_draft]

    def unroll(self, ids: torch.Tensor, features):
        """The training-time test over windows ``ids [B, T]``: yields ``(k, out [B, T-1, H])``
        for steps ``k = 0 .. ttt_steps - 1`` (index i is position i + 1; from step k on, the
        first k entries have no draft path and are not scored)."""
        h = self.drafter.head
        tokens, pos = self.entry_inputs(ids)
        fused = self.drafter._feature(features)  # [B, T, H]: fc over the taps in the head's order
        emb = F.embedding(tokens, self.drafter.embed_weight.detach()).to(fused.dtype)  # [B, T-1, H], raw lookup
        rope = h.rotary_emb(fused, pos)
        kv, feature, n = _StepKV(), fused[:, :-1], pos.shape[1]
        for k in range(min(self.steps, n)):
            out = h.midlayer(emb, feature, rope, ttt_mask(n, k, ids.device), kv)  # [B, T-1, H]
            yield k, out
            feature = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # step k+1 at t reads step k's output at t-1

    def loss(self, ids, features, logits, step=None, mask=None):
        h = self.drafter.head
        z = logits[:, 1:].index_select(-1, self.draft_ids)  # target's distribution over the draft vocabulary
        w = label_weight(mask, 2, z.shape[1])  # entry i stands at position i + 1: its label is token i + 2
        total, acc = 0.0, 0.0
        for k, out in self.unroll(ids, features):
            draft = h.lm_head(h.norm(out))[:, k:]  # the first k positions have no step-k entry
            total = total + 0.8**k * soft_ce(draft, z[:, k:], None if w is None else w[:, k:])
            if k == 0:
                hit = (self.draft_ids[draft.argmax(-1)] == logits[:, 1:].argmax(-1)).float()
                acc = (hit.mean() if w is None else weighted_mean(hit, w)).item()
        return total, acc


class DraftTrain(TrainHead):
    """A separate small draft model (``--head draft``): a Llama-style causal LM over the
    target's vocabulary, distilled from the target (cross-entropy against its distribution at
    every position, i.e. KL up to a constant). Reads no taps; saved with ``save_pretrained``
    and the target's tokenizer, so ``speculate(target, draft=load(OUT/head))`` runs it."""

    kind = "draft"
    taps: tuple[str, ...] = ()

    def __init__(self, runner: ModelRunner, init: str | None, seed: int, layers: int, hidden: int, tokenizer):
        from transformers import LlamaConfig, LlamaForCausalLM

        from specfx.model.load import load_causal_lm

        model = runner.model
        if init is not None:
            draft = load_causal_lm(init, device=runner.device)
        else:
            tc = model.config.get_text_config()
            heads = max(1, hidden // 64)
            config = LlamaConfig(
                vocab_size=runner.vocab_size, hidden_size=hidden, intermediate_size=int(round(2.75 * hidden / 32)) * 32,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=getattr(tc, "max_position_embeddings", 2048), tie_word_embeddings=True,
                bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
            )  # fmt: skip
            torch.manual_seed(seed)
            draft = LlamaForCausalLM(config).to(runner.device)
            draft.generation_config = copy.deepcopy(model.generation_config)
        self.module = draft.train()
        self.drafter, self.tokenizer = draft, tokenizer

    def loss(self, ids, features, logits, step=None, mask=None):
        out = self.module(input_ids=ids).logits  # [B, T, V]
        w = label_weight(mask, 1, out.shape[1])
        return soft_ce(out, logits, w), top1(out, logits.argmax(-1), w)

    def save(self, path):
        path = Path(path)
        self.module.save_pretrained(path)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        return path


HEADS = ("medusa", "eagle", "eagle3", "draft", "pard", "dflash")  # pard, dflash: specfx.train.pard, .dflash
