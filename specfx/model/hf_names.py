"""What differs between the transformers releases specfx supports, resolved in one place.

Read by capability (what the installed release does), never by version number.

The cache's name.
transformers 5.24 renamed the cache argument of every forward (models, decoder layers,
attention modules, MTP layers) from ``past_key_values`` to ``cache``, keeping the old name as a
deprecated alias until 5.40, and the output classes' field (``GenerateDecoderOnlyOutput``,
``CausalLMOutputWithPast``) with it. specfx supports releases on both sides, so it never writes
either name by hand: it asks the callable it is about to call (:func:`cache_kwarg`) and the
output class it is about to build (:func:`output_cache_field`), by capability, not by version.
A model loaded with ``trust_remote_code`` may still use the old name on a new transformers;
asking its own forward covers that too.

The repetition penalty and left padding (:func:`penalty_counts_left_padding`).

Where a checkpoint's MTP weights are (:func:`mtp_weights_regex`).
``MtpModel.get_mtp_weights_regex`` arrived in transformers 5.20; before, ``MtpModel.from_pretrained``
built the same pattern inline from the model's ``_keys_to_ignore_on_load_unexpected``, which is
what specfx does where the method is missing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable

__all__ = [
    "CACHE_KWARGS",
    "cache_kwarg",
    "mtp_weights_regex",
    "output_cache",
    "output_cache_field",
    "penalty_counts_left_padding",
]

# The names a forward may give its cache argument, newest first.
CACHE_KWARGS = ("cache", "past_key_values")


def cache_kwarg(fn: Callable) -> str | None:
    """The keyword ``fn`` takes its KV cache under: ``"cache"`` (transformers >= 5.24) or
    ``"past_key_values"`` (earlier releases, remote code); None if it takes neither.

    ``fn`` is a forward (``model.forward``, ``layer.forward``) or a module (its ``forward`` is
    read). Decorated forwards (``@deprecate_kwarg``) are unwrapped by ``inspect.signature``.
    """
    if not inspect.isfunction(fn) and not inspect.ismethod(fn) and hasattr(fn, "forward"):
        fn = fn.forward
    return _cache_kwarg_of(getattr(fn, "__func__", fn))


@functools.lru_cache(maxsize=1024)
def _cache_kwarg_of(fn: Callable) -> str | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_KWARGS if name in params), None)


def output_cache_field(output_class: type | None = None) -> str:
    """The field an HF output class (default ``GenerateDecoderOnlyOutput``) holds the cache in:
    ``"cache"`` on transformers >= 5.24, ``"past_key_values"`` before."""
    if output_class is None:
        from transformers.generation.utils import GenerateDecoderOnlyOutput as output_class
    names = {f.name for f in dataclasses.fields(output_class)}
    return next(name for name in CACHE_KWARGS if name in names)


def output_cache(output):
    """The cache an HF output object carries, under whichever name its class uses (reading the
    deprecated ``past_key_values`` property of a new output would log a deprecation warning)."""
    return getattr(output, output_cache_field(type(output)))


_PENALTY_COUNTS_PADDING: bool | None = None  # read once; a plain global so compiled code reads a constant


def penalty_counts_left_padding() -> bool:
    """Whether HF's ``generate()`` counts a left-padded row's padding tokens as seen for the
    repetition penalty: up to transformers 5.22 it penalises every id in ``input_ids``, padding
    included; from 5.23 on ``generate()`` passes each row's padding length as
    ``prompt_ignore_length`` and the processor skips it (the processor learned per-row lengths in
    the same change, which is what this checks: two rows, different lengths). Called once eagerly
    (``speculate()``) before any graph that reads it is traced."""
    global _PENALTY_COUNTS_PADDING
    if _PENALTY_COUNTS_PADDING is None:
        _PENALTY_COUNTS_PADDING = _probe_penalty()
    return _PENALTY_COUNTS_PADDING


def _probe_penalty() -> bool:
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    try:
        processor = RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([1, 0]))
        scores = processor(torch.tensor([[3, 4], [3, 4]]), torch.ones(2, 5))
    except (TypeError, ValueError, RuntimeError):  # a release whose processor takes one int for every row
        return True
    return not (scores[0, 3] == 1 and scores[1, 3] != 1)


def mtp_weights_regex(mtp_model: type, model) -> re.Pattern:
    """The pattern ``mtp_model.from_pretrained(model)`` selects MTP weights from the checkpoint
    with; a ValueError when ``model``'s class registers none (transformers cannot load its MTP
    layers). ``mtp_model`` is transformers' ``MtpModel``: its ``get_mtp_weights_regex`` where the
    release has one (5.20 on), else the pattern its ``from_pretrained`` built inline (5.17 to
    5.19): the model's ``_keys_to_ignore_on_load_unexpected``, less those naming a layer number
    below the decoder's layer count (a smaller checkpoint's MTP layers inside a bigger one's)."""
    get = getattr(mtp_model, "get_mtp_weights_regex", None)
    if get is not None:
        return get(model)
    num_hidden_layers = model.config.get_text_config().num_hidden_layers
    patterns = []
    for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ():
        layer = re.search(r"\.(\d+)", pattern)
        if layer is None or int(layer.group(1)) >= num_hidden_layers:
            patterns.append(pattern)
    if not patterns:
        raise ValueError(f"{type(model).__name__} does not seem to register any known MTP layer patterns")
    return re.compile("|".join(f"({pattern})" for pattern in patterns))
