"""Loading a model from a local directory, safetensors only, never from a hub.

The one loader of specfx's own tools (``specfx bench``, ``specfx demo``). A path is checked
before transformers sees it, because transformers would otherwise (a) fall back to
``pytorch_model.bin``, a pickle whose loading can run arbitrary code, and (b) take any string
that is not an existing directory for a hub repository id and spend tens of seconds on
network attempts before failing with a traceback.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["NO_HUB_KERNELS", "check_model_dir", "load_causal_lm", "load_tokenizer"]

# What every ``from_pretrained`` of specfx's own passes (decision 99). transformers 5.25 made
# ``use_kernels=True`` the default (and the ``kernels`` package a dependency): it swaps layers'
# forwards for kernels fetched from the hub on CUDA/ROCm/XPU, which needs the network at load
# time and puts opaque custom ops where Inductor would fuse the plain torch code of a round.
# Older releases accept the argument with the same meaning (their default is False).
NO_HUB_KERNELS = {"use_kernels": False}

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT_HINT = (
    "convert it once where you trust the file: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) "
    "writes model.safetensors"
)


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a Path if it is a local directory with ``config.json`` and safetensors weights
    (``*.safetensors`` or ``model.safetensors.index.json``); otherwise a ValueError saying what is
    missing and how to fix it. Reads no weights."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(
            f"model path {str(path)!r} is not an existing local directory. specfx loads models only from "
            f"local directories (config.json + *.safetensors) and never downloads; fetch a hub model first, "
            f"e.g. `hf download ORG/NAME --local-dir DIR`, and pass DIR."
        )
    if not (p / "config.json").is_file():
        raise ValueError(
            f"{p} has no config.json: it is not a Hugging Face model directory (save_pretrained writes one)."
        )
    if not any(p.glob("*.safetensors")) and not (p / "model.safetensors.index.json").is_file():
        pickles = sorted(f.name for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES)
        found = f"; it has {', '.join(pickles)} (pickle), which specfx does not load" if pickles else ""
        raise ValueError(f"{p} has no safetensors weights (*.safetensors){found}: {CONVERT_HINT}.")
    return p


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs):
    """A causal LM from the local directory ``path`` (see :func:`check_model_dir`), cast to
    ``dtype``, on ``device``, in eval mode; ``kwargs`` go to ``from_pretrained`` (hub kernels
    off unless ``use_kernels=True`` is passed: see ``NO_HUB_KERNELS``)."""
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path)
    kwargs = {**NO_HUB_KERNELS, **kwargs}
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, use_safetensors=True, local_files_only=True, **kwargs)
    return model.to(device).eval()


def load_tokenizer(path: str | Path):
    """The tokenizer saved in the local directory ``path``, or None if it holds none."""
    from transformers import AutoTokenizer

    p = check_model_dir(path)
    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError):  # a model directory without tokenizer files
        return None
