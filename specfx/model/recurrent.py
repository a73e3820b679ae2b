"""Exact rollback of recurrent / linear-attention state (issue 29; wired into the engine by
:class:`~specfx.model.runner.ModelRunner` for stateful targets, see docs/ARCHITECTURE.md decision 76
and docs/HYBRID.md).

A KV cache can hold a round's K+1 verified tokens and let the mask hide the rejected ones; a
recurrent state cannot: after the verify forward it has absorbed all K+1. After a round that
accepts n of K, every stateful layer must hold the state after exactly the n+1 committed inputs
(the round's first token and the n accepted proposals; the correction or bonus is the next round's
first input). What this module provides, generically (HF's unified linear-attention cache API of
transformers >= 5.17, the declared minimum: ``cache.layers[i]`` a ``LinearAttentionCacheLayerMixin`` with ``conv_states``
and ``recurrent_states`` dicts):

* :class:`StateSnapshot`: every stateful layer's conv and recurrent tensors, copied (before a
  round) and written back (rollback), per row where a row mask says so;
* :func:`conv_state_after`: a short causal conv's state after n+1 of the T new inputs, exactly,
  from the old state and the inputs (the conv state is the last ``kernel`` input columns);
* :class:`MixerTaps`: the stateful mixer modules, found generically (the innermost modules with a
  ``layer_idx`` whose cache layer is a linear-attention layer), their inputs recorded during a
  forward, and :meth:`MixerTaps.replay` to re-run only them on the accepted prefix of those inputs
  from a snapshot: the state after n+1 inputs without re-running attention, MLPs or the LM head;
  :meth:`MixerTaps.replay_steps`, the same with fixed shapes and per-row n (decision 76's choice),
  over the inputs of one forward or of several in a row (a draft model's round, decision 81), or
  :meth:`MixerTaps.select` where the recording stepped the mixers (decisions 90, 91);
* :class:`StateLayer` and :func:`slot_cache_with_state`: specfx's :class:`SlotCache` with HF's
  linear-attention layer over zeroed static buffers where HF's layer mapping puts state, and
  :func:`masks_with_state`, the mask dict such a model needs (4-D for attention layers, the 2-D
  padding mask for stateful ones).

Shapes: conv states ``[B, C, kernel]``; recurrent states per mixer kind (GDN ``[B, Hv, Dk, Dv]``,
Mamba2 ``[B, H, Dh, N]``, Mamba1 ``[B, D, N]``); ``n``, ``keep`` ``[B]``.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from specfx.model.cache import SlotCache, SlotLayer
from specfx.model.dynamo import back_reference, mark_static
from specfx.model.masks import attention_mask_keys, cache_layer_classes, state_only_layer_types
from specfx.model.mixer_calls import (
    cat_steps,
    column,
    column_kw,
    columns,
    layer_state,
    prefix,
    prefix_kw,
    step_kw,
    width,
)

__all__ = [
    "MixerTaps",
    "SlotStateLayer",
    "StateLayer",
    "StateSnapshot",
    "keeps_state",
    "masks_with_state",
    "slot_cache_with_state",
    "state_layer_types",
    "stateful_layers",
]


class StateLayer(LinearAttentionLayer):
    """HF's linear-attention cache layer over static buffers for every row, always "with a previous
    state": after the allocation forward its buffers are zeroed and kept, and a zero state is no
    state for every kernel the survey met (conv: zero left context = the prefill's zero padding;
    scans: ``initial_state`` zeros = None), so a prefill and a verify forward take the same path
    (one graph per shape, no Python branch on whether a row has started). HF's layer already
    writes in place (``copy_``), which keeps the buffers' addresses for compiled graphs."""

    def start(self) -> None:
        """Zero every buffer and mark each state as present (after the allocation forward, and
        before a new batch's prefill)."""
        for i in range(self.number_of_states):
            for states, ready in (
                (self.conv_states, self.is_conv_states_initialized),
                (self.recurrent_states, self.is_recurrent_states_initialized),
            ):
                if ready[i]:
                    states[i].zero_()
                    mark_static(states[i])  # written in place by every round, like the KV buffers
            self.has_previous_state[i] = True


