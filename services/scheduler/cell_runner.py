"""One cell's switches: converge the cell to the role it was last ordered into, one switch at a time, keep the
processes its role needs running, and report every transition as an event.

Warm (`GYRE_CELL_WARM`, the default), both roles' processes run once the cell has a role, and a switch starts
nothing: `cell.draining` → the old role's process lets go (a rollout worker moves its sessions, `kv.migrated`
each, and sleeps; the trainer coordinator lets the cell's rank leave its group at a step boundary) and says so
with `cell.drained` (caused by that `cell.draining`) → `cell.released` → the other process takes the role (the
worker wakes on the release and reports `weights.loaded`; the coordinator lets the rank into its group and
reports `trainer.group_formed` listing the cell) → `cell.ready(warm=True, phases)`. The restart path (warm off,
or a process that died) stops the old process after its drain and starts the new one cold. The runner learns
what the processes did only from their events, which the agent folds into `reports` (cell_reports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from services.scheduler.cell_launch import CellLaunch
from services.scheduler.cell_process import CellProcess
from services.scheduler.cell_reports import CellReports
from services.scheduler.cell_settings import CellSettings
from services.scheduler.cell_switch import (
    keeps_old_process,
    kept_roles,
    merged_phases,
    restart_delay,
    takes_role_warm,
)
from shared.cells import Role
from shared.events import CellDrained, CellDraining, CellReady, CellReleased, Event, EventData
from shared.runtime import utcnow
from shared.settings import Settings

T = TypeVar("T")


class CellAgentError(Exception):
    pass


class CellStartFailed(CellAgentError):
    def __init__(self, cell_id: str, role: str, detail: str) -> None:
        super().__init__(f"cell {cell_id}: the {role} process did not become ready: {detail}")


class CellHost(Protocol):
    """What a runner needs from its agent: configuration, a way to write the cell's events, and the newest
    generation of the trainer's group in the log."""

    cfg: CellSettings
    settings: Settings
    node_id: str
    log_dir: Path
    log: Any

    async def report(self, data: EventData, *, cell_id: str, cause: Event | None) -> Event: ...

    async def group_generation(self) -> tuple[int, tuple[str, ...]]: ...


