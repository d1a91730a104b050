"""Unit and property tests of the pure scheduling policies (elastic, async, colocate)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from .sched_strategies import RESERVE, snapshots

from services.scheduler.policies import (
    AssignCell,
    AsyncPolicy,
    CellState,
    CellView,
    ColocatePolicy,
    DispatchQuery,
    ElasticPolicy,
    ElasticTiming,
    LiveExecution,
    MigrateSession,
    Outcome,
    PolicyViolation,
    QueuedQuery,
    Role,
    Snapshot,
    TrainerView,
    apply_actions,
    make_policy,
)

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def snap(
    cells: list[CellView],
    live: list[LiveExecution] = (),  # type: ignore[assignment]
    queued: int = 0,
    *,
    group: int = 2,
    version: int = 0,
    dispatched: int = 0,
    k: int = 1,
    backlog: int = 0,
    complete: bool = False,
    now: float = 10_000.0,
    budget: int | None = None,
) -> Snapshot:
    return Snapshot(
        now_s=now,
        cells=tuple(cells),
        live=tuple(live),
        queued=tuple(QueuedQuery(f"q{dispatched + i}", group) for i in range(queued)),
        finished_untrained=(),
        trainer=TrainerView(version, backlog, complete, steps_total=100, tokens_per_cell_s=100.0),
        max_staleness=k,
        budget_cells=budget if budget is not None else len(cells),
        batch_queries=1,
        queries_dispatched=dispatched,
        session_kv_reserve_tokens=RESERVE,
    )


def cell(i: int, role: Role, slots: int = 4, state: CellState = CellState.ACTIVE) -> CellView:
    return CellView(f"c{i}", role, state, RESERVE * slots, 0.0)


def session(i: int, cell_id: str, kv: int = RESERVE, batch: int = 0) -> LiveExecution:
    return LiveExecution(f"e{i}", f"old{i}", cell_id, kv, kv, 0, batch)


# ---------------------------------------------------------------- properties over random snapshots


def check(policy: object, snapshot: Snapshot) -> Outcome:
    actions = policy.decide(snapshot)  # type: ignore[attr-defined]
    # apply_actions raises on: unknown ids, migrations into missing room or off rollout, a cell
    # leaving rollout with sessions not migrated, more cells in a role than the budget, a dispatch
    # beyond the staleness bound or at the wrong version, a group not fully placed.
    return apply_actions(snapshot, actions, allow_parking=policy.allows_parking)  # type: ignore[attr-defined]


@PROPS
@given(snapshots())
def test_elastic_never_kills_sessions_nor_breaks_budget_or_staleness(s: Snapshot) -> None:
    outcome = check(ElasticPolicy(), s)
    assert not outcome.parked
    for e in s.live:
        dest = outcome.cell_of[e.execution_id]
        assert outcome.roles[dest] is Role.ROLLOUT, f"{e.execution_id} ended on a {outcome.roles[dest]} cell"


@PROPS
@given(snapshots())
def test_async_never_moves_a_cell_that_holds_sessions(s: Snapshot) -> None:
    if s.budget_cells < 2:
        return
    policy = AsyncPolicy(rollout_cells=max(1, s.budget_cells // 2))
    outcome = check(policy, s)
    assert not outcome.parked
    assert not any(isinstance(a, MigrateSession) for a in policy.decide(s))


@PROPS
@given(snapshots(parked=True))
def test_colocate_parks_sessions_but_never_drops_them(s: Snapshot) -> None:
    outcome = check(ColocatePolicy(), s)
    assert set(outcome.cell_of) == {e.execution_id for e in s.live}
    for eid in outcome.parked:
        assert outcome.roles[outcome.cell_of[eid]] is Role.TRAIN


@PROPS
@given(snapshots())
def test_every_policy_decides_deterministically(s: Snapshot) -> None:
    for policy in (ElasticPolicy(), ColocatePolicy(), AsyncPolicy(rollout_cells=1)):
        if isinstance(policy, AsyncPolicy) and s.budget_cells < 2:
            continue
        assert policy.decide(s) == policy.decide(s)


def idle_cells_while_work_waits(policy: ElasticPolicy, s: Snapshot, outcome: Outcome) -> list[str]:
    """Cells that end the decision idle although work is waiting that they could take.

    Rollout work that waits = sessions the staleness bound lets start, not started, and not covered
    by the free room of rollout cells plus cells already switching into rollout. Training work that
    waits = a backlog. Cells inside their hysteresis dwell are exempt (the policy's stated rule).
    """
    cells = s.cells_by_id()
    room_q = s.queued[: s.dispatch_room()]
    waiting = sum(q.group_size for q in room_q[outcome.dispatched :])
    limit = {c: int(cells[c].kv_capacity_tokens * policy.fill) for c in cells}
    incoming = 0
    for cid, role in outcome.roles.items():
        if role is Role.ROLLOUT and outcome.states[cid] is CellState.ACTIVE:
            incoming += max(0, limit[cid] - outcome.reserved[cid]) // RESERVE
        elif role is Role.ROLLOUT and outcome.states[cid] is CellState.SWITCHING:
            incoming += limit[cid] // RESERVE
    rollout_uncovered = waiting > incoming
    backlog = s.trainer.backlog_tokens > 0
    occupied = set(outcome.cell_of.values()) | set(outcome.placed)
    in_budget = sum(1 for r in outcome.roles.values() if r is not Role.IDLE)
    bad = []
    for cid, role in outcome.roles.items():
        state = outcome.states[cid]
        dwelling = s.now_s - cells[cid].role_since_s < policy.min_dwell_s and role is cells[cid].role
        if state is CellState.SWITCHING or dwelling:
            continue
        if role is Role.IDLE and in_budget < s.budget_cells and (rollout_uncovered or backlog):
            bad.append(f"{cid} unassigned")
        if role is Role.TRAIN and not backlog and rollout_uncovered:
            bad.append(f"{cid} trains nothing while {waiting} sessions wait")
        if role is Role.ROLLOUT and state is CellState.ACTIVE and cid not in occupied and backlog and waiting == 0:
            bad.append(f"{cid} empty rollout cell while the trainer has a backlog")
    return bad


@PROPS
@given(snapshots())
def test_elastic_leaves_no_cell_idle_while_work_it_could_take_waits(s: Snapshot) -> None:
    policy = ElasticPolicy()
    outcome = check(policy, s)
    assert idle_cells_while_work_waits(policy, s, outcome) == []


# ---------------------------------------------------------------- scenarios


def test_elastic_consolidates_tail_sessions_and_hands_freed_cells_to_training() -> None:
    # Four rollout cells each hold one straggler; the batch is complete, so training is critical.
    # A cell has room for 5 average sessions; packed to 90% it takes 4.
    cells = [cell(i, Role.ROLLOUT, slots=5) for i in range(4)] + [cell(4, Role.TRAIN)]
    live = [session(i, f"c{i}", batch=1) for i in range(4)]
    s = snap(cells, live, backlog=10**7, complete=True)
    actions = ElasticPolicy().decide(s)
    outcome = apply_actions(s, actions, allow_parking=False)
    hosts = {outcome.cell_of[e.execution_id] for e in live}
    assert len(hosts) == 1, "four stragglers fit on one cell within KV capacity"
    assert sum(1 for r in outcome.roles.values() if r is Role.TRAIN) == 4
    assert all(isinstance(a, MigrateSession | AssignCell) for a in actions)


def test_elastic_consolidation_respects_kv_capacity() -> None:
    # Sessions reserve 2 of a cell's 4 slots each (pack limit 90%: one per cell), so nothing can merge.
    cells = [cell(i, Role.ROLLOUT) for i in range(3)] + [cell(3, Role.TRAIN)]
    live = [session(i, f"c{i}", kv=2 * RESERVE) for i in range(3)]
    s = snap(cells, live, backlog=10**7, complete=True)
    outcome = apply_actions(s, ElasticPolicy().decide(s), allow_parking=False)
    assert {outcome.cell_of[e.execution_id] for e in live} == {"c0", "c1", "c2"}


def test_elastic_takes_idle_train_cells_for_queries_that_do_not_fit() -> None:
    cells = [cell(0, Role.ROLLOUT, slots=2), cell(1, Role.TRAIN), cell(2, Role.TRAIN)]
    s = snap(cells, queued=3, group=2, k=2)
    actions = ElasticPolicy().decide(s)
    assert AssignCell("c1", Role.ROLLOUT) in actions
    dispatched = [a for a in actions if isinstance(a, DispatchQuery)]
    assert len(dispatched) == 0, "c0 holds 1 session at 90% fill, a group needs 2"


def test_elastic_respects_staleness_bound() -> None:
    cells = [cell(i, Role.ROLLOUT, slots=8) for i in range(4)]
    # Version 0, k = 1, B = 1: queries for batches 0 and 1 may start, i.e. two, and one already has.
    s = snap(cells, queued=5, group=1, dispatched=1, k=1)
    dispatched = [a for a in ElasticPolicy().decide(s) if isinstance(a, DispatchQuery)]
    assert [a.query_id for a in dispatched] == ["q1"]


def test_elastic_does_not_move_a_cell_inside_its_dwell_time() -> None:
    fresh = CellView("c1", Role.ROLLOUT, CellState.ACTIVE, RESERVE * 4, role_since_s=9_990.0)
    cells = [cell(0, Role.ROLLOUT), fresh, cell(2, Role.TRAIN)]
    live = [session(0, "c0", batch=1), session(1, "c1", batch=1)]
    s = snap(cells, live, backlog=10**7, complete=True, now=10_000.0)
    outcome = apply_actions(s, ElasticPolicy().decide(s), allow_parking=False)
    assert outcome.roles["c1"] is Role.ROLLOUT


def test_elastic_timing_scales_the_dwell_to_the_run() -> None:
    """The same cell, 10 s in its role: the default dwell (minutes) keeps it; a run of seconds-long steps
    (`GYRE_SCHEDULER_ELASTIC_MIN_DWELL_S`, as `gyre run` sets it) moves it."""
    fresh = CellView("c1", Role.ROLLOUT, CellState.ACTIVE, RESERVE * 4, role_since_s=9_990.0)
    cells = [cell(0, Role.ROLLOUT, slots=8), fresh, cell(2, Role.TRAIN)]
    live = [session(0, "c0", batch=1), session(1, "c0", batch=1), session(2, "c0", batch=1), session(3, "c1", batch=1)]
    s = snap(cells, live, backlog=10**7, complete=True, now=10_000.0)
    assert apply_actions(s, ElasticPolicy().decide(s), allow_parking=False).roles["c1"] is Role.ROLLOUT
    scaled = make_policy("elastic", budget_cells=3, elastic_timing=ElasticTiming(min_dwell_s=5.0))
    assert isinstance(scaled, ElasticPolicy) and scaled.min_dwell_s == 5.0
    outcome = apply_actions(s, scaled.decide(s), allow_parking=False)
    assert outcome.roles["c1"] is Role.TRAIN


def test_elastic_skips_a_consolidation_that_costs_more_than_it_buys() -> None:
    # 1 token of backlog and no session of the current batch: moving a session cannot pay back.
    cells = [cell(0, Role.ROLLOUT), cell(1, Role.ROLLOUT), cell(2, Role.TRAIN)]
    live = [session(0, "c0", batch=3), session(1, "c1", batch=3)]
    s = snap(cells, live, backlog=1, complete=True, k=3)
    actions = ElasticPolicy().decide(s)
    assert not any(isinstance(a, MigrateSession) for a in actions)


def test_colocate_turns_the_whole_pool_to_training_when_the_batch_is_complete() -> None:
    cells = [cell(i, Role.ROLLOUT) for i in range(3)]
    live = [session(0, "c0", batch=1)]
    s = snap(cells, live, backlog=100, complete=True)
    actions = ColocatePolicy().decide(s)
    assert actions == [AssignCell(f"c{i}", Role.TRAIN) for i in range(3)]
    assert apply_actions(s, actions, allow_parking=True).parked == {"e0"}


def test_async_keeps_its_split() -> None:
    cells = [cell(i, Role.IDLE) for i in range(4)]
    s = snap(cells, queued=1)
    actions = AsyncPolicy(rollout_cells=1).decide(s)
    assert [a for a in actions if isinstance(a, AssignCell)] == [
        AssignCell("c0", Role.ROLLOUT),
        AssignCell("c1", Role.TRAIN),
        AssignCell("c2", Role.TRAIN),
        AssignCell("c3", Role.TRAIN),
    ]


@pytest.mark.parametrize("policy", [AsyncPolicy(rollout_cells=1), ColocatePolicy()], ids=["async", "colocate"])
def test_a_cell_registering_late_does_not_push_the_fixed_pool_past_its_budget(policy: object) -> None:
    """c1 registered after c0 and c2 took the budget's two roles; it sorts between them by id."""
    cells = [cell(0, Role.ROLLOUT), cell(1, Role.IDLE), cell(2, Role.TRAIN)]
    s = snap(cells, queued=1, budget=2)
    outcome = check(policy, s)  # raises if the decision asks for more roles than the budget
    assert outcome.roles["c1"] is Role.IDLE


def test_checker_rejects_a_train_assignment_that_would_kill_a_session() -> None:
    cells = [cell(0, Role.ROLLOUT), cell(1, Role.TRAIN)]
    s = snap(cells, [session(0, "c0")])
    with pytest.raises(PolicyViolation, match="must be migrated first"):
        apply_actions(s, [AssignCell("c0", Role.TRAIN)], allow_parking=False)


def test_checker_rejects_a_dispatch_beyond_the_staleness_bound() -> None:
    cells = [cell(0, Role.ROLLOUT, slots=8)]
    s = snap(cells, queued=2, group=1, dispatched=2, k=1)
    with pytest.raises(PolicyViolation, match="beyond staleness bound"):
        apply_actions(s, [DispatchQuery("q2", 0, ("c0",))], allow_parking=False)


def test_checker_rejects_more_cells_than_the_budget() -> None:
    cells = [cell(0, Role.ROLLOUT), cell(1, Role.IDLE)]
    s = snap(cells, budget=1)
    with pytest.raises(PolicyViolation, match="budget"):
        apply_actions(s, [AssignCell("c1", Role.TRAIN)], allow_parking=False)


def test_make_policy_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="expected a policy"):
        make_policy("round-robin", budget_cells=4)


