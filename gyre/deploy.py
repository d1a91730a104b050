"""`gyre deploy`: a run whose processes an orchestrator starts (compose.yaml, Kubernetes), one per container,
where `gyre run` starts them itself on one machine. The same run config drives both.

- `prepare`, a one-shot job: plans the run config (the plan's errors stop it, one line each), provides the
  model (the tiny one created from its seed, or the checkpoint the config names, mounted) and the warm start,
  and writes the run's settings to `<state>/runs/<run id>/run.env`. A run already prepared is left as it is,
  so a deployment taken down and brought up again resumes its run from the log and its checkpoints.
- `serve NAME`: one process of the run (relay, trajectory, trainer, gateway, harness, cells, scheduler, the
  entry points `gyre run` starts) with the run's settings beneath its own environment: what the orchestrator
  sets (addresses, ports, this node's cells) wins.
- `report`: waits for the run's last step, then writes the run's report beside its settings.

With `GYRE_DEPLOY_SHARE=object` the nodes need no shared volume: `prepare` also stores the run's settings and
models in the NATS Object Store and points the trainer's checkpoints there, and `serve` and `report` on a node
without the run's folder fetch it first (gyre/deploy_share.py).

Addresses are never the run's: each container gets NATS, PostgreSQL, the gateway and the trainer's rendezvous
from its orchestrator (deploy/env/*.env for compose).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gyre.config import ConfigError, dump, environment, load_config, parse_sets
from gyre.deploy_share import ShareError, ShareMode, share_mode
from gyre.processes import service_processes
from gyre.run_plan import plan_run
from shared.events import Event
from shared.settings import load_settings

console = Console()
app = typer.Typer(help="A run whose processes an orchestrator starts (compose, Kubernetes).", no_args_is_help=True)

RUN_ENV = "run.env"  # the run's settings, KEY=VALUE lines, readable by its owner only (it holds the token secret)


def run_dir() -> Path:
    """Where this deployment's run keeps its settings, model, checkpoints, executions and report."""
    settings = load_settings()
    return settings.state_dir / "runs" / settings.run_id