class CellRunner:
    """Converges one cell to the role it was last ordered into, one switch at a time, and keeps the processes
    of its role running (a crashed one is restarted after a backoff; one that exits 0 has finished its work)."""

    def __init__(self, host: CellHost, cell_id: str, index: int) -> None:
        self.host = host
        self.cell_id = cell_id
        self.index = index
        self.role: Role = Role.IDLE
        self.desired: Role = Role.IDLE
        self.applied_version = 0  # stream version of the assignment `desired` came from
        self.cause: Event | None = None
        self.procs: dict[Role, CellProcess] = {}  # each role's process, from its launch (ready or not) to its stop
        self.launches = 0
        self.crashes: dict[Role, int] = {}  # crashes in a row, per role
        self.restart_at: dict[Role, float] = {}  # monotonic time a crashed role's process may start again
        self.finished: set[Role] = set()  # exited 0: not restarted until a switch needs the role
        # No process kept while idle: ordered idle, or not yet ordered unless both roles stand by from the start.
        self.parked = not host.cfg.standby_from_start
        # cell.ready for the role taken, until it is in the log: the scheduler counts the cell from that event
        # alone, so a write that fails is tried again rather than leave the cell "switching" for ever.
        self.unreported: CellReady | None = None
        self.changed = asyncio.Event()
        # The fold of the cell's process reports; `reported` wakes a switch waiting on one.
        self.reports = CellReports(cell_id)
        self.reported = asyncio.Event()
        self.launch = CellLaunch(host.cfg, host.settings, host.node_id, cell_id, index)
        self.log = host.log.bind(cell_id=cell_id)

    @property
    def cfg(self) -> CellSettings:
        return self.host.cfg

    @property
    def active(self) -> CellProcess | None:
        """The process serving the cell's role (None while idle, or between a crash and its restart)."""
        return self.procs.get(self.role)

    @property
    def standby(self) -> CellProcess | None:
        other = [p for r, p in self.procs.items() if r is not self.role]
        return other[0] if other else None

    def want(self, role: Role, version: int, cause: Event | None) -> None:
        if version <= self.applied_version:
            return  # an older order delivered late; a newer one already decided
        self.desired, self.applied_version, self.cause = role, version, cause
        self.changed.set()

    def fold_report(self, event: Event) -> None:
        """A report about this cell: a drain finished, weights its worker serves, a group listing it."""
        if self.reports.fold(event):
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
            if await self._reap():
                continue
            next_start = await self._start_missing()
            self.changed.clear()
            waits = [self.changed.wait(), stop.wait()] + [p.wait() for p in self.procs.values()]
            await _first_of(waits, timeout_s=None if next_start is None else max(0.0, next_start - time.monotonic()))

    # ---- keeping processes up ----

    async def _reap(self) -> bool:
        """Collect the processes that exited: a crash is restarted after a backoff (`_start_missing`), a clean
        exit is not. True if any had."""
        reaped = False
        for role, proc in list(self.procs.items()):
            if not proc.exited:
                continue
            reaped = True
            del self.procs[role]
            code = await proc.stop(0)
            standby = role is not self.role
            if code == 0:
                self.finished.add(role)
                self.log.info("cell_process_finished", role=role, standby=standby)
                continue
            self.crashes[role] = self.crashes.get(role, 0) + 1
            delay = restart_delay(self.cfg.restart_backoff_s, self.cfg.restart_backoff_max_s, self.crashes[role])
            self.restart_at[role] = time.monotonic() + delay
            self.log.warning("cell_process_crashed", role=role, standby=standby, exit_code=code,
                             crashes_in_a_row=self.crashes[role], restart_in_s=delay)
        return reaped

    async def _start_missing(self) -> float | None:
        """Start the processes the cell's role keeps that are not running (a standby after the role was taken,
        a crashed process once its backoff is over), without waiting for them: each says itself when it is up
        (a worker's `weights.loaded`, a rank's `trainer.rank_ready`). Returns when the next backoff ends."""
        now = time.monotonic()
        pending: list[float] = []
        for role in kept_roles(self.role, warm=self.cfg.warm, parked=self.parked):
            if role in self.procs or role in self.finished:
                continue
            if (due := self.restart_at.get(role, 0.0)) > now:
                pending.append(due)
                continue
            standby = role is not self.role
            try:
                proc = await self._start(role, standby=standby)
            except CellStartFailed as exc:
                self.crashes[role] = self.crashes.get(role, 0) + 1
                self.restart_at[role] = now + restart_delay(self.cfg.restart_backoff_s, self.cfg.restart_backoff_max_s,
                                                            self.crashes[role])
                self.log.error("cell_process_not_started", role=role, standby=standby, error=str(exc))
                pending.append(self.restart_at[role])
                continue
            event = "cell_process_restarted" if self.crashes.get(role) else "cell_standby_started"
            self.log.info(event, role=role, standby=standby, pid=proc.pid)
        return min(pending) if pending else None

    # ---- switching ----

    async def switch(self, target: Role, stop: asyncio.Event) -> None:
        t0 = time.monotonic()
        old = self.role
        self.unreported = None  # a newer order: its own cell.ready follows
        self.log.info("cell_switch_started", from_role=old, to_role=target, warm=self.cfg.warm)
        await self._reap()  # a process that died since the last look is not a warm one
        phases: dict[str, float] = {}
        drained: CellDrained | None = None
        generation = 0
        old_released = False  # a release from idle was emitted (a warm cell's first assignment)
        if old is not Role.IDLE:
            draining = await self._emit(CellDraining(cell_id=self.cell_id, from_role=old))
            proc = self.procs.get(old)
            reports = self.launch.reports_its_drain(old)
            if proc is not None and reports:
                drained = await self._await_drained(proc, draining, stop)
            if proc is not None and not keeps_old_process(warm=self.cfg.warm, target=target, reports_drain=reports,
                                                          drained=drained is not None):
                t_stop = time.monotonic()
                code = await proc.stop(self.cfg.stop_timeout_s)
                self.procs.pop(old, None)
                phases["stop_s"] = time.monotonic() - t_stop
                self.log.info("cell_process_stopped", role=old, exit_code=code)
            self.role = Role.IDLE
            # Read before the release: the coordinator lets the cell into a group only after it, so a group that
            # lists the cell with a newer generation was formed for this switch.
            generation = await self._group_generation(target)
            released_at = utcnow()
            await self._emit(CellReleased(cell_id=self.cell_id, from_role=old,
                                          migrated_sessions=drained.migrated_sessions if drained else 0,
                                          seconds=time.monotonic() - t0))
        else:
            if self.cfg.warm and not self.parked and target is not Role.IDLE:
                # Both roles stand by from the start: an order that came before they were started starts them
                # now, in standby, and the release below wakes the role's (a worker still loading its engine
                # finds the release when it is up).
                await self._start_missing()
            generation = await self._group_generation(target)
            released_at = utcnow()
            standing_by = self.procs.get(target)
            if self.cfg.warm and target is not Role.IDLE and standing_by is not None and not standing_by.exited:
                # A first assignment of a warm cell: its standby takes the role on the cell's release from idle.
                await self._emit(CellReleased(cell_id=self.cell_id, from_role=Role.IDLE, migrated_sessions=0,
                                              seconds=time.monotonic() - t0))
                old_released = True
        self.parked = target is Role.IDLE
        if target is Role.IDLE:
            await self._stop_all("idle")
            self.role = target
            self.unreported = CellReady(cell_id=self.cell_id, role=target, switch_seconds=time.monotonic() - t0)
            await self._report_ready()
            return
        self.finished.discard(target)
        self.crashes.pop(target, None)
        self.restart_at.pop(target, None)
        warm, version = False, None
        said: dict[str, float] = {}
        proc = self.procs.get(target)
        if proc is not None and takes_role_warm(warm=self.cfg.warm, released=old is not Role.IDLE or old_released,
                                                target_running=not proc.exited):
            try:
                version, said = await self._await_ready(proc, stop, since=released_at, generation=generation,
                                                        warm=True)
                warm = True
            except CellStartFailed as exc:
                # The warm process did not take the role (it died, or said nothing in time): the restart path.
                self.log.warning("cell_warm_switch_failed", role=target, error=str(exc))
                await proc.stop(self.cfg.stop_timeout_s)
                self.procs.pop(target, None)
                if stop.is_set():
                    raise
        elif proc is not None:
            # Not one to wake (restart path, dead, or no release to wake it on after a failed switch): start afresh.
            await proc.stop(self.cfg.stop_timeout_s)
            self.procs.pop(target, None)
        if not warm:
            t_start = time.monotonic()
            proc = await self._start(target, standby=False)
            try:
                version, said = await self._await_ready(proc, stop, since=proc.launched_at, generation=generation,
                                                        warm=False)
            except BaseException:
                # If this stop is cancelled (the agent's shutdown cuts its tasks short), `procs` still names the
                # process and `shutdown` finishes the job.
                await proc.stop(self.cfg.stop_timeout_s)
                self.procs.pop(target, None)
                raise
            phases["start_s"] = time.monotonic() - t_start
        self.role = target
        self.unreported = CellReady(
            cell_id=self.cell_id, role=target, switch_seconds=time.monotonic() - t0, policy_version=version,
            warm=warm, phases=merged_phases(drained.phases if drained else {}, said, phases),
        )
        await self._report_ready()

    async def _report_ready(self) -> None:
        assert self.unreported is not None
        ready = self.unreported
        await self._emit(ready)
        self.unreported = None
        self.log.info("cell_ready", role=ready.role, switch_seconds=round(ready.switch_seconds, 3), warm=ready.warm,
                      phases={k: round(v, 3) for k, v in ready.phases.items()})

    async def _group_generation(self, target: Role) -> int:
        """The generation a rank's readiness is a later group than: the newest one, unless it already lists the
        cell (a rank standing by on an idle cell is let in on the assignment itself, which may come first)."""
        if self._readiness(target) != "group":
            return 0
        generation, members = await self.host.group_generation()
        return generation - 1 if self.cell_id in members else generation

    # ---- processes ----

    def command(self, role: Role) -> list[str]:
        return self.launch.command(role, sys.executable)

    def environment(self, role: Role | str, *, standby: bool = False) -> dict[str, str]:
        return self.launch.environment(Role(role), os.environ, standby=standby)

    def _readiness(self, role: Role) -> str:
        return self.launch.readiness(role)

    async def _start(self, role: Role, *, standby: bool) -> CellProcess:
        self.launches += 1
        log_path = self.host.log_dir / self.cell_id / f"{role}-{self.launches}.log"
        argv = self.command(role)
        try:
            proc = await CellProcess.start(argv, env=self.environment(role, standby=standby), role=role,
                                           log_path=log_path, cores=self.launch.cores)
        except OSError as exc:  # a command that does not exist or cannot run
            raise CellStartFailed(self.cell_id, role, f"could not start {argv}: {exc}") from exc
        self.procs[role] = proc
        self.log.info("cell_process_started", role=role, standby=standby, pid=proc.pid, argv=argv, log=str(log_path))
        return proc

    async def _await_ready(self, proc: CellProcess, stop: asyncio.Event, *, since: datetime, generation: int,
                           warm: bool) -> tuple[int | None, dict[str, float]]:
        """Until `proc` serves its role: a worker's first `weights.loaded` dated from `since` (its start, or its
        wake after the release), a rank's first group listing the cell after `generation`. Returns the version a
        worker serves and the phases the readiness event reported."""
        mode = self._readiness(proc.role)
        version: int | None = None
        said: dict[str, float] = {}
        match mode:
            case "started":
                if not warm:
                    await _first_of([proc.wait(), stop.wait()], timeout_s=self.cfg.start_grace_s)
                ready = True
            case "status":
                loaded = await self._until(lambda: self.reports.loaded_since(since), proc, stop)
                ready = loaded is not None
                if loaded is not None:
                    version, said = loaded.version, dict(loaded.phases)
            case "group":
                group = await self._until(lambda: self.reports.group_after(generation), proc, stop)
                ready = group is not None
                if group is not None:
                    said = dict(group.phases)
            case _:
                ready = await self._healthy(proc, stop)
        if proc.exited:
            raise CellStartFailed(self.cell_id, proc.role, f"exited with code {proc.proc.returncode} "
                                  f"(see {proc.log_file.name})")
        if stop.is_set():
            raise CellStartFailed(self.cell_id, proc.role, "the agent is stopping")
        if not ready:
            raise CellStartFailed(self.cell_id, proc.role, f"not ready ({mode}) within {self.cfg.ready_timeout_s} s")
        return version, said

    async def _healthy(self, proc: CellProcess, stop: asyncio.Event) -> bool:
        """Poll the process's health endpoint (HTTP has nothing to wait on) until it answers 200."""
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while not proc.exited and not stop.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"http://127.0.0.1:{self.launch.port(proc.role)}/")).status_code == 200:
                        return True
                await _first_of([proc.wait(), stop.wait()], timeout_s=0.05)
        return False

    async def _await_drained(self, proc: CellProcess, draining: Event, stop: asyncio.Event) -> CellDrained | None:
        """Until the drain `draining` asked for is reported done (its cell.drained), the process exits, the agent
        stops or `drain_timeout_s` passes; the report, or None without one."""
        drained = await self._until(lambda: self.reports.drained(draining.event_id), proc, stop,
                                    self.cfg.drain_timeout_s)
        if drained is not None:
            self.log.info("cell_drained", role=proc.role, migrated_sessions=drained.migrated_sessions,
                          parked_sessions=drained.parked_sessions, detail=drained.detail, phases=drained.phases)
        elif proc.exited:
            self.log.warning("process_exited_while_draining", role=proc.role, exit_code=proc.proc.returncode)
        elif not stop.is_set():
            self.log.warning("drain_timed_out", role=proc.role, waited_s=self.cfg.drain_timeout_s)
        return drained

    async def _until(self, found: Callable[[], T | None], proc: CellProcess, stop: asyncio.Event,
                     timeout_s: float | None = None) -> T | None:
        """Wait for `found()` to give a value, checked again on each report about the cell; None once the
        process exits, the agent stops or `timeout_s` (default `ready_timeout_s`) passes."""
        deadline = time.monotonic() + (self.cfg.ready_timeout_s if timeout_s is None else timeout_s)
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

    async def _stop_all(self, reason: str) -> None:
        for role, proc in list(self.procs.items()):
            code = await proc.stop(self.cfg.stop_timeout_s)
            self.procs.pop(role, None)
            self.log.info("cell_process_stopped", role=role, exit_code=code, reason=reason)

    async def shutdown(self) -> None:
        await self._stop_all("agent stopping")


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

