"""Static KV storage written at per-row slots held in device tensors.

specfx hands the model an HF ``Cache`` (the stable hook every decoder in transformers calls
as ``cache.update(k, v, layer_idx)``, passed as ``cache``, or ``past_key_values`` before
transformers 5.24) whose layers own preallocated buffers::

    keys, values   # [B, kv_heads, capacity, head_dim] per layer, allocated once

Before each forward the runtime sets ``cache.slots`` to a ``[B, T]`` int64 tensor: the buffer
slot each of the T new tokens of each row is written to (slot == position, except padding,
which goes to the never-visible *trash slot* ``capacity - 1``). ``update`` scatters the new
keys/values there in place and returns the whole buffers; the explicit 4-D mask decides what
each query sees. Rejected proposals are never cropped: a later round overwrites their slots
and the mask hides them until then.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specfx.model.dynamo import back_reference, mark_static

__all__ = ["SlotCache", "SlotLayer"]


class SlotLayer(CacheLayerMixin):
    """One layer's static buffers, allocated lazily on the first (eager) prefill."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotCache):
        super().__init__()
        self._owner = weakref.ref(owner)  # the cache holds its layers (decision 93)
        self.indexer_keys: torch.Tensor | None = None  # a DSA indexer's keys, if the model has one
        # a KV compressor's per-token projections by name (DeepSeek-V4: "compressor", "indexer"):
        # (kv, gate) buffers [B, C, D] at slots, returned cut to whole windows of compress_rate (decision 97)
        self.compressed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.compress_rate: int | None = None  # the layer's window, set by the cache from the config

    @property
    def owner(self) -> SlotCache:
        """The cache whose ``slots`` and ``rows`` this layer's writes follow."""
        return back_reference(self._owner, "cache layer's cache")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, h, _, _ = key_states.shape
        owner = self.owner
        b, cap = owner.rows.shape[0], owner.capacity  # all rows, even from a one-row forward
        self.keys = key_states.new_zeros((b, h, cap, key_states.shape[-1]))  # [B, H, C, Dk]
        self.values = value_states.new_zeros((b, h, cap, value_states.shape[-1]))  # [B, H, C, Dv]
        mark_static(self.keys, self.values)  # written in place by every round
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner  # one dereference per update (a weak reference: decision 93)
        slots = owner.slots  # [B, T]
        rows = owner.rows  # [B, 1]
        # buffer[b, :, slots[b, t]] = new[b, :, t]; advanced indices first -> value is [B, T, H, D]
        row = owner.row
        if row is not None:  # one row at a time (ModelRunner's rowwise protocol)
            rows = rows[row : row + 1]
        self.keys[rows, :, slots] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[rows, :, slots] = value_states.transpose(1, 2).to(self.values.dtype)
        if row is not None:
            return self.keys[row : row + 1], self.values[row : row + 1]
        return self.keys, self.values

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """A sparse-attention indexer's keys (HF's ``Cache.update_indexer``: DeepSeek-V3.2-style
        DSA layers), one ``[B, T, D]`` key per token: written at the tokens' slots like KV, in a
        ``[B, C, D]`` buffer of its own (decision 94); returns the whole buffer."""
        owner = self.owner
        rows, row = owner.rows, owner.row
        if self.indexer_keys is None:
            b, d = rows.shape[0], indexer_key_states.shape[-1]
            self.indexer_keys = indexer_key_states.new_zeros((b, owner.capacity, d))  # [B, C, Di]
            mark_static(self.indexer_keys)
        if row is not None:
            rows = rows[row : row + 1]
        self.indexer_keys[rows, owner.slots] = indexer_key_states.to(self.indexer_keys.dtype)
        return self.indexer_keys if row is None else self.indexer_keys[row : row + 1]

    # --- a KV compressor's cache API (DeepSeek-V4's DeepseekV4HCACache / DeepseekV4CSACache; decision 97)
    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """The compressor's per-token projections ``kv, gate [B, T, D]`` written at the tokens'
        slots; returns every whole window of the buffers, from slot 0: ``(kv [B, C', D], gate,
        0)``. The compressor then pools every window on each forward; which pooled entries a query
        sees is decided from its position (HF's own rule: window w once the query is at or past its
        last token), so a window holding rejected or unwritten slots is never seen."""
        owner = self.owner
        rows, row = owner.rows, owner.row
        if name not in self.compressed:
            if not self.compress_rate:
                raise ValueError(f"a cache layer's compressor {name!r} runs, but the config declares no window for it")
            pair = tuple(t.new_zeros((rows.shape[0], owner.capacity, t.shape[-1])) for t in (kv, gate))  # [B, C, D]
            mark_static(*pair)
            self.compressed[name] = pair
        if row is not None:
            rows = rows[row : row + 1]
        usable = owner.capacity // self.compress_rate * self.compress_rate
        out = []
        for buf, new in zip(self.compressed[name], (kv, gate), strict=True):
            buf[rows, owner.slots] = new.to(buf.dtype)
            out.append((buf if row is None else buf[row : row + 1])[:, :usable])
        return out[0], out[1], 0

    def update_overlap_state(self, name: str, chunk_kv, chunk_gate, head_dim: int):
        """No earlier window to carry: :meth:`store_compression_weights` returns every window from
        slot 0, whose first has none (as in HF's first forward)."""
        return None, None

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """The pooled entries of every window, as the compressor computed them this forward."""
        return compressed

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        # Lengths are per row and live on the device; HF only asks this when no position_ids
        # are given, and specfx always gives them.
        return 0

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotCache(Cache):
    """An HF ``Cache`` of :class:`SlotLayer` s sharing one slot tensor.

    Attributes:
        capacity: slots per row; the last one is the trash slot for padding.
        slots: ``[B, T]`` int64, where the current forward writes each new token.
        rows: ``[B, 1]`` int64, ``arange(B)`` for the scatter.
        row, query_offset: the row and first query position of a one-row forward (the
            rowwise protocol for models that need a 2-D mask; None/unused otherwise).
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device: torch.device, compress_rates=()):
        self.capacity = capacity
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])
        for layer, rate in zip(self.layers, compress_rates, strict=False):
            layer.compress_rate = rate  # a KV compressor's window per layer (DeepSeek-V4), None elsewhere
        self.rows = torch.arange(batch_size, device=device).unsqueeze(1)
        self.slots = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        self.row: int | None = None  # set: forwards see only this row (rowwise protocol)
        self.query_offset = torch.zeros((), dtype=torch.long, device=device)

    def get_query_offset(self, layer_idx: int = 0) -> torch.Tensor:
        """Position of the first query of the current forward (rowwise protocol: transformers
        builds the causal mask from it; with explicit 4-D masks it is never asked)."""
        return self.query_offset

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's KV at slots ``src [B, M]`` to ``dst [B, M]`` of the same rows, in
        place (all reads before any write, so the two may overlap): a token tree's accepted
        path moves from its scratch slots to the committed ones."""
        for layer in self.kv_layers:
            for buf in (layer.keys, layer.values):
                buf[self.rows, :, dst] = buf[self.rows, :, src]
            if layer.indexer_keys is not None:
                layer.indexer_keys[self.rows, dst] = layer.indexer_keys[self.rows, src]
            for buf in (t for pair in layer.compressed.values() for t in pair):
                buf[self.rows, dst] = buf[self.rows, src]

    @property
    def trash_slot(self) -> int:
        return self.capacity - 1

    @property
    def kv_layers(self) -> list[SlotLayer]:
        """The layers holding allocated KV buffers (a model with state has layers of state only,
        see :mod:`specfx.model.recurrent`, and layers holding both)."""
        return [layer for layer in self.layers if isinstance(layer, SlotLayer) and layer.is_initialized]

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer: KV, and the conv and recurrent states of layers keeping state."""
        kv = sum(
            layer.keys.nbytes
            + layer.values.nbytes
            + getattr(layer.indexer_keys, "nbytes", 0)
            + sum(t.nbytes for pair in layer.compressed.values() for t in pair)
            for layer in self.kv_layers
        )
        states = (
            t
            for layer in self.layers
            for d in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
            for t in d.values()
        )
        return kv + sum(t.nbytes for t in states if t is not None)
