"""Medusa heads as the drafter: ``draft="medusa:DIR"`` / ``specfx.drafters.heads.medusa.Medusa(DIR)``.

Medusa (Cai et al. 2024) puts K small heads on the target's last hidden state after its final
norm (tap ``"final"``). Head ``i`` (0-based) is ``num_layers`` residual blocks ``x + SiLU(W x +
b)`` (``W [H, H]``, with bias) followed by its own LM head ``[V, H]`` (no bias). At the hidden
state of position ``L - 1`` (the one whose LM head chose the pending token at ``L``), head ``i``
predicts the token at ``L + 1 + i``: the heads guess several tokens ahead at once, from one
feature, without a draft model and without any KV cache.

Checkpoints, safetensors only (loaded with :func:`specfx.drafters.heads.checkpoint.read_head`):

* FasterDecoding's layout (Medusa-1 heads, ``medusa_lm_head.safetensors`` and a
  ``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers``): the state dict of its
  ``medusa_head`` ModuleList, ``{i}.{j}.linear.weight`` / ``.bias`` for block ``j`` of head ``i``
  and ``{i}.{num_layers}.weight`` for the head's LM head. A Medusa-2 model checkpoint holds the
  same tensors under ``medusa_head.`` (the rest of it, the base model, is ignored).
* vLLM's converted layout (``model_type: "medusa"``; ``num_heads``, ``num_hidden_layers``):
  ``blocks.{i}.layers.{j}.weight`` (``.bias`` with ``medusa_fc_bias``) and ``lm_heads.{i}.weight``,
  or one ``lm_heads.0.weight`` shared by every head with ``original_lm_head``; an optional
  ``medusa_heads.`` prefix is dropped, as vLLM's loader drops it.

:meth:`Medusa.save` writes either layout back (``layout="vllm"`` by default; no engine reads
both: vLLM's loader knows only its own names and skips the others, FasterDecoding's only its
own). Counts missing from ``config.json`` are inferred from the tensor names; a config that
contradicts the tensors is refused. What each engine reads: docs/HEADS.md.

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

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from specfx.drafters.base import Drafter, TreeDrafting
from specfx.drafters.drafting import stash_at
from specfx.model.dynamo import mark_static
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_tree
from specfx.drafters.heads.checkpoint import HeadCheckpoint, check_tensors, read_head, warn_engine_gaps, write_head

__all__ = ["Medusa", "from_name"]

KIND = "Medusa"
LAYOUTS = ("medusa", "vllm")
MEDUSA_FILE = "medusa_lm_head.safetensors"  # what FasterDecoding's trainer writes (and TGI reads)
VLLM_FILE = "model.safetensors"

# Tensor names of each layout: (head, block, what) / (head,) captured.
_MEDUSA_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_MEDUSA_LM = re.compile(r"(\d+)\.(\d+)\.weight")
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_LM = re.compile(r"lm_heads\.(\d+)\.weight")


def _count(value, name: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}.")
    return value


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
        weight, bias, lm_head = _load(ckpt, num_heads)
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
        n = _count(num_heads, "num_heads", where, 1)
        m = _count(num_layers, "num_layers", where, 0)
        h = _count(hidden_size, "hidden_size", where, 1)
        v = _count(vocab_size, "vocab_size", where, 1)
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
        n = _count(num_heads, "num_heads", where, 1)
        m = _count(num_layers, "num_layers", where, 0)
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
        n, m, h, v = self.num_heads, self.num_layers, self.hidden_size, self.vocab_size
        weight, lm = self.weight.detach().cpu(), self.lm_head.detach().cpu()
        bias = self.bias.detach().cpu() if self.bias is not None else None
        tensors: dict[str, torch.Tensor] = {}
        # every entry its own storage: safetensors refuses tensors that share memory
        if layout == "medusa":
            base = base_model_name_or_path or self._target_name()
            for i in range(n):
                for j in range(m):
                    tensors[f"{i}.{j}.linear.weight"] = weight[i, j].clone()
                    tensors[f"{i}.{j}.linear.bias"] = bias[i, j].clone() if bias is not None else weight.new_zeros(h)
                tensors[f"{i}.{m}.weight"] = lm[0 if self.shared_lm_head else i].clone()
            config = {"medusa_num_heads": n, "medusa_num_layers": m, "hidden_size": h, "vocab_size": v}
            if base:
                config["base_model_name_or_path"] = base
            warn_engine_gaps(KIND, path, self.engine_gaps(layout, base))
            return write_head(path, config, tensors, filename=MEDUSA_FILE)
        for i in range(n):
            for j in range(m):
                tensors[f"blocks.{i}.layers.{j}.weight"] = weight[i, j].clone()
                if bias is not None:
                    tensors[f"blocks.{i}.layers.{j}.bias"] = bias[i, j].clone()
        for i in range(lm.shape[0]):
            tensors[f"lm_heads.{i}.weight"] = lm[i].clone()
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "num_heads": n,
            "num_hidden_layers": m,
            "hidden_size": h,
            "vocab_size": v,
            "truncated_vocab_size": v,
            "medusa_fc_bias": bias is not None,
            "original_lm_head": self.shared_lm_head,
        }
        warn_engine_gaps(KIND, path, self.engine_gaps(layout))
        return write_head(path, config, tensors, filename=VLLM_FILE)

    def _target_name(self) -> str | None:
        model = getattr(self.target, "model", None) if self.target is not None else None
        return getattr(model, "name_or_path", None) or None

    def engine_gaps(self, layout: str = "vllm", base_model_name_or_path: str | None = None) -> dict[str, list[str]]:
        """Why the engine reading ``layout`` would not draft with these heads, saved by
        :meth:`save`, what specfx drafts: engine -> reasons (empty where it would). vLLM runs
        every head its layout holds; FasterDecoding's ``MedusaModel`` builds 5 heads (whatever
        ``medusa_num_heads`` says), each head's residual blocks as one block repeated
        (``[ResBlock(h)] * medusa_num_layers``, so its loader gives every block the last one's
        weights), and loads the target from ``base_model_name_or_path`` (an unset one defaults
        to lmsys/vicuna-7b-v1.3)."""
        if layout == "vllm":
            return {"vLLM": []}
        reasons = []
        if self.num_heads != 5:
            reasons.append(
                f"its loader builds 5 heads whatever medusa_num_heads says, so with these {self.num_heads} "
                + ("the 5th keeps a random init and drafts garbage where its tree reaches depth 5." if self.num_heads < 5
                   else f"it ignores heads 5 to {self.num_heads - 1}.")  # fmt: skip
            )
        if self.num_layers > 1:
            w = self.weight.detach()
            b = self.bias.detach() if self.bias is not None else None
            same = all(
                torch.equal(w[:, j], w[:, -1]) and (b is None or torch.equal(b[:, j], b[:, -1]))
                for j in range(self.num_layers)
            )
            if not same:
                reasons.append(
                    f"its MedusaModel builds each head's {self.num_layers} residual blocks as one ResBlock repeated, "
                    f"so it would run the last block's weights {self.num_layers} times; save one block per head "
                    f"(--medusa-layers 1) or use layout='vllm'."
                )
        if not (base_model_name_or_path or self._target_name()):
            reasons.append(
                "config.json has no base_model_name_or_path (the target this head drafts for), so its loader would "
                "load lmsys/vicuna-7b-v1.3; pass save(..., base_model_name_or_path=...) or bind the heads first."
            )
        return {"FasterDecoding's Medusa": reasons}

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
        tree = ctx.token_tree
        logits = self.head_logits(self.stash, tree.depth)  # [B, D, V]: head d - 1 for depth d
        depths = tree.depths

        def step(queries, tokens):
            # every node of one level has depth d; its children (depth d + 1) come from head d,
            # whatever the node: Medusa's heads do not see the path
            d = depths[queries[0]]
            return logits[:, d : d + 1].expand(-1, len(queries), -1)

        return draft_tree(ctx, logits[:, :1], step)


# --------------------------------------------------------------------------- loading
def _config_count(config: dict, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        if name in config:
            return name, _count(config[name], name, f"{KIND} checkpoint config.json", 0)
    return None


def _parse(tensors: dict[str, torch.Tensor], patterns, path) -> dict[str, tuple]:
    """name -> its regex groups under the first pattern it matches; ValueError naming the
    tensors that belong to no pattern of the layout."""
    parsed, stray = {}, []
    for name in tensors:
        for pattern in patterns:
            match = pattern.fullmatch(name)
            if match:
                parsed[name] = (pattern, *match.groups())
                break
        else:
            stray.append(name)
    if "token_map" in stray:
        raise ValueError(
            f"{KIND} checkpoint {str(path)!r} has a token_map (heads over a truncated vocabulary, "
            f"truncated_vocab_size); specfx does not support those: use heads over the full vocabulary."
        )
    if stray:
        raise ValueError(
            f"{KIND} checkpoint {str(path)!r} has tensors that are not part of its layout: "
            f"{', '.join(sorted(stray)[:6])}{' ...' if len(stray) > 6 else ''}."
        )
    return parsed


def _layout(ckpt: HeadCheckpoint) -> tuple[str, dict[str, torch.Tensor]]:
    """Which layout ``ckpt`` is in, and its tensors under that layout's names (prefixes gone)."""
    tensors = ckpt.tensors
    if any(k.startswith("medusa_head.") for k in tensors):  # a Medusa-2 model: the heads in it
        return "medusa", {k[len("medusa_head.") :]: t for k, t in tensors.items() if k.startswith("medusa_head.")}
    tensors = {k.removeprefix("medusa_heads."): t for k, t in tensors.items()}
    if any(k.startswith(("blocks.", "lm_heads.")) for k in tensors):
        return "vllm", tensors
    if any(re.match(r"\d+\.", k) for k in tensors):
        return "medusa", tensors
    have = sorted(tensors)
    raise ValueError(
        f"{KIND} checkpoint {str(ckpt.path)!r} is in no Medusa layout: it has {', '.join(have[:6])}"
        f"{' ...' if len(have) > 6 else ''}; expected FasterDecoding's '{{i}}.{{j}}.linear.weight' and "
        f"'{{i}}.{{num_layers}}.weight' (medusa_lm_head.safetensors) or vLLM's 'blocks.{{i}}.layers.{{j}}.weight' "
        f"and 'lm_heads.{{i}}.weight'."
    )


