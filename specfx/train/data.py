"""Training data for ``specfx train``: texts from files, folders and JSONL, tokenized with the
target's tokenizer into one stream per side (training / held-out), and fixed-length windows
drawn from it as a pure function of (seed, step).

Inputs (``--data``, repeatable):

* a text file: one document (any suffix except ``.jsonl``; a file that is not UTF-8 is refused);
* a folder: every regular file under it, recursively, sorted by path, that decodes as UTF-8
  (others skipped: images, caches), ``.jsonl`` files there read as below;
* a ``.jsonl`` file: one JSON value per line, either a string, an object with ``"text"``, or an
  object with ``"messages"`` / ``"conversations"`` (a list of ``{"role", "content"}`` turns,
  ShareGPT's ``{"from", "value"}`` accepted), rendered with the tokenizer's chat template when
  it has one, else as ``role: content`` lines.

With ``--assistant-only-loss`` (TRL's ``assistant_only_loss``), only the assistant turns of chat
records are learnt and scored: :func:`label_streams` gives, beside each token stream, a mask that
is 1 on the tokens of each assistant turn's content and on the one token the template puts right
after it (its end of turn, which the model generates too) and 0 elsewhere (system prompts, user
turns, the template's own markup, plain texts, the document separators).

The held-out split is by document and fixed: a document is held out when the first 8 hex digits
of the SHA-256 of its text, read as an integer, fall under ``heldout_permille / 1000`` of the
range (the demo pair's rule, on the content instead of a path, so JSONL lines split too). It
does not depend on the seed. With a single document, or none held out, the last
``heldout_permille`` of the stream is held out instead.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["load_texts", "split_texts", "encode", "label_streams", "Windows"]


class ChatText(str):
    """A rendered chat record: the text, with ``assistant`` the ``(start, end)`` character spans
    of its assistant turns' contents (None when the template did not reproduce a turn verbatim)."""

    assistant: list[tuple[int, int]] | None = None


def _chat_text(text: str, turns: list[dict]) -> ChatText:
    out, spans, at = ChatText(text), [], 0
    for t in turns:
        start = text.find(t["content"], at)
        if start < 0:  # the template rewrote a turn (stripped it, say): no spans to trust
            return out
        at = start + len(t["content"])
        if t["role"] == "assistant":
            spans.append((start, at))
    out.assistant = spans
    return out


def _read_text(path: Path, strict: bool) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        if strict:
            raise ValueError(
                f"--data {str(path)!r} is not UTF-8 text; pass text files, a folder or a JSONL file."
            ) from None
        return None


def _turns(value, where: str) -> list[dict]:
    turns = []
    for turn in value:
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: a chat turn must be an object with role/content, got {turn!r:.60}.")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where}: a chat turn needs string 'role' and 'content' (or 'from' and 'value').")
        role = {"human": "user", "gpt": "assistant"}.get(role, role)
        turns.append({"role": role, "content": content})
    return turns


def _jsonl(path: Path, tokenizer) -> list[str]:
    texts = []
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--data {str(path)!r} line {n}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON ({e.msg}).") from None
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict) and isinstance(value.get("text"), str):
            texts.append(value["text"])
        elif isinstance(value, dict) and isinstance(value.get("messages", value.get("conversations")), list):
            turns = _turns(value.get("messages", value.get("conversations")), where)
            if template:
                text = tokenizer.apply_chat_template(turns, tokenize=False)
            else:
                text = "".join(f"{t['role']}: {t['content']}\n" for t in turns)
            texts.append(_chat_text(text, turns))
        else:
            raise ValueError(
                f'{where}: expected a string, an object with "text", or an object with "messages" '
                f"(a list of role/content turns)."
            )
    return texts


def load_texts(paths, tokenizer=None) -> list[str]:
    """The documents of every ``--data`` path, in order (see the module docstring)."""
    if not paths:
        raise ValueError("specfx train needs --data: text files, a folder of them, or a JSONL file.")
    texts: list[str] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            for p in sorted(p for p in path.rglob("*") if p.is_file()):
                text = _read_text(p, strict=False)
                if text and p.suffix == ".jsonl":
                    texts += _jsonl(p, tokenizer)
                elif text:
                    texts.append(text)
        elif path.is_file():
            if path.suffix == ".jsonl":
                texts += _jsonl(path, tokenizer)
            else:
                text = _read_text(path, strict=True)
                if text:
                    texts.append(text)
        else:
            raise ValueError(f"--data {str(raw)!r} does not exist (pass text files, a folder or a JSONL file).")
    if not texts:
        raise ValueError(f"--data {', '.join(map(str, paths))}: no non-empty UTF-8 text found.")
    return texts


def is_heldout(text: str, permille: int) -> bool:
    digest = int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16)
    return digest < permille / 1000 * 16**8


