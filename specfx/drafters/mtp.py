"""Native multi-token-prediction (MTP) heads as the drafter: ``draft="mtp"`` / ``specfx.MTP()``.

Some checkpoints (DeepSeek-V3, GLM-4-MoE, Mellum, ...) ship MTP layers next to the decoder:
layer ``i`` combines the embedding of the token at position ``q`` with the hidden state of
depth ``i - 1`` at ``q - 1`` (depth -1 = the target's last hidden state, after its final norm)
through one decoder block, and the shared LM head predicts the token at ``q + 1``.
transformers builds them as ``transformers.modeling_layers.MtpModel`` (loaded from the target's
checkpoint, sharing its embedding, LM head and rotary embedding); specfx calls those layers
itself with fixed shapes inside the round, with its own static per-row cache and masks.

Cache semantics (those of HF's ``MtpCache``, in slot == position form): layer ``i`` holds an
entry for each position ``q >= i + 1``, computed from the committed token at ``q`` and the
depth ``i - 1`` hidden state at ``q - 1``; slots ``<= i`` are masked out. Keeping that exact
without host syncs:

* :meth:`MTP.observe` runs after the target's forward of every prefill and round, once the
  emitted tokens are committed. For every position ``p`` the target just processed it runs
  each MTP layer at ``p + 1`` (a window of T = K + 1 positions, or the prompt), which writes
  every newly committed entry; entries past the new pending position ``L`` are garbage that
  the mask hides and the next window overwrites. It stashes each layer's hidden state at ``L``.
* :meth:`MTP.propose` drafts from the stash: proposal 1 is the LM head of layer 0's hidden at
  ``L``; proposal ``i + 1`` (``i < m``) comes from layer ``i`` run over the draft positions
  ``L+1..L+i`` (the window HF's ``MtpModel.forward`` gives that layer); proposals past the
  number of MTP layers ``m`` chain the last layer on its own output, one token a step (what
  vLLM does for DeepSeek-V3's single MTP layer).

The target's last hidden state comes from the target's own forward
(``ModelRunner.forward(..., taps=("final",))``, the hidden-taps pass), so nothing
in the target is patched. Sampling is lossless (q is the processed MTP distribution) and
greedy output equals the target's, whatever the MTP layers predict.
"""

from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F

from specfx.drafters.base import TREE_DRAFTERS, Drafter
from specfx.drafters.drafting import draft_chain, stash_at
from specfx.drafters.mtp_fc import LAYOUTS as FC_LAYOUTS
from specfx.drafters.mtp_fc import FcMtpLayers, checkpoint_files, fc_mtp_layer_count
from specfx.drafters.mtp_v4 import V4MtpLayers
from specfx.model.architectures import ARCHITECTURES
from specfx.model.cache import SlotCache
from specfx.model.dynamo import mark_static
from specfx.model.hf_names import cache_kwarg, mtp_weights_regex
from specfx.model.masks import check_attn_implementation, layer_pattern, to_format, visible_slots
from specfx.model.runner import ModelRunner

__all__ = ["LAYOUTS", "MTP", "has_mtp", "mtp_layer_count", "mtp_support", "random_mtp_layers", "save_with_mtp_layers"]

LAYOUTS = {**FC_LAYOUTS, "deepseek_v4": V4MtpLayers}  # ArchSpec.mtp_layout -> the class specfx builds


def mtp_support():
    """transformers' ``MtpModel`` class, or None when this transformers has no MTP support
    (detected by capability, not by version)."""
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError:
        return None
    return MtpModel


def mtp_layout(model) -> str:
    """The MTP layout specfx builds for ``model``'s type itself (``ArchSpec.mtp_layout``:
    ``"qwen3_next"``, ``"bailing"``, ``"deepseek_v4"``; its class: ``LAYOUTS``), or "" where transformers'
    ``MtpModel`` is the way (or none is)."""
    config = model.config.get_text_config(decoder=True)
    return getattr(ARCHITECTURES.get(getattr(config, "model_type", None)), "mtp_layout", "")


