"""Explicit 4-D attention masks built from per-row positions.

Every query at position ``p`` sees exactly the buffer slots ``0..p`` of its own row: slot ==
position for real tokens, stale slots beyond ``p`` (rejected proposals, padding garbage) and
the trash slot stay hidden. HF models return a 4-D mask untouched (``masking_utils``), so this
is the hook through which specfx controls attention; the format each attention
implementation expects is declared in :data:`MASK_FORMATS`.
"""

from __future__ import annotations

import torch

__all__ = ["MASK_FORMATS", "build_mask", "check_attn_implementation"]

# attention implementation -> mask format it expects when handed a 4-D tensor.
MASK_FORMATS = {
    "sdpa": "bool",  # True = attend
    "eager": "additive",  # 0 = attend, dtype-min = hidden
}


def check_attn_implementation(model) -> str:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASK_FORMATS:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={impl!r}, which specfx cannot drive "
            f"with an explicit per-row 4-D mask yet. Load the model with one of "
            f"{sorted(MASK_FORMATS)} (e.g. from_pretrained(..., attn_implementation='sdpa'))."
        )
    return impl


def build_mask(positions: torch.Tensor, capacity: int, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """``positions [B, T]`` -> mask ``[B, 1, T, capacity]`` where slot j is visible iff j <= p."""
    slots = torch.arange(capacity, device=positions.device)
    visible = slots.view(1, 1, 1, capacity) <= positions.unsqueeze(1).unsqueeze(-1)
    if fmt == "bool":
        return visible
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)
