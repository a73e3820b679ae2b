"""The prompt suite of ``specfx bench suite`` (:mod:`specfx.bench.tasks.suite`): loading
``specfx/bench/prompts/suite.jsonl``, rendering a prompt with the model's chat template, left-padded
batches of a category, and counting the tokens a chat answer generated (EOS kept).

The suite is the project's own text, in Spec-Bench's categories: one JSON object a line,
``{"id": "rag-03", "category": "rag", "messages": [{"role": "user", "content": ...}, ...]}``,
``messages`` ending with the user's turn (a multi-turn prompt carries a previous assistant turn).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

__all__ = ["CATEGORIES", "count_new_tokens", "load_suite", "make_batches", "render"]

CATEGORIES = (
    "multi_turn",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
    "code_writing",
    "code_editing",
)


def load_suite(path: str | Path | None = None) -> dict[str, list[dict]]:
    """The prompt suite: category -> prompts in file order, each ``{"id", "category", "messages"}``
    (``messages``: chat messages, ``{"role", "content"}``, ending with a user turn). ``path``: a
    JSONL file of that format (default: the shipped ``specfx/bench/prompts/suite.jsonl``).
    A malformed line raises ValueError naming it."""
    source = resources.files("specfx.bench") / "prompts" / "suite.jsonl" if path is None else Path(path)
    suite: dict[str, list[dict]] = {}
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            messages = item["messages"]
            ok = isinstance(item["id"], str) and isinstance(item["category"], str) and isinstance(messages, list)
            ok = ok and all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)
            ok = ok and bool(messages) and messages[-1]["role"] == "user"
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{source}:{number}: not a suite prompt ({type(e).__name__}: {e})") from None
        if not ok:
            raise ValueError(
                f'{source}:{number}: a suite prompt is {{"id": str, "category": str, "messages": [{{"role", '
                f'"content"}}, ...]}} ending with a user message; got {line[:120]!r}'
            )
        suite.setdefault(item["category"], []).append(item)
    return suite


def render(tokenizer, messages: list[dict]) -> str:
    """``messages`` as the model sees them: the chat template with the assistant's turn opened."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def make_batches(tokenizer, prompts: list[dict], batch: int, device) -> list[dict]:
    """``prompts`` rendered and left-padded ``batch`` at a time into ``{"input_ids": [B, S],
    "attention_mask": [B, S]}``; the last batch is filled by cycling ``prompts`` from the start."""
    texts = [render(tokenizer, p["messages"]) for p in prompts]
    batches = []
    for start in range(0, len(texts), batch):
        rows = [texts[(start + r) % len(texts)] for r in range(batch)]
        enc = tokenizer(rows, return_tensors="pt", padding=True, padding_side="left")
        batches.append({k: enc[k].to(device) for k in ("input_ids", "attention_mask")})
    return batches


def count_new_tokens(out: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> int:
    """Tokens generated in ``out`` ``[B, prompt_width + new]``: per row up to and including its
    first EOS (HF pads a finished row with pad_token_id), else all of its new columns."""
    new = out[:, prompt_width:]  # [B, new]
    if not eos_ids or new.shape[1] == 0:
        return new.numel()
    is_eos = torch.isin(new, torch.tensor(sorted(eos_ids), device=new.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new.shape[1])  # [B]
    return int(first.sum())
