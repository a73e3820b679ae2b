"""The report of ``specfx bench suite`` (:mod:`specfx.bench.tasks.suite`): per-category ratios,
their means, issue 27's targets with PASS/FAIL, the markdown tables and the bar plot.

Everything here is a function of the measured results (name -> ``{"status", "categories":
{category: {"tokens_per_s", ...}}}``), so the arithmetic is tested on synthetic timings.
A ratio is specfx's tokens/s over the peer's on the same category (> 1: specfx is faster); the
average is the arithmetic mean of a column over the categories (None, printed "n/a", when a
category lacks it); "HF best" is, per category, the faster of HF's speculative options that ran.

Time. With sampling, methods emit different samples, so rows stop at different lengths and the
token counts differ; at batch > 1 a batch runs until its longest row ends, so tokens/s mixes speed
with how many tokens the shorter rows happened to emit (one seed, 8 rows a category: the chat
suite's batch-8 sampling once read 0.55x on qa, 410 tokens against HF's 828, in less wall time).
``time_vs_hf_dynamic``, HF generate()'s median seconds on the category over the method's (> 1:
specfx finished the same prompts sooner), is printed beside it: the same work bound (prompts,
``max_new_tokens``), read with the tokens/s where the token counts differ.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from specfx.bench.harness import BASELINE

__all__ = [
    "HF_SPECULATIVE",
    "TARGETS",
    "category_summary",
    "markdown_report",
    "specfx_differences",
    "suite_plot",
    "summarise",
    "target_checks",
]

HF_SPECULATIVE = ("hf_prompt_lookup", "hf_early_exit")
# issue 27's targets at batch 1: (what, column, over categories: "mean" or "min", threshold)
TARGETS = (
    ("average vs HF generate()", "vs_hf_dynamic", "mean", 1.5),
    ("every category vs HF generate()", "vs_hf_dynamic", "min", 1.0),
    ("every category vs HF's best speculative option", "vs_hf_best", "min", 1.2),
)
COLUMNS = ("tokens_per_s", "vs_hf_dynamic", "vs_hf_prompt_lookup", "vs_hf_best", "tau", "time_vs_hf_dynamic")
LABELS = {BASELINE: "HF generate()", "hf_prompt_lookup": "HF prompt lookup", "hf_early_exit": "HF early exit"}


def _measured(results: dict, name: str, category: str, key: str) -> float | None:
    """Method ``name``'s ``key`` on ``category`` (None where it did not run or did not measure it)."""
    r = results.get(name)
    if r is None or r["status"] != "ok" or category not in r["categories"]:
        return None
    return r["categories"][category].get(key)


