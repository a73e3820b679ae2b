"""Medusa heads' checkpoint layouts: reading either public layout into tensors, writing tensors
back, and what each serving engine would make of a saved head (docs/HEADS.md).

* FasterDecoding's layout (Medusa-1 heads, ``medusa_lm_head.safetensors`` and a
  ``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers``): the state dict of its
  ``medusa_head`` ModuleList, ``{i}.{j}.linear.weight`` / ``.bias`` for block ``j`` of head ``i``
  and ``{i}.{num_layers}.weight`` for the head's LM head. A Medusa-2 model checkpoint holds the
  same tensors under ``medusa_head.`` (the rest of it, the base model, is ignored).
* vLLM's converted layout (``model_type: "medusa"``; ``num_heads``, ``num_hidden_layers``):
  ``blocks.{i}.layers.{j}.weight`` (``.bias`` with ``medusa_fc_bias``) and ``lm_heads.{i}.weight``,
  or one ``lm_heads.0.weight`` shared by every head with ``original_lm_head``; an optional
  ``medusa_heads.`` prefix is dropped, as vLLM's loader drops it.

No engine reads both: vLLM's loader knows only its own names and skips the others,
FasterDecoding's only its own. Counts missing from ``config.json`` are inferred from the tensor
names; a config that contradicts the tensors is refused.

In memory the heads are three tensors: ``weight [N, M, H, H]`` (head, block, out, in), ``bias
[N, M, H]`` or None, ``lm_head [N, V, H]`` (or ``[1, V, H]``: one shared by every head).
:func:`read_heads` gives them from a checkpoint, :func:`layout_tensors` the config.json and
tensors of a layout, :func:`engine_gaps` why an engine would not run them as specfx does.
"""

from __future__ import annotations

import re

import torch

from specfx.drafters.heads.checkpoint import HeadCheckpoint, check_tensors

__all__ = ["KIND", "LAYOUTS", "MEDUSA_FILE", "VLLM_FILE", "check_count", "engine_gaps", "layout_tensors", "read_heads"]


KIND = "Medusa"
LAYOUTS = ("medusa", "vllm")
MEDUSA_FILE = "medusa_lm_head.safetensors"  # what FasterDecoding's trainer writes (and TGI reads)
VLLM_FILE = "model.safetensors"

# Tensor names of each layout: (head, block, what) / (head,) captured.
_MEDUSA_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_MEDUSA_LM = re.compile(r"(\d+)\.(\d+)\.weight")
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_LM = re.compile(r"lm_heads\.(\d+)\.weight")


def check_count(value, name: str, where: str, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum`` (a count of heads, blocks, sizes), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}.")
    return value