def mtp_layer_count(model) -> int:
    """MTP layers the model's config declares: ``num_mtp_layers`` of its text config, or for a
    type with an ``mtp_layout`` that layout's count (0 when absent)."""
    if mtp_layout(model):
        return fc_mtp_layer_count(model.config)
    config = model.config.get_text_config()
    n = getattr(config, "num_mtp_layers", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _checkpoint_keys(model) -> list[str] | None:
    """Tensor names of the model's safetensors checkpoint (local directory or the HF cache;
    never the network), read from the index or the file headers; None if not found."""
    files = checkpoint_files(model)
    return None if files is None else list(files)


def _cannot_load_mtp(model) -> str | None:
    """Why the installed transformers cannot build ``model``'s MTP layers and load them from a
    checkpoint (HF's own error), or None when it can. Asked of transformers itself, not of a version
    number: e.g. Mellum's MTP layers arrived in transformers 5.20; before, its config has no MTP
    layer types (``get_mtp_config()`` refuses) and its class registers no MTP weights."""
    try:
        model.config.get_mtp_config()  # what MtpModel(model, n) builds its layers from
        mtp_weights_regex(mtp_support(), model)  # what MtpModel.from_pretrained(model) loads
    except (ValueError, AttributeError, TypeError) as e:
        return str(e) or type(e).__name__
    return None


def _checkpoint_has_mtp_weights(model) -> bool:
    if layout := mtp_layout(model):  # a tensor every layer reads first
        return LAYOUTS[layout].presence_key(model.config) in (_checkpoint_keys(model) or ())
    try:
        pattern: re.Pattern = mtp_weights_regex(mtp_support(), model)
    except (ValueError, AttributeError, TypeError):
        return False
    keys = _checkpoint_keys(model)
    return bool(keys) and any(pattern.search(k) for k in keys)


def has_mtp(model) -> bool:
    """True when ``draft="mtp"`` can work on ``model`` as loaded: transformers supports MTP for
    this model, the config declares MTP layers, and the checkpoint the model came from holds their
    weights. Cheap (config and safetensors headers only) and never raises."""
    try:
        if mtp_layout(model):
            return mtp_layer_count(model) > 0 and _checkpoint_has_mtp_weights(model)
        return (
            mtp_support() is not None
            and mtp_layer_count(model) > 0
            and _cannot_load_mtp(model) is None
            and _checkpoint_has_mtp_weights(model)
        )
    except Exception:  # a heuristic for the default choice must not break speculate()
        return False


def random_mtp_layers(target, num_layers: int, std: float = 0.3, seed: int = 0):
    """``MtpModel(target, num_layers)`` with seeded random matrices (norms at 1), in eval mode:
    MTP layers for tests and benchmarks of the machinery (their drafts are meaningless).
    ``MtpModel`` is meant to be loaded from a checkpoint, and its own init leaves e.g. fused
    expert weights uninitialised, hence the explicit values. ``target.config`` must declare
    ``num_mtp_layers``. For a type with an ``mtp_layout``: that layout's class instead."""
    if layout := mtp_layout(target):
        return LAYOUTS[layout].random(target, num_layers, std, seed)
    layers = mtp_support()(target, num_layers).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layers.layers.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return layers


def save_with_mtp_layers(target, layers, directory) -> None:
    """Save ``target`` to ``directory`` with ``layers`` added to its ``model.safetensors`` under
    ``mtp.``: an ``MtpModel`` in the layout ``MtpModel.from_pretrained`` reads (embedding and
    shared head are the target's, not saved twice), or :class:`FcMtpLayers` in its checkpoint
    layout, experts in the form the target's own layers were saved in. For tests and benchmarks."""
    from safetensors.torch import load_file, save_file

    target.save_pretrained(directory)
    file = os.path.join(directory, "model.safetensors")
    tensors = load_file(file)
    if isinstance(layers, FcMtpLayers):
        tensors.update(layers.checkpoint_tensors(per_expert=any(".experts.0." in k for k in tensors)))
    else:
        for name, t in layers.state_dict().items():
            if not name.startswith(("embed_tokens.", "shared_head.")):  # shared with the target
                tensors["mtp." + name] = t.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def _no_mtp_error(model, why: str) -> ValueError:
    return ValueError(
        f"draft='mtp': {type(model).__name__} {why}. MTP drafting needs a checkpoint that carries "
        f"multi-token-prediction layers (DeepSeek-V3, GLM-4-MoE, Mellum, ... with num_mtp_layers in "
        f"their config; Qwen3-Next, Qwen3.5 with mtp_num_hidden_layers and mtp.* tensors; BailingHybrid; DeepSeek-V4), or "
        f"specfx.MTP(layers=...) with MTP layers built for this target. "
        f"Otherwise use draft='prompt_lookup', draft='early_exit:N' or a draft model."
    )


class MTP(Drafter):
    """Draft with the target's own multi-token-prediction layers (see the module docstring).

    Args:
        layers: a ``transformers.modeling_layers.MtpModel`` built for this target (e.g.
            ``MtpModel(target, n)`` trained by you, or ``MtpModel.from_pretrained(target)``), or,
            for a type whose table row names an MTP layout (Qwen3-Next, Qwen3.5, BailingHybrid, DeepSeek-V4), that
            layout's class in :mod:`specfx.drafters.mtp_fc` built for this target.
            None (default, and ``draft="mtp"``): loaded from the target's checkpoint at
            ``speculate()`` time, by ``MtpModel.from_pretrained`` or, for such a type, by
            the layout's ``from_checkpoint`` (the MTP tensors transformers drops).
    """

    name = "mtp"
    taps = ("final",)  # the target's last hidden state, after its final norm

    def __init__(self, layers=None):
        if layers is not None and not isinstance(layers, FcMtpLayers):
            mtp_model = mtp_support()
            if mtp_model is None or not isinstance(layers, mtp_model):
                raise TypeError(
                    f"MTP(layers=...) takes a transformers MtpModel (transformers.modeling_layers.MtpModel) "
                    f"or specfx.drafters.mtp_fc.FcMtpLayers, got {type(layers).__name__}."
                )
        self.mtp = layers
        self.cache: SlotCache | None = None
        self.stash: torch.Tensor | None = None  # [m, B, 1, H] each layer's hidden at the pending position

    def __repr__(self) -> str:
        return f"MTP(layers={self.num_layers if self.mtp is not None else 'from checkpoint'})"

    @property
    def num_layers(self) -> int:
        return len(self.mtp.layers)

    # ----------------------------------------------------------------- setup
    def stateful_target_refusal(self, model) -> str | None:
        """Why these MTP layers cannot draft for ``model``, a target keeping recurrent state, or
        None when they can: layers of a layout specfx builds (``ArchSpec.mtp_layout``) keep
        attention KV only, whatever the target's mixers; transformers' ``MtpModel`` layers are the
        target's decoder-layer class, which may keep state that nothing rolls back (decision 86)."""
        if isinstance(self.mtp, FcMtpLayers) or (self.mtp is None and mtp_layout(model)):
            return None
        config = model.config.get_text_config(decoder=True)
        reason = getattr(ARCHITECTURES.get(getattr(config, "model_type", None)), "mtp_reason", "")
        if self.mtp is None and reason:
            return f"draft='mtp' is refused on model type {config.model_type!r}: {reason}"
        return (
            "transformers' MTP layers (MtpModel) are built from the target's own decoder-layer class, whose "
            "layers may keep state of their own that nothing rolls back, and no stateful type's MtpModel layers "
            "have been verified; specfx builds MTP layers keeping attention KV only for the types whose table row "
            "names an MTP layout (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, BailingHybrid, DeepSeek-V4: ArchSpec.mtp_layout)"
        )

    def bind(self, target: ModelRunner) -> None:
        model = target.model
        if self.mtp is None and mtp_layout(model):
            self.mtp = self._load_layout(model)
        mtp_model = mtp_support()
        if mtp_model is None and not isinstance(self.mtp, FcMtpLayers):
            import transformers

            raise _no_mtp_error(
                model,
                f"cannot use MTP with transformers {transformers.__version__}, which has no MTP support "
                f"(transformers.modeling_layers.MtpModel); upgrade transformers",
            )
        if self.mtp is None:
            config = model.config.get_text_config(decoder=True)
            reason = getattr(ARCHITECTURES.get(getattr(config, "model_type", None)), "mtp_reason", "")
            if reason:  # a type whose checkpoints ship MTP layers specfx has no layout for (DeepSeek-V4)
                raise ValueError(f"draft='mtp' is refused on model type {config.model_type!r}: {reason}")
            if mtp_layer_count(model) == 0:
                raise _no_mtp_error(model, "has no MTP layers (its config sets no num_mtp_layers)")
            why = _cannot_load_mtp(model)
            if why is not None:
                import transformers

                raise ValueError(
                    f"draft='mtp': {type(model).__name__} declares {mtp_layer_count(model)} MTP layer(s), but "
                    f"transformers {transformers.__version__} cannot build or load this model's MTP layers "
                    f"({why}): its implementation of {type(model).__name__} has no MTP support. Upgrade "
                    f"transformers to a release whose {type(model).__name__} supports MTP layers, or use "
                    f"draft='prompt_lookup', draft='early_exit:N' or a draft model."
                )
            if not _checkpoint_has_mtp_weights(model):
                where = getattr(model.config, "name_or_path", "") or "(no checkpoint path)"
                raise _no_mtp_error(
                    model,
                    f"declares {mtp_layer_count(model)} MTP layer(s) but its checkpoint {where!r} holds no "
                    f"MTP weights (the model was not loaded from such a checkpoint, or it was saved without them)",
                )
            self.mtp = mtp_model.from_pretrained(model, device_map={"": target.device}).eval()
        if self.mtp.training:
            raise ValueError(
                "MTP(layers=...): the MTP layers are in training mode (dropout would change the drafts "
                "from call to call); call .eval() on it first."
            )
        head = getattr(self.mtp, "shared_head", None)
        if head is None or head.weight.data_ptr() != target.model.get_output_embeddings().weight.data_ptr():
            raise ValueError(
                "MTP(layers=...): these MTP layers were built for another model; they must share the "
                "target's LM head, as MtpModel(target, n) and MtpModel.from_pretrained(target) make them."
            )
        # the target's state a depth -1 reads: its last hidden state after the final norm, or the layout's own
        # (DeepSeek-V4's: its last layer's hyper-connection streams)
        self.taps = (getattr(self.mtp, "target_tap", "final"),)
        config = self.mtp.config
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers)
        owner = f"draft='mtp': {type(model).__name__}'s MTP layers"
        # per MTP layer: ("full", None) | ("sliding", W) | ("chunked", S)
        self.patterns = [layer_pattern(config, t, owner) for t in self.layer_types]
        self.mask_format = check_attn_implementation(self.mtp)
        layer = self.mtp.layers[0]  # "cache" from transformers 5.24 on; V4's layer passes **kwargs to its attention
        self.cache_kwarg = cache_kwarg(layer) or cache_kwarg(getattr(layer, "self_attn", layer))
        self.target = target
        self.vocab = target.vocab_size

    @staticmethod
    def _load_layout(model) -> FcMtpLayers:
        """The layers of ``model``'s table-row layout, from its checkpoint (clear errors otherwise)."""
        if mtp_layer_count(model) == 0:
            raise _no_mtp_error(
                model, "has no MTP layers (its config sets no mtp_num_hidden_layers or num_nextn_predict_layers)"
            )
        if not _checkpoint_has_mtp_weights(model):
            where = getattr(model.config, "name_or_path", "") or "(no checkpoint path)"
            raise _no_mtp_error(
                model,
                f"declares {mtp_layer_count(model)} MTP layer(s) but its checkpoint {where!r} holds no "
                f"MTP weights ({LAYOUTS[mtp_layout(model)].presence_key(model.config)}; the model was not loaded "
                f"from such a checkpoint, or it was saved without them)",
            )
        return LAYOUTS[mtp_layout(model)].from_checkpoint(model)

    def allocate(self, batch_size: int, capacity: int) -> None:
        device = self.target.device
        self.cache = SlotCache(self.num_layers, batch_size, capacity, device)
        hidden = getattr(self.mtp, "hidden_width", self.mtp.config.hidden_size)  # what the depths exchange
        self.stash = torch.zeros((self.num_layers, batch_size, 1, hidden), dtype=self.target.dtype, device=device)
        # written in place every round, like the KV buffers (whose SlotLayers mark themselves)
        mark_static(self.stash)
        # One eager probe per layer allocates its KV buffers (shapes learned from the layer
        # itself) writing only the trash slot, so no compiled graph allocates them.
        zeros = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        trash = torch.full_like(zeros, self.cache.trash_slot)
        with torch.no_grad():
            for i in range(self.num_layers):
                self._layer(i, zeros, self.stash[i], zeros, trash)

    # ----------------------------------------------------------------- one MTP layer
    def _mask(self, i: int, positions: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T, C]``: query at q sees slots ``i+1 <= j <= q`` (HF's MtpCache offsets)
        within the layer's window or chunk; a query with ``q <= i`` (never a real draft) sees only slot
        q, so no row is fully masked (SDPA would return NaN)."""
        capacity = self.cache.capacity
        visible = visible_slots(positions, capacity, self.patterns[i])
        slots = torch.arange(capacity, device=positions.device).view(1, 1, 1, -1)
        q = positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, 1]
        visible = visible & ((slots >= i + 1) | (slots == q))
        return to_format(visible, self.mask_format, self.target.dtype)

    def _layer(self, i: int, ids, hidden, positions, slots) -> torch.Tensor:
        """MTP layer ``i`` on tokens ``ids [B, T]`` at ``positions`` with the previous depth's
        hidden states ``[B, T, H]`` (each at position - 1); KV written at ``slots``."""
        mtp = self.mtp
        self.cache.slots = slots
        embeds = mtp.embed_tokens(ids)
        mask = self._mask(i, positions)
        if isinstance(mtp, FcMtpLayers):  # a layout specfx builds: its own depth and rope
            return mtp.forward_layer(
                i, embeds, hidden, positions, attention_mask=mask, **{self.cache_kwarg: self.cache}
            )
        rope = None
        if mtp.rotary_emb is not None:
            kwargs = {"layer_type": self.layer_types[i]} if getattr(mtp, "has_per_layer_rope", False) else {}
            rope = mtp.rotary_emb(embeds, position_ids=positions, **kwargs)
        out = mtp.layers[i](
            embeds,
            hidden,
            position_embeddings=rope,
            attention_mask=mask,
            position_ids=positions,
            **{self.cache_kwarg: self.cache},
        )
        if getattr(mtp, "use_shared_post_norm", False):
            out = mtp.shared_post_norm(out)
        return out

    def _logits(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """The draft logits of MTP depth ``i``'s output ``hidden``."""
        if isinstance(self.mtp, FcMtpLayers):
            hidden = self.mtp.head_input(hidden, i)
        project = getattr(self.mtp, "_project_to_logits", None)  # muP scaling, vocab slicing as HF does
        logits = project(hidden) if project is not None else self.mtp.shared_head(hidden)
        if logits.shape[-1] < self.vocab:  # an unpadded vocabulary: padding ids are never drafted
            logits = F.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))
        return logits

    # ----------------------------------------------------------------- the round
    def observe(self, ctx, features, positions, slots) -> None:
        """Commit the MTP entries for the positions after those the target just processed
        (``features``: its last hidden state ``[B, T, H]`` at ``positions``/``slots [B, T]``), and stash each layer's hidden
        state at the new pending position ``ctx.lengths``."""
        (hidden,) = features
        capacity = self.cache.capacity
        q_pos = positions + 1  # [B, T]: layer i at p + 1 uses the depth i-1 hidden at p
        q_slots = torch.where(slots == positions, q_pos, self.cache.trash_slot).clamp(max=capacity - 1)
        ids = ctx.tokens.gather(1, q_pos.clamp(max=capacity - 1))  # committed up to the pending token
        at_pending = q_pos == ctx.lengths.unsqueeze(1)  # [B, T], one True per row that advanced
        if isinstance(self.mtp, FcMtpLayers):
            hidden = self.mtp.target_hidden(hidden)
        h_in = hidden.to(self.stash.dtype)
        for i in range(self.num_layers):
            out = self._layer(i, ids, h_in, q_pos, q_slots)  # [B, T, H] at positions p + 1
            # the next depth at p + 1 needs this depth at p: the stash (p = old pending) then out
            h_in = torch.cat([self.stash[i], out[:, :-1]], dim=1)
            stash_at(self.stash[i], out, at_pending)

    def propose(self, ctx):
        m = self.num_layers
        lengths = ctx.lengths.unsqueeze(1)  # [B, 1], the pending position L
        prev = self.stash[0][:, :0]  # [B, i, H]: depth i - 1 outputs at L+1..L+i - 1 (none yet)
        last = self.stash[0]  # [B, 1, H]: the hidden the next chained step starts from

        def step(i, proposals):
            nonlocal prev, last
            if i < m:  # layer i over the draft positions L+1..L+i, as in HF's MtpModel.forward
                pos = lengths + torch.arange(1, i + 1, device=lengths.device)  # [B, i]
                ids = torch.cat(proposals, dim=1)  # [B, i]
                out = self._layer(i, ids, torch.cat([self.stash[i - 1], prev], dim=1), pos, pos)
                prev, last = out, out[:, -1:]
            else:  # past the MTP layers: chain the last one on its own output
                pos = lengths + i  # [B, 1]
                last = self._layer(m - 1, proposals[-1], last, pos, pos)
            return self._logits(last, min(i, m - 1))

        return draft_chain(ctx, self._logits(self.stash[0], 0), step)  # proposal 0: layer 0 at L -> L + 1

    def chain_only_reason(self) -> str:
        return (
            "MTP heads draft a chain only, not a token tree: MTP layer i drafts the token i + 1 "
            "positions ahead from layer i - 1's hidden state along one path, and their cache keeps one "
            "entry per position, not per tree node. Use draft='mtp' with num_speculative_tokens=K (no "
            f"tree=), or a drafter that branches: {TREE_DRAFTERS}."
        )


def from_name(arg: str | None) -> MTP:
    if arg is not None:
        raise ValueError(f"draft='mtp:{arg}': 'mtp' takes no argument; use draft='mtp'.")
    return MTP()
