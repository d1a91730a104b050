"""Fault tests for the foundation: each asserts that every event takes effect exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from shared.bus import Bus, ConsumerOptions
from shared.events import Event
from gyre.local import EmbeddedNats
from shared.relay import OutboxRelay
from shared.runtime import Service
from shared.settings import Settings
from shared.effects import Effects
from shared.store import EventStore
from tests.conftest import Infra, drop_bus, make_bus, unique
from tests.shared.helpers import assigned

FAST = ConsumerOptions(ack_wait_s=1.0, max_deliver=20, backoff_s=(0.1,), batch=100, fetch_timeout_s=0.2)


class Collector:
    """A durable consumer that records every delivery (not deduplicated: duplicates must show)."""

    def __init__(self, bus: Bus, durable: str) -> None:
        self.bus = bus
        self.durable = durable
        self.seen: list[str] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        async def handler(event: Event, msg) -> None:
            self.seen.append(str(event.event_id))

        for c in await self.bus.consumer(self.durable, ["cell.assigned"], FAST):
            self.tasks.append(asyncio.create_task(c.run(handler, self.stop)))

    async def wait_for(self, n: int, timeout: float = 30.0) -> None:
        async def until():
            while len(self.seen) < n:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(until(), timeout)
        await asyncio.sleep(0.5)  # room for a duplicate to show up

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


async def assert_exactly_once_on_the_bus(bus: Bus, collector: Collector, written: list[Event]) -> None:
    """Every event reached the consumer, and JetStream holds each exactly once (redelivery after a slow ack
    is allowed by at-least-once delivery; the stream itself must hold no duplicate)."""
    assert set(collector.seen) == {str(e.event_id) for e in written}
    info = await bus.js.stream_info(bus.stream_name("cell"))
    assert info.state.messages == len(written)


def relay_for(store: EventStore, bus: Bus, infra_url: str, **kw) -> OutboxRelay:
    return OutboxRelay(store, bus, dsn=infra_url, idle_wait_s=0.1, **kw)


async def test_relay_crash_after_publish_before_saving_position(store, bus, infra: Infra):
    events = [assigned(f"cell-{i}", 1) for i in range(50)]
    await store.append(events)

    async def crash(position: int) -> None:
        raise SystemExit("relay killed after the publish was acked")

    with pytest.raises(SystemExit):
        await relay_for(store, bus, infra.database_url, after_publish=crash).run_once()
    assert await store.get_position("relay") == 0  # nothing recorded: the restart will publish again
    restarted = relay_for(store, bus, infra.database_url)
    assert await restarted.run_once() == 50
    collector = Collector(bus, "after-crash")
    await collector.start()
    await collector.wait_for(50)
    await collector.close()
    await assert_exactly_once_on_the_bus(bus, collector, events)


async def test_relay_killed_between_append_and_publish(store, bus, infra: Infra, repo_root: Path):
    """A relay process is SIGKILLed mid-stream; a new one picks up from the saved position."""
    env = {
        **os.environ,
        "GYRE_DATABASE_URL": infra.database_url,
        "GYRE_NATS_URL": infra.nats_url,
        "GYRE_DB_SCHEMA": store.schema,
        "GYRE_SUBJECT_PREFIX": bus.prefix,
    }
    cmd = [sys.executable, "-m", "shared.relay"]
    collector = Collector(bus, "kill9")
    await collector.start()
    relay = subprocess.Popen(cmd, cwd=repo_root, env=env, stderr=subprocess.DEVNULL)
    written: list[Event] = []
    for i in range(20):
        batch = [assigned(f"cell-k{i}-{j}", 1) for j in range(10)]
        await store.append(batch)
        written += batch
        if i == 10:
            relay.send_signal(signal.SIGKILL)
            relay.wait()
        if i == 14:
            relay = subprocess.Popen(cmd, cwd=repo_root, env=env, stderr=subprocess.DEVNULL)
        await asyncio.sleep(0.05)
    try:
        await collector.wait_for(len(written))
    finally:
        relay.terminate()
        relay.wait()
        await collector.close()
    await assert_exactly_once_on_the_bus(bus, collector, written)


async def test_nats_server_killed_and_restarted_mid_stream(store, infra: Infra):
    """JetStream keeps what it acked on disk; the relay re-publishes what it had not saved. Nothing lost."""
    state = Path(tempfile.mkdtemp(prefix="gyre-nats-fault-"))
    nats = EmbeddedNats(state)
    nats.start()
    bus = await make_bus(nats.url)
    stop = asyncio.Event()
    relay = relay_for(store, bus, infra.database_url)
    relay_task = asyncio.create_task(relay.run(stop))
    written: list[Event] = []
    try:
        for i in range(30):
            batch = [assigned(f"cell-n{i}-{j}", 1) for j in range(10)]
            await store.append(batch)
            written += batch
            if i == 10:
                nats.kill()
            if i == 15:
                restarted = EmbeddedNats(state, port=nats.port)
                restarted.start()
                nats = restarted
            await asyncio.sleep(0.05)
        collector = Collector(bus, "survivor")
        await collector.start()
        await collector.wait_for(len(written), timeout=60)
        await collector.close()
        await assert_exactly_once_on_the_bus(bus, collector, written)
    finally:
        stop.set()
        await relay_task
        await drop_bus(bus)
        nats.stop()


class EffectService(Service):
    """A service whose effect is appending one `cell-effect-*` event per input event."""

    name = "effects"
    crash_before_ack = False

    async def setup(self) -> None:
        self.on(["cell.assigned"], self.apply, options=FAST)

    async def apply(self, event: Event) -> Effects:
        effects = Effects()
        effects.append([assigned(f"cell-effect-{event.event_id}", 1)])
        return effects


async def test_consumer_killed_before_ack_applies_the_effect_once(store, bus, infra: Infra, monkeypatch):
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=unique("r"),
    )
    inputs = [assigned(f"cell-in{i}", 1, run_id=settings.run_id) for i in range(5)]
    for e in inputs:
        await bus.publish(e)

    # First incarnation: the transaction commits, then the process "dies" before acking.
    from nats.aio.msg import Msg

    original_ack = Msg.ack
    acks_lost = 0

    async def die(self, *a, **k):
        nonlocal acks_lost
        acks_lost += 1
        raise asyncio.CancelledError("killed before ack")

    monkeypatch.setattr(Msg, "ack", die)
    async def effects() -> list[str]:
        return [s.event.stream_id for s in await store.read_after(0) if s.event.stream_id.startswith("cell-effect-")]

    async def until(predicate, timeout_s: float = 60.0) -> None:  # noqa: ANN001
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await predicate():
            assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
            await asyncio.sleep(0.05)

    first = EffectService(settings)
    await first.start()

    async def crashed_once() -> bool:
        return acks_lost >= 1 and len(await effects()) >= 1

    await until(crashed_once)  # the crash really came between the commit and the ack
    await first.stop()

    # Second incarnation: everything is redelivered; effects already applied are skipped, the rest applied once.
    monkeypatch.setattr(Msg, "ack", original_ack)
    second = EffectService(settings)
    await second.start()

    async def all_applied() -> bool:
        return len(await effects()) >= len(inputs)

    await until(all_applied)
    await asyncio.sleep(1.5)  # past the ack wait: a duplicate redelivery would show now
    await second.stop()
    assert sorted(await effects()) == sorted(f"cell-effect-{e.event_id}" for e in inputs)


async def test_no_transaction_is_open_while_a_handler_computes(store, bus, infra: Infra):
    """Two-phase handlers: the handler computes with no transaction open (a training step takes minutes, and an
    open transaction would hold its connection and its snapshot all that while); the effects and the tracking
    row are then recorded together in one short transaction."""
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=unique("r"),
    )
    computing, release = asyncio.Event(), asyncio.Event()

    class SlowEffectService(EffectService):
        async def apply(self, event: Event) -> Effects:
            computing.set()
            await release.wait()
            return await super().apply(event)

    service = SlowEffectService(settings)
    await service.start()
    trigger = assigned("cell-in", 1, run_id=settings.run_id)
    try:
        await bus.publish(trigger)
        await asyncio.wait_for(computing.wait(), 30)
        async with store.engine.connect() as conn:
            open_transactions = (await conn.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%' AND query ILIKE '%tracking%'"
            ))).scalar()
        assert open_transactions == 0
        release.set()
        for _ in range(600):
            if await store.read_stream(f"cell-effect-{trigger.event_id}"):
                break
            await asyncio.sleep(0.05)
        assert await store.is_processed("effects", trigger.event_id)
        assert len(await store.read_stream(f"cell-effect-{trigger.event_id}")) == 1
    finally:
        release.set()
        await service.stop()


async def test_a_service_handles_its_own_run_only(store, bus, infra: Infra):
    """Runs share the bus: another run's events are acknowledged and left alone (no effect, no tracking)."""
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=unique("mine"),
    )
    mine = [assigned(f"cell-mine{i}", 1, run_id=settings.run_id) for i in range(2)]
    theirs = [assigned(f"cell-theirs{i}", 1, run_id=unique("theirs")) for i in range(3)]
    for e in [theirs[0], *mine, *theirs[1:]]:
        await bus.publish(e)
    service = EffectService(settings)
    await service.start()
    try:
        for _ in range(100):
            if service.processed + service.skipped_other_runs >= 5:
                break
            await asyncio.sleep(0.1)
    finally:
        await service.stop()
    effects = [s.event.stream_id for s in await store.read_after(0) if s.event.stream_id.startswith("cell-effect-")]
    assert sorted(effects) == sorted(f"cell-effect-{e.event_id}" for e in mine)
    assert (service.processed, service.skipped_other_runs) == (2, 3)


