"""Stand-ins for the processes on a cell, speaking their event contracts through the real event store and NATS, for
the cell agent's tests: `fake_cell_processes.py worker <mode> <dir>` and `fake_cell_processes.py rank <dir>`.

Each writes its pid to `<dir>/<cell>-<role>.pid` and appends a line per launch to `<dir>/<cell>-<role>.launches`
(`<pid> standby=<0|1>`; `-` for a rank, which starts the same either way), so a test sees what the agent
started and how.

The worker (its contract: docs/rollout.md): started active (GYRE_ROLLOUT_STANDBY=0) it appends `weights.loaded`
(version 4) at once; in standby it appends nothing and waits for its cell to be released into rollout (a
`cell.released` of its cell from another role, or one already in the log when it came up), then wakes:
`weights.loaded` (version 5, phases `wake_s`, `load_s`). On a `cell.draining` of its cell from rollout (issued after
it started, while awake) it drains its 3 sessions as `<mode>` says and goes to sleep: `peer` moves each to another
node's worker (`kv.migrated`) and reports `cell.drained` (phases `drain_s`, `sleep_s`); `alone` keeps them parked
and says so; `confused` first reports a drain some other order asked for, then its own; `silent` never reports;
`exits` quits without a report. `dies-on-wake` exits 1 when it should wake.

The rank (its contract: docs/trainer.md): appends `trainer.rank_ready` with a fresh rank id, answers the
coordinator's requests to join (`<prefix>.fake_rank.<cell>.form`), and waits to be stopped; the trainer coordinator (here
`live_cells.FakeCoordinator`) decides whether it is in the group.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats  # noqa: E402

from shared.events import (  # noqa: E402
    CellAssigned,
    CellDrained,
    CellReleased,
    EventData,
    KvMigrated,
    RankReady,
    WeightsLoaded,
    new_event,
    parse_event,
)
from shared.runtime import utcnow  # noqa: E402
from shared.store import EventStore  # noqa: E402


async def _connect() -> tuple[EventStore, nats.NATS]:
    store = await EventStore.connect(os.environ["GYRE_DATABASE_URL"], schema=os.environ.get("GYRE_DB_SCHEMA") or None)
    return store, await nats.connect(os.environ["GYRE_NATS_URL"])


def _announce(directory: Path, cell: str, role: str, standby: bool | None) -> None:
    (directory / f"{cell}-{role}.pid").write_text(str(os.getpid()))
    with open(directory / f"{cell}-{role}.launches", "a") as launches:
        launches.write(f"{os.getpid()} standby={'-' if standby is None else int(standby)}\n")


async def worker(mode: str, directory: Path) -> None:
    cell, run_id = os.environ["GYRE_ROLLOUT_CELL_ID"], os.environ["GYRE_RUN_ID"]
    standby = os.environ.get("GYRE_ROLLOUT_STANDBY") == "1"
    started = utcnow()
    _announce(directory, cell, "rollout", standby)
    store, nc = await _connect()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    awake = not standby

    async def append(data: EventData, cause: uuid.UUID | None = None) -> None:
        event = new_event(data, run_id=run_id, stream_id="cell-" + cell, version=1, occurred_at=utcnow(),
                          causation_id=cause)
        await store.append([event], expected_version="any")

    async def wake() -> None:
        nonlocal awake
        if awake:
            return
        if mode == "dies-on-wake":
            os._exit(1)
        awake = True
        await append(WeightsLoaded(cell_id=cell, worker_id=cell, version=5, phases={"wake_s": 0.02, "load_s": 0.03}))

    async def on_draining(msg: nats.aio.msg.Msg) -> None:
        nonlocal awake
        event = parse_event(msg.data)
        data = event.data
        if data.cell_id != cell or data.from_role != "rollout" or event.occurred_at < started or not awake:
            return
        if mode == "exits":
            stop.set()
            return
        if mode == "silent":
            return
        if mode == "confused":
            await append(CellDrained(cell_id=cell, worker_id=cell, migrated_sessions=99, parked_sessions=0,
                                     seconds=0.1), cause=uuid.uuid4())
        moved = 3 if mode in ("peer", "confused") else 0
        for i in range(moved):
            await append(KvMigrated(execution_id=f"x{i}", from_cell=cell, to_cell="n2-cell0", tokens=10, bytes=10,
                                    seconds=0.1, method="kv"))
        awake = False
        await append(CellDrained(cell_id=cell, worker_id=cell, migrated_sessions=moved, parked_sessions=3 - moved,
                                 seconds=0.1, phases={"drain_s": 0.1, "sleep_s": 0.05}), cause=event.event_id)

    async def on_released(msg: nats.aio.msg.Msg) -> None:
        event = parse_event(msg.data)
        if event.data.cell_id == cell and event.data.from_role != "rollout" and event.occurred_at >= started:
            # Only a release into rollout: the cell's latest order says where it goes (as lifecycle.wakes_me).
            orders = [s.event.data for s in await store.read_stream("cell-" + cell)
                      if s.event.run_id == run_id and isinstance(s.event.data, CellAssigned)]
            if orders and orders[-1].role == "rollout":
                await wake()

    prefix = os.environ["GYRE_SUBJECT_PREFIX"]
    await nc.subscribe(prefix + ".cell.draining", cb=on_draining)
    await nc.subscribe(prefix + ".cell.released", cb=on_released)
    if standby:
        # Released into rollout while this standby came up: the release it waits for is already in the log.
        order: CellAssigned | None = None
        released_since = False
        for stored in await store.read_stream("cell-" + cell):
            if stored.event.run_id != run_id:
                continue
            if isinstance(stored.event.data, CellAssigned):
                order, released_since = stored.event.data, False
            elif isinstance(stored.event.data, CellReleased) and stored.event.data.from_role != "rollout":
                released_since = True
        if order is not None and order.role == "rollout" and released_since:
            await wake()
    else:
        await append(WeightsLoaded(cell_id=cell, worker_id=cell, version=4, phases={"engine_s": 0.5}))
    await stop.wait()
    await nc.close()
    await store.close()


async def rank(directory: Path) -> None:
    cell, run_id = os.environ["GYRE_TRAINER_CELL_ID"], os.environ["GYRE_RUN_ID"]
    _announce(directory, cell, "train", standby=None)  # a rank is told nothing: the coordinator decides
    store, nc = await _connect()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    rank_id = f"{cell}-{uuid.uuid4().hex[:8]}"

    async def on_form(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b'{"ok": true}')

    # Not under `<prefix>.trainer.`, the trainer event family's JetStream stream (it would answer with its ack).
    await nc.subscribe(f"{os.environ['GYRE_SUBJECT_PREFIX']}.fake_rank.{cell}.form", cb=on_form)
    event = new_event(RankReady(cell_id=cell, rank_id=rank_id), run_id=run_id, stream_id="cell-" + cell, version=1,
                      occurred_at=utcnow())
    await store.append([event], expected_version="any")
    await stop.wait()
    await nc.close()
    await store.close()


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["worker", mode, directory]:
            asyncio.run(worker(mode, Path(directory)))
        case ["rank", directory]:
            asyncio.run(rank(Path(directory)))
        case _:
            raise SystemExit(f"usage: {sys.argv[0]} worker <mode> <dir> | rank <dir>; got {sys.argv[1:]}")
