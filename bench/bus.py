"""Events per second through append → outbox relay → JetStream → durable consumer, against raw nats-py
publish+consume of the same payloads in the same run.

    python bench/bus.py [--events 20000] [--batch 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlalchemy as sa  # noqa: E402

from bench._infra import servers  # noqa: E402
from shared.bus import Bus, ConsumerOptions  # noqa: E402
from shared.events import CellAssigned, Event, new_event  # noqa: E402
from shared.store import EventStore, run_migrations  # noqa: E402


def make_events(n: int, run_id: str) -> list[Event]:
    now = datetime.now(UTC)
    return [
        new_event(
            CellAssigned(cell_id=f"c{i % 64}", role="rollout", policy="elastic", reason="bench"),
            run_id=run_id, stream_id=f"cell-{i}", version=1, occurred_at=now,
        )
        for i in range(n)
    ]


async def end_to_end(nats_url: str, db_url: str, n: int, batch: int) -> float:
    schema = "bench_" + uuid.uuid4().hex[:8]
    await asyncio.to_thread(run_migrations, db_url, schema)
    store = await EventStore.connect(db_url, schema=schema)
    bus = await Bus.connect(nats_url, prefix="bench" + uuid.uuid4().hex[:8])
    await bus.ensure_streams()
    events = make_events(n, "bench")
    received = 0
    done = asyncio.Event()
    stop = asyncio.Event()

    async def handler(event: Event, msg) -> None:
        nonlocal received
        received += 1
        if received >= n:
            done.set()

    options = ConsumerOptions(batch=batch, fetch_timeout_s=0.5)
    consumers = await bus.consumer("bench", ["cell.assigned"], options)
    tasks = [asyncio.create_task(c.run(handler, stop)) for c in consumers]
    # The relay runs as its own process, as it does in a deployment (`gyre relay`).
    env = {**os.environ, "GYRE_DATABASE_URL": db_url, "GYRE_NATS_URL": nats_url, "GYRE_DB_SCHEMA": schema,
           "GYRE_SUBJECT_PREFIX": bus.prefix, "GYRE_RUN_ID": "bench"}
    relay = subprocess.Popen([sys.executable, "-m", "shared.relay"], env=env, stderr=subprocess.DEVNULL,
                             cwd=Path(__file__).resolve().parents[1])
    await asyncio.sleep(2.0)  # let it connect; its start-up is not part of the throughput
    start = time.perf_counter()
    for i in range(0, n, batch):
        await store.append(events[i : i + batch])
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - start
    stop.set()
    relay.terminate()
    relay.wait()
    await asyncio.gather(*tasks)
    await bus.delete_streams()
    await bus.close()
    async with store.engine.begin() as conn:
        await conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    await store.close()
    return n / elapsed


async def raw(nats_url: str, n: int, batch: int) -> float:
    """The same payloads with plain nats-py: publish (acked, same concurrency) and a pull consumer."""
    import nats
    from nats.js.api import StreamConfig

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    name = "RAW" + uuid.uuid4().hex[:8].upper()
    subject = name.lower() + ".cell.assigned"
    await js.add_stream(StreamConfig(name=name, subjects=[subject], duplicate_window=120))
    payloads = [(e.to_json(), str(e.event_id)) for e in make_events(n, "raw")]
    sub = await js.pull_subscribe(subject, durable="raw", stream=name)
    received = 0

    async def consume() -> None:
        nonlocal received
        while received < n:
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except asyncio.TimeoutError:
                continue
            for msg in msgs:
                json.loads(msg.data)
                await msg.ack()
                received += 1

    start = time.perf_counter()
    consumer = asyncio.create_task(consume())
    for i in range(0, n, batch):  # the same pipelined, acked publish the relay uses
        futures = [await js.publish_async(subject, p, headers={"Nats-Msg-Id": mid}) for p, mid in payloads[i : i + batch]]
        await asyncio.gather(*futures)
    await asyncio.wait_for(consumer, 600)
    elapsed = time.perf_counter() - start
    await js.delete_stream(name)
    await nc.close()
    return n / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    with servers() as (nats_url, db_url, kind):
        raw_rate = await raw(nats_url, args.events, args.batch)
        e2e_rate = await end_to_end(nats_url, db_url, args.events, args.batch)
    print(f"servers: {kind}; events: {args.events}; batch: {args.batch}", file=sys.stderr)
    print(json.dumps({
        "bench": "bus",
        "events_per_s": round(e2e_rate, 1),
        "raw_publish_per_s": round(raw_rate, 1),
        "ratio": round(e2e_rate / raw_rate, 3),
    }))


if __name__ == "__main__":
    asyncio.run(main())
