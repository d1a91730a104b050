"""The cell agent on real NATS and PostgreSQL, with trivial processes standing in for rollout workers and
trainer ranks: registration, switches in order with durations, real process starts and stops, the rollout
worker's drain protocol, crash restarts and resuming after an agent restart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from pathlib import Path

from services.scheduler.cell_agent import CellAgent, CellSettings, cell_ids, safe_id
from shared.events import CellAssigned, new_event
from shared.relay import OutboxRelay
from shared.runtime import utcnow
from shared.settings import Settings
from tests.conftest import Infra, unique

# A stand-in for a role's process: writes its pid where the test can see it, then sleeps.
SLEEPER = "import os,sys,time,pathlib; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)"
# A trainer rank that ignores SIGTERM: only SIGKILL stops it.
STUBBORN = ("import os,sys,time,signal,pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)")

# A stand-in rollout worker that speaks the worker's NATS contract: it heartbeats its status on
# `<prefix>.rollout.status` with 3 live sessions, and reports drained once it sees cell.draining for its cell
# (with the argument `stuck`, it never manages to drain).
FAKE_WORKER = '''
import asyncio, json, os, pathlib, signal, sys
import nats

async def main():
    cell, prefix = os.environ["GYRE_ROLLOUT_CELL_ID"], os.environ["GYRE_SUBJECT_PREFIX"]
    pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
    nc = await nats.connect(os.environ["GYRE_NATS_URL"])
    state = {"state": "active", "live": 3}
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def on_draining(msg):
        if json.loads(msg.data)["data"]["cell_id"] == cell and sys.argv[2:] != ["stuck"]:
            state.update(state="drained", live=0)

    await nc.subscribe(prefix + ".cell.draining", cb=on_draining)
    while not stop.is_set():
        status = {"worker_id": cell, "cell_id": cell, "state": state["state"], "live_sessions": state["live"],
                  "capacity": 8, "in_flight": 0, "policy_version": 4, "max_model_len": 64}
        await nc.publish(prefix + ".rollout.status", json.dumps(status).encode())
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass
    await nc.close()

asyncio.run(main())
'''


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
    assert [(d.from_role, d.live_sessions) for d in drains] == [("rollout", 0), ("train", 0)]
    assert [r.from_role for r in releases] == ["rollout", "train"]
    assert [r.role for r in readies] == ["rollout", "train", "rollout"]
    for released, ready in zip(releases, readies[1:]):
        assert ready.switch_seconds >= released.seconds > 0
    assigned = [e for e in events if e.type == "cell.assigned"]
    for order, report in zip(assigned[1:], [e for e in events if e.type == "cell.draining"]):
        assert report.causation_id == order.event_id  # each switch names the order it carries out


async def peer_heartbeats(bus, stop: asyncio.Event) -> None:
    """Another node's active rollout worker, somewhere for a draining worker's sessions to go."""
    status = {"worker_id": "n2-cell0", "cell_id": "n2-cell0", "state": "active", "live_sessions": 0,
              "capacity": 8, "in_flight": 0, "policy_version": 4, "max_model_len": 64}
    while not stop.is_set():
        await bus.nc.publish(f"{bus.prefix}.rollout.status", json.dumps(status).encode())
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass


async def switch_fake_worker(store, bus, infra, tmp_path, *, stuck: bool, peer: bool) -> list:
    run_id = unique("run-")
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, rollout_ready="status",
                rollout_command=f"{{python}} {script} {tmp_path}/{{cell_id}}-rollout.pid" + (" stuck" if stuck else ""),
                train_command=f"{{python}} -c '{SLEEPER}' {tmp_path}/{{cell_id}}-train.pid")
    cell = "n1-cell0"
    stop_peer = asyncio.Event()
    peer_task = asyncio.create_task(peer_heartbeats(bus, stop_peer)) if peer else None
    try:
        async with Running(store, bus, infra, svc):
            await assign(store, run_id, cell, "rollout")
            await wait_for(store, run_id, cell, "cell.ready", 1)
            await assign(store, run_id, cell, "train")
            events = await wait_for(store, run_id, cell, "cell.ready", 2)
    finally:
        stop_peer.set()
        if peer_task is not None:
            await peer_task
    return [[e.data for e in events if e.type == t] for t in ("cell.ready", "cell.draining", "cell.released")]


async def test_rollout_drain_waits_for_the_worker_and_counts_its_sessions(store, bus, infra, tmp_path):
    ready, draining, released = await switch_fake_worker(store, bus, infra, tmp_path, stuck=False, peer=True)
    assert ready[0].policy_version == 4  # the worker's heartbeat made it ready, with its weights' version
    assert draining[0].live_sessions == 3
    assert released[0].migrated_sessions == 3  # the worker reported drained before it was stopped


async def test_with_no_other_rollout_worker_the_sessions_stay_parked(store, bus, infra, tmp_path):
    """A colocate pool turning to training has nowhere to migrate: the switch goes on (drain_timeout_s is
    600 s here, far beyond the test's wait) and reports nothing migrated."""
    ready, draining, released = await switch_fake_worker(store, bus, infra, tmp_path, stuck=True, peer=False)
    assert draining[0].live_sessions == 3
    assert released[0].migrated_sessions == 0
    assert [r.role for r in ready] == ["rollout", "train"]


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
