"""The event store on PostgreSQL: append-only events with a gap-free global position, consumers' tracking rows,
the relay's positions, and the Postgres backend of the blob store port (`PostgresBlobStore`).

Appends take a transaction-scoped advisory lock just before inserting and hold it until commit, so global
positions commit in order: a reader tailing `position > p` can never skip an event that commits late. The
statements are in shared/store_sql.py, the hot path's group commit in shared/grouped_append.py.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from shared.blobs import DEFAULT_MEDIA_TYPE, BlobLocation, BlobNotFound, blob_ref, checked
from shared.effects import Effects, ExpectedVersion
from shared.events import BlobRef, Event, parse_event
from shared.grouped_append import GROUPED_APPENDER_NAME, GroupedAppender
from shared.own_connection import OwnConnection
from shared.store_sql import (
    APPEND,
    INSERT_BLOBS,
    IS_PROCESSED,
    LOCK,
    MARK_PROCESSED,
    READ_RAW,
    RUN_SUMMARIES,
    RunSummary,
    ConcurrencyConflict,
    DuplicateEvent,
    StoreError,
    append_params,
    blob_params,
    blobs_table,
    driver_of,
    events_table,
    integrity_error,
    relay_table,
)

MIGRATIONS = Path(__file__).parent / "migrations"

@dataclass(frozen=True)
class StoredEvent:
    position: int
    event: Event


def async_url(url: str) -> str:
    """Accept `postgresql://` / `postgres://` URLs and select the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise StoreError(f"expected a postgresql:// URL, got {url!r}")


