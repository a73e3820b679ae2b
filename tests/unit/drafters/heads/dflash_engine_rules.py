"""How vLLM and SGLang load a DFlash draft, restated from their source so the tests can check
that what :meth:`specfx.DFlash.save` writes is what they read. Neither engine is installed here
(nor runs on a CPU): each function below re-states, in plain Python, only the loading *rules*
(which config.json keys it reads and their defaults, how it sizes its parameters, which tensor
names it maps where, which it refuses and which it silently drops), and returns what it would
hold, the tensors included (tests/unit/drafters/heads/dflash_engine_forward.py computes the
engines' drafts from them). Facts, not code. First read file by file at the commits below
(decision 77 of docs/ARCHITECTURE.md); every rule was read again, all files at one release, in
the published wheels of **vLLM 0.33.0** (``vllm/_version.py``: commit ``g4ba787ec9``) and
**SGLang 0.5.23** (decision 85), where they hold unless said otherwise:

* vllm-project/vllm
  - vllm/model_executor/models/registry.py @ 0.33.0: ``_SPECULATIVE_DECODING_MODELS`` maps
    ``"DFlashDraftModel"`` (and ``MuseGlimmerAssistantModel`` / ``DFlashMuseGlimmerAssistantModel``)
    to ``("qwen3_dflash", "DFlashQwen3ForCausalLM")``; an architecture it does not list is no
    DFlash drafter (the stored ``registry.py`` of decision 77, 0002bff0, predates DFlash);
  - vllm/transformers_utils/configs/eagle.py @ 0.33.0: ``EAGLEConfig(method="dflash")`` keeps an
    architecture starting or ending with "DFlash" and prefixes any other with it (so
    ``Qwen3ForCausalLM`` is asked for as ``DFlashQwen3ForCausalLM``, which is not registered);
  - vllm/config/speculative.py @ 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443 and 0.33.0:
    ``method="dflash"`` must be given, or the path contain "dflash" (or the architectures
    transformers' ``MuseGlimmerAssistantModel``); otherwise the method stays ``draft_model``;
    ``num_speculative_tokens`` must be given unless the draft config has ``n_predict``, its
    default (0.33.0);
  - vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9 and
    0.33.0: ``DFlashQwen3ForCausalLM.load_weights`` (``t2d`` skipped, ``d2t`` renamed, every
    other name but ``lm_head`` prefixed ``model.``; ``embed_tokens`` dropped unless shipped), then
    ``DFlashQwen3Model``'s mapper (``midlayer.`` -> ``layers.0.``, ``encoder.fc.`` -> ``fc.``,
    ``encoder.output_norm_enc.`` -> ``hidden_norm.``; ``.q_proj``/``.k_proj``/``.v_proj`` stacked
    into ``.qkv_proj``, ``.gate_proj``/``.up_proj`` into ``.gate_up_proj``) and
    ``AutoWeightsLoader`` (a name with no parameter is an error); ``o_proj`` has a bias iff
    ``attention_bias``; layer causality from ``is_causal``, else ``dflash_config.causal``, else
    ``layer_types[i] == "sliding_attention"``; ``fc`` takes ``(target_hidden_size or
    hidden_size) * len(aux layers)``, or ``* num_hidden_layers`` without them;
  - vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424
    and 0.33.0: ``get_eagle3_aux_layers_from_config`` (top-level ``eagle_aux_hidden_state_layer_ids``
    first, else ``dflash_config.target_layer_ids`` plus 1, ...); the target appends the input of
    layer ``idx`` (the residual stream) for each ``idx`` among them, in layer order;
  - vllm/v1/spec_decode/llm_base_proposer.py @ 00c4f22dae4795e34658bead82fa071e6bb7ae39 and
    vllm/v1/worker/gpu/spec_decode/utils.py @ 0.33.0 (``get_parallel_drafting_token_id``): the
    mask id is ``dflash_config["mask_token_id"]``, else a top-level ``mask_token_id``, else
    ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id``.
* sgl-project/sglang
  - python/sglang/srt/models/dflash.py @ 003b23d7388eabdfbfecd2610c7e228f9f6a2734 and 0.5.23:
    ``DFlashDraftModel`` (an entry class) and its ``load_weights`` (``.q_proj.`` etc. stacked,
    names resolved as they are or with/without ``model.``, unknown names silently ignored,
    ``fc.weight`` shape checked); ``fc`` takes ``hidden_size * len(target_layer_ids)``;
    ``hidden_act`` silu (0.5.23: or swigluoai); ``full_attention`` layers are non-causal
    (ENCODER_ONLY) unless ``is_causal``;
  - python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582 and
    0.5.23: ``parse_dflash_draft_config`` (``block_size``, ``num_target_layers``,
    ``target_layer_ids``, ``mask_token_id`` from ``dflash_config`` else the top level; ids resolved
    by the reference's ``build_target_layer_ids`` over ``num_target_layers``, else over the
    draft's own depth, and checked to lie in ``0 .. num_target_layers - 1``);
  - python/sglang/srt/speculative/dflash_worker.py @ 0468412fb7dc9909923ee6b6c95cfcfca24cfe34
    (0.5.23: dflash_worker_v2.py and srt/arg_groups/speculative_hook.py): the block size is
    ``speculative_num_draft_tokens``, else the config's ``block_size`` (else 16); the mask id: the
    config's, else the tokenizer's id of ``mask_token``; the targets' hook
    ``set_dflash_layers_to_capture`` captures before layer ``i + 1`` for each id ``i``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from tests.unit.drafters.heads.engine_rules import EngineRefuses


@dataclass
class Held:
    """What an engine holds after loading: each parameter's shards filled (name -> {shard: shape})
    and the tensors that filled them (name -> {shard: tensor}), the parameters it expected
    (name -> {shard: shape}, shards in the order the engine stacks them), the file tensors it
    dropped, and what it read from the config (``taps``: the target layers whose *outputs* it
    feeds ``fc``, in order; ``mask_token_id``, ``block_size``, ``causal`` per draft layer, ...)."""

    filled: dict[str, dict] = field(default_factory=dict)
    expected: dict[str, dict] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    read: dict = field(default_factory=dict)
    tensors: dict[str, dict] = field(default_factory=dict)

    @property
    def unfilled(self) -> list[str]:
        return sorted(n for n, shards in self.expected.items() if self.filled.get(n, {}).keys() != shards.keys())

    def param(self, name: str):
        """The engine's parameter ``name`` as it holds it: stacked shards (``qkv_proj``: q, k, v
        rows; ``gate_up_proj``: gate, up) concatenated along the output dimension."""
        import torch

        shards = self.tensors[name]
        return torch.cat([shards[s] for s in self.expected[name]], dim=0)


_STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


def _params(c: dict, fc_in: int) -> dict[str, dict]:
    """The draft's parameters (both engines build the same ones): name -> {shard: shape}."""
    h, heads, inter = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    kv = c.get("num_key_value_heads") or heads
    d = c.get("head_dim") or h // heads
    out = {"fc.weight": {None: (h, fc_in)}, "hidden_norm.weight": {None: (h,)}, "norm.weight": {None: (h,)}}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = {"q": (heads * d, h), "k": (kv * d, h), "v": (kv * d, h)}
        out[p + "self_attn.o_proj.weight"] = {None: (h, heads * d)}
        if c.get("attention_bias"):
            out[p + "self_attn.qkv_proj.bias"] = {"q": (heads * d,), "k": (kv * d,), "v": (kv * d,)}
            out[p + "self_attn.o_proj.bias"] = {None: (h,)}
        out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = {None: (d,)}
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = {None: (h,)}
        out[p + "mlp.gate_up_proj.weight"] = {0: (inter, h), 1: (inter, h)}
        out[p + "mlp.down_proj.weight"] = {None: (h, inter)}
    return out


