"""The live scheduler's pure core: the query plan and the fold of a run's events into a policy Snapshot."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.live import PlanError, QueryPlan, RunView, derive_seed
from services.scheduler.policies import CellState, Role, make_policy
from services.scheduler.policies.actions import AssignCell, DispatchQuery, apply_actions
from shared.events import (
    BatchReady,
    BlobRef,
    CallCompleted,
    CellAssigned,
    CellDraining,
    CellReady,
    CellRegistered,
    EventData,
    ExecutionFinished,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    KvMigrated,
    KvMigrationOrdered,
    StepCompleted,
    WeightsLoaded,
    WeightsPublished,
    new_event,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
REF = BlobRef(digest="sha256:" + "0" * 64, size=0)


def plan(**kw) -> QueryPlan:
    base = dict(run_id="r1", task_ids=("a", "b", "c"), queries_per_step=2, total_steps=3, group_size=2, seed=7)
    return QueryPlan(**{**base, **kw})  # type: ignore[arg-type]


def view(p: QueryPlan | None = None, *, staleness: int = 0) -> RunView:
    return RunView(plan=p or plan(), max_staleness=staleness, session_reserve_tokens=10, default_kv_tokens=1000)


class Log:
    """Builds events of one run with increasing times."""

    def __init__(self, run_id: str = "r1") -> None:
        self.run_id = run_id
        self.t = 0

    def __call__(self, data: EventData, stream: str = "s"):
        self.t += 1
        return new_event(data, run_id=self.run_id, stream_id=stream, version=1, occurred_at=T0 + timedelta(seconds=self.t))


def registered(cell: str, kv: int = 1000) -> CellRegistered:
    return CellRegistered(cell_id=cell, node_id="n", accelerators=1, device="cpu", memory_bytes=0, kv_capacity_tokens=kv)


def ready_cells(v: RunView, log: Log, roles: dict[str, str]) -> None:
    for cell, role in roles.items():
        v.apply(log(registered(cell)))
        v.apply(log(CellAssigned(cell_id=cell, role=role, policy="async")))  # type: ignore[arg-type]
        v.apply(log(CellReady(cell_id=cell, role=role, switch_seconds=1.0)))  # type: ignore[arg-type]


# ---- the plan ----


def test_query_ids_name_run_step_and_index_and_parse_back() -> None:
    p = plan()
    ids = [p.query_id(n) for n in range(p.total_queries)]
    assert ids[:3] == ["r1-step0-q0", "r1-step0-q1", "r1-step1-q0"]
    assert len(set(ids)) == len(ids)
    assert [p.number_of(i) for i in ids] == list(range(p.total_queries))
    assert p.number_of("r2-step0-q0") is None and p.number_of("r1-step0-q5") is None


def test_seeds_follow_the_run_seed_not_the_run_id() -> None:
    a, b = plan(run_id="async-run"), plan(run_id="colocate-run")
    assert [a.seeds_for(n) for n in range(6)] == [b.seeds_for(n) for n in range(6)]
    assert a.seeds_for(0) != plan(seed=8).seeds_for(0)
    assert len({s for n in range(6) for s in a.seeds_for(n)}) == 12  # distinct per step, index and sample
    assert derive_seed(7, 0, 0, 0) == a.seeds_for(0)[0]


def test_task_choice_round_robin_and_seeded_are_deterministic() -> None:
    assert [plan().task_for(n) for n in range(4)] == ["a", "b", "c", "a"]
    seeded = plan(task_order="seeded")
    assert [seeded.task_for(n) for n in range(20)] == [plan(task_order="seeded").task_for(n) for n in range(20)]
    assert set(seeded.task_for(n) for n in range(60)) == {"a", "b", "c"}


def test_plan_rejects_no_tasks_and_dispatch_past_the_last_step() -> None:
    with pytest.raises(PlanError, match="at least one task"):
        plan(task_ids=())
    with pytest.raises(PlanError, match=r"\[0, 6\)"):
        plan().dispatch(6, policy_version=0)
    q = plan().dispatch(3, policy_version=1)
    assert (q.query_id, q.step, q.task_id, q.group_size, q.policy_version) == ("r1-step1-q1", 1, "a", 2, 1)
    assert q.step_queries == 2  # the trajectory service waits for both of the step's queries


# ---- the fold ----


def test_registered_cells_start_idle_and_follow_assignment_until_ready() -> None:
    v, log = view(), Log()
    v.apply(log(registered("c0", kv=500)))
    v.apply(log(registered("c1", kv=0)))
    snap = v.snapshot(0)
    assert [(c.cell_id, c.role, c.state, c.kv_capacity_bytes) for c in snap.cells] == [
        ("c0", Role.IDLE, CellState.ACTIVE, 500),
        ("c1", Role.IDLE, CellState.ACTIVE, 1000),  # 0 = unknown capacity: the configured default
    ]
    v.apply(log(CellAssigned(cell_id="c0", role="rollout", policy="async")))
    assert v.snapshot(0).cells[0].state is CellState.SWITCHING
    v.apply(log(CellDraining(cell_id="c0", from_role="idle", live_sessions=0)))
    assert v.snapshot(0).cells[0].state is CellState.SWITCHING
    ready = log(CellReady(cell_id="c0", role="rollout", switch_seconds=2.0))
    v.apply(ready)
    c0 = v.snapshot(0).cells[0]
    assert (c0.role, c0.state, c0.role_since_s) == (Role.ROLLOUT, CellState.ACTIVE, v.seconds_at(ready.occurred_at))
    # The agent restarted: the cell is between roles until it reports ready again.
    v.apply(log(registered("c0", kv=500)))
    assert v.snapshot(0).cells[0].state is CellState.SWITCHING


def test_dispatched_queries_are_live_until_their_executions_end() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "train"})
    p = v.plan
    v.apply(log(p.dispatch(0, policy_version=0), "query-0"))
    snap = v.snapshot(0)
    assert snap.queries_dispatched == 1
    assert [e.execution_id for e in snap.live] == ["r1-step0-q0-s0", "r1-step0-q0-s1"]
    assert {e.cell_id for e in snap.live} == {"c0"}  # only rollout cells hold sessions
    v.apply(log(ExecutionStarted(execution_id="x0", query_id="r1-step0-q0", task_id="a", group_size=2,
                                 sample_index=0, seed=1)))
    assert sorted(e.execution_id for e in v.snapshot(0).live) == ["r1-step0-q0-s1", "x0"]
    v.apply(log(ExecutionFinished(execution_id="x0", elapsed_s=1, calls=2)))
    v.apply(log(ExecutionTimedOut(execution_id="r1-step0-q0-s1", budget="wall_clock", elapsed_s=1, calls=2)))
    v.apply(log(ExecutionScored(execution_id="x0", query_id="r1-step0-q0", reward=1.0, tests_passed=1, tests_total=1)))
    snap = v.snapshot(0)
    assert snap.live == ()
    assert [f.execution_id for f in snap.finished_untrained] == ["r1-step0-q0-s1", "x0"]
    assert not snap.trainer.batch_complete  # the step's second query has not been dispatched
    assert v.rewards == {"x0": 1.0}


def test_trainer_progress_moves_version_backlog_and_batch_completion() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    for n in range(2):
        v.apply(log(v.plan.dispatch(n, policy_version=0)))
        for i in range(2):
            v.apply(log(ExecutionFinished(execution_id=f"{v.plan.query_id(n)}-s{i}", elapsed_s=1, calls=1)))
    assert v.snapshot(0).trainer.batch_complete
    v.apply(log(BatchReady(step=0, batch=REF, query_ids=[], executions=4, trees=4, micro_batches=1,
                           unique_tokens=600, flat_tokens=900, target_tokens=300, min_policy_version=0,
                           max_policy_version=0)))
    assert v.snapshot(0).trainer.backlog_tokens == 600
    v.apply(log(StepCompleted(step=0, policy_version=1, world_size=2, seconds=3.0, metrics={})))
    snap = v.snapshot(0)
    assert (snap.trainer.policy_version, snap.trainer.backlog_tokens) == (1, 0)
    assert snap.trainer.tokens_per_cell_s == pytest.approx(100.0)
    assert snap.finished_untrained == ()  # trained executions leave the backlog
    assert not snap.trainer.batch_complete
    v.apply(log(WeightsPublished(version=2, step=1, weights=REF)))
    assert v.policy_version == 2
    v.apply(log(StepCompleted(step=2, policy_version=3, world_size=1, seconds=1.0, metrics={})))
    assert v.done


def test_the_queue_holds_the_next_queries_the_staleness_bound_could_reach() -> None:
    v = view(staleness=1)
    assert v.queued() == [0, 1, 2, 3]  # steps 0 and 1 at version 0 with k = 1
    v.apply(Log()(v.plan.dispatch(0, policy_version=0)))
    assert v.queued() == [1, 2, 3]
    v.policy_version = 2
    assert v.queued() == [1, 2, 3, 4, 5]  # capped at the last planned step


def rollout_cell_serving(v: RunView, log: Log, cell: str, version: int | None) -> None:
    v.apply(log(registered(cell)))
    v.apply(log(CellAssigned(cell_id=cell, role="rollout", policy="async")))
    v.apply(log(CellReady(cell_id=cell, role="rollout", switch_seconds=1.0, policy_version=version)))


def test_queries_wait_for_the_rollout_cells_to_load_the_newest_published_weights() -> None:
    """With the trainer at version 1 and a worker still on 0, step 2 (k = 1) would be generated partly by
    version 0: the bound counts from the trainer's version less the versions a worker has still to load."""
    v, log = view(plan(total_steps=4), staleness=1), Log()
    rollout_cell_serving(v, log, "c0", 0)
    ready_cells(v, log, {"c1": "train"})
    v.apply(log(WeightsPublished(version=0, step=-1, weights=REF)))
    v.apply(log(WeightsPublished(version=1, step=0, weights=REF)))
    assert (v.policy_version, v.weights_lag(), v.dispatch_version()) == (1, 1, 0)
    assert v.queued() == [0, 1, 2, 3] and v.held_for_weights() == 2  # steps 0-1; step 2 waits
    assert [q.query_id for q in v.snapshot(0).queued] == [v.plan.query_id(n) for n in range(4)]
    v.apply(log(WeightsLoaded(cell_id="c0", worker_id="w0", version=1)))
    assert v.dispatch_version() == 1 and v.queued() == [0, 1, 2, 3, 4, 5] and v.held_for_weights() == 0
    v.apply(log(WeightsLoaded(cell_id="c0", worker_id="w0", version=0)))  # a late report of an older load
    assert v.dispatch_version() == 1
    # A cell switching into rollout does not hold dispatch; once ready it counts with what it serves.
    v.apply(log(WeightsPublished(version=2, step=1, weights=REF)))
    v.apply(log(WeightsLoaded(cell_id="c0", worker_id="w0", version=2)))
    v.apply(log(CellAssigned(cell_id="c1", role="rollout", policy="elastic")))
    assert v.dispatch_version() == 2
    v.apply(log(CellReady(cell_id="c1", role="rollout", switch_seconds=1.0, policy_version=1)))
    assert v.dispatch_version() == 1
    v.apply(log(CellReady(cell_id="c1", role="train", switch_seconds=1.0)))  # off rollout: not counted again
    assert v.dispatch_version() == 2


