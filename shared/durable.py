"""Writes that outlive an outage of the event store.

A service's own writes (an execution's score, a worker's report, work done at start-up) happen outside any
delivery that a redelivery would repeat: if one fails because PostgreSQL is restarting, the fact is lost and
the run waits for it for ever (found by the whole-loop chaos test: a harness that finished an execution while
the store restarted never scored it). So such a write is retried, with backoff, while the store cannot be
reached, for up to `Settings.store_outage_s`. The answer of a write can be lost after its commit; the retry then
finds its events already in the log (a duplicate event, or a stream that moved past the expected version) and
checks that they are all there: that write is done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar
from uuid import UUID

import psycopg
import sqlalchemy.exc

from shared.store import ConcurrencyConflict, DuplicateEvent, EventStore

T = TypeVar("T")


def store_unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the store could not be reached or dropped the connection (not what was written)."""
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError, ConnectionError)):
        return True
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return exc.connection_invalidated or isinstance(exc.orig, (psycopg.OperationalError, psycopg.InterfaceError))
    return isinstance(exc, sqlalchemy.exc.InterfaceError)


async def write_through_outage(store: EventStore, write: Callable[[], Awaitable[T]], event_ids: Iterable[UUID], *,
                               outage_s: float, log: Any, what: str) -> T | None:
    """`write()`, retried while the store is unreachable (for `outage_s` at most); None when a retry finds that
    an earlier try had committed (every one of `event_ids` is in the log)."""
    ids = set(event_ids)
    deadline = time.monotonic() + outage_s
    delay, failures = 0.2, 0
    while True:
        try:
            return await write()
        except (DuplicateEvent, ConcurrencyConflict):
            if failures and ids and await store.holds(ids):
                log.info("write_found_committed", what=what, after_failures=failures)
                return None
            raise
        except Exception as exc:
            if not store_unreachable(exc) or time.monotonic() + delay > deadline:
                raise
            failures += 1
            if failures == 1:
                log.warning("store_unreachable_retrying", what=what, error=f"{type(exc).__name__}: {exc}"[:300],
                            gives_up_after_s=outage_s)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
