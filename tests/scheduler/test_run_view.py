"""The fold of a run's events into the policies' Snapshot: cells, queries, trainer, weights, and (driven by the real
policies) a whole run's worth of decisions folded back."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policies import CellState, Role, make_policy
from services.scheduler.policies.actions import AssignCell, DispatchQuery, MigrateSession, apply_actions
from services.scheduler.run_view import RunView
from shared.events import (
    BatchReady,
    CellAssigned,
    CellDrained,
    CellDraining,
    CellReady,
    CellReleased,
    ExecutionFinished,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
    KvMigrated,
    KvMigrationOrdered,
    StepCompleted,
    WeightsLoaded,
    WeightsPublished,
)

from .fold_log import REF, T0, Log, drained, eid, plan, ready_cells, registered, rollout_cell_serving, view


def test_registered_cells_start_idle_and_follow_assignment_until_ready() -> None:
    v, log = view(), Log()
    v.apply(log(registered("c0", kv=500)))
    v.apply(log(registered("c1", kv=0)))
    snap = v.snapshot(0)
    assert [(c.cell_id, c.role, c.state, c.kv_capacity_tokens) for c in snap.cells] == [
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


def test_a_cell_admits_against_the_smaller_of_its_registered_kv_and_what_its_engine_reports() -> None:
    v, log = view(), Log()
    v.apply(log(registered("c0", kv=500)))
    v.apply(log(registered("c1", kv=0)))
    v.apply(log(WeightsLoaded(cell_id="c0", worker_id="c0", version=0, kv_capacity_tokens=384)))
    v.apply(log(WeightsLoaded(cell_id="c1", worker_id="c1", version=0, kv_capacity_tokens=4096)))
    assert [c.kv_capacity_tokens for c in v.snapshot(0).cells] == [384, 4096]  # c1 registered none: the engine's
    # A worker that does not report its engine's KV (0) changes nothing; the agent registering again keeps the
    # engine's report, and a registration below it wins.
    v.apply(log(WeightsLoaded(cell_id="c1", worker_id="c1", version=1)))
    v.apply(log(registered("c0", kv=256)))
    assert [c.kv_capacity_tokens for c in v.snapshot(0).cells] == [256, 4096]


def test_dispatched_queries_are_live_until_their_executions_end() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "train"})
    p = v.plan
    v.apply(log(p.dispatch(0, policy_version=0, placements=("c0", "c0")), "query-0"))
    snap = v.snapshot(0)
    assert snap.queries_dispatched == 1
    assert [e.execution_id for e in snap.live] == [eid(0, 0), eid(0, 1)]
    assert {e.cell_id for e in snap.live} == {"c0"}
    # The harness's execution.started names the execution; its id is the one that counts from then on.
    v.apply(log(ExecutionStarted(execution_id="x0", query_id="r1-step0-q0", task_id="a", group_size=2,
                                 sample_index=0, seed=1)))
    assert sorted(e.execution_id for e in v.snapshot(0).live) == [eid(0, 1), "x0"]
    v.apply(log(ExecutionFinished(execution_id="x0", elapsed_s=1, calls=2)))
    v.apply(log(ExecutionTimedOut(execution_id=eid(0, 1), budget="wall_clock", elapsed_s=1, calls=2)))
    v.apply(log(ExecutionScored(execution_id="x0", query_id="r1-step0-q0", reward=1.0, tests_passed=1, tests_total=1)))
    snap = v.snapshot(0)
    assert snap.live == ()
    assert [f.execution_id for f in snap.finished_untrained] == [eid(0, 1), "x0"]
    assert not snap.trainer.batch_complete  # the step's second query has not been dispatched
    assert v.rewards == {"x0": 1.0}


def test_trainer_progress_moves_version_backlog_and_batch_completion() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    for n in range(2):
        v.apply(log(v.plan.dispatch(n, policy_version=0, placements=("c0", "c0"))))
        for i in range(2):
            v.apply(log(ExecutionFinished(execution_id=eid(n, i), elapsed_s=1, calls=1)))
    # Forecast from the folded dispatches and ends, before the trajectory service's batch.ready.
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


def test_a_built_batch_is_complete_whatever_the_fold_has_seen_of_its_executions() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    assert not v.batch_complete(0)
    v.apply(log(BatchReady(step=0, batch=REF, query_ids=[], executions=2, trees=2, micro_batches=1,
                           unique_tokens=60, flat_tokens=90, target_tokens=30, min_policy_version=0,
                           max_policy_version=0)))
    assert v.batch_complete(0)  # batch.ready decides once it is in the log


def test_the_queue_holds_the_next_queries_the_staleness_bound_could_reach() -> None:
    v = view(staleness=1)
    assert v.queued() == [0, 1, 2, 3]  # steps 0 and 1 at version 0 with k = 1
    v.apply(Log()(v.plan.dispatch(0, policy_version=0)))
    assert v.queued() == [1, 2, 3]
    v.policy_version = 2
    assert v.queued() == [1, 2, 3, 4, 5]  # capped at the last planned step


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
    """Its agent copied the version of the worker's start-up weights.loaded (1); the worker then loaded version 2
    and said so before the agent's cell.ready(1) landed."""
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
    v, log = view(plan(total_steps=4), weights_wait_s=300.0), Log()
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
    event = log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0")))
    assert v.apply(event)
    before = v.snapshot(1.0)
    assert not v.apply(event)
    other = Log("r2")
    assert not v.apply(other(registered("zz")))
    assert not v.apply(other(StepCompleted(step=0, policy_version=5, world_size=1, seconds=1, metrics={})))
    assert v.snapshot(1.0) == before


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
    v.apply(log(ExecutionFinished(execution_id=eid("r1-step0-q0", 0), elapsed_s=1, calls=1)))
    v.apply(log(ExecutionScored(execution_id=eid("r1-step0-q0", 0), query_id="r1-step0-q0", reward=1.0,
                                tests_passed=1, tests_total=1)))
    snap = v.snapshot(float(log.t) + 400)
    actions = policy.decide(snap)
    apply_actions(snap, actions, allow_parking=False)  # raises if a cell with a session is ordered to train
    assert AssignCell("b", Role.TRAIN) not in actions


