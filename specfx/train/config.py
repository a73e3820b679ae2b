"""The options of a ``specfx train`` run: :class:`TrainConfig` (every flag, stored as
``OUT/config.json``) and its checks, and which options a ``--resume`` may change."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfx.drafters.heads.medusa import LAYOUTS as MEDUSA_LAYOUTS
from specfx.train.heads import HEADS

__all__ = ["FREE", "LAYER_SIZES", "TrainConfig"]


@dataclass
class TrainConfig:
    """Everything that determines a run (``OUT/config.json``)."""

    target: str
    head: str
    data: list[str]
    out: str
    init: str | None = None
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 10
    seed: int = 0
    heldout_permille: int = 50
    assistant_only_loss: bool = False
    eval_batches: int = 2
    ckpt_every: int = 50
    medusa_heads: int = 4
    medusa_layers: int = 1
    medusa_layout: str = "vllm"
    draft_vocab_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    ttt_steps: int = 3
    feature_noise: float = 0.1
    draft_layers: int = 2
    draft_hidden: int = 128
    pard_k: int = 8
    pard_token: int | None = None
    pard_cod_ratio: float = 0.7
    pard_cod_min: float = 0.2
    pard_distill: float = 0.0
    dflash_block: int = 16
    dflash_token: int | None = None
    dflash_anchors: int = 512
    dflash_gamma: float | None = None
    dflash_taps: list[int] | None = None
    dflash_distill: float = 0.0
    eval_prompts: int = 4
    eval_prompt_len: int = 64
    eval_new_tokens: int = 48
    eval_ks: list[int] = field(default_factory=lambda: [2, 4, 8])
    cache_features: bool = False
    stop_after: int | None = None
    device: str = "cpu"
    bf16: bool = False

    def autocast(self) -> torch.autocast:
        """``--bf16``: the head's forward (and so its backward) under bfloat16 autocast; the weights,
        the optimizer and the target's features stay float32. Off: a context that changes nothing."""
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.bf16)

    def check(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"--head {self.head!r}: choose one of {', '.join(HEADS)}.")
        for name in ("steps", "batch_size", "ckpt_every", "medusa_heads", "ttt_steps", "eval_batches", "draft_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if self.medusa_layout not in MEDUSA_LAYOUTS:
            raise ValueError(
                f"--medusa-layout {self.medusa_layout!r}: choose {' or '.join(MEDUSA_LAYOUTS)} (docs/HEADS.md: vllm for "
                f"vLLM, medusa for FasterDecoding's Medusa)."
            )
        if self.pard_k < 1:
            raise ValueError(f"--pard-k must be >= 1, got {self.pard_k}.")
        if not 0 < self.pard_cod_ratio <= 1 or not 0 <= self.pard_cod_min <= 1:
            raise ValueError(
                f"--pard-cod-ratio must be in (0, 1] and --pard-cod-min in [0, 1], got {self.pard_cod_ratio} and "
                f"{self.pard_cod_min}."
            )
        for name in ("pard_distill", "dflash_distill"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}.")
        if self.head == "pard" and self.seq_len < self.pard_k + 2:
            raise ValueError(f"--head pard: --seq-len must be >= --pard-k + 2, got {self.seq_len}.")
        if self.dflash_block < 2 or self.dflash_anchors < 1:
            raise ValueError(
                f"--dflash-block must be >= 2 and --dflash-anchors >= 1, got {self.dflash_block} and {self.dflash_anchors}."
            )
        if self.dflash_gamma is not None and not self.dflash_gamma > 0:
            raise ValueError(f"--dflash-gamma must be > 0 (or absent: no decay), got {self.dflash_gamma}.")
        if self.head == "dflash" and self.seq_len < self.dflash_block + 1:
            raise ValueError(f"--head dflash: --seq-len must be >= --dflash-block + 1, got {self.seq_len}.")
        if self.seq_len < 4:
            raise ValueError(f"--seq-len must be >= 4, got {self.seq_len}.")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}.")
        if not 0 <= self.feature_noise < float("inf"):
            raise ValueError(f"--feature-noise must be a finite number >= 0, got {self.feature_noise}.")
        if not 0 < self.heldout_permille < 1000:
            raise ValueError(f"--heldout-permille must be in 1..999, got {self.heldout_permille}.")
        sizes = [n for n in LAYER_SIZES if getattr(self, n) is not None]
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if sizes and self.head != "eagle3":
            raise ValueError(
                f"--{sizes[0].replace('_', '-')} sizes an EAGLE-3 head's decoder layer; --head {self.head} has no "
                f"such option (--head draft: --draft-hidden / --draft-layers)."
            )
        if (sizes or self.draft_vocab_size is not None) and self.init is not None:
            name = (sizes or ["draft_vocab_size"])[0].replace("_", "-")
            raise ValueError(
                f"--{name} sizes a head trained from scratch, but --init {self.init!r} brings its own sizes; "
                f"drop one of them."
            )


# The EAGLE-3 decoder layer's sizes (default: the target's).
LAYER_SIZES = ("intermediate_size", "num_attention_heads", "num_key_value_heads")

# Options a --resume may change: evaluation, checkpointing, the device and precision, and --steps (extending
# a run; the learning-rate schedule then follows the new value: stop early with --stop-after instead).
FREE = (
    "steps",
    "stop_after",
    "ckpt_every",
    "device",
    "bf16",
    "eval_batches",
    "eval_prompts",
    "eval_prompt_len",
    "eval_new_tokens",
    "eval_ks",
    "medusa_layout",
)
