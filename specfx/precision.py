"""The reduced-precision rule: how specfx's greedy output may differ from HF's in bf16/fp16.

In float32 specfx's greedy output equals ``model.generate()`` exactly. In bfloat16 and float16
the two compute the same logits with different kernels (a K+1-token verification forward and a
static cache versus HF's one-token steps), so rounding differs and an argmax may flip where the
top candidates are within rounding of each other. The rule, checked by
:func:`check_greedy_agreement` and tested in ``tests/test_precision.py``:

    Rows agree token for token up to their first difference, if any. At that position the
    model's own logits (a plain forward over the agreed prefix, upcast to float32) rank both
    candidates, specfx's token and HF's, within ``tolerance`` of the best logit, where
    ``tolerance = NEAR_TIE_ULPS * eps(dtype) * max(1, |best logit|)``.

After the first difference the sequences are different generations; nothing is claimed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NEAR_TIE_ULPS", "Divergence", "check_greedy_agreement", "first_divergence"]

NEAR_TIE_ULPS = 8


@dataclass
class Divergence:
    """Where a row first differs and how close the two candidates were."""

    row: int
    index: int  # column in the sequences
    tokens: tuple[int, int]  # (candidate's token, reference's token)
    gap: float  # best logit minus the lower of the two candidates' logits
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.tolerance


def first_divergence(candidate: torch.Tensor, reference: torch.Tensor) -> list[int | None]:
    """Per row, the first column where two ``[B, S]`` sequences differ (None if equal)."""
    if candidate.shape != reference.shape:
        width = min(candidate.shape[1], reference.shape[1])
        candidate, reference = candidate[:, :width], reference[:, :width]
    diff = (candidate != reference).cpu()
    return [int(d.nonzero()[0]) if d.any() else None for d in diff]


@torch.no_grad()
def check_greedy_agreement(model, candidate, reference, attention_mask=None) -> list[Divergence]:
    """Divergences of ``candidate`` from ``reference`` (both ``[B, S]`` greedy outputs of
    ``model`` including the prompt); each one's ``near_tie`` says whether the rule holds."""
    eps = torch.finfo(model.dtype).eps
    out = []
    for row, index in enumerate(first_divergence(candidate, reference)):
        if index is None:
            continue
        prefix = reference[row : row + 1, :index].to(model.device)
        kwargs = {}
        if attention_mask is not None:
            mask = attention_mask[row : row + 1].to(model.device)
            mask = torch.cat([mask, mask.new_ones(1, index - mask.shape[1])], dim=1)[:, :index]
            kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        logits = model(input_ids=prefix, use_cache=False, **kwargs).logits[0, -1].float()
        a, b = int(candidate[row, index]), int(reference[row, index])
        best = float(logits.max())
        gap = best - min(float(logits[a]), float(logits[b]))
        out.append(Divergence(row, index, (a, b), gap, NEAR_TIE_ULPS * eps * max(1.0, abs(best))))
    return out
