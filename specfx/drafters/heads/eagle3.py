"""EAGLE-3 draft heads: ``draft="eagle3:DIR"`` / ``specfx.drafters.heads.eagle3.Eagle3(DIR)``.

An EAGLE-3 head (Li et al. 2025; SafeAILab's ``eagle/model/cnets.py``, vLLM's
``Eagle3LlamaForCausalLM``, SpecForge's ``LlamaForCausalLMEagle3``) is one Llama-style decoder
layer that drafts from three of the target's hidden states, a low, a middle and a high one:

* ``fc``: ``Linear(3 * target_hidden -> hidden, no bias)`` over ``cat[low; mid; high]``, the
  *inputs* of three target decoder layers, concatenated in layer order. The result is the
  feature of a committed position.
* ``midlayer``: at position t, the token embedding ``e_t`` and the feature ``f`` of position
  ``t - 1`` (the fused target feature for committed positions, the head's own output for
  drafted ones) make ``x = cat[input_layernorm(e_t); hidden_norm(f)]`` (2H); attention reads
  q, k, v from x (rotary on q and k, from the head's own config); the residual stream starts
  at ``f``; then ``post_attention_layernorm`` and a SwiGLU MLP with their residual.
* the output ``o_t`` predicts the token at ``t + 1`` through ``lm_head(norm(o_t))`` over a
  *draft vocabulary* of ``draft_vocab_size`` ids, and ``o_t`` itself, *before* ``norm``, is
  the feature the next draft step reads (SafeAILab's ``topK_genrate`` and training loop,
  vLLM's ``hidden_prenorm``).
* draft id ``d`` is target id ``d + d2t[d]``; ``t2d`` (bool over the target vocabulary) marks
  the ids in the draft vocabulary. specfx maps the draft logits onto the target vocabulary in
  the graph (-inf elsewhere), so q is a distribution over the target's ids, zero outside the
  draft vocabulary, and sampling stays lossless.

Which target layers (the taps). Three conventions are in use:

* vLLM reads ``eagle_aux_hidden_state_layer_ids`` at the top of the head's config.json: id k
  is the hidden state *entering* decoder layer k (HF's ``output_hidden_states[k]``; k == L,
  the number of target layers, is the last layer's output before the final norm);
* SpecForge and SGLang read ``eagle_config.eagle_aux_hidden_state_layer_ids``: id i is the
  *output* of layer i, i.e. the input of layer ``i + 1`` (SpecForge's default ``[1, L//2 - 1,
  L - 4]`` is the same three states as the others' defaults);
* absent both: the inputs of layers ``2, L // 2, L - 3`` (SafeAILab's, vLLM's and SGLang's
  default; SafeAILab's code reads no key and always uses it).

specfx reads the top-level key first, then the nested one (adding 1, as SGLang and SpecForge,
which write that key, mean it), then the default. The states are concatenated for ``fc`` in the
order listed, repeats included: a target of fewer than 7 layers has a default that repeats a
layer (L = 4: ``[2, 2, 1]``, L = 6: ``[2, 3, 3]``), which SpecForge's HF capture trains on as listed. ids that are out
of range are refused, and so are distinct ids out of ascending order: engines that capture each
layer once (SafeAILab, vLLM, SGLang) concatenate in layer order, SpecForge's HF capture in the
order listed, so the order the head was trained in is unknown. :meth:`Eagle3.save` writes both
keys, each in its reader's convention, so vLLM and SGLang read the same layers; taps that
repeat, descend, or include the embeddings (id 0, SGLang) or the last layer's output (id L)
cannot be captured by those engines and are saved with a warning (docs/HEADS.md).

The head's layer is Llama-style whatever the target (Gemma, Mixtral, ...), sized by its own
config.json, as every trainer builds it. Supported variant: vLLM's ``norm_before_residual``
(the residual stream starts at ``hidden_norm(f)``). Refused with a clear error: more than one
layer, SpecForge's ``fc_norm`` and ``norm_output=false``, ``norm_before_fc``, rotary scaling
that changes with the sequence length (dynamic, longrope).

Tensors (safetensors; ``layers.0.`` is accepted for ``midlayer.``)::

    fc.weight                                   [H, 3 * H_target]
    midlayer.input_layernorm.weight             [H]   (on the token embedding)
    midlayer.hidden_norm.weight                 [H]   (on the feature)
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * D, 2H], [kv_heads * D, 2H]
    midlayer.self_attn.o_proj.weight            [H, heads * D]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [V_draft, H]
    d2t [V_draft] int64, t2d [V] bool           (optional when V_draft == V)
    embed_tokens.weight                         [V, H]  (optional)

Embeddings: the target's input embedding table, shared (never copied) and looked up raw, as
SafeAILab and vLLM do (no model-specific scaling such as Gemma's sqrt(H)). A checkpoint's own
``embed_tokens.weight`` is used only when it differs from the target's (a head whose hidden
size differs from the target's must bring its own); an identical copy is dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specfx.model.cache import SlotCache
from specfx.model.runner import ModelRunner
from specfx.drafters.heads.eagle_base import EagleBase
from specfx.drafters.heads.eagle_checkpoint import rope_keys
from specfx.drafters.heads.checkpoint import HeadCheckpoint, check_tensors, read_head, warn_engine_gaps, write_head

logger = logging.getLogger(__name__)

__all__ = ["Eagle3", "Eagle3Head", "from_name", "resolve_taps"]

KIND = "EAGLE-3"

# config.json keys of the head's Llama layer (the rest of the file is EAGLE-3's own or ignored)
_LLAMA_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
    "mlp_bias", "vocab_size",
)  # fmt: skip
# Layout variants some trainers write that specfx does not implement: key -> (value that is
# the plain layout, what the variant does)
_VARIANTS = {
    "fc_norm": (False, "an RMSNorm on each tapped state before fc (SpecForge)"),
    "norm_before_fc": (False, "an RMSNorm on the tapped states before fc"),
    "norm_output": (True, "the LM head on the un-normalised output (SpecForge's norm_output=false)"),
}


def _error(path, what: str) -> ValueError:
    return ValueError(f"{KIND} checkpoint {str(path)!r}: {what}")


# ------------------------------------------------------------------------------ the layer
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


# ------------------------------------------------------------------------------ the taps
def resolve_taps(config: dict, num_layers: int, where: str = "the head's config.json") -> tuple[str, ...]:
    """The target hidden states an EAGLE-3 head with ``config`` reads from a target of
    ``num_layers`` decoder layers, in the order ``fc`` concatenates them (repeats included), as
    :class:`~specfx.drafters.base.Drafter` tap names (``"layer:k"``: the input of layer k; ``"last"``:
    the last layer's output, before the final norm). See the module docstring for the three
    conventions; ValueError for ids that cannot be used."""
    nested = config.get("eagle_config")
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids, key, shift = config["eagle_aux_hidden_state_layer_ids"], "eagle_aux_hidden_state_layer_ids", 0
    elif isinstance(nested, dict) and nested.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids, key, shift = nested["eagle_aux_hidden_state_layer_ids"], "eagle_config.eagle_aux_hidden_state_layer_ids", 1
    else:
        ids, key, shift = [2, num_layers // 2, num_layers - 3], None, 0
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{KIND}: {key} in {where} must be a list of layer ids (ints), got {ids!r}.")
    inputs = [i + shift for i in ids]  # the boundary index: HF's output_hidden_states[k]
    meaning = "the output of layer i (SpecForge/SGLang)" if shift else "the input of decoder layer k (vLLM)"
    name = f"{key} = {list(ids)}" if key else f"the default taps (the inputs of layers 2, L // 2 and L - 3 = {inputs})"
    if key is None and min(inputs) < 0:
        raise ValueError(
            f"{KIND}: the target has {num_layers} decoder layers, too few for {name}. Name the layers the head was "
            f'trained on in {where}: "eagle_aux_hidden_state_layer_ids": [k1, k2, k3] (k: {meaning}).'
        )
    if any(k < 0 or k > num_layers for k in inputs):
        raise ValueError(
            f"{KIND}: {name} in {where} names target layers out of range; the target has "
            f"{num_layers} decoder layers (each id is {meaning}, so the ids must lie in "
            f"{0 - shift}..{num_layers - shift}). Was the head trained for another target?"
        )
    if len(set(inputs)) == len(inputs) and any(a >= b for a, b in zip(inputs, inputs[1:], strict=False)):
        raise ValueError(
            f"{KIND}: {name} {'for this target' if key is None else 'in ' + where} lists distinct layers out of "
            f"ascending order; engines that capture each layer once (SafeAILab, vLLM, SGLang) concatenate their "
            f"states in layer order, SpecForge's HF capture in the order listed, so specfx cannot tell which order "
            f'the head was trained with. Name them in {where} in that order: "eagle_aux_hidden_state_layer_ids": '
            f"[k1, k2, k3] (k: {meaning}; ascending if trained by SafeAILab, vLLM or SGLang)."
        )
    return tuple("last" if k == num_layers else f"layer:{k}" for k in inputs)


def _explicit_ids(config: dict) -> list[int] | None:
    """The tap ids ``config`` names, in vLLM's convention (top-level key, else the nested key
    plus 1), or None when it names none (the default)."""
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    key = "eagle_aux_hidden_state_layer_ids"
    for ids, shift in ((config.get(key), 0), (nested.get(key), 1)):
        if isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return [i + shift for i in ids]
        if ids is not None:
            return None  # malformed: resolve_taps says so at bind
    return None


def _captured_once(ids: list[int], num_layers: int | None, first: int) -> list[int]:
    """The boundaries an engine that captures, in one pass over the target's layers, the input
    of every layer whose index is in ``ids`` (from layer ``first`` on) gets: each once, in layer
    order, never the last layer's output (vLLM's and SGLang's capture)."""
    last = num_layers if num_layers is not None else max(ids) + 1
    return sorted({k for k in ids if first <= k < last})


