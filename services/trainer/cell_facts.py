"""The cells as the coordinator knows them: each cell's stream folded by membership.py, from the store. A fact the
consumer delivers only says which cell to fold again, so facts delivered late, twice or out of order change nothing.
"""

from __future__ import annotations

import time
import uuid

from services.trainer.membership import CELL_FACTS, CellView, fold_cell, fold_stream
from shared.events import Event, stream_id_for
from shared.store import EventStore


class CellFacts:
    def __init__(self, store: EventStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.views: dict[str, CellView] = {}
        self._dirty: set[str] = set()  # cells whose stream gained a fact since they were folded
        self._drain_seen: dict[uuid.UUID, float] = {}  # when each train drain was first seen (its wait_step_s)

    async def load(self) -> None:
        """Every cell of the run, from its whole history."""
        by_cell: dict[str, list[Event]] = {}
        for stored in await self.store.read_all(types=list(CELL_FACTS), run_id=self.run_id):
            by_cell.setdefault(getattr(stored.event.data, "cell_id"), []).append(stored.event)
        self.views = {cell: fold_stream(cell, sorted(events, key=lambda e: e.version))
                      for cell, events in by_cell.items()}
        self._seen_drains()

    def touch(self, cell_id: str) -> None:
        """A fact of `cell_id` arrived: fold its stream again before the next decision."""
        self._dirty.add(cell_id)

    async def refresh(self) -> list[CellView]:
        """The views, every touched cell folded again from its stream."""
        while self._dirty:
            cell = self._dirty.pop()
            stream = await self.store.read_stream(stream_id_for("cell", cell))
            self.views[cell] = fold_stream(cell, [s.event for s in stream
                                                  if s.event.run_id == self.run_id and s.event.type in CELL_FACTS])
        self._seen_drains()
        return list(self.views.values())

    def _seen_drains(self) -> None:
        now = time.monotonic()
        for view in self.views.values():
            if view.drain is not None:
                self._drain_seen.setdefault(view.drain, now)

    def waited(self, draining_id: uuid.UUID) -> float:
        """Seconds since the coordinator first saw the drain (what it waited for a step boundary)."""
        return time.monotonic() - self._drain_seen.get(draining_id, time.monotonic())

    async def draining_event(self, cell_id: str, draining_id: uuid.UUID) -> Event | None:
        return next((s.event for s in await self.store.read_stream(stream_id_for("cell", cell_id))
                     if s.event.event_id == draining_id), None)

    def answered(self, cell_id: str, drained: Event) -> None:
        """The coordinator's own `cell.drained`, folded at once so the drain is never answered twice."""
        self.views[cell_id] = fold_cell(self.views[cell_id], drained)
        if drained.causation_id is not None:
            self._drain_seen.pop(drained.causation_id, None)


__all__ = ["CellFacts"]
