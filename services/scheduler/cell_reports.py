"""What a cell agent knows of the processes on one cell, folded from their events alone (pure: no I/O, no clock):
the drains they finished, the weights the cell's rollout worker loaded, the trainer groups that listed the cell."""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

from shared.events import CellDrained, Event, GroupFormed, WeightsLoaded

# Recent loads and groups kept per cell: a switch waits for the first one after it began, seconds later at most
# a few publications or re-formations on.
KEPT = 64


@dataclass(slots=True)
class CellReports:
    """The reports about one cell, as its agent received them (each may arrive twice: folding is idempotent)."""

    cell_id: str
    drains: dict[uuid.UUID, CellDrained] = field(default_factory=dict)  # by the cell.draining that asked
    loads: deque[tuple[datetime, WeightsLoaded]] = field(default_factory=lambda: deque(maxlen=KEPT))
    groups: deque[GroupFormed] = field(default_factory=lambda: deque(maxlen=KEPT))

    def fold(self, event: Event) -> bool:
        """Fold one report; False when it says nothing about this cell."""
        match event.data:
            case CellDrained(cell_id=self.cell_id) as drained if event.causation_id is not None:
                self.drains[event.causation_id] = drained
            case WeightsLoaded(cell_id=self.cell_id) as loaded:
                if (event.occurred_at, loaded) not in self.loads:
                    self.loads.append((event.occurred_at, loaded))
            case GroupFormed() as group if self.cell_id in group.members:
                if group not in self.groups:
                    self.groups.append(group)
            case _:
                return False
        return True

    def drained(self, cause: uuid.UUID) -> CellDrained | None:
        """The end of the drain `cause` (a cell.draining) asked for, once (a report of another drain is not it)."""
        return self.drains.pop(cause, None)

    def loaded_since(self, since: datetime) -> WeightsLoaded | None:
        """The cell's first `weights.loaded` dated at or after `since`: its worker's start or wake (the worker runs
        on the agent's node, so its clock is the one `since` was read from)."""
        after = [(at, loaded) for at, loaded in self.loads if at >= since]
        return min(after, key=lambda pair: pair[0])[1] if after else None

    def group_after(self, generation: int) -> GroupFormed | None:
        """The first trainer group listing the cell formed after `generation` (the newest in the log when the
        switch began: generations only grow, so a later one was formed after)."""
        later = [g for g in self.groups if g.generation > generation]
        return min(later, key=lambda g: g.generation) if later else None