def _fill(held: Held, name: str, shard, tensor, engine: str) -> None:
    want = held.expected[name][shard]
    if tuple(tensor.shape) != want:
        raise EngineRefuses(f"{engine}: {name} ({shard}) is {list(tensor.shape)}, its parameter {list(want)}")
    held.filled.setdefault(name, {})[shard] = want
    held.tensors.setdefault(name, {})[shard] = tensor


def _captured(ids_plus_one: list[int], num_target_layers: int, after_last: bool = False) -> list[int]:
    """The target layers whose output the engine captures (the input of layer ``idx`` for each
    ``idx`` it was given, in layer order; ``after_last``: also the last layer's output, before
    the final norm, for ``idx`` = the layer count), as output-of-layer ids."""
    return [idx - 1 for idx in range(num_target_layers + after_last) if idx in ids_plus_one]


def _read(directory: Path) -> tuple[dict, dict]:
    return json.loads((directory / "config.json").read_text()), load_file(str(directory / "model.safetensors"))


# vllm/model_executor/models/registry.py @ vLLM 0.33.0, _SPECULATIVE_DECODING_MODELS: its entries
# named DFlash (and transformers' assistant), architecture -> (module, class); the others there
# are other drafters (EAGLE, MTP, DSpark, ...)
VLLM_DFLASH_REGISTRY = {
    "DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),
    "DFlash2DraftModel": ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM"),
    "DFlash2BeamDraftModel": ("vllm.models.beam", "DFlash2BeamForCausalLM"),
    "MuseGlimmerAssistantModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),
    "DFlashMuseGlimmerAssistantModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),
    "DFlashQwen3XPressModel": ("qwen3_xpress", "Qwen3XPressForCausalLM"),
    "DFlashLagunaForCausalLM": ("laguna_dflash", "DFlashLagunaForCausalLM"),
}


