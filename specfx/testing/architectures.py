"""Running the architecture table's models: the checks behind :mod:`specfx.model.architectures`.

The table itself is data and pure queries (model layer); what needs a tiny model of each type or
``speculate()`` lives here (a tool beside the library, which may import every layer):

- :func:`tiny_decodes_incrementally`: the predicate ``supported()`` asks for ``if_causal`` rows;
- :func:`sweep`: greedy equality with ``model.generate()`` for every causal LM type transformers
  ships, in eager mode: ``python -m specfx.testing.architectures --sweep [TYPES...]``
  (``python -m specfx.model.architectures`` prints the table).
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import specfx
from specfx.model.architectures import ARCHITECTURES, ArchSpec, decodes_incrementally
from specfx.model.architectures import supported as _supported
from specfx.testing.tiny import perturbed_copy, tiny_causal_lm, tiny_config

__all__ = ["supported_here", "sweep", "tiny_decodes_incrementally"]


@functools.cache
def tiny_decodes_incrementally(name: str) -> bool:
    """Whether the installed implementation of model type ``name`` decodes incrementally, read
    off its tiny model (:func:`specfx.model.architectures.decodes_incrementally`)."""
    return decodes_incrementally(tiny_causal_lm(name, **ARCHITECTURES[name].overrides))


def supported_here() -> list[str]:
    """The table's supported types for the installed transformers, ``if_causal`` rows checked
    on their tiny model (what ``supported()`` returned before it took the predicate)."""
    return _supported(tiny_decodes_incrementally)


def sweep(model_types=None, max_new_tokens: int = 40) -> list[tuple[str, str]]:
    """Check model types (default: every causal LM type transformers ships) in eager mode:
    greedy equality with ``model.generate()`` at batch 1 and for a left-padded batch, with a
    perturbed copy as draft. Returns ``(model_type, result)`` rows."""
    rows = []
    for mt in model_types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        spec = ARCHITECTURES.get(mt, ArchSpec("unknown"))
        try:
            cfg = tiny_config(mt, **spec.overrides)
            with torch.device("meta"):
                n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
            if n > 30e6:
                rows.append((mt, f"skipped: tiny config still has {n / 1e6:.0f}M parameters"))
                continue
            target = tiny_causal_lm(mt, **spec.overrides)
            spec_gen = specfx.speculate(
                target, draft=perturbed_copy(target, 0.03), num_speculative_tokens=3, compile=False
            )
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, 128, (3, 10), generator=g)
            mask = torch.ones_like(ids)
            mask[0, :4] = 0
            mask[1, :2] = 0
            ids = ids.masked_fill(mask == 0, 0)
            results = []
            for x, m in ((ids[2:], None), (ids, mask)):
                kw = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=m)
                same = torch.equal(spec_gen.generate(x, **kw), target.generate(x, **kw))
                results.append("equal" if same else "DIFFERENT")
            rows.append((mt, f"batch 1 {results[0]}, padded batch {results[1]}"))
        except Exception as e:  # a sweep reports every failure and goes on
            rows.append((mt, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="check every causal LM type transformers ships")
    parser.add_argument("types", nargs="*", help="model types to check (default: all)")
    args = parser.parse_args()
    if not (args.sweep or args.types):
        parser.error("give --sweep or model types (python -m specfx.model.architectures prints the table)")
    for mt, result in sweep(args.types or None):
        print(f"{mt:28s} {ARCHITECTURES.get(mt, ArchSpec('not in table')).status:12s} {result}", flush=True)
