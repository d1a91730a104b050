"""Routing rules (pure): the one least-loaded order, used by the router for new sessions and by a draining
worker for where its sessions go; where a new session goes; how much of a prompt a worker already holds."""

from __future__ import annotations

import numpy as np

from services.rollout.routing import SessionMirror, choose_worker, least_loaded
from shared.worker_status import WorkerStatus


def status(worker_id: str, *, live: int = 0, capacity: int = 4, in_flight: int = 0, state: str = "active",
           cell: str | None = None) -> WorkerStatus:
    return WorkerStatus(worker_id=worker_id, cell_id=cell or f"cell-{worker_id}", state=state,  # type: ignore[arg-type]
                        live_sessions=live, capacity=capacity, in_flight=in_flight, policy_version=0,
                        max_model_len=1024)


def test_least_loaded_goes_by_sessions_per_capacity_then_calls_in_flight_then_id() -> None:
    assert least_loaded([status("a", live=2, capacity=4), status("b", live=3, capacity=8)]).worker_id == "b"
    assert least_loaded([status("a", live=1, in_flight=3), status("b", live=1, in_flight=1)]).worker_id == "b"
    assert least_loaded([status("b", live=1), status("a", live=1)]).worker_id == "a"
    assert least_loaded([]) is None
    # Sessions placed since the last heartbeat count when the heartbeat lags behind them.
    assert least_loaded([status("a"), status("b", live=1)], {"a": 2}).worker_id == "b"


def test_a_new_session_goes_to_its_preferred_cell_with_room_else_the_least_loaded_active_worker() -> None:
    live = [status("a", live=1), status("b", live=3, cell="cell-x"), status("c", state="draining")]
    assert choose_worker(live, placed={}, preferred_cell="cell-x").worker_id == "b"
    assert choose_worker(live, placed={"b": 4}, preferred_cell="cell-x").worker_id == "a"  # full by now
    assert choose_worker(live, placed={}, exclude={"a"}).worker_id == "b"
    assert choose_worker(live, placed={"a": 4, "b": 4}) is None


def test_a_worker_in_standby_takes_no_new_session_and_no_migrated_one() -> None:
    from services.rollout.routing import migration_target

    live = [status("s", state="standby", cell="cell-x"), status("a", live=3)]
    assert choose_worker(live, placed={}, preferred_cell="cell-x").worker_id == "a"
    assert choose_worker(live, placed={"a": 4}, preferred_cell="cell-x") is None
    assert migration_target(live, preferred=("s",)).worker_id == "a"
    assert migration_target(live, preferred=("s",), only_preferred=True) is None


def test_only_what_the_worker_does_not_hold_is_sent_and_at_least_one_token() -> None:
    mirror = SessionMirror("w", np.arange(10, dtype=np.int32), np.arange(100, 105, dtype=np.int32))
    assert mirror.delta_base(np.concatenate([np.arange(10), np.arange(100, 105), [7]]).astype(np.int32)) == 15
    assert mirror.delta_base(np.concatenate([np.arange(10), [100, 101]]).astype(np.int32)) == 11  # all held
    assert mirror.delta_base(np.array([0, 1, 9], dtype=np.int32)) == 2


def test_a_moved_session_follows_its_executions_other_chains_else_goes_to_the_least_loaded_preferred_peer() -> None:
    from services.rollout.routing import migration_target

    peers = [status("a"), status("b", live=2), status("c", live=3), status("d", state="draining")]
    assert migration_target(peers).worker_id == "a"
    assert migration_target(peers, follow="c").worker_id == "c"  # its first chain went there
    assert migration_target(peers, preferred=("b", "c")).worker_id == "b"
    assert migration_target(peers, preferred=("d",)).worker_id == "a"  # not active: any active peer
    assert migration_target(peers, preferred=("d",), only_preferred=True) is None
    assert migration_target(peers, refused={"a", "b", "c"}) is None
