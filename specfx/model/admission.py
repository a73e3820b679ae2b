"""Admission: whether specfx can run a model exactly, decided at ``speculate()`` (and again when
its buffers grow), with the refusal a user reads when it cannot.

Checked on the model object alone (:func:`check_causal_lm`, :func:`check_weights_loaded`): an HF
decoder-only causal LM with an LM head and a KV cache argument, no recurrent state, no row of the
architecture table marked ``unsupported``, its weights loaded.

Checked by running it (:func:`check_incremental`, :func:`tree_refusal`): the model's own full
forward against specfx's incremental path through the runner (the measurements are
:mod:`specfx.model.probe`). A model that fails with the 4-D mask protocol but takes a plain causal
mask is retried with the row-wise 2-D protocol (Bloom's ALiBi); the runner keeps what was found:
``runner.protocol``, ``runner.probed_capacity`` (the largest capacity vouched for) and
``runner.tree_failure`` (the tree probe's finding). Only the runner's public surface is used
(``forward``, ``scratch_cache``, ``model``, ``role``, ``dtype``, ``device``...), so this module
imports no runner: the dependency runs one way, runner -> admission.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from specfx.model.architectures import ARCHITECTURES, compressed_kv
from specfx.model.hf_names import cache_kwarg
from specfx.model.probe import (
    compare,
    compare_rows,
    compare_states,
    full_logits,
    incremental_logits,
    not_causal,
    own_decoding,
    probe_capacity,
    probe_tokens,
    tree_logits,
)
from specfx.model.recurrent import StateSnapshot, keeps_state

__all__ = [
    "check_causal_lm",
    "check_incremental",
    "check_weights_loaded",
    "state_refusal",
    "taps_refusal",
    "tree_refusal",
]

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
    declared = ARCHITECTURES.get(getattr(config, "model_type", None))
    if declared is not None and declared.status == "unsupported":
        raise ValueError(f"{role} ({name}) is not supported by specfx: {declared.reason}.")
    kept = keeps_state(model) and not compressed_kv(getattr(config, "model_type", None))  # decision 97
    if kept or (declared is not None and declared.stateful and declared.status == "refused"):
        why = state_refusal(model, role)
        if why is not None:
            raise ValueError(why)
    if cache_kwarg(model.forward) is None and state_cache_kwarg(model) is None:
        raise ValueError(
            f"{role} ({name}) does not take a KV cache (its forward has neither a cache nor a "
            f"past_key_values argument), so its decoding cannot be driven incrementally; specfx "
            f"cannot speculate it."
        )


def state_cache_kwarg(model) -> str | None:
    """``"cache_params"`` for a stateful model whose forward takes its cache under that name (Mamba2
    before transformers 5.24, an HF ``Cache`` with the linear-attention API all the same), else
    None. Asked only where :func:`~specfx.model.hf_names.cache_kwarg` finds no attention cache name."""
    import inspect

    if not getattr(model, "_is_stateful", False):
        return None
    return "cache_params" if "cache_params" in inspect.signature(model.forward).parameters else None


def state_refusal(model, role: str) -> str | None:
    """Why specfx cannot speculate ``model``, which keeps recurrent or linear-attention state, or
    None if it can (decisions 76, 79 and 81): as the target or as a draft model, when HF's own
    cache layout for its config (``DynamicCache(config=...)``) keeps the state in HF
    linear-attention layers (alone or beside KV in the same layer), and its type is not declared
    refused in the architecture table (whose reason is quoted). The incremental-decoding probe
    then checks it by running it. Drafters that feed a draft model other than a chain of its own
    proposals refuse state themselves (PARD's mask tokens)."""
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    name = type(model).__name__
    model_type = getattr(model.config, "model_type", None)
    declared = ARCHITECTURES.get(model_type)
    if declared is not None and declared.status == "refused":
        return (
            f"{role} ({name}): specfx cannot speculate model type {model_type!r} exactly: {declared.reason}. "
            f"It refuses it rather than generate different tokens (docs/HYBRID.md and the README's supported "
            f"models list the hybrid types it runs)."
        )
    who = f"{role} ({name}) keeps recurrent or linear-attention state (Mamba/RWKV/hybrid-style layers)"
    try:
        layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    except Exception as e:
        return f"{who}, and its cache layout cannot be read from its config ({type(e).__name__}: {e}); specfx cannot speculate it."
    if not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers):
        return (
            f"{who} outside HF's linear-attention cache API (Cache.update_conv_state / "
            f"update_recurrent_state), so specfx cannot snapshot and roll it back; it cannot speculate this model."
        )
    return None


