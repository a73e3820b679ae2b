"""``generate()`` arguments resolved exactly as transformers resolves them, then checked.

Priority (HF's): explicit kwargs / ``generation_config`` > ``model.generation_config`` > HF's
global defaults. Anything specfx cannot honour raises, naming the argument; nothing is
silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .sampling import SamplingParams

__all__ = ["GenerateRequest", "resolve_generate_args"]

# Arguments of generate() that are not GenerationConfig fields and that specfx handles.
_CALL_ARGS = ("attention_mask", "streamer", "stopping_criteria", "generation_config")
# generate() arguments that select features specfx does not offer; None / empty means unused.
_UNSUPPORTED_CALL_ARGS = {
    "logits_processor": "custom logits processors cannot be fused into the compiled round",
    "prefix_allowed_tokens_fn": "constrained decoding is not supported",
    "assistant_model": "specfx is itself the speculative decoder: pass draft= to speculate()",
    "assistant_tokenizer": "universal assisted decoding is not supported",
    "tokenizer": "stop_strings are not supported",
    "negative_prompt_ids": "classifier-free guidance is not supported",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported",
    "inputs_embeds": "pass input_ids: the round drafts and verifies token ids",
    "past_key_values": "specfx owns the cache (static per-row buffers)",
    "synced_gpus": "multi-GPU synced generation is not supported",
    "custom_generate": "custom generation loops are not supported",
}
# GenerationConfig fields and the value that means "off" (what specfx requires).
_OFF = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "sequence_bias": None,
    "guidance_scale": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "watermarking_config": None,
    "min_p": None,
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
    "stop_strings": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "dola_layers": None,
    "use_cache": True,
    "cache_implementation": None,
}


@dataclass
class GenerateRequest:
    """A validated generate() call."""

    input_ids: torch.Tensor  # [B, S] int64, on the model's device
    prompt_lengths: torch.Tensor  # [B] int64 (real tokens; the prompt is left-padded)
    max_new_tokens: int
    sampling: SamplingParams
    pad_token_id: int | None
    streamer: Any
    stopping_criteria: Any
    return_dict_in_generate: bool
    max_time: float | None


def _check_off(gc) -> None:
    for name, off in _OFF.items():
        value = getattr(gc, name, off)
        if value in (None, off) or (name == "min_p" and value == 0):
            continue
        if name == "num_beams" and value is None:
            continue
        raise ValueError(
            f"generate(): {name}={value!r} is not supported by specfx speculative decoding "
            f"(supported: greedy and sampling with temperature, top_k, top_p, repetition_penalty, "
            f"min_length/min_new_tokens, eos_token_id). Leave {name} at {off!r}, or use the "
            f"wrapped model's own generate() for this."
        )


def _as_id_list(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def resolve_generate_args(model, vocab_size: int, max_positions: int | None, inputs, kwargs: dict) -> GenerateRequest:
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", None)
    if inputs is not None and input_ids is not None:
        raise ValueError("generate(): pass the prompt once, either positionally or as input_ids=, not both.")
    input_ids = inputs if inputs is not None else input_ids
    for name, why in _UNSUPPORTED_CALL_ARGS.items():
        value = kwargs.pop(name, None)
        if value is not None and not (name == "logits_processor" and len(value) == 0) and value is not False:
            raise ValueError(f"generate(): {name} is not supported: {why}.")
    call = {name: kwargs.pop(name, None) for name in _CALL_ARGS}
    if input_ids is None:
        raise ValueError("generate(): input_ids is required (a [batch, length] LongTensor of token ids).")
    input_ids, prompt_lengths = _check_prompt(input_ids, call["attention_mask"], vocab_size, model)

    gc_given = call["generation_config"]
    user_max_length = kwargs.get("max_length") is not None
    has_default_max_length = (
        not user_max_length
        and (gc_given is None or gc_given.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (gc_given is None or gc_given.min_length is None)
        and model.generation_config.min_length is None
    )
    try:
        gc, leftover = model._prepare_generation_config(gc_given, **kwargs)
    except TypeError as e:  # pragma: no cover - depends on HF internals
        raise TypeError(f"generate(): {e}") from e
    if leftover:
        raise TypeError(
            f"generate() got unexpected or unsupported argument(s) {sorted(leftover)}. specfx accepts "
            f"HF's generation arguments (GenerationConfig fields) plus {list(_CALL_ARGS)}."
        )
    gc.validate()
    _check_off(gc)

    seq_len = input_ids.shape[1]
    if gc.max_new_tokens is not None:
        max_length = gc.max_new_tokens + seq_len
    elif has_default_max_length:
        max_length = gc.max_length + seq_len
        if max_positions is not None:
            max_length = min(max_length, max_positions)
    else:
        max_length = gc.max_length
    max_new = max_length - seq_len
    if max_new <= 0:
        raise ValueError(
            f"generate(): nothing to generate: the prompt is {seq_len} tokens and max_length is "
            f"{max_length}. Raise max_length, or pass max_new_tokens= instead."
        )
    min_length = 0 if has_default_min_length and gc.min_new_tokens is None else (gc.min_length or 0)
    if gc.min_new_tokens is not None:
        min_length = gc.min_new_tokens + seq_len
    if max_positions is not None and max_length > max_positions:
        raise ValueError(
            f"generate(): prompt ({seq_len}) + new tokens ({max_new}) = {max_length} exceeds the "
            f"model's max_position_embeddings={max_positions}. Shorten the prompt or lower max_new_tokens."
        )

    eos = _as_id_list(gc.eos_token_id)
    for t in eos:
        if not 0 <= t < vocab_size:
            raise ValueError(f"generate(): eos_token_id {t} is outside the vocabulary [0, {vocab_size}).")
    pad = gc.pad_token_id
    if pad is None and eos:
        pad = eos[0]
    if isinstance(pad, torch.Tensor):
        pad = int(pad.flatten()[0])

    do_sample = bool(gc.do_sample)
    temperature = 1.0 if gc.temperature is None else float(gc.temperature)
    top_k = int(gc.top_k or 0)
    top_p = 1.0 if gc.top_p is None else float(gc.top_p)
    penalty = 1.0 if gc.repetition_penalty is None else float(gc.repetition_penalty)
    if do_sample:
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(
                f"generate(): temperature must be a finite number > 0 when sampling, got {gc.temperature}. "
                f"For greedy decoding pass do_sample=False."
            )
        if top_k < 0:
            raise ValueError(f"generate(): top_k must be >= 0 (0 disables it), got {top_k}.")
        if not 0 < top_p <= 1:
            raise ValueError(f"generate(): top_p must be in (0, 1], got {top_p}.")
    if not penalty > 0:
        raise ValueError(f"generate(): repetition_penalty must be > 0, got {penalty}.")

    if call["stopping_criteria"] and input_ids.shape[0] > 1 and not eos:
        raise ValueError(
            "generate(): stopping_criteria with batch size > 1 need an eos_token_id: without one, "
            "transformers keeps generating rows the criteria finished (it has no pad to freeze them), "
            "which specfx does not reproduce. Pass eos_token_id=, or generate row by row."
        )
    streamer = call["streamer"]
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("generate(): a streamer needs batch size 1 (as in transformers).")
    sampling = SamplingParams(
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=penalty,
        min_new_tokens=max(0, min_length - seq_len),
        eos_token_ids=eos,
    )
    return GenerateRequest(
        input_ids=input_ids,
        prompt_lengths=prompt_lengths,
        max_new_tokens=max_new,
        sampling=sampling,
        pad_token_id=pad,
        streamer=streamer,
        stopping_criteria=call["stopping_criteria"],
        return_dict_in_generate=bool(gc.return_dict_in_generate),
        max_time=gc.max_time,
    )


def _check_prompt(input_ids, attention_mask, vocab_size: int, model):
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
    input_ids = input_ids.to(device=model.device, dtype=torch.long)
    if attention_mask is None:
        mask = torch.ones_like(input_ids)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"generate(): attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got "
                f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}."
            )
        mask = attention_mask.to(device=model.device).long()
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("generate(): attention_mask must hold only 0 and 1.")
    lengths = mask.sum(dim=1)
    # left padding: once a row's real tokens start they run to the end
    expected = torch.arange(input_ids.shape[1], device=mask.device).unsqueeze(0) >= (input_ids.shape[1] - lengths).unsqueeze(1)
    if not torch.equal(mask.bool(), expected):
        raise ValueError(
            "generate(): specfx needs left-padded prompts (padding first, then the real tokens), as "
            "transformers recommends for decoder-only models: tokenizer.padding_side = 'left'."
        )
    if (lengths == 0).any():
        raise ValueError("generate(): a row of the prompt has no real tokens (attention_mask all 0).")
    real = mask.bool()
    ids_real = input_ids[real]
    if ids_real.numel() and (int(ids_real.min()) < 0 or int(ids_real.max()) >= vocab_size):
        bad = ids_real[(ids_real < 0) | (ids_real >= vocab_size)][0].item()
        raise ValueError(
            f"generate(): token id {bad} is outside the model's vocabulary [0, {vocab_size}). "
            f"Were these ids made by a different tokenizer?"
        )
    return input_ids, lengths
