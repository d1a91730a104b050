"""The cell agent, one per node: registers the node's cells, and on `cell.assigned` stops what runs on a
cell and starts what its new role needs (a rollout worker or a trainer rank), reporting every transition.

A switch is `cell.draining` → (the rollout worker migrates its live sessions) → old process stopped
(SIGTERM, SIGKILL after a timeout) → `cell.released` → new process started and healthy → `cell.ready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.cells import Role
from shared.events import (
    CellAssigned,
    CellDraining,
    CellReady,
    CellRegistered,
    CellReleased,
    Event,
    EventData,
    stream_id_for,
)
from shared.logging import configure_logging
from shared.runtime import Service
from shared.settings import Settings, load_settings
from shared.effects import Effects



# A command template of just `hold` runs a placeholder that only occupies the cell until it is stopped:
# for a role whose service runs outside the agent (e.g. a single-process trainer started by `gyre run`).
HOLD = "hold"
HOLD_CODE = "import signal; signal.pause()"


class CellAgentError(Exception):
    pass


class CellStartFailed(CellAgentError):
    def __init__(self, cell_id: str, role: str, detail: str) -> None:
        super().__init__(f"cell {cell_id}: the {role} process did not become ready: {detail}")


class CellSettings(BaseSettings):
    """`GYRE_CELL_…`: the node's cells and what runs on them.

    Command templates take `{cell_id}`, `{node_id}`, `{run_id}`, `{python}`, `{port}` and `{devices}`.
    Readiness: `status` = the rollout worker's heartbeat on `<prefix>.rollout.status` says active;
    `health` = the process's health endpoint (GYRE_HEALTH_PORT = health_port_base + cell index) answers
    200; `started` = the process is still alive after `start_grace_s`.
    """

    model_config = SettingsConfigDict(env_prefix="GYRE_CELL_", extra="ignore", frozen=True)

    count: int = Field(default=1, ge=1)
    node_id: str = ""  # default: GYRE_NODE_ID (the host name)
    accelerators: int = Field(default=1, ge=1)  # per cell
    device: str = "cpu"
    memory_bytes: int = Field(default=0, ge=0)
    kv_capacity_tokens: int = Field(default=1 << 20, ge=0)
    rollout_command: str = "{python} -m services.rollout worker"
    train_command: str = "{python} -m services.trainer"
    rollout_ready: Literal["status", "health", "started"] = "status"
    train_ready: Literal["health", "started"] = "health"
    health_port_base: int = Field(default=9300, ge=0)  # 0: children get no health port
    start_grace_s: float = Field(default=1.0, ge=0)
    ready_timeout_s: float = Field(default=900.0, gt=0)
    drain_timeout_s: float = Field(default=600.0, ge=0)
    stop_timeout_s: float = Field(default=30.0, ge=0)
    restart_backoff_s: float = Field(default=2.0, ge=0)
    log_dir: Path | None = None  # default: <state_dir>/cells


def safe_id(text: str) -> str:
    """Cell ids end up in NATS subjects (a worker's id is its cell id): no dots, spaces or wildcards."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text).strip("-") or "node"


def cell_ids(node_id: str, count: int) -> list[str]:
    return [f"{safe_id(node_id)}-cell{i}" for i in range(count)]


@dataclass
class WorkerSeen:
    """The latest heartbeat a rollout worker published for a cell."""

    state: str
    live_sessions: int
    policy_version: int | None
    at: float  # monotonic time received


class CellProcess:
    """One process running a role on a cell, in its own process group so a stop reaches its children."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str, log_file: IO[bytes]) -> None:
        self.proc = proc
        self.role = role
        self.log_file = log_file
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exited(self) -> bool:
        return self.proc.returncode is not None

    @classmethod
    async def start(cls, argv: list[str], *, env: dict[str, str], role: str, log_path: Path) -> CellProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        except BaseException:
            log_file.close()
            raise
        return cls(proc, role, log_file)

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM the group, SIGKILL it after `timeout_s`; returns the exit code."""
        if not self.exited:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                self._signal(signal.SIGKILL)
        code = await self.proc.wait()
        self._signal(signal.SIGKILL)  # whatever the leader left behind in its group
        self.log_file.close()
        return code

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def _die_with_parent() -> None:
    """In the child: die with the agent (Linux), so a killed agent leaves no orphan engines behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class CellRunner:
    """Converges one cell to the role it was last ordered into, one switch at a time, and keeps the
    role's process running (a crashed process is restarted; one that exits 0 has finished its work)."""

    def __init__(self, agent: CellAgent, cell_id: str, index: int) -> None:
        self.agent = agent
        self.cell_id = cell_id
        self.index = index
        self.role: Role = Role.IDLE
        self.desired: Role = Role.IDLE
        self.applied_version = 0  # stream version of the assignment `desired` came from
        self.cause: Event | None = None
        self.proc: CellProcess | None = None
        self.starting: CellProcess | None = None  # launched, not yet ready (not in `proc` until it is)
        self.launches = 0
        # cell.ready for the role taken, until it is in the log: the scheduler counts the cell from that event
        # alone, so a write that fails is tried again rather than leave the cell "switching" for ever.
        self.unreported: CellReady | None = None
        self.changed = asyncio.Event()
        self.log = agent.log.bind(cell_id=cell_id)

    @property
    def cfg(self) -> CellSettings:
        return self.agent.cfg

    def want(self, role: Role, version: int, cause: Event | None) -> None:
        if version <= self.applied_version:
            return  # an older order delivered late; a newer one already decided
        self.desired, self.applied_version, self.cause = role, version, cause
        self.changed.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.unreported is not None and self.desired == self.role:
                try:
                    await self._report_ready()
                except Exception:
                    self.log.exception("cell_ready_not_reported", role=self.role)
                    await _sleep_unless(stop, self.cfg.restart_backoff_s)
                continue
            if self.desired != self.role:
                try:
                    await self.switch(self.desired, stop)
                except CellStartFailed as exc:
                    self.log.error("cell_start_failed", error=str(exc))
                    await _sleep_unless(stop, self.cfg.restart_backoff_s)
                except Exception:
                    self.log.exception("cell_switch_failed", to_role=self.desired)
                    await _sleep_unless(stop, self.cfg.restart_backoff_s)
                continue
            if self.proc is not None and self.proc.exited:
                await self._supervise(stop)
                continue
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=0.25)

    async def _supervise(self, stop: asyncio.Event) -> None:
        assert self.proc is not None
        code = await self.proc.stop(0)
        role = self.proc.role
        self.proc = None
        if code == 0:
            self.log.info("cell_process_finished", role=role)
            return
        self.log.warning("cell_process_crashed", role=role, exit_code=code)
        await _sleep_unless(stop, self.cfg.restart_backoff_s)
        if stop.is_set() or self.desired != self.role:
            return
        try:
            self.proc, _ = await self._launch(self.role, stop)
            self.log.info("cell_process_restarted", role=self.role, pid=self.proc.pid)
        except CellStartFailed as exc:
            self.log.error("cell_restart_failed", error=str(exc))

    async def switch(self, target: Role, stop: asyncio.Event) -> None:
        t0 = time.monotonic()
        old = self.role
        self.unreported = None  # a newer order: its own cell.ready follows
        self.log.info("cell_switch_started", from_role=old, to_role=target)
        if old != "idle":
            sessions = self._live_sessions() if old == "rollout" else 0
            await self._emit(CellDraining(cell_id=self.cell_id, from_role=old, live_sessions=sessions))
            migrated = 0
            if old == "rollout" and self.proc is not None:
                migrated = await self._await_drained(self.proc, sessions, time.monotonic(), stop)
            if self.proc is not None:
                code = await self.proc.stop(self.cfg.stop_timeout_s)
                self.log.info("cell_process_stopped", role=old, exit_code=code)
                self.proc = None
            self.role = Role.IDLE
            await self._emit(CellReleased(cell_id=self.cell_id, from_role=old, migrated_sessions=migrated,
                                          seconds=time.monotonic() - t0))
        version = None
        if target != "idle":
            self.proc, version = await self._launch(target, stop)
        self.role = target
        self.unreported = CellReady(cell_id=self.cell_id, role=target, switch_seconds=time.monotonic() - t0,
                                    policy_version=version)
        await self._report_ready()

    async def _report_ready(self) -> None:
        assert self.unreported is not None
        ready = self.unreported
        await self._emit(ready)
        self.unreported = None
        self.log.info("cell_ready", role=ready.role, switch_seconds=round(ready.switch_seconds, 3))

    # ---- processes ----

    def template(self, role: str) -> str:
        return self.cfg.rollout_command if role == "rollout" else self.cfg.train_command

    def command(self, role: str) -> list[str]:
        template = self.template(role)
        if template.strip() == HOLD:
            return [sys.executable, "-c", HOLD_CODE]
        values = {
            "cell_id": self.cell_id, "node_id": self.agent.node_id, "run_id": self.agent.settings.run_id,
            "python": sys.executable, "port": str(self.port or ""), "devices": self.devices,
        }
        return [part.format(**values) for part in shlex.split(template)]

    @property
    def port(self) -> int | None:
        return self.cfg.health_port_base + self.index if self.cfg.health_port_base else None

    @property
    def devices(self) -> str:
        n = self.cfg.accelerators
        return ",".join(str(i) for i in range(self.index * n, (self.index + 1) * n))

    def environment(self, role: str) -> dict[str, str]:
        s = self.agent.settings
        env = dict(os.environ)
        env.pop("GYRE_HEALTH_PORT", None)  # the agent's own port; each child gets its cell's
        env.update({
            "GYRE_RUN_ID": s.run_id, "GYRE_SUBJECT_PREFIX": s.subject_prefix, "GYRE_NODE_ID": self.agent.node_id,
            "GYRE_CELL_ID": self.cell_id, "GYRE_CELL_ROLE": role,
        })
        for key, value in (("GYRE_DATABASE_URL", s.database_url), ("GYRE_NATS_URL", s.nats_url),
                           ("GYRE_DB_SCHEMA", s.db_schema or "")):
            if value:
                env[key] = value
        if self.port:
            env["GYRE_HEALTH_PORT"] = str(self.port)
        if role == "rollout":
            env["GYRE_ROLLOUT_CELL_ID"] = self.cell_id
        if role == "train":
            env["GYRE_TRAINER_CELL_ID"] = self.cell_id
        if self.cfg.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        return env

    async def _launch(self, role: Role, stop: asyncio.Event) -> tuple[CellProcess, int | None]:
        self.launches += 1
        log_path = self.agent.log_dir / self.cell_id / f"{role}-{self.launches}.log"
        argv = self.command(role)
        try:
            proc = await CellProcess.start(argv, env=self.environment(role), role=role, log_path=log_path)
        except OSError as exc:  # a command that does not exist or cannot run
            raise CellStartFailed(self.cell_id, role, f"could not start {argv}: {exc}") from exc
        self.log.info("cell_process_started", role=role, pid=proc.pid, argv=argv, log=str(log_path))
        self.starting = proc
        try:
            version = await self._await_ready(proc, role, stop)
        except BaseException:
            # If this stop is cancelled (the agent's shutdown cuts its tasks short), `starting` still names
            # the process and `shutdown` finishes the job.
            await proc.stop(self.cfg.stop_timeout_s)
            self.starting = None
            raise
        self.starting = None
        return proc, version

    async def _await_ready(self, proc: CellProcess, role: str, stop: asyncio.Event) -> int | None:
        mode = self.cfg.rollout_ready if role == "rollout" else self.cfg.train_ready
        if (mode == "health" and self.port is None) or self.template(role).strip() == HOLD:
            mode = "started"
        deadline = time.monotonic() + (self.cfg.start_grace_s if mode == "started" else self.cfg.ready_timeout_s)
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if proc.exited:
                    raise CellStartFailed(self.cell_id, role, f"exited with code {proc.proc.returncode} "
                                          f"(see {proc.log_file.name})")
                if stop.is_set():
                    raise CellStartFailed(self.cell_id, role, "the agent is stopping")
                match mode:
                    case "status":
                        seen = self.agent.workers.get(self.cell_id)
                        if seen is not None and seen.at >= proc.started_at and seen.state == "active":
                            return seen.policy_version
                    case "health":
                        with contextlib.suppress(httpx.HTTPError):
                            if (await http.get(f"http://127.0.0.1:{self.port}/")).status_code == 200:
                                return None
                if time.monotonic() >= deadline:
                    if mode == "started":
                        return None
                    raise CellStartFailed(self.cell_id, role, f"not ready ({mode}) within {self.cfg.ready_timeout_s} s")
                await asyncio.sleep(0.05)

    def _live_sessions(self) -> int:
        seen = self.agent.workers.get(self.cell_id)
        return seen.live_sessions if seen is not None and self.proc and seen.at >= self.proc.started_at else 0

    async def _await_drained(self, proc: CellProcess, sessions: int, since: float, stop: asyncio.Event) -> int:
        """Wait for the worker (which drains itself on cell.draining) to report drained; returns how many
        sessions left the cell. A process that never published a heartbeat speaks no drain protocol."""
        seen = self.agent.workers.get(self.cell_id)
        if seen is None or seen.at < proc.started_at:
            return 0
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while not proc.exited and not stop.is_set():
            seen = self.agent.workers[self.cell_id]
            if seen.at >= since and seen.state == "drained":
                return sessions
            if seen.at >= since and not self.agent.active_peers(self.cell_id):
                # No other rollout worker is up (a colocate pool turning to training): the sessions stay
                # parked with the harness and are recomputed on a rollout cell later.
                self.log.info("sessions_parked", live_sessions=seen.live_sessions)
                return max(0, sessions - seen.live_sessions)
            if time.monotonic() >= deadline:
                self.log.warning("drain_timed_out", live_sessions=seen.live_sessions, state=seen.state)
                return max(0, sessions - seen.live_sessions)
            await asyncio.sleep(0.05)
        return max(0, sessions - self.agent.workers[self.cell_id].live_sessions)

    async def _emit(self, data: EventData) -> None:
        await self.agent.emit([self.agent.event(data, stream_id=stream_id_for("cell", self.cell_id), cause=self.cause)])

    async def shutdown(self) -> None:
        for proc in (self.starting, self.proc):
            if proc is not None:
                code = await proc.stop(self.cfg.stop_timeout_s)
                self.log.info("cell_process_stopped", role=proc.role, exit_code=code, reason="agent stopping")
        self.starting = self.proc = None


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


