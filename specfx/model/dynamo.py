"""Small helpers every compiled piece of specfx shares (one home for each)."""

from __future__ import annotations

import types

import torch

__all__ = ["fresh_code", "mark_static", "release_code"]


def fresh_code(fn):
    """A copy of the function ``fn`` with its own code object.

    Dynamo keeps compiled graphs, guards and the recompile budget per code object, so a copy
    gives each user (a generator's graph variant, one early-exit capture) a private cache that
    never counts against another's recompile limit. Dynamo never frees a compiled code
    object's cache by itself: call :func:`release_code` when the copy is no longer used.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def release_code(*codes) -> None:
    """Drop Dynamo's cache entries (compiled graphs, guards) of these private code objects, and
    only theirs (``torch._dynamo.reset()`` would reset the whole process)."""
    for code in codes:
        torch._dynamo.reset_code(code)


def mark_static(*tensors: torch.Tensor) -> None:
    """Mark long-lived buffers (KV caches, round state, drafter stashes) as static inputs.

    On CUDA, Inductor's CUDA graphs then keep in-place writes to them instead of copying them
    in and out on every replay. No guard on the address (``guard=False``): a reallocated buffer
    of the same shape reuses the compiled graph rather than recompiling it. A no-op on CPU.
    """
    for t in tensors:
        if t.is_cuda:
            torch._dynamo.mark_static_address(t, guard=False)
