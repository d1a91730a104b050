"""Contract suite for the event store port, run against a real PostgreSQL per backend (embedded and by URL).

Its blobs have their own suite (test_blob_contract.py), shared with the other blob backends."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from shared.events import CellAssigned, Event, new_event
from shared.blobs import blob_ref
from shared.grouped_append import GROUPED_APPENDER_NAME, GroupedAppender
from shared.store import ConcurrencyConflict, DuplicateEvent, EventStore, StoreError, processed_check_name
from tests.conftest import drop_store, make_store
from tests.shared.helpers import assigned


@pytest.fixture
async def es(backend):
    store = await make_store(backend.database_url)
    yield store
    await drop_store(store)


async def test_append_returns_increasing_positions_and_reads_back(es: EventStore):
    events = [assigned("cell-a", v) for v in (1, 2, 3)]
    positions = await es.append(events)
    assert positions == sorted(positions) and len(set(positions)) == 3
    stream = await es.read_stream("cell-a")
    assert [s.event for s in stream] == events
    assert [s.position for s in stream] == positions
    assert await es.stream_version("cell-a") == 3


async def test_explicit_version_conflict_is_a_named_error(es: EventStore):
    await es.append([assigned("cell-a", 1)])
    with pytest.raises(ConcurrencyConflict, match="cell-a"):
        await es.append([assigned("cell-a", 1)])
    with pytest.raises(ConcurrencyConflict, match="expected version 0"):
        await es.append([assigned("cell-a")], expected_version=0)
    await es.append([assigned("cell-a")], expected_version=1)
    assert await es.stream_version("cell-a") == 2


async def test_any_version_appends_at_the_stream_end(es: EventStore):
    await es.append([assigned("cell-a", 1)])
    await es.append([assigned("cell-a"), assigned("cell-b"), assigned("cell-a")], expected_version="any")
    assert [s.event.version for s in await es.read_stream("cell-a")] == [1, 2, 3]
    assert [s.event.version for s in await es.read_stream("cell-b")] == [1]


async def test_a_failed_append_writes_nothing(es: EventStore):
    await es.append([assigned("cell-a", 2)])
    with pytest.raises(ConcurrencyConflict):
        await es.append([assigned("cell-b", 1), assigned("cell-a", 2)])
    assert await es.read_stream("cell-b") == []


async def test_the_same_event_twice_is_refused(es: EventStore):
    event = assigned("cell-a", 1)
    await es.append([event])
    with pytest.raises(DuplicateEvent):
        await es.append([event.model_copy(update={"stream_id": "cell-z"})])


async def test_read_after_filters_by_type_and_run(es: EventStore):
    await es.append([assigned("cell-a", 1, run_id="r1"), assigned("cell-b", 1, run_id="r2")])
    assert len(await es.read_after(0)) == 2
    assert [s.event.run_id for s in await es.read_after(0, run_id="r2")] == ["r2"]
    assert await es.read_after(0, types=["cell.ready"]) == []
    first = (await es.read_after(0, limit=1))[0]
    assert [s.event.stream_id for s in await es.read_after(first.position)] == ["cell-b"]


async def test_tracking_commits_with_effects_or_not_at_all(es: EventStore):
    event = assigned("cell-a", 1)
    with pytest.raises(RuntimeError):
        async with es.transaction() as tx:
            assert await tx.mark_processed("svc", event.event_id)
            tx.append([assigned("cell-out", 1)])
            raise RuntimeError("crash inside the handler")
    assert not await es.is_processed("svc", event.event_id)
    assert await es.read_stream("cell-out") == []
    async with es.transaction() as tx:
        assert await tx.mark_processed("svc", event.event_id)
        tx.append([assigned("cell-out", 1)])
    async with es.transaction() as tx:
        assert not await tx.mark_processed("svc", event.event_id)
    assert await es.is_processed("svc", event.event_id)
    assert not await es.is_processed("other", event.event_id)
    assert len(await es.read_stream("cell-out")) == 1


async def test_the_processed_check_survives_losing_its_connection(es: EventStore):
    """Every handled event asks `is_processed` first, on a connection of the store's own: a server that drops it
    (a restart, an idle timeout) costs one reconnect, not the service."""
    event = assigned("cell-a", 1)
    async with es.transaction() as tx:
        await tx.mark_processed("svc", event.event_id)
    assert await es.is_processed("svc", event.event_id)
    async with es.engine.connect() as conn:  # this store's check only: other stores may share the database
        killed = (await conn.execute(sa.text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND application_name = :name"
        ), {"name": processed_check_name(es.schema)})).scalar()
    assert killed == 1
    assert await es.is_processed("svc", event.event_id)
    assert not await es.is_processed("svc", assigned("cell-b", 1).event_id)


async def test_positions_are_saved_per_name(es: EventStore):
    assert await es.get_position("relay") == 0
    await es.set_position("relay", 42)
    await es.set_position("relay", 43)
    assert await es.get_position("relay") == 43
    assert await es.get_position("other") == 0


async def test_two_writers_racing_on_one_stream_give_one_conflict(es: EventStore):
    await es.append([assigned("cell-a", 1)])

    async def writer(tag: str):
        event = assigned("cell-a", 2, role="train" if tag == "x" else "rollout")
        try:
            await es.append([event], expected_version=1)
            return "ok"
        except ConcurrencyConflict:
            return "conflict"

    results = await asyncio.gather(*(writer(t) for t in "xyxyxy"))
    assert sorted(results) == ["conflict"] * 5 + ["ok"]
    stream = await es.read_stream("cell-a")
    assert [s.event.version for s in stream] == [1, 2]
    assert isinstance(stream[1].event.data, CellAssigned)


async def test_a_tailing_reader_never_skips_a_late_commit(es: EventStore):
    """Transaction A appends first but commits last; the reader must still see every event, in order."""
    seen: list[str] = []
    stop = asyncio.Event()

    async def tail():
        position = 0
        while not stop.is_set() or await es.read_after(position):
            for stored in await es.read_after(position):
                seen.append(stored.event.stream_id)
                position = stored.position
            await asyncio.sleep(0.005)

    reader = asyncio.create_task(tail())
    a_inside = asyncio.Event()
    release_a = asyncio.Event()

    async def slow_writer():
        async with es.transaction() as tx:
            tx.append([assigned("cell-slow", 1)])
            a_inside.set()
            await release_a.wait()  # held open: A's append is flushed only when it commits

    async def fast_writers():
        await a_inside.wait()
        for i in range(20):
            await es.append([assigned(f"cell-fast{i}", 1)])

    a = asyncio.create_task(slow_writer())
    fast = asyncio.create_task(fast_writers())
    await asyncio.sleep(0.2)
    release_a.set()
    await asyncio.gather(a, fast)
    stop.set()
    await reader
    stored = await es.read_after(0, limit=100)
    assert [s.position for s in stored] == sorted(s.position for s in stored)
    assert seen == [s.event.stream_id for s in stored]
    assert len(seen) == 21


@pytest.mark.parametrize("grouped", [False, True], ids=["append", "append_grouped"])
async def test_a_held_append_lock_orders_commits(es: EventStore, grouped: bool):
    """Even when A takes its position first and B must wait, a reader never sees B before A (B on another
    stream, so only the ordering lock can make it wait)."""
    async with es.engine.connect() as conn_a:
        trans = await conn_a.begin()
        await es._append(conn_a, [assigned("cell-a", 1)], None)  # holds the ordering lock, uncommitted
        event = assigned("cell-b", 1)
        b = asyncio.create_task(es.append_grouped([event]) if grouped else es.append([event]))
        await asyncio.sleep(0.3)
        assert not b.done(), "B must wait for A's commit"
        assert await es.read_after(0) == []
        await trans.commit()
    await b
    assert [s.event.stream_id for s in await es.read_after(0)] == ["cell-a", "cell-b"]


async def test_raw_reads_parse_back_to_the_same_events(es: EventStore):
    from shared.events import parse_event

    events = [assigned(f"cell-{i}", 1) for i in range(5)]
    await es.append(events)
    raw = await es.read_after_raw(0)
    assert [parse_event(r.payload) for r in raw] == events
    assert [r.position for r in raw] == [s.position for s in await es.read_after(0)]


async def test_after_commit_callbacks_run_only_after_a_commit(es: EventStore):
    ran: list[str] = []
    async with es.transaction() as tx:
        tx.after_commit(lambda: ran.append("sync"))

        async def later() -> None:
            ran.append("async")

        tx.after_commit(later)
        assert ran == []
    assert ran == ["sync", "async"]
    with pytest.raises(RuntimeError):
        async with es.transaction() as tx:
            tx.after_commit(lambda: ran.append("never"))
            raise RuntimeError("rolled back")
    assert ran == ["sync", "async"]


async def test_grouped_appends_version_each_stream_in_call_order(es: EventStore):
    """Concurrent callers' appends commit together; each stream still gets gap-free versions in call order."""
    await es.append([assigned("cell-a", 1)])

    def tagged(stream: str, tag: str) -> Event:
        data = CellAssigned(cell_id=stream.removeprefix("cell-"), role="rollout", policy="async", reason=tag)
        return new_event(data, run_id="r", stream_id=stream, version=1, occurred_at=datetime.now(UTC))

    async def caller(i: int) -> None:
        stream = f"cell-{'ab'[i % 2]}"
        blob = f"record {i}".encode()
        await es.append_grouped([tagged(stream, f"r{i}"), tagged(stream, f"s{i}")], blobs=[(blob, "text/plain")])

    await asyncio.gather(*(caller(i) for i in range(20)))
    for stream in ("cell-a", "cell-b"):
        stored = await es.read_stream(stream)
        assert [s.event.version for s in stored] == list(range(1, len(stored) + 1))
    # In the log's order (positions), each append's events together and the appends in the order they were made.
    in_log = [(s.event.stream_id, s.event.data.reason) for s in (await es.read_after(0, limit=100))[1:]]
    assert in_log == [(f"cell-{'ab'[i % 2]}", f"{tag}{i}") for i in range(20) for tag in "rs"]
    for i in range(20):
        assert await es.blobs.get(blob_ref(f"record {i}".encode(), "text/plain")) == f"record {i}".encode()


