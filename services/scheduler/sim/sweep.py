"""Speedup sweeps: elastic over async and colocate against tail heaviness and against cluster size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.scheduler.sim.engine import SimOptions
from services.scheduler.sim.presets import get_preset
from services.scheduler.sim.runner import run_sim


def run_sweep(
    preset: str,
    *,
    steps: int | None = 12,
    seed: int = 0,
    tails: tuple[float, ...] = (0.15, 0.26, 0.4, 0.55),
    sizes: tuple[float, ...] = (0.5, 1.0, 2.0),
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Vary the within-query spread (`sample_log_sd`, the tail a step waits for) and the cluster size
    (cells and batch scaled together, so the load per cell stays put); report the speedups."""
    base = get_preset(preset)
    opts = SimOptions(record_timeline=False, validate=False)
    rows_tail: list[dict[str, Any]] = []
    for sd in tails:
        r = run_sim(base, steps, seed, None, plots=False, options=opts, sample_log_sd=sd)
        rows_tail.append({"x": sd, "label": "per-sample log-sd of duration (tail heaviness)", **r["speedups"]})
    rows_size: list[dict[str, Any]] = []
    for f in sizes:
        cells = max(4, round(base.cells * f))
        batch = max(1, round(base.batch_queries * f))
        r = run_sim(base, steps, seed, None, plots=False, options=opts, cells=cells, batch_queries=batch)
        rows_size.append({"x": cells, "label": "cells (batch scaled with them)", **r["speedups"]})
    sweep = {"tail": rows_tail, "cluster_size": rows_size}
    if out_dir is not None:
        from services.scheduler.sim.plots import plot_sweep

        out_dir.mkdir(parents=True, exist_ok=True)
        plot_sweep(sweep, out_dir / f"sweep_{preset}.png")
    return sweep