def test_a_worker_that_loaded_newer_weights_while_its_cell_switched_in_is_not_taken_back_by_cell_ready() -> None:
    """Its agent read the worker's version (1) from a heartbeat; the worker then loaded version 2 and said so
    before the agent's cell.ready(1) landed."""
    v, log = view(plan(total_steps=4), staleness=0), Log()
    ready_cells(v, log, {"c1": "train"})
    v.apply(log(registered("c0")))
    v.apply(log(WeightsPublished(version=2, step=1, weights=REF)))
    v.apply(log(CellAssigned(cell_id="c0", role="rollout", policy="elastic")))
    v.apply(log(WeightsLoaded(cell_id="c0", worker_id="w0", version=2)))
    v.apply(log(CellReady(cell_id="c0", role="rollout", switch_seconds=1.0, policy_version=1)))
    assert v.weights_lag() == 0 and v.dispatch_version() == 2


def test_versions_the_trainer_never_publishes_are_not_waited_for() -> None:
    """`publish_every` 3: the workers can serve 0 and 3 only. Waiting for them to serve the trainer's 5 would
    wait for ever (version 6 needs batch 5, which would need it)."""
    v, log = view(plan(total_steps=8), staleness=1), Log()
    rollout_cell_serving(v, log, "c0", 0)
    v.apply(log(WeightsPublished(version=3, step=2, weights=REF)))
    v.apply(log(WeightsLoaded(cell_id="c0", worker_id="w0", version=3)))
    v.apply(log(StepCompleted(step=4, policy_version=5, world_size=1, seconds=1, metrics={})))
    assert (v.policy_version, v.published_version, v.weights_lag(), v.dispatch_version()) == (5, 3, 0, 5)
    assert max(v.queued()) == 13  # steps up to 6 = 5 + k: what the trainer's version allows


