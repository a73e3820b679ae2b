"""The reduced-precision rule: how specfx's greedy output may differ from HF's in bf16/fp16.

In float32 specfx's greedy output equals ``model.generate()`` exactly. In bfloat16 and float16
the two compute the same logits with different kernels (a K+1-token verification forward and a
static cache versus HF's one-token steps), so rounding differs and an argmax may flip where the
top candidates are within rounding of each other. The rule, checked by
:func:`check_greedy_agreement` and tested in ``tests/unit/testing/test_precision.py``:

    Rows agree token for token up to their first difference, if any. At that position the
    model's own logits (a plain forward over the agreed prefix, upcast to float32) rank both
    candidates, specfx's token and HF's, within ``tolerance`` of the best logit, where
    ``tolerance = NEAR_TIE_ULPS * eps(dtype) * max(1, |best logit|)``; or, in a mixture of
    experts, a router of that forward has a near-tie at its top-k boundary (the k-th and
    (k+1)-th expert scores within the same tolerance, scaled by the top score) at the
    predicting position: rounding then picks other experts there, and the logits may differ
    by far more than rounding (seen on Mixtral in bfloat16, compiled: a router gap of 0.03 at
    the predicting position, a logit gap of 2.8). Only the predicting position counts: over
    a whole prefix some router is nearly always that close somewhere, which would excuse
    any divergence.

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
    router_gap: float | None = None  # smallest top-k boundary gap of any router (MoE only)
    router_tolerance: float | None = None

    @property
    def near_tie(self) -> bool:
        if self.router_gap is not None and self.router_gap <= self.router_tolerance:
            return True
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
        top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
        if top_k:
            kwargs["output_router_logits"] = True
        output = model(input_ids=prefix, use_cache=False, **kwargs)
        logits = output.logits[0, -1].float()
        a, b = int(candidate[row, index]), int(reference[row, index])
        best = float(logits.max())
        gap = best - min(float(logits[a]), float(logits[b]))
        d = Divergence(row, index, (a, b), gap, NEAR_TIE_ULPS * eps * max(1.0, abs(best)))
        routers = getattr(output, "router_logits", None) if top_k else None
        if routers:
            d.router_gap, d.router_tolerance = _router_near_tie(routers, top_k, eps)
        out.append(d)
    return out


def _router_near_tie(router_logits, top_k: int, eps: float) -> tuple[float, float]:
    """At the last (predicting) position: the gap between the k-th and (k+1)-th expert score
    of the router closest to a tie, and the tolerance there (relative to its top score)."""
    best_gap, best_tol = float("inf"), 0.0
    for scores in router_logits:
        scores = scores.float().reshape(-1, scores.shape[-1])
        if scores.shape[-1] <= top_k:
            continue
        top = scores[-1].sort(descending=True).values  # one row: the tokens of the prefix, in order
        gap = float(top[top_k - 1] - top[top_k])
        tol = NEAR_TIE_ULPS * eps * max(1.0, float(top.abs().max()))
        if gap - tol < best_gap - best_tol:
            best_gap, best_tol = gap, tol
    return best_gap, best_tol
