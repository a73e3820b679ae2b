"""The decoder layer of an EAGLE-1/2 head, built from the target's own layer class.

SafeAILab's EAGLE-1/2 head runs one decoder layer without its input norm (the fc output enters
attention as is), with the target's rotary embedding. specfx builds that layer as a fresh layer 0
of the target's own decoder-layer class, with the target's config sized by the head's
``config.json`` where it says (:data:`LAYER_OVERRIDES`), or, for a head whose tensors are a dense
Llama layer's where the target has experts (SafeAILab's Mixtral heads), as transformers'
``LlamaDecoderLayer`` (:func:`dense_llama_layer`).
"""

from __future__ import annotations

import copy

from torch import nn

from specfx.model.admission import hc_streams
from specfx.model.capture import decoder_layer_names
from specfx.model.masks import layer_pattern, mask_plan, state_only_layer_types
from specfx.model.recurrent import state_layer_types

__all__ = ["LAYER_OVERRIDES", "decoder_layer", "dense_llama_layer", "layer_type_and_pattern", "target_rotary"]

# Checkpoint config keys that size the head's decoder layer where they differ from the
# target's config (SafeAILab's config.json is a copy of the target's with num_hidden_layers=1).
LAYER_OVERRIDES = (
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "attention_bias",
    "mlp_bias",
)


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


def _target_layer(model, owner: str, attention: bool = False) -> nn.Module:
    """``model``'s first decoder layer (found generically, :func:`specfx.model.capture.decoder_layer_names`);
    with ``attention``, its first one with attention (``self_attn``), if any (a hybrid target's first
    layers may keep recurrent state instead)."""
    try:
        layers = [model.get_submodule(name) for name in decoder_layer_names(model)]
    except ValueError as e:
        raise ValueError(f"{owner}: {e} EAGLE heads reuse the target's decoder-layer class.") from None
    with_attention = [layer for layer in layers if isinstance(getattr(layer, "self_attn", None), nn.Module)]
    return (with_attention or layers)[0] if attention else layers[0]


def _attention_layer_type(config, owner: str) -> None:
    """Make ``config``'s layer 0 an attention layer where the target's is a stateful one (hybrid targets:
    Qwen3-Next's first layers are gated delta nets): EAGLE's layer is the target's layer class with its
    own KV, so it takes the target's first layer type that keeps KV only (decision 82). ValueError
    when every layer type keeps state (an EAGLE layer would keep state of its own)."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin

    types = list(getattr(config, "layer_types", None) or [])
    # HF's own mapping first: an attention target's config is never handed to DynamicCache here
    if not types or not issubclass(DYNAMIC_LAYER_TYPE_MAPPING.get(types[0], object), LinearAttentionCacheLayerMixin):
        return
    stateful = state_layer_types(config)
    attention = [t for t in types if t not in stateful | state_only_layer_types(config)]  # KV, no state
    if not attention:
        raise ValueError(
            f"{owner}: every layer type of this target ({sorted(set(types))}) keeps recurrent or linear-attention "
            f"state, and EAGLE-1's layer is the target's own layer class: it would keep state of its own. Use an "
            f"EAGLE-3 or DFlash draft (attention layers of their own), Medusa heads or a draft model."
        )
    types[0] = attention[0]
    try:
        config.layer_types = types
    except AttributeError as e:  # derived from other fields (Jamba's attn_layer_period): not settable
        raise ValueError(
            f"{owner}: this target's layer 0 keeps recurrent or linear-attention state and its config derives "
            f"its layer types from other fields ({type(config).__name__}.layer_types cannot be set), so EAGLE-1's "
            f"layer (the target's own layer class) cannot be built as an attention layer. Use an EAGLE-3 or DFlash "
            f"draft (attention layers of their own), Medusa heads or a draft model."
        ) from e


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
    target_dim = getattr(getattr(_target_layer(model, owner, attention=True), "self_attn", None), "head_dim", None)
    if head_dim != target_dim:
        raise ValueError(
            f"{owner}: the head's attention has head_dim {head_dim} but the target's has {target_dim}; "
            f"the head runs with the target's rotary embedding, so its heads must have the target's size."
        )
    return layer.eval()


def decoder_layer(model, overrides: dict, owner: str) -> tuple[nn.Module, object]:
    """A fresh layer 0 of ``model``'s own decoder-layer class, built with its config (sizes
    overridden by ``overrides``), without its input norm. Returns ``(layer, config)``."""
    streams = hc_streams(model)
    if streams > 1:
        raise ValueError(
            f"{owner}: the target's decoder layers ({type(_target_layer(model, owner)).__name__}) take {streams} "
            f"hyper-connection streams ([batch, tokens, {streams}, hidden], config.hc_mult), and EAGLE-1's layer is "
            f"the target's own layer class fed one hidden state per token: it cannot be built for this target. Use "
            f"Medusa heads, prompt lookup, early exit or a draft model."
        )
    config = copy.deepcopy(model.config.get_text_config())
    for key, value in overrides.items():
        setattr(config, key, value)
    _attention_layer_type(config, owner)
    return _head_layer(type(_target_layer(model, owner)), config, model, owner), config


def dense_llama_layer(model, overrides: dict, owner: str) -> tuple[nn.Module, object]:
    """transformers' ``LlamaDecoderLayer`` sized like ``model`` (then ``overrides``), full
    attention, without its input norm: the layer SafeAILab's EAGLE-1/2 code builds whatever
    the target (its Mixtral heads are dense Llama layers). Returns ``(layer, config)``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    text = model.config.get_text_config()
    sizes = {k: getattr(text, k) for k in ("hidden_size", "vocab_size", "max_position_embeddings") + LAYER_OVERRIDES
             if getattr(text, k, None) is not None}  # fmt: skip
    config = LlamaConfig(**{**sizes, **overrides, "num_hidden_layers": 1})
    config._attn_implementation = text._attn_implementation
    return _head_layer(LlamaDecoderLayer, config, model, owner), config


def layer_type_and_pattern(layer_config, owner: str):
    """``(layer_type or None, mask pattern)`` of a head's layer 0 (layer 0's attention pattern,
    e.g. Gemma2's sliding window)."""
    layer_types = getattr(layer_config, "layer_types", None)
    layer_type = layer_types[0] if layer_types else None
    if layer_type is not None:
        return layer_type, layer_pattern(layer_config, layer_type, owner)
    return None, mask_plan(layer_config, owner).single
