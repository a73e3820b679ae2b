"""A DFlash draft model's modules and its checkpoint layout: :class:`DFlashHead` holds the
weights under the checkpoint's tensor names and computes what the reference computes
(z-lab/dflash at commit 44947fbf71114e241c96de194f4b382b5dd330d0, ``dflash/model.py``:
``DFlashDraftModel``, ``Qwen3DFlashDecoderLayer``, ``Qwen3DFlashAttention``); :func:`load_head`
reads a checkpoint into one. What the drafter does in a round: :mod:`specfx.drafters.heads.dflash`.

The layout (z-lab's published ``*-DFlash*`` checkpoints; safetensors, no remote code)::

    config.json   a Qwen3 config (hidden_size, intermediate_size, num_attention_heads,
                  num_key_value_heads, head_dim, rms_norm_eps, rope_theta / rope_parameters,
                  hidden_act, attention_bias, num_hidden_layers: the draft's layers, layer_types)
                  plus block_size, num_target_layers and
                  dflash_config: {"mask_token_id": ID, "target_layer_ids": [i, ...]}
    fc.weight                                  [H, n_taps * H]
    hidden_norm.weight                         [H]
    layers.{l}.input_layernorm.weight          [H]
    layers.{l}.self_attn.{q,k,v,o}_proj.weight (and .bias with attention_bias)
    layers.{l}.self_attn.{q,k}_norm.weight     [D]
    layers.{l}.post_attention_layernorm.weight [H]
    layers.{l}.mlp.{gate,up,down}_proj.weight
    norm.weight                                [H]

No embedding and no LM head: the draft reads the target's (``target.model.embed_tokens``,
``target.lm_head`` in the reference). ``target_layer_ids`` id i is the *output* of target layer
i (the reference's ``hidden_states[i + 1]``); absent, the reference's
``build_target_layer_ids(num_target_layers, num_hidden_layers)``. transformers' own DFlash
assistant (``MuseGlimmerAssistantModel``, transformers >= 5.24) names the context projection
``encoder.fc`` / ``encoder.output_norm_enc`` and keeps ``block_size``, ``mask_token_id`` and
``target_layer_ids`` at the top of its config: read here too.

What each module computes (a layer of the reference): the context (the target's tapped states,
concatenated in listed order) becomes ``hidden_norm(fc(.))``; a layer's queries come from the
block only (``q_norm`` per head, rotary), its keys and values from the context and the block
alike (the same ``k_proj``/``v_proj``, ``k_norm`` per head on every key, rotary at each token's
position); attention is not causal; then the usual pre-norm residual and SwiGLU MLP; the final
``norm``. Refused with a clear error: sliding-window draft layers (the reference's PyTorch model
applies the window only under flash attention, so what it drafts depends on the backend), rotary
scaling that changes with the sequence length.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from specfx.drafters.heads.checkpoint import LAYER_KEYS, HeadCheckpoint, check_tensors, layer_config
from specfx.model.cache import SlotCache

__all__ = ["KIND", "DFlashHead", "checkpoint_error", "default_layer_ids", "load_head", "read_fields", "serving_gaps"]

KIND = "DFlash"

# transformers' DFlash assistant names -> the reference's
_HF_NAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}

# config.json keys of the draft's Qwen3 layers (mlp_bias: Qwen3's MLP has none; a checkpoint
# with MLP biases is refused by its tensors)
_QWEN3_KEYS = (*(k for k in LAYER_KEYS if k != "mlp_bias"), "num_hidden_layers")


def checkpoint_error(path, what: str) -> ValueError:
    return ValueError(f"{KIND} checkpoint {str(path)!r}: {what}")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's ``build_target_layer_ids``: the middle layer for a one-layer draft, else
    ``num_draft_layers`` ids spread evenly (rounded) from 1 to ``num_target_layers - 3``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def serving_gaps(
    layer_ids: list[int] | None, num_target_layers: int | None, scaled_embedding: bool = False
) -> dict[str, list[str]]:
    """Why vLLM and SGLang could not serve a draft saved with these taps (engine -> reasons;
    decisions 77 and 85 of docs/ARCHITECTURE.md). Both capture the residual stream at a target
    layer's *input* (tap i: the input of layer i + 1), not the reference's state for the last
    layer (its output after the final norm: vLLM 0.33.0 reads it before that norm, SGLang not at
    all); without ``target_layer_ids`` vLLM sizes ``fc`` by the draft's own depth and SGLang takes
    the reference's default over ``num_target_layers``.
    ``scaled_embedding``: the bound target's input-embedding module scales what it looks up
    (Gemma's sqrt(hidden_size) in transformers), which both engines leave out of the block."""
    reasons: list[str] = []
    if layer_ids is None:
        reasons.append(
            "the draft's config names no target_layer_ids and they are unknown until it is bound to its target "
            "(bind it, or load a draft whose config names them, before saving)."
        )
    elif isinstance(num_target_layers, int) and num_target_layers - 1 in layer_ids:
        reasons.append(
            f"target_layer_ids {layer_ids} taps the last target layer ({num_target_layers - 1}): the reference reads "
            f"its output after the target's final norm, these engines the residual stream at a layer's input (tap i: "
            f"the input of layer i + 1), which has no final norm (vLLM 0.33.0 captures the last layer's output before "
            f"the final norm, so it drafts from other states; SGLang captures nothing past the last layer and "
            f"refuses the draft's fc); train on taps below it."
        )
    if scaled_embedding:
        reasons.append(
            "the target's input-embedding module scales the embeddings it looks up (Gemma's sqrt(hidden_size) in "
            "transformers); specfx and the reference embed the draft's block through that module, these engines "
            "with the target's raw embedding table (their Gemma models scale in the model's forward, not in the "
            "table they share with the draft), so the block starts from other embeddings and drafts other tokens; "
            "no config field changes that."
        )
    return {"vLLM": reasons, "SGLang": list(reasons)}


def read_fields(config: dict, where) -> dict:
    """DFlash's own fields of a config.json (z-lab's ``dflash_config`` first, then the top level
    as transformers' assistant writes them): ``block_size``, ``mask_token_id``,
    ``target_layer_ids`` (None: the default, known once the target's depth is) and
    ``num_target_layers`` (or None)."""
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}

    def get(key):
        return nested[key] if nested.get(key) is not None else config.get(key)

    fields = {k: get(k) for k in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers")}
    for key in ("block_size", "mask_token_id"):
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if key == "block_size" else 0):
            raise checkpoint_error(
                where,
                f"config.json needs {key} (an int{', at least 2' if key == 'block_size' else ' token id'}; z-lab writes "
                f"{'block_size at the top' if key == 'block_size' else 'dflash_config.mask_token_id'}), got {value!r}.",
            )
    ids = fields["target_layer_ids"]
    if ids is not None and (
        not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise checkpoint_error(where, f"dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}.")
    return fields


def _qwen3_config(config: dict, where) -> Qwen3Config:
    """The draft's layer config from its config.json (Qwen3's defaults for the optional keys);
    ValueError for what is missing or cannot run as the reference runs it."""
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    qwen3 = layer_config(Qwen3Config, _QWEN3_KEYS, config, lambda what: checkpoint_error(where, what), required)
    types = config.get("layer_types") or []
    if any(t != "full_attention" for t in types) or config.get("use_sliding_window"):
        raise checkpoint_error(
            where,
            f"its layers {types} include sliding-window attention, which the reference's PyTorch model applies only "
            f"under flash attention (its eager and SDPA paths attend to the whole context), so what it drafts depends "
            f"on the backend; specfx runs DFlash drafts with full attention in every layer.",
        )
    return qwen3


class DFlashAttention(nn.Module):
    """A layer's attention: queries from the block, keys and values from the context (written
    to the draft's static KV by :meth:`context_kv`) and from the block, no causal mask."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def _heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return proj(x).view(b, t, -1, self.head_dim)  # [B, T, heads, D]

    def context_kv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values ``[B, kv, T, D]`` of hidden states ``x [B, T, H]``."""
        k = self.k_norm(self._heads(self.k_proj, x)).transpose(1, 2)
        v = self._heads(self.v_proj, x).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, *rope)
        return k, v

    def forward(self, x, rope, keys, values, visible: torch.Tensor, within: torch.Tensor | None = None):
        """``x [B, T, H]`` (the block), the context's ``keys``/``values [B, kv, C, D]`` and which
        of their slots each query sees ``visible [B, 1 or T, C]`` -> ``[B, T, H]``. The block's
        queries see all of it (inference), or where ``within [T, T]`` (training: several
        blocks side by side, each seeing itself only)."""
        b, t, _ = x.shape
        q = self.q_norm(self._heads(self.q_proj, x)).transpose(1, 2)  # [B, h, T, D]
        k, v = self.context_kv(x, rope)  # the block's own keys and values [B, kv, T, D]
        q, _ = apply_rotary_pos_emb(q, q, *rope)
        group, d, kv = self.heads // self.kv_heads, self.head_dim, self.kv_heads
        # grouped queries as rows of their KV head: no copy of the (large) cached keys
        qg = q.reshape(b, kv, group * t, d) * d**-0.5
        s_ctx = (qg @ keys.transpose(-1, -2)).view(b, kv, group, t, -1)  # [B, kv, g, T, C]
        s_ctx = s_ctx.masked_fill(~visible[:, None, None], float("-inf")).view(b, kv, group * t, -1)
        s_blk = qg @ k.transpose(-1, -2)  # [B, kv, gT, T]: bidirectional within the block
        if within is not None:
            s_blk = s_blk.view(b, kv, group, t, t).masked_fill(~within, float("-inf")).view(b, kv, group * t, t)
        p = torch.cat([s_ctx, s_blk], dim=-1).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        c = keys.shape[2]
        out = p[..., :c] @ values + p[..., c:] @ v  # [B, kv, gT, D]
        out = out.view(b, self.heads, t, d).transpose(1, 2).reshape(b, t, self.heads * d)
        return self.o_proj(out)


