"""Small helpers every compiled piece of specfx shares (one home for each)."""

from __future__ import annotations

import types
import weakref

import torch

__all__ = ["back_reference", "fresh_code", "mark_static", "release_code"]


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


def back_reference(ref: weakref.ref, what: str):
    """What ``ref`` points to: an owner that a part it owns reads (a cache layer its cache, a
    capture its runner, a mixer hook its recorder). A strong reference back would be a cycle, and a
    cycle keeps every buffer of a freed generator alive until Python's cyclic collector happens to
    run (decision 93). Dynamo traces this dereference exactly on torch 2.11 and 2.13 (a property
    setter is not: torch 2.11's graph reads the value from before the set)."""
    owner = ref()
    if owner is None:
        raise RuntimeError(f"specfx: this {what} outlived its owner; keep the owner alive while using it.")
    return owner