async def test_a_duplicate_in_a_grouped_commit_fails_only_its_own_append(es: EventStore):
    stored = assigned("cell-a", 1)
    await es.append([stored])
    results = await asyncio.gather(
        es.append_grouped([assigned("cell-b")]),
        es.append_grouped([assigned("cell-d"), stored]),
        es.append_grouped([assigned("cell-c")]),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], DuplicateEvent) and results[1].event_id == stored.event_id
    assert await es.read_stream("cell-d") == [], "a failed append writes nothing"
    assert len(await es.read_stream("cell-b")) == len(await es.read_stream("cell-c")) == 1
    assert len(await es.read_stream("cell-a")) == 1


async def test_a_grouped_append_after_a_held_append_takes_the_next_version(es: EventStore):
    async with es.engine.connect() as conn:
        trans = await conn.begin()
        await es._append(conn, [assigned("cell-a", 1)], None)  # holds the ordering lock, uncommitted
        grouped = asyncio.create_task(es.append_grouped([assigned("cell-a")]))
        await asyncio.sleep(0.3)
        assert not grouped.done(), "the grouped append must wait for the lock"
        await trans.commit()
    await grouped
    stored = await es.read_stream("cell-a")
    assert [s.event.version for s in stored] == [1, 2]
    assert [s.position for s in stored] == sorted(s.position for s in stored)


