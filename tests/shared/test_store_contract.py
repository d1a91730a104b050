"""Contract suite for the event store port, run against a real PostgreSQL per backend (embedded and by URL)."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from shared.events import CellAssigned
from shared.store import BlobCorrupted, BlobNotFound, ConcurrencyConflict, DuplicateEvent, EventStore, blobs_table
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


async def test_blobs_are_content_addressed_and_deduplicated(es: EventStore):
    ref = await es.put_blob(b"tokens" * 100, "application/x-test")
    again = await es.put_blob(b"tokens" * 100, "application/x-test")
    assert ref == again and ref.size == 600
    assert await es.get_blob(ref) == b"tokens" * 100
    assert await es.has_blob(ref.digest)
    async with es.engine.connect() as conn:
        count = (await conn.execute(sa.select(sa.func.count()).select_from(blobs_table))).scalar()
    assert count == 1


async def test_missing_and_corrupted_blobs_are_named_errors(es: EventStore):
    with pytest.raises(BlobNotFound):
        await es.get_blob("sha256:" + "1" * 64)
    ref = await es.put_blob(b"original")
    async with es.engine.begin() as conn:
        await conn.execute(sa.update(blobs_table).values(data=b"tampered"))
    with pytest.raises(BlobCorrupted):
        await es.get_blob(ref)


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


async def test_a_held_append_lock_orders_commits(es: EventStore):
    """Even when A takes its position first and B must wait, a reader never sees B before A."""
    async with es.engine.connect() as conn_a:
        trans = await conn_a.begin()
        await es._append(conn_a, [assigned("cell-a", 1)], None)  # holds the ordering lock, uncommitted
        b = asyncio.create_task(es.append([assigned("cell-b", 1)]))
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