def _load(ckpt: HeadCheckpoint, num_heads: int | None):
    """``(weight [N, M, H, H], bias [N, M, H] | None, lm_head [N or 1, V, H])`` from a checkpoint
    in either layout, checked against its config."""
    layout, tensors = _layout(ckpt)
    view = HeadCheckpoint(ckpt.path, ckpt.config, tensors)  # the layout's names, for messages
    config, where = ckpt.config, f"{KIND} checkpoint {str(ckpt.path)!r}"
    vllm = layout == "vllm"
    block_re, lm_re = (_VLLM_BLOCK, _VLLM_LM) if vllm else (_MEDUSA_BLOCK, _MEDUSA_LM)
    parsed = _parse(tensors, (block_re, lm_re), ckpt.path)
    found_n = 1 + max((int(g[1]) for g in parsed.values()), default=-1)
    found_m = 1 + max((int(g[2]) for g in parsed.values() if g[0] is block_re), default=-1)
    if not vllm:  # a head's LM head is the entry after its blocks: {i}.{M}.weight
        lm_index = {int(g[2]) for g in parsed.values() if g[0] is lm_re}
        if lm_index and lm_index != {found_m}:
            raise ValueError(
                f"{where}: its heads' LM heads are entries {sorted(lm_index)}, but after {found_m} residual "
                f"block(s) a head's LM head is entry {found_m} ('{{i}}.{found_m}.weight'); the checkpoint is "
                f"incomplete or not a Medusa head."
            )
    counts = (
        (("num_heads", "medusa_num_heads") if vllm else ("medusa_num_heads",), found_n, "heads"),
        (("num_hidden_layers", "medusa_num_layers") if vllm else ("medusa_num_layers",), found_m, "residual blocks per head"),
    )
    for names, found, what in counts:
        declared = _config_count(config, names)
        if declared is not None and declared[1] != found and not (what == "heads" and num_heads is not None):
            hint = " (or pass num_heads= to use only the first heads)" if what == "heads" else ""
            raise ValueError(
                f"{where}: config.json says {declared[0]}={declared[1]}, but its tensors hold {found} {what}. "
                f"Fix config.json{hint}."
            )
    shared = vllm and bool(config.get("original_lm_head", False))
    lm_name = "lm_heads.{i}.weight" if vllm else f"{{i}}.{found_m}.weight"
    first_lm = lm_name.format(i=0)
    if first_lm not in tensors:
        check_tensors(view, KIND, {first_lm: ()})  # names what is missing, and what is there
    if tensors[first_lm].dim() != 2:
        raise ValueError(f"{where}: {first_lm} has shape {list(tensors[first_lm].shape)}, expected [V, H].")
    v, h = tensors[first_lm].shape
    for key, value in (("hidden_size", h), ("vocab_size", v)):
        if key in config and config[key] != value:
            raise ValueError(f"{where}: config.json says {key}={config[key]}, but its LM heads are {[v, h]} ([V, H]).")
    truncated = config.get("truncated_vocab_size")
    if truncated is not None and truncated != config.get("vocab_size", truncated):
        raise ValueError(
            f"{where}: config.json sets truncated_vocab_size={truncated} (heads over a truncated vocabulary "
            f"with a token_map); specfx does not support those: use heads over the full vocabulary."
        )
    if vllm:
        block = "blocks.{i}.layers.{j}.{w}"
        has_bias = any(k.endswith(".bias") for k in tensors)
        declared_bias = config.get("medusa_fc_bias")
        if declared_bias is not None and bool(declared_bias) != has_bias:
            raise ValueError(
                f"{where}: config.json says medusa_fc_bias={declared_bias}, but its residual blocks "
                f"{'have' if has_bias else 'have no'} biases. Fix config.json."
            )
        # unset medusa_fc_bias: vLLM would ignore bias tensors; specfx computes what the file holds
        if shared and sum(1 for k in tensors if _VLLM_LM.fullmatch(k)) > 1:
            raise ValueError(f"{where}: config.json says original_lm_head (one LM head), but the tensors hold several.")
    else:
        block, has_bias = "{i}.{j}.linear.{w}", True  # FasterDecoding's ResBlock always has a bias

    n, m = found_n, found_m
    if num_heads is not None:
        n = _count(num_heads, "num_heads", f"Medusa({str(ckpt.path)!r}, num_heads=...)", 1)
        if n > found_n:
            raise ValueError(f"Medusa(num_heads={n}): {where} holds only {found_n} heads.")
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(found_n):
        for j in range(m):
            expected[block.format(i=i, j=j, w="weight")] = (h, h)
            if has_bias:
                expected[block.format(i=i, j=j, w="bias")] = (h,)
        if not shared or i == 0:
            expected[lm_name.format(i=i)] = (v, h)
    check_tensors(view, KIND, expected)

    dtype = tensors[first_lm].dtype

    def blocks(w: str, shape: tuple[int, ...]) -> torch.Tensor:  # [N, M, *shape]
        if m == 0:
            return torch.zeros((n, 0, *shape), dtype=dtype)
        return torch.stack([torch.stack([tensors[block.format(i=i, j=j, w=w)] for j in range(m)]) for i in range(n)]).to(dtype)

    lm_head = torch.stack([tensors[lm_name.format(i=i)] for i in range(1 if shared else n)])  # [N or 1, V, H]
    return blocks("weight", (h, h)), blocks("bias", (h,)) if has_bias else None, lm_head


def from_name(arg: str | None) -> Medusa:
    """``draft="medusa:DIR"``."""
    if arg is None:
        raise ValueError(
            "draft='medusa' needs the heads' checkpoint: draft='medusa:DIR', DIR a local directory with "
            "medusa_lm_head.safetensors (FasterDecoding's layout) or vLLM's converted layout, and its "
            "config.json; or pass draft=specfx.drafters.heads.medusa.Medusa(DIR)."
        )
    return Medusa(arg)