def test_a_cell_stuck_behind_the_newest_weights_stops_holding_dispatch_after_the_wait() -> None:
    v = RunView(plan=plan(total_steps=4), max_staleness=0, session_reserve_tokens=10, default_kv_tokens=1000,
                weights_wait_s=300.0)
    log = Log()
    rollout_cell_serving(v, log, "c0", 0)
    rollout_cell_serving(v, log, "c1", 0)
    v.apply(log(WeightsPublished(version=1, step=0, weights=REF)))
    published_at = v.seconds_at(T0 + timedelta(seconds=log.t))
    v.apply(log(WeightsLoaded(cell_id="c1", worker_id="w1", version=1)))
    assert v.dispatch_version(published_at + 299) == 0 and v.stuck_cells(published_at + 299) == []
    assert v.dispatch_version(published_at + 301) == 1 and v.stuck_cells(published_at + 301) == ["c0"]
    assert v.dispatch_version() == 0  # without a clock every cell counts
    v.apply(log(WeightsLoaded(cell_id="c0", worker_id="w0", version=1)))  # it got there after all
    assert v.stuck_cells(published_at + 400) == [] and v.dispatch_version(published_at + 400) == 1


def test_cells_that_never_said_what_they_serve_do_not_hold_dispatch() -> None:
    v, log = view(staleness=0), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "train"})  # cell.ready without a policy version
    v.apply(log(WeightsPublished(version=1, step=0, weights=REF)))
    assert v.dispatch_version() == 1 and v.queued() == [0, 1, 2, 3] and v.held_for_weights() == 0


