"""Medusa heads as the drafter: ``draft="medusa:DIR"`` / ``specfx.drafters.heads.medusa.Medusa(DIR)``.

Medusa (Cai et al. 2024) puts K small heads on the target's last hidden state after its final
norm (tap ``"final"``). Head ``i`` (0-based) is ``num_layers`` residual blocks ``x + SiLU(W x +
b)`` (``W [H, H]``, with bias) followed by its own LM head ``[V, H]`` (no bias). At the hidden
state of position ``L - 1`` (the one whose LM head chose the pending token at ``L``), head ``i``
predicts the token at ``L + 1 + i``: the heads guess several tokens ahead at once, from one
feature, without a draft model and without any KV cache.

Checkpoints, safetensors only, in FasterDecoding's layout or vLLM's converted one (both read;
:meth:`Medusa.save` writes either, ``layout="vllm"`` by default): :mod:`specfx.drafters.heads.medusa_checkpoint`.
What each engine reads: docs/HEADS.md.

The round: :meth:`Medusa.observe` keeps, per row, the target's final hidden state at the new
pending position minus one (a static ``[B, H]`` stash); :meth:`Medusa.propose` runs the first K
heads on it and proposes each head's argmax (deterministic, so verification is lossless with a
one-hot q); :meth:`Medusa.propose_tree` fills a token tree the Medusa way: the node with child
ranks ``(r_1, ..., r_d)`` gets the ``r_d``-th most likely token of head ``d - 1``, whatever its
parent. A K or a tree deeper than the heads is refused at ``speculate()`` (``max_depth``).
Proposals are chosen from the heads' logits after the same processors as the target's
scores (repetition penalty, min_new_tokens), which at their defaults change nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specfx.drafters.base import Drafter, TreeDrafting
from specfx.drafters.drafting import stash_at
from specfx.drafters.heads.checkpoint import read_head, warn_engine_gaps, write_head
from specfx.drafters.heads.medusa_checkpoint import KIND, LAYOUTS, check_count, engine_gaps, layout_tensors, read_heads
from specfx.model.dynamo import mark_static
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_positional_tree

__all__ = ["LAYOUTS", "Medusa", "from_name"]


class Medusa(TreeDrafting, Drafter):
    """Medusa heads over the target's final hidden state (see the module docstring).

    Args:
        path: a head checkpoint directory (or one ``.safetensors`` file with ``config.json``
            beside it) in FasterDecoding's or vLLM's layout.
        num_heads: use only the first ``num_heads`` heads of the checkpoint (default: all; its
            ``config.json`` must then agree with the tensors).

    Attributes:
        weight: ``[N, M, H, H]`` the residual blocks' weights (head, block, out, in).
        bias: ``[N, M, H]`` their biases, or None (vLLM heads without ``medusa_fc_bias``).
        lm_head: ``[N, V, H]`` one LM head per head, or ``[1, V, H]`` one shared by all heads.
    """

    name = "medusa"
    taps = ("final",)

    def __init__(self, path: str | Path, *, num_heads: int | None = None):
        ckpt = read_head(path, KIND)
        weight, bias, lm_head = read_heads(ckpt, num_heads)
        self._set(weight, bias, lm_head)

    # ----------------------------------------------------------------- building one
    def _set(self, weight: torch.Tensor, bias: torch.Tensor | None, lm_head: torch.Tensor) -> None:
        if weight.dim() != 4:
            raise ValueError(f"Medusa heads: blocks must be [heads, layers, H, H], got {list(weight.shape)}.")
        n, m, h, h_in = weight.shape
        if h != h_in or lm_head.dim() != 3 or lm_head.shape[2] != h or lm_head.shape[0] not in (1, n):
            raise ValueError(
                f"Medusa heads: inconsistent shapes: blocks {list(weight.shape)} ([heads, layers, H, H]), "
                f"LM heads {list(lm_head.shape)} ([heads or 1, V, H])."
            )
        if bias is not None and tuple(bias.shape) != (n, m, h):
            raise ValueError(f"Medusa heads: block biases have shape {list(bias.shape)}, expected {[n, m, h]}.")
        if n < 1:
            raise ValueError("Medusa heads: at least one head is needed.")
        self.weight, self.bias, self.lm_head = weight, bias, lm_head
        self.target: ModelRunner | None = None
        self.stash: torch.Tensor | None = None

    @classmethod
    def from_weights(cls, weight: torch.Tensor, bias: torch.Tensor | None, lm_head: torch.Tensor) -> Medusa:
        """Heads from tensors in memory: ``weight [N, M, H, H]``, ``bias [N, M, H]`` or None,
        ``lm_head [N, V, H]`` (or ``[1, V, H]``: one LM head shared by every head). The tensors
        are used as given (not copied) until :meth:`bind` casts them to the target's dtype."""
        heads = cls.__new__(cls)
        heads._set(weight, bias, lm_head)
        return heads

    @classmethod
    def random(
        cls,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        seed: int = 0,
        scale: float = 0.1,
    ) -> Medusa:
        """Seeded random heads (float32, Gaussian entries of std ``scale``), for tests and for
        benchmarks of the machinery; they accept about what chance gives."""
        where = "Medusa.random()"
        n = check_count(num_heads, "num_heads", where, 1)
        m = check_count(num_layers, "num_layers", where, 0)
        h = check_count(hidden_size, "hidden_size", where, 1)
        v = check_count(vocab_size, "vocab_size", where, 1)
        g = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(shape, generator=g) * scale

        return cls.from_weights(randn(n, m, h, h), randn(n, m, h), randn(n, v, h))

    @classmethod
    def from_target(cls, model, num_heads: int = 4, num_layers: int = 1) -> Medusa:
        """Untrained heads for ``model`` as Medusa initialises them before training: every
        residual block zero (so the identity, SiLU(0) = 0) and every head reading through the
        target's own LM head, shared, not copied. Each head then predicts what the target
        predicts at the hidden state: the pending token again (useful on repetitive text)."""
        where = "Medusa.from_target()"
        n = check_count(num_heads, "num_heads", where, 1)
        m = check_count(num_layers, "num_layers", where, 0)
        head = model.get_output_embeddings().weight.detach()  # [V, H]
        h = head.shape[1]
        zeros = torch.zeros((n, m, h, h), dtype=head.dtype, device=head.device)
        return cls.from_weights(zeros, zeros[:, :, 0], head.unsqueeze(0))

    # ----------------------------------------------------------------- sizes
    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.weight.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[2]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[1]

    @property
    def shared_lm_head(self) -> bool:
        return self.lm_head.shape[0] == 1

    @property
    def max_depth(self) -> int:
        """Head ``i`` predicts ``i + 1`` tokens past the pending one: no more than one
        proposal per head along any path."""
        return self.num_heads

    def __repr__(self) -> str:
        shared = ", shared LM head" if self.shared_lm_head else ""
        return (
            f"Medusa({self.num_heads} heads, {self.num_layers} block(s) each, hidden {self.hidden_size}, "
            f"vocabulary {self.vocab_size}{shared})"
        )

    # ----------------------------------------------------------------- checkpoints
    def save(self, path: str | Path, layout: str = "vllm", *, base_model_name_or_path: str | None = None) -> Path:
        """Write the heads to directory ``path`` in a public layout and return it (docs/HEADS.md):

        * ``"vllm"`` (default): vLLM's converted layout, ``model.safetensors`` (``blocks.{i}.layers.{j}``,
          ``lm_heads.{i}``) and a ``config.json`` with ``model_type: "medusa"``, which vLLM's
          Medusa loader reads (it skips tensors of any other name);
        * ``"medusa"``: FasterDecoding's, ``medusa_lm_head.safetensors`` (``{i}.{j}.linear``,
          ``{i}.{num_layers}``; FasterDecoding's loader reads the same tensors as
          ``medusa_lm_head.pt``) and a ``config.json`` with ``medusa_num_heads``,
          ``medusa_num_layers`` and ``base_model_name_or_path``, which FasterDecoding's loader
          needs to find the target: ``base_model_name_or_path`` if given, else the bound
          target's ``name_or_path``. Heads without biases get zero biases (same computation).

        A head some engine of its layout would not run as specfx does is saved with a
        :class:`~specfx.drafters.heads.checkpoint.HeadLayoutWarning` (:meth:`engine_gaps`)."""
        if layout not in LAYOUTS:
            raise ValueError(f"Medusa.save(layout={layout!r}): the layouts are {', '.join(map(repr, LAYOUTS))}.")
        base = base_model_name_or_path or self._target_name()
        config, tensors, filename = layout_tensors(self.weight, self.bias, self.lm_head, layout, base)
        warn_engine_gaps(KIND, path, self.engine_gaps(layout, base))
        return write_head(path, config, tensors, filename=filename)

    def _target_name(self) -> str | None:
        model = getattr(self.target, "model", None) if self.target is not None else None
        return getattr(model, "name_or_path", None) or None

    def engine_gaps(self, layout: str = "vllm", base_model_name_or_path: str | None = None) -> dict[str, list[str]]:
        """Why the engine reading ``layout`` would not draft with these heads, saved by
        :meth:`save`, what specfx drafts: engine -> reasons (empty where it would); see
        :func:`specfx.drafters.heads.medusa_checkpoint.engine_gaps`."""
        return engine_gaps(self.weight, self.bias, layout, base_model_name_or_path or self._target_name())

    # ----------------------------------------------------------------- the Drafter
    def bind(self, target: ModelRunner) -> None:
        why = target.taps_refusal()
        if why is not None:
            raise ValueError(f"draft='medusa': {why}")
        hidden = target.model.get_output_embeddings().weight.shape[1]
        if self.hidden_size != hidden:
            raise ValueError(
                f"Medusa heads have hidden size {self.hidden_size}, but the target's final hidden state "
                f"(its LM head's input) has {hidden}: these heads were trained for another model."
            )
        if self.vocab_size > target.vocab_size:
            raise ValueError(
                f"Medusa heads predict over a vocabulary of {self.vocab_size} tokens, but the target's LM "
                f"head has {target.vocab_size} rows: these heads were trained for another model."
            )
        self.target = target
        self._follow_target()

    def _follow_target(self) -> None:
        """Cast and move the heads' own tensors to the target's dtype and device (no copy when
        they already match); the target itself is never touched."""
        device, dtype = self.target.device, self.target.dtype
        self.weight = self.weight.detach().to(device, dtype)
        self.bias = self.bias.detach().to(device, dtype) if self.bias is not None else None
        self.lm_head = self.lm_head.detach().to(device, dtype)

    def allocate(self, batch_size: int, capacity: int) -> None:
        target = self.target
        self._follow_target()  # the generator reallocates after model.to(dtype or device)
        # [B, H]: the target's final hidden state at each row's pending position - 1
        self.stash = torch.zeros((batch_size, self.hidden_size), dtype=target.dtype, device=target.device)
        mark_static(self.stash)  # written in place every round
        # transformers installs its output recording lazily on the first output_hidden_states
        # call; make that call here, eagerly, never inside a compiled graph (as MTP does)
        zeros = torch.zeros((batch_size, 1), dtype=torch.long, device=target.device)
        with torch.no_grad():
            target.forward(zeros, zeros, torch.full_like(zeros, target.cache.trash_slot), taps=self.taps)

    def observe(self, ctx, features, positions, slots) -> None:
        """Stash each row's feature at position ``ctx.lengths - 1`` (the token before the new
        pending one); rows with no such column (finished rows) keep theirs. Padding columns
        (written to the trash slot, so ``slots != positions``) never match."""
        (hidden,) = features  # [B, T, H]
        stash_at(self.stash, hidden, (positions == (ctx.lengths - 1).unsqueeze(1)) & (slots == positions))

    def head_logits(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """Logits ``[B, n, V_target]`` of heads ``0..n-1`` at ``hidden [B, H]``; token ids past
        the heads' own vocabulary (a padded target LM head) get -inf and are never proposed."""
        x = hidden.unsqueeze(1).expand(-1, n, -1)  # [B, n, H]
        for j in range(self.num_layers):
            y = torch.einsum("bnh,nkh->bnk", x, self.weight[:n, j])
            if self.bias is not None:
                y = y + self.bias[:n, j]
            x = x + F.silu(y)
        if self.shared_lm_head:
            logits = x @ self.lm_head[0].T  # [B, n, V]
        else:
            logits = torch.einsum("bnh,nvh->bnv", x, self.lm_head[:n])
        missing = self.target.vocab_size - logits.shape[-1]
        if missing > 0:
            logits = F.pad(logits, (0, missing), value=float("-inf"))
        return logits

    def propose(self, ctx):
        logits = self.head_logits(self.stash, ctx.k)  # [B, K, V]: head i predicts L + 1 + i
        proposals: list[torch.Tensor] = []
        for i in range(ctx.k):
            scores = ctx.process(logits[:, i : i + 1], i, proposals)  # [B, 1, V]
            proposals.append(scores.argmax(dim=-1))  # [B, 1]
        return torch.cat(proposals, dim=1), None  # deterministic: q is one-hot

    def propose_tree(self, ctx) -> torch.Tensor:
        # head d - 1 for depth d: Medusa's heads do not see the path
        return draft_positional_tree(ctx, self.head_logits(self.stash, ctx.token_tree.depth))


def from_name(arg: str | None) -> Medusa:
    """``draft="medusa:DIR"``."""
    if arg is None:
        raise ValueError(
            "draft='medusa' needs the heads' checkpoint: draft='medusa:DIR', DIR a local directory with "
            "medusa_lm_head.safetensors (FasterDecoding's layout) or vLLM's converted layout, and its "
            "config.json; or pass draft=specfx.drafters.heads.medusa.Medusa(DIR)."
        )
    return Medusa(arg)
