"""Group commit for the event store's hot path: concurrent appends the store versions share one pipelined
transaction on a connection of the appender's own (the gateway records every model call through it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg

from shared.events import Event
from shared.effects import ExpectedVersion
from shared.own_connection import OwnConnection
from shared.store_sql import ConcurrencyConflict, DuplicateEvent, StoreError, integrity_error


class AppendTarget(Protocol):
    """What the appender needs of the store: its schema and DSN, and the pipelined write of one append."""

    schema: str | None

    def dsn(self) -> str: ...

    async def _write(
        self,
        driver: psycopg.AsyncConnection[Any],
        events: Sequence[Event],
        expected: ExpectedVersion,
        blobs: Sequence[tuple[bytes, str]] = (),
        *,
        check: bool = True,
    ) -> list[int]: ...


GROUPED_APPENDER_NAME = "gyre-grouped-appender"  # its connection's application_name (pg_stat_activity)


@dataclass
class _Queued:
    events: list[Event]
    blobs: list[tuple[bytes, str]]
    done: asyncio.Future[None]


class GroupedAppender:
    """Group commit for appends the store versions: every append queued while a commit is in flight goes into
    the next one, a single transaction on a connection of its own whose statements (blobs, lock, events,
    commit) are pipelined into one round trip.

    For a path that must write before it answers and runs many times at once (the gateway records every model
    call before the reply leaves): N concurrent appends cost one round trip and one commit, not N pooled
    transactions of several round trips each. Failures: an append that conflicts (an event already in the log)
    fails alone, the batch being split; a deadlock or serialization failure is retried; a lost connection is
    reopened and the commit retried once, and if the retry finds every event already stored, the lost attempt
    had committed. A caller is told of success only once its events are committed.
    """

    max_events = 1024  # per commit
    attempts = 3  # per commit, against deadlocks and serialization failures

    def __init__(self, store: AppendTarget) -> None:
        self.store = store
        self._queue: list[_Queued] = []
        self._inflight: list[_Queued] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._own = OwnConnection(store.dsn(), store.schema, application_name=GROUPED_APPENDER_NAME)
        self._task: asyncio.Task[None] | None = None

    async def append(self, events: Sequence[Event], blobs: Sequence[tuple[bytes, str]] = ()) -> None:
        if self._closing:
            raise StoreError("the event store is closed")
        if not events and not blobs:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody waits now
        self._queue.append(_Queued(list(events), list(blobs), done))
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="grouped-appender")
        await asyncio.shield(done)  # a caller that stops waiting does not take the others' commit with it

    async def close(self) -> None:
        """Commit what is queued, then close the connection."""
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            try:
                await asyncio.shield(task)  # a cancelled close must not cancel a commit in flight
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this close was cancelled, not the writer
        await self._drop_connection()

    async def _run(self) -> None:
        try:
            while self._queue or not self._closing:
                if not self._queue:
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                size = 0
                while self._queue and (not self._inflight or size + len(self._queue[0].events) <= self.max_events):
                    self._inflight.append(self._queue.pop(0))
                    size += len(self._inflight[-1].events)
                await self._commit_batch(self._inflight)
                self._inflight = []
        finally:  # cancelled (the loop is closing): nobody may wait forever, nor be told of a commit it lacks
            for queued in self._inflight:
                if not queued.done.done():
                    queued.done.set_exception(StoreError("the appender stopped during its commit: outcome unknown"))
            for queued in self._queue:
                if not queued.done.done():
                    queued.done.set_exception(StoreError("the event store closed before the append committed"))
            self._inflight, self._queue = [], []

    async def _commit_batch(self, batch: list[_Queued]) -> None:
        try:
            await self._commit(batch)
        except (DuplicateEvent, ConcurrencyConflict) as exc:
            if len(batch) > 1:
                for one in batch:  # keep the failure to the append that caused it
                    await self._commit_batch([one])
                return
            batch[0].done.set_exception(exc)
        except Exception as exc:
            for queued in batch:
                queued.done.set_exception(exc)
        else:
            for queued in batch:
                queued.done.set_result(None)

    async def _commit(self, batch: list[_Queued]) -> None:
        events = [e for queued in batch for e in queued.events]
        blobs = [b for queued in batch for b in queued.blobs]
        rollbacks, reconnected = 0, False
        while True:  # returns once committed; every other way out raises
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                conn = await self._connection()
                async with conn.pipeline(), conn.transaction():
                    await self.store._write(conn, events, "any", blobs, check=False)
                return
            except psycopg.IntegrityError as exc:
                if reconnected and await self._all_stored(events):
                    return  # the attempt whose connection was lost had committed
                raise integrity_error(exc, events) from exc
            except psycopg.errors.TransactionRollback:
                rollbacks += 1
                if rollbacks >= self.attempts:
                    raise
            except psycopg.OperationalError:
                if conn is not None and not (conn.broken or conn.closed):
                    raise  # the server refused the statement: retrying would not help
                await self._drop_connection()
                if reconnected:
                    raise
                reconnected = True

    async def _all_stored(self, events: list[Event]) -> bool:
        conn = await self._connection()
        cursor = await conn.execute("SELECT count(*) FROM events WHERE event_id = ANY(%s)",
                                    ([e.event_id for e in events],))
        row = await cursor.fetchone()
        await conn.rollback()  # the read opened a transaction
        return row is not None and row[0] == len(events)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        return await self._own.get()

    async def _drop_connection(self) -> None:
        await self._own.drop()


__all__ = ["GROUPED_APPENDER_NAME", "AppendTarget", "GroupedAppender"]