class DFlashLayer(nn.Module):
    """``Qwen3DFlashDecoderLayer``: pre-norm attention and MLP, each with its residual."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Qwen3RMSNorm(h, eps=eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(h, eps=eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, rope, keys, values, visible, within=None):
        h = x + self.self_attn(self.input_layernorm(x), rope, keys, values, visible, within)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    """The draft model's weights in the reference's names (see the module docstring), built
    from its config.json dict; ``fields`` are DFlash's own (:func:`read_fields`)."""

    def __init__(self, config: dict, fields: dict, num_taps: int, where=KIND):
        super().__init__()
        qwen3 = _qwen3_config(config, where)
        self.config, self.fields, self.qwen3 = dict(config), dict(fields), qwen3
        h = qwen3.hidden_size
        self.hidden_size, self.num_taps = h, num_taps
        self.block_size, self.mask_token_id = int(fields["block_size"]), int(fields["mask_token_id"])
        self.layers = nn.ModuleList(DFlashLayer(qwen3) for _ in range(qwen3.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=qwen3.rms_norm_eps)
        self.fc = nn.Linear(num_taps * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=qwen3.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3)  # inv_freq: a non-persistent buffer

    def context(self, states: torch.Tensor) -> torch.Tensor:
        """The target's tapped states, concatenated ``[B, T, n_taps * H]`` -> ``[B, T, H]``."""
        return self.hidden_norm(self.fc(states))

    def write_context(self, context: torch.Tensor, positions: torch.Tensor, cache: SlotCache) -> None:
        """Every layer's keys and values of ``context [B, T, H]`` at ``positions [B, T]``, into
        ``cache`` at its current slots."""
        rope = self.rotary_emb(context, positions)
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            kv.update(*layer.self_attn.context_kv(context, rope))

    def block(self, noise: torch.Tensor, positions: torch.Tensor, cache: SlotCache, visible: torch.Tensor):
        """The block's output ``[B, T, H]`` (after ``norm``) from its embeddings ``noise [B, T, H]``
        at ``positions [B, T]``, attending to the cached context where ``visible [B, C]``."""
        rope = self.rotary_emb(noise, positions)
        x = noise
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            x = layer(x, rope, kv.keys, kv.values, visible.unsqueeze(1))
        return self.norm(x)

    def blocks(self, noise, positions, context, context_positions, visible, within):
        """Training's forward: several blocks side by side (``noise [B, N*n, H]`` at
        ``positions``) over a context computed here (``context [B, T, H]`` at
        ``context_positions [B, T]``), each query seeing the context where ``visible
        [B, N*n, T]`` and the blocks where ``within [N*n, N*n]`` -> ``[B, N*n, H]``."""
        rope, ctx_rope = self.rotary_emb(noise, positions), self.rotary_emb(context, context_positions)
        x = noise
        for layer in self.layers:
            keys, values = layer.self_attn.context_kv(context, ctx_rope)
            x = layer(x, rope, keys, values, visible, within)
        return self.norm(x)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


def load_head(ckpt: HeadCheckpoint) -> DFlashHead:
    """The :class:`DFlashHead` of a checkpoint in the reference's layout (or transformers'
    names for the context projection); ValueError for what is missing or inconsistent."""
    tensors = {_HF_NAMES.get(k, k): v for k, v in ckpt.tensors.items()}
    fields = read_fields(ckpt.config, ckpt.path)
    if "fc.weight" not in tensors:
        check_tensors(HeadCheckpoint(ckpt.path, ckpt.config, tensors), KIND, {"fc.weight": ()})
    h = ckpt.config.get("hidden_size")
    width = tensors["fc.weight"].shape[-1]
    if not isinstance(h, int) or isinstance(h, bool) or h < 1 or width % h:
        raise checkpoint_error(ckpt.path, f"fc.weight takes {width} inputs, not a multiple of hidden_size {h!r}.")
    num_taps = width // h
    ids = fields["target_layer_ids"]
    if ids is not None and len(ids) != num_taps:
        raise checkpoint_error(
            ckpt.path,
            f"fc.weight takes {num_taps} target hidden states but target_layer_ids names {len(ids)}: {ids}.",
        )
    head = DFlashHead(ckpt.config, fields, num_taps, ckpt.path)
    expected = {n: tuple(t.shape) for n, t in head.state_dict().items()}
    check_tensors(HeadCheckpoint(ckpt.path, ckpt.config, tensors), KIND, expected)
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise checkpoint_error(
            ckpt.path,
            f"it has tensors the DFlash layout does not define: {', '.join(extra[:6])}; a layout specfx does not "
            f"implement would draft something else than its reference.",
        )
    head.load_state_dict({n: tensors[n] for n in expected})
    return head.eval()
