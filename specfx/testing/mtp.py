"""Tiny targets with random native MTP layers (DeepSeek-V3, GLM-4-MoE, Mellum), for tests and
``specfx bench gpu_check``: ``mtp_target(arch, m)`` gives ``(target, mtp_layers)``, cached; and
``fc_mtp_checkpoint(arch, m, directory)``: a tiny hybrid target (Qwen3-Next, Qwen3.5, BailingHybrid) saved with
random MTP layers of its table row's layout and loaded back from that checkpoint (decision 86)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specfx.drafters import mtp as mtp_module
from specfx.drafters.mtp import LAYOUTS
from specfx.model.architectures import ARCHITECTURES
from specfx.testing.tiny import STATEFUL_TINY, tiny_causal_lm

__all__ = ["BUILT", "MTP_ARCHS", "fc_mtp_checkpoint", "hf_builds_mtp", "mtp_config", "mtp_target"]

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256,
    initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
# Per architecture: overrides giving a tiny model (MoE with 4 experts) and the MTP depths it allows.
MTP_ARCHS = {
    "deepseek_v3": (
        dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16,
             q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
             first_k_dense_replace=1, n_shared_experts=1),
        (1, 2, 3),
    ),
    "glm4_moe": (
        dict(num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1),
        (1, 2),
    ),
    "mellum": (  # its MTP layer is a sliding-window layer; the prompts below outgrow the window
        dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        (1,),
    ),
}  # fmt: skip

_cache = {}


def mtp_config(arch: str, m: int, vocab: int = 128, **kw):
    overrides, _ = MTP_ARCHS[arch]
    return AutoConfig.for_model(arch, **{**_COMMON, **overrides, "num_mtp_layers": m, "vocab_size": vocab, **kw})


def hf_builds_mtp(arch: str) -> bool:
    """Whether the installed transformers builds ``arch``'s MTP layers: ``MtpModel(target, m)``
    starts from ``config.get_mtp_config()``, which refuses a config whose MTP layers it cannot
    type (Mellum before transformers 5.20: ``layer_types`` but no ``mtp_layer_types``)."""
    try:
        mtp_config(arch, 1).get_mtp_config()
    except ValueError:
        return False
    return True


def mtp_target(arch: str, m: int, vocab: int = 128, seed: int = 0, **kw):
    """(target, MtpModel) for a tiny ``arch`` with ``m`` random MTP layers (both eval)."""
    key = (arch, m, vocab, seed, tuple(sorted(kw.items())))
    if key not in _cache:
        config = mtp_config(arch, m, vocab, **kw)
        torch.manual_seed(seed)
        target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        target.generation_config.pad_token_id = 0
        layers = mtp_module.random_mtp_layers(target, m, std=config.initializer_range, seed=seed + 1)
        _cache[key] = (target, layers)
    return _cache[key]


BUILT = sorted(arch for arch in MTP_ARCHS if hf_builds_mtp(arch))  # where this transformers builds MTP layers


def fc_mtp_checkpoint(arch: str, m: int, directory, vocab: int = 128, seed: int = 0, **overrides):
    """``(target, layers)``: a tiny ``arch`` (a type whose table row names an MTP layout) declaring
    ``m`` MTP layers (its layout's ``count_field``), saved to ``directory`` with random MTP layers
    under their checkpoint names and loaded back from there (so ``draft="mtp"`` reads them from the checkpoint);
    ``layers``: those random layers, tied to the loaded target. No EOS; the pad id (0) has a real
    embedding, so only the 2-D mask hides padding, as in real checkpoints. ``overrides``: more config
    fields for the target (e.g. ``initializer_range``), over its tiny row's."""
    config = {**(STATEFUL_TINY.get(arch) or ARCHITECTURES[arch].overrides), **overrides}
    count = LAYOUTS[ARCHITECTURES[arch].mtp_layout].count_field  # the config field counting the MTP layers
    target = tiny_causal_lm(arch, vocab_size=vocab, seed=seed, **{count: m}, **config)
    with torch.no_grad():
        target.get_input_embeddings().weight[0].normal_()
    layers = mtp_module.random_mtp_layers(target, m, std=0.3, seed=seed + 1)
    mtp_module.save_with_mtp_layers(target, layers, directory)
    loaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=target.config._attn_implementation).eval()
    loaded.generation_config.eos_token_id = None
    loaded.generation_config.pad_token_id = 0
    layers.tie(loaded)
    return loaded, layers
