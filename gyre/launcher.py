"""`gyre run`: the whole RL loop on one machine from one run config (gyre/config.py), each service as its own
process with the same command compose.yaml uses, a live view of the run, and a report at the end.

The launcher only starts processes and reads the event log; the services talk to each other through
NATS and PostgreSQL exactly as they would on separate nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.live import Live
from rich.table import Table

from gyre import local
from gyre.config import ConfigError, RunConfig, dump, environment, load_config, parse_sets
from gyre.run_plan import RunPlan, plan_run
from gyre.report import build_report, summary_lines
from gyre.trackers import Trackers
from gyre.warm_start import warm_start
from gyre.report_plots import write_report
from gyre.processes import (
    Proc,
    ServiceKeptDying,
    restart,
    scratch_folder,
    serve_metrics,
    service_processes,
    start_all,
    stop_all,
)
from shared.events import (
    CellAssigned,
    CellReady,
    Event,
    ExecutionFinished,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    KvMigrated,
)
from shared.settings import load_settings, new_run_id

console = Console()


def run_environment(
    config: RunConfig,
    *,
    run_id: str,
    nats_url: str,
    database_url: str,
    model_dir: Path,
    run_dir: Path,
    task_ids: list[str],
    gateway_port: int,
    token_secret: str | None = None,
    extra: dict[str, str] | None = None,
    more_gateway_ports: Sequence[int] = (),
) -> dict[str, str]:
    """The environment every process of one run shares: the config's settings as the `GYRE_…` variables the
    services read (gyre/config.py), and where this run's servers, folders and ports are."""
    ipc = scratch_folder(run_id)
    ipc.mkdir(parents=True, exist_ok=True)
    secret = token_secret or os.environ.get("GYRE_ROLLOUT_TOKEN_SECRET") or secrets.token_urlsafe(32)
    cells = config.scheduling.cells
    env = {
        **os.environ,
        **environment(config, model_dir, task_ids),
        "GYRE_RUN_ID": run_id,
        "GYRE_NATS_URL": nats_url,
        "GYRE_DATABASE_URL": database_url,
        "GYRE_STATE_DIR": str(run_dir / "state"),
        # A cell's rollout worker serves health on base + index and its trainer rank on base + cells + index: a
        # free block, so runs on one machine do not clash. Train cells run trainer ranks (the cell agent's default).
        "GYRE_CELL_HEALTH_PORT_BASE": str(local.free_port_block(2 * cells)),
        "GYRE_CELL_LOG_DIR": str(run_dir / "logs" / "cells"),
        "GYRE_ROLLOUT_PORT": str(gateway_port),
        # Every gateway of the run: the harness sticks each execution to one of them (shared.gateways).
        "GYRE_HARNESS_GATEWAY_URL": ",".join(f"http://127.0.0.1:{p}" for p in (gateway_port, *more_gateway_ports)),
        # The harness derives each execution's token from this secret and the gateway recognises it (no call
        # between them); the tokens survive a gateway restart (the launcher restarts services) and a resume.
        "GYRE_ROLLOUT_TOKEN_SECRET": secret,
        "GYRE_HARNESS_WORK_DIR": str(run_dir / "executions"),
        "GYRE_TRAINER_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        **engine_caches(run_dir / "cache"),
        "TMPDIR": str(ipc),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra or {})
    return env


