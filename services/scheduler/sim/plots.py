"""Report images: per-cell role timelines and the speedup sweep (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

if TYPE_CHECKING:
    from services.scheduler.sim.engine import Simulation

COLOURS = {"rollout": "#2b8cbe", "train": "#e6550d", "switching": "#222222", "idle": "#dddddd"}


def plot_timelines(sims: dict[str, Simulation], path: Path, *, title: str, max_cells: int = 128) -> None:
    """One panel per policy: a row per cell, coloured by role over time (hours)."""
    fig, axes = plt.subplots(len(sims), 1, figsize=(12, 2.6 * len(sims)), sharex=True, squeeze=False)
    end = max(s.t for s in sims.values()) / 3600.0
    for ax, (name, sim) in zip(axes[:, 0], sims.items()):
        cells = sim.cells[:max_cells]
        for row, cell in enumerate(cells):
            for label in COLOURS:
                bars = [(a / 3600.0, (b - a) / 3600.0) for a, b, lab in cell.segments if lab == label]
                if bars:
                    ax.broken_barh(bars, (row, 0.9), facecolors=COLOURS[label], linewidth=0)
        for t in sim.step_times:
            ax.axvline(t / 3600.0, color="#00000022", linewidth=0.5)
        ax.set_ylim(0, len(cells))
        ax.set_xlim(0, end)
        ax.set_ylabel(f"{name}\ncells")
        ax.set_title(f"{name}: {sim.t / 3600.0:.1f} h for {len(sim.step_times)} steps", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("hours")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="upper right", ncol=4, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    """Speedup of elastic over async and colocate against tail heaviness and against cluster size."""
    panels = [(k, v) for k, v in sweep.items() if v]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (axis, rows) in zip(axes[0], panels):
        xs = [r["x"] for r in rows]
        ax.plot(xs, [r["elastic_vs_async"] for r in rows], "o-", label="elastic / async")
        ax.plot(xs, [r["elastic_vs_colocate"] for r in rows], "s-", label="elastic / colocate")
        ax.axhspan(1.38, 1.78, color="#2b8cbe22", label="published vs async")
        ax.axhspan(1.21, 1.85, color="#e6550d11", label="published vs colocate")
        ax.axhline(1.0, color="#888888", linewidth=0.8)
        ax.set_xlabel(rows[0]["label"])
        ax.set_ylabel("speedup (x)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
