"""Explicit 4-D attention masks built from per-row positions.

Every query at position ``p`` sees buffer slots ``0..p`` of its own row (slot == position for
real tokens), further restricted by the layer's attention pattern: a sliding window of ``W``
shows slots ``p - W < j <= p``, a chunked layer of size ``S`` shows the slots of ``p``'s chunk.
Stale slots beyond ``p`` (rejected proposals, padding garbage) and the trash slot stay hidden.

HF models return a 4-D mask untouched (``masking_utils``), so this is the hook through which
specfx controls attention. Models whose layers differ (``config.layer_types``, e.g. Gemma2's
alternating sliding/full layers) take a dict ``{layer_type: mask}``; models with one pattern
take one tensor. :func:`mask_plan` derives which from the config alone, so an architecture that
follows these conventions needs no code here. The tensor format each attention implementation
expects is declared in :data:`MASK_FORMATS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "MASK_FORMATS",
    "MaskPlan",
    "TreeView",
    "attention_mask_keys",
    "build_mask",
    "cache_layer_classes",
    "check_attn_implementation",
    "layer_pattern",
    "mask_plan",
    "state_only_layer_types",
    "to_format",
    "visible_slots",
]

# attention implementation -> mask format it expects when handed a 4-D tensor.
MASK_FORMATS = {
    "sdpa": "bool",  # True = attend
    "eager": "additive",  # 0 = attend, dtype-min = hidden
}

# config.layer_types value -> (pattern, config attribute holding its size)
ATTENTION_LAYER_TYPES = {
    "full_attention": ("full", None),
    "sliding_attention": ("sliding", "sliding_window"),
    "chunked_attention": ("chunked", "attention_chunk_size"),
    # DeepSeek-V3.2-style sparse attention (DSA): causal over every key; the model's indexer picks
    # its top-k keys among those the mask shows, from keys kept at slots (decision 94); the type is
    # named deepseek_sparse_attention in transformers 5.17, indexed_attention in 5.24 and 5.25
    "deepseek_sparse_attention": ("full", None),
    "indexed_attention": ("full", None),
    # DeepSeek-V4 (decision 97): a sliding window over the tokens' own KV in every layer; the pooled windows
    # the compressor appends to the keys come with the bias the compressor builds for them
    "compressed_sparse_attention": ("sliding", "sliding_window"),
    "heavily_compressed_attention": ("sliding", "sliding_window"),
}

# A layer pattern: ("full", None) | ("sliding", W) | ("chunked", S)
Pattern = tuple


class MaskPlan:
    """Which masks a model's forward takes: ``single`` (one pattern for all layers, passed as a
    tensor) or ``by_type`` (``{layer_type: pattern}``, passed as a dict)."""

    def __init__(self, single: Pattern | None, by_type: dict[str, Pattern] | None):
        self.single = single
        self.by_type = by_type

    def build(self, positions: torch.Tensor, capacity: int, fmt: str, dtype: torch.dtype, tree: TreeView | None = None):
        if self.by_type is None:
            return build_mask(positions, capacity, fmt, dtype, self.single, tree)
        built: dict[Pattern, torch.Tensor] = {}
        masks = {}
        for layer_type, pattern in self.by_type.items():
            if pattern not in built:
                built[pattern] = build_mask(positions, capacity, fmt, dtype, pattern, tree)
            masks[layer_type] = built[pattern]
        return masks


def layer_pattern(config, layer_type: str, model_name: str) -> Pattern:
    """The mask pattern of ``config``'s layers of type ``layer_type`` (a ``config.layer_types``
    value): ``("full", None)``, ``("sliding", W)`` or ``("chunked", S)``, the size read from the
    config attribute :data:`ATTENTION_LAYER_TYPES` names. Unknown types and sizes that are not
    a positive int raise a ValueError naming ``model_name``."""
    if layer_type not in ATTENTION_LAYER_TYPES:
        raise ValueError(
            f"{model_name} has layers of type {layer_type!r} (config.layer_types), which keep state "
            f"specfx cannot roll back per row (only {sorted(ATTENTION_LAYER_TYPES)} are "
            f"supported). Recurrent and linear-attention layers run only for the types the "
            f"architecture table admits with state."
        )
    kind, attr = ATTENTION_LAYER_TYPES[layer_type]
    if attr is None:
        return (kind, None)
    size = getattr(config, attr, None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"{model_name} has {layer_type!r} layers but config.{attr} is {size!r}; specfx needs a "
            f"positive int to build that layer's mask."
        )
    return (kind, size)


def mask_plan(config, model_name: str, stateful: bool = False) -> MaskPlan:
    """The masks a model needs, from its config: ``layer_types`` when present (one mask per
    distinct type; a dict when they differ), else ``sliding_window`` (all layers sliding) or
    plain causal. Unknown layer types (linear attention, recurrent state, sparse indexers...)
    raise: specfx cannot keep their state per row with rollback; except, for a model admitted with
    state (``stateful``, decisions 76 and 79), whose masks follow HF's cache layer for each type
    (:func:`attention_mask_keys`): layers without KV take the runner's 2-D padding mask instead."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if stateful:
            by_type = attention_mask_keys(config, model_name)
        else:
            by_type = {t: layer_pattern(config, t, model_name) for t in dict.fromkeys(layer_types)}
        if not by_type:  # stateful layers only: no attention mask is used
            return MaskPlan(("full", None), None)
        if len(set(by_type.values())) == 1:
            return MaskPlan(next(iter(by_type.values())), None)
        return MaskPlan(None, by_type)
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(config, "use_sliding_window", True) is not False:
        return MaskPlan(("sliding", window), None)
    return MaskPlan(("full", None), None)


