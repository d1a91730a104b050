"""The membership fold and the group decision (pure): which cells' ranks train, from the cells' own events."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.membership import CellView, Member, candidates, decide, fold_stream
from shared.cells import Role
from shared.events import (
    CellAssigned,
    CellDrained,
    CellDraining,
    CellReleased,
    CellReady,
    Event,
    EventData,
    RankReady,
    new_event,
)

T0 = datetime(2026, 12, 1, tzinfo=UTC)


class Stream:
    """One cell's stream, written the way the scheduler, the agent, the rank and the coordinator write it."""

    def __init__(self, cell_id: str = "n-cell0") -> None:
        self.cell_id = cell_id
        self.events: list[Event] = []

    def add(self, data: EventData, cause: Event | None = None) -> Event:
        event = new_event(data, run_id="r", stream_id=f"cell-{self.cell_id}", version=len(self.events) + 1,
                          occurred_at=T0, causation_id=cause.event_id if cause else None)
        self.events.append(event)
        return event

    def assign(self, role: Role) -> Event:
        return self.add(CellAssigned(cell_id=self.cell_id, role=role, policy="p"))

    def draining(self, from_role: Role) -> Event:
        return self.add(CellDraining(cell_id=self.cell_id, from_role=from_role))

    def released(self, from_role: Role) -> Event:
        return self.add(CellReleased(cell_id=self.cell_id, from_role=from_role, migrated_sessions=0, seconds=0.0))

    def drained(self, cause: Event) -> Event:
        return self.add(CellDrained(cell_id=self.cell_id, worker_id="w", migrated_sessions=0, parked_sessions=0,
                                    seconds=0.0), cause=cause)

    def rank_ready(self, rank_id: str = "rank-a") -> Event:
        return self.add(RankReady(cell_id=self.cell_id, rank_id=rank_id))

    @property
    def view(self) -> CellView:
        return fold_stream(self.cell_id, self.events)


def test_a_cell_assigned_to_train_from_idle_trains_once_its_rank_stands_by() -> None:
    s = Stream()
    s.assign(Role.TRAIN)
    assert s.view.trains and candidates([s.view], set()) == ()  # no rank process yet
    s.rank_ready("rank-a")
    assert candidates([s.view], set()) == (Member("n-cell0", "rank-a"),)


def test_a_rollout_cell_joins_only_after_its_release() -> None:
    s = Stream()
    s.rank_ready()  # the standby rank of a rollout cell
    s.assign(Role.ROLLOUT)
    s.add(CellReady(cell_id=s.cell_id, role=Role.ROLLOUT, switch_seconds=1.0))
    s.assign(Role.TRAIN)
    assert not s.view.trains, "the cell still serves rollouts"
    drain = s.draining(Role.ROLLOUT)
    s.drained(drain)
    assert not s.view.trains and s.view.drain is None, "a rollout drain is the worker's to answer"
    s.released(Role.ROLLOUT)
    assert s.view.trains


def test_an_order_away_from_train_takes_the_cell_out_and_its_drain_waits_for_the_coordinators_answer() -> None:
    s = Stream()
    s.assign(Role.TRAIN)
    s.rank_ready()
    s.assign(Role.ROLLOUT)
    assert not s.view.trains, "the latest order is no longer train: the rank leaves at the next boundary"
    assert s.view.holder is Role.TRAIN, "but the cell holds training until the agent drains and releases it"
    drain = s.draining(Role.TRAIN)
    assert not s.view.trains and s.view.drain == drain.event_id
    s.drained(drain)
    assert s.view.drain is None
    s.released(Role.TRAIN)
    assert not s.view.trains and s.view.holder is Role.ROLLOUT


def test_a_release_carries_out_the_switch_that_began_not_a_later_order() -> None:
    s = Stream()
    s.assign(Role.TRAIN)
    s.rank_ready()
    s.assign(Role.ROLLOUT)
    drain = s.draining(Role.TRAIN)
    s.assign(Role.TRAIN)  # the scheduler changes its mind while the cell drains
    s.drained(drain)
    s.released(Role.TRAIN)
    assert not s.view.trains, "the agent goes on to rollout first; training waits for that role's release"
    s.draining(Role.ROLLOUT)
    s.released(Role.ROLLOUT)
    assert s.view.trains


def test_an_order_back_before_any_drain_keeps_the_member() -> None:
    s = Stream()
    s.assign(Role.TRAIN)
    s.rank_ready()
    s.assign(Role.ROLLOUT)
    s.assign(Role.TRAIN)  # the agent never began the switch
    assert s.view.trains


def test_a_failed_rank_is_left_out_until_a_new_process_stands_by() -> None:
    s = Stream()
    s.assign(Role.TRAIN)
    s.rank_ready("rank-a")
    assert candidates([s.view], {"rank-a"}) == ()
    s.rank_ready("rank-b")  # the agent restarted it
    assert candidates([s.view], {"rank-a"}) == (Member("n-cell0", "rank-b"),)


def test_decide_reforms_on_any_change_and_says_why() -> None:
    a, b = Stream("n-cell0"), Stream("n-cell1")
    for s in (a, b):
        s.assign(Role.TRAIN)
        s.rank_ready(f"{s.cell_id}-r")
    both = (Member("n-cell0", "n-cell0-r"), Member("n-cell1", "n-cell1-r"))
    first = decide([a.view, b.view], set(), (), intact=True)
    assert first.reform and first.members == both and first.reason == "joined n-cell0, n-cell1"
    assert not decide([a.view, b.view], set(), both, intact=True).reform
    again = decide([a.view, b.view], set(), both, intact=False)
    assert again.reform and again.members == both and again.reason == "re-formed after a failed step"
    failed = decide([a.view, b.view], {"n-cell1-r"}, both, intact=False)
    assert failed.members == both[:1] and failed.reason == "failed n-cell1"
    drain = b.draining(Role.TRAIN)
    left = decide([a.view, b.view], set(), both, intact=True)
    assert left.members == both[:1] and left.reason == "left n-cell1"
    assert [(d.cell_id, d.draining_id, d.member) for d in left.drains] == [("n-cell1", drain.event_id, both[1])]


ACTIONS = st.lists(st.sampled_from(
    ["assign_train", "assign_rollout", "assign_idle", "drain_train", "drain_rollout", "release_train",
     "release_rollout", "answer", "rank", "rank2"]), max_size=25)


@settings(max_examples=300, deadline=None)
@given(ACTIONS)
def test_fold_invariants(actions: list[str]) -> None:
    """Whatever the order of facts: a member's latest order is train, no train drain is pending on it, a pending
    drain is only ever the latest draining from train, and folding is deterministic."""
    s = Stream()
    last_train_drain: uuid.UUID | None = None
    for action in actions:
        match action.split("_"):
            case ["assign", role]:
                s.assign(Role(role))
            case ["drain", role]:
                event = s.draining(Role(role))
                if role == "train":
                    last_train_drain = event.event_id
            case ["release", role]:
                s.released(Role(role))
            case ["answer"]:
                if s.view.drain is not None:
                    s.add(CellDrained(cell_id=s.cell_id, worker_id="w", migrated_sessions=0, parked_sessions=0,
                                      seconds=0.0), cause=next(e for e in s.events if e.event_id == s.view.drain))
            case [rank]:
                s.rank_ready(rank)
        view = s.view
        latest = next((e.data.role for e in reversed(s.events) if isinstance(e.data, CellAssigned)), None)
        if candidates([view], set()):
            assert latest is Role.TRAIN and view.drain is None and not view.leaving
        assert view.drain in (None, last_train_drain)
        assert fold_stream(s.cell_id, s.events) == view