def test_events_of_other_runs_and_duplicates_change_nothing() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    event = log(v.plan.dispatch(0, policy_version=0))
    assert v.apply(event)
    before = v.snapshot(1.0)
    assert not v.apply(event)
    other = Log("r2")
    assert not v.apply(other(registered("zz")))
    assert not v.apply(other(StepCompleted(step=0, policy_version=5, world_size=1, seconds=1, metrics={})))
    assert v.snapshot(1.0) == before


def test_sessions_follow_migrations_and_leave_a_cell_ordered_out_of_rollout() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0)))
    placed = {e.execution_id: e.cell_id for e in v.snapshot(0).live}
    assert placed == {"r1-step0-q0-s0": "c0", "r1-step0-q0-s1": "c1"}  # spread, least loaded first
    v.apply(log(KvMigrated(execution_id="r1-step0-q0-s0", from_cell="c0", to_cell="c2", tokens=5, bytes=50,
                           seconds=0.1, method="kv")))
    v.apply(log(CellAssigned(cell_id="c1", role="train", policy="elastic")))
    # c1's worker drains onto the least loaded rollout cell left (c0, empty since the migration).
    assert {e.execution_id: e.cell_id for e in v.snapshot(0).live} == {"r1-step0-q0-s0": "c2", "r1-step0-q0-s1": "c0"}


