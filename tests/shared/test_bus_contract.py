"""Contract suite for the bus port, run against a real nats-server per backend (embedded and by URL)."""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid

import nats.js.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.bus import (
    FAMILIES,
    DLQ_DELIVERIES,
    DLQ_REASON,
    Bus,
    ConsumerOptions,
    ObjectDigestMismatch,
    ObjectFetchTimeout,
    PoisonMessage,
    PublishFailed,
)
from shared.events import Event, EventError, parse_event
from tests.conftest import drop_bus, make_bus
from tests.hostile import DELETE, json_values, replaced
from tests.shared.helpers import assigned

FAST = ConsumerOptions(ack_wait_s=1.0, max_deliver=3, backoff_s=(0.1,), batch=50, fetch_timeout_s=0.2)


@pytest.fixture
async def nbus(backend):
    b = await make_bus(backend.nats_url)
    yield b
    await drop_bus(b)


async def consume_until(bus: Bus, durable: str, types, handler, done, options=FAST, timeout=15.0):
    stop = asyncio.Event()
    consumers = await bus.consumer(durable, types, options)
    tasks = [asyncio.create_task(c.run(handler, stop)) for c in consumers]
    try:
        await asyncio.wait_for(done(), timeout)
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def receive(bus: Bus, durable: str, types, count: int) -> list[Event]:
    """Run a durable consumer until `count` events arrived; returns them in arrival order."""
    got: list[Event] = []

    async def handler(event, msg):
        got.append(event)

    async def done():
        while len(got) < count:
            await asyncio.sleep(0.05)

    await consume_until(bus, durable, types, handler, done)
    return got


async def test_publish_is_deduplicated_by_event_id(nbus: Bus):
    event = assigned()
    assert await nbus.publish(event) is True
    assert await nbus.publish(event) is False
    assert await nbus.publish_many([event, assigned()]) == 1


async def test_pipelined_publish_counts_new_events_and_keeps_their_order(nbus: Bus):
    events = [assigned("cell-a", v) for v in range(1, 301)]
    payloads = [(e.type, e.to_json(), str(e.event_id)) for e in events]
    assert await nbus.publish_payloads(payloads[:200]) == 200
    assert await nbus.publish_payloads(payloads) == 100  # the first 200 are duplicates
    assert await receive(nbus, "pipelined", ["cell.assigned"], 300) == events


async def test_pipelined_publish_without_a_stream_is_a_named_error(nbus: Bus):
    with pytest.raises(PublishFailed, match="2 of 2 publishes failed"):
        await nbus.publish_payloads([("nowhere.a", b"{}", "m1"), ("nowhere.b", b"{}", "m2")], ack_timeout_s=5)


async def test_durable_consumer_receives_in_order_and_acks(nbus: Bus):
    events = [assigned("cell-a", v) for v in range(1, 21)]
    for e in events:
        await nbus.publish(e)
    assert await receive(nbus, "c1", ["cell.assigned"], 20) == events
    # Acked: a new run of the same durable consumer receives nothing more.
    more: list[Event] = []

    async def handler2(event, msg):
        more.append(event)

    async def wait_a_bit():
        await asyncio.sleep(1.5)

    await consume_until(nbus, "c1", ["cell.assigned"], handler2, wait_a_bit)
    assert more == []


async def test_consumer_filters_by_type_across_families(nbus: Bus):
    await nbus.publish(assigned())
    from tests.shared.test_events import scored

    await nbus.publish(scored())
    got: list[str] = []

    async def handler(event, msg):
        got.append(event.type)

    async def done():
        while len(got) < 2:
            await asyncio.sleep(0.05)

    await consume_until(nbus, "multi", ["cell.assigned", "execution.scored"], handler, done)
    assert sorted(got) == ["cell.assigned", "execution.scored"]