class CellAgent(Service):
    name = "cell-agent"

    def __init__(self, settings: Settings | None = None, cell: CellSettings | None = None) -> None:
        super().__init__(settings)
        self.cfg = cell or CellSettings()
        self.node_id = safe_id(self.cfg.node_id or self.settings.node_id)
        self.log_dir = self.cfg.log_dir or Path(self.settings.state_dir) / "cells"
        self.runners = {cid: CellRunner(self, cid, i) for i, cid in enumerate(cell_ids(self.node_id, self.cfg.count))}
        self.workers: dict[str, WorkerSeen] = {}
        self._status_sub: Any = None
        self.log = self.log.bind(node_id=self.node_id)

    async def setup(self) -> None:
        assert self.bus is not None and self.store is not None
        self._status_sub = await self.bus.nc.subscribe(f"{self.bus.prefix}.rollout.status", cb=self._on_status)
        for runner in self.runners.values():
            await runner._emit(CellRegistered(
                cell_id=runner.cell_id, node_id=self.node_id, accelerators=self.cfg.accelerators,
                device=self.cfg.device, memory_bytes=self.cfg.memory_bytes,
                kv_capacity_tokens=self.cfg.kv_capacity_tokens,
            ))
        # The last order for each cell in this run (a restarted agent resumes it; the durable consumer
        # only delivers what it has not acknowledged, and `want` ignores anything older).
        for stored in await self.store.read_all(types=["cell.assigned"], run_id=self.settings.run_id):
            order = stored.event.data
            if isinstance(order, CellAssigned) and order.cell_id in self.runners:
                self.runners[order.cell_id].want(order.role, stored.event.version, stored.event)
        # One durable consumer per run and node: every agent must see every order of its run.
        self.on(["cell.assigned"], self._on_assigned, durable=safe_id(f"cell-agent-{self.settings.run_id}-{self.node_id}"))
        for runner in self.runners.values():
            self.spawn(runner.run(self.stop_event), name=f"cell-{runner.cell_id}")
        self.log.info("cells_registered", cells=list(self.runners))

    async def _on_assigned(self, event: Event) -> Effects:
        effects = Effects()
        order = event.data
        if event.run_id != self.settings.run_id or not isinstance(order, CellAssigned):
            return effects
        runner = self.runners.get(order.cell_id)
        if runner is not None:
            effects.after_commit(lambda: runner.want(order.role, event.version, event))
        return effects

    async def _on_status(self, msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            cell_id = str(body["cell_id"])
            seen = WorkerSeen(str(body["state"]), int(body.get("live_sessions", 0)),
                              body.get("policy_version"), time.monotonic())
        except (ValueError, KeyError, TypeError):
            self.log.warning("bad_worker_status", data=msg.data[:200])
            return
        self.workers[cell_id] = seen  # every worker's, not only ours: a drain needs somewhere to go

    def active_peers(self, cell_id: str, *, within_s: float = 5.0) -> list[str]:
        """Rollout workers on other cells that heartbeat as active: where a draining worker can migrate."""
        now = time.monotonic()
        return sorted(c for c, w in self.workers.items()
                      if c != cell_id and w.state == "active" and now - w.at <= within_s)

    def health(self) -> dict[str, Any]:
        return {"cells": {cid: {"role": r.role, "desired": r.desired, "pid": r.proc.pid if r.proc else None}
                          for cid, r in self.runners.items()}}

    async def teardown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.runners.values()))
        if self._status_sub is not None:
            with contextlib.suppress(Exception):
                await self._status_sub.unsubscribe()


def main() -> None:
    settings = load_settings()
    configure_logging(CellAgent.name, run_id=settings.run_id)
    asyncio.run(CellAgent(settings).run(freeze_heap=True))
