"""`gyre run`: the whole RL loop on one machine, each service as its own process with the same command
compose.yaml uses, a live view of the run, and a report at the end.

The launcher only starts processes and reads the event log; the services talk to each other through
NATS and PostgreSQL exactly as they would on separate nodes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gyre import local
from gyre.report import build_report, summary_lines
from gyre.report_plots import write_report
from gyre.processes import Proc, ServiceKeptDying, restart, service_processes, start_all, stop_all
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
    """The environment every process of one run shares (settings are `GYRE_…` variables)."""
    cache = run_dir / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    # vLLM binds IPC sockets under TMPDIR and a socket path may not exceed 107 bytes: keep it short.
    ipc = Path(tempfile.gettempdir()) / f"gyre-{hashlib.sha1(run_id.encode()).hexdigest()[:10]}"
    ipc.mkdir(parents=True, exist_ok=True)
    token_secret = os.environ.get("GYRE_ROLLOUT_TOKEN_SECRET") or secrets.token_urlsafe(32)
    env = {
        **os.environ,
        "GYRE_RUN_ID": run_id,
        "GYRE_NATS_URL": nats_url,
        "GYRE_DATABASE_URL": database_url,
        "GYRE_STATE_DIR": str(run_dir / "state"),
        "GYRE_MODEL_DIR": str(model_dir),
        "GYRE_MODE": mode,
        "GYRE_GROUP_SIZE": str(group_size),
        "GYRE_MAX_STALENESS": str(max_staleness),
        "GYRE_SCHEDULER_TOTAL_STEPS": str(steps),
        "GYRE_SCHEDULER_SEED": str(seed),
        "GYRE_SCHEDULER_TASK_IDS": ",".join(task_ids),
        "GYRE_SCHEDULER_MIN_CELLS": str(cells),
        "GYRE_SCHEDULER_TICK_S": "0.5",
        "GYRE_CELL_COUNT": str(cells),
        # A cell's rollout worker serves health on base + index and its trainer rank on base + cells + index: a
        # free block, so runs on one machine do not clash. Train cells run trainer ranks (the cell agent's default).
        "GYRE_CELL_HEALTH_PORT_BASE": str(local.free_port_block(2 * cells)),
        # The elastic policy's hysteresis scaled to the tiny loop, whose steps take seconds, not minutes.
        "GYRE_SCHEDULER_ELASTIC_MIN_DWELL_S": "10",
        "GYRE_SCHEDULER_ELASTIC_TRAIN_HORIZON_S": "30",
        "GYRE_SCHEDULER_ELASTIC_MARGIN": "0",
        "GYRE_CELL_LOG_DIR": str(run_dir / "logs" / "cells"),
        "GYRE_ROLLOUT_PORT": str(gateway_port),
        "GYRE_ROLLOUT_MODEL_NAME": "gyre-tiny",
        "GYRE_HARNESS_GATEWAY_URL": f"http://127.0.0.1:{gateway_port}",
        # The harness derives each execution's token from this secret and the gateway recognises it (no call
        # between them); the tokens survive a gateway restart (the launcher restarts services).
        "GYRE_ROLLOUT_TOKEN_SECRET": token_secret,
        "GYRE_HARNESS_MODEL_NAME": "gyre-tiny",
        "GYRE_HARNESS_WORK_DIR": str(run_dir / "executions"),
        # The tiny model's tasks need one or two calls; bound each execution so a step stays short.
        "GYRE_HARNESS_WALL_BUDGET_S": "90",
        "GYRE_HARNESS_CALL_BUDGET": "3",
        "GYRE_HARNESS_MAX_TOKENS": "64",
        "GYRE_HARNESS_CONCURRENCY": "4",
        "GYRE_TRAINER_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TMPDIR": str(ipc),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra or {})
    return env


async def _watch(
    database_url: str, run_id: str, steps: int, procs: list[Proc], timeout_s: float, env: dict[str, str],
    log_dir: Path, schema: str | None = None,
) -> list[Event]:
    from shared.store import EventStore

    store = await EventStore.connect(database_url, schema=schema)
    events: list[Event] = []
    position = 0
    started = time.monotonic()
    try:
        with Live(console=console, refresh_per_second=2) as live:
            while True:
                page = await store.read_after(position, run_id=run_id, limit=5000)
                if page:
                    position = page[-1].position
                    events += [s.event for s in page]
                live.update(_view(events, procs, steps, time.monotonic() - started))
                done = sum(1 for e in events if e.type == "step.completed")
                if done >= steps:
                    return events
                for proc in procs:
                    if not proc.alive():
                        restart(proc, env, log_dir)
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"the run did not finish {steps} steps within {timeout_s:.0f} s")
                await asyncio.sleep(0.5)
    finally:
        await store.close()


def _view(events: list[Event], procs: list[Proc], steps: int, elapsed: float) -> Table:
    roles: dict[str, str] = {}
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
                roles[d.cell_id] = f"{d.role} (switching)"
            case CellReady() as d:
                roles[d.cell_id] = d.role
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
    for cell, role in sorted(roles.items()):
        table.add_row(f"cell {cell}", role)
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


# The learnable family: generated shell tasks whose solution is one short command the tiny model can hold
# (create-file needs the text copied verbatim, which a 2-layer model does not learn in minutes; see
# docs/learning.md).
LEARNABLE_FAMILIES: tuple[str, ...] = ("sum-numbers", "count-matches", "uppercase", "sort-lines")


def learnable_tasks(families: tuple[str, ...] = LEARNABLE_FAMILIES, tasks_dir: Path = Path("tasks")) -> list[str]:
    """The shipped tasks of the learnable family (tasks/<family>-<n>); demonstrations never use their parameters.

    Interleaved across families (count-matches-1, sort-lines-1, sum-numbers-1, uppercase-1, count-matches-2,
    …), so the scheduler's round-robin gives every step a mix of skills: a batch of one family pushes the
    small shared policy toward that family's command, and the next family's rollouts pay for it.
    """
    by_family: dict[str, list[str]] = {}
    for name in sorted(p.name for p in tasks_dir.iterdir() if p.name.rsplit("-", 1)[0] in families):
        by_family.setdefault(name.rsplit("-", 1)[0], []).append(name)
    columns = [by_family[f] for f in sorted(by_family)]
    return [column[i] for i in range(max(map(len, columns), default=0)) for column in columns if i < len(column)]


def resolve_tasks(tasks_dir: Path, task_ids: str) -> list[str]:
    """The tasks a run trains on: the named ones, each checked to load (a bad one is a clear error here rather
    than a failed execution later), or the shipped learnable family."""
    from services.harness.tasks import TaskFormatError, load_task

    if not task_ids.strip():
        found = learnable_tasks(tasks_dir=tasks_dir)
        if not found:
            raise typer.BadParameter(f"{tasks_dir} holds none of the shipped family ({', '.join(LEARNABLE_FAMILIES)}):"
                                     f" name the tasks to train on with --task-ids")
        return found
    chosen = [t.strip() for t in task_ids.split(",") if t.strip()]
    for task_id in chosen:
        try:
            load_task(tasks_dir / task_id)
        except (TaskFormatError, FileNotFoundError) as exc:
            raise typer.BadParameter(f"--task-ids {task_id}: {exc}") from exc
    return chosen


@dataclass(frozen=True)
class WarmStart:
    """The supervised warm-start: an imperfect demonstrator's demonstrations of the learnable family.

    `slip_rate` of them skip the work or run a wrong command (services/harness/demos.py), so the warm-started
    policy solves the held-out tasks only part of the time and RL has something to learn.
    """

    steps: int = 150
    conversations_per_step: int = 32
    lr: float = 2e-3
    slip_rate: float = 0.7
    families: tuple[str, ...] = LEARNABLE_FAMILIES


def warm_start(python: str, base: Path, run_dir: Path, options: WarmStart, seed: int, env: dict[str, str]) -> Path:
    """Write the demonstrations and run `gyre train sft` as its own process; returns the fine-tuned model."""
    from services.harness.demos import write_demos

    out = run_dir / "sft"
    data = run_dir / "warmstart" / "demos.jsonl"
    count = write_demos(
        data, seed=seed, count=options.steps * options.conversations_per_step, families=options.families,
        slip_rate=options.slip_rate,
    )
    argv = [
        python, "-m", "gyre.cli", "train", "sft", "--model", str(base), "--data", str(data), "--out", str(out),
        "--lr", str(options.lr), "--conversations-per-step", str(options.conversations_per_step),
        "--epochs", "1", "--precision", "fp32",
    ]
    log = run_dir / "logs" / "sft.log"
    console.print(
        f"warm-start: {count} demonstrations ({options.slip_rate:.0%} with a slip) → {options.steps} SFT steps; "
        f"log {log}"
    )
    started = time.monotonic()
    with open(log, "ab") as sink, console.status("supervised warm-start (SFT)…"):
        done = subprocess.run(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"the warm-start failed (exit {done.returncode}); see {log}")
    console.print(f"warm-start done in {time.monotonic() - started:.0f} s → {out}")
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(
    mode: Annotated[str, typer.Option(help="elastic, async or colocate.")] = "async",
    steps: Annotated[int, typer.Option(help="RL steps to train.")] = 30,
    seed: Annotated[int, typer.Option(help="Seed for the model, the tasks and the sampling.")] = 0,
    group_size: Annotated[int, typer.Option(help="Executions per query (G).")] = 8,
    max_staleness: Annotated[int, typer.Option(help="Policy versions a rollout may lag the trainer.")] = 1,
    queries_per_step: Annotated[int, typer.Option(help="Queries (groups of G) per training step.")] = 2,
    lr: Annotated[float, typer.Option(help="RL learning rate (the trainer's GYRE_TRAINER_LR).")] = 3e-4,
    sft_steps: Annotated[int, typer.Option(help="Warm-start SFT steps (32 demonstrations each); 0 skips it.")] = 150,
    slip_rate: Annotated[float, typer.Option(help="Share of demonstrations with a mistake.")] = 0.7,
    warm_start_dir: Annotated[
        Path | None, typer.Option("--warm-start", help="Use this warm-started model instead of training one.")
    ] = None,
    timeout_s: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600.0,
    tasks_dir_option: Annotated[
        Path, typer.Option("--tasks-dir", help="Folder of task folders (Terminal-Bench format).")
    ] = Path("tasks"),
    task_ids: Annotated[
        str, typer.Option(help="Comma-separated task ids to train on (default: the shipped shell-task family).")
    ] = "",
    cells: Annotated[int, typer.Option(help="Cells on this machine; each runs a rollout worker or a trainer rank.")] = 2,
    restart: Annotated[
        bool, typer.Option("--restart", help="Switch cells by restarting their process (default: warm, both kept).")
    ] = False,
) -> None:
    """Run the RL loop: infrastructure, tiny model, SFT warm-start, then RL with every service as a process."""
    if mode not in ("elastic", "async", "colocate"):
        raise typer.BadParameter(f"--mode must be elastic, async or colocate, got {mode!r}")
    if not 0.0 <= slip_rate <= 1.0:
        raise typer.BadParameter(f"--slip-rate must be a fraction in [0, 1], got {slip_rate}")
    for name, value, least in (("--steps", steps, 1), ("--group-size", group_size, 1),
                               ("--queries-per-step", queries_per_step, 1), ("--max-staleness", max_staleness, 0),
                               ("--sft-steps", sft_steps, 0), ("--cells", cells, 2)):
        if value < least:
            raise typer.BadParameter(f"{name} must be at least {least}, got {value}")
    if lr <= 0 or timeout_s <= 0:
        raise typer.BadParameter(f"--lr and --timeout-s must be positive, got {lr} and {timeout_s}")
    if warm_start_dir is not None and not (warm_start_dir / "config.json").is_file():
        raise typer.BadParameter(f"--warm-start {warm_start_dir}: not a model directory (no config.json)")
    tasks_dir = tasks_dir_option.resolve()
    if not tasks_dir.is_dir():
        if tasks_dir_option == Path("tasks"):
            raise typer.BadParameter(f"no tasks/ folder in {Path.cwd()}: run `gyre run` from the repository root")
        raise typer.BadParameter(f"--tasks-dir {tasks_dir_option}: no such folder")
    chosen = resolve_tasks(tasks_dir, task_ids)
    settings = load_settings()
    endpoints = local.up(settings.state_dir, nats_url=settings.nats_url, database_url=settings.database_url,
                         schema=settings.db_schema)
    run_id = new_run_id()
    run_dir = Path("runs") / run_id
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]run {run_id}[/] — mode {mode}, {cells} cells, {steps} steps, G={group_size}, "
                  f"staleness {max_staleness}")
    from gyre.tinymodel import create_tiny_model

    model_dir = create_tiny_model(run_dir / "model", seed=seed, size="tiny")
    env = loop_environment(
        run_id=run_id, nats_url=endpoints.nats_url, database_url=endpoints.database_url, model_dir=model_dir,
        run_dir=run_dir, mode=mode, steps=steps, group_size=group_size, max_staleness=max_staleness, seed=seed,
        task_ids=chosen, gateway_port=local.free_port(), cells=cells,
        extra={"GYRE_CELL_WARM": "false" if restart else "true","GYRE_SCHEDULER_QUERIES_PER_STEP": str(queries_per_step), "GYRE_TRAINER_LR": str(lr),
               "GYRE_HARNESS_TASKS_DIR": str(tasks_dir)},
    )
    procs = service_processes(sys.executable)
    # The services run in their own sessions (a Ctrl-C in the terminal reaches only this process), so a
    # SIGTERM or SIGHUP to `gyre run` must stop them as Ctrl-C does.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if warm_start_dir is not None:
            env["GYRE_MODEL_DIR"] = str(warm_start_dir)
        elif sft_steps > 0:
            options = WarmStart(steps=sft_steps, slip_rate=slip_rate)
            env["GYRE_MODEL_DIR"] = str(warm_start(sys.executable, model_dir, run_dir, options, seed, env))
        start_all(procs, env, run_dir / "logs")
        events = asyncio.run(
            _watch(endpoints.database_url, run_id, steps, procs, timeout_s, env, run_dir / "logs",
                   schema=settings.db_schema)
        )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/]")
        raise typer.Exit(130)
    except (TimeoutError, ServiceKeptDying) as exc:
        console.print(f"[red]{exc}[/] — logs in {run_dir / 'logs'}")
        raise typer.Exit(1)
    finally:
        stop_all(procs, run_id)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report = build_report(run_id, events)
    written = write_report(report, run_dir)
    for line in summary_lines(report):
        console.print(line)
    console.print("report: " + ", ".join(str(p) for p in written))


run_app = run
