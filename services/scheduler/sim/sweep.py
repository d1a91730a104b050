"""Speedup sweeps: elastic over async and colocate against tail heaviness and against cluster size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.scheduler.sim.engine import SimOptions
from services.scheduler.sim.presets import get_preset
from services.scheduler.sim.runner import run_sim
from services.scheduler.sim.workload import Preset


SWEEP_STEPS = 12  # steps a sweep point runs unless told otherwise: enough for the pipeline to fill


def run_sweep(
    preset: str | Preset,
    *,
    steps: int | None = SWEEP_STEPS,
    seed: int = 0,
    budgets: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5),
    sizes: tuple[float, ...] = (0.5, 1.0, 2.0),
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Vary the tail and the cluster size; report elastic's speedups.

    Tail heaviness is varied through the agent's time budget (`timeout_h` × each of `budgets`):
    a batch of hundreds of executions always has some that run into the budget, so the budget,
    not the spread of the bulk, sets how long the slowest execution of a step runs. Cluster size
    scales cells and batch together, so the load per cell stays put.
    """
    base = get_preset(preset) if isinstance(preset, str) else preset
    opts = SimOptions(record_timeline=False, validate=False)
    rows_tail: list[dict[str, Any]] = []
    for f in budgets:
        budget = base.timeout_h * f
        r = run_sim(base, steps, seed, None, plots=False, options=opts, timeout_h=budget)
        rows_tail.append({"x": budget, "label": "agent time budget, h (how long the tail may run)", **r["speedups"]})
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
        plot_sweep(sweep, out_dir / f"sweep_{base.name}.png")
    return sweep


DRIFT_RATES = (0.0, 0.02, 0.05, 0.1)  # per step: 0.05 doubles an execution's work in ~14 steps


def run_drift_sweep(
    preset: str | Preset, *, rates: tuple[float, ...] = DRIFT_RATES, steps: int | None = SWEEP_STEPS, seed: int = 0,
) -> list[dict[str, Any]]:
    """Each drift rate on one preset: every mode's end-to-end hours and elastic's speedups. Async's split is
    sized at the start (from the workload without drift) and kept; colocate and elastic see the drift as it
    comes. Nothing is tuned to any published figure."""
    base = get_preset(preset) if isinstance(preset, str) else preset
    opts = SimOptions(record_timeline=False, validate=False)
    rows: list[dict[str, Any]] = []
    for rate in rates:
        r = run_sim(base, steps, seed, None, plots=False, options=opts, drift_per_step=rate)
        hours = {k: v["end_to_end_h"] for k, v in r["policies"].items()}
        rows.append({"drift_per_step": rate, "hours": hours, "lower_bound_h": r["lower_bound"]["hours"],
                     "async_rollout_cells": r["policies"].get("async", {}).get("async_rollout_cells"),
                     **r["speedups"]})
    return rows