# ------------------------------------------------------------------------------ the head
def _llama_config(config: dict, where) -> LlamaConfig:
    """The head's decoder layer config (sizes, norm epsilon, activation, rotary, the target
    vocabulary's size) from its config.json, with Llama's defaults for the optional keys.
    ValueError for what is missing or cannot run inside a round."""
    for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _error(where, f"config.json needs a positive int {name}, got {value!r}.")
    kw = {k: config[k] for k in _LLAMA_KEYS if config.get(k) is not None}
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    if kw["num_attention_heads"] % kw["num_key_value_heads"]:
        raise _error(
            where,
            f"num_attention_heads {kw['num_attention_heads']} is not a multiple of num_key_value_heads {kw['num_key_value_heads']}.",
        )
    llama = LlamaConfig(**kw)
    rope_type = (llama.rope_parameters or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise _error(
            where,
            f"rotary scaling {rope_type!r} changes with the sequence length (a host-side decision per "
            f"forward), which a compiled round cannot make; heads with default, linear, llama3 or yarn rotary work.",
        )
    return llama


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


def _rename(name: str) -> str:
    """vLLM's converted checkpoints name the midlayer ``layers.0``."""
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def load_head(ckpt: HeadCheckpoint) -> tuple[Eagle3Head, torch.Tensor | None]:
    """The head in ``ckpt`` (checked against its own config: every tensor of the layout with
    its shape, the vocabulary mapping) and its own ``embed_tokens.weight`` if it has one."""
    where, config = ckpt.path, ckpt.config
    if not config:
        raise _error(where, "has no config.json (the head's sizes, vocabularies and tapped layers are read from it).")
    for key, (plain, what) in _VARIANTS.items():
        if key in config and bool(config[key]) != plain:
            raise _error(
                where, f"sets {key}={config[key]!r}: {what}, a variant of the EAGLE-3 layout specfx does not implement."
            )
    layer_types = config.get("layer_types")
    if layer_types and layer_types[0] != "full_attention":
        raise _error(where, f"its layer is {layer_types[0]!r}; specfx runs EAGLE-3 heads with full attention only.")
    tensors = {_rename(n): t for n, t in ckpt.tensors.items()}
    deeper = sorted({n.split(".")[1] for n in tensors if n.startswith("layers.")})
    layers = config.get("num_hidden_layers", 1)
    if deeper or layers != 1:
        raise _error(
            where,
            f"has {layers} decoder layers (tensors under layers.{', layers.'.join(deeper) or '1'}); "
            f"specfx runs EAGLE-3 heads with one layer (midlayer, or layers.0), the layout SafeAILab and SpecForge train.",
        )
    target_hidden = int(config.get("target_hidden_size") or config.get("hidden_size") or 0)
    fc = tensors.get("fc.weight")
    taps = (
        fc.shape[1] // target_hidden
        if fc is not None and fc.dim() == 2 and target_hidden and fc.shape[1] % target_hidden == 0
        else 3
    )
    head = Eagle3Head(config, num_taps=taps, where=f"{KIND} checkpoint {str(where)!r}")
    expected = head.expected_shapes()
    why = {
        "fc.weight": f"[hidden_size, {taps} tapped states x target_hidden_size {head.target_hidden_size}]",
        "lm_head.weight": f"[draft_vocab_size {head.draft_vocab_size}, hidden_size]",
    }
    own = tensors.get("embed_tokens.weight")
    if own is not None:
        expected["embed_tokens.weight"] = (head.vocab_size, head.hidden_size)
        why["embed_tokens.weight"] = f"[vocab_size {head.vocab_size}, hidden_size {head.hidden_size}]"
    check_tensors(HeadCheckpoint(where, config, tensors), KIND, expected, why)
    unknown = sorted(set(tensors) - set(expected) - {"d2t", "t2d"})
    if unknown:
        logger.warning(
            "%s checkpoint %r: ignoring tensors outside the layout: %s", KIND, str(where), ", ".join(unknown)
        )
    d2t, t2d = _vocab_map(head, tensors.get("d2t"), tensors.get("t2d"), where)
    state = {n: tensors[n] for n in expected if n != "embed_tokens.weight"}
    head.load_state_dict({**state, "d2t": d2t, "t2d": t2d})
    return head, own


def _vocab_map(head: Eagle3Head, d2t, t2d, where) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [V_draft] int64, t2d [V] bool)`` checked: every draft id maps to a distinct target
    id in range, and ``t2d`` (when given) marks exactly those. Absent, both are the identity
    (allowed only when the draft vocabulary is the target's)."""
    vd, v = head.draft_vocab_size, head.vocab_size
    if vd > v:
        raise _error(where, f"draft_vocab_size {vd} exceeds vocab_size {v}.")
    if d2t is None:
        if vd != v:
            raise _error(
                where,
                f"has a draft vocabulary of {vd} ids for a target vocabulary of {v} but no d2t tensor mapping them.",
            )
        d2t = torch.zeros(vd, dtype=torch.long)
    if d2t.shape != (vd,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise _error(
            where,
            f"d2t must be an integer tensor of shape [{vd}] (draft_vocab_size), got {d2t.dtype} {list(d2t.shape)}.",
        )
    ids = torch.arange(vd) + d2t.long()
    if vd and (int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().numel() != vd):
        raise _error(
            where, f"d2t maps draft ids outside the target vocabulary of {v} ids, or two draft ids to one target id."
        )
    mapped = torch.zeros(v, dtype=torch.bool)
    mapped[ids] = True
    if t2d is not None and (t2d.shape != (v,) or not torch.equal(t2d.bool(), mapped)):
        raise _error(
            where,
            f"t2d (shape {list(t2d.shape)}) does not mark exactly the {vd} target ids d2t maps to; the "
            f"vocabulary mapping is inconsistent (vocab_size {v}).",
        )
    return d2t.long(), mapped


# ------------------------------------------------------------------------------ the drafter
class Eagle3(EagleBase):
    """An EAGLE-3 head as the drafter (the layout and the taps in the module docstring; the
    cache protocol in :mod:`specfx.drafters.heads.eagle`).

    Args:
        path: a local directory holding the head's ``config.json`` and safetensors weights
            (SafeAILab, SpecForge or vLLM layout), or one ``.safetensors`` file with a
            ``config.json`` beside it.

    ``Eagle3.random(target, draft_vocab_size=...)`` makes a random head for ``target`` (tests,
    training), :meth:`save` writes the layout back. The head's own parameters follow the
    target's device and dtype at bind; the embedding table is the target's, shared.
    """

    name = "eagle3"

    def __init__(self, path: str | Path):
        if path is None or (isinstance(path, str) and not path.strip()):
            raise ValueError(
                "Eagle3(path): path is required: the directory of an EAGLE-3 head checkpoint (config.json and "
                "*.safetensors, as SafeAILab, SpecForge or vLLM write them), e.g. "
                "specfx.drafters.heads.eagle3.Eagle3('/models/EAGLE3-LLaMA3.1-8B') or draft='eagle3:/models/EAGLE3-LLaMA3.1-8B'."
            )
        ckpt = read_head(path, KIND)
        head, own = load_head(ckpt)
        self._init(head, own, str(ckpt.path))

    def _init(self, head: Eagle3Head, own_embedding: torch.Tensor | None, where: str) -> None:
        self.head = head.eval()
        self.own_embedding = own_embedding  # decided at bind: used only if it differs from the target's
        self.where = where
        self.embed_weight: torch.Tensor | None = None
        self.vocab_index: torch.Tensor | None = None
        self.num_target_layers: int | None = None  # known after random() or binding
        self.layer_ids: list[int] | None = None  # the taps in fc's order, vLLM's convention (after binding)
        self.tap_order: list[int] | None = None  # fc's i-th state is features[tap_order[i]] (taps deduplicated)

    def __repr__(self) -> str:
        return f"Eagle3({self.where!r})"

    @classmethod
    def random(
        cls,
        target,
        draft_vocab_size: int | None = None,
        seed: int = 0,
        layer_ids=None,
        std: float | None = None,
        *,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
    ) -> Eagle3:
        """A head for ``target`` (an HF causal LM) with seeded random weights: the target's
        sizes and rotary settings, a draft vocabulary of ``draft_vocab_size`` target ids (a
        seeded random subset, in increasing order; default: the whole vocabulary), taps at
        ``layer_ids`` (vLLM's convention: the inputs of those decoder layers; default the
        inputs of layers 2, L // 2, L - 3). ``std`` defaults to the target's
        ``initializer_range``; norms are 1. For tests and as a start for training: its drafts
        are meaningless until trained.

        A narrower decoder layer than the target's: ``intermediate_size`` (MLP width),
        ``num_attention_heads`` and ``num_key_value_heads`` (each head keeps the target's
        ``head_dim``; the key/value heads default to the target's when they divide the query
        heads, else to the query heads). The hidden size stays the target's: the head reads
        the target's token embeddings, and a narrower one would need its own table. All are
        written to config.json. vLLM and SGLang read ``head_dim`` there; SafeAILab's code derives
        it as ``hidden_size / num_attention_heads`` and cannot load a head whose heads keep the
        target's ``head_dim`` while there are fewer of them (saved with a warning)."""
        model = target.model if isinstance(target, ModelRunner) else target
        tc = model.config.get_text_config()
        vocab = model.get_output_embeddings().weight.shape[0]
        vd = vocab if draft_vocab_size is None else int(draft_vocab_size)
        if not 1 <= vd <= vocab:
            raise ValueError(
                f"Eagle3.random: draft_vocab_size must be in 1..{vocab} (the target's vocabulary), got {vd}."
            )
        for name, value in (("intermediate_size", intermediate_size), ("num_attention_heads", num_attention_heads),
                            ("num_key_value_heads", num_key_value_heads)):  # fmt: skip
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Eagle3.random: {name} must be a positive int, got {value!r}.")
        heads = num_attention_heads or tc.num_attention_heads
        target_kv = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
        kv_heads = num_key_value_heads or (target_kv if target_kv <= heads and heads % target_kv == 0 else heads)
        if heads % kv_heads:
            raise ValueError(
                f"Eagle3.random: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}; "
                f"choose key/value heads that divide the query heads (e.g. num_key_value_heads=1)."
            )
        layers = tc.num_hidden_layers
        ids = list(layer_ids) if layer_ids is not None else [2, layers // 2, layers - 3]
        config = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": tc.hidden_size,
            "intermediate_size": intermediate_size or getattr(tc, "intermediate_size", None)
            or getattr(tc, "n_inner", None) or 4 * tc.hidden_size,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            "hidden_act": "silu", "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
            "max_position_embeddings": getattr(tc, "max_position_embeddings", 2048),
            **rope_keys(tc), "vocab_size": vocab, "draft_vocab_size": vd, "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": ids,
        }  # fmt: skip
        resolve_taps(config, layers, "Eagle3.random(layer_ids=...)")
        head = Eagle3Head(config)
        std = float(getattr(tc, "initializer_range", 0.02)) if std is None else std
        g = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(vocab, generator=g)[:vd].sort().values
        with torch.no_grad():
            for p in head.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
            head.d2t.copy_(chosen - torch.arange(vd))
            head.t2d.zero_()
            head.t2d[chosen] = True
        drafter = cls.__new__(cls)
        drafter._init(head, None, f"Eagle3.random(seed={seed})")
        drafter.num_target_layers = layers
        return drafter

    def save(self, path: str | Path) -> Path:
        """Write the head to directory ``path`` (``config.json`` and ``model.safetensors``) in the
        layout :class:`Eagle3` (``draft="eagle3:DIR"``), SafeAILab's EAGLE, SpecForge, vLLM and
        SGLang read (docs/HEADS.md). The tapped layers, when known (given, or resolved by binding
        to a target), are written twice, so vLLM and SGLang read the same ones: at the top
        (``eagle_aux_hidden_state_layer_ids``, vLLM's convention: layer inputs) and in
        ``eagle_config`` (SGLang's and SpecForge's: layer outputs, each id one less). A head some
        engine would not run as specfx does is saved with a
        :class:`~specfx.drafters.heads.checkpoint.HeadLayoutWarning` naming it (:meth:`engine_gaps`)."""
        head = self.head
        config = dict(
            head.config, num_hidden_layers=1, draft_vocab_size=head.draft_vocab_size, vocab_size=head.vocab_size
        )
        if head.target_hidden_size != head.hidden_size:
            config["target_hidden_size"] = head.target_hidden_size
        else:  # SafeAILab loads the target's embedding only when target_hidden_size is absent
            config.pop("target_hidden_size", None)
        ids = self.layer_ids if self.layer_ids is not None else _explicit_ids(config)
        if ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(ids)
            nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
            config["eagle_config"] = {**nested, "eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids]}
        tensors = head.tensors()
        if head.embed_tokens is not None:
            tensors["embed_tokens.weight"] = head.embed_tokens.weight
        elif self.own_embedding is not None:
            tensors["embed_tokens.weight"] = self.own_embedding
        config["torch_dtype"] = str(head.fc.weight.dtype).removeprefix("torch.")
        warn_engine_gaps(KIND, path, self.engine_gaps())
        return write_head(path, config, tensors)

    def engine_gaps(self) -> dict[str, list[str]]:
        """Why each engine (``"SafeAILab's EAGLE"``, ``"vLLM"``, ``"SGLang"``) would not draft
        with this head, saved by :meth:`save`, what specfx drafts: engine -> reasons (empty
        lists where it would). The rules are in docs/HEADS.md; the taps are checked against the
        target's depth once it is known (after :meth:`random` or binding)."""
        head, config = self.head, self.head.config
        llama = head.llama
        gaps: dict[str, list[str]] = {"SafeAILab's EAGLE": [], "vLLM": [], "SGLang": []}
        L = self.num_target_layers
        ids = self.layer_ids if self.layer_ids is not None else _explicit_ids(config)
        listed = ids if ids is not None else ([2, L // 2, L - 3] if L is not None else None)
        if listed is not None:
            for engine, first in (("vLLM", 0), ("SGLang", 1)):
                got = _captured_once(listed, L, first)
                if got != list(listed):
                    why = ""
                    if engine == "SGLang" and 0 in listed:
                        why = "id 0 (the embeddings) cannot be captured: its layer-0 capture adds a missing residual; "
                    gaps[engine].append(
                        f"{why}it captures the input of each listed layer once, in layer order, and never the last "
                        f"layer's output, so it would feed fc the states of layers {got} instead of {list(listed)} "
                        f"(top-level eagle_aux_hidden_state_layer_ids, vLLM's convention)."
                    )
        if listed is not None:
            depth = L if L is not None else listed[-1] + 3  # target unknown: the one depth whose default it could be
            fixed = _captured_once([2, depth // 2, depth - 3], depth, 0)
            if fixed != list(listed):
                which = f"{fixed} for this {L}-layer target" if L is not None else "for no target depth"
                gaps["SafeAILab's EAGLE"].append(
                    f"it reads no tap ids and always feeds fc the inputs of layers 2, L // 2, L - 3, each once in "
                    f"layer order; those are not {list(listed)} ({which})."
                )
        h, heads, d = llama.hidden_size, llama.num_attention_heads, llama.head_dim
        if d * heads != h:
            gaps["SafeAILab's EAGLE"].append(
                f"it derives head_dim = hidden_size / num_attention_heads = {h // heads} and ignores head_dim ({d} "
                f"here), so its q_proj is [{h}, {2 * h}] where this head's is [{heads * d}, {2 * h}]: it cannot load "
                f"this head (train without --num-attention-heads to serve it there)."
            )
        if "rope_scaling" in rope_keys(config) or config.get("rope_scaling"):
            gaps["SafeAILab's EAGLE"].append(
                "its config takes rope_scaling only as {'type': 'linear' | 'dynamic', 'factor': f}, and its layer "
                "then uses base 10000, not rope_theta."
            )
        if config.get("norm_before_residual"):
            for engine in ("SafeAILab's EAGLE", "SGLang"):
                gaps[engine].append("it ignores norm_before_residual (its residual starts at the unnormed feature).")
        if getattr(llama, "attention_bias", False):
            gaps["SafeAILab's EAGLE"].append("its attention has no biases (load_state_dict(strict=False) drops them).")
            gaps["SGLang"].append("its EAGLE-3 q/k/v projection has no bias.")
        if getattr(llama, "mlp_bias", False):
            gaps["SafeAILab's EAGLE"].append("its MLP has no biases.")
            gaps["SGLang"].append("its Llama MLP has no biases.")
        if llama.hidden_act != "silu":
            for engine in ("vLLM", "SGLang"):
                gaps[engine].append(f"its Llama MLP supports hidden_act 'silu' only, not {llama.hidden_act!r}.")
        return gaps

    # ----------------------------------------------------------------- binding
    def _bind(self, target: ModelRunner) -> None:
        head, model = self.head, target.model
        tc = model.config.get_text_config()
        owner = f"{KIND} head {self.where!r}"
        if head.target_hidden_size != tc.hidden_size:
            raise ValueError(
                f"{owner} reads target hidden states of size {head.target_hidden_size} (target_hidden_size; fc takes "
                f"{head.num_taps} x {head.target_hidden_size}), but this target ({type(model).__name__}) has hidden size "
                f"{tc.hidden_size}; use the head trained for this target."
            )
        if head.vocab_size not in (target.vocab_size, target.config_vocab_size):
            raise ValueError(
                f"{owner} maps its draft vocabulary into a target vocabulary of {head.vocab_size} ids (vocab_size, "
                f"t2d), but this target ({type(model).__name__}) has {target.vocab_size}; use the head trained for "
                f"this target's tokenizer."
            )
        taps = resolve_taps(head.config, target.num_layers, f"{owner}'s config.json")
        if len(taps) != head.num_taps:
            raise ValueError(
                f"{owner}: its fc takes {head.num_taps} target hidden states but its config names {len(taps)} layers "
                f"(eagle_aux_hidden_state_layer_ids); the checkpoint is inconsistent."
            )
        self.taps = tuple(dict.fromkeys(taps))  # the target returns each tapped state once
        self.tap_order = [self.taps.index(t) for t in taps]
        self.layer_ids = [target.num_layers if t == "last" else int(t[6:]) for t in taps]
        self.num_target_layers = target.num_layers
        table = model.get_input_embeddings().weight  # [V, H_target], shared
        own = head.embed_tokens.weight.detach() if head.embed_tokens is not None else self.own_embedding
        if (
            own is not None
            and own.shape == table.shape
            and torch.equal(own.to(table.device, table.dtype), table.detach())
        ):
            own = None  # a copy of the target's table (SafeAILab freezes it in training): share the target's
        if own is None and table.shape[1] != head.hidden_size:
            raise ValueError(
                f"{owner} has hidden size {head.hidden_size} but the target's embedding has {table.shape[1]} columns; "
                f"such a head must bring its own embed_tokens.weight, and this checkpoint has none."
            )
        if own is not None:
            head.use_own_embedding(own)
        else:
            head.embed_tokens = None
        self.own_embedding = None  # now the head's, or dropped for the target's
        self._follow_target()
        device, vocab, vd = target.device, target.vocab_size, head.draft_vocab_size
        targets = head.target_ids()
        if vd == vocab and torch.equal(targets, torch.arange(vocab, device=device)):
            self.vocab_index = None  # the draft vocabulary is the target's
        else:  # target id -> its draft id, or vd: the -inf column _logits appends
            index = torch.full((vocab,), vd, dtype=torch.long, device=device)
            index[targets] = torch.arange(vd, device=device)
            self.vocab_index = index
        self.state_size = head.hidden_size

    def _follow_target(self) -> None:
        """The head's own parameters on the target's device and in its dtype (the rotary
        frequencies stay float32); the embedding table is the target's, or the head's own."""
        head, device, dtype = self.head, self.target.device, self.target.dtype
        for module in (head.fc, head.midlayer, head.norm, head.lm_head, head.embed_tokens):
            if module is not None:
                module.to(device=device, dtype=dtype)
        head.rotary_emb.to(device=device)
        head.d2t, head.t2d = head.d2t.to(device), head.t2d.to(device)
        if self.vocab_index is not None:
            self.vocab_index = self.vocab_index.to(device)
        own = head.embed_tokens
        self.embed_weight = own.weight if own is not None else self.target.model.get_input_embeddings().weight

    def _allocate_kv(self, batch_size: int, capacity: int) -> None:
        self._follow_target()  # the generator reallocates after model.to(dtype or device)
        super()._allocate_kv(batch_size, capacity)

    # ----------------------------------------------------------------- the head
    def _feature(self, features):
        fc = self.head.fc
        states = [features[i] for i in self.tap_order]  # fc's order, repeats included
        return fc(torch.cat(states, dim=-1).to(fc.weight.dtype))  # [B, T, 3 H_target] -> [B, T, H]

    def _entry(self, ids, feature, positions, slots, tree):
        head = self.head
        self.cache.slots = slots
        emb = F.embedding(ids, self.embed_weight).to(feature.dtype)  # [B, T, H], raw lookup
        rope = head.rotary_emb(feature, positions)  # cos, sin [B, T, D]
        return head.midlayer(emb, feature, rope, self._entry_mask(positions, tree), self.cache)

    def _logits(self, out):
        head = self.head
        logits = head.lm_head(head.norm(out))  # [B, T, V_draft]
        if self.vocab_index is None:
            return logits
        # onto the target's vocabulary: ids outside the draft vocabulary get -inf (q = 0 there)
        return F.pad(logits, (0, 1), value=float("-inf")).index_select(-1, self.vocab_index)  # [B, T, V]


def from_name(arg: str | None) -> Eagle3:
    """``draft="eagle3:DIR"``: an EAGLE-3 head loaded from checkpoint directory DIR."""
    if not arg:
        raise ValueError(
            "draft='eagle3' needs the head's checkpoint directory after a colon: draft='eagle3:DIR' (an EAGLE-3 head: "
            "config.json and *.safetensors, as SafeAILab, SpecForge or vLLM write them)."
        )
    return Eagle3(arg)
