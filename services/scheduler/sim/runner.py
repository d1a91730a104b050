"""Runs the three policies on one sampled workload and gathers the report (JSON-ready dict)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.scheduler.policies import POLICY_NAMES, make_policy
from services.scheduler.sim.bounds import lower_bound, rollout_cell_seconds
from services.scheduler.sim.engine import SimOptions, Simulation, session_reserve_tokens
from services.scheduler.sim.presets import get_preset
from services.scheduler.sim.workload import HOUR, Preset, sample_workload, workload_stats


def async_rollout_cells(preset: Preset, seed: int) -> int:
    """Async's fixed rollout pool, sized to the expected share of rollout work at the admission fill.

    A fixed split is only fair if it matches the average demand; this is the split an operator
    would pick from the same workload statistics the presets are built from. Under drift it is sized at the
    start (from the workload without drift: what the operator sees when the run begins) and kept.
    """
    if preset.async_rollout_share is not None:
        share = preset.async_rollout_share
    else:
        start = preset.scaled(drift_per_step=0.0)
        w = sample_workload(start, seed + 7_919, n_queries=min(2_000, preset.steps * preset.batch_queries))
        roll = rollout_cell_seconds(preset, w, preset.fill)
        train = float(w.context_tokens.sum()) / preset.train_tokens_per_cell_s
        share = roll / (roll + train)
    # The pool must hold at least one query's group: a query is dispatched whole. Slots per cell are
    # counted as admission counts them (the engine's reserve against Room.limit, in KV tokens).
    limit = int(preset.kv_capacity_tokens * preset.fill)
    per_cell = max(1, limit // session_reserve_tokens(preset))
    smallest = math.ceil(preset.group_size / per_cell)
    return min(preset.cells - 1, max(smallest, round(share * preset.cells)))


def simulate_policy(
    preset: Preset, seed: int, policy_name: str, options: SimOptions | None = None, rollout_cells: int | None = None
) -> tuple[Simulation, dict[str, Any]]:
    """Run one policy; return the finished simulation and its metrics."""
    w = sample_workload(preset, seed)
    if policy_name == "async" and rollout_cells is None:
        rollout_cells = async_rollout_cells(preset, seed)
    policy = make_policy(
        policy_name,
        budget_cells=preset.cells,
        rollout_cells=rollout_cells,
        fill=preset.fill,
        colocate_run_ahead=preset.colocate_run_ahead,
    )
    sim = Simulation(preset, w, policy, options)
    started = time.perf_counter()
    end_s = sim.run()
    return sim, metrics(sim, end_s, time.perf_counter() - started, rollout_cells)


def metrics(sim: Simulation, end_s: float, wall_s: float, rollout_cells: int | None) -> dict[str, Any]:
    total = sum(sim.area.values())
    share = {k: (v / total if total else 0.0) for k, v in sim.area.items()}
    rollout_time = sim.area["rollout_busy"] + sim.area["rollout_empty"]
    train_time = sim.area["train_busy"] + sim.area["train_waiting"]
    stale = sim.staleness
    return {
        "policy": sim.policy.name,
        "end_to_end_h": end_s / HOUR,
        "step_times_h": [t / HOUR for t in sim.step_times],
        "cell_hours": {k: v / HOUR for k, v in sim.area.items()},
        "share_of_cell_time": share,
        "utilisation": {
            "rollout_busy_share": sim.area["rollout_busy"] / rollout_time if rollout_time else 0.0,
            "train_busy_share": sim.area["train_busy"] / train_time if train_time else 0.0,
            "busy_share": (sim.area["rollout_busy"] + sim.area["train_busy"]) / total if total else 0.0,
        },
        "idle_cell_h": {
            "rollout": sim.area["rollout_empty"] / HOUR,
            "train": sim.area["train_waiting"] / HOUR,
            "unassigned": sim.area["idle"] / HOUR,
        },
        "switches": sim.switches,
        "switch_cost_cell_h": sim.switch_cell_s / HOUR,
        "migrations": sim.migrations,
        "migrated_gb": sim.migrated_bytes / 1e9,
        "migration_session_h": sim.migration_s / HOUR,
        "recomputes": sim.recomputes,  # of the migrations: moves by abort and prefill again
        "recomputed_m_tokens": sim.recomputed_tokens / 1e6,
        "prefill_stall_cell_h": sim.prefill_stall_cell_s / HOUR,
        "sample_wait_s": sim.sample_wait_s / sim.samples_waited if sim.samples_waited else 0.0,
        "staleness": {
            "bound": sim.p.max_staleness,
            "mean": sum(stale) / len(stale) if stale else 0.0,
            "max": max(stale) if stale else 0,
        },
        "peak_kv_fill": sim.peak_fill,
        "budget_cuts": sim.budget_cuts,  # executions a wall-clock budget ended early (0 under a work budget)
        "trained_tokens_m": sim.trained_tokens / 1e6,
        "decisions": sim.decisions,
        "async_rollout_cells": rollout_cells,
        "colocate_run_ahead": sim.p.colocate_run_ahead if sim.policy.name == "colocate" else None,
        "sim_wall_s": wall_s,
    }


def kv_share(runs: dict[str, dict[str, Any]]) -> float:
    """How much of elastic's lead over the peer policy comes from moving KV rather than prefilling again.

    elastic-recompute makes elastic's decisions but moves sessions as the peer does, so elastic → elastic-recompute
    is what recomputing costs and elastic-recompute → reprefill what the peer's switching gate costs (or saves, when
    negative); the share is the first over the whole gap (nan when there is no gap).
    """
    elastic = runs["elastic"]["end_to_end_h"]
    gap = runs["reprefill"]["end_to_end_h"] - elastic
    return (runs["elastic-recompute"]["end_to_end_h"] - elastic) / gap if abs(gap) > 1e-9 else math.nan


def run_sim(
    preset: str | Preset,
    steps: int | None = None,
    seed: int = 0,
    out_dir: Path | None = None,
    *,
    policies: tuple[str, ...] = POLICY_NAMES,
    plots: bool = True,
    options: SimOptions | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Simulate `policies` on a preset (optionally with fewer steps or other overrides); write the report.

    Returns the report dict; with `out_dir`, also writes `report_<preset>.json` and, with `plots`,
    `timeline_<preset>.png` (per-cell roles of every policy) there.
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    if steps is not None:
        overrides["steps"] = steps
    if overrides:
        p = p.scaled(**overrides)
    opts = options or SimOptions(record_timeline=plots and out_dir is not None)
    started = time.perf_counter()
    w = sample_workload(p, seed)
    lb = lower_bound(p, w, opts)
    runs: dict[str, dict[str, Any]] = {}
    sims: dict[str, Simulation] = {}
    for name in policies:
        sim, m = simulate_policy(p, seed, name, opts)
        m["distance_to_lower_bound"] = m["end_to_end_h"] / lb.hours - 1.0
        runs[name] = m
        sims[name] = sim
    speedups: dict[str, float] = {}
    if "elastic" in runs:
        for other in ("async", "colocate", "reprefill", "elastic-recompute"):
            if other in runs:
                key = f"elastic_vs_{other}".replace("-", "_")
                speedups[key] = runs[other]["end_to_end_h"] / runs["elastic"]["end_to_end_h"]
        if "reprefill" in runs and "elastic-recompute" in runs:
            speedups["kv_share_of_reprefill_gap"] = kv_share(runs)
    report: dict[str, Any] = {
        "preset": p.name,
        "seed": seed,
        "parameters": {k: v for k, v in asdict(p).items() if k != "sweep"},
        "workload": workload_stats(p, w),
        "lower_bound": asdict(lb),
        "policies": runs,
        "speedups": speedups,
        "wall_s": time.perf_counter() - started,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if plots:
            from services.scheduler.sim.plots import plot_timelines

            plot_timelines(sims, out_dir / f"timeline_{p.name}.png", title=f"{p.name}: cell roles over time")
            report["timeline_png"] = str(out_dir / f"timeline_{p.name}.png")
        (out_dir / f"report_{p.name}.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    return report
