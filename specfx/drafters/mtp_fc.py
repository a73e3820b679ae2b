"""MTP layers that transformers drops, built by specfx from the target's own classes and read
from its checkpoint (``ArchSpec.mtp_layout``; decisions 86, 95): the ``"qwen3_next"`` layout
(Qwen3-Next, Qwen3.5, Qwen3.5-MoE; :class:`FcMtpLayers`, below) and the ``"bailing"`` layout
(BailingHybrid, inclusionAI's Ling 3; :class:`EhMtpLayers`, at the end).

transformers' classes of these types skip the checkpoint's ``mtp.*`` tensors
(``_keys_to_ignore_on_load_unexpected``) and their configs declare no ``num_mtp_layers``, so its
``MtpModel`` cannot build them. The layout is the one vLLM loads (``Qwen3NextMultiTokenPredictor``
in vllm-project/vllm ``vllm/model_executor/models/qwen3_next_mtp.py`` @ ffdc9857,
``Qwen3_5MultiTokenPredictor`` in ``qwen3_5_mtp.py`` @ 9a4f2b9f), restated::

    mtp.pre_fc_norm_embedding   RMSNorm (the target's class) of the token's embedding   [B, T, H]
    mtp.pre_fc_norm_hidden      RMSNorm of the previous depth's hidden state              [B, T, H]
    mtp.fc                      Linear(2H -> H, no bias) over cat(embedding, hidden)      [B, T, 2H]
    mtp.layers.{i}              the target's decoder layer built as a full-attention layer, index i
    mtp.norm                    RMSNorm of the layer's output: the LM head's input and the next depth's hidden

``fc`` and the three norms are shared by the layers; the embedding and LM head are the target's.
A step's hidden input is the target's last hidden state after its final norm, then the step's own
output. Layer counts: the config's ``mtp_num_hidden_layers`` (what Qwen ships), else
``num_nextn_predict_layers``; every shipped checkpoint has one. Past the last layer specfx chains
the last one on its own output (vLLM cycles ``layers[step % n]``: the same for n = 1).

The norms are the target's own class (Qwen3-Next's and Qwen3.5's RMSNorm scale by ``1 + weight``),
so no formula is restated here. Expert weights are read in either form a checkpoint holds them:
one tensor per expert (``experts.{e}.gate_proj/up_proj/down_proj.weight``, how transformers saves
these types) folded as transformers folds the target's own (its "qwen2_moe" conversion: experts
stacked, gate then up concatenated), or already fused (``experts.gate_up_proj``).

Only safetensors are read (headers, then the ``mtp.*`` tensors); nothing is unpickled.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections import defaultdict

import torch
from torch import nn

__all__ = ["LAYOUTS", "EhMtpLayers", "FcMtpLayers", "checkpoint_files", "fc_mtp_layer_count"]

PREFIX = "mtp."
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_files(model) -> dict[str, str] | None:
    """``{tensor name: safetensors file}`` of the checkpoint ``model`` was loaded from (a local
    directory or the HF cache; never the network), from the index or the file's header; None if
    no safetensors checkpoint is found."""
    from safetensors import safe_open

    path = getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None)
    if not path:
        return None

    def locate(filename):
        if os.path.isdir(path):
            f = os.path.join(path, filename)
            return f if os.path.isfile(f) else None
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        f = try_to_load_from_cache(path, filename)
        return f if isinstance(f, str) else None

    index = locate("model.safetensors.index.json")
    if index is not None:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = {name: locate(shard) for name, shard in weight_map.items()}
        return {name: f for name, f in files.items() if f is not None}
    single = locate("model.safetensors")
    if single is None:
        return None
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def fc_mtp_layer_count(config) -> int:
    """MTP layers a config of this layout declares: ``mtp_num_hidden_layers``, else
    ``num_nextn_predict_layers`` (0 when neither is a positive int)."""
    config = config.get_text_config(decoder=True)
    for field in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        n = getattr(config, field, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return 0


class FcMtpLayers(nn.Module):
    """The ``"qwen3_next"`` MTP layout (module docstring) for ``target``: its state dict holds the
    checkpoint's ``mtp.*`` tensors under their names less ``mtp.``; the embedding, LM head and
    rotary embedding are the target's, shared and not owned (kept out of the state dict).

    :meth:`forward_layer` is one depth: what transformers' ``MtpLayer`` computes for DeepSeek-style
    layers, with this layout's shared fc and norms.

    A layout is a subclass: its modules (``__init__``), its depth (:meth:`forward_layer`), its
    checkpoint names (:meth:`module_name` / :meth:`checkpoint_name`), the tensor whose presence says
    a checkpoint has the layers (:meth:`presence_key`), the config field counting them
    (``count_field``) and the engine whose loader it follows (``reference``)."""

    count_field = "mtp_num_hidden_layers"
    reference = "vLLM's Qwen3-Next/Qwen3.5 MTP"

    def __init__(self, target, num_layers: int, *, place: bool = True):
        super().__init__()
        decoder = target.get_decoder()
        self.config = config = self.layer_config(target, num_layers)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        norm, layer = type(decoder.norm), type(decoder.layers[0])
        self.pre_fc_norm_embedding = norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(layer(config, i) for i in range(num_layers))
        self.norm = norm(hidden, eps=eps)
        if place:  # else built on the meta device, its tensors assigned from a checkpoint
            self.place(target)
        self.tie(target)

    @classmethod
    def layer_config(cls, target, num_layers: int):
        """A copy of the target's text config for ``num_layers`` MTP layers of full attention (the
        target's decoder-layer class reads its mixer from ``layer_types[layer_idx]``)."""
        config = copy.deepcopy(target.config.get_text_config(decoder=True))
        config.num_hidden_layers = num_layers
        config.layer_types = ["full_attention"] * num_layers
        return config

    def place(self, target):
        """On ``target``'s device in its dtype, but for the tensors its class keeps in float32
        (``_keep_in_fp32_modules(_strict)``, matched as transformers matches them: a substring of the
        name; BailingHybrid's router weight and score-correction bias), as the target's own layers."""
        self.to(device=target.device, dtype=target.dtype)
        keep = [
            *(getattr(target, "_keep_in_fp32_modules", None) or ()),
            *(getattr(target, "_keep_in_fp32_modules_strict", None) or ()),
        ]
        if keep and target.dtype != torch.float32:
            pattern = re.compile("|".join(re.escape(k) for k in keep))
            for name, t in [*self.named_parameters(), *self.named_buffers()]:
                if pattern.search(name) and t.is_floating_point():
                    t.data = t.data.float()
        return self

    def tie(self, target) -> None:
        """Share ``target``'s embedding, LM head and rotary embedding (plain attributes: not
        submodules, so neither in the state dict nor moved by ``.to()``)."""
        object.__setattr__(self, "embed_tokens", target.get_input_embeddings())
        object.__setattr__(self, "shared_head", target.get_output_embeddings())
        object.__setattr__(self, "rotary_emb", getattr(target.get_decoder(), "rotary_emb", None))

    def forward_layer(
        self, i: int, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        """Depth ``i``: ``embeds [B, T, H]`` (the tokens at q ``positions [B, T]``) and ``hidden
        [B, T, H]`` (the previous depth at q - 1) -> ``[B, T, H]``, normed; ``kwargs`` go to the decoder
        layer (mask, cache)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        rope = self.rope(embeds, positions)
        return self.norm(self.layers[i](self.fc(x), position_embeddings=rope, position_ids=positions, **kwargs))

    def head_input(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """The LM head's input from depth ``i``'s output: the output itself (already normed)."""
        return hidden

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's tapped state as depth 0 reads it: as it is."""
        return hidden

    def rope(self, embeds: torch.Tensor, positions: torch.Tensor):
        """The target's rotary embedding at ``positions [B, T]``, as its text model computes it: a
        multimodal rope (Qwen3.5's, ``mrope_section``) gets the text positions on each of its three
        grids (transformers 5.17's takes only those; later releases expand a 2-D input the same way)."""
        if getattr(self.rotary_emb, "mrope_section", None) is not None:
            positions = positions.unsqueeze(0).expand(3, -1, -1)  # [3, B, T]
        return self.rotary_emb(embeds, positions)

    # ----------------------------------------------------------------- checkpoint names
    @classmethod
    def module_name(cls, name: str, config) -> str | None:
        """The state-dict name of checkpoint tensor ``name`` (None: not one of these layers')."""
        return name[len(PREFIX) :] if name.startswith(PREFIX) else None

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint name of state-dict entry ``name`` (experts fused; see :meth:`checkpoint_tensors`)."""
        return PREFIX + name

    @classmethod
    def presence_key(cls, config) -> str:
        """A tensor every checkpoint with these layers holds (the first thing a depth reads)."""
        return PREFIX + "fc.weight"

    # ----------------------------------------------------------------- building
    @classmethod
    def random(cls, target, num_layers: int, std: float = 0.3, seed: int = 0) -> FcMtpLayers:
        """Seeded random matrices and norm weights perturbed around their initial values (so a norm
        left out changes even the greedy drafts), in eval mode: layers for tests and benchmarks of
        the machinery (their drafts are meaningless)."""
        layers = cls(target, num_layers).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in layers.parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(noise * std if p.dim() >= 2 else p + noise * 0.2)
        return layers

    @classmethod
    def from_checkpoint(cls, target) -> FcMtpLayers:
        """The layers of the checkpoint ``target`` was loaded from (ValueError naming what is
        missing or unexpected)."""
        n = fc_mtp_layer_count(target.config)
        name = type(target).__name__
        if getattr(target.config.get_text_config(decoder=True), "mtp_use_dedicated_embeddings", False):
            raise ValueError(
                f"draft='mtp': {name}'s config sets mtp_use_dedicated_embeddings: MTP layers with an "
                f"embedding of their own are a layout specfx has not read (every checkpoint seen shares the target's)."
            )
        config = target.config.get_text_config(decoder=True)
        files = {}  # {module name: (checkpoint name, file)}
        for k, f in (checkpoint_files(target) or {}).items():
            if (m := cls.module_name(k, config)) is not None:
                files[m] = (k, f)
        with torch.device("meta"):  # no initialisation of what the checkpoint overwrites (billions of expert weights)
            layers = cls(target, n, place=False)
        tensors = _fold_experts(cls.read_tensors(files), set(layers.state_dict()))
        missing, unexpected = layers.load_state_dict(tensors, strict=False, assign=True)
        unset = [name for name, t in layers.named_buffers() if t.is_meta]
        if missing or unexpected or unset:
            raise ValueError(
                f"draft='mtp': the checkpoint's MTP tensors do not match {n} MTP layer(s) of {name}'s layout "
                f"({cls.reference}): missing {sorted(layers.checkpoint_name(k) for k in missing)[:8]}, "
                f"unexpected {sorted(files[k][0] if k in files else k for k in unexpected)[:8]}, "
                f"buffers no checkpoint sets {unset[:8]}."
            )
        return layers.place(target).eval()

    @classmethod
    def read_tensors(cls, files: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
        """``{module name: tensor}`` from ``{module name: (checkpoint name, safetensors file)}``."""
        return _read(files)

    def checkpoint_tensors(self, per_expert: bool) -> dict[str, torch.Tensor]:
        """This module's tensors under their checkpoint names, experts one tensor per expert when
        ``per_expert`` (how transformers saves these types), else fused."""
        tensors = {k: t.detach().contiguous() for k, t in self.state_dict().items()}
        tensors = _unfold_experts(tensors) if per_expert else tensors
        return {self.checkpoint_name(k): t for k, t in tensors.items()}


def _read(files: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    """``{module name: tensor}`` from ``{module name: (checkpoint name, safetensors file)}``."""
    from safetensors import safe_open

    by_file = defaultdict(list)
    for module_name, (name, f) in files.items():
        by_file[f].append((module_name, name))
    tensors = {}
    for f, names in by_file.items():
        with safe_open(f, framework="pt", device="cpu") as opened:
            for module_name, name in names:
                tensors[module_name] = opened.get_tensor(name)
    return tensors


def _fold_experts(tensors: dict[str, torch.Tensor], module_keys: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors folded into the module's fused ones where it has them:
    ``gate_up_proj [E, 2I, H]`` (expert e's gate rows, then its up rows) and ``down_proj [E, H, I]``."""
    out, groups = {}, defaultdict(dict)
    for k, t in tensors.items():
        m = _PER_EXPERT.match(k)
        if m and f"{m['experts']}.gate_up_proj" in module_keys:
            groups[m["experts"]][int(m["e"]), m["proj"]] = t
        else:
            out[k] = t
    for experts, parts in groups.items():
        count = 1 + max(e for e, _ in parts)
        need = [(e, p) for e in range(count) for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in parts]
        if need:
            raise ValueError(
                f"draft='mtp': the checkpoint lacks the MTP tensor {experts}.{need[0][0]}.{need[0][1]}.weight."
            )
        out[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(count)]
        )
        out[f"{experts}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])
    return out


def _unfold_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in tensors.items():
        if k.endswith(".experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e, rows in enumerate(t):
                gate, up = rows.chunk(2)
                out[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}{e}.up_proj.weight"] = up.contiguous()
        elif k.endswith(".experts.down_proj"):
            base = k[: -len("down_proj")]
            for e, rows in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = rows.contiguous()
        else:
            out[k] = t
    return out


# ----------------------------------------------------------------- the "bailing" layout
_AT_LAYER = re.compile(r"^model\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")
# checkpoint -> transformers names inside an MTP layer, by prefix (BailingHybrid's conversion mapping; a
# checkpoint saved by transformers is written back in the original names; one in transformers' own names
# passes unchanged, so both forms are read)
_TO_MODULE = (
    ("attention.dense.", "self_attn.o_proj."),
    ("attention.", "self_attn."),
    ("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"),
)
_TO_CHECKPOINT = (
    ("self_attn.o_proj.", "attention.dense."),
    ("self_attn.", "attention."),
    ("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias"),
)


def _rename(rest: str, pairs) -> str:
    """``rest`` (a name inside one layer) with the first matching prefix of ``pairs`` replaced."""
    for old, new in pairs:
        if rest.startswith(old):
            return new + rest[len(old) :]
    return rest


class EhMtpLayers(FcMtpLayers):
    """The ``"bailing"`` MTP layout (BailingHybrid: inclusionAI's Ling 3; decision 95), the one vLLM
    loads (``BailingMoeV3MultiTokenPredictor`` in vllm-project/vllm
    ``vllm/model_executor/models/bailing_moe_v3_mtp.py`` @ 017ad415), restated: MTP layer ``i`` is stored
    after the decoder's, at ``model.layers.{num_hidden_layers + i}``, with norms and projection of its own::

        enorm, hnorm       RMSNorm of the token's embedding and of the previous depth's hidden state
        eh_proj            Linear(2H -> H, no bias) over cat(enorm(embedding), hnorm(hidden))
        input_layernorm, attention.* (MLA, head-wise gate), post_attention_layernorm, mlp.* (MoE)
                           a decoder layer: the target's class built as a full-attention MoE layer
        final_layernorm    RMSNorm of the layer's output: the LM head's input and the next depth's hidden

    Tensors are named as Ling's checkpoints name them (``attention.dense`` is transformers'
    ``self_attn.o_proj``, ``mlp.gate.expert_bias`` its ``e_score_correction_bias``, experts one tensor
    each); the config counts the layers in ``num_mtp_layers`` (``num_nextn_predict_layers``). Unlike
    DeepSeek's MTP in vLLM, this one does not zero the embedding at position 0."""

    count_field = "num_mtp_layers"
    reference = "vLLM's Bailing-MoE V3 MTP"

    def __init__(self, target, num_layers: int, *, place: bool = True):
        nn.Module.__init__(self)
        decoder = target.get_decoder()
        self.first = target.config.get_text_config(decoder=True).num_hidden_layers  # checkpoint index of MTP layer 0
        self.config = config = self.layer_config(target, num_layers)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        norm, layer_class = type(decoder.norm), type(decoder.layers[0])
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            layer = layer_class(config, i)
            layer.enorm, layer.hnorm = norm(hidden, eps=eps), norm(hidden, eps=eps)
            layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            layer.final_layernorm = norm(hidden, eps=eps)
            self.layers.append(layer)
        if place:
            self.place(target)
        self.tie(target)

    @classmethod
    def layer_config(cls, target, num_layers: int):
        """Full attention (MLA) and MoE, as vLLM builds the layer whatever its index."""
        config = super().layer_config(target, num_layers)
        config.mlp_layer_types = ["sparse"] * num_layers
        return config

    @classmethod
    def random(cls, target, num_layers: int, std: float = 0.3, seed: int = 0) -> EhMtpLayers:
        """As :meth:`FcMtpLayers.random`, the routers' score-correction biases (buffers the checkpoint
        sets too) random as well, so that a bias left unread changes the drafts."""
        layers = super().random(target, num_layers, std, seed)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, b in layers.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=g))
        return layers

    def forward_layer(
        self, i: int, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        layer = self.layers[i]
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        rope = self.rope(embeds, positions)
        return layer.final_layernorm(layer(x, position_embeddings=rope, position_ids=positions, **kwargs))

    @classmethod
    def module_name(cls, name: str, config) -> str | None:
        m = _AT_LAYER.match(name)
        if m is None:
            return None
        i = int(m["i"]) - config.num_hidden_layers
        if not 0 <= i < fc_mtp_layer_count(config):
            return None
        return f"layers.{i}.{_rename(m['rest'], _TO_MODULE)}"

    def checkpoint_name(self, name: str) -> str:
        _, i, rest = name.split(".", 2)
        return f"model.layers.{self.first + int(i)}.{_rename(rest, _TO_CHECKPOINT)}"

    @classmethod
    def presence_key(cls, config) -> str:
        return f"model.layers.{config.get_text_config(decoder=True).num_hidden_layers}.eh_proj.weight"


LAYOUTS = {"qwen3_next": FcMtpLayers, "bailing": EhMtpLayers}  # ArchSpec.mtp_layout -> its class