async def test_a_background_task_that_dies_makes_the_service_unhealthy(store, bus, infra: Infra):
    """A consumer or background task ending in an error would leave the process up but idle: the health
    endpoint must say so (503, naming the task), so a supervisor restarts it and it resumes from the log."""
    from gyre.local import free_port

    class Broken(EffectService):
        async def setup(self) -> None:
            await super().setup()

            async def worker() -> None:
                raise RuntimeError("worker fell over")

            self.spawn(worker(), name="worker")

    port = free_port()
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=unique("sick"), health_port=port,
    )
    service = Broken(settings)
    await service.start()
    try:
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        reply = await reader.read()
        writer.close()
    finally:
        await service.stop()
    assert reply.startswith(b"HTTP/1.1 503")
    assert service.failed_tasks == ["worker"] and b'"failed_tasks": ["worker"]' in reply


async def test_a_stopping_service_wakes_its_own_waits_and_cancels_only_a_task_that_ignores_the_stop(
        store, bus, infra: Infra, monkeypatch):
    """`stopping` runs before the service waits for its tasks: a task waiting on an event of its own (the trainer's
    re-forming loop, the gateway's HTTP server) ends by itself instead of holding the stop for the whole grace period
    and being cancelled; one that ignores the stop is cancelled after the grace period, and named."""
    import shared.runtime as runtime

    monkeypatch.setattr(runtime, "STOP_GRACE_S", 0.5)  # the stuck task's wait: short, whatever the machine
    ended: dict[str, str] = {}

    class Waiting(EffectService):
        async def setup(self) -> None:
            await super().setup()
            self.wake = asyncio.Event()

            async def waits_on_its_event() -> None:
                await self.wake.wait()
                ended["own"] = "ended"

            async def ignores_the_stop() -> None:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    ended["stuck"] = "cancelled"
                    raise

            self.own = self.spawn(waits_on_its_event(), name="own")
            self.stuck = self.spawn(ignores_the_stop(), name="stuck")

        def stopping(self) -> None:
            self.wake.set()

    settings = Settings(database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
                        subject_prefix=bus.prefix, run_id=unique("stop"))
    service = Waiting(settings)
    await service.start()
    warnings: list[dict[str, object]] = []
    monkeypatch.setattr(service.log, "warning", lambda event, **kw: warnings.append({"event": event, **kw}))
    await service.stop()
    assert ended == {"own": "ended", "stuck": "cancelled"}
    assert not service.own.cancelled() and service.stuck.cancelled()
    assert warnings == [{"event": "tasks_cancelled_at_stop", "tasks": ["stuck"], "grace_s": 0.5}]


