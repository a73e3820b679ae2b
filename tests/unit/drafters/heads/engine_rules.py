"""How each serving engine loads a head checkpoint, restated from its source so the tests can
check that what specfx saves drafts the same there. None of the engines is installed here (and
none runs its kernels on a CPU), so each loader below re-states, in plain PyTorch, only the
loading *rules*: which config.json keys it reads (and their defaults), how it derives sizes,
which tensor names it maps where, what it silently skips, what it leaves unloaded. The
drafting computation itself is the plain-PyTorch reference of tests/unit/drafters/heads/test_eagle.py and
test_eagle3.py (which the tests there check against specfx proposal by proposal).

Read at (docs/HEADS.md has the same list):

* SafeAILab/EAGLE cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b: eagle/model/ea_model.py (EaModel:
  ``EConfig.from_pretrained``, ``con["bias"]`` default true, ``load_state_dict(strict=False)``),
  eagle/model/configs.py (EConfig), eagle/model/cnets1.py (EAGLE-1 ``Model``, ``LlamaAttention``:
  ``head_dim = hidden_size // num_heads``, ``qkv_bias``, ``rope_theta`` else 10000,
  ``rope_scaling {"type", "factor"}``), eagle/model/cnets.py (EAGLE-3 ``Model``,
  ``LlamaDecoderLayeremb``), eagle/model/modeling_llama_kv.py (EAGLE-3 taps: the inputs of the
  layers ``idx`` with ``idx == L - 3 or idx == L // 2 or idx == 2``, in layer order).
* vllm-project/vllm: vllm/model_executor/models/llama_eagle.py @ 00da92319af4b2ad2cde8525b7b609c779bdc52f
  (EAGLE-1: ``fc`` without bias, tensors not in the model skipped),
  vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
  (EAGLE-3: ``midlayer.`` -> ``layers.0.``, ``d2t``, ``t2d`` skipped, ``norm_before_residual``;
  attention biases ``attention_bias or bias``, ``qkv_bias`` for q/k/v),
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424
  (taps: top-level ``eagle_aux_hidden_state_layer_ids``, else the model's default
  ``(2, L // 2, L - 3)``; the target appends the input of layer ``idx`` when ``idx`` is in
  them, in layer order), vllm/transformers_utils/configs/eagle.py @ 23c5aa92d517802488a0c77a5f58cd0a2019c5a3
  (``Eagle{arch}`` for each architecture), vllm/model_executor/models/registry.py @
  0002bff0b6cb36a3c8a17364de3303664463c412 (the first registered architecture wins),
  vllm/model_executor/models/medusa.py @ 01dbb08195ca9c70ac9044786a906a353e07fcdf and
  vllm/transformers_utils/configs/medusa.py @ 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f.
* sgl-project/sglang: python/sglang/srt/models/llama_eagle.py @ 034b3be819faf3f84c5aae5a4cda27bdf2e12de0
  (EAGLE-1: ``fc`` always with a bias), python/sglang/srt/models/llama_eagle3.py @
  03d5a7771f6082e7737a5f19cae7d1e863087013 (EAGLE-3: q/k/v without bias, residual = the unnormed
  feature), python/sglang/srt/models/llama.py @ 00239548f1cd1a06ca145a5447a86738090a48f1
  (``set_eagle3_layers_to_capture``: ``eagle_config.eagle_aux_hidden_state_layer_ids`` plus 1,
  else ``[2, L // 2, L - 3]``; ``hidden_states + residual`` for each captured layer ``i``, in
  layer order; ``head_dim`` from the config; attention biases ``attention_bias or bias``),
  python/sglang/srt/models/registry.py @ 04585cc5f11c71d2b1d50d8a70b0ed4a16cc9917.
* FasterDecoding/Medusa e2a5d20c048a9b0a4092e6933c34313687422518: medusa/model/medusa_model.py
  (``MedusaConfig`` when ``AutoConfig`` fails: ``medusa_num_layers``, ``base_model_name_or_path``
  default lmsys/vicuna-7b-v1.3, 5 heads whatever ``medusa_num_heads`` says; each head
  ``[ResBlock(h)] * medusa_num_layers`` (one block, repeated) then ``Linear(h, V)``;
  ``medusa_lm_head.pt`` loaded with ``strict=False``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig

from tests.unit.drafters.heads.test_eagle import _Reference as _Eagle1Reference
from tests.unit.drafters.heads.test_eagle3 import _Reference as _Eagle3Reference
from tests.unit.drafters.heads.test_eagle3 import _rms, _rotary


class EngineRefuses(Exception):
    """The engine would stop with an error on this checkpoint (not silently wrong)."""


@dataclass
class Loaded:
    """What an engine holds after loading: ``config`` (what it read, as the reference forwards
    take it), ``tensors`` (its parameters that a file tensor filled, under the checkpoint's
    names), ``never_loaded`` (parameters it created that no tensor filled: uninitialised
    memory or a random init there) and ``skipped`` (file tensors it ignored)."""

    config: dict
    tensors: dict[str, torch.Tensor]
    never_loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    taps: list[int] | None = None  # EAGLE-3: the layer inputs concatenated for fc, in that order


def _read(directory: Path, filename: str = "model.safetensors") -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((directory / "config.json").read_text())
    return config, load_file(str(directory / filename))


def _fill(expected: dict[str, tuple], tensors: dict[str, torch.Tensor], engine: str) -> Loaded:
    """``load_state_dict(strict=False)``-like: every expected parameter a tensor of its name
    fills (a shape mismatch is an error there too); the others stay unloaded."""
    got = {}
    for name, shape in expected.items():
        if name in tensors:
            if tuple(tensors[name].shape) != tuple(shape):
                raise EngineRefuses(f"{engine}: {name} is {list(tensors[name].shape)}, its parameter {list(shape)}")
            got[name] = tensors[name]
    return Loaded(
        config={},
        tensors=got,
        never_loaded=sorted(set(expected) - set(got)),
        skipped=sorted(set(tensors) - set(expected)),
    )


def _hf_rope(config: dict) -> tuple[float, dict | None]:
    """(base, scaling or None) as transformers' LlamaConfig, which vLLM builds the head's config
    with, resolves them from config.json (top-level rope_theta / rope_scaling, or rope_parameters)."""
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "hidden_size", "num_attention_heads")
    params = dict(LlamaConfig(**{k: config[k] for k in keys if k in config}).rope_parameters or {})
    theta = float(params.pop("rope_theta", 10000.0))
    return theta, params if params.get("rope_type", "default") != "default" else None


# ------------------------------------------------------------------------------ EAGLE-1
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _eagle1_params(h: int, heads: int, kv: int, d: int, inter: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                   fc_bias: bool) -> dict[str, tuple]:  # fmt: skip
    """The parameters of a Llama EAGLE-1 head (fc, one Llama layer without input norm)."""
    shapes = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
              "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}  # fmt: skip
    out = {f"layers.0.{n}.weight": s for n, s in shapes.items()}
    out["layers.0.post_attention_layernorm.weight"] = (h,)
    for n, s in shapes.items():
        wanted = {"self_attn.o_proj": o_bias, "mlp.gate_proj": mlp_bias, "mlp.up_proj": mlp_bias,
                  "mlp.down_proj": mlp_bias}.get(n, qkv_bias)  # fmt: skip
        if wanted:
            out[f"layers.0.{n}.bias"] = (s[0],)
    out["fc.weight"] = (h, 2 * h)
    if fc_bias:
        out["fc.bias"] = (h,)
    return out


def _sizes(config: dict) -> tuple[int, int, int, int]:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    return h, heads, config.get("num_key_value_heads") or heads, config["intermediate_size"]


def safeailab_eagle1(directory: Path) -> Loaded:
    config, tensors = _read(directory)
    h, heads, kv, inter = _sizes(config)
    if h % heads:
        raise EngineRefuses("SafeAILab: hidden_size must be divisible by num_heads")
    d = h // heads  # head_dim is derived, never read
    scaling = config.get("rope_scaling")
    if scaling is not None:  # EConfig's validation, then cnets1._init_rope (base 10000 with scaling)
        if not isinstance(scaling, dict) or len(scaling) != 2 or scaling.get("type") not in ("linear", "dynamic"):
            raise EngineRefuses(f"SafeAILab: rope_scaling must be {{'type', 'factor'}}, got {scaling}")
        theta, scaling = 10000.0, {"rope_type": scaling["type"], "factor": scaling["factor"]}
    else:
        theta = float(config.get("rope_theta", 10000.0))  # an attribute only when config.json has the key
    fc_bias = config.get("bias", True)
    qkv_bias = bool(config.get("qkv_bias", False))
    loaded = _fill(_eagle1_params(h, heads, kv, d, inter, qkv_bias, False, False, fc_bias), tensors, "SafeAILab")
    loaded.config = dict(hidden_size=h, heads=heads, kv_heads=kv, head_dim=d, rope_theta=theta, rope_scaling=scaling,
                         eps=config.get("rms_norm_eps", 1e-6), act=config.get("hidden_act", "silu"))  # fmt: skip
    return loaded


_VLLM_ARCHS = {"EagleLlamaForCausalLM", "EagleLlama4ForCausalLM", "EagleMiniCPMForCausalLM", "Eagle3LlamaForCausalLM",
               "LlamaForCausalLMEagle3", "MedusaModel"}  # fmt: skip  # the EAGLE part of its registry
_SGLANG_ARCHS = {"LlamaForCausalLMEagle", "LlamaForCausalLMEagle3", "LlamaForCausalLM", "Qwen2ForCausalLM",
                 "MistralForCausalLM"}  # fmt: skip  # a few entries of its registry (by class name)


def _llama_attention_biases(config: dict) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) of vLLM's LlamaDecoderLayer: ``attention_bias or bias`` on all four,
    ``qkv_bias`` (when present) instead for q/k/v."""
    both = bool(config.get("attention_bias", False) or config.get("bias", False))
    return (bool(config["qkv_bias"]) if "qkv_bias" in config else both), both


