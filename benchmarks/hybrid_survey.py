"""Issue 29's survey: every causal-LM type specfx refuses for recurrent or linear-attention state,
as the installed transformers builds it tiny. Prints one table (docs/HYBRID.md holds its output
under 5.24 and 5.17) and writes JSON.

Per type: does a tiny model build (with :data:`OVERRIDES`)? which mixer modules (class names, the
kind read from them)? which cache the forward returns and which layer classes it holds (the
unified linear-attention API of 5.24: ``LinearAttentionLayer`` & co.; or a per-model cache, or a
state tuple)? the state tensors of the first stateful layer (conv: ``[B, C, kernel]``; recurrent)?
and three exactness checks through HF's own cache (the one the forward returns):

* ``cont``: prefill P tokens, then ONE forward of T new tokens from that state (a verify forward)
  against the full forward over P+T tokens: max |logit diff| / max |logit|;
* ``steps``: the same T tokens one forward each (HF's own decoding) against the full forward
  (both with explicit ``position_ids`` where the forward takes them);
* ``pad``: HF ``generate()`` (greedy) of a prompt in a left-padded batch against the same prompt at
  batch 1: max relative difference of the generated steps' logits (0: padding never enters the
  state), and whether the tokens agree.

Run: ``PYTHONPATH=. python benchmarks/hybrid_survey.py [TYPES...] [--json out.json]`` (system python:
transformers 5.24; ``/work/venv517/bin/python``: 5.17). One thread; tiny models; ~1 min.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings

import torch

from specfx.model.architectures import ARCHITECTURES

TYPES = (
    "bamba bailing_hybrid falcon_h1 falcon_mamba granitemoehybrid jamba kimi_linear lfm3 mamba mamba2 nemotron_h "
    "olmo_hybrid qwen3_5_text qwen3_5_moe_text qwen3_next qwen4_exp_text recurrent_gemma rwkv xlstm zamba zamba2 "
    "deepseek_v4 lara_mini minimax hy_v4 inkling_text inkling2_text inkling2_loop_text"
).split()

# Tiny-config overrides beyond specfx.testing.tiny's generic shrinking: the architecture table's (one
# layer of each kind, heads consistent with the shrunken hidden size), and these for the rows without
# them (a 2-layer config of the default pattern is all linear-attention, and HF's cache then cannot
# answer get_seq_length)
OVERRIDES: dict[str, dict] = {
    **{name: spec.overrides for name, spec in ARCHITECTURES.items() if spec.stateful and spec.overrides},
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64),
    "xlstm": dict(qk_dim_factor=1.0),
}

# Mixer kinds by a fragment of the module's class name (first match wins).
KINDS = (
    ("GatedDeltaNet", "GDN (gated delta rule)"),
    ("DeltaAttention", "KDA (Kimi delta attention)"),
    ("Mamba2", "Mamba2 SSD"),
    ("Bamba", "Mamba2 SSD"),
    ("GraniteMoeHybridMamba", "Mamba2 SSD"),
    ("HCA", "compressed attention"),
    ("NemotronHMamba", "Mamba2 SSD"),
    ("FalconH1Mixer", "Mamba2 SSD"),
    ("Zamba2Mamba", "Mamba2 SSD"),
    ("Mixer", "Mamba1 selective scan"),
    ("ShortConv", "short conv"),
    ("Rglru", "RG-LRU + conv"),
    ("RecurrentBlock", "RG-LRU + conv"),
    ("Rwkv", "RWKV-4 WKV"),
    ("Lightning", "lightning attention"),
    ("mLSTM", "mLSTM"),
    ("xLSTM", "mLSTM"),
    ("LinearAttention", "linear attention"),
)
_STATEFUL = (
    "Mixer",
    "DeltaNet",
    "DeltaAttention",
    "ShortConv",
    "Conv",
    "Recurrent",
    "Rglru",
    "SelfAttention",
    "Lightning",
    "LSTM",
    "Lstm",
    "Linear",
    "Mamba",
)


def build(name: str):
    from specfx.testing.tiny import tiny_causal_lm

    return tiny_causal_lm(name, **OVERRIDES.get(name, {}))


def mixers(model) -> list[str]:
    """Class names of the modules that carry state (heuristic, for the table only)."""
    names = []
    for mod in model.modules():
        cls = type(mod).__name__
        if cls in names or cls.endswith(
            ("Model", "ForCausalLM", "DecoderLayer", "AttentionLayer", "RMSNorm", "Norm", "MLP")
        ):
            continue
        if any(s in cls for s in _STATEFUL) and "Rotary" not in cls and cls != "Linear" and "Embedding" not in cls:
            names.append(cls)
    return names


def kind_of(classes: list[str]) -> str:
    kinds = []
    for cls in classes:
        kind = next((k for frag, k in KINDS if frag in cls), None)
        if kind and kind not in kinds:
            kinds.append(kind)
    return ", ".join(kinds) or "?"


def _cache_out(out):
    for field in ("cache", "past_key_values", "cache_params", "state"):
        value = getattr(out, field, None)
        if value is not None:
            return field, value
    return None, None


def _forward_kw(model, field: str | None, value, start: int = 0) -> dict:
    """The keyword that hands ``value`` back to the forward; a model whose state lives inside it
    (RecurrentGemma returns no cache) gets the new tokens' ``cache_position`` instead."""
    import inspect

    params = inspect.signature(model.forward).parameters
    if field is None:
        return {"cache_position": torch.arange(start, start + 1)} if "cache_position" in params else {}
    for name in (field, "cache", "past_key_values", "cache_params", "state"):
        if name in params:
            return {name: value}
    return {}


