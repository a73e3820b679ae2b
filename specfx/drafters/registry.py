"""The drafter registry: what ``speculate(draft=...)`` accepts, and which drafter it picks when
none is given.

:data:`NAMED_DRAFTERS` maps a name (``draft="name"`` / ``"name:arg"``) to a factory;
:data:`DEFAULT_DRAFTERS` lists, in order, the drafters tried when no ``draft=`` is given, each
with an availability check. Both tables are declarative: their modules are imported when a name
is resolved, never registered by importing them. :func:`resolve_drafter` turns ``draft=`` into a
:class:`~specfx.drafters.base.Drafter` (a causal LM becomes a
:class:`~specfx.drafters.draft_model.DraftModel`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from specfx.drafters.base import Drafter
from specfx.drafters.draft_model import DraftModel

__all__ = ["DEFAULT_DRAFTERS", "NAMED_DRAFTERS", "resolve_drafter"]


# name -> factory(argument or None) -> Drafter, for ``draft="name"`` or ``draft="name:arg"``.
# A factory is a callable or a ``"module:attribute"`` reference, imported when the name is
# resolved: the table is the one place drafters are declared, and no module has to be
# imported first (or register itself as a side effect of being imported).
NAMED_DRAFTERS: dict[str, str | Callable[[str | None], Drafter]] = {
    "prompt_lookup": "specfx.drafters.prompt_lookup:from_name",
    "lookahead": "specfx.drafters.lookahead:from_name",
    "early_exit": "specfx.drafters.early_exit:from_name",
    "mtp": "specfx.drafters.mtp:from_name",
    "pard": "specfx.drafters.pard:from_name",  # draft="pard:DIR" (a PARD checkpoint)
    "medusa": "specfx.drafters.heads.medusa:from_name",  # draft="medusa:DIR"
    "eagle": "specfx.drafters.heads.eagle:from_name",  # draft="eagle:DIR" (EAGLE-1/2)
    "eagle3": "specfx.drafters.heads.eagle3:from_name",  # draft="eagle3:DIR"
    "dflash": "specfx.drafters.heads.dflash:from_name",  # draft="dflash:DIR"
}


def _always(model) -> bool:
    return True


# What ``speculate(model)`` uses without ``draft=``: the first ``(name, available(model))``
# whose check passes, built as ``NAMED_DRAFTERS[name](None)``; a check is a callable or a
# ``"module:attribute"`` reference. Methods that need model parts (MTP heads) come first;
# prompt lookup needs nothing from the model, so it is the fallback.
DEFAULT_DRAFTERS: list[tuple[str, str | Callable[[object], bool]]] = [
    ("mtp", "specfx.drafters.mtp:has_mtp"),
    ("prompt_lookup", _always),
]


def _load(ref):
    """A callable from the tables above: itself, or ``"module:attribute"`` imported now."""
    if callable(ref):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _looks_like_a_path(draft: str) -> bool:
    # a hub id ("org/name") or a file-system path; no drafter name has a slash
    return "/" in draft or os.sep in draft or os.path.exists(draft)


def _named(draft: str) -> Drafter:
    name, _, arg = draft.partition(":")
    if name not in NAMED_DRAFTERS:
        known = ", ".join(repr(n) for n in sorted(NAMED_DRAFTERS)) or "none"
        if _looks_like_a_path(draft):
            raise ValueError(
                f"draft={draft!r} looks like a path or a Hugging Face hub id, but draft= takes a model "
                f"object, not where to load one from: load the draft model first, e.g. "
                f"draft=AutoModelForCausalLM.from_pretrained({draft!r}) (a smaller causal LM sharing the "
                f"target's vocabulary). A Medusa or EAGLE head directory is named with its kind: "
                f"draft='medusa:{draft}', 'eagle:{draft}' or 'eagle3:{draft}'. Named drafters: {known}."
            )
        raise ValueError(
            f"unknown drafter {draft!r}. Named drafters: {known} (an argument follows a colon, "
            f"e.g. 'prompt_lookup:3'); or pass a draft model (a causal LM sharing the target's "
            f"vocabulary; a model name is not loaded for you: draft=AutoModelForCausalLM.from_pretrained(name)) "
            f"or a specfx Drafter instance."
        )
    return _load(NAMED_DRAFTERS[name])(arg or None)


def resolve_drafter(draft, model) -> Drafter:
    """Turn ``speculate()``'s ``draft=`` into a :class:`Drafter` (not yet bound).

    ``draft`` is a Drafter (used as is), a name from :data:`NAMED_DRAFTERS` (``"name"`` or
    ``"name:arg"``), a causal LM (wrapped in :class:`DraftModel`), or None: the first entry of
    :data:`DEFAULT_DRAFTERS` available for ``model`` (the target).
    """
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str):
        return _named(draft)
    if draft is None:
        for name, available in DEFAULT_DRAFTERS:
            if _load(available)(model):
                return _named(name)
        raise ValueError(
            "speculate(): no default drafter is available for this model; pass draft=, a smaller "
            "causal LM sharing the target's vocabulary, or a drafter name."
        )
    return DraftModel(draft)