def test_a_warm_switch_makes_the_cell_serve_its_new_role_only_from_cell_ready_whatever_its_processes_said_before(
) -> None:
    """Both directions as a warm cell reports them: from the order to cell.ready the cell is switching in its new
    role (no policy places on it or orders it again), its old role lets go first (its sessions leave until the
    drain ends; the trainer's cell.drained for a train cell moves none), and a worker's wake before cell.ready
    says what it will serve, not that it serves."""
    v, log = view(plan(queries_per_step=1, group_size=2), staleness=1), Log()
    ready_cells(v, log, {"a": "rollout", "b": "rollout", "c": "train"})
    policy = make_policy("elastic", budget_cells=3)

    def decided(cell: str) -> list:
        snap = v.snapshot(float(log.t))
        actions = policy.decide(snap)
        apply_actions(snap, actions, allow_parking=False)  # raises on an order to a switching cell
        return [x for x in actions if (isinstance(x, AssignCell) and x.cell_id == cell)
                or (isinstance(x, DispatchQuery) and cell in x.placements)]

    def state(cell: str) -> tuple[Role, CellState]:
        view_of = v.snapshot(0).cells_by_id()[cell]
        return view_of.role, view_of.state

    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("a", "b"))))
    v.apply(log(WeightsPublished(version=1, step=0, weights=REF)))
    v.apply(log(WeightsLoaded(cell_id="c", worker_id="c", version=1)))  # c's worker stands by: it serves nothing
    assert v.cells["c"].served_version is None
    # a: rollout -> train
    v.apply(log(CellAssigned(cell_id="a", role="train", policy="elastic")))
    v.apply(log(CellDraining(cell_id="a", from_role="rollout")))
    assert state("a") == (Role.TRAIN, CellState.SWITCHING) and decided("a") == []
    assert [(e.cell_id, e.migrating) for e in v.snapshot(0).live] == [("a", True), ("b", False)]
    v.apply(log(KvMigrated(execution_id=eid(0, 0), from_cell="a", to_cell="b", tokens=8, bytes=80, seconds=0.5,
                           method="kv")))
    assert (v.prefill_tokens_avoided, v.kv_fallbacks) == (8, 0)  # what the target did not prefill again
    v.apply(log(drained("a", migrated=1)))
    v.apply(log(CellReleased(cell_id="a", from_role="rollout", migrated_sessions=1, seconds=0.4)))
    assert state("a") == (Role.TRAIN, CellState.SWITCHING) and decided("a") == []  # the rank is not in yet
    v.apply(log(CellReady(cell_id="a", role="train", switch_seconds=2.0, warm=True, phases={"drain_s": 0.4})))
    assert state("a") == (Role.TRAIN, CellState.ACTIVE)
    # c: train -> rollout
    v.apply(log(CellAssigned(cell_id="c", role="rollout", policy="elastic")))
    v.apply(log(CellDraining(cell_id="c", from_role="train")))
    v.apply(log(CellDrained(cell_id="c", worker_id="rank-c", migrated_sessions=0, parked_sessions=0, seconds=0.1,
                            phases={"wait_step_s": 0.1})))
    v.apply(log(CellReleased(cell_id="c", from_role="train", migrated_sessions=0, seconds=0.1)))
    assert [(e.cell_id, e.migrating) for e in v.snapshot(0).live] == [("b", False), ("b", False)]
    v.apply(log(WeightsLoaded(cell_id="c", worker_id="c", version=1, phases={"wake_s": 0.2})))  # the wake
    assert state("c") == (Role.ROLLOUT, CellState.SWITCHING) and decided("c") == []
    assert v.cells["c"].served_version == 1
    v.apply(log(CellReady(cell_id="c", role="rollout", switch_seconds=1.0, policy_version=1, warm=True)))
    assert state("c") == (Role.ROLLOUT, CellState.ACTIVE)
    costs = v.snapshot(0).switch_costs
    assert (costs.to_train_s, costs.to_rollout_s) == (2.0, 1.0)


