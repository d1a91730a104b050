"""The dashboard's read model: each run's events folded as they arrive, from the event store (live and finished
runs alike, and after a restart: everything is read back from the log) or from an exported log file.

A run is read once and then only from its last position, so a page that polls a live run costs one small
query a poll; its view is rebuilt only when the run has new events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from gyre.dashboard import views
from services.trajectory.replay import ReplayError, Selection, import_text, replay, select_events
from shared.events import BlobRef, CallCompleted, Event
from shared.store import EventStore, RunSummary


class UnknownRun(LookupError):
    pass


class UnknownExecution(LookupError):
    pass


class EventSource(Protocol):
    """Where the read model reads: runs, a run's events after a position, and blobs by reference."""

    async def runs(self) -> list[RunSummary]: ...

    async def events_after(self, run_id: str, position: int) -> list[tuple[int, Event]]: ...

    async def blob(self, ref: BlobRef) -> bytes: ...


class StoreEvents:
    """The event store, read page by page."""

    def __init__(self, store: EventStore) -> None:
        self.store = store

    async def runs(self) -> list[RunSummary]:
        return await self.store.runs()

    async def events_after(self, run_id: str, position: int) -> list[tuple[int, Event]]:
        out: list[tuple[int, Event]] = []
        while True:
            page = await self.store.read_after(position, limit=5000, run_id=run_id)
            out += [(s.position, s.event) for s in page]
            if len(page) < 5000:
                return out
            position = page[-1].position

    async def blob(self, ref: BlobRef) -> bytes:
        return await self.store.blobs.get(ref)


class FileEvents:
    """An exported log (`gyre replay --export`, or any gyre-execution-log file): a finished record of its runs,
    its events numbered in file order."""

    def __init__(self, path: Path) -> None:
        loaded = import_text(path.read_text())
        self.events = list(enumerate(loaded.events, start=1))
        self.blobs = loaded.blobs

    async def runs(self) -> list[RunSummary]:
        spans: dict[str, list[tuple[int, datetime]]] = {}
        for position, event in self.events:
            spans.setdefault(event.run_id, []).append((position, event.occurred_at))
        rows = [RunSummary(run, s[0][0], s[-1][0], len(s), min(t for _, t in s), max(t for _, t in s))
                for run, s in spans.items()]
        return sorted(rows, key=lambda r: -r.last_position)

    async def events_after(self, run_id: str, position: int) -> list[tuple[int, Event]]:
        return [(p, e) for p, e in self.events if p > position and e.run_id == run_id]

    async def blob(self, ref: BlobRef) -> bytes:
        try:
            return self.blobs[ref.digest]
        except KeyError:
            raise KeyError(f"blob {ref.digest} is not in the file") from None


@dataclass
class _Run:
    events: list[Event] = field(default_factory=list)
    position: int = 0
    view: dict[str, Any] | None = None
    view_position: int = -1
    next_build_at: float = 0.0  # monotonic time before which the view is not folded again
    trees: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # (execution, its calls) -> view
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ReadModel:
    """Runs, their views and their executions' trees, kept up to date from an event source."""

    def __init__(self, source: EventSource, *, cap_k: int, decode: Callable[[list[int]], str] | None = None) -> None:
        self.source = source
        self.cap_k = cap_k
        self.decode = decode  # token ids -> text, when the run's tokenizer is at hand
        self._runs: dict[str, _Run] = {}

    async def runs(self) -> list[dict[str, Any]]:
        return [{"run_id": r.run_id, "events": r.events, "first_at": r.first_at.isoformat(),
                 "last_at": r.last_at.isoformat(), "position": r.last_position} for r in await self.source.runs()]

    async def _refresh(self, run_id: str) -> _Run:
        run = self._runs.setdefault(run_id, _Run())
        async with run.lock:
            new = await self.source.events_after(run_id, run.position)
            if new:
                run.events += [e for _, e in new]
                run.position = new[-1][0]
        if not run.events:
            self._runs.pop(run_id, None)
            raise UnknownRun(f"no run {run_id!r} in the log")
        return run

    async def run(self, run_id: str, *, since: int | None = None) -> dict[str, Any] | None:
        """The run's view; None when it has nothing after position `since` (the page has it already)."""
        run = await self._refresh(run_id)
        async with run.lock:
            # A long live run's view takes a while to fold: rebuilt at most every 4× what the last one took.
            if run.view is None or (run.view_position != run.position and time.monotonic() >= run.next_build_at):
                started = time.monotonic()
                run.view = await asyncio.to_thread(views.run_view, run_id, list(run.events), position=run.position)
                run.view_position = run.position
                run.next_build_at = time.monotonic() + 4 * (time.monotonic() - started)
        if since is not None and since >= run.view_position:
            return None
        return run.view

    async def calls(self, run_id: str, execution_id: str) -> list[dict[str, Any]]:
        run = await self._refresh(run_id)
        self._execution_events(run, execution_id)
        return views.calls_of(run.events, execution_id)

    def _execution_events(self, run: _Run, execution_id: str) -> list[Event]:
        try:
            return select_events(run.events, Selection(execution=execution_id))
        except ReplayError as exc:
            raise UnknownExecution(f"no execution {execution_id!r} in this run") from exc

    async def tree(self, run_id: str, execution_id: str) -> dict[str, Any]:
        """The execution's tree as the trajectory service builds it (rebuilt from the log), as of now."""
        run = await self._refresh(run_id)
        chosen = self._execution_events(run, execution_id)
        key = (execution_id, len(chosen))
        if key not in run.trees:
            refs = {e.data.record.digest: e.data.record for e in chosen if isinstance(e.data, CallCompleted)}
            blobs = {digest: await self.source.blob(ref) for digest, ref in refs.items()}
            report = await asyncio.to_thread(replay, chosen, lambda ref: blobs[ref.digest],
                                             Selection(execution=execution_id))
            if not report.executions:
                raise UnknownExecution(f"execution {execution_id!r} has no calls yet")
            run.trees[key] = views.tree_view(report.executions[0], cap_k=self.cap_k)
        return run.trees[key]

    async def call(self, run_id: str, execution_id: str, call_index: int) -> dict[str, Any]:
        """One recorded call: its event's summary and its tokens (the prompt's new part and the completion)."""
        from shared.calls import call_record

        run = await self._refresh(run_id)
        found = [e for e in self._execution_events(run, execution_id)
                 if isinstance(e.data, CallCompleted) and e.data.call_index == call_index]
        if not found:
            raise UnknownExecution(f"execution {execution_id!r} has no call {call_index}")
        data = found[-1].data
        assert isinstance(data, CallCompleted)
        record = call_record(data, await self.source.blob(data.record))
        new_prompt, completion = record.tokens.new_prompt.tolist(), record.tokens.completion.tolist()
        text = {"new_prompt_text": self.decode(new_prompt), "completion_text": self.decode(completion)} \
            if self.decode else {}
        return {**data.model_dump(mode="json", exclude={"record"}), "record": data.record.digest,
                "new_prompt": new_prompt, "completion": completion,
                "logprobs": [round(float(x), 4) for x in record.tokens.logprobs], **text}