def vllm_eagle1(directory: Path) -> Loaded:
    config, tensors = _read(directory)
    archs = [a if a.startswith("Eagle") else f"Eagle{a}" for a in config.get("architectures", [])]
    arch = next((a for a in archs if a in _VLLM_ARCHS), None)
    if arch != "EagleLlamaForCausalLM":
        raise EngineRefuses(f"vLLM: architectures {archs} resolve to {arch}, not its Llama EAGLE model")
    if config.get("hidden_act", "silu") != "silu":
        raise EngineRefuses("vLLM: its LlamaMLP supports silu only")
    h, heads, kv, inter = _sizes(config)
    d = config.get("head_dim") or h // heads
    qkv_bias, o_bias = _llama_attention_biases(config)
    expected = _eagle1_params(h, heads, kv, d, inter, qkv_bias, o_bias, bool(config.get("mlp_bias")), False)
    loaded = _fill(expected, tensors, "vLLM")  # fc.bias: not a parameter, skipped; embed_tokens: the target's
    theta, scaling = _hf_rope(config)
    loaded.config = dict(hidden_size=h, heads=heads, kv_heads=kv, head_dim=d, rope_theta=theta, rope_scaling=scaling,
                         eps=config.get("rms_norm_eps", 1e-6), act="silu")  # fmt: skip
    return loaded


