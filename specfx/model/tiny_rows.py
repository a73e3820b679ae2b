"""Tiny-config overrides of the architecture table's rows whose small configs need more than the sizes
:data:`specfx.testing.tiny.TINY_SIZES` sets (:mod:`specfx.model.architectures` reads them into its rows'
``overrides``): the rows with state, and DeepSeek-V4's."""

from __future__ import annotations

__all__ = ["STATE_TINY", "V4_TINY"]

# Tiny configs of the state rows: one layer of each kind (a 2-layer config of a default pattern may be all
# linear attention), heads consistent with the small hidden size, SSD sizes small (the torch SSD path is slow)
_GDN = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
_KDA = dict(
    layer_types=["linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse"],
    linear_num_heads=4,
    linear_head_dim=16,
    n_group=1,
    topk_group=1,
    num_experts=4,
    num_experts_per_tok=2,
    num_key_value_heads=4,
)
_SSD = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16)
STATE_TINY = {
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), _GDN),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, n_groups=1),
    "kimi_linear": _KDA,
    "bailing_hybrid": dict(_KDA, first_k_dense_replace=1),
    "bamba": dict(_SSD, attn_layer_indices=[1]),
    "granitemoehybrid": dict(_SSD, layer_types=["mamba", "attention"]),
    "falcon_h1": dict(_SSD, mamba_d_ssm=128),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    **dict.fromkeys(("mamba", "falcon_mamba"), dict(hidden_size=32, state_size=4)),
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16
    ),
    "zamba": dict(
        num_hidden_layers=3,
        layers_block_type=["linear_attention", "hybrid", "hybrid"],
        attn_layer_period=2,
        attn_layer_offset=1,
        attention_head_dim=32,
        n_mamba_heads=2,
    ),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1),
    "zamba2": dict(
        layers_block_type=["linear_attention", "hybrid"],
        hybrid_layer_ids=[1],
        mamba_headdim=16,
        n_mamba_heads=8,
        attention_head_dim=32,
        mamba_d_state=16,
    ),
    "qwen4_exp_text": dict(
        _GDN, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4
    ),
}

# DeepSeek-V4, tiny: one layer of each attention type, windows of 8 (HCA) and 4 (CSA) so a 40-token probe
# crosses several, a top-k of 3 pooled entries so the indexer chooses, random biases and sinks left to the test
V4_TINY = dict(
    num_hidden_layers=3,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    head_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    hc_mult=2,
    hc_sinkhorn_iters=3,
    pad_token_id=None,
)