def test_elastic_sends_an_empty_rollout_cell_to_training_when_a_backlog_waits() -> None:
    # One session keeps c0 busy; c1 and c2 are empty and long past their dwell; the trainer has work
    # that one train cell clears in time, so only work conservation moves them.
    cells = [cell(0, Role.ROLLOUT), cell(1, Role.ROLLOUT), cell(2, Role.ROLLOUT), cell(3, Role.TRAIN)]
    s = snap(cells, [session(0, "c0", batch=0)], backlog=1_000)
    outcome = apply_actions(s, ElasticPolicy().decide(s), allow_parking=False)
    assert idle_cells_while_work_waits(ElasticPolicy(), s, outcome) == []
    assert outcome.roles["c0"] is Role.ROLLOUT


# ---------------------------------------------------------------- the peer policy's options


def peer(gate: str = "step") -> ElasticPolicy:
    return ElasticPolicy(transfer="recompute", gate=gate)  # type: ignore[arg-type]


@PROPS
@given(snapshots())
def test_the_peer_policy_never_kills_sessions_and_moves_them_only_by_recompute(s: Snapshot) -> None:
    policy = make_policy("reprefill", budget_cells=s.budget_cells)
    outcome = check(policy, s)
    assert not outcome.parked
    moves = [a for a in policy.decide(s) if isinstance(a, MigrateSession)]
    assert all(m.method == "recompute" for m in moves)
    assert all(m.method == "kv" for m in ElasticPolicy().decide(s) if isinstance(m, MigrateSession))