def test_a_drained_cells_sessions_go_to_cells_already_serving_not_to_one_switching_in() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "train"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    v.apply(log(v.plan.dispatch(1, policy_version=0, placements=("c1", "c1"))))
    v.apply(log(CellAssigned(cell_id="c2", role="rollout", policy="elastic")))  # empty, but no worker yet
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="elastic")))
    assert {e.cell_id for e in v.snapshot(0).live} == {"c1"}


def test_sessions_sit_where_the_policy_placed_them_then_where_their_calls_are_served() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c2", "c2"))))
    assert {e.cell_id for e in v.snapshot(0).live} == {"c2"}
    v.apply(log(CallCompleted(execution_id="r1-step0-q0-s1", call_id="k", call_index=0, record=REF, prompt_tokens=3,
                              new_prompt_tokens=3, completion_tokens=1, policy_version=0, cell_id="c0")))
    assert {e.execution_id: e.cell_id for e in v.snapshot(0).live} == {"r1-step0-q0-s0": "c2", "r1-step0-q0-s1": "c0"}
    # c0 leaves rollout and its worker moves the session on; the call it served last is recorded after that
    # (gateway and worker write independently): the session does not go back to a cell that holds none.
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="elastic")))
    v.apply(log(KvMigrated(execution_id="r1-step0-q0-s1", from_cell="c0", to_cell="c1", tokens=5, bytes=50,
                           seconds=0.1, method="kv")))
    v.apply(log(CallCompleted(execution_id="r1-step0-q0-s1", call_id="late", call_index=1, record=REF,
                              prompt_tokens=3, new_prompt_tokens=3, completion_tokens=1, policy_version=0,
                              cell_id="c0")))
    assert {e.execution_id: e.cell_id for e in v.snapshot(0).live} == {"r1-step0-q0-s0": "c2", "r1-step0-q0-s1": "c1"}


def call(execution_id: str, cell: str, index: int, prompt: int, completion: int, chain: str = "main") -> CallCompleted:
    return CallCompleted(execution_id=execution_id, call_id=f"{execution_id}-{chain}-{index}", call_index=index,
                         record=REF, prompt_tokens=prompt, new_prompt_tokens=prompt, completion_tokens=completion,
                         policy_version=0, cell_id=cell, chain_id=chain)


def test_a_sessions_context_is_the_latest_call_of_each_of_its_chains() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0)))
    v.apply(log(call("r1-step0-q0-s0", "c0", 0, prompt=100, completion=20)))
    v.apply(log(call("r1-step0-q0-s0", "c0", 1, prompt=150, completion=30)))
    v.apply(log(call("r1-step0-q0-s0", "c0", 2, prompt=40, completion=5, chain="sub-1")))  # a delegation's chain
    v.apply(log(call("r1-step0-q0-s0", "c0", 0, prompt=100, completion=20)))  # a duplicate of an older call
    live = {e.execution_id: e for e in v.snapshot(0).live}
    assert live["r1-step0-q0-s0"].context_tokens == 180 + 45
    assert live["r1-step0-q0-s0"].kv_bytes == 225  # live KV is counted in tokens, as cells register capacity
    assert live["r1-step0-q0-s1"].context_tokens == 0  # no call yet
    # A session past its reserve reserves what it holds.
    snap = v.snapshot(0)
    assert snap.reserved_bytes(live["r1-step0-q0-s0"]) == 225 and snap.reserved_bytes(live["r1-step0-q0-s1"]) == 10


