"""How vLLM and SGLang compute one DFlash block's proposals, restated in plain PyTorch from their
source (facts, not code), so a test can run a draft saved by specfx the way each engine runs it.
The weights come from the restated loaders of tests/unit/drafters/heads/dflash_engine_rules.py
(:class:`Held`: stacked ``qkv_proj`` / ``gate_up_proj`` as the engines hold them), so a loading
mistake shows up in the numbers too. Read in the published wheels of vLLM 0.33.0 (its
``_version.py``: commit ``g4ba787ec9``) and SGLang 0.5.23 (decision 85 of docs/ARCHITECTURE.md):

* **Context (the target's tapped states -> the draft's KV).** vLLM
  (vllm/model_executor/models/qwen3_dflash.py: ``DFlashQwen3ForCausalLM.combine_hidden_states``,
  ``DFlashQwen3Model.precompute_and_store_context_kv``): ``fc`` over the concatenated taps, then
  an RMSNorm with ``hidden_norm``'s weight, then one GEMM with the k and v rows of every layer's
  ``qkv_proj`` (and its bias), ``k_norm`` per head, rotary (neox, the layer's ``rope_parameters``,
  base 1e6 if none) at each context token's position; written to the draft's paged KV cache at
  that position's slot. SGLang (srt/models/dflash.py ``project_target_hidden``;
  srt/speculative/dflash_worker_v2.py ``_append_target_hidden_to_draft_kv_by_loc``):
  ``hidden_norm(fc(taps))``, then per layer ``kv_proj_only``, ``apply_k_norm``, ``apply_k_rope``,
  ``set_kv_buffer`` at the context slots. Which rows: vLLM
  (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py ``_prepare_dflash_inputs_kernel``) the
  target's tokens of the last verify minus the rejected ones (rejected rows write nothing);
  SGLang the committed prefix of the verified block (``set_kv_buffer_prefix_valid``).
* **The block.** vLLM: the bonus token (the one the target just sampled) then
  ``num_speculative_tokens`` mask tokens (``get_parallel_drafting_token_id``) at positions
  ``last_valid_pos + 1 + i``; ``1 + num_speculative_tokens`` query rows, whatever the draft's
  ``block_size``. SGLang (dflash_worker_v2.py, the block preparation): ``block_ids[:, 0]`` the
  bonus token, the rest ``mask_token_id``, positions ``prefix_len + arange(block_size)``
  (``block_size`` = ``speculative_num_draft_tokens``, by default the config's). Embedded with
  the target's embedding *table* (vLLM: ``load_dflash_model`` in
  vllm/v1/worker/gpu/spec_decode/dflash/utils.py shares ``target.model.embed_tokens``, called by
  ``DFlashQwen3Model.embed_input_ids``; SGLang: ``target_model.get_input_embeddings()``, times
  ``noise_embed_scale`` = 1 unless the target defines ``get_dflash_noise_embedding_scale``, which
  no model in 0.5.23 does); neither applies a scale the target's own forward applies (Gemma).
* **Each layer** (vLLM ``DFlashQwen3DecoderLayer`` / ``DFlashQwen3Attention``; SGLang
  ``DFlashDecoderLayer`` / ``DFlashAttention``): pre-norm with the residual carried beside the
  stream (``input_layernorm(x, residual)`` adds, then normalises); ``qkv_proj`` of the block,
  ``q_norm`` / ``k_norm`` per head, rotary at the block's positions; the block's K/V written to
  the cache at the block's slots (vLLM: ``Attention`` writes before it reads); attention of the
  block's queries over the request's cache up to ``last_valid_pos + 1 + rows`` (vLLM ``seq_lens``;
  SGLang ``TARGET_VERIFY`` over ``prefix_lens`` plus the block), scale ``head_dim ** -0.5``,
  causal only where the loader read ``causal`` (vLLM ``get_draft_attn_causal``; SGLang
  ``ENCODER_ONLY`` for full-attention layers); ``o_proj``; ``post_attention_layernorm``;
  SiLU-and-mul over ``gate_up_proj``, ``down_proj``. Then ``norm`` of stream plus residual.
* **Proposals.** vLLM: the rows at block offsets 1 .. ``num_speculative_tokens`` (the sample
  indices of ``_prepare_dflash_inputs_kernel``; the bonus row is not sampled), through
  ``compute_logits`` (the target's ``lm_head`` shared, ``logit_scale`` 1), argmax under
  ``draft_sample_method="greedy"`` (the default, vllm/config/speculative.py). SGLang: rows 1 ..
  ``block_size - 1`` times the target's ``lm_head`` weight, argmax (``_DflashDraftSampler``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.unit.drafters.heads.dflash_engine_rules import Held


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [T, heads, D]`` rotated at ``positions [T]``, halves rotated against each other."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    angle = positions.float()[:, None] * inv_freq  # [T, D/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # [T, 1, D/2]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class EngineDFlash:
    """One request's DFlash drafting as ``engine`` ("vLLM" or "SGLang") runs it: the weights it
    loaded (``held``), the draft's config.json ``config``, the target's embedding table and LM head
    weight, and a KV cache with one slot per position (a paged cache addressed through the block
    table, slot == position here) that persists across steps. A slot never written raises when read:
    a layout that reads KV it never stored fails loudly instead of reading zeros."""

    def __init__(self, engine: str, held: Held, config: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                 capacity: int = 256):  # fmt: skip
        self.engine, self.held, self.config = engine, held, config
        self.embed, self.lm_head = embed, lm_head
        self.heads, self.hidden = config["num_attention_heads"], config["hidden_size"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        rope = config.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta") or config.get("rope_theta") or 1e6)  # set_default_rope_theta
        self.layers = config["num_hidden_layers"]
        shape = (self.layers, capacity, self.kv_heads, self.head_dim)
        self.keys, self.values = torch.zeros(shape), torch.zeros(shape)
        self.written = torch.zeros(self.layers, capacity, dtype=torch.bool)
        self.from_context = torch.zeros(self.layers, capacity, dtype=torch.bool)  # else from a block

    def _p(self, name: str) -> torch.Tensor:
        return self.held.param(name)

    def _bias(self, name: str) -> torch.Tensor | None:
        return self.held.param(name) if name in self.held.tensors else None

    def _kv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k and v rows of the layer's ``qkv_proj`` on ``x [T, H]``: keys normed and rotated."""
        p, q_size, kv_size = f"layers.{layer}.self_attn.", self.heads * self.head_dim, self.kv_heads * self.head_dim
        w, b = self._p(p + "qkv_proj.weight")[q_size:], self._bias(p + "qkv_proj.bias")
        kv = F.linear(x, w, None if b is None else b[q_size:])
        k, v = (
            kv[:, :kv_size].view(-1, self.kv_heads, self.head_dim),
            kv[:, kv_size:].view(-1, self.kv_heads, self.head_dim),
        )
        k = _rope_neox(_rms(k, self._p(p + "k_norm.weight"), self.eps), positions, self.theta)
        return k, v

    def _store(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: bool) -> None:
        self.keys[layer, positions], self.values[layer, positions] = k, v
        self.written[layer, positions], self.from_context[layer, positions] = True, context

    def store_context(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """The context rows of one step: the target's tapped states ``taps [T, n * H]`` (in the
        order the loader read) of the tokens at ``positions [T]``, into every layer's cache."""
        if self.engine == "vLLM":  # combine_hidden_states (fc), then the precompute's RMSNorm
            x = _rms(F.linear(taps, self._p("fc.weight")), self._p("hidden_norm.weight"), self.eps)
        else:  # project_target_hidden
            x = _rms(taps @ self._p("fc.weight").T, self._p("hidden_norm.weight"), self.eps)
        for layer in range(self.layers):
            self._store(layer, positions, *self._kv(layer, x, positions), context=True)

    def block_logits(self, bonus: int, last_valid_pos: int, rows: int, mask_token_id: int) -> torch.Tensor:
        """The block after the committed context ending at ``last_valid_pos``: ``rows`` query rows
        (the bonus token, then masks); the logits ``[rows - 1, V]`` of the rows that are sampled."""
        positions = last_valid_pos + 1 + torch.arange(rows)
        ids = torch.tensor([bonus] + [mask_token_id] * (rows - 1))
        x, residual = F.embedding(ids, self.embed), None  # the table, no scale
        seen = last_valid_pos + 1 + rows  # seq_len: the context and the block
        group = self.heads // self.kv_heads
        for layer in range(self.layers):
            p = f"layers.{layer}."
            residual = x if residual is None else x + residual
            h = _rms(residual, self._p(p + "input_layernorm.weight"), self.eps)
            qkv = F.linear(h, self._p(p + "self_attn.qkv_proj.weight"), self._bias(p + "self_attn.qkv_proj.bias"))
            q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
            q = qkv[:, :q_size].view(rows, self.heads, self.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(rows, self.kv_heads, self.head_dim)
            v = qkv[:, q_size + kv_size :].view(rows, self.kv_heads, self.head_dim)
            q = _rope_neox(_rms(q, self._p(p + "self_attn.q_norm.weight"), self.eps), positions, self.theta)
            k = _rope_neox(_rms(k, self._p(p + "self_attn.k_norm.weight"), self.eps), positions, self.theta)
            self._store(layer, positions, k, v, context=False)  # written before it is read
            if not bool(self.written[layer, :seen].all()):
                raise AssertionError(f"{self.engine}: layer {layer} reads slots never written below {seen}")
            if not bool(self.from_context[layer, : last_valid_pos + 1].all()):  # an older block's KV left behind
                raise AssertionError(
                    f"{self.engine}: layer {layer} reads block KV as context below {last_valid_pos + 1}"
                )
            keys = self.keys[layer, :seen].repeat_interleave(group, 1)  # [S, heads, D]
            values = self.values[layer, :seen].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) * self.head_dim**-0.5
            if self.held.read["causal"][layer]:
                scores = scores.masked_fill(torch.arange(seen)[None, None] > positions[None, :, None], float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(rows, q_size)
            attn = F.linear(out, self._p(p + "self_attn.o_proj.weight"), self._bias(p + "self_attn.o_proj.bias"))
            residual = attn + residual
            h = _rms(residual, self._p(p + "post_attention_layernorm.weight"), self.eps)
            gate, up = F.linear(h, self._p(p + "mlp.gate_up_proj.weight")).chunk(2, dim=-1)
            x = F.linear(F.silu(gate) * up, self._p(p + "mlp.down_proj.weight"))
        out = _rms(x + residual, self._p("norm.weight"), self.eps)
        return out[1:] @ self.lm_head.T  # the bonus row is not sampled