def cache_layer_classes(config) -> dict[str, type]:
    """Each of the config's layer types -> the class of HF's own cache layer for it
    (``DynamicCache(config=...)``: HF's mapping and its renaming, e.g. 5.24's "moe"/"mlp" layers
    to ``DummyLayer``), which says what a layer keeps: KV, recurrent state, both, or nothing."""
    from transformers.cache_utils import DynamicCache

    text = config.get_text_config(decoder=True)
    layers = DynamicCache(config=text).layers
    return {t: type(layer) for t, layer in zip(getattr(text, "layer_types", None) or (), layers, strict=False)}


def attention_mask_keys(config, model_name: str) -> dict[str, Pattern]:
    """The 4-D masks a model with state needs, by the key its forward looks them up under: every
    layer type whose HF cache layer keeps KV (its own pattern), and for a layer keeping KV and state
    together (HF's "hybrid" layers: Falcon-H1, Zamba2) the key of its attention kind too
    ("full_attention" or "sliding_attention": HF's forwards read those layers' masks there, the
    state's 2-D mask under "linear_attention"). Types keeping state or nothing are left out."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    keys: dict[str, Pattern] = {}
    for t, cls in cache_layer_classes(config).items():
        if not issubclass(cls, DynamicLayer):
            continue  # state only, or no cache at all (MLP/MoE layers): the 2-D padding mask
        if issubclass(cls, LinearAttentionCacheLayerMixin):
            kind = "sliding_attention" if issubclass(cls, DynamicSlidingWindowLayer) else "full_attention"
            keys[t] = keys[kind] = layer_pattern(config, kind, model_name)
        else:
            keys[t] = layer_pattern(config, t, model_name)
    return keys


def state_only_layer_types(config) -> set[str]:
    """The config's layer types whose HF cache layer keeps no KV (recurrent or linear-attention state,
    or nothing: MLP/MoE layers): they take the 2-D padding mask, not an attention mask."""
    from transformers.cache_utils import DynamicLayer

    return {t for t, cls in cache_layer_classes(config).items() if not issubclass(cls, DynamicLayer)}


def check_attn_implementation(model) -> str:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASK_FORMATS:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={impl!r}, which specfx cannot drive "
            f"with an explicit per-row 4-D mask yet. Load the model with one of "
            f"{sorted(MASK_FORMATS)} (e.g. from_pretrained(..., attn_implementation='sdpa'))."
        )
    return impl


@dataclass
class TreeView:
    """What a forward over token-tree nodes needs to build its mask (see :mod:`specfx.trees.types`):
    node ``n`` of a row sits in slot ``lengths + n`` at position ``lengths + depth[n]``, and
    query ``t`` of the forward is node ``queries[t]``."""

    lengths: torch.Tensor  # [B] int64, the root's slot and position (the pending token)
    depth: torch.Tensor  # [R, N+1] int64, R = 1 or B
    ancestors: torch.Tensor  # [R, N+1, N+1] bool, ancestor-or-self
    queries: tuple[int, ...]  # node index of each query column


def visible_slots(
    positions: torch.Tensor, capacity: int, pattern: Pattern = ("full", None), tree: TreeView | None = None
) -> torch.Tensor:
    """``positions [B, T]`` -> bool ``[B, 1, T, capacity]``: slot j visible iff j <= p and j is
    inside p's window/chunk.

    With ``tree``, slots ``L+1 .. L+N`` hold the round's tree nodes rather than positions: a
    query (a node) sees the committed slots ``0..L`` and the slots of its own ancestors (and
    itself), and windows/chunks are measured on the *positions* of those keys (``L + depth``)."""
    slots = torch.arange(capacity, device=positions.device).view(1, 1, 1, capacity)
    pos = positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, 1]
    if tree is None:
        key_pos = slots
        visible = slots <= pos
    else:
        b, n = positions.shape[0], tree.depth.shape[1] - 1
        lengths = tree.lengths.view(b, 1)
        rel = slots.view(1, capacity) - lengths  # [B, C], node index of a tree slot
        in_tree = (rel >= 1) & (rel <= n)
        node = rel.clamp(0, n)
        key_pos = torch.where(in_tree, lengths + tree.depth.expand(b, -1).gather(1, node), slots.view(1, capacity))
        queries = torch.tensor(tree.queries, device=positions.device)
        anc = tree.ancestors.expand(b, -1, -1)[:, queries]  # [B, T, N+1]
        is_anc = anc.gather(2, node.unsqueeze(1).expand(-1, len(tree.queries), -1))  # [B, T, C]
        visible = torch.where(in_tree.unsqueeze(1), is_anc, rel.unsqueeze(1) <= 0).unsqueeze(1)  # [B, 1, T, C]
        key_pos = key_pos.view(b, 1, 1, capacity)
    kind, size = pattern
    if kind == "sliding":
        visible = visible & (key_pos > pos - size)
    elif kind == "chunked":
        visible = visible & (key_pos // size == pos // size)
    return visible


def to_format(visible: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) in the format of :data:`MASK_FORMATS`: itself for ``"bool"``,
    ``0`` / ``finfo(dtype).min`` of ``dtype`` for ``"additive"``."""
    if fmt == "bool":
        return visible
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


def build_mask(
    positions: torch.Tensor,
    capacity: int,
    fmt: str,
    dtype: torch.dtype,
    pattern: Pattern = ("full", None),
    tree: TreeView | None = None,
) -> torch.Tensor:
    """``positions [B, T]`` -> mask ``[B, 1, T, capacity]`` in format ``fmt``: slot j visible
    iff j <= p and j is inside p's window/chunk, or per ``tree`` (:func:`visible_slots`)."""
    return to_format(visible_slots(positions, capacity, pattern, tree), fmt, dtype)
