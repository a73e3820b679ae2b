"""Tables and files of the GPU benchmark (:mod:`specfx.bench.tasks.gpu`): a markdown table of the ratios side
by side, one line of floors and measured forward times per combination, and the JSON of
everything measured."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import torch
import transformers

import specfx
from specfx.bench.oracle import expected_acceptance

__all__ = ["fmt", "table", "floor_lines", "profile_lines", "auto_lines", "meta_info", "write", "print_summary"]

AUTO_FLOOR = 0.95  # issue 30: "auto" never below 0.95x HF static + compile


def fmt(x, spec: str, na: str = "-") -> str:
    """``format(x, spec)``, or ``na`` for a missing or NaN value."""
    return na if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(combos: list[dict], args) -> str:
    hdr = "| pair | B | ctx | method | tok/s | vs HF static+compile | α | τ | round overhead | of floor | same tokens | warm-up s |"
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for c in combos:
        ov = c.get("round_overhead", {})
        for name, r in c["methods"].items():
            cells = [c["pair"], str(c["batch"]), str(c["context"]), name]
            if r.get("status") != "ok":
                cells += [f"{r.get('status')}: {r.get('reason', '')[:60]}"] + [""] * 7
            else:
                st = r.get("spec_stats", {})
                family = "specfx_oracle" if name.startswith("specfx_oracle_") else name
                same = r.get("same_tokens_as_hf_dynamic")
                mism = r.get("first_mismatch_per_row", [])
                same_txt = (
                    "-" if same is None else ("yes" if same else f"{sum(m is None for m in mism)}/{len(mism)} rows")
                )
                cells += [
                    fmt(r["tokens_per_s"], ".1f"),
                    fmt(r.get("speedup_vs_hf_static_compiled"), ".2f")
                    + ("x" if "speedup_vs_hf_static_compiled" in r else ""),
                    fmt(st.get("acceptance_rate"), ".3f"),
                    fmt(st.get("tau"), ".2f"),
                    fmt(ov.get(f"overhead[{family}]"), ".2f"),
                    fmt(r.get("fraction_of_floor"), ".2f"),
                    same_txt,
                    fmt(r.get("warmup_s"), ".0f"),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_lines(combos: list[dict]) -> str:
    out = []
    for c in combos:
        f, ov = c["floor"], c.get("round_overhead", {})
        rf = ", ".join(f"{m.removeprefix('specfx_')} {v:.3f}" for m, v in f["round_floor_ms"].items())
        parts = ""
        if "verify_ms" in ov:
            parts = (
                f"; measured: verify {ov['verify_ms']:.3f} ms ({ov['verify_fraction_of_bandwidth']:.2f} of copy bandwidth)"
                + (f", target step {ov['target_step_ms']:.3f} ms" if "target_step_ms" in ov else "")
                + (f", draft step {ov['draft_step_ms']:.3f} ms" if "draft_step_ms" in ov else "")
                + "".join(
                    f", round[{m.removeprefix('round_ms[')} {v:.3f} ms"
                    for m, v in ov.items()
                    if m.startswith("round_ms[")
                )
            )
        out.append(
            f"{c['pair']} B={c['batch']} ctx={c['context']}: floor at ctx {f['context_mean']}: decode step "
            f"{f['decode_floor_ms']:.3f} ms, round ({rf}) ms{parts}"
        )
    return "\n".join(out)


def profile_lines(combos: list[dict]) -> str:
    """One line per profiled call: the device's busy fraction in the decode loop and its gaps."""
    out = []
    for c in combos:
        for name, p in c.get("profile", {}).items():
            if name.endswith("|error"):
                out.append(f"{c['pair']} B={c['batch']} ctx={c['context']} {name}: {p[:200]}")
                continue
            out.append(
                f"{c['pair']} B={c['batch']} ctx={c['context']} {name}: device busy {fmt(p.get('busy_fraction'), '.3f')} "
                f"of the decode loop ({fmt(p.get('span_ms'), '.1f')} ms, idle {fmt(p.get('idle_ms'), '.2f')} ms, "
                f"{p.get('gaps_over_20us', '-')} gaps > 20 us, largest {p.get('largest_gaps_us', '-')} us); "
                f"{p['graph_launches']} CUDA-graph launches / {p['rounds']} rounds; "
                f"{fmt(p.get('span_ms_per_round'), '.3f')} ms per round; call {p['wall_ms']:.1f} ms"
            )
    return "\n".join(out)


