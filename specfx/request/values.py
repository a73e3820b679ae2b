"""Scalar ``generate()`` arguments checked and normalised as transformers treats them.

HF accepts a number wherever it compares or converts one (``max_new_tokens=10.5``, a NumPy
int, a one-element tensor, ``eos_token_id=66.0``); where it would fail with a raw Python or
torch error, or where a value means nothing (NaN lengths, a fractional token id), these raise
a ``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "as_length",
    "as_min_length",
    "as_number",
    "as_scalar",
    "as_token_id",
    "as_token_ids",
    "check_logits_to_keep",
]


def as_scalar(name: str, value):
    """A one-element tensor or NumPy scalar as a Python number (HF accepts both)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"generate(): {name} must be a single number, got a tensor of shape {tuple(value.shape)}.")
        return value.item()
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # NumPy scalars
        return value.item()
    return value


def as_number(name: str, value) -> float | int:
    value = as_scalar(name, value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"generate(): {name} must be a number, got {type(value).__name__} {value!r}.")
    return value


def as_length(name: str, value) -> float | int | None:
    """A length bound (max_new_tokens, max_length). HF stops once the length reaches the bound,
    so a fractional bound counts up (10.5 new tokens -> 11), which the caller reproduces with
    ceil; NaN/inf bound nothing (HF then runs into the position limit) and are refused."""
    if value is None:
        return None
    value = as_number(name, value)
    if not math.isfinite(value):
        raise ValueError(f"generate(): {name} must be a finite number of tokens, got {value}. Pass an int.")
    return value


def as_min_length(name: str, value) -> int | None:
    """min_new_tokens / min_length: HF's MinLength processors accept only ints."""
    if value is None:
        return None
    value = as_scalar(name, value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        raise ValueError(f"generate(): {name} must be a non-negative integer, got {value}.")
    raise TypeError(f"generate(): {name} must be an int, got {type(value).__name__} {value!r}.")


def as_token_id(name: str, value) -> int:
    """One token id. Whole floats are accepted as HF accepts them (it converts with
    torch.tensor(..., dtype=long)); a fractional or non-finite id names no token."""
    value = as_number(name, value)
    if not (math.isfinite(value) and value == int(value)):
        raise ValueError(f"generate(): {name} must hold whole token ids, got {value}.")
    return int(value)


def as_token_ids(name: str, value) -> tuple[int, ...]:
    """An int, a list of ints or a tensor of ids, as a tuple (empty for None)."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        return tuple(as_token_id(name, v) for v in value)
    return (as_token_id(name, value),)


def check_logits_to_keep(value) -> None:
    """``logits_to_keep`` is a forward argument HF's generate() passes through. Any int >= 0
    keeps the last position's logits, the only ones generate() reads, so it cannot change
    the output and specfx (which computes only the logits it needs) accepts and ignores it. A
    tensor selects positions, which would change the tokens: refused."""
    if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0):
        return
    raise ValueError(
        f"generate(): logits_to_keep={value!r} is not supported: specfx computes only the logits "
        f"generation needs; an int >= 0 is accepted (it cannot change the output), a tensor of "
        f"positions is not. Leave logits_to_keep unset."
    )
