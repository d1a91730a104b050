"""The two baselines: `async` (fixed rollout and training pools) and `colocate` (one pool, alternating)."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.policies.actions import Action, AssignCell
from services.scheduler.policies.base import Room, accepting, budget_pool, dispatch_onto
from services.scheduler.policies.snapshot import CellState, Snapshot
from shared.cells import Role


class PolicyConfigError(ValueError):
    """A policy was configured with values it cannot work with."""


@dataclass(frozen=True, slots=True)
class AsyncPolicy:
    """Fixed split: the first `rollout_cells` cells of the budget's pool (by id) roll out, the rest train."""

    rollout_cells: int
    fill: float = 0.9
    name: str = "async"
    allows_parking: bool = False

    def __post_init__(self) -> None:
        if self.rollout_cells < 1:
            raise PolicyConfigError(f"async needs at least one rollout cell, got {self.rollout_cells}")

    def decide(self, snapshot: Snapshot) -> list[Action]:
        if self.rollout_cells >= snapshot.budget_cells:
            raise PolicyConfigError(
                f"async needs rollout_cells < budget ({snapshot.budget_cells}) to keep a trainer, "
                f"got {self.rollout_cells}"
            )
        ordered = budget_pool(snapshot)
        actions: list[Action] = []
        for i, cell in enumerate(ordered):
            want = Role.ROLLOUT if i < self.rollout_cells else Role.TRAIN
            if cell.role is not want and cell.state is not CellState.SWITCHING:
                # Only at start-up: a fixed pool never moves a cell that holds sessions.
                if not any(e.cell_id == cell.cell_id for e in snapshot.live):
                    actions.append(AssignCell(cell.cell_id, want))
        room = Room.of(snapshot, self.fill)
        rollout = [c.cell_id for c in ordered[: self.rollout_cells] if accepting(c)]
        actions += dispatch_onto(snapshot, room, rollout)
        return actions


@dataclass(frozen=True, slots=True)
class ColocatePolicy:
    """One pool: every cell rolls out until the trainer's batch is complete, then every cell trains.

    With `run_ahead` (default, the same staleness bound as the other policies) a rollout phase also
    starts later batches up to the bound, which fills the pool while the current batch's tail runs;
    those sessions are parked in place during training (the engine gives its memory to the trainer)
    and continue, their KV recomputed, when the pool returns to rollout. Without it a phase rolls
    out exactly the trainer's current batch (a synchronous colocated loop).
    """

    fill: float = 0.9
    run_ahead: bool = True
    name: str = "colocate"
    allows_parking: bool = True

    def decide(self, snapshot: Snapshot) -> list[Action]:
        ordered = budget_pool(snapshot)
        trainer = snapshot.trainer
        train_phase = trainer.batch_complete and trainer.policy_version < trainer.steps_total
        want = Role.TRAIN if train_phase else Role.ROLLOUT
        actions: list[Action] = [
            AssignCell(c.cell_id, want)
            for c in ordered
            if c.role is not want and c.state is not CellState.SWITCHING
        ]
        if not train_phase:
            room = Room.of(snapshot, self.fill)
            limit = None
            if not self.run_ahead:
                limit = (trainer.policy_version + 1) * snapshot.batch_queries - snapshot.queries_dispatched
            accepting_ids = [c.cell_id for c in ordered if accepting(c)]
            actions += dispatch_onto(snapshot, room, accepting_ids, limit=limit)
        return actions
