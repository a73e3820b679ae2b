"""``specfx train``: train a Medusa, EAGLE or EAGLE-3 head (or a small draft model, plain or PARD) for your own target.

Usage::

    specfx train --target DIR --head eagle3 --data corpus/ --out runs/head      # or python -m specfx.train
    specfx train ... --resume                                                   # continue from runs/head/ckpt

Steps, each deterministic for a given ``--seed``:

1. **Data** (:mod:`specfx.train.data`): texts from files, folders or JSONL (chat turns rendered
   with the target's chat template when it has one), tokenized with the target's tokenizer,
   split into training and held-out sides by document, and drawn as windows of ``--seq-len``
   tokens from a generator seeded with ``(seed, step)``; with ``--assistant-only-loss``, label masks
   beside the streams keep every loss and held-out metric to the assistant turns of chat records.
2. **Features**: the target (loaded safetensors-only, eval mode, never trained) runs each window
   through :meth:`specfx.model.runner.ModelRunner.forward` with the head's taps, under ``no_grad``:
   the logits and hidden states the head will see in a round, computed on the fly, or once into
   safetensors shards with ``--cache-features`` (:mod:`specfx.train.cache`) for several epochs.
3. **Heads and losses** (:mod:`specfx.train.heads`): the drafter classes' own modules, trained
   with AdamW (warm-up then cosine decay to 10 %, :mod:`specfx.train.schedule`; gradient clipping
   at 1). The run's options are a :class:`specfx.train.config.TrainConfig`.
4. **Checkpoints**: every ``--ckpt-every`` steps (and at the end) the head's parameters and the
   optimizer moments go to ``OUT/ckpt/state.safetensors`` with ``OUT/ckpt/meta.json`` (nothing
   is pickled; :mod:`specfx.train.checkpoint`, the demo pair's format too); ``--resume`` continues from there exactly (same batches, same moments; the
   learning-rate schedule is the one for ``--steps``, so stop a run early with ``--stop-after``).
5. **Output**: ``OUT/head/`` in the head's public layout (its ``save()``: what SafeAILab's
   EAGLE, vLLM and SGLang read; Medusa in vLLM's layout or, ``--medusa-layout medusa``,
   FasterDecoding's; docs/HEADS.md), loadable with
   ``specfx.Medusa/Eagle/Eagle3(OUT/head)`` or ``draft="eagle3:OUT/head"``; ``OUT/eval.json``
   with held-out greedy τ and acceptance per depth at K = 2, 4, 8 and for a tree, measured by
   specfx itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch

from specfx.drafters.heads.medusa import LAYOUTS as MEDUSA_LAYOUTS
from specfx.train import checkpoint
from specfx.train.cache import FeatureCache
from specfx.train.config import FREE, LAYER_SIZES, TrainConfig
from specfx.train.data import Windows, label_streams, load_texts, streams
from specfx.train.dflash import DFlashTrain
from specfx.train.evaluation import evaluate, heldout_metrics, reads_target, target_pass
from specfx.train.heads import HEADS, DraftTrain, Eagle3Train, EagleTrain, MedusaTrain, TrainHead
from specfx.train.pard import PardTrain, default_mask_token
from specfx.train.schedule import lr_at

__all__ = ["TrainConfig", "train", "main"]


def _warn_mask_in_data(head, stream, name: str, flag: str, log) -> None:
    seen = int((stream == head.mask_token).sum())
    if seen:
        log(f"warning: the {name} mask token {head.mask_token} occurs {seen} times in the training data; pass "
            f"{flag} with an id the tokenizer never produces")  # fmt: skip


def build_head(cfg: TrainConfig, runner, stream, tokenizer, log=print, mask=None) -> TrainHead:
    """The trained head ``cfg.head`` for ``runner``'s target over the token ``stream``; ``mask``
    (``--assistant-only-loss``'s label mask, beside ``stream``) keeps an EAGLE-3 draft
    vocabulary to the tokens it learns, as SpecForge counts only loss-masked tokens."""
    if cfg.head == "pard":
        head = PardTrain(runner, cfg.init, cfg.seed, cfg.draft_layers, cfg.draft_hidden, tokenizer, cfg.pard_k,
                         cfg.pard_token, cfg.pard_cod_ratio, cfg.pard_cod_min, cfg.pard_distill)  # fmt: skip
        _warn_mask_in_data(head, stream, "PARD", "--pard-token", log)
        return head
    if cfg.head == "dflash":
        token = cfg.dflash_token
        if token is None and cfg.init is None:
            token = default_mask_token(runner.model.config, tokenizer)
        head = DFlashTrain(runner, cfg.init, cfg.seed, cfg.dflash_block, cfg.draft_layers, token, cfg.dflash_anchors,
                           cfg.dflash_gamma, cfg.dflash_taps, cfg.dflash_distill)  # fmt: skip
        _warn_mask_in_data(head, stream, "DFlash", "--dflash-token", log)
        return head
    if cfg.head == "draft":
        return DraftTrain(runner, cfg.init, cfg.seed, cfg.draft_layers, cfg.draft_hidden, tokenizer)
    if cfg.head == "medusa":
        base = str(Path(cfg.target).expanduser().resolve())  # FasterDecoding's loader finds the target there
        return MedusaTrain(runner, cfg.init, cfg.medusa_heads, cfg.medusa_layers, cfg.seed, cfg.medusa_layout, base)
    if cfg.head == "eagle":
        return EagleTrain(runner, cfg.init, cfg.seed, cfg.feature_noise)
    sizes = {n: getattr(cfg, n) for n in LAYER_SIZES if getattr(cfg, n) is not None}
    learnt = stream if mask is None else stream[mask > 0]
    return Eagle3Train(runner, cfg.init, cfg.seed, cfg.draft_vocab_size, learnt, cfg.ttt_steps, sizes)


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(ckpt: Path, step: int, head: TrainHead, opt, history: list) -> None:
    """The head's parameters and optimizer moments in the trainers' one format
    (:mod:`specfx.train.checkpoint`), one role named ``head``."""
    checkpoint.save_checkpoint(ckpt, step, {"head": head.module}, {"head": opt}, history)


def load_checkpoint(ckpt: Path, head: TrainHead, opt) -> tuple[int, list]:
    return checkpoint.load_checkpoint(ckpt, {"head": head.module}, {"head": opt})


# ----------------------------------------------------------------------------- training
def _same_files(saved, given):
    """``(saved, given)`` data lists, with ``saved`` replaced by ``given`` where each pair of
    entries names one existing file (``os.path.samefile``), so that a resume from another
    working directory, or with absolute paths, is not refused as different data."""
    import os

    if not isinstance(saved, list) or len(saved) != len(given):
        return saved, given
    try:
        if all(os.path.samefile(a, b) for a, b in zip(saved, given, strict=True)):
            return list(given), given
    except OSError:  # a file is missing: compare the names as given
        pass
    return saved, given


def train(cfg: TrainConfig, resume: bool = False, log=print) -> dict:
    """Train (or, with ``resume``, continue) a head into ``cfg.out``; returns the summary
    written to ``OUT/eval.json``."""
    from tqdm.auto import tqdm

    from specfx.model.load import check_model_dir, load_causal_lm, load_tokenizer
    from specfx.model.runner import ModelRunner

    cfg.check()
    check_model_dir(cfg.target)
    out = Path(cfg.out)
    ckpt = out / "ckpt"
    cfg_path = out / "config.json"
    if (ckpt / "meta.json").exists():
        if not resume:
            raise ValueError(
                f"--out {str(out)!r} already holds a training checkpoint: pass --resume to continue it, or a new --out."
            )
        # an option added since the run was written (--assistant-only-loss, say) reads as its default
        known = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
        saved = known | json.loads(cfg_path.read_text())
        fixed = {k: v for k, v in saved.items() if k not in FREE}
        mine = {k: v for k, v in asdict(cfg).items() if k not in FREE}
        # the same data files named from another directory (relative against absolute) are the same run
        fixed["data"], mine["data"] = _same_files(fixed.get("data"), mine["data"])
        if fixed != mine:
            diff = sorted(k for k in mine if fixed.get(k) != mine[k])
            raise ValueError(f"--resume: {', '.join(diff)} differ from the run in {str(out)!r}; pass the same options.")
    elif resume:
        raise ValueError(f"--resume: {str(out)!r} holds no checkpoint (ckpt/meta.json) to continue.")
    tokenizer = load_tokenizer(cfg.target)
    if tokenizer is None:
        raise ValueError(
            f"--target {cfg.target!r} has no tokenizer files; specfx train tokenizes --data with the target's tokenizer."
        )
    texts = load_texts(cfg.data, tokenizer)
    if cfg.assistant_only_loss:  # label masks beside the streams: only assistant turns are learnt and scored
        train_ids, held_ids, train_mask, held_mask = label_streams(tokenizer, texts, cfg.heldout_permille, cfg.seq_len)
    else:
        train_ids, held_ids = streams(tokenizer, texts, cfg.heldout_permille, cfg.seq_len)
        train_mask = held_mask = None
    out.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(asdict(cfg), indent=1))

    torch.manual_seed(cfg.seed)
    model = load_causal_lm(cfg.target, device=cfg.device)
    runner = ModelRunner(model, "target")
    runner.allocate(cfg.batch_size, cfg.seq_len + 1)
    head = build_head(cfg, runner, train_ids, tokenizer, log, train_mask)
    params = list(head.module.parameters())
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    step, history = 0, []
    if resume:
        step, history = load_checkpoint(ckpt, head, opt)
        log(f"resumed from step {step}")
    windows = Windows(train_ids, cfg.seq_len, cfg.batch_size, cfg.seed)
    mask_windows = None if train_mask is None else Windows(train_mask, cfg.seq_len, cfg.batch_size, cfg.seed)
    cache = None
    if cfg.cache_features and not reads_target(head):
        raise ValueError(f"--cache-features: --head {cfg.head} reads no target features; drop the flag.")
    if cfg.cache_features:
        cache = FeatureCache(
            out / "features", runner, train_ids, cfg.seq_len, cfg.batch_size, cfg.seed, head.taps, target_pass
        )
        with tqdm(total=len(cache.windows), desc="caching target features", unit="window", leave=False) as cbar:
            if not cache.build(cbar.update):
                log(f"reusing the cached target features in {out / 'features'}")
    held_args = (cfg.seq_len, cfg.batch_size, cfg.seed)
    held = Windows(held_ids, *held_args).fixed(cfg.eval_batches)
    held_masks = None if held_mask is None else Windows(held_mask, *held_args).fixed(cfg.eval_batches)
    n_params = sum(p.numel() for p in params)
    log(f"specfx train: {cfg.head} head, {n_params / 1e6:.2f} M trained parameters, {len(train_ids)} training / "
        f"{len(held_ids)} held-out tokens, {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len}, {cfg.device}")  # fmt: skip
    started = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"training {cfg.head}", unit="step", dynamic_ncols=True)
    held_acc = float("nan")
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    while step < end:
        if cache is not None:
            ids, logits, features = cache.at(step)
        elif not reads_target(head):
            ids, logits, features = windows.at(step).to(runner.device), None, ()
        else:
            ids = windows.at(step).to(runner.device)
            logits, features = target_pass(runner, ids, head.taps)
        if train_mask is None:
            mask = None
        elif cache is not None:
            mask = cache.mask_at(step, train_mask)
        else:  # the same starts as the windows: one generator, seeded (seed, step)
            mask = mask_windows.at(step).to(runner.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, peak=cfg.lr, warmup=cfg.warmup, steps=cfg.steps)
        with cfg.autocast():
            loss, acc = head.loss(ids, features, logits, step, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        record = {"step": step, "loss": round(loss.item(), 6), "acc": round(acc, 4)}
        if step % cfg.ckpt_every == 0 or step == end:
            held_loss, held_acc = heldout_metrics(head, runner, held, cfg.autocast, held_masks)
            record.update(heldout_loss=round(held_loss, 6), heldout_acc=round(held_acc, 4))
            if hasattr(head, "heldout_depth_acc"):
                record["heldout_acc_per_depth"] = [round(a, 4) for a in head.heldout_depth_acc]
            history.append(record)
            save_checkpoint(ckpt, step, head, opt, history)
        else:
            history.append(record)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}", heldout_acc=f"{held_acc:.2f}")
        bar.update(1)
    bar.close()
    seconds = time.perf_counter() - started
    head_dir = head.save(out / "head")
    log(f"saved the {cfg.head} head to {head_dir}")
    summary = {
        "head": cfg.head, "head_dir": str(head_dir), "steps": step, "train_seconds_this_run": round(seconds, 1),
        "final": history[-1] if history else None,
        "eval": evaluate(cfg, model, head_dir, cfg.head, held_ids) if cfg.eval_prompts > 0 and step == cfg.steps else {},
    }  # fmt: skip
    if hasattr(head, "heldout_depth_acc"):
        log("held-out top-1 per mask depth: " + ", ".join(f"{a:.2f}" for a in head.heldout_depth_acc))
    (out / "eval.json").write_text(json.dumps(summary, indent=1))
    for name, r in summary["eval"].items():
        if "tau" in r:
            log(
                f"held-out greedy {name}: tau {r['tau']:.2f}, acceptance per depth {', '.join(f'{x:.2f}' for x in r['per_depth'])}"
            )
        else:
            log(f"held-out {name}: skipped ({r['skipped']})")
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfx train", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target: a local HF causal LM directory (safetensors)")
    p.add_argument("--head", required=True, choices=HEADS, help="what to train")
    p.add_argument("--data", required=True, action="append", help="text file, folder or JSONL (repeatable)")
    p.add_argument("--out", required=True, help="run directory: ckpt/, head/, eval.json")
    p.add_argument("--init", default=None, help="an existing head directory to continue training from")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    defaults = TrainConfig("", "", [], "")
    helps = {
        "steps": "optimizer steps (the learning-rate schedule spans them)",
        "batch_size": "windows per step",
        "seq_len": "tokens per window",
        "seed": "seeds the head's initialisation, the windows drawn and the feature noise",
        "heldout_permille": "documents held out for evaluation, per thousand (split by a hash of the text)",
        "eval_batches": "held-out batches for the loss and top-1 agreement shown in the progress bar",
        "ckpt_every": "steps between checkpoints in OUT/ckpt",
        "medusa_heads": "--head medusa: heads (head i guesses the token i + 2 ahead)",
        "medusa_layers": "--head medusa: residual blocks per head",
        "ttt_steps": "--head eagle3: training-time-test steps unrolled on the head's own outputs",
        "eval_prompts": "held-out prompts for the final tau/acceptance evaluation (0: skip it)",
        "eval_prompt_len": "tokens per evaluation prompt",
        "eval_new_tokens": "new tokens per evaluation prompt",
        "warmup": "linear warm-up steps before the cosine decay",
    }
    for name, text in helps.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                       help=f"{text} (default {getattr(defaults, name)})")  # fmt: skip
    p.add_argument("--batch", dest="batch_size", type=int, default=argparse.SUPPRESS, help="alias of --batch-size")
    p.add_argument(
        "--draft-layers", type=int, default=defaults.draft_layers, help="--head draft / pard / dflash: decoder layers"
    )
    p.add_argument("--draft-hidden", type=int, default=defaults.draft_hidden, help="--head draft / pard: hidden size")
    pard_flags = (
        ("pard_k", int, "tokens predicted per forward, K (the reference's para_num)"),
        ("pard_token", int, "the mask token id, an existing id of the target's vocabulary that the data never uses "
         "(absent: the first id past the tokenizer's vocabulary when the embedding is larger, else a pad id that is "
         "not BOS/EOS, else the last id)"),
        ("pard_cod_ratio", float, "COD, mask depth j keeps a fraction max(ratio**j, min) of the positions (1: keep all)"),
        ("pard_cod_min", float, "COD's smallest kept fraction"),
        ("pard_distill", float, "weight w of the target's distribution in every entry's loss: (1 - w) x cross-entropy "
         "against the data's token + w x cross-entropy against the target's distribution there (0: PARD's hard "
         "labels, no target forward)"),
    )  # fmt: skip
    dflash_flags = (
        ("dflash_block", int, "the pending token plus block_size - 1 masks drafted in one forward (z-lab's b16: 16)"),
        ("dflash_token", int, "the mask token id (as --pard-token's default; an --init draft keeps its own)"),
        ("dflash_anchors", int, "blocks per window, at random anchors (SpecForge's num_anchors: 512)"),
        ("dflash_gamma", float, "weight block position k's loss by exp(-(k - 1) / gamma) (absent: no decay)"),
        ("dflash_distill", float, "weight w of the target's distribution in every block position's loss, as "
         "--pard-distill's (0: the data's tokens only, as SpecForge)"),
    )  # fmt: skip
    for head, flags in (("pard", pard_flags), ("dflash", dflash_flags)):
        for name, kind, text in flags:
            default = getattr(defaults, name)
            p.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                           help=f"--head {head}: {text}" + (f"; default {default}" if default is not None else ""))  # fmt: skip
    p.add_argument(
        "--dflash-taps",
        type=int,
        nargs="+",
        default=None,
        help="--head dflash: the target layers whose outputs the draft reads (its config's target_layer_ids; default "
        "the reference's spread for --draft-layers: one layer reads the middle layer only)",
    )
    p.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate, AdamW (default {defaults.lr})")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW weight decay (default 0)")
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="EAGLE-3 from scratch: draft vocabulary (default min(V, 32000))",
    )
    for name, what in (("intermediate_size", "MLP width"), ("num_attention_heads", "attention heads"),
                       ("num_key_value_heads", "key/value heads")):  # fmt: skip
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"EAGLE-3 from scratch: the decoder layer's {what} (default: the target's); for a head with "
            f"fewer parameters",
        )
    p.add_argument(
        "--feature-noise",
        type=float,
        default=defaults.feature_noise,
        help="EAGLE: half-width of the uniform noise added to the target features the head reads\n"
        "(the method's augmentation; 0 turns it off; default 0.1)",
    )
    p.add_argument(
        "--medusa-layout",
        choices=MEDUSA_LAYOUTS,
        default=defaults.medusa_layout,
        help="--head medusa: the tensor names and config.json written: vllm (vLLM's Medusa loader, the default) or "
        "medusa (FasterDecoding's names, medusa_lm_head.safetensors); no engine reads both (docs/HEADS.md)",
    )
    p.add_argument("--eval-ks", type=int, nargs="+", default=[2, 4, 8], help="chain lengths K evaluated at the end")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="end this run at that step, checkpointed (the schedule is still --steps'); --resume continues it",
    )
    p.add_argument(
        "--cache-features",
        action="store_true",
        help="compute the target's features once into OUT/features (safetensors shards) and reuse them",
    )
    p.add_argument(
        "--assistant-only-loss",
        action="store_true",
        help="learn and score only the assistant turns of chat JSONL records (their content and end of turn), as "
        "TRL's assistant_only_loss and EAGLE-3's loss mask; system prompts, user turns and plain texts stay context",
    )
    p.add_argument("--device", default="cpu", help="where the target and the head run: cpu (default) or cuda")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="mixed precision: the head's matmuls in bfloat16 (torch.autocast), its weights, optimizer and loss in "
        "float32; faster on GPUs and on CPUs with AVX512-BF16 or AMX (PARD on SmolLM2, 2 CPU threads: 1.4x)",
    )
    return p


def main(argv=None) -> int:
    args = vars(parser().parse_args(argv))
    resume = args.pop("resume")
    try:
        train(TrainConfig(**args), resume=resume)
    except ValueError as e:
        print(f"specfx train: error: {e}", file=sys.stderr)
        return 2
    return 0
