"""Which cell events a worker process acts on (pure): the drain that puts it to sleep, the release that wakes it,
and the publication it loads on waking."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from services.rollout.lifecycle import (
    drains_me,
    latest_assignment,
    newest_publication,
    release_while_starting,
    wakes_me,
)
from shared.cells import Role
from shared.events import (
    BlobRef,
    CellAssigned,
    CellDraining,
    CellReleased,
    Event,
    WeightsPublished,
    new_event,
)

T0 = datetime(2026, 12, 2, tzinfo=UTC)


def release(cell: str = "cell-1", from_role: str = "train") -> CellReleased:
    return CellReleased(cell_id=cell, from_role=from_role, migrated_sessions=0, seconds=0.1)  # type: ignore[arg-type]


def test_only_the_release_of_its_own_cell_to_rollout_after_it_slept_wakes_a_standby_worker() -> None:
    later, earlier = T0 + timedelta(seconds=1), T0 - timedelta(seconds=1)
    ok = {"cell_id": "cell-1", "asleep_since": T0, "state": "standby", "assigned": Role.ROLLOUT}
    assert wakes_me(release(), issued_at=later, **ok)
    assert wakes_me(release(from_role="idle"), issued_at=later, **ok)
    assert wakes_me(release(), issued_at=later, **{**ok, "assigned": None})  # a log with no scheduler in it
    # Its own drain's release (the way to training), another cell's, an older one, a worker that serves, or a
    # cell released on its way to idle.
    assert not wakes_me(release(from_role="rollout"), issued_at=later, **ok)
    assert not wakes_me(release(cell="cell-2"), issued_at=later, **ok)
    assert not wakes_me(release(), issued_at=earlier, **ok)
    assert not wakes_me(release(), issued_at=later, **{**ok, "state": "active"})
    assert not wakes_me(release(), issued_at=later, **{**ok, "assigned": Role.IDLE})


def _log(*data) -> list[Event]:
    return [new_event(d, run_id="r", stream_id="cell-1", version=i + 1, occurred_at=T0) for i, d in enumerate(data)]


def test_a_standby_start_wakes_for_a_release_to_rollout_it_missed_while_starting() -> None:
    def assigned(role: str) -> CellAssigned:
        return CellAssigned(cell_id="cell-1", role=role, policy="elastic")  # type: ignore[arg-type]

    to_rollout = _log(assigned("train"), assigned("rollout"), CellDraining(cell_id="cell-1", from_role="train"),
                      release())
    assert latest_assignment(to_rollout, "cell-1") is Role.ROLLOUT
    assert release_while_starting(to_rollout, "cell-1") is to_rollout[-1]
    # Still training, released on the way to idle, not yet released, or released and drained again since.
    assert release_while_starting(_log(assigned("train")), "cell-1") is None
    assert release_while_starting(_log(assigned("rollout"), assigned("idle"), release()), "cell-1") is None
    assert release_while_starting(to_rollout[:3], "cell-1") is None
    again = [*to_rollout, *_log(CellDraining(cell_id="cell-1", from_role="rollout"))]
    assert release_while_starting(again, "cell-1") is None
    assert release_while_starting([], "cell-1") is None and latest_assignment([], "cell-1") is None


def test_a_worker_drains_on_its_cells_rollout_drain_issued_after_it_started() -> None:
    order = CellDraining(cell_id="cell-1", from_role="rollout")
    assert drains_me(order, issued_at=T0, cell_id="cell-1", started_at=T0)
    assert not drains_me(order, issued_at=T0 - timedelta(seconds=5), cell_id="cell-1", started_at=T0)
    assert not drains_me(CellDraining(cell_id="cell-1", from_role="train"), issued_at=T0, cell_id="cell-1",
                         started_at=T0)


def test_a_waking_worker_loads_the_highest_published_version_whatever_the_order_it_was_logged_in() -> None:
    ref = BlobRef(digest="sha256:" + "0" * 64, size=1, media_type="application/x-safetensors")
    published = [WeightsPublished(version=v, step=v - 1, weights=ref) for v in (0, 3, 2)]
    newest = newest_publication(published)
    assert newest is not None and newest.version == 3
    assert newest_publication([]) is None