def read_env(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def _fail(message: str) -> typer.Exit:
    for line in message.splitlines():
        console.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


@app.command()
def prepare(
    config_file: Annotated[Path, typer.Option("--config", help="The run config (YAML or TOML).")],
    sets: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one setting: section.key=value; repeatable.")] = None,
) -> None:
    """Plan the run, provide its model and warm start, and write its settings (once: a prepared run is kept)."""
    here = run_dir()
    mode = _share_mode()
    if (here / RUN_ENV).is_file():
        console.print(f"run {here.name} is prepared ({here / RUN_ENV}): its services resume it")
        if mode == "object":
            _share(here)
        return
    extra = [s for s in os.environ.get("GYRE_DEPLOY_SET", "").split(";") if s.strip()]
    try:
        config, sources = load_config(config_file, overrides=parse_sets([*extra, *(sets or [])]))
        plan = plan_run(config, sources)
        plan.check()
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    (here / "logs").mkdir(parents=True, exist_ok=True)
    if config.is_tiny():
        from gyre.tinymodel import tiny_model

        console.print(f"creating the {config.model.path} model from seed {config.seed}")
        model_dir = tiny_model(here / "model", seed=config.seed, size=config.model.path,  # type: ignore[arg-type]
                                      overwrite=True)
    else:
        model_dir = Path(config.model.path).resolve()
    env = {
        **environment(config, model_dir, plan.task_ids),
        "GYRE_ROLLOUT_TOKEN_SECRET": secrets.token_urlsafe(32),
        "GYRE_HARNESS_WORK_DIR": str(here / "executions"),
        "GYRE_TRAINER_CHECKPOINT_DIR": str(here / "checkpoints"),
        "GYRE_CELL_LOG_DIR": str(here / "logs" / "cells"),
        "VLLM_CACHE_ROOT": str(here / "cache" / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(here / "cache" / "torchinductor"),
    }
    if mode == "object":  # nodes share nothing but the bus: the ranks' checkpoints go to the Object Store too
        env["GYRE_TRAINER_CHECKPOINT_STORE"] = "object"
    if config.warm_start.model is not None:
        env["GYRE_MODEL_DIR"] = str(Path(config.warm_start.model).resolve())
    elif config.warm_start.steps > 0:
        from gyre.warm_start import warm_start

        env["GYRE_MODEL_DIR"] = str(warm_start(sys.executable, model_dir, here, config, {**os.environ, **env}))
    (here / "config.yaml").write_text(dump(config))
    # Written last and whole (a rename): a job killed before this point prepares again from the start.
    partial = here / (RUN_ENV + ".partial")
    partial.touch(mode=0o600)
    partial.write_text("".join(f"{k}={v}\n" for k, v in sorted(env.items())))
    partial.rename(here / RUN_ENV)
    console.print(f"run {here.name} prepared: {len(plan.task_ids)} tasks, {config.scheduling.steps} steps; "
                  f"settings in {here / RUN_ENV}")
    if mode == "object":
        _share(here)


def _share_mode() -> ShareMode:
    try:
        return share_mode()
    except ShareError as exc:
        raise _fail(str(exc)) from None


def _share(here: Path) -> None:
    """Store the prepared run in the Object Store for nodes without this folder (once: a stored run is kept)."""
    import nats.errors

    from gyre.deploy_share import publish_run, same_run, stored_settings
    from shared.objects import ObjectStoreError

    settings = load_settings()
    run_env = (here / RUN_ENV).read_text()
    deadline = time.monotonic() + 300
    while True:  # a cluster that is still electing its leaders times requests out for a while
        try:
            stored_env = asyncio.run(stored_settings(settings))
            if stored_env is not None:
                if same_run(stored_env, here, run_env):
                    return
                raise _fail(f"the Object Store holds a run {settings.run_id} prepared otherwise (another model, "
                            f"tasks or token secret): use another GYRE_RUN_ID, or remove runs/{settings.run_id}/ "
                            f"from the checkpoint bucket")
            stored = asyncio.run(publish_run(settings, here, run_env))
            break
        except (nats.errors.Error, ObjectStoreError) as exc:
            if time.monotonic() > deadline:
                raise _fail(f"the Object Store did not take the run: {type(exc).__name__}: {exc}") from None
            time.sleep(2.0)
    console.print(f"run {here.name} stored in the Object Store for the other nodes ({stored / 2**20:.1f} MiB)")


def _await_prepared(here: Path, wait_s: float, needs: str = RUN_ENV) -> None:
    """Wait for the prepared run's `needs` file in this node's run folder; with GYRE_DEPLOY_SHARE=object, fetch
    the run from the Object Store into it when it is not there."""
    deadline = time.monotonic() + wait_s
    mode = _share_mode()
    if (here / needs).is_file() and (here / RUN_ENV).is_file():
        return
    console.print(f"waiting for the run to be prepared ({here / needs}"
                  f"{', or stored in the Object Store' if mode == 'object' else ''})")
    if mode == "object":
        from gyre.deploy_share import fetch_run

        here.mkdir(parents=True, exist_ok=True)
        if not asyncio.run(fetch_run(load_settings(), here, RUN_ENV, deadline)):
            raise _fail(f"the run {here.name} was not stored in the Object Store within {wait_s:g} s: has "
                        f"`gyre deploy prepare` run with GYRE_DEPLOY_SHARE=object?")
        return
    while not ((here / needs).is_file() and (here / RUN_ENV).is_file()):
        if time.monotonic() > deadline:
            raise _fail(f"{here / needs} did not appear within {wait_s:g} s: has `gyre deploy prepare` run?")
        time.sleep(1.0)


PROCESSES = tuple(p.name for p in service_processes(sys.executable))


@app.command()
def serve(
    name: Annotated[str, typer.Argument(help="One of: " + ", ".join(PROCESSES) + ".")],
    wait_s: Annotated[float, typer.Option(help="How long to wait for `prepare` to write the run's settings.")]
    = 3600.0,
) -> None:
    """Run one process of the prepared run, with the run's settings beneath this container's environment."""
    procs = {p.name: p for p in service_processes(sys.executable)}
    if name not in procs:
        raise _fail(f"unknown process {name!r}; expected one of {', '.join(procs)}")
    _await_prepared(run_dir(), wait_s)
    path = run_dir() / RUN_ENV
    argv = procs[name].argv
    os.execvpe(argv[0], argv, process_environment(read_env(path), dict(os.environ), procs[name].env))


def process_environment(run: dict[str, str], container: dict[str, str], own: dict[str, str]) -> dict[str, str]:
    """A process's environment: the run's settings, under what its container sets (the orchestrator's addresses,
    ports, this node's cells), under what the process itself needs (a second gateway's port and id)."""
    return {**run, **container, **own}


@app.command()
def report(
    timeout_s: Annotated[float, typer.Option(help="Give up when the run has not finished after this.")] = 86400.0,
) -> None:
    """Wait for the prepared run's last step, then write its report (report.json and its figures) beside it."""
    from gyre.report import build_report, summary_lines
    from gyre.report_plots import write_report

    here = run_dir()
    deadline = time.monotonic() + timeout_s
    _await_prepared(here, timeout_s, needs="config.yaml")
    config, _ = load_config(here / "config.yaml")
    try:
        events = asyncio.run(_events_until(load_settings().run_id, config.scheduling.steps, deadline))
    except TimeoutError as exc:
        raise _fail(str(exc)) from None
    built = build_report(here.name, events)
    written = write_report(built, here)
    for line in summary_lines(built):
        console.print(line)
    console.print("report: " + ", ".join(str(p) for p in written))


async def _events_until(run_id: str, steps: int, deadline: float) -> list[Event]:
    from shared.store import EventStore

    settings = load_settings()
    store = await EventStore.connect(settings.database_url, schema=settings.db_schema)
    events: list[Event] = []
    position = 0
    try:
        while True:
            page = await store.read_after(position, run_id=run_id, limit=5000)
            if page:
                position = page[-1].position
                events += [s.event for s in page]
                continue
            done = sum(1 for e in events if e.type == "step.completed")
            if done >= steps:
                return events
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run finished {done} of {steps} steps in time")
            await asyncio.sleep(2.0)
    finally:
        await store.close()


__all__ = ["PROCESSES", "RUN_ENV", "app", "process_environment", "read_env", "run_dir"]
