"""What `benchmarks/gpu_train6.sh` sends back from a GPU machine, and how it becomes a draft here.

A call returns at most 8 files of < 16 MiB each, so a trained head or draft comes back as one
results JSON and its weights in bfloat16, cut into parts (a 40 M-parameter PARD draft: ~81 MiB,
6 parts):

    python benchmarks/gpu_train6_files.py pack HEAD RUN_DIR OUT CPU_S_PER_STEP CPU_LABEL   # there
    python benchmarks/gpu_train6_files.py join DIR OUT_DIR [HEAD]                          # here

``pack`` writes ``OUT/HEAD_results.json`` (eval.json, the checkpoint's per-step history, the
head's config.json and its other small text files verbatim) and ``OUT/HEAD_bf16.partNN`` (the
floating tensors cast to bfloat16, as ``smollm2_head_recipe.py ship`` casts the shipped head),
then prints s/step against the CPU's. ``join`` rebuilds a directory that ``draft="HEAD:OUT_DIR"``
loads: the parts joined (sha256 checked), the text files written back, and what was too large
to return (a PARD draft's 3.5 MB tokenizer.json) copied from the local SmolLM2 conversion,
whose tokenizer the draft was saved with.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

PART_BYTES = 15 * 1024 * 1024  # under the 16 MiB a returned file may have
MAX_FILES = 8  # what one call returns
SMALL_TEXT = 64 * 1024  # text files of the head directory up to this size ride in the results JSON


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _bf16_copy(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(src)
    cast = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}
    save_file(cast, dst, metadata={"format": "pt"})


def pack(head: str, run_dir: Path, out: Path, cpu_per_step: str, cpu_label: str) -> int:
    results: dict = {"head": head}
    eval_path, meta_path = run_dir / "eval.json", run_dir / "ckpt" / "meta.json"
    results["eval"] = json.loads(eval_path.read_text()) if eval_path.exists() else None
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    results["checkpoint_step"], results["history"] = meta.get("step"), meta.get("history", [])
    head_dir = run_dir / "head"
    weights = head_dir / "model.safetensors"
    files, left = {}, []
    if head_dir.is_dir():
        for f in sorted(head_dir.iterdir()):
            if f.name == weights.name:
                continue
            if f.is_file() and f.stat().st_size <= SMALL_TEXT:
                files[f.name] = f.read_text()
            else:
                left.append(f.name)
    results["config"] = json.loads(files["config.json"]) if "config.json" in files else None
    results["files"], results["files_not_returned"] = files, left
    results["weights"] = None
    for stale in out.glob(f"{head}_bf16.part*"):
        stale.unlink()
    if weights.exists():
        bf16 = run_dir / "bf16.safetensors"
        _bf16_copy(weights, bf16)
        size = bf16.stat().st_size
        n = -(-size // PART_BYTES)
        room = MAX_FILES - 2  # log.txt and the results JSON come back too
        info = {"dtype": "bfloat16", "bytes": size, "sha256": _sha256(bf16), "parts": n}
        if n > room:
            print(f"NOT returning the weights: {size} bytes in bfloat16 are {n} parts of {PART_BYTES}, "
                  f"over the {room} files left of the {MAX_FILES} a call returns")  # fmt: skip
            info["returned"] = False
        else:
            with open(bf16, "rb") as f:
                for i in range(n):
                    (out / f"{head}_bf16.part{i:02d}").write_bytes(f.read(PART_BYTES))
            info["returned"] = True
            print(f"weights: {size} bytes in bfloat16, sha256 {info['sha256']}, {n} part(s) {head}_bf16.part*")
        results["weights"] = info
    (out / f"{head}_results.json").write_text(json.dumps(results, indent=1) + "\n")
    e = results["eval"]
    if e is None:
        print(f"no eval.json: the run did not finish (see the log); checkpoint at step {results['checkpoint_step']}")
        return 1
    per = e["train_seconds_this_run"] / max(e["steps"], 1)
    lo, _, hi = cpu_per_step.partition("-")
    speed = f"{float(lo) / per:.3g}x" + (f"-{float(hi) / per:.3g}x" if hi else "")
    print(f"{head}: {e['steps']} steps in {e['train_seconds_this_run']} s: {per:.3f} s/step ({speed} the CPU's "
          f"{cpu_per_step} s/step, {cpu_label}); final {e['final']}")  # fmt: skip
    return 0


def join(src: Path, dest: Path, head: str | None = None) -> int:
    found = sorted(src.glob(f"{head or '*'}_results.json"))
    if len(found) != 1:
        names = ", ".join(f.name for f in found) or "none"
        print(f"{src}: expected one {head or 'HEAD'}_results.json, found {names}; name the head: join DIR OUT_DIR HEAD")
        return 1
    results = json.loads(found[0].read_text())
    head, weights = results["head"], results["weights"]
    if not weights or not weights.get("returned"):
        print(f"{found[0]}: no weights came back with it (see its log.txt)")
        return 1
    parts = sorted(src.glob(f"{head}_bf16.part*"))
    if len(parts) != weights["parts"]:
        print(f"{src}: {len(parts)} of the {weights['parts']} parts {head}_bf16.part* are here")
        return 1
    dest.mkdir(parents=True, exist_ok=True)
    model = dest / "model.safetensors"
    with open(model, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    if _sha256(model) != weights["sha256"]:
        print(f"{model}: sha256 differs from the returned {weights['sha256']}: a part is broken")
        return 1
    for name, text in results["files"].items():
        (dest / name).write_text(text)
    if results["files_not_returned"]:
        from specfx.demo.smollm2 import smollm2_dir

        local = smollm2_dir(fetch=False)
        for name in results["files_not_returned"]:
            shutil.copy(local / name, dest / name)
        print(f"copied from {local}: {', '.join(results['files_not_returned'])}")
    print(f"wrote {dest} ({model.stat().st_size} bytes of weights, sha256 ok): draft={f'{head}:{dest}'!r}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 6 and argv[0] == "pack":
        return pack(argv[1], Path(argv[2]), Path(argv[3]), argv[4], argv[5])
    if len(argv) in (3, 4) and argv[0] == "join":
        return join(Path(argv[1]), Path(argv[2]), argv[3] if len(argv) == 4 else None)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
