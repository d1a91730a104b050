"""Where the fold holds each live session: where the policy placed it, then where the gateway's call records and
the workers' migration and drain reports say it is. Nothing is predicted."""

from __future__ import annotations

from datetime import timedelta

from services.scheduler.policies import Role, make_policy
from services.scheduler.policies.actions import AssignCell, apply_actions
from shared.events import (
    CellAssigned,
    CellDraining,
    CellReady,
    CellReleased,
    ExecutionFinished,
    ExecutionStarted,
    KvMigrated,
    KvMigrationOrdered,
    KvMigrationRefused,
    execution_id_for,
)

from .fold_log import T0, Log, call, drained, eid, ready_cells, registered, view


def where(v, at: float = 0.0) -> dict[str, tuple[str, bool]]:
    return {e.execution_id: (e.cell_id, e.migrating) for e in v.snapshot(at).live}


def moved(execution_id: str, src: str, dst: str, tokens: int = 5) -> KvMigrated:
    return KvMigrated(execution_id=execution_id, from_cell=src, to_cell=dst, tokens=tokens, bytes=50, seconds=0.1,
                      method="kv")


def test_sessions_are_named_by_the_harness_rule_before_the_harness_announces_them() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    assert [e.execution_id for e in v.snapshot(0).live] == [execution_id_for("r1-step0-q0", i) for i in (0, 1)]
    assert eid(0, 1) == "execution-r1-step0-q0-001"
    # The harness's start with the same id changes nothing; its end ends the session.
    v.apply(log(ExecutionStarted(execution_id=eid(0, 0), query_id="r1-step0-q0", task_id="a", group_size=2,
                                 sample_index=0, seed=1)))
    v.apply(log(ExecutionFinished(execution_id=eid(0, 0), elapsed_s=1, calls=1)))
    assert [e.execution_id for e in v.snapshot(0).live] == [eid(0, 1)]


def test_sessions_sit_where_the_policy_placed_them_then_where_their_calls_are_served() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c2", "c2"))))
    assert {e.cell_id for e in v.snapshot(0).live} == {"c2"}
    v.apply(log(call(eid(0, 1), "c0", 0)))
    assert where(v) == {eid(0, 0): ("c2", False), eid(0, 1): ("c0", False)}
    # c0 leaves rollout and its worker moves the session on; the call it served last is recorded after that
    # (gateway and worker write independently): the session does not go back to a cell that holds none.
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="elastic")))
    v.apply(log(moved(eid(0, 1), "c0", "c1")))
    v.apply(log(call(eid(0, 1), "c0", 1)))
    assert where(v) == {eid(0, 0): ("c2", False), eid(0, 1): ("c1", False)}


def test_without_placements_sessions_are_on_no_cell_until_their_first_call() -> None:
    """A dispatch without placements (an old log, a hand-written event): the router chose, so the fold waits for
    the gateway's record of a call to say where; until then the session holds KV on no cell."""
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0)))
    snap = v.snapshot(0)
    assert snap.live == () and v.sessions.unplaced() == 2 and len(v.sessions) == 2
    assert snap.queries_dispatched == 1
    v.apply(log(call(eid(0, 1), "c1", 0, prompt=30, completion=2)))
    assert where(v) == {eid(0, 1): ("c1", False)} and v.sessions.unplaced() == 1
    assert v.snapshot(0).live[0].kv_tokens == 32


def test_a_sessions_context_is_the_latest_call_of_each_of_its_chains() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    e0, e1 = eid(0, 0), eid(0, 1)
    v.apply(log(call(e0, "c0", 0, prompt=100, completion=20)))
    v.apply(log(call(e0, "c0", 1, prompt=150, completion=30)))
    v.apply(log(call(e0, "c0", 2, prompt=40, completion=5, chain="sub-1")))  # a delegation's chain
    v.apply(log(call(e0, "c0", 0, prompt=100, completion=20)))  # a duplicate of an older call
    live = {e.execution_id: e for e in v.snapshot(0).live}
    assert live[e0].context_tokens == 180 + 45
    assert live[e0].kv_tokens == 225  # KV in tokens, as cells register their capacity
    assert live[e1].context_tokens == 0  # no call yet
    # A session past its reserve reserves what it holds.
    snap = v.snapshot(0)
    assert snap.reserved_tokens(live[e0]) == 225 and snap.reserved_tokens(live[e1]) == 10


