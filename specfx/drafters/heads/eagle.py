"""EAGLE drafters: a small head that drafts from the target's own hidden states.

EAGLE (Li et al., 2024; SafeAILab/EAGLE) drafts with one decoder layer that reads, at each
position, the token there and the target's feature (hidden state) one position earlier, and
predicts the feature of its own position; the target's LM head turns that prediction into a
draft token. Deeper draft steps feed the head's own output back as the feature. EAGLE-1/2
(:class:`Eagle`) read the target's last hidden state after its final norm; EAGLE-3
(:mod:`specfx.drafters.heads.eagle3`) fuses several layers' hidden states instead. Both share the
cache protocol of :class:`EagleBase`.

The cache protocol
------------------
An *entry* at position ``t`` pairs the token ``x_t`` with the feature of position ``t - 1``:
the target's feature for committed positions, the head's own output for drafted ones. Its
output predicts the feature at ``t``, and the LM head on that output the token at ``t + 1``.
Entry ``t`` lives at slot ``t`` of the head's one-layer static KV cache, at position ``t``.
(SafeAILab numbers the entry pairing ``x_t`` with ``f_{t-1}`` as position ``t - 1``; rotary
attention depends only on position differences, so indexing entries by the token's position
is the same attention.) Position 0 has no entry (no feature precedes it): slot 0 is masked
out, the query's own slot always visible so no mask row is empty.

* :meth:`EagleBase.observe` runs after every target forward (prefill, chain round, tree
  round), once the emitted tokens are committed. For each position ``p`` the target just
  processed (real columns: slot == position) it writes the entry at ``p + 1`` (token
  ``ctx.tokens[p + 1]``, feature ``f_p``) in one forward, and stashes that forward's output at
  the new pending position ``ctx.lengths`` (rows without such a column keep their stash).
  Entries past the pending token pair garbage tokens or rejected features; every one of those
  slots is rewritten by a later observe before any query can see it. So after a round the
  head's cache is what it would be had it seen only the emitted tokens, with no catch-up
  forward in propose.
* :meth:`EagleBase.propose` (a chain of K): proposal 1 is the LM head on the stash (the
  entry at the pending position ``L``); step ``i`` writes the entry ``(proposal i, previous
  output)`` at position and slot ``L + i``. Proposals are processed and sampled like the
  target's scores (:func:`specfx.drafters.drafting.draft_chain`), so sampling stays lossless.
* :meth:`EagleBase.propose_tree` (a static :class:`~specfx.trees.types.TokenTree`): node ``n``'s entry
  sits at position ``L + depth[n]`` in scratch slot ``L + n`` and sees the committed entries
  and its ancestors' (the tree mask); its feature is its parent's output (the root's is the
  stash: the root is the pending token, whose entry observe committed at slot ``L``).
  :meth:`commit_tree` moves nothing: the next observe rewrites the accepted path's entries.
* :meth:`EagleBase.propose_dynamic_tree` (EAGLE-2, ``TokenTree.eagle2()``): the same entries,
  grown per row by :func:`specfx.trees.drafting.draft_dynamic_tree`: the ``k`` nodes expanded at a
  depth run as one forward, each reading its parent's output, in the scratch slots and under
  the per-row tree mask that function gives.

Contract for subclasses (EAGLE-1/2 here, EAGLE-3 in :mod:`specfx.drafters.heads.eagle3`)
--------------------------------------------------------------------------------
* ``taps``: the target hidden states the head reads (see :class:`specfx.drafters.base.Drafter`).
* ``_bind(target)``: build and check the head for ``target`` (a :class:`~specfx.model.runner.ModelRunner`),
  move its own parameters to the target's device and dtype, and set ``state_size`` (S, the width
  of an entry's output and feature input). The base's :meth:`bind` has already set
  ``self.target`` and ``self.mask_format``.
* ``_feature(features) -> [B, T, S]``: the target's taps (one ``[B, T, H]`` tensor each) as the
  feature input of entries (EAGLE-1: the ``"final"`` tap itself; EAGLE-3: its fused taps).
* ``_entry(ids [B, T], feature [B, T, S], positions, slots, tree) -> out [B, T, S]``: one draft
  forward writing the entries' KV at ``slots`` (set ``self.cache.slots`` first; mask with
  :meth:`_entry_mask`; ``tree`` a :class:`~specfx.model.masks.TreeView` or None).
* ``_logits(out) -> [B, T, V]``: draft logits over the target's vocabulary.
* ``_allocate_kv(batch, capacity)``: set ``self.cache`` (default: a one-layer
  :class:`~specfx.model.cache.SlotCache`); the base then allocates the stash and runs one eager
  probe entry (writing only the trash slot) so the KV buffers exist before any compiled graph.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import torch
from torch import nn

from specfx.model.cache import SlotCache
from specfx.model.capture import decoder_layer_names
from specfx.drafters.base import Drafter, DynamicTreeDrafting
from specfx.drafters.drafting import draft_chain, stash_at
from specfx.model.dynamo import mark_static
from specfx.model.hf_names import cache_kwarg
from specfx.model.masks import TreeView, check_attn_implementation, layer_pattern, mask_plan, to_format, visible_slots
from specfx.model.runner import ModelRunner
from specfx.trees.drafting import draft_dynamic_tree, draft_tree, level_inputs, tree_view
from specfx.drafters.heads.checkpoint import HeadCheckpoint, check_tensors, read_head, warn_engine_gaps, write_head

__all__ = ["Eagle", "EagleBase", "from_name", "rope_keys", "target_rotary"]


def target_rotary(model, owner: str):
    """``model``'s rotary-embedding module (``model.base_model.rotary_emb``), which a head runs
    its decoder layer with (rotary attention: positions are shared with the target). ValueError
    when the target has none (learned or ALiBi positions)."""
    rotary = getattr(model.base_model, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise ValueError(
            f"{owner}: the target {type(model).__name__} has no rotary position embedding "
            f"(base_model.rotary_emb); EAGLE heads run a decoder layer with the target's rotary "
            f"embedding, so they serve rotary-position targets only (Llama, Qwen, Mistral, Gemma, ...)."
        )
    return rotary


class EagleBase(DynamicTreeDrafting, Drafter):
    """A drafter that runs a head on the target's features, with its own one-layer static KV
    (see the module docstring for the cache protocol and the subclass contract)."""


    target: ModelRunner
    mask_format: str
    state_size: int
    cache: SlotCache | None = None
    stash: torch.Tensor | None = None  # [B, 1, S] the entry's output at the pending position

    # ----------------------------------------------------------------- setup
    def bind(self, target: ModelRunner) -> None:
        why = target.taps_refusal()
        if why is not None:
            raise ValueError(why)
        self.target = target
        self.mask_format = check_attn_implementation(target.model)
        self._bind(target)

    def _bind(self, target: ModelRunner) -> None:
        raise NotImplementedError

    def _allocate_kv(self, batch_size: int, capacity: int) -> None:
        self.cache = SlotCache(1, batch_size, capacity, self.target.device)

    def allocate(self, batch_size: int, capacity: int) -> None:
        device = self.target.device
        self._allocate_kv(batch_size, capacity)
        self.stash = torch.zeros((batch_size, 1, self.state_size), dtype=self.target.dtype, device=device)
        mark_static(self.stash)  # written in place every round, like the KV buffers
        zeros = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        trash = torch.full_like(zeros, self.cache.trash_slot)
        with torch.no_grad():
            # transformers installs its hidden-state recording lazily on the first
            # output_hidden_states call: do that here, eagerly, not inside a compiled graph
            self.target.forward(zeros, zeros, trash, taps=self.taps)
            self._entry(zeros, self.stash, zeros, trash, None)  # allocates the KV buffers

    # ----------------------------------------------------------------- the head (subclasses)
    def _feature(self, features: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def _entry(self, ids, feature, positions, slots, tree: TreeView | None) -> torch.Tensor:
        raise NotImplementedError

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _entry_mask(self, positions: torch.Tensor, tree: TreeView | None, pattern=("full", None)) -> torch.Tensor:
        """``[B, 1, T, C]`` in the target's mask format: the usual causal (or tree) visibility
        within the layer's ``pattern``, without slot 0 (it holds no entry); a chain query always
        sees its own slot, so the probe at position 0 has a non-empty row (SDPA would give NaN).
        Tree queries sit at positions >= 1 and see their own slot through the tree mask."""
        capacity = self.cache.capacity
        visible = visible_slots(positions, capacity, pattern, tree)
        slots = torch.arange(capacity, device=positions.device).view(1, 1, 1, -1)
        if tree is None:
            visible = visible & ((slots >= 1) | (slots == positions.unsqueeze(1).unsqueeze(-1)))
        else:
            visible = visible & (slots >= 1)
        return to_format(visible, self.mask_format, self.target.dtype)

    # ----------------------------------------------------------------- the round
    def observe(self, ctx, features, positions, slots) -> None:
        """Write the entries after the positions the target just processed (``features`` at
        ``positions``/``slots [B, T]``) and stash the output at the pending position."""
        feature = self._feature(features).to(self.stash.dtype)  # [B, T, S]
        capacity = self.cache.capacity
        q_pos = positions + 1  # [B, T]: the entry at p + 1 reads the feature at p
        q_slots = torch.where(slots == positions, q_pos, self.cache.trash_slot).clamp(max=capacity - 1)
        ids = ctx.tokens.gather(1, q_pos.clamp(max=ctx.tokens.shape[1] - 1))  # committed up to the pending token
        out = self._entry(ids, feature, q_pos, q_slots, None)  # [B, T, S]
        stash_at(self.stash, out, q_pos == ctx.lengths.unsqueeze(1))  # one True per row that advanced

    def propose(self, ctx):
        lengths = ctx.lengths.unsqueeze(1)  # [B, 1], the pending position L
        last = self.stash  # [B, 1, S]: the entry output the next step reads as its feature

        def step(i, proposals):
            nonlocal last
            pos = lengths + i  # [B, 1]: proposal i - 1 (0-based) sits at L + i
            last = self._entry(proposals[-1], last, pos, pos, None)
            return self._logits(last)

        return draft_chain(ctx, self._logits(self.stash), step)

    def propose_tree(self, ctx):
        parents = ctx.token_tree.parents
        outputs: dict[int, torch.Tensor] = {0: self.stash}  # node -> its entry's output [B, 1, S]

        def step(queries, tokens):
            ids, pos, slots = level_inputs(ctx, queries, tokens)
            feature = torch.cat([outputs[parents[q]] for q in queries], dim=1)  # [B, T, S]
            out = self._entry(ids, feature, pos, slots, tree_view(ctx, queries))
            for t, q in enumerate(queries):
                outputs[q] = out[:, t : t + 1]
            return self._logits(out)

        return draft_tree(ctx, self._logits(self.stash), step)


    def propose_dynamic_tree(self, ctx):
        # EAGLE-2: the expanded nodes of each depth run as one draft forward, each reading its
        # parent's output (the root's children: the stash), in the scratch slots the tree
        # growth assigns; observe rewrites the accepted path's entries as for a static tree.
        def step(ids, states, positions, slots, view):
            out = self._entry(ids, states, positions, slots, view)  # [B, k, S]
            return self._logits(out), out

        return draft_dynamic_tree(ctx, self._logits(self.stash), self.stash, step)

    def commit_tree(self, src, dst) -> None:
        """Nothing to move: observe rewrites the accepted path's entries from the target's
        features, which is what the head would have computed had it seen only those tokens."""


# Checkpoint config keys that size the head's decoder layer where they differ from the
# target's config (SafeAILab's config.json is a copy of the target's with num_hidden_layers=1).
_LAYER_OVERRIDES = (
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "attention_bias",
    "mlp_bias",
)
# Target config keys copied into a saved head's config.json (the SafeAILab layout).
_CONFIG_KEYS = ("model_type", "hidden_size", "vocab_size", "max_position_embeddings", "rope_theta", "rope_parameters",
                "pad_token_id", "bos_token_id", "eos_token_id") + _LAYER_OVERRIDES  # fmt: skip


def _getter(config):
    return config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)


def _rope_theta(config) -> float | None:
    get = _getter(config)
    theta = get("rope_theta")
    if theta is None:
        params = get("rope_parameters")
        if isinstance(params, dict):
            theta = params.get("rope_theta")
    return theta


def rope_keys(config) -> dict:
    """``config``'s rotary settings (a config object or a config.json dict) as a head's
    config.json writes them for every engine: ``rope_theta`` at the top level, where SafeAILab's
    EConfig, vLLM and SGLang read it (transformers 5 keeps it only inside ``rope_parameters``,
    which those readers ignore: a head saved without it runs with base 10000 there), and for
    scaled rotary ``rope_scaling`` (``rope_parameters`` without the base)."""
    get = _getter(config)
    params = dict(get("rope_parameters") or {})
    if params and "rope_type" not in params and "rope_theta" not in params:  # per layer type (Gemma 3)
        params = dict(params.get("full_attention") or next(iter(params.values())))
    theta = params.pop("rope_theta", None) or get("rope_theta") or 10000.0
    keys = {"rope_theta": float(theta)}
    if params.get("rope_type", "default") != "default":
        keys["rope_scaling"] = params
    return keys


def _target_layer(model, owner: str) -> nn.Module:
    """``model``'s first decoder layer (found generically, :func:`specfx.model.capture.decoder_layer_names`)."""
    try:
        return model.get_submodule(decoder_layer_names(model)[0])
    except ValueError as e:
        raise ValueError(f"{owner}: {e} EAGLE heads reuse the target's decoder-layer class.") from None