def check_weights_loaded(model, role: str) -> None:
    """Raise unless every weight of ``model`` is materialised (none on the meta device)."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"{role} ({type(model).__name__}) has weights on the meta device (built without "
            f"loading them): load it with from_pretrained(path), or materialise it with "
            f".to_empty(device=...) and load its weights, before speculate()."
        )


def check_incremental(runner, capacity: int) -> None:
    """Refuse a model whose incremental decoding through specfx's hooks differs from its
    own full forward (see :mod:`specfx.model.probe`): one that attends to later tokens (BERT-style
    heads without ``is_decoder=True``), derives positions from the cache length instead of
    ``position_ids``, builds attention windows from the cache's length, or otherwise ignores
    the cache, mask or positions it is given. One full forward and one incremental pass at
    ``capacity`` slots; skipped in training mode, where dropout would blur the comparison
    (the runner's first ``allocate`` in eval mode probes then). On success sets
    ``runner.probed_capacity`` (and ``runner.protocol`` when the row-wise fallback is the one
    that passed)."""
    model = runner.model
    if model.training:
        return
    capacity = max(capacity, probe_capacity(runner.probe_length))
    seq = probe_tokens(runner.probe_length, runner.vocab_size, runner.device)
    with torch.no_grad():
        full = full_logits(model, seq)
    if not bool(full.isfinite().all()):
        raise ValueError(
            f"{runner.role} ({type(model).__name__}) produces NaN or inf logits in its own forward "
            f"(on specfx's check sequence of {seq.numel()} tokens), so specfx cannot check that it "
            f"runs it exactly. Check the weights and dtype (float16 overflow is a common cause)."
        )
    failure = _probe(runner, seq, full, capacity)
    stateful = getattr(runner, "stateful", False)
    if failure is not None and stateful and runner.probed_capacity == 0 and not runner.state_steps:
        runner.state_steps = True  # verify by the mixers' single steps (decision 90)
        stepped = _probe(runner, seq, full, capacity)
        if stepped is None:
            failure = None
        else:
            runner.state_steps = False
    retry = not stateful  # the rowwise protocol has no state rollback
    if failure is not None and retry and runner.probed_capacity == 0 and runner.mask_plan.single == ("full", None):
        runner.protocol = "rowwise_2d"  # e.g. ALiBi from a 2-D mask (Bloom)
        if _probe(runner, seq, full, capacity) is None:
            failure = None
        else:
            runner.protocol = "mask_4d"
    if failure is None:
        runner.probed_capacity = capacity
        return
    cause = failure if isinstance(failure, Exception) else None
    if cause is None:
        try:  # only to name the cause: a forward that attends to later tokens
            with torch.no_grad():
                later = not_causal(model, seq, full, runner.dtype)
        except Exception:  # the refusal below stands either way
            later = None
        if later is not None:
            raise ValueError(_not_causal_refusal(runner, failure, later, capacity))
    raise ValueError(_refusal(runner, failure, capacity)) from cause


def _probe(runner, seq: torch.Tensor, full: torch.Tensor, capacity: int):
    """None if specfx's incremental path at ``capacity`` slots reproduces ``full`` (the
    model's logits ``[L, V]`` for ``seq [L]``; for a stateful model, its own decoding instead:
    :func:`~specfx.model.probe.own_decoding`, logits and the state at the end); else the exception
    raised or what differs. The runner's own buffers are left as they were."""
    try:
        with torch.no_grad(), runner.scratch_cache(2, capacity):
            got = incremental_logits(runner, seq)
            states = ref = None
            if runner.stateful:  # the live state at the end (a new snapshot of it) against the model's own
                states = [t for _, _, t in StateSnapshot(runner.cache).tensors]
                name = cache_kwarg(runner.model.forward) or state_cache_kwarg(runner.model)
                full, ref = own_decoding(runner.model, seq, name)
    except Exception as e:  # reported by the caller, which names the model
        return e
    found = compare(got, full, runner.dtype)
    return found if found is not None or states is None else compare_states(states, ref, runner.dtype)


def _when(runner, capacity: int) -> str:
    return f"when its KV buffers grew to {capacity} slots" if runner.probed_capacity else f"at {capacity} slots"


def _not_causal_refusal(runner, failure: str, later: str, capacity: int) -> str:
    who = f"{runner.role} ({type(runner.model).__name__})"
    config = runner.model.config.get_text_config()
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
        f"{who} does not decode incrementally like its full forward {_when(runner, capacity)} ({failure}), "
        f"because its full forward attends to later tokens ({later}): no incremental decoding reproduces it, "
        f"not even its own generate(). {hint} specfx cannot run it exactly, so it refuses it rather than "
        f"generate different tokens."
    )


def _refusal(runner, failure, capacity: int) -> str:
    who = f"{runner.role} ({type(runner.model).__name__})"
    when = _when(runner, capacity)
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


