"""The stopping criteria of a ``generate()`` call that run on the host, merged as HF merges them.

specfx stops on the device at ``max_length`` and at EOS; everything else a user's
``stopping_criteria=`` or ``stop_strings=`` asks for is called on the host, one HF step at a
time, by :class:`specfx.engine.step_replay.StepReplay`.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)

__all__ = ["stopping_criteria"]


def stopping_criteria(given, max_length: int, eos: tuple[int, ...], gc, tokenizer) -> StoppingCriteriaList | None:
    """The criteria HF's generate() calls besides those specfx runs on the device (max length,
    EOS): the user's, and HF's ``StopStringCriteria`` for ``stop_strings``, in the order HF's
    merge calls them (its own first, where a user's one of the same class replaces it).

    HF also replaces its max-length or EOS criterion with a user's one of the same class; where
    that would make it generate past ``max_length`` or through an EOS id, which specfx stops
    at, it is refused."""
    items = [] if not given else list(given) if isinstance(given, (list, tuple)) else [given]
    for c in items:
        if type(c) is MaxLengthCriteria and c.max_length > max_length:
            raise ValueError(
                f"generate(): stopping_criteria holds MaxLengthCriteria(max_length={c.max_length}), which "
                f"transformers uses instead of its own max_length={max_length}, generating past it; specfx "
                f"sizes its buffers by max_length. Pass max_length={c.max_length} (or max_new_tokens) instead."
            )
        if type(c) is EosTokenCriteria and eos and not set(eos) <= set(torch.as_tensor(c.eos_token_id).flatten().tolist()):
            raise ValueError(
                f"generate(): stopping_criteria holds an EosTokenCriteria without every eos_token_id {list(eos)}; "
                f"transformers uses it instead of its own, and would not stop on the others, which specfx stops "
                f"on. Pass those ids as eos_token_id= instead."
            )
    # HF's own criteria in its order: a class where specfx stops on the device instead
    own: list = [MaxLengthCriteria] + ([MaxTimeCriteria] if gc.max_time is not None else [])
    if gc.stop_strings is not None:
        if tokenizer is None:  # HF's own error
            raise ValueError(
                "generate(): there are one or more stop strings, either in the arguments to `generate` or in the "
                "model's generation config, but no tokenizer. When generating with stop strings, you must pass "
                "the model's tokenizer to the `tokenizer` argument of `generate`."
            )
        own.append(StopStringCriteria(stop_strings=gc.stop_strings, tokenizer=tokenizer))
    own += [EosTokenCriteria] if gc.eos_token_id is not None else []
    ordered = []
    for default in own:  # a user's criterion of the same class takes its place, as in HF's merge
        kind = default if isinstance(default, type) else type(default)
        user = next((c for c in items if type(c) is kind), None)
        if user is not None or not isinstance(default, type):
            ordered.append(default if user is None else user)
    ordered += [c for c in items if c not in ordered]
    return StoppingCriteriaList(ordered) if ordered else None