def _head_layer(cls, config, model, owner: str) -> nn.Module:
    """``cls(config, 0)`` with its input norm replaced by identity (EAGLE's layer has none: the
    fc output enters attention as is), checked to have the target's head size (it runs with the
    target's rotary embedding)."""
    name = cls.__name__
    try:
        layer = cls(config, 0)
    except Exception as e:
        raise ValueError(
            f"{owner}: {type(model).__name__}'s decoder layer ({name}) cannot be built as {name}(config, "
            f"layer_idx=0) ({type(e).__name__}: {e}); EAGLE heads need a target whose decoder layers are "
            f"built that way (Llama, Qwen, Mistral, Gemma, Mixtral, ...)."
        ) from e
    if not isinstance(getattr(layer, "input_layernorm", None), nn.Module):
        raise ValueError(
            f"{owner}: {type(model).__name__}'s decoder layer ({name}) has no input_layernorm, which EAGLE's "
            f"layer drops (its input is the fc output); this target's layers are not of that form."
        )
    layer.input_layernorm = nn.Identity()
    head_dim = getattr(getattr(layer, "self_attn", None), "head_dim", None)
    target_dim = getattr(getattr(_target_layer(model, owner), "self_attn", None), "head_dim", None)
    if head_dim != target_dim:
        raise ValueError(
            f"{owner}: the head's attention has head_dim {head_dim} but the target's has {target_dim}; "
            f"the head runs with the target's rotary embedding, so its heads must have the target's size."
        )
    return layer.eval()


