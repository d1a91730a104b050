"""The policy interface and the placement arithmetic every policy shares (KV room, dispatch)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.policies.actions import Action, DispatchQuery
from services.scheduler.policies.snapshot import CellState, CellView, Snapshot
from shared.cells import Role


class Policy(Protocol):
    """A scheduling policy: a pure function of the snapshot."""

    @property
    def name(self) -> str: ...

    @property
    def allows_parking(self) -> bool:
        """True only for colocate, whose train phase parks live sessions in place."""
        ...

    def decide(self, snapshot: Snapshot) -> list[Action]: ...


@dataclass(slots=True)
class Room:
    """Mutable KV bookkeeping for one decision: reserved KV tokens per rollout cell against a fill target."""

    reserved: dict[str, int]
    limit: dict[str, int]

    @classmethod
    def of(cls, snapshot: Snapshot, fill: float) -> Room:
        reserved = {c.cell_id: 0 for c in snapshot.cells}
        floor = snapshot.session_kv_reserve_tokens
        for e in snapshot.live:  # inlined Snapshot.reserved_tokens: this loop runs every decision
            reserved[e.cell_id] = reserved.get(e.cell_id, 0) + (e.kv_tokens if e.kv_tokens > floor else floor)
        limit = {c.cell_id: int(c.kv_capacity_tokens * fill) for c in snapshot.cells}
        return cls(reserved=reserved, limit=limit)

    def free(self, cell_id: str) -> int:
        return self.limit[cell_id] - self.reserved[cell_id]


def budget_pool(snapshot: Snapshot) -> list[CellView]:
    """The cells a fixed pool runs on: those already holding a role first, then by id, up to the budget.

    By id alone, a cell registering late with a smaller id would displace one that holds a role, and the
    pool would ask for more roles than the budget allows (every decision refused from then on).
    """
    ranked = sorted(snapshot.cells, key=lambda c: (c.role is Role.IDLE, c.cell_id))[: snapshot.budget_cells]
    return sorted(ranked, key=lambda c: c.cell_id)


def accepting(cell: CellView) -> bool:
    """A cell that takes new sessions now."""
    return cell.role is Role.ROLLOUT and cell.state is CellState.ACTIVE


def dispatch_onto(
    snapshot: Snapshot,
    room: Room,
    cell_ids: list[str],
    *,
    exclude: frozenset[str] = frozenset(),
    limit: int | None = None,
) -> list[Action]:
    """Dispatch queued queries in order while the staleness bound and KV room allow.

    Each session goes to the cell with the most free room (spreading keeps per-session decode fast;
    elastic consolidates later when the load falls). A query starts only when its whole group fits.
    """
    reserve = snapshot.session_kv_reserve_tokens
    candidates = [c for c in cell_ids if c not in exclude]
    heap = [(-room.free(c), c) for c in candidates if room.free(c) >= reserve]
    heapq.heapify(heap)
    actions: list[Action] = []
    allowed = snapshot.dispatch_room() if limit is None else min(limit, snapshot.dispatch_room())
    for query in snapshot.queued[:allowed]:
        if len(heap) == 0:
            break
        places: list[str] = []
        while len(places) < query.group_size and heap:
            neg_free, cid = heapq.heappop(heap)
            places.append(cid)
            if -(neg_free + reserve) >= reserve:
                heapq.heappush(heap, (neg_free + reserve, cid))
        if len(places) < query.group_size:
            break  # the whole group does not fit; queries start in order, so stop here
        for cid in places:
            room.reserved[cid] += reserve
        actions.append(
            DispatchQuery(
                query_id=query.query_id,
                policy_version=snapshot.trainer.policy_version,
                placements=tuple(places),
            )
        )
    return actions


def free_slots(snapshot: Snapshot, room: Room, cell_ids: list[str]) -> int:
    """How many more average sessions the given cells can take."""
    reserve = max(1, snapshot.session_kv_reserve_tokens)
    return sum(max(0, room.free(c)) // reserve for c in cell_ids)


def pending_sessions(snapshot: Snapshot) -> int:
    """Sessions of queries that may start now under the staleness bound."""
    return sum(q.group_size for q in snapshot.queued[: snapshot.dispatch_room()])
