"""EAGLE-1/2 heads' checkpoint layout (SafeAILab's, which vLLM and SGLang also read): the
target config keys a saved head's ``config.json`` carries (:data:`CONFIG_KEYS`, :func:`rope_keys`),
and what each serving engine would make of a saved head (:func:`engine_gaps`; docs/HEADS.md).
Reading the tensors into the head's modules is :meth:`specfx.drafters.heads.eagle.Eagle._build`
(it needs the target's layer class); the files themselves are :mod:`specfx.drafters.heads.checkpoint`'s.
"""

from __future__ import annotations

import torch

from specfx.drafters.heads.eagle_layer import LAYER_OVERRIDES

__all__ = ["CONFIG_KEYS", "QKV_BIAS", "engine_gaps", "is_llama_layer", "rope_keys", "rope_theta"]

# Target config keys copied into a saved head's config.json (the SafeAILab layout).
CONFIG_KEYS = ("model_type", "hidden_size", "vocab_size", "max_position_embeddings", "rope_theta", "rope_parameters",
               "pad_token_id", "bos_token_id", "eos_token_id") + LAYER_OVERRIDES  # fmt: skip

# The engines' EAGLE-1 layer (SafeAILab's cnets1.LlamaDecoderLayer, vLLM's and SGLang's
# LlamaDecoderLayer, each without its input norm) holds these tensors; transformers' layer
# classes that compute that layer from them (Mistral: plus a window; Qwen2: plus q/k/v biases).
_LLAMA_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
_LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")  # mixtral: SafeAILab's dense heads
_LLAMA_WEIGHTS = frozenset(
    f"layers.0.{n}.weight"
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")
)  # fmt: skip
QKV_BIAS = frozenset(f"layers.0.self_attn.{p}_proj.bias" for p in "qkv")
_O_BIAS = frozenset({"layers.0.self_attn.o_proj.bias"})
_MLP_BIAS = frozenset(f"layers.0.mlp.{p}_proj.bias" for p in ("gate", "up", "down"))


def _getter(config):
    return config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)


def rope_theta(config) -> float | None:
    """``config``'s rotary base (a config object or a config.json dict), or None if it names none."""
    get = _getter(config)
    theta = get("rope_theta")
    if theta is None:
        params = get("rope_parameters")
        if isinstance(params, dict):
            theta = params.get("rope_theta")
    return theta


def rope_keys(config) -> dict:
    """``config``'s rotary settings (a config object or a config.json dict) as a head's
    config.json writes them for every engine: ``rope_theta`` at the top level, where SafeAILab's
    EConfig, vLLM and SGLang read it (transformers 5 keeps it only inside ``rope_parameters``,
    which those readers ignore: a head saved without it runs with base 10000 there), and for
    scaled rotary ``rope_scaling`` (``rope_parameters`` without the base)."""
    get = _getter(config)
    params = dict(get("rope_parameters") or {})
    if params and "rope_type" not in params and "rope_theta" not in params:  # per layer type (Gemma 3)
        params = dict(params.get("full_attention") or next(iter(params.values())))
    theta = params.pop("rope_theta", None) or get("rope_theta") or 10000.0
    keys = {"rope_theta": float(theta)}
    if params.get("rope_type", "default") != "default":
        keys["rope_scaling"] = params
    return keys


def is_llama_layer(tensors: dict[str, torch.Tensor], config: dict, layer_facts: tuple | None) -> bool:
    """Whether the head's layer is the Llama layer every engine builds: its class computes one
    (``layer_facts``, its class name and mask pattern, when known; else ``config``'s model type
    says so) and its ``tensors`` are a Llama layer's, biases aside."""
    names = {k for k in tensors if k.startswith("layers.0.")}
    if not names >= _LLAMA_WEIGHTS or names - _LLAMA_WEIGHTS - QKV_BIAS - _O_BIAS - _MLP_BIAS:
        return False
    if layer_facts is not None:
        return layer_facts[0] in _LLAMA_LAYER_CLASSES
    return config.get("model_type") in _LLAMA_MODEL_TYPES


def engine_gaps(tensors: dict[str, torch.Tensor], config: dict, layer_facts: tuple | None) -> dict[str, list[str]]:
    """Why each engine (``"SafeAILab's EAGLE"``, ``"vLLM"``, ``"SGLang"``) would not draft with
    the head of ``tensors`` and ``config`` (its config.json), saved as is, what specfx drafts:
    engine -> reasons (empty lists where it would). The rules are in docs/HEADS.md; the layer's
    class and window (``layer_facts``) are checked once known, else None."""
    names = {k for k in tensors if k.startswith("layers.0.")}
    gaps: dict[str, list[str]] = {"SafeAILab's EAGLE": [], "vLLM": [], "SGLang": []}
    if not is_llama_layer(tensors, config, layer_facts):
        kind = layer_facts[0] if layer_facts else config.get("model_type")
        extra = sorted(n[len("layers.0.") :] for n in names - _LLAMA_WEIGHTS - QKV_BIAS - _O_BIAS - _MLP_BIAS)
        with_ = f" (with {', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})" if extra else ""
        for reasons in gaps.values():
            reasons.append(f"the head's layer is {kind}{with_}; its EAGLE code builds a Llama layer instead.")
    pattern = layer_facts[1] if layer_facts else ("full", None)
    if pattern[0] != "full":
        for reasons in gaps.values():
            reasons.append(
                f"the head's layer attends within a {pattern[0]} window of {pattern[1]} tokens; its EAGLE layer "
                f"attends to the whole context."
            )
    bias = tensors.get("fc.bias")
    if bias is not None and bool(bias.abs().max() > 0):
        gaps["vLLM"].append(
            "its EAGLE fc has no bias and skips fc.bias, which is nonzero here; heads trained by `specfx train` "
            "(and Eagle.random(fc_bias=False)) have none."
        )
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    q_rows = tensors["layers.0.self_attn.q_proj.weight"].shape[0] if _LLAMA_WEIGHTS <= names else None
    if hidden and heads and q_rows is not None and q_rows != hidden:
        gaps["SafeAILab's EAGLE"].append(
            f"it derives head_dim = hidden_size / num_attention_heads = {hidden // heads} and ignores head_dim "
            f"({q_rows // heads} here)."
        )
    if "rope_scaling" in rope_keys(config) or config.get("rope_scaling"):
        gaps["SafeAILab's EAGLE"].append(
            "its config takes rope_scaling only as {'type': 'linear' | 'dynamic', 'factor': f}, and its layer "
            "then uses base 10000, not rope_theta."
        )
    if names & _O_BIAS:
        gaps["SafeAILab's EAGLE"].append("its o_proj has no bias (only q/k/v have, with qkv_bias).")
    if names & _MLP_BIAS:
        gaps["SafeAILab's EAGLE"].append("its MLP has no biases.")
        gaps["SGLang"].append("its Llama MLP has no biases.")
    if bool(names & QKV_BIAS) != bool(names & _O_BIAS):
        gaps["SGLang"].append(
            "its Llama attention has biases on q, k, v and o together (attention_bias or bias) or on none, "
            "and the head has them on " + ("q, k, v only." if names & QKV_BIAS else "o only.")
        )
    if config.get("hidden_act", "silu") != "silu":
        for engine in ("vLLM", "SGLang"):
            gaps[engine].append(f"its Llama MLP supports hidden_act 'silu' only, not {config['hidden_act']!r}.")
    return gaps
