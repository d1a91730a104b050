"""The cell agent on real NATS and PostgreSQL, with trivial processes standing in for rollout workers and
trainer ranks: registration, switches in order with durations, real process starts and stops (the restart path),
the rollout worker's drain protocol, crash restarts and resuming after an agent restart. The warm path:
test_live_warm_cells.py."""

from __future__ import annotations

import asyncio
import os
import signal

from services.scheduler.cell_settings import cell_ids, safe_id
from shared.events import WeightsLoaded, new_event
from shared.runtime import utcnow
from tests.conftest import unique

from .live_cells import (
    SLEEPER,
    Running,
    agent,
    alive,
    assign,
    cell_log,
    fake_worker,
    free_port_pair,
    pid_in,
    wait_for,
)


def test_cell_ids_are_safe_in_nats_subjects() -> None:
    assert cell_ids("gpu-node.example.com", 2) == ["gpu-node-example-com-cell0", "gpu-node-example-com-cell1"]
    assert safe_id("a b*c>") == "a-b-c"


async def test_a_switch_drains_releases_and_readies_in_order_and_swaps_the_processes(store, bus, infra, tmp_path):
    """The restart path (GYRE_CELL_WARM=0): each switch stops the old role's process and starts the new one."""
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path, warm=False)
    cell = "n1-cell0"
    async with Running(store, bus, infra, svc):
        registered = [s.event.data for s in await store.read_all(types=["cell.registered"], run_id=run_id)]
        assert [(r.cell_id, r.node_id, r.kv_capacity_tokens) for r in registered] == [
            ("n1-cell0", "n1", 0), ("n1-cell1", "n1", 0)]  # 0: what the engine reports

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
        active = svc.runners[cell].active
        assert active is not None and active.pid == second_rollout
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
    assert [(r.role, r.warm) for r in readies] == [("rollout", False), ("train", False), ("rollout", False)]
    for released, ready in zip(releases, readies[1:]):
        assert ready.switch_seconds >= released.seconds > 0
    assigned = [e for e in events if e.type == "cell.assigned"]
    for order, report in zip(assigned[1:], [e for e in events if e.type == "cell.draining"]):
        assert report.causation_id == order.event_id  # each switch names the order it carries out


async def switch_fake_worker(store, bus, infra, tmp_path, mode: str, **cell) -> list:
    """Start the fake worker on a cell (rollout), then order the cell to train; the cell's ready, draining and
    released events."""
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, rollout_ready="status", ready_timeout_s=60,
                rollout_command=fake_worker(mode, tmp_path),
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
    """With `health` readiness the cell is ready only once its process answers on its health port (a cell's
    train process gets the port after the node's rollout ports: base + count + index)."""
    run_id = unique("run-")
    base = free_port_pair()
    port = base + 1
    server = "{python} -m http.server {port} --bind 127.0.0.1 --directory " + str(tmp_path)
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, train_ready="health", health_port_base=base,
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
        assert runner.role == "idle" and runner.active is None
    assert [e.type for e in await cell_log(store, run_id, cell)] == ["cell.registered", "cell.assigned"]


async def test_hold_occupies_a_cell_with_a_placeholder_until_stopped(store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, train_command="hold", train_ready="health",
                health_port_base=1)
    cell = "n1-cell0"
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell, "train")
        await wait_for(store, run_id, cell, "cell.ready", 1)  # not waiting on a health port nothing serves
        proc = svc.runners[cell].active
        assert proc is not None and not proc.exited
        pid = proc.pid
    assert not alive(pid)


async def test_stopping_the_agent_while_a_process_starts_leaves_no_process_behind(store, bus, infra, tmp_path):
    """The agent stops while a trainer that ignores SIGTERM is still starting (its health port never answers),
    with a stop timeout longer than the service waits for its tasks: the cancelled launch must not strand it."""
    run_id = unique("run-")
    svc = agent(infra, store, bus, run_id, tmp_path, count=1, train_ready="health", health_port_base=free_port_pair(),
                ready_timeout_s=120, stop_timeout_s=11)
    cell = "n1-cell0"
    async with Running(store, bus, infra, svc):
        await assign(store, run_id, cell, "train")
        pid = await pid_in(tmp_path / f"{cell}-train.pid")
        assert svc.runners[cell].active is None  # still starting
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
