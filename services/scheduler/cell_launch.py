"""What runs on a cell in a role, pure: the command line from its template, its environment, its health port,
and how the agent tells that it is ready (and whether it reports its drains)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from services.scheduler.cell_process import HOLD, HOLD_ARGV
from services.scheduler.cell_settings import CellSettings
from shared.cells import Role
from shared.settings import Settings


@dataclass(frozen=True, slots=True)
class CellLaunch:
    """One cell's launch parameters: the agent's configuration and where the cell sits on its node."""

    cfg: CellSettings
    settings: Settings
    node_id: str
    cell_id: str
    index: int

    def template(self, role: Role) -> str:
        return self.cfg.rollout_command if role is Role.ROLLOUT else self.cfg.train_command

    def command(self, role: Role, python: str) -> list[str]:
        template = self.template(role)
        if template.strip() == HOLD:
            return list(HOLD_ARGV)
        values = {
            "cell_id": self.cell_id, "node_id": self.node_id, "run_id": self.settings.run_id,
            "python": python, "port": str(self.port(role) or ""), "devices": self.devices,
        }
        return [part.format(**values) for part in shlex.split(template)]

    def port(self, role: Role) -> int | None:
        """The health port of the cell's process for `role`: the node's rollout ports first, then its train
        ports (both run at once on a warm cell)."""
        if not self.cfg.health_port_base:
            return None
        return self.cfg.health_port_base + self.index + (self.cfg.count if role is Role.TRAIN else 0)

    @property
    def devices(self) -> str:
        n = self.cfg.accelerators
        return ",".join(str(i) for i in range(self.index * n, (self.index + 1) * n))

    @property
    def cores(self) -> list[int] | None:
        """The CPU cores this cell's processes are pinned to, or None (not asked for, not a CPU cell, or the node
        has fewer cores than its cells need)."""
        if not self.cfg.pin_cores or self.cfg.device != "cpu":
            return None
        usable = sorted(os.sched_getaffinity(0))
        n = self.cfg.accelerators
        if self.cfg.count * n > len(usable):
            return None
        return usable[self.index * n : (self.index + 1) * n]

    def environment(self, role: Role, base: Mapping[str, str], *, standby: bool = False) -> dict[str, str]:
        """`base` (the agent's environment) with what the role's process needs to know of its run and cell."""
        s = self.settings
        env = dict(base)
        env.pop("GYRE_HEALTH_PORT", None)  # the agent's own port; each child gets its own
        env.update({
            "GYRE_RUN_ID": s.run_id, "GYRE_SUBJECT_PREFIX": s.subject_prefix, "GYRE_NODE_ID": self.node_id,
            "GYRE_CELL_ID": self.cell_id, "GYRE_CELL_ROLE": role.value,
        })
        for key, value in (("GYRE_DATABASE_URL", s.database_url), ("GYRE_NATS_URL", s.nats_url),
                           ("GYRE_DB_SCHEMA", s.db_schema or "")):
            if value:
                env[key] = value
        if port := self.port(role):
            env["GYRE_HEALTH_PORT"] = str(port)
        if role is Role.ROLLOUT:
            env["GYRE_ROLLOUT_CELL_ID"] = self.cell_id
            # A standby worker loads its engine, then sleeps until its cell is released into rollout.
            env["GYRE_ROLLOUT_STANDBY"] = "1" if standby else "0"
        if role is Role.TRAIN:
            env["GYRE_TRAINER_CELL_ID"] = self.cell_id  # a rank always starts outside the group
        if self.cfg.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        if (cores := self.cores) is not None:
            # vLLM on CPU binds its OpenMP threads to every core unless told which; torch sizes its pool by these.
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
            env["OMP_NUM_THREADS"] = str(len(cores))
        return env

    def readiness(self, role: Role) -> str:
        mode = self.cfg.rollout_ready if role is Role.ROLLOUT else self.cfg.train_ready
        if (mode == "health" and self.port(role) is None) or self.template(role).strip() == HOLD:
            return "started"
        return mode

    def reports_its_drain(self, role: Role) -> bool:
        """Only a Gyre rollout worker (`status`) and a Gyre trainer rank (`group`, through the coordinator) let go
        of the cell on cell.draining and say when they are done; any other process is not waited for."""
        return self.readiness(role) == ("status" if role is Role.ROLLOUT else "group")