def test_a_leaving_cells_sessions_stay_on_it_migrating_until_the_worker_reports_where_each_went() -> None:
    """Between cell.assigned (out of rollout) and cell.drained, the worker chooses where each session goes; the
    fold learns it from each kv.migrated, and the ones the worker kept stay parked once the drain ends."""
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c1", "c1"))))
    v.apply(log(v.plan.dispatch(1, policy_version=0, placements=("c0", "c2"))))
    v.apply(log(CellAssigned(cell_id="c1", role="train", policy="elastic")))
    leaving = {eid(0, 0): ("c1", True), eid(0, 1): ("c1", True)}
    assert where(v) == {**leaving, eid(1, 0): ("c0", False), eid(1, 1): ("c2", False)}
    v.apply(log(CellDraining(cell_id="c1", from_role="rollout", live_sessions=2)))
    v.apply(log(moved(eid(0, 1), "c1", "c2")))  # the worker's choice, whatever the fold would have guessed
    assert where(v)[eid(0, 1)] == ("c2", False) and where(v)[eid(0, 0)] == ("c1", True)
    v.apply(log(drained("c1", migrated=1, parked=1)))
    assert where(v)[eid(0, 0)] == ("c1", False)  # kept by the worker: parked on the cell
    v.apply(log(CellReleased(cell_id="c1", from_role="rollout", migrated_sessions=1, seconds=1.0)))
    v.apply(log(CellReady(cell_id="c1", role="train", switch_seconds=1.0)))
    assert where(v)[eid(0, 0)] == ("c1", False)


def test_a_pool_with_no_rollout_cell_left_parks_its_sessions() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="colocate")))
    assert set(where(v).values()) == {("c0", True)}
    v.apply(log(drained("c0", parked=2)))
    assert set(where(v).values()) == {("c0", False)}
    # The pool comes back to rollout: its parked sessions are served there again.
    v.apply(log(CellAssigned(cell_id="c0", role="rollout", policy="colocate")))
    v.apply(log(CellReady(cell_id="c0", role="rollout", switch_seconds=1.0)))
    v.apply(log(call(eid(0, 0), "c0", 0)))
    assert set(where(v).values()) == {("c0", False)}


def test_a_drain_that_ends_without_a_report_parks_what_is_left_once_the_cell_is_released() -> None:
    """The agent stops a worker that did not report its drain in time (or that exited): nothing moves after
    cell.released, so the sessions still on the cell stay parked there. A restarted agent ends one too."""
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c1"))))
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="elastic")))
    v.apply(log(CellReleased(cell_id="c0", from_role="rollout", migrated_sessions=0, seconds=600.0)))
    assert where(v)[eid(0, 0)] == ("c0", False)
    v.apply(log(CellAssigned(cell_id="c1", role="train", policy="elastic")))
    assert where(v)[eid(0, 1)] == ("c1", True)
    v.apply(log(registered("c1")))  # its agent restarted mid-drain; the worker died with it
    assert where(v)[eid(0, 1)] == ("c1", False)


def test_sessions_leaving_a_cell_do_not_stop_the_policy_deciding() -> None:
    """While a drain runs, its sessions are neither moved again nor counted on a rollout cell; the checker
    accepts the decisions made meanwhile and after the drain parks what it could not move."""
    v, log = view(staleness=1), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="elastic")))
    policy = make_policy("elastic", budget_cells=3)
    for _ in range(2):
        snap = v.snapshot(float(log.t) + 400)
        actions = policy.decide(snap)
        apply_actions(snap, actions, allow_parking=False)
        assert not any(getattr(a, "execution_id", None) in (eid(0, 0), eid(0, 1)) for a in actions)
        assert AssignCell("c0", Role.ROLLOUT) not in actions  # a switching cell is left to finish its switch
        v.apply(log(drained("c0", parked=2)))
        v.apply(log(CellReady(cell_id="c0", role="train", switch_seconds=1.0)))


