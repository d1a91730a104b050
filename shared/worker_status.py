"""The rollout worker's status: the message each worker broadcasts (as a heartbeat and on every change) and the
NATS subjects of the worker data path. Defined once here and validated on both sides: workers publish it, the
gateway's router and draining peers read it, operators and tests watch it.

Lifecycle facts that other services act on (a finished drain, the weights a worker serves) are events
(`cell.drained`, `weights.loaded`), not heartbeats: the heartbeat is for routing, which must be fresher than the
event log.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# `standby`: the engine is loaded but asleep while the cell serves another role (training); nothing is placed or
# adopted on it until its cell is released back to rollout and it wakes.
WorkerState = Literal["active", "draining", "drained", "standby"]


class WorkerStatus(BaseModel):
    """Broadcast by each worker (heartbeat and on change) so routers know capacity and drains."""

    # A heartbeat from a newer build may carry fields this one does not know: ignore them rather than go deaf.
    model_config = ConfigDict(frozen=True, extra="ignore")

    worker_id: str
    cell_id: str
    state: WorkerState
    live_sessions: int = Field(ge=0)
    capacity: int = Field(ge=1)
    in_flight: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    max_model_len: int = Field(ge=1)
    moved: dict[str, str] = Field(default_factory=dict)  # execution_id -> worker it migrated to


def status_subject(prefix: str) -> str:
    """Where every worker publishes its `WorkerStatus`."""
    return f"{prefix}.rollout.status"


def worker_subject(prefix: str, worker_id: str, verb: str) -> str:
    """A worker's request/reply endpoint (`generate`, `adopt`, `drain`, `end`)."""
    return f"{prefix}.rollout.worker.{worker_id}.{verb}"


def ended_subject(prefix: str) -> str:
    """Every worker hears an execution's end here, whether or not it holds the execution: a session can sit
    where the router does not know of it (a migration that finished after the end, an execution placed again
    while its old worker drained)."""
    return f"{prefix}.rollout.ended"


__all__ = ["WorkerState", "WorkerStatus", "ended_subject", "status_subject", "worker_subject"]
