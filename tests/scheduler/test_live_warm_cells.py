"""The cell agent's warm switches on real NATS and PostgreSQL, with fake rollout workers and trainer ranks that
speak their event contracts (fake_cell_processes.py) and a fake trainer coordinator (live_cells.FakeCoordinator):
a cell keeps both roles' processes, a switch moves the role between them phase by phase, and the restart path
stands in when a warm process died."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import unique

from .live_cells import (
    FakeCoordinator,
    Running,
    agent,
    alive,
    assign,
    fake_rank,
    fake_worker,
    launches,
    wait_for,
    wait_until,
)

CELL = "n1-cell0"
SWITCH_TYPES = {"cell.assigned", "cell.draining", "kv.migrated", "cell.drained", "cell.released", "weights.loaded",
                "cell.ready"}


def warm_agent(infra, store, bus, run_id, tmp_path, worker_mode: str = "peer", **cell):
    return agent(infra, store, bus, run_id, tmp_path, count=1, rollout_ready="status", train_ready="group",
                 ready_timeout_s=60, stop_timeout_s=5, rollout_command=fake_worker(worker_mode, tmp_path),
                 train_command=fake_rank(tmp_path), **cell)


def after(events: list, event) -> list[str]:
    """The types of the switch events after `event` (a rank's `trainer.rank_ready` comes whenever it comes)."""
    return [e.type for e in events[events.index(event) + 1:] if e.type in SWITCH_TYPES]


async def groups_listing(store, run_id: str, cell: str) -> list:
    return [s for s in await store.read_all(types=["trainer.group_formed"], run_id=run_id)
            if cell in s.event.data.members]


async def position_of(store, run_id: str, event) -> int:
    return next(s.position for s in await store.read_all(run_id=run_id) if s.event.event_id == event.event_id)


@pytest.mark.parametrize("first", ["rollout", "train"])
async def test_a_first_assignment_starts_the_role_cold_then_the_other_role_in_standby(first, store, bus, infra,
                                                                                      tmp_path):
    """Without `standby_from_start`: the role's process starts cold, the other one in standby after it."""
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path)
    other = "train" if first == "rollout" else "rollout"
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        await assign(store, run_id, CELL, first)
        events = await wait_for(store, run_id, CELL, "cell.ready", 1)
        ready = events[-1]
        standby = await wait_until(lambda: launches(tmp_path, CELL, other), f"a standby {other} process")
        if first == "train":
            # The rank came up outside any group; the coordinator let it in (the cell was idle): ready.
            assert ready.data.phases.keys() == {"group_s", "build_s", "load_s", "start_s"}
            assert standby == [(standby[0][0], True)]  # the worker loads its engine and sleeps
        else:
            assert ready.data.policy_version == 4 and ready.data.phases.keys() == {"engine_s", "start_s"}
            await wait_for(store, run_id, CELL, "trainer.rank_ready", 1)  # the standby rank stands by
        runner = svc.runners[CELL]
        assert (ready.data.role, ready.data.warm) == (first, False)
        assert [pid for pid, _ in launches(tmp_path, CELL, first)] == [runner.active.pid]
        assert runner.standby is not None and runner.standby.pid == standby[0][0] and alive(standby[0][0])
    assert not alive(standby[0][0])  # the agent stops what it started
    log = [s.event for s in await store.read_stream(f"cell-{CELL}")]
    assert [e.type for e in log if e.type.startswith("cell.")] == ["cell.registered", "cell.assigned", "cell.ready"]


@pytest.mark.parametrize("first", ["rollout", "train"])
async def test_a_registered_cell_stands_by_in_both_roles_and_its_first_assignment_starts_nothing(
        first, store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path, standby_from_start=True)
    other = "train" if first == "rollout" else "rollout"
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        # Before any order both processes start in standby: the worker loads its engine and sleeps, the rank
        # stands by outside any group.
        standing = {role: await wait_until(lambda role=role: launches(tmp_path, CELL, role), f"a standby {role}")
                    for role in ("rollout", "train")}
        assert standing["rollout"] == [(standing["rollout"][0][0], True)]  # a worker told to stand by
        assert len(standing["train"]) == 1  # a rank (it starts the same either way)
        await wait_for(store, run_id, CELL, "trainer.rank_ready", 1)
        await assign(store, run_id, CELL, first)
        events = await wait_for(store, run_id, CELL, "cell.ready", 1)
        ready = [e for e in events if e.type == "cell.ready"][-1]
        # The release from idle is what the standby takes the role on: the worker wakes and loads the newest
        # weights, or the coordinator lets the rank into its group.
        if first == "train":
            assert ready.data.phases.keys() == {"group_s", "build_s", "load_s"}
        else:
            assert ready.data.policy_version is not None and ready.data.phases.keys() == {"wake_s", "load_s"}
        runner = svc.runners[CELL]
        assert (ready.data.role, ready.data.warm) == (first, True)
        assert {role: launches(tmp_path, CELL, role) for role in ("rollout", "train")} == standing  # nothing started
        assert runner.active is not None and runner.active.pid == standing[first][0][0]
        assert runner.standby is not None and runner.standby.pid == standing[other][0][0]
    assert not any(alive(rows[0][0]) for rows in standing.values())  # the agent stops what it started
    log = [s.event for s in await store.read_stream(f"cell-{CELL}")]
    assert [e.type for e in log if e.type.startswith("cell.")] == [
        "cell.registered", "cell.assigned", "cell.released", "cell.ready"]
    assert [e.data.from_role for e in log if e.type == "cell.released"] == ["idle"]


