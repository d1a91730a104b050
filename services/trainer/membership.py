"""Who trains: a pure fold of each cell's stream into what the coordinator needs to know of it, and the decision of
the trainer group's members from those views and the group as it stands. No I/O, no clock: events in, data out.

A cell is a member candidate when its latest `cell.assigned` is `train`, the cell holds that role (it was free when
the order came, or its previous role released it since), nothing is draining it from training, and its rank process
stands by (a `trainer.rank_ready` whose process has not failed since). `cell.draining(from_role=train)` takes it
out at once; the coordinator answers it with `cell.drained` once the rank has left (`CellView.drain` until then).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from shared.cells import Role
from shared.events import CellAssigned, CellDrained, CellDraining, CellReleased, Event, RankReady

# The event types the fold reads (all on the cell's stream, `cell-<cell_id>`).
CELL_FACTS: tuple[str, ...] = ("cell.assigned", "cell.draining", "cell.released", "cell.drained", "trainer.rank_ready")


@dataclass(frozen=True)
class CellView:
    """One cell as the trainer sees it, after its stream up to some version."""

    cell_id: str
    assigned: Role | None = None  # the latest order
    holder: Role | None = None  # the role the cell serves, or is being brought into (None: free)
    leaving: bool = False  # a `cell.draining` without its `cell.released` yet
    switch_target: Role | None = None  # the order standing when the drain began: what the agent switches to
    rank_id: str | None = None  # the rank process that last said it stands by on the cell
    drain: uuid.UUID | None = None  # a `cell.draining(from_role=train)` no `cell.drained` has answered yet

    @property
    def trains(self) -> bool:
        """Ordered into training and holding the role (released from its previous one, or it was free), with no
        drain out of training left to answer (the coordinator answers it before it forms the next group)."""
        return self.assigned is Role.TRAIN and self.holder is Role.TRAIN and not self.leaving and self.drain is None


def _held(role: Role | None) -> Role | None:
    return None if role is None or role is Role.IDLE else role


def fold_cell(view: CellView, event: Event) -> CellView:
    """`view` after one more event of the cell's stream (events in stream-version order)."""
    match event.data:
        case CellAssigned(role=role):
            # A free cell takes the role at once (from idle nothing is drained first); a held one keeps its
            # role until the agent has drained and released it.
            holder = _held(role) if view.holder is None and not view.leaving else view.holder
            return replace(view, assigned=role, holder=holder)
        case CellDraining(from_role=from_role):
            drain = event.event_id if from_role is Role.TRAIN else view.drain
            return replace(view, leaving=True, switch_target=view.assigned, drain=drain)
        case CellReleased():
            # The agent carries out the switch it began: the order that stood at the drain, not a later one
            # (that one is a switch of its own, with its own drain).
            target = view.switch_target if view.leaving else view.assigned
            return replace(view, leaving=False, holder=_held(target), switch_target=None)
        case CellDrained() if view.drain is not None and event.causation_id == view.drain:
            return replace(view, drain=None)
        case RankReady(rank_id=rank_id):
            return replace(view, rank_id=rank_id)
        case _:
            return view


def fold_stream(cell_id: str, events: Iterable[Event]) -> CellView:
    view = CellView(cell_id)
    for event in events:
        view = fold_cell(view, event)
    return view


@dataclass(frozen=True, order=True)
class Member:
    """A group member: the cell and the rank process on it (a restarted process is another member)."""

    cell_id: str
    rank_id: str


@dataclass(frozen=True)
class DrainOrder:
    """A `cell.draining(from_role=train)` to answer: `member` is the rank to let go first (None: not in the group)."""

    cell_id: str
    draining_id: uuid.UUID
    member: Member | None


@dataclass(frozen=True)
class Decision:
    members: tuple[Member, ...]  # in rank order
    reform: bool  # the group must (re-)form with `members` before the next step
    reason: str
    drains: tuple[DrainOrder, ...]


def candidates(cells: Iterable[CellView], failed: AbstractSet[str]) -> tuple[Member, ...]:
    """The members the cells ask for, in rank order (by cell id, so the same cells give the same ranks)."""
    return tuple(sorted(
        Member(c.cell_id, c.rank_id) for c in cells if c.trains and c.rank_id is not None and c.rank_id not in failed
    ))


def decide(
    cells: Sequence[CellView], failed: AbstractSet[str], current: Sequence[Member], intact: bool
) -> Decision:
    """The group to have before the next step, from the cells' views, the rank processes known to have failed, the
    group's current members and whether it is intact (False after a member left or a step failed in it)."""
    want = candidates(cells, failed)
    now = tuple(current)
    in_group = {m.cell_id: m for m in now}
    drains = tuple(
        DrainOrder(c.cell_id, c.drain, in_group.get(c.cell_id)) for c in sorted(cells, key=lambda c: c.cell_id)
        if c.drain is not None
    )
    if want == now and intact:
        return Decision(want, reform=False, reason="", drains=drains)
    return Decision(want, reform=True, reason=_reason(want, now, failed), drains=drains)


def _reason(want: tuple[Member, ...], now: tuple[Member, ...], failed: AbstractSet[str]) -> str:
    kept = set(want) & set(now)
    joined = [m.cell_id for m in want if m not in kept]
    gone_failed = [m.cell_id for m in now if m not in kept and m.rank_id in failed]
    left = [m.cell_id for m in now if m not in kept and m.rank_id not in failed]
    parts = [f"{what} {', '.join(cells)}" for what, cells in
             (("joined", joined), ("left", left), ("failed", gone_failed)) if cells]
    return "; ".join(parts) or "re-formed after a failed step"


__all__ = [
    "CELL_FACTS",
    "CellView",
    "Decision",
    "DrainOrder",
    "Member",
    "candidates",
    "decide",
    "fold_cell",
    "fold_stream",
]