def test_an_ordered_move_shows_the_session_migrating_onto_its_target_until_the_worker_reports_it() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    v.apply(log(KvMigrationOrdered(execution_id="r1-step0-q0-s0", from_cell="c0", to_cell="c1", policy="elastic")))
    at = float(log.t)
    live = {e.execution_id: e for e in v.snapshot(at).live}
    assert (live["r1-step0-q0-s0"].cell_id, live["r1-step0-q0-s0"].migrating) == ("c1", True)
    assert (live["r1-step0-q0-s1"].cell_id, live["r1-step0-q0-s1"].migrating) == ("c0", False)
    # A call the source served before the move is recorded now: the move still stands.
    v.apply(log(call("r1-step0-q0-s0", "c0", 0, prompt=10, completion=2)))
    assert {e.execution_id: (e.cell_id, e.migrating) for e in v.snapshot(at).live}["r1-step0-q0-s0"] == ("c1", True)
    v.apply(log(KvMigrated(execution_id="r1-step0-q0-s0", from_cell="c0", to_cell="c1", tokens=12, bytes=0,
                           seconds=0.1, method="recompute")))
    # ... and one recorded after the worker's report does not send it back to the cell it left.
    v.apply(log(call("r1-step0-q0-s0", "c0", 1, prompt=14, completion=2)))
    assert {e.execution_id: (e.cell_id, e.migrating) for e in v.snapshot(at).live}["r1-step0-q0-s0"] == ("c1", False)
    v.apply(log(call("r1-step0-q0-s0", "c1", 2, prompt=18, completion=2)))
    assert {e.execution_id: e.cell_id for e in v.snapshot(at).live}["r1-step0-q0-s0"] == "c1"


def test_an_ordered_move_nobody_reports_lapses_and_one_onto_a_cell_leaving_rollout_is_void() -> None:
    v = RunView(plan=plan(), max_staleness=0, session_reserve_tokens=10, default_kv_tokens=1000,
                migration_timeout_s=60.0)
    log = Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    v.apply(log(KvMigrationOrdered(execution_id="r1-step0-q0-s0", from_cell="c0", to_cell="c1", policy="elastic")))
    at = v.seconds_at(T0 + timedelta(seconds=log.t))  # the order's time on the snapshot's axis
    assert {e.execution_id: e.migrating for e in v.snapshot(at + 59).live}["r1-step0-q0-s0"]
    # The worker could not move it (target refused, say): after the timeout it is where it was, to be decided again.
    lapsed = {e.execution_id: (e.cell_id, e.migrating) for e in v.snapshot(at + 61).live}
    assert lapsed["r1-step0-q0-s0"] == ("c0", False)
    v.apply(log(KvMigrationOrdered(execution_id="r1-step0-q0-s1", from_cell="c0", to_cell="c2", policy="elastic")))
    v.apply(log(CellAssigned(cell_id="c2", role="train", policy="elastic")))  # its target drains: it stays on c0
    assert {e.execution_id: (e.cell_id, e.migrating) for e in v.snapshot(float(log.t)).live}["r1-step0-q0-s1"] == (
        "c0", False)
    # A move ordered off a cell that then leaves rollout is where its session goes, still migrating until the
    # worker says it moved; a session without a live order goes to the least loaded cell serving.
    v.apply(log(KvMigrationOrdered(execution_id="r1-step0-q0-s1", from_cell="c0", to_cell="c1", policy="elastic")))
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="elastic")))
    late = v.seconds_at(T0 + timedelta(seconds=log.t))
    assert {e.execution_id: (e.cell_id, e.migrating) for e in v.snapshot(late).live} == {
        "r1-step0-q0-s0": ("c1", True), "r1-step0-q0-s1": ("c1", True)}  # s0's order had not lapsed yet then
    v.apply(log(KvMigrated(execution_id="r1-step0-q0-s1", from_cell="c0", to_cell="c1", tokens=5, bytes=50,
                           seconds=0.1, method="recompute")))
    assert {e.execution_id: e.migrating for e in v.snapshot(late).live}["r1-step0-q0-s1"] is False


