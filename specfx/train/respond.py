"""The target's own responses to prompts: the training data of the method's recipe (EAGLE-3,
Medusa-2 and PARD all train on what the target itself says, not on a corpus written by others).

``python -m specfx.train.respond --target DIR --prompts P.jsonl --out R.jsonl`` reads prompts
(JSONL: ``{"id", "messages": [...]}`` with the conversation so far, ending with a user turn),
renders each with the target's chat template and appends ``{"id", "category", "messages"}``
with the target's answer as the last, assistant turn to ``R.jsonl``, one line per prompt, in
batches of ``--batch-size`` prompts of similar length (left-padded, HF ``generate()``).

* Greedy by default (the data then matches what a greedy user sees; ``--do-sample`` with
  ``--temperature`` for variety), seeded per batch so a rerun gives the same file.
* Resumable: ids already in ``R.jsonl`` are skipped, so an interrupted run continues where it
  stopped (a batch is written only once it is finished).
* The output is what ``specfx train --data R.jsonl`` reads (the ``messages`` form).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

__all__ = ["read_prompts", "respond", "main"]


def read_prompts(path: str | Path) -> list[dict]:
    """The prompts of a JSONL file: objects with a unique ``id`` and ``messages`` ending in a
    user turn (checked)."""
    rows, seen = [], set()
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        where = f"{path} line {n}"
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
            raise ValueError(f"{where}: expected an object with 'messages' ending in a user turn.")
        if "id" not in row or row["id"] in seen:
            raise ValueError(f"{where}: every prompt needs a unique 'id'.")
        seen.add(row["id"])
        rows.append(row)
    return rows


def _done(out: Path) -> set:
    if not out.exists():
        return set()
    return {json.loads(line)["id"] for line in out.read_text(encoding="utf-8").splitlines() if line.strip()}


@torch.no_grad()
def respond(
    model,
    tokenizer,
    prompts: list[dict],
    out: str | Path,
    max_new_tokens: int = 192,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 0.7,
    seed: int = 0,
    log=print,
) -> int:
    """Append the target's answer to every prompt not yet in ``out``; returns how many were
    written by this call. Batches hold prompts of similar rendered length (fewer pad tokens)."""
    out = Path(out)
    done = _done(out)
    todo = [p for p in prompts if p["id"] not in done]
    if not todo:
        return 0
    texts = {
        p["id"]: tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True) for p in todo
    }
    lengths = {i: len(tokenizer(t, add_special_tokens=False)["input_ids"]) for i, t in texts.items()}
    todo.sort(key=lambda p: lengths[p["id"]])
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    pad = model.generation_config.pad_token_id
    pad = tokenizer.eos_token_id if pad is None else pad
    eos = model.generation_config.eos_token_id
    written, start = 0, time.monotonic()
    try:
        for b in range(0, len(todo), batch_size):
            batch = todo[b : b + batch_size]
            enc = tokenizer(
                [texts[p["id"]] for p in batch], return_tensors="pt", padding=True, add_special_tokens=False
            )
            enc = enc.to(model.device)
            torch.manual_seed(seed * 1_000_003 + b)
            kwargs = (
                dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
                if do_sample
                else dict(do_sample=False)
            )
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad, **kwargs)
            new = ids[:, enc["input_ids"].shape[1] :]
            with out.open("a", encoding="utf-8") as f:
                for p, row in zip(batch, new.tolist(), strict=True):
                    answer = tokenizer.decode(_until_eos(row, eos), skip_special_tokens=True).strip()
                    messages = p["messages"] + [{"role": "assistant", "content": answer}]
                    f.write(json.dumps({"id": p["id"], "category": p.get("category"), "messages": messages}) + "\n")
            written += len(batch)
            rate = written / (time.monotonic() - start)
            log(f"{written + len(done)}/{len(prompts)} answered ({rate * 60:.0f}/min)")
    finally:
        tokenizer.padding_side = side
    return written


def _until_eos(row: list[int], eos) -> list[int]:
    stops = set(eos if isinstance(eos, list | tuple) else [eos]) - {None}
    for i, t in enumerate(row):
        if t in stops:
            return row[:i]
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specfx.train.respond",
        description="Append the target's own answers to chat prompts (JSONL) to a JSONL file that specfx train reads.",
    )
    p.add_argument("--target", required=True, help="a local HF causal LM directory (safetensors) with a chat template")
    p.add_argument("--prompts", required=True, help="JSONL of {id, messages} ending in a user turn")
    p.add_argument("--out", required=True, help="JSONL to append {id, category, messages} to (resumable)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p


def main(argv=None) -> int:
    from specfx.model.load import load_causal_lm, load_tokenizer

    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_causal_lm(args.target, torch.float32).eval()
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"{args.target}: needs a tokenizer with a chat template.")
    n = respond(
        model, tokenizer, read_prompts(args.prompts), args.out, args.max_new_tokens, args.batch_size,
        args.do_sample, args.temperature, args.seed,
    )  # fmt: skip
    print(f"wrote {n} answers to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
