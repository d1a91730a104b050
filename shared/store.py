"""The event store on PostgreSQL: append-only events with a gap-free global position, blobs, tracking.

Appends take a transaction-scoped advisory lock just before inserting and hold it until commit, so global
positions commit in order: a reader tailing `position > p` can never skip an event that commits late.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
import zlib
import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psycopg
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from shared.events import BlobRef, Event, parse_event
from shared.tokens import digest_of

MIGRATIONS = Path(__file__).parent / "migrations"

metadata = sa.MetaData()
events_table = sa.Table(
    "events",
    metadata,
    sa.Column("position", sa.BigInteger, primary_key=True),
    sa.Column("event_id", postgresql.UUID(as_uuid=True)),
    sa.Column("stream_id", sa.Text),
    sa.Column("version", sa.Integer),
    sa.Column("type", sa.Text),
    sa.Column("schema_version", sa.Integer),
    sa.Column("run_id", sa.Text),
    sa.Column("occurred_at", sa.DateTime(timezone=True)),
    sa.Column("causation_id", postgresql.UUID(as_uuid=True)),
    sa.Column("correlation_id", postgresql.UUID(as_uuid=True)),
    sa.Column("data", postgresql.JSONB),
)
blobs_table = sa.Table(
    "blobs",
    metadata,
    sa.Column("digest", sa.Text, primary_key=True),
    sa.Column("size", sa.BigInteger),
    sa.Column("media_type", sa.Text),
    sa.Column("data", sa.LargeBinary),
)
tracking_table = sa.Table(
    "tracking",
    metadata,
    sa.Column("consumer", sa.Text, primary_key=True),
    sa.Column("event_id", postgresql.UUID(as_uuid=True), primary_key=True),
)
relay_table = sa.Table(
    "relay_positions",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("position", sa.BigInteger),
    sa.Column("updated_at", sa.DateTime(timezone=True)),
)

ExpectedVersion = int | Literal["any"] | None

# The relay's read: PostgreSQL renders each envelope as JSON text, so Python only forwards bytes.
_READ_RAW = sa.text(
    """
    SELECT position, event_id, type,
           json_build_object(
               'event_id', event_id, 'type', type, 'schema_version', schema_version, 'run_id', run_id,
               'stream_id', stream_id, 'version', version, 'occurred_at', occurred_at,
               'causation_id', causation_id, 'correlation_id', correlation_id, 'data', data
           )::text
    FROM events WHERE position > :position ORDER BY position LIMIT :limit
    """
)

# An append is three statements pipelined into one round trip, inside a transaction: the blobs its events refer
# to, the ordering lock, then the events (all through psycopg with binary array parameters, `%(name)b`: the text
# format would quote and escape every JSON document and timestamp into an array literal, which costs more CPU
# than the insert). Blobs go first so that no transaction writes a blob while it holds the lock (one that wrote
# the same blob first and waits for the lock would deadlock with it), in digest order for the same reason.
# `_APPEND` runs after the lock statement, so its snapshot sees every earlier append and stream heads are
# exact. Versions are assigned when `assign` is set: the stream's head plus the event's rank in its stream. With
# `expected` set, the rows are inserted only if the stream's head is at it; a short RETURNING tells the caller
# it was not. The relay's wake-up rides along (only a wake-up: equal payloads collapse to one per commit).
_INSERT_BLOBS = """
    INSERT INTO blobs (digest, size, media_type, data)
    SELECT * FROM unnest(CAST(%(digest)b AS text[]), CAST(%(size)b AS bigint[]), CAST(%(media_type)b AS text[]),
                         CAST(%(data)b AS bytea[]))
    ON CONFLICT (digest) DO NOTHING
"""
_LOCK = "SELECT pg_advisory_xact_lock(%s)"
_APPEND = """
    WITH inserted AS (
        INSERT INTO events (event_id, stream_id, version, type, schema_version, run_id, occurred_at,
                            causation_id, correlation_id, data)
        SELECT t.event_id, t.stream_id,
               CASE WHEN %(assign)s
                    THEN COALESCE(h.head, 0) + row_number() OVER (PARTITION BY t.stream_id ORDER BY t.ord)
                    ELSE t.version END,
               t.type, t.schema_version, t.run_id, t.occurred_at, t.causation_id, t.correlation_id, t.data
        FROM unnest(
            CAST(%(event_id)b AS uuid[]), CAST(%(stream_id)b AS text[]), CAST(%(version)b AS int[]),
            CAST(%(type)b AS text[]), CAST(%(schema_version)b AS int[]), CAST(%(run_id)b AS text[]),
            CAST(%(occurred_at)b AS timestamptz[]), CAST(%(causation_id)b AS uuid[]),
            CAST(%(correlation_id)b AS uuid[]), CAST(%(data)b AS jsonb[])
        ) WITH ORDINALITY AS t(event_id, stream_id, version, type, schema_version, run_id, occurred_at,
                               causation_id, correlation_id, data, ord)
        LEFT JOIN LATERAL (SELECT max(e.version) AS head FROM events e WHERE e.stream_id = t.stream_id) h
               ON %(assign)s
        WHERE CAST(%(expected)s AS int) IS NULL OR COALESCE(h.head, 0) = CAST(%(expected)s AS int)
        ORDER BY t.ord
        RETURNING position
    )
    SELECT inserted.position FROM inserted CROSS JOIN (SELECT pg_notify(%(channel)s, '')) AS woken
    ORDER BY inserted.position
