"""One model's forward with static per-row KV, explicit positions and an explicit mask.

:class:`ModelRunner` does the forward only; what it asks of other modules, one way each:
whether the model is admitted (:mod:`specfx.model.admission`, at construction and when its buffers
outgrow every capacity probed), the tapped forwards that also return hidden states
(:mod:`specfx.model.taps`), the masks (:mod:`specfx.model.masks`) and the cache
(:mod:`specfx.model.cache`). None of those imports the runner.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from specfx.model.admission import (
    check_causal_lm,
    check_incremental,
    check_weights_loaded,
    state_cache_kwarg,
    taps_refusal,
    tree_refusal,
)
from specfx.model.architectures import compressed_kv, min_queries
from specfx.model.cache import SlotCache
from specfx.model.hf_names import cache_kwarg
from specfx.model.masks import TreeView, check_attn_implementation, mask_plan
from specfx.model.probe import probe_capacity, probe_length
from specfx.model.recurrent import (
    MixerTaps,
    StateSnapshot,
    keeps_state,
    masks_with_state,
    slot_cache_with_state,
    stateful_layers,
)
from specfx.model.taps import TapCaptures
from specfx.trees.types import DynamicTree, TokenTree

__all__ = ["ModelRunner", "cache_layer_count", "state_hooks"]


def cache_layer_count(model, num_layers: int) -> int:
    """How many cache layers the model writes: ``num_layers``, or more when its forward grows
    HF's cache beyond the config's layers (looped models such as Dory keep one copy of each
    recurrent layer's cache per loop, appended to ``cache.layers`` on the first forward). Read
    off one two-token forward through a ``DynamicCache``, so that specfx allocates every layer
    up front and the model never copies specfx's cache layers itself."""
    from transformers.cache_utils import DynamicCache

    name = cache_kwarg(model.forward)
    try:
        dynamic = DynamicCache(config=model.config.get_text_config(decoder=True))
    except Exception:  # a config DynamicCache cannot read: the config's count is all we know
        return num_layers
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{name: dynamic})
    except Exception:  # the probe reports a model that fails through a cache, with its reason
        return num_layers
    return max(num_layers, len(dynamic.layers))


