"""Train specfx's demo pair: a small Llama-style target and a much smaller draft on the Python
standard library's own source code (a corpus every machine has offline).

Usage::

    python -m specfx.train.pair --out runs/pair            # train (resumes if --out has a checkpoint)
    python -m specfx.train.pair --out runs/pair --export specfx/demo/demo_pair --dtype float16

Steps, each deterministic for a given ``--seed``:

1. **Corpus.** Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``
   excluded; files that are not UTF-8 skipped), sorted by path. The held-out split is fixed and
   by whole files: a file is held out when the first 8 hex digits of the SHA-256 of its path
   relative to the stdlib root, read as an integer, are ``< heldout_permille / 1000 * 16**8``. It
   does not depend on the seed or on which other files exist, so a given file lands on the same
   side on every machine. ``data_*/corpus.json`` in ``--out`` lists both sides.
2. **Tokenizer.** One byte-level BPE (the ``tokenizers`` library) trained on the training files
   only, shared by both models. Special tokens: ``<|endoftext|>`` (id 0; BOS, EOS and the
   document separator) and ``<|pad|>`` (id 1).
3. **Models.** ``LlamaForCausalLM`` target and draft (tied input/output embeddings), trained
   *jointly* on the same batches: the target on next-token cross-entropy, the draft on
   ``(1 - distill) * cross-entropy + distill * KL(target || draft)`` against the target's
   (detached) predictions of the same step. Distillation costs no extra forward and teaches the
   draft to agree with the target, which is what acceptance measures. Batches are random windows
   of ``--context + 1`` tokens of the concatenated training stream, drawn from a generator seeded
   with ``(seed, step)``, so a resumed run sees exactly the batches an uninterrupted one would.
   AdamW, linear warm-up then cosine decay to 10 %, gradient clipping at 1. A second phase of
   ``--draft-steps`` steps then distills the draft alone (KL only) from the frozen target on
   further batches: cheap (no target backward) and what raises acceptance most.
4. **Checkpoints.** Every ``--ckpt-every`` steps the weights and optimizer moments go to
   ``ckpt/state.safetensors`` (safetensors only; nothing is pickled) with ``ckpt/meta.json``;
   rerunning the same command resumes from there (``--stop-after STEP`` ends a run early at a
   checkpoint and saves it; the learning-rate schedule is still the one for ``--steps``).
5. **Output.** ``target/`` and ``draft/`` in Hugging Face format (``config.json``,
   ``generation_config.json``, ``model.safetensors``, tokenizer files), loadable with
   ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``,
   and ``eval.json`` with each model's held-out loss and perplexity. ``--export DIR`` copies
   both to DIR in ``--dtype`` (float16 / bfloat16 for shipping) without training further.

Defaults are the shipped pair's run (``specfx/demo/demo_pair``), sized for a 2-core CPU:
550 joint steps of 16 x 256 tokens (2.25 M tokens, about a quarter of the training stream;
47 minutes on one core of a shared machine), then 600 draft-only steps (16 minutes). On a GPU
pass ``--device cuda`` and larger ``--target-hidden/--target-layers/--steps``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specfx.model.load import NO_HUB_KERNELS
from specfx.train.checkpoint import load_checkpoint, save_checkpoint
from specfx.train.pair_corpus import (
    EOS,
    PAD,
    build_corpus,
    heldout_prompts,
    prepare,
    train_tokenizer,
)
from specfx.train.schedule import lr_at

__all__ = ["PairConfig", "build_corpus", "train_tokenizer", "make_model", "train", "export_pair", "main"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairConfig:
    """Everything that determines a run of the demo pair's training (stored in ``--out/config.json``);
    ``specfx train``'s config for a head is :class:`specfx.train.config.TrainConfig`.

    Attributes:
        seed: seeds model initialisation and batch sampling.
        heldout_permille: held-out share of stdlib files, in thousandths (the split is by path hash).
        vocab_size: BPE vocabulary size (shared by target and draft).
        context: training sequence length in tokens.
        target_layers / target_hidden / target_heads / target_kv_heads: the target's shape
            (MLP width = ``mlp_ratio * hidden`` rounded to 32).
        draft_layers / draft_hidden / draft_heads / draft_kv_heads: the draft's shape.
        mlp_ratio: Llama MLP intermediate size / hidden size.
        max_positions: ``max_position_embeddings`` written to the configs (RoPE, so longer than
            ``context`` works, with quality decreasing past what training saw).
        steps: optimizer steps; batch_size: sequences per step.
        lr / draft_lr: peak learning rates; warmup: warm-up steps; weight_decay: AdamW decay.
        distill: weight of KL(target || draft) in the draft's loss (0 = plain language modelling).
        draft_steps: steps of a second phase after the joint one: the target is frozen and the
            draft alone is distilled (loss = KL(target || draft) only) on further batches.
        draft_phase_lr: peak learning rate of that phase (10 warm-up steps, cosine to 10 %).
        ckpt_every: steps between checkpoints.
        eval_tokens: held-out tokens used for the held-out loss.
    """

    seed: int = 0
    heldout_permille: int = 50
    vocab_size: int = 4096
    context: int = 256
    target_layers: int = 4
    target_hidden: int = 256
    target_heads: int = 4
    target_kv_heads: int = 2
    draft_layers: int = 1
    draft_hidden: int = 128
    draft_heads: int = 2
    draft_kv_heads: int = 1
    mlp_ratio: float = 2.75
    max_positions: int = 1024
    steps: int = 550
    batch_size: int = 16
    lr: float = 2e-3
    draft_lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    distill: float = 0.5
    draft_steps: int = 600
    draft_phase_lr: float = 1e-3
    ckpt_every: int = 100
    eval_tokens: int = 65536


# ----------------------------------------------------------------------------- models
def make_model(cfg: PairConfig, role: str, tokenizer):
    """A freshly initialised ``LlamaForCausalLM`` for ``role`` ("target" or "draft")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = getattr(cfg, f"{role}_hidden")
    eos = tokenizer.convert_tokens_to_ids(EOS)
    pad = tokenizer.convert_tokens_to_ids(PAD)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=int(round(cfg.mlp_ratio * hidden / 32)) * 32,
        num_hidden_layers=getattr(cfg, f"{role}_layers"),
        num_attention_heads=getattr(cfg, f"{role}_heads"),
        num_key_value_heads=getattr(cfg, f"{role}_kv_heads"),
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=pad,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = pad
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = eos
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def batch_at(stream: np.ndarray, step: int, cfg: PairConfig) -> torch.Tensor:
    """The step's batch ``[batch_size, context + 1]``: a pure function of (seed, step)."""
    g = np.random.default_rng([cfg.seed, step])
    starts = g.integers(0, len(stream) - cfg.context - 1, size=cfg.batch_size)
    return torch.from_numpy(np.stack([stream[s : s + cfg.context + 1] for s in starts]).astype(np.int64))