def engine_caches(fallback: Path) -> dict[str, str]:
    """Where engines keep what they derive from their inputs alone (vLLM's model-class inspection, torch inductor's
    compiled kernels): the folders the environment names when it names them (`make` names .cache/, so every run
    and test on the machine shares them: each entry is keyed by its inputs' digest, and a second engine start skips
    ~7 s of CPU inspecting the model class in a subprocess and the kernels' compile), else under `fallback`."""
    caches = {"VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(fallback / "vllm"),
              "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(fallback / "torchinductor")}
    for folder in caches.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    return caches


def loop_environment(
    *,
    run_id: str,
    nats_url: str,
    database_url: str,
    model_dir: Path,
    run_dir: Path,
    mode: str,
    steps: int,
    group_size: int,
    max_staleness: int,
    seed: int,
    task_ids: list[str],
    gateway_port: int,
    cells: int = 2,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """A short run's environment from the default config with its shape given (the e2e tests and benches):
    one query per step, the trainer's own learning rate."""
    config = RunConfig.model_validate({
        "seed": seed,
        "scheduling": {"mode": mode, "steps": steps, "group_size": group_size, "max_staleness": max_staleness,
                       "cells": cells, "queries_per_step": 1},
        "optim": {"lr": 1e-6},
    })
    return run_environment(config, run_id=run_id, nats_url=nats_url, database_url=database_url, model_dir=model_dir,
                           run_dir=run_dir, task_ids=task_ids, gateway_port=gateway_port, extra=extra)


async def _watch(
    database_url: str, run_id: str, steps: int, procs: list[Proc], timeout_s: float, env: dict[str, str],
    log_dir: Path, schema: str | None = None, trackers: Trackers | None = None,
) -> list[Event]:
    from shared.store import EventStore

    store = await EventStore.connect(database_url, schema=schema)
    events: list[Event] = []
    position = 0
    started = time.monotonic()
    # A stop signal is taken by the loop, not raised inside whatever it is awaiting (a database call's greenlet
    # cannot be unwound by it): the watch closes the store, then raises the interrupt the caller handles.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        with Live(console=console, refresh_per_second=2) as live:
            while not stop.is_set():
                page = await store.read_after(position, run_id=run_id, limit=5000)
                if page:
                    position = page[-1].position
                    events += [s.event for s in page]
                live.update(_view(events, procs, steps, time.monotonic() - started))
                if trackers is not None:
                    trackers.update(events)
                done = sum(1 for e in events if e.type == "step.completed")
                if done >= steps:
                    return events
                for proc in procs:
                    if not proc.alive():
                        restart(proc, env, log_dir)
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"the run did not finish {steps} steps within {timeout_s:.0f} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await store.close()
    raise KeyboardInterrupt("stopped by a signal")


def _view(events: list[Event], procs: list[Proc], steps: int, elapsed: float) -> Table:
    roles: dict[str, str] = {}
    since: dict[str, datetime] = {}  # cells between an assignment and being ready: since when
    served: set[str] = set()  # cells that have been ready once
    running: set[str] = set()
    counts = Counter(e.type for e in events)
    rewards: dict[int, list[float]] = {}
    step_of: dict[str, int] = {}
    moved = Counter[str]()
    avoided = 0
    for e in events:
        match e.data:
            case KvMigrated() as d:
                moved[d.method] += 1
                avoided += d.tokens if d.method == "kv" else 0
            case CellAssigned() as d:
                # A first start loads the model and starts the engine or the rank (minutes on CPUs): say so, with
                # how long it has taken, so a slow start does not look like a hang.
                first = d.cell_id not in served
                since[d.cell_id] = e.occurred_at
                roles[d.cell_id] = f"{d.role} ({'first start: loading the model' if first else 'switching'}"
            case CellReady() as d:
                roles[d.cell_id] = d.role
                served.add(d.cell_id)
                since.pop(d.cell_id, None)
            case ExecutionStarted() as d:
                running.add(d.execution_id)
                step_of[d.execution_id] = d.step
            case ExecutionFinished() | ExecutionTimedOut() as d:
                running.discard(d.execution_id)
            case ExecutionScored() as d:
                rewards.setdefault(step_of.get(d.execution_id, 0), []).append(d.reward)
    table = Table(title=f"Gyre run — {elapsed:.0f} s — steps {counts['step.completed']}/{steps}")
    table.add_column("what")
    table.add_column("state")
    now = datetime.now(timezone.utc)
    for cell, role in sorted(roles.items()):
        table.add_row(f"cell {cell}", f"{role}, {(now - since[cell]).total_seconds():.0f} s)" if cell in since else role)
    table.add_row("executions running", str(len(running)))
    table.add_row("executions scored", str(counts["execution.scored"]))
    table.add_row("sessions moved", f"{moved['kv']} by KV, {moved['recompute']} recomputed; "
                                    f"re-prefill avoided {avoided:,} tokens")
    for step, values in sorted(rewards.items()):
        table.add_row(f"step {step} reward", f"{sum(values) / len(values):.3f} over {len(values)}")
    table.add_row("processes", ", ".join(
        p.name + ("" if p.alive() else " (down)") + (f" (restarted {p.restarts}×)" if p.restarts else "") for p in procs
    ))
    return table


@dataclass(frozen=True)
class RunRecord:
    """What `--resume` needs beyond the run's config (runs/<id>/config.yaml): the model RL started from, the
    tasks, and the token secret the run's executions hold. Kept in runs/<id>/run.json, readable by its owner only."""

    run_id: str
    model_dir: str
    task_ids: list[str]
    token_secret: str

    def save(self, run_dir: Path) -> None:
        path = run_dir / RUN_RECORD
        path.touch(mode=0o600)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        path = run_dir / RUN_RECORD
        if not path.is_file():
            raise ConfigError(f"--resume {run_dir.name}: no {path} (the run never started its services): start "
                              f"a new run")
        return cls(**json.loads(path.read_text()))


RUN_RECORD = "run.json"
RUN_CONFIG = "config.yaml"
METRICS_TARGETS = "metrics-targets.json"  # every process's /metrics, as Prometheus's file_sd_configs reads it


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# `gyre run`'s flags, each an override of one config setting.
FLAGS: dict[str, str] = {
    "mode": "scheduling.mode", "steps": "scheduling.steps", "seed": "seed", "group_size": "scheduling.group_size",
    "max_staleness": "scheduling.max_staleness", "queries_per_step": "scheduling.queries_per_step",
    "lr": "optim.lr", "sft_steps": "warm_start.steps", "slip_rate": "warm_start.slip_rate",
    "warm_start_dir": "warm_start.model", "timeout_s": "logging.timeout_s", "tasks_dir": "tasks.dir",
    "task_ids": "tasks.train", "cells": "scheduling.cells",
}


def run(
    config_file: Annotated[Path | None, typer.Option(
        "--config", help="The run config (YAML or TOML; configs/ has examples). Default: configs/demo.yaml's "
                         "settings.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the config and print the plan; start nothing.")]
    = False,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one setting: section.key=value (e.g. scheduling.steps=5); repeatable.")] = None,
    resume: Annotated[str | None, typer.Option(
        help="Continue this stopped run (its id) from its log and checkpoints, with its own config.")] = None,
    mode: Annotated[str | None, typer.Option(help="scheduling.mode: elastic, async or colocate.")] = None,
    steps: Annotated[int | None, typer.Option(help="scheduling.steps: RL steps to train.")] = None,
    seed: Annotated[int | None, typer.Option(help="seed: the model, the tasks and the sampling.")] = None,
    group_size: Annotated[int | None, typer.Option(help="scheduling.group_size: executions per query (G).")] = None,
    max_staleness: Annotated[int | None, typer.Option(help="scheduling.max_staleness.")] = None,
    queries_per_step: Annotated[int | None, typer.Option(help="scheduling.queries_per_step.")] = None,
    lr: Annotated[float | None, typer.Option(help="optim.lr: the RL learning rate.")] = None,
    sft_steps: Annotated[int | None, typer.Option(help="warm_start.steps; 0 skips the warm start.")] = None,
    slip_rate: Annotated[float | None, typer.Option(help="warm_start.slip_rate.")] = None,
    warm_start_dir: Annotated[Path | None, typer.Option(
        "--warm-start", help="warm_start.model: an already warm-started model.")] = None,
    timeout_s: Annotated[float | None, typer.Option(help="logging.timeout_s: give up after this.")] = None,
    tasks_dir: Annotated[Path | None, typer.Option(help="tasks.dir: folder of task folders.")] = None,
    task_ids: Annotated[str | None, typer.Option(help="tasks.train: comma-separated task ids.")] = None,
    cells: Annotated[int | None, typer.Option(help="scheduling.cells on this machine.")] = None,
    restart: Annotated[bool, typer.Option(
        "--restart", help="scheduling.warm=false: switch cells by restarting their process.")] = False,
    run_id: Annotated[str | None, typer.Option(
        "--run-id", help="Name the new run (letters, digits, - and _; default: a fresh run-<hex>).")] = None,
) -> None:
    """Run the RL loop from one config: infrastructure, model, warm start, then RL with every service as a process."""
    given = locals()
    try:
        config, plan, run_id, run_dir, record = _plan(given, config_file, sets or [], resume, restart, run_id)
        if not dry_run:
            plan.check()
    except ConfigError as exc:  # one line per problem, each naming its key; nothing has started
        for line in str(exc).splitlines():
            console.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    if dry_run:
        for line in plan.lines(run_dir if record else run_dir.with_name("<run id>")):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(2 if plan.errors else 0)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    _run(config, plan, run_id, run_dir, record)


def _plan(given: dict[str, Any], config_file: Path | None, sets: list[str], resume: str | None, restart: bool,
          run_id: str | None = None) -> tuple[RunConfig, RunPlan, str, Path, RunRecord | None]:
    """The run's config (the file, or a resumed run's own, with the flags and `--set` over it) and its plan."""
    overrides: dict[str, Any] = {key: given[flag] for flag, key in FLAGS.items() if given[flag] is not None}
    overrides = {k: str(v) if isinstance(v, Path) else v for k, v in overrides.items()}
    if restart:
        overrides["scheduling.warm"] = False
    overrides.update(parse_sets(sets))
    record: RunRecord | None = None
    if resume is not None:
        if config_file is not None:
            raise ConfigError("--resume runs with the run's own config: change settings with --set, not --config")
        runs_dir = Path(load_config(None, overrides=overrides)[0].logging.runs_dir)
        record = RunRecord.load(runs_dir / resume)
        config_file = runs_dir / resume / RUN_CONFIG
    config, sources = load_config(config_file, overrides=overrides)
    plan = plan_run(config, sources)
    if run_id is not None:
        if resume is not None:
            raise ConfigError("--run-id names a new run; --resume continues the run it names")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", run_id):
            raise ConfigError(f"--run-id: expected letters, digits, - and _ (at most 64), got {run_id!r}")
        if (Path(config.logging.runs_dir) / run_id).exists():
            raise ConfigError(f"--run-id: {Path(config.logging.runs_dir) / run_id} exists: name a new run")
    run_id = record.run_id if record else run_id or new_run_id()
    return config, plan, run_id, Path(config.logging.runs_dir) / run_id, record


def _run(config: RunConfig, plan: RunPlan, run_id: str, run_dir: Path, record: RunRecord | None) -> None:
    settings = load_settings()
    endpoints = local.up(settings.state_dir, nats_url=settings.nats_url, database_url=settings.database_url,
                         schema=settings.db_schema)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    s = config.scheduling
    console.print(f"[bold]run {run_id}[/]{' (resumed)' if record else ''} — mode {s.mode}, {s.cells} cells, "
                  f"{s.steps} steps, G={s.group_size}, staleness {s.max_staleness}")
    if record is None:
        if config.is_tiny():
            from gyre.tinymodel import tiny_model

            with console.status(f"creating the {config.model.path} model from seed {config.seed}…"):
                model_dir = tiny_model(run_dir / "model", seed=config.seed, size=config.model.path)  # type: ignore[arg-type]
        else:
            model_dir = Path(config.model.path).resolve()
        (run_dir / RUN_CONFIG).write_text(dump(config))
    else:
        model_dir = Path(record.model_dir)
    more_gateways = [local.free_port() for _ in range(s.gateways - 1)]
    env = run_environment(
        config, run_id=run_id, nats_url=endpoints.nats_url, database_url=endpoints.database_url,
        model_dir=model_dir, run_dir=run_dir, task_ids=record.task_ids if record else plan.task_ids,
        gateway_port=local.free_port(), token_secret=record.token_secret if record else None,
        more_gateway_ports=more_gateways,
    )
    procs = service_processes(sys.executable, more_gateway_ports=more_gateways)
    # Every process serves /metrics on a port of its own; Prometheus reads where from this file (file_sd).
    targets = serve_metrics(procs, env, [local.free_port() for _ in procs])
    (run_dir / METRICS_TARGETS).write_text(json.dumps(targets, indent=1))
    # The services run in their own sessions (a Ctrl-C in the terminal reaches only this process), so a
    # SIGTERM or SIGHUP to `gyre run` must stop them as Ctrl-C does.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if record is None:
            if config.warm_start.model is not None:
                env["GYRE_MODEL_DIR"] = str(Path(config.warm_start.model).resolve())
            elif config.warm_start.steps > 0:
                env["GYRE_MODEL_DIR"] = str(warm_start(sys.executable, model_dir, run_dir, config, env).resolve())
            RunRecord(run_id, env["GYRE_MODEL_DIR"], plan.task_ids, env["GYRE_ROLLOUT_TOKEN_SECRET"]).save(run_dir)
        trackers = Trackers(config.logging.trackers, run_dir, run_id, config.model_dump(mode="json"),
                            project=config.logging.wandb_project, mode=config.logging.wandb_mode)
        start_all(procs, env, run_dir / "logs")
        try:
            events = asyncio.run(
                _watch(endpoints.database_url, run_id, s.steps, procs, config.logging.timeout_s, env,
                       run_dir / "logs", schema=settings.db_schema, trackers=trackers)
            )
        finally:
            trackers.close()
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: stopping every process[/] — continue with `gyre run --resume {run_id}`")
        raise typer.Exit(130)
    except (TimeoutError, ServiceKeptDying) as exc:
        console.print(f"[red]{exc}[/] — logs in {run_dir / 'logs'}")
        raise typer.Exit(1)
    finally:
        stop_all(procs, run_id)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report = build_report(run_id, events)
    report.tasks_left_out = dict(plan.left_out)
    written = write_report(report, run_dir)
    for line in summary_lines(report):
        console.print(line)
    console.print("report: " + ", ".join(str(p) for p in written))


run_app = run
