"""A recorded mixer call, cut by input position (decisions 76 and 90): the calls
:class:`~specfx.model.recurrent.MixerTaps` records are ``(args, kwargs)`` whose time-indexed
tensors are ``[B, T, ...]`` (the 2-D padding mask ``[B, T]`` included); a replay or a step calls
the same module on a prefix or on one position of them."""

from __future__ import annotations

import torch

__all__ = [
    "cat_steps",
    "column",
    "column_kw",
    "columns",
    "conv_state_after",
    "layer_state",
    "prefix",
    "prefix_kw",
    "step_kw",
    "width",
]


def columns(recorded: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict, int]]:
    """(args, kwargs, column) of every input position of the recorded forwards, in order; a
    forward's width is its first time-indexed tensor's (``[B, T, ...]``), a static shape."""
    out = []
    for args, kwargs in recorded:
        out.extend((args, kwargs, t) for t in range(width(args, kwargs)))
    return out


def _cut(x, sl):
    return x[:, sl] if isinstance(x, torch.Tensor) and x.dim() >= 2 else x


def prefix(args, length):
    """A recorded call's positional arguments for its first ``length`` input positions."""
    return tuple(_cut(a, slice(0, length)) for a in args)


def prefix_kw(kwargs, length, cache):
    """Its keyword arguments for them, through ``cache`` (a replay's), without a padding mask."""
    out = {k: _cut(v, slice(0, length)) for k, v in kwargs.items()}
    for name in ("cache", "cache_params", "past_key_values"):
        if name in out:
            out[name] = cache
    out["attention_mask"] = None  # a verify forward has no padding
    return out


def width(args, kwargs) -> int:
    """The number of input positions of a mixer call (its first ``[B, T, ...]`` tensor's T)."""
    return next(v.shape[1] for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 2)


def step_kw(kwargs, t):
    """A recorded call's keyword arguments for its input position ``t`` alone (the cache and
    every other argument as recorded; a 2-D padding mask sliced like the inputs)."""
    return {k: _cut(v, slice(t, t + 1)) for k, v in kwargs.items()}


def cat_steps(outs: list):
    """One forward's output from its single-position calls' (a tensor ``[B, 1, ...]`` each, or a
    tuple whose ``[B, 1, ...]`` tensors are joined and other entries taken from the last call)."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=1)
    return type(outs[0])(
        torch.cat(parts, dim=1) if isinstance(parts[-1], torch.Tensor) and parts[-1].dim() >= 2 else parts[-1]
        for parts in zip(*outs, strict=True)
    )


def column(args, t):
    """A recorded call's positional arguments for its input position ``t`` alone."""
    return tuple(_cut(a, slice(t, t + 1)) for a in args)


def column_kw(kwargs, t, cache):
    """Its keyword arguments for position ``t``, through ``cache``, without a padding mask (a replay's)."""
    return prefix_kw(step_kw(kwargs, t), 1, cache)


def layer_state(layer, copy: bool = True) -> list[tuple[dict, int, torch.Tensor]]:
    """(owner dict, state_idx, tensor) of every conv and recurrent tensor of one stateful cache
    layer, in a fixed order; the tensors cloned unless ``copy`` is False."""
    return [
        (states, idx, t.clone() if copy else t)
        for states in (layer.conv_states, layer.recurrent_states)
        for idx, t in states.items()
        if t is not None
    ]


def conv_state_after(old: torch.Tensor, new: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The conv state after the first ``n[b] + 1`` of the T new input columns, per row.

    old ``[B, C, k]`` (state before the forward), new ``[B, C, T]`` (the inputs the model handed
    ``update_conv_state``), n ``[B]`` in 0..T-1 -> ``[B, C, k]``: columns n+1 .. n+k of
    ``cat(old, new)``, a gather with fixed shapes (no host sync)."""
    k = old.shape[-1]
    full = torch.cat([old, new.to(old.dtype)], dim=-1)  # [B, C, k + T]
    cols = n.view(-1, 1) + 1 + torch.arange(k, device=n.device)  # [B, k]
    return full.gather(-1, cols.unsqueeze(1).expand(-1, full.shape[1], -1))
