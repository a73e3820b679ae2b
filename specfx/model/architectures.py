"""The architecture conformance table: what specfx supports, per HF model type.

The engine has no per-architecture code: :class:`specfx.model.runner.ModelRunner` drives every model
through the same hooks (``cache.update`` on the cache argument, a 4-D mask or a dict of them keyed by
``config.layer_types``, ``position_ids``) and refuses, at ``speculate()``, models whose state it
cannot roll back. This table is *declarative*: it records what was verified for each model type
and what makes the architecture interesting, and the conformance tests
(``tests/conformance/test_conformance.py``) are generated from it. An architecture missing from the
table that follows the conventions works anyway; ``python -m specfx.testing.architectures
--sweep`` checks every causal LM type transformers ships and prints the rows to add (the table
itself imports nothing above the model layer: what runs models through ``speculate()`` lives
in :mod:`specfx.testing.architectures`).

A row may hold only where the installed implementation is causal (``ArchSpec.if_causal``): transformers
5.17's BigBird, MegatronBert and RemBert attend to later tokens even as decoders. Whether it is
is read off the installed implementation itself (:func:`decodes_incrementally`, HF's own cached
decoding against its full forward), never off a version number; :func:`supported` leaves such a
row out where its predicate says it is not, and ``speculate()`` refuses the model there (the incremental-decoding
probe).

The engine reads declarations from here for what nothing in the config or graph reveals: the
``unsupported`` and ``refused`` statuses (``speculate()`` refuses such a model with the recorded
reason rather than risk wrong tokens), and the per-type facts of the rows that need them (MTP
layouts and reasons, the torch whose Inductor compiles a type, DeepSeek-V4's compressed KV,
fewest queries per forward and padding refusal: decision 97).

Statuses:
    supported   greedy output equals ``model.generate()`` (fp32, batch 1 and a left-padded
                batch, generating past the sliding window where there is one), as target and
                as draft; sampling runs.
    refused     ``speculate()`` raises a ValueError naming the reason (recurrent or
                linear-attention state, no KV cache, or the incremental-decoding probe: the
                model's logits through specfx's cache, mask and positions differ from its
                full forward, e.g. bidirectional heads, positions taken from the cache length,
                windows cut from the buffer length; see :mod:`specfx.model.probe`).
    unsupported known not to work yet; ``reason`` says why, and ``speculate()`` raises it (a
                declared refusal, for failures no generic check catches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specfx.model.probe import decodes_incrementally
from specfx.model.tiny_rows import STATE_TINY as _STATE_TINY
from specfx.model.tiny_rows import V4_TINY as _V4_TINY

__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "compressed_kv",
    "COMPILED_SUBSET",
    "REPRESENTATIVE",
    "decodes_incrementally",
    "inductor_miscompiles",
    "installed",
    "min_queries",
    "supported",
]


@dataclass(frozen=True)
class ArchSpec:
    """One row: status, what the architecture exercises, and tiny-config overrides.
    ``if_causal``: supported only where the installed implementation decodes incrementally
    (:func:`decodes_incrementally`); elsewhere refused by the probe and left out of :func:`supported`.
    ``stateful``: recurrent, linear-attention or other non-KV state (decisions 76, 79). On a supported
    row: supported as a target or a draft model with chain rounds only, eager or compiled (decisions
    78, 81, 82; no trees or early exit, MTP only where ``mtp_layout`` names a layout, 86), so left out of :func:`supported`'s generic matrix;
    ``inductor_torch``: the oldest torch whose Inductor compiles the type's round correctly
    (decision 84; an older one is refused Inductor at ``speculate()``);
    ``tests/unit/model/test_hybrid_speculate.py`` checks them. On a refused row: ``speculate()`` refuses
    the type up front, in any role, quoting ``reason`` (what cannot be run exactly, why, what would fix it).
    ``mtp_layout``: the layout of the MTP layers the type's checkpoints ship and transformers drops, which
    specfx builds itself (:mod:`specfx.drafters.mtp_fc`; decision 86): ``draft="mtp"`` runs on such a type,
    stateful or not, since the layout's layers keep attention KV only. ``mtp_reason``: why
    ``draft="mtp"`` is refused on a type whose checkpoints ship MTP layers specfx cannot run (decision 86;
    DeepSeek-V4's, 97). ``compressed_kv``, ``min_queries``, ``padding_reason``: decision 97, below; a
    ``compressed_kv`` row is left out of :func:`supported`'s generic matrix too (its left-padded batches
    are refused), ``tests/unit/model/test_compressed_kv.py`` checks it."""

    status: str
    features: str = ""
    reason: str = ""
    overrides: dict = field(default_factory=dict)
    if_causal: bool = False
    stateful: bool = False
    inductor_torch: str = ""  # the oldest torch whose Inductor compiles this type's round correctly ("": any)
    mtp_layout: str = ""  # "qwen3_next": MTP layers specfx builds from the checkpoint's mtp.* tensors ("": none)
    mtp_reason: str = ""  # why draft="mtp" is refused on this stateful type ("": the generic reason)
    # Decision 97 (DeepSeek-V4): ``compressed_kv``: what HF marks as state (``_is_stateful``) is a KV
    # compressor's running windows, which specfx keeps as per-token values at slots (nothing to roll back);
    # ``min_queries``: every forward gets at least this many queries (a padding query added before a shorter
    # one: at a single query HF's heavily-compressed layers show every pooled window, built for a cache that
    # holds complete windows only); ``padding_reason``: why rows of unequal prompt lengths are refused
    compressed_kv: bool = False
    min_queries: int = 1
    padding_reason: str = ""


def _s(features: str = "", **overrides) -> ArchSpec:
    return ArchSpec("supported", features, overrides=overrides)


def _r(reason: str, **overrides) -> ArchSpec:
    return ArchSpec("refused", reason=reason, overrides=overrides)


def _state(
    features: str, inductor_torch: str = "", mtp_layout: str = "", mtp_reason: str = "", **overrides
) -> ArchSpec:
    return ArchSpec(
        "supported",
        features,
        overrides=overrides,
        stateful=True,
        inductor_torch=inductor_torch,
        mtp_layout=mtp_layout,
        mtp_reason=mtp_reason,
    )


# torch 2.11's Inductor corrupts memory in the CPU round of these mixers ("double free or corruption"
# in the generated kernel; zamba: C++ that does not compile; 2.13 is right, decision 84): refused
INDUCTOR_2_13 = {"kimi_linear", "bailing_hybrid", "mamba2", "bamba", "granitemoehybrid", "falcon_h1", "zamba"}


# MTP layers transformers drops (ignored on load) that specfx builds from the target's own decoder-layer class
# as a full-attention layer, laid out as vLLM loads them (decisions 86, 95; specfx/drafters/mtp_fc.py)
MTP_LAYOUTS = {**dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), "qwen3_next"), "bailing_hybrid": "bailing"}
MTP_REASONS = {
    "olmo_hybrid": (
        "transformers ignores its checkpoints' mtp.* tensors and its config declares no MTP layer count, and no "
        "engine documents their layout (vLLM's olmo_hybrid.py has no MTP predictor), so specfx has none to build"
    ),
}


def _u(reason: str) -> ArchSpec:
    return ArchSpec("unsupported", reason=reason)


def _r_state(reason: str, **overrides) -> ArchSpec:
    """A type with recurrent, linear-attention or other non-KV state that specfx cannot run exactly:
    refused up front at ``speculate()`` with ``reason`` (decision 79)."""
    return ArchSpec("refused", reason=reason, overrides=overrides, stateful=True)


# Multi-token forward unlike the single-token decoding: the probe finds it, the mixers verify by steps (90)
_MAMBA1 = (
    "Mamba1 selective-scan layers, verified by their own single-token steps (transformers' multi-token scan "
    "starts from a zero state, decision 90)"
)
_DT_LIMIT = (
    "Mamba2 SSD layers, verified by their own single-token steps (transformers' multi-token path clamps the time "
    "step to time_step_min, the single-token path generate() decodes with does not; decision 90)"
)
_OUTSIDE = (
    "outside HF's linear-attention cache API (Cache.update_conv_state / update_recurrent_state), so specfx cannot "
    "snapshot and roll it back"
)
_INKLING = (
    "attention whose relative-position bias (and its length scaling) is computed from the cache's query offset and "
    "key length (Cache.get_query_offset / get_mask_sizes), not from position_ids, so specfx's per-row positions "
    "and slots cannot be given to it (its short-conv state would roll back)"
)

ARCHITECTURES: dict[str, ArchSpec] = {
    # --- the required set
    "llama": _s("RoPE, GQA"),
    "mistral": _s("sliding window on every layer"),
    "qwen2": _s("QKV bias"),
    "qwen3": _s("QK norm"),
    "gemma": _s("scaled embeddings, GeGLU"),
    "gemma2": _s("logit softcapping, alternating sliding/full layers (dict masks), eager attention"),
    "phi3": _s("fused QKV, sliding window"),
    "gpt2": _s("learned absolute positions, Conv1D"),
    "gpt_neox": _s("partial rotary, parallel residual"),
    "opt": _s("learned positions with offset 2"),
    "falcon": _s("multi-query attention, parallel attention/MLP"),
    "stablelm": _s("partial rotary, LayerNorm"),
    "bloom": _s("ALiBi built from a 2-D padding mask: the rowwise protocol the probe falls back to"),
    "mixtral": _s("mixture of experts, sliding window"),
    "qwen2_moe": _s("mixture of experts with shared expert"),
    # --- further decoder-only attention architectures verified by the sweep
    **{
        name: _s()
        for name in (
            "afmoe apertus arcee aria_text beam biogpt bitnet codegen cohere cohere2 cohere2_moe ctrl cwm "
            "diffllama doge ernie4_5 exaone4 exaone_moe flex_olmo flint gemma3_text gemma4_unified_text glm "
            "glm4 glm4_moe gpt-sw3 gpt_bigcode gpt_neox_japanese gpt_oss gptj granite granite_swa granitemoe "
            "granitemoe_swa granitemoeshared helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 hyperclovax "
            "internlm3 iquestcoder jais2 jetmoe kolibri1 laguna llama4_text mellum mimo_v2_flash "
            "minimax_m2 minimax_m3_vl_text ministral ministral3 modernbert-decoder nanochat nemotron olmo "
            "olmo2 olmo3 olmoe persimmon phi phimoe qwen3_moe seed_oss smollm3 solar_open starcoder2 "
            "vaultgemma xglm"
            # new in transformers 5.24
            " apertus1p5_text exaone sarvam_moe"
        ).split()
    },
    "lfm2": _s(
        "short-conv layers in hybrid configs (layer_types 'conv'): their conv state is rolled back as recurrent state "
        "(decision 79; tests/unit/model/test_hybrid_speculate.py); the tiny config here is attention only"
    ),
    "dory": _s(
        "looped recurrent-depth layers: one cache copy per loop, appended by the model's own forward "
        "(specfx allocates every cache layer the forward writes up front)",
        num_hidden_layers=3,  # 1 input, 1 recurrent (run twice), 1 output layer
        n_input_layers=1,
        n_output_layers=1,
    ),
    "mpt": _s("ALiBi"),
    # multi-head latent attention (MLA): KV heads = query heads, as in the real checkpoints
    **{
        name: _s("multi-head latent attention", num_key_value_heads=4, head_dim=8)
        for name in ("deepseek_v2 deepseek_v3 minicpm3 glm4_moe_lite youtu sarvam_mla").split()
    },
    # DeepSeek sparse attention (DSA): MLA whose indexer keeps one key per token (HF's
    # update_indexer), held at slots beside the KV (decision 94); a top-k of 8 makes the selection
    # matter past 8 tokens; 16 indexer heads, as the real ones have many: with 2, a quarter of the
    # keys score exactly 0 (every head's ReLU zero) and HF's own incremental decoding breaks the
    # ties differently from its full forward
    **{
        name: _s(
            "DeepSeek sparse attention (MLA + an indexer choosing each query's top-k keys; its keys kept at slots)",
            num_key_value_heads=4,
            head_dim=8,
            index_topk=8,
            index_head_dim=16,
            index_n_heads=16,
            # no zero (padding_idx) embedding row: a token embedded as zeros gives its indexer query
            # zero scores for every key, a top-k of ties that HF's own incremental decoding and
            # full forward break differently
            pad_token_id=None,
        )
        for name in ("deepseek_v32 glm_moe_dsa axk2 hy_v4").split()
    },
    # BERT-family LM heads are causal only with is_decoder=True (TINY_SIZES sets it); with
    # is_decoder=False they attend bidirectionally and speculate() refuses them.
    **{
        name: _s("encoder used as a decoder (is_decoder=True)")
        for name in (
            "roc_bert bert bert-generation camembert data2vec-text electra ernie roberta roberta-prelayernorm "
            "xlm-roberta xlm-roberta-xl"
        ).split()
    },
    # transformers 5.17's BigBird, MegatronBert and RemBert build a bidirectional mask even with
    # is_decoder=True (5.18 made them causal): their forward attends to later tokens, so HF's own
    # generate() (the prompt in one forward, then a token at a time) neither equals its forward
    # nor can be reproduced by any incremental decoding; the probe refuses them there.
    **{
        name: ArchSpec(
            "supported",
            "encoder used as a decoder (is_decoder=True); supported where the installed implementation is "
            "causal as a decoder (transformers 5.17's attends to later tokens even then: refused there)",
            if_causal=True,
        )
        for name in ("big_bird", "megatron-bert", "rembert")
    },
    # --- recurrent / linear-attention state rolled back exactly (decisions 76, 79): target only, chains,
    # eager or specfx_eager; tests/unit/model/test_hybrid_speculate.py checks every row
    **{
        name: _state(
            f"{mixer}: static state buffers, snapshot before the verify forward, rollback by the mixers' single steps",
            inductor_torch="2.13" if name in INDUCTOR_2_13 else "",
            mtp_layout=MTP_LAYOUTS.get(name, ""),
            mtp_reason=MTP_REASONS.get(name, ""),
            **_STATE_TINY.get(name, {}),
        )
        for names, mixer in (
            (
                "qwen3_next qwen3_5_text qwen3_5_moe_text olmo_hybrid",
                "gated-delta-net linear attention + full attention",
            ),
            ("lara_mini", "gated-delta-net linear attention + sliding attention"),
            ("kimi_linear bailing_hybrid", "Kimi delta attention (KDA) + full attention"),
            ("mamba2", "Mamba2 SSD layers only (the 2-D padding mask is its whole mask)"),
            ("bamba granitemoehybrid", "Mamba2 SSD layers + full attention"),
            ("falcon_h1", "Mamba2 SSD and attention in the same layer (KV at slots and state in one cache layer)"),
            ("lfm3", "short-conv layers (conv state only) + full attention"),
            ("mamba falcon_mamba", _MAMBA1),
            ("jamba", _MAMBA1 + " + full attention, mixture of experts"),
            ("zamba", _MAMBA1 + " + shared attention blocks"),
            ("nemotron_h", _DT_LIMIT + " + attention and MLP layers"),
            ("zamba2", _DT_LIMIT + " + shared attention blocks (KV and state in one cache layer)"),
        )
        for name in names.split()
    },
    # --- refused with the precise reason (decision 79); speculate() quotes it
    "qwen4_exp_text": _r_state(
        "its QSA indexer rotates pooled key blocks by positions it reads from a history of every position_ids the "
        "model has seen, which the forward appends to its first indexed cache layer (indexer_position_ids) and "
        "indexes by key: a history that grows per forward and keeps rejected tokens, not a per-slot table; and it "
        "selects blocks per row and per query with host loops over torch.nonzero, which no single graph holds "
        "(its indexer keys would be kept at slots as DeepSeek-V3.2's, decision 94, and its gated-delta-net layers "
        "rolled back as Qwen3-Next's)",
        **_STATE_TINY["qwen4_exp_text"],
    ),
    # compressed-KV attention (decision 97): windows of per-token projections pooled into KV entries; their
    # projections kept at slots like KV and pooled again on every forward
    "deepseek_v4": ArchSpec(
        "supported",
        "compressed sparse and heavily compressed attention (windows of per-token projections pooled into KV "
        "entries, an indexer's top-k over them), sliding attention with sinks, hyper-connections, hash routing",
        overrides=_V4_TINY,
        compressed_kv=True,
        min_queries=2,
        mtp_layout="deepseek_v4",  # its MTP layer, which transformers drops: specfx.drafters.mtp_v4 (decision 98)
        padding_reason=(
            "its compressor pools windows of cache positions, which on a left-padded row include the padding, "
            "so HF's own generate() output for a padded row differs from the same prompt alone (specfx would "
            "generate the latter); pass prompts of equal length, or one at a time"
        ),
    ),
    "minimax": _r_state("lightning-attention (linear-attention) state kept in its own MiniMaxCache, " + _OUTSIDE),
    "recurrent_gemma": _r_state("RG-LRU recurrent state held inside its modules, not in a cache: " + _OUTSIDE),
    "rwkv": _r_state(
        "RWKV-4 recurrent state passed as a state= tuple, " + _OUTSIDE + "; left padding also changes HF's own "
        "generate() output"
    ),
    "xlstm": _r_state(
        "mLSTM recurrent state in its own xLSTMCache, " + _OUTSIDE + "; left padding also changes HF's own "
        "generate() output"
    ),
    "inkling_text": _r_state(_INKLING),
    **{
        name: _r_state(
            "short-conv state and sliding attention in the same layer ('hybrid_sliding'), and HF's own generate() "
            "raises IndexError on a left-padded batch, so greedy equality there cannot be checked"
        )
        for name in ("inkling2_text", "inkling2_loop_text")
    },
    **{
        name: _r("derives positions from the cache length, not position_ids (caught by the incremental-decoding probe)")
        for name in ("mvp", "trocr", "roformer", "bart", "mbart", "marian", "pegasus", "bigbird_pegasus")
    },
    "gpt_neo": _r(
        "local-attention window cut from the cache's key length (the buffer capacity), not from "
        "position_ids (caught by the incremental-decoding probe at the generator's capacity)",
        attention_types=[[["global", "local"], 1]],  # one entry per layer of the tiny config
        max_position_embeddings=1024,  # room for a probe past its window of 256
    ),
    "hrm_text": _r(
        "its logits at a position depend on the tokens after it in the same forward (its full "
        "forward on a prefix differs from the prefix of its full forward, by ~1% of the logits' scale), "
        "so no incremental decoding reproduces it (caught by the incremental-decoding probe)"
    ),
    "moshi": _r(
        "its forward ignores config.sliding_window (full causal mask) while its generate() cache "
        "windows to it, so no incremental path matches both (caught by the incremental-decoding probe)"
    ),
    "openai-gpt": _r("no KV cache (forward takes no cache argument)"),
    "xlnet": _r("no KV cache (forward takes no cache argument)"),
    # --- not yet
    "blenderbot-small": _u("its generation config forces EOS (forced_eos_token_id), which specfx does not implement"),
    "gemma3n_text": _u("layers share KV across layers (KV-sharing layers write no cache)"),
}

# Compiled (one round graph, fullgraph) in CI: one per graph feature that eager tests cannot
# vouch for (dict masks + softcapping + eager attention; mixture-of-experts routing; the
# rowwise 2-D-mask protocol).
COMPILED_SUBSET = ("gemma2", "mixtral", "bloom")

# The default test tier's architectures (``--full`` runs every supported one): the required
# set, then one per mechanism the rest add: latent attention (deepseek_v3), an encoder used as a
# decoder (bert), ALiBi from slots (mpt), local/global layers with their own rope (gemma3_text),
# chunked attention (llama4_text), attention sinks (gpt_oss), layers without rope (cohere2),
# looped layers appending cache layers (dory).
REPRESENTATIVE = (
    "llama mistral qwen2 qwen3 gemma gemma2 phi3 gpt2 gpt_neox opt falcon stablelm bloom mixtral qwen2_moe "
    "deepseek_v3 bert mpt gemma3_text llama4_text gpt_oss cohere2 dory"
).split()


def inductor_miscompiles(model_type: str | None) -> str:
    """The oldest torch whose Inductor compiles ``model_type``'s round correctly
    (``ArchSpec.inductor_torch``) when the installed torch is older than it, else "" (decision 84):
    ``speculate()`` refuses Inductor for the type then."""
    oldest = getattr(ARCHITECTURES.get(model_type), "inductor_torch", "")
    return oldest if oldest and torch.__version__ < oldest else ""


def compressed_kv(model_type: str | None) -> bool:
    """Whether ``model_type``'s state, as HF marks it (``_is_stateful``), is a KV compressor's windows that
    specfx keeps at slots (``ArchSpec.compressed_kv`` on a supported row, decision 97): not state to roll back."""
    spec = ARCHITECTURES.get(model_type)
    return spec is not None and spec.compressed_kv and spec.status == "supported"


def min_queries(model_type: str | None) -> int:
    """The fewest queries a forward of ``model_type`` may have (``ArchSpec.min_queries``, decision 97)."""
    return getattr(ARCHITECTURES.get(model_type), "min_queries", 1)


def installed(name: str) -> bool:
    """Whether the installed transformers ships model type ``name`` (the table also lists types
    of newer releases than the declared minimum)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return name in CONFIG_MAPPING_NAMES


def supported(decodes_incrementally_by_type: Callable[[str], bool]) -> list[str]:
    """Supported model types that the installed transformers ships, less the ``if_causal`` rows
    for which ``decodes_incrementally_by_type(name)`` is False (whether the installed
    implementation of that type decodes incrementally: :func:`decodes_incrementally` on a model
    of that type; ``specfx.testing.architectures.tiny_decodes_incrementally`` checks its tiny
    model). The predicate is asked only for ``if_causal`` rows."""
    return [
        name
        for name, spec in ARCHITECTURES.items()
        if spec.status == "supported"
        and not spec.stateful
        and not spec.compressed_kv
        and installed(name)
        and (not spec.if_causal or decodes_incrementally_by_type(name))
    ]


if __name__ == "__main__":
    import sys

    if sys.argv[1:]:  # the sweep runs speculate(): a tool above this layer
        sys.exit("the sweep is `python -m specfx.testing.architectures --sweep [TYPES...]`")
    for name, spec in ARCHITECTURES.items():
        print(f"{name:24s} {spec.status:12s} {spec.features or spec.reason}")
