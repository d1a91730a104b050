"""The event bus on NATS JetStream: one stream per event family, deduplicated publish, durable pull consumers
(shared/consumer.py) with a dead-letter subject, request/reply for the data path, and a bucket of the JetStream
Object Store (shared/objects.py) for large payloads.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from shared.consumer import ConsumerOptions, Handler, JetStreamConsumer, PoisonMessage
from shared.events import REGISTRY, Event
from shared.logging import get_logger
from shared.objects import ObjectDigestMismatch, ObjectFetchTimeout, ObjectStore

FAMILIES: tuple[str, ...] = tuple(sorted({t.split(".", 1)[0] for t in REGISTRY}))
DLQ_REASON = "Gyre-Dlq-Reason"
DLQ_SUBJECT = "Gyre-Dlq-Subject"
DLQ_DELIVERIES = "Gyre-Dlq-Deliveries"
KV_OBJECT_TTL_S = 3600.0  # a migrated KV cache waits at most this long for its target

log = get_logger(component="bus")


class BusError(Exception):
    pass


class PublishFailed(BusError):
    """JetStream refused or did not acknowledge a publish (no stream for the subject, a limit, a timeout)."""


RequestHandler = Callable[[bytes], Awaitable[bytes]]


class Bus:
    def __init__(self, nc: NatsClient, js: JetStreamContext, prefix: str, duplicate_window_s: float,
                 replicas: int = 1) -> None:
        self.nc = nc
        self.js = js
        self.prefix = prefix
        self.duplicate_window_s = duplicate_window_s
        # Copies of every stream and bucket this connection creates: 3 on a three-server cluster, so the loss of
        # one server loses nothing (an existing stream is updated to it).
        self.replicas = replicas
        self._stream_prefix = re.sub(r"[^A-Za-z0-9_-]", "_", prefix).upper()
        self.objects = ObjectStore(js, f"{self._stream_prefix}-blobs".lower(), replicas=replicas)
        # KV caches between rollout workers: only in transit, so a bucket whose objects expire.
        self.kv_objects = ObjectStore(js, f"{self._stream_prefix}-kv".lower(), ttl_s=KV_OBJECT_TTL_S,
                                      replicas=replicas)
        # The trainer's distributed checkpoints, by name (services/trainer/checkpoints.py).
        self.checkpoints = ObjectStore(js, f"{self._stream_prefix}-checkpoints".lower(), replicas=replicas)
        self._acks_subject: str | None = None
        self._pending_acks: dict[str, _PendingAcks] = {}
        self.dead_letters: Counter[str] = Counter()  # what this connection dead-lettered, by consumer

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        prefix: str = "gyre",
        duplicate_window_s: float = 120.0,
        connect_timeout_s: float = 30.0,
        name: str | None = None,
        replicas: int = 1,
    ) -> Bus:
        """Connect (retrying until `connect_timeout_s`) and keep reconnecting forever after a drop. `url` may list
        several servers of one cluster, comma-separated: the client connects to any and moves to another when
        its server goes (it also learns the cluster's other members from the server)."""
        servers = [u.strip() for u in url.split(",") if u.strip()]
        deadline = asyncio.get_running_loop().time() + connect_timeout_s
        while True:
            try:
                nc = await nats.connect(
                    servers,
                    name=name,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                    connect_timeout=2,
                    drain_timeout=5,
                    allow_reconnect=True,
                )
                break
            except (OSError, nats.errors.NoServersError, nats.errors.TimeoutError) as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise BusError(f"could not reach NATS at {url}: {exc}") from exc
                await asyncio.sleep(0.25)
        return cls(nc, nc.jetstream(timeout=10), prefix, duplicate_window_s, replicas)

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    # ---- naming ----

    def subject(self, event_type: str) -> str:
        return f"{self.prefix}.{event_type}"

    def stream_name(self, family: str) -> str:
        return f"{self._stream_prefix}_{family.upper()}"

    def dlq_subject(self, consumer: str) -> str:
        return f"{self.prefix}.dlq.{consumer}"

    @property
    def dlq_stream(self) -> str:
        return f"{self._stream_prefix}_DLQ"

    async def ensure_streams(self) -> None:
        """Create (or update) the family streams and the dead-letter stream. Idempotent."""
        for family in FAMILIES:
            await self._ensure_stream(self.stream_name(family), [f"{self.prefix}.{family}.>"])
        await self._ensure_stream(self.dlq_stream, [f"{self.prefix}.dlq.>"])

    async def _ensure_stream(self, name: str, subjects: list[str]) -> None:
        config = StreamConfig(
            name=name,
            subjects=subjects,
            storage=StorageType.FILE,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
        )
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.js.update_stream(config)

    async def delete_streams(self) -> None:
        for name in [self.stream_name(f) for f in FAMILIES] + [self.dlq_stream]:
            try:
                await self.js.delete_stream(name)
            except nats.js.errors.NotFoundError:
                pass

    # ---- publish ----

    async def publish(self, event: Event) -> bool:
        """Publish with `Nats-Msg-Id = event_id`; returns False when JetStream saw it as a duplicate."""
        ack = await self.js.publish(
            self.subject(event.type), event.to_json(), headers={"Nats-Msg-Id": str(event.event_id)}
        )
        return not ack.duplicate

    async def publish_many(self, events: Sequence[Event]) -> int:
        """Publish pipelined and wait for every ack; returns how many were new (not duplicates)."""
        return await self.publish_payloads([(e.type, e.to_json(), str(e.event_id)) for e in events])

    async def publish_payloads(
        self, items: Sequence[tuple[str, bytes, str]], *, ack_timeout_s: float = 10.0
    ) -> int:
        """Publish (event_type, payload, event_id) triples pipelined and wait for every JetStream ack
        (bounded: a server that dies mid-batch raises, and the caller re-sends; dedup absorbs it).
        Returns how many were new.

        The publishes go out as plain NATS publishes whose reply subjects name this batch and the item, on
        one reply subscription per connection: less than half the CPU per message of `publish_async` (a
        future, a semaphore and a token each), which was the relay's largest cost per event.
        """
        if not items:
            return 0
        inbox = await self._ack_inbox()
        acks = _PendingAcks(len(items))
        token = uuid.uuid4().hex
        self._pending_acks[token] = acks
        prefix = f"{inbox}.{token}."
        try:
            for index, (event_type, payload, event_id) in enumerate(items):
                await self.nc.publish(
                    self.subject(event_type), payload, reply=prefix + str(index), headers={"Nats-Msg-Id": event_id}
                )
            await asyncio.wait_for(acks.done, ack_timeout_s)
        finally:
            del self._pending_acks[token]
        if acks.errors:
            index, error = acks.errors[0]
            raise PublishFailed(f"{len(acks.errors)} of {len(items)} publishes failed; item {index}: {error}")
        return acks.new

    async def _ack_inbox(self) -> str:
        if self._acks_subject is None:
            inbox = self.nc.new_inbox()
            await self.nc.subscribe(f"{inbox}.*.*", cb=self._on_ack)
            self._acks_subject = inbox
        return self._acks_subject

    async def _on_ack(self, msg: Msg) -> None:
        _, token, index = msg.subject.rsplit(".", 2)
        acks = self._pending_acks.get(token)
        if acks is not None:  # None: a late ack for a batch that already timed out (and will be re-sent)
            acks.record(int(index), msg)

    async def publish_raw(self, subject: str, payload: bytes, *, msg_id: str | None = None) -> None:
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        await self.js.publish(subject, payload, headers=headers)

    # ---- consume ----

    async def consumer(
        self,
        durable: str,
        event_types: Sequence[str],
        options: ConsumerOptions | None = None,
    ) -> list[JetStreamConsumer]:
        """Durable pull consumers (one per family stream) that deliver only `event_types`.

        The server filters: one subject, or several with `filter_subjects` (NATS ≥ 2.10). An older server
        ignores `filter_subjects` and would deliver the whole family, so there the consumer takes the
        family's wildcard explicitly and drops the other types itself (acked, never handed to the handler).
        """
        options = options or ConsumerOptions()
        by_family: dict[str, list[str]] = {}
        for t in event_types:
            by_family.setdefault(t.split(".", 1)[0], []).append(t)
        multi = self.supports_multi_filter
        consumers = []
        for family, types in sorted(by_family.items()):
            name = f"{durable}-{family}"
            subjects = [self.subject(t) for t in types]
            if len(subjects) == 1:
                single, several = subjects[0], None
            elif multi:
                single, several = None, subjects
            else:
                single, several = self.subject(f"{family}.>"), None
            config = ConsumerConfig(
                durable_name=name,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                # No server-side `backoff`: the server would replace `ack_wait` with its first entry. Failed
                # handlers nak with the backoff delays themselves (`handle_one`); a running handler keeps its
                # message with progress acks, so `ack_wait` is how long a consumer that died holding a
                # message delays it.
                ack_wait=options.ack_wait_s,
                max_deliver=options.max_deliver,
                filter_subjects=several,
                filter_subject=single,
                max_ack_pending=max(options.batch * 4, 1000),
            )
            # pull_subscribe creates the durable consumer once and binds to it after a restart.
            sub = await self.js.pull_subscribe(single or subjects[0], durable=name, stream=self.stream_name(family),
                                               config=config)
            consumers.append(JetStreamConsumer(self, durable, sub, options, types=frozenset(types)))
        return consumers

    @property
    def supports_multi_filter(self) -> bool:
        """Whether the server honours a consumer's `filter_subjects` (added in NATS 2.10)."""
        version = self.nc.connected_server_version
        return (version.major, version.minor) >= (2, 10)

    async def dead_letter(self, consumer: str, msg: Msg, reason: str) -> None:
        deliveries = str(msg.metadata.num_delivered) if msg.reply else "0"
        headers = {
            DLQ_REASON: reason[:2000],
            DLQ_SUBJECT: msg.subject,
            DLQ_DELIVERIES: deliveries,
        }
        await self.js.publish(self.dlq_subject(consumer), msg.data, headers=headers)
        self.dead_letters[consumer] += 1
        log.warning("dead_lettered", consumer=consumer, subject=msg.subject, reason=reason[:300])

    async def read_dead_letters(self, consumer: str, *, timeout: float = 1.0) -> list[tuple[bytes, dict[str, str]]]:
        """Every dead letter of `consumer` so far (an ephemeral ordered read; for operators and tests)."""
        out: list[tuple[bytes, dict[str, str]]] = []
        sub = await self.js.subscribe(self.dlq_subject(consumer), ordered_consumer=True)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=timeout)
                except nats.errors.TimeoutError:
                    return out
                out.append((msg.data, dict(msg.headers or {})))
        finally:
            await sub.unsubscribe()

    # ---- request/reply (data path) ----

    async def request(self, subject: str, payload: bytes, *, timeout: float = 60.0) -> bytes:
        msg = await self.nc.request(subject, payload, timeout=timeout)
        return msg.data

    async def serve(self, subject: str, handler: RequestHandler, *, queue: str = "") -> Any:
        async def on_msg(msg: Msg) -> None:
            try:
                reply = await handler(msg.data)
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # the requester must get an answer, not a timeout
                # BaseException: some libraries raise their failures as one (torch's DCP), and one escaping here
                # would end the subscription's task, leaving every later request on the subject unanswered.
                log.exception("request_handler_failed", subject=msg.subject)
                reply = b'{"error":' + _json_str(f"{type(exc).__name__}: {exc}") + b"}"
            await msg.respond(reply)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    # ---- object store (large payloads by digest) ----

    async def put_object(self, data: bytes, *, name: str | None = None) -> str:
        """Store bytes in this bus's bucket under their digest (or `name`): see `ObjectStore.put_object`."""
        return await self.objects.put_object(data, name=name)

    async def get_object(
        self, name_or_digest: str, *, expected_digest: str | None = None, stall_s: float = 60.0
    ) -> bytes:
        """Read an object whole: see `ObjectStore.get_object`."""
        return await self.objects.get_object(name_or_digest, expected_digest=expected_digest, stall_s=stall_s)