def with_wait(s: Snapshot, wait_s: float) -> Snapshot:
    from dataclasses import replace

    return replace(s, trainer=replace(s.trainer, sample_wait_s=wait_s))


def test_the_step_gate_returns_train_cells_to_rollout_only_when_the_wait_saved_outweighs_the_round_trip() -> None:
    # A query of 2 waits for room that only the train cells can give; the batch the trainer waits for (version 0,
    # one query a batch) still has its two sessions running on c0.
    cells = [cell(0, Role.ROLLOUT, slots=2), cell(1, Role.TRAIN), cell(2, Role.TRAIN)]
    live = [session(0, "c0", batch=0), session(1, "c0", batch=0)]
    s = snap(cells, live, queued=1, group=2, k=1, dispatched=1)
    # 2 unfinished × wait × the train pool's share 2/3 against 8.52 + 3.46 s: 8.9 s a sample is too little, 9.1 enough.
    assert not any(isinstance(a, AssignCell) and a.role is Role.ROLLOUT for a in peer().decide(with_wait(s, 8.9)))
    assert AssignCell("c1", Role.ROLLOUT) in peer().decide(with_wait(s, 9.1))
    assert AssignCell("c1", Role.ROLLOUT) in peer().decide(s), "no measured wait yet: the gate is open"
    assert AssignCell("c1", Role.ROLLOUT) in ElasticPolicy(transfer="recompute").decide(with_wait(s, 8.9))


def test_the_step_gate_keeps_train_cells_once_the_batch_is_complete() -> None:
    cells = [cell(0, Role.ROLLOUT, slots=2), cell(1, Role.TRAIN), cell(2, Role.TRAIN)]
    s = snap(cells, [session(0, "c0", batch=1), session(1, "c0", batch=1)], queued=1, group=2, k=1, dispatched=1,
             backlog=10**6, complete=True)
    assert not any(isinstance(a, AssignCell) and a.role is Role.ROLLOUT for a in peer().decide(with_wait(s, 1e6)))


def test_the_step_gate_consolidates_whatever_the_payback() -> None:
    # The scenario elastic's payback test refuses (1 token of backlog): verl hands cells to the trainer whenever
    # it wants them, and pays the recompute.
    cells = [cell(0, Role.ROLLOUT), cell(1, Role.ROLLOUT), cell(2, Role.TRAIN)]
    live = [session(0, "c0", batch=3), session(1, "c1", batch=3)]
    s = snap(cells, live, backlog=1, complete=True, k=3)
    moves = [a for a in peer().decide(s) if isinstance(a, MigrateSession)]
    assert moves and all(m.method == "recompute" for m in moves)