def test_a_refused_move_is_settled_at_once_and_late_records_move_nothing_only_for_calls_in_flight() -> None:
    from shared.events import KvMigrationRefused

    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    e = "r1-step0-q0-s0"
    v.apply(log(KvMigrationOrdered(execution_id=e, from_cell="c0", to_cell="c1", policy="elastic")))
    v.apply(log(KvMigrationRefused(execution_id=e, from_cell="c0", to_cell="c1", reason="no session here")))
    assert {x.execution_id: (x.cell_id, x.migrating) for x in v.snapshot(0).live}[e] == ("c0", False)
    for i in range(3):
        v.apply(log(call(e, "c0", i, prompt=10 + i, completion=1)))
    v.apply(log(KvMigrated(execution_id=e, from_cell="c0", to_cell="c2", tokens=14, bytes=0, seconds=0.5,
                           method="recompute")))
    v.apply(log(call(e, "c0", 3, prompt=20, completion=1)))  # in flight when it moved, recorded after
    assert {x.execution_id: x.cell_id for x in v.snapshot(0).live}[e] == "c2"
    v.apply(log(call(e, "c0", 4, prompt=22, completion=1)))  # a later call there: it was placed there again
    assert {x.execution_id: x.cell_id for x in v.snapshot(0).live}[e] == "c0"
    # Migrations measured so far set the rate the policy prices moves at (tokens per second on the live side).
    assert v.measured_switch_costs().migration_bytes_per_s == 28.0


def test_without_placements_sessions_are_spread_over_cells_that_take_sessions_only() -> None:
    """A cell switching into rollout is not running its worker yet: the router places nothing there."""
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "train", "c1": "rollout"})
    v.apply(log(CellAssigned(cell_id="c0", role="rollout", policy="elastic")))  # switching, not yet ready
    v.apply(log(v.plan.dispatch(0, policy_version=0)))
    assert {e.cell_id for e in v.snapshot(0).live} == {"c1"}


def test_elastic_never_sends_a_cell_holding_a_session_to_training_while_another_switches_in() -> None:
    """The policy places a query on the only cell taking sessions while another switches into rollout; with the
    placement folded, the next decision sees that cell occupied and does not order it to train."""
    v, log = view(plan(queries_per_step=1, group_size=1), staleness=1), Log()
    ready_cells(v, log, {"a": "train", "b": "rollout"})
    policy = make_policy("elastic", budget_cells=2)
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("b",))))
    v.apply(log(CellAssigned(cell_id="a", role="rollout", policy="elastic")))
    snap = v.snapshot(float(log.t))
    (dispatch,) = [x for x in policy.decide(snap) if isinstance(x, DispatchQuery)]
    assert dispatch.placements == ("b",)
    v.apply(log(v.plan.dispatch(1, policy_version=0, placements=dispatch.placements)))
    v.apply(log(ExecutionFinished(execution_id="r1-step0-q0-s0", elapsed_s=1, calls=1)))
    v.apply(log(ExecutionScored(execution_id="r1-step0-q0-s0", query_id="r1-step0-q0", reward=1.0, tests_passed=1,
                                tests_total=1)))
    snap = v.snapshot(float(log.t) + 400)
    actions = policy.decide(snap)
    apply_actions(snap, actions, allow_parking=False)  # raises if a cell with a session is ordered to train
    assert AssignCell("b", Role.TRAIN) not in actions


