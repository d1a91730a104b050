"""`gyre dashboard`: serve the dashboard over the event store (or an exported log) until interrupted."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

err = Console(stderr=True)


def is_local(host: str) -> bool:
    """Whether `host` listens on this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def dashboard(
    host: Annotated[str, typer.Option(help="Where to listen. Beyond localhost a token is asked for.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="The port to listen on.")] = 8765,
    token: Annotated[Optional[str], typer.Option(
        envvar="GYRE_DASHBOARD_TOKEN", help="The token the page asks for (made up and printed when it listens "
        "beyond localhost without one).")] = None,
    log: Annotated[Optional[Path], typer.Option(
        "--log", help="Show an exported log file (gyre replay --export) instead of the event store.")] = None,
    model: Annotated[Optional[Path], typer.Option(
        help="A model folder whose tokenizer decodes recorded calls into text.")] = None,
) -> None:
    """A web page of runs: reward, pass rate and loss, the cells' timeline with switches, executions and their
    calls, and any execution's trajectory tree. Read-only; updates as the log grows."""
    import uvicorn

    from gyre.dashboard.app import create_app
    from gyre.dashboard.source import EventSource, FileEvents, ReadModel, StoreEvents
    from services.trajectory.replay import ReplayError
    from shared.settings import load_settings
    from shared.store import EventStore

    settings = load_settings()
    if token is None and not is_local(host):
        token = secrets.token_urlsafe(18)
    decode = None
    if model is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=False))

    async def serve() -> None:
        store: EventStore | None = None
        source: EventSource
        if log is not None:
            try:
                source = FileEvents(log)
            except ReplayError as exc:  # not a log file, or a damaged one: say which line
                err.print(f"[red]error:[/] --log {log}: {exc}", highlight=False, soft_wrap=True)
                raise typer.Exit(2) from exc
        else:
            if not settings.database_url:
                raise typer.BadParameter("no database configured (GYRE_DATABASE_URL) and none running: "
                                         "run `gyre up` first, or give --log FILE")
            store = await EventStore.connect(settings.database_url, schema=settings.db_schema)
            source = StoreEvents(store)
        app = create_app(ReadModel(source, cap_k=settings.cap_k, decode=decode), token=token)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        err.print(f"dashboard at [bold]http://{shown}:{port}/{'?token=' + token if token else ''}[/] "
                  f"({'file ' + str(log) if log else 'the event store'}); Ctrl-C stops it")
        try:
            await server.serve()
        finally:
            if store is not None:
                await store.close()

    asyncio.run(serve())
