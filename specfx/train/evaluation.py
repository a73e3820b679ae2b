"""The frozen target's pass over training windows, and ``specfx train``'s evaluation: held-out
loss and top-1 agreement at every checkpoint, held-out greedy τ of the saved head at the end."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from specfx.train.config import TrainConfig
from specfx.train.heads import TrainHead

__all__ = ["target_pass", "reads_target", "heldout_metrics", "evaluate"]


def target_pass(runner, ids: torch.Tensor, taps) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The frozen target over windows ``ids [B, T]``: ``(logits [B, T, V], features)``."""
    b, t = ids.shape
    pos = torch.arange(t, device=runner.device).expand(b, -1)
    with torch.no_grad():
        if not taps:  # a draft model reads only the target's logits
            return runner.forward(ids.to(runner.device), pos, pos).detach(), ()
        logits, features = runner.forward(ids.to(runner.device), pos, pos, taps=taps)
    return logits.detach(), tuple(f.detach() for f in features)


def reads_target(head: TrainHead) -> bool:
    """Whether the head's loss reads the target's logits or features (PARD's reads the data only)."""
    return getattr(head, "reads_target", True)


def heldout_metrics(
    head: TrainHead, runner, batches, autocast=contextlib.nullcontext, masks=None
) -> tuple[float, float]:
    """Mean held-out loss and top-1 agreement, the head's loss under ``autocast()`` (the target's pass
    outside it, as in training), over the labels ``masks`` (``--assistant-only-loss``'s, one per
    batch) mark, or all; a block head's per-depth agreement (over every held-out batch) is left
    in ``head.heldout_depth_acc``."""
    losses, accs, depths = [], [], []
    with torch.no_grad():
        for i, ids in enumerate(batches):
            logits, features = target_pass(runner, ids, head.taps) if reads_target(head) else (None, ())
            mask = None if masks is None else masks[i].to(runner.device)
            with autocast():
                loss, acc = head.loss(ids.to(runner.device), features, logits, None, mask)
            losses.append(loss.item())
            accs.append(acc)
            depths.append(getattr(head, "depth_acc", []))
    if depths[0]:
        head.heldout_depth_acc = [sum(d[j] for d in depths) / len(depths) for j in range(len(depths[0]))]
    return sum(losses) / len(losses), sum(accs) / len(accs)


def evaluate(cfg: TrainConfig, model, head_dir: Path, kind: str, held) -> dict:
    """Held-out greedy τ and per-depth acceptance of the saved head, loaded back from
    ``head_dir`` as ``speculate()`` would, at each K and for a tree."""
    import specfx
    from specfx.drafters.heads.dflash import DFlash
    from specfx.drafters.heads.eagle import Eagle
    from specfx.drafters.heads.eagle3 import Eagle3
    from specfx.drafters.heads.medusa import Medusa
    from specfx.drafters.pard import Pard
    from specfx.model.load import load_causal_lm

    cls = {
        "medusa": Medusa,
        "eagle": Eagle,
        "eagle3": Eagle3,
        "draft": lambda d: load_causal_lm(d, device=model.device),
        "pard": lambda d: Pard(load_causal_lm(d, device=model.device)),
        "dflash": DFlash,
    }[kind]
    n, length = cfg.eval_prompts, cfg.eval_prompt_len
    starts = torch.linspace(0, len(held) - length, n).long().tolist()
    prompts = [torch.from_numpy(held[s : s + length].astype("int64")).view(1, -1).to(model.device) for s in starts]
    settings: dict[str, dict] = {}
    for k in cfg.eval_ks:
        settings[f"K={k}"] = {"num_speculative_tokens": k}
    trees = {
        "medusa": specfx.TokenTree.medusa(budget=16),
        "draft": specfx.TokenTree.topk(depth=4, branching=2, budget=16),
    }
    tree = trees.get(kind) or specfx.TokenTree.eagle2(budget=16)
    if kind not in ("pard", "dflash"):  # block drafters draft chains only
        settings["tree"] = {"tree": tree, "num_speculative_tokens": tree.size}  # pinned (unset: "auto", tree or K = 0)
    results = {}
    for name, kw in settings.items():
        try:
            spec = specfx.speculate(model, draft=cls(head_dir), compile=False, **kw)
        except ValueError as e:  # e.g. a K deeper than Medusa's heads
            results[name] = {"skipped": str(e)}
            continue
        for p in prompts:
            spec.generate(p, max_new_tokens=cfg.eval_new_tokens, do_sample=False)
        st = spec.cumulative_stats
        results[name] = {
            "tau": round(st.tokens_per_round, 4),
            "acceptance_rate": round(st.acceptance_rate, 4),
            "per_depth": [round(r, 4) for r in st.per_position_rate],
        }
    return results
