"""`gyre compare`: the same seeded workload under each scheduling mode, one run after the other on the same cells,
budget, staleness bound and steps, then a comparison report (compare.json and images) in runs/<compare id>/.

Each mode is a `gyre run` of its own (its own run id, report and log), started from one warm start: the first run
warm-starts the model and the others start from its result, so every mode trains the same starting policy on the
same tasks with the same seeds. Each run's trees are then replayed and verified (`gyre replay --run --verify`).
With `--simulate` the simulator, calibrated on one of the runs' own events, predicts each mode's wall-clock
(services/scheduler/sim/calibrate.py) and the report puts prediction and measurement side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from gyre.compare_report import comparison, mode_summary, summary_lines, write_images
from gyre.config import ConfigError, load_config, parse_sets

console = Console()
MODES = ("async", "colocate", "elastic", "reprefill")
DEFAULT_CONFIG = Path("configs/long-horizon.yaml")


def compare(
    config_file: Annotated[Path, typer.Option("--config", help="The run config every mode runs.")] = DEFAULT_CONFIG,
    modes: Annotated[str, typer.Option(help="Comma-separated modes, run in this order.")] = ",".join(MODES),
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a setting for every mode: "
                                                   "section.key=value; repeatable.")] = None,
    steps: Annotated[int | None, typer.Option(help="scheduling.steps for every mode.")] = None,
    warm_start_dir: Annotated[Path | None, typer.Option(
        "--warm-start", help="An already warm-started model for every mode (default: the first run makes one).")]
    = None,
    simulate: Annotated[bool, typer.Option(help="Calibrate the simulator on a run's events and predict each mode.")]
    = True,
    verify: Annotated[bool, typer.Option(help="Replay and verify each run's trees after it.")] = True,
    rebuild: Annotated[str | None, typer.Option(
        help="Run nothing: rebuild this comparison's report (runs/<compare id>/) from its runs' reports and logs.")]
    = None,
) -> None:
    """Run the same workload under each mode, one after the other, and write the comparison report."""
    if rebuild is not None:
        _rebuild(rebuild, Path(load_config(config_file)[0].logging.runs_dir), simulate=simulate)
        return
    names = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    overrides = dict(parse_sets(sets or []))
    if steps is not None:
        overrides["scheduling.steps"] = str(steps)
    try:
        if unknown or not names:
            raise ConfigError(f"--modes: expected some of {list(MODES)}, got {names}")
        if len(set(names)) != len(names):
            raise ConfigError(f"--modes: each mode once, got {names}")
        config, _ = load_config(config_file, overrides=overrides)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            console.print(f"[red]error:[/] {line}", highlight=False, markup=False)
        raise typer.Exit(2) from exc
    compare_id = "compare-" + uuid.uuid4().hex[:10]
    runs_dir = Path(config.logging.runs_dir)
    out = runs_dir / compare_id
    out.mkdir(parents=True, exist_ok=True)
    s = config.scheduling
    console.print(f"[bold]{compare_id}[/]: {', '.join(names)} on {s.cells} cells, {s.steps} steps of "
                  f"{s.queries_per_step} × G={s.group_size}, staleness {s.max_staleness} — {config_file}")
    summaries: dict[str, dict[str, Any]] = {}
    run_ids: dict[str, str] = {}
    warm = warm_start_dir
    started = time.monotonic()
    for mode in names:
        run_id = f"{compare_id}-{mode}"
        run_ids[mode] = run_id
        argv = [sys.executable, "-m", "gyre.cli", "run", "--config", str(config_file), "--mode", mode,
                "--run-id", run_id, *(f"--set={k}={v}" for k, v in overrides.items())]
        if warm is not None:
            argv += ["--warm-start", str(warm)]
        console.print(f"[bold]{mode}[/]: gyre run → {runs_dir / run_id} (log {out / (mode + '.log')})")
        t0 = time.monotonic()
        with open(out / f"{mode}.log", "wb") as log:
            code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
        report_path = runs_dir / run_id / "report.json"
        if code != 0 or not report_path.is_file():
            console.print(f"[red]{mode}: the run failed (exit {code}); see {out / (mode + '.log')}[/]")
            raise typer.Exit(1)
        if warm is None:
            warm = Path(json.loads((runs_dir / run_id / "run.json").read_text())["model_dir"])
        summaries[mode] = mode_summary(mode, run_id, json.loads(report_path.read_text()))
        if verify:
            summaries[mode]["replay_verified"] = _verify(run_id, out / f"{mode}-replay.log")
        console.print(f"  {summaries[mode]['wall_s']:.0f} s for {summaries[mode]['steps']} steps "
                      f"(run {time.monotonic() - t0:.0f} s in all)"
                      + ("" if not verify else
                         f"; replay {'verified' if summaries[mode]['replay_verified'] else 'DIVERGED'}"))
    workload = {"config": str(config_file), "overrides": overrides, "cells": s.cells, "steps": s.steps,
                "queries_per_step": s.queries_per_step, "group_size": s.group_size,
                "max_staleness": s.max_staleness, "pin_cells": s.pin_cells, "seed": config.seed,
                "warm_start_model": str(warm) if warm else None, "compare_s": round(time.monotonic() - started, 1)}
    result = comparison(summaries, workload=workload)
    (out / "compare.json").write_text(json.dumps(result, indent=2))  # `--rebuild` works even if the fit fails
    if simulate:
        result["simulator"] = predict_modes(result, runs_dir, run_ids)
        (out / "compare.json").write_text(json.dumps(result, indent=2))
    images = write_images(result, out)
    for line in summary_lines(result):
        console.print(line, highlight=False)
    console.print(f"report: {out / 'compare.json'}, " + ", ".join(str(p) for p in images))


def _rebuild(compare_id: str, runs_dir: Path, *, simulate: bool) -> None:
    out = runs_dir / compare_id
    path = out / "compare.json"
    if not path.is_file():
        console.print(f"[red]error:[/] no {path}: --rebuild takes the id of a comparison that ran", markup=False)
        raise typer.Exit(2)
    old = json.loads(path.read_text())
    summaries: dict[str, dict[str, Any]] = {}
    run_ids: dict[str, str] = {}
    for mode, m in old["modes"].items():
        run_ids[mode] = m["run_id"]
        report = json.loads((runs_dir / m["run_id"] / "report.json").read_text())
        summaries[mode] = mode_summary(mode, m["run_id"], report)
        if "replay_verified" in m:
            summaries[mode]["replay_verified"] = m["replay_verified"]
    result = comparison(summaries, workload=old["workload"])
    if simulate:
        result["simulator"] = predict_modes(result, runs_dir, run_ids)
    path.write_text(json.dumps(result, indent=2))
    images = write_images(result, out)
    for line in summary_lines(result):
        console.print(line, highlight=False)
    console.print(f"report: {path}, " + ", ".join(str(p) for p in images))


def predict_modes(result: dict[str, Any], runs_dir: Path, run_ids: dict[str, str],
                  calibrate_on: str | None = None) -> dict[str, Any]:
    """Fit on one mode's run (elastic's by default, else the first), predict every mode, and set `sim_wall_s`
    beside each mode's `wall_s` in `result`; returns what was fitted and the errors."""
    import asyncio

    import yaml

    from gyre import local
    from services.scheduler.sim.calibrate import fit, load_run_events, simulate_modes
    from shared.settings import load_settings

    modes = list(result["modes"])
    # The elastic run moves cells and sessions: it measures switches and migrations, which async's does not.
    source = calibrate_on or ("elastic" if "elastic" in modes else modes[0])
    run_id = run_ids[source]
    config = yaml.safe_load((runs_dir / run_id / "config.yaml").read_text())
    # The runs' log: on the configured servers, or on the embedded ones the first `gyre run` brought up (after
    # this command started, so not in its settings).
    settings = load_settings()
    _, database_url = local.configured_or_running(settings.nats_url, settings.database_url, settings.state_dir)
    events = asyncio.run(load_run_events(run_id, database_url))
    steps = max(m["steps"] for m in result["modes"].values())
    cal, trace = fit(run_id, events, group_size=config["scheduling"]["group_size"])
    predicted = simulate_modes(cal, trace, config, modes, steps=steps)
    errors = {}
    for mode, m in result["modes"].items():
        m["sim_wall_s"] = predicted[mode]
        if m["wall_s"] > 0:
            errors[mode] = round(predicted[mode] / m["wall_s"] - 1.0, 4)
    return {"calibrated_on": source, "fitted": asdict(cal), "sim_wall_s": predicted, "relative_error": errors,
            "within_15_percent": all(abs(e) <= 0.15 for e in errors.values())}


def _verify(run_id: str, log_path: Path) -> bool:
    with open(log_path, "wb") as log:
        code = subprocess.call([sys.executable, "-m", "gyre.cli", "replay", "--run", run_id, "--verify", "-q"],
                               stdout=log, stderr=subprocess.STDOUT)
    return code == 0


compare_app = compare
