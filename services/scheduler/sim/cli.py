"""`gyre sim`: run the policies on a preset and write the report (JSON and images)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from services.scheduler.policies import PEER_POLICY_NAMES, POLICY_NAMES
from services.scheduler.sim.presets import get_preset, preset_names
from services.scheduler.sim.runner import run_sim
from services.scheduler.sim.workload import PresetError

sim_app = typer.Typer(help="Discrete-event cluster simulator driving the scheduler's policies.")


@sim_app.callback(invoke_without_command=True)
def sim(
    preset: str = typer.Option("flagship", help=f"one of {', '.join(preset_names())}"),
    steps: int | None = typer.Option(None, help="optimiser steps (default: the preset's)"),
    seed: int = typer.Option(0, help="workload seed; a seed fixes the whole run"),
    out: Path = typer.Option(Path("sim-out"), help="folder for report_<preset>.json and the images"),
    policies: str = typer.Option(
        ",".join(POLICY_NAMES + PEER_POLICY_NAMES),
        help="comma-separated policies: the three modes, and the peer's (reprefill: verl's step switching, "
             "sessions aborted and prefilled again; elastic-recompute: elastic's decisions, sessions recomputed)"),
    cells: int | None = typer.Option(None, help="override the preset's cell budget"),
    batch_queries: int | None = typer.Option(None, help="override the preset's queries per step"),
    budget: str | None = typer.Option(
        None, help="how the agent's time budget ends an execution: work (nominal hours) or wall_clock (default: work)"
    ),
    sweep: bool = typer.Option(False, help="also sweep tail heaviness and cluster size (--steps steps a point, default 12)"),
    drift: float | None = typer.Option(
        None, help="workload drift: each step's executions (1 + DRIFT)× the step before's difficulty (default 0)"
    ),
    drift_sweep: bool = typer.Option(False, help="also sweep the drift rate (0, 2, 5, 10 %/step; --steps a point)"),
    plots: bool = typer.Option(True, help="write the timeline (and sweep) images"),
    from_run: str | None = typer.Option(
        None, "--from-run", help="calibrate on this live run instead of a preset: fit the engine, cells, training and "
        "workload from its events and predict each live mode's seconds on its workload"),
    runs_dir: Path = typer.Option(Path("runs"), help="where --from-run's run folder (its config.yaml) is"),
) -> None:
    """Simulate the preset under each policy and print the headline numbers as JSON."""
    if from_run is not None:
        _from_run(from_run, runs_dir, out, steps)
        return
    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    overrides: dict[str, Any] = {"cells": cells, "batch_queries": batch_queries, "budget": budget,
                                 "drift_per_step": drift}
    try:
        chosen = get_preset(preset).scaled(**{k: v for k, v in overrides.items() if v is not None})
        report = run_sim(chosen, steps, seed, out, policies=names, plots=plots)
    except PresetError as exc:
        raise typer.BadParameter(str(exc)) from exc
    summary = {
        "preset": report["preset"],
        "hours": {k: round(v["end_to_end_h"], 2) for k, v in report["policies"].items()},
        "lower_bound_h": round(report["lower_bound"]["hours"], 2),
        "speedups": {k: round(v, 3) for k, v in report["speedups"].items()},
        "report": str(out / f"report_{report['preset']}.json"),
    }
    if sweep:
        from services.scheduler.sim.sweep import SWEEP_STEPS, run_sweep

        # The sweep runs `--steps` steps per point when given, else its own default (12).
        result = run_sweep(chosen, steps=steps or SWEEP_STEPS, seed=seed, out_dir=out if plots else None)
        (out / f"sweep_{chosen.name}.json").write_text(json.dumps(result, indent=2))
        summary["sweep"] = str(out / f"sweep_{chosen.name}.json")
    if drift_sweep:
        from services.scheduler.sim.sweep import SWEEP_STEPS, run_drift_sweep

        rows = run_drift_sweep(chosen, steps=steps or SWEEP_STEPS, seed=seed)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"drift_{chosen.name}.json").write_text(json.dumps(rows, indent=2))
        summary["drift"] = [{"drift_per_step": r["drift_per_step"], "elastic_vs_async": round(r["elastic_vs_async"], 3),
                             "elastic_vs_colocate": round(r["elastic_vs_colocate"], 3)} for r in rows]
    typer.echo(json.dumps(summary))


def _from_run(run_id: str, runs_dir: Path, out: Path, steps: int | None) -> None:
    """Fit a preset to the run's log and simulate every live mode on its workload (docs/simulator.md, "Calibration
    against live runs")."""
    import asyncio
    from dataclasses import asdict

    import yaml

    from services.scheduler.sim.calibrate import CalibrationError, fit, load_run_events, simulate_modes

    config_path = runs_dir / run_id / "config.yaml"
    if not config_path.is_file():
        raise typer.BadParameter(f"no {config_path}: --from-run takes a run of `gyre run` (see --runs-dir)")
    config = yaml.safe_load(config_path.read_text())
    try:
        events = asyncio.run(load_run_events(run_id))
        cal, trace = fit(run_id, events, group_size=config["scheduling"]["group_size"])
    except CalibrationError as exc:
        raise typer.BadParameter(str(exc)) from exc
    predicted = simulate_modes(cal, trace, config, ("async", "colocate", "elastic", "reprefill"),
                               steps=steps or config["scheduling"]["steps"])
    result = {"calibrated_on": run_id, "fitted": asdict(cal), "sim_wall_s": predicted}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"calibrated_{run_id}.json").write_text(json.dumps(result, indent=2))
    typer.echo(json.dumps(result))
