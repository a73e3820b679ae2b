"""EAGLE-3 heads' checkpoint layout: which target layers a head reads (:func:`resolve_taps`),
reading a checkpoint into an :class:`~specfx.drafters.heads.eagle3_head.Eagle3Head`
(:func:`load_head`), and what each serving engine would make of a saved head (:func:`engine_gaps`;
docs/HEADS.md).

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
order listed, so the order the head was trained in is unknown. ``Eagle3.save`` writes both
keys, each in its reader's convention, so vLLM and SGLang read the same layers; taps that
repeat, descend, or include the embeddings (id 0, SGLang) or the last layer's output (id L)
cannot be captured by those engines and are saved with a warning (docs/HEADS.md).

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
"""

from __future__ import annotations

import logging

import torch

from specfx.drafters.heads.checkpoint import HeadCheckpoint, check_tensors
from specfx.drafters.heads.eagle3_head import KIND, Eagle3Head, checkpoint_error
from specfx.drafters.heads.eagle_checkpoint import rope_keys

logger = logging.getLogger(__name__)

__all__ = ["engine_gaps", "explicit_ids", "load_head", "resolve_taps"]

# Layout variants some trainers write that specfx does not implement: key -> (value that is
# the plain layout, what the variant does)
_VARIANTS = {
    "fc_norm": (False, "an RMSNorm on each tapped state before fc (SpecForge)"),
    "norm_before_fc": (False, "an RMSNorm on the tapped states before fc"),
    "norm_output": (True, "the LM head on the un-normalised output (SpecForge's norm_output=false)"),
}



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


def explicit_ids(config: dict) -> list[int] | None:
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


# ------------------------------------------------------------------------------ reading
def _rename(name: str) -> str:
    """vLLM's converted checkpoints name the midlayer ``layers.0``."""
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def load_head(ckpt: HeadCheckpoint) -> tuple[Eagle3Head, torch.Tensor | None]:
    """The head in ``ckpt`` (checked against its own config: every tensor of the layout with
    its shape, the vocabulary mapping) and its own ``embed_tokens.weight`` if it has one."""
    where, config = ckpt.path, ckpt.config
    if not config:
        raise checkpoint_error(where, "has no config.json (the head's sizes, vocabularies and tapped layers are read from it).")
    for key, (plain, what) in _VARIANTS.items():
        if key in config and bool(config[key]) != plain:
            raise checkpoint_error(
                where, f"sets {key}={config[key]!r}: {what}, a variant of the EAGLE-3 layout specfx does not implement."
            )
    layer_types = config.get("layer_types")
    if layer_types and layer_types[0] != "full_attention":
        raise checkpoint_error(where, f"its layer is {layer_types[0]!r}; specfx runs EAGLE-3 heads with full attention only.")
    tensors = {_rename(n): t for n, t in ckpt.tensors.items()}
    deeper = sorted({n.split(".")[1] for n in tensors if n.startswith("layers.")})
    layers = config.get("num_hidden_layers", 1)
    if deeper or layers != 1:
        raise checkpoint_error(
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
        raise checkpoint_error(where, f"draft_vocab_size {vd} exceeds vocab_size {v}.")
    if d2t is None:
        if vd != v:
            raise checkpoint_error(
                where,
                f"has a draft vocabulary of {vd} ids for a target vocabulary of {v} but no d2t tensor mapping them.",
            )
        d2t = torch.zeros(vd, dtype=torch.long)
    if d2t.shape != (vd,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise checkpoint_error(
            where,
            f"d2t must be an integer tensor of shape [{vd}] (draft_vocab_size), got {d2t.dtype} {list(d2t.shape)}.",
        )
    ids = torch.arange(vd) + d2t.long()
    if vd and (int(ids.min()) < 0 or int(ids.max()) >= v or ids.unique().numel() != vd):
        raise checkpoint_error(
            where, f"d2t maps draft ids outside the target vocabulary of {v} ids, or two draft ids to one target id."
        )
    mapped = torch.zeros(v, dtype=torch.bool)
    mapped[ids] = True
    if t2d is not None and (t2d.shape != (v,) or not torch.equal(t2d.bool(), mapped)):
        raise checkpoint_error(
            where,
            f"t2d (shape {list(t2d.shape)}) does not mark exactly the {vd} target ids d2t maps to; the "
            f"vocabulary mapping is inconsistent (vocab_size {v}).",
        )
    return d2t.long(), mapped


# ------------------------------------------------------------------------------ engines
def engine_gaps(head: Eagle3Head, layer_ids: list[int] | None, num_target_layers: int | None) -> dict[str, list[str]]:
    """Why each engine (``"SafeAILab's EAGLE"``, ``"vLLM"``, ``"SGLang"``) would not draft with
    ``head`` saved as is, what specfx drafts: engine -> reasons (empty lists where it would).
    ``layer_ids``: its taps in fc's order (vLLM's convention) when known, else those its config
    names; ``num_target_layers``: the target's depth when known. The rules are in docs/HEADS.md."""
    config = head.config
    llama = head.llama
    gaps: dict[str, list[str]] = {"SafeAILab's EAGLE": [], "vLLM": [], "SGLang": []}
    L = num_target_layers
    ids = layer_ids if layer_ids is not None else explicit_ids(config)
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