@pytest.mark.parametrize("server_filters_several", [True, False], ids=["server-filters", "family-wildcard"])
async def test_consumer_of_several_types_of_one_family_gets_only_those(
    nbus: Bus, server_filters_several: bool, monkeypatch: pytest.MonkeyPatch
):
    """NATS before 2.10 ignores `filter_subjects`; the consumer must still hand over only its own types
    (the gateway revoked executions' tokens on `execution.started` when it did not)."""
    from datetime import UTC, datetime

    from shared.events import CellReady, CellReleased, new_event

    if not server_filters_several:
        monkeypatch.setattr(Bus, "supports_multi_filter", property(lambda self: False))
    elif not nbus.supports_multi_filter:
        pytest.skip("this NATS server predates 2.10 and cannot filter on several subjects (the family-wildcard case runs)")

    def event(data, version: int) -> Event:
        return new_event(data, run_id="r", stream_id="cell-a", version=version, occurred_at=datetime.now(UTC))

    published = [
        assigned("cell-a", 1),
        event(CellReady(cell_id="a", role="rollout", switch_seconds=1.0), 2),
        event(CellReleased(cell_id="a", from_role="rollout", migrated_sessions=0, seconds=1.0), 3),
        event(CellReady(cell_id="a", role="train", switch_seconds=1.0), 4),
        assigned("cell-a", 5),
    ]
    for e in published:
        await nbus.publish(e)
    got = await receive(nbus, "two-types", ["cell.assigned", "cell.released"], 3)
    await asyncio.sleep(0.3)  # nothing else may follow
    assert [e.event_id for e in got] == [published[i].event_id for i in (0, 2, 4)]


async def test_unacked_message_is_redelivered(nbus: Bus):
    await nbus.publish(assigned())
    deliveries: list[int] = []

    async def flaky(event, msg):
        deliveries.append(msg.metadata.num_delivered)
        if len(deliveries) == 1:
            raise ConnectionError("transient")

    async def done():
        while len(deliveries) < 2:
            await asyncio.sleep(0.05)

    await consume_until(nbus, "flaky", ["cell.assigned"], flaky, done)
    assert deliveries == [1, 2]


async def test_poison_message_is_dead_lettered_after_max_deliver_and_consumer_goes_on(nbus: Bus):
    bad, good = assigned("cell-bad"), assigned("cell-good")
    await nbus.publish(bad)
    await nbus.publish(good)
    handled: list[str] = []

    async def handler(event, msg):
        if event.stream_id == "cell-bad":
            raise ValueError("cannot apply this event")
        handled.append(event.stream_id)

    async def done():
        while not (handled and await nbus.read_dead_letters("poison", timeout=0.2)):
            await asyncio.sleep(0.1)

    await consume_until(nbus, "poison", ["cell.assigned"], handler, done)
    assert handled == ["cell-good"]
    letters = await nbus.read_dead_letters("poison")
    assert len(letters) == 1
    data, headers = letters[0]
    assert data == bad.to_json()
    assert "failed 3 times" in headers[DLQ_REASON] and "cannot apply" in headers[DLQ_REASON]
    assert headers[DLQ_DELIVERIES] == "3"


async def test_handler_can_reject_a_message_as_poison_at_once(nbus: Bus):
    await nbus.publish(assigned())
    calls = []

    async def handler(event, msg):
        calls.append(1)
        raise PoisonMessage("references a blob that does not exist")

    async def done():
        while not await nbus.read_dead_letters("reject", timeout=0.2):
            await asyncio.sleep(0.05)

    await consume_until(nbus, "reject", ["cell.assigned"], handler, done)
    assert len(calls) == 1
    (_, headers), = await nbus.read_dead_letters("reject")
    assert "blob that does not exist" in headers[DLQ_REASON]


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"{not json", "not JSON"),
        (b'{"type": "cell.exploded", "schema_version": 1}', "unknown event type"),
        (b'{"type": "cell.assigned", "schema_version": 1, "data": {}}', "invalid event"),
    ],
)
async def test_malformed_payloads_are_dead_lettered_with_a_reason(nbus: Bus, payload: bytes, reason: str):
    await nbus.publish_raw(nbus.subject("cell.assigned"), payload, msg_id="m1")
    good = assigned()
    await nbus.publish(good)
    handled: list[Event] = []

    async def handler(event, msg):
        handled.append(event)

    async def done():
        while not handled:
            await asyncio.sleep(0.05)

    await consume_until(nbus, "strict", ["cell.assigned"], handler, done)
    assert handled == [good]
    letters = await nbus.read_dead_letters("strict")
    assert [d for d, _ in letters] == [payload]
    assert reason in letters[0][1][DLQ_REASON]


