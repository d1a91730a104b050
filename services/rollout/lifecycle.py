"""Which cell events a rollout worker process acts on, and which publication it loads when it wakes (pure).

A worker is `active` (serves), `draining` (moves its sessions away), or in `standby` (engine asleep while its cell
serves another role). A rollout drain of its cell puts it to sleep; the release of its cell from another role,
once the cell is assigned to rollout, wakes it. The per-worker durable consumer outlives a process, so a process
also gets the orders its cell received before it began: those are not for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from shared.cells import Role
from shared.events import (
    CellAssigned,
    CellDraining,
    CellReleased,
    Event,
    KvMigrationOrdered,
    WeightsPublished,
)
from shared.worker_status import WorkerState


def drains_me(order: CellDraining, *, issued_at: datetime, cell_id: str, started_at: datetime) -> bool:
    """A drain order for this worker: its cell, leaving the rollout role, issued after this process began (the
    cell agent issuing it runs on the same node, so the clocks agree). The order for leaving the train role is
    the trainer's."""
    return order.cell_id == cell_id and order.from_role is Role.ROLLOUT and issued_at >= started_at


def wakes_me(release: CellReleased, *, issued_at: datetime, cell_id: str, asleep_since: datetime,
             state: WorkerState, assigned: Role | None) -> bool:
    """A release that wakes this worker: its cell, let go by another role (train, idle), while it stands by,
    issued after it went to sleep (its process start, or the drain order it slept after: an older release,
    redelivered, is not this standby's end), and the cell's latest assignment (`assigned`; None when its log has
    none, as in a run without a scheduler) is rollout: a cell released on its way to idle stays asleep. The
    release that follows its own drain (from rollout) is the way to training."""
    return (release.cell_id == cell_id and release.from_role is not Role.ROLLOUT and issued_at >= asleep_since
            and state == "standby" and assigned in (Role.ROLLOUT, None))


def latest_assignment(cell_log: Iterable[Event], cell_id: str) -> Role | None:
    """The role the cell's latest `cell.assigned` gives it (None when there is none)."""
    role: Role | None = None
    for event in cell_log:
        if isinstance(event.data, CellAssigned) and event.data.cell_id == cell_id:
            role = event.data.role
    return role


def release_while_starting(cell_log: Sequence[Event], cell_id: str) -> Event | None:
    """The release a worker that starts in standby missed: its cell's log ends with the cell assigned to rollout
    and released by its other role after that assignment (the cell agent released it while this process was
    still importing and building its engine, before it could hear of it). None when the cell is not waiting for
    a rollout worker."""
    pending: Event | None = None
    for event in cell_log:
        data = event.data
        if isinstance(data, CellAssigned) and data.cell_id == cell_id:
            pending = None
        elif isinstance(data, CellReleased) and data.cell_id == cell_id and data.from_role is not Role.ROLLOUT:
            pending = event
        elif isinstance(data, CellDraining) and data.cell_id == cell_id:
            pending = None
    return pending if latest_assignment(cell_log, cell_id) is Role.ROLLOUT else None


def orders_me(order: KvMigrationOrdered, *, cell_id: str) -> bool:
    """A session move ordered off this worker's cell. Unlike a drain it is not dated against the process's start
    (the scheduler's clock is another node's): an order meant for an earlier worker on the cell names sessions
    this one does not hold, and the worker moves only sessions it holds."""
    return order.from_cell == cell_id


def newest_publication(published: Iterable[WeightsPublished]) -> WeightsPublished | None:
    """The publication a waking worker loads: the highest version (the log's order is the trainer's, but a
    version is what a worker compares)."""
    return max(published, key=lambda p: p.version, default=None)


__all__ = ["drains_me", "latest_assignment", "newest_publication", "orders_me", "release_while_starting", "wakes_me"]
