"""The call recorder's Postgres backend: an execution's log is its stream in the event store, a call's record blob
goes in the store's blob table in the same commit as its events."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from services.rollout.recorder import LoggedRecorder
from shared.calls import CALL_RECORD_MEDIA_TYPE
from shared.events import BlobRef, Event, stream_id_for
from shared.store import EventStore


class PostgresCallStorage:
    """`CallStorage` on `shared.store.EventStore`."""

    def __init__(self, store: EventStore) -> None:
        self.store = store

    async def read_execution(self, execution_id: str) -> list[Event]:
        return [item.event for item in await self.store.read_stream(stream_id_for("execution", execution_id))]

    async def get_blob(self, ref: BlobRef) -> bytes:
        return await self.store.blobs.get(ref)

    async def append_call(self, events: Sequence[Event], blob: bytes) -> None:
        # On every call's reply path: one append carries the blob and the events, and concurrent calls' appends
        # commit together (one statement, one commit).
        await self.store.append_grouped(events, blobs=[(blob, CALL_RECORD_MEDIA_TYPE)])

    async def append_events(self, events: Sequence[Event]) -> None:
        await self.store.append(events, expected_version="any")


class PostgresCallRecorder(LoggedRecorder):
    """The gateway's recorder: calls recorded in the event store before their reply."""

    def __init__(self, store: EventStore, *, run_id: str, clock: Callable[[], datetime] | None = None) -> None:
        super().__init__(PostgresCallStorage(store), run_id=run_id, clock=clock)


__all__ = ["PostgresCallRecorder", "PostgresCallStorage"]