class SlotStateLayer(StateLayer, SlotLayer):
    """A layer keeping attention KV and state together (HF's ``LinearAttentionAndFullAttentionLayer``:
    Falcon-H1's layers, Zamba2's hybrid ones): :class:`SlotLayer`'s KV at slots, which the mask hides
    when rejected, and :class:`StateLayer`'s state buffers, which the snapshot and mixer steps roll back.
    HF's own hybrid layer combines its two parents the same way."""

    def __init__(self, owner: SlotCache, number_of_states: int = 1):
        SlotLayer.__init__(self, owner)
        StateLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2:  # cache.update(keys, values): the KV buffers
            SlotLayer.lazy_initialization(self, *args)
        else:  # update_conv_state / update_recurrent_state, by keyword
            StateLayer.lazy_initialization(self, *args, **kwargs)

    def get_max_length(self) -> int:  # the KV buffers' (the state mixin answers -1)
        return SlotLayer.get_max_length(self)

    is_compileable = True


def state_layer_types(config) -> set[str]:
    """The config's layer types whose HF cache layer carries state (HF's own mapping; those
    holding KV too, HF's "hybrid" layers, included)."""
    return {t for t, cls in cache_layer_classes(config).items() if issubclass(cls, LinearAttentionCacheLayerMixin)}


