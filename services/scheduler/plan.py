"""The run's query plan: which queries a run trains on, their ids, tasks and seeds, and their dispatch events.

Pure: every value is a function of the run id, the run seed and a query's number, so a restarted scheduler
names the same queries again.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from shared.events import QueryDispatched

TaskOrder = Literal["round_robin", "seeded"]


class PlanError(ValueError):
    """The query plan was configured with values it cannot work with."""


def derive_seed(seed: int, *parts: int) -> int:
    """A 31-bit seed from the run seed and a path of integers; stable across processes and Python versions."""
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class QueryPlan:
    """Which queries a run trains on: `queries_per_step` queries feed each of `total_steps` steps.

    Query number n feeds step n // queries_per_step. Its id, task and seeds are functions of
    (run, step, index) and the run seed, so a restarted scheduler names the same queries again.
    Seeds do not depend on the run id: runs in different modes with one seed see the same samples.
    """

    run_id: str
    task_ids: tuple[str, ...]
    queries_per_step: int
    total_steps: int
    group_size: int
    seed: int = 0
    task_order: TaskOrder = "round_robin"
    harness: str = "builtin"

    def __post_init__(self) -> None:
        if not self.task_ids:
            raise PlanError("expected at least one task id to train on, got none")
        if self.queries_per_step < 1 or self.total_steps < 0 or self.group_size < 1:
            raise PlanError(
                f"expected queries_per_step >= 1, total_steps >= 0 and group_size >= 1, got "
                f"{self.queries_per_step}, {self.total_steps} and {self.group_size}"
            )

    @property
    def total_queries(self) -> int:
        return self.total_steps * self.queries_per_step

    def slot(self, n: int) -> tuple[int, int]:
        """(step, index within the step) of query number n."""
        return divmod(n, self.queries_per_step)

    def query_id(self, n: int) -> str:
        step, index = self.slot(n)
        return f"{self.run_id}-step{step}-q{index}"

    def number_of(self, query_id: str) -> int | None:
        """The query number a planned query id names, or None for a query this plan did not make."""
        match = re.fullmatch(re.escape(self.run_id) + r"-step(\d+)-q(\d+)", query_id)
        if match is None:
            return None
        step, index = int(match.group(1)), int(match.group(2))
        if index >= self.queries_per_step:
            return None
        return step * self.queries_per_step + index

    def task_for(self, n: int) -> str:
        match self.task_order:
            case "round_robin":
                return self.task_ids[n % len(self.task_ids)]
            case "seeded":
                return random.Random(derive_seed(self.seed, n, -1)).choice(self.task_ids)
            case _:
                raise PlanError(f"expected task_order round_robin or seeded, got {self.task_order!r}")

    def seeds_for(self, n: int) -> list[int]:
        step, index = self.slot(n)
        return [derive_seed(self.seed, step, index, sample) for sample in range(self.group_size)]

    def dispatch(self, n: int, *, policy_version: int, placements: tuple[str, ...] = ()) -> QueryDispatched:
        if not 0 <= n < self.total_queries:
            raise PlanError(f"expected a query number in [0, {self.total_queries}), got {n}")
        step, _ = self.slot(n)
        return QueryDispatched(
            query_id=self.query_id(n),
            task_id=self.task_for(n),
            group_size=self.group_size,
            seeds=self.seeds_for(n),
            step=step,
            policy_version=policy_version,
            harness=self.harness,
            placements=list(placements),
            step_queries=self.queries_per_step,
        )


def query_stream(query_id: str) -> str:
    """One stream per query: appending its dispatch at expected version 0 makes a second dispatch impossible."""
    return f"query-{query_id}"