def vllm_dflash(
    directory: Path,
    num_target_layers: int,
    target_hidden: int,
    method: str | None = "dflash",
    num_speculative_tokens: int | None = None,
) -> Held:
    """vLLM serving ``directory`` with ``--speculative-config`` ``method`` (None: not given) and
    ``num_speculative_tokens`` (None: not given)."""
    c, tensors = _read(directory)
    nested = c.get("dflash_config") or {}
    if method is None:  # the default method, then detected from the path or transformers' class
        found = "dflash" in str(directory).lower() or "MuseGlimmerAssistantModel" in c["architectures"]
        method = "dflash" if found else "draft_model"
    if method != "dflash":
        raise EngineRefuses(f"vLLM: served as method={method!r}, an ordinary draft model, not a DFlash drafter")
    if num_speculative_tokens is None:
        num_speculative_tokens = c.get("n_predict")
    if num_speculative_tokens is None:
        raise EngineRefuses("vLLM: a speculative model was provided, but num_speculative_tokens was not provided")
    # EAGLEConfig(method="dflash"), then the registry: the first architecture it lists
    archs = [a if a.startswith("DFlash") or a.endswith("DFlash") else f"DFlash{a}" for a in c["architectures"]]
    registered = [VLLM_DFLASH_REGISTRY[a] for a in archs if a in VLLM_DFLASH_REGISTRY]
    if not registered:
        raise EngineRefuses(f"vLLM: no registered DFlash architecture among {archs}")
    aux = c.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in (nested.get("target_layer_ids") or [])]
    n = len(aux) if aux else c["num_hidden_layers"]
    held = Held(expected=_params(c, (c.get("target_hidden_size") or c["hidden_size"]) * n))
    # vLLM 0.33.0 (model_executor/models/interfaces.py _maybe_add_hidden_state, called in llama.py's
    # forward after every layer): layer idx's input, and for idx = L the last layer's output before
    # the final norm (the reference reads that one after it)
    taps = _captured(aux, num_target_layers, after_last=True)
    if len(taps) * target_hidden != held.expected["fc.weight"][None][1]:  # combine_hidden_states' check
        raise EngineRefuses(f"vLLM: the target captures {len(taps)} states for aux layers {aux}, fc takes {n}")
    if "mask_token_id" in nested:
        mask = nested["mask_token_id"]
    elif c.get("mask_token_id") is not None:
        mask = c["mask_token_id"]
    else:
        raise EngineRefuses("vLLM: no mask token id for parallel drafting")
    types = c.get("layer_types")
    causal = [
        bool(c["is_causal"]) if c.get("is_causal") is not None
        else bool(nested["causal"]) if nested.get("causal") is not None
        else bool(types) and types[i] == "sliding_attention"
        for i in range(c["num_hidden_layers"])
    ]  # fmt: skip
    held.read = dict(architectures=archs, model_class=registered[0], taps=taps, mask_token_id=mask, causal=causal,
                     rope_theta=c.get("rope_theta"), num_speculative_tokens=num_speculative_tokens,
                     before_final_norm=[i for i in taps if i == num_target_layers - 1])  # fmt: skip
    for name, tensor in tensors.items():
        if "t2d" in name or "d2t" in name or "lm_head" in name or "embed_tokens" in name:
            held.dropped.append(name)  # not the draft model's (d2t: a parameter of its own)
            continue
        for old, new in {
            "midlayer.": "layers.0.",
            "encoder.output_norm_enc.": "hidden_norm.",
            "encoder.fc.": "fc.",
        }.items():
            name = name.replace(old, new)
        shard = None
        for weight, (param, sid) in _STACKED.items():
            if f".{weight}" in name:
                name, shard = name.replace(f".{weight}", f".{param}"), sid
                break
        if name not in held.expected:  # AutoWeightsLoader: no module or parameter of that name
            raise EngineRefuses(f"vLLM: no parameter for {name}")
        _fill(held, name, shard, tensor, "vLLM")
    return held


