"""What ``generate(return_dict_in_generate=True)`` returns beyond ``sequences``, in HF's layout.

specfx keeps its state in static per-row buffers where a row's tokens start at slot 0
(slot == position); HF's outputs are laid out like the returned ``sequences``: each row
left-padded to the batch's prompt width, every row as long as the longest. The functions here
translate, so that code written against HF's outputs works unchanged.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache

from specfx.model.cache import SlotCache
from specfx.model.hf_names import cache_kwarg, output_cache_field
from specfx.model.recurrent import stateful_layers

__all__ = ["build_output_cache", "generate_output", "step_tuples"]


@torch.no_grad()
def build_output_cache(
    model,
    cache: SlotCache,
    sequences: torch.Tensor,
    prompt_lengths: torch.Tensor,
    counts: torch.Tensor,
) -> DynamicCache:
    """The ``DynamicCache`` HF's ``generate()`` would return, built from specfx's buffers.

    Args:
        model: the target (its config chooses the cache's layer types, as in HF's generate).
        cache: the target's :class:`SlotCache`; ``keys/values [B, H, C, D]`` per layer, row b's
            real tokens at slots ``0 .. prompt_lengths[b] + counts[b] - 1``.
        sequences: ``[B, S + W]`` what generate() returns: left-padded prompts, then each row's
            ``counts[b]`` new tokens, then padding up to the longest row's ``W``.
        prompt_lengths: ``[B]`` real prompt tokens per row.
        counts: ``[B]`` new tokens per row.

    Returns:
        A ``DynamicCache`` of ``L = S + W - 1`` entries per layer (HF never forwards the last
        token); row b's entry j is the KV of ``sequences[b, j]``. Left padding holds zeros (the
        prompt's attention mask hides it, in HF too). Past the end of a row that finished before
        the longest, HF kept forwarding its pad tokens with the mask at 1; specfx never ran them,
        so those few tokens are forwarded here through the plain model, as HF did. Sliding-window
        layers keep their last ``window - 1`` entries, as HF's do.
    """
    device = sequences.device
    prompt_lengths, counts = prompt_lengths.to(device), counts.to(device)
    prompt_width = sequences.shape[1] - int(counts.max())
    common = prompt_width + int(counts.min()) - 1  # entries every row has in specfx's buffers
    if stateful_layers(cache):  # recurrent state (decision 76)
        raise ValueError(
            f"return_dict_in_generate: cannot return the cache for {type(model).__name__}: it keeps recurrent "
            f"or linear-attention state, which specfx does not export into HF's cache yet. Pass "
            f"return_dict_in_generate=False, or run model.generate() to continue from a cache."
        )
    dynamic = DynamicCache(config=model.config.get_text_config(decoder=True))
    if len(dynamic.layers) != len(cache.layers):
        raise ValueError(
            f"return_dict_in_generate: cannot return the cache for {type(model).__name__}: its "
            f"HF cache has {len(dynamic.layers)} layers where specfx keeps {len(cache.layers)} (shared "
            f"or non-KV layers). Pass return_dict_in_generate=False, or run model.generate() to continue "
            f"from a cache."
        )
    if any(getattr(layer, "compressed", None) for layer in cache.layers):
        # a KV compressor's windows (decision 97): HF's cache layers keep running pooled entries, buffers and
        # counts specfx does not hold; its own forward over the sequence builds them (prompts of equal length)
        _forward_tail(model, dynamic, sequences, prompt_width - prompt_lengths, 0)
        return dynamic
    slots = torch.arange(common, device=device).unsqueeze(0) - (prompt_width - prompt_lengths).unsqueeze(1)  # [B, L']
    for i, layer in enumerate(cache.layers):
        dynamic.update(_gather(layer.keys, slots), _gather(layer.values, slots), i)
        if getattr(layer, "indexer_keys", None) is not None:  # a DSA indexer's keys, [R, C, Di] (decision 94)
            dynamic.update_indexer(_gather(layer.indexer_keys.unsqueeze(1), slots).squeeze(1), i)
    if common < sequences.shape[1] - 1:
        _forward_tail(model, dynamic, sequences, prompt_width - prompt_lengths, common)
    return dynamic


def _forward_tail(model, dynamic: DynamicCache, sequences: torch.Tensor, padding: torch.Tensor, start: int) -> None:
    """Append the KV of ``sequences[:, start:-1]`` to ``dynamic`` with the plain model, with the
    mask and positions HF's generate() used: the prompt's mask, then 1 for every new token
    (finished rows included), positions counting real tokens (``padding [B]`` per row)."""
    end = sequences.shape[1] - 1
    cols = torch.arange(end, device=sequences.device).unsqueeze(0)
    mask = (cols >= padding.unsqueeze(1)).long()  # [B, end]
    kwargs = {}
    params = inspect.signature(model.forward).parameters
    if "position_ids" in params:
        kwargs["position_ids"] = (cols - padding.unsqueeze(1))[:, start:]  # >= 1: past every prompt
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1  # only the KV is wanted
    kwargs[cache_kwarg(model.forward)] = dynamic
    model(input_ids=sequences[:, start:end], attention_mask=mask, use_cache=True, **kwargs)


def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buffer [R, H, C, D]`` (R >= B: the batch bucket, the call's rows first), ``slots [B, L]``
    -> ``[B, H, L, D]`` (zeros where slots < 0)."""
    b = slots.shape[0]
    _, h, _, d = buffer.shape
    index = slots.clamp_min(0)[:, None, :, None].expand(b, h, slots.shape[1], d)
    return buffer[:b].gather(2, index).masked_fill((slots < 0)[:, None, :, None], 0)