async def test_a_service_whose_health_port_is_taken_fails_at_once_and_lets_go(store, bus, infra: Infra):
    """A health port taken by another socket must end the start at once, before any setup (a rollout worker
    loads an engine there), and the process must let go of what it holds so that it exits: one that raised and
    lingered looked to its cell agent like a worker still starting, for the whole readiness timeout."""
    import socket

    from shared import ports

    class Counting(EffectService):
        set_up = 0
        torn_down = 0

        async def setup(self) -> None:
            Counting.set_up += 1
            await super().setup()

        async def teardown(self) -> None:
            Counting.torn_down += 1

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        settings = Settings(
            database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
            subject_prefix=bus.prefix, run_id=unique("taken"), health_port=taken.getsockname()[1],
        )
        service = Counting(settings)
        with pytest.raises(OSError, match="address already in use"):
            await service.start()
    assert (Counting.set_up, Counting.torn_down) == (0, 1)
    assert service.stop_event.is_set() and not service.running


def test_ports_a_run_picks_lie_below_the_ephemeral_range():
    """The kernel hands ports of its ephemeral range to any socket; a run's own ports lie below it."""
    from shared import ports

    first = ports.ephemeral_first()
    base = ports.free_port_block(4)
    assert ports.LOWEST <= base and base + 4 <= first
    assert all(ports.LOWEST <= ports.free_port() < first for _ in range(20))


