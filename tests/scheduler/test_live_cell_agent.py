"""The cell agent on real NATS and PostgreSQL, with trivial processes standing in for rollout workers and
trainer ranks: registration, switches in order with durations, real process starts and stops, the rollout
worker's drain protocol, crash restarts and resuming after an agent restart."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

from services.scheduler.cell_agent import CellAgent
from services.scheduler.cell_settings import CellSettings, cell_ids, safe_id
from shared.events import CellAssigned, WeightsLoaded, new_event
from shared.relay import OutboxRelay
from shared.runtime import utcnow
from shared.settings import Settings
from tests.conftest import Infra, unique

REPO = str(Path(__file__).resolve().parents[2])

# A stand-in for a role's process: writes its pid where the test can see it, then sleeps.
SLEEPER = "import os,sys,time,pathlib; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)"
# A trainer rank that ignores SIGTERM: only SIGKILL stops it.
STUBBORN = ("import os,sys,time,signal,pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)")

# A stand-in rollout worker that speaks the worker's event contract, through the real event store: once up it
# appends `weights.loaded` (version 4) for its cell, and on a `cell.draining` of its cell (from rollout, issued after
# it started) it drains its 3 sessions as its first argument says: `peer` moves each to another node's worker
# (`kv.migrated`) and reports `cell.drained`; `alone` keeps them parked and says so; `confused` first reports a
# drain some other order asked for, then its own; `silent` never reports; `exits` quits without a report.
FAKE_WORKER = """
import asyncio, os, pathlib, signal, sys, uuid
sys.path.insert(0, {repo!r})
import nats
from shared.events import CellDrained, KvMigrated, WeightsLoaded, new_event, parse_event
from shared.runtime import utcnow
from shared.store import EventStore

async def main():
    mode = sys.argv[1]
    cell, run_id = os.environ["GYRE_ROLLOUT_CELL_ID"], os.environ["GYRE_RUN_ID"]
    started = utcnow()
    pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
    store = await EventStore.connect(os.environ["GYRE_DATABASE_URL"], schema=os.environ.get("GYRE_DB_SCHEMA") or None)
    nc = await nats.connect(os.environ["GYRE_NATS_URL"])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def append(data, cause=None):
        event = new_event(data, run_id=run_id, stream_id="cell-" + cell, version=1, occurred_at=utcnow(),
                          causation_id=cause)
        await store.append([event], expected_version="any")

    async def on_draining(msg):
        event = parse_event(msg.data)
        if event.data.cell_id != cell or event.data.from_role != "rollout" or event.occurred_at < started:
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
            await append(KvMigrated(execution_id=f"x{{i}}", from_cell=cell, to_cell="n2-cell0", tokens=10, bytes=10,
                                    seconds=0.1, method="kv"))
        await append(CellDrained(cell_id=cell, worker_id=cell, migrated_sessions=moved, parked_sessions=3 - moved,
                                 seconds=0.1), cause=event.event_id)

    await nc.subscribe(os.environ["GYRE_SUBJECT_PREFIX"] + ".cell.draining", cb=on_draining)
    await append(WeightsLoaded(cell_id=cell, worker_id=cell, version=4))
    await stop.wait()
    await nc.close()
    await store.close()

asyncio.run(main())
"""


def agent(infra: Infra, store, bus, run_id: str, tmp_path: Path, **cell) -> CellAgent:
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, state_dir=tmp_path / "state",
    )
    base = dict(
        count=2, node_id="n1", rollout_ready="started", train_ready="started", start_grace_s=0.2,
        stop_timeout_s=0.5, restart_backoff_s=0.1, health_port_base=0,
        rollout_command=f"{{python}} -c '{SLEEPER}' {tmp_path}/{{cell_id}}-rollout.pid",
        train_command=f"{{python}} -c '{STUBBORN}' {tmp_path}/{{cell_id}}-train.pid",
    )
    return CellAgent(settings, CellSettings(**{**base, **cell}))


class Running:
    """The agent plus the outbox relay that carries the scheduler's orders to it over NATS."""

    def __init__(self, store, bus, infra: Infra, svc: CellAgent) -> None:
        self.svc = svc
        self.stop = asyncio.Event()
        self.relay = OutboxRelay(store, bus, dsn=infra.database_url, idle_wait_s=0.05)
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> CellAgent:
        self.task = asyncio.create_task(self.relay.run(self.stop))
        await self.svc.start()
        return self.svc

    async def __aexit__(self, *exc) -> None:
        await self.svc.stop()
        self.stop.set()
        assert self.task is not None
        await self.task


