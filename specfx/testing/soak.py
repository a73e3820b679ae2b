"""The call mix of the soak test (tests/soak/test_soak.py) and of ``benchmarks/soak_compiles.py``:
the sampling modes, the (batch, mode) classes and the request builders, so that the test and the
measurement of its compiles serve the same workload."""

from __future__ import annotations

import random

import torch

__all__ = ["CLASSES", "MODES", "REPLAYS", "growing_request", "soak_request"]

MODES = {
    "greedy": {},
    "greedy_penalty": dict(repetition_penalty=1.3, min_new_tokens=3),
    "sample": dict(do_sample=True, temperature=0.8),
    "top_k": dict(do_sample=True, top_k=20),
    "top_p": dict(do_sample=True, top_p=0.9, repetition_penalty=1.2),
}
CLASSES = [(b, m) for b in (1, 2, 3) for m in MODES]
REPLAYS = 48  # after the first pass over CLASSES


def growing_request():
    """The first request: 100 + 156 tokens, so the buffers grow to 512 slots (100 + 156 + K + 2
    > 256) before any graph compiles (``ids, attention_mask, max_new_tokens``)."""
    return torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(5)), None, 156


def soak_request(batch: int, rng: random.Random):
    """A ragged left-padded batch ``(ids, attention_mask, max_new_tokens)``: each row 1..60 real
    tokens, 1..40 new tokens."""
    lengths = [rng.randint(1, 60) for _ in range(batch)]
    width = max(lengths)
    ids = torch.randint(3, 128, (batch, width), generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
    mask = (torch.arange(width) >= (width - torch.tensor(lengths)).unsqueeze(1)).long()
    return ids * mask, mask, rng.randint(1, 40)