class ModelRunner:
    """Calls an HF causal LM through the stable hooks: a :class:`SlotCache` as its cache
    argument (``cache``, or ``past_key_values`` before transformers 5.24), a 4-D ``attention_mask`` and ``position_ids``.

    The model object is used as is (no weights copied, nothing patched). It is admitted here
    (:mod:`specfx.model.admission`: ValueError if specfx cannot run it exactly) and probed
    again when its buffers grow past every capacity probed so far.
    """

    def __init__(self, model, role: str):
        check_causal_lm(model, role)
        check_weights_loaded(model, role)
        self.mask_format = check_attn_implementation(model)
        config = model.config.get_text_config()
        # state as HF marks it, less a KV compressor's windows kept at slots (decision 97)
        stateful = keeps_state(model) and not compressed_kv(getattr(config, "model_type", None))
        self.mask_plan = mask_plan(config, type(model).__name__, stateful=stateful)
        self.model = model
        self.role = role
        self.num_layers = config.num_hidden_layers
        self.cache_layers = cache_layer_count(model, self.num_layers)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.config_vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.cache: SlotCache | None = None
        # "mask_4d": explicit 4-D masks (every conforming model); "rowwise_2d": the fallback
        # chosen by admission when the 4-D protocol fails (see _forward_rowwise).
        self.protocol = "mask_4d"
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # "cache" (transformers >= 5.24) or "past_key_values"; "cache_params" for Mamba2 before 5.24
        self._cache_kwarg = cache_kwarg(model.forward) or state_cache_kwarg(model)
        # admission's state: the probe's sequence length, the largest buffer capacity the probe
        # vouched for (0: none yet), the tree probe's finding ("" = passed; None = not run)
        self.probe_length = probe_length(config, self.mask_plan, self.max_positions)
        self.probed_capacity = 0
        self.tree_failure: str | None = None
        self.taps = TapCaptures(self)  # the captured tapped forwards (forward(..., taps=...))
        # recurrent / linear-attention state (decision 76): static per-row buffers, a snapshot
        # taken before each verify forward and the mixers' single steps that roll it back
        self.stateful = stateful
        # a KV compressor's window per cache layer (DeepSeek-V4's config.compress_rates by layer type), and the
        # fewest queries a forward may have (ArchSpec.min_queries; decision 97)
        rates = getattr(config, "compress_rates", None)
        types = getattr(config, "layer_types", None) or ()
        self.compress_rates = [rates.get(t) for t in types] if isinstance(rates, dict) else []
        self.min_queries = min_queries(getattr(config, "model_type", None))
        self.state_snapshot: StateSnapshot | None = None
        self.mixer_taps: MixerTaps | None = None
        # the mixers verify by their single-token path (decision 90): set by the probe, which tries
        # the multi-token forward first
        self.state_steps = False
        check_incremental(self, probe_capacity(self.probe_length))

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def allocate(self, batch_size: int, capacity: int) -> None:
        """New static buffers, allocated now by one eager probe forward (which learns each
        layer's KV shapes from the model itself and writes only the trash slot), so that no
        compiled graph ever allocates or rebinds them.

        A capacity beyond every one probed so far is probed first, since a model may depend on
        its buffers' length (GPT-Neo's local attention does): ValueError if it fails there."""
        if capacity > self.probed_capacity:
            check_incremental(self, capacity)
        self._allocate_buffers(batch_size, capacity)
        self.taps.keep(capacity)

    @contextmanager
    def scratch_cache(self, batch_size: int, capacity: int):
        """Buffers of this shape for the ``with`` block only (a check at ``speculate()`` time,
        before the generator allocates); the runner's own cache is back afterwards."""
        saved = self.cache, self.state_snapshot, self.mixer_taps
        try:
            self._allocate_buffers(batch_size, capacity)
            yield self.cache
        finally:
            self.cache, self.state_snapshot, self.mixer_taps = saved

    def _allocate_buffers(self, batch_size: int, capacity: int) -> None:
        if self.stateful:
            self.cache = slot_cache_with_state(self.model.config, batch_size, capacity, self.device)
        else:
            self.cache = SlotCache(self.cache_layers, batch_size, capacity, self.device, self.compress_rates)
        zeros = torch.zeros((batch_size, 1), dtype=torch.long, device=self.device)
        trash = torch.full_like(zeros, self.cache.trash_slot)
        with torch.no_grad():
            self.forward(zeros, zeros, trash)
            if self.stateful:  # the mixers: the modules that touch state in a second such forward
                self.state_snapshot = StateSnapshot(self.cache)
                self.mixer_taps = MixerTaps(
                    self.model, self.cache, run=lambda: self.forward(zeros, zeros, trash), steps=self.state_steps
                )
                self.reset_state()

    # ------------------------------------------- recurrent state (decision 76; stateful models only)
    def reset_state(self) -> None:
        """Zero every row's recurrent and conv state (before a prefill: every row restarts; a zero
        state is no state for every kernel admitted)."""
        for _, layer in stateful_layers(self.cache):
            layer.start()

    def verify_recording(self, ids, positions, slots, taps: tuple[str, ...] = ()):
        """A verify forward of a stateful model: the state snapshot taken first, the stateful
        mixers' inputs recorded during it (forward pre-hooks on the model's mixer modules,
        removed before this returns), for :meth:`roll_back_state`. With ``taps``: ``(logits,
        features)`` as :meth:`forward`, from a tapped capture that returns the mixers' inputs
        itself (decision 82: a captured graph calls no module, so no hook runs in it)."""
        self.state_snapshot.take()
        self.mixer_taps.after.clear()
        if taps:
            return self.taps.forward(ids, positions, slots, None, taps, record=True)
        taps = self.mixer_taps
        if taps.attached:  # compiled rounds: attached around the call (attach_state_hooks), not traced
            taps.on = True
            out = self.forward(ids, positions, slots)
            taps.on = False
            return out
        with taps.recording():
            return self.forward(ids, positions, slots)

    def start_recording(self) -> None:
        """Start a stretch of forwards whose stateful mixers' inputs are all recorded, in order (a
        stateful draft model's round: its catch-up and each draft step, decision 81): the state
        snapshot taken first; :meth:`stop_recording` ends it, :meth:`roll_back_state` rolls back
        over every input recorded. The hooks stay attached until :meth:`detach_state_hooks` (the
        generator's, after each call; a compiled round finds them attached already)."""
        self.state_snapshot.take()
        self.mixer_taps.after.clear()
        if not self.mixer_taps.attached:  # eager rounds; a compiled one reads the plain flag only
            self.mixer_taps.attach()
        self.mixer_taps.on = True

    def stop_recording(self) -> None:
        self.mixer_taps.on = False

    def roll_back_state(self, n: torch.Tensor, tokens: int | None = None) -> None:
        """After a verify forward of ``tokens`` inputs (:meth:`verify_recording`; or forwards of
        ``tokens`` inputs in all, :meth:`start_recording`; None: every input recorded) of which row b
        keeps the first ``n[b]`` (0..tokens): every stateful layer's state becomes the state
        after exactly those inputs (fixed shapes, per-row n, no host sync). Where the recording
        stepped the mixers (decision 90) each row's state is selected from those the steps passed
        through (decision 91); otherwise the snapshot is written back, then the mixers' own
        single-token steps run on the recorded inputs, each kept only by the rows within their n."""
        taps = self.mixer_taps
        if taps.stepped_through(tokens):  # the verify stepped the mixers: select each row's state (decision 91)
            taps.select(self.state_snapshot, n, tokens)
        else:
            self.state_snapshot.restore()
            taps.replay_steps(self.cache, n - 1, tokens)
        taps.inputs.clear()  # never replayed again (a graph traced without hooks fails, not reuses)
        taps.after.clear()

    def attach_state_hooks(self) -> None:
        """Register the mixers' recording hooks for a stretch of compiled rounds (a graph records
        through them only if they are there when it is traced and run); :meth:`detach_state_hooks`
        removes them. Eager rounds register them around each verify forward themselves."""
        if self.mixer_taps is not None:
            self.mixer_taps.attach()

    def detach_state_hooks(self) -> None:
        if self.mixer_taps is not None:
            self.mixer_taps.detach()

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tree: TreeView | None = None,
        taps: tuple[str, ...] = (),
        last_only: bool = False,
    ):
        """ids, positions, slots ``[B, T]`` -> logits ``[B, T, V]``; writes KV at ``slots``.
        With ``taps`` (``"final"``, ``"last"``, ``"layer:i"``; see
        :mod:`specfx.passes.rewrites.hidden_taps`): ``(logits, features)``, one hidden state ``[B, T, H]``
        per tap, for drafters that read the target's hidden states, from a capture of this
        forward rewritten by the hidden-taps pass (:meth:`prepare_taps`); its logits are bit
        for bit the untapped forward's.
        With ``tree``: the tokens are token-tree nodes, and each sees the committed prefix and
        its own ancestors only (:func:`specfx.model.masks.visible_slots`).
        ``last_only``: the logits of the last column only, ``[B, 1, V]`` (prefill): the model
        is asked for them with ``logits_to_keep=1`` when its forward takes it (HF's generate()
        does the same in its prefill), else the full logits are sliced; with ``taps`` the
        captured forward's logits are sliced (its graph prunes them when compiled).

        Positions are clamped to the model's range: only uncommitted padding ever exceeds it,
        and an out-of-range learned position embedding would fault inside a kernel.
        """
        pad = self.min_queries - ids.shape[1] if tree is None else 0
        if pad > 0:  # padding queries first: position 0, the trash slot, seen by nothing real (decision 97)
            ids, positions = (torch.cat([torch.zeros_like(x[:, :1]).expand(-1, pad), x], dim=1) for x in (ids, positions))
            slots = torch.cat([torch.full_like(slots[:, :1], self.cache.trash_slot).expand(-1, pad), slots], dim=1)
        logits = self._forward(ids, positions, slots, tree, taps, last_only)
        if pad > 0 and not last_only:
            logits = (logits[0][:, pad:], tuple(f[:, pad:] for f in logits[1])) if taps else logits[:, pad:]
        if not last_only:
            return logits
        if taps:
            return logits[0][:, -1:], logits[1]
        return logits[:, -1:]

    def _forward(self, ids, positions, slots, tree, taps, last_only):
        cache = self.cache
        if self.protocol == "rowwise_2d":
            if tree is not None:
                raise ValueError(self.tree_refusal())
            if taps:
                raise ValueError(self.taps_refusal())
            return self._forward_rowwise(ids, positions, slots, last_only)
        if taps:
            return self.taps.forward(ids, positions, slots, tree, taps)
        cache.slots = slots
        mask = self.mask_plan.build(positions, cache.capacity, self.mask_format, self.dtype, tree)
        if self.stateful:  # the stateful layers' 2-D mask: 0 on padding (the trash slot)
            mask = masks_with_state(self.model.config, mask, (slots != cache.trash_slot).long())
        return self._call(ids, mask, positions, **self._keep_last(last_only))

    def _keep_last(self, last_only: bool) -> dict:
        if last_only and self._takes_logits_to_keep:
            return {"logits_to_keep": 1}
        return {}

    # ------------------------------------------- admission and taps, as callers ask the runner
    def tree_refusal(self) -> str | None:
        """Why this model cannot verify token trees, or None if it can
        (:func:`specfx.model.admission.tree_refusal`: a tree-shaped probe, run once)."""
        return tree_refusal(self)

    def taps_refusal(self) -> str | None:
        """Why drafters cannot read this model's hidden states, or None if they can."""
        return taps_refusal(self)

    def check_taps(self, taps) -> None:
        """ValueError unless drafters can read the hidden states ``taps`` of this model
        (:meth:`specfx.model.taps.TapCaptures.check`)."""
        self.taps.check(taps)

    def prepare_taps(
        self, batch_size: int, tokens: int, taps, tree: TokenTree | DynamicTree | None = None, record: bool = False
    ) -> None:
        """Capture the tapped forward of this shape now, eagerly, unless it is captured already
        (:meth:`specfx.model.taps.TapCaptures.prepare`; ``record``: the verify forward of
        :meth:`verify_recording`)."""
        if tree is None:
            tokens = max(tokens, self.min_queries)  # forward() pads shorter ones (decision 97)
        self.taps.prepare(batch_size, tokens, taps, tree, record)

    def _call(self, ids, mask, positions, **kwargs):
        if self.max_positions is not None:
            positions = positions.clamp(max=self.max_positions - 1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: self.cache},
            **kwargs,
        )
        return out.logits

    def _forward_rowwise(self, ids, positions, slots, last_only: bool = False):
        """The fallback protocol for models that need a 2-D padding mask (Bloom builds its ALiBi
        bias from it): one forward per row, each with a 2-D mask over every slot and the
        row's query offset given through the cache (``get_query_offset``), from which
        transformers builds the causal mask itself. Row b's last column is real (left padding),
        so its queries start at ``positions[b, -1] - (T - 1)``; padding queries fall below 0
        and see nothing. Exact, but B forwards instead of one."""
        cache = self.cache
        t = ids.shape[1]
        mask = torch.ones((1, cache.capacity), dtype=torch.long, device=ids.device)
        outs = []
        for b in range(ids.shape[0]):
            cache.row = b
            cache.slots = slots[b : b + 1]
            cache.query_offset = positions[b, -1] - (t - 1)
            outs.append(self._call(ids[b : b + 1], mask, positions[b : b + 1], **self._keep_last(last_only)))
        cache.row = None
        return torch.cat(outs)


@contextmanager
def state_hooks(runners, attach: bool):
    """The stateful ``runners``' mixer recording hooks around a stretch of rounds: attached first if
    ``attach`` (compiled rounds are traced and run with them; eager ones attach around each verify
    forward themselves), removed after in any case, so the user's models keep no hook (decision 76)."""
    for runner in runners if attach else ():
        runner.attach_state_hooks()
    try:
        yield
    finally:
        for runner in runners:
            runner.detach_state_hooks()