def _json_str(text: str) -> bytes:
    return json.dumps(text).encode()


class _PendingAcks:
    """The JetStream acks still expected for one pipelined batch of publishes."""

    def __init__(self, count: int) -> None:
        self.seen = bytearray(count)
        self.left = count
        self.new = 0
        self.errors: list[tuple[int, str]] = []
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def record(self, index: int, msg: Msg) -> None:
        if not 0 <= index < len(self.seen) or self.seen[index]:
            return
        self.seen[index] = 1
        self.left -= 1
        headers = msg.headers or {}
        if status := headers.get("Status"):  # 503: no stream listens on the subject
            self.errors.append((index, f"status {status} {headers.get('Description', '')}".strip()))
        else:
            try:
                reply = json.loads(msg.data)
            except ValueError:
                reply = {"error": {"description": f"not a publish ack: {msg.data[:200]!r}"}}
            if "error" in reply:
                self.errors.append((index, str(reply["error"].get("description", reply["error"]))))
            elif not reply.get("duplicate"):
                self.new += 1
        if self.left == 0 and not self.done.done():
            self.done.set_result(None)


__all__ = [
    "Bus",
    "BusError",
    "ConsumerOptions",
    "Handler",
    "JetStreamConsumer",
    "ObjectDigestMismatch",
    "ObjectFetchTimeout",
    "PoisonMessage",
    "PublishFailed",
]