"""


def _blob_params(blobs: Sequence[tuple[bytes, str]]) -> dict[str, Any]:
    rows = sorted({digest_of(data): (len(data), media_type, data) for data, media_type in blobs}.items())
    return {
        "digest": [digest for digest, _ in rows],
        "size": [size for _, (size, _, _) in rows],
        "media_type": [media_type for _, (_, media_type, _) in rows],
        "data": [data for _, (_, _, data) in rows],
    }


def _append_params(events: Sequence[Event], expected: ExpectedVersion, *, channel: str) -> dict[str, Any]:
    return {
        "channel": channel,
        "event_id": [e.event_id for e in events],
        "stream_id": [e.stream_id for e in events],
        "version": [e.version for e in events],
        "type": [e.type for e in events],
        "schema_version": [e.schema_version for e in events],
        "run_id": [e.run_id for e in events],
        "occurred_at": [e.occurred_at for e in events],
        "causation_id": [e.causation_id for e in events],
        "correlation_id": [e.correlation_id for e in events],
        "data": [e.data.model_dump_json() for e in events],
        "assign": expected is not None,
        "expected": expected if isinstance(expected, int) else None,
    }


def _integrity_error(exc: psycopg.IntegrityError, events: Sequence[Event]) -> StoreError:
    if "event_id" in (exc.diag.constraint_name or ""):
        found = re.search(r"\(event_id\)=\(([0-9a-f-]{36})\)", exc.diag.message_detail or "")
        return DuplicateEvent(uuid.UUID(found.group(1)) if found else events[0].event_id)
    stream = events[0].stream_id if events else "?"
    return ConcurrencyConflict(stream, "a version being appended already exists")


# Once per handled event, in the handler's transaction: a plain statement on the driver costs a third less
# CPU than building and compiling the SQLAlchemy insert each time.
_MARK_PROCESSED = "INSERT INTO tracking (consumer, event_id) VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING event_id"


def blob_ref(data: bytes, media_type: str = "application/octet-stream") -> BlobRef:
    """The reference a blob gets in the store (content-addressed): known before it is written."""
    return BlobRef(digest=digest_of(data), size=len(data), media_type=media_type, store="pg")


async def _driver(conn: AsyncConnection) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection under a SQLAlchemy one (same session, same transaction)."""
    driver: psycopg.AsyncConnection[Any] | None = (await conn.get_raw_connection()).driver_connection
    assert driver is not None
    return driver


class StoreError(Exception):
    pass


class ConcurrencyConflict(StoreError):
    """Another writer appended to the stream first (a `(stream_id, version)` key violation)."""

    def __init__(self, stream_id: str, detail: str) -> None:
        super().__init__(f"concurrency conflict on stream {stream_id!r}: {detail}")
        self.stream_id = stream_id


class DuplicateEvent(StoreError):
    def __init__(self, event_id: uuid.UUID) -> None:
        super().__init__(f"event {event_id} is already in the log")
        self.event_id = event_id


class BlobNotFound(StoreError):
    def __init__(self, digest: str) -> None:
        super().__init__(f"no blob with digest {digest}")
        self.digest = digest