# --------------------------------------------------------------------------- reading
def _config_count(config: dict, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        if name in config:
            return name, check_count(config[name], name, f"{KIND} checkpoint config.json", 0)
    return None


def _parse(tensors: dict[str, torch.Tensor], patterns, path) -> dict[str, tuple]:
    """name -> its regex groups under the first pattern it matches; ValueError naming the
    tensors that belong to no pattern of the layout."""
    parsed, stray = {}, []
    for name in tensors:
        for pattern in patterns:
            match = pattern.fullmatch(name)
            if match:
                parsed[name] = (pattern, *match.groups())
                break
        else:
            stray.append(name)
    if "token_map" in stray:
        raise ValueError(
            f"{KIND} checkpoint {str(path)!r} has a token_map (heads over a truncated vocabulary, "
            f"truncated_vocab_size); specfx does not support those: use heads over the full vocabulary."
        )
    if stray:
        raise ValueError(
            f"{KIND} checkpoint {str(path)!r} has tensors that are not part of its layout: "
            f"{', '.join(sorted(stray)[:6])}{' ...' if len(stray) > 6 else ''}."
        )
    return parsed


def _layout(ckpt: HeadCheckpoint) -> tuple[str, dict[str, torch.Tensor]]:
    """Which layout ``ckpt`` is in, and its tensors under that layout's names (prefixes gone)."""
    tensors = ckpt.tensors
    if any(k.startswith("medusa_head.") for k in tensors):  # a Medusa-2 model: the heads in it
        return "medusa", {k[len("medusa_head.") :]: t for k, t in tensors.items() if k.startswith("medusa_head.")}
    tensors = {k.removeprefix("medusa_heads."): t for k, t in tensors.items()}
    if any(k.startswith(("blocks.", "lm_heads.")) for k in tensors):
        return "vllm", tensors
    if any(re.match(r"\d+\.", k) for k in tensors):
        return "medusa", tensors
    have = sorted(tensors)
    raise ValueError(
        f"{KIND} checkpoint {str(ckpt.path)!r} is in no Medusa layout: it has {', '.join(have[:6])}"
        f"{' ...' if len(have) > 6 else ''}; expected FasterDecoding's '{{i}}.{{j}}.linear.weight' and "
        f"'{{i}}.{{num_layers}}.weight' (medusa_lm_head.safetensors) or vLLM's 'blocks.{{i}}.layers.{{j}}.weight' "
        f"and 'lm_heads.{{i}}.weight'."
    )


def read_heads(ckpt: HeadCheckpoint, num_heads: int | None):
    """``(weight [N, M, H, H], bias [N, M, H] | None, lm_head [N or 1, V, H])`` from a checkpoint
    in either layout, checked against its config."""
    layout, tensors = _layout(ckpt)
    view = HeadCheckpoint(ckpt.path, ckpt.config, tensors)  # the layout's names, for messages
    config, where = ckpt.config, f"{KIND} checkpoint {str(ckpt.path)!r}"
    vllm = layout == "vllm"
    block_re, lm_re = (_VLLM_BLOCK, _VLLM_LM) if vllm else (_MEDUSA_BLOCK, _MEDUSA_LM)
    parsed = _parse(tensors, (block_re, lm_re), ckpt.path)
    found_n = 1 + max((int(g[1]) for g in parsed.values()), default=-1)
    found_m = 1 + max((int(g[2]) for g in parsed.values() if g[0] is block_re), default=-1)
    if not vllm:  # a head's LM head is the entry after its blocks: {i}.{M}.weight
        lm_index = {int(g[2]) for g in parsed.values() if g[0] is lm_re}
        if lm_index and lm_index != {found_m}:
            raise ValueError(
                f"{where}: its heads' LM heads are entries {sorted(lm_index)}, but after {found_m} residual "
                f"block(s) a head's LM head is entry {found_m} ('{{i}}.{found_m}.weight'); the checkpoint is "
                f"incomplete or not a Medusa head."
            )
    counts = (
        (("num_heads", "medusa_num_heads") if vllm else ("medusa_num_heads",), found_n, "heads"),
        (("num_hidden_layers", "medusa_num_layers") if vllm else ("medusa_num_layers",), found_m, "residual blocks per head"),
    )
    for names, found, what in counts:
        declared = _config_count(config, names)
        if declared is not None and declared[1] != found and not (what == "heads" and num_heads is not None):
            hint = " (or pass num_heads= to use only the first heads)" if what == "heads" else ""
            raise ValueError(
                f"{where}: config.json says {declared[0]}={declared[1]}, but its tensors hold {found} {what}. "
                f"Fix config.json{hint}."
            )
    shared = vllm and bool(config.get("original_lm_head", False))
    lm_name = "lm_heads.{i}.weight" if vllm else f"{{i}}.{found_m}.weight"
    first_lm = lm_name.format(i=0)
    if first_lm not in tensors:
        check_tensors(view, KIND, {first_lm: ()})  # names what is missing, and what is there
    if tensors[first_lm].dim() != 2:
        raise ValueError(f"{where}: {first_lm} has shape {list(tensors[first_lm].shape)}, expected [V, H].")
    v, h = tensors[first_lm].shape
    for key, value in (("hidden_size", h), ("vocab_size", v)):
        if key in config and config[key] != value:
            raise ValueError(f"{where}: config.json says {key}={config[key]}, but its LM heads are {[v, h]} ([V, H]).")
    truncated = config.get("truncated_vocab_size")
    if truncated is not None and truncated != config.get("vocab_size", truncated):
        raise ValueError(
            f"{where}: config.json sets truncated_vocab_size={truncated} (heads over a truncated vocabulary "
            f"with a token_map); specfx does not support those: use heads over the full vocabulary."
        )
    if vllm:
        block = "blocks.{i}.layers.{j}.{w}"
        has_bias = any(k.endswith(".bias") for k in tensors)
        declared_bias = config.get("medusa_fc_bias")
        if declared_bias is not None and bool(declared_bias) != has_bias:
            raise ValueError(
                f"{where}: config.json says medusa_fc_bias={declared_bias}, but its residual blocks "
                f"{'have' if has_bias else 'have no'} biases. Fix config.json."
            )
        # unset medusa_fc_bias: vLLM would ignore bias tensors; specfx computes what the file holds
        if shared and sum(1 for k in tensors if _VLLM_LM.fullmatch(k)) > 1:
            raise ValueError(f"{where}: config.json says original_lm_head (one LM head), but the tensors hold several.")
    else:
        block, has_bias = "{i}.{j}.linear.{w}", True  # FasterDecoding's ResBlock always has a bias

    n, m = found_n, found_m
    if num_heads is not None:
        n = check_count(num_heads, "num_heads", f"Medusa({str(ckpt.path)!r}, num_heads=...)", 1)
        if n > found_n:
            raise ValueError(f"Medusa(num_heads={n}): {where} holds only {found_n} heads.")
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(found_n):
        for j in range(m):
            expected[block.format(i=i, j=j, w="weight")] = (h, h)
            if has_bias:
                expected[block.format(i=i, j=j, w="bias")] = (h,)
        if not shared or i == 0:
            expected[lm_name.format(i=i)] = (v, h)
    check_tensors(view, KIND, expected)

    dtype = tensors[first_lm].dtype

    def blocks(w: str, shape: tuple[int, ...]) -> torch.Tensor:  # [N, M, *shape]
        if m == 0:
            return torch.zeros((n, 0, *shape), dtype=dtype)
        return torch.stack([torch.stack([tensors[block.format(i=i, j=j, w=w)] for j in range(m)]) for i in range(n)]).to(dtype)

    lm_head = torch.stack([tensors[lm_name.format(i=i)] for i in range(1 if shared else n)])  # [N or 1, V, H]
    return blocks("weight", (h, h)), blocks("bias", (h,)) if has_bias else None, lm_head


# --------------------------------------------------------------------------- writing
def layout_tensors(
    weight: torch.Tensor, bias: torch.Tensor | None, lm_head: torch.Tensor, layout: str, base: str | None
) -> tuple[dict, dict[str, torch.Tensor], str]:
    """``(config.json dict, tensors, file name)`` of the heads in ``layout`` (``"vllm"`` or
    ``"medusa"``, see :meth:`specfx.drafters.heads.medusa.Medusa.save`); ``base`` is the
    ``base_model_name_or_path`` FasterDecoding's layout records (ignored by vLLM's)."""
    n, m, h = weight.shape[:3]
    v = lm_head.shape[1]
    shared = lm_head.shape[0] == 1
    weight, lm = weight.detach().cpu(), lm_head.detach().cpu()
    bias = bias.detach().cpu() if bias is not None else None
    tensors: dict[str, torch.Tensor] = {}
    # every entry its own storage: safetensors refuses tensors that share memory
    if layout == "medusa":
        for i in range(n):
            for j in range(m):
                tensors[f"{i}.{j}.linear.weight"] = weight[i, j].clone()
                tensors[f"{i}.{j}.linear.bias"] = bias[i, j].clone() if bias is not None else weight.new_zeros(h)
            tensors[f"{i}.{m}.weight"] = lm[0 if shared else i].clone()
        config = {"medusa_num_heads": n, "medusa_num_layers": m, "hidden_size": h, "vocab_size": v}
        if base:
            config["base_model_name_or_path"] = base
        return config, tensors, MEDUSA_FILE
    for i in range(n):
        for j in range(m):
            tensors[f"blocks.{i}.layers.{j}.weight"] = weight[i, j].clone()
            if bias is not None:
                tensors[f"blocks.{i}.layers.{j}.bias"] = bias[i, j].clone()
    for i in range(lm.shape[0]):
        tensors[f"lm_heads.{i}.weight"] = lm[i].clone()
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": n,
        "num_hidden_layers": m,
        "hidden_size": h,
        "vocab_size": v,
        "truncated_vocab_size": v,
        "medusa_fc_bias": bias is not None,
        "original_lm_head": shared,
    }
    return config, tensors, VLLM_FILE