def _positions(model, start: int, length: int) -> dict:
    """Explicit ``position_ids``, as specfx and HF's generate() pass them (Bamba derives wrong
    positions from its cache without them: its cache's first layer is a state layer)."""
    import inspect

    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    return {"position_ids": torch.arange(start, start + length).unsqueeze(0)}


def cache_summary(cache) -> tuple[str, str]:
    """(cache class and layer classes, state shapes of the first stateful layer)."""
    if cache is None:
        return "none returned", ""
    if isinstance(cache, (tuple, list)):
        return f"{type(cache).__name__} of {len(cache)}", "; ".join(str(tuple(t.shape)) for t in cache[:5])
    layers = getattr(cache, "layers", None)
    if not layers:
        attrs = {k: tuple(v.shape) for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
        lists = [(k, v) for k, v in vars(cache).items() if isinstance(v, list) and v and hasattr(v[0], "shape")]
        if lists:  # MiniMax: a list of per-layer states beside the KV layers
            attrs.update({f"{k}[0]": tuple(v[0].shape) for k, v in lists})
        if not attrs:  # a dict of per-layer tensors (xLSTM: rnn_state)
            for k, v in vars(cache).items():
                if isinstance(v, dict) and v:
                    first = next(iter(v.values()))
                    first = first if isinstance(first, (tuple, list)) else (first,)
                    attrs = {f"{k}[0][{i}]": tuple(t.shape) for i, t in enumerate(first) if hasattr(t, "shape")}
                    break
        return type(cache).__name__, "; ".join(f"{k} {s}" for k, s in attrs.items())
    kinds = sorted({type(layer).__name__ for layer in layers})
    shapes = ""
    for layer in layers:
        if hasattr(layer, "conv_states"):
            parts = []
            for i, t in layer.conv_states.items():
                if t is not None:
                    parts.append(f"conv[{i}] {tuple(t.shape)}")
            for i, t in layer.recurrent_states.items():
                if t is not None:
                    parts.append(f"rec[{i}] {tuple(t.shape)}")
            shapes = "; ".join(parts)
            break
    return f"{type(cache).__name__}: {'/'.join(kinds)}", shapes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.no_grad()
def continuation(model, p: int = 10, t: int = 5, seed: int = 0) -> tuple[float, float, str, str]:
    """(cont, steps, cache summary, state shapes); see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    seq = torch.randint(3, vocab, (1, p + t), generator=g)
    full = model(input_ids=seq).logits[0, p:].float()
    out = model(input_ids=seq[:, :p], use_cache=True)
    field, cache = _cache_out(out)
    summary = cache_summary(cache)
    kw = _forward_kw(model, field, cache, p) | _positions(model, p, t)
    if "cache_position" in kw:
        kw["cache_position"] = torch.arange(p, p + t)
    cont = model(input_ids=seq[:, p:], use_cache=True, **kw).logits[0].float()
    out = model(input_ids=seq[:, :p], use_cache=True)
    field, cache = _cache_out(out)
    steps = []
    for i in range(t):
        kw = _forward_kw(model, field, cache, p + i) | _positions(model, p + i, 1)
        out = model(input_ids=seq[:, p + i : p + i + 1], use_cache=True, **kw)
        field2, cache2 = _cache_out(out)
        if cache2 is not None:
            field, cache = field2, cache2
        steps.append(out.logits[0, -1].float())
    return rel(cont, full), rel(torch.stack(steps), full), *summary


@torch.no_grad()
def padding(model, new: int = 6, seed: int = 1) -> tuple[float, bool]:
    """A 5-token prompt generated alone and left-padded (by 4) beside a 9-token one."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    short = torch.randint(3, vocab, (1, 5), generator=g)
    long = torch.randint(3, vocab, (1, 9), generator=g)
    kw = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    alone = model.generate(input_ids=short, attention_mask=torch.ones_like(short), **kw)
    ids = torch.cat([torch.cat([torch.zeros((1, 4), dtype=torch.long), short], 1), long])
    mask = torch.cat(
        [torch.cat([torch.zeros((1, 4), dtype=torch.long), torch.ones_like(short)], 1), torch.ones_like(long)]
    )
    batch = model.generate(input_ids=ids, attention_mask=mask, **kw)
    a = torch.stack([x[0] for x in alone.logits]).float()
    b = torch.stack([x[0] for x in batch.logits]).float()
    return rel(b, a), bool(torch.equal(alone.sequences[0, 5:], batch.sequences[0, 9:]))


def survey(name: str) -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    row: dict = {"type": name}
    if name not in CONFIG_MAPPING_NAMES:
        row["status"] = "not shipped"
        return row
    t0 = time.perf_counter()
    try:
        model = build(name)
    except Exception as e:  # a table of what builds: the failure is the finding
        row["status"] = f"build fails: {type(e).__name__}: {str(e)[:120]}"
        return row
    row["status"] = "builds"
    row["mixers"] = mixers(model)
    row["kind"] = kind_of(row["mixers"])
    for check, fn in (("continuation", continuation), ("padding", padding)):
        try:
            values = fn(model)
        except Exception as e:
            row[check] = f"fails: {type(e).__name__}: {str(e)[:120]}"
            continue
        if check == "continuation":
            row["cont"], row["steps"], row["cache"], row["state"] = values
        else:
            row["pad"], row["pad_tokens_equal"] = values
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", default=TYPES)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, threads 1, load {os.getloadavg()}")
    rows = []
    print(
        "| type | kind | mixer classes | cache (layer classes) | state of the first stateful layer | cont | steps | pad | pad tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.types:
        row = survey(name)
        rows.append(row)
        if row["status"] != "builds":
            print(f"| {name} | {row['status']} | | | | | | | |", flush=True)
            continue
        print(
            f"| {name} | {row['kind']} | {' '.join(row['mixers'])} | {row.get('cache', row.get('continuation', ''))} | "
            f"{row.get('state', '')} | {_fmt(row.get('cont', '-'))} | {_fmt(row.get('steps', '-'))} | "
            f"{_fmt(row.get('pad', row.get('padding', '-')))} | {row.get('pad_tokens_equal', '-')} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