def run_migrations(url: str, schema: str | None = None) -> None:
    """Bring the database (and schema) up to the latest migration. Idempotent."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["url"] = async_url(url)
    config.attributes["schema"] = schema
    command.upgrade(config, "head")


def _lock_key(schema: str | None) -> int:
    return zlib.crc32(f"gyre-events:{schema or 'public'}".encode())


def notify_channel(schema: str | None) -> str:
    return f"gyre_events_{schema or 'public'}".lower()


def _row_body(row: Any) -> dict[str, Any]:
    return {
        "event_id": str(row.event_id),
        "type": row.type,
        "schema_version": row.schema_version,
        "run_id": row.run_id,
        "stream_id": row.stream_id,
        "version": row.version,
        "occurred_at": row.occurred_at.isoformat(),
        "causation_id": str(row.causation_id) if row.causation_id else None,
        "correlation_id": str(row.correlation_id) if row.correlation_id else None,
        "data": row.data,
    }


def _row_to_event(row: Any) -> StoredEvent:
    return StoredEvent(position=row.position, event=parse_event(_row_body(row)))


@dataclass(frozen=True)
class RawEvent:
    """An event as the relay forwards it: already-validated JSON bytes, not re-parsed on the hot path."""

    position: int
    event_id: uuid.UUID
    type: str
    payload: bytes


class Transaction:
    """One unit of work: tracking, service effects and appended events commit together or not at all.

    Appends are buffered and written at commit, so the ordering lock is held only for the final inserts.
    """

    def __init__(self, store: EventStore, connection: AsyncConnection) -> None:
        self.store = store
        self.connection = connection
        self._pending = Effects()

    def record(self, effects: Effects) -> None:
        """Commit a handler's effects with this transaction: its blobs and appends at commit, in order, then
        its callbacks once committed."""
        self._pending.blobs += effects.blobs
        self._pending.appends += effects.appends
        self._pending.callbacks += effects.callbacks

    def after_commit(self, callback: Callable[[], Any]) -> None:
        """Run `callback` once the transaction has committed (e.g. start work the commit made durable)."""
        self._pending.after_commit(callback)

    def append(self, events: Sequence[Event], *, expected_version: ExpectedVersion = None) -> None:
        self._pending.append(events, expected_version=expected_version)

    async def mark_processed(self, consumer: str, event_id: uuid.UUID) -> bool:
        """Record that `consumer` handled the event; False if it already had (the effect must be skipped)."""
        cursor = await (await driver_of(self.connection)).execute(MARK_PROCESSED, (consumer, event_id))
        return await cursor.fetchone() is not None

    async def _flush(self) -> list[int]:
        positions: list[int] = []
        driver = await driver_of(self.connection)
        if self._pending.blobs:
            await driver.execute(INSERT_BLOBS, blob_params(self._pending.blobs))
        for append in self._pending.appends:
            async with driver.pipeline():
                positions += await self.store._write(driver, append.events, append.expected_version)
        self._pending.blobs.clear()
        self._pending.appends.clear()
        return positions


class EventStore:
    """The execution log on PostgreSQL: append and read events (`append`, `read_stream`, `read_after`), the
    unit of work a handler's effects commit in with its tracking row (`transaction`, `is_processed`), and the
    relay's positions. Its blobs are `self.blobs`, the Postgres backend of the blob store port."""

    def __init__(self, engine: AsyncEngine, schema: str | None = None) -> None:
        self.engine = engine
        self.schema = schema
        self._lock_key = _lock_key(schema)
        self.channel = notify_channel(schema)
        self._grouped: GroupedAppender | None = None
        self._tracking = _TrackingReader(self)
        self.blobs = PostgresBlobStore(engine)

    @classmethod
    async def connect(cls, url: str, *, schema: str | None = None, migrate: bool = False, pool_size: int = 5) -> EventStore:
        if migrate:
            await asyncio.to_thread(run_migrations, url, schema)
        connect_args: dict[str, Any] = {}
        if schema:
            connect_args["options"] = f"-csearch_path={schema}"
        engine = create_async_engine(
            async_url(url), connect_args=connect_args, pool_size=pool_size, pool_pre_ping=True
        )
        try:
            async with engine.connect() as conn:  # fail here, not on first use, when the server is away
                await conn.execute(sa.text("SELECT 1"))
        except Exception:
            await engine.dispose()
            raise
        return cls(engine, schema)

    async def close(self) -> None:
        if self._grouped is not None:
            await self._grouped.close()
        await self._tracking.close()
        await self.engine.dispose()

    def dsn(self) -> str:
        """A libpq connection string for this store's database (for connections outside the pool)."""
        return self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

    # ---- transactions ----

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        async with self.engine.connect() as conn:
            async with conn.begin():
                tx = Transaction(self, conn)
                yield tx
                await tx._flush()
        for callback in tx._pending.callbacks:
            result = callback()
            if asyncio.iscoroutine(result):
                await result

    # ---- events ----

    async def append(
        self,
        events: Sequence[Event],
        *,
        expected_version: ExpectedVersion = None,
        blobs: Sequence[tuple[bytes, str]] = (),
    ) -> list[int]:
        """Append events atomically, with any blobs they refer to, and return the events' global positions.

        expected_version: None = the events' own versions must be free; int = the stream (all events share
        one) must currently be at that version; "any" = the store assigns the next versions per stream.
        blobs: (data, media type) pairs written in the same transaction (their references: `blob_ref`).
        """
        async with self.engine.connect() as conn:
            driver = await driver_of(conn)
            async with driver.pipeline(), driver.transaction():
                return await self._write(driver, events, expected_version, blobs)

    async def append_grouped(self, events: Sequence[Event], *, blobs: Sequence[tuple[bytes, str]] = ()) -> None:
        """Append events the store versions ("any"), with their blobs, committed together with the appends of
        other concurrent callers (group commit). For hot paths: see `GroupedAppender`."""
        if self._grouped is None:
            self._grouped = GroupedAppender(self)
        await self._grouped.append(events, blobs)

    async def _append(self, conn: AsyncConnection, events: Sequence[Event], expected: ExpectedVersion) -> list[int]:
        """Append inside the caller's transaction (it holds the ordering lock until it commits)."""
        driver = await driver_of(conn)
        async with driver.pipeline():
            return await self._write(driver, events, expected)

    async def _write(
        self,
        driver: psycopg.AsyncConnection[Any],
        events: Sequence[Event],
        expected: ExpectedVersion,
        blobs: Sequence[tuple[bytes, str]] = (),
        *,
        check: bool = True,
    ) -> list[int]:
        """Send an append's statements on `driver`, in pipeline mode and inside its open transaction, and with
        `check` wait for them (one round trip) and return the events' positions. Without it nothing is waited
        for; the caller's commit reports any error."""
        streams = {e.stream_id for e in events}
        if isinstance(expected, int) and len(streams) > 1:
            raise StoreError(f"an expected version applies to one stream; got events for {sorted(streams)}")
        if blobs:
            await driver.execute(INSERT_BLOBS, blob_params(blobs))
        if not events:
            return []
        await driver.execute(LOCK, (self._lock_key,))
        try:
            cursor = await driver.execute(APPEND, append_params(events, expected, channel=self.channel))
            if not check:
                return []
            positions = [r[0] for r in await cursor.fetchall()]
        except psycopg.IntegrityError as exc:
            raise integrity_error(exc, events) from exc
        if len(positions) != len(events):  # the expected-version guard held the rows back
            (stream,) = streams
            cursor = await driver.execute("SELECT COALESCE(max(version), 0) FROM events WHERE stream_id = %s",
                                          (stream,))
            head = (await cursor.fetchone() or (0,))[0]
            raise ConcurrencyConflict(stream, f"expected version {expected}, stream is at {head}")
        return positions

    async def _stream_versions(self, conn: AsyncConnection, streams: Iterable[str]) -> dict[str, int]:
        streams = list(streams)
        stmt = (
            sa.select(events_table.c.stream_id, sa.func.max(events_table.c.version))
            .where(events_table.c.stream_id.in_(streams))
            .group_by(events_table.c.stream_id)
        )
        found = {row[0]: row[1] for row in await conn.execute(stmt)}
        return {s: int(found.get(s) or 0) for s in streams}

    async def stream_version(self, stream_id: str) -> int:
        async with self.engine.connect() as conn:
            return (await self._stream_versions(conn, [stream_id]))[stream_id]

    async def read_stream(self, stream_id: str, *, from_version: int = 1) -> list[StoredEvent]:
        stmt = (
            sa.select(events_table)
            .where(events_table.c.stream_id == stream_id, events_table.c.version >= from_version)
            .order_by(events_table.c.version)
        )
        async with self.engine.connect() as conn:
            return [_row_to_event(r) for r in await conn.execute(stmt)]

    async def read_after(
        self,
        position: int,
        *,
        limit: int = 1000,
        types: Sequence[str] | None = None,
        run_id: str | None = None,
    ) -> list[StoredEvent]:
        """Events with a global position above `position`, in commit order."""
        stmt = sa.select(events_table).where(events_table.c.position > position)
        if types:
            stmt = stmt.where(events_table.c.type.in_(list(types)))
        if run_id:
            stmt = stmt.where(events_table.c.run_id == run_id)
        stmt = stmt.order_by(events_table.c.position).limit(limit)
        async with self.engine.connect() as conn:
            return [_row_to_event(r) for r in await conn.execute(stmt)]

    async def read_after_raw(self, position: int, *, limit: int = 1000) -> list[RawEvent]:
        """Like read_after, but as JSON bytes: events were validated when appended, so the relay skips
        rebuilding pydantic models for each one."""
        async with self.engine.connect() as conn:
            rows = list(await conn.execute(READ_RAW, {"position": position, "limit": limit}))
        return [RawEvent(position=r[0], event_id=r[1], type=r[2], payload=r[3].encode()) for r in rows]

    async def read_all(self, *, types: Sequence[str] | None = None, run_id: str | None = None) -> list[StoredEvent]:
        out: list[StoredEvent] = []
        while page := await self.read_after(out[-1].position if out else 0, limit=5000, types=types, run_id=run_id):
            out += page
        return out

    async def runs(self, *, limit: int = 200) -> list[RunSummary]:
        """The runs in the log, the one written to last first."""
        async with self.engine.connect() as conn:
            return [RunSummary(*row) for row in await conn.execute(RUN_SUMMARIES.limit(limit))]

    async def holds(self, event_ids: Iterable[uuid.UUID]) -> bool:
        """Whether every one of these events is in the log (a write retried after losing its answer)."""
        wanted = set(event_ids)
        async with self.engine.connect() as conn:
            found = await conn.execute(sa.select(events_table.c.event_id).where(events_table.c.event_id.in_(wanted)))
            return {row[0] for row in found} == wanted

    async def head_position(self) -> int:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(sa.func.max(events_table.c.position)))).scalar()
        return int(value or 0)

    # ---- tracking and positions ----

    async def is_processed(self, consumer: str, event_id: uuid.UUID) -> bool:
        """Whether `consumer` recorded handling the event (the runtime's check before a handler computes)."""
        return await self._tracking.is_processed(consumer, event_id)

    async def get_position(self, name: str) -> int:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(relay_table.c.position).where(relay_table.c.name == name))).scalar()
        return int(value or 0)

    async def set_position(self, name: str, position: int) -> None:
        stmt = postgresql.insert(relay_table).values(name=name, position=position)
        stmt = stmt.on_conflict_do_update(
            index_elements=[relay_table.c.name],
            set_={"position": stmt.excluded.position, "updated_at": sa.func.now()},
        )
        async with self.engine.connect() as conn:
            async with conn.begin():
                await conn.execute(stmt)


