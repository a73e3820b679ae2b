"""EAGLE-1/2 heads as the drafter: ``draft="eagle:DIR"`` / ``specfx.drafters.heads.eagle.Eagle(DIR)``.

EAGLE (Li et al., 2024; SafeAILab/EAGLE) drafts with one decoder layer that reads, at each
position, the token there and the target's feature (hidden state) one position earlier, and
predicts the feature of its own position; the target's LM head turns that prediction into a
draft token. EAGLE-1/2 (:class:`Eagle`) read the target's last hidden state after its final
norm; EAGLE-3 (:mod:`specfx.drafters.heads.eagle3`) fuses several layers' hidden states instead.

The pieces: the cache protocol both share, how the head's entries are written and read in the
round, is :class:`~specfx.drafters.heads.eagle_base.EagleBase`; the head's decoder layer is built
from the target's own layer class by :mod:`specfx.drafters.heads.eagle_layer`; the checkpoint
layout (SafeAILab's) and what each engine makes of a saved head are in
:mod:`specfx.drafters.heads.eagle_checkpoint`. This module is the head itself: its checkpoint
read into modules, bound to a target, and run as one entry forward.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from specfx.drafters.heads.checkpoint import HeadCheckpoint, check_tensors, read_head, warn_engine_gaps, write_head
from specfx.drafters.heads.eagle_base import EagleBase
from specfx.drafters.heads.eagle_checkpoint import (
    CONFIG_KEYS,
    QKV_BIAS,
    engine_gaps,
    is_llama_layer,
    rope_keys,
    rope_theta,
)
from specfx.drafters.heads.eagle_layer import (
    LAYER_OVERRIDES,
    decoder_layer,
    dense_llama_layer,
    layer_type_and_pattern,
    target_rotary,
)
from specfx.model.hf_names import cache_kwarg
from specfx.model.runner import ModelRunner

# EagleBase, rope_keys and target_rotary are re-exported: their home was this module
__all__ = ["Eagle", "EagleBase", "from_name", "rope_keys", "target_rotary"]


def _is_norm(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 1 and "norm" in name


class Eagle(EagleBase):
    """An EAGLE-1/2 head in SafeAILab's layout: ``fc`` (2H -> H, with a bias in SafeAILab's
    checkpoints) on ``cat[embed(token), feature]``, then one decoder layer of the target's own
    class without its input norm, then the target's LM head (no norm before it). The feature is
    the target's last hidden state after its final norm (tap ``"final"``).

    The layer is built with the target's config, sized by the checkpoint's ``config.json``
    where it says (``intermediate_size``, heads, ...), as layer 0 (its attention pattern:
    layer 0's, e.g. Gemma2's sliding window). A checkpoint whose layer holds a dense MLP where
    the target's layer has experts (SafeAILab builds a Llama layer for every target, Mixtral
    included) runs as transformers' ``LlamaDecoderLayer`` sized like the target, full attention.
    Whatever the layer, it runs with the target's rotary embedding, so targets without one are
    refused, as are heads whose ``rope_theta`` differs from the target's.

    Args:
        path: a local directory holding ``config.json`` and safetensors weights (``fc.weight``,
            optionally ``fc.bias``, ``layers.0.*``; an ``embed_tokens.weight`` there is only
            shape-checked: the head uses the target's embedding), or one ``.safetensors`` file.

    ``Eagle.random(target)`` makes a random head for ``target`` (tests, training), and
    :meth:`save` writes the same layout. The embedding and LM head are the target's (shared,
    never copied); the head's own parameters follow the target's device and dtype at bind.
    """

    name = "eagle"
    taps = ("final",)  # the target's last hidden state, after its final norm

    def __init__(self, path: str | Path):
        if path is None or (isinstance(path, str) and not path.strip()):
            raise ValueError(
                "Eagle(path): path is required: the directory of an EAGLE head checkpoint in SafeAILab's "
                "layout (config.json and *.safetensors), e.g. specfx.drafters.heads.eagle.Eagle('/models/EAGLE-llama') "
                "or draft='eagle:/models/EAGLE-llama'."
            )
        self._set_checkpoint(read_head(path, "EAGLE"))

    @classmethod
    def _from_checkpoint(cls, ckpt: HeadCheckpoint) -> Eagle:
        head = cls.__new__(cls)
        head._set_checkpoint(ckpt)
        return head

    def _set_checkpoint(self, ckpt: HeadCheckpoint) -> None:
        config = ckpt.config
        deeper = sorted({k.split(".")[1] for k in ckpt.tensors if k.startswith("layers.") and not k.startswith("layers.0.")})
        if deeper or config.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"EAGLE checkpoint {str(ckpt.path)!r} has {config.get('num_hidden_layers', 1 + len(deeper))} decoder "
                f"layers; EAGLE-1/2 heads have one (layers.0), which is what specfx runs."
            )
        if config.get("add_para_norm"):
            raise ValueError(
                f"EAGLE checkpoint {str(ckpt.path)!r} sets add_para_norm (HASS-style norms on the embedding "
                f"and the feature), which specfx's EAGLE head does not implement."
            )
        self.checkpoint = ckpt
        self.fc: nn.Linear | None = None
        self.layer: nn.Module | None = None
        # (layer class name, mask pattern) once known (random() or bind): what engine_gaps checks
        self.layer_facts: tuple[str, tuple] | None = None

    def __repr__(self) -> str:
        return f"Eagle({str(self.checkpoint.path)!r})"

    @property
    def has_bias(self) -> bool:
        """Whether ``fc`` has a bias: the config's ``bias`` when it says (SafeAILab's key),
        else whether the weights hold ``fc.bias``."""
        bias = self.checkpoint.config.get("bias")
        return bool(bias) if bias is not None else "fc.bias" in self.checkpoint.tensors

    # ----------------------------------------------------------------- building
    def _layer_overrides(self, model) -> dict:
        target = model.config.get_text_config()
        return {k: v for k, v in self.checkpoint.config.items() if k in LAYER_OVERRIDES and hasattr(target, k)}

    def _build(self, model) -> None:
        """The head's modules for ``model`` (an HF causal LM) from the checkpoint's tensors,
        checked against the target's sizes."""
        owner = f"EAGLE head {str(self.checkpoint.path)!r}"
        config = model.config.get_text_config()
        hidden = config.hidden_size
        vocab = model.get_output_embeddings().weight.shape[0]
        ckpt = self.checkpoint
        for key, value, why in (
            ("hidden_size", hidden, "hidden size"),
            ("vocab_size", (vocab, config.vocab_size), "vocabulary size"),
        ):
            got = ckpt.config.get(key)
            allowed = value if isinstance(value, tuple) else (value,)
            if got is not None and got not in allowed:
                raise ValueError(
                    f"{owner} was trained for a target with {why} {got} (its config.json {key}), but this "
                    f"target ({type(model).__name__}) has {allowed[0]}; use the head trained for this target."
                )
        theta, target_theta = rope_theta(ckpt.config), rope_theta(config)
        if theta is not None and target_theta is not None and float(theta) != float(target_theta):
            raise ValueError(
                f"{owner} was trained with rope_theta {theta} but the target has {target_theta}; the head runs "
                f"with the target's rotary embedding, so it must be the head trained for this target."
            )
        overrides = self._layer_overrides(model)
        layer, layer_config = decoder_layer(model, overrides, owner)
        have = {k[len("layers.0.") :] for k in ckpt.tensors if k.startswith("layers.0.")}
        if have != set(layer.state_dict()):  # SafeAILab's dense layer for an MoE target (Mixtral)?
            dense, dense_config = dense_llama_layer(model, overrides, owner)
            if have == set(dense.state_dict()):
                layer, layer_config = dense, dense_config
        expected = {"fc.weight": (hidden, 2 * hidden)}
        why = {"fc.weight": f"[hidden, 2 * hidden] for the target's hidden size {hidden}"}
        if self.has_bias:
            expected["fc.bias"] = (hidden,)
        expected.update({f"layers.0.{k}": tuple(t.shape) for k, t in layer.state_dict().items()})
        if "embed_tokens.weight" in ckpt.tensors:
            expected["embed_tokens.weight"] = (vocab, hidden)
            why["embed_tokens.weight"] = f"the target's embedding [{vocab}, {hidden}]"
        check_tensors(ckpt, "EAGLE", expected, why)
        unknown = sorted(k for k in ckpt.tensors if k.startswith("layers.0.") and k not in expected)
        if unknown:
            raise ValueError(
                f"{owner} has tensors this target's decoder layer ({type(layer).__name__}, without its input "
                f"norm) does not: {', '.join(unknown[:6])}; the head was trained for another architecture."
            )
        fc = nn.Linear(2 * hidden, hidden, bias=self.has_bias)
        with torch.no_grad():
            fc.weight.copy_(ckpt.tensors["fc.weight"])
            if self.has_bias:
                fc.bias.copy_(ckpt.tensors["fc.bias"])
            layer.load_state_dict({k[len("layers.0.") :]: v for k, v in ckpt.tensors.items() if k.startswith("layers.0.")})
        self.fc, self.layer, self.layer_config = fc.eval(), layer, layer_config

    @classmethod
    def random(cls, target, seed: int = 0, std: float | None = None, *, fc_bias: bool = False) -> Eagle:
        """A head for ``target`` (an HF causal LM) with seeded random weights (norms at their
        defaults; ``std`` defaults to the target's ``initializer_range``): for tests and as a
        starting point for training. Its drafts are meaningless until trained.

        ``fc_bias``: give ``fc`` a (random) bias, as SafeAILab's heads have. Off by default:
        vLLM's EAGLE ``fc`` has no bias and drops ``fc.bias``, so only a head without one (saved
        as a zero bias, which SGLang's and SafeAILab's ``fc`` need) drafts the same everywhere."""
        model = target.model if isinstance(target, ModelRunner) else target
        config = model.config.get_text_config()
        std = float(getattr(config, "initializer_range", 0.02)) if std is None else std
        layer, layer_config = decoder_layer(model, {}, "Eagle.random")
        hidden = config.hidden_size
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(shape, generator=g) * std

        tensors = {"fc.weight": rand(hidden, 2 * hidden)}
        bias = rand(hidden)  # drawn either way: a seed gives the same layer weights with or without it
        if fc_bias:
            tensors["fc.bias"] = bias
        for k, t in layer.state_dict().items():
            tensors[f"layers.0.{k}"] = t.detach().clone() if _is_norm(k, t) else rand(*t.shape)
        saved = config.to_dict()
        head_config = {k: saved[k] for k in CONFIG_KEYS if saved.get(k) is not None}
        head_config.update(rope_keys(config), architectures=[type(model).__name__], num_hidden_layers=1, bias=fc_bias)
        head = cls._from_checkpoint(HeadCheckpoint(Path(f"Eagle.random(seed={seed})"), head_config, tensors))
        head.layer_facts = (type(layer).__name__, layer_type_and_pattern(layer_config, "Eagle.random")[1])
        return head

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The head's tensors in the checkpoint layout (the built modules' when built)."""
        if self.layer is None:
            return dict(self.checkpoint.tensors)
        tensors = {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        tensors.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return tensors

    def save(self, path: str | Path) -> Path:
        """Write the head to directory ``path`` in SafeAILab's layout (``config.json`` and
        ``model.safetensors``), which :class:`Eagle` (``draft="eagle:DIR"``), SafeAILab's EAGLE
        code, vLLM and SGLang load (docs/HEADS.md):

        * ``rope_theta`` at the top level (and ``rope_scaling`` for scaled rotary), where those
          readers look for the base;
        * ``fc.bias`` always, zeros for a head without one (SGLang's ``fc`` always has a bias,
          SafeAILab's by default; vLLM's has none and skips it), and no ``bias`` key: vLLM and
          SGLang read ``bias`` as *attention* biases, SafeAILab as the fc bias (default true);
        * ``qkv_bias`` (SafeAILab and vLLM: biases on q/k/v only);
        * for a Llama layer, ``architectures`` ``["LlamaForCausalLMEagle", "LlamaForCausalLM"]``:
          SGLang takes the first it knows (its EAGLE class), vLLM prefixes each with ``Eagle``
          and takes the first it knows (``EagleLlamaForCausalLM``).

        A head some engine would not run as specfx does is saved with a
        :class:`~specfx.drafters.heads.checkpoint.HeadLayoutWarning` naming it (:meth:`engine_gaps`)."""
        tensors = self.state_dict()
        hidden = tensors["fc.weight"].shape[0]
        if "fc.bias" not in tensors:
            tensors["fc.bias"] = torch.zeros(hidden, dtype=tensors["fc.weight"].dtype)
        config = {k: v for k, v in self.checkpoint.config.items() if k != "bias"}
        config.update(rope_keys(config), num_hidden_layers=1, qkv_bias=QKV_BIAS <= set(tensors))
        if is_llama_layer(tensors, self.checkpoint.config, self.layer_facts):
            config["architectures"] = ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
        warn_engine_gaps("EAGLE", path, self.engine_gaps())
        return write_head(path, config, tensors)

    def engine_gaps(self) -> dict[str, list[str]]:
        """Why each engine (``"SafeAILab's EAGLE"``, ``"vLLM"``, ``"SGLang"``) would not draft
        with this head, saved by :meth:`save`, what specfx drafts: engine -> reasons (empty
        lists where it would); see :func:`specfx.drafters.heads.eagle_checkpoint.engine_gaps`.
        The layer's class and window are checked once known (after :meth:`random` or binding)."""
        return engine_gaps(self.state_dict(), self.checkpoint.config, self.layer_facts)

    # ----------------------------------------------------------------- binding
    def _bind(self, target: ModelRunner) -> None:
        model = target.model
        owner = f"EAGLE head {str(self.checkpoint.path)!r}"
        self.rotary = target_rotary(model, owner)
        if self.layer is not None:  # built before (bound to a target, maybe trained): keep its weights
            tensors = {k: v.detach().to("cpu") for k, v in self.state_dict().items()}
            self.checkpoint = HeadCheckpoint(self.checkpoint.path, self.checkpoint.config, tensors)
        self._build(model)
        self.per_layer_rope = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.layer_type, self.pattern = layer_type_and_pattern(self.layer_config, owner)
        self.layer_facts = (type(self.layer).__name__, self.pattern)
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.fc.to(device=target.device, dtype=target.dtype)
        self.layer.to(device=target.device, dtype=target.dtype)
        self.cache_kwarg = cache_kwarg(self.layer)  # "cache" from transformers 5.24 on
        self.state_size = self.fc.out_features

    # ----------------------------------------------------------------- the head
    def _feature(self, features):
        return features[0]

    def _entry(self, ids, feature, positions, slots, tree):
        self.cache.slots = slots
        embeds = self.embed(ids).to(feature.dtype)  # [B, T, H]
        x = self.fc(torch.cat([embeds, feature], dim=-1))  # [B, T, H]
        kwargs = {"layer_type": self.layer_type} if self.per_layer_rope else {}
        rope = self.rotary(x, positions, **kwargs)
        out = self.layer(
            x,
            attention_mask=self._entry_mask(positions, tree, self.pattern),
            position_ids=positions,
            position_embeddings=rope,
            **{self.cache_kwarg: self.cache},
        )
        return out[0] if isinstance(out, tuple) else out

    def _logits(self, out):
        return self.lm_head(out)


def from_name(arg: str | None) -> Eagle:
    """``draft="eagle:DIR"``: an EAGLE-1/2 head loaded from checkpoint directory DIR."""
    if not arg:
        raise ValueError(
            "draft='eagle' needs the head's checkpoint directory after a colon: draft='eagle:DIR' (an EAGLE-1/2 "
            "head in SafeAILab's layout: config.json and *.safetensors)."
        )
    return Eagle(arg)
