"""DFlash (block diffusion for flash speculative decoding; z-lab, arXiv 2602.06036):
``draft="dflash:DIR"`` / ``specfx.DFlash(DIR)``.

A DFlash draft is a few Qwen3-style layers that fill a block of masked positions in one forward,
conditioned on the target's hidden states at several layers. What carries over from the
reference (z-lab/dflash at commit 44947fbf71114e241c96de194f4b382b5dd330d0, ``dflash/model.py``,
``dflash_generate`` and ``DFlashDraftModel``):

* the *context*: for every token the target has processed and that is committed, the outputs
  of the target layers ``target_layer_ids`` (the reference's ``hidden_states[i + 1]``; the
  last layer's output is the state after the final norm there, tap ``"final"`` here),
  concatenated in listed order, through ``fc`` and ``hidden_norm``. Each draft layer turns it
  into keys and values (its own ``k_proj``, ``k_norm``, ``v_proj``, rotary at the token's
  position), kept across rounds: the reference's draft KV cache, cropped to the committed tokens;
* the *block* of ``block_size`` tokens at positions ``L .. L + block_size - 1``: the pending
  token (the target's last sampled one, at ``L``) then ``block_size - 1`` mask tokens
  (``mask_token_id``), embedded with the target's own input embedding (called as a module, as
  the reference calls ``target.model.embed_tokens``);
* attention without a causal mask: every block position sees the whole committed context and
  the whole block (the reference passes no mask, ``is_causal=False``);
* the target's LM head on the block's outputs at positions ``1 ..``: proposal ``i`` is the argmax
  there. The reference drafts greedily whatever the temperature (``sample(draft_logits)`` at
  temperature 0) and verifies by sampling the target, so q is one-hot on the proposal here too
  and sampling stays lossless (the standard rejection rule with a one-hot q).

In a round: :meth:`DFlash.observe` writes the context KV of the positions the target just
verified (after prefill: the prompt), at slot == position, in the draft's static per-row
:class:`~specfx.model.cache.SlotCache`; entries of rejected tokens sit past the new pending
position, where no query looks (a block sees slots ``< L`` only) until a later observe rewrites
them. :meth:`DFlash.propose` runs the whole block (always ``block_size`` tokens, as trained: with
bidirectional attention a shorter block would draft other tokens) and returns its first K
proposals, so K is at most ``block_size - 1``. The block's own keys and values never enter the
cache (the reference crops them away after each draft forward).

Where transformers' own DFlash (``DFlashTokenCandidateGenerator``, transformers >= 5.24) differs
from the reference, specfx follows the reference: transformers samples the proposals from the
draft's (processed) softmax when sampling, and its assistant model applies its layers' sliding
window through the mask; specfx refuses sliding draft layers (see
:mod:`specfx.drafters.heads.dflash_head`). Greedy, both draft the same tokens.

Token trees (``speculate(tree=TokenTree)``, decision 103; not in the reference, which drafts chains):
the same block forward gives one distribution per block position that does not depend on the
path (every position sees the pending token and masks, never a proposal), so a static tree of
depth D <= ``block_size - 1`` is filled as PARD's and Medusa's are: the node with child ranks
``(r_1, ..., r_d)`` gets the ``r_d``-th most likely token at position d. Every node is a
deterministic choice, so tree verification stays lossless; a tree whose nodes are all first
guesses proposes the chain's tokens. Dynamic (EAGLE-2) trees need path-dependent scores and are
refused. K = 0 rounds ("auto"'s plain decoding) leave the context behind, so the drafter is not
``resumable``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfx.drafters.base import Drafter, TreeDrafting
from specfx.drafters.heads.checkpoint import read_head, target_attention, warn_engine_gaps, write_head
from specfx.drafters.heads.dflash_head import (
    KIND,
    DFlashHead,
    default_layer_ids,
    load_head,
    read_fields,
    serving_gaps,
)
from specfx.drafters.heads.eagle_checkpoint import rope_keys
from specfx.model.admission import streams_refusal
from specfx.model.cache import SlotCache
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_positional_tree

__all__ = ["DFlash", "DFlashHead", "from_name"]


class DFlash(TreeDrafting, Drafter):
    """A DFlash draft model from checkpoint directory ``path`` (z-lab's layout: config.json and
    safetensors; see :mod:`specfx.drafters.heads.dflash_head`). :meth:`random` makes one for a
    target (tests, training), :meth:`save` writes the layout back. Its parameters follow the
    target's device and dtype at bind; the embedding and the LM head are the target's, shared."""

    name = "dflash"

    def __init__(self, path: str | Path):
        if path is None or (isinstance(path, str) and not path.strip()):
            raise ValueError(
                "DFlash(path): path is required: the directory of a DFlash draft checkpoint (config.json and "
                "*.safetensors, as z-lab publishes them), e.g. specfx.DFlash('/models/Qwen3-8B-DFlash-b16') or "
                "draft='dflash:/models/Qwen3-8B-DFlash-b16'."
            )
        ckpt = read_head(path, KIND)
        self._init(load_head(ckpt), str(ckpt.path))

    def _init(self, head: DFlashHead, where: str) -> None:
        self.head = head.eval()
        self.where = where
        self.max_depth = head.block_size - 1
        self.layer_ids: list[int] | None = head.fields["target_layer_ids"]  # resolved at bind when absent
        self.tap_order: list[int] | None = None
        self.target: ModelRunner | None = None
        self.cache: SlotCache | None = None

    def __repr__(self) -> str:
        return f"DFlash({self.where!r}, block_size={self.head.block_size})"

    @classmethod
    def random(
        cls,
        target,
        block_size: int = 4,
        num_layers: int = 1,
        layer_ids=None,
        mask_token_id: int | None = None,
        seed: int = 0,
        std: float | None = None,
    ) -> DFlash:
        """A draft for ``target`` (an HF causal LM) with seeded random weights: the target's
        sizes and rotary settings, ``num_layers`` layers, ``block_size``, taps at ``layer_ids``
        (outputs of those target layers; default the reference's spread, clamped to the target's
        layers), ``mask_token_id``
        (default the last id of the vocabulary). ``std`` defaults to the target's
        ``initializer_range``; norms are 1. Its drafts are meaningless until trained."""
        model = target.model if isinstance(target, ModelRunner) else target
        tc = model.config.get_text_config()
        vocab = model.get_input_embeddings().weight.shape[0]
        layers = tc.num_hidden_layers
        if layer_ids is not None:
            ids = list(layer_ids)
        else:  # the reference's spread, kept inside a shallow target (it reaches below layer 0 under 5 layers)
            ids = [min(max(i, 0), layers - 1) for i in default_layer_ids(layers, num_layers)]
        heads, kv_heads, head_dim = target_attention(tc)
        config = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": tc.hidden_size,
            "intermediate_size": getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "hidden_act": "silu", "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
            "max_position_embeddings": getattr(tc, "max_position_embeddings", 2048),
            **rope_keys(tc), "attention_bias": False, "num_hidden_layers": num_layers,
            "layer_types": ["full_attention"] * num_layers, "vocab_size": vocab, "tie_word_embeddings": False,
            "block_size": block_size, "num_target_layers": layers,
            "dflash_config": {"mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id, "target_layer_ids": ids},
        }  # fmt: skip
        head = DFlashHead(config, read_fields(config, "DFlash.random"), len(ids), "DFlash.random")
        std = float(getattr(tc, "initializer_range", 0.02)) if std is None else std
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in head.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        drafter = cls.__new__(cls)
        drafter._init(head, f"DFlash.random(seed={seed})")
        return drafter

    def save(self, path: str | Path) -> Path:
        """Write the draft to directory ``path`` (config.json and model.safetensors) in z-lab's
        layout, which :class:`DFlash`, the reference's ``DFlashDraftModel.from_pretrained`` and the
        DFlash loaders of vLLM and SGLang read (docs/ARCHITECTURE.md, decisions 77 and 85, name
        their files and releases): ``architectures`` ``["DFlashDraftModel"]``, the taps written
        explicitly whenever they are known (the engines size ``fc`` from them), the base rotary
        frequency at the top level, ``n_predict`` = ``block_size - 1`` (vLLM's default
        ``num_speculative_tokens``: the block specfx drafts with). A
        :class:`~specfx.drafters.heads.checkpoint.HeadLayoutWarning` names the engines that could
        not serve it as saved (see :func:`serving_gaps`)."""
        head = self.head
        config = dict(head.config)
        layers = self.target.num_layers if self.target is not None else head.fields["num_target_layers"]
        ids = self.layer_ids
        if ids is None and isinstance(layers, int):  # what bind resolves; the engines resolve no default alike
            ids = default_layer_ids(layers, len(head.layers))
            ids = ids if len(ids) == head.num_taps and all(0 <= i < layers for i in ids) else None
        nested = dict(config.get("dflash_config") or {})
        nested["mask_token_id"] = head.mask_token_id
        if ids is not None:
            nested["target_layer_ids"] = list(ids)
        config["dflash_config"] = nested
        config["block_size"] = head.block_size
        # vLLM reads no block_size: its block is the bonus token plus num_speculative_tokens masks, and
        # with attention inside the block both ways a shorter block drafts other tokens than specfx's
        # (always the whole block); n_predict is vLLM's default num_speculative_tokens, the trained one
        config["n_predict"] = head.block_size - 1
        if isinstance(layers, int):
            config["num_target_layers"] = layers
        # one source per field: transformers' top-level copies, and vLLM's EAGLE-3 tap list, which it
        # would read before dflash_config.target_layer_ids
        for key in ("mask_token_id", "target_layer_ids", "eagle_aux_hidden_state_layer_ids"):
            config.pop(key, None)
        # the tensors are z-lab's Qwen3 draft whatever the source named it (transformers' assistant):
        # the class vLLM keeps (a name starting with DFlash) and SGLang's entry class
        config["architectures"], config["model_type"] = ["DFlashDraftModel"], "qwen3"
        for key, value in rope_keys(config).items():  # readers with transformers 4 ignore rope_parameters
            config.setdefault(key, value)
        config["torch_dtype"] = str(head.fc.weight.dtype).removeprefix("torch.")
        out = write_head(path, config, head.tensors())
        warn_engine_gaps(KIND, out, serving_gaps(ids, layers, self._scaled_embedding()))
        return out

    def _scaled_embedding(self) -> bool:
        """Whether the bound target's input-embedding module returns other than its table's rows
        (a scale inside it, as transformers' Gemma models have); False when unbound (unknown)."""
        if self.target is None:
            return False
        embed = self.target.model.get_input_embeddings()
        ids = torch.arange(min(8, embed.weight.shape[0]), device=embed.weight.device).unsqueeze(0)
        with torch.no_grad():
            return not torch.equal(embed(ids), torch.nn.functional.embedding(ids, embed.weight))

    # ----------------------------------------------------------------- binding
    def bind(self, target: ModelRunner) -> None:
        why = target.taps_refusal()
        if why is not None:
            raise ValueError(why)
        head, model = self.head, target.model
        tc = model.config.get_text_config()
        owner = f"{KIND} draft {self.where!r}"
        layers = target.num_layers
        if head.hidden_size != tc.hidden_size:
            raise ValueError(
                f"{owner} has hidden size {head.hidden_size} but this target ({type(model).__name__}) has "
                f"{tc.hidden_size}; a DFlash draft reads the target's hidden states and token embeddings at its own "
                f"width, so it serves the target it was trained for only."
            )
        trained_for = head.fields["num_target_layers"]
        if isinstance(trained_for, int) and trained_for != layers:
            raise ValueError(
                f"{owner} was trained on a target of {trained_for} layers (num_target_layers) but this target "
                f"({type(model).__name__}) has {layers}; use the draft trained for this target."
            )
        vocab = model.get_input_embeddings().weight.shape[0]
        draft_vocab = head.config.get("vocab_size")
        if isinstance(draft_vocab, int) and draft_vocab not in (target.vocab_size, target.config_vocab_size, vocab):
            raise ValueError(
                f"{owner} was trained with a vocabulary of {draft_vocab} ids (vocab_size) but this target "
                f"({type(model).__name__}) has {target.vocab_size}; use the draft trained for this target's tokenizer."
            )
        if not 0 <= head.mask_token_id < vocab:
            raise ValueError(
                f"{owner}: mask_token_id {head.mask_token_id} is outside the target's embedding table (0..{vocab - 1}); "
                f"the draft embeds its mask tokens with the target's table, so it needs the target it was trained for."
            )
        ids = self.layer_ids if self.layer_ids is not None else default_layer_ids(layers, len(head.layers))
        if len(ids) != head.num_taps or not all(0 <= i < layers for i in ids):
            raise ValueError(
                f"{owner}: target_layer_ids {ids} must name {head.num_taps} layers (fc's inputs) of this target's "
                f"{layers} (0..{layers - 1}); use the draft trained for this target."
            )
        taps = ["final" if i == layers - 1 else f"layer:{i + 1}" for i in ids]  # outputs of layer i
        why = streams_refusal(target, taps)
        if why is not None:
            raise ValueError(why)
        self.taps = tuple(dict.fromkeys(taps))  # the target returns each tapped state once
        self.tap_order = [self.taps.index(t) for t in taps]
        self.layer_ids = list(ids)
        self.target = target
        self._follow_target()

    def _follow_target(self) -> None:
        """The draft's parameters on the target's device and in its dtype (the rotary
        frequencies stay float32)."""
        head, device = self.head, self.target.device
        for module in (head.layers, head.norm, head.fc, head.hidden_norm):
            module.to(device=device, dtype=self.target.dtype)
        head.rotary_emb.to(device=device)

    def allocate(self, batch_size: int, capacity: int) -> None:
        self._follow_target()  # the generator reallocates after model.to(dtype or device)
        target, device = self.target, self.target.device
        self.cache = SlotCache(len(self.head.layers), batch_size, capacity, device)
        zeros = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        trash = torch.full_like(zeros, self.cache.trash_slot)
        with torch.no_grad():
            # transformers installs its hidden-state recording lazily on the first
            # output_hidden_states call: do that here, eagerly, not inside a compiled graph
            target.forward(zeros, zeros, trash, taps=self.taps)
            context = torch.zeros((batch_size, 1, self.head.hidden_size), dtype=target.dtype, device=device)
            self.cache.slots = trash
            self.head.write_context(context, zeros, self.cache)  # allocates the KV buffers

    # ----------------------------------------------------------------- the round
    def observe(self, ctx, features, positions, slots) -> None:
        """The context KV of the positions the target just processed (``features`` at
        ``positions``/``slots [B, T]``), every draft layer's, at those slots."""
        states = torch.cat([features[i] for i in self.tap_order], dim=-1)  # [B, T, n_taps * H], fc's order
        context = self.head.context(states.to(self.head.fc.weight.dtype))  # [B, T, H]
        self.cache.slots = slots
        self.head.write_context(context, positions, self.cache)

    def block_logits(self, ctx, k: int) -> torch.Tensor:
        """The one draft forward of a round: the target's LM head on block positions ``1 .. k``,
        logits ``[B, k, V]`` for the tokens at ``L + 1 .. L + k`` (k: the chain's K or the tree's depth)."""
        head, lengths = self.head, ctx.lengths  # [B]: the pending position L
        b, n = lengths.shape[0], head.block_size
        pending = ctx.tokens.gather(1, lengths.unsqueeze(1))  # [B, 1]
        ids = torch.cat([pending, pending.new_full((b, n - 1), head.mask_token_id)], dim=1)  # [B, n]
        noise = self.target.model.get_input_embeddings()(ids).to(head.fc.weight.dtype)  # [B, n, H]
        positions = lengths.unsqueeze(1) + torch.arange(n, device=lengths.device)  # [B, n]
        visible = torch.arange(self.cache.capacity, device=lengths.device) < lengths.unsqueeze(1)  # [B, C]: committed
        out = head.block(noise, positions, self.cache, visible)  # [B, n, H]
        return self.target.model.get_output_embeddings()(out[:, 1 : 1 + k])  # [B, k, V]

    def propose(self, ctx):
        return self.block_logits(ctx, ctx.k).argmax(dim=-1), None  # greedy drafting, as the reference: q one-hot

    def propose_tree(self, ctx) -> torch.Tensor:
        return draft_positional_tree(ctx, self.block_logits(ctx, ctx.token_tree.depth))  # [B, N]


def from_name(arg: str | None) -> DFlash:
    """``draft="dflash:DIR"``: a DFlash draft loaded from checkpoint directory DIR."""
    if not arg:
        raise ValueError(
            "draft='dflash' needs the draft's checkpoint directory after a colon: draft='dflash:DIR' (a DFlash "
            "draft: config.json and *.safetensors, as z-lab publishes them)."
        )
    return DFlash(arg)
