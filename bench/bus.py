"""Events per second through append → outbox relay → JetStream → durable consumer, against raw nats-py
publish+consume of the same payloads in the same run.

    python bench/bus.py [--events 20000] [--batch 500] [--exactly-once]

The JSON also holds the CPU per event of both sides and their ratio (`cpu_us_per_event`, bench process +
relay + servers when embedded; `raw_cpu_us_per_event`, bench process + nats-server): on a shared machine
the wall-clock rate moves with other jobs' load, the CPU per event much less, and the end-to-end side runs
its relay in a second process (the raw side is one process), so the CPU ratio is the fairer comparison.
Stderr says where the end-to-end CPU went. Both sides check that every event arrived exactly once, and
an untimed raw round warms the server before either is timed.
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

from bench._infra import Servers, servers, tree_cpu_s  # noqa: E402
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


def cpu_snapshot(relay_pid: int, infra: Servers) -> dict[str, float | None]:
    return {
        "bench": time.process_time(),
        "relay": tree_cpu_s(relay_pid),
        **{name: tree_cpu_s(pid) for name, pid in infra.pids.items()},
    }


def cpu_per_event(before: dict[str, float | None], after: dict[str, float | None], n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, start in before.items():
        end = after.get(name)
        if start is not None and end is not None:
            out[name] = round((end - start) / n * 1e6, 1)
    out["total"] = round(sum(out.values()), 1)
    return out


async def end_to_end(
    infra: Servers, n: int, batch: int, *, exactly_once: bool = False
) -> tuple[float, dict[str, float]]:
    nats_url, db_url = infra.nats_url, infra.database_url
    schema = "bench_" + uuid.uuid4().hex[:8]
    await asyncio.to_thread(run_migrations, db_url, schema)
    store = await EventStore.connect(db_url, schema=schema)
    bus = await Bus.connect(nats_url, prefix="bench" + uuid.uuid4().hex[:8])
    await bus.ensure_streams()
    events = make_events(n, "bench")
    seen: set[uuid.UUID] = set()
    duplicates = 0
    done = asyncio.Event()
    stop = asyncio.Event()

    async def handler(event: Event, msg) -> None:
        nonlocal duplicates
        if exactly_once:  # as a service's handler runs: skip what was processed, then record the tracking row
            if await store.is_processed("bench", event.event_id):
                return
            async with store.transaction() as tx:
                if not await tx.mark_processed("bench", event.event_id):
                    return
        if event.event_id in seen:
            duplicates += 1
        seen.add(event.event_id)
        if len(seen) >= n:
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
    cpu_before = cpu_snapshot(relay.pid, infra)
    start = time.perf_counter()
    for i in range(0, n, batch):
        await store.append(events[i : i + batch])
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - start
    cpu = cpu_per_event(cpu_before, cpu_snapshot(relay.pid, infra), n)
    stop.set()
    relay.terminate()
    relay.wait()
    await asyncio.gather(*tasks)
    await bus.delete_streams()
    await bus.close()
    async with store.engine.begin() as conn:
        await conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    await store.close()
    check_delivery("end to end", {e.event_id for e in events}, seen, duplicates)
    return n / elapsed, cpu


def check_delivery(side: str, sent: set[uuid.UUID], seen: set[uuid.UUID], duplicates: int) -> None:
    """A rate counts only if every event arrived once: a redelivery or a lost event would move it."""
    if seen != sent or duplicates:
        raise SystemExit(f"{side}: {len(sent - seen)} events lost, {len(seen - sent)} unknown, {duplicates} "
                         f"delivered twice")


async def raw(infra: Servers, n: int, batch: int) -> tuple[float, dict[str, float]]:
    """The same payloads with plain nats-py: `publish_async` (pipelined, each acked; the relay's own
    `Bus.publish_payloads` is a leaner path) and a pull consumer, in this one process."""
    import nats
    from nats.js.api import StreamConfig

    nc = await nats.connect(infra.nats_url)
    js = nc.jetstream()
    name = "RAW" + uuid.uuid4().hex[:8].upper()
    subject = name.lower() + ".cell.assigned"
    await js.add_stream(StreamConfig(name=name, subjects=[subject], duplicate_window=120))
    payloads = [(e.to_json(), str(e.event_id)) for e in make_events(n, "raw")]
    sub = await js.pull_subscribe(subject, durable="raw", stream=name)
    seen: set[uuid.UUID] = set()
    duplicates = 0

    async def consume() -> None:
        nonlocal duplicates
        while len(seen) < n:
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except asyncio.TimeoutError:
                continue
            for msg in msgs:
                event_id = uuid.UUID(json.loads(msg.data)["event_id"])
                duplicates += event_id in seen
                seen.add(event_id)
                await msg.ack()

    cpu_before = {"bench": time.process_time(), **{k: tree_cpu_s(p) for k, p in infra.pids.items() if k == "nats-server"}}
    start = time.perf_counter()
    consumer = asyncio.create_task(consume())
    for i in range(0, n, batch):
        futures = [await js.publish_async(subject, p, headers={"Nats-Msg-Id": mid}) for p, mid in payloads[i : i + batch]]
        await asyncio.gather(*futures)
    await asyncio.wait_for(consumer, 600)
    elapsed = time.perf_counter() - start
    cpu_after = {"bench": time.process_time(), **{k: tree_cpu_s(p) for k, p in infra.pids.items() if k == "nats-server"}}
    await js.delete_stream(name)
    await nc.close()
    check_delivery("raw", {uuid.UUID(mid) for _, mid in payloads}, seen, duplicates)
    return n / elapsed, cpu_per_event(cpu_before, cpu_after, n)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--exactly-once", action="store_true",
                        help="the consumer records each event in the tracking table, one transaction per event")
    args = parser.parse_args()
    with servers() as infra:
        await raw(infra, min(args.events, 2_000), args.batch)  # warm-up, untimed
        raw_rate, raw_cpu = await raw(infra, args.events, args.batch)
        e2e_rate, cpu = await end_to_end(infra, args.events, args.batch, exactly_once=args.exactly_once)
    print(f"servers: {infra.kind}; events: {args.events}; batch: {args.batch}; "
          f"exactly-once tracking: {args.exactly_once}", file=sys.stderr)
    print(f"CPU µs per event, end to end: {json.dumps(cpu)}; raw nats-py: {json.dumps(raw_cpu)}", file=sys.stderr)
    print(json.dumps({
        "bench": "bus",
        "events_per_s": round(e2e_rate, 1),
        "raw_per_s": round(raw_rate, 1),
        "ratio": round(e2e_rate / raw_rate, 3),
        "cpu_us_per_event": cpu["total"],
        "raw_cpu_us_per_event": raw_cpu["total"],
        "cpu_ratio": round(raw_cpu["total"] / cpu["total"], 3),
    }))


if __name__ == "__main__":
    asyncio.run(main())
