"""The service runtime every Gyre process uses: settings, logging, store and bus connections with retry,
exactly-once event handlers, append-and-publish, a health endpoint and graceful shutdown on SIGTERM.

Writing a service:

    class TrajectoryService(Service):
        name = "trajectory"

        async def setup(self) -> None:
            self.on(["execution.scored", "call.completed"], self.handle)

        async def handle(self, event: Event) -> Effects:
            effects = Effects()
            ...                      # compute; then effects.append(...), effects.put_blob(...), effects.after_commit(...)
            return effects

    if __name__ == "__main__":
        TrajectoryService.main()

Exactly once, in two phases: a handler computes its effects outside any transaction (an event already processed
is skipped before it runs), then the runtime records them together with the event's tracking row in one short
transaction. A redelivered event (crash before ack) finds its row and is skipped: its effects were recorded once,
or not at all. A handler may therefore run more than once for one event (a crash between computing and
recording): what it computes must be safe to compute again, and anything it changes in memory before its
effects are recorded must be undone if recording fails (the trainer rolls back to its checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

from nats.aio.msg import Msg

from shared.blobs import Blobs
from shared.bus import Bus, ConsumerOptions, JetStreamConsumer
from shared.durable import write_through_outage
from shared.effects import Effects
from shared.events import Event, EventData, new_event
from shared.logging import configure_logging, get_logger
from shared.metrics import ServiceMetrics
from shared.objects import ObjectBlobStore
from shared.settings import Settings, load_settings
from shared.store import EventStore

EventHandler = Callable[[Event], Awaitable[Effects | None]]

# How long a stopping service waits for its tasks (a handler finishing its message) before it cancels them.
STOP_GRACE_S = 10.0


def utcnow() -> datetime:
    return datetime.now(UTC)


def freeze_startup_heap() -> int:
    """Move every object alive now out of the garbage collector's sight (after a collection): returns how many.

    A service's heap after setup is mostly what it imported and loaded (PyTorch, transformers, vLLM's front
    end: millions of objects) and stays alive for the process's life, yet every full collection walks all of
    it: measured in the rollout gateway, 100–480 ms with the event loop stopped, every call in flight frozen
    with it. Frozen, those objects are skipped and full collections walk only what the service made since.
    What is frozen is never collected, so this runs once, after setup."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Service:
    name: ClassVar[str] = "service"

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or load_settings()
        self.log = get_logger(service=self.name, run_id=self.settings.run_id)
        self.store: EventStore | None = None
        self.bus: Bus | None = None
        self.blobs = Blobs()  # every blob backend behind one port, set on connect
        self.stop_event = asyncio.Event()
        self._handlers: list[tuple[str, list[str], EventHandler, ConsumerOptions]] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self.failed_tasks: list[str] = []  # names of spawned tasks that ended with an error
        self._health_server: asyncio.base_events.Server | None = None
        self.running = False  # set once `start` is done; the health endpoint answers 503 until then
        self.started_at = time.monotonic()
        self.processed = 0
        self.skipped_other_runs = 0
        self.metrics = ServiceMetrics(self.name, health=self._health_answer, healthy=self._healthy,
                                      dead_letters=lambda: dict(self.bus.dead_letters) if self.bus else {})

    # ---- hooks for subclasses ----

    async def setup(self) -> None:
        """Register handlers with `self.on(...)` and start background work. Runs after connecting."""

    def stopping(self) -> None:
        """Tell background work that waits on something other than `stop_event` (a server, an event of its own) to
        end. Runs once at shutdown, before the service waits for its tasks, so that none of them holds the stop up
        for the whole grace period."""

    async def teardown(self) -> None:
        """Release what `setup` acquired. Runs once on shutdown, after the tasks have ended."""

    def health(self) -> dict[str, Any]:
        return {}

    # ---- wiring ----

    def on(
        self,
        event_types: Sequence[str],
        handler: EventHandler,
        *,
        durable: str | None = None,
        options: ConsumerOptions | None = None,
    ) -> None:
        options = options or ConsumerOptions(
            ack_wait_s=self.settings.ack_wait_s,
            max_deliver=self.settings.max_deliver,
            backoff_s=tuple(self.settings.backoff_s),
        )
        self._handlers.append((durable or self.name, list(event_types), handler, options))

    def spawn(self, coro: Awaitable[Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.append(task)
        task.add_done_callback(self._task_ended)
        return task

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        """A consumer or background task that dies with an error leaves the process up but not working:
        log it and report the service unhealthy, so a supervisor can restart it (it resumes from the log).
        A finished task is forgotten: a long-lived service spawns one per drain or ordered session move."""
        if task in self._tasks:
            self._tasks.remove(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        self.failed_tasks.append(task.get_name())
        self.log.error("task_failed", task=task.get_name(), error=f"{type(exc).__name__}: {exc}")

    async def connect(self) -> None:
        s = self.settings
        if not s.database_url or not s.nats_url:
            raise RuntimeError(
                "GYRE_DATABASE_URL and GYRE_NATS_URL must be set for a service; `gyre up` prints them"
            )
        self.store = await _retry(
            lambda: EventStore.connect(s.database_url, schema=s.db_schema), what="postgres", log=self.log
        )
        self.bus = await Bus.connect(
            s.nats_url, prefix=s.subject_prefix, duplicate_window_s=s.duplicate_window_s, name=self.name,
            replicas=s.stream_replicas,
        )
        await self.bus.ensure_streams()
        self.blobs = Blobs(self.store.blobs, ObjectBlobStore(self.bus.objects))

    async def start(self) -> None:
        """Open the health endpoint, connect, run `setup`, and start consumers (returns once running). The port
        is bound first, so a port that is taken fails the start in a moment rather than after a long setup; the
        endpoint answers 503 until the start is done. A start that fails lets go of what it got (an engine's
        processes, connections) before it raises, so that the process exits: one that raised and lingered would
        look like one still starting."""
        try:
            await self._start()
        except BaseException as exc:
            self.log.error("service_start_failed", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                await self.stop()
            raise

    async def _start(self) -> None:
        if self.settings.health_port:
            self._health_server = await asyncio.start_server(
                self._serve_health, self.settings.health_host, self.settings.health_port
            )
        await self.connect()
        await self.setup()
        assert self.bus is not None
        consumers = []
        for durable, types, handler, options in self._handlers:
            for consumer in await self.bus.consumer(durable, types, options):
                consumers.append(consumer)
                self.spawn(consumer.run(self._exactly_once(durable, handler), self.stop_event), name=consumer.name)
        if consumers and self.settings.health_port:
            self.spawn(self._watch_consumers(consumers), name="consumer-lag")
        self.running = True
        self.log.info("service_started", handlers=[t for _, t, _, _ in self._handlers])

    async def stop(self) -> None:
        self.stop_event.set()
        self.stopping()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_GRACE_S)
            if late := sorted(t.get_name() for t in self._tasks if not t.done()):
                self.log.warning("tasks_cancelled_at_stop", tasks=late, grace_s=STOP_GRACE_S)
            for task in self._tasks:
                task.cancel()
        try:
            await self.teardown()
        except Exception as exc:  # a teardown after a failed start may find half of what setup makes
            self.log.warning("teardown_failed", error=f"{type(exc).__name__}: {exc}")
        if self._health_server is not None:
            self._health_server.close()
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            await self.store.close()
        self.log.info("service_stopped", processed=self.processed)

    async def run(self, *, freeze_heap: bool = False) -> None:
        """Start, serve until SIGTERM/SIGINT, stop. A process of its own passes `freeze_heap` (see
        `freeze_startup_heap`); a test running several services in one process does not."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        await self.start()
        if freeze_heap:
            self.log.info("heap_frozen", objects=freeze_startup_heap())
        await self.stop_event.wait()
        await self.stop()

    @classmethod
    def main(cls) -> None:
        settings = load_settings()
        configure_logging(cls.name, run_id=settings.run_id)
        asyncio.run(cls(settings).run(freeze_heap=True))

    # ---- events ----

    def _exactly_once(self, consumer: str, handler: EventHandler) -> Callable[[Event, Msg], Awaitable[None]]:
        async def handle(event: Event, msg: Msg) -> None:
            assert self.store is not None
            if event.run_id != self.settings.run_id:
                # Runs share the bus: a service serves its own run only (acked, not recorded as processed).
                self.skipped_other_runs += 1
                return
            store = self.store
            if await write_through_outage(store, lambda: store.is_processed(consumer, event.event_id), (),
                                          outage_s=self.settings.store_outage_s, log=self.log, what="tracking"):
                self.metrics.duplicates.labels(consumer=consumer).inc()
                return
            started = time.perf_counter()
            effects = await handler(event)  # outside any transaction: a step may take minutes

            async def commit() -> bool:
                async with store.transaction() as tx:
                    if not await tx.mark_processed(consumer, event.event_id):
                        return False
                    if effects:
                        tx.record(effects)
                return True

            # Through a store outage: the work is done, and a redelivery would do it again (a trainer step) or,
            # after `max_deliver` tries, dead-letter it. A retry whose first try committed finds it processed.
            if not await write_through_outage(store, commit, (), outage_s=self.settings.store_outage_s,
                                              log=self.log, what=f"{consumer}: {event.type}"):
                self.metrics.duplicates.labels(consumer=consumer).inc()
                return  # another delivery (or an earlier try of this one) recorded it: these effects are dropped
            self.processed += 1
            self.metrics.handled.labels(consumer=consumer, type=event.type).inc()
            self.metrics.handler_seconds.labels(consumer=consumer).observe(time.perf_counter() - started)
            if effects:
                self.metrics.recorded(e for append in effects.appends for e in append.events)

        return handle

    async def record(self, effects: Effects) -> None:
        """Commit effects that no event caused (work a service does at start-up) in one short transaction;
        through a store outage (shared/durable.py)."""
        store = self.store
        assert store is not None
        events = [e for append in effects.appends for e in append.events]

        async def commit() -> None:
            async with store.transaction() as tx:
                tx.record(effects)

        await write_through_outage(store, commit, (e.event_id for e in events),
                                   outage_s=self.settings.store_outage_s, log=self.log, what="effects")
        self.metrics.recorded(events)

    def event(
        self,
        data: EventData,
        *,
        stream_id: str,
        version: int = 1,
        cause: Event | None = None,
        occurred_at: datetime | None = None,
    ) -> Event:
        """Build an event of this run; with `append(..., expected_version="any")` the store sets `version`."""
        return new_event(
            data,
            run_id=self.settings.run_id,
            stream_id=stream_id,
            version=version,
            occurred_at=occurred_at or utcnow(),
            causation_id=cause.event_id if cause else None,
            correlation_id=(cause.correlation_id or cause.event_id) if cause else None,
        )

    async def emit(self, events: Sequence[Event], *, expected_version: int | str | None = "any") -> list[int]:
        """Append to the event log, through a store outage (shared/durable.py); the outbox relay publishes them
        to JetStream. The events' positions ([] when a retry found them already appended)."""
        store = self.store
        assert store is not None
        positions = await write_through_outage(
            store, lambda: store.append(events, expected_version=expected_version),  # type: ignore[arg-type]
            (e.event_id for e in events), outage_s=self.settings.store_outage_s, log=self.log,
            what=", ".join(sorted({e.type for e in events})))
        self.metrics.recorded(events)
        return positions or []

    # ---- health ----

    async def _watch_consumers(self, consumers: Sequence[JetStreamConsumer], every_s: float = 5.0) -> None:
        """Each consumer's lag (pending on the bus) and work in hand (delivered, not acked), for /metrics."""
        while not self.stop_event.is_set():
            for consumer in consumers:
                try:
                    info = await consumer.sub.consumer_info()
                except Exception:  # reconnecting, or stopping: the last figures stand
                    continue
                self.metrics.pending.labels(consumer=consumer.name).set(info.num_pending or 0)
                self.metrics.ack_pending.labels(consumer=consumer.name).set(info.num_ack_pending or 0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), every_s)

    def _healthy(self) -> bool:
        return (self.running and self.bus is not None and self.bus.nc.is_connected and not self.stop_event.is_set()
                and not self.failed_tasks)

    def _health_answer(self) -> dict[str, Any]:
        return {"processed": self.processed, "failed_tasks": self.failed_tasks,
                "uptime_s": round(time.monotonic() - self.started_at, 1), **self.health()}

    async def _serve_health(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """`GET /metrics`: the service's Prometheus metrics (shared/metrics.py); any other request: its health,
        JSON, 200 when healthy and 503 when not."""
        try:
            request = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            request = exc.partial if isinstance(exc, asyncio.IncompleteReadError) else b""
        path = request.split(b"\r\n", 1)[0].split(b" ")[1:2]
        if path and path[0].split(b"?")[0] == b"/metrics":
            self.metrics.failed_tasks.set(len(self.failed_tasks))
            body, status, content_type = self.metrics.exposition(), b"200 OK", self.metrics.content_type.encode()
        else:
            ok = self._healthy()
            body = json.dumps({"service": self.name, "ok": ok, **self._health_answer()}).encode()
            status, content_type = (b"200 OK" if ok else b"503 Service Unavailable"), b"application/json"
        writer.write(
            b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
        )
        await writer.drain()
        writer.close()


async def _retry(factory: Callable[[], Awaitable[Any]], *, what: str, log: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        try:
            return await factory()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("connect_retry", target=what, error=str(exc), retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


__all__ = ["JetStreamConsumer", "Service", "utcnow"]
