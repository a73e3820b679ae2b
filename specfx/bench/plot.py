"""The PNG plots of ``specfx demo`` and ``specfx bench``; needs matplotlib (``pip install "specfx[plot]"``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["acceptance_plot", "PLOT_INSTALL_HINT"]

PLOT_INSTALL_HINT = 'plots need matplotlib, an optional extra: pip install "specfx[plot]" (or pip install matplotlib)'


def acceptance_plot(path: Path, per_position: dict, speeds: dict, speed_title: str, x_label: str = "") -> Path | None:
    """Two panels: acceptance rate by proposal position (one line per label) and speed bars
    (``speeds``: label -> tokens/s, or label -> {x: tokens/s} for lines over ``x_label``).
    Returns ``path``, or None (and logs how to install it) when matplotlib is missing: a
    benchmark's numbers are worth keeping without their picture."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        from specfx.bench.harness import log

        log(f"no plot written: {PLOT_INSTALL_HINT}")
        return None

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    for label, rates in per_position.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax.set(xlabel="proposal position", ylabel="acceptance rate", ylim=(0, 1.02), title="Acceptance by position")
    ax.set_xticks(range(1, max((len(r) for r in per_position.values()), default=1) + 1))
    ax.grid(alpha=0.3)
    if per_position:
        ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    if speeds and all(isinstance(v, dict) for v in speeds.values()):
        for label, series in speeds.items():
            xs = sorted(series)
            ax.plot(xs, [series[x] for x in xs], marker="o", label=label)
        ax.set(xlabel=x_label, ylabel="tokens/s")
        ax.legend(fontsize=8)
    else:
        names = list(speeds)
        ax.barh(names, [speeds[n] for n in names], color="tab:blue")
        ax.invert_yaxis()
        ax.set(xlabel="tokens/s")
    ax.set(title=speed_title)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
