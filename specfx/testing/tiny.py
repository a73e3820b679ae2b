"""Tiny randomly initialised HF causal LMs built from configs (no downloads), for tests,
the eager demo and benchmarks of the machinery.

:func:`tiny_config` shrinks any architecture's default config generically: every size field
it recognises (hidden size, layers, heads, experts, windows...) is set to a small value, so a
new architecture usually needs no entry. Per-architecture exceptions live in
:mod:`specfx.model.architectures`.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

__all__ = ["STATEFUL_TINY", "TINY_CONFIGS", "TINY_SIZES", "tiny_config", "tiny_causal_lm", "tiny_pair", "perturbed_copy"]

# Historical per-architecture configs of the core tests (kept so their models do not change).
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(n_embd=64, n_head=4, n_positions=256),
}

# Targets with recurrent / linear-attention state (decisions 76, 79), built small and consistent:
# each supported state row's tiny config from the architecture table (one state layer beside one
# attention layer, heads that fit the tiny hidden size), and LFM2's hybrid configs (a supported
# type whose short-conv layers keep state only where a config has them)
def _stateful_tiny() -> dict[str, dict]:
    from specfx.model.architectures import ARCHITECTURES

    rows = {name: dict(spec.overrides) for name, spec in ARCHITECTURES.items() if spec.stateful and spec.status == "supported"}
    return {**rows, "lfm2": dict(layer_types=["conv", "full_attention"])}


STATEFUL_TINY: dict[str, dict] = _stateful_tiny()

# Size fields (under their various names) and the small value each gets when a config has it.
# The sliding window is small so generation runs past it; the large initializer range spreads
# the logits so float rounding cannot flip a greedy argmax (random near-ties would make
# exact-equality tests flaky for reasons unrelated to specfx).
TINY_SIZES: dict[str, object] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), 64),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"), 128),
    "head_dim": 16,
    "rotary_dim": 8,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "initializer_range": 0.3,
    "is_decoder": True,  # BERT-style LM heads are causal only as decoders
    "use_cache": True,
}
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_POSITION_FIELDS = ("max_position_embeddings", "n_positions")


def tiny_config(arch: str, *, vocab_size: int = 128, num_layers: int = 2, max_positions: int = 256, **overrides):
    """A small config of HF model type ``arch``: each recognised size field of its default
    config set small (:data:`TINY_SIZES`), then ``overrides``. Token ids: bos 1, eos 2, pad 0."""
    try:
        defaults = AutoConfig.for_model(arch).to_dict()
    except ValueError as e:
        raise ValueError(f"unknown architecture {arch!r}: {e}") from None
    if arch in TINY_CONFIGS:
        kw = dict(TINY_CONFIGS[arch], initializer_range=0.3)
    else:
        kw = {k: v for k, v in TINY_SIZES.items() if k in defaults}
    kw.update({k: num_layers for k in _LAYER_FIELDS if k in defaults})
    kw.update({k: max_positions for k in _POSITION_FIELDS if k in defaults})
    kw.update(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def tiny_causal_lm(
    arch: str = "llama",
    *,
    vocab_size: int = 128,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_positions: int = 256,
    attn_implementation: str = "sdpa",
    **overrides,
):
    """A random ``arch`` causal LM (eval mode) with a few layers and a small vocabulary.

    Uses ``attn_implementation`` (default sdpa), falling back to eager for architectures
    whose transformers implementation has no sdpa path."""
    config = tiny_config(arch, vocab_size=vocab_size, num_layers=num_layers, max_positions=max_positions, **overrides)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    except ValueError as e:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(e):
            raise
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def perturbed_copy(model, noise: float, seed: int = 1):
    """A copy of ``model`` with Gaussian noise (relative scale ``noise``) on every weight: a
    draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            spread = p.std() if p.numel() > 1 else p.abs().reshape(())
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * noise * spread.clamp_min(1e-3))
    return draft


def tiny_pair(arch: str = "llama", draft_arch: str | None = None, *, noise: float | None = 0.03, **kw):
    """(target, draft). With ``noise`` the draft is a perturbed copy of the target (partial
    acceptance); with ``noise=None`` it is an independent 1-layer model of ``draft_arch``."""
    target = tiny_causal_lm(arch, **kw)
    if noise is not None and draft_arch is None:
        return target, perturbed_copy(target, noise)
    kw = {k: v for k, v in kw.items() if k != "num_layers"}
    return target, tiny_causal_lm(draft_arch or arch, num_layers=1, seed=kw.pop("seed", 0) + 7, **kw)
