"""A three-server NATS cluster on this machine (JetStream on each, Gyre's streams and buckets in three copies):
the bus goes on through the loss of any one server, the stream's leader included. Every event published before
and after the loss is delivered to a durable consumer, none is stored twice, and an object written before the
loss reads back whole."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre.local import nats_server_binary
from shared.bus import Bus, ConsumerOptions
from shared.events import Event
from shared.ports import free_port
from shared.tokens import digest_of
from tests.conftest import unique
from tests.shared.helpers import assigned

FAST = ConsumerOptions(ack_wait_s=2.0, max_deliver=10, backoff_s=(0.2,), batch=50, fetch_timeout_s=0.2)


@dataclass
class Server:
    name: str
    port: int
    route_port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, routes: list[int]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        conf = self.folder / "nats.conf"
        conf.write_text(
            f"server_name: {self.name}\nlisten: 127.0.0.1:{self.port}\nmax_payload: 8MB\n"
            f'jetstream {{ store_dir: "{self.folder / "js"}" }}\n'
            f"cluster {{ name: gyre, listen: 127.0.0.1:{self.route_port}, routes: ["
            + ", ".join(f"nats-route://127.0.0.1:{r}" for r in routes) + "] }\n"
        )
        log = open(self.folder / "nats.log", "ab")
        self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def cluster(tmp_path: Path):
    servers = [Server(f"n{i}", free_port(), free_port(), tmp_path / f"n{i}") for i in range(3)]
    for server in servers:
        server.start([s.route_port for s in servers if s is not server])
    yield servers
    for server in servers:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


async def connect(servers: list[Server], *, prefix: str) -> Bus:
    url = ",".join(f"nats://127.0.0.1:{s.port}" for s in servers)
    bus = await Bus.connect(url, prefix=prefix, replicas=3)
    deadline = time.monotonic() + 60
    while True:  # the cluster elects its JetStream meta leader after the servers have met
        try:
            await bus.ensure_streams()
            return bus
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def events(n: int, offset: int) -> list[Event]:
    return [assigned(f"cell-{offset + i}") for i in range(n)]


async def publish_through(bus: Bus, batch: list[Event], timeout: float = 60) -> None:
    """Publish each event, retrying while the cluster moves its leaders (the same event id is stored once)."""
    for event in batch:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await bus.publish(event)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def retried(call, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def test_the_bus_goes_on_through_the_loss_of_the_streams_leader(cluster: list[Server]) -> None:
    """A running consumer (a service) reads on through the loss of the server leading the stream; publishes
    made meanwhile are retried by event id, so each is stored once."""
    bus = await connect(cluster, prefix=unique("c"))
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        first, second = events(50, 0), events(50, 50)
        stream = bus.stream_name(first[0].type.split(".")[0])
        info = await bus.js.stream_info(stream)
        assert info.config.num_replicas == 3 and info.cluster is not None and len(info.cluster.replicas or []) == 2
        received: list[str] = []

        async def handle(event: Event, _delivery: object) -> None:
            received.append(str(event.event_id))

        async def until(count: int) -> None:
            while len(set(received)) < count:
                await asyncio.sleep(0.1)

        consumers = await bus.consumer("cluster-reader", [first[0].type], FAST)
        tasks = [asyncio.create_task(c.run(handle, stop)) for c in consumers]
        await publish_through(bus, first)
        digest = await bus.put_object(b"weights" * 100_000)
        await asyncio.wait_for(until(50), 180)

        leader = next(s for s in cluster if s.name == info.cluster.leader)
        leader.kill()

        await publish_through(bus, second)
        await asyncio.wait_for(until(100), 300)
        assert set(received) == {str(e.event_id) for e in first + second}
        after = await retried(lambda: bus.js.stream_info(stream))
        assert after.cluster is not None and after.cluster.leader != leader.name
        assert after.state.messages == 100  # nothing stored twice, though publishes were retried
        assert await retried(lambda: bus.get_object(digest)) == b"weights" * 100_000
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()  # the cluster and its streams go with the test's folder


async def test_a_bucket_made_with_a_server_down_takes_its_first_write_at_once(cluster: list[Server]) -> None:
    """A session's KV in transit goes to a bucket made on its first use, by whichever worker comes first: made in
    three copies with one of the three servers down, a write just after waits for the stream's leader instead of
    each chunk coming back 503 (no responders) while the two live replicas elect one."""
    from nats.js.api import ObjectStoreConfig, StorageType

    from shared.objects import ObjectStore

    bus = await connect(cluster, prefix=unique("c"))
    other = await connect(cluster[1:], prefix=unique("c"))  # another process's connection, to another server
    try:
        cluster[2].kill()
        await retried(bus.ensure_streams)  # the meta layer answers again with two of three
        data = bytes(range(256)) * 8192  # 2 MiB: four chunks
        for i in range(3):  # fresh buckets: each a new stream, each with an election of its own
            bucket = unique(f"transit{i}")
            await other.js.create_object_store(bucket, config=ObjectStoreConfig(
                bucket=bucket, ttl=60.0, replicas=3, storage=StorageType.MEMORY))  # the other worker made it
            store = ObjectStore(bus.js, bucket, ttl_s=60.0, replicas=3)
            upload = await store.start_put(data, name="kv-first", digest=digest_of(data))
            assert await upload.task == digest_of(data)
            info = await bus.js.stream_info(f"OBJ_{bucket}")
            assert info.cluster is not None and info.cluster.leader and info.config.num_replicas == 3
    finally:
        await other.close()
        await bus.close()