def _speed(results: dict, name: str, category: str) -> float | None:
    return _measured(results, name, category, "tokens_per_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def category_summary(results: dict, name: str, category: str) -> dict:
    """Method ``name`` on ``category``: tokens/s, ratios to HF generate(), HF prompt lookup and
    HF's best speculative option (``hf_best`` names it), τ, α and the greedy token check."""
    speed = _speed(results, name, category)
    peers = {p: _speed(results, p, category) for p in HF_SPECULATIVE}
    ran = {p: s for p, s in peers.items() if s is not None}
    best = max(ran, key=ran.get) if ran else None
    res = results[name]["categories"][category]
    return dict(
        tokens_per_s=speed,
        vs_hf_dynamic=_ratio(speed, _speed(results, BASELINE, category)),
        vs_hf_prompt_lookup=_ratio(speed, peers["hf_prompt_lookup"]),
        vs_hf_best=_ratio(speed, ran.get(best)),
        hf_best=best,
        tau=res.get("tau"),
        time_vs_hf_dynamic=_ratio(*(_measured(results, n, category, "median_s") for n in (BASELINE, name))),
        alpha=res.get("alpha"),
        same_tokens_as_hf_dynamic=res.get("same_tokens_as_hf_dynamic"),
    )


def _mean(values: list) -> float | None:
    return statistics.fmean(values) if values and all(v is not None for v in values) else None


def target_checks(per_category: dict[str, dict], average: dict) -> list[dict]:
    """Issue 27's batch-1 targets on one specfx method's per-category summaries and their
    averages: ``{"target", "threshold", "value", "where", "passed"}`` each (``where``: the
    category of a minimum; ``value``/``passed`` None when a peer did not run)."""
    checks = []
    for what, column, over, threshold in TARGETS:
        where = None
        if over == "mean":
            value = average.get(column)
        else:
            values = {c: s[column] for c, s in per_category.items()}
            value = None if not values or None in values.values() else min(values.values())
            where = None if value is None else min(values, key=values.get)
        passed = None if value is None else value >= threshold
        checks.append(
            dict(target=f"{what} >= {threshold}x", threshold=threshold, value=value, where=where, passed=passed)
        )
    return checks


def summarise(results: dict, batch: int) -> dict:
    """specfx method -> ``{"categories": {category: summary}, "average": {column: mean},
    "targets": [...]}`` for one mode and batch size; the targets apply at batch 1 only."""
    out = {}
    for name, r in results.items():
        if not name.startswith("specfx") or r["status"] != "ok":
            continue
        per = {c: category_summary(results, name, c) for c in r["categories"]}
        average = {col: _mean([s[col] for s in per.values()]) for col in COLUMNS}
        out[name] = dict(categories=per, average=average, targets=target_checks(per, average) if batch == 1 else [])
    return out


def specfx_differences(runs: dict) -> list[str]:
    """Where a specfx method's greedy output differed from HF generate()'s: "MODE batch B NAME on
    CATEGORY" for each (``runs``: mode -> batch -> {"methods": results}); HF peers are not listed."""
    return [
        f"{mode} batch {batch} {name} on {c}"
        for mode, by_batch in runs.items()
        for batch, cfg in by_batch.items()
        for name, r in cfg["methods"].items()
        if name.startswith("specfx")
        for c, res in r["categories"].items()
        if res.get("same_tokens_as_hf_dynamic") is False
    ]


# ----------------------------------------------------------------------------- markdown
def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _f(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[passed]


def config_table(results: dict, summary: dict, name: str) -> list[str]:
    """The markdown table of one specfx method against HF on every category, and its targets."""
    peers = [BASELINE, *HF_SPECULATIVE]
    lines = [
        "| category | " + " | ".join(f"{LABELS[p]} tok/s" for p in peers) + f" | {name} tok/s | vs HF generate() "
        "| vs HF prompt lookup | vs HF best (which) | τ | same tokens as HF | time vs HF generate() |",
        "|---|" + "---:|" * (len(peers) + 5) + "---|---:|",
    ]
    s = summary[name]
    for c, row in s["categories"].items():
        same = {True: "yes", False: "**NO**", None: ""}[row["same_tokens_as_hf_dynamic"]]
        best = f"{_x(row['vs_hf_best'])} ({LABELS.get(row['hf_best'], 'n/a')})" if row["hf_best"] else "n/a"
        lines.append(
            f"| {c} | "
            + " | ".join(_f(_speed(results, p, c)) for p in peers)
            + f" | {_f(row['tokens_per_s'])} | {_x(row['vs_hf_dynamic'])} | {_x(row['vs_hf_prompt_lookup'])} "
            f"| {best} | {_f(row['tau'], 2)} | {same} | {_x(row['time_vs_hf_dynamic'])} |"
        )
    avg = s["average"]
    peer_means = [_mean([_speed(results, p, c) for c in s["categories"]]) for p in peers]
    lines.append(
        "| **average** | "
        + " | ".join(_f(v) for v in peer_means)
        + f" | {_f(avg['tokens_per_s'])} | **{_x(avg['vs_hf_dynamic'])}** | {_x(avg['vs_hf_prompt_lookup'])} "
        f"| {_x(avg['vs_hf_best'])} | {_f(avg['tau'], 2)} | | {_x(avg['time_vs_hf_dynamic'])} |"
    )
    lines.append("")
    for t in s["targets"]:
        where = f" (lowest: {t['where']})" if t["where"] else ""
        lines.append(f"- target: {t['target']}: {_x(t['value'])}{where} -> **{_verdict(t['passed'])}**")
    return lines + [""]


def markdown_report(runs: dict, args, meta: dict) -> str:
    """suite.md: the run's header, then per mode and batch size one table per specfx method,
    the targets (batch 1), and what did not run or differs."""
    lines = [
        f"# specfx bench suite: {meta['model']}",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['model']}, float32, {meta['device']}, {meta['machine']['threads']} torch thread(s), "
        f"{args.max_new_tokens} new tokens at most (EOS kept), {args.repeats} timed repeat(s), medians; "
        f"specfx {'eager' if args.no_compile else 'compiled'}; torch {meta['versions']['torch']}, "
        f"transformers {meta['versions']['transformers']}; {meta['machine']['cpu']}; load average "
        f"{meta['load_avg']['start'][0]:.2f} at start, {meta['load_avg']['end'][0]:.2f} at end; "
        f"{meta['wall_s']:.0f} s in all.",
        "",
        "Ratios are specfx's tokens/s over the peer's on the same prompts (> 1: specfx is faster); "
        "averages are means over categories; HF's speculative methods run at batch 1 only (n/a above). "
        "'time vs HF generate()' is HF's seconds over specfx's on the same prompts: with sampling the "
        "methods emit different samples (rows stop at different lengths), so at batch > 1, where a batch "
        "runs until its longest row ends, read tokens/s ratios with it.",
        "",
    ]
    for mode, by_batch in runs.items():
        for batch, cfg in by_batch.items():
            results, summary = cfg["methods"], cfg["summary"]
            extra = f", temperature {args.temperature}, seeded" if mode == "sample" else ""
            lines += [f"## {mode}{extra}, batch {batch}", ""]
            for name in summary:
                lines += config_table(results, summary, name)
            for name, r in results.items():
                if r["status"] != "ok":
                    lines.append(f"- {name}: not run ({r['reason'][:200]})")
                elif r.get("graphs_compiled_while_timed"):
                    lines.append(
                        f"- {name}: compiled {r['graphs_compiled_while_timed']} graph(s) during the timed runs"
                    )
                elif not name.startswith("specfx") and name != BASELINE:
                    differs = [c for c, res in r["categories"].items() if res.get("same_tokens_as_hf_dynamic") is False]
                    if differs:
                        lines.append(f"- {name} (an HF peer) differs from HF generate() on {', '.join(differs)}")
            lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plot
def suite_plot(path: Path, runs: dict) -> Path | None:
    """Per-category bars of each specfx method's ratio to HF generate() (and, at batch 1, to HF's
    best speculative option), one panel per mode and batch size. Returns ``path``, or None (and
    logs how to install it) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        from specfx.bench.harness import log
        from specfx.bench.plot import PLOT_INSTALL_HINT

        log(f"no plot written: {PLOT_INSTALL_HINT}")
        return None

    panels = [(mode, batch, cfg["summary"]) for mode, by_batch in runs.items() for batch, cfg in by_batch.items()]
    fig = Figure(figsize=(12, 3.6 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (mode, batch, summary) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        bars = [
            (f"{name} vs {LABELS[BASELINE] if col == 'vs_hf_dynamic' else 'HF best'}", s, col)
            for name, s in summary.items()
            for col in ("vs_hf_dynamic", "vs_hf_best")
            if any(row[col] is not None for row in s["categories"].values())
        ]
        categories = list(next(iter(summary.values()))["categories"]) if summary else []
        width = 0.8 / max(len(bars), 1)
        for j, (label, s, col) in enumerate(bars):
            values = [s["categories"][c][col] or 0.0 for c in categories] + [s["average"][col] or 0.0]
            ax.bar([x + j * width for x in range(len(values))], values, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(bars) - 1) / 2 for x in range(len(categories) + 1)], [*categories, "average"])
        ax.set(ylabel="tokens/s ratio", title=f"{mode}, batch {batch}")
        ax.grid(axis="y", alpha=0.3)
        if bars:
            ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
