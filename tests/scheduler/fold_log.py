"""Builders for the fold tests: a run's plan, a RunView over it, and events of that run at increasing times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from services.scheduler.plan import QueryPlan
from services.scheduler.run_view import RunView
from shared.events import (
    BlobRef,
    CallCompleted,
    CellAssigned,
    CellDrained,
    CellReady,
    CellRegistered,
    Event,
    EventData,
    execution_id_for,
    new_event,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
REF = BlobRef(digest="sha256:" + "0" * 64, size=0)


def plan(**kw: object) -> QueryPlan:
    base: dict[str, object] = dict(run_id="r1", task_ids=("a", "b", "c"), queries_per_step=2, total_steps=3,
                                   group_size=2, seed=7)
    return QueryPlan(**{**base, **kw})  # type: ignore[arg-type]


def view(p: QueryPlan | None = None, *, staleness: int = 0, **kw: object) -> RunView:
    return RunView(plan=p or plan(), max_staleness=staleness, session_reserve_tokens=10, default_kv_tokens=1000,
                   **kw)  # type: ignore[arg-type]


def eid(query: int | str, sample: int, run_id: str = "r1") -> str:
    """The execution id of a sample, by query number (step 0 and 1 of the default plan: 0..3) or query id."""
    query_id = query if isinstance(query, str) else f"{run_id}-step{query // 2}-q{query % 2}"
    return execution_id_for(query_id, sample)


class Log:
    """Builds events of one run with increasing times (one second apart)."""

    def __init__(self, run_id: str = "r1") -> None:
        self.run_id = run_id
        self.t = 0

    def __call__(self, data: EventData, stream: str = "s") -> Event:
        self.t += 1
        return new_event(data, run_id=self.run_id, stream_id=stream, version=1,
                         occurred_at=T0 + timedelta(seconds=self.t))


def registered(cell: str, kv: int = 1000) -> CellRegistered:
    return CellRegistered(cell_id=cell, node_id="n", accelerators=1, device="cpu", memory_bytes=0,
                          kv_capacity_tokens=kv)


def ready_cells(v: RunView, log: Log, roles: dict[str, str]) -> None:
    for cell, role in roles.items():
        v.apply(log(registered(cell)))
        v.apply(log(CellAssigned(cell_id=cell, role=role, policy="async")))  # type: ignore[arg-type]
        v.apply(log(CellReady(cell_id=cell, role=role, switch_seconds=1.0)))  # type: ignore[arg-type]


def rollout_cell_serving(v: RunView, log: Log, cell: str, version: int | None) -> None:
    v.apply(log(registered(cell)))
    v.apply(log(CellAssigned(cell_id=cell, role="rollout", policy="async")))  # type: ignore[arg-type]
    v.apply(log(CellReady(cell_id=cell, role="rollout", switch_seconds=1.0, policy_version=version)))  # type: ignore[arg-type]


def call(execution_id: str, cell: str, index: int, prompt: int = 3, completion: int = 1,
         chain: str = "main") -> CallCompleted:
    return CallCompleted(execution_id=execution_id, call_id=f"{execution_id}-{chain}-{index}", call_index=index,
                         record=REF, prompt_tokens=prompt, new_prompt_tokens=prompt, completion_tokens=completion,
                         policy_version=0, cell_id=cell, chain_id=chain)


def drained(cell: str, migrated: int = 0, parked: int = 0) -> CellDrained:
    return CellDrained(cell_id=cell, worker_id=cell, migrated_sessions=migrated, parked_sessions=parked, seconds=1.0)
