"""The counter-based random stream and sampling from it.

Uniforms are a pure function of (seed, counter, stream, index): identical in eager and compiled
mode and on every device, with no generator object in the graph, so a seed reproduces a whole
generation. Graph-friendly: no host sync, fixed shapes.
"""

from __future__ import annotations

import torch

__all__ = ["sample_from", "uniform"]

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 holding values in [0, 2**32); multipliers < 2**31 keep
    every product inside int64, so it is exact on every backend."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): a pure function of (seed, counter, stream, index).

    Identical in eager and compiled mode and on every device, needs no generator object in
    the graph, and a seed reproduces a whole generation.
    """
    numel = 1
    for s in shape:
        numel *= s
    key = _mix32((seed & _MASK32) ^ _mix32((counter & _MASK32) ^ _mix32(torch.full_like(seed, stream))))
    idx = torch.arange(numel, device=seed.device, dtype=torch.long).view(shape)
    h = _mix32(_mix32(idx ^ key) ^ ((seed >> 32) & _MASK32))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_from(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index ∝ ``weights`` (unnormalised, >= 0) along the last dim: the exponential race
    argmax(w / E), E = -log(u) ~ Exp(1). Exact, and no host sync."""
    return torch.argmax(weights / (-torch.log(u)), dim=-1)