def test_a_process_never_hands_out_a_port_twice_though_none_is_bound_yet(monkeypatch):
    """A run picks its processes' ports before any of them binds one: the same draw again (two of a run's
    processes were once given one port) is passed over for the next draw."""
    import itertools
    import random

    from shared import ports

    first = ports.free_port()
    fresh = random.Random(7)
    draws = itertools.chain([first, first, first - 1], iter(lambda: fresh.randint(ports.LOWEST, 30_000), None))
    monkeypatch.setattr(ports._rng, "randint", lambda low, high: next(draws))
    second = ports.free_port()  # drew `first` again, then `first - 1`
    assert second != first
    block = ports.free_port_block(3)
    assert {first, second}.isdisjoint(range(block, block + 3))



async def test_a_handler_commit_waits_out_a_store_outage_instead_of_redoing_the_work(
        store, bus, infra: Infra, monkeypatch):
    """The store unreachable when a handler's effects are committed: the commit is retried (the handler is not
    run again, nothing is dead-lettered), and each effect lands once."""
    import contextlib

    import psycopg

    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=unique("outage"),
    )
    inputs = [assigned(f"cell-out{i}", 1, run_id=settings.run_id) for i in range(3)]
    handled: list[str] = []

    class Counting(EffectService):
        async def apply(self, event: Event) -> Effects:
            handled.append(event.stream_id)
            return await super().apply(event)

    original = EventStore.transaction
    failures = {"left": 4}

    @contextlib.asynccontextmanager
    async def flaky(self):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise psycopg.OperationalError("connection failed: Connection refused")
        async with original(self) as tx:
            yield tx

    monkeypatch.setattr(EventStore, "transaction", flaky)
    service = Counting(settings)
    await service.start()
    try:
        for e in inputs:
            await bus.publish(e)
        deadline = asyncio.get_running_loop().time() + 60
        while len([s for s in await store.read_after(0) if s.event.stream_id.startswith("cell-effect-")]) < 3:
            assert asyncio.get_running_loop().time() < deadline, "effects not applied in time"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
    finally:
        await service.stop()
    effects = [s.event.stream_id for s in await store.read_after(0) if s.event.stream_id.startswith("cell-effect-")]
    assert sorted(effects) == sorted(f"cell-effect-{e.event_id}" for e in inputs)
    assert sorted(handled) == sorted(e.stream_id for e in inputs)  # each handled once: no redelivery
    assert failures["left"] == 0 and not bus.dead_letters