async def assign(store, run_id: str, cell: str, role: str) -> None:
    event = new_event(CellAssigned(cell_id=cell, role=role, policy="test"), run_id=run_id,  # type: ignore[arg-type]
                      stream_id=f"cell-{cell}", version=1, occurred_at=utcnow())
    await store.append([event], expected_version="any")


async def cell_log(store, run_id: str, cell: str) -> list:
    return [s.event for s in await store.read_stream(f"cell-{cell}") if s.event.run_id == run_id]


async def wait_for(store, run_id: str, cell: str, etype: str, count: int, timeout: float = 60) -> list:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        events = await cell_log(store, run_id, cell)
        if sum(1 for e in events if e.type == etype) >= count:
            return events
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"expected {count} {etype} on {cell}; have {[e.type for e in events]}")
        await asyncio.sleep(0.05)


async def pid_in(path: Path, *, not_pid: int | None = None, timeout: float = 30) -> int:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if path.exists() and path.read_text():
            pid = int(path.read_text())
            if pid != not_pid:
                return pid
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no pid in {path}")
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cell_ids_are_safe_in_nats_subjects() -> None:
    assert cell_ids("gpu-node.example.com", 2) == ["gpu-node-example-com-cell0", "gpu-node-example-com-cell1"]
    assert safe_id("a b*c>") == "a-b-c"


async def test_a_switch_drains_releases_and_readies_in_order_and_swaps_the_processes(store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path)
    cell = "n1-cell0"
    async with Running(store, bus, infra, svc):
        registered = [s.event.data for s in await store.read_all(types=["cell.registered"], run_id=run_id)]
        assert [(r.cell_id, r.node_id, r.kv_capacity_tokens) for r in registered] == [
            ("n1-cell0", "n1", 1 << 20), ("n1-cell1", "n1", 1 << 20)]

        await assign(store, run_id, cell, "rollout")
        await wait_for(store, run_id, cell, "cell.ready", 1)
        rollout_pid = await pid_in(tmp_path / f"{cell}-rollout.pid")
        assert alive(rollout_pid)

        await assign(store, run_id, cell, "train")
        await wait_for(store, run_id, cell, "cell.ready", 2)
        train_pid = await pid_in(tmp_path / f"{cell}-train.pid")
        assert alive(train_pid) and not alive(rollout_pid)

        # The trainer stand-in ignores SIGTERM: the agent must SIGKILL it to switch back.
        await assign(store, run_id, cell, "rollout")
        events = await wait_for(store, run_id, cell, "cell.ready", 3)
        second_rollout = await pid_in(tmp_path / f"{cell}-rollout.pid", not_pid=rollout_pid)
        assert not alive(train_pid) and alive(second_rollout)
        assert svc.runners[cell].proc is not None and svc.runners[cell].proc.pid == second_rollout
    assert not alive(second_rollout)  # the agent stops what it started
    assert not (tmp_path / "n1-cell1-rollout.pid").exists()  # the other cell was never ordered anywhere

    kinds = [e.type for e in events]
    assert kinds == [
        "cell.registered",
        "cell.assigned", "cell.ready",  # idle -> rollout: nothing to drain
        "cell.assigned", "cell.draining", "cell.released", "cell.ready",
        "cell.assigned", "cell.draining", "cell.released", "cell.ready",
    ]
    drains = [e.data for e in events if e.type == "cell.draining"]
    releases = [e.data for e in events if e.type == "cell.released"]
    readies = [e.data for e in events if e.type == "cell.ready"]
    assert [(d.from_role, d.live_sessions) for d in drains] == [("rollout", None), ("train", None)]
    assert [r.from_role for r in releases] == ["rollout", "train"]
    assert [r.role for r in readies] == ["rollout", "train", "rollout"]
    for released, ready in zip(releases, readies[1:]):
        assert ready.switch_seconds >= released.seconds > 0
    assigned = [e for e in events if e.type == "cell.assigned"]
    for order, report in zip(assigned[1:], [e for e in events if e.type == "cell.draining"]):
        assert report.causation_id == order.event_id  # each switch names the order it carries out


