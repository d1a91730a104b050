"""Pure scheduling policies shared by the live scheduler and the simulator: `decide(snapshot) -> actions`."""

from __future__ import annotations

from services.scheduler.policies.actions import (
    Action,
    AssignCell,
    DispatchQuery,
    DrainCell,
    MigrateSession,
    Outcome,
    PolicyViolation,
    apply_actions,
)
from services.scheduler.policies.base import Policy
from services.scheduler.policies.elastic import ElasticPolicy, ElasticTiming
from services.scheduler.policies.fixed import AsyncPolicy, ColocatePolicy, PolicyConfigError
from services.scheduler.policies.snapshot import (
    CellState,
    CellView,
    FinishedExecution,
    LiveExecution,
    QueuedQuery,
    Snapshot,
    SwitchCosts,
    TrainerView,
    admitted_kv_tokens,
)
from shared.cells import Role

POLICY_NAMES = ("elastic", "async", "colocate")
# KV the live scheduler reserves for a session on its cell until the session holds more (the admission floor), and
# the fraction of a cell's KV the policies admit to: the defaults of GYRE_SCHEDULER_SESSION_RESERVE_TOKENS / _FILL.
SESSION_RESERVE_TOKENS = 8192
FILL = 0.9
# The closest peer's behaviour, for comparison: verl's step switching (sessions aborted and prefilled again,
# switches gated on their measured cost), and elastic with only the first of those two changes.
PEER_POLICY_NAMES = ("reprefill", "elastic-recompute")


def make_policy(
    name: str,
    *,
    budget_cells: int,
    rollout_cells: int | None = None,
    fill: float = 0.9,
    colocate_run_ahead: bool = True,
    elastic_timing: ElasticTiming | None = None,
) -> Policy:
    """Build a policy by name; `rollout_cells` sizes async's fixed rollout pool (default: half);
    `elastic_timing` overrides the elastic policy's time constants (the defaults suit hour-long rollouts)."""
    match name:
        case "elastic" | "reprefill" | "elastic-recompute":
            timing = elastic_timing or ElasticTiming()
            peer = {"reprefill": {"transfer": "recompute", "gate": "step"},
                    "elastic-recompute": {"transfer": "recompute"}}.get(name, {})
            return ElasticPolicy(fill=fill, pack_fill=fill, train_horizon_s=timing.train_horizon_s,
                                 min_dwell_s=timing.min_dwell_s, margin=timing.margin, name=name,
                                 **peer)  # type: ignore[arg-type]
        case "async":
            return AsyncPolicy(rollout_cells=rollout_cells or max(1, budget_cells // 2), fill=fill)
        case "colocate":
            return ColocatePolicy(fill=fill, run_ahead=colocate_run_ahead)
        case _:
            raise PolicyConfigError(f"expected a policy in {POLICY_NAMES + PEER_POLICY_NAMES}, got {name!r}")


__all__ = [
    "Action",
    "AssignCell",
    "AsyncPolicy",
    "CellState",
    "CellView",
    "ColocatePolicy",
    "DispatchQuery",
    "DrainCell",
    "ElasticPolicy",
    "FILL",
    "ElasticTiming",
    "FinishedExecution",
    "LiveExecution",
    "MigrateSession",
    "Outcome",
    "PEER_POLICY_NAMES",
    "POLICY_NAMES",
    "Policy",
    "PolicyConfigError",
    "PolicyViolation",
    "QueuedQuery",
    "Role",
    "SESSION_RESERVE_TOKENS",
    "Snapshot",
    "SwitchCosts",
    "TrainerView",
    "admitted_kv_tokens",
    "apply_actions",
    "make_policy",
]
