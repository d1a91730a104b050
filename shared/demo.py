"""`make demo`: the main job on a fresh machine.

When the full RL loop is installed (`gyre run`), it runs it. Until then it brings up the local
infrastructure, creates the tiny model, and sends events through the log → relay → JetStream path,
saying plainly what it did.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from shared import local
from shared.settings import load_settings

console = Console()


def main() -> int:
    if importlib.util.find_spec("services.scheduler.run") is not None:
        from services.scheduler.run import main as run_main  # the full loop, once it exists

        return int(run_main(sys.argv[1:]) or 0)
    settings = load_settings()
    console.rule("[bold]Gyre demo: foundation")
    console.print("The full RL loop (`gyre run`) is not built yet; this demo exercises what is.")
    found = local.up(settings.state_dir, nats_url=settings.nats_url, database_url=settings.database_url)
    console.print(f"1. infrastructure up — NATS {found.nats_url}, Postgres {found.database_url} (migrated)")

    model_dir = Path("runs/demo/model")
    started = time.perf_counter()
    from shared.tinymodel import create_tiny_model, model_info

    create_tiny_model(model_dir, seed=0, size="tiny", overwrite=True)
    info = model_info(model_dir)
    console.print(
        f"2. tiny model at {model_dir} in {time.perf_counter() - started:.1f} s — "
        + ", ".join(f"{k}={v}" for k, v in info.items() if k in ("architecture", "parameters", "vocab_size", "max_context"))
    )
    count = asyncio.run(_round_trip(found.nats_url, found.database_url, settings.run_id))
    console.print(f"3. {count} events appended to Postgres, relayed to JetStream and consumed once each")
    console.print(f"Stop the servers with `gyre down` (state in {settings.state_dir}).")
    Path("runs/demo").mkdir(parents=True, exist_ok=True)
    Path("runs/demo/report.json").write_text(json.dumps({"model": info, "events_round_trip": count}, indent=2, default=str))
    return 0


async def _round_trip(nats_url: str, database_url: str, run_id: str) -> int:
    from shared.bus import Bus, ConsumerOptions
    from shared.events import CellRegistered, new_event
    from shared.relay import OutboxRelay
    from shared.store import EventStore

    store = await EventStore.connect(database_url)
    bus = await Bus.connect(nats_url)
    await bus.ensure_streams()
    events = [
        new_event(
            CellRegistered(cell_id=f"demo-{i}", node_id="local", accelerators=1, device="cpu",
                           memory_bytes=0, kv_capacity_tokens=0),
            run_id=run_id, stream_id=f"cell-demo-{i}", version=1, occurred_at=datetime.now(UTC),
        )
        for i in range(4)
    ]
    wanted = {e.event_id for e in events}
    seen: set = set()
    stop = asyncio.Event()

    async def handler(event, msg) -> None:
        if event.event_id in wanted:
            seen.add(event.event_id)
            if seen == wanted:
                stop.set()

    await store.append(events, expected_version="any")
    relay = OutboxRelay(store, bus, dsn=database_url)
    consumers = await bus.consumer("demo-" + run_id, ["cell.registered"], ConsumerOptions(fetch_timeout_s=0.2))
    tasks = [asyncio.create_task(relay.run(stop))] + [asyncio.create_task(c.run(handler, stop)) for c in consumers]
    try:
        await asyncio.wait_for(stop.wait(), 60)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await bus.close()
        await store.close()
    return len(seen)


if __name__ == "__main__":
    sys.exit(main())