async def switch_fake_worker(store, bus, infra, tmp_path, mode: str, **cell) -> list:
    """Start the fake worker on a cell (rollout), then order the cell to train; the cell's ready, draining and
    released events."""
    run_id = unique("run-")
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(repo=REPO))
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, rollout_ready="status", ready_timeout_s=60,
                rollout_command=f"{{python}} {script} {mode} {tmp_path}/{{cell_id}}-rollout.pid",
                train_command=f"{{python}} -c '{SLEEPER}' {tmp_path}/{{cell_id}}-train.pid", **cell)
    cell_id = "n1-cell0"
    # A worker that ran on the cell before (in this run) loaded version 1: that does not make a new one ready.
    old = new_event(WeightsLoaded(cell_id=cell_id, worker_id=cell_id, version=1), run_id=run_id,
                    stream_id=f"cell-{cell_id}", version=1, occurred_at=utcnow())
    await store.append([old], expected_version="any")
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell_id, "rollout")
        await wait_for(store, run_id, cell_id, "cell.ready", 1)
        await assign(store, run_id, cell_id, "train")
        events = await wait_for(store, run_id, cell_id, "cell.ready", 2)
    return [[e for e in events if e.type == t] for t in ("cell.ready", "cell.draining", "cell.drained", "cell.released")]


async def test_rollout_drain_waits_for_the_workers_report_and_counts_what_it_moved(store, bus, infra, tmp_path):
    ready, draining, drained, released = await switch_fake_worker(store, bus, infra, tmp_path, "peer")
    assert ready[0].data.policy_version == 4  # the new worker's start-up weights.loaded made it ready
    assert draining[0].data.live_sessions is None  # the agent does not know; the worker's report counts them
    assert drained[0].causation_id == draining[0].event_id
    assert released[0].data.migrated_sessions == 3  # from the worker's cell.drained
    assert drained[0].version < released[0].version  # the agent released the cell only after the report


async def test_with_no_other_rollout_worker_the_sessions_stay_parked(store, bus, infra, tmp_path):
    """A colocate pool turning to training has nowhere to migrate: the worker says it kept its sessions, and the
    switch goes on at once (drain_timeout_s is 600 s here, far beyond the test's wait)."""
    ready, draining, drained, released = await switch_fake_worker(store, bus, infra, tmp_path, "alone")
    assert (drained[0].data.migrated_sessions, drained[0].data.parked_sessions) == (0, 3)
    assert released[0].data.migrated_sessions == 0
    assert [r.data.role for r in ready] == ["rollout", "train"]


async def test_only_the_report_of_the_drain_the_agent_asked_for_ends_it(store, bus, infra, tmp_path):
    """A cell.drained caused by another order (a drain before this one) is not this drain's end."""
    _, draining, drained, released = await switch_fake_worker(store, bus, infra, tmp_path, "confused")
    assert [d.data.migrated_sessions for d in drained] == [99, 3]
    assert drained[1].causation_id == draining[0].event_id != drained[0].causation_id
    assert released[0].data.migrated_sessions == 3


async def test_a_worker_that_never_reports_its_drain_is_stopped_after_the_drain_timeout(store, bus, infra, tmp_path):
    ready, _, drained, released = await switch_fake_worker(store, bus, infra, tmp_path, "silent", drain_timeout_s=0.5)
    assert drained == [] and released[0].data.migrated_sessions == 0
    assert [r.data.role for r in ready] == ["rollout", "train"]


async def test_a_worker_that_exits_while_draining_ends_the_wait(store, bus, infra, tmp_path):
    """drain_timeout_s is 600 s: the switch goes on because the process is gone, not because time ran out."""
    ready, _, drained, released = await switch_fake_worker(store, bus, infra, tmp_path, "exits")
    assert drained == [] and released[0].data.migrated_sessions == 0
    assert [r.data.role for r in ready] == ["rollout", "train"]


