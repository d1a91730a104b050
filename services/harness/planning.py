"""Pure planning for the harness service: a query's executions, and what to do with them after a crash.

Execution ids are derived from the query, so a restarted service finds the same state folders.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.events import execution_id_for


class QueryPlanError(ValueError):
    """A query dispatch cannot be expanded into executions."""


class PlannedExecution(BaseModel):
    model_config = ConfigDict(frozen=True)

    execution_id: str
    query_id: str
    task_id: str
    sample_index: int = Field(ge=0)
    seed: int
    group_size: int = Field(ge=1)


def plan_query(*, query_id: str, task_id: str, group_size: int, seeds: list[int]) -> tuple[PlannedExecution, ...]:
    """One execution per seed: the group of G samples of one task."""
    if len(seeds) != group_size:
        raise QueryPlanError(f"query {query_id}: expected {group_size} seeds (one per execution), got {len(seeds)}")
    return tuple(
        PlannedExecution(
            execution_id=execution_id_for(query_id, index),
            query_id=query_id,
            task_id=task_id,
            sample_index=index,
            seed=seed,
            group_size=group_size,
        )
        for index, seed in enumerate(seeds)
    )


class RecoveryAction(BaseModel):
    """After a restart: mark an execution timed out (budget 'crash') and/or grade its preserved work."""

    model_config = ConfigDict(frozen=True)

    execution_id: str
    mark_timed_out: bool
    grade: bool


Stage = Literal["started", "stopped", "scored"]


def recovery_actions(stages: Mapping[str, Iterable[Stage]]) -> tuple[RecoveryAction, ...]:
    """Given what the log says happened to each execution, what a restarted service must still do.

    An execution that started but never stopped cannot be resumed (its agent process is gone): it is
    marked timed out and graded. One that stopped but was not scored is graded. Sorted by id.
    """
    actions = []
    for execution_id in sorted(stages):
        seen = set(stages[execution_id])
        if "scored" in seen or "started" not in seen:
            continue
        actions.append(RecoveryAction(execution_id=execution_id, mark_timed_out="stopped" not in seen, grade=True))
    return tuple(actions)