async def test_a_grouped_append_survives_a_lost_connection(es: EventStore):
    await es.append_grouped([assigned("cell-a")])
    async with es.engine.connect() as conn:
        pids = (await conn.execute(sa.text(
            "SELECT pid FROM pg_stat_activity WHERE application_name = :name"), {"name": GROUPED_APPENDER_NAME})
        ).scalars().all()
        assert pids, "the grouped appender's connection should be visible"
        for pid in pids:
            await conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    await es.append_grouped([assigned("cell-a")])
    assert [s.event.version for s in await es.read_stream("cell-a")] == [1, 2]


async def test_closing_the_store_commits_queued_grouped_appends(backend):
    store = await make_store(backend.database_url)
    try:
        pending = [asyncio.create_task(store.append_grouped([assigned(f"cell-{i}")])) for i in range(5)]
        await asyncio.sleep(0)
        assert store._grouped is not None
        await store._grouped.close()
        await asyncio.gather(*pending)
        assert [len(await store.read_stream(f"cell-{i}")) for i in range(5)] == [1] * 5
        with pytest.raises(StoreError, match="closed"):
            await store.append_grouped([assigned("cell-x")])
    finally:
        await drop_store(store)


async def test_a_grouped_append_that_cannot_reach_the_database_raises(es: EventStore, monkeypatch):
    import psycopg

    monkeypatch.setattr(es, "dsn", lambda: "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2")
    with pytest.raises(psycopg.OperationalError):
        await es.append_grouped([assigned("cell-a")])
    monkeypatch.undo()
    assert await es.read_stream("cell-a") == []


async def test_an_append_of_no_events_writes_nothing_and_returns_no_positions(es: EventStore):
    assert await es.append([], expected_version=3) == []
    await es.append_grouped([])
    assert await es.read_after(0) == []


async def test_a_grouped_appender_stopped_mid_commit_fails_its_callers(es: EventStore, monkeypatch):
    """Nobody waits forever: the batch in flight learns that its outcome is unknown, the queued ones that
    they were not written."""
    started = asyncio.Event()

    async def slow_commit(self: GroupedAppender, batch: list) -> None:
        started.set()
        await asyncio.sleep(30)

    monkeypatch.setattr(GroupedAppender, "_commit", slow_commit)
    first = asyncio.create_task(es.append_grouped([assigned("cell-a")]))
    await started.wait()
    second = asyncio.create_task(es.append_grouped([assigned("cell-b")]))
    await asyncio.sleep(0)
    assert es._grouped is not None and es._grouped._task is not None
    es._grouped._task.cancel()
    with pytest.raises(StoreError, match="outcome unknown"):
        await asyncio.wait_for(first, 5)
    with pytest.raises(StoreError, match="before the append committed"):
        await asyncio.wait_for(second, 5)
