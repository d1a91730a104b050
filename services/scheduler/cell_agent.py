"""The cell agent, one per node: registers the node's cells, and on `cell.assigned` stops what runs on a cell and
starts what its new role needs (a rollout worker or a trainer rank), reporting every transition (cell_runner.py).

It learns what its rollout workers did from their events only: `cell.drained` ends a drain, a `weights.loaded`
after a launch says the worker serves. It reads no heartbeat.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from services.scheduler.cell_runner import CellRunner
from services.scheduler.cell_settings import CellSettings, cell_ids, safe_id
from shared.effects import Effects
from shared.events import CellAssigned, CellDrained, CellRegistered, Event, EventData, WeightsLoaded, stream_id_for
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
        self.on(["cell.drained", "weights.loaded"], self._on_worker_report, durable=f"{durable}-reports")
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

    async def _on_worker_report(self, event: Event) -> None:
        # Folded in memory only, and safe to fold twice: a drain report is keyed by its cause, a load by its time.
        data = event.data
        if isinstance(data, CellDrained | WeightsLoaded) and (runner := self.runners.get(data.cell_id)) is not None:
            runner.fold_report(event)

    def health(self) -> dict[str, Any]:
        return {"cells": {cid: {"role": r.role, "desired": r.desired, "pid": r.proc.pid if r.proc else None}
                          for cid, r in self.runners.items()}}

    async def teardown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.runners.values()))


def main() -> None:
    settings = load_settings()
    configure_logging(CellAgent.name, run_id=settings.run_id)
    asyncio.run(CellAgent(settings).run(freeze_heap=True))
