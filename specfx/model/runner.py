"""One model's forward with static per-row KV, explicit positions and an explicit mask."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from specfx.model.cache import SlotCache
from specfx.model.capture import CapturedForward, CaptureError, capture_forward, decoder_layer_names
from specfx.model.hf_names import cache_kwarg
from specfx.model.masks import TreeView, check_attn_implementation, mask_plan
from specfx.passes.pipeline import PassError, run_passes
from specfx.passes.rewrites.hidden_taps import check_tap_names, hidden_taps
from specfx.model.admission import (
    compare,
    compare_rows,
    full_logits,
    incremental_logits,
    not_causal,
    probe_capacity,
    probe_length,
    probe_tokens,
    tree_logits,
)
from specfx.trees.types import DynamicTree, TokenTree, TreeTensors

__all__ = ["ModelRunner", "check_causal_lm"]

_CAUSAL_LM_CLASSES = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def check_causal_lm(model, role: str) -> None:
    """Raise a clear error unless ``model`` is an HF decoder-only causal LM with a KV cache."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"{role} must be a transformers PreTrainedModel with a causal LM head "
            f"(e.g. AutoModelForCausalLM.from_pretrained(path)), got {type(model).__name__}."
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{role} ({type(model).__name__}) is an encoder-decoder model; specfx speculates decoder-only causal LMs."
        )
    name = type(model).__name__
    if name not in _CAUSAL_LM_CLASSES or model.get_output_embeddings() is None:
        raise ValueError(
            f"{role} ({name}) is not a causal LM with an LM head. Load it with "
            f"AutoModelForCausalLM, not AutoModel or a classification head."
        )
    from specfx.model.architectures import ARCHITECTURES

    declared = ARCHITECTURES.get(getattr(config, "model_type", None))
    if declared is not None and declared.status == "unsupported":
        raise ValueError(f"{role} ({name}) is not supported by specfx: {declared.reason}.")
    if getattr(model, "_is_stateful", False):
        raise ValueError(
            f"{role} ({name}) keeps recurrent or linear-attention state (Mamba/RWKV/hybrid-style "
            f"layers). Speculation needs to discard rejected tokens per row, which such state "
            f"cannot undo, so specfx cannot speculate this model."
        )
    if cache_kwarg(model.forward) is None:
        raise ValueError(
            f"{role} ({name}) does not take a KV cache (its forward has neither a cache nor a "
            f"past_key_values argument), so its decoding cannot be driven incrementally; specfx "
            f"cannot speculate it."
        )


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

    The model object is used as is (no weights copied, nothing patched).
    """

    def __init__(self, model, role: str):
        check_causal_lm(model, role)
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(
                f"{role} ({type(model).__name__}) has weights on the meta device (built without "
                f"loading them): load it with from_pretrained(path), or materialise it with "
                f".to_empty(device=...) and load its weights, before speculate()."
            )
        self.mask_format = check_attn_implementation(model)
        config = model.config.get_text_config()
        self.mask_plan = mask_plan(config, type(model).__name__)
        self.model = model
        self.role = role
        self.num_layers = config.num_hidden_layers
        self.cache_layers = cache_layer_count(model, self.num_layers)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.config_vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.cache: SlotCache | None = None
        # "mask_4d": explicit 4-D masks (every conforming model); "rowwise_2d": the fallback
        # chosen by the probe when the 4-D protocol fails (see _forward_rowwise).
        self.protocol = "mask_4d"
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = cache_kwarg(model.forward)  # "cache" (transformers >= 5.24) or "past_key_values"
        self.probe_length = probe_length(config, self.mask_plan, self.max_positions)
        self.probed_capacity = 0  # the largest buffer capacity the probe vouched for (0: none yet)
        self._tree_failure: str | None = None  # the tree probe's finding ("" = passed; None = not run)
        # taps_key(...) -> the captured forward returning (logits, *tapped); see prepare_taps
        self._tap_graphs: dict[tuple, CapturedForward] = {}
        self._tap_signature: tuple | None = None  # (dtype, device) the captures were made for
        self._check_incremental(probe_capacity(self.probe_length))

    def _check_incremental(self, capacity: int) -> None:
        """Refuse a model whose incremental decoding through specfx's hooks differs from its
        own full forward (see :mod:`specfx.model.admission`): one that attends to later tokens (BERT-style
        heads without ``is_decoder=True``), derives positions from the cache length instead of
        ``position_ids``, builds attention windows from the cache's length, or otherwise ignores
        the cache, mask or positions it is given. One full forward and one incremental pass at
        ``capacity`` slots; skipped in training mode, where dropout would blur the comparison
        (the first :meth:`allocate` in eval mode probes then)."""
        model = self.model
        if model.training:
            return
        capacity = max(capacity, probe_capacity(self.probe_length))
        seq = probe_tokens(self.probe_length, self.vocab_size, self.device)
        with torch.no_grad():
            full = full_logits(model, seq)
        if not bool(full.isfinite().all()):
            raise ValueError(
                f"{self.role} ({type(model).__name__}) produces NaN or inf logits in its own forward "
                f"(on specfx's check sequence of {seq.numel()} tokens), so specfx cannot check that it "
                f"runs it exactly. Check the weights and dtype (float16 overflow is a common cause)."
            )
        failure = self._probe(seq, full, capacity)
        if failure is not None and self.probed_capacity == 0 and self.mask_plan.single == ("full", None):
            self.protocol = "rowwise_2d"  # e.g. ALiBi from a 2-D mask (Bloom)
            if self._probe(seq, full, capacity) is None:
                failure = None
            else:
                self.protocol = "mask_4d"
        if failure is None:
            self.probed_capacity = capacity
            return
        cause = failure if isinstance(failure, Exception) else None
        if cause is None:
            try:  # only to name the cause: a forward that attends to later tokens
                with torch.no_grad():
                    later = not_causal(model, seq, full, self.dtype)
            except Exception:  # the refusal below stands either way
                later = None
            if later is not None:
                raise ValueError(self._not_causal_refusal(failure, later, capacity))
        raise ValueError(self._refusal(failure, capacity)) from cause

    def _not_causal_refusal(self, failure: str, later: str, capacity: int) -> str:
        who = f"{self.role} ({type(self.model).__name__})"
        when = f"when its KV buffers grew to {capacity} slots" if self.probed_capacity else f"at {capacity} slots"
        config = self.model.config.get_text_config()
        if getattr(config, "is_decoder", None) is True:
            import transformers

            hint = (
                f"Its config sets is_decoder=True, yet the implementation in transformers "
                f"{transformers.__version__} attends bidirectionally (as BigBird, MegatronBert, RemBert and RoFormer "
                f"do in transformers 5.17, even as decoders): upgrade transformers to a release whose implementation "
                f"is causal as a decoder."
            )
        else:
            hint = "BERT-style heads are causal only as decoders: load the model with is_decoder=True."
        return (
            f"{who} does not decode incrementally like its full forward {when} ({failure}), "
            f"because its full forward attends to later tokens ({later}): no incremental decoding reproduces it, "
            f"not even its own generate(). {hint} specfx cannot run it exactly, so it refuses it rather than "
            f"generate different tokens."
        )

    def _refusal(self, failure, capacity: int) -> str:
        who = f"{self.role} ({type(self.model).__name__})"
        when = f"when its KV buffers grew to {capacity} slots" if self.probed_capacity else f"at {capacity} slots"
        if isinstance(failure, Exception):
            return (
                f"{who} failed when driven through a KV cache with an explicit 4-D mask and position_ids "
                f"{when} ({type(failure).__name__}: {failure}); specfx cannot speculate it."
            )
        return (
            f"{who} does not decode incrementally like its full forward {when} ({failure}). It attends "
            f"to later tokens (BERT-style heads need is_decoder=True), derives positions from the cache "
            f"length rather than position_ids, or builds its attention window from the cache's length "
            f"(GPT-Neo's local attention). specfx cannot run it exactly, so it refuses it rather than "
            f"generate different tokens."
        )

    def _probe(self, seq: torch.Tensor, full: torch.Tensor, capacity: int):
        """None if specfx's incremental path at ``capacity`` slots reproduces ``full`` (the
        model's logits ``[L, V]`` for ``seq [L]``); else the exception raised or what differs.
        The runner's own buffers are left as they were."""
        saved = self.cache
        try:
            with torch.no_grad():
                self._allocate_buffers(2, capacity)
                got = incremental_logits(self, seq)
        except Exception as e:  # reported by the caller, which names the model
            return e
        finally:
            self.cache = saved
        return compare(got, full, self.dtype)

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
            self._check_incremental(capacity)
        self._allocate_buffers(batch_size, capacity)
        # Tapped captures of this capacity stay (they read the current cache's tensors at call
        # time, and a compiled round that inlined one would recompile for a new one); those of
        # an outgrown capacity, or of another dtype or device, go.
        signature = (self.dtype, self.device)
        if signature != self._tap_signature:
            self._tap_graphs, self._tap_signature = {}, signature
        self._tap_graphs = {k: g for k, g in self._tap_graphs.items() if k[2] == capacity}

    @contextmanager
    def scratch_cache(self, batch_size: int, capacity: int):
        """Buffers of this shape for the ``with`` block only (a check at ``speculate()`` time,
        before the generator allocates); the runner's own cache is back afterwards."""
        saved = self.cache
        try:
            self._allocate_buffers(batch_size, capacity)
            yield self.cache
        finally:
            self.cache = saved

    def _allocate_buffers(self, batch_size: int, capacity: int) -> None:
        self.cache = SlotCache(self.cache_layers, batch_size, capacity, self.device)
        zeros = torch.zeros((batch_size, 1), dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.forward(zeros, zeros, torch.full_like(zeros, self.cache.trash_slot))

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
        logits = self._forward(ids, positions, slots, tree, taps, last_only)
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
            return self._forward_tapped(ids, positions, slots, tree, taps)
        cache.slots = slots
        mask = self.mask_plan.build(positions, cache.capacity, self.mask_format, self.dtype, tree)
        return self._call(ids, mask, positions, **self._keep_last(last_only))

    def _keep_last(self, last_only: bool) -> dict:
        if last_only and self._takes_logits_to_keep:
            return {"logits_to_keep": 1}
        return {}

    def tree_refusal(self) -> str | None:
        """Why this model cannot verify token trees, or None if it can. Checked once per runner
        by a tree-shaped probe (:func:`specfx.model.admission.tree_logits`): tree nodes sit in slots that
        are not their positions, which a model deriving positions or biases from slot indices
        gets wrong (MPT's ALiBi) though it decodes chains exactly."""
        if self.protocol == "rowwise_2d":
            return (
                f"{self.role} ({type(self.model).__name__}) needs a 2-D padding mask (specfx drives it "
                f"row by row, letting transformers build its causal mask), so its attention cannot be "
                f"given a token tree's mask; use a chain (num_speculative_tokens=K, no tree=)."
            )
        if self._tree_failure is None:
            self._tree_failure = self._probe_tree() or ""
        if self._tree_failure:
            return (
                f"{self.role} ({type(self.model).__name__}) does not verify a token tree like its own full "
                f"forward ({self._tree_failure}): tree nodes sit in KV slots that are not their positions, and "
                f"this model derives positions or attention biases from slot indices (ALiBi built from the "
                f"cache, as MPT's). specfx cannot verify trees on it exactly; use a chain "
                f"(num_speculative_tokens=K, no tree=)."
            )
        return None

    def _probe_tree(self) -> str | None:
        """None if a tree verification reproduces the full forward, else what differs (or the
        exception raised). Skipped in training mode, like the incremental probe."""
        if self.model.training:
            return None
        seq = probe_tokens(min(self.probe_length, 16), self.vocab_size, self.device)
        saved = self.cache
        try:
            with torch.no_grad():
                full = full_logits(self.model, seq)
                self._allocate_buffers(1, probe_capacity(seq.numel()))
                got = tree_logits(self, seq)
        except Exception as e:  # reported by the caller, which names the model
            return f"{type(e).__name__}: {e}"
        finally:
            self.cache = saved
        n = seq.numel()
        return compare_rows(got, full[n - 3 :], self.dtype)

    # ----------------------------------------------------------------- hidden taps
    def check_taps(self, taps) -> None:
        """ValueError unless drafters can read the hidden states ``taps`` of this model: the
        names must be valid for its layers and the model must run in one forward (at
        ``speculate()`` time, so a bad drafter fails before any capture)."""
        if not taps:
            return
        why = self.taps_refusal()
        if why is not None:
            raise ValueError(why)
        check_tap_names(taps, self.num_layers)
        decoder_layer_names(self.model)  # the layer boundaries must be findable

    def taps_key(self, batch_size: int, tokens: int, tree: TreeView | TokenTree | None, taps) -> tuple:
        """The shape a tapped capture serves: ``(batch, tokens, capacity, tree, taps)``, tree
        None or ``(rows of its tables, N, queries)``."""
        if isinstance(tree, TokenTree):  # a round's verification: every node, one table for all rows
            tree = (1, tree.size, tuple(range(tree.size + 1)))
        elif isinstance(tree, DynamicTree):  # the same, with a table per row
            tree = (batch_size, tree.size, tuple(range(tree.size + 1)))
        elif tree is not None:
            tree = (tree.depth.shape[0], tree.depth.shape[1] - 1, tuple(tree.queries))
        return (batch_size, tokens, self.cache.capacity, tree, tuple(taps))

    def prepare_taps(self, batch_size: int, tokens: int, taps, tree: TokenTree | DynamicTree | None = None) -> None:
        """Capture, now and eagerly, the tapped forward of ``[batch_size, tokens]`` inputs (with
        ``tree``: a verification of all its nodes) unless it is captured already. A compiled
        graph calling ``forward(..., taps=...)`` must find its capture ready: capturing is a
        Dynamo trace of its own, which cannot run while a round is being compiled."""
        if not taps or self._tap_graphs.get(self.taps_key(batch_size, tokens, tree, taps)) is not None:
            return
        view = None
        if tree is not None:
            if isinstance(tree, DynamicTree):  # per-row tables, traced as inputs: any tree of that shape
                parents = torch.zeros((batch_size, tree.size + 1), dtype=torch.long, device=self.device)
                tables = TreeTensors.from_parents(parents, tree.depth)
            else:
                tables = tree.tensors(self.device)
            lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
            view = TreeView(lengths, tables.depth, tables.ancestors, tuple(range(tree.size + 1)))
        self._capture_taps(batch_size, tokens, view, taps)

    def _forward_tapped(self, ids, positions, slots, tree: TreeView | None, taps):
        key = self.taps_key(ids.shape[0], ids.shape[1], tree, taps)
        graph = self._tap_graphs.get(key)
        if graph is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"specfx internal error: forward(taps={tuple(taps)}) inside a compiled graph for a shape "
                    f"(batch, tokens, capacity, tree, taps) = {key} that was not captured beforehand; "
                    f"ModelRunner.prepare_taps() must run eagerly before the graph is compiled."
                )
            graph = self._capture_taps(ids.shape[0], ids.shape[1], tree, taps)
        logits, *features = graph(ids, positions, slots, tree)
        return logits, tuple(features)

    def _capture_taps(self, batch_size: int, tokens: int, tree: TreeView | None, taps) -> CapturedForward:
        self.check_taps(taps)
        layer_names = decoder_layer_names(self.model)

        def hidden_taps_pass(gm):
            return hidden_taps(gm, layer_names=layer_names, taps=taps)

        hidden_taps_pass.__name__ = "hidden_taps"  # how the driver names it in errors

        def transform(gm) -> int:  # through the driver: the graph is linted after the pass
            return run_passes(gm, [hidden_taps_pass], round_checks=False).sites[0][1]

        try:
            graph = capture_forward(self, batch_size, tokens, tree=tree, transform=transform)
        except CaptureError as e:
            raise ValueError(
                f"{self.role} ({type(self.model).__name__}): the hidden-state taps {tuple(taps)} need its forward "
                f"captured as one graph, and {e} Drafters that read no hidden states (a draft model, "
                f"prompt lookup) can serve it."
            ) from e
        except PassError as e:  # the layer boundaries are not where the taps pass looks (looped layers)
            raise ValueError(
                f"{self.role} ({type(self.model).__name__}): its hidden states {tuple(taps)} cannot be tapped: "
                f"{e}. Drafters that read no hidden states (a draft model, prompt lookup) can serve it."
            ) from e
        self._tap_graphs[self.taps_key(batch_size, tokens, tree, taps)] = graph
        return graph

    def taps_refusal(self) -> str | None:
        """Why drafters cannot read this model's hidden states, or None if they can."""
        if self.protocol == "rowwise_2d":
            return (
                f"{self.role} ({type(self.model).__name__}) needs a 2-D padding mask (specfx drives it "
                f"row by row), so its hidden states cannot be tapped in one forward; drafters that "
                f"read the target's hidden states (MTP, Medusa, EAGLE) cannot serve it."
            )
        return None

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