def sglang_eagle1(directory: Path) -> Loaded:
    config, tensors = _read(directory)
    arch = next((a for a in config.get("architectures", []) if a in _SGLANG_ARCHS), None)
    if arch != "LlamaForCausalLMEagle":
        raise EngineRefuses(f"SGLang: architectures {config.get('architectures')} resolve to {arch}, not its EAGLE model")
    if config.get("hidden_act", "silu") != "silu":
        raise EngineRefuses("SGLang: its LlamaMLP supports silu only")
    h, heads, kv, inter = _sizes(config)
    d = config.get("head_dim") or h // heads  # getattr(config, "head_dim", hidden // heads)
    both = bool(config.get("attention_bias", False) or config.get("bias", False))
    loaded = _fill(_eagle1_params(h, heads, kv, d, inter, both, both, False, True), tensors, "SGLang")
    theta = float(config.get("rope_theta", 10000.0))  # getattr(config, "rope_theta", 10000) on its HF config
    loaded.config = dict(hidden_size=h, heads=heads, kv_heads=kv, head_dim=d, rope_theta=theta, rope_scaling=None,
                         eps=config.get("rms_norm_eps", 1e-6), act="silu")  # fmt: skip
    return loaded


EAGLE1_ENGINES = {"SafeAILab's EAGLE": safeailab_eagle1, "vLLM": vllm_eagle1, "SGLang": sglang_eagle1}