async def test_a_failure_outside_the_handler_loses_neither_the_loop_nor_the_message(nbus: Bus, monkeypatch):
    """The dead-letter publish fails once (the server away mid-reconnect, say): the consumer goes on with the
    next event, and the unacknowledged payload comes back after ack_wait and is dead-lettered then."""
    bad = b'{"type": ["cell.assigned"], "schema_version": 1, "data": {}}'
    await nbus.publish_raw(nbus.subject("cell.assigned"), bad, msg_id="bad")
    good = assigned()
    await nbus.publish(good)
    real = nbus.dead_letter
    attempts = []

    async def flaky(consumer, msg, reason):  # noqa: ANN001, ANN202
        attempts.append(reason)
        if len(attempts) == 1:
            raise ConnectionError("publish lost")
        await real(consumer, msg, reason)

    monkeypatch.setattr(nbus, "dead_letter", flaky)
    handled: list[Event] = []

    async def handler(event, msg):
        handled.append(event)

    async def done():
        while not (handled and await nbus.read_dead_letters("sturdy", timeout=0.2)):
            await asyncio.sleep(0.05)

    await consume_until(nbus, "sturdy", ["cell.assigned"], handler, done)
    assert handled == [good] and len(attempts) == 2
    assert [d for d, _ in await nbus.read_dead_letters("sturdy")] == [bad]


async def test_the_server_keeps_the_consumers_ack_wait(nbus: Bus):
    """Redelivery of a message whose handler is still running waits `ack_wait`; a server-side backoff
    list would replace it with its first delay."""
    (consumer,) = await nbus.consumer("patient", ["cell.assigned"], FAST)
    info = await nbus.js.consumer_info(nbus.stream_name("cell"), "patient-cell")
    await consumer.sub.unsubscribe()
    assert info.config.ack_wait == FAST.ack_wait_s and not info.config.backoff


async def test_a_handler_running_longer_than_ack_wait_keeps_its_message(nbus: Bus):
    """Progress acks: a 2.5 s handler under a 1 s ack_wait is delivered once, not again while it runs."""
    event = assigned()
    await nbus.publish(event)
    deliveries: list[int] = []

    async def slow(ev, msg):
        deliveries.append(msg.metadata.num_delivered)
        await asyncio.sleep(2.5)

    async def done():
        while not deliveries:
            await asyncio.sleep(0.05)
        await asyncio.sleep(4.0)  # long enough for a redelivery to show up

    await consume_until(nbus, "slow", ["cell.assigned"], slow, done)
    assert deliveries == [1]


async def test_request_reply(nbus: Bus):
    async def echo(data: bytes) -> bytes:
        return data[::-1]

    async def broken(data: bytes) -> bytes:
        raise RuntimeError("worker fell over")

    class Outside(BaseException):  # as torch's CheckpointException is
        pass

    async def outside(data: bytes) -> bytes:
        raise Outside("not an Exception")

    subs = [await nbus.serve(f"{nbus.prefix}.rpc.{name}", fn)
            for name, fn in (("echo", echo), ("broken", broken), ("outside", outside))]
    assert await nbus.request(f"{nbus.prefix}.rpc.echo", b"abc", timeout=5) == b"cba"
    assert b"worker fell over" in await nbus.request(f"{nbus.prefix}.rpc.broken", b"x", timeout=5)
    # A BaseException is answered too, and the subject keeps answering after it.
    for _ in range(2):
        assert b"not an Exception" in await nbus.request(f"{nbus.prefix}.rpc.outside", b"x", timeout=5)
    for sub in subs:
        await sub.unsubscribe()


async def test_object_store_round_trip_is_digest_checked(nbus: Bus):
    data = bytes(range(256)) * 20_000  # 5 MB: above the default max message size, chunked by the store
    digest = await nbus.put_object(data)
    assert await nbus.get_object(digest) == data
    await nbus.put_object(b"other", name="named")
    with pytest.raises(ObjectDigestMismatch):
        await nbus.get_object("named", expected_digest=digest)


