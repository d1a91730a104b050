"""`gyre replay`: rebuild trajectory trees and batches from the execution log (Postgres, read-only, or an
exported JSONL file), print them with their statistics, export the log, and verify determinism."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree

from services.trajectory.replay import (
    CorruptLog,
    ExecutionReplay,
    LoadedLog,
    ReplayDivergence,
    ReplayError,
    ReplayReport,
    Selection,
    export_text,
    import_text,
    referenced_blobs,
    replay,
    select_events,
    verify,
)
from services.trajectory.state import CONSUMED_TYPES
from services.trajectory.tree import TrajectoryTree

replay_app = typer.Typer(help="Rebuild trajectory trees from the execution log; verify determinism.",
                         add_completion=False)
console = Console(width=160) if not Console().is_terminal else Console()
err = Console(stderr=True)

EXIT_DIVERGED = 1
EXIT_BAD_LOG = 2


async def _load_from_postgres(selection: Selection) -> LoadedLog:
    """Read the selected events and their blobs; only SELECTs are issued (replay never writes)."""
    from shared.blobs import BlobError
    from shared.events import EventError
    from shared.settings import load_settings
    from shared.store import EventStore, StoreError

    settings = load_settings()
    if not settings.database_url:  # `gyre` fills it in from a running `gyre up`
        raise typer.BadParameter("no database configured (GYRE_DATABASE_URL) and none running: run `gyre up` first")
    store = await EventStore.connect(settings.database_url, schema=settings.db_schema)
    try:
        with err.status("reading the log…"):
            stored = await store.read_all(types=list(CONSUMED_TYPES), run_id=selection.run)
        events = select_events([s.event for s in stored], selection)
        refs = list(referenced_blobs(events))
        blobs: dict[str, bytes] = {}
        # A run's log holds a blob per call: thousands for a long run; the bar shows how far the read is.
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=err, transient=True) as progress:
            reading = progress.add_task(f"reading {len(events):,} events' blobs", total=len(refs))
            for ref in refs:
                blobs[ref.digest] = await store.blobs.get(ref)
                progress.advance(reading)
    except (StoreError, BlobError, EventError) as exc:  # a blob missing or not matching its digest, an unreadable row
        raise CorruptLog(f"{type(exc).__name__}: {exc}") from exc
    finally:
        await store.close()
    return LoadedLog(events, blobs)


def _node_label(tree: TrajectoryTree, node: int, show_tokens: int) -> str:
    start, length = int(tree.node_start[node]), int(tree.node_len[node])
    depth = int(tree.depth[start])
    targets = int(tree.is_target[start : start + length].sum())
    calls = sorted({int(c) for c in tree.call_index[start : start + length]})
    kinds = {c.call_index: c.kind for c in tree.calls}
    first = int(tree.node_first_call[node])
    label = (f"[bold]{length}[/] tok [dim]@{depth}[/] · [green]{targets} targets[/] · call {first} "
             f"[cyan]{kinds.get(first, '?')}[/] ({tree.calls[first].chain_id})")
    if len(calls) > 1:
        label += f" · calls {calls[0]}–{calls[-1]}"
    if show_tokens:
        ids = tree.tokens[start : start + min(length, show_tokens)].tolist()
        label += f" [dim]{ids}{'…' if length > show_tokens else ''}[/]"
    return label


def render_tree(replayed: ExecutionReplay, *, max_nodes: int = 80, show_tokens: int = 0) -> Tree:
    tree = replayed.tree
    reward = "—" if replayed.reward is None else f"{replayed.reward:g}"
    adv = "—" if replayed.advantage is None else f"{replayed.advantage:+.3f}"
    root = Tree(f"[bold]execution {replayed.execution_id}[/] query {replayed.query_id} step {replayed.step} "
                f"· {replayed.status} · reward {reward} · advantage {adv}")
    handles: dict[int, Tree] = {}
    shown = 0
    for node in range(tree.num_nodes):
        if shown >= max_nodes:
            root.add(f"[dim]… {tree.num_nodes - shown} more nodes (use --max-nodes)[/]")
            break
        parent = int(tree.node_parent[node])
        anchor = handles.get(parent, root) if parent >= 0 else root
        if parent >= 0 and parent not in handles:
            continue
        handles[node] = anchor.add(_node_label(tree, node, show_tokens))
        shown += 1
    return root


def stats_table(report: ReplayReport) -> Table:
    table = Table(title=f"replay of {report.selection.describe()}")
    table.add_column("execution", no_wrap=True)
    for col in ("status", "reward / adv", "calls", "traj", "unique / flat", "targets", "branches", "digest"):
        table.add_column(col)
    for e in report.executions:
        s = e.tree.stats()
        branches = " ".join(f"{k[:5]} {v}" for k, v in s.branches.items() if v) or "—"
        reward = "—" if e.reward is None else f"{e.reward:g}"
        adv = "—" if e.advantage is None else f"{e.advantage:+.2f}"
        table.add_row(
            e.execution_id, e.status, f"{reward} / {adv}", str(s.calls), str(s.trajectories),
            f"{s.unique_tokens} / {s.flat_tokens} (×{s.flat_tokens / max(s.unique_tokens, 1):.2f})",
            str(s.target_tokens), branches, e.digest[7:19],
        )
    return table


def batch_table(report: ReplayReport) -> Table:
    table = Table(title="batches")
    for col in ("step", "executions", "micro-batches", "targets", "live digest", "replayed digest", "match"):
        table.add_column(col)
    for b in report.batches:
        rebuilt = b.rebuilt
        table.add_row(
            str(b.step), str(len(rebuilt.executions)) if rebuilt else "—",
            str(len(rebuilt.micro_batches)) if rebuilt else "—",
            str(rebuilt.meta.get("target_tokens")) if rebuilt else "—",
            (b.live_digest or "—")[7:23], (b.rebuilt_digest or "—")[7:23],
            "[green]yes[/]" if b.live_digest == b.rebuilt_digest else "[red]NO[/]",
        )
    return table


@replay_app.callback(invoke_without_command=True)
def replay_command(
    execution: Annotated[Optional[str], typer.Option("--execution", help="One execution id.")] = None,
    query: Annotated[Optional[str], typer.Option("--query", help="Every execution of one query.")] = None,
    step: Annotated[Optional[int], typer.Option("--step", help="Every execution of one step, and its batch.")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="A whole run (also narrows the other selectors).")] = None,
    export: Annotated[Optional[Path], typer.Option("--export", help="Write the selected log to this JSONL file.")] = None,
    from_file: Annotated[Optional[Path], typer.Option("--from-file", help="Replay an exported JSONL log.")] = None,
    verify_: Annotated[bool, typer.Option("--verify", help="Rebuild twice and against live batches; "
                                          "exit 1 at the first difference.")] = False,
    max_nodes: Annotated[int, typer.Option(help="Nodes printed per tree.")] = 80,
    tokens: Annotated[int, typer.Option(help="Print the first N token ids of each node.")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Statistics only, no trees.")] = False,
) -> None:
    """Rebuild trees for an execution, a query, a step or a run and print them with their statistics."""
    chosen = [x is not None for x in (execution, query, step)]
    if sum(chosen) > 1:
        raise typer.BadParameter("give at most one of --execution, --query, --step (--run may combine)")
    selection = Selection(execution=execution, query=query, step=step, run=run)
    try:
        if from_file is not None:
            loaded = import_text(from_file.read_text())
            events = select_events(loaded.events, selection)
            loaded = LoadedLog(events, loaded.blobs)
        else:
            loaded = asyncio.run(_load_from_postgres(selection))
        if export is not None:
            export.write_text(export_text(loaded.events, loaded.get_blob))
            err.print(f"exported {len(loaded.events)} events to {export}")
        with err.status(f"{'verifying' if verify_ else 'replaying'} {len(loaded.events):,} events…"):
            report = (verify if verify_ else replay)(loaded.events, loaded.get_blob, selection)
    except ReplayDivergence as exc:
        err.print(f"[red bold]DIVERGED[/] {exc.what} at {exc.where}: expected {exc.expected!r}, got {exc.actual!r}")
        raise typer.Exit(EXIT_DIVERGED) from exc
    except CorruptLog as exc:
        err.print(f"[red bold]corrupted log[/]: {exc}")
        raise typer.Exit(EXIT_BAD_LOG) from exc
    except ReplayError as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(EXIT_BAD_LOG) from exc
    if not quiet:
        for e in report.executions:
            console.print(render_tree(e, max_nodes=max_nodes, show_tokens=tokens))
    console.print(stats_table(report))
    if report.batches:
        console.print(batch_table(report))
    if verify_:
        console.print(f"[green]deterministic[/]: {len(report.executions)} trees and {len(report.batches)} batches "
                      "rebuilt identically" + (", matching the live batches" if report.batches else ""))
