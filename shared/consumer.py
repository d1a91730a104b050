"""A durable JetStream pull consumer: fetch → parse → handle → ack, with progress acks while a handler runs,
backoff on failure, and dead letters for malformed events and exhausted redeliveries."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.events import Event, EventError, parse_event
from shared.logging import get_logger

log = get_logger(component="bus")


class PoisonMessage(Exception):
    """Raised by a handler to dead-letter a message at once (it can never succeed)."""


Handler = Callable[[Event, Msg], Awaitable[None]]


@dataclass(frozen=True)
class ConsumerOptions:
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: Sequence[float] = (0.5, 2.0, 5.0)
    batch: int = 256
    fetch_timeout_s: float = 1.0


class DeadLetters(Protocol):
    """What a consumer needs of the bus: its connection and the dead-letter subject."""

    nc: NatsClient

    async def dead_letter(self, consumer: str, msg: Msg, reason: str) -> None: ...


class JetStreamConsumer:
    """Fetch → parse → handle → ack. Malformed events and exhausted redeliveries go to the dead-letter subject."""

    def __init__(
        self,
        bus: DeadLetters,
        name: str,
        sub: JetStreamContext.PullSubscription,
        options: ConsumerOptions,
        *,
        types: frozenset[str] | None = None,
    ) -> None:
        self.bus = bus
        self.name = name
        self.sub = sub
        self.options = options
        self.types = types  # None: every type the subscription delivers
        self.skipped_types = 0

    async def run(self, handler: Handler, stop: asyncio.Event) -> None:
        try:
            await self._loop(handler, stop)
        finally:
            if not self.bus.nc.is_closed:
                try:
                    await self.sub.unsubscribe()
                except Exception:  # already gone with the connection
                    pass

    async def _loop(self, handler: Handler, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                msgs = await self.sub.fetch(self.options.batch, timeout=self.options.fetch_timeout_s)
            except asyncio.TimeoutError:  # nats raises both its own subclass and the plain one
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
                if self.bus.nc.is_closed:
                    return
                log.warning("fetch_interrupted", consumer=self.name, error=str(exc))
                await asyncio.sleep(0.25)
                continue
            except nats.js.errors.APIError as exc:
                log.warning("fetch_failed", consumer=self.name, error=str(exc))
                await asyncio.sleep(0.25)
                continue
            for msg in msgs:
                try:
                    await self.handle_one(msg, handler)
                except Exception:  # e.g. a dead-letter publish or an ack lost to a reconnect: not acked, so
                    # the server delivers the message again after `ack_wait`; the loop must not die with it
                    log.exception("delivery_failed", consumer=self.name, subject=msg.subject)

    async def _while_in_progress(self, msg: Msg, work: Awaitable[None]) -> None:
        """Run a handler, telling the server every third of `ack_wait` that the message is still being worked
        on: a trainer step may take many minutes and must not be redelivered meanwhile, while a message whose
        consumer died comes back after one `ack_wait`."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.options.ack_wait_s / 3)
                try:
                    await msg.in_progress()
                except Exception as exc:  # a lost beat costs at worst a redelivery, which tracking absorbs
                    log.warning("progress_ack_failed", consumer=self.name, error=str(exc))

        beating = asyncio.create_task(beat())
        try:
            await work
        finally:
            beating.cancel()

    async def handle_one(self, msg: Msg, handler: Handler) -> None:
        try:
            event = parse_event(msg.data)
        except EventError as exc:
            await self.bus.dead_letter(self.name, msg, f"malformed event: {exc}")
            await msg.term()
            return
        if self.types is not None and event.type not in self.types:
            self.skipped_types += 1  # a family wildcard on a server without multi-subject filters
            await msg.ack()
            return
        try:
            await self._while_in_progress(msg, handler(event, msg))
        except PoisonMessage as exc:
            await self.bus.dead_letter(self.name, msg, f"poison: {exc}")
            await msg.term()
            return
        except Exception as exc:
            delivered = msg.metadata.num_delivered
            if delivered >= self.options.max_deliver:
                await self.bus.dead_letter(
                    self.name, msg, f"handler failed {delivered} times; last error {type(exc).__name__}: {exc}"
                )
                await msg.term()
            else:
                backoff = self.options.backoff_s
                delay = backoff[min(delivered - 1, len(backoff) - 1)] if backoff else 0.5
                log.warning("handler_failed", consumer=self.name, type=event.type, error=str(exc), retry_in=delay)
                await msg.nak(delay=delay)
            return
        # A fire-and-forget ack: a lost one means a redelivery, which tracking turns into a no-op.
        await msg.ack()


__all__ = ["ConsumerOptions", "DeadLetters", "Handler", "JetStreamConsumer", "PoisonMessage"]