class BlobCorrupted(StoreError):
    def __init__(self, digest: str, actual: str) -> None:
        super().__init__(f"blob {digest} reads back with digest {actual}")


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
        self._pending: list[tuple[list[Event], ExpectedVersion]] = []
        self._after_commit: list[Callable[[], Any]] = []

    def after_commit(self, callback: Callable[[], Any]) -> None:
        """Run `callback` once the transaction has committed (e.g. start work the commit made durable)."""
        self._after_commit.append(callback)

    def append(self, events: Sequence[Event], *, expected_version: ExpectedVersion = None) -> None:
        self._pending.append((list(events), expected_version))

    async def put_blob(self, data: bytes, media_type: str = "application/octet-stream") -> BlobRef:
        await (await _driver(self.connection)).execute(_INSERT_BLOBS, _blob_params([(data, media_type)]))
        return blob_ref(data, media_type)

    async def mark_processed(self, consumer: str, event_id: uuid.UUID) -> bool:
        """Record that `consumer` handled the event; False if it already had (the effect must be skipped)."""
        cursor = await (await _driver(self.connection)).execute(_MARK_PROCESSED, (consumer, event_id))
        return await cursor.fetchone() is not None

    async def _flush(self) -> list[int]:
        positions: list[int] = []
        driver = await _driver(self.connection)
        for events, expected in self._pending:
            async with driver.pipeline():
                positions += await self.store._write(driver, events, expected)
        self._pending.clear()
        return positions


class EventStore:
    """Ports: append / read_stream / read_after (events), put_blob / get_blob (blobs), tracking, positions."""

    def __init__(self, engine: AsyncEngine, schema: str | None = None) -> None:
        self.engine = engine
        self.schema = schema
        self._lock_key = _lock_key(schema)
        self.channel = notify_channel(schema)
        self._grouped: GroupedAppender | None = None

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
        for callback in tx._after_commit:
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
            driver = await _driver(conn)
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
        driver = await _driver(conn)
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
            await driver.execute(_INSERT_BLOBS, _blob_params(blobs))
        if not events:
            return []
        await driver.execute(_LOCK, (self._lock_key,))
        try:
            cursor = await driver.execute(_APPEND, _append_params(events, expected, channel=self.channel))
            if not check:
                return []
            positions = [r[0] for r in await cursor.fetchall()]
        except psycopg.IntegrityError as exc:
            raise _integrity_error(exc, events) from exc
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
            rows = list(await conn.execute(_READ_RAW, {"position": position, "limit": limit}))
        return [RawEvent(position=r[0], event_id=r[1], type=r[2], payload=r[3].encode()) for r in rows]

    async def read_all(self, *, types: Sequence[str] | None = None, run_id: str | None = None) -> list[StoredEvent]:
        out: list[StoredEvent] = []
        position = 0
        while True:
            page = await self.read_after(position, limit=5000, types=types, run_id=run_id)
            if not page:
                return out
            out += page
            position = page[-1].position

    async def head_position(self) -> int:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(sa.func.max(events_table.c.position)))).scalar()
        return int(value or 0)

    # ---- blobs ----

    async def put_blob(self, data: bytes, media_type: str = "application/octet-stream") -> BlobRef:
        async with self.engine.connect() as conn:
            async with conn.begin():
                return await self._put_blob(conn, data, media_type)

    async def _put_blob(self, conn: AsyncConnection, data: bytes, media_type: str) -> BlobRef:
        await (await _driver(conn)).execute(_INSERT_BLOBS, _blob_params([(data, media_type)]))
        return blob_ref(data, media_type)

    async def get_blob(self, ref: BlobRef | str) -> bytes:
        digest = ref.digest if isinstance(ref, BlobRef) else ref
        async with self.engine.connect() as conn:
            data = (await conn.execute(sa.select(blobs_table.c.data).where(blobs_table.c.digest == digest))).scalar()
        if data is None:
            raise BlobNotFound(digest)
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise BlobCorrupted(digest, actual)
        return bytes(data)

    async def has_blob(self, digest: str) -> bool:
        async with self.engine.connect() as conn:
            stmt = sa.select(blobs_table.c.digest).where(blobs_table.c.digest == digest)
            return (await conn.execute(stmt)).first() is not None

    # ---- tracking and positions ----

    async def is_processed(self, consumer: str, event_id: uuid.UUID) -> bool:
        stmt = sa.select(tracking_table.c.event_id).where(
            tracking_table.c.consumer == consumer, tracking_table.c.event_id == event_id
        )
        async with self.engine.connect() as conn:
            return (await conn.execute(stmt)).first() is not None

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

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._queue: list[_Queued] = []
        self._inflight: list[_Queued] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._conn: psycopg.AsyncConnection[Any] | None = None
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
                raise _integrity_error(exc, events) from exc
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
        if self._conn is None or self._conn.closed:
            if self.store.schema:  # otherwise the URL's own options stand
                self._conn = await psycopg.AsyncConnection.connect(
                    self.store.dsn(), application_name=GROUPED_APPENDER_NAME,
                    options=f"-csearch_path={self.store.schema}",
                )
            else:
                self._conn = await psycopg.AsyncConnection.connect(
                    self.store.dsn(), application_name=GROUPED_APPENDER_NAME
                )
        return self._conn

    async def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            except psycopg.Error:
                pass
            self._conn = None