def test_a_pool_with_no_rollout_cell_left_parks_its_sessions() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0)))
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="colocate")))
    assert {e.cell_id for e in v.snapshot(0).live} == {"c0"}


def test_measured_switches_replace_the_reference_switch_costs() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    assert v.snapshot(0).switch_costs.to_train_s == 8.52  # nothing measured yet
    for role, seconds in (("train", 2.0), ("rollout", 1.0), ("train", 4.0)):
        v.apply(log(CellAssigned(cell_id="c0", role=role, policy="colocate")))  # type: ignore[arg-type]
        v.apply(log(CellDraining(cell_id="c0", from_role="rollout" if role == "train" else "train", live_sessions=0)))
        v.apply(log(CellReady(cell_id="c0", role=role, switch_seconds=seconds)))  # type: ignore[arg-type]
    costs = v.snapshot(0).switch_costs
    assert (costs.to_train_s, costs.to_rollout_s) == (3.0, 1.0)


# ---- property: folding what a policy decides keeps the snapshot consistent ----


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["async", "colocate", "elastic"]),
    cells=st.integers(2, 4),
    staleness=st.integers(0, 2),
    script=st.lists(st.sampled_from(["tick", "finish", "step"]), min_size=1, max_size=40),
)
def test_a_simulated_run_dispatches_each_query_once_within_the_bound(mode, cells, staleness, script) -> None:
    """Drive the real policy on the fold: every decision passes the invariant checker, each planned query is
    dispatched at most once, never beyond the staleness bound, and the live count matches the log."""
    p = plan(total_steps=4)
    v, log = view(p, staleness=staleness), Log()
    for i in range(cells):
        v.apply(log(registered(f"c{i}", kv=1000)))
    policy = make_policy(mode, budget_cells=cells)
    dispatched: list[tuple[int, int]] = []  # (step, trainer version at dispatch)
    for op in script:
        snap = v.snapshot(float(log.t))
        if op == "tick" and not v.done:
            actions = policy.decide(snap)
            apply_actions(snap, actions, allow_parking=policy.allows_parking)
            for a in actions:
                if isinstance(a, AssignCell):
                    v.apply(log(CellAssigned(cell_id=a.cell_id, role=a.role.value, policy=mode)))
                    v.apply(log(CellReady(cell_id=a.cell_id, role=a.role.value, switch_seconds=0.1)))
                # MigrateSession and DrainCell: the workers carry them out; the fold mirrors the moves
                # when a cell is ordered out of rollout.
                elif isinstance(a, DispatchQuery):
                    n = p.number_of(a.query_id)
                    assert n is not None
                    data = p.dispatch(n, policy_version=a.policy_version, placements=a.placements)
                    dispatched.append((data.step, v.policy_version))
                    v.apply(log(data))
                    # The fold holds each session where the policy placed it (the router follows that).
                    assert tuple(v.sessions[(a.query_id, i)].cell_id for i in range(p.group_size)) == a.placements
        elif op == "finish" and v.sessions:
            key = min(v.sessions)
            v.apply(log(ExecutionFinished(execution_id=v.sessions[key].execution_id, elapsed_s=1, calls=1)))
        elif op == "step" and not v.done and v.batch_complete(v.policy_version):
            step = v.policy_version
            v.apply(log(StepCompleted(step=step, policy_version=step + 1, world_size=1, seconds=1, metrics={})))
        ended = sum(q.ended for q in v.queries.values())
        assert len(v.snapshot(0).live) == sum(q.group_size for q in v.queries.values()) - ended
    steps = [s for s, _ in dispatched]
    assert len(dispatched) == len(set(v.dispatched_numbers)) == len(v.queries)
    assert steps == sorted(steps)  # queries go out in plan order
    assert all(step <= version + staleness for step, version in dispatched)
    assert all(step < p.total_steps for step in steps)
