"""One cell's switches: converge the cell to the role it was last ordered into, one switch at a time, keep the
role's process running, and report every transition as an event.

A switch out of rollout: `cell.draining` → the cell's rollout worker moves its sessions (`kv.migrated` each) and
reports `cell.drained` (caused by that `cell.draining`) → the process is stopped (SIGTERM, SIGKILL after a
timeout) → `cell.released` → the new role's process is started and ready → `cell.ready`. The runner learns
what its worker did only from the worker's events, which the agent folds into `fold_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from services.scheduler.cell_process import HOLD, HOLD_ARGV, CellProcess
from services.scheduler.cell_settings import CellSettings
from shared.cells import Role
from shared.events import CellDrained, CellDraining, CellReady, CellReleased, Event, EventData, WeightsLoaded
from shared.settings import Settings

T = TypeVar("T")


class CellAgentError(Exception):
    pass


class CellStartFailed(CellAgentError):
    def __init__(self, cell_id: str, role: str, detail: str) -> None:
        super().__init__(f"cell {cell_id}: the {role} process did not become ready: {detail}")


class CellHost(Protocol):
    """What a runner needs from its agent: configuration, and a way to write the cell's events."""

    cfg: CellSettings
    settings: Settings
    node_id: str
    log_dir: Path
    log: Any

    async def report(self, data: EventData, *, cell_id: str, cause: Event | None) -> Event: ...


