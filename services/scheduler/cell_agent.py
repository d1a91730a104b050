"""The cell agent, one per node: registers the node's cells, and on `cell.assigned` moves a cell into its new role
(cell_runner.py): warm, between the two processes it keeps on the cell (a rollout worker and a trainer rank, one
of them in standby); else by stopping one and starting the other. It reports every transition.

It learns what the processes did from their events only: `cell.drained` ends a drain (a worker's, or the trainer
coordinator's for a rank), a `weights.loaded` of the cell after a start or a release says its worker serves, a
`trainer.group_formed` listing the cell says its rank trains. It reads no heartbeat.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from services.scheduler.cell_runner import CellRunner
from services.scheduler.cell_settings import CellSettings, cell_ids, safe_id
from shared.effects import Effects
from shared.events import (
    CellAssigned,
    CellRegistered,
    Event,
    EventData,
    GroupFormed,
    stream_id_for,
)
from shared.logging import configure_logging
from shared.runtime import Service
from shared.settings import Settings, load_settings


class CellAgent(Service):
    name = "cell-agent"

    def __init__(self, settings: Settings | None = None, cell: CellSettings | None = None) -> None:
        super().__init__(settings)
        self.cfg = cell or CellSettings()
        self.node_id = safe_id(self.cfg.node_id or self.settings.node_id)
        self.log_dir = self.cfg.log_dir or Path(self.settings.state_dir) / "cells"
        self.log = self.log.bind(node_id=self.node_id)
        self.runners = {cid: CellRunner(self, cid, i) for i, cid in enumerate(cell_ids(self.node_id, self.cfg.count))}
        # The trainer's groups read from the log so far: the position of the last one read, the newest generation.
        self._groups_read: tuple[int, int, tuple[str, ...]] = (0, 0, ())

    async def setup(self) -> None:
        assert self.store is not None
        for runner in self.runners.values():
            await self.report(CellRegistered(
                cell_id=runner.cell_id, node_id=self.node_id, accelerators=self.cfg.accelerators,
                device=self.cfg.device, memory_bytes=self.cfg.memory_bytes,
                kv_capacity_tokens=self.cfg.kv_capacity_tokens,
            ), cell_id=runner.cell_id, cause=None)
        # The last order for each cell in this run (a restarted agent resumes it; the durable consumer
        # only delivers what it has not acknowledged, and `want` ignores anything older).
        for stored in await self.store.read_all(types=["cell.assigned"], run_id=self.settings.run_id):
            order = stored.event.data
            if isinstance(order, CellAssigned) and order.cell_id in self.runners:
                self.runners[order.cell_id].want(order.role, stored.event.version, stored.event)
        # One durable consumer per run and node for each kind: every agent must see every order of its run, and
        # the reports of the workers on its cells.
        durable = safe_id(f"cell-agent-{self.settings.run_id}-{self.node_id}")
        self.on(["cell.assigned"], self._on_assigned, durable=durable)
        self.on(["cell.drained", "weights.loaded", "trainer.group_formed"], self._on_report,
                durable=f"{durable}-reports")
        for runner in self.runners.values():
            self.spawn(runner.run(self.stop_event), name=f"cell-{runner.cell_id}")
        self.log.info("cells_registered", cells=list(self.runners))

    async def report(self, data: EventData, *, cell_id: str, cause: Event | None) -> Event:
        """Append one event of `cell_id`'s stream (caused by `cause`, the order being carried out)."""
        event = self.event(data, stream_id=stream_id_for("cell", cell_id), cause=cause)
        await self.emit([event])
        return event

    async def _on_assigned(self, event: Event) -> Effects:
        effects = Effects()
        order = event.data
        if event.run_id != self.settings.run_id or not isinstance(order, CellAssigned):
            return effects
        runner = self.runners.get(order.cell_id)
        if runner is not None:
            effects.after_commit(lambda: runner.want(order.role, event.version, event))
        return effects

    async def _on_report(self, event: Event) -> None:
        # Folded in memory only, and safe to fold twice (cell_reports.py).
        data = event.data
        cells = data.members if isinstance(data, GroupFormed) else [getattr(data, "cell_id", "")]
        for cell_id in cells:
            if (runner := self.runners.get(cell_id)) is not None:
                runner.fold_report(event)

    async def group_generation(self) -> tuple[int, tuple[str, ...]]:
        """The newest generation of the trainer's group in the log (0: none yet) and its members, read on from the
        last call."""
        assert self.store is not None
        position, generation, members = self._groups_read
        while page := await self.store.read_after(position, limit=1000, types=["trainer.group_formed"],
                                                  run_id=self.settings.run_id):
            for stored in page:
                data = stored.event.data
                if isinstance(data, GroupFormed) and data.generation > generation:
                    generation, members = data.generation, tuple(data.members)
            position = page[-1].position
        self._groups_read = (position, generation, members)
        return generation, members

    def health(self) -> dict[str, Any]:
        return {"cells": {cid: {"role": r.role, "desired": r.desired, "warm": self.cfg.warm,
                                "pid": r.active.pid if r.active else None,
                                "standby_pid": r.standby.pid if r.standby else None}
                          for cid, r in self.runners.items()}}

    async def teardown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.runners.values()))


def main() -> None:
    settings = load_settings()
    configure_logging(CellAgent.name, run_id=settings.run_id)
    asyncio.run(CellAgent(settings).run(freeze_heap=True))
