"""The tables ``specfx bench`` (:mod:`specfx.bench.tasks.default`) prints: every method's
tokens/s and speedup per batch size, and the named drafters' table."""

from __future__ import annotations

__all__ = ["drafters_table", "markdown_table"]


def drafters_table(runs: dict, names: list[str]) -> str:
    """α / τ per drafter (rows) and K or tree (columns), per batch size: the eager runs, the
    compiled ones where the eager runs were skipped (greedy: the same tokens either way)."""
    lines = []
    for batch, results in runs.items():
        labels: list[str] = []
        kind = "eager" if any(n.startswith("specfx_eager[") for n in results) else "compiled"
        for name in results:
            if name.startswith(f"specfx_{kind}[") and name.partition("@")[2] not in labels:
                labels.append(name.partition("@")[2])
        lines += [
            f"Drafters side by side, batch {batch} (α accepted/proposed, τ tokens per round; {kind}):",
            "",
            "| drafter | " + " | ".join(f"K = {k}" if k.isdigit() else k for k in labels) + " |",
            "|---|" + "---:|" * len(labels),
        ]
        for d in names:
            cells = []
            for label in labels:
                r = results.get(f"specfx_{kind}[{d}]@{label}")
                st = r.get("stats") if r and r["status"] == "ok" else None
                ok = r is not None and r.get("same_tokens_as_hf_dynamic", True)
                cells.append(
                    "not run"
                    if st is None
                    else f"α {st['acceptance_rate']:.3f}, τ {st['tokens_per_round']:.2f}"
                    + ("" if ok else " **NOT EQUAL**")
                )
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def markdown_table(runs: dict) -> str:
    lines = [
        "| batch | method | tokens/s | vs hf_dynamic | vs hf_static_compiled | α | τ | same tokens as HF |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    autos = []
    for batch, results in runs.items():
        best = results.get("hf_static_compiled", {})
        for name, r in results.items():
            if r["status"] != "ok":
                lines.append(f"| {batch} | {name} | not run: {r['reason'][:80]} | | | | | |")
                continue
            st = r.get("stats")
            a, t = (f"{st['acceptance_rate']:.3f}", f"{st['tokens_per_round']:.2f}") if st else ("", "")
            same = {True: "yes", False: "**NO**", None: ""}[r.get("same_tokens_as_hf_dynamic")]
            vs = f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}×" if best.get("status") == "ok" else ""
            lines.append(
                f"| {batch} | {name} | {r['tokens_per_s']:.1f} | {r.get('speedup_vs_hf_dynamic', float('nan')):.2f}× "
                f"| {vs} | {a} | {t} | {same} |"
            )
            if "auto_k" in r:
                autos.append((batch, name, r["auto_k"]))
    if autos:
        lines += ["", "`auto`: sync windows per K in the last call; round times it measured (ms):", ""]
        for batch, name, info in autos:
            times = ", ".join(f"K={k}: {t:.2f}" for k, t in info["round_times_ms"].items())
            lines.append(f"- batch {batch}, {name}: windows {info['windows_per_k']}; times {times}")
    rows = [(b, n, r["round_overhead"]) for b, res in runs.items() for n, r in res.items() if "round_overhead" in r]
    if rows:
        lines += [
            "",
            "Round overhead = round / (K × draft step + verify of K+1 tokens), parts timed separately (ms):",
            "",
            "| batch | method | draft step | verify | K×d+v | round | overhead |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for batch, name, o in rows:
            if "error" in o:
                lines.append(f"| {batch} | {name} | not measured: {o['error'][:80]} | | | | |")
                continue
            lines.append(
                f"| {batch} | {name} | {o['draft_step_ms']:.3f} | {o['verify_ms']:.3f} | {o['parts_ms']:.3f} "
                f"| {o['round_ms']:.3f} | {o['overhead']:.2f}× |"
            )
    return "\n".join(lines) + "\n"
