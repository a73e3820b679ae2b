"""The demo pair's corpus and tokenizer (steps 1 and 2 of :mod:`specfx.train.pair`): the Python
standard library's ``.py`` files split by a hash of their path, a byte-level BPE trained on the
training side, the token streams (:func:`prepare` caches them in the run's directory), and the
held-out prompts the demo completes."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

__all__ = [
    "EOS",
    "PAD",
    "build_corpus",
    "encode_stream",
    "heldout_prompts",
    "is_heldout",
    "prepare",
    "stdlib_root",
    "train_tokenizer",
]

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str, permille: int) -> bool:
    """The fixed split: by a hash of the file's path relative to the stdlib root."""
    h = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16)
    return h < permille * 16**8 // 1000


def build_corpus(permille: int, root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """``{"train": [(relpath, text)], "heldout": [...]}`` from the stdlib's ``.py`` files."""
    root = root or stdlib_root()
    split: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            split["heldout" if is_heldout(rel, permille) else "train"].append((rel, text))
    return split


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE trained on ``texts``, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None, pad_token=PAD, padding_side="left"
    )


def encode_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one uint16 token stream, each followed by EOS."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    out: list[int] = []
    for text in tqdm(texts, desc="tokenizing", unit="file", leave=False):
        out.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(eos)
    return np.asarray(out, dtype=np.uint16)


def heldout_prompts(root: Path, files: list[str], n: int = 12, lines: int = 6) -> list[dict]:
    """Up to ``n`` code prompts from held-out files: in each file (in order) the first ``def``
    past its first 20 lines, with the ``lines - 1`` lines after it (without the last newline)."""
    prompts = []
    for rel in files:
        try:
            text = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        for i in range(20, len(text) - lines):
            if text[i].lstrip().startswith("def ") and all(t.strip() for t in text[i : i + lines]):
                # No trailing newline: BPE merges a newline with the next line's indentation, so
                # a prompt ending in a bare "\n" token would start from an unusual token.
                prompts.append({"file": rel, "line": i + 1, "text": "".join(text[i : i + lines]).rstrip("\n")})
                break
        if len(prompts) == n:
            break
    return prompts


def prepare(out: Path, cfg):
    """Corpus split, tokenizer and token streams for a :class:`~specfx.train.pair.PairConfig`
    (cached in ``out``): ``(tokenizer, {"train": stream, "heldout": stream})``."""
    from transformers import AutoTokenizer

    # The corpus and tokenizer depend only on these two fields; other options reuse them.
    key = f"v{cfg.vocab_size}_h{cfg.heldout_permille}"
    tok_dir, data = out / f"tokenizer_{key}", out / f"data_{key}"
    if not (data / "heldout.npy").exists():
        logger.info("building the corpus from %s", stdlib_root())
        split = build_corpus(cfg.heldout_permille)
        data.mkdir(parents=True, exist_ok=True)
        (data / "corpus.json").write_text(
            json.dumps(
                {
                    "root": str(stdlib_root()),
                    "python": sys.version.split()[0],
                    "rule": f"held out iff int(sha256(relpath)[:8], 16) < {cfg.heldout_permille} * 16**8 // 1000",
                    **{k: [r for r, _ in v] for k, v in split.items()},
                    "chars": {k: sum(len(t) for _, t in v) for k, v in split.items()},
                },
                indent=1,
            )
        )
        logger.info("training the tokenizer (vocab %d) on %d files", cfg.vocab_size, len(split["train"]))
        tokenizer = train_tokenizer([t for _, t in split["train"]], cfg.vocab_size)
        tokenizer.save_pretrained(tok_dir)
        for name, files in split.items():
            np.save(data / f"{name}.tmp.npy", encode_stream(tokenizer, [t for _, t in files]))
        for name in split:  # heldout.npy last: its presence marks a complete preparation
            (data / f"{name}.tmp.npy").replace(data / f"{name}.npy")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    streams = {name: np.load(data / f"{name}.npy", allow_pickle=False) for name in ("train", "heldout")}
    return tokenizer, streams