class CellRunner:
    """Converges one cell to the role it was last ordered into, one switch at a time, and keeps the
    role's process running (a crashed process is restarted; one that exits 0 has finished its work)."""

    def __init__(self, host: CellHost, cell_id: str, index: int) -> None:
        self.host = host
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
        # The fold of the cell's worker reports: finished drains by the cell.draining that asked for them, and
        # the newest weights.loaded (when it happened, the version). `reported` wakes a switch waiting on them.
        self.drains: dict[uuid.UUID, CellDrained] = {}
        self.loaded: tuple[datetime, int] | None = None
        self.reported = asyncio.Event()
        self.log = host.log.bind(cell_id=cell_id)

    @property
    def cfg(self) -> CellSettings:
        return self.host.cfg

    def want(self, role: Role, version: int, cause: Event | None) -> None:
        if version <= self.applied_version:
            return  # an older order delivered late; a newer one already decided
        self.desired, self.applied_version, self.cause = role, version, cause
        self.changed.set()

    def fold_report(self, event: Event) -> None:
        """A report of this cell's worker: a drain it finished, or weights it serves."""
        match event.data:
            case CellDrained() as drained if event.causation_id is not None:
                self.drains[event.causation_id] = drained
            case WeightsLoaded(version=version):
                if self.loaded is None or event.occurred_at >= self.loaded[0]:
                    self.loaded = (event.occurred_at, version)
            case _:
                return
        self.reported.set()

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
            waits = [self.changed.wait(), stop.wait()] + ([self.proc.wait()] if self.proc is not None else [])
            await _first_of(waits, timeout_s=None)

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
        if old is not Role.IDLE:
            draining = await self._emit(CellDraining(cell_id=self.cell_id, from_role=old))
            migrated = 0
            if self.proc is not None and self._reports_its_drain(self.proc):
                drained = await self._await_drained(self.proc, draining, stop)
                migrated = drained.migrated_sessions if drained is not None else 0
            if self.proc is not None:
                code = await self.proc.stop(self.cfg.stop_timeout_s)
                self.log.info("cell_process_stopped", role=old, exit_code=code)
                self.proc = None
            self.role = Role.IDLE
            await self._emit(CellReleased(cell_id=self.cell_id, from_role=old, migrated_sessions=migrated,
                                          seconds=time.monotonic() - t0))
        version = None
        if target is not Role.IDLE:
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

    def template(self, role: Role) -> str:
        return self.cfg.rollout_command if role is Role.ROLLOUT else self.cfg.train_command

    def command(self, role: Role) -> list[str]:
        template = self.template(role)
        if template.strip() == HOLD:
            return list(HOLD_ARGV)
        values = {
            "cell_id": self.cell_id, "node_id": self.host.node_id, "run_id": self.host.settings.run_id,
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

    def environment(self, role: Role | str) -> dict[str, str]:
        role = Role(role)
        s = self.host.settings
        env = dict(os.environ)
        env.pop("GYRE_HEALTH_PORT", None)  # the agent's own port; each child gets its cell's
        env.update({
            "GYRE_RUN_ID": s.run_id, "GYRE_SUBJECT_PREFIX": s.subject_prefix, "GYRE_NODE_ID": self.host.node_id,
            "GYRE_CELL_ID": self.cell_id, "GYRE_CELL_ROLE": role.value,
        })
        for key, value in (("GYRE_DATABASE_URL", s.database_url), ("GYRE_NATS_URL", s.nats_url),
                           ("GYRE_DB_SCHEMA", s.db_schema or "")):
            if value:
                env[key] = value
        if self.port:
            env["GYRE_HEALTH_PORT"] = str(self.port)
        if role is Role.ROLLOUT:
            env["GYRE_ROLLOUT_CELL_ID"] = self.cell_id
        if role is Role.TRAIN:
            env["GYRE_TRAINER_CELL_ID"] = self.cell_id
        if self.cfg.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        return env

    def _readiness(self, role: Role) -> str:
        mode = self.cfg.rollout_ready if role is Role.ROLLOUT else self.cfg.train_ready
        if (mode == "health" and self.port is None) or self.template(role).strip() == HOLD:
            return "started"
        return mode

    def _reports_its_drain(self, proc: CellProcess) -> bool:
        """Only a Gyre rollout worker (`status` readiness) drains itself on cell.draining and says when it is
        done; any other process is stopped at once."""
        return proc.role is Role.ROLLOUT and self._readiness(Role.ROLLOUT) == "status"

    async def _launch(self, role: Role, stop: asyncio.Event) -> tuple[CellProcess, int | None]:
        self.launches += 1
        log_path = self.host.log_dir / self.cell_id / f"{role}-{self.launches}.log"
        argv = self.command(role)
        try:
            proc = await CellProcess.start(argv, env=self.environment(role), role=role, log_path=log_path)
        except OSError as exc:  # a command that does not exist or cannot run
            raise CellStartFailed(self.cell_id, role, f"could not start {argv}: {exc}") from exc
        self.log.info("cell_process_started", role=role, pid=proc.pid, argv=argv, log=str(log_path))
        self.starting = proc
        try:
            version = await self._await_ready(proc, stop)
        except BaseException:
            # If this stop is cancelled (the agent's shutdown cuts its tasks short), `starting` still names
            # the process and `shutdown` finishes the job.
            await proc.stop(self.cfg.stop_timeout_s)
            self.starting = None
            raise
        self.starting = None
        return proc, version

    async def _await_ready(self, proc: CellProcess, stop: asyncio.Event) -> int | None:
        """Until `proc` is ready for its role; returns the policy version a rollout worker serves (`status`)."""
        mode = self._readiness(proc.role)
        version: int | None = None
        match mode:
            case "started":
                await _first_of([proc.wait(), stop.wait()], timeout_s=self.cfg.start_grace_s)
                ready = True
            case "status":
                # The worker's weights.loaded at start-up, dated after this launch (same node, same clock): an
                # earlier one came from a process that ran on the cell before.
                version = await self._until(
                    lambda: self.loaded[1] if self.loaded and self.loaded[0] >= proc.launched_at else None,
                    proc, stop, self.cfg.ready_timeout_s,
                )
                ready = version is not None
            case _:
                ready = await self._healthy(proc, stop)
        if proc.exited:
            raise CellStartFailed(self.cell_id, proc.role, f"exited with code {proc.proc.returncode} "
                                  f"(see {proc.log_file.name})")
        if stop.is_set():
            raise CellStartFailed(self.cell_id, proc.role, "the agent is stopping")
        if not ready:
            raise CellStartFailed(self.cell_id, proc.role, f"not ready ({mode}) within {self.cfg.ready_timeout_s} s")
        return version

    async def _healthy(self, proc: CellProcess, stop: asyncio.Event) -> bool:
        """Poll the process's health endpoint (HTTP has nothing to wait on) until it answers 200."""
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while not proc.exited and not stop.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{self.port}/")).status_code == 200:
                        return True
                await _first_of([proc.wait(), stop.wait()], timeout_s=0.05)
        return False

    async def _await_drained(self, proc: CellProcess, draining: Event, stop: asyncio.Event) -> CellDrained | None:
        """Until the worker reports the drain `draining` asked for (its cell.drained), the worker exits, the agent
        stops or `drain_timeout_s` passes; the report, or None without one."""
        drained = await self._until(lambda: self.drains.pop(draining.event_id, None), proc, stop,
                                    self.cfg.drain_timeout_s)
        if drained is not None:
            self.log.info("cell_drained", migrated_sessions=drained.migrated_sessions,
                          parked_sessions=drained.parked_sessions, detail=drained.detail)
        elif proc.exited:
            self.log.warning("worker_exited_while_draining", exit_code=proc.proc.returncode)
        elif not stop.is_set():
            self.log.warning("drain_timed_out", waited_s=self.cfg.drain_timeout_s)
        return drained

    async def _until(self, found: Callable[[], T | None], proc: CellProcess, stop: asyncio.Event,
                     timeout_s: float) -> T | None:
        """Wait for `found()` to give a value, checked again on each report of the cell's worker; None once the
        process exits, the agent stops or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.reported.clear()  # before the check: a report that lands after it wakes the wait below
            if (value := found()) is not None:
                return value
            left = deadline - time.monotonic()
            if proc.exited or stop.is_set() or left <= 0:
                return None
            await _first_of([self.reported.wait(), proc.wait(), stop.wait()], timeout_s=left)

    async def _emit(self, data: EventData) -> Event:
        return await self.host.report(data, cell_id=self.cell_id, cause=self.cause)

    async def shutdown(self) -> None:
        for proc in (self.starting, self.proc):
            if proc is not None:
                code = await proc.stop(self.cfg.stop_timeout_s)
                self.log.info("cell_process_stopped", role=proc.role, exit_code=code, reason="agent stopping")
        self.starting = self.proc = None


async def _first_of(waits: Sequence[Awaitable[Any]], *, timeout_s: float | None) -> None:
    """Until the first of `waits` completes or `timeout_s` passes; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    await _first_of([stop.wait()], timeout_s=seconds)