# ---- property: folding what a policy decides, and what the workers report, keeps the snapshot consistent ----


def carry_out(v: RunView, log: Log, action: AssignCell | MigrateSession, mode: str) -> None:
    """Append what the other services write for an order: the source worker's move, or the cell agent's switch
    with its worker's drain (whatever is left on a cell leaving rollout stays parked: colocate's case)."""
    if isinstance(action, MigrateSession):
        v.apply(log(KvMigrationOrdered(execution_id=action.execution_id, from_cell=action.from_cell,
                                       to_cell=action.to_cell, policy=mode)))
        v.apply(log(KvMigrated(execution_id=action.execution_id, from_cell=action.from_cell,
                               to_cell=action.to_cell, tokens=1, bytes=1, seconds=0.01, method="kv")))
        return
    was = v.cells[action.cell_id].role
    v.apply(log(CellAssigned(cell_id=action.cell_id, role=action.role, policy=mode)))
    if was is not Role.IDLE:
        v.apply(log(CellDraining(cell_id=action.cell_id, from_role=was, live_sessions=0)))
        if was is Role.ROLLOUT:
            left = sum(1 for e in v.snapshot(float(log.t)).live if e.cell_id == action.cell_id)
            v.apply(log(drained(action.cell_id, parked=left)))
        v.apply(log(CellReleased(cell_id=action.cell_id, from_role=was, migrated_sessions=0, seconds=0.1)))
    v.apply(log(CellReady(cell_id=action.cell_id, role=action.role, switch_seconds=0.1)))


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["async", "colocate", "elastic"]),
    cells=st.integers(2, 4),
    staleness=st.integers(0, 2),
    script=st.lists(st.sampled_from(["tick", "finish", "step"]), min_size=1, max_size=40),
)
def test_a_simulated_run_dispatches_each_query_once_within_the_bound(mode, cells, staleness, script) -> None:
    """Drive the real policy on the fold, with the workers' reports folded back: every decision passes the
    invariant checker, each planned query is dispatched at most once, never beyond the staleness bound, the
    live count matches the log, and no session is left migrating once every move and drain has reported."""
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
                if isinstance(a, AssignCell | MigrateSession):
                    carry_out(v, log, a, mode)
                elif isinstance(a, DispatchQuery):
                    n = p.number_of(a.query_id)
                    assert n is not None
                    data = p.dispatch(n, policy_version=a.policy_version, placements=a.placements)
                    dispatched.append((data.step, v.policy_version))
                    v.apply(log(data))
                    # The fold holds each session where the policy placed it (the router follows that).
                    by_key = v.sessions.by_key
                    assert tuple(by_key[(a.query_id, i)].cell_id for i in range(p.group_size)) == a.placements
            assert not any(e.migrating for e in v.snapshot(float(log.t)).live)
        elif op == "finish" and v.sessions:
            key = min(v.sessions.by_key)
            v.apply(log(ExecutionFinished(execution_id=v.sessions.by_key[key].execution_id, elapsed_s=1, calls=1)))
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


def test_the_trainers_wait_for_its_batch_is_measured_per_execution_it_waited_for() -> None:
    """What the peer policy's gate goes on: seconds a ready train cell waited for its incomplete batch, divided by
    the executions of that batch that ended while it waited. A rollout-only run measures nothing."""
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    v.apply(log(ExecutionFinished(execution_id=eid(0, 0), elapsed_s=1, calls=1)))
    assert (v.wait_s, v.samples_waited, v.snapshot(0).trainer.sample_wait_s) == (0.0, 0, 0.0)
    ready_cells(v, log, {"c1": "train"})  # ready at second 6
    v.apply(log(v.plan.dispatch(1, policy_version=0, placements=("c0", "c0"))))  # 7
    v.apply(log(ExecutionFinished(execution_id=eid(0, 1), elapsed_s=1, calls=1)))  # 8
    v.apply(log(ExecutionFinished(execution_id=eid(1, 0), elapsed_s=1, calls=1)))  # 9
    v.apply(log(ExecutionFinished(execution_id=eid(1, 1), elapsed_s=1, calls=1)))  # 10: the batch is complete
    assert v.samples_waited == 3 and v.wait_s == 4.0
    assert v.snapshot(10).trainer.sample_wait_s == pytest.approx(4.0 / 3)
    v.apply(log(ExecutionFinished(execution_id="someone-else", elapsed_s=1, calls=1)))
    assert v.wait_s == 4.0, "no wait while the batch is complete"
