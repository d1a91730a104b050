"""The cell agent's decisions, pure: which processes a cell keeps, whether a switch moves the role between
running processes (warm) or starts one (cold), how long a crashed process waits, and the phases `cell.ready`
reports."""

from __future__ import annotations

from collections.abc import Mapping

from shared.cells import Role

ROLES = (Role.ROLLOUT, Role.TRAIN)


def kept_roles(role: Role, *, warm: bool, parked: bool = False) -> tuple[Role, ...]:
    """The roles whose processes run on a cell serving `role`: both when warm (the other one in standby, and
    both in standby on a cell that has had no order yet, so even its first assignment starts nothing), else only
    the role's own; none on a cell ordered idle (`parked`: the scheduler took it out of the budget)."""
    if role is Role.IDLE:
        return ROLES if warm and not parked else ()
    return ROLES if warm else (role,)


def keeps_old_process(*, warm: bool, target: Role, reports_drain: bool, drained: bool) -> bool:
    """Whether the old role's process stays on the cell (in standby) once the cell is released. Only when warm
    and the cell keeps a role; and only a process that let go as asked (its drain was reported, or it is not
    one that reports): one silent past the drain timeout is in a state nobody knows, so it is stopped (and
    restarted cold, in standby)."""
    return warm and target is not Role.IDLE and (drained or not reports_drain)


def takes_role_warm(*, warm: bool, released: bool, target_running: bool) -> bool:
    """Whether a switch moves the role to the target role's running process rather than start one: when warm,
    that process is up, and the switch released the cell (the release is what a standby acts on: from its old
    role, or from idle on a first assignment). A standby that died starts cold at the switch."""
    return warm and released and target_running


def restart_delay(backoff_s: float, max_s: float, crashes_in_a_row: int) -> float:
    """Seconds before restarting a role's process after its `crashes_in_a_row`-th crash: doubling, capped."""
    doublings = min(max(crashes_in_a_row - 1, 0), 16)
    return min(max_s, backoff_s * float(1 << doublings))


def merged_phases(*parts: Mapping[str, float]) -> dict[str, float]:
    """One switch's phases from each report (the drain's, the readiness event's, the agent's own), in order."""
    merged: dict[str, float] = {}
    for part in parts:
        merged.update(part)
    return merged
