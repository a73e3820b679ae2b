"""Drafters: whatever proposes the tokens of a round.

* :mod:`~specfx.drafters.base`: the :class:`Drafter` interface and the capability mixins
  (:class:`TreeDrafting`, :class:`DynamicTreeDrafting`, :class:`Branching`); its docstring says
  where to add a drafter.
* :mod:`~specfx.drafters.registry`: ``draft="name"`` and the default drafter
  (:func:`resolve_drafter`, ``NAMED_DRAFTERS``, ``DEFAULT_DRAFTERS``).
* :mod:`~specfx.drafters.drafting`: the chain loop and stash every model-running drafter shares.
* One module per drafter: :mod:`~specfx.drafters.draft_model`, :mod:`~specfx.drafters.prompt_lookup`,
  :mod:`~specfx.drafters.lookahead`, :mod:`~specfx.drafters.early_exit`, :mod:`~specfx.drafters.mtp`, :mod:`~specfx.drafters.pard`;
  heads over the target's hidden states (Medusa, EAGLE, EAGLE-3) and their checkpoint layouts in
  :mod:`specfx.drafters.heads`.

The drafter classes are exported here but imported on first access: importing this package (or
the registry) imports no drafter module, so the registry's tables stay the one place drafters
are declared (a module is imported when its name is resolved).
"""

from __future__ import annotations

import importlib

from specfx.drafters.base import Branching, Drafter, DynamicTreeDrafting, TreeDrafting, branch_slots, shape_refusal
from specfx.drafters.draft_model import DraftModel
from specfx.drafters.registry import DEFAULT_DRAFTERS, NAMED_DRAFTERS, resolve_drafter

__all__ = [
    # the interface and capabilities
    "Drafter",
    "TreeDrafting",
    "DynamicTreeDrafting",
    "Branching",
    "branch_slots",
    "shape_refusal",
    # the registry
    "resolve_drafter",
    "NAMED_DRAFTERS",
    "DEFAULT_DRAFTERS",
    # the drafters
    "DraftModel",
    "PromptLookup",
    "Lookahead",
    "EarlyExit",
    "MTP",
    "Pard",
    "Medusa",
    "Eagle",
    "Eagle3",
    "DFlash",
]

# class -> its module, imported on first access (PEP 562)
_LAZY = {
    "PromptLookup": "specfx.drafters.prompt_lookup",
    "Lookahead": "specfx.drafters.lookahead",
    "EarlyExit": "specfx.drafters.early_exit",
    "MTP": "specfx.drafters.mtp",
    "Pard": "specfx.drafters.pard",
    "Medusa": "specfx.drafters.heads.medusa",
    "Eagle": "specfx.drafters.heads.eagle",
    "Eagle3": "specfx.drafters.heads.eagle3",
    "DFlash": "specfx.drafters.heads.dflash",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
