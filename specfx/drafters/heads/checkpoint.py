"""Reading and writing draft-head checkpoints (Medusa, EAGLE, EAGLE-3) in their public layouts.

A head checkpoint is a local directory (or one ``.safetensors`` file) holding safetensors
weights and, usually, a ``config.json``. Sharded weights (several ``*.safetensors`` files) are
merged. Pickle files (``.bin``, ``.pt``, ...) are never loaded: their loading can run arbitrary
code, so a directory that has only those is refused with the one-line conversion to run where
the file is trusted. Nothing here knows a head type: each head module checks the tensors it
needs (:func:`check_tensors`) against the target's sizes.

Heads are saved for the engines users serve them with (SafeAILab's EAGLE code, vLLM, SGLang,
FasterDecoding's Medusa; what each reads is in docs/HEADS.md). A head that some engine would load
but not run as specfx runs it (a layer it cannot build, taps it cannot capture, a tensor it
drops) is still saved, with one :class:`HeadLayoutWarning` naming each such engine and why
(:func:`warn_engine_gaps`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from specfx.model.load import PICKLE_SUFFIXES

__all__ = [
    "LAYER_KEYS",
    "HeadCheckpoint",
    "HeadLayoutWarning",
    "check_tensors",
    "layer_config",
    "read_head",
    "target_attention",
    "warn_engine_gaps",
    "write_head",
]

# config.json keys that size a head's decoder layer, as transformers' Llama-family configs name
# them (the rest of a head's config.json is its own or ignored)
LAYER_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
    "mlp_bias", "vocab_size",
)  # fmt: skip


def _convert_hint(pickles: list[Path]) -> str:
    name = pickles[0].name if pickles else "FILE.pt"
    return (
        f"convert it once, where you trust the file: python -c \"import torch; from safetensors.torch import "
        f"save_file; sd = torch.load('{name}', map_location='cpu', weights_only=True); "
        f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{Path(name).stem}.safetensors')\""
    )


class HeadCheckpoint:
    """What :func:`read_head` found: ``config`` (``config.json``'s dict, or {}), ``tensors``
    (name -> CPU tensor, every safetensors file merged) and ``path`` (for messages)."""

    def __init__(self, path: Path, config: dict, tensors: dict[str, torch.Tensor]):
        self.path = path
        self.config = config
        self.tensors = tensors

    def has(self, *names: str) -> bool:
        return all(n in self.tensors for n in names)

    def __repr__(self) -> str:
        return f"HeadCheckpoint({str(self.path)!r}, {len(self.tensors)} tensors)"


def read_head(path: str | Path, kind: str) -> HeadCheckpoint:
    """Read the head checkpoint at ``path`` (a directory, or one ``.safetensors`` file with an
    optional ``config.json`` beside it). ``kind`` names the head in messages (``"Medusa"``).
    ValueError if nothing safetensors is there (naming the pickle files found, with how to
    convert them), or if ``config.json`` is not a JSON object."""
    from safetensors.torch import load_file

    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".safetensors":
            hint = _convert_hint([p]) if p.suffix in PICKLE_SUFFIXES else "save it with safetensors"
            raise ValueError(
                f"{kind} checkpoint {str(path)!r} is not a .safetensors file; specfx loads head weights "
                f"from safetensors only and never unpickles ({hint})."
            )
        files, folder = [p], p.parent
    elif p.is_dir():
        files, folder = sorted(p.glob("*.safetensors")), p
        if not files:
            pickles = sorted(f for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES)
            found = (
                f" It has {', '.join(f.name for f in pickles)} (pickle), which specfx never loads: {_convert_hint(pickles)}."
                if pickles
                else ""
            )
            raise ValueError(f"{kind} checkpoint directory {str(p)!r} has no *.safetensors weights.{found}")
    else:
        raise ValueError(
            f"{kind} checkpoint {str(path)!r} is not an existing local directory or .safetensors file; "
            f"specfx never downloads: fetch it first (e.g. `hf download ORG/NAME --local-dir DIR`) and pass DIR."
        )
    config: dict = {}
    config_file = folder / "config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{kind} checkpoint: {config_file} is not valid JSON ({e}).") from None
        if not isinstance(config, dict):
            raise ValueError(f"{kind} checkpoint: {config_file} must hold a JSON object, got {type(config).__name__}.")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f), device="cpu"))
    return HeadCheckpoint(p, config, tensors)


def write_head(path: str | Path, config: dict, tensors: dict[str, torch.Tensor], filename: str = "model.safetensors") -> Path:
    """Write a head checkpoint: ``config.json`` and one safetensors file in directory ``path``
    (created). Tensors are saved contiguous, on the CPU, as they are (dtype unchanged)."""
    from safetensors.torch import save_file

    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(p / filename))
    return p


def check_tensors(ckpt: HeadCheckpoint, kind: str, expected: dict[str, tuple[int, ...]], why: dict[str, str] | None = None) -> None:
    """ValueError unless every name in ``expected`` is in ``ckpt`` with that shape. ``why`` maps
    a name to what its shape must match (e.g. ``"the target's hidden size 4096"``), for the
    message. Missing tensors are listed together (a few), with the names the file does have."""
    missing = [n for n in expected if n not in ckpt.tensors]
    if missing:
        have = sorted(ckpt.tensors)
        raise ValueError(
            f"{kind} checkpoint {str(ckpt.path)!r} is missing {len(missing)} tensor(s) of its layout: "
            f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; it has {', '.join(have[:8])}"
            f"{' ...' if len(have) > 8 else ''}. Is it a {kind} checkpoint, and for this target?"
        )
    for name, shape in expected.items():
        got = tuple(ckpt.tensors[name].shape)
        if got != tuple(shape):
            reason = f" ({why[name]})" if why and name in why else ""
            raise ValueError(
                f"{kind} checkpoint {str(ckpt.path)!r}: {name} has shape {list(got)}, expected {list(shape)}{reason}; "
                f"the head was trained for another target."
            )


class HeadLayoutWarning(UserWarning):
    """A head was saved in a layout some serving engine reads, but that engine would not draft
    with it what specfx drafts (the message names the engine, the reason and the fix)."""


def warn_engine_gaps(kind: str, path: str | Path, gaps: dict[str, list[str]]) -> None:
    """One :class:`HeadLayoutWarning` for the head of type ``kind`` saved at ``path``, listing
    for each engine in ``gaps`` (engine name -> reasons) why it cannot run the head as saved;
    nothing when every list is empty."""
    gaps = {engine: reasons for engine, reasons in gaps.items() if reasons}
    if not gaps:
        return
    lines = "\n".join(f"  - {engine}: {' '.join(reasons)}" for engine, reasons in gaps.items())
    names = list(gaps)
    engines = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    warnings.warn(
        f"{kind} head saved to {str(path)!r}, but {engines} would not draft with it what specfx "
        f"drafts:\n{lines}\nspecfx loads it as saved; serve it elsewhere only where no reason above applies "
        f"(docs/HEADS.md lists what each engine reads).",
        HeadLayoutWarning,
        stacklevel=3,
    )


def target_attention(tc) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head_dim)`` a random head takes from the target's text config
    ``tc``: the target's attention, or for a target without attention (Mamba2: state layers only)
    heads of its ``head_dim`` (64 if none) across its hidden size."""
    heads = getattr(tc, "num_attention_heads", None)
    head_dim = getattr(tc, "head_dim", None) or (tc.hidden_size // heads if heads else 64)
    heads = heads or tc.hidden_size // head_dim
    return heads, getattr(tc, "num_key_value_heads", None) or heads, head_dim


def layer_config(config_class, keys, config: dict, error, required=("hidden_size", "num_attention_heads", "intermediate_size")):
    """A head's decoder-layer config (``config_class``, e.g. ``LlamaConfig``) from the ``keys``
    of its config.json dict ``config``, with the class's defaults for the optional ones.
    ``error(what)`` makes the ValueError for what is missing or cannot run inside a round: a
    ``required`` size that is not a positive int, query heads that are not a multiple of the
    key/value heads, rotary scaling that changes with the sequence length."""
    for name in required:
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise error(f"config.json needs a positive int {name}, got {value!r}.")
    kw = {k: config[k] for k in keys if config.get(k) is not None}
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    if kw["num_attention_heads"] % kw["num_key_value_heads"]:
        raise error(
            f"num_attention_heads {kw['num_attention_heads']} is not a multiple of num_key_value_heads "
            f"{kw['num_key_value_heads']}."
        )
    built = config_class(**kw)
    rope_type = (built.rope_parameters or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise error(
            f"rotary scaling {rope_type!r} changes with the sequence length (a host-side decision per "
            f"forward), which a compiled round cannot make; heads with default, linear, llama3 or yarn rotary work."
        )
    return built