def split_texts(texts: list[str], permille: int) -> tuple[list[str], list[str]]:
    """``(training, held_out)`` documents by the fixed content-hash rule."""
    train = [t for t in texts if not is_heldout(t, permille)]
    held = [t for t in texts if is_heldout(t, permille)]
    return train, held


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """One int32 stream: each document's ids followed by the EOS id (the document separator)."""
    sep = tokenizer.eos_token_id
    out: list[int] = []
    for text in texts:
        out += tokenizer(text, add_special_tokens=False)["input_ids"]
        if sep is not None:
            out.append(int(sep))
    return np.asarray(out, dtype=np.int32)


def streams(tokenizer, texts: list[str], permille: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)`` token streams, each at least one window of ``length`` tokens."""
    train, held = split_texts(texts, permille)
    if not train or not held:  # one document, or none on one side: split the stream's tail
        stream = encode(tokenizer, texts)
        cut = len(stream) - max(length, len(stream) * permille // 1000)
        train_ids, held_ids = stream[:cut], stream[cut:]
    else:
        train_ids, held_ids = encode(tokenizer, train), encode(tokenizer, held)
    for name, ids in (("training", train_ids), ("held-out", held_ids)):
        if len(ids) < length:
            raise ValueError(
                f"--data has {len(ids)} {name} tokens, fewer than one window of --seq-len {length}: "
                f"pass more text or a shorter --seq-len."
            )
    return train_ids, held_ids


def _label_mask(tokenizer, text: str) -> list[int]:
    """Per token of ``text`` (as :func:`encode` tokenizes it): 1 on an assistant turn's content
    and on the token right after it, else 0 (module docstring)."""
    spans = getattr(text, "assistant", None)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    mask = [0] * len(offsets)
    for start, end in spans or ():
        inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        if inside:  # the content, then its end of turn
            first, stop = inside[0], min(inside[-1] + 2, len(mask))
            mask[first:stop] = [1] * (stop - first)
    return mask


def label_streams(tokenizer, texts: list[str], permille: int, length: int):
    """:func:`streams` with ``--assistant-only-loss``'s label masks: ``(train, held_out,
    train_mask, held_out_mask)``, each mask a uint8 array beside its stream."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "--assistant-only-loss needs a fast tokenizer (its character offsets locate the assistant turns); "
            "this target's tokenizer is a slow one."
        )
    if any(isinstance(t, ChatText) and t.assistant is None for t in texts):
        raise ValueError(
            "--assistant-only-loss: the tokenizer's chat template does not reproduce a chat turn's content "
            "verbatim, so its assistant tokens cannot be located; leave the flag out for this data."
        )
    if not any(getattr(t, "assistant", None) for t in texts):
        raise ValueError(
            "--assistant-only-loss: --data holds no chat records with assistant turns (JSONL objects with "
            '"messages"); leave the flag out to learn every token.'
        )
    per_text = {id(t): _label_mask(tokenizer, t) for t in texts}
    sep = [0] if tokenizer.eos_token_id is not None else []

    def mask_of(docs):
        return np.asarray([m for t in docs for m in per_text[id(t)] + sep], dtype=np.uint8)

    train, held = split_texts(texts, permille)
    ids = streams(tokenizer, texts, permille, length)
    if not train or not held:  # streams() split the tail of the whole stream
        whole = mask_of(texts)
        masks = whole[: len(ids[0])], whole[len(ids[0]) :]
    else:
        masks = mask_of(train), mask_of(held)
    for name, mask in zip(("training", "held-out"), masks, strict=True):
        if not mask.any():
            raise ValueError(
                f"--assistant-only-loss: the {name} side of --data has no assistant tokens (documents split by "
                f"--heldout-permille); pass more chat records."
            )
    return (*ids, *masks)


class Windows:
    """Fixed-length windows ``[batch, length]`` of a token stream, drawn at random starts from a
    generator seeded with ``(seed, step)``: a pure function of the step, so a resumed run sees
    exactly the batches an uninterrupted one would."""

    def __init__(self, stream: np.ndarray, length: int, batch: int, seed: int):
        self.stream, self.length, self.batch, self.seed = stream, length, batch, seed

    def at(self, step: int) -> torch.Tensor:
        g = np.random.default_rng([self.seed, step])
        starts = g.integers(0, len(self.stream) - self.length + 1, size=self.batch)
        return torch.from_numpy(np.stack([self.stream[s : s + self.length] for s in starts]).astype(np.int64))

    def fixed(self, count: int) -> list[torch.Tensor]:
        """``count`` batches of evenly spaced windows (the held-out evaluation set)."""
        n = count * self.batch
        starts = np.linspace(0, len(self.stream) - self.length, n).astype(np.int64)
        rows = np.stack([self.stream[s : s + self.length] for s in starts]).astype(np.int64)
        return [torch.from_numpy(rows[i * self.batch : (i + 1) * self.batch]) for i in range(count)]
