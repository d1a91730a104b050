"""The outbox relay: tails the Postgres event table and publishes each event to JetStream.

It records its position only after JetStream acknowledged the publish. A crash before that republishes
the same events on restart, and JetStream drops them as duplicates (`Nats-Msg-Id = event_id`), so no
event is lost and none is delivered twice within the duplicate window.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from shared.bus import Bus
from shared.logging import get_logger
from shared.runtime import Service
from shared.store import EventStore

log = get_logger(component="relay")


class Waker:
    """LISTENs on the store's channel; a notification is only a wake-up, readers go by position."""

    def __init__(self, dsn: str, channel: str) -> None:
        self.dsn = dsn
        self.channel = channel
        self._conn: psycopg.AsyncConnection | None = None

    async def open(self) -> None:
        self._conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        await self._conn.execute(f'LISTEN "{self.channel}"')

    async def wait(self, timeout: float) -> None:
        if self._conn is None:
            await asyncio.sleep(timeout)
            return
        try:
            async for _ in self._conn.notifies(timeout=timeout, stop_after=1):
                pass
        except psycopg.OperationalError as exc:
            log.warning("listen_lost", error=str(exc))
            await self.close()
            await asyncio.sleep(timeout)
            try:
                await self.open()
            except psycopg.OperationalError:
                self._conn = None

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


def plain_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


class OutboxRelay:
    def __init__(
        self,
        store: EventStore,
        bus: Bus,
        *,
        dsn: str,
        name: str = "relay",
        batch: int = 1000,
        idle_wait_s: float = 1.0,
        after_publish: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.bus = bus
        self.name = name
        self.batch = batch
        self.idle_wait_s = idle_wait_s
        self.waker = Waker(plain_dsn(dsn), store.channel)
        # Fault-injection hook for tests: runs after the publish is acked, before the position is saved.
        self.after_publish = after_publish
        self.published = 0
        self.position = 0  # the log position published up to
        self.behind = 0  # events appended past it when last looked (0 once the relay has caught up)

    async def run_once(self) -> int:
        """Publish everything after the saved position; returns how many events were sent.

        While JetStream acknowledges one page, the next is read from PostgreSQL; it is published only
        after the position of the page before is saved, so pages reach the stream in log order.
        """
        position = self.position = await self.store.get_position(self.name)
        sent = 0
        page = await self.store.read_after_raw(position, limit=self.batch)
        while page:
            acked = asyncio.ensure_future(
                self.bus.publish_payloads([(e.type, e.payload, str(e.event_id)) for e in page])
            )
            try:
                following = await self.store.read_after_raw(page[-1].position, limit=self.batch)
            finally:
                await acked  # raises when a publish failed: nothing after the saved position is lost
            last = page[-1].position
            if self.after_publish is not None:
                await self.after_publish(last)
            await self.store.set_position(self.name, last)
            self.position = last
            sent += len(page)
            self.published += len(page)
            page = following
        return sent

    async def run(self, stop: asyncio.Event) -> None:
        await self.waker.open()
        try:
            while not stop.is_set():
                try:
                    sent = await self.run_once()
                except Exception as exc:  # the bus or the database is away: wait and go on from the log
                    log.warning("relay_retry", error=f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(0.5)
                    continue
                if sent == 0:
                    self.behind = 0
                    await self.waker.wait(self.idle_wait_s)
                else:  # appends may have gone on meanwhile: how far the log's head is now
                    with contextlib.suppress(Exception):
                        self.behind = max(0, await self.store.head_position() - self.position)
        finally:
            await self.waker.close()


class RelayService(Service):
    """`gyre relay` / `python -m shared.relay`: one relay per deployment, resuming from its saved position."""

    name = "relay"

    async def setup(self) -> None:
        assert self.store is not None and self.bus is not None
        dsn = self.settings.database_url
        relay = OutboxRelay(self.store, self.bus, dsn=dsn)
        self.log.info("relay_started", position=await self.store.get_position(relay.name))
        self.relay = relay
        self.spawn(relay.run(self.stop_event), name="relay")

    def health(self) -> dict[str, Any]:
        # As metrics: gyre_relay_published, gyre_relay_position, gyre_relay_behind (events not yet on the bus).
        return {"published": self.relay.published, "position": self.relay.position, "behind": self.relay.behind}


async def run_relay_process() -> None:
    from shared.logging import configure_logging
    from shared.settings import load_settings

    settings = load_settings()
    configure_logging("relay", run_id=settings.run_id)
    await RelayService(settings).run(freeze_heap=True)


if __name__ == "__main__":
    asyncio.run(run_relay_process())
