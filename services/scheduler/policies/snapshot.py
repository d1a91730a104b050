"""What a scheduling policy sees: a frozen snapshot of cells, sessions, queries and trainer.

The live scheduler fills it from events (cell.*, execution.*, step.completed, weights.published);
the simulator fills it from its model. Time arrives as data (`now_s`), never from a clock. KV is
counted in tokens throughout (cells register their capacity in tokens); the simulator converts its
bytes at its boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from shared.cells import Role


class CellState(StrEnum):
    """Where a cell stands in its role's life cycle."""

    ACTIVE = "active"  # serving its role
    SWITCHING = "switching"  # between roles; unavailable until cell.ready
    DRAINING = "draining"  # rollout cell taking no new sessions, waiting to be released


def admitted_kv_tokens(registered: int, engine: int, default: int) -> int:
    """The KV a cell admits sessions against: the smaller of what the cell registered and what its rollout engine
    reported allocating, either alone where the other is 0 (unknown), `default` where both are."""
    known = [kv for kv in (registered, engine) if kv]
    return min(known) if known else default


@dataclass(frozen=True, slots=True)
class CellView:
    """One accelerator cell: its role, its state and its KV-cache capacity (in tokens)."""

    cell_id: str
    role: Role
    state: CellState
    kv_capacity_tokens: int
    role_since_s: float = 0.0  # when the cell last entered its role (for hysteresis)


@dataclass(frozen=True, slots=True)
class LiveExecution:
    """One running agent session, pinned to a rollout cell (or parked there during a colocate train phase)."""

    execution_id: str
    query_id: str
    cell_id: str
    context_tokens: int
    kv_tokens: int  # the KV it holds on its cell
    dispatch_version: int  # policy version when its query was dispatched
    batch: int  # training step whose batch it belongs to
    # Its KV is in flight: towards `cell_id` (an ordered move), or off `cell_id` (a cell leaving rollout whose
    # worker has not yet said where the session went). Either way it is not to be moved again until it lands.
    migrating: bool = False


@dataclass(frozen=True, slots=True)
class QueuedQuery:
    """A query waiting to be dispatched: `group_size` executions of one task."""

    query_id: str
    group_size: int


@dataclass(frozen=True, slots=True)
class FinishedExecution:
    """An execution that finished (or timed out) and whose tokens have not been trained yet."""

    execution_id: str
    query_id: str
    batch: int
    tokens: int


@dataclass(frozen=True, slots=True)
class TrainerView:
    """The trainer's progress: version = optimiser steps completed; it trains batch `policy_version` next."""

    policy_version: int
    backlog_tokens: int  # finished, untrained tokens of the current batch still to process
    batch_complete: bool  # every execution of the current batch has finished
    steps_total: int  # the run ends after this many steps
    tokens_per_cell_s: float = 0.0  # measured training throughput of one cell (0: not measured yet)
    # Seconds the trainer waited per execution it had to wait for, over the run so far (the wait while its batch
    # was incomplete, divided by the executions that finished in it); 0: no wait measured yet.
    sample_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    """Seconds to move a cell between roles, and the rate a KV migration gets (in tokens per second)."""

    to_train_s: float = 8.52
    to_rollout_s: float = 3.46
    # About what one 12k-token move took on the live system (docs/rollout.md, "Benchmark"): the prior the live
    # scheduler uses until it has measured a migration (the simulator always sets its own).
    migration_tokens_per_s: float = 10_000.0
    # The rate a target prefills a session moved by recompute (its history again): what a move without KV costs.
    prefill_tokens_per_s: float = 20_000.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a policy may base a decision on; a pure value."""

    now_s: float
    cells: tuple[CellView, ...]
    live: tuple[LiveExecution, ...]
    queued: tuple[QueuedQuery, ...]
    finished_untrained: tuple[FinishedExecution, ...]
    trainer: TrainerView
    max_staleness: int
    budget_cells: int
    batch_queries: int  # queries per training batch (B)
    queries_dispatched: int  # queries dispatched since the run began
    session_kv_reserve_tokens: int  # KV tokens an average session grows to (what admission reserves for it)
    switch_costs: SwitchCosts = field(default_factory=SwitchCosts)

    def dispatch_room(self) -> int:
        """How many more queries may start without any of them landing beyond the staleness bound.

        Query number n joins batch n // B; it may start at version v only if n // B <= v + k.
        """
        limit = (self.trainer.policy_version + self.max_staleness + 1) * self.batch_queries
        limit = min(limit, self.trainer.steps_total * self.batch_queries)
        return max(0, limit - self.queries_dispatched)

    def batch_of_next_query(self, offset: int = 0) -> int:
        return (self.queries_dispatched + offset) // self.batch_queries

    def reserved_tokens(self, execution: LiveExecution) -> int:
        """KV tokens a live session holds against its cell: what it uses, or the average reserve if more."""
        return max(execution.kv_tokens, self.session_kv_reserve_tokens)

    def cells_by_id(self) -> dict[str, CellView]:
        return {c.cell_id: c for c in self.cells}
