"""The one checkpoint format of specfx's trainers (``specfx train``'s heads and the demo pair):
``ckpt/state.safetensors`` holds every role's parameters (``<role>.model.<name>``) and AdamW
moments (``<role>.opt.<i>.exp_avg|exp_avg_sq|step``), ``ckpt/meta.json`` the step and the loss
history. Safetensors only: nothing is pickled. The tensors file is written to a temporary name
and renamed, so a run killed while saving keeps its previous checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(ckpt: Path, step: int, models: dict, opts: dict, history: list) -> None:
    """Save ``models`` (role -> module) and their optimizers ``opts`` (role -> AdamW) at ``step``."""
    from safetensors.torch import save_file

    tensors = {}
    for role, model in models.items():
        # named_parameters() lists a tied weight once (safetensors refuses shared storage).
        for name, p in model.named_parameters():
            tensors[f"{role}.model.{name}"] = p.detach().contiguous().cpu()
        for i, state in opts[role].state_dict()["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                tensors[f"{role}.opt.{i}.{key}"] = torch.as_tensor(state[key]).detach().contiguous().cpu()
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / "state.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(ckpt / "state.safetensors")
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "history": history}))


def load_checkpoint(ckpt: Path, models: dict, opts: dict) -> tuple[int, list]:
    """Load a checkpoint into ``models`` and ``opts`` in place; returns (step, history)."""
    from safetensors.torch import load_file

    meta = json.loads((ckpt / "meta.json").read_text())
    tensors = load_file(str(ckpt / "state.safetensors"))
    for role, model in models.items():
        prefix = f"{role}.model."
        params = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        missing, unexpected = model.load_state_dict(params, strict=False)
        if unexpected or set(missing) - {name for name, _ in model.named_buffers()} - {"lm_head.weight"}:
            raise ValueError(f"checkpoint {ckpt} does not match the model: missing {missing}, unexpected {unexpected}")
        sd = opts[role].state_dict()
        for i in range(len(list(model.parameters()))):
            if f"{role}.opt.{i}.exp_avg" in tensors:
                sd["state"][i] = {key: tensors[f"{role}.opt.{i}.{key}"] for key in ("exp_avg", "exp_avg_sq", "step")}
        opts[role].load_state_dict(sd)
    return meta["step"], meta["history"]
