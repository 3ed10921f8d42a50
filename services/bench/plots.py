"""PNG plots of a benchmark report (matplotlib, Agg backend: no display needed).

- `speedup.png`: eagle3 ÷ baseline output tok/s against concurrency, one line per
  temperature, with the break-even line at 1.0.
- `acceptance.png`: per-position acceptance (share of drafts whose position i was accepted)
  per temperature.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.store import atomic_path


def _figure():  # noqa: ANN202 - matplotlib types stay out of the signature
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(6, 4), dpi=100)


def _save(plt: Any, fig: Any, out: Path) -> Path:
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out


def plot_speedup(report: dict[str, Any], out: Path) -> Path:
    """Speedup vs concurrency, one line per temperature. Returns `out`."""
    plt, fig, ax = _figure()
    temps = sorted({r["temperature"] for r in report["rows"]})
    for t in temps:
        rows = sorted(
            (r for r in report["rows"] if r["temperature"] == t and r["speedup"]),
            key=lambda r: r["concurrency"],
        )
        ax.plot(
            [r["concurrency"] for r in rows],
            [r["speedup"] for r in rows],
            marker="o",
            label=f"T={t:g}",
        )
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="break-even")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speedup (eagle3 / baseline tok/s)")
    ax.set_title(f"EAGLE-3 speedup: {report.get('run_id', '')}", fontsize=9)
    ax.legend()
    return _save(plt, fig, out)


def plot_acceptance(report: dict[str, Any], out: Path) -> Path:
    """Per-position acceptance per temperature. Returns `out`."""
    plt, fig, ax = _figure()
    for t, rates in report["per_position_rate"].items():
        if rates:
            ax.plot(
                range(1, len(rates) + 1),
                rates,
                marker="o",
                label=f"T={float(t):g}, tau={report['tau'][t]:.2f}",
            )
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title(f"Per-position acceptance: {report.get('run_id', '')}", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return _save(plt, fig, out)
