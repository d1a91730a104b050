"""The live scheduler on real NATS and PostgreSQL: role assignment, dispatch within the staleness bound,
no duplicate dispatch across a restart, colocate's alternation, and silence once the run is done."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.policies import DispatchQuery
from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.events import (
    CellAssigned,
    CellReady,
    CellRegistered,
    EventData,
    ExecutionFinished,
    KvMigrated,
    StepCompleted,
    WeightsLoaded,
    execution_id_for,
    new_event,
)
from shared.runtime import utcnow
from shared.settings import Settings
from tests.conftest import Infra, unique

G = 2


def scheduler(infra: Infra, store, bus, run_id: str, mode: str, **sched) -> SchedulerService:
    settings = Settings(
        database_url=infra.database_url, nats_url=infra.nats_url, db_schema=store.schema,
        subject_prefix=bus.prefix, run_id=run_id, mode=mode, max_staleness=0, group_size=G,
    )
    base = dict(task_ids="task-a,task-b", queries_per_step=2, total_steps=2, tick_s=0.1, seed=3)
    return SchedulerService(settings, SchedulerSettings(**{**base, **sched}))


async def append(store, run_id: str, data: EventData, stream: str = "test") -> None:
    await store.append(
        [new_event(data, run_id=run_id, stream_id=stream, version=1, occurred_at=utcnow())], expected_version="any"
    )


async def register(store, run_id: str, *cells: str) -> None:
    for cell in cells:
        await append(store, run_id, CellRegistered(cell_id=cell, node_id="n1", accelerators=1, device="cpu",
                                                   memory_bytes=0, kv_capacity_tokens=1 << 20), f"cell-{cell}")


async def ready(store, run_id: str, roles: dict[str, str]) -> None:
    for cell, role in roles.items():
        await append(store, run_id, CellReady(cell_id=cell, role=role, switch_seconds=0.5), f"cell-{cell}")  # type: ignore[arg-type]


async def events_of(store, run_id: str, etype: str) -> list:
    return [s.event for s in await store.read_all(types=[etype], run_id=run_id)]


async def wait_until(store, run_id: str, etype: str, count: int, timeout: float = 60) -> list:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = await events_of(store, run_id, etype)
        if len(found) >= count:
            return found
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"expected {count} {etype} events, have {len(found)}")
        await asyncio.sleep(0.05)


async def ticks(svc: SchedulerService, n: int = 4, timeout: float = 30) -> None:
    """Let the service decide `n` more times (absence checks wait on decisions, not on the clock)."""
    target = svc.ticks + n
    deadline = asyncio.get_running_loop().time() + timeout
    while svc.ticks < target:
        assert asyncio.get_running_loop().time() < deadline, "the scheduler stopped ticking"
        await asyncio.sleep(0.02)


def assigned_roles(events: list) -> dict[str, list[str]]:
    roles: dict[str, list[str]] = {}
    for e in events:
        roles.setdefault(e.data.cell_id, []).append(e.data.role)
    return roles


async def test_async_assigns_fixed_pools_and_dispatches_within_the_staleness_bound(store, bus, infra):
    run_id = unique("run-")
    svc = scheduler(infra, store, bus, run_id, "async")
    await register(store, run_id, "n1-cell0", "n1-cell1")
    await svc.start()
    try:
        assigned = await wait_until(store, run_id, "cell.assigned", 2)
        assert assigned_roles(assigned) == {"n1-cell0": ["rollout"], "n1-cell1": ["train"]}
        assert all(e.data.policy == "async" for e in assigned)
        await ticks(svc)
        assert await events_of(store, run_id, "query.dispatched") == []  # no active rollout cell yet
        await ready(store, run_id, {"n1-cell0": "rollout", "n1-cell1": "train"})
        await wait_until(store, run_id, "query.dispatched", 2)
        await ticks(svc)
        # k = 0: step 1's queries wait for the trainer's first version.
        assert len(await events_of(store, run_id, "query.dispatched")) == 2
        await append(store, run_id, StepCompleted(step=0, policy_version=1, world_size=1, seconds=1.0, metrics={}))
        dispatched = await wait_until(store, run_id, "query.dispatched", 4)
        await ticks(svc)
        assert len(await events_of(store, run_id, "query.dispatched")) == 4  # every planned query, once
        assert len(await events_of(store, run_id, "cell.assigned")) == 2  # fixed pools never move
    finally:
        await svc.stop()
    got = [(e.data.query_id, e.data.step, e.data.policy_version, e.data.task_id) for e in dispatched]
    assert got == [
        (f"{run_id}-step0-q0", 0, 0, "task-a"),
        (f"{run_id}-step0-q1", 0, 0, "task-b"),
        (f"{run_id}-step1-q0", 1, 1, "task-a"),
        (f"{run_id}-step1-q1", 1, 1, "task-b"),
    ]
    assert [e.stream_id for e in dispatched] == [f"query-{q}" for q, *_ in got]
    assert all(len(e.data.seeds) == G and e.data.group_size == G for e in dispatched)
    assert [e.data.seeds for e in dispatched] == [svc.plan.seeds_for(n) for n in range(4)]
    assert dispatched[0].data.seeds != dispatched[1].data.seeds


async def test_a_restarted_scheduler_resumes_from_the_log_without_dispatching_twice(store, bus, infra):
    run_id = unique("run-")
    await register(store, run_id, "n1-cell0", "n1-cell1")
    first = scheduler(infra, store, bus, run_id, "async", total_steps=3)
    await first.start()
    try:
        await wait_until(store, run_id, "cell.assigned", 2)
        await ready(store, run_id, {"n1-cell0": "rollout", "n1-cell1": "train"})
        await wait_until(store, run_id, "query.dispatched", 2)
    finally:
        await first.stop()

    second = scheduler(infra, store, bus, run_id, "async", total_steps=3)
    await second.start()
    try:
        await ticks(second)
        assert len(await events_of(store, run_id, "query.dispatched")) == 2
        assert len(await events_of(store, run_id, "cell.assigned")) == 2
        # A scheduler that has not read the log (a second instance racing this one) still cannot
        # dispatch a query again: its stream already holds the dispatch.
        stale = scheduler(infra, store, bus, run_id, "async", total_steps=3)
        stale.store = store
        snapshot = stale.view.snapshot(0)
        again = DispatchQuery(query_id=f"{run_id}-step0-q0", policy_version=0, placements=("n1-cell0",) * G)
        assert await stale.execute(snapshot, [again]) == []
        await append(store, run_id, StepCompleted(step=0, policy_version=1, world_size=1, seconds=1.0, metrics={}))
        await wait_until(store, run_id, "query.dispatched", 4)
        await ticks(second)
    finally:
        await second.stop()
    ids = [e.data.query_id for e in await events_of(store, run_id, "query.dispatched")]
    assert ids == [f"{run_id}-step{s}-q{i}" for s in (0, 1) for i in (0, 1)]


async def test_colocate_alternates_the_whole_pool_between_rollout_and_training(store, bus, infra):
    run_id = unique("run-")
    svc = scheduler(infra, store, bus, run_id, "colocate", queries_per_step=1, total_steps=2)
    cells = ("n1-cell0", "n1-cell1")
    await register(store, run_id, *cells)
    await svc.start()

    async def finish_step(step: int) -> None:
        query = f"{run_id}-step{step}-q0"
        for i in range(G):
            await append(store, run_id, ExecutionFinished(execution_id=execution_id_for(query, i), elapsed_s=1, calls=1))

    try:
        await wait_until(store, run_id, "cell.assigned", 2)
        await ready(store, run_id, dict.fromkeys(cells, "rollout"))
        await wait_until(store, run_id, "query.dispatched", 1)
        await finish_step(0)
        await wait_until(store, run_id, "cell.assigned", 4)  # the batch is complete: everyone trains
        await ready(store, run_id, dict.fromkeys(cells, "train"))
        await ticks(svc)
        assert len(await events_of(store, run_id, "query.dispatched")) == 1  # no rollout while training
        await append(store, run_id, StepCompleted(step=0, policy_version=1, world_size=2, seconds=1.0, metrics={}))
        await wait_until(store, run_id, "cell.assigned", 6)  # the step is done: everyone rolls out again
        await ready(store, run_id, dict.fromkeys(cells, "rollout"))
        await wait_until(store, run_id, "query.dispatched", 2)
        await finish_step(1)
        await wait_until(store, run_id, "cell.assigned", 8)
        await ready(store, run_id, dict.fromkeys(cells, "train"))
        await append(store, run_id, StepCompleted(step=1, policy_version=2, world_size=2, seconds=1.0, metrics={}))
        before = len(await store.read_all(run_id=run_id))
        await ticks(svc)
        after = len(await store.read_all(run_id=run_id))
    finally:
        await svc.stop()
    roles = assigned_roles(await events_of(store, run_id, "cell.assigned"))
    assert roles == dict.fromkeys(cells, ["rollout", "train", "rollout", "train"])
    dispatched = await events_of(store, run_id, "query.dispatched")
    assert [(e.data.step, e.data.policy_version) for e in dispatched] == [(0, 0), (1, 1)]
    assert after == before  # the run is done: the scheduler emits nothing more


async def test_elastic_runs_live_on_the_same_policy_object_the_simulator_drives(store, bus, infra):
    from services.scheduler.policies import ElasticPolicy

    run_id = unique("run-")
    svc = scheduler(infra, store, bus, run_id, "elastic", total_steps=1)
    await register(store, run_id, "n1-cell0", "n1-cell1")
    await svc.start()
    try:
        assigned = await wait_until(store, run_id, "cell.assigned", 1)
        await ready(store, run_id, {e.data.cell_id: e.data.role for e in assigned})
        dispatched = await wait_until(store, run_id, "query.dispatched", 2)
    finally:
        await svc.stop()
    assert isinstance(svc.policy(2), ElasticPolicy)
    assert "rollout" in {e.data.role for e in assigned}
    assert [e.data.step for e in dispatched] == [0, 0]
    assert all(e.data.policy == "elastic" for e in await events_of(store, run_id, "cell.assigned"))


async def test_async_with_a_single_cell_decides_nothing_until_a_trainer_cell_joins(store, bus, infra):
    run_id = unique("run-")
    svc = scheduler(infra, store, bus, run_id, "async", total_steps=1)
    await register(store, run_id, "n1-cell0")
    await svc.start()
    try:
        await ticks(svc)
        assert await events_of(store, run_id, "cell.assigned") == []  # a fixed split needs two cells
        await register(store, run_id, "n1-cell1")
        assigned = await wait_until(store, run_id, "cell.assigned", 2)
    finally:
        await svc.stop()
    assert assigned_roles(assigned) == {"n1-cell0": ["rollout"], "n1-cell1": ["train"]}


async def test_elastic_orders_session_moves_live_once_each_and_the_fold_waits_for_them(store, bus, infra):
    """A decision's MigrateSession becomes kv.migration_ordered (the source cell's worker carries it out); the
    fold shows the session migrating, so later ticks do not order it again while the move is on its way."""
    from services.scheduler.plan import query_stream

    run_id = unique("run-")
    svc = scheduler(infra, store, bus, run_id, "elastic", total_steps=1, session_reserve_tokens=1000)
    cells = ("n1-cell0", "n1-cell1", "n1-cell2")
    await register(store, run_id, *cells)
    for cell in cells:  # all three already in rollout, as a previous scheduler left them
        await append(store, run_id, CellAssigned(cell_id=cell, role="rollout", policy="elastic"), f"cell-{cell}")
    await ready(store, run_id, dict.fromkeys(cells, "rollout"))
    for n in range(2):  # both queries of the step were placed on cell0 only
        data = svc.plan.dispatch(n, policy_version=0, placements=("n1-cell0",) * G)
        await append(store, run_id, data, query_stream(data.query_id))
    await svc.start()
    try:
        ordered = await wait_until(store, run_id, "kv.migration_ordered", 2)
        await ticks(svc, 6)
        ordered = await events_of(store, run_id, "kv.migration_ordered")
        live = svc.view.snapshot(svc.view.seconds_at(utcnow())).live
        # A move the worker made by KV shows in the scheduler's health numbers (gyre_scheduler_kv_… metrics).
        first = ordered[0].data
        await append(store, run_id, KvMigrated(execution_id=first.execution_id, from_cell=first.from_cell,
                                               to_cell=first.to_cell, tokens=300, bytes=3000, seconds=0.2,
                                               method="kv"), f"cell-{first.from_cell}")
        await ticks(svc, 2)
        kv_health = svc.health()["kv"]
    finally:
        await svc.stop()
    assert kv_health == {"prefill_tokens_avoided": 300, "fallbacks": 0}
    moves = [(e.data.execution_id, e.data.from_cell, e.data.to_cell) for e in ordered]
    assert len({m[0] for m in moves}) == len(moves)  # each session ordered once
    assert {m[1] for m in moves} == {"n1-cell0"} and {m[2] for m in moves} == {"n1-cell1", "n1-cell2"}
    assert all(e.data.policy == "elastic" and e.stream_id == "cell-n1-cell0" for e in ordered)
    by_id = {e.execution_id: e for e in live}
    assert all(by_id[m[0]].migrating and by_id[m[0]].cell_id == m[2] for m in moves)


@pytest.mark.parametrize(("kv_tokens", "fits"), [(9216, False), (18432, True)])
async def test_a_query_no_rollout_cell_can_hold_is_named_once(store, bus, infra, kv_tokens: int, fits: bool):
    """Engines whose KV admits one session each (9,216 tokens): async's one rollout cell can never start a query
    of two. The run config refuses such KV before a run starts; a run configured another way gets the query named
    (health, log) instead of waiting in silence. Engines that admit two (18,432) start it and name nothing."""
    run_id = unique("run-")
    svc = scheduler(infra, store, bus, run_id, "async", total_steps=1)
    await register(store, run_id, "n1-cell0", "n1-cell1")
    await svc.start()
    try:
        await wait_until(store, run_id, "cell.assigned", 2)
        await ticks(svc)
        assert svc.health()["never_fits"] == ""  # no engine has said what it holds yet
        await append(store, run_id, WeightsLoaded(cell_id="n1-cell0", worker_id="n1-cell0", version=0,
                                                  kv_capacity_tokens=kv_tokens), "cell-n1-cell0")
        await ready(store, run_id, {"n1-cell0": "rollout", "n1-cell1": "train"})
        if fits:
            await wait_until(store, run_id, "query.dispatched", 1)
        await ticks(svc)
        assert svc.health()["never_fits"] == ("" if fits else f"{run_id}-step0-q0")
        if not fits:
            assert await events_of(store, run_id, "query.dispatched") == []
    finally:
        await svc.stop()