def auto_lines(combos: list[dict]) -> str:
    """One line per "auto" row: the Ks its last call ran (sync windows), the round times it chose
    from, and its ratio to HF static + compile against the issue's bound."""
    out = []
    for c in combos:
        for name, r in c["methods"].items():
            auto = r.get("spec_stats", {}).get("auto_k")
            if auto is None:
                continue
            ratio = r.get("speedup_vs_hf_static_compiled")
            verdict = "" if ratio is None else f" ({'>=' if ratio >= AUTO_FLOOR else 'BELOW'} {AUTO_FLOOR})"
            times = ", ".join(f"{k}: {t:.3f}" for k, t in auto["round_times_ms"].items())
            out.append(
                f"{c['pair']} B={c['batch']} ctx={c['context']} {name}: K windows {auto['windows_per_k']}, "
                f"round ms {{{times}}}; {fmt(ratio, '.3f')}x HF static+compile{verdict}"
            )
    return "\n".join(out)


def meta_info(args, bandwidth) -> dict:
    dev = torch.device(args.device)
    return dict(
        torch=torch.__version__,
        transformers=transformers.__version__,
        specfx=specfx.__version__,
        python=platform.python_version(),
        device=str(dev),
        gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        copy_bandwidth=bandwidth,
        assumed=args.assumed,
        inductor_options=getattr(args, "inductor_options", None) or {},
        command=args.command,
    )


def write(args, meta, combos, skipped) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = dict(config=config, meta=meta, combos=combos, skipped=skipped)
    (args.out_dir / f"bench_{args.tag}.json").write_text(json.dumps(data, indent=2, default=str))
    opts = meta.get("inductor_options") or "defaults"
    md = [
        f"# bench_gpu ({meta['gpu'] or meta['device']}, {args.dtype}, K={args.k}, {args.new_tokens} new tokens, "
        f"Inductor options: {opts})",
        "",
    ]
    md += [table(combos, args), "", "```", floor_lines(combos), profile_lines(combos), auto_lines(combos), "```"]
    if skipped:
        md += ["", "Skipped (budget): " + ", ".join(skipped)]
    (args.out_dir / f"bench_{args.tag}.md").write_text("\n".join(md) + "\n")


def print_summary(args, meta: dict, combos: list[dict], skipped: list[str], predicted_total: float) -> None:
    """The table, the floors and the oracle's measured against expected acceptance, on stdout."""
    bandwidth = meta["copy_bandwidth"]
    print()
    print(f"bench_gpu: {meta['gpu'] or meta['device']}, {args.dtype}, K={args.k}, {args.new_tokens} new tokens per row, "
          f"medians of {args.repeats}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; torch {meta['torch']}, "
          f"transformers {meta['transformers']}")  # fmt: skip
    print(table(combos, args))
    print(floor_lines(combos))
    if any(c.get("profile") for c in combos):
        print(profile_lines(combos))
    if auto_lines(combos):
        print(auto_lines(combos))
    for c in combos:
        for name, r in c["methods"].items():
            if name.startswith("specfx_oracle_") and "spec_stats" in r:
                alpha = float(name.rsplit("_", 1)[1])
                rate, tau = expected_acceptance(alpha, args.k)
                print(f"{c['pair']} B={c['batch']} ctx={c['context']} {name}: acceptance {r['spec_stats']['acceptance_rate']:.3f} "
                      f"(expected {rate:.3f}), tau {r['spec_stats']['tau']:.2f} (expected {tau:.2f} before end truncation)")  # fmt: skip
    if skipped:
        print("skipped (budget): " + ", ".join(skipped))
    print(
        f"total {meta['wall_s']:.0f} s (predicted {predicted_total:.0f} s); results in {args.out_dir}/bench_{args.tag}.json/.md"
    )
