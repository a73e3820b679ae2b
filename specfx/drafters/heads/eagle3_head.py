"""The modules of an EAGLE-3 head, the computation that matches the reference implementations
(SafeAILab's ``eagle/model/cnets.py``, vLLM's ``Eagle3LlamaForCausalLM``): :class:`Eagle3Head`
holds the weights in the checkpoint's names, :class:`Eagle3Layer` is its midlayer (embedding and
feature in, the next feature out) and :class:`Eagle3Attention` the midlayer's attention over the
head's own static KV. See :mod:`specfx.drafters.heads.eagle3` for what the head computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specfx.drafters.heads.checkpoint import LAYER_KEYS, layer_config
from specfx.model.cache import SlotCache

__all__ = ["KIND", "Eagle3Attention", "Eagle3Head", "Eagle3Layer", "checkpoint_error"]

KIND = "EAGLE-3"

def checkpoint_error(path, what: str) -> ValueError:
    """The ValueError for what is wrong with the EAGLE-3 checkpoint at ``path``."""
    return ValueError(f"{KIND} checkpoint {str(path)!r}: {what}")


class Eagle3Attention(nn.Module):
    """The midlayer's attention: q, k, v from the 2H input ``cat[emb; feature]``, rotary on q
    and k, attention over the head's own static per-row KV (a one-layer
    :class:`~specfx.model.cache.SlotCache`, written at the cache's current slots) under an explicit
    bool mask ``[B, 1, T, C]``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, h, T, D]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, D]
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        keys, values = cache.layers[0].update(k, v)  # [B, kv, C, D]: every slot, this forward's written
        group = self.heads // self.kv_heads
        if group > 1:  # grouped-query attention: each KV head serves `group` query heads (a view, then one copy)
            full = (b, self.kv_heads, group) + keys.shape[2:]  # [B, kv, group, C, D]
            keys = keys[:, :, None].expand(full).flatten(1, 2)
            values = values[:, :, None].expand(full).flatten(1, 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, h, T, D], scale 1/sqrt(D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Eagle3Layer(nn.Module):
    """The midlayer (see the module docstring): embedding and feature in, the next feature out."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)
        # vLLM's variant: the residual stream starts at hidden_norm(feature), not the feature
        self.norm_before_residual = norm_before_residual

    def forward(self, emb, feature, rope, mask, cache) -> torch.Tensor:
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [B, T, 2H]
        h = residual + self.self_attn(x, rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _llama_config(config: dict, where) -> LlamaConfig:
    """The head's decoder layer config (sizes, norm epsilon, activation, rotary, the target
    vocabulary's size) from its config.json, with Llama's defaults for the optional keys.
    ValueError for what is missing or cannot run inside a round."""
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    return layer_config(LlamaConfig, LAYER_KEYS, config, lambda what: checkpoint_error(where, what), required)


class Eagle3Head(nn.Module):
    """The weights of an EAGLE-3 head in its checkpoint layout (parameter names are the
    checkpoint's tensor names), built from the head's ``config`` (config.json's dict).

    ``num_taps`` tapped target states of ``target_hidden_size`` each feed ``fc``; ``d2t``
    ``[V_draft]`` and ``t2d`` ``[V]`` map the draft vocabulary. ``embed_tokens`` is None
    (the target's table is used) unless :meth:`use_own_embedding` gave it one."""

    def __init__(self, config: dict, num_taps: int = 3, where="EAGLE-3 head"):
        super().__init__()
        llama = _llama_config(config, where)
        self.config = dict(config)
        self.llama = llama
        h = llama.hidden_size
        self.hidden_size = h
        self.target_hidden_size = int(config.get("target_hidden_size") or h)
        self.vocab_size = int(llama.vocab_size)
        self.draft_vocab_size = int(config.get("draft_vocab_size") or self.vocab_size)
        self.num_taps = num_taps
        self.fc = nn.Linear(num_taps * self.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(llama, bool(config.get("norm_before_residual", False)))
        self.norm = LlamaRMSNorm(h, eps=llama.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(self.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None
        self.rotary_emb = LlamaRotaryEmbedding(llama)  # inv_freq: a non-persistent buffer

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the layout requires (d2t/t2d only for a reduced vocabulary)."""
        shapes = {n: tuple(t.shape) for n, t in self.state_dict().items() if n not in ("d2t", "t2d")}
        if self.draft_vocab_size != self.vocab_size:
            shapes.update(d2t=(self.draft_vocab_size,))
        return shapes

    def target_ids(self) -> torch.Tensor:
        """``[V_draft]`` the target id of each draft id."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def use_own_embedding(self, weight: torch.Tensor) -> None:
        self.embed_tokens = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight.clone())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (d2t and t2d always written: every loader accepts them)."""
        return dict(self.state_dict())