def sglang_dflash(directory: Path, num_target_layers: int, num_draft_tokens: int | None = None) -> Held:
    """SGLang serving ``directory`` with ``--speculative-num-draft-tokens`` ``num_draft_tokens``
    (None: not given)."""
    c, tensors = _read(directory)
    nested = c.get("dflash_config") or {}

    def get(key, default=None):
        return nested.get(key, c.get(key, default))

    if "DFlashDraftModel" not in c.get("architectures", []):
        raise EngineRefuses(f"SGLang: no entry class for {c.get('architectures')}")
    if c.get("hidden_act", "silu") not in ("silu", "swigluoai"):
        raise EngineRefuses("SGLang: DFlash MLP supports silu and swigluoai only")
    mask = get("mask_token_id")
    if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int) or mask < 0):
        raise EngineRefuses(f"SGLang: mask_token_id {mask!r}")
    depth = get("num_target_layers") or c["num_hidden_layers"]
    ids = get("target_layer_ids")
    if ids is None:  # build_target_layer_ids over the resolved depth
        k = c["num_hidden_layers"]
        ids = [depth // 2] if k == 1 else [int(round(1 + i * (depth - 4) / (k - 1))) for i in range(k)]
    if any(not 0 <= i < depth for i in ids):
        raise EngineRefuses(f"SGLang: target_layer_ids {ids} out of 0..{depth - 1}")
    taps = _captured([i + 1 for i in ids], num_target_layers)
    if len(taps) != len(ids):
        raise EngineRefuses(f"SGLang: the target captures {len(taps)} states for target_layer_ids {ids}")
    held = Held(expected=_params(c, c["hidden_size"] * len(ids)))
    types = c.get("layer_types")
    if types is not None and any(t not in ("full_attention", "sliding_attention") for t in types):
        raise EngineRefuses(f"SGLang: layer types {types}")
    # no layer types: encoder-only (non-causal) layers; else is_causal, else causal iff sliding
    causal = [
        types is not None and (bool(c["is_causal"]) if c.get("is_causal") is not None else types[i] == "sliding_attention")
        for i in range(c["num_hidden_layers"])
    ]  # fmt: skip
    block = num_draft_tokens or get("block_size") or 16
    held.read = dict(taps=taps, mask_token_id=mask, block_size=block, causal=causal, rope_theta=c.get("rope_theta"))
    for name, tensor in tensors.items():
        shard = None
        for weight, (param, sid) in _STACKED.items():
            if f".{weight}." in name:
                name, shard = name.replace(weight, param), sid
                break
        resolved = name if name in held.expected else name.removeprefix("model.")
        if resolved not in held.expected:
            held.dropped.append(name)  # ignored without a word
            continue
        _fill(held, resolved, shard, tensor, "SGLang")
    return held
