"""What a policy may order, and the checker that every executor (live or simulated) applies to it.

Actions in one decision apply in order: migrations and drains before the assignments that free a cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.scheduler.policies.snapshot import CellState, Snapshot
from shared.cells import Role


@dataclass(frozen=True, slots=True)
class AssignCell:
    """Order a cell into a role. A rollout cell still holding sessions parks them (colocate only)."""

    cell_id: str
    role: Role


@dataclass(frozen=True, slots=True)
class DrainCell:
    """Stop placing new sessions on a rollout cell; it is released once empty."""

    cell_id: str


@dataclass(frozen=True, slots=True)
class MigrateSession:
    """Move a live session to another rollout cell; its requests are rerouted there.

    `method` "kv" carries its KV cache over; "recompute" aborts its in-flight request and resubmits prompt and
    partial output on the target, which prefills them again (the peer policy's way of moving a session).
    """

    execution_id: str
    from_cell: str
    to_cell: str
    method: Literal["kv", "recompute"] = "kv"


@dataclass(frozen=True, slots=True)
class DispatchQuery:
    """Start a query's group of executions at `policy_version`, one per cell in `placements`."""

    query_id: str
    policy_version: int
    placements: tuple[str, ...]


Action = AssignCell | DrainCell | MigrateSession | DispatchQuery


class PolicyViolation(ValueError):
    """A decision broke an invariant of the scheduling contract."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """The state a decision leads to, as far as the invariants care."""

    roles: dict[str, Role]
    states: dict[str, CellState]
    cell_of: dict[str, str]  # live execution id -> cell after migrations
    parked: frozenset[str]  # executions left on a cell that became a train cell
    placed: dict[str, int]  # cell -> new sessions placed on it
    dispatched: int
    reserved: dict[str, int]  # rollout cell -> reserved KV tokens after the decision


def apply_actions(snapshot: Snapshot, actions: list[Action], *, allow_parking: bool) -> Outcome:
    """Check `actions` against `snapshot` and return the resulting state, or raise PolicyViolation.

    Checked: known cells and sessions; migrations only between rollout cells into room that exists;
    no session lost; at most `budget_cells` cells in a role; dispatches within the staleness bound and
    at the snapshot's policy version; a query's group fully placed on active rollout cells.
    """
    cells = snapshot.cells_by_id()
    roles = {c.cell_id: c.role for c in snapshot.cells}
    states = {c.cell_id: c.state for c in snapshot.cells}
    live = {e.execution_id: e for e in snapshot.live}
    cell_of = {e.execution_id: e.cell_id for e in snapshot.live}
    reserved: dict[str, int] = {c.cell_id: 0 for c in snapshot.cells}
    for e in snapshot.live:
        reserved[e.cell_id] = reserved.get(e.cell_id, 0) + snapshot.reserved_tokens(e)
    queued = {q.query_id: q for q in snapshot.queued}
    placed: dict[str, int] = {}
    dispatched = 0
    migrated: set[str] = set()
    parked: set[str] = set()

    def need_cell(cell_id: str) -> None:
        if cell_id not in cells:
            raise PolicyViolation(f"expected a known cell id, got {cell_id!r}")

    for action in actions:
        match action:
            case MigrateSession(execution_id=eid, from_cell=src, to_cell=dst):
                need_cell(src)
                need_cell(dst)
                if eid not in live:
                    raise PolicyViolation(f"expected a live execution to migrate, got {eid!r}")
                if cell_of[eid] != src:
                    raise PolicyViolation(f"execution {eid} is on {cell_of[eid]}, not on {src}")
                if live[eid].migrating or eid in migrated:
                    raise PolicyViolation(f"execution {eid} is already migrating")
                if roles[dst] is not Role.ROLLOUT or states[dst] is not CellState.ACTIVE or dst == src:
                    raise PolicyViolation(f"migration target {dst} must be another active rollout cell")
                need = snapshot.reserved_tokens(live[eid])
                if reserved[dst] + need > cells[dst].kv_capacity_tokens:
                    raise PolicyViolation(
                        f"migrating {eid} needs {need} KV tokens on {dst}, which has "
                        f"{cells[dst].kv_capacity_tokens - reserved[dst]} free"
                    )
                reserved[src] -= need
                reserved[dst] += need
                cell_of[eid] = dst
                migrated.add(eid)
            case DrainCell(cell_id=cid):
                need_cell(cid)
                if roles[cid] is not Role.ROLLOUT:
                    raise PolicyViolation(f"only a rollout cell can drain; {cid} is {roles[cid]}")
                states[cid] = CellState.DRAINING
            case AssignCell(cell_id=cid, role=role):
                need_cell(cid)
                if states[cid] is CellState.SWITCHING:
                    raise PolicyViolation(f"cell {cid} is already switching")
                if role is Role.TRAIN or role is Role.IDLE:
                    left = [e for e, c in cell_of.items() if c == cid]
                    if left and not allow_parking:
                        raise PolicyViolation(
                            f"cell {cid} leaves rollout with {len(left)} live sessions still on it "
                            f"(e.g. {left[0]}); they must be migrated first"
                        )
                    if left and role is Role.IDLE:
                        raise PolicyViolation(f"cell {cid} cannot go idle with live sessions")
                    parked.update(left)
                if role is Role.ROLLOUT:
                    parked.difference_update(e for e, c in cell_of.items() if c == cid)
                if role is not roles[cid]:
                    roles[cid] = role
                    states[cid] = CellState.SWITCHING
                elif states[cid] is CellState.DRAINING:
                    states[cid] = CellState.ACTIVE
            case DispatchQuery(query_id=qid, policy_version=version, placements=places):
                if qid not in queued:
                    raise PolicyViolation(f"expected a queued query, got {qid!r}")
                if version != snapshot.trainer.policy_version:
                    raise PolicyViolation(
                        f"dispatch must use the trainer's version {snapshot.trainer.policy_version}, got {version}"
                    )
                if dispatched >= snapshot.dispatch_room():
                    batch = snapshot.batch_of_next_query(dispatched)
                    raise PolicyViolation(
                        f"query {qid} would join batch {batch} at version {version}: beyond staleness "
                        f"bound {snapshot.max_staleness} or past the last step"
                    )
                if len(places) != queued[qid].group_size:
                    raise PolicyViolation(f"query {qid} needs {queued[qid].group_size} placements, got {len(places)}")
                for cid in places:
                    need_cell(cid)
                    if roles[cid] is not Role.ROLLOUT or states[cid] is not CellState.ACTIVE:
                        raise PolicyViolation(f"query {qid} placed on {cid}, which is not an active rollout cell")
                    reserved[cid] += snapshot.session_kv_reserve_tokens
                    placed[cid] = placed.get(cid, 0) + 1
                    if reserved[cid] > cells[cid].kv_capacity_tokens:
                        raise PolicyViolation(f"query {qid} overfills the KV reserve of cell {cid}")
                del queued[qid]
                dispatched += 1
            case _:
                raise PolicyViolation(f"expected an Action, got {action!r}")

    in_budget = sum(1 for r in roles.values() if r is not Role.IDLE)
    if in_budget > snapshot.budget_cells:
        raise PolicyViolation(f"{in_budget} cells hold a role; the budget is {snapshot.budget_cells}")
    return Outcome(
        roles=roles,
        states=states,
        cell_of=cell_of,
        parked=frozenset(parked),
        placed=placed,
        dispatched=dispatched,
        reserved=reserved,
    )
