"""Benchmark prompts cut from the Python standard library's source, and the targets they run on.

Functions of ``--fn-tokens`` tokens (default 40-90, so that an edit prompt and its
continuation fit the demo pair's 256-token training context) are cut from the files the demo
pair holds out of training (the path-hash rule of ``specfx.train.pair``), in a fixed
order shuffled by ``--seed``:

    edit      the function, two blank lines, then its first line again with the function renamed
              (``name`` -> ``name_v2``): a model that copies from its context continues with
              the body, i.e. the output repeats a span of the prompt
    complete  the function's first 3 lines only: the continuation is new code (little to copy)
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

import torch

from specfx.demo.pair import DEMO_PAIR_DIR
from specfx.model.load import load_causal_lm, load_tokenizer

__all__ = ["DEMO_TARGET", "functions", "heldout_files", "load_target", "parsed_files", "pick_functions", "source_of",
           "task_prompt"]

DEMO_TARGET = DEMO_PAIR_DIR / "target"
HELDOUT_PERMILLE = 50  # specfx.train.pair's default split


def default_target() -> str:
    """The demo pair's target directory when it is shipped, else ``"random"``."""
    return str(DEMO_TARGET) if (DEMO_TARGET / "config.json").exists() else "random"


def heldout_files() -> list[Path]:
    """Stdlib files held out of the demo pair's training (sorted), by its path-hash rule."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel:
            continue
        if int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) < HELDOUT_PERMILLE * 16**8 // 1000:
            out.append(path)
    return out


def parsed_files(paths) -> Iterator[tuple[Path, ast.Module, list[str]]]:
    """(path, syntax tree, source lines) of each of ``paths`` that reads as UTF-8 and parses."""
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield path, tree, text.splitlines()


def source_of(node: ast.AST, lines: list[str]) -> str | None:
    """``node``'s source, dedented; None when it is indented with tabs."""
    src = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    return None if "\t" in src else src


def functions(encode, min_tokens: int, max_tokens: int) -> list[tuple[str, str, str]]:
    """(file, function name, dedented source) of every function of min..max tokens."""
    found = []
    for path, tree, lines in parsed_files(heldout_files()):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.decorator_list:
                src = source_of(node, lines)
                if src is not None and min_tokens <= len(encode(src)) <= max_tokens:
                    found.append((path.name, node.name, src))
    return found


def task_prompt(task: str, name: str, src: str) -> str:
    # No trailing newline: BPE merges a newline with the next line's indentation, so a prompt
    # ending in a bare newline would force a token boundary the model never saw in training.
    if task == "edit":
        first = src.splitlines()[0].replace(f"def {name}(", f"def {name}_v2(", 1)
        return f"{src}\n\n\n{first}"
    return "\n".join(src.splitlines()[:3])


def pick_functions(encode, fn_tokens: tuple[int, int], num: int, seed: int) -> tuple[list, int]:
    """``num`` functions (file, name, source) picked by ``seed``, and how many there were."""
    pool = functions(encode, *fn_tokens)
    random.Random(seed).shuffle(pool)
    return pool[:num], len(pool)


def load_target(spec: str):
    """(target, encode, description) for ``spec``: a local model directory with safetensors
    weights and a tokenizer, or ``"random"`` (a random 6-layer llama over UTF-8 bytes)."""
    from specfx.testing.tiny import tiny_causal_lm

    if spec == "random":
        target = tiny_causal_lm(
            "llama", vocab_size=512, num_layers=6, hidden_size=256, intermediate_size=704, max_positions=2048
        )
        return target, lambda s: list(s.encode("utf-8")), "random 6-layer llama over UTF-8 bytes (α meaningless)"
    target, tok = load_causal_lm(spec, torch.float32), load_tokenizer(spec)
    if tok is None:
        raise ValueError(f"{spec} has no tokenizer files: these prompts are text; save the tokenizer beside the model.")
    return target, lambda s: tok(s, add_special_tokens=False)["input_ids"], f"{spec} (trained)"