def tree_refusal(runner) -> str | None:
    """Why this model cannot verify token trees, or None if it can. Checked once per runner
    by a tree-shaped probe (:func:`specfx.model.probe.tree_logits`; its finding is kept in
    ``runner.tree_failure``): tree nodes sit in slots that are not their positions, which a
    model deriving positions or biases from slot indices gets wrong (MPT's ALiBi) though it
    decodes chains exactly."""
    if runner.protocol == "rowwise_2d":
        return (
            f"{runner.role} ({type(runner.model).__name__}) needs a 2-D padding mask (specfx drives it "
            f"row by row, letting transformers build its causal mask), so its attention cannot be "
            f"given a token tree's mask; use a chain (num_speculative_tokens=K, no tree=)."
        )
    if getattr(runner, "stateful", False):
        return (
            f"{runner.role} ({type(runner.model).__name__}) keeps recurrent or linear-attention state, which "
            f"specfx rolls back along a chain only (a token tree would need one state per branch); use a "
            f"chain (num_speculative_tokens=K, no tree=)."
        )
    if any(getattr(runner, "compress_rates", ())):  # decision 97 (the tree probe fails on it too)
        return (
            f"{runner.role} ({type(runner.model).__name__}) pools windows of consecutive KV slots into compressed "
            f"entries (DeepSeek-V4's compressors), and a token tree's nodes sit in slots that are not their "
            f"positions, so a window would pool tokens of different branches; use a chain "
            f"(num_speculative_tokens=K, no tree=)."
        )
    if runner.tree_failure is None:
        runner.tree_failure = _probe_tree(runner) or ""
    if runner.tree_failure:
        return (
            f"{runner.role} ({type(runner.model).__name__}) does not verify a token tree like its own full "
            f"forward ({runner.tree_failure}): tree nodes sit in KV slots that are not their positions, and "
            f"this model derives positions or attention biases from slot indices (ALiBi built from the "
            f"cache, as MPT's). specfx cannot verify trees on it exactly; use a chain "
            f"(num_speculative_tokens=K, no tree=)."
        )
    return None


def _probe_tree(runner) -> str | None:
    """None if a tree verification reproduces the full forward, else what differs (or the
    exception raised). Skipped in training mode, like the incremental probe. The runner's own
    buffers are left as they were."""
    if runner.model.training:
        return None
    seq = probe_tokens(min(runner.probe_length, 16), runner.vocab_size, runner.device)
    try:
        with torch.no_grad():
            full = full_logits(runner.model, seq)
            with runner.scratch_cache(1, probe_capacity(seq.numel())):
                got = tree_logits(runner, seq)
    except Exception as e:  # reported by the caller, which names the model
        return f"{type(e).__name__}: {e}"
    n = seq.numel()
    return compare_rows(got, full[n - 3 :], runner.dtype)


def taps_refusal(runner) -> str | None:
    """Why drafters cannot read this model's hidden states, or None if they can."""
    if runner.protocol == "rowwise_2d":
        return (
            f"{runner.role} ({type(runner.model).__name__}) needs a 2-D padding mask (specfx drives it "
            f"row by row), so its hidden states cannot be tapped in one forward; drafters that "
            f"read the target's hidden states (MTP, Medusa, EAGLE) cannot serve it."
        )
    return None


def hc_streams(model) -> int:
    """How many hyper-connection streams ``model``'s decoder layers carry (``config.hc_mult``; 1: none)."""
    return getattr(model.config.get_text_config(), "hc_mult", None) or 1


def streams_refusal(runner, taps) -> str | None:
    """Why a head reading one ``[B, T, H]`` state per token (EAGLE-3, DFlash) cannot read the hidden
    states ``taps`` of this model, or None if it can: between its decoder layers a model with
    hyper-connections (``hc_mult`` streams: DeepSeek-V4, HY-V4) carries ``[B, T, hc_mult, H]``; only
    ``"final"`` (after the model's own stream mixing and final norm) is one state per token. (DeepSeek-V4's
    own MTP layers read the streams by design: :mod:`specfx.drafters.mtp_v4`.)"""
    streams = hc_streams(runner.model)
    inner = [t for t in dict.fromkeys(taps) if t != "final"]
    if streams <= 1 or not inner:
        return None
    return (
        f"{runner.role} ({type(runner.model).__name__}) carries {streams} hyper-connection streams between its "
        f"decoder layers (config.hc_mult): its hidden states at {', '.join(map(repr, inner))} are [batch, tokens, "
        f"{streams}, hidden], not one hidden state per token, so a drafter reading them (EAGLE-3, DFlash) has no "
        f"defined input there and none is trained for it; Medusa heads (reading the final hidden state), the "
        f"model's own MTP layers where it ships them (draft='mtp'), prompt lookup, early exit or a draft model can "
        f"serve it."
    )