def step_tuples(
    first: torch.Tensor,
    rounds: list[tuple[torch.Tensor, torch.Tensor]],
    counts: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Per-step score (or logit) tensors in HF's ``scores``/``logits`` layout.

    Args:
        first: ``[B, V]`` the values that chose the first new token (prefill).
        rounds: per round, ``(values [B, K+1, V], n_emitted [B])``: ``values[b, i]`` chose the
            i-th token row b emitted in that round; entries past ``n_emitted[b]`` are unused.
        counts: ``[B]`` new tokens per row in the returned ``sequences`` (after EOS, length
            limits and stopping criteria; a row never has more values than its count).

    Returns:
        ``max(counts)`` tensors ``[B, V]``, one per generated step, as HF returns one per step
        up to the longest row. HF keeps forwarding pad tokens for rows that already finished;
        specfx does not, so for such a row (step >= counts[b]) the entry is all zeros — the
        pad-step convention (mask them with the row's count, as HF users do with the padding
        in ``sequences``).
    """
    batch, vocab = first.shape
    width = int(counts.max())
    steps = first.new_zeros((batch, width, vocab))
    per_row = [[first[b]] for b in range(batch)]
    for values, n_emitted in rounds:
        n = n_emitted.tolist()
        for b in range(batch):
            per_row[b].extend(values[b, : n[b]].unbind(0))
    for b in range(batch):
        c = int(counts[b])
        if c:
            steps[b, :c] = torch.stack(per_row[b][:c])
    return tuple(steps.unbind(1))


def generate_output(model, cache: SlotCache, req, sequences: torch.Tensor, counts: torch.Tensor, steps=None):
    """HF's ``GenerateDecoderOnlyOutput`` for ``return_dict_in_generate=True``: ``sequences``
    ``[B, S + W]``, the cache (see :func:`build_output_cache`; the field is ``cache`` from
    transformers 5.24 on, ``past_key_values`` before, as in HF's own output) and, when asked
    for, ``scores``/``logits`` (see :func:`step_tuples`); ``counts [B]`` are the new tokens per
    row; ``steps`` the generator's per-call list of ``(scores, logits [B, T, V], n_emitted
    [B])``, prefill first (T = 1), then one entry per round."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    dynamic = build_output_cache(model, cache, sequences, req.prompt_lengths, counts)
    tuples = {}
    for name, index, wanted in (("scores", 0, req.output_scores), ("logits", 1, req.output_logits)):
        if wanted and steps:
            first, *rounds = steps
            tuples[name] = step_tuples(first[index][:, 0], [(s[index], s[2]) for s in rounds], counts)
    tuples[output_cache_field(GenerateDecoderOnlyOutput)] = dynamic
    return GenerateDecoderOnlyOutput(sequences=sequences, **tuples)