async def test_a_warm_switch_both_ways_starts_no_process_and_reports_its_phases(store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path)
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        await assign(store, run_id, CELL, "rollout")
        await wait_for(store, run_id, CELL, "cell.ready", 1)
        await wait_for(store, run_id, CELL, "trainer.rank_ready", 1)
        started = {role: launches(tmp_path, CELL, role) for role in ("rollout", "train")}
        await assign(store, run_id, CELL, "train")
        events = await wait_for(store, run_id, CELL, "cell.ready", 2)
        to_train = events[-1]
        await assign(store, run_id, CELL, "rollout")
        events = await wait_for(store, run_id, CELL, "cell.ready", 3)
        to_rollout = events[-1]
        assert {role: launches(tmp_path, CELL, role) for role in ("rollout", "train")} == started  # nothing started
        assert all(alive(pid) for rows in started.values() for pid, _ in rows)
    first_ready = [e for e in events if e.type == "cell.ready"][0]
    assert after(events, first_ready) == [
        "cell.assigned", "cell.draining", "kv.migrated", "kv.migrated", "kv.migrated", "cell.drained",
        "cell.released", "cell.ready",  # rollout -> train: the worker drained and sleeps, the rank joined
        "cell.assigned", "cell.draining", "cell.drained", "cell.released", "weights.loaded", "cell.ready",
    ]  # train -> rollout: the coordinator let the rank go, the worker woke on the release
    assert (to_train.data.role, to_train.data.warm, to_train.data.policy_version) == ("train", True, None)
    assert to_train.data.phases == {"drain_s": 0.1, "sleep_s": 0.05, "group_s": 0.01, "build_s": 0.02, "load_s": 0.03}
    assert (to_rollout.data.role, to_rollout.data.warm, to_rollout.data.policy_version) == ("rollout", True, 5)
    assert to_rollout.data.phases == {"wait_step_s": 0.0, "leave_s": 0.01, "wake_s": 0.02, "load_s": 0.03}
    drains = [e for e in events if e.type == "cell.draining"]
    drained = [e for e in events if e.type == "cell.drained"]
    assert [d.causation_id for d in drained] == [d.event_id for d in drains]  # each answers its own drain
    assert [e.data.worker_id.startswith(f"{CELL}-") for e in drained] == [False, True]  # the worker, then the rank
    releases = [e for e in events if e.type == "cell.released"]
    assert [r.data.migrated_sessions for r in releases] == [3, 0]
    # The rank was let in only after the release, and the cell was ready only once the group listed it.
    (joined, *_) = await groups_listing(store, run_id, CELL)
    assert await position_of(store, run_id, releases[0]) < joined.position < await position_of(store, run_id, to_train)


async def test_the_restart_path_stops_one_process_and_starts_the_other_and_a_rank_is_ready_once_its_group_forms(
        store, bus, infra, tmp_path):
    """GYRE_CELL_WARM=0: one process per cell; the train role is a real rank, ready once a group lists the cell,
    and it is stopped only after the coordinator let it leave the group (its cell.drained)."""
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path, warm=False)
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        await assign(store, run_id, CELL, "rollout")
        await wait_for(store, run_id, CELL, "cell.ready", 1)
        await assign(store, run_id, CELL, "train")
        events = await wait_for(store, run_id, CELL, "cell.ready", 2)
        to_train = events[-1]
        (worker, _), = launches(tmp_path, CELL, "rollout")
        (rank, _), = launches(tmp_path, CELL, "train")  # started by the switch, not before: no standby
        assert not alive(worker) and alive(rank)
        await assign(store, run_id, CELL, "rollout")
        events = await wait_for(store, run_id, CELL, "cell.ready", 3)
        to_rollout = events[-1]
        assert not alive(rank)
        assert [standby for _, standby in launches(tmp_path, CELL, "rollout")] == [False, False]
    assert (to_train.data.warm, to_rollout.data.warm) == (False, False)
    assert to_train.data.phases.keys() == {"drain_s", "sleep_s", "stop_s", "start_s", "group_s", "build_s", "load_s"}
    assert to_rollout.data.phases.keys() == {"wait_step_s", "leave_s", "stop_s", "start_s", "engine_s"}
    assert to_rollout.data.policy_version == 4
    second = [e for e in events if e.type == "cell.ready"][1]
    assert after(events, second) == ["cell.assigned", "cell.draining", "cell.drained", "cell.released",
                                     "weights.loaded", "cell.ready"]