class _SlowWriter(io.RawIOBase):
    """A reader's sink that takes its time with each chunk, as a busy process does."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        time.sleep(0.01)
        self.data += b
        return len(b)


async def test_a_second_put_of_the_same_bytes_leaves_a_read_in_progress_whole(nbus: Bus):
    """A trainer whose step changed nothing publishes the same weights again while a worker reads them: the
    Object Store would replace the object and purge the chunks that read is waiting for (it never returns)."""
    data = bytes(range(256)) * 16_000  # 4 MB: ~32 chunks, read at ~10 ms each
    digest = await nbus.put_object(data)
    store = await nbus.objects._objects()  # noqa: SLF001
    name = digest.replace(":", "-")
    before = await store.get_info(name)
    sink = _SlowWriter()
    reading = asyncio.create_task(store.get(name, writeinto=sink))
    await asyncio.sleep(0.05)
    assert await nbus.put_object(data) == digest
    await asyncio.wait_for(reading, 30)
    assert bytes(sink.data) == data
    assert (await store.get_info(name)).nuid == before.nuid  # written once


async def test_a_read_whose_chunks_are_gone_fails_instead_of_waiting_for_ever(nbus: Bus):
    digest = await nbus.put_object(bytes(range(256)) * 2_000)
    store = await nbus.objects._objects()  # noqa: SLF001
    info = await store.get_info(digest.replace(":", "-"))
    await nbus.js.purge_stream(store._stream, subject=f"$O.{info.bucket}.C.{info.nuid}")  # noqa: SLF001
    with pytest.raises(ObjectFetchTimeout, match="0 B arrived, then nothing for 1 s"):
        await nbus.get_object(digest, stall_s=1.0)


_EVENT_PATHS = [("type",), ("schema_version",), ("data",), ("stream_id",), ("version",), ("event_id",),
                ("occurred_at",), ("run_id",), ("data", "cell_id"), ("data", "role"), ("data", "policy")]
_values = json_values(words=["cell.released", "cell.exploded", "rollout", "train", 0, -1])
_payloads = (
    st.binary(max_size=120)
    | _values.map(lambda v: json.dumps(v, allow_nan=True).encode())
    | st.builds(lambda p, v: (p, v), st.sampled_from(_EVENT_PATHS), _values | st.just(DELETE))
    | st.integers(200, 3000).map(lambda n: b'{"type": "cell.assigned", "data": ' + b"[" * n + b"]" * n + b"}")
)


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(payloads=st.lists(_payloads, min_size=5, max_size=12))
async def test_generated_malformed_events_are_dead_lettered_never_dropped(backend, payloads: list) -> None:
    """Whatever lands on an event subject is either an event the handler gets or a dead letter with its reason:
    handled plus dead-lettered is everything published, and the consumer goes on. (A bus of its own per
    example: a new consumer reads its stream from the start.)"""
    nbus = await make_bus(backend.nats_url)
    try:
        await _dead_letter_or_deliver(nbus, payloads)
    finally:
        await drop_bus(nbus)


async def _dead_letter_or_deliver(nbus: Bus, payloads: list) -> None:
    durable = f"fuzz-{uuid.uuid4().hex[:8]}"
    sent: list[bytes] = []
    for i, payload in enumerate(payloads):
        raw = (json.dumps(replaced(json.loads(assigned().to_json()), *payload), allow_nan=True).encode()
               if isinstance(payload, tuple) else payload)
        await nbus.publish_raw(nbus.subject("cell.assigned"), raw, msg_id=f"{durable}-{i}")
        sent.append(raw)
    last = assigned("cell-last")
    await nbus.publish(last)
    parses = []
    for raw in sent:
        try:
            parse_event(raw)
            parses.append(True)
        except EventError:
            parses.append(False)
    handled: list[Event] = []

    async def handler(event: Event, msg: object) -> None:
        handled.append(event)

    async def done() -> None:
        while not any(e.stream_id == "cell-last" for e in handled):
            await asyncio.sleep(0.05)
        while len(await nbus.read_dead_letters(durable, timeout=0.2)) < parses.count(False):
            await asyncio.sleep(0.05)

    await consume_until(nbus, durable, ["cell.assigned"], handler, done)
    letters = await nbus.read_dead_letters(durable)
    assert sorted(d for d, _ in letters) == sorted(raw for raw, ok in zip(sent, parses, strict=True) if not ok)
    assert all(headers[DLQ_REASON].strip() for _, headers in letters)
    assert len(handled) == parses.count(True) + 1


async def test_streams_and_buckets_are_made_with_the_copies_asked_for(backend):
    """The copies a connection asks for reach the server: one here; three, which one server cannot keep, are
    refused by it rather than silently made as one (a three-server cluster keeps them: docs/deploy.md)."""
    from tests.conftest import unique

    one = await Bus.connect(backend.nats_url, prefix=unique("t"), replicas=1)
    try:
        await one.ensure_streams()
        info = await one.js.stream_info(one.stream_name(FAMILIES[0]))
        assert info.config.num_replicas == 1
    finally:
        await drop_bus(one)
    three = await Bus.connect(backend.nats_url, prefix=unique("t"), replicas=3)
    try:
        with pytest.raises(nats.js.errors.APIError):
            await three.ensure_streams()
        with pytest.raises(nats.js.errors.APIError):
            await three.objects.put_object(b"x")
    finally:
        await drop_bus(three)
