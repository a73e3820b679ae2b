"""The memory-bandwidth floor of decoding: how fast a round could possibly run.

A decode step at small batch is memory-bound: every weight is read once per forward, and
every query reads the KV cache of its row. So the least time a forward can take is the bytes
it must read over the device's memory bandwidth; measured time over that floor says how much
is left to gain. Formulas (B = batch, T = new tokens per row, ctx = KV entries attended):

    weight bytes  = Σ over parameter tensors, each counted once (tied weights once), of
                    numel × dtype size; except an embedding table that nothing reads in full
                    (the input embedding when it is not tied to the LM head), which is a
                    gather: min(B·T, rows) rows × row size. The LM head is read in full.
    KV bytes      = layers × 2 (K and V) × B × kv_heads × ctx × head_dim × dtype size
                    (kv_heads = num_key_value_heads: grouped-query attention reads fewer)
    forward floor = (weight bytes + KV bytes) / bandwidth
    round floor   = (K draft forwards of 1 token + 1 target forward of K+1 tokens) / bandwidth
    decode floor  = one target forward of 1 token (non-speculative, per token and row)
    ideal tok/s   = B × τ / round floor          (speculative, at the measured τ)
                  = B / decode floor             (non-speculative)
    fraction of floor = measured tok/s / ideal tok/s

``bandwidth`` is the measured device-to-device copy bandwidth counting bytes read plus bytes
written (:func:`measure_copy_bandwidth`), the rate a streaming read can reach. Not counted:
activations, the KV entries written, attention arithmetic and launch gaps; at batch 1-16 and
contexts up to a few thousand tokens they are small next to the weights, and they are part of
what the fraction of floor measures. Attention kernels that read a whole preallocated KV
buffer (static caches, specfx's slot buffers) read more than ``ctx`` entries; the floor counts
only what a perfect kernel needs.

Models can live on the ``meta`` device: only shapes and dtypes are used, so the floor of an
8B-parameter model is computed without allocating it (:func:`meta_model`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specfx.engine.timing import call_times

__all__ = [
    "ForwardBytes",
    "meta_model",
    "kv_geometry",
    "weight_bytes_read",
    "kv_bytes_read",
    "forward_bytes",
    "device_time",
    "measure_copy_bandwidth",
    "round_floor_seconds",
    "decode_floor_seconds",
    "ideal_tokens_per_s",
    "fraction_of_floor",
]


@dataclass(frozen=True)
class ForwardBytes:
    """Bytes one forward must read from device memory."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def meta_model(config, dtype: torch.dtype):
    """An HF causal LM of ``config`` on the meta device (shapes and dtypes, no storage)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config, with grouped-query attention:
    ``num_key_value_heads`` when the config has it, else one KV head per attention head."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def weight_bytes_read(model, tokens: int, dtype: torch.dtype | None = None) -> int:
    """Parameter bytes one forward over ``tokens`` tokens (B·T, all rows) reads.

    Each parameter tensor counts once (``model.parameters()`` already yields a tied tensor
    once). An ``nn.Embedding`` whose weight no other module uses is a gather: it reads
    ``min(tokens, rows)`` rows. A tied embedding is read in full by the LM head, which covers
    the gather. ``dtype`` overrides the parameters' own element size.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int (batch x tokens per row), got {tokens!r}.")
    uses: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    gathers = {
        id(m.weight): m.weight
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and uses.get(id(m.weight), 0) == 1
    }
    total = 0
    for p in model.parameters():
        size = _dtype_size(dtype or p.dtype)
        if id(p) in gathers:
            rows, row = p.shape[0], p[0].numel()
            total += min(tokens, rows) * row * size
        else:
            total += p.numel() * size
    return total


def kv_bytes_read(config, batch: int, context: int, dtype: torch.dtype) -> int:
    """KV-cache bytes one forward reads: every layer reads K and V of ``context`` entries for
    each of ``batch`` rows: ``layers · 2 · batch · kv_heads · context · head_dim · size``."""
    layers, kv_heads, head_dim = kv_geometry(config)
    return layers * 2 * batch * kv_heads * context * head_dim * _dtype_size(dtype)


def forward_bytes(
    model, batch: int, tokens_per_row: int, context: int, dtype: torch.dtype | None = None
) -> ForwardBytes:
    """Weight and KV bytes of one forward of ``tokens_per_row`` tokens for each of ``batch``
    rows attending ``context`` KV entries (dtype: the model's unless given)."""
    dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
    return ForwardBytes(
        weights=weight_bytes_read(model, batch * tokens_per_row, dtype),
        kv=kv_bytes_read(model.config, batch, context, dtype),
    )


def round_floor_seconds(target, draft, *, k: int, batch: int, context: int, bandwidth: float, dtype=None) -> float:
    """Least time of one speculative round: K draft forwards of 1 token and one target forward
    of K+1 tokens, all at ``context`` entries, over ``bandwidth`` bytes/s. ``draft=None`` for a
    drafter that reads no model (an oracle, prompt lookup): only the verification counts."""
    total = forward_bytes(target, batch, k + 1, context, dtype).total
    if draft is not None:
        total += k * forward_bytes(draft, batch, 1, context, dtype).total
    return total / bandwidth


def decode_floor_seconds(target, *, batch: int, context: int, bandwidth: float, dtype=None) -> float:
    """Least time of one non-speculative decode step (1 token per row): the per-token floor of
    plain ``generate()``."""
    return forward_bytes(target, batch, 1, context, dtype).total / bandwidth


def ideal_tokens_per_s(tau: float, floor_seconds: float, batch: int) -> float:
    """Tokens/s at the floor: ``batch · τ / floor_seconds`` (τ = 1 for a plain decode step)."""
    return batch * tau / floor_seconds


def fraction_of_floor(measured_tokens_per_s: float, ideal: float) -> float:
    """Measured tokens/s over the ideal (1.0 = at the bandwidth floor)."""
    return measured_tokens_per_s / ideal


def device_time(fn: Callable[[], object], device, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``iters`` individually timed calls of ``fn`` after ``warmup`` calls:
    CUDA events on a CUDA device (no host clock in the measurement), :func:`~specfx.engine.timing.call_times`
    elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return statistics.median(call_times(fn, iters, warmup=warmup))
    # CUDA events, not call_times' host clock: the device's own time, without launch overhead
    for _ in range(warmup):
        fn()
    times = []
    torch.cuda.synchronize(device)
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_copy_bandwidth(device, nbytes: int | None = None, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    Copies a random ``nbytes`` buffer (default 2 GiB on CUDA: far above the L2; 256 MiB
    elsewhere) after a warm-up; median of ``iters`` timed copies (:func:`device_time`).
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    n = nbytes // 4
    src = torch.rand(n, device=device)  # random, not zeros: zeros can move faster than data
    dst = torch.empty_like(src)
    seconds = device_time(lambda: dst.copy_(src), device, iters=iters, warmup=3)
    return 2 * n * 4 / seconds
