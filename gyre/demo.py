"""`make demo`: the main job on a fresh machine — the RL loop (`gyre run`) on the tiny model.

`python -m gyre.demo --foundation` instead only brings up the infrastructure, creates the tiny model
and sends events through the log → relay → JetStream path.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gyre import local
from shared.settings import load_settings

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from shared.events import Event

console = Console()


def main() -> int:
    if "--foundation" not in sys.argv:
        return run_loop()
    settings = load_settings()
    console.rule("[bold]Gyre demo: foundation")
    console.print("The full RL loop (`gyre run`) is not built yet; this demo exercises what is.")
    found = local.up(settings.state_dir, nats_url=settings.nats_url, database_url=settings.database_url)
    console.print(f"1. infrastructure up — NATS {found.nats_url}, Postgres {found.database_url} (migrated)")

    model_dir = Path("runs/demo/model")
    started = time.perf_counter()
    from gyre.tinymodel import model_info, tiny_model

    tiny_model(model_dir, seed=0, size="tiny", overwrite=True)
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


def run_loop() -> int:
    """The RL loop with every service as its own process (`gyre run`), sized for a 2-core machine."""
    from gyre.launcher import run

    console.rule("[bold]Gyre demo: the RL loop")
    console.print(
        "Starts NATS and PostgreSQL, creates the tiny model, and runs every service as its own process: "
        "scheduler, cell agent (each cell a vLLM rollout worker or a trainer rank, the other standing by), "
        "gateway, harness (sandboxes), trajectory, trainer coordinator, relay. "
        "First a supervised warm-start on an imperfect demonstrator's demonstrations of the shell-task family "
        "(it skips the work or runs a wrong command 70% of the time), then 30 RL steps of 2 queries × 8 "
        "executions on the held-out shipped tasks; the mean reward should climb as RL removes the slips. "
        "Report and curve in runs/<run_id>/ (docs/learning.md). The run's config: configs/demo.yaml."
    )
    run(config_file=Path("configs/demo.yaml"))
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
    seen: set[uuid.UUID] = set()
    stop = asyncio.Event()

    async def handler(event: Event, msg: Msg) -> None:
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
