"""``specfx bench``: specfx against Hugging Face generation, measured side by side in one process.

Tasks (``specfx bench [TASK] --help``):

    (default)  the draft-model benchmark: HF dynamic/static/compiled/assisted vs specfx at every
               K and batch size (:mod:`specfx.bench.tasks.default`)
    drafters   prompt lookup (fixed K and "auto") against HF's prompt lookup on code from the
               standard library (:mod:`specfx.bench.tasks.drafters`)
    selfspec   early exit and MTP heads against HF's equivalents (:mod:`specfx.bench.tasks.selfspec`)
    trees      token trees against chains at the same verification budget, demo pair
               (:mod:`specfx.bench.tasks.trees`)
    gpu        the GPU benchmark: Llama-shaped random-weight pairs, an oracle drafter of
               controlled acceptance and the bandwidth floor (:mod:`specfx.bench.tasks.gpu`;
               ``--smoke`` checks it on tiny CPU models, ``--dry-run`` predicts its runtime)
    gpu_check  every drafter compiled on CUDA: greedy equality, one graph per shape, no host
               sync, CUDA-graph launches (:mod:`specfx.bench.tasks.gpu_check`)
    suite      SmolLM2-135M-Instruct on the project's Spec-Bench-style chat suite (eight
               categories), specfx against HF generate(), prompt lookup and early exit, greedy
               and sampling, batch 1 and 8, with issue 27's targets (:mod:`specfx.bench.tasks.suite`)

Building blocks: :mod:`.harness` (timing loops, token checks, HF's peers), :mod:`.counters`
(HF's forwards), :mod:`.floor` (the bandwidth floor), :mod:`.oracle` (the oracle drafter),
:mod:`.stdlib_code` and ``prompts/suite.jsonl`` (prompts), :mod:`.plot`. From a checkout without installing, run a task as
``python3 -m specfx.cli bench TASK ...``.

A tool beside the library: ``import specfx`` does not import this package (nor tqdm's bars or
matplotlib, which :mod:`specfx.bench.plot` needs only when it draws).
"""

from __future__ import annotations

import sys

__all__ = ["main", "TASKS"]

TASKS = ("drafters", "selfspec", "trees", "gpu", "gpu_check", "suite")


def main(argv=None) -> int:
    """Entry point of ``specfx bench``: a task name first selects that task."""
    argv = sys.argv[2:] if argv is None else list(argv)
    if argv[:1] == ["drafters"]:
        from specfx.bench.tasks.drafters import main as task_main
    elif argv[:1] == ["selfspec"]:
        from specfx.bench.tasks.selfspec import main as task_main
    elif argv[:1] == ["trees"]:
        from specfx.bench.tasks.trees import main as task_main
    elif argv[:1] == ["gpu"]:
        from specfx.bench.tasks.gpu import main as task_main
    elif argv[:1] == ["gpu_check"]:
        from specfx.bench.tasks.gpu_check import main as task_main
    elif argv[:1] == ["suite"]:
        from specfx.bench.tasks.suite import main as task_main
    else:
        from specfx.bench.tasks.default import main as core_main

        return core_main(argv)
    return task_main(argv[1:])
