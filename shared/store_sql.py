"""The execution log's PostgreSQL schema as the store writes it: tables, the hand-tuned statements of the hot
paths (append, blobs, tracking, the relay's read), their parameters, and the store's errors. No I/O here: the
store (shared/store.py) and its group-commit writer (shared/grouped_append.py) run these statements.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.effects import ExpectedVersion
from shared.events import Event
from shared.tokens import digest_of

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


# The relay's read: PostgreSQL renders each envelope as JSON text, so Python only forwards bytes.
READ_RAW = sa.text(
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

@dataclass(frozen=True)
class RunSummary:
    """One run's extent in the log: first and last position and time, and how many events it has."""

    run_id: str
    first_position: int
    last_position: int
    events: int
    first_at: datetime
    last_at: datetime


# One row per run: its extent in the log (by position and time) and its size, newest first.
RUN_SUMMARIES = (
    sa.select(events_table.c.run_id, sa.func.min(events_table.c.position), sa.func.max(events_table.c.position),
              sa.func.count(), sa.func.min(events_table.c.occurred_at), sa.func.max(events_table.c.occurred_at))
    .group_by(events_table.c.run_id)
    .order_by(sa.func.max(events_table.c.position).desc())
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
INSERT_BLOBS = """
    INSERT INTO blobs (digest, size, media_type, data)
    SELECT * FROM unnest(CAST(%(digest)b AS text[]), CAST(%(size)b AS bigint[]), CAST(%(media_type)b AS text[]),
                         CAST(%(data)b AS bytea[]))
    ON CONFLICT (digest) DO NOTHING
"""
LOCK = "SELECT pg_advisory_xact_lock(%s)"
APPEND = """
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


def blob_params(blobs: Sequence[tuple[bytes, str]]) -> dict[str, Any]:
    rows = sorted({digest_of(data): (len(data), media_type, data) for data, media_type in blobs}.items())
    return {
        "digest": [digest for digest, _ in rows],
        "size": [size for _, (size, _, _) in rows],
        "media_type": [media_type for _, (_, media_type, _) in rows],
        "data": [data for _, (_, _, data) in rows],
    }


def append_params(events: Sequence[Event], expected: ExpectedVersion, *, channel: str) -> dict[str, Any]:
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


def integrity_error(exc: psycopg.IntegrityError, events: Sequence[Event]) -> StoreError:
    if "event_id" in (exc.diag.constraint_name or ""):
        found = re.search(r"\(event_id\)=\(([0-9a-f-]{36})\)", exc.diag.message_detail or "")
        return DuplicateEvent(uuid.UUID(found.group(1)) if found else events[0].event_id)
    stream = events[0].stream_id if events else "?"
    return ConcurrencyConflict(stream, "a version being appended already exists")


# Once per handled event, in the handler's transaction: a plain statement on the driver costs a third less
# CPU than building and compiling the SQLAlchemy insert each time.
MARK_PROCESSED = "INSERT INTO tracking (consumer, event_id) VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING event_id"


IS_PROCESSED = "SELECT 1 FROM tracking WHERE consumer = %s AND event_id = %s"


async def driver_of(conn: AsyncConnection) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection under a SQLAlchemy one (same session, same transaction)."""
    driver: psycopg.AsyncConnection[Any] | None = (await conn.get_raw_connection()).driver_connection
    assert driver is not None
    return driver
