"""``generate()`` arguments resolved exactly as transformers resolves them, then checked.

Priority (HF's): explicit kwargs / ``generation_config`` > ``model.generation_config`` > HF's
global defaults. Anything specfx cannot honour raises, naming the argument; nothing is
silently ignored.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from specfx.model.architectures import ARCHITECTURES
from specfx.request.criteria import stopping_criteria
from specfx.request.inputs import check_ids, check_mask, infer_attention_mask
from specfx.request.values import (
    as_length,
    as_min_length,
    as_number,
    as_scalar,
    as_token_id,
    as_token_ids,
    check_logits_to_keep,
)
from specfx.sampling.processors import SamplingParams

__all__ = ["GenerateRequest", "resolve_generate_args"]

logger = logging.getLogger(__name__)

# Arguments of generate() that are not GenerationConfig fields and that specfx handles.
_CALL_ARGS = ("attention_mask", "streamer", "stopping_criteria", "generation_config", "tokenizer")
# generate() arguments that select features specfx does not offer; None / empty means unused.
_UNSUPPORTED_CALL_ARGS = {
    "logits_processor": "custom logits processors cannot be fused into the compiled round",
    "prefix_allowed_tokens_fn": "constrained decoding is not supported",
    "assistant_model": "specfx is itself the speculative decoder: pass draft= to speculate()",
    "assistant_tokenizer": "universal assisted decoding is not supported",
    "negative_prompt_ids": "classifier-free guidance is not supported",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported",
    "inputs_embeds": "pass input_ids: the round drafts and verifies token ids",
    "cache": "specfx owns the cache (static per-row buffers)",
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
    "token_healing": False,
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
    pads_finished: bool  # HF extends finished rows with the pad (it has an EOS criterion)
    streamer: Any
    stopping_criteria: StoppingCriteriaList | None  # the user's, called once per step (step_replay)
    return_dict_in_generate: bool
    max_time: float | None
    output_scores: bool = False  # HF's scores: processed logits per step
    output_logits: bool = False  # HF's logits: raw logits per step


# Warpers HF builds only when sampling (``_get_logits_processor``): greedy ignores them, so a
# checkpoint's generation_config.json that sets them does not stop a greedy call.
_SAMPLING_ONLY = ("min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
# Forward outputs HF collects only into a returned dict: computed and dropped otherwise.
_FORWARD_OUTPUTS = {"output_attentions": "attention weights", "output_hidden_states": "hidden states"}


def _is_off(name: str, value, off) -> bool:
    """Whether ``value`` of GenerationConfig field ``name`` changes nothing HF generates."""
    if value is None or (not isinstance(value, (list, tuple)) and value == off):
        return True
    if name in ("suppress_tokens", "begin_suppress_tokens"):
        return len(value) == 0  # HF's processor over an empty list suppresses nothing
    if name == "cache_implementation":
        return value == "dynamic"  # HF's default cache, named: the tokens are the same
    return name == "min_p" and value == 0


def _check_off(gc) -> None:
    for name, off in _OFF.items():
        if name in _SAMPLING_ONLY and not gc.do_sample:
            continue
        if name == "num_return_sequences" and gc.do_sample:
            continue  # a batch of repeated prompts (see resolve_generate_args); HF refuses it when greedy
        value = getattr(gc, name, off)
        if _is_off(name, value, off):
            continue
        raise ValueError(
            f"generate(): {name}={value!r} is not supported by specfx speculative decoding "
            f"(supported: greedy and sampling with temperature, top_k, top_p, repetition_penalty, "
            f"min_length/min_new_tokens, eos_token_id). Leave {name} at {off!r}, or use the "
            f"wrapped model's own generate() for this."
        )


def _check_generation_config(value) -> None:
    if value is not None and not isinstance(value, GenerationConfig):
        raise TypeError(
            f"generate(): generation_config must be a transformers.GenerationConfig, got "
            f"{type(value).__name__}. Build one with GenerationConfig(**fields), or pass the fields "
            f"as keyword arguments to generate()."
        )


def _as_seconds(name: str, value) -> float:
    value = float(as_number(name, value))
    if math.isnan(value):
        raise ValueError(f"generate(): {name} must be a number of seconds, got nan.")
    return value


# Numeric GenerationConfig fields and their checks (each returns the normalised value).
_NUMBER_CHECKS = {
    "max_new_tokens": as_length,
    "max_length": as_length,
    "min_new_tokens": as_min_length,
    "min_length": as_min_length,
    "max_time": _as_seconds,
    "repetition_penalty": as_number,
    "eos_token_id": as_token_ids,
    "pad_token_id": as_token_id,
}


def _check_numbers(values) -> dict:
    """Check the numeric fields set in ``values`` (generate()'s kwargs, or a resolved config):
    HF's own config handling fails on a string with a raw TypeError, so this runs before it
    (on the kwargs) and after it (on fields that came from a GenerationConfig object).
    Returns the normalised values of the fields that are set."""
    get = values.get if isinstance(values, dict) else lambda name: getattr(values, name, None)
    return {name: check(name, get(name)) for name, check in _NUMBER_CHECKS.items() if get(name) is not None}


# --------------------------------------------------------------------------- resolution
def resolve_generate_args(model, vocab_size: int, max_positions: int | None, inputs, kwargs: dict) -> GenerateRequest:
    """generate()'s ``inputs``/``kwargs`` resolved in HF's order: the prompt's ids, then the
    generation config (kwargs > ``generation_config`` > the model's), then the attention mask
    (given, or inferred from the resolved pad and EOS ids as HF infers it), lengths and sampling."""
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", None)
    if inputs is not None and input_ids is not None:
        raise ValueError("generate(): pass the prompt once, either positionally or as input_ids=, not both.")
    input_ids = inputs if inputs is not None else input_ids
    for name, why in _UNSUPPORTED_CALL_ARGS.items():
        value = kwargs.pop(name, None)
        if value is not None and not (name == "logits_processor" and len(value) == 0) and value is not False:
            raise ValueError(f"generate(): {name} is not supported: {why}.")
    check_logits_to_keep(kwargs.pop("logits_to_keep", None))
    call = {name: kwargs.pop(name, None) for name in _CALL_ARGS}
    if input_ids is None:
        raise ValueError("generate(): input_ids is required (a [batch, length] LongTensor of token ids).")
    input_ids = check_ids(input_ids, model)
    gc_given = call["generation_config"]
    _check_generation_config(gc_given)

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
    _check_numbers(kwargs)
    try:
        gc, leftover = model._prepare_generation_config(gc_given, **kwargs)
    except TypeError as e:  # pragma: no cover - depends on HF internals
        raise TypeError(f"generate(): {e}") from e
    for name, what in _FORWARD_OUTPUTS.items():
        leftover.pop(name, None)  # HF's resolution also hands them on as forward kwargs
        if getattr(gc, name, False) and gc.return_dict_in_generate:
            raise ValueError(
                f"generate(): {name}=True is not supported: specfx does not return the target's per-step "
                f"{what} (its compiled rounds compute only tokens and logits). Leave {name} unset, or use "
                f"the wrapped model's own generate() for them."
            )
    if leftover:
        raise TypeError(
            f"generate() got unexpected or unsupported argument(s) {sorted(leftover)}. specfx accepts "
            f"HF's generation arguments (GenerationConfig fields) plus {list(_CALL_ARGS)}."
        )
    checked = _check_numbers(gc)
    eos_all, pad = checked.pop("eos_token_id", ()), checked.pop("pad_token_id", None)
    for name, value in checked.items():  # normalised (e.g. a one-element tensor -> int) on HF's copy
        setattr(gc, name, value)
    gc.validate()
    _check_off(gc)

    # HF's pad defaults to the first EOS id, even a negative one (it then fills finished rows with it)
    pad = eos_all[0] if pad is None and eos_all else pad
    mask = call["attention_mask"]
    inferred = mask is None
    if inferred:
        mask = infer_attention_mask(input_ids, pad, eos_all)
    prompt_lengths = check_mask(input_ids, mask, vocab_size, pad if inferred else None)
    _check_padding(model, prompt_lengths)
    if gc.do_sample and (gc.num_return_sequences or 1) > 1:
        # HF's _expand_inputs_for_generation: each prompt num_return_sequences times in a row
        input_ids = input_ids.repeat_interleave(gc.num_return_sequences, dim=0)
        prompt_lengths = prompt_lengths.repeat_interleave(gc.num_return_sequences, dim=0)

    seq_len = input_ids.shape[1]
    max_new, min_new = _new_token_bounds(gc, seq_len, max_positions, has_default_max_length, has_default_min_length)
    eos = _check_eos(eos_all, vocab_size)
    do_sample = bool(gc.do_sample)
    sampling = SamplingParams(
        do_sample=do_sample, **_sampling_values(gc, do_sample), min_new_tokens=min_new, eos_token_ids=eos
    )

    criteria = stopping_criteria(call["stopping_criteria"], seq_len + max_new, eos, gc, call["tokenizer"])
    # HF's has_eos_stopping_criteria: finished rows are then extended with the pad token
    pads_finished = bool(eos_all) or any(hasattr(c, "eos_token_id") for c in criteria or ())
    if pads_finished and pad is None:
        raise ValueError(
            "generate(): a stopping criterion has an eos_token_id, so transformers extends finished rows "
            "with pad_token_id, and none is set (transformers fails here too). Pass pad_token_id=."
        )
    return GenerateRequest(
        input_ids=input_ids,
        prompt_lengths=prompt_lengths,
        max_new_tokens=max_new,
        sampling=sampling,
        pad_token_id=pad,
        pads_finished=pads_finished,
        streamer=call["streamer"],
        stopping_criteria=criteria,
        return_dict_in_generate=bool(gc.return_dict_in_generate),
        max_time=gc.max_time,
        output_scores=bool(gc.output_scores),
        output_logits=bool(gc.output_logits),
    )


def _check_padding(model, prompt_lengths: torch.Tensor) -> None:
    """ValueError for a batch of prompts of unequal lengths to a target whose type declares HF's own
    output for a left-padded row differs from the same prompt alone (``ArchSpec.padding_reason``,
    decision 97): specfx would generate the prompt's own continuation, HF something else."""
    model_type = getattr(model.config, "model_type", None)
    reason = getattr(ARCHITECTURES.get(model_type), "padding_reason", "")
    if reason and int(prompt_lengths.min()) != int(prompt_lengths.max()):
        raise ValueError(
            f"generate(): {type(model).__name__} cannot generate a batch of prompts of unequal lengths (left-padded: "
            f"{sorted(set(prompt_lengths.tolist()))} tokens) exactly: {reason}."
        )


def _new_token_bounds(gc, seq_len, max_positions, has_default_max_length, has_default_min_length) -> tuple[int, int]:
    """(max_new_tokens, min_new_tokens) as HF derives them from the resolved config."""
    if gc.max_new_tokens is not None:
        max_length = gc.max_new_tokens + seq_len
    elif has_default_max_length:
        max_length = gc.max_length + seq_len
        if max_positions is not None:
            max_length = min(max_length, max_positions)
    else:
        max_length = gc.max_length
    max_length = math.ceil(max_length)  # HF stops at the first length >= max_length
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
    return max_new, max(0, min_length - seq_len)


def _check_eos(eos_all: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """The EOS ids generation stops on. Negative ids are HF's "never stop" (it warns and never
    matches them), so they are dropped: the runtime itself pads its EOS list with -1."""
    if any(t < 0 for t in eos_all):
        logger.warning(
            "generate(): eos_token_id %s holds negative ids; like transformers, generation never "
            "stops on them (only on the non-negative ids, if any).",
            list(eos_all),
        )
    eos = tuple(t for t in eos_all if t >= 0)
    for t in eos:
        if t >= vocab_size:
            raise ValueError(f"generate(): eos_token_id {t} is outside the vocabulary [0, {vocab_size}).")
    return eos


def _sampling_values(gc, do_sample: bool) -> dict:
    """temperature, top_k, top_p, repetition_penalty, checked as HF's warpers check them.
    HF ignores the warpers' values when not sampling, so they are checked only when sampling."""
    penalty = 1.0 if gc.repetition_penalty is None else float(gc.repetition_penalty)
    if not penalty > 0:
        raise ValueError(f"generate(): repetition_penalty must be > 0, got {penalty}.")
    if not do_sample:
        return dict(repetition_penalty=penalty)
    temperature = 1.0 if gc.temperature is None else float(as_number("temperature", gc.temperature))
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(
            f"generate(): temperature must be a finite number > 0 when sampling, got {gc.temperature}. "
            f"For greedy decoding pass do_sample=False."
        )
    top_k = 0 if gc.top_k is None else as_scalar("top_k", gc.top_k)
    if isinstance(top_k, numbers.Real) and not isinstance(top_k, numbers.Integral):
        raise ValueError(f"generate(): top_k must be a whole number >= 0 (0 disables it), got {top_k}.")
    if not isinstance(top_k, numbers.Integral):
        raise TypeError(f"generate(): top_k must be an int, got {type(top_k).__name__} {top_k!r}.")
    if top_k < 0:
        raise ValueError(f"generate(): top_k must be >= 0 (0 disables it), got {top_k}.")
    top_p = 1.0 if gc.top_p is None else float(as_number("top_p", gc.top_p))
    if not 0 < top_p <= 1:
        raise ValueError(f"generate(): top_p must be in (0, 1], got {top_p}.")
    return dict(temperature=temperature, top_k=int(top_k), top_p=top_p, repetition_penalty=penalty)