def _decoder_layer(model, overrides: dict, owner: str) -> tuple[nn.Module, object]:
    """A fresh layer 0 of ``model``'s own decoder-layer class, built with its config (sizes
    overridden by ``overrides``), without its input norm. Returns ``(layer, config)``."""
    config = copy.deepcopy(model.config.get_text_config())
    for key, value in overrides.items():
        setattr(config, key, value)
    return _head_layer(type(_target_layer(model, owner)), config, model, owner), config


def _dense_llama_layer(model, overrides: dict, owner: str) -> tuple[nn.Module, object]:
    """transformers' ``LlamaDecoderLayer`` sized like ``model`` (then ``overrides``), full
    attention, without its input norm: the layer SafeAILab's EAGLE-1/2 code builds whatever
    the target (its Mixtral heads are dense Llama layers). Returns ``(layer, config)``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    text = model.config.get_text_config()
    sizes = {k: getattr(text, k) for k in ("hidden_size", "vocab_size", "max_position_embeddings") + _LAYER_OVERRIDES
             if getattr(text, k, None) is not None}  # fmt: skip
    config = LlamaConfig(**{**sizes, **overrides, "num_hidden_layers": 1})
    config._attn_implementation = text._attn_implementation
    return _head_layer(LlamaDecoderLayer, config, model, owner), config


def _is_norm(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 1 and "norm" in name


def _layer_type_and_pattern(layer_config, owner: str):
    """``(layer_type or None, mask pattern)`` of a head's layer 0 (layer 0's attention pattern,
    e.g. Gemma2's sliding window)."""
    layer_types = getattr(layer_config, "layer_types", None)
    layer_type = layer_types[0] if layer_types else None
    if layer_type is not None:
        return layer_type, layer_pattern(layer_config, layer_type, owner)
    return None, mask_plan(layer_config, owner).single