def engine_gaps(weight: torch.Tensor, bias: torch.Tensor | None, layout: str, base: str | None) -> dict[str, list[str]]:
    """Why the engine reading ``layout`` would not draft with these heads what specfx drafts:
    engine -> reasons (empty where it would). vLLM runs every head its layout holds;
    FasterDecoding's ``MedusaModel`` builds 5 heads (whatever ``medusa_num_heads`` says), each
    head's residual blocks as one block repeated (``[ResBlock(h)] * medusa_num_layers``, so its
    loader gives every block the last one's weights), and loads the target from ``base`` (its
    ``base_model_name_or_path``; an unset one defaults to lmsys/vicuna-7b-v1.3)."""
    if layout == "vllm":
        return {"vLLM": []}
    num_heads, num_layers = weight.shape[:2]
    reasons = []
    if num_heads != 5:
        reasons.append(
            f"its loader builds 5 heads whatever medusa_num_heads says, so with these {num_heads} "
            + ("the 5th keeps a random init and drafts garbage where its tree reaches depth 5." if num_heads < 5
               else f"it ignores heads 5 to {num_heads - 1}.")  # fmt: skip
        )
    if num_layers > 1:
        w = weight.detach()
        b = bias.detach() if bias is not None else None
        same = all(
            torch.equal(w[:, j], w[:, -1]) and (b is None or torch.equal(b[:, j], b[:, -1]))
            for j in range(num_layers)
        )
        if not same:
            reasons.append(
                f"its MedusaModel builds each head's {num_layers} residual blocks as one ResBlock repeated, "
                f"so it would run the last block's weights {num_layers} times; save one block per head "
                f"(--medusa-layers 1) or use layout='vllm'."
            )
    if not base:
        reasons.append(
            "config.json has no base_model_name_or_path (the target this head drafts for), so its loader would "
            "load lmsys/vicuna-7b-v1.3; pass save(..., base_model_name_or_path=...) or bind the heads first."
        )
    return {"FasterDecoding's Medusa": reasons}
