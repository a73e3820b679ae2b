"""Tiny randomly initialised HF causal LMs built from configs (no downloads), for tests,
the eager demo and benchmarks of the machinery."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

__all__ = ["TINY_CONFIGS", "tiny_causal_lm", "tiny_pair", "perturbed_copy"]

# Per architecture: config overrides giving a small model. A large initializer range spreads the
# logits, so float rounding differences cannot flip a greedy argmax (random near-ties would
# make exact-equality tests flaky for reasons unrelated to specfx).
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(n_embd=64, n_head=4, n_positions=256),
}


def tiny_causal_lm(
    arch: str = "llama",
    *,
    vocab_size: int = 128,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_positions: int = 256,
    initializer_range: float = 0.3,
    **overrides,
):
    """A random ``arch`` causal LM (eval mode) with a few layers and a small vocabulary."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(TINY_CONFIGS)}")
    kw = dict(TINY_CONFIGS[arch])
    if arch == "gpt2":
        kw.update(n_layer=num_layers, n_positions=max_positions)
    else:
        kw.update(num_hidden_layers=num_layers, max_position_embeddings=max_positions)
    kw.update(vocab_size=vocab_size, initializer_range=initializer_range, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    config = AutoConfig.for_model(arch, **kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def perturbed_copy(model, noise: float, seed: int = 1):
    """A copy of ``model`` with Gaussian noise (relative scale ``noise``) on every weight: a
    draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * noise * p.std().clamp_min(1e-3))
    return draft


def tiny_pair(arch: str = "llama", draft_arch: str | None = None, *, noise: float | None = 0.03, **kw):
    """(target, draft). With ``noise`` the draft is a perturbed copy of the target (partial
    acceptance); with ``noise=None`` it is an independent 1-layer model of ``draft_arch``."""
    target = tiny_causal_lm(arch, **kw)
    if noise is not None and draft_arch is None:
        return target, perturbed_copy(target, noise)
    kw = {k: v for k, v in kw.items() if k != "num_layers"}
    return target, tiny_causal_lm(draft_arch or arch, num_layers=1, seed=kw.pop("seed", 0) + 7, **kw)
