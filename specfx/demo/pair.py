"""The shipped demo pair: a small Llama-style target and a much smaller draft trained by
:mod:`specfx.train.pair` on the Python standard library's source (see
``specfx/demo/demo_pair/MODEL_CARD.md``), and code prompts cut from held-out files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["DEMO_PAIR_DIR", "DEMO_DRAFTERS", "load_demo_pair", "demo_drafter", "demo_prompts"]

DEMO_PAIR_DIR = Path(__file__).parent / "demo_pair"
# The shipped drafters for the demo target: the draft model, and heads trained by ``specfx train``
# on the same stdlib training split (``demo_pair/heads/<name>``, public layouts; MODEL_CARD.md "Heads").
DEMO_DRAFTERS = ("draft", "eagle3", "eagle", "medusa")


def _check_shipped() -> None:
    for role in ("target", "draft"):
        if not (DEMO_PAIR_DIR / role / "config.json").exists():
            raise FileNotFoundError(
                f"the demo pair is missing: {DEMO_PAIR_DIR / role} has no config.json. It ships inside the "
                f"specfx package; reinstall specfx, or train one with `python -m specfx.train.pair`."
            )


def load_demo_pair(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load the shipped pair: ``(target, draft, tokenizer)``, both models in eval mode.

    The shipped weights are stored in **float16** (half the size); this returns them cast to
    ``dtype``, **float32 by default**: the precision in which specfx's greedy output is
    exactly HF's. (A plain ``AutoModelForCausalLM.from_pretrained(path)`` of the same
    directory gives float16 models, where greedy output may differ at near-ties.)
    """
    from specfx.model.load import load_causal_lm, load_tokenizer

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}.")
    _check_shipped()
    target, draft = (load_causal_lm(DEMO_PAIR_DIR / role, dtype, device) for role in ("target", "draft"))
    return target, draft, load_tokenizer(DEMO_PAIR_DIR / "target")


def demo_drafter(name: str, draft_model=None):
    """A shipped drafter for the demo target, ready for ``specfx.speculate(target, draft=...)``:
    ``"draft"`` returns ``draft_model`` (the pair's draft, from :func:`load_demo_pair`);
    ``"eagle3"``, ``"eagle"``, ``"medusa"`` load a fresh ``specfx.Eagle3`` / ``Eagle`` /
    ``Medusa`` from ``demo_pair/heads/<name>`` (a drafter binds to one generator, so load one
    per ``speculate()`` call)."""
    if name not in DEMO_DRAFTERS:
        raise ValueError(f"unknown demo drafter {name!r}: choose one of {', '.join(DEMO_DRAFTERS)}.")
    if name == "draft":
        if draft_model is None:
            raise ValueError('demo_drafter("draft") needs the draft model from load_demo_pair().')
        return draft_model
    from specfx.drafters.heads.eagle import Eagle
    from specfx.drafters.heads.eagle3 import Eagle3
    from specfx.drafters.heads.medusa import Medusa

    path = DEMO_PAIR_DIR / "heads" / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the shipped {name} head is missing: {path} has no config.json (reinstall specfx).")
    return {"eagle3": Eagle3, "eagle": Eagle, "medusa": Medusa}[name](path)


def demo_prompts() -> list[dict]:
    """Code prompts cut from held-out stdlib files (never seen in training): a list of
    ``{"file": relpath, "text": prompt}``, in a fixed order."""
    _check_shipped()
    return json.loads((DEMO_PAIR_DIR / "prompts.json").read_text())
