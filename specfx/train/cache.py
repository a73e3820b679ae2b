"""``specfx train --cache-features``: the target's features computed once and read back from
disk (safetensors shards) on every later visit, for runs of several epochs over a corpus.

The training stream is cut into ``W`` non-overlapping windows of ``--seq-len`` tokens; step
``s`` trains on ``--batch`` of them drawn from a generator seeded with ``(seed, s)`` (so a
resumed run sees the same batches). Before training, the frozen target runs once over every
window and each shard of :data:`SHARD` windows is written to ``OUT/features/`` with the token
ids, the head's taps and the target's final hidden state; ``meta.json`` there records what the
shards hold, and a rerun (or ``--resume``) whose windows and taps match reuses them.

The target's logits (``[T, V]`` per window, too large to store for real vocabularies) are
recomputed from the cached final hidden state through the target's own LM head. That is exact
only for models whose logits are their LM head applied to that state: the cache checks it on
the first batch and refuses models that scale or soft-cap in between (run those without
``--cache-features``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["FeatureCache", "SHARD"]

SHARD = 64  # windows per shard file


def _key(tap: str) -> str:
    return "tap." + tap.replace(":", "_")


class FeatureCache:
    """Windows of ``stream`` with the target's features, on disk under ``root``."""

    def __init__(self, root: Path, runner, stream: np.ndarray, length: int, batch: int, seed: int, taps, target_pass):
        self.root, self.runner, self.batch, self.seed = root, runner, batch, seed
        self.taps = tuple(taps)
        self.stored = self.taps if "final" in self.taps else (*self.taps, "final")
        count = len(stream) // length
        self.windows = np.asarray(stream[: count * length], dtype=np.int64).reshape(count, length)
        digest = hashlib.sha256(self.windows.tobytes()).hexdigest()
        self.meta = {
            "windows": count,
            "seq_len": length,
            "taps": list(self.stored),
            "shard": SHARD,
            "tokens_sha256": digest,
        }
        self._target_pass = target_pass
        self._files: dict[int, object] = {}

    def build(self, progress=None) -> bool:
        """Compute and write every shard unless a matching cache exists; True if it did."""
        meta_path = self.root / "meta.json"
        if meta_path.exists() and json.loads(meta_path.read_text()) == self.meta:
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path.unlink(missing_ok=True)
        count, checked = len(self.windows), False
        for start in range(0, count, SHARD):
            rows = self.windows[start : start + SHARD]
            parts: dict[str, list[torch.Tensor]] = {_key(t): [] for t in self.stored}
            for b in range(0, len(rows), self.batch):
                chunk = rows[b : b + self.batch]
                n = len(chunk)
                if n < self.batch:  # keep the one captured shape: pad with the last window
                    chunk = np.concatenate([chunk, np.repeat(chunk[-1:], self.batch - n, axis=0)])
                logits, features = self._target_pass(self.runner, torch.from_numpy(chunk), self.stored)
                if not checked:
                    self._check_logits(logits, features[self.stored.index("final")])
                    checked = True
                for tap, f in zip(self.stored, features, strict=True):
                    parts[_key(tap)].append(f[:n].cpu())
                if progress is not None:
                    progress(n)
            tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()}
            tensors["ids"] = torch.from_numpy(rows.copy())
            save_file(tensors, str(self.root / f"shard_{start // SHARD:05d}.safetensors"))
        meta_path.write_text(json.dumps(self.meta))
        return True

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.runner.model.get_output_embeddings()(final)

    def _check_logits(self, logits: torch.Tensor, final: torch.Tensor) -> None:
        again = self.logits(final)
        scale = float(logits.abs().max()) or 1.0
        if not torch.allclose(again.float(), logits.float(), rtol=1e-3, atol=1e-3 * scale):
            name = type(self.runner.model).__name__
            raise ValueError(
                f"--cache-features: {name}'s logits are not its LM head applied to its final hidden state "
                f"(it scales or soft-caps them), so they cannot be recomputed from cached features; "
                f"run without --cache-features."
            )

    def _file(self, shard: int):
        if shard not in self._files:
            self._files[shard] = safe_open(str(self.root / f"shard_{shard:05d}.safetensors"), "pt")
        return self._files[shard]

    def picks(self, step: int) -> list[int]:
        """The windows step ``step`` reads (indices into ``self.windows``)."""
        return np.random.default_rng([self.seed, step]).integers(0, len(self.windows), size=self.batch).tolist()

    def mask_at(self, step: int, mask: np.ndarray) -> torch.Tensor:
        """Step ``step``'s rows ``[B, T]`` of ``mask``, an array beside the cached stream (the
        label masks of ``--assistant-only-loss``)."""
        rows = np.asarray(mask[: self.windows.size]).reshape(self.windows.shape)[self.picks(step)]
        return torch.from_numpy(rows.astype(np.int64)).to(self.runner.device)

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Step ``step``'s ``(ids [B, T], logits [B, T, V], features)`` from the cache."""
        picks = self.picks(step)
        device = self.runner.device
        got: dict[str, list[torch.Tensor]] = {k: [] for k in ["ids", *map(_key, self.stored)]}
        for w in picks:
            f = self._file(w // SHARD)
            for k in got:
                got[k].append(f.get_slice(k)[w % SHARD])
        ids = torch.stack(got["ids"]).to(device)
        stored = {t: torch.stack(got[_key(t)]).to(device) for t in self.stored}
        return ids, self.logits(stored["final"]), tuple(stored[t] for t in self.taps)