def _llama_layer(x: torch.Tensor, w: dict[str, torch.Tensor], c: dict, pos: torch.Tensor) -> torch.Tensor:
    """A Llama decoder layer without its input norm (the engines' EAGLE-1 layer) over ``x
    [1, T, H]`` at positions ``pos [1, T]``, causal."""
    t, heads, kv, d = x.shape[1], c["heads"], c["kv_heads"], c["head_dim"]

    def proj(name, inp):
        return F.linear(inp, w[f"layers.0.{name}.weight"], w.get(f"layers.0.{name}.bias"))

    q = proj("self_attn.q_proj", x).view(1, t, heads, d)
    k = proj("self_attn.k_proj", x).view(1, t, kv, d)
    v = proj("self_attn.v_proj", x).view(1, t, kv, d)
    scaled = pos / c["rope_scaling"]["factor"] if c["rope_scaling"] else pos  # linear scaling
    q, k = _rotary(q, scaled, c["rope_theta"]), _rotary(k, scaled, c["rope_theta"])
    k, v = k.repeat_interleave(heads // kv, 2), v.repeat_interleave(heads // kv, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    h = x + proj("self_attn.o_proj", torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(1, t, heads * d))
    y = _rms(h, w["layers.0.post_attention_layernorm.weight"], c["eps"])
    return h + proj("mlp.down_proj", F.silu(proj("mlp.gate_proj", y)) * proj("mlp.up_proj", y))


class Eagle1Engine(_Eagle1Reference):
    """The EAGLE-1 reference's drafting (chain, tree) with the head as ``loaded`` by an engine:
    its fc (bias or not), its Llama layer and rotary, the target's embedding and LM head."""

    def __init__(self, target, loaded: Loaded):
        if loaded.never_loaded:
            raise EngineRefuses(f"parameters left unloaded (garbage there): {loaded.never_loaded}")
        self.target, self.loaded = target, loaded

    @torch.no_grad()
    def last_output(self, tokens, feats):
        w, n = self.loaded.tensors, len(tokens)
        emb = F.embedding(torch.tensor([tokens]), self.target.get_input_embeddings().weight)
        x = F.linear(torch.cat([emb, feats[None]], -1), w["fc.weight"], w.get("fc.bias"))
        return _llama_layer(x, w, self.loaded.config, torch.arange(1, n + 1)[None])[0, -1:]


# ------------------------------------------------------------------------------ EAGLE-3
def _eagle3_params(config: dict, d: int, taps: int, names: dict[str, torch.Tensor]) -> dict[str, tuple]:
    h, heads, kv, inter = _sizes(config)
    th, vd = config.get("target_hidden_size") or h, config.get("draft_vocab_size") or config["vocab_size"]
    out = {"fc.weight": (h, taps * th), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    for n, s in {"self_attn.q_proj": (heads * d, 2 * h), "self_attn.k_proj": (kv * d, 2 * h),
                 "self_attn.v_proj": (kv * d, 2 * h), "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (inter, h),
                 "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}.items():  # fmt: skip
        out[f"midlayer.{n}.weight"] = s
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"midlayer.{n}.weight"] = (h,)
    if vd != config["vocab_size"] or "d2t" in names:
        out["d2t"] = (vd,)
    if "embed_tokens.weight" in names:
        out["embed_tokens.weight"] = (config["vocab_size"], h)
    return out


def _eagle3(engine, config, tensors, d, taps, norm_before_residual, theta, num_layers) -> Loaded:
    if len(taps) != 3:  # fc takes 3 x target_hidden_size: the concatenation of fewer states does not fit
        raise EngineRefuses(f"{engine}: captures {len(taps)} target states {taps}, its fc takes 3")
    loaded = _fill(_eagle3_params(config, d, 3, tensors), tensors, engine)
    loaded.config = dict(config, head_dim=d, rope_theta=theta, norm_before_residual=norm_before_residual,
                         eagle_aux_hidden_state_layer_ids=taps)  # fmt: skip
    loaded.taps = taps
    return loaded


def _once_in_layer_order(ids, num_layers: int) -> list[int]:
    """The inputs of the layers ``idx in ids`` a pass over layers ``0..L-1`` appends."""
    return [i for i in range(num_layers) if i in ids]


def safeailab_eagle3(directory: Path, num_layers: int) -> Loaded:
    config, tensors = _read(directory)
    h, heads = config["hidden_size"], config["num_attention_heads"]
    d = h // heads  # derived; head_dim is ignored
    if d * heads != h:
        raise EngineRefuses("SafeAILab: hidden_size must be divisible by num_heads")
    if config.get("rope_scaling") is not None:
        raise EngineRefuses("SafeAILab: EConfig takes rope_scaling only as {'type', 'factor'}")
    L = num_layers
    taps = [i for i in range(L) if i == L - 3 or i == L // 2 or i == 2]  # no key read
    tensors = {k: v for k, v in tensors.items() if k != "d2t" or config.get("draft_vocab_size") != config["vocab_size"]}
    return _eagle3("SafeAILab", config, tensors, d, taps, False, float(config.get("rope_theta", 10000.0)), L)


def vllm_eagle3(directory: Path, num_layers: int) -> Loaded:
    config, tensors = _read(directory)
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (2, num_layers // 2, num_layers - 3)
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items() if k != "t2d"}
    unknown = set(tensors) - set(_eagle3_params(config, d, 3, tensors))
    if unknown:  # params_dict[name]: a KeyError there
        raise EngineRefuses(f"vLLM: no parameter for {sorted(unknown)}")
    theta, _ = _hf_rope(config)
    return _eagle3("vLLM", config, tensors, d, _once_in_layer_order(ids, num_layers),
                   bool(config.get("norm_before_residual", False)), theta, num_layers)  # fmt: skip


def sglang_eagle3(directory: Path, num_layers: int) -> Loaded:
    config, tensors = _read(directory)
    nested = config.get("eagle_config")
    try:  # model_runner: eagle_config["eagle_aux_hidden_state_layer_ids"], any failure -> None
        ids = [i + 1 for i in nested["eagle_aux_hidden_state_layer_ids"]]
    except (KeyError, TypeError):
        ids = [2, num_layers // 2, num_layers - 3]
    if 0 in ids:  # layer 0: hidden_states + residual with no residual yet
        raise EngineRefuses("SGLang: capturing the input of layer 0 adds a residual that is None")
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    tensors = {k: v for k, v in tensors.items() if k != "t2d"}
    return _eagle3("SGLang", config, tensors, d, _once_in_layer_order(ids, num_layers), False,
                   float(config.get("rope_theta", 10000.0)), num_layers)  # fmt: skip


EAGLE3_ENGINES = {"SafeAILab's EAGLE": safeailab_eagle3, "vLLM": vllm_eagle3, "SGLang": sglang_eagle3}


class Eagle3Engine(_Eagle3Reference):
    """The EAGLE-3 reference's drafting with the head as ``loaded`` by an engine (its sizes,
    rotary base, residual variant and the target states it feeds fc, in its order)."""

    def __init__(self, target, loaded: Loaded):
        if loaded.never_loaded:
            raise EngineRefuses(f"parameters left unloaded (garbage there): {loaded.never_loaded}")
        self.target, self.cfg, self.w = target, loaded.config, dict(loaded.tensors)
        self.w.setdefault("d2t", torch.zeros(self.cfg.get("draft_vocab_size") or self.cfg["vocab_size"], dtype=torch.long))
        self.table = target.get_input_embeddings().weight


# ------------------------------------------------------------------------------ Medusa
@dataclass
class MedusaLoaded:
    """Per head: its residual blocks ``[(W, b or None)]`` and its LM head, as the engine runs them."""

    blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]]
    lm_heads: list[torch.Tensor]
    config: dict
    never_loaded: list[str]


def vllm_medusa(directory: Path) -> MedusaLoaded:
    config = json.loads((directory / "config.json").read_text())
    if config.get("model_type") != "medusa":
        raise EngineRefuses(f"vLLM: model_type {config.get('model_type')!r} does not select its MedusaConfig")
    for k in list(config):  # MedusaConfig.from_pretrained's renaming
        if "num" in k and "heads" in k:
            config["num_heads"] = config.pop(k)
        elif "num" in k and "layers" in k:
            config["num_hidden_layers"] = config.pop(k)
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):  # every safetensors file of the directory
        tensors.update({k.replace("medusa_heads.", ""): v for k, v in load_file(str(f)).items()})
    n, m, bias = config.get("num_heads", 5), config.get("num_hidden_layers", 1), config.get("medusa_fc_bias", False)
    shared = config.get("original_lm_head", False)
    names = [f"blocks.{i}.layers.{j}.{p}" for i in range(n) for j in range(m) for p in ("weight", "bias")[: 1 + bias]]
    names += ["lm_heads.0.weight"] if shared else [f"lm_heads.{i}.weight" for i in range(n)]
    never = sorted(set(names) - set(tensors))
    blocks = [[(tensors.get(f"blocks.{i}.layers.{j}.weight"), tensors.get(f"blocks.{i}.layers.{j}.bias") if bias else None)
               for j in range(m)] for i in range(n)]  # fmt: skip
    lm = [tensors.get("lm_heads.0.weight" if shared else f"lm_heads.{i}.weight") for i in range(n)]
    return MedusaLoaded(blocks, lm, config, never)


def fasterdecoding_medusa(directory: Path) -> MedusaLoaded:
    config = json.loads((directory / "config.json").read_text())
    try:  # MedusaModel.from_pretrained: a config transformers knows is the Medusa-2 path (a whole model)
        AutoConfig.for_model(config["model_type"])
        raise EngineRefuses(f"FasterDecoding: model_type {config['model_type']!r} takes the whole-model path")
    except (KeyError, ValueError):
        pass
    if not (directory / "medusa_lm_head.safetensors").is_file():  # medusa_lm_head.pt there: these tensors, pickled
        raise EngineRefuses("FasterDecoding: no medusa_lm_head weights")
    tensors = load_file(str(directory / "medusa_lm_head.safetensors"))
    base = config.get("base_model_name_or_path", "lmsys/vicuna-7b-v1.3")
    m, n = config.get("medusa_num_layers", 1), 5  # base_model_config.medusa_num_heads = 5
    blocks, lm, never = [], [], []
    for i in range(n):
        # [ResBlock(h)] * m: one module under m names; load_state_dict fills it m times, the last wins
        last = (tensors.get(f"{i}.{m - 1}.linear.weight"), tensors.get(f"{i}.{m - 1}.linear.bias")) if m else None
        blocks.append([last] * m)
        lm.append(tensors.get(f"{i}.{m}.weight"))
        if lm[-1] is None or (m and last[0] is None):
            never.append(f"head {i}")
    return MedusaLoaded(blocks, lm, dict(config, base_model_name_or_path=base), never)


def medusa_logits(x: torch.Tensor, heads: MedusaLoaded, n: int) -> torch.Tensor:
    """``[n, ..., V]``: heads ``0..n-1`` at hidden states ``x`` (``x + SiLU(W x + b)`` per block)."""
    out = []
    for i in range(n):
        h = x
        for w, b in heads.blocks[i]:
            h = h + F.silu(F.linear(h, w, b))
        out.append(F.linear(h, heads.lm_heads[i]))
    return torch.stack(out)