@pytest.mark.parametrize("role", ["rollout", "train"])
async def test_a_crashed_standby_process_is_restarted_in_standby(role, store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path)
    standby = "train" if role == "rollout" else "rollout"
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        await assign(store, run_id, CELL, role)
        await wait_for(store, run_id, CELL, "cell.ready", 1)
        (first, flag), = await wait_until(lambda: launches(tmp_path, CELL, standby), "the standby's start")
        active = svc.runners[CELL].active.pid
        os.kill(first, signal.SIGKILL)
        rows = await wait_until(lambda: launches(tmp_path, CELL, standby)[1:], "the standby's restart")
        assert rows == [(rows[0][0], flag)] and alive(rows[0][0])  # started in standby again
        assert svc.runners[CELL].active.pid == active and alive(active)  # the serving process is untouched
    log = [s.event for s in await store.read_stream(f"cell-{CELL}")]
    assert [e.type for e in log if e.type.startswith("cell.")] == ["cell.registered", "cell.assigned", "cell.ready"]


async def test_a_switch_whose_standby_died_starts_the_role_cold(store, bus, infra, tmp_path):
    """The standby rank died and its restart is 10 minutes away (it kept dying): the switch does not wait for it."""
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path, restart_backoff_s=600, restart_backoff_max_s=600)
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        await assign(store, run_id, CELL, "rollout")
        await wait_for(store, run_id, CELL, "cell.ready", 1)
        await wait_for(store, run_id, CELL, "trainer.rank_ready", 1)
        (rank, _), = launches(tmp_path, CELL, "train")
        (worker, _), = launches(tmp_path, CELL, "rollout")
        os.kill(rank, signal.SIGKILL)
        await wait_until(lambda: svc.runners[CELL].standby is None, "the agent to see the standby die")
        await assign(store, run_id, CELL, "train")
        events = await wait_for(store, run_id, CELL, "cell.ready", 2)
        ready = events[-1].data
        assert [pid for pid, _ in launches(tmp_path, CELL, "train")][0] == rank
        (cold, _) = launches(tmp_path, CELL, "train")[1]
        assert alive(cold) and alive(worker)  # the worker stays, asleep, as the cell's standby
        assert svc.runners[CELL].standby.pid == worker
    assert (ready.role, ready.warm) == ("train", False)
    assert ready.phases.keys() == {"drain_s", "sleep_s", "start_s", "group_s", "build_s", "load_s"}


async def test_a_standby_worker_that_dies_when_woken_is_replaced_by_a_cold_start(store, bus, infra, tmp_path):
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path, worker_mode="dies-on-wake")
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        await assign(store, run_id, CELL, "train")
        await wait_for(store, run_id, CELL, "cell.ready", 1)
        await wait_until(lambda: launches(tmp_path, CELL, "rollout"), "the standby worker")
        await assign(store, run_id, CELL, "rollout")
        events = await wait_for(store, run_id, CELL, "cell.ready", 2)
    ready = events[-1].data
    assert (ready.role, ready.warm, ready.policy_version) == ("rollout", False, 4)
    assert [standby for _, standby in launches(tmp_path, CELL, "rollout")] == [True, False]
    assert ready.phases.keys() == {"wait_step_s", "leave_s", "start_s", "engine_s"}


async def test_a_worker_silent_past_the_drain_timeout_is_stopped_and_replaced_by_a_fresh_standby(
        store, bus, infra, tmp_path):
    """Its state is unknown (it may still hold sessions): it is not kept as the cell's standby."""
    run_id = unique("run-")
    svc = warm_agent(infra, store, bus, run_id, tmp_path, worker_mode="silent", drain_timeout_s=0.5)
    async with FakeCoordinator(store, bus, infra, run_id), Running(store, bus, infra, svc):
        await assign(store, run_id, CELL, "rollout")
        await wait_for(store, run_id, CELL, "cell.ready", 1)
        await assign(store, run_id, CELL, "train")
        events = await wait_for(store, run_id, CELL, "cell.ready", 2)
        rows = await wait_until(lambda: launches(tmp_path, CELL, "rollout")[1:], "a fresh standby worker")
        (silent, _) = launches(tmp_path, CELL, "rollout")[0]
        assert not alive(silent) and rows == [(rows[0][0], True)]
    ready = events[-1].data
    assert (ready.role, ready.warm) == ("train", True)  # the rank was warm all the same
    assert ready.phases.keys() == {"stop_s", "group_s", "build_s", "load_s"}