def processed_check_name(schema: str | None) -> str:
    """The `application_name` of a store's processed-check connection (its schema's, in pg_stat_activity)."""
    return f"gyre-processed-check:{schema or 'public'}"[:63]


class _TrackingReader:
    """`is_processed` on an autocommit connection of its own: every handled event asks it first, and a pooled
    checkout (with its pre-ping round trip) and a compiled SQLAlchemy select cost ten times the query's CPU
    (≈ 880 against ≈ 80 µs measured). One query at a time (a connection runs one); a lost connection is
    opened again once."""

    def __init__(self, store: EventStore) -> None:
        self._own = OwnConnection(store.dsn(), store.schema, autocommit=True,
                                  application_name=processed_check_name(store.schema))
        self._lock = asyncio.Lock()

    async def is_processed(self, consumer: str, event_id: uuid.UUID) -> bool:
        async with self._lock:
            for attempt in (1, 2):
                try:
                    cursor = await (await self._own.get()).execute(IS_PROCESSED, (consumer, event_id))
                    return await cursor.fetchone() is not None
                except psycopg.OperationalError:
                    await self._own.drop()
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self._own.drop()


class PostgresBlobStore:
    """The blob store port's Postgres backend (`store="pg"`): blobs beside the events that refer to them.

    A handler's own blobs are written in its transaction (`Effects.put_blob`); this writes one on its own."""

    location: BlobLocation = "pg"

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def put(self, data: bytes, media_type: str = DEFAULT_MEDIA_TYPE) -> BlobRef:
        async with self.engine.connect() as conn:
            async with conn.begin():
                await (await driver_of(conn)).execute(INSERT_BLOBS, blob_params([(data, media_type)]))
        return blob_ref(data, media_type)

    async def get(self, ref: BlobRef) -> bytes:
        async with self.engine.connect() as conn:
            stmt = sa.select(blobs_table.c.data).where(blobs_table.c.digest == ref.digest)
            data = (await conn.execute(stmt)).scalar()
        if data is None:
            raise BlobNotFound(ref.digest)
        return checked(ref, bytes(data))

    async def has(self, ref: BlobRef) -> bool:
        async with self.engine.connect() as conn:
            stmt = sa.select(blobs_table.c.digest).where(blobs_table.c.digest == ref.digest)
            return (await conn.execute(stmt)).first() is not None

    async def delete(self, ref: BlobRef) -> bool:
        async with self.engine.connect() as conn:
            async with conn.begin():
                result = await conn.execute(sa.delete(blobs_table).where(blobs_table.c.digest == ref.digest))
        return bool(result.rowcount)


__all__ = [
    "GROUPED_APPENDER_NAME", "ConcurrencyConflict", "DuplicateEvent", "EventStore", "ExpectedVersion",
    "PostgresBlobStore", "RawEvent", "RunSummary", "StoreError", "StoredEvent", "Transaction", "async_url",
    "notify_channel", "processed_check_name", "run_migrations",
]