# The engines' EAGLE-1 layer (SafeAILab's cnets1.LlamaDecoderLayer, vLLM's and SGLang's
# LlamaDecoderLayer, each without its input norm) holds these tensors; transformers' layer
# classes that compute that layer from them (Mistral: plus a window; Qwen2: plus q/k/v biases).
_LLAMA_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
_LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")  # mixtral: SafeAILab's dense heads
_LLAMA_WEIGHTS = frozenset(
    f"layers.0.{n}.weight"
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")
)  # fmt: skip
_QKV_BIAS = frozenset(f"layers.0.self_attn.{p}_proj.bias" for p in "qkv")
_O_BIAS = frozenset({"layers.0.self_attn.o_proj.bias"})
_MLP_BIAS = frozenset(f"layers.0.mlp.{p}_proj.bias" for p in ("gate", "up", "down"))


class Eagle(EagleBase):
    """An EAGLE-1/2 head in SafeAILab's layout: ``fc`` (2H -> H, with a bias in SafeAILab's
    checkpoints) on ``cat[embed(token), feature]``, then one decoder layer of the target's own
    class without its input norm, then the target's LM head (no norm before it). The feature is
    the target's last hidden state after its final norm (tap ``"final"``).

    The layer is built with the target's config, sized by the checkpoint's ``config.json``
    where it says (``intermediate_size``, heads, ...), as layer 0 (its attention pattern:
    layer 0's, e.g. Gemma2's sliding window). A checkpoint whose layer holds a dense MLP where
    the target's layer has experts (SafeAILab builds a Llama layer for every target, Mixtral
    included) runs as transformers' ``LlamaDecoderLayer`` sized like the target, full attention.
    Whatever the layer, it runs with the target's rotary embedding, so targets without one are
    refused, as are heads whose ``rope_theta`` differs from the target's.

    Args:
        path: a local directory holding ``config.json`` and safetensors weights (``fc.weight``,
            optionally ``fc.bias``, ``layers.0.*``; an ``embed_tokens.weight`` there is only
            shape-checked: the head uses the target's embedding), or one ``.safetensors`` file.

    ``Eagle.random(target)`` makes a random head for ``target`` (tests, training), and
    :meth:`save` writes the same layout. The embedding and LM head are the target's (shared,
    never copied); the head's own parameters follow the target's device and dtype at bind.
    """

    name = "eagle"
    taps = ("final",)  # the target's last hidden state, after its final norm

    def __init__(self, path: str | Path):
        if path is None or (isinstance(path, str) and not path.strip()):
            raise ValueError(
                "Eagle(path): path is required: the directory of an EAGLE head checkpoint in SafeAILab's "
                "layout (config.json and *.safetensors), e.g. specfx.drafters.heads.eagle.Eagle('/models/EAGLE-llama') "
                "or draft='eagle:/models/EAGLE-llama'."
            )
        self._set_checkpoint(read_head(path, "EAGLE"))

    @classmethod
    def _from_checkpoint(cls, ckpt: HeadCheckpoint) -> Eagle:
        head = cls.__new__(cls)
        head._set_checkpoint(ckpt)
        return head

    def _set_checkpoint(self, ckpt: HeadCheckpoint) -> None:
        config = ckpt.config
        deeper = sorted({k.split(".")[1] for k in ckpt.tensors if k.startswith("layers.") and not k.startswith("layers.0.")})
        if deeper or config.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"EAGLE checkpoint {str(ckpt.path)!r} has {config.get('num_hidden_layers', 1 + len(deeper))} decoder "
                f"layers; EAGLE-1/2 heads have one (layers.0), which is what specfx runs."
            )
        if config.get("add_para_norm"):
            raise ValueError(
                f"EAGLE checkpoint {str(ckpt.path)!r} sets add_para_norm (HASS-style norms on the embedding "
                f"and the feature), which specfx's EAGLE head does not implement."
            )
        self.checkpoint = ckpt
        self.fc: nn.Linear | None = None
        self.layer: nn.Module | None = None
        # (layer class name, mask pattern) once known (random() or bind): what engine_gaps checks
        self.layer_facts: tuple[str, tuple] | None = None

    def __repr__(self) -> str:
        return f"Eagle({str(self.checkpoint.path)!r})"

    @property
    def has_bias(self) -> bool:
        """Whether ``fc`` has a bias: the config's ``bias`` when it says (SafeAILab's key),
        else whether the weights hold ``fc.bias``."""
        bias = self.checkpoint.config.get("bias")
        return bool(bias) if bias is not None else "fc.bias" in self.checkpoint.tensors

    # ----------------------------------------------------------------- building
    def _layer_overrides(self, model) -> dict:
        target = model.config.get_text_config()
        return {k: v for k, v in self.checkpoint.config.items() if k in _LAYER_OVERRIDES and hasattr(target, k)}

    def _build(self, model) -> None:
        """The head's modules for ``model`` (an HF causal LM) from the checkpoint's tensors,
        checked against the target's sizes."""
        owner = f"EAGLE head {str(self.checkpoint.path)!r}"
        config = model.config.get_text_config()
        hidden = config.hidden_size
        vocab = model.get_output_embeddings().weight.shape[0]
        ckpt = self.checkpoint
        for key, value, why in (
            ("hidden_size", hidden, "hidden size"),
            ("vocab_size", (vocab, config.vocab_size), "vocabulary size"),
        ):
            got = ckpt.config.get(key)
            allowed = value if isinstance(value, tuple) else (value,)
            if got is not None and got not in allowed:
                raise ValueError(
                    f"{owner} was trained for a target with {why} {got} (its config.json {key}), but this "
                    f"target ({type(model).__name__}) has {allowed[0]}; use the head trained for this target."
                )
        theta, target_theta = _rope_theta(ckpt.config), _rope_theta(config)
        if theta is not None and target_theta is not None and float(theta) != float(target_theta):
            raise ValueError(
                f"{owner} was trained with rope_theta {theta} but the target has {target_theta}; the head runs "
                f"with the target's rotary embedding, so it must be the head trained for this target."
            )
        overrides = self._layer_overrides(model)
        layer, layer_config = _decoder_layer(model, overrides, owner)
        have = {k[len("layers.0.") :] for k in ckpt.tensors if k.startswith("layers.0.")}
        if have != set(layer.state_dict()):  # SafeAILab's dense layer for an MoE target (Mixtral)?
            dense, dense_config = _dense_llama_layer(model, overrides, owner)
            if have == set(dense.state_dict()):
                layer, layer_config = dense, dense_config
        expected = {"fc.weight": (hidden, 2 * hidden)}
        why = {"fc.weight": f"[hidden, 2 * hidden] for the target's hidden size {hidden}"}
        if self.has_bias:
            expected["fc.bias"] = (hidden,)
        expected.update({f"layers.0.{k}": tuple(t.shape) for k, t in layer.state_dict().items()})
        if "embed_tokens.weight" in ckpt.tensors:
            expected["embed_tokens.weight"] = (vocab, hidden)
            why["embed_tokens.weight"] = f"the target's embedding [{vocab}, {hidden}]"
        check_tensors(ckpt, "EAGLE", expected, why)
        unknown = sorted(k for k in ckpt.tensors if k.startswith("layers.0.") and k not in expected)
        if unknown:
            raise ValueError(
                f"{owner} has tensors this target's decoder layer ({type(layer).__name__}, without its input "
                f"norm) does not: {', '.join(unknown[:6])}; the head was trained for another architecture."
            )
        fc = nn.Linear(2 * hidden, hidden, bias=self.has_bias)
        with torch.no_grad():
            fc.weight.copy_(ckpt.tensors["fc.weight"])
            if self.has_bias:
                fc.bias.copy_(ckpt.tensors["fc.bias"])
            layer.load_state_dict({k[len("layers.0.") :]: v for k, v in ckpt.tensors.items() if k.startswith("layers.0.")})
        self.fc, self.layer, self.layer_config = fc.eval(), layer, layer_config

    @classmethod
    def random(cls, target, seed: int = 0, std: float | None = None, *, fc_bias: bool = False) -> Eagle:
        """A head for ``target`` (an HF causal LM) with seeded random weights (norms at their
        defaults; ``std`` defaults to the target's ``initializer_range``): for tests and as a
        starting point for training. Its drafts are meaningless until trained.

        ``fc_bias``: give ``fc`` a (random) bias, as SafeAILab's heads have. Off by default:
        vLLM's EAGLE ``fc`` has no bias and drops ``fc.bias``, so only a head without one (saved
        as a zero bias, which SGLang's and SafeAILab's ``fc`` need) drafts the same everywhere."""
        model = target.model if isinstance(target, ModelRunner) else target
        config = model.config.get_text_config()
        std = float(getattr(config, "initializer_range", 0.02)) if std is None else std
        layer, layer_config = _decoder_layer(model, {}, "Eagle.random")
        hidden = config.hidden_size
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(shape, generator=g) * std

        tensors = {"fc.weight": rand(hidden, 2 * hidden)}
        bias = rand(hidden)  # drawn either way: a seed gives the same layer weights with or without it
        if fc_bias:
            tensors["fc.bias"] = bias
        for k, t in layer.state_dict().items():
            tensors[f"layers.0.{k}"] = t.detach().clone() if _is_norm(k, t) else rand(*t.shape)
        saved = config.to_dict()
        head_config = {k: saved[k] for k in _CONFIG_KEYS if saved.get(k) is not None}
        head_config.update(rope_keys(config), architectures=[type(model).__name__], num_hidden_layers=1, bias=fc_bias)
        head = cls._from_checkpoint(HeadCheckpoint(Path(f"Eagle.random(seed={seed})"), head_config, tensors))
        head.layer_facts = (type(layer).__name__, _layer_type_and_pattern(layer_config, "Eagle.random")[1])
        return head

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The head's tensors in the checkpoint layout (the built modules' when built)."""
        if self.layer is None:
            return dict(self.checkpoint.tensors)
        tensors = {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        tensors.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return tensors

    def save(self, path: str | Path) -> Path:
        """Write the head to directory ``path`` in SafeAILab's layout (``config.json`` and
        ``model.safetensors``), which :class:`Eagle` (``draft="eagle:DIR"``), SafeAILab's EAGLE
        code, vLLM and SGLang load (docs/HEADS.md):

        * ``rope_theta`` at the top level (and ``rope_scaling`` for scaled rotary), where those
          readers look for the base;
        * ``fc.bias`` always, zeros for a head without one (SGLang's ``fc`` always has a bias,
          SafeAILab's by default; vLLM's has none and skips it), and no ``bias`` key: vLLM and
          SGLang read ``bias`` as *attention* biases, SafeAILab as the fc bias (default true);
        * ``qkv_bias`` (SafeAILab and vLLM: biases on q/k/v only);
        * for a Llama layer, ``architectures`` ``["LlamaForCausalLMEagle", "LlamaForCausalLM"]``:
          SGLang takes the first it knows (its EAGLE class), vLLM prefixes each with ``Eagle``
          and takes the first it knows (``EagleLlamaForCausalLM``).

        A head some engine would not run as specfx does is saved with a
        :class:`~specfx.drafters.heads.checkpoint.HeadLayoutWarning` naming it (:meth:`engine_gaps`)."""
        tensors = self.state_dict()
        hidden = tensors["fc.weight"].shape[0]
        if "fc.bias" not in tensors:
            tensors["fc.bias"] = torch.zeros(hidden, dtype=tensors["fc.weight"].dtype)
        config = {k: v for k, v in self.checkpoint.config.items() if k != "bias"}
        config.update(rope_keys(config), num_hidden_layers=1, qkv_bias=_QKV_BIAS <= set(tensors))
        if self._llama_layer(tensors):
            config["architectures"] = ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
        warn_engine_gaps("EAGLE", path, self.engine_gaps())
        return write_head(path, config, tensors)

    def _llama_layer(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether the head's layer is the Llama layer every engine builds: its class computes
        one (when known, else the config's model type says so) and its tensors are a Llama
        layer's, biases aside."""
        names = {k for k in tensors if k.startswith("layers.0.")}
        if not names >= _LLAMA_WEIGHTS or names - _LLAMA_WEIGHTS - _QKV_BIAS - _O_BIAS - _MLP_BIAS:
            return False
        if self.layer_facts is not None:
            return self.layer_facts[0] in _LLAMA_LAYER_CLASSES
        return self.checkpoint.config.get("model_type") in _LLAMA_MODEL_TYPES

    def engine_gaps(self) -> dict[str, list[str]]:
        """Why each engine (``"SafeAILab's EAGLE"``, ``"vLLM"``, ``"SGLang"``) would not draft
        with this head, saved by :meth:`save`, what specfx drafts: engine -> reasons (empty
        lists where it would). The rules are in docs/HEADS.md; the layer's class and window are
        checked once known (after :meth:`random` or binding)."""
        tensors = self.state_dict()
        config = self.checkpoint.config
        names = {k for k in tensors if k.startswith("layers.0.")}
        gaps: dict[str, list[str]] = {"SafeAILab's EAGLE": [], "vLLM": [], "SGLang": []}
        if not self._llama_layer(tensors):
            kind = self.layer_facts[0] if self.layer_facts else config.get("model_type")
            extra = sorted(n[len("layers.0.") :] for n in names - _LLAMA_WEIGHTS - _QKV_BIAS - _O_BIAS - _MLP_BIAS)
            with_ = f" (with {', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})" if extra else ""
            for reasons in gaps.values():
                reasons.append(f"the head's layer is {kind}{with_}; its EAGLE code builds a Llama layer instead.")
        pattern = self.layer_facts[1] if self.layer_facts else ("full", None)
        if pattern[0] != "full":
            for reasons in gaps.values():
                reasons.append(
                    f"the head's layer attends within a {pattern[0]} window of {pattern[1]} tokens; its EAGLE layer "
                    f"attends to the whole context."
                )
        bias = tensors.get("fc.bias")
        if bias is not None and bool(bias.abs().max() > 0):
            gaps["vLLM"].append(
                "its EAGLE fc has no bias and skips fc.bias, which is nonzero here; heads trained by `specfx train` "
                "(and Eagle.random(fc_bias=False)) have none."
            )
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        q_rows = tensors["layers.0.self_attn.q_proj.weight"].shape[0] if _LLAMA_WEIGHTS <= names else None
        if hidden and heads and q_rows is not None and q_rows != hidden:
            gaps["SafeAILab's EAGLE"].append(
                f"it derives head_dim = hidden_size / num_attention_heads = {hidden // heads} and ignores head_dim "
                f"({q_rows // heads} here)."
            )
        if "rope_scaling" in rope_keys(config) or config.get("rope_scaling"):
            gaps["SafeAILab's EAGLE"].append(
                "its config takes rope_scaling only as {'type': 'linear' | 'dynamic', 'factor': f}, and its layer "
                "then uses base 10000, not rope_theta."
            )
        if names & _O_BIAS:
            gaps["SafeAILab's EAGLE"].append("its o_proj has no bias (only q/k/v have, with qkv_bias).")
        if names & _MLP_BIAS:
            gaps["SafeAILab's EAGLE"].append("its MLP has no biases.")
            gaps["SGLang"].append("its Llama MLP has no biases.")
        if bool(names & _QKV_BIAS) != bool(names & _O_BIAS):
            gaps["SGLang"].append(
                "its Llama attention has biases on q, k, v and o together (attention_bias or bias) or on none, "
                "and the head has them on " + ("q, k, v only." if names & _QKV_BIAS else "o only.")
            )
        if config.get("hidden_act", "silu") != "silu":
            for engine in ("vLLM", "SGLang"):
                gaps[engine].append(f"its Llama MLP supports hidden_act 'silu' only, not {config['hidden_act']!r}.")
        return gaps

    # ----------------------------------------------------------------- binding
    def _bind(self, target: ModelRunner) -> None:
        model = target.model
        owner = f"EAGLE head {str(self.checkpoint.path)!r}"
        self.rotary = target_rotary(model, owner)
        if self.layer is not None:  # built before (bound to a target, maybe trained): keep its weights
            tensors = {k: v.detach().to("cpu") for k, v in self.state_dict().items()}
            self.checkpoint = HeadCheckpoint(self.checkpoint.path, self.checkpoint.config, tensors)
        self._build(model)
        self.per_layer_rope = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.layer_type, self.pattern = _layer_type_and_pattern(self.layer_config, owner)
        self.layer_facts = (type(self.layer).__name__, self.pattern)
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.fc.to(device=target.device, dtype=target.dtype)
        self.layer.to(device=target.device, dtype=target.dtype)
        self.cache_kwarg = cache_kwarg(self.layer)  # "cache" from transformers 5.24 on
        self.state_size = self.fc.out_features

    # ----------------------------------------------------------------- the head
    def _feature(self, features):
        return features[0]

    def _entry(self, ids, feature, positions, slots, tree):
        self.cache.slots = slots
        embeds = self.embed(ids).to(feature.dtype)  # [B, T, H]
        x = self.fc(torch.cat([embeds, feature], dim=-1))  # [B, T, H]
        kwargs = {"layer_type": self.layer_type} if self.per_layer_rope else {}
        rope = self.rotary(x, positions, **kwargs)
        out = self.layer(
            x,
            attention_mask=self._entry_mask(positions, tree, self.pattern),
            position_ids=positions,
            position_embeddings=rope,
            **{self.cache_kwarg: self.cache},
        )
        return out[0] if isinstance(out, tuple) else out

    def _logits(self, out):
        return self.lm_head(out)


def from_name(arg: str | None) -> Eagle:
    """``draft="eagle:DIR"``: an EAGLE-1/2 head loaded from checkpoint directory DIR."""
    if not arg:
        raise ValueError(
            "draft='eagle' needs the head's checkpoint directory after a colon: draft='eagle:DIR' (an EAGLE-1/2 "
            "head in SafeAILab's layout: config.json and *.safetensors)."
        )
    return Eagle(arg)
