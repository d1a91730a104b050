"""The `gyre` command: local infrastructure, tiny models, the event log, and each service's entry points.

Service command groups (sim, replay, train, harness, ...) are mounted lazily so `gyre up` never imports torch.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from gyre import local
from shared.settings import Settings, load_settings

console = Console(stderr=True)
app = typer.Typer(help="Gyre: elastic RL for long-horizon LLM agents.", no_args_is_help=True, add_completion=False)
events_app = typer.Typer(help="Read the execution log.", no_args_is_help=True)
model_app = typer.Typer(help="Create and inspect local models.", no_args_is_help=True)
app.add_typer(events_app, name="events")
app.add_typer(model_app, name="model")

# name -> (module, attribute, help): mounted only when invoked.
LAZY_GROUPS: dict[str, tuple[str, str, str]] = {
    "sim": ("services.scheduler.sim.cli", "sim_app", "Simulate scheduling policies on a cluster model."),
    "replay": ("services.trajectory.cli", "replay_app", "Rebuild trajectory trees from the log; verify determinism."),
    "train": ("services.trainer.cli", "train_app", "Training entry points (SFT warm-start, steps)."),
    "harness": ("services.harness.cli", "harness_app", "Tasks, sandboxes and executions."),
    "rollout": ("services.rollout.cli", "rollout_app", "Rollout gateway and workers."),
    "scheduler": ("services.scheduler.cli", "scheduler_app", "The live scheduler and cell agents."),
    "run": ("gyre.launcher", "run_app", "Run the whole RL loop: every service as a process, live view, report."),
    "compare": ("gyre.compare", "compare_app", "Run one workload under each scheduling mode; compare them."),
    "eval": ("gyre.eval", "eval_app", "Score a policy on held-out tasks: pass@1 and mean score."),
    "dashboard": ("gyre.dashboard.cli", "dashboard", "A live web page of runs: curves, cells, executions, trees."),
    "deploy": ("gyre.deploy", "app", "A run whose processes an orchestrator starts: prepare, serve, report."),
}

StateDir = Annotated[Optional[Path], typer.Option("--state-dir", help="Where embedded servers keep their data.")]


def endpoints(settings: Settings | None = None) -> tuple[str, str]:
    """(nats_url, database_url): from settings when configured, else from a running `gyre up`."""
    settings = settings or load_settings()
    try:
        return local.configured_or_running(settings.nats_url, settings.database_url, settings.state_dir)
    except local.LocalInfraError as exc:
        raise typer.BadParameter(str(exc)) from exc


@app.command()
def up(state_dir: StateDir = None) -> None:
    """Start NATS (JetStream) and PostgreSQL unless given by URL, run migrations, print the URLs."""
    settings = load_settings()
    state = state_dir or settings.state_dir
    found = local.up(state, nats_url=settings.nats_url, database_url=settings.database_url, schema=settings.db_schema)
    console.print(f"[green]NATS[/]      {found.nats_url} ({'embedded' if found.embedded_nats else 'given by URL'})")
    console.print(
        f"[green]Postgres[/]  {found.database_url} ({'embedded' if found.embedded_postgres else 'given by URL'})"
    )
    console.print(f"Environment for services: source {state / 'env'}")
    print(f"GYRE_NATS_URL={found.nats_url}\nGYRE_DATABASE_URL={found.database_url}")


@app.command()
def down(state_dir: StateDir = None) -> None:
    """Stop the embedded servers that `gyre up` started."""
    state = state_dir or load_settings().state_dir
    stopped = local.down(state)
    console.print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@app.command()
def status(state_dir: StateDir = None) -> None:
    """Show what runs."""
    state = state_dir or load_settings().state_dir
    print(json.dumps(local.status(state), indent=2))


SERVICES = ("scheduler", "rollout", "harness", "trajectory", "trainer")


@app.command()
def serve(service: Annotated[str, typer.Argument(help="One of: " + ", ".join(SERVICES) + ".")]) -> None:
    """Run one service as this process (the same as `python -m services.<name>`)."""
    import runpy

    if service not in SERVICES:
        raise typer.BadParameter(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    sys.argv = [f"services.{service}"]
    runpy.run_module(f"services.{service}", run_name="__main__", alter_sys=True)


@app.command()
def migrate() -> None:
    """Run the database migrations against GYRE_DATABASE_URL (the one-shot job in compose)."""
    from shared.store import run_migrations

    settings = load_settings()
    _, db = endpoints(settings)
    run_migrations(db, settings.db_schema)
    console.print("migrations at head")


@app.command()
def relay() -> None:
    """Run the outbox relay (Postgres event table → JetStream)."""
    from shared.relay import run_relay_process

    asyncio.run(run_relay_process())


@model_app.command("init")
def model_init(
    out_dir: Path,
    seed: Annotated[int, typer.Option(help="Seed for weights and tokenizer corpus.")] = 0,
    size: Annotated[str, typer.Option(help="tiny or small.")] = "tiny",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing model directory.")] = False,
) -> None:
    """Create a Hugging Face–format causal LM with a locally trained tokenizer, deterministic from the seed."""
    from gyre.tinymodel import create_tiny_model, model_info

    if size not in ("tiny", "small"):
        raise typer.BadParameter(f"--size must be tiny or small, got {size!r}")
    path = create_tiny_model(out_dir, seed=seed, size=size, overwrite=overwrite)  # type: ignore[arg-type]
    print(json.dumps(model_info(path), indent=2, default=str))


@events_app.command("tail")
def events_tail(
    type_: Annotated[Optional[list[str]], typer.Option("--type", help="Only these event types.")] = None,
    stream: Annotated[Optional[str], typer.Option(help="Only this stream (prefix match).")] = None,
    run_id: Annotated[Optional[str], typer.Option("--run", help="Only this run.")] = None,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", "-f")] = True,
    since: Annotated[int, typer.Option(help="Start after this global position.")] = 0,
) -> None:
    """Print events as JSON lines, following new ones as they commit."""
    asyncio.run(_tail(type_, stream, run_id, follow, since))


async def _tail(types: list[str] | None, stream: str | None, run_id: str | None, follow: bool, since: int) -> None:
    from shared.relay import Waker, plain_dsn
    from shared.store import EventStore

    settings = load_settings()
    _, db = endpoints(settings)
    store = await EventStore.connect(db, schema=settings.db_schema)
    waker = Waker(plain_dsn(db), store.channel)
    await waker.open()
    position = since
    try:
        while True:
            page = await store.read_after(position, limit=1000, types=types, run_id=run_id)
            for stored in page:
                position = stored.position
                if stream and not stored.event.stream_id.startswith(stream):
                    continue
                print(json.dumps({"position": stored.position, **stored.event.to_dict()}), flush=True)
            if not page:
                if not follow:
                    return
                await waker.wait(1.0)
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    finally:
        await waker.close()
        await store.close()


@events_app.command("export")
def events_export(
    out: Path,
    run_id: Annotated[Optional[str], typer.Option("--run", help="Only this run.")] = None,
    type_: Annotated[Optional[list[str]], typer.Option("--type", help="Only these event types.")] = None,
    with_blobs: Annotated[bool, typer.Option(
        "--with-blobs", help="Write a whole log file instead: the blobs the events refer to (call records, "
        "batches) beside them, which `gyre dashboard --log` and `gyre replay --from-file` read.")] = False,
) -> None:
    """Write the log (or one run of it) as JSONL, one event per line with its global position."""

    async def export() -> int:
        from shared.store import EventStore

        settings = load_settings()
        _, db = endpoints(settings)
        store = await EventStore.connect(db, schema=settings.db_schema)
        try:
            events = await store.read_all(types=type_, run_id=run_id)
            if with_blobs:
                from services.trajectory.replay import export_text, referenced_blobs

                logged = [s.event for s in events]
                blobs = {ref.digest: await store.blobs.get(ref) for ref in referenced_blobs(logged)}
                out.write_text(export_text(logged, lambda ref: blobs[ref.digest]))
                return len(events)
        finally:
            await store.close()
        with out.open("w") as f:
            for stored in events:
                f.write(json.dumps({"position": stored.position, **stored.event.to_dict()}) + "\n")
        return len(events)

    count = asyncio.run(export())
    console.print(f"wrote {count} events to {out} at {datetime.now():%H:%M:%S}")


def _listed() -> None:
    """A lazy group as the top-level help lists it (never run: `main` mounts the real one when it is named)."""


def _mount(name: str) -> bool:
    spec = LAZY_GROUPS.get(name)
    if spec is None:
        return False
    module_name, attr, help_text = spec
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return False
        raise
    sub = getattr(module, attr)
    if isinstance(sub, typer.Typer):
        app.add_typer(sub, name=name, help=help_text)
    else:
        app.command(name=name, help=help_text)(sub)
    return True


# Errors that mean the user's input or setup is wrong, not that Gyre is: a message and exit 2, no traceback.
def _user_errors() -> tuple[type[BaseException], ...]:
    from pydantic import ValidationError

    from gyre.config import ConfigError
    from gyre.tinymodel import TinyModelError
    from gyre.trackers import TrackerUnavailable
    from shared.settings import SettingsError

    return (SettingsError, ConfigError, ValidationError, local.LocalInfraError, TinyModelError, FileNotFoundError,
            TrackerUnavailable)


def _export_endpoints() -> None:
    """Hand the services' own commands the servers of a running `gyre up` when no URLs are configured: they
    read settings only and know nothing of the local launcher."""
    settings = load_settings()
    try:
        nats_url, database_url = local.configured_or_running(settings.nats_url, settings.database_url,
                                                             settings.state_dir)
    except local.LocalInfraError:
        return  # the command says so itself if it needs them
    os.environ.setdefault("GYRE_NATS_URL", nats_url)
    os.environ.setdefault("GYRE_DATABASE_URL", database_url)


def main() -> None:
    args = sys.argv[1:]
    try:
        if args and args[0] in LAZY_GROUPS:
            _export_endpoints()
            _mount(args[0])
        elif not args or args[0] in ("--help", "-h"):
            # Listed by name and help text, not imported: the groups' modules import torch and vLLM (8 s of the
            # top-level help, now ~0.3 s); `gyre <group> --help` imports the one asked for.
            for name, (_, _, help_text) in LAZY_GROUPS.items():
                app.command(name=name, help=help_text, context_settings={"allow_extra_args": True})(_listed)
        app()  # click handles usage errors itself (message, exit 2)
    except _user_errors() as exc:
        lines = str(exc).strip().splitlines()
        if type(exc).__name__ == "ConfigError":  # every line is a problem of its own, named by its key
            for line in lines:
                console.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            sys.exit(2)
        console.print(f"[red]error:[/] {type(exc).__name__}: {escape(lines[0] if lines else '')}", highlight=False)
        if len(lines) > 1:
            console.print("\n".join(lines[1:12]), highlight=False, markup=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
