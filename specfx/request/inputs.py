"""The prompt of a ``generate()`` call: ``input_ids`` and ``attention_mask`` checked and, where
HF infers the mask from the ids, inferred by HF's rule."""

from __future__ import annotations

import torch

__all__ = ["check_ids", "check_mask", "infer_attention_mask"]


def check_ids(input_ids, model) -> torch.Tensor:
    """input_ids as ``[B, S]`` int64 on the model's device."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"generate(): input_ids must be a torch.LongTensor of shape [batch, length], got "
            f"{type(input_ids).__name__}. Use tokenizer(..., return_tensors='pt')."
        )
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(
            f"generate(): input_ids must hold integer token ids, got dtype {input_ids.dtype}. "
            f"Convert with input_ids.long()."
        )
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(f"generate(): input_ids must be [batch, length], got shape {tuple(input_ids.shape)}.")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"generate(): the prompt is empty (shape {tuple(input_ids.shape)}); give at least one token "
            f"per row (e.g. the BOS token)."
        )
    return input_ids.to(device=model.device, dtype=torch.long)


def infer_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: tuple[int, ...]) -> torch.Tensor:
    """The mask HF's generate() builds when none is given (``_prepare_attention_mask_for_generation``).

    ``input_ids [B, S]`` -> ``[B, S]`` int64: ``input_ids != pad`` when the pad id is set, occurs
    in the prompt and is not one of the EOS ids (negative ones included); all ones otherwise.
    ``pad`` is the resolved one (HF's ``_pad_token_tensor``: ``pad_token_id``, else the first
    EOS id), so with no explicit pad token nothing is inferred.
    """
    ones = torch.ones_like(input_ids)
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return ones
    return (input_ids != pad).long()


def check_mask(input_ids, attention_mask, vocab_size: int, inferred_from: int | None) -> torch.Tensor:
    """Validate a left-padded ``attention_mask [B, S]`` of 0/1 (given, or inferred from pad id
    ``inferred_from``) and the real tokens under it; returns ``prompt_lengths [B]``."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate(): attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got "
            f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}."
        )
    mask = attention_mask.to(device=input_ids.device)
    # before any integer conversion: 0.9 would truncate to 0 (HF keeps it as a fractional weight)
    other = (mask != 0) & (mask != 1)
    if other.any():
        raise ValueError(
            f"generate(): attention_mask must hold only 0 and 1 (padding / real token), got "
            f"{mask[other][0].item():g}. Pass the tokenizer's mask, or (mask > 0.5).long() if yours is soft."
        )
    mask = mask.long()
    origin = ""
    if inferred_from is not None:  # the user never wrote this mask: say where it came from
        origin = (
            f" (no attention_mask was given, so as transformers does it was inferred from "
            f"pad_token_id={inferred_from}: every {inferred_from} in the prompt counts as padding; pass "
            f"attention_mask= explicitly, or a pad_token_id the prompt does not use)"
        )
    lengths = mask.sum(dim=1)
    # left padding: once a row's real tokens start they run to the end
    cols = torch.arange(input_ids.shape[1], device=mask.device).unsqueeze(0)
    if not torch.equal(mask.bool(), cols >= (input_ids.shape[1] - lengths).unsqueeze(1)):
        raise ValueError(
            "generate(): specfx needs left-padded prompts (padding first, then the real tokens), as "
            f"transformers recommends for decoder-only models: tokenizer.padding_side = 'left'{origin}."
        )
    if (lengths == 0).any():
        raise ValueError(f"generate(): a row of the prompt has no real tokens (attention_mask all 0){origin}.")
    ids_real = input_ids[mask.bool()]
    if int(ids_real.min()) < 0 or int(ids_real.max()) >= vocab_size:
        bad = ids_real[(ids_real < 0) | (ids_real >= vocab_size)][0].item()
        raise ValueError(
            f"generate(): token id {bad} is outside the model's vocabulary [0, {vocab_size}). "
            f"Were these ids made by a different tokenizer?"
        )
    return lengths