def test_an_ordered_move_shows_the_session_migrating_onto_its_target_until_the_worker_reports_it() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    e0, e1 = eid(0, 0), eid(0, 1)
    v.apply(log(KvMigrationOrdered(execution_id=e0, from_cell="c0", to_cell="c1", policy="elastic")))
    at = float(log.t)
    assert where(v, at)[e0] == ("c1", True) and where(v, at)[e1] == ("c0", False)
    # A call the source served before the move is recorded now: the move still stands.
    v.apply(log(call(e0, "c0", 0, prompt=10, completion=2)))
    assert where(v, at)[e0] == ("c1", True)
    v.apply(log(KvMigrated(execution_id=e0, from_cell="c0", to_cell="c1", tokens=12, bytes=0, seconds=0.1,
                           method="recompute")))
    # ... and one recorded after the worker's report does not send it back to the cell it left.
    v.apply(log(call(e0, "c0", 1, prompt=14, completion=2)))
    assert where(v, at)[e0] == ("c1", False)
    v.apply(log(call(e0, "c1", 2, prompt=18, completion=2)))
    assert where(v, at)[e0] == ("c1", False)


def test_an_ordered_move_nobody_reports_lapses_and_one_onto_a_cell_leaving_rollout_is_void() -> None:
    v, log = view(migration_timeout_s=60.0), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    e0, e1 = eid(0, 0), eid(0, 1)
    v.apply(log(KvMigrationOrdered(execution_id=e0, from_cell="c0", to_cell="c1", policy="elastic")))
    at = v.seconds_at(T0 + timedelta(seconds=log.t))  # the order's time on the snapshot's axis
    assert where(v, at + 59)[e0][1]
    # The worker could not move it (target refused, say): after the timeout it is where it was, to be decided again.
    assert where(v, at + 61)[e0] == ("c0", False)
    v.apply(log(KvMigrationOrdered(execution_id=e1, from_cell="c0", to_cell="c2", policy="elastic")))
    v.apply(log(CellAssigned(cell_id="c2", role="train", policy="elastic")))  # its target drains: it stays on c0
    assert where(v, float(log.t))[e1] == ("c0", False)
    # A move ordered off a cell that then leaves rollout shows the session migrating to its target (the worker
    # carries out orders it took); a session without a live order is leaving its cell, destination unknown.
    v.apply(log(KvMigrationOrdered(execution_id=e1, from_cell="c0", to_cell="c1", policy="elastic")))
    v.apply(log(CellAssigned(cell_id="c0", role="train", policy="elastic")))
    late = v.seconds_at(T0 + timedelta(seconds=log.t))
    assert where(v, late) == {e0: ("c1", True), e1: ("c1", True)}  # e0's order had not lapsed yet then
    assert where(v, late + 61) == {e0: ("c0", True), e1: ("c0", True)}  # both orders lapsed: leaving c0
    v.apply(log(KvMigrated(execution_id=e1, from_cell="c0", to_cell="c1", tokens=5, bytes=50, seconds=0.1,
                           method="recompute")))
    assert where(v, late)[e1] == ("c1", False)
    v.apply(log(drained("c0", migrated=1, parked=1)))
    assert where(v, late) == {e0: ("c0", False), e1: ("c1", False)}  # the pending order ended with the drain


def test_a_refused_move_is_settled_at_once_and_late_records_move_nothing_only_for_calls_in_flight() -> None:
    v, log = view(), Log()
    ready_cells(v, log, {"c0": "rollout", "c1": "rollout", "c2": "rollout"})
    v.apply(log(v.plan.dispatch(0, policy_version=0, placements=("c0", "c0"))))
    e = eid(0, 0)
    v.apply(log(KvMigrationOrdered(execution_id=e, from_cell="c0", to_cell="c1", policy="elastic")))
    v.apply(log(KvMigrationRefused(execution_id=e, from_cell="c0", to_cell="c1", reason="no session here")))
    # Settled at once: it stays on c0, held from the policies (shown migrating) until its next call, so the
    # refused move is not ordered again every tick.
    assert where(v)[e] == ("c0", True)
    for i in range(3):
        v.apply(log(call(e, "c0", i, prompt=10 + i, completion=1)))
    assert where(v)[e] == ("c0", False)  # its calls free it for the policies again
    v.apply(log(KvMigrated(execution_id=e, from_cell="c0", to_cell="c2", tokens=14, bytes=0, seconds=0.5,
                           method="recompute")))
    v.apply(log(call(e, "c0", 3, prompt=20, completion=1)))  # in flight when it moved, recorded after
    assert where(v)[e][0] == "c2"
    v.apply(log(call(e, "c0", 4, prompt=22, completion=1)))  # a later call there: it was placed there again
    assert where(v)[e][0] == "c0"
    # Migrations measured so far set the rate the policy prices moves at, in KV tokens per second.
    assert v.measured_switch_costs().migration_tokens_per_s == 28.0
