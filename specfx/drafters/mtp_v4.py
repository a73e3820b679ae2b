"""DeepSeek-V4's MTP layer, which transformers drops (``_keys_to_ignore_on_load_unexpected``), built by
specfx from the target's own classes and read from its checkpoint (``ArchSpec.mtp_layout =
"deepseek_v4"``; decision 98).

The layout, restated from DeepSeek's own V4 inference code (``MTPBlock`` in the checkpoint's
``inference/model.py``) and the engines that load it (SGLang's ``DeepseekV4ModelNextN`` in
``python/sglang/srt/models/deepseek_v4_nextn.py``: the MTP layer is built with compress ratio 0)::

    hidden   the previous depth's hyper-connection streams [B, T, hc_mult, H]: the target's last decoder
             layer's output *before* its ``hc_head`` (depth -1), then each MTP depth's own output streams
    enorm, hnorm       RMSNorm of the token's embedding [B, T, H] and of each stream of ``hidden``
    e_proj, h_proj     Linear(H -> H, no bias) each: x = e_proj(enorm(e))[:, :, None] + h_proj(hnorm(hidden))
    the decoder layer  the target's V4 block (hyper-connections, attention, MoE) with sliding-window
                       attention only (no compressor, no indexer) and top-k routing (no hash routing)
    hc_head_fn/base/scale, norm
                       the layer's own stream collapse and final norm: the LM head's input is
                       norm(hc_head(output streams)); the next depth's hidden is the output streams

The embedding and the LM head are the target's. Checkpoint names are DeepSeek's (``mtp.{i}.e_proj.weight``,
``mtp.{i}.attn.wq_a.weight``, ``mtp.{i}.ffn.experts.{e}.w1.weight``, ``mtp.{i}.hc_attn_fn``, ...), mapped
onto transformers' V4 layer as transformers maps the main layers' (its ``deepseek_v4`` conversion).
DeepSeek's releases hold the MTP tensors quantized, FP8 blocks and FP4 experts each with a ``.scale`` tensor
of per-block factors: :func:`dequantize` expands them on loading (the format as transformers' FP8 loader
reads it, ``Fp8Dequantize`` in ``integrations/finegrained_fp8.py``).

Inside specfx the streams travel flattened, ``[B, T, hc_mult * H]`` (:attr:`V4MtpLayers.hidden_width`), so the
MTP drafter's stash and chaining are the same as for every other layout.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specfx.drafters.mtp_fc import FcMtpLayers, _read, _rename, fc_mtp_layer_count

__all__ = ["V4MtpLayers", "dequantize"]

_AT_DEPTH = re.compile(r"^mtp\.(?P<i>\d+)\.(?P<rest>.+)$")
# inside one MTP depth: DeepSeek's names -> transformers' V4 names (first matching prefix)
_TO_MODULE = (
    ("hc_head_fn", "hc_head.hc_fn"),
    ("hc_head_base", "hc_head.hc_base"),
    ("hc_head_scale", "hc_head.hc_scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.norm.", "self_attn.kv_norm."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ("ffn.", "mlp."),
)
_EXPERT = re.compile(r"^mlp\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_EXPERT_MODULE = re.compile(r"^mlp\.experts\.(?P<e>\d+)\.(?P<p>gate_proj|up_proj|down_proj)\.weight$")
_W_TO_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_PROJ_TO_W = {v: k for k, v in _W_TO_PROJ.items()}


class V4MtpLayers(FcMtpLayers):
    """The ``"deepseek_v4"`` MTP layout (module docstring) for ``target``: ``layers.{i}`` is the target's V4
    decoder-layer class with ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm`` and ``hc_head`` of its own."""

    count_field = "num_nextn_predict_layers"
    reference = "DeepSeek's V4 MTPBlock (SGLang's DeepseekV4ModelNextN)"
    target_tap = "last"  # the last decoder layer's output streams, before the target's hc_head

    def __init__(self, target, num_layers: int, *, place: bool = True):
        nn.Module.__init__(self)
        decoder = target.get_decoder()
        self.config = config = self.layer_config(target, num_layers)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        norm, layer_class, head_class = type(decoder.norm), type(decoder.layers[0]), type(decoder.hc_head)
        self.streams = config.hc_mult
        self.hidden_width = self.streams * hidden  # the streams, flattened
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            layer = layer_class(config, i)
            layer.e_proj = nn.Linear(hidden, hidden, bias=False)
            layer.h_proj = nn.Linear(hidden, hidden, bias=False)
            layer.enorm, layer.hnorm, layer.norm = (norm(hidden, eps=eps) for _ in range(3))
            layer.hc_head = head_class(config)
            self.layers.append(layer)
        if place:
            self.place(target)
        self.tie(target)

    @classmethod
    def layer_config(cls, target, num_layers: int):
        """Sliding-window attention (compress ratio 0: no compressor, no indexer) and top-k routed MoE."""
        config = super().layer_config(target, num_layers)
        config.layer_types = ["sliding_attention"] * num_layers
        config.mlp_layer_types = ["moe"] * num_layers
        return config

    @classmethod
    def random(cls, target, num_layers: int, std: float = 0.3, seed: int = 0) -> V4MtpLayers:
        """Seeded random layers (see :meth:`FcMtpLayers.random`), every tensor set (the V4 classes leave their
        hyper-connection parameters uninitialised): matrices ``N(0, std)``, norm weights and the
        hyper-connections' scales near 1, their bases, the attention sinks and the routers'
        score-correction biases random."""
        layers = cls(target, num_layers).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, t in [*layers.named_parameters(), *layers.named_buffers()]:
                noise = torch.randn(t.shape, generator=g)
                if t.dim() >= 2:
                    t.copy_(noise * std)
                elif name.endswith(("weight", "scale")):
                    t.copy_(1.0 + noise * 0.2)
                else:  # hyper-connection bases, sinks, score-correction biases
                    t.copy_(noise * 0.5)
        return layers

    def rope(self, embeds: torch.Tensor, positions: torch.Tensor):
        """The target's "main" rope (the one its sliding-window layers read) at ``positions``."""
        return {"main": self.rotary_emb(embeds, position_ids=positions, layer_type="main")}

    def forward_layer(
        self, i: int, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        """Depth ``i``: ``embeds [B, T, H]`` and the previous depth's streams ``hidden [B, T, hc * H]`` ->
        this depth's output streams ``[B, T, hc * H]`` (the LM head reads :meth:`head_input` of them)."""
        layer = self.layers[i]
        streams = hidden.unflatten(-1, (self.streams, -1))  # [B, T, hc, H]
        x = layer.e_proj(layer.enorm(embeds)).unsqueeze(2) + layer.h_proj(layer.hnorm(streams))
        out = layer(x, position_embeddings=self.rope(embeds, positions), position_ids=positions, **kwargs)
        return out.flatten(2)

    def head_input(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """The LM head's input from depth ``i``'s output streams: its own stream collapse, then its norm."""
        layer = self.layers[i]
        return layer.norm(layer.hc_head(hidden.unflatten(-1, (self.streams, -1))))

    def target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's tapped streams ``[B, T, hc, H]``, flattened as the depths exchange them."""
        return hidden.flatten(2)

    # ----------------------------------------------------------------- checkpoint names
    @classmethod
    def module_name(cls, name: str, config) -> str | None:
        m = _AT_DEPTH.match(name)
        if m is None or not int(m["i"]) < fc_mtp_layer_count(config):
            return None
        rest = _rename(m["rest"], _TO_MODULE)
        if e := _EXPERT.match(rest):
            rest = f"mlp.experts.{e['e']}.{_W_TO_PROJ[e['w']]}.weight"  # folded with the others on loading
        return f"layers.{m['i']}.{rest}"

    def checkpoint_name(self, name: str) -> str:
        _, i, rest = name.split(".", 2)
        if e := _EXPERT_MODULE.match(rest):
            return f"mtp.{i}.ffn.experts.{e['e']}.{_PROJ_TO_W[e['p']]}.weight"
        return f"mtp.{i}.{_rename(rest, [(new, old) for old, new in _TO_MODULE])}"

    @classmethod
    def presence_key(cls, config) -> str:
        return "mtp.0.e_proj.weight"

    @classmethod
    def read_tensors(cls, files: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
        """The tensors, each quantized one (a ``X.weight`` with a ``X.scale`` beside it, as DeepSeek ships its
        FP8 and FP4 tensors) dequantized (:func:`dequantize`) and its scale dropped."""
        raw = _read({ckpt: (ckpt, f) for ckpt, f in files.values()})
        module_of = {ckpt: m for m, (ckpt, _) in files.items()}
        for name in [n for n in raw if n.endswith(".scale")]:
            weight = name[: -len("scale")] + "weight"
            if weight not in raw:
                raise ValueError(f"draft='mtp': the checkpoint has the quantization scale {name!r} but not {weight!r}.")
            raw[weight] = dequantize(raw[weight], raw.pop(name), name)
        return {module_of[ckpt]: t for ckpt, t in raw.items()}


# E2M1 (FP4) values by nibble: sign bit 3, then exponent and mantissa
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """A block-scaled quantized matrix as float32: FP8 (``float8_e4m3fn``) or FP4 (E2M1, two values per byte in
    ``int8``/``uint8``/``float4_e2m1fn_x2``, the low nibble first), times its per-block ``scale`` (float, or
    ``float8_e8m0fnu``/``uint8`` exponents: ``2 ** (e - 127)``). The blocks are the weight's ``[rows, cols]`` over
    the scale's grid (DeepSeek: 128 x 128 for FP8 matrices, 1 x 32 for FP4 experts). Leading dims (stacked
    experts) are carried."""
    if weight.dtype in (torch.int8, torch.uint8) or str(weight.dtype) == "torch.float4_e2m1fn_x2":
        table = torch.tensor(_E2M1)
        packed = weight.contiguous().view(torch.uint8).long()
        values = torch.stack([table[packed & 0xF], table[packed >> 4]], dim=-1)
        values = values.reshape(*weight.shape[:-1], 2 * weight.shape[-1])
    else:
        values = weight.float()
    factor = (scale.float() - 127.0).exp2() if scale.dtype == torch.uint8 else scale.float()
    rows, cols = values.shape[-2:]
    grid = factor.shape[-2:] if factor.dim() >= 2 else (1, 1)
    if factor.dim() < 2 or rows % grid[0] or cols % grid[1] or factor.shape[:-2] != values.shape[:-2]:
        raise ValueError(
            f"draft='mtp': the quantization scale {name!r} of shape {list(scale.shape)} does not tile its weight "
            f"of shape {list(values.shape)} in blocks."
        )
    blocks = values.reshape(*values.shape[:-2], grid[0], rows // grid[0], grid[1], cols // grid[1])
    return (blocks * factor.unsqueeze(-1).unsqueeze(-3)).reshape(values.shape)