async def test_a_crashed_process_is_restarted_and_a_restarted_agent_resumes_its_last_order(store, bus, infra, tmp_path):
    run_id = unique("run-")
    cell = "n1-cell0"
    pid_file = tmp_path / f"{cell}-train.pid"
    kwargs = dict(count=1, train_command=f"{{python}} -c '{SLEEPER}' {tmp_path}/{{cell_id}}-train.pid")
    async with Running(store, bus, infra, agent(infra, store, bus, run_id, tmp_path, **kwargs)):
        await assign(store, run_id, cell, "train")
        await wait_for(store, run_id, cell, "cell.ready", 1)
        first = await pid_in(pid_file)
        os.kill(first, signal.SIGKILL)
        restarted = await pid_in(pid_file, not_pid=first)
        assert alive(restarted)
    assert not alive(restarted)

    async with Running(store, bus, infra, agent(infra, store, bus, run_id, tmp_path, **kwargs)):
        events = await wait_for(store, run_id, cell, "cell.ready", 2)
        resumed = await pid_in(pid_file, not_pid=restarted)
        assert alive(resumed)
    assert [e.type for e in events] == [
        "cell.registered", "cell.assigned", "cell.ready",  # a crash restart is not a switch: no events
        "cell.registered", "cell.ready",  # the new agent brings the cell back into its last ordered role
    ]
    assert events[-1].data.role == "train"


async def test_a_health_endpoint_decides_readiness(store, bus, infra, tmp_path):
    """With `health` readiness the cell is ready only once its process answers on its health port."""
    run_id = unique("run-")
    with socket.socket() as probe:  # a port nothing listens on now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = "{python} -m http.server {port} --bind 127.0.0.1 --directory " + str(tmp_path)
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, train_ready="health", health_port_base=port,
                ready_timeout_s=60, train_command=server)
    cell, role = "n1-cell0", "train"
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell, role)
        await wait_for(store, run_id, cell, "cell.ready", 1)
        import httpx

        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{port}/")).status_code == 200
        env = svc.runners[cell].environment(role)
        assert env["GYRE_HEALTH_PORT"] == str(port) and env["GYRE_TRAINER_CELL_ID"] == cell


async def test_a_command_that_cannot_start_is_retried_and_never_reported_ready(store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, train_command="/nonexistent/trainer {cell_id}")
    cell = "n1-cell0"
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell, "train")
        runner = svc.runners[cell]
        for _ in range(600):
            if runner.launches >= 3:
                break
            await asyncio.sleep(0.05)
        assert runner.launches >= 3  # retried after each failure
        assert runner.role == "idle" and runner.proc is None
    assert [e.type for e in await cell_log(store, run_id, cell)] == ["cell.registered", "cell.assigned"]


async def test_hold_occupies_a_cell_with_a_placeholder_until_stopped(store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, train_command="hold", train_ready="health",
                health_port_base=1)
    cell = "n1-cell0"
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell, "train")
        await wait_for(store, run_id, cell, "cell.ready", 1)  # not waiting on a health port nothing serves
        proc = svc.runners[cell].proc
        assert proc is not None and not proc.exited
        pid = proc.pid
    assert not alive(pid)


async def test_stopping_the_agent_while_a_process_starts_leaves_no_process_behind(store, bus, infra, tmp_path):
    """The agent stops while a trainer that ignores SIGTERM is still starting (its health port never answers),
    with a stop timeout longer than the service waits for its tasks: the cancelled launch must not strand it."""
    run_id = unique("run-")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, train_ready="health", health_port_base=port,
                ready_timeout_s=120, stop_timeout_s=11)
    cell = "n1-cell0"
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell, "train")
        pid = await pid_in(tmp_path / f"{cell}-train.pid")
        assert svc.runners[cell].proc is None  # still starting
    assert not alive(pid)


async def test_a_ready_that_could_not_be_written_is_written_once_the_store_answers(store, bus, infra, tmp_path):
    """The process is up and the role taken, but writing cell.ready fails (the database is briefly away): the
    agent tries again until the event is in the log, since the scheduler counts the cell from it alone."""
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path, count=1)
    cell = "n1-cell0"
    failures = []
    emit = svc.emit

    async def flaky_emit(events, *args, **kwargs):
        if any(e.type == "cell.ready" for e in events) and len(failures) < 2:
            failures.append(events)
            raise ConnectionError("postgres went away")
        return await emit(events, *args, **kwargs)

    svc.emit = flaky_emit  # type: ignore[method-assign]
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell, "rollout")
        events = await wait_for(store, run_id, cell, "cell.ready", 1)
    assert len(failures) == 2
    assert [e.type for e in events] == ["cell.registered", "cell.assigned", "cell.ready"]
    assert events[-1].data.role == "rollout" and svc.runners[cell].unreported is None
