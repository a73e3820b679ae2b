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

Which target layers it reads (the taps), the tensors of its layout and what each engine makes
of a saved head: :mod:`specfx.drafters.heads.eagle3_checkpoint`; its modules:
:mod:`specfx.drafters.heads.eagle3_head`; the cache protocol it runs in the round:
:class:`~specfx.drafters.heads.eagle_base.EagleBase`.

The head's layer is Llama-style whatever the target (Gemma, Mixtral, ...), sized by its own
config.json, as every trainer builds it. Supported variant: vLLM's ``norm_before_residual``
(the residual stream starts at ``hidden_norm(f)``). Refused with a clear error: more than one
layer, SpecForge's ``fc_norm`` and ``norm_output=false``, ``norm_before_fc``, rotary scaling
that changes with the sequence length (dynamic, longrope).

Embeddings: the target's input embedding table, shared (never copied) and looked up raw, as
SafeAILab and vLLM do (no model-specific scaling such as Gemma's sqrt(H)). A checkpoint's own
``embed_tokens.weight`` is used only when it differs from the target's (a head whose hidden
size differs from the target's must bring its own); an identical copy is dropped.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specfx.drafters.heads.checkpoint import read_head, target_attention, warn_engine_gaps, write_head
from specfx.drafters.heads.eagle3_checkpoint import engine_gaps, explicit_ids, load_head, resolve_taps
from specfx.drafters.heads.eagle3_head import KIND, Eagle3Head
from specfx.drafters.heads.eagle_base import EagleBase
from specfx.drafters.heads.eagle_checkpoint import rope_keys
from specfx.model.admission import streams_refusal
from specfx.model.runner import ModelRunner

# Eagle3Head and resolve_taps are re-exported: their home was this module
__all__ = ["Eagle3", "Eagle3Head", "from_name", "resolve_taps"]


class Eagle3(EagleBase):
    """An EAGLE-3 head as the drafter (the layout and the taps in
    :mod:`specfx.drafters.heads.eagle3_checkpoint`; the cache protocol in
    :mod:`specfx.drafters.heads.eagle_base`).

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
        target_heads, target_kv, head_dim = target_attention(tc)
        heads = num_attention_heads or target_heads
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
            "head_dim": head_dim,
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
        ids = self.layer_ids if self.layer_ids is not None else explicit_ids(config)
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
        lists where it would); see :func:`specfx.drafters.heads.eagle3_checkpoint.engine_gaps`.
        The taps are checked against the target's depth once it is known (after :meth:`random`
        or binding)."""
        return engine_gaps(self.head, self.layer_ids, self.num_target_layers)

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
        why = streams_refusal(target, taps)
        if why is not None:
            raise ValueError(why)
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
