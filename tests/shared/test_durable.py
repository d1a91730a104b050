"""A service's own writes outlive a store outage: retried while the store cannot be reached, done when a retry
finds that the first try had committed, and given up (raised) after the outage allowance or on a real error."""

from __future__ import annotations

import psycopg
import pytest
import structlog

from shared.durable import store_unreachable, write_through_outage
from shared.store import ConcurrencyConflict, EventStore
from tests.shared.helpers import assigned

log = structlog.get_logger()


def outage(times: int, then):
    """A write that finds the store unreachable `times` times, then does `then()`."""
    calls = {"n": 0}

    async def write():
        calls["n"] += 1
        if calls["n"] <= times:
            raise psycopg.OperationalError("connection failed: Connection refused")
        return await then()

    return write, calls


async def test_a_write_waits_out_an_outage(store: EventStore):
    event = assigned("cell-d1", 1)
    write, calls = outage(3, lambda: store.append([event], expected_version="any"))
    positions = await write_through_outage(store, write, [event.event_id], outage_s=30, log=log, what="t")
    assert calls["n"] == 4 and positions and await store.holds([event.event_id])


async def test_a_retry_that_finds_the_first_try_committed_is_done(store: EventStore):
    """The connection dropped after the commit: the retry's duplicate says the write is in the log."""
    event = assigned("cell-d2", 1)
    await store.append([event], expected_version="any")  # what the lost-answer try did
    write, calls = outage(1, lambda: store.append([event], expected_version="any"))
    assert await write_through_outage(store, write, [event.event_id], outage_s=30, log=log, what="t") is None
    assert calls["n"] == 2 and len(await store.read_stream("cell-d2")) == 1
    # A conflict on the first try is a real one: raised, not taken for a committed retry.
    other = assigned("cell-d2", 1)
    with pytest.raises(ConcurrencyConflict):
        async def conflict():
            return await store.append([other], expected_version=0)
        await write_through_outage(store, conflict, [other.event_id], outage_s=30, log=log, what="t")


async def test_a_real_error_or_a_long_outage_is_raised():
    async def bad():
        raise ValueError("not a connection problem")

    with pytest.raises(ValueError):
        await write_through_outage(None, bad, [], outage_s=30, log=log, what="t")  # type: ignore[arg-type]
    write, calls = outage(1000, lambda: None)
    with pytest.raises(psycopg.OperationalError):
        await write_through_outage(None, write, [], outage_s=1.0, log=log, what="t")  # type: ignore[arg-type]
    assert 2 <= calls["n"] <= 6
    assert store_unreachable(psycopg.OperationalError("x")) and not store_unreachable(ValueError("x"))