def make_optimizer(model, lr: float, wd: float):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


# ----------------------------------------------------------------------------- training
@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, cfg: PairConfig, device) -> float:
    """Mean next-token cross-entropy over the first ``eval_tokens`` held-out tokens."""
    model.eval()
    n = min(len(stream) - 1, cfg.eval_tokens) // cfg.context * cfg.context
    ids = torch.from_numpy(stream[: n + 1].astype(np.int64))
    total, count = 0.0, 0
    for s in range(0, n, cfg.context * 8):
        rows = [ids[i : i + cfg.context + 1] for i in range(s, min(n, s + cfg.context * 8), cfg.context)]
        x = torch.stack(rows).to(device)
        logits = model(x[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def draft_phase_step(models: dict, opt, inputs, labels, s: int, cfg: PairConfig) -> tuple[float, float]:
    """One step of the draft-only phase (step ``s`` of ``cfg.draft_steps``): KL to the frozen
    target's predictions. Returns (KL, the draft's cross-entropy, for the log)."""
    lr = lr_at(s, peak=cfg.draft_phase_lr, warmup=10, steps=cfg.draft_steps)
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.no_grad():
        t_logp = models["target"](inputs).logits.flatten(0, 1).log_softmax(-1)
    d_logits = models["draft"](inputs).logits.flatten(0, 1)
    kl = F.kl_div(d_logits.log_softmax(-1), t_logp, log_target=True, reduction="batchmean")
    opt.zero_grad(set_to_none=True)
    kl.backward()
    torch.nn.utils.clip_grad_norm_(models["draft"].parameters(), 1.0)
    opt.step()
    return kl.item(), F.cross_entropy(d_logits.detach(), labels).item()


def train(
    out: Path, cfg: PairConfig, device: str = "cpu", threads: int | None = None, stop_after: int | None = None
) -> dict:
    """Train (or resume) both models into ``out``; returns the evaluation summary.

    ``stop_after`` ends training early at that step (the schedule stays the one for
    ``cfg.steps``): resuming with the step of the last checkpoint evaluates and saves it as is.
    """
    if threads:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    # These only affect steps after the joint phase (or nothing trained), so a finished joint
    # run may be resumed with new values.
    free = {"draft_steps", "draft_phase_lr", "ckpt_every", "eval_tokens"}

    def fixed(c: dict) -> dict:
        return {k: v for k, v in c.items() if k not in free}

    if (out / "ckpt" / "meta.json").exists() and fixed(json.loads(cfg_path.read_text())) != fixed(asdict(cfg)):
        raise ValueError(
            f"{out} holds a checkpoint of a run with a different configuration ({cfg_path}); "
            f"pass a new --out, or the same options to resume."
        )
    cfg_path.write_text(json.dumps(asdict(cfg), indent=1))
    tokenizer, streams = prepare(out, cfg)
    logger.info("tokens: train %d, held-out %d", len(streams["train"]), len(streams["heldout"]))

    torch.manual_seed(cfg.seed)
    models = {role: make_model(cfg, role, tokenizer).to(device).train() for role in ("target", "draft")}
    peaks = {"target": cfg.lr, "draft": cfg.draft_lr}
    opts = {role: make_optimizer(m, peaks[role], cfg.weight_decay) for role, m in models.items()}
    ckpt = out / "ckpt"
    step, history = 0, []
    if (ckpt / "meta.json").exists():
        step, history = load_checkpoint(ckpt, models, opts)
        logger.info("resumed from step %d", step)
    for role, m in models.items():
        logger.info("%s: %.2f M parameters", role, n_params(m) / 1e6)

    total = cfg.steps + cfg.draft_steps
    bar = tqdm(total=total, initial=step, desc="training target+draft", unit="step", dynamic_ncols=True)
    t0, tokens = time.perf_counter(), 0
    last = total if stop_after is None else min(total, stop_after)
    while step < last:
        x = batch_at(streams["train"], step, cfg).to(device)
        inputs, labels = x[:, :-1], x[:, 1:].flatten()
        if step >= cfg.steps:  # second phase: the draft alone, distilled from the frozen target
            kl, d_ce = draft_phase_step(models, opts["draft"], inputs, labels, step - cfg.steps, cfg)
            step += 1
            tokens += inputs.numel()
            bar.update(1)
            bar.set_postfix(draft_ce=f"{d_ce:.3f}", kl=f"{kl:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
            if step % 25 == 0 or step == last:
                history.append({"step": step, "draft_ce": d_ce, "kl": kl})
            if step % cfg.ckpt_every == 0 or step == last:
                save_checkpoint(ckpt, step, models, opts, history)
            continue
        for role in models:
            for group in opts[role].param_groups:
                group["lr"] = lr_at(step, peak=peaks[role], warmup=cfg.warmup, steps=cfg.steps)
        t_logits = models["target"](inputs).logits.flatten(0, 1)
        t_loss = F.cross_entropy(t_logits, labels)
        d_logits = models["draft"](inputs).logits.flatten(0, 1)
        d_ce = F.cross_entropy(d_logits, labels)
        kl = F.kl_div(
            d_logits.log_softmax(-1), t_logits.detach().log_softmax(-1), log_target=True, reduction="batchmean"
        )
        d_loss = (1 - cfg.distill) * d_ce + cfg.distill * kl
        for role, loss in (("target", t_loss), ("draft", d_loss)):
            opts[role].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[role].parameters(), 1.0)
            opts[role].step()
        step += 1
        tokens += inputs.numel()
        bar.update(1)
        bar.set_postfix(
            target=f"{t_loss.item():.3f}",
            draft_ce=f"{d_ce.item():.3f}",
            kl=f"{kl.item():.3f}",
            tok_s=f"{tokens / (time.perf_counter() - t0):.0f}",
        )
        if step % 25 == 0 or step == cfg.steps:
            history.append({"step": step, "target": t_loss.item(), "draft_ce": d_ce.item(), "kl": kl.item()})
        if step % cfg.ckpt_every == 0 or step == last:
            save_checkpoint(ckpt, step, models, opts, history)
    bar.close()

    summary = {
        "config": asdict(cfg),
        "steps_trained": step,
        "train_tokens": int(len(streams["train"])),
        "heldout_tokens": int(len(streams["heldout"])),
        "history_tail": history[-4:],
    }
    for role, model in models.items():
        loss = heldout_loss(model, streams["heldout"], cfg, device)
        summary[role] = {"params": n_params(model), "heldout_loss": loss, "heldout_ppl": math.exp(loss)}
        logger.info("%s: held-out loss %.4f, perplexity %.2f", role, loss, math.exp(loss))
        model.eval().save_pretrained(out / role)
        tokenizer.save_pretrained(out / role)
    (out / "eval.json").write_text(json.dumps(summary, indent=1))
    return summary


def export_pair(run: Path, dest: Path, dtype: str = "float16") -> None:
    """Copy ``run/{target,draft}`` (HF format) to ``dest`` with weights cast to ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for role in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(run / role, dtype=torch.float32, **NO_HUB_KERNELS)
        model = model.to(getattr(torch, dtype))
        if (dest / role).exists():
            shutil.rmtree(dest / role)
        model.save_pretrained(dest / role)
        AutoTokenizer.from_pretrained(run / role).save_pretrained(dest / role)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("eval.json", "config.json"):
        if (run / name).exists():
            shutil.copy(run / name, dest / ("train_" + name if name == "config.json" else name))
    cfg = json.loads((run / "config.json").read_text())
    corpus = json.loads((run / f"data_v{cfg['vocab_size']}_h{cfg['heldout_permille']}" / "corpus.json").read_text())
    (dest / "heldout_files.json").write_text(
        json.dumps({k: corpus[k] for k in ("python", "rule", "heldout")}, indent=1)
    )
    prompts = heldout_prompts(Path(corpus["root"]), corpus["heldout"])
    (dest / "prompts.json").write_text(json.dumps(prompts, indent=1))


def main(argv=None) -> int:
    """``python -m specfx.train.pair``: train (or resume) a pair, or ``--export`` one."""
    parser = argparse.ArgumentParser(
        prog="python -m specfx.train.pair",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="run directory (resumes if it has a checkpoint)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--stop-after", type=int, default=None, help="stop at this step (e.g. the last checkpoint's) and save"
    )
    parser.add_argument(
        "--export", type=Path, default=None, help="only export the finished run in --out to this directory"
    )
    parser.add_argument(
        "--dtype", default="float16", choices=("float16", "bfloat16", "float32"), help="weights dtype for --export"
    )
    defaults = PairConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.export is not None:
        export_pair(args.out, args.export, args.dtype)
        print(f"exported {args.out} to {args.export} ({args.dtype})")
        return 0
    cfg = PairConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    summary = train(args.out, cfg, args.device, args.threads, args.stop_after)
    print(json.dumps({r: summary[r] for r in ("target", "draft")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