def keeps_state(model) -> bool:
    """Whether ``model`` keeps recurrent or linear-attention state: HF marks it (``_is_stateful``)
    or HF's layer mapping gives one of its config's layer types a state layer (LFM2's short-conv
    layers, which HF does not mark)."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

    if getattr(model, "_is_stateful", False):
        return True
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
    return any(issubclass(DYNAMIC_LAYER_TYPE_MAPPING.get(t, object), LinearAttentionCacheLayerMixin) for t in types)


def masks_with_state(config, kv_mask, pad: torch.Tensor | None):
    """The ``attention_mask`` of a model with stateful layers: ``kv_mask`` (a 4-D mask, or the
    runner's dict of them by :func:`~specfx.model.masks.attention_mask_keys`) for the layers keeping
    KV, and ``pad`` for those keeping state or nothing (``[B, T]``, 1 on real tokens; None where nothing is
    padding, as in every verify forward: a static choice, no sync), which HF's mixers multiply their
    inputs by, also under "linear_attention", where HF's forwards read the state's mask of a layer
    keeping both; ``pad`` alone for a model without KV layers."""
    no_kv = state_only_layer_types(config)
    if no_kv == set(config.get_text_config(decoder=True).layer_types):
        return pad
    if isinstance(kv_mask, dict):
        masks = dict(kv_mask)
    else:
        masks = dict.fromkeys(attention_mask_keys(config, type(config).__name__), kv_mask)
    masks.update(dict.fromkeys(no_kv | {"linear_attention"}, pad))
    return masks


def slot_cache_with_state(config, batch_size: int, capacity: int, device) -> SlotCache:
    """A :class:`SlotCache` whose stateful layers are :class:`StateLayer` s, and :class:`SlotStateLayer` s
    where a layer keeps KV too (Falcon-H1, Zamba2's hybrid layers): which layers carry KV, state or
    both is read from HF's own layer mapping for the config's layer types
    (``DynamicCache(config=...)``), not from a list of architectures."""
    from transformers.cache_utils import DynamicCache

    hf_layers = DynamicCache(config=config.get_text_config(decoder=True)).layers
    cache = SlotCache(len(hf_layers), batch_size, capacity, device)
    for i, hf_layer in enumerate(hf_layers):
        if isinstance(hf_layer, LinearAttentionCacheLayerMixin):
            n = hf_layer.number_of_states
            both = isinstance(hf_layer, CacheLayerMixin)
            cache.layers[i] = SlotStateLayer(cache, n) if both else StateLayer(number_of_states=n)
    return cache


def stateful_layers(cache) -> list[tuple[int, LinearAttentionCacheLayerMixin]]:
    """(layer index, layer) of every linear-attention layer of an HF cache."""
    return [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


class StateSnapshot:
    """A copy of every conv and recurrent state tensor of ``cache`` (its stateful layers only: the
    attention KV needs no snapshot, the mask hides rejected entries)."""

    def __init__(self, cache):
        self.tensors: list[tuple[dict, int, torch.Tensor]] = []  # (owner dict, state_idx, copy)
        for _, layer in stateful_layers(cache):  # layer_state's order, which select() relies on
            self.tensors.extend(layer_state(layer))
        mark_static(*(saved for _, _, saved in self.tensors))  # taken in place every round

    def take(self) -> None:
        """Copy the live states into the snapshot, in place (a round's first step: the snapshot's
        buffers are static, allocated once)."""
        for states, idx, saved in self.tensors:
            saved.copy_(states[idx])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, _, t in self.tensors)

    def restore(self, keep: torch.Tensor | None = None) -> None:
        """Write the snapshot back in place, into every row, or only where ``keep [B]`` is False
        (rows that keep their current state: the predicated write of a per-row rollback)."""
        for states, idx, saved in self.tensors:
            live = states[idx]
            if keep is None:
                live.copy_(saved)
            else:
                live.copy_(torch.where(keep.view(-1, *([1] * (saved.dim() - 1))), live, saved))


class MixerTaps:
    """The stateful mixers of ``model`` and, inside :meth:`recording`, their inputs.

    A mixer is the innermost module with a ``layer_idx`` attribute whose cache layer (in ``cache``)
    is a linear-attention layer: Qwen3-Next's ``Qwen3NextGatedDeltaNet``, Mamba2's ``Mamba2Mixer``,
    no per-architecture code. Where a layer keeps KV and state (Falcon-H1: an attention and a Mamba2
    module with the same ``layer_idx``) only the modules that write the state are mixers: given
    ``run`` (one forward through ``cache``), those are found by running it (decision 79). Hooks are registered by :meth:`attach` (or for the block of
    :meth:`recording`) and record only while :attr:`on`; the engine's version may tap the captured
    graph instead, as the hidden-taps pass does.

    ``steps`` (decision 90; types whose multi-token forward does not continue a cached state as their
    single-token decoding does): while recording (a verify, a draft's catch-up: the only multi-token
    forwards from a live state), the pre-hook hands a mixer position 0 alone and a forward hook
    runs the later positions through the module's own ``forward`` (hooks not re-entered), joins the
    outputs and keeps the state after each position (:meth:`select`)."""

    def __init__(self, model, cache, run=None, steps: bool = False):
        linear = {i for i, _ in stateful_layers(cache)}
        candidates = [
            (name, mod) for name, mod in model.named_modules() if isinstance(getattr(mod, "layer_idx", None), int)
        ]
        names = {name for name, _ in candidates}
        self.mixers = [
            mod
            for name, mod in candidates
            if mod.layer_idx in linear and not any(other.startswith(name + ".") for other in names)
        ]
        if run is not None:
            self.mixers = _state_writers(self.mixers, cache, run)
        # per mixer, the (args, kwargs) of each forward recorded, in order (one for a verify forward;
        # a stateful draft's round records its catch-up and each draft step, decision 81)
        self.inputs: dict[int, list[tuple[tuple, dict]]] = {}
        self.on = False  # record only while True (the replays call the same modules)
        self._handles: list = []
        self._step = StateSnapshot(cache)  # the state before a replay step (replay_steps), taken in place
        self.steps = steps
        self._cache = cache
        self._first, k = {}, 0  # select(): each stateful layer's first entry in a StateSnapshot of the cache
        for i, layer in stateful_layers(cache):  # (by position: an id() of a dict breaks torch 2.11's Dynamo)
            self._first[i], k = k, k + len(layer_state(layer, copy=False))
        self._pending: dict[int, tuple[tuple, dict]] = {}  # steps: a stepped call's own inputs, by mixer
        self.after: dict[int, list[list]] = {}  # steps: per mixer, the state after each recorded position

        recorder = weakref.ref(self)  # the hooks are kept here: a strong reference back is a cycle (decision 93)

        def hook(mod, args, kwargs):  # one function for every attach: a compiled graph guards on it
            self = back_reference(recorder, "mixer hook's recorder")
            if self.on:
                self.inputs.setdefault(id(mod), []).append((args, kwargs))
                if self.steps and width(args, kwargs) > 1:  # the module runs position 0 alone
                    self._pending[id(mod)] = (args, kwargs)
                    return column(args, 0), step_kw(kwargs, 0)
            return None

        def stepped(mod, args, kwargs, out):  # steps only: positions 1.. by single-token calls, joined
            self = back_reference(recorder, "mixer hook's recorder")
            if not self.on:
                return None
            layer = self._cache.layers[mod.layer_idx]
            after = self.after.setdefault(id(mod), [])
            after.append(layer_state(layer))
            pending = self._pending.pop(id(mod), None)
            if pending is None:
                return None
            args, kwargs = pending
            outs = [out]
            for t in range(1, width(args, kwargs)):
                outs.append(mod.forward(*column(args, t), **step_kw(kwargs, t)))
                after.append(layer_state(layer))
            return cat_steps(outs)

        self._hook, self._stepped = hook, stepped
        self.attached = False  # a plain flag a compiled graph can read (not the hook handles)

    def attach(self) -> None:
        """Register the recording hooks (once); :meth:`recording` does it for its block. A
        compiled round attaches before tracing and sets :attr:`on` inside: registering a hook
        cannot be traced."""
        if not self._handles:
            self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.mixers]
            if self.steps:
                self._handles += [m.register_forward_hook(self._stepped, with_kwargs=True) for m in self.mixers]
            self.attached = True

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.attached = False

    @contextmanager
    def recording(self):
        attached = not self._handles
        self.attach()
        self.on = True
        try:
            yield self
        finally:
            self.on = False
            if attached:
                self.detach()

    # ------------------------------------------------ recorded inside a captured forward (decision 82)
    def flat_inputs(self) -> tuple[torch.Tensor, ...]:
        """The recorded inputs' tensors, mixers in order, each mixer's positional then keyword ones
        (``attention_mask`` left out: a replay passes None). Called inside the trace of a capture
        (:class:`~specfx.model.taps.TapCaptures`), whose extra outputs they become: a captured graph
        calls no module, so no hook can record during it."""
        out: list[torch.Tensor] = []
        for mod in self.mixers:
            for args, kwargs in self.inputs[id(mod)]:  # one recorded forward per capture
                out += [a for a in args if isinstance(a, torch.Tensor)]
                out += [v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k != "attention_mask"]
        # each as a view of its own: Dynamo returns a tensor that leaves the graph several times (or a
        # graph input) through its bytecode, not as several outputs of the FX graph specfx calls, and
        # transformers 5.25 passes every Mamba2 mixer the same position_ids
        return tuple(t.view_as(t) for t in out)

    def template(self, cache) -> list[list[tuple[tuple, dict]]]:
        """The recorded inputs' structure, per mixer and recorded forward, with :data:`_TENSOR`
        where :meth:`flat_inputs` takes a tensor and :data:`_CACHE` where ``cache`` was passed
        (no tensor, no cache kept)."""

        def spec(k, v):
            if k == "attention_mask":
                return None
            return _TENSOR if isinstance(v, torch.Tensor) else _CACHE if v is cache else v

        return [
            [(tuple(spec(None, a) for a in args), {k: spec(k, v) for k, v in kwargs.items()}) for args, kwargs in forwards]
            for forwards in (self.inputs[id(mod)] for mod in self.mixers)
        ]

    def load(self, template: list[list[tuple[tuple, dict]]], tensors, cache) -> None:
        """Set the recorded inputs from a captured forward's extra outputs ``tensors`` (in
        :meth:`flat_inputs`' order) and the capture's :meth:`template`, as the hooks would have."""
        it = iter(tensors)
        self.after.clear()  # states kept while the capture was traced: not this call's

        def fill(v):
            return next(it) if v is _TENSOR else cache if v is _CACHE else v

        for mod, forwards in zip(self.mixers, template, strict=True):
            self.inputs[id(mod)] = [
                (tuple(fill(a) for a in args), {k: fill(v) for k, v in kwargs.items()}) for args, kwargs in forwards
            ]

    def replay(self, cache, length: int) -> None:
        """Re-run every mixer on the first ``length`` positions of its recorded inputs, through
        ``cache`` (whose states the caller has restored to the pre-forward snapshot): the states
        become those after exactly ``length`` inputs. One length for all rows (batch 1, or rows
        that accepted alike; one recorded forward); see :meth:`replay_steps` for per-row lengths."""
        for mod in self.mixers:
            (args, kwargs), *_ = self.inputs[id(mod)]
            mod(*prefix(args, length), **prefix_kw(kwargs, length, cache))

    def replay_steps(self, cache, n: torch.Tensor, tokens: int | None = None) -> None:
        """Per-row lengths with fixed shapes: ``tokens`` single-position mixer calls from the
        restored snapshot, each row's state frozen once its ``n[b] + 1`` inputs are in (a
        predicated write per step; no host sync). The inputs are the recorded forwards' columns
        in order (one forward's, or several forwards' one after another; ``tokens`` None: all of
        them). The caller has restored the snapshot taken before the first recorded forward."""
        before = self._step  # static buffers allocated with the taps, reused by every step and round
        cols = {id(mod): columns(self.inputs[id(mod)]) for mod in self.mixers}
        if tokens is None:
            tokens = len(cols[id(self.mixers[0])])
        for t in range(tokens):
            before.take()
            for mod in self.mixers:
                args, kwargs, col = cols[id(mod)][t]
                mod(*column(args, col), **column_kw(kwargs, col, cache))
            before.restore(keep=t <= n)

    def stepped_through(self, tokens: int | None) -> bool:
        """Whether the steps kept each mixer's state after each of the first ``tokens`` inputs (None: all)."""
        if not self.steps:
            return False
        for mod in self.mixers:
            kept = len(self.after.get(id(mod), ()))
            if kept == 0 or kept < (tokens if tokens is not None else len(columns(self.inputs.get(id(mod), [])))):
                return False
        return True

    def select(self, snapshot: StateSnapshot, n: torch.Tensor, tokens: int | None = None) -> None:
        """Steps mode's rollback: each row's state after exactly its first ``n[b]`` recorded inputs
        (0: ``snapshot``'s), selected from the states the steps passed through (a gather per state
        tensor; fixed shapes, no host sync, no mixer call)."""
        first, rows = self._first, torch.arange(n.shape[0], device=n.device)
        for mod in self.mixers:
            after = self.after[id(mod)][:tokens] if tokens is not None else self.after[id(mod)]
            for j, (_, _, live) in enumerate(layer_state(self._cache.layers[mod.layer_idx], copy=False)):
                saved = snapshot.tensors[first[mod.layer_idx] + j][2]
                stack = torch.stack([saved, *(kept[j][2] for kept in after)])
                live.copy_(stack[n, rows])


_TENSOR, _CACHE = object(), object()  # a template's places for a recorded tensor and for the cache


class _Touches(dict):
    """A layer's conv or recurrent state dict that counts its reads (while mixers are found)."""

    def __init__(self, states: dict, counter: list):
        super().__init__(states)
        self.counter = counter

    def __getitem__(self, idx):
        self.counter[0] += 1
        return super().__getitem__(idx)


def _state_writers(mods, cache, run) -> list:
    """Those of ``mods`` inside whose forward their cache layer's state is read or written during
    ``run()`` (HF's mixers read it through ``cache.get_conv_state`` and write it through
    ``update_conv_state`` or in place; attention beside it in the same layer touches only KV):
    each state dict swapped for one that counts, a pre- and a post-hook on each module."""
    layers = dict(stateful_layers(cache))
    counters = {i: [0] for i in layers}
    saved = {i: (layer.conv_states, layer.recurrent_states) for i, layer in layers.items()}
    before: dict[int, int] = {}
    touched: set[int] = set()

    def pre(mod, args):
        before[id(mod)] = counters[mod.layer_idx][0]

    def post(mod, args, out):
        if counters[mod.layer_idx][0] > before[id(mod)]:
            touched.add(id(mod))

    handles = [h for m in mods for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    for i, layer in layers.items():
        layer.conv_states = _Touches(layer.conv_states, counters[i])
        layer.recurrent_states = _Touches(layer.recurrent_states, counters[i])
    try:
        run()
    finally:
        for i, layer in layers.items():  # the same dict objects back (the snapshots hold them)
            for name, orig in zip(("conv_states", "recurrent_states"), saved[i], strict=True):
                orig.update(getattr(layer, name))
                setattr(layer, name, orig)
        for h in handles:
            h.remove()
    return [m for m in mods if id(m) in touched]
